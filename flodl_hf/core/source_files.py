"""Reading the files of a source directory safely, and the sentence-transformers ``modules.json`` that names them.

Only regular files inside the source are read: a symlink is followed only when it stays inside (into the hub
cache's ``blobs/`` for a hub snapshot), and a module path that is absolute or has ``..`` is refused. The export's
carry plan (flodl_hf.roundtrip.carry) and ``embed``'s sentence-transformers pipeline (flodl_hf.tasks.embed) both
read ``modules.json`` through here.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath

from flodl_hf.core.errors import CheckpointFormatError, ConfigError

MODULES_NAME = "modules.json"


# ---- containment: only regular files inside the source ----------------------------------------------

def allowed_roots(root: Path) -> list[Path]:
    """Where a file of ``root`` may really live: ``root``, and the blobs of a hub cache snapshot."""
    real = root.resolve()
    allowed = [real]
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        allowed.append((real.parent.parent / "blobs").resolve())
    return allowed


def inside(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def checked_file(root: Path, name: str, error: type[Exception] = CheckpointFormatError,
                 what: str = "the source") -> Path:
    """The real path of ``root/name`` if it is a regular file inside ``root`` (``what``, for messages); else
    ``error``, naming the file."""
    path = root / name
    try:
        real = path.resolve()
        mode = os.lstat(path).st_mode
        real_mode = os.stat(real).st_mode
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise error(f"{path}: cannot be read ({exc})") from exc
    if stat.S_ISLNK(mode) and not inside(real, allowed_roots(root)):
        raise error(f"{path}: is a symlink to {real}, outside {what} {root}: refused "
                    "(copy the file in, or remove the link)")
    if not inside(real, allowed_roots(root)):  # a folder on the way is a link out
        raise error(f"{path}: resolves to {real}, outside {what} {root}: refused")
    if not stat.S_ISREG(real_mode):
        raise error(f"{path}: is not a regular file: refused")
    return real


# ---- modules.json ------------------------------------------------------------------------------------

def module_path(entry: object, index: int, where: Path) -> PurePosixPath | None:
    """A module's folder, relative to the model root (None: the root itself). ConfigError unless it is
    a plain relative path with no ``..``."""
    if not isinstance(entry, dict) or not isinstance(entry.get("path", ""), str):
        raise ConfigError(f"{where}: entry {index} is not an object with a string 'path' ({entry!r})")
    text = entry.get("path", "")
    pure = PurePosixPath(text)
    if "\\" in text or pure.is_absolute() or ".." in pure.parts or (len(text) > 1 and text[1] == ":"):
        raise ConfigError(f"{where}: entry {index} ({entry.get('name', index)!r}) has module path {text!r}, "
                          "which leaves the model directory (absolute, a drive, or '..'): refused")
    parts = [p for p in pure.parts if p != "."]
    return PurePosixPath(*parts) if parts else None


def read_modules(root: Path) -> list[dict]:
    """modules.json of ``root`` as a list of entries (checked to be one)."""
    path = root / MODULES_NAME
    checked_file(root, MODULES_NAME)
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, list):
        raise ConfigError(f"{path}: expected a list of modules, found a {type(data).__name__}")
    return data
