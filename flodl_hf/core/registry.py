"""The registries: every task a model can be built for, and every model family, each declared once.

## Tasks

A task is its name (as the CLI and the Auto classes spell it), transformers' class-name
suffix (``ForMaskedLM``), transformers' Auto class and Auto mapping (for parity, export and
the verify matrix), our output record, its loss, and the default task model with the
``Family`` factory that builds its head part. Everything that lists tasks reads this table:
the registry's architecture names, ``auto``, ``parity``, ``export``, ``verify``, the CLI's
``--head`` choices and the parity tests.

The six core tasks are registered here. A family may add its own (ELECTRA's
``pretraining``) with :func:`register_task` and list it in ``Family.tasks``; such a task
belongs to the families that declare it (``core=False``), so the verify matrix only asks
those families for it.

## Families

Families register under their HF ``model_type``; the registry owns dispatch.

A family is a small class: its config class, its backbone class, the prefix its
head models put the backbone under, and the head parts where it differs from
the defaults (which live in ``flodl_hf.heads``). A family derived from another
overrides only what differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

from flodl_hf.core import slots
from flodl_hf.core.errors import RegistryError, UnsupportedModelError
from flodl_hf.core.losses import (choice_loss, image_classification_loss, masked_image_loss,
                                  sequence_classification_loss, sequence_loss, span_loss, token_loss)
from flodl_hf.core.outputs import (BaseModelOutput, ImageClassifierOutput, MaskedImageModelingOutput, MaskedLMOutput,
                                   ModelOutput, MultipleChoiceModelOutput, QuestionAnsweringModelOutput,
                                   SequenceClassifierOutput, TokenClassifierOutput)

if TYPE_CHECKING:
    from flodl_hf.core.config import BaseConfig
    from flodl_hf.core.keys import FileLayout, KeyMap, Merge
    from flodl_hf.core.modeling import HeadPart, PreTrainedModel


# loss(model, logits, num_items_in_batch=None, **labels) -> scalar; the labels are the task model's keyword
# arguments. Every loss takes num_items_in_batch (transformers' gradient-accumulation count) and honours it only
# where the model's family lists the task in ``num_items_tasks`` (``counted_items``); elsewhere it is ignored,
# as transformers ignores it there.
Loss = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Task:
    """One task: names on both sides, output record, loss, and the default model that runs it."""

    name: str                      # "mlm": the CLI's and our Auto classes' spelling
    suffix: str                    # "ForMaskedLM": arch + suffix is transformers' class name
    auto_class: str                # "AutoModelForMaskedLM": transformers' Auto class (parity reference)
    hf_mapping: str                # transformers.models.auto.modeling_auto mapping of model_type -> class
    output: type[ModelOutput]
    head_factory: str | None       # the Family classmethod that builds the head part (None: bare backbone)
    model: str | None = None       # "package.module:Class" of the default task model (None: the backbone)
    loss: Loss | None = None
    core: bool = True              # False: added by a family; only families declaring it have the cell
    # (model_type, class name) pairs for a task transformers has no Auto mapping for (GPT2DoubleHeadsModel)
    classes: tuple[tuple[str, str], ...] = ()

    def model_class(self) -> type["PreTrainedModel"]:
        """The default task model. Task models register under their "module:Class" name when their module is
        imported (``register_task_model``: flodl_hf.heads and the families), so core never imports them."""
        if self.model is None:
            raise UnsupportedModelError(f"task {self.name!r} runs the family's backbone, not a task model")
        if self.model not in _TASK_MODELS:
            _ensure_loaded()  # the families import the heads
        try:
            return _TASK_MODELS[self.model]
        except KeyError:
            raise UnsupportedModelError(f"task {self.name!r}: its task model {self.model} is not registered "
                                        "(its module registers it with register_task_model)") from None


_TASKS: dict[str, Task] = {}
_TASK_MODELS: dict[str, type] = {}


def register_task_model(cls: type) -> type:
    """Class decorator: make a task model reachable by the "module:Class" name a ``Task`` gives as its model."""
    _TASK_MODELS[f"{cls.__module__}:{cls.__qualname__}"] = cls
    return cls


def register_task(task: Task) -> Task:
    """Add a task (a family adding its own calls this at import). Re-registering the same task is a no-op."""
    known = _TASKS.get(task.name)
    if known is not None and known != task:
        raise ValueError(f"task {task.name!r} is already registered differently")
    _TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    _ensure_loaded()  # families register their own tasks when imported
    try:
        return _TASKS[name]
    except KeyError:
        raise UnsupportedModelError(f"task {name!r} is not known; known tasks: {', '.join(task_names())}") from None


def task_names(core_only: bool = False) -> tuple[str, ...]:
    """Every registered task name (core first, then those families added), or the core ones only."""
    _ensure_loaded()  # families register their own tasks when imported
    return tuple(t.name for t in _TASKS.values() if t.core or not core_only)


def tasks() -> tuple[Task, ...]:
    _ensure_loaded()  # families register their own tasks when imported
    return tuple(_TASKS.values())

_HEADS = "flodl_hf.heads"
for _task in (
    Task("base", "Model", "AutoModel", "MODEL_MAPPING_NAMES", BaseModelOutput, None),
    Task("seqcls", "ForSequenceClassification", "AutoModelForSequenceClassification",
         "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", SequenceClassifierOutput, "sequence_head",
         f"{_HEADS}.sequence_classification:ModelForSequenceClassification", sequence_loss),
    Task("tokcls", "ForTokenClassification", "AutoModelForTokenClassification",
         "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", TokenClassifierOutput, "token_head",
         f"{_HEADS}.token_classification:ModelForTokenClassification", token_loss),
    Task("qa", "ForQuestionAnswering", "AutoModelForQuestionAnswering",
         "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", QuestionAnsweringModelOutput, "span_head",
         f"{_HEADS}.question_answering:ModelForQuestionAnswering", span_loss),
    Task("mlm", "ForMaskedLM", "AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", MaskedLMOutput,
         "lm_head", f"{_HEADS}.masked_lm:ModelForMaskedLM", token_loss),
    Task("mc", "ForMultipleChoice", "AutoModelForMultipleChoice", "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
         MultipleChoiceModelOutput, "multiple_choice_head",
         f"{_HEADS}.multiple_choice:ModelForMultipleChoice", choice_loss),
):
    register_task(_task)

CORE_TASKS = tuple(_TASKS)

# The image tasks (pixel_values in): asked only of the families that declare them (core=False).
for _task in (
    Task("image_classification", "ForImageClassification", "AutoModelForImageClassification",
         "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", ImageClassifierOutput, "image_classification_head",
         f"{_HEADS}.image_classification:ModelForImageClassification", image_classification_loss, core=False),
    Task("masked_image_modeling", "ForMaskedImageModeling", "AutoModelForMaskedImageModeling",
         "MODEL_FOR_MASKED_IMAGE_MODELING_MAPPING_NAMES", MaskedImageModelingOutput, "masked_image_head",
         f"{_HEADS}.masked_image_modeling:ModelForMaskedImageModeling", masked_image_loss, core=False),
):
    register_task(_task)


def hf_mapping(task: str) -> dict[str, str]:
    """transformers' model_type -> class name mapping for ``task`` ({} where transformers has none)."""
    from transformers.models.auto import modeling_auto
    spec = get_task(task)
    mapping = dict(spec.classes) if spec.classes else getattr(modeling_auto, spec.hf_mapping, {})
    # a model type with several classes for one Auto class (DeiT's two image classifiers): the first, which is the
    # task's own (the others are tasks of their own: DeiT's image_classification_teacher)
    if not any(isinstance(v, (tuple, list)) for v in mapping.values()):
        return mapping
    return {k: v[0] if isinstance(v, (tuple, list)) else v for k, v in mapping.items()}


class TaskField(Mapping):
    """A read-only view ``task name -> one field of its Task`` over the live registry (for code that
    wants a table, such as ``parity.REFERENCE_CLASSES``)."""

    def __init__(self, field: str) -> None:
        self._field = field

    def __getitem__(self, name: str) -> Any:
        if name not in task_names():
            raise KeyError(name)
        return getattr(get_task(name), self._field)

    def __iter__(self):
        return iter(task_names())

    def __len__(self) -> int:
        return len(task_names())


# ---- families -------------------------------------------------------------------------------------------

# The core task names (the task table above holds every task and its facts).
TASKS = CORE_TASKS

_FAMILIES: dict[str, type["Family"]] = {}
_loaded = False


def _default_head(task: str) -> classmethod:
    """A ``Family`` head factory that returns the head part ``task``'s default model gives (its ``default_head``)."""
    def factory(cls: type["Family"], config: "BaseConfig") -> "HeadPart":
        return get_task(task).model_class().default_head(cls, config)
    factory.__name__ = factory.__qualname__ = f"default {task} head"
    return classmethod(factory)


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
    # The tasks this family supports (names in flodl_hf.core.registry), and its own task models
    # where the registry's default does not fit.
    tasks: ClassVar[tuple[str, ...]] = CORE_TASKS
    task_models: ClassVar[dict[str, type["PreTrainedModel"]]] = {}
    # Whether float position_ids are taken as transformers takes them (DeBERTa's .long(), RoPE's .float());
    # otherwise they are an InputError naming position_ids.
    float_position_ids: ClassVar[bool] = False
    # The tasks whose transformers head hands num_items_in_batch to its loss (self.loss_function(..., **kwargs)):
    # there the loss is the sum over the batch divided by it (losses.counted_items); every other head
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
    def task_for(cls, task: str, config: "BaseConfig") -> str:
        """The task that runs when ``task`` is asked of a checkpoint with ``config``: ``task`` itself, except where
        transformers' Auto class holds several classes for the family and picks by ``architectures`` (DeiT)."""
        return task

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
        if model_cls.takes_family:  # a task model builds its backbone from the family; a backbone is one
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

    # The defaults are the default task model's own head part (``default_head``, in flodl_hf.heads): the task model
    # is asked, so core never imports the heads.
    sequence_head = _default_head("seqcls")
    multiple_choice_head = _default_head("mc")
    token_head = _default_head("tokcls")
    span_head = _default_head("qa")
    image_classification_head = _default_head("image_classification")
    masked_image_head = _default_head("masked_image_modeling")

    @classmethod
    def sequence_loss(cls, logits: "torch.Tensor", labels: "torch.Tensor", config: "BaseConfig") -> "torch.Tensor":
        """Sequence-classification loss; transformers' shared rule unless a family has its own."""
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


def register(family: type[Family]) -> type[Family]:
    """Class decorator: make a family reachable by its model_type and aliases."""
    for name in family.model_types():
        _FAMILIES[name] = family
    return family


def _ensure_loaded() -> None:
    """Import every family once (through ``slots.IMPORT_FAMILIES``, which the package facade fills). The flag is
    set only after the import succeeded: a family that fails to import raises here on every call, never leaving a
    silently partial registry behind."""
    global _loaded
    if _loaded:
        return
    try:
        slots.IMPORT_FAMILIES()  # importing flodl_hf.families registers every family
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
