"""The trainer checkpoint's schema, in one place: what ``flodl_hf.training.trainer`` writes and what both the
trainer (resume) and ``flodl_hf.roundtrip.export`` (``export --checkpoint``) read.

A checkpoint is a ``torch.save`` dict, loadable with ``weights_only=True``, that carries
``"format": FORMAT`` and ``"version": <= VERSION``; a file without that format is not ours and
is refused, whoever reads it (flodl_hf.training.checkpoints' docstring lists the other keys). The model part
is ``"model"`` (the model's own state_dict) and ``"config"`` (``config.to_dict()``, or None for
a model without a config).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from flodl_hf.core.errors import CheckpointFormatError

FORMAT = "flodl-hf/trainer-checkpoint"
VERSION = 1
MODEL_KEYS = ("model", "config")


def header() -> dict[str, Any]:
    """The keys every checkpoint file (main or per-worker) starts with."""
    return {"format": FORMAT, "version": VERSION}


def read(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint file's dict, tensors on the CPU; anything not written by the trainer is refused."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: no such checkpoint file")
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "global" not in str(exc):  # no object refused: the bytes themselves are not a pickle torch reads
            raise CheckpointFormatError(f"{path}: not a readable trainer checkpoint (truncated, or other bytes than "
                                        "torch.save writes)") from exc
        raise CheckpointFormatError(
            f"{path}: not a flodl-hf trainer checkpoint: it holds objects other than tensors and plain "
            f"containers, which are refused, never unpickled ({str(exc).splitlines()[0]})") from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{path}: not a readable trainer checkpoint ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise CheckpointFormatError(
            f"{path}: not a flodl-hf trainer checkpoint (no format={FORMAT!r}; found {found}). For a "
            "HuggingFace checkpoint use `flodl-hf export --hub PATH`.")
    version = data.get("version", 0)
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointFormatError(f"{path}: checkpoint version {version!r} is newer than this flodl-hf reads "
                                    f"({VERSION}); upgrade flodl-hf")
    return data


def model_part(data: dict[str, Any], path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, state_dict) of a checkpoint read by :func:`read`, checked for export."""
    missing = [k for k in MODEL_KEYS if k not in data]
    if missing:
        raise CheckpointFormatError(f"{path}: the checkpoint has no {', '.join(map(repr, missing))} entry")
    state, config = data["model"], data["config"]
    if config is None:
        raise CheckpointFormatError(f"{path}: the checkpoint has no config (the trained model had none), so "
                                    "the family and head are unknown; only flodl-hf models can be exported")
    if not isinstance(config, dict):
        raise CheckpointFormatError(f"{path}: entry 'config' is a {type(config).__name__}, not a config dict")
    if not isinstance(state, dict) or not state:
        raise CheckpointFormatError(f"{path}: entry 'model' is not a non-empty state_dict")
    for key, value in state.items():
        if not isinstance(key, str):
            raise CheckpointFormatError(f"{path}: model entry {key!r} has a {type(key).__name__} key, not a tensor name")
        if not isinstance(value, torch.Tensor):
            raise CheckpointFormatError(f"{path}: model entry {key!r} is a {type(value).__name__}, not a tensor")
    return config, state
