"""Small checks shared by the readers and writers: paths that must stay inside a directory,
paths that must not overlap, and a content hash of a directory tree.

Paths are compared after ``os.path.realpath``, so ``..`` segments and symbolic links are seen
through: ``SRC/../SRC`` is ``SRC``, and a link pointing out of a checkpoint points out of it.
"""

from __future__ import annotations

import hashlib
import re
import os
from pathlib import Path


def real(path: str | os.PathLike) -> Path:
    """The absolute path with every symlink and ``..`` resolved (the path need not exist)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def is_within(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """``path`` is ``root`` or lies below it, once both are resolved."""
    p, r = real(path), real(root)
    return p == r or p.is_relative_to(r)


def overlap(a: str | os.PathLike, b: str | os.PathLike) -> str | None:
    """How two paths overlap once resolved: 'is', 'contains' (a holds b), 'is inside' (b holds a), or None."""
    ra, rb = real(a), real(b)
    if ra == rb:
        return "is"
    if rb.is_relative_to(ra):
        return "contains"
    if ra.is_relative_to(rb):
        return "is inside"
    return None


def file_above(path: str | os.PathLike) -> Path | None:
    """The nearest existing ancestor of ``path`` where it is not a directory (nothing can be made
    below it), else None."""
    above = next((p for p in Path(path).expanduser().absolute().parents if p.exists() or p.is_symlink()), None)
    return above if above is not None and not above.is_dir() else None


def safe_member(root: Path, name: object, allowed: Path | None = None) -> Path | None:
    """``root / name`` when ``name`` is a relative path that stays inside ``root`` (or ``allowed``, the
    directory its symlinks may point into, e.g. a hub cache's blobs), else None."""
    if not isinstance(name, str) or not name or "\x00" in name:
        return None
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or name.startswith(("/", "\\")):
        return None
    path = root / rel
    if not is_within(path, allowed or root):
        return None
    return path


def tree_hash(path: str | os.PathLike) -> str:
    """sha256 over a directory tree: every entry's relative path, kind and content (links by target).

    A missing path hashes to ``"missing"``; a file hashes as a one-entry tree.
    """
    root = Path(path)
    if not root.exists() and not root.is_symlink():
        return "missing"
    digest = hashlib.sha256()

    def add(entry: Path, rel: str) -> None:
        if entry.is_symlink():
            digest.update(f"L {rel} -> {os.readlink(entry)}\n".encode("utf-8", "surrogateescape"))
        elif entry.is_dir():
            digest.update(f"D {rel}\n".encode("utf-8", "surrogateescape"))
            for child in sorted(entry.iterdir(), key=lambda p: p.name):
                add(child, f"{rel}/{child.name}" if rel else child.name)
        else:
            digest.update(f"F {rel}\n".encode("utf-8", "surrogateescape"))
            with open(entry, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    add(root, "")
    return digest.hexdigest()


# ---- configs against what they describe --------------------------------------------------------------

def check_config_dict(data: object, where: str) -> None:
    """The shape of a config dict before any family reads it: an object whose ``model_type`` (when
    present) is a string and whose ``architectures`` is a list of strings."""
    from flodl_hf.core.errors import ConfigError
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, found a {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{where}: field names must be strings, found {bad[0]!r}")
    model_type = data.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError(f"{where}: field model_type={model_type!r} is a {type(model_type).__name__}, expected a string")
    architectures = data.get("architectures")
    if architectures is not None and (not isinstance(architectures, list)
                                      or not all(isinstance(a, str) for a in architectures)):
        raise ConfigError(f"{where}: field architectures={architectures!r} must be a list of class names (strings)")


# Config fields that count stacked layers, and the key pattern that holds one per layer.
_LAYER_FIELDS = (("num_hidden_layers", re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")),
                 ("n_layers", re.compile(r"(?:^|\.)transformer\.layer\.(\d+)\.")),
                 ("num_hidden_groups", re.compile(r"(?:^|\.)albert_layer_groups\.(\d+)\.")),
                 ("num_hidden_layers", re.compile(r"(?:^|\.)model\.layers\.(\d+)\.|^layers\.(\d+)\.")))  # ModernBERT


def check_config_fits(config: object, tensors: dict, where: str) -> None:
    """Bound what a config asks to build by the checkpoint's own keys, before anything is built: a
    config asking for more stacked layers than the checkpoint holds keys for fails at once (it would
    otherwise spend minutes building 10**6 layers only to report them missing)."""
    from flodl_hf.core.errors import ConfigError
    keys = [k for k in tensors if isinstance(k, str)]
    for name, pattern in _LAYER_FIELDS:
        asked = getattr(config, name, None)
        if not isinstance(asked, int):
            continue
        held = {int(m.group(m.lastindex)) for k in keys for m in [pattern.search(k)] if m}
        if held and asked > len(held):
            raise ConfigError(f"{where}: field {name}={asked}, but the checkpoint holds keys for {len(held)} "
                              f"layer(s) (indices {min(held)}..{max(held)}): fix {name} in config.json")
