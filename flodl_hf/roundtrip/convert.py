"""``pytorch_model.bin`` (single or sharded) to safetensors, proven bitwise.

Pickled ``.bin`` files are read with ``torch.load(weights_only=True)`` only. Tensors that
share storage (tied weights saved by older transformers) are written as independent
copies under every name they had, so safetensors' "tensors share memory" check never
trips and the converted checkpoint holds exactly the keys of the original. After writing,
every tensor is read back and compared byte for byte; the other files of the checkpoint
(config, tokenizer, README...) are copied. All of it lands atomically in ``out``.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flodl_hf.core import io
from flodl_hf.core.errors import CheckpointFormatError
from flodl_hf.core.fs import (WRITTEN_MARK, atomic_directory, check_out, local_source, protected_paths,
                              written_files_list)
from flodl_hf.roundtrip.export import _version, same_bytes


@dataclass
class ConvertResult:
    out: Path
    weight_files: list[str]
    tensors: int
    shared: list[list[str]] = field(default_factory=list)  # groups of names that shared storage in the source
    copied: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "out": str(self.out)}


def shared_groups(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names whose tensors share one storage (tied weights, or views of one buffer)."""
    by_storage: dict[tuple, list[str]] = {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage()
        by_storage.setdefault((storage.data_ptr(), storage.nbytes()), []).append(name)
    return [names for names in by_storage.values() if len(names) > 1]


def _side_files(ckpt: io.Checkpoint, single_file: bool) -> list[Path]:
    """Every other regular file of the checkpoint (relative paths kept); hidden entries and .bin weights
    skipped. Directory links are not followed, and a file link pointing out of the checkpoint (a hub
    snapshot's links into its own blobs excepted) is refused: nothing outside the source is copied."""
    from flodl_hf.core.validate import is_within
    weights = {p.resolve() for p in ckpt.weight_files}
    if single_file:
        # a weights file named alone: only the files HF writes beside it (the names export's carry copies),
        # not whatever else its folder holds
        from flodl_hf.roundtrip.carry import DESCRIPTION_NAMES, TOKENIZER_NAMES
        patterns = (io.CONFIG_NAME, *DESCRIPTION_NAMES, *TOKENIZER_NAMES)
        candidates = [p for p in ckpt.root.iterdir() if any(fnmatch.fnmatchcase(p.name, pat) for pat in patterns)]
    else:
        candidates = []
        for folder, dirs, files in os.walk(ckpt.root, followlinks=False):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            candidates += [Path(folder) / f for f in files]
    out = []
    for path in sorted(set(candidates)):
        rel = path.relative_to(ckpt.root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if path.is_symlink() and not is_within(path, ckpt.link_root):
            raise CheckpointFormatError(f"{path}: a symbolic link pointing out of the checkpoint "
                                        f"({os.path.realpath(path)}); convert copies only the checkpoint's own "
                                        "files. Replace the link by the file, or remove it (nothing was written)")
        if not path.is_file():
            continue
        if path.resolve() in weights or path.name == io.BIN_INDEX:
            continue
        out.append(path)
    return out


def verify_written(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Read every written tensor back; raise unless each is byte-identical to the original and none is extra."""
    written = io.load_tensors(io.resolve(directory))
    missing = sorted(set(tensors) - set(written))
    extra = sorted(set(written) - set(tensors))
    differ = sorted(k for k in tensors if k in written and not same_bytes(tensors[k], written[k]))
    if missing or extra or differ:
        raise CheckpointFormatError(
            f"conversion check failed, nothing was written: missing {missing[:5]}, extra {extra[:5]}, "
            f"not byte-identical {differ[:5]}")


def convert(source: str | os.PathLike, out: str | os.PathLike, revision: str | None = None,
            max_shard_size: int | str = "5GB", force: bool = False) -> ConvertResult:
    """Convert a ``.bin`` checkpoint (directory, file or hub id) to safetensors in ``out``."""
    io.parse_size(max_shard_size)  # a bad size fails before any work
    out_path = check_out(out, force, local_source(source))
    ckpt = io.resolve(source, revision)
    if ckpt.format != "bin":
        raise CheckpointFormatError(f"{source}: already safetensors ({', '.join(p.name for p in ckpt.weight_files)}); "
                                    "there is nothing to convert")
    single_file = Path(source).expanduser().is_file()
    protect = protected_paths(ckpt, not single_file)
    check_out(out_path, force, protect)
    side = _side_files(ckpt, single_file)
    protect += [(p, True) for p in side]
    check_out(out_path, force, protect)
    tensors = io.load_tensors(ckpt)
    shared = shared_groups(tensors)
    with atomic_directory(out_path, force, protect) as tmp:
        files = io.save_safetensors(tensors, tmp, max_shard_size)  # writes contiguous copies: sharing is harmless
        verify_written(tmp, tensors)
        copied = []
        for path in side:
            rel = path.relative_to(ckpt.root)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, tmp / rel)
            copied.append(str(rel))
        # convert copies config.json as it is, so its stamp (what --force may replace) is a file of its own
        # with the list of files written (itself included): all that a later --force may replace
        (tmp / WRITTEN_MARK).write_text(json.dumps({"written_by": "flodl-hf convert", "version": _version(),
                                                    "source": str(source),
                                                    "files": written_files_list(tmp) + [WRITTEN_MARK]}) + "\n")
        weight_files = sorted(p.name for p in files) + ([io.SAFE_INDEX] if len(files) > 1 else [])
    return ConvertResult(out_path, weight_files, len(tensors), shared, copied)
