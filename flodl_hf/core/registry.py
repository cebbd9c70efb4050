"""Families register under their HF ``model_type``; the registry owns dispatch.

A family is a small class: its config class, its backbone class, the prefix its
head models put the backbone under, and the head parts where it differs from
the defaults (which live in ``flodl_hf.heads``). A family derived from another
overrides only what differs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from flodl_hf.core.errors import RegistryError, UnsupportedModelError
from flodl_hf.core.task_registry import CORE_TASKS, get_task

if TYPE_CHECKING:
    import torch

    from flodl_hf.core.config import BaseConfig
    from flodl_hf.core.keys import FileLayout, KeyMap, Merge
    from flodl_hf.core.modeling import HeadPart, PreTrainedModel

# The core task names (the task registry, flodl_hf.core.task_registry, holds every task and its facts).
TASKS = CORE_TASKS

_FAMILIES: dict[str, type["Family"]] = {}
_loaded = False


class Family:
    """What a model family declares. Subclass, set the class attributes, decorate with @register."""

    model_type: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    arch: ClassVar[str]                        # HF class-name stem: "Bert" -> BertForMaskedLM
    prefix: ClassVar[str]                      # HF base_model_prefix: "bert"
    config_class: ClassVar[type["BaseConfig"]]
    backbone_class: ClassVar[type["PreTrainedModel"]]
    # (hf_key, native_key) patterns with "{}" for one dotted-free segment; load and export both use them.
    key_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Old spellings a checkpoint may use, mapped one way on load (suffix -> suffix); export writes today's.
    legacy_suffixes: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Regexes of checkpoint keys skipped on load, as transformers' _keys_to_ignore_on_load_unexpected (old buffers).
    ignored_keys: ClassVar[tuple[str, ...]] = ()
    # Module tensors made of several file tensors (keys.Merge: Mixtral's stacked experts); empty: none.
    key_merges: ClassVar[tuple["Merge", ...]] = ()
    # How the files lay tensors out where that is not the module tree (keys.FileLayout: transformers' conversion
    # mapping's renames, fused tensors split on load and joined on export, a leading prefix dropped); None: the files
    # are in the module layout.
    file_layout: ClassVar["FileLayout | None"] = None
    # Attention paths transformers has for this family, declared once (DeBERTa has only its own, "eager").
    # Parity runs each; a model asked for a path its family lacks runs the first one.
    attn_implementations: ClassVar[tuple[str, ...]] = ("sdpa", "eager")
    # The tasks this family supports (names in flodl_hf.core.task_registry), and its own task models
    # where the registry's default does not fit.
    tasks: ClassVar[tuple[str, ...]] = CORE_TASKS
    task_models: ClassVar[dict[str, type["PreTrainedModel"]]] = {}
    # Whether float position_ids are taken as transformers takes them (DeBERTa's .long(), RoPE's .float());
    # otherwise they are an InputError naming position_ids.
    float_position_ids: ClassVar[bool] = False
    # The tasks whose transformers head hands num_items_in_batch to its loss (self.loss_function(..., **kwargs)):
    # there the loss is the sum over the batch divided by it (task_registry.counted_items); every other head
    # takes it and ignores it, as transformers' do.
    num_items_tasks: ClassVar[frozenset[str]] = frozenset()
    # What an explicit output_hidden_states=None / output_attentions=None means. transformers 5's models that
    # record outputs with hooks (check_model_inputs / capture_outputs) read a keyword passed as None as False;
    # the older ones (DeBERTa-v2, MPNet) take the config's value, as for a keyword left out.
    none_is_config_default: ClassVar[bool] = False
    # Whether transformers' task classes register their head before the backbone (XLM-RoBERTa's, CamemBERT's):
    # TaskModel mounts them in that order, which named_parameters, hence clip_grad_norm_'s sum, follows.
    head_before_backbone: ClassVar[bool] = False

    # ---- building ---------------------------------------------------------------------------
    @classmethod
    def supports(cls, task: str) -> bool:
        return task in cls.tasks

    @classmethod
    def model_class(cls, task: str) -> type["PreTrainedModel"]:
        """The class that runs ``task`` for this family: its own task model, the backbone, or the default."""
        if task not in cls.tasks:
            raise UnsupportedModelError(f"{cls.model_type}: no {task!r} task is declared for this family "
                                        f"(it has {', '.join(cls.tasks)})")
        if task in cls.task_models:
            return cls.task_models[task]
        spec = get_task(task)
        return cls.backbone_class if spec.model is None else spec.model_class()

    @classmethod
    def build(cls, config: "BaseConfig", task: str = "base", add_pooling_layer: bool = True) -> "PreTrainedModel":
        """A model of this family for ``task``, uninitialised. The family is passed in, not looked up, so a
        family that is not registered builds too."""
        model_cls = cls.model_class(task)
        if issubclass(model_cls, _task_model_base()):
            return model_cls(config, family=cls)
        model = model_cls(config, add_pooling_layer=add_pooling_layer)
        model.bind_family(cls)
        return model

    @classmethod
    def key_map(cls) -> "KeyMap":
        """How this family's checkpoint keys map to module keys (prefix, renames, legacy spellings, keys skipped,
        merges, file layout)."""
        from flodl_hf.core.keys import KeyMap
        return KeyMap(cls.prefix, cls.key_renames, cls.legacy_suffixes, cls.ignored_keys, cls.key_merges,
                      cls.file_layout)

    # ---- head parts: defaults shared by the BERT lineage; families override what differs ----
    @classmethod
    def classifier_dropout(cls, config: "BaseConfig") -> float:
        value = getattr(config, "classifier_dropout", None)
        return value if value is not None else getattr(config, "hidden_dropout_prob", 0.0)

    @classmethod
    def sequence_head(cls, config: "BaseConfig") -> "HeadPart":
        from flodl_hf.heads import PooledClassifier
        return PooledClassifier(config.hidden_size, config.num_labels, cls.classifier_dropout(config))

    @classmethod
    def multiple_choice_head(cls, config: "BaseConfig") -> "HeadPart":
        from flodl_hf.heads import PooledClassifier
        return PooledClassifier(config.hidden_size, 1, cls.classifier_dropout(config))

    @classmethod
    def token_head(cls, config: "BaseConfig") -> "HeadPart":
        from flodl_hf.heads import TokenClassifier
        return TokenClassifier(config.hidden_size, config.num_labels, cls.classifier_dropout(config))

    @classmethod
    def span_head(cls, config: "BaseConfig") -> "HeadPart":
        from flodl_hf.heads import SpanClassifier
        return SpanClassifier(config.hidden_size, config.num_labels)

    @classmethod
    def sequence_loss(cls, logits: "torch.Tensor", labels: "torch.Tensor", config: "BaseConfig") -> "torch.Tensor":
        """Sequence-classification loss; transformers' shared rule unless a family has its own."""
        from flodl_hf.heads import sequence_classification_loss
        return sequence_classification_loss(logits, labels, config.problem_type)

    @classmethod
    def sequence_logits(cls, logits: "torch.Tensor", labels: "torch.Tensor", config: "BaseConfig") -> "torch.Tensor":
        """The logits a sequence classifier returns when given ``labels``: the head's, unless the family's
        transformers model returns what its loss read (DeBERTa-v2's regression: flattened, labels' dtype)."""
        return logits

    @classmethod
    def lm_head(cls, config: "BaseConfig") -> "HeadPart":
        raise UnsupportedModelError(f"{cls.model_type}: no masked-LM head is declared for this family")

    @classmethod
    def max_sequence_length(cls, config: "BaseConfig") -> int | None:
        """The longest input the position table takes (None: no absolute limit)."""
        return getattr(config, "max_position_embeddings", None)

    # ---- names ----------------------------------------------------------------------------
    @classmethod
    def architecture(cls, task: str) -> str:
        return cls.arch + get_task(task).suffix

    @classmethod
    def model_types(cls) -> tuple[str, ...]:
        return (cls.model_type, *cls.aliases)


def _task_model_base() -> type:
    from flodl_hf.core.modeling import TaskModel
    return TaskModel


def register(family: type[Family]) -> type[Family]:
    """Class decorator: make a family reachable by its model_type and aliases."""
    for name in family.model_types():
        _FAMILIES[name] = family
    return family


def _ensure_loaded() -> None:
    """Import every family once. The flag is set only after the import succeeded: a family that fails to
    import raises here on every call, never leaving a silently partial registry behind."""
    global _loaded
    if _loaded:
        return
    try:
        import flodl_hf.families  # noqa: F401  (importing registers every family)
    except Exception as exc:
        raise RegistryError(f"flodl_hf.families failed to import, so no model family is available "
                            f"({type(exc).__name__}: {exc}); reinstall flodl-hf or fix the family named above") from exc
    _loaded = True


def supported_model_types() -> list[str]:
    _ensure_loaded()
    return sorted(_FAMILIES)


def get_family(model_type: str) -> type[Family]:
    _ensure_loaded()
    try:
        return _FAMILIES[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported families: "
            + ", ".join(supported_model_types())) from None


def parse_architecture(name: str) -> tuple[type[Family], str]:
    """'RobertaForMaskedLM' -> (Roberta family, 'mlm'); raises when no family/head matches."""
    _ensure_loaded()
    for family in dict.fromkeys(_FAMILIES.values()):
        for task in family.tasks:
            if family.architecture(task) == name:
                return family, task
    raise UnsupportedModelError(
        f"architecture {name!r} is not supported; supported: "
        + ", ".join(sorted(f.architecture(t) for f in set(_FAMILIES.values()) for t in f.tasks)))
