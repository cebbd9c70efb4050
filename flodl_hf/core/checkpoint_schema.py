"""The trainer checkpoint's schema, in one place: what ``flodl_hf.training.trainer`` writes and what both the
trainer (resume) and ``flodl_hf.roundtrip.export`` (``export --checkpoint``) read.

A checkpoint is a ``torch.save`` dict, loadable with ``weights_only=True``, that carries
``"format": FORMAT`` and ``"version": <= VERSION``; a file without that format is not ours and
is refused, whoever reads it (flodl_hf.training.checkpoints' docstring lists the other keys). The model part
is ``"model"`` (the model's own state_dict) and ``"config"`` (``config.to_dict()``, or None for
a model without a config).

:func:`read` checks every field it knows, whoever reads: its type, its range, and what one field says about
another (a position inside the data, one El Che count per worker). Which fields must be there depends on the
reader (``kind``): ``"main"`` (worker 0's file, as a resume reads it: the fields it reads without a default,
the optimizer, whole RNG states), ``"side"`` (another worker's ``.rank-R.pt``: its step and its states), or None
(export, which needs only ``model`` and ``config``: :func:`model_part`). Every refusal is a
:class:`CheckpointFormatError` naming the file and the field. What only a Trainer can check (the step its
epoch and position make in this run, optimizer states against its own optimizer) is
``flodl_hf.training.checkpoints``'.
"""

from __future__ import annotations

import math
import os
import pickle
import random
import re
from pathlib import Path
from typing import Any, Callable

import torch

from flodl_hf.core.errors import CheckpointFormatError

FORMAT = "flodl-hf/trainer-checkpoint"
VERSION = 1
MODEL_KEYS = ("model", "config")
SYNCS = ("ddp", "el-che", "none", "fsdp")
_SHARDS_RE = re.compile(r"^step-\d{8,}(?:-\d+)?\.dcp$")  # sync="fsdp": the shard directory beside the main file
_COUNT_MAX = 2**63 - 1  # counters are int64 wherever torch meets them


def header() -> dict[str, Any]:
    """The keys every checkpoint file (main or per-worker) starts with."""
    return {"format": FORMAT, "version": VERSION}


class _Bad(Exception):
    """A field that breaks the schema: ``field`` (dotted path) and what is wrong with it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.field, self.problem = field, problem


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} ({value.dtype})"
    text = repr(value)
    return f"{text[:57]}... ({type(value).__name__})" if len(text) > 60 else f"{text} ({type(value).__name__})"


Check = Callable[[Any, str], None]


def _int(lo: int | None = 0, none: bool = False) -> Check:
    def check(value: Any, field: str) -> None:
        if value is None and none:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad(field, f"is {_show(value)}, not an int{' or None' if none else ''}")
        if (lo is not None and value < lo) or abs(value) > _COUNT_MAX:
            raise _Bad(field, f"is {value}, outside [{lo if lo is not None else -_COUNT_MAX}, {_COUNT_MAX}]")
    return check


def _number(value: Any, field: str) -> None:
    """A finite number >= 0 (seconds, a share)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _Bad(field, f"is {_show(value)}, not a finite number >= 0")


def _choice(*options: Any) -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, (str, type(None))) or value not in options:  # (a tensor compares elementwise)
            raise _Bad(field, f"is {_show(value)}, not one of {', '.join(map(repr, options))}")
    return check


def _kind(*types: type, none: bool = False) -> Check:
    def check(value: Any, field: str) -> None:
        if value is None and none:
            return
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            names = " or ".join(t.__name__ for t in types) + (" or None" if none else "")
            raise _Bad(field, f"is {_show(value)}, not a {names}")
    return check


def _tensor(value: Any, field: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise _Bad(field, f"is {_show(value)}, not a tensor")


def _tensors(value: Any, field: str) -> None:
    """A state_dict: tensor names to tensors."""
    if not isinstance(value, dict):
        raise _Bad(field, f"is {_show(value)}, not a state_dict (a dict of tensors)")
    for key, tensor in value.items():
        if not isinstance(key, str):
            raise _Bad(field, f"is not a state_dict: {field} entry {key!r} has a {type(key).__name__} key, not a "
                              "tensor name")
        if not isinstance(tensor, torch.Tensor):
            raise _Bad(field, f"is not a state_dict: {field} entry {key!r} is {_show(tensor)}, not a tensor")


def _tensor_list(value: Any, field: str) -> None:
    if not isinstance(value, (list, tuple)):
        raise _Bad(field, f"is {_show(value)}, not a list of tensors")
    for i, tensor in enumerate(value):
        _tensor(tensor, f"{field}[{i}]")


def _config(value: Any, field: str) -> None:
    """A dict or None (a config: its values are the config class's to check, with a ConfigError)."""
    if value is not None and not isinstance(value, dict):
        raise _Bad(field, f"is {_show(value)}, not a dict or None")


def _plain(value: Any, field: str, depth: int = 0) -> None:
    """A value an optimizer or scheduler keeps: numbers, bools, strings, None, tensors and lists, tuples and
    dicts of them."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return
    if depth < 6 and isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _plain(item, f"{field}[{i}]", depth + 1)
        return
    if depth < 6 and isinstance(value, dict):
        for key, item in value.items():
            _plain(item, f"{field}.{key}", depth + 1)
        return
    raise _Bad(field, f"is {_show(value)}, not a number, string, tensor or a list or dict of them")


def _optimizer(none: bool = False) -> Check:
    """A torch optimizer's state_dict: ``state`` (parameter index -> its state) and ``param_groups``."""
    def check(value: Any, field: str) -> None:
        if value is None and none:
            return
        if not isinstance(value, dict) or not {"state", "param_groups"} <= value.keys():
            raise _Bad(field, f"is {_show(value)}, not an optimizer state_dict (a dict with 'state' and "
                              "'param_groups')")
        state, groups = value["state"], value["param_groups"]
        if not isinstance(state, dict):
            raise _Bad(f"{field}.state", f"is {_show(state)}, not a dict")
        for index, entry in state.items():
            _int()(index, f"{field}.state key")
            if not isinstance(entry, dict) or not all(isinstance(k, str) for k in entry):
                raise _Bad(f"{field}.state[{index}]", f"is {_show(entry)}, not a dict of named values")
            _plain(entry, f"{field}.state[{index}]")
        if not isinstance(groups, list) or not groups:
            raise _Bad(f"{field}.param_groups", f"is {_show(groups)}, not a list of parameter groups")
        for i, group in enumerate(groups):
            where = f"{field}.param_groups[{i}]"
            if not isinstance(group, dict) or not all(isinstance(k, str) for k in group):
                raise _Bad(where, f"is {_show(group)}, not a dict of settings")
            params = group.get("params")
            if not isinstance(params, list):
                raise _Bad(f"{where}.params", f"is {_show(params)}, not a list of parameter indices")
            for j, index in enumerate(params):
                _int()(index, f"{where}.params[{j}]")
            _plain(group, where)
    return check


def _dict_or_none(value: Any, field: str) -> None:
    if value is not None and not isinstance(value, dict):
        raise _Bad(field, f"is {_show(value)}, not a dict or None")
    if value is not None:
        _plain(value, field)


def _cpu_state(value: Any, field: str) -> None:
    size = torch.get_rng_state().numel()
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or tuple(value.shape) != (size,):
        raise _Bad(field, f"is {_show(value)}, not torch's CPU generator state ({size} uint8)")


def _cuda_state(value: Any, field: str) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise _Bad(field, f"is {_show(value)}, not a CUDA generator state (uint8)")


def _python_state(value: Any, field: str) -> None:
    internal = value[1] if isinstance(value, (list, tuple)) and len(value) == 3 else None
    if (internal is None or type(value[0]) is not int or value[0] != random.Random.VERSION
            or not isinstance(internal, (list, tuple)) or len(internal) != 625
            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32 for x in internal)
            or internal[-1] > 624 or not (value[2] is None or type(value[2]) is float)):
        raise _Bad(field, f"is {_show(value)}, not Python's random state (random.getstate())")


def _numpy_state(value: Any, field: str) -> None:
    ok = isinstance(value, (list, tuple)) and len(value) == 5
    if ok:
        kind, keys, pos, has_gauss, cached = value
        ok = (type(kind) is str and kind == "MT19937" and isinstance(keys, torch.Tensor)
              and tuple(keys.shape) == (624,) and not keys.is_floating_point()
              and bool(((keys >= 0) & (keys < 2**32)).all()) and type(pos) is int and 0 <= pos <= 624
              and type(has_gauss) is int and has_gauss in (0, 1) and type(cached) is float)
    if not ok:
        raise _Bad(field, f"is {_show(value)}, not NumPy's random state")


def _rng(required: tuple[str, ...]) -> Check:
    """The RNG states a worker saves (flodl_hf.training.checkpoints._rng_state)."""
    def check(value: Any, field: str) -> None:
        if not isinstance(value, dict):
            raise _Bad(field, f"is {_show(value)}, not the RNG states (a dict with 'torch' and 'python')")
        _fields(value, {"torch": _cpu_state, "cuda": _cuda_state, "python": _python_state, "numpy": _numpy_state},
                required, field + ".")
    return check


def _behind(value: Any, field: str) -> None:
    if not isinstance(value, dict) or not {"share", "start"} <= value.keys():
        raise _Bad(field, f"is {_show(value)}, not a dict with 'share' and 'start'")
    _number(value["share"], f"{field}.share")
    _tensor_list(value["start"], f"{field}.start")


def _worker(required: tuple[str, ...], strict: bool) -> Check:
    """A worker's states; ``strict`` (a resume's read): the RNG states whole, as a resume sets them."""
    checks = {"rng": _rng(("torch", "python") if strict else ()), "batches": _int(), "optimizer": _optimizer(),
              "scheduler": _dict_or_none, "scaler": _kind(dict), "carried": _tensor_list, "behind": _behind}

    def check(value: Any, field: str) -> None:
        if not isinstance(value, dict):
            raise _Bad(field, f"is {_show(value)}, not a dict of this worker's states")
        _fields(value, checks, required, field + ".")
    return check


def _el_che(value: Any, field: str) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or not {"anchor", "counts", "ms_per_batch"} <= value.keys():
        raise _Bad(field, f"is {_show(value)}, not None or a dict with 'anchor', 'counts' and 'ms_per_batch'")
    _int(1)(value["anchor"], f"{field}.anchor")
    for name, item in (("counts", _int(0)), ("ms_per_batch", None)):
        seq = value[name]
        if not isinstance(seq, (list, tuple)) or not seq:
            raise _Bad(f"{field}.{name}", f"is {_show(seq)}, not a list with one entry per worker")
        for i, entry in enumerate(seq):
            if item is not None:
                item(entry, f"{field}.{name}[{i}]")
            elif entry is not None:
                _number(entry, f"{field}.{name}[{i}]")


def _shards_name(value: Any, field: str) -> None:
    """``sharded``: None, or the name of the DCP directory beside the main file (a name, never a path)."""
    if value is not None and (not isinstance(value, str) or not _SHARDS_RE.match(value)):
        raise _Bad(field, f"is {_show(value)}, not None or a shard directory's name (step-XXXXXXXX.dcp)")


_MAIN: dict[str, Check] = {
    "model": _tensors, "config": _config, "source": _kind(str, none=True), "lora": _dict_or_none,
    "step": _int(), "epoch": _int(), "position": _int(), "samples": _int(), "train_time": _number,
    "seed": _int(None), "batch_size": _int(1, none=True), "world_size": _int(1), "sync": _choice(*SYNCS),
    "batching": _choice("fixed", "length"), "max_tokens": _int(1, none=True), "data_size": _int(1),
    "shuffle": _kind(bool), "gradient_accumulation_steps": _int(1), "precision": _choice(None, "bf16", "fp16"),
    "num_items_in_batch": _kind(bool), "el_che": _el_che, "outer": _optimizer(none=True),
    "sharded": _shards_name,
}
# What a resume reads without a default (the others are absent from older checkpoints, or not read).
_MAIN_REQUIRED = ("model", "step", "epoch", "position", "samples", "train_time", "seed", "batch_size",
                  "world_size", "sync", "worker")


def _fields(data: dict, checks: dict[str, Check], required: tuple[str, ...], prefix: str = "") -> None:
    for name in required:
        if name not in data:
            raise _Bad(prefix + name, "is missing")
    for name, check in checks.items():
        if name in data:
            check(data[name], prefix + name)


def _validate(data: dict, kind: str | None) -> None:
    """Raise :class:`_Bad` at the first field of ``data`` that breaks the schema."""
    version = data.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise _Bad("version", f"is {_show(version)}, not a version number")
    if kind == "side":
        _fields(data, {"step": _int(), "worker": _worker((), strict=True)}, ("step", "worker"))
        return
    # A sharded checkpoint (sync="fsdp") keeps the model and the optimizer state in its shard directory.
    owned = () if data.get("sharded") else ("optimizer",)
    checks = {**_MAIN, "worker": _worker(owned, strict=True) if kind == "main" else _worker((), strict=False)}
    _fields(data, checks, _MAIN_REQUIRED if kind == "main" else ())
    size, position = data.get("data_size"), data.get("position")
    if isinstance(size, int) and isinstance(position, int) and position >= size:
        raise _Bad("position", f"is {position}, past the data ({size} samples; a position is within its epoch)")
    el_che, world = data.get("el_che"), data.get("world_size")
    if el_che and isinstance(world, int):
        for name in ("counts", "ms_per_batch"):
            if len(el_che[name]) != world:
                raise _Bad(f"el_che.{name}", f"has {len(el_che[name])} entries for {world} workers (world_size)")


def refuse(path: str | os.PathLike, field: str, problem: str) -> CheckpointFormatError:
    """The error for a field that breaks the schema (also for what a reader checks against its own run)."""
    return CheckpointFormatError(f"{path}: field {field!r} {problem}; this is not a checkpoint as flodl-hf's trainer "
                                 "writes it (edited by hand, or written by another program)")


# Opcodes that import or call (GLOBAL, INST, OBJ, REDUCE, BUILD, NEWOBJ(_EX), STACK_GLOBAL, EXT1/2/4), as
# torch's weights-only unpickler names them when it refuses one ("Unsupported operand N").
_CODE_OPCODES = {ord(c) for c in "ciobR"} | {0x81, 0x82, 0x83, 0x84, 0x92, 0x93}
_ASKS_FOR_CODE = re.compile(r"global|reduce|can only (?:create|build)", re.IGNORECASE)


def _unpickling_error(path: Path, exc: pickle.UnpicklingError) -> CheckpointFormatError:
    """Torch's weights-only loader refused the file: a pickle that asks for code (an import, a call), or
    bytes it does not read at all (truncated, another pickle protocol, not torch.save's)."""
    text = str(exc)
    detail = next((line.strip() for line in text.splitlines() if _ASKS_FOR_CODE.search(line)
                   and "weights_only" not in line), "")
    operand = re.search(r"Unsupported operand (\d+)", text)
    if detail or (operand and int(operand.group(1)) in _CODE_OPCODES):
        named = re.search(r"GLOBAL (\S+)", detail)
        what = f"code ({named.group(1)})" if named else f"code ({detail or operand.group(0)})"
        return CheckpointFormatError(
            f"{path}: refused: its pickle asks for {what}, and it was never unpickled. A trainer checkpoint holds no "
            "objects other than tensors and plain containers, so this file was not written by flodl-hf's trainer; "
            "do not load it with weights_only=False unless you trust whoever wrote it")
    first = next((line.strip() for line in text.splitlines() if "Unsupported" in line or "WeightsUnpickler" in line),
                 text.splitlines()[0] if text else type(exc).__name__)
    return CheckpointFormatError(f"{path}: not a readable trainer checkpoint (truncated, or other bytes than "
                                 f"torch.save writes: {first})")


def read(path: str | os.PathLike, kind: str | None = None) -> dict[str, Any]:
    """A checkpoint file's dict, tensors on the CPU, every known field checked; anything not written by the
    trainer is refused. ``kind``: ``"main"`` or ``"side"`` (a resume's reads: the fields it needs must be
    there), or None (export)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: no such checkpoint file")
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _unpickling_error(path, exc) from exc
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise CheckpointFormatError(f"{path}: not a readable trainer checkpoint ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = sorted(map(str, data))[:20] if isinstance(data, dict) else type(data).__name__
        raise CheckpointFormatError(
            f"{path}: not a flodl-hf trainer checkpoint (no format={FORMAT!r}; found {found}). For a "
            "HuggingFace checkpoint use `flodl-hf export --hub PATH`.")
    version = data.get("version", 0)
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise CheckpointFormatError(f"{path}: checkpoint version {version!r} is newer than this flodl-hf reads "
                                    f"({VERSION}); upgrade flodl-hf")
    try:
        _validate(data, kind)
    except _Bad as bad:
        raise refuse(path, bad.field, bad.problem) from None
    if kind is None and data.get("sharded"):  # export: the whole model, put together from its shards
        from flodl_hf.core.sharded_checkpoint import read_model
        data["model"] = read_model(path.parent / data["sharded"])
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
            raise CheckpointFormatError(f"{path}: model entry {key!r} has a {type(key).__name__} key, not a tensor "
                                        "name")
        if not isinstance(value, torch.Tensor):
            raise CheckpointFormatError(f"{path}: model entry {key!r} is a {type(value).__name__}, not a tensor")
    return config, state
