"""Auto classes: pick the family from ``config.json`` and the head from the class used.

``AutoModelForMaskedLM.from_pretrained(source)`` mirrors transformers: a local
directory, a single weights file, or a hub id (``revision=``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from flodl_hf.core import io, keys
from flodl_hf.core.config import Activation, BaseConfig
from flodl_hf.core.errors import (CheckpointFormatError, ConfigError, InputError, UnsupportedModelError,
                                  WeightsMismatchError)
from flodl_hf.core.keys import has_pooler
from flodl_hf.core.layers import check_attn_implementation, init_weights
from flodl_hf.core.modeling import PreTrainedModel, load_weights, meta_device
from flodl_hf.core.registry import Family, get_family, parse_architecture
from flodl_hf.core.registry import task_names, tasks


def config_from_dict(data: dict[str, Any], where: str = "config.json") -> BaseConfig:
    """Validate a config dict and build the family's config dataclass from it."""
    return family_and_config(data, where)[1]


def family_and_config(data: dict[str, Any], where: str = "config.json") -> tuple[type[Family], BaseConfig]:
    """The family a config dict names (looked up once, here) and its config dataclass."""
    if "auto_map" in data:
        raise ConfigError(f"{where}: declares auto_map (custom code on the hub). flodl-hf never runs remote "
                          "code; use a checkpoint of a supported family without auto_map.")
    from flodl_hf.core.validate import check_config_dict
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


def _config_path(source: str | os.PathLike, revision: str | None = None, hub: dict | None = None) -> Path:
    """Where a config source's config.json is: a .json file, a directory's own (no weights needed), or a
    resolved checkpoint's (a hub id)."""
    path = Path(str(source)).expanduser() / ((hub or {}).get("subfolder") or "")
    if path.is_dir():
        from flodl_hf.core.validate import is_within
        if (path / io.CONFIG_NAME).is_symlink() and not is_within(path / io.CONFIG_NAME, io.link_root(path)):
            raise CheckpointFormatError(f"{path / io.CONFIG_NAME} is a link to a file outside {path}: nothing is read "
                                        "from there; copy the file in instead")
        return path / io.CONFIG_NAME
    if path.is_file() and path.name.endswith(".json"):
        return path
    return _resolve(source, revision, hub or {}).config_path


class AutoConfig:
    @staticmethod
    def from_pretrained(source: str | Path, revision: str | None = None, **kwargs: Any) -> BaseConfig:
        """config.json of ``source``; ``kwargs`` set fields as transformers sets them (the quick tour's
        ``AutoConfig.from_pretrained(name, n_heads=12)``), as ``from_pretrained``'s config overrides."""
        gguf_file = kwargs.pop("gguf_file", None)
        if gguf_file is not None:  # the file's metadata is its config, as transformers' gguf_file=
            gguf = _gguf_source(source, gguf_file)
            path, data = gguf.path, gguf.config
        else:
            path = _config_path(source, revision)
            data = io.read_json(path, "config.json")
        config = config_from_dict(data, str(path))
        return _with_overrides(config, kwargs, str(path))[1] if kwargs else config

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


def _attn(name: str | None, family: type[Family]) -> str:
    """transformers' default (None): sdpa where the family has it, else its one path."""
    if name is None:
        name = "sdpa" if "sdpa" in family.attn_implementations else family.attn_implementations[0]
    return check_attn_implementation(name, family)


# transformers 5.24's from_pretrained keywords that it drops itself (no longer used, telemetry, remote code's revision).
_DROPPED = frozenset({"mirror", "_fast_init", "low_cpu_mem_usage", "from_tf", "from_flax", "offload_state_dict",
                      "_commit_hash", "_from_auto", "_from_pipeline", "code_revision"})
# Its keywords flodl-hf does not implement, with transformers' defaults: the default is taken (it asks for
# nothing), any other value is an InputError naming the keyword.
_NOT_IMPLEMENTED = {
    "output_loading_info": False, "use_safetensors": None, "weights_only": True, "variant": None, "state_dict": None,
    "proxies": None, "tqdm_class": None, "max_memory": None, "offload_folder": None, "offload_buffers": False,
    "quantization_config": None, "adapter_kwargs": None, "adapter_name": "default", "generation_config": None,
    "distributed_config": None, "device_mesh": None, "tp_plan": None, "tp_size": None,
    "allow_all_kernels": False, "use_kernels": False, "kernel_config": None, "key_mapping": None,
    "fusion_config": None, "disable_mmap": None, "experts_implementation": None,
    "torchscript": False, "chunk_size_feed_forward": 0, "add_cross_attention": False, "is_encoder_decoder": False,
}
# Attributes every transformers config has, besides a family's fields and the file's own (config overrides).
_HF_CONFIG_FIELDS = frozenset({"architectures", "id2label", "label2id", "num_labels", "problem_type",
                               "transformers_version", "bos_token_id", "eos_token_id", "sep_token_id",
                               "decoder_start_token_id", "tie_word_embeddings", "is_decoder", "use_cache",
                               "tokenizer_class", "finetuning_task", "task_specific_params", "prefix",
                               # the forward's defaults (PreTrainedModel.__call__ reads them)
                               "output_hidden_states", "output_attentions", "return_dict"})
_HUB_OPTIONS = ("cache_dir", "force_download", "local_files_only", "token")


def from_pretrained_kwargs(cls: type, model_args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A ``from_pretrained(source, ...)`` call's arguments for ``load_model``: transformers hands positional
    ``model_args`` to the model's ``__init__``; no flodl-hf model takes any."""
    if model_args:
        raise InputError(f"{cls.__name__}.from_pretrained takes the source as its only positional argument; got "
                         f"{len(model_args)} more (transformers hands them to the model's __init__, which takes none)")
    for name in ("task", "expect"):
        if name in kwargs:
            raise InputError(f"{name}=: not a {cls.__name__}.from_pretrained keyword (the class sets it; "
                             "flodl_hf.load_model takes it)")
    return kwargs


def _option_errors(options: dict[str, Any]) -> None:
    """Drop what transformers drops; a non-default value of a keyword not implemented here is an InputError."""
    for name in [n for n in options if n in _DROPPED or n in _NOT_IMPLEMENTED]:
        value, default = options.pop(name), _NOT_IMPLEMENTED.get(name)
        if name in _DROPPED or value is None or value is default or (isinstance(value, (bool, str))
                                                                     and value == default):
            continue
        raise InputError(f"from_pretrained({name}={value!r}): not implemented in flodl-hf (only transformers' "
                         f"default, {default!r}, is taken)")


def _resolve(source: str | os.PathLike, revision: str | None, hub: dict[str, Any]) -> io.Checkpoint:
    """``io.resolve`` with transformers' hub options: ``subfolder`` (a local directory's or a hub repo's), and
    ``cache_dir``, ``force_download``, ``local_files_only``, ``token``, handed to huggingface_hub for a hub id
    (a local path ignores them, as transformers does)."""
    options = {k: hub[k] for k in _HUB_OPTIONS if hub.get(k) not in (None, False)}
    return io.resolve(source, revision, hub.get("subfolder") or "", **options)


def _with_overrides(config: BaseConfig, overrides: dict[str, Any], where: str) -> tuple[type[Family], BaseConfig]:
    """The config with transformers' keyword overrides applied as it applies them: in the order given, each
    set on the config (``num_labels`` re-labels LABEL_0... when the count differs, leaving both maps otherwise;
    ``id2label`` alone leaves ``label2id`` as it was), then every field checked as config.json's are."""
    fields = {f.name for f in dataclasses.fields(config)} - {"raw", "attn_implementation"}
    for key, value in overrides.items():
        if key not in fields and key not in config.raw and key not in _HF_CONFIG_FIELDS:
            raise InputError(f"from_pretrained({key}=...): not a from_pretrained option and not a field of the "
                             f"{config.model_type} config (transformers hands it to the model's __init__, which "
                             "takes no such argument)")
        if key == "num_labels":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"num_labels must be a positive int, got {value!r}")
            config.num_labels = value
        elif key in fields:
            setattr(config, key, value)
        else:
            config.raw[key] = value
    return family_and_config(config.to_dict(), f"{where} with from_pretrained({', '.join(f'{k}=' for k in overrides)})")


def _gguf_source(source: str | Path, gguf_file: str | os.PathLike) -> Any:
    """transformers' ``from_pretrained(source, gguf_file=...)``: the file read by flodl_hf.gguf (config from its
    metadata, tensors dequantised one at a time)."""
    from flodl_hf.gguf import GGUFSource
    return GGUFSource.open(source, gguf_file)


def _fresh_mismatched(model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    """``ignore_mismatched_sizes``: each file tensor whose shape differs from the model's, replaced by an empty
    one of the model's shape (initialised after loading, as transformers does), and those model keys."""
    shapes, aliases = keys.expected(model)
    state = keys.normalise(model, tensors, shapes, aliases)
    bad = [k for k in shapes if k in state and state[k].shape != shapes[k]]
    if not bad:
        return tensors, []
    replace = {id(state[k]): torch.empty(shapes[k], dtype=state[k].dtype) for k in bad}
    return {name: replace.get(id(t), t) for name, t in tensors.items()}, bad


def _device(device_map: Any) -> torch.device | None:
    """transformers' ``device_map`` for a model on one device: "auto" (the GPU when there is one, else the
    CPU), a device, its name or index; a map placing modules apart is not implemented."""
    if device_map is None:
        return None
    if device_map == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if not isinstance(device_map, (str, int, torch.device)) or isinstance(device_map, bool):
        raise InputError(f"device_map={device_map!r}: flodl-hf puts the whole model on one device: pass 'auto', "
                         "a device ('cpu', 'cuda:0', torch.device) or its index")
    try:
        return torch.device(device_map)
    except (RuntimeError, ValueError) as exc:
        raise InputError(f"device_map={device_map!r}: not a device, nor 'auto' ({exc})") from None


def model_from_pretrained(cls: type, source: str | Path, model_args: tuple, kwargs: dict[str, Any]) -> PreTrainedModel:
    """``PreTrainedModel.from_pretrained`` (core's ``slots.LOAD_MODEL``): ``source`` loaded into ``cls``'s task,
    transformers' keywords as ``load_model`` takes them."""
    return load_model(source, cls.task, expect=cls, **from_pretrained_kwargs(cls, model_args, kwargs))


def load_model(source: str | Path, task: str = "auto", *, dtype: torch.dtype | str | None = None,
               revision: str | None = None, attn_implementation: str | None = None,
               config: BaseConfig | str | os.PathLike | None = None, expect: type | None = None,
               adapter: str | Path | None = None, torch_dtype: torch.dtype | str | None = None,
               device_map: Any = None, ignore_mismatched_sizes: bool = False, trust_remote_code: bool | None = None,
               cache_dir: str | os.PathLike | None = None, force_download: bool = False,
               local_files_only: bool = False, token: str | bool | None = None, subfolder: str = "",
               **overrides: Any) -> PreTrainedModel:
    """Resolve, read and strictly load a checkpoint into the native model for ``task``; ``adapter``: a PEFT
    LoRA adapter directory to put on it (flodl_hf.lora.load_adapter).

    transformers 5.24's ``from_pretrained`` keywords: ``dtype`` (``torch_dtype``, its older name, when ``dtype``
    is not given), ``attn_implementation`` (None: sdpa where the family has it), ``config`` (a config, or a path
    or hub id to read one from), the hub options ``revision cache_dir force_download local_files_only token
    subfolder``, ``device_map`` (one device), ``ignore_mismatched_sizes`` (weights whose shapes differ from the
    model's initialised afresh), ``add_pooling_layer`` (a bare backbone), and any other keyword a config field to
    set (``num_labels``, ``id2label``, ``classifier_dropout``...), unless ``config`` is a config object. A keyword
    transformers has and flodl-hf does not implement is an InputError naming it."""
    gguf_file = overrides.pop("gguf_file", None)
    _option_errors(overrides)
    if "num_labels" in overrides and overrides["num_labels"] is None:  # as leaving it out
        del overrides["num_labels"]
    # trust_remote_code=True changes nothing, as in transformers for a checkpoint without auto_map: flodl-hf runs
    # no remote code, and a config declaring auto_map is refused whatever it says (_read_config).
    add_pooling_layer = overrides.pop("add_pooling_layer", True)
    if add_pooling_layer is not True and task != "base":
        raise InputError(f"add_pooling_layer: only a bare backbone (AutoModel) takes it (transformers hands it to "
                         f"the {task} model's __init__, which takes no such argument)")
    dtype = _dtype_arg(dtype if dtype is not None else torch_dtype)
    device = _device(device_map)
    hub = {"subfolder": subfolder, "cache_dir": cache_dir, "force_download": force_download,
           "local_files_only": local_files_only, "token": token}
    gguf = None if gguf_file is None else _gguf_source(source, gguf_file)
    ckpt = _resolve(source, revision, hub) if gguf is None else gguf.checkpoint
    # The family is resolved once, here; the model carries it from here on.
    if isinstance(config, BaseConfig):
        if overrides:  # transformers hands them to the model's __init__, which takes none of them
            raise InputError(f"from_pretrained({', '.join(f'{k}=' for k in overrides)}) with config= a config "
                             f"object: set {'it' if len(overrides) == 1 else 'them'} on the config (transformers "
                             "hands them to the model's __init__, which takes no such argument)")
        config = copy.deepcopy(config)
        family = get_family(config.model_type)
    elif config is None or isinstance(config, (str, os.PathLike)):
        path = ckpt.config_path if config is None else _config_path(config, revision, hub)
        if gguf is not None and config is None:  # the file's metadata is its config
            path, data = gguf.path, gguf.config
        else:
            data = io.read_json(path, "config.json")
        family, config = family_and_config(data, str(path))
        if overrides:
            family, config = _with_overrides(config, overrides, str(path))
    else:
        raise InputError(f"config={type(config).__name__}: expected a config (AutoConfig.from_pretrained), or the "
                         "path or hub id of one")
    if attn_implementation is None and config.raw.get("output_attentions") is True:
        attn_implementation = "eager"  # as transformers: attention weights asked of every forward need eager
    config.attn_implementation = _attn(attn_implementation, family)
    if task == "auto":
        task = task_of(config, family)
    task = family.task_for(task, config)  # DeiT's teacher checkpoint read by AutoModelForImageClassification
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
        tensors = io.load_tensors(ckpt, dtype) if gguf is None else gguf.tensors(family, config, dtype)
        from flodl_hf.core.validate import check_config_fits
        check_config_fits(config, tensors, str(ckpt.config_path))
        with meta_device():
            model = family.build(config, task, add_pooling_layer=has_pooler(tensors) and bool(add_pooling_layer))
        fresh: list[str] = []
        if ignore_mismatched_sizes:
            tensors, fresh = _fresh_mismatched(model, tensors)
        try:
            load_weights(model, tensors, ckpt.source)
        except WeightsMismatchError as exc:
            if not exc.mismatched:
                raise
            raise WeightsMismatchError(f"{ckpt.source} (pass ignore_mismatched_sizes=True to initialise the "
                                       "mismatched weights afresh, as transformers does)",
                                       exc.missing, exc.mismatched, exc.unexpected) from None
        std = getattr(config, "initializer_range", 0.02)
        for key in fresh:  # in the model's order, as transformers' _init_weights (the same draws, seeded alike)
            owner, _, name = key.rpartition(".")
            keys.init_fresh(model.get_submodule(owner), name, std)
    if fresh:
        warnings.warn(f"Some weights of {ckpt.source} did not fit {model.architecture} and are newly initialised "
                      f"(ignore_mismatched_sizes=True): {', '.join(fresh)}. Train the model on a downstream task "
                      "before using it for predictions.", stacklevel=2)
    model.source_root = ckpt.root.absolute()  # the trainer records it, so an export of a fine-tune carries the source's card
    if adapter is not None:
        from flodl_hf.lora import load_adapter
        load_adapter(model, adapter)
    if device is not None:
        model.to(device)
    return model.eval()


class _AutoModel:
    task = "base"

    @classmethod
    def from_pretrained(cls, source: str | Path, *model_args: Any, **kwargs: Any) -> PreTrainedModel:
        """transformers' keywords, as ``load_model`` takes them."""
        return load_model(source, cls.task, **from_pretrained_kwargs(cls, model_args, kwargs))

    @classmethod
    def from_config(cls, config: BaseConfig, attn_implementation: str | None = None) -> PreTrainedModel:
        """A freshly initialised model (transformers' init: normal(initializer_range), zero bias)."""
        family = get_family(config.model_type)
        config.attn_implementation = _attn(attn_implementation, family)
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


class AutoModelForImageClassification(_AutoModel):
    """The image classifiers (``pixel_values`` in; DeiT's with a teacher where the checkpoint names that class)."""

    task = "image_classification"


class AutoModelForMaskedImageModeling(_AutoModel):
    """SimMIM's masked image modeling (ViT, DeiT): the image rebuilt from its patches."""

    task = "masked_image_modeling"


_NAMED = (AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification,
          AutoModelForQuestionAnswering, AutoModelForMaskedLM, AutoModelForMultipleChoice, AutoModelForPreTraining,
          AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForMaskedImageModeling)


def auto_classes() -> dict[str, type[_AutoModel]]:
    """Task -> Auto class, for every registered task; a task a family added without a class here gets
    one named as transformers names its Auto class."""
    named = {c.task: c for c in _NAMED}
    return {t.name: named.get(t.name) or type(t.auto_class, (_AutoModel,), {"task": t.name}) for t in tasks()}
