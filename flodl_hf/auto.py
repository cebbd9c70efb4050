"""Auto classes: pick the family from ``config.json`` and the head from the class used.

``AutoModelForMaskedLM.from_pretrained(source)`` mirrors transformers: a local
directory, a single weights file, or a hub id (``revision=``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import io
from .config import Activation, BaseConfig
from .errors import ConfigError, InputError, UnsupportedModelError
from .keys import has_pooler
from .layers import check_attn_implementation, init_weights
from .modeling import PreTrainedModel, load_weights, meta_device
from .registry import Family, get_family, parse_architecture
from .task_registry import task_names, tasks


def config_from_dict(data: dict[str, Any], where: str = "config.json") -> BaseConfig:
    """Validate a config dict and build the family's config dataclass from it."""
    return family_and_config(data, where)[1]


def family_and_config(data: dict[str, Any], where: str = "config.json") -> tuple[type[Family], BaseConfig]:
    """The family a config dict names (looked up once, here) and its config dataclass."""
    if "auto_map" in data:
        raise ConfigError(f"{where}: declares auto_map (custom code on the hub). flodl-hf never runs remote "
                          "code; use a checkpoint of a supported family without auto_map.")
    from .validate import check_config_dict
    check_config_dict(data, where)
    model_type = data.get("model_type")
    if not model_type:
        architectures = data.get("architectures") or []
        if not architectures:
            raise ConfigError(f"{where}: has neither model_type nor architectures; cannot tell the family")
        try:
            family, _ = parse_architecture(architectures[0])
        except UnsupportedModelError as exc:
            raise ConfigError(f"{where}: no model_type, and {exc}") from None
        model_type = family.model_type
    try:
        family = get_family(model_type)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{where}: {exc}") from None
    try:
        config = family.config_class.from_dict(data)
        if "hidden_act" in data:  # read only when the layers are built: checked here, where the file is known
            Activation.parse(data["hidden_act"])
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if not config.raw.get("model_type"):
        config.raw["model_type"] = family.model_type
    return family, config


class AutoConfig:
    @staticmethod
    def from_pretrained(source: str | Path, revision: str | None = None) -> BaseConfig:
        path = Path(source)
        if path.is_file() and path.name.endswith(".json"):
            return config_from_dict(io.read_json(path, "config.json"), str(path))
        ckpt = io.resolve(source, revision)
        return config_from_dict(io.read_json(ckpt.config_path, "config.json"), str(ckpt.config_path))

    @staticmethod
    def from_dict(data: dict[str, Any]) -> BaseConfig:
        return config_from_dict(data, "config dict")

    @staticmethod
    def for_model(model_type: str, **fields: Any) -> BaseConfig:
        return config_from_dict({"model_type": model_type, **fields}, "config")


def model_class(config: BaseConfig, task: str, family: type[Family] | None = None) -> type[PreTrainedModel]:
    """The class that runs ``task`` for the config's family (or the ``family`` given)."""
    return (family or get_family(config.model_type)).model_class(task)


def task_of(config: BaseConfig, family: type[Family] | None = None) -> str:
    """The head a checkpoint was saved with, from ``architectures[0]`` ("base" when absent); the
    config's own family's class names first, then every family's."""
    architectures = config.architectures or []
    if not architectures:
        return "base"
    if family is not None:
        for task in family.tasks:
            if family.architecture(task) == architectures[0]:
                return task
    return parse_architecture(architectures[0])[1]


def build_model(config: BaseConfig, task: str, add_pooling_layer: bool = True,
                family: type[Family] | None = None) -> PreTrainedModel:
    """An uninitialised model; the family is resolved here once (or given) and passed to the model."""
    return (family or get_family(config.model_type)).build(config, task, add_pooling_layer=add_pooling_layer)


def _dtype_arg(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as transformers' ``from_pretrained`` takes it: a floating torch dtype, its name
    ("float16", "torch.bfloat16"), or "auto" / None (the checkpoint's own)."""
    if dtype is None or dtype == "auto":
        return None
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise InputError(f"dtype must be a floating torch dtype, its name ('float32', 'bfloat16') or 'auto'; "
                         f"got {dtype!r}")
    return found


def load_model(source: str | Path, task: str = "auto", *, dtype: torch.dtype | str | None = None,
               revision: str | None = None, num_labels: int | None = None, attn_implementation: str = "sdpa",
               config: BaseConfig | None = None, expect: type | None = None,
               adapter: str | Path | None = None) -> PreTrainedModel:
    """Resolve, read and strictly load a checkpoint into the native model for ``task``; ``adapter``: a PEFT
    LoRA adapter directory to put on it (flodl_hf.lora.load_adapter)."""
    dtype = _dtype_arg(dtype)
    if num_labels is not None and (isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1):
        raise InputError(f"num_labels must be a positive int, got {num_labels!r}")
    ckpt = io.resolve(source, revision)
    # The family is resolved once, here; the model carries it from here on.
    if config is None:
        family, config = family_and_config(io.read_json(ckpt.config_path, "config.json"), str(ckpt.config_path))
    else:
        family = get_family(config.model_type)
    if num_labels is not None:
        config.num_labels = num_labels
    config.attn_implementation = check_attn_implementation(attn_implementation, family)
    if task == "auto":
        task = task_of(config, family)
    if task not in task_names():
        raise InputError(f"task {task!r}: expected one of {', '.join(task_names())} or 'auto'")
    if task in ("seqcls", "tokcls") and sorted(config.id2label) != list(range(config.num_labels)):
        # The head's output i is the label id2label[i]: ids with a gap leave an output without a name
        raise ConfigError(f"{ckpt.config_path}: id2label's ids are {sorted(config.id2label)}; a classifier's "
                          f"labels must be numbered 0 to {config.num_labels - 1}, one per output")
    cls = family.model_class(task)
    if expect is not None and expect is not PreTrainedModel and not issubclass(cls, expect):
        raise UnsupportedModelError(f"{source} holds a {config.model_type!r} model; {expect.__name__} cannot load it "
                                    f"(use the Auto classes or {cls.__name__})")
    # Outside inference mode even when called inside it: parameters made there are inference tensors, which
    # cannot be trained and on which F.linear of a sliced input (logits_to_keep=1) took another kernel than
    # transformers' (measured: ulps apart on a tied LLaMA head).
    with torch.inference_mode(False):
        tensors = io.load_tensors(ckpt, dtype)
        from .validate import check_config_fits
        check_config_fits(config, tensors, str(ckpt.config_path))
        with meta_device():
            model = family.build(config, task, add_pooling_layer=has_pooler(tensors))
        load_weights(model, tensors, ckpt.source)
    model.source_root = ckpt.root.absolute()  # the trainer records it, so an export of a fine-tune carries the source's card
    if adapter is not None:
        from .lora import load_adapter
        load_adapter(model, adapter)
    return model.eval()


class _AutoModel:
    task = "base"

    @classmethod
    def from_pretrained(cls, source: str | Path, *, dtype: torch.dtype | None = None, revision: str | None = None,
                        num_labels: int | None = None, attn_implementation: str = "sdpa",
                        config: BaseConfig | None = None, adapter: str | Path | None = None) -> PreTrainedModel:
        return load_model(source, cls.task, dtype=dtype, revision=revision, num_labels=num_labels,
                          attn_implementation=attn_implementation, config=config, adapter=adapter)

    @classmethod
    def from_config(cls, config: BaseConfig, attn_implementation: str = "sdpa") -> PreTrainedModel:
        """A freshly initialised model (transformers' init: normal(initializer_range), zero bias)."""
        family = get_family(config.model_type)
        config.attn_implementation = check_attn_implementation(attn_implementation, family)
        model = family.build(config, cls.task)
        init_weights(model, config.initializer_range)
        return model


class AutoModel(_AutoModel):
    task = "base"


class AutoModelForSequenceClassification(_AutoModel):
    task = "seqcls"


class AutoModelForTokenClassification(_AutoModel):
    task = "tokcls"


class AutoModelForQuestionAnswering(_AutoModel):
    task = "qa"


class AutoModelForMaskedLM(_AutoModel):
    task = "mlm"


class AutoModelForMultipleChoice(_AutoModel):
    task = "mc"


class AutoModelForPreTraining(_AutoModel):
    """ELECTRA's replaced-token discriminator (the ``pretraining`` task ELECTRA adds)."""

    task = "pretraining"


class AutoModelForCausalLM(_AutoModel):
    """The decoders' causal LM (the ``causal_lm`` task: LLaMA, Mistral, Qwen2), with its KV cache."""

    task = "causal_lm"


_NAMED = (AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification,
          AutoModelForQuestionAnswering, AutoModelForMaskedLM, AutoModelForMultipleChoice, AutoModelForPreTraining,
          AutoModelForCausalLM)


def auto_classes() -> dict[str, type[_AutoModel]]:
    """Task -> Auto class, for every registered task; a task a family added without a class here gets
    one named as transformers names its Auto class."""
    named = {c.task: c for c in _NAMED}
    return {t.name: named.get(t.name) or type(t.auto_class, (_AutoModel,), {"task": t.name}) for t in tasks()}
