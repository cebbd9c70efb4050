"""Finding a checkpoint and reading (or writing) its files.

A source is a local directory, a single weights file, or a hub id resolved
through ``huggingface_hub`` and its cache. Weights come from safetensors
(memory-mapped, sharded or not) or from ``pytorch_model.bin`` files read with
``torch.load(weights_only=True)`` only: a pickle holding anything but tensors
is refused, never executed.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from flodl_hf.core.errors import CheckpointFormatError, ConfigError, SourceNotFoundError

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
CONFIG_NAME = "config.json"
# Files a model directory may carry besides weights; fetched from the hub with the weights.
SIDE_PATTERNS = ["*.json", "*.txt", "*.model", "*.jinja", "README.md", "LICENSE*", "NOTICE"]


@dataclass
class Checkpoint:
    """A resolved source: where config and weights live, and how they are stored."""

    source: str                      # what the user passed (hub id or path), for messages
    root: Path                       # directory holding config.json and side files
    weight_files: list[Path] = field(default_factory=list)
    format: str = "safetensors"      # "safetensors" or "bin"
    revision: str | None = None
    weight_map: dict[str, str] | None = None  # sharded: key -> file name

    @property
    def config_path(self) -> Path:
        return self.root / CONFIG_NAME

    @property
    def link_root(self) -> Path:
        """Where the checkpoint's files may resolve to: its directory, or for a hub cache snapshot
        (``models--X/snapshots/REV``, whose files link into ``models--X/blobs``) the repo's cache."""
        return link_root(self.root)


def link_root(root: Path) -> Path:
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--")):
        return root.parent.parent
    return root


def read_index(index_path: Path) -> dict[str, str]:
    """The ``weight_map`` of a shard index, checked: a JSON object whose ``weight_map`` maps string keys
    to shard file names that stay inside the checkpoint (no absolute path, no ``..``, no link out)."""
    from flodl_hf.core.validate import safe_member
    data = read_json(index_path, "the shard index", CheckpointFormatError)
    if "weight_map" not in data:
        raise CheckpointFormatError(f"{index_path}: not a valid shard index (no 'weight_map')")
    weight_map = data["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError(f"{index_path}: 'weight_map' is a {type(weight_map).__name__}, expected an "
                                    "object mapping each tensor name to its shard file")
    if not weight_map:
        raise CheckpointFormatError(f"{index_path}: 'weight_map' is empty: the index names no tensors")
    root = Path(index_path).parent
    allowed = link_root(root)
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise CheckpointFormatError(f"{index_path}: weight_map entry {key!r} is a {type(name).__name__}, "
                                        "expected a shard file name")
        if safe_member(root, name, allowed) is None:
            raise CheckpointFormatError(
                f"{index_path}: weight_map entry {key!r} names shard {name!r}, which is not inside {root} "
                "(absolute, '..' or a link out of the checkpoint): refused, nothing outside a checkpoint is read")
    return dict(weight_map)


def _is_hub_id(source: str) -> bool:
    parts = source.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not source.startswith((".", "~")) and "\\" not in source


def _weights_in_dir(root: Path, source: str) -> tuple[list[Path], str, dict[str, str] | None]:
    """Pick the weight files of a directory: safetensors first, then .bin; sharded via index."""
    from flodl_hf.core.validate import is_within
    allowed = link_root(root)
    for name in (SAFE_SINGLE, BIN_SINGLE, CONFIG_NAME):  # as the shards of an index: no link out of the checkpoint
        if (root / name).is_symlink() and not is_within(root / name, allowed):
            raise CheckpointFormatError(f"{root / name} is a link to {os.path.realpath(root / name)}, outside the "
                                        f"checkpoint {root}: nothing is read from there; copy the file in instead")
    for index_name, single, fmt in ((SAFE_INDEX, SAFE_SINGLE, "safetensors"), (BIN_INDEX, BIN_SINGLE, "bin")):
        if (root / single).is_file():
            return [root / single], fmt, None
        if (root / index_name).is_file():
            index_path = root / index_name
            weight_map = read_index(index_path)
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (root / f).is_file()]
            if missing:
                raise CheckpointFormatError(
                    f"{index_path} names shard(s) that are not in {root}: {', '.join(missing)}")
            return [root / f for f in files], fmt, dict(weight_map)
    raise SourceNotFoundError(
        f"no weights in {source}: expected {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} or {BIN_INDEX}")


def _download(repo_id: str, revision: str | None, subfolder: str = "", **options) -> Path:
    """Fetch config, tokenizer files and weights of a hub repo (or use the cache when offline): safetensors,
    else ``.bin``; ``subfolder`` and huggingface_hub's ``cache_dir``, ``force_download``, ``local_files_only``
    and ``token`` as transformers' ``from_pretrained`` hands them on."""
    prefix = f"{subfolder}/" if subfolder else ""
    try:
        from huggingface_hub import snapshot_download
        for weights in ("*.safetensors", "*.bin"):
            root = Path(snapshot_download(repo_id, revision=revision, **options,
                                          allow_patterns=[prefix + p for p in [*SIDE_PATTERNS, weights]])) / subfolder
            if any(root.glob(weights)):
                break
        return root
    except Exception as exc:  # network down, repo unknown, gated: all end the same way for the user
        where = f"'{repo_id}'" + (f" (subfolder {subfolder!r})" if subfolder else "")
        raise SourceNotFoundError(
            f"cannot resolve {where}: it is not a local path, and the hub could not be reached "
            f"or holds no such repo, with nothing cached ({type(exc).__name__}: {exc}). "
            "Pass a local directory or weights file instead (for example a directory written by "
            "save_pretrained, or a sample from `flodl-hf samples fetch`).") from exc


def resolve(source: str | os.PathLike, revision: str | None = None, subfolder: str = "",
            **hub_options) -> Checkpoint:
    """Resolve a local directory, a single weights file, or a hub id into a Checkpoint. ``subfolder`` is a
    directory inside it; ``hub_options`` (huggingface_hub's ``cache_dir``, ``force_download``,
    ``local_files_only``, ``token``) apply to a hub id only, as transformers applies them."""
    text = str(source)
    path = Path(text).expanduser()
    if text.startswith("samples/") and not path.exists():
        from flodl_hf.core.samples import sample_path  # samples/<name>: a sample unpacked by `flodl-hf samples fetch`
        path = sample_path(text)
    if subfolder and path.exists():
        path = path / subfolder
    if path.is_dir():
        files, fmt, wmap = _weights_in_dir(path, text)
        return Checkpoint(text, path, files, fmt, revision, wmap)
    if path.is_file():
        name = path.name
        if name.endswith(".index.json"):
            files, fmt, wmap = _weights_in_dir(path.parent, text)
            return Checkpoint(text, path.parent, files, fmt, revision, wmap)
        if name.endswith(".safetensors"):
            return Checkpoint(text, path.parent, [path], "safetensors", revision)
        if name.endswith((".bin", ".pt", ".pth")):
            return Checkpoint(text, path.parent, [path], "bin", revision)
        raise CheckpointFormatError(f"{path}: unknown weights format (expected .safetensors or .bin)")
    if path.exists() or not _is_hub_id(text) or (subfolder and Path(text).expanduser().exists()):
        raise SourceNotFoundError(f"{path}: no such file or directory")
    root = _download(text, revision, subfolder, **hub_options)
    files, fmt, wmap = _weights_in_dir(root, text)
    return Checkpoint(text, root, files, fmt, revision, wmap)


def read_json(path: Path, what: str = "file", error: type[Exception] = ConfigError) -> dict:
    """A JSON object from ``path``; anything else (missing, a directory, unreadable, not UTF-8 JSON,
    not an object) is ``error`` (a ConfigError, or a CheckpointFormatError for a shard index) naming the file."""
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError as exc:
        raise error(f"{path}: {what} not found") from exc
    except IsADirectoryError as exc:
        raise error(f"{path}: {what} is a directory, not a file") from exc
    except OSError as exc:
        raise error(f"{path}: cannot read {what} ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise error(f"{path}: {what} is not UTF-8 text ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise error(f"{path}: {what} is not valid JSON ({exc})") from exc
    except RecursionError:
        raise error(f"{path}: {what} is not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise error(f"{path}: {what} must be a JSON object, found a JSON {type(data).__name__}")
    return data


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)
    except SafetensorError as exc:
        raise CheckpointFormatError(f"{path}: corrupt or truncated safetensors file ({exc})") from exc
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointFormatError(f"{path}: cannot read safetensors file ({exc})") from exc


def _legacy_pickles_broken(path: Path) -> bool:
    """Whether a legacy torch file's four pickles (magic, protocol, system info, data) fail to parse as pickle
    opcodes: a file cut inside a GLOBAL reads as an unknown global to the weights-only unpickler, so without this
    check a truncated file would be called unsafe. Parsing opcodes runs nothing."""
    import pickletools
    with open(path, "rb") as handle:
        try:
            for _ in range(4):
                for _op in pickletools.genops(handle):
                    pass
        except Exception:  # noqa: BLE001 - any parse failure means the bytes are not whole pickles
            return True
    return False


def _iter_bin(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # torch.save's zip format is memory-mapped; the legacy (torch < 1.6, non-zip) format cannot be, so it is
    # read whole. map_location="cpu": checkpoints saved from a GPU name CUDA storages, loaded here onto the CPU.
    import zipfile
    try:
        zipped = zipfile.is_zipfile(path)
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read .bin checkpoint ({exc.strerror or exc})") from exc
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as exc:
        if not zipped and _legacy_pickles_broken(path):
            raise CheckpointFormatError(f"{path}: corrupt or truncated .bin checkpoint: its pickles end before "
                                        "their STOP (legacy, non-zip torch file)") from exc
        raise CheckpointFormatError(
            f"{path}: refused to unpickle: it holds objects other than tensors, which could run "
            f"code. Convert it to safetensors where you trust it. ({str(exc).splitlines()[0]})") from exc
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError, TypeError, AttributeError,
            struct.error) as exc:
        what = "zip archive" if zipped else "legacy (non-zip) torch file"
        raise CheckpointFormatError(f"{path}: corrupt or truncated .bin checkpoint: cannot read it as a torch "
                                    f"{what} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                                    ) from exc
    if isinstance(data, dict) and "state_dict" in data and isinstance(data["state_dict"], dict):
        data = data["state_dict"]
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: expected a dict of tensors, found {type(data).__name__}")
    for key, value in data.items():
        if not isinstance(key, str):
            raise CheckpointFormatError(f"{path}: key {key!r} is a {type(key).__name__}, not a tensor name (str)")
        if not isinstance(value, torch.Tensor):
            raise CheckpointFormatError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor")
        yield key, value


def load_tensors(ckpt: Checkpoint, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, as stored (or cast to ``dtype`` when given)."""
    reader = _iter_safetensors if ckpt.format == "safetensors" else _iter_bin
    out: dict[str, torch.Tensor] = {}
    found_in: dict[str, str] = {}
    index = ckpt.root / (SAFE_INDEX if ckpt.format == "safetensors" else BIN_INDEX)
    for path in ckpt.weight_files:
        for key, tensor in reader(path):
            # The index is the truth: a key lives in the one shard it names, once.
            if key in found_in:
                raise CheckpointFormatError(f"{path}: key {key!r} is also in {found_in[key]}: a tensor held by two "
                                            "shards (or twice) is ambiguous; nothing was loaded")
            if ckpt.weight_map is not None and Path(ckpt.weight_map.get(key, "")) != path.relative_to(ckpt.root):
                named = ckpt.weight_map.get(key)
                raise CheckpointFormatError(
                    f"{path}: holds key {key!r}, which {index} "
                    + (f"assigns to {named}" if named else "does not name") + "; nothing was loaded")
            found_in[key] = path.name
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            out[key] = tensor
    if dtype is None:
        _unify_dtypes(out, ckpt)
    if ckpt.weight_map is not None:
        absent = sorted(k for k in ckpt.weight_map if k not in out)
        if absent:
            raise CheckpointFormatError(
                f"{index}: names keys its shards do not hold: "
                + ", ".join(f"{k!r} (in {ckpt.weight_map[k]})" for k in absent[:10]))
    return out


_FLOAT_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _unify_dtypes(tensors: dict[str, torch.Tensor], ckpt: Checkpoint) -> None:
    """One floating dtype per model, as transformers 5 loads with its default ``dtype="auto"``: the
    config's ``dtype`` (or ``torch_dtype``) when it names one, else the first floating tensor's; the other
    floating tensors are cast to it. A file whose floating tensors already share one dtype is kept as is."""
    floats = [(k, t) for k, t in tensors.items() if t.is_floating_point()]
    if len({t.dtype for _, t in floats}) < 2:
        return
    target = None
    try:
        config = json.loads(ckpt.config_path.read_text(encoding="utf-8"))
        named = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
        target = _FLOAT_NAMES.get(str(named).removeprefix("torch."))
    except (OSError, ValueError, RecursionError):
        pass
    target = target or floats[0][1].dtype
    cast = [k for k, t in floats if t.dtype != target]
    for key in cast:
        tensors[key] = tensors[key].to(target)
    import warnings
    warnings.warn(f"{ckpt.source}: floating tensors of several dtypes; cast to {str(target).removeprefix('torch.')} "
                  f"(the config's dtype, else the first tensor's, as transformers does): {', '.join(cast[:10])}"
                  + (f" and {len(cast) - 10} more" if len(cast) > 10 else ""), stacklevel=3)


def parse_size(size: int | str) -> int:
    """'5GB' -> bytes (decimal units, as transformers reads them); ints pass through. Anything but a
    positive size is an InputError naming max_shard_size."""
    from flodl_hf.core.errors import InputError
    value = None
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        text = size.strip().upper()
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
        unit = next((u for u in units if text.endswith(u)), None)
        try:
            value = int(float(text[: -len(unit)] if unit else text) * units.get(unit, 1))
        except ValueError:
            value = None
    if value is None or value < 1:
        raise InputError(f"max_shard_size must be a positive size such as 5GB, 400MB or 2GiB (or bytes); got {size!r}")
    return value


def save_safetensors(tensors: dict[str, torch.Tensor], directory: Path, max_shard_size: int | str = "5GB",
                     metadata: dict[str, str] | None = None) -> list[Path]:
    """Write tensors as ``model.safetensors``, or as shards plus an index above ``max_shard_size``.

    Tensors sharing storage are written as independent contiguous copies, so tied
    weights never trip safetensors' "tensors share memory" check.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    limit = parse_size(max_shard_size)
    meta = {"format": "pt", **(metadata or {})}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][key] = tensor.detach().to("cpu").contiguous().clone()
        size += nbytes
    if len(shards) == 1:
        path = directory / SAFE_SINGLE
        save_file(shards[0], str(path), metadata=meta)
        return [path]
    paths, weight_map, total, count = [], {}, 0, 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata=meta)
        paths.append(directory / name)
        for key, tensor in shard.items():
            weight_map[key] = name
            total += tensor.numel() * tensor.element_size()
            count += tensor.numel()
    # transformers' index metadata: total_parameters (tied tensors once) and total_size in bytes.
    index = {"metadata": {"total_parameters": count, "total_size": total}, "weight_map": weight_map}
    (directory / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (owner checks of scratch directories and test namespaces)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
