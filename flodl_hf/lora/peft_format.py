"""PEFT's adapter directory: the adapter's tensors under PEFT's keys, ``adapter_config.json`` written
(:func:`save_adapter`) and read (:func:`read_adapter_config`, :func:`load_adapter`), each field checked."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flodl_hf.core.errors import AdapterBaseMismatchError, AdapterError, UnsupportedAdapterError, WeightsMismatchError
from flodl_hf.core.fs import ADAPTER_MARK
from flodl_hf.lora.adapt import add_lora, atomic
from flodl_hf.lora.base import _check_base, base_paths
from flodl_hf.lora.config import (_OPTIONAL_FIELDS, PEFT_TASK_TYPES, TASK_OF_PEFT_TASK_TYPE, LoraConfig,
                                  _check_base_record, _check_task, _show, lora_settings)
from flodl_hf.lora.layers import LoraConv1D, LoraParameters
from flodl_hf.lora.patterns import check_patterns
from flodl_hf.lora.targets import _module, is_lora, lora_layers, matched_names, token_targets

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_STAMP = ADAPTER_MARK   # our side file: the task and the base's weight sha256 (PEFT ignores it)
PEFT_PREFIX = "base_model.model."
SUPPORTED_PEFT_TYPES = ("LORA",)

# init_lora_weights values after which PEFT's reload is plain LoRA: the base is left as it is and the file's A
# and B overwrite the init. pissa*, olora and corda subtract their own init's B @ A from the base weight at every
# load, loftq replaces the base weight by its quantised copy, mica is a LoRA variant (B frozen): refused.
_PLAIN_INITS = ("gaussian", "orthogonal", "eva", "lora_ga")

# adapter_config.json fields whose non-default values change the computation and are not implemented.
_UNSUPPORTED_FIELDS = {"layer_replication": None,
                       "use_qalora": False, "alora_invocation_tokens": None, "arrow_config": None,
                       "use_bdlora": None, "velora_config": None, "monteclora_config": None, "kasa_config": None}


def _is_default(value: Any, default: Any) -> bool:
    """An _UNSUPPORTED_FIELDS value that leaves PEFT's computation plain: null, the default by identity (so
    ``layers_to_transform: 0`` is not taken for ``False``), or an empty list / object / string."""
    if value is None or value is default or value is False:
        return True
    return isinstance(value, (list, dict, str)) and len(value) == 0


# ---- the adapter's tensors, under our keys and under PEFT's -------------------------------------------

def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an adapter holds, under the model's keys: every trainable parameter (LoRA A and B,
    modules to save, biases by ``bias``), in ``state_dict`` order."""
    if not is_lora(model):
        raise AdapterError(f"{type(model).__name__} has no LoRA adapters (call flodl_hf.lora.add_lora first)")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if id(v) in trainable}


def _to_hf(model: nn.Module, key: str) -> str:
    """Our key -> PEFT's (without ``base_model.model.``): the module path in transformers' model through the
    family's table (``KeyMap.module_name``); an adapted layer's own bias sits under ``base_layer.`` in PEFT's
    model, and so in its file."""
    key_map = model.family.key_map() if hasattr(model, "family") else None
    hf = key_map.module_name if key_map is not None else (lambda k: k)
    adapted = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.([^.]+)\.weight", key)
    if adapted and isinstance(layer := _module(model, adapted.group(1)), LoraParameters):
        # PEFT's nested ParamWrappers: the first adapted Parameter innermost, one base_layer per wrapper around it
        module, part, name = adapted.groups()
        names = list(layer.lora_A)
        path = hf(f"{module}.{name}")[: -len(name) - 1]
        return path + ".base_layer" * (len(names) - 1 - names.index(name)) + f".{part}.weight"
    if key.endswith(".trainable_tokens_delta"):  # TrainableTokensWrapper.adapter_state_dict's key
        module = key[: -len(".trainable_tokens_delta")]
        return hf(module + ".weight")[: -len(".weight")] + ".token_adapter.trainable_tokens_delta"
    for part in (".lora_A.weight", ".lora_B.weight", ".lora_B.bias", ".lora_magnitude_vector", ".bias"):
        if key.endswith(part):  # the module's own weight key goes through the family's table
            module = key[: -len(part)]
            path = hf(module + ".weight")[: -len(".weight")]
            if part == ".bias":
                if module not in getattr(model.lora_config, "targeted", ()):
                    return hf(key)
                return path + ".base_layer.bias"
            return path + part
    return hf(key)


def peft_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the keys ``PeftModel.save_pretrained`` writes."""
    return {PEFT_PREFIX + _to_hf(model, k): v.detach().cpu().contiguous() for k, v in adapter_state(model).items()}


def peft_config_dict(model: nn.Module, base: str | None = None) -> dict[str, Any]:
    """``adapter_config.json`` as PEFT's ``LoraConfig.save_pretrained`` writes it (the fields that matter)."""
    cfg: LoraConfig = model.lora_config
    task_type = cfg.task_type
    targets = (cfg.target_modules if cfg.target_modules is None or isinstance(cfg.target_modules, str)
               else sorted(cfg.target_modules))
    excluded = cfg.exclude_modules
    out: dict[str, Any] = {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base, "revision": None,
        "r": cfg.r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout, "target_modules": targets,
        "modules_to_save": cfg.modules_to_save, "use_rslora": cfg.use_rslora, "bias": cfg.bias,
        # PEFT sets fan_in_fan_out at each target by its type (True on a Conv1D, False on nn.Linear): the last one's
        "fan_in_fan_out": isinstance(next(reversed(lora_layers(model).values()), None), LoraConv1D),
        "init_lora_weights": True, "inference_mode": True,
        "layers_to_transform": cfg.layers_to_transform, "layers_pattern": cfg.layers_pattern,
        "rank_pattern": cfg.rank_pattern, "alpha_pattern": cfg.alpha_pattern,
        "exclude_modules": sorted(excluded) if isinstance(excluded, list) else excluded,  # a set in PEFT
        "use_dora": cfg.use_dora, "lora_bias": cfg.lora_bias,
        "trainable_token_indices": cfg.trainable_token_indices,   # as given: a list, or module name -> list
        # a set in PEFT for the MoE families it converts (written in set order): sorted
        "target_parameters": sorted(cfg.target_parameters) if cfg.target_parameters else cfg.target_parameters,
    }
    if task_type is None and hasattr(model, "architecture"):
        # what PEFT writes for a model without a task type: the class, so our reader knows the head
        out["auto_mapping"] = {"base_model_class": model.architecture, "parent_library": "transformers"}
    return out


def save_adapter(model: nn.Module, out: str | os.PathLike, force: bool = False,
                 base: str | os.PathLike | None = None,
                 protect: list[tuple[Path, bool]] | None = None) -> Path:
    """Write ``model``'s adapter as a PEFT adapter directory (atomically). ``out`` may not be, contain or lie
    inside the base model the adapter depends on, nor any path in ``protect``."""
    from flodl_hf.core.fs import atomic_directory, check_out, written_files_list
    ref = getattr(model, "lora_base", None) or {}
    base = str(base) if base is not None else ref.get("source")
    protect = list(protect or []) + base_paths(ref.get("source"), base, getattr(model, "source_root", None))
    out_path = check_out(out, force, protect)
    with atomic_directory(out_path, force, protect) as tmp:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config_dict(model, base), indent=2, sort_keys=True) + "\n")
        _save_file(peft_state(model), tmp)
        # with the list of files written (itself included): all that a later --force may replace
        (tmp / BASE_STAMP).write_text(json.dumps({"task": model.lora_config.task, "base": ref or None,
                                                  "files": written_files_list(tmp) + [BASE_STAMP]},
                                                 indent=2, sort_keys=True) + "\n")
    return out_path


def _save_file(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


# ---- reading PEFT's adapters --------------------------------------------------------------------------

def _add_lora_from(model: nn.Module, settings: dict[str, Any], task_type: str | None) -> nn.Module:
    """``add_lora`` with checked settings (:func:`lora_settings`), for weights loaded next: the RNG draws of the
    init, overwritten, leave the caller's RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        return add_lora(model, r=settings["r"], alpha=settings["lora_alpha"], dropout=settings["lora_dropout"],
                        target_modules=settings["target_modules"], modules_to_save=settings["modules_to_save"],
                        use_rslora=settings["use_rslora"], bias=settings["bias"], task_type=task_type,
                        **{name: settings[name] for name, *_ in _OPTIONAL_FIELDS})


# adapter_config.json's other fields that we read: (field, check, what is expected).
_OTHER_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("task_type", lambda v: v is None or isinstance(v, str), "a string or null"),
    ("base_model_name_or_path", lambda v: v is None or isinstance(v, str), "a string or null"),
    ("auto_mapping", lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("base_model_class"),
                                                                                 (str, type(None)))),
     "an object or null, its 'base_model_class' a string"),
)


def adapter_file(directory: str | os.PathLike, name: str) -> Path | None:
    """``directory/name`` when it is there (None when not), checked to be a regular file inside the adapter
    directory, as the weights loader checks a checkpoint's files (flodl_hf.core.source_files.checked_file): a
    symlink is followed when it stays inside (or points into a hub cache's ``blobs/``); one out of the directory,
    a directory or a device is an AdapterError naming the file."""
    from flodl_hf.core.source_files import checked_file
    root = Path(directory).expanduser()
    path = root / name
    if not path.exists() and not path.is_symlink():
        return None
    checked_file(root, name, AdapterError, "the adapter directory")
    return path


def read_adapter_config(directory: str | os.PathLike) -> dict[str, Any]:
    """``adapter_config.json``, checked: a PEFT type and options we implement, each field of PEFT's type, or a
    typed error naming the file and the field."""
    path = adapter_file(directory, ADAPTER_CONFIG)
    if path is None:
        raise AdapterError(f"{Path(directory)}: no {ADAPTER_CONFIG}, so this is not a PEFT adapter directory")
    from flodl_hf.core.errors import ConfigError
    from flodl_hf.core.io import read_json
    try:
        data = read_json(path, ADAPTER_CONFIG)
    except ConfigError as exc:
        raise AdapterError(str(exc)) from exc
    kind = data.get("peft_type")
    if kind not in SUPPORTED_PEFT_TYPES:
        raise UnsupportedAdapterError(f"{path}: peft_type {_show(kind)} is not supported; flodl-hf reads "
                                      f"{', '.join(SUPPORTED_PEFT_TYPES)} adapters")
    if data.get("fan_in_fan_out") is True and data.get("target_parameters"):  # ParamWrapper's ValueError
        raise AdapterError(f"{path}: fan_in_fan_out=true with target_parameters, which PEFT refuses; expected "
                           "fan_in_fan_out false")
    if data.get("fan_in_fan_out") is not None and not isinstance(data["fan_in_fan_out"], bool):
        # any true or false: PEFT decides it per layer type (LoraConv1D)
        raise AdapterError(f"{path}: field 'fan_in_fan_out' is {_show(data['fan_in_fan_out'])} "
                           f"({type(data['fan_in_fan_out']).__name__}); expected JSON true or false")
    for name, default in _UNSUPPORTED_FIELDS.items():
        value = data.get(name, default)
        if default is False and value is not None and not isinstance(value, bool):
            raise AdapterError(f"{path}: field {name!r} is {_show(value)} ({type(value).__name__}); expected JSON "
                               "true or false")
        if not _is_default(value, default):
            raise UnsupportedAdapterError(f"{path}: {name}={_show(value)} is not supported (flodl-hf implements "
                                          f"plain LoRA on linear layers; {name} must be {default!r})")
    init = data.get("init_lora_weights", True)
    if not isinstance(init, (bool, str)):
        raise AdapterError(f"{path}: field 'init_lora_weights' is {_show(init)} ({type(init).__name__}); expected "
                           "JSON true or false, or the name of one of PEFT's initialisations")
    if isinstance(init, str) and init not in _PLAIN_INITS:
        if init.startswith(("pissa", "corda")) or init == "olora":
            why = ("PEFT reruns this initialisation when it loads the adapter and subtracts its B @ A from the "
                   "base weights, so the base under the adapter is not the base checkpoint")
        elif init == "loftq":
            why = "PEFT replaces the base weights by their LoftQ-quantised copy when it loads the adapter"
        elif init == "mica":
            why = "MiCA is a LoRA variant (lora_B frozen)"
        else:
            why = "it is not one of PEFT's initialisations that reload as plain LoRA"
        raise UnsupportedAdapterError(f"{path}: init_lora_weights={_show(init)} is not supported: {why}; flodl-hf "
                                      "reads adapters whose init_lora_weights is true, false or one of "
                                      f"{', '.join(map(repr, _PLAIN_INITS))} (PEFT's path_initial_model_for_weight_"
                                      "conversion saves a PiSSA/OLoRA/CorDA adapter as plain LoRA)")
    settings = lora_settings(data, str(path))
    if settings["lora_bias"] and not isinstance(init, bool):  # LoraConfig.__post_init__'s ValueError
        raise AdapterError(f"{path}: lora_bias=true with init_lora_weights={_show(init)}, which PEFT refuses (a lora_B "
                           "bias only with init_lora_weights true or false); expected init_lora_weights true")
    odd = [f"{k} -> {r}" for k, r in settings["rank_pattern"].items() if r % 2]
    if init == "orthogonal" and (settings["r"] % 2 or odd):
        # peft.tuners.lora.layer.LoraLayer.orthogonal_init reruns at every load and splits a QR basis in halves
        given = f"field 'r' is {settings['r']}" if settings["r"] % 2 else f"field 'rank_pattern' gives {', '.join(odd)}"
        raise AdapterError(f"{path}: init_lora_weights='orthogonal' needs an even r, and {given}; PEFT refuses this "
                           "adapter too (its orthogonal initialisation, rerun when it loads the adapter, requires the "
                           "LoRA rank to be even). The saved A and B replace the initialisation at load, so setting "
                           "init_lora_weights to true in this file loads the same adapter, in PEFT as here")
    for name, ok, expected in _OTHER_FIELDS:
        if not ok(data.get(name)):
            value = data[name]
            raise AdapterError(f"{path}: field {name!r} is {_show(value)} ({type(value).__name__}); "
                               f"expected {expected}")
    return data


def read_base_stamp(directory: str | os.PathLike) -> dict[str, Any] | None:
    """Our side file (``flodl_hf_base.json``: the task and the base reference), checked; None where absent."""
    path = adapter_file(directory, BASE_STAMP)
    if path is None:
        return None
    from flodl_hf.core.errors import ConfigError
    from flodl_hf.core.io import read_json
    try:
        data = read_json(path, BASE_STAMP)
    except ConfigError as exc:
        raise AdapterError(str(exc)) from exc
    if data.get("task") is not None:
        _check_task(data["task"], str(path), AdapterError)
    _check_base_record(data.get("base"), str(path), AdapterError)
    return data


def adapter_task(data: dict[str, Any], directory: Path) -> str | None:
    """The head an adapter was trained with, from task_type, our side file, or auto_mapping."""
    reverse = {v: k for k, v in PEFT_TASK_TYPES.items()}
    if data.get("task_type") in reverse:
        return reverse[data["task_type"]]
    stamp = read_base_stamp(directory)
    if stamp and stamp.get("task"):
        return stamp["task"]
    arch = (data.get("auto_mapping") or {}).get("base_model_class")
    if arch:
        from flodl_hf.core.registry import parse_architecture
        return parse_architecture(arch)[1]
    return None


def _check_tensors(tensors: dict[str, Any], where: str) -> None:
    """Each of an adapter's tensors is a floating-point tensor (PEFT's float32, or a float16 / bfloat16 base's
    dtype, cast on loading as PEFT casts it); an integer, bool or complex one, or a value that is no tensor, is an
    AdapterError naming the key (PEFT casts an integer tensor and loads it)."""
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise AdapterError(f"{where}: {key} is a {type(value).__name__}, not a tensor")
        if not value.is_floating_point():
            raise AdapterError(f"{where}: {key} is a {str(value.dtype).removeprefix('torch.')} tensor; an adapter's "
                               "tensors are floating point (float32, or the base's float16 / bfloat16)")


def _load_into(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Strictly put an adapter's tensors (under the model's keys) into a LoRA model: every key, shape and dtype
    checked before the first is copied."""
    _check_tensors(tensors, where)
    want = adapter_state(model)
    missing = [k for k in want if k not in tensors]
    unexpected = sorted(k for k in tensors if k not in want)
    if missing or unexpected:
        raise WeightsMismatchError(where, missing, [], unexpected)
    mismatched = [(k, tuple(want[k].shape), tuple(tensors[k].shape)) for k in want if tensors[k].shape != want[k].shape]
    if mismatched:
        lines = ", ".join(f"{k}: model {a}, adapter {b}" for k, a, b in mismatched)
        raise AdapterBaseMismatchError(f"{where}: the adapter does not fit this base (shapes differ): {lines}")
    with torch.no_grad():
        for k, v in want.items():
            v.copy_(tensors[k])


@atomic
def load_adapter(model: nn.Module, directory: str | os.PathLike) -> nn.Module:
    """Add the PEFT LoRA adapter in ``directory`` to ``model`` (in place) and load its weights strictly. Each file
    is read from inside the directory only (:func:`adapter_file`); a refused adapter leaves the model as it was
    (:func:`flodl_hf.lora.adapt.atomic`)."""
    directory = Path(directory).expanduser()
    data = read_adapter_config(directory)
    weights = adapter_file(directory, ADAPTER_WEIGHTS)
    if weights is None:
        raise AdapterError(f"{directory}: no {ADAPTER_WEIGHTS} (adapters saved as .bin are not read; save with "
                           "safe_serialization=True)")
    stamp = read_base_stamp(directory)
    if stamp:
        _check_base(model, stamp.get("base"), str(directory))
    settings = lora_settings(data, str(directory / ADAPTER_CONFIG))
    check_patterns(settings, matched_names(model), str(directory / ADAPTER_CONFIG))
    task = getattr(model, "task", "base")
    task_type = data.get("task_type")
    if task_type in TASK_OF_PEFT_TASK_TYPE and TASK_OF_PEFT_TASK_TYPE[task_type] != task:
        raise AdapterBaseMismatchError(
            f"{directory / ADAPTER_CONFIG}: task_type {task_type!r} is an adapter for the "
            f"{TASK_OF_PEFT_TASK_TYPE[task_type]} task (its head), but this model "
            f"({type(model).__name__}) is {task}; load it onto a {TASK_OF_PEFT_TASK_TYPE[task_type]} model")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:  # read before the model is touched: a bad file leaves it as it was
        raw = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{weights}: not a readable safetensors file ({exc}); {ADAPTER_WEIGHTS} must be what "
                           "PeftModel.save_pretrained writes") from exc
    _check_tensors(raw, str(weights))
    # token ids checked against this model's embeddings first, so the error names the file
    token_targets(model, settings["trainable_token_indices"], [], str(directory / ADAPTER_CONFIG))
    # PeftModel.from_pretrained: the config's modules_to_save, plus the head its task_type's class adds
    _add_lora_from(model, settings, task_type)
    ours = {}
    hf_of = {_to_hf(model, k): k for k in adapter_state(model)}
    for key, tensor in raw.items():
        bare = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if data.get("bias") == "all" and re.search(r"\.(original_module|modules_to_save)\.(.+\.)?bias$", bare):
            continue  # bias="all": PEFT also saves its wrapper's copies of a saved module's biases (nested too)
        ours[hf_of.get(bare, bare)] = tensor
    _load_into(model, ours, str(weights))
    return model
