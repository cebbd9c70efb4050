"""The base model an adapter depends on: its reference (where it was loaded from, its weight files' sha256), the
check of a recorded one, and its local paths, which an export must not overwrite."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from flodl_hf.core.errors import AdapterBaseMismatchError


def base_reference(model: nn.Module) -> dict[str, Any] | None:
    """Where the base was loaded from and its weight files' sha256 (None for a model not loaded from disk)."""
    root = getattr(model, "source_root", None)
    if not root:
        return None
    from flodl_hf.core.fs import sha256_file
    from flodl_hf.core.io import resolve
    ckpt = resolve(root)
    return {"source": str(root), "weights_sha256": {f.name: sha256_file(f) for f in ckpt.weight_files}}


def _check_base(model: nn.Module, recorded: dict | None, where: str) -> None:
    """A recorded base sha256 that differs from the model's base is a typed error."""
    if not recorded or not recorded.get("weights_sha256"):
        return
    if getattr(model, "lora_base", None) is None:
        model.lora_base = base_reference(model)  # hashed once per model
    mine = (model.lora_base or {}).get("weights_sha256")
    if mine and mine != recorded["weights_sha256"]:
        raise AdapterBaseMismatchError(f"{where}: the adapter was trained on base {recorded.get('source')} with "
                                       f"weights sha256 {recorded['weights_sha256']}, but this model's base has "
                                       f"{mine}; load the adapter onto the base it was trained on")


def base_paths(*sources: Any) -> list[tuple[Path, bool]]:
    """The local paths an adapter depends on (its base model directory, a checkpoint), as export's
    ``protect`` entries: --out may neither be, contain, nor lie inside any of them. Hub ids are skipped."""
    out = []
    for source in sources:
        if isinstance(source, (str, os.PathLike)) and str(source):
            path = Path(source).expanduser()
            if path.exists() or path.is_symlink():
                out.append((path.absolute(), True))
    return out
