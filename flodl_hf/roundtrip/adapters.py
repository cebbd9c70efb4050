"""A LoRA trainer checkpoint out again: the model it describes (its referenced base with the adapter on it), merged
(``export --checkpoint CKPT`` / ``--merge``) or as a PEFT adapter directory (``export --adapter``)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flodl_hf.auto import config_from_dict, load_model
from flodl_hf.core import checkpoint_schema
from flodl_hf.core.errors import CheckpointFormatError
from flodl_hf.core.fs import check_out
from flodl_hf.lora import (base_paths, checkpoint_entry, load_checkpoint_adapter, lora_settings, merge_and_unload,
                           save_adapter)


def model_from_checkpoint(data: dict[str, Any], path: str | os.PathLike) -> nn.Module:
    """The LoRA model a trainer checkpoint describes: the referenced base (sha256 checked), the adapter on it."""
    entry = checkpoint_entry(data, path)
    if not entry:
        raise CheckpointFormatError(f"{path}: not a LoRA checkpoint (no 'lora' entry); export it without --adapter")
    cfg = entry["config"]
    settings = lora_settings(cfg, f"{path}: entry 'lora', 'config'", CheckpointFormatError, defaults=False)
    base = entry.get("base") or {}
    if not base.get("source"):
        raise CheckpointFormatError(f"{path}: the LoRA checkpoint records no base source")
    config_dict, saved = checkpoint_schema.model_part(data, path)
    config = config_from_dict(config_dict, f"{path} (config)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a head fresh on the base is a module to save, loaded below
        model = load_model(base["source"], cfg["task"], config=config)
    return load_checkpoint_adapter(model, entry, settings, saved, path)


def merged_checkpoint_state(data: dict[str, Any], path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A LoRA trainer checkpoint's full, merged state_dict (what ``export --checkpoint`` writes)."""
    model = merge_and_unload(model_from_checkpoint(data, path))
    return {k: v.detach() for k, v in model.state_dict().items()}


def export_adapter(checkpoint: str | os.PathLike, out: str | os.PathLike, force: bool = False) -> Path:
    """``flodl-hf export --checkpoint CKPT --adapter``: a trainer checkpoint's adapter as a PEFT directory."""
    path = Path(checkpoint).expanduser().absolute()
    protect = [(path, True)]
    check_out(out, force, protect)
    data = checkpoint_schema.read(path)
    entry = checkpoint_entry(data, path) or {}
    protect += base_paths((entry.get("base") or {}).get("source"))  # the base the adapter depends on
    check_out(out, force, protect)  # before the base is loaded
    model = model_from_checkpoint(data, path)
    return save_adapter(model, out, force, protect=protect)


def require_lora_checkpoint(checkpoint: str | os.PathLike) -> None:
    """``--merge``: a typed error unless the checkpoint holds a LoRA adapter."""
    if not checkpoint_entry(checkpoint_schema.read(checkpoint), checkpoint):
        raise CheckpointFormatError(f"{checkpoint}: not a LoRA checkpoint (no 'lora' entry); export it without --merge")
