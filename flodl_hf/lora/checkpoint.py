"""A LoRA model in a trainer checkpoint: the ``"model"`` it saves (only the adapter when the base is on disk), its
``"lora"`` entry (written and checked), resuming from one, and a checkpoint's adapter put on its base."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from flodl_hf.core.errors import AdapterError, CheckpointFormatError
from flodl_hf.lora.adapt import atomic
from flodl_hf.lora.base import _check_base, base_reference
from flodl_hf.lora.config import PEFT_TASK_TYPES, _check_base_record, _check_task, _show, lora_settings
from flodl_hf.lora.patterns import check_patterns
from flodl_hf.lora.peft_format import _add_lora_from, _load_into, adapter_state
from flodl_hf.lora.targets import is_lora, matched_names


def trainer_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a trainer checkpoint's ``"model"`` holds: the whole state_dict, or, for a LoRA model whose base
    is on disk, only the adapter (the base is referenced by ``trainer_entry``)."""
    if is_lora(model) and (getattr(model, "lora_base", None) or {}).get("source"):
        return {k: v.detach().cpu() for k, v in adapter_state(model).items()}
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def trainer_entry(model: nn.Module) -> dict[str, Any] | None:
    """The checkpoint's ``"lora"`` entry: the adapter's config, the base reference, whether only the adapter is
    saved."""
    if not is_lora(model):
        return None
    base = getattr(model, "lora_base", None)
    return {"config": model.lora_config.to_dict(), "base": base, "adapter_only": bool((base or {}).get("source"))}


def checkpoint_entry(data: dict[str, Any], path: str | os.PathLike | None) -> dict[str, Any] | None:
    """A trainer checkpoint's ``"lora"`` entry, checked (what :func:`trainer_entry` writes): None for a model
    without LoRA, else a dict with ``config`` (the LoRA settings and ``task``), ``base`` and ``adapter_only``.
    Anything else is a CheckpointFormatError naming the file and the entry."""
    entry = data.get("lora")
    if entry is None:
        return None
    where = f"{path}: entry 'lora'"
    if not isinstance(entry, dict):
        raise CheckpointFormatError(f"{where} is {_show(entry)} ({type(entry).__name__}); expected None or a dict "
                                    "with 'config', 'base' and 'adapter_only' (flodl_hf.lora.trainer_entry)")
    for key in ("config", "adapter_only"):
        if key not in entry:
            raise CheckpointFormatError(f"{where} has no field {key!r}; expected a dict with 'config', 'base' and "
                                        "'adapter_only' (flodl_hf.lora.trainer_entry)")
    if not isinstance(entry["adapter_only"], bool):
        raise CheckpointFormatError(f"{where}: field 'adapter_only' is {_show(entry['adapter_only'])} "
                                    f"({type(entry['adapter_only']).__name__}); expected True or False")
    cfg = entry["config"]
    if not isinstance(cfg, dict):
        raise CheckpointFormatError(f"{where}: field 'config' is {_show(cfg)} ({type(cfg).__name__}); expected the "
                                    "adapter's settings (a dict: r, lora_alpha, lora_dropout, target_modules ...)")
    lora_settings(cfg, f"{where}, 'config'", CheckpointFormatError, defaults=False)
    _check_task(cfg.get("task"), f"{where}, 'config'", CheckpointFormatError)
    if cfg.get("task_type") is not None and not isinstance(cfg["task_type"], str):
        raise CheckpointFormatError(f"{where}, 'config': field 'task_type' is {_show(cfg['task_type'])} "
                                    f"({type(cfg['task_type']).__name__}); expected PEFT's task type (a string) or "
                                    "null")
    _check_base_record(entry.get("base"), where, CheckpointFormatError)
    return entry


def load_trainer_state(model: nn.Module, state: dict[str, Any], where: str) -> None:
    """Resume: put a checkpoint's ``"model"`` back, strictly (adapter-only checkpoints into a LoRA model)."""
    entry = checkpoint_entry(state, where)
    if not entry or not entry["adapter_only"]:
        model.load_state_dict(state["model"])
        return
    if not is_lora(model):
        raise AdapterError(f"{where}: the checkpoint holds only a LoRA adapter; call flodl_hf.lora.add_lora with "
                           f"the same settings ({_settings(entry['config'])}) before resuming")
    _check_base(model, entry.get("base"), where)
    _load_into(model, state["model"], where)


def _settings(cfg: dict[str, Any]) -> str:
    return ", ".join(f"{k}={cfg[k]!r}" for k in ("r", "lora_alpha", "lora_dropout", "target_modules",
                                                  "modules_to_save", "use_rslora", "bias", "use_dora", "lora_bias",
                                                  "target_parameters") if k in cfg)


@atomic
def load_checkpoint_adapter(model: nn.Module, entry: dict[str, Any], settings: dict[str, Any],
                            saved: dict[str, torch.Tensor], path: str | os.PathLike) -> nn.Module:
    """Put a trainer checkpoint's adapter on ``model``, the base its ``"lora"`` entry references (``entry``, from
    :func:`checkpoint_entry`), just loaded: the base's sha256 checked against the recorded one, the adapter of the
    entry's ``settings`` (:func:`lora_settings`) added, its tensors loaded strictly from ``saved`` (the
    checkpoint's ``"model"``). A refusal leaves the model as it was. Returns the model, in eval mode."""
    cfg = entry["config"]
    base = entry.get("base") or {}
    model.lora_base = base_reference(model)
    _check_base(model, base, str(path))
    model.lora_base = base
    check_patterns(settings, matched_names(model), f"{path}: entry 'lora', 'config'", CheckpointFormatError)
    # a checkpoint written before task_type was recorded: PEFT's task type for the task, as add_lora then took
    task_type = cfg["task_type"] if "task_type" in cfg else PEFT_TASK_TYPES.get(cfg["task"])
    _add_lora_from(model, settings, task_type)
    state = saved if entry["adapter_only"] else {k: v for k, v in saved.items() if k in adapter_state(model)}
    _load_into(model, state, str(path))
    return model.eval()
