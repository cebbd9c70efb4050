"""The Trainer's checkpoints: writing them (worker 0's main file, the other workers' side files), their
rotation, finding and restoring the newest on resume, and the RNG states they carry.

Checkpoint format
-----------------
``checkpoint_dir/step-XXXXXXXX.pt`` (``torch.save``, loadable with ``weights_only=True``),
written by worker 0 to a temporary file (``.step-XXXXXXXX.pt.tmp-HOST-PID``) and renamed into place. A later
point of training with the same step number (a live El Che window that ends inside the step) is
``step-XXXXXXXX-SAMPLES.pt``::

    {
      "format": "flodl-hf/trainer-checkpoint", "version": 1,
      "model": state_dict of the unwrapped model (CPU tensors, the model's own keys),
      "config": model.config.to_dict() if the model has one, else None,
      "source": the directory the model was loaded from (load_model), else None,
      "step": int, "epoch": int, "position": int,   # samples of the epoch already dealt
      "samples": int,                               # samples trained on, all workers
      "train_time": float,                          # seconds, evaluation excluded
      "seed": int, "batch_size": int | None, "world_size": int, "sync": str,
      "batching": "fixed" | "length", "max_tokens": int | None,
      "gradient_accumulation_steps": int, "precision": None | "bf16" | "fp16",  # absent: 1, None
      "num_items_in_batch": bool,                   # step takes the step's count of label items (absent: unknown)
      "el_che": {"anchor": int, "counts": [int], "ms_per_batch": [float | None],
                 "cadence": {...Cadence's fields}, "asked": {...ElChe's fields}} | None,
      "outer": DiLoCo outer SGD state_dict | None,
      "worker": worker 0's {"optimizer", "scheduler", "rng", "batches"[, "scaler"]},  # fp16: GradScaler
      "lora": None | {"config", "base": {"source", "weights_sha256"}, "adapter_only"},  # flodl_hf.lora
      "sharded": None | "step-XXXXXXXX.dcp",        # sync="fsdp": model and optimizer in that directory
    }

Under ``sync="fsdp"`` every worker writes its shards of the model and the optimizer state into
``step-XXXXXXXX.dcp/`` (``torch.distributed.checkpoint``) before the main file, whose ``"model"`` is then
empty and whose ``worker`` has no optimizer (:mod:`flodl_hf.training.sync.fsdp`).

A LoRA model (``flodl_hf.lora.add_lora``) whose base was loaded from disk saves only its trainable
tensors under ``"model"``; the base is referenced, and its sha256 checked on resume and export.

With several workers, each other worker first writes ``step-XXXXXXXX.rank-R.pt`` holding
``{"format", "version", "step", "worker": {...}}`` (under DDP without the optimizer and
scheduler, which equal worker 0's); the main file is written last, so its presence means
the set is complete. ``checkpoint_dir`` must be shared by all nodes. The newest main file
is resumed from; ``keep_checkpoints`` sets how many are kept.

The trainer's files are known by their exact names, and only regular files: rotation and ``resume=False``
remove those and nothing else (a user's ``step-00000001.pt.bak`` stays, a directory named like a checkpoint is
neither removed nor resumed from). A temporary that a killed write left is removed by the next start, when its
host is this one and its process is gone. Every read goes through :func:`flodl_hf.core.checkpoint_schema.read`
(each field checked), and a resume checks the rest against its own run (:meth:`CheckpointsMixin._check_point`,
:meth:`CheckpointsMixin._check_states`). A full disk is a :class:`CheckpointWriteError` naming the file.
"""

from __future__ import annotations

import dataclasses
import errno
import inspect
import math
import os
import random
import re
import socket
import stat
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flodl_hf import lora
from flodl_hf.core import checkpoint_schema
from flodl_hf.core.errors import CheckpointFormatError, CheckpointWriteError
from flodl_hf.core.io import pid_alive
from flodl_hf.training.sync import Plan, TrainerConfigError, TrainerError
from flodl_hf.training.sync.choice import plain
from flodl_hf.training.sync.fsdp import clear_shards, load_shards, save_shards

__all__ = ["CheckpointsMixin", "latest_checkpoint", "load_checkpoint"]

CHECKPOINT_FORMAT = checkpoint_schema.FORMAT    # flodl_hf.core.checkpoint_schema holds the schema
CHECKPOINT_VERSION = checkpoint_schema.VERSION
_CHECKPOINT_RE = re.compile(r"^step-(\d{8,})(?:-(\d+))?\.pt$")  # step, then the samples of a later point
_RANK_FILE_RE = re.compile(r"^(step-\d{8,}(?:-\d+)?)\.rank-\d+\.pt$")  # a worker's side file: its main's stem


class CheckpointsMixin:
    """:class:`~flodl_hf.training.trainer.Trainer`'s checkpoints: written at its checkpoint points, read back
    on resume. Its run state is the Trainer's (set in ``_setup``)."""

    def save_checkpoint(self) -> Path | None:
        """Write the checkpoint for the current step (every worker calls it); worker 0 returns its path."""
        point = (self.epoch, self.position)
        if self.checkpoint_dir is None or self._saved_at == point:
            return None
        # Live El Che windows end anywhere inside a step of ``global_batch`` samples, so the last
        # window can share its step number with the checkpoint before it: that later point gets a
        # name of its own (the samples seen added), never an overwrite of a set already complete.
        name = f"step-{self.step:08d}" + (f"-{self.samples}" if self._saved_step == self.step else "")
        self._saved_at, self._saved_step = point, self.step
        comm, directory = self.comm, self.checkpoint_dir
        worker = {"rng": _rng_state(self.device), "batches": self.batches}
        if self._carried is not None:
            worker["carried"] = [c.clone() for c in self._carried]  # this worker's own, like its optimizer
        if self._behind is not None:  # extrapolate: the last window's start and the lead's share of its move
            worker["behind"] = {"share": self._ahead_share, "start": [b.clone() for b in self._behind]}
        sharded = self.sync == "fsdp"  # the model and the optimizer state go to the shard directory
        if self.sync not in ("ddp", "fsdp") or comm.rank == 0:
            if not sharded:
                worker["optimizer"] = self.optimizer.state_dict()
            worker["scheduler"] = self.scheduler.state_dict() if self.scheduler is not None else None
            if self._scaler is not None:  # fp16: the loss scale and its growth count
                worker["scaler"] = self._scaler.state_dict()
        shards = directory / f"{name}.dcp"
        if comm.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            if sharded:
                clear_shards(shards)  # what a killed write of this name left: its main file never came
        comm.barrier()
        if sharded:
            save_shards(self.model, self.optimizer, shards, bool((lora.trainer_entry(self.model) or {})
                                                                 .get("adapter_only")))
            finite = not comm.any_flag(not _finite(self.model))  # every worker's shards
        if comm.rank > 0:
            _atomic_save({"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": self.step,
                          "worker": worker}, directory / f"{name}.rank-{comm.rank}.pt")
        comm.barrier()  # every side file is in place before the main file commits the set
        if comm.rank != 0:
            return None
        config = getattr(self.model, "config", None)
        state = {
            "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
            "model": {} if sharded else lora.trainer_model_state(self.model),  # a LoRA model: the adapter only
            "sharded": shards.name if sharded else None,     # sync="fsdp": the model and optimizer's shards
            "lora": lora.trainer_entry(self.model),          # its settings and base (source, sha256), else None
            "config": config.to_dict() if hasattr(config, "to_dict") else None,
            "source": str(getattr(self.model, "source_root", "") or "") or None,  # where it was loaded from
            "step": self.step, "epoch": self.epoch, "position": self.position, "samples": self.samples,
            "train_time": self.train_time, "seed": self.seed, "batch_size": self.batch_size,
            "world_size": comm.world, "sync": self.sync, "batching": self.batching, "max_tokens": self.max_tokens,
            "data_size": len(self.data), "shuffle": self.shuffle,
            "gradient_accumulation_steps": self.accumulation, "precision": self.precision,
            "num_items_in_batch": self._counting,  # a resume whose step counts otherwise scales its losses otherwise
            "el_che": {"anchor": self.plan.anchor, "counts": list(self.plan.counts), "ms_per_batch": self._ms,
                       # the choices made for this run and what was asked: a resume asked the same keeps them
                       "cadence": plain(dataclasses.asdict(self.el_che)), "asked": self._el_che_record["asked"]}
            if self.plan is not None else None,
            "outer": self.outer.state_dict() if self.outer is not None else None,
            "worker": worker,
        }
        path = directory / f"{name}.pt"
        _atomic_save(state, path)
        self._log_event("checkpoint", step=self.step, path=str(path))
        # A NaN or inf loss trains on, as in transformers' Trainer; but a checkpoint whose weights are no longer
        # finite never rotates out the last one that was (this run's), so the run can be resumed from before it.
        if not sharded:
            finite = _finite(self.model)
        if finite:
            self._last_finite = path
        else:
            kept = (f"{self._last_finite.name}, the last checkpoint with finite weights, is kept (not rotated out)"
                    if self._last_finite is not None else "no checkpoint of this run has finite weights")
            warnings.warn(f"step {self.step}: the model's weights are not finite (a NaN or inf loss or gradient) in "
                          f"{path.name}; {kept}", RuntimeWarning, stacklevel=2)
        for old in _checkpoints(directory)[:-self.keep_checkpoints]:
            if old == self._last_finite and not finite:
                continue
            for f in _checkpoint_set(old):  # its exact names only; the main file first, so that a stop
                _remove(f)  # halfway never leaves a main file without its side files
        return path

    def _check_same_settings(self) -> None:
        """Every worker must be given the same run: a seed, batch size or data of its own would deal
        samples twice or never, or stop one worker's collectives short of the others' (a gloo abort
        that names nothing). Compared once, at the start; every worker raises the same error."""
        if self.comm.world == 1:
            return
        mine = {"seed": self.seed, "batch_size": self.batch_size if self.batch_size is not None else -1,
                "data size": len(self.data), "shuffle": int(bool(self.shuffle)),
                "sync": ("ddp", "el-che", "none", "fsdp").index(self.sync), "epochs": self.epochs or -1,
                "max_steps": self.max_steps or -1, "max_tokens": self.max_tokens or -1,
                "batching": ("fixed", "length").index(self.batching),
                "gradient_accumulation_steps": self.accumulation,
                "precision": (None, "bf16", "fp16").index(self.precision),
                "step taking num_items_in_batch": int(self._counting),
                "average_tokens_across_devices": int(self.average_tokens_across_devices)}
        rows = self.comm.gather_floats([float(v) for v in mine.values()]).tolist()
        for i, name in enumerate(mine):
            values = [row[i] for row in rows]
            if len(set(values)) > 1:
                shown = ", ".join(f"worker {r}: {int(v)}" for r, v in enumerate(values))
                raise TrainerConfigError(f"{name} differs between the workers ({shown}): give every worker "
                                         "the same Trainer arguments and data")

    def _find_resume(self) -> tuple[dict, dict] | None:
        if self.checkpoint_dir is None or not self.resume:
            return None
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return None
        try:
            state = load_checkpoint(path)
        except CheckpointFormatError as exc:  # the resume names the way on: an older set, or a fresh start
            raise self._way_on(exc, path) from exc
        for key, mine, old in (("batch_size", self.batch_size, None), ("sync", self.sync, None),
                               ("seed", self.seed, None), ("batching", self.batching, "fixed"),
                               ("max_tokens", self.max_tokens, None), ("data_size", len(self.data), len(self.data)),
                               ("shuffle", self.shuffle, self.shuffle),  # (data_size on: older checkpoints lack them)
                               ("gradient_accumulation_steps", self.accumulation, 1),
                               ("precision", self.precision, None),
                               ("num_items_in_batch", self._counting, self._counting)):  # older: not recorded
            if state.get(key, old) != mine:
                if key == "num_items_in_batch":
                    raise TrainerError(f"{path}: checkpoint was written by a step that "
                                       f"{'takes' if state[key] else 'does not take'} num_items_in_batch, and this "
                                       f"Trainer's step {'does' if mine else 'does not'}: the losses would be scaled "
                                       "another way from here on. Give step the same signature, or resume=False to "
                                       "start fresh")
                raise TrainerError(f"{path}: checkpoint has {key}={state.get(key)!r} but this Trainer has "
                                   f"{key}={mine!r}; pass the same value, or resume=False to start fresh")
        worker = state["worker"]
        rank, world = self.comm.rank, self.comm.world
        try:
            self._check_point(state, path)
            if state["world_size"] != world:
                warnings.warn(f"{path}: written by {state['world_size']} workers, resumed by {world}: data position "
                              "is kept, per-worker optimizer and RNG states are not, so the run is not bit-exact")
                worker = {k: v for k, v in worker.items() if k not in ("rng", "carried", "behind")}
                state["el_che"] = None
            elif rank > 0:
                side = path.with_name(f"{path.stem}.rank-{rank}.pt")
                extra = load_checkpoint(side, kind="side")
                if extra["step"] != state["step"]:
                    raise checkpoint_schema.refuse(side, "step", f"is {extra['step']}, but {path.name}'s is "
                                                   f"{state['step']}: the two files are not one set")
                worker = {**worker, **extra["worker"]} if self.sync in ("ddp", "fsdp") else extra["worker"]
                if "optimizer" not in worker and not state.get("sharded"):
                    raise checkpoint_schema.refuse(side, "worker.optimizer", "is missing")
        except CheckpointFormatError as exc:
            raise self._way_on(exc, path) from exc
        self.resumed_from = path
        return state, worker

    def _way_on(self, exc: CheckpointFormatError, path: Path) -> CheckpointFormatError:
        """``exc`` with the way on: the older checkpoint a resume would take once ``path`` is removed, or a
        fresh start."""
        older = [p.name for p in _checkpoints(self.checkpoint_dir) if p != path]
        return CheckpointFormatError(f"{exc}. Resuming reads the newest checkpoint: remove {path.name} (and its "
                                     f"step's .rank-*.pt files) to resume from "
                                     f"{older[-1] if older else 'nothing (no older checkpoint)'}, or pass "
                                     "resume=False to start fresh")

    def _check_point(self, state: dict, path: Path) -> None:
        """The checkpoint's point of training must be one of this run's: its position inside an epoch of this
        data, and (the same workers: the same steps) its step the one its epoch and position make."""
        unit = "batches" if self._batches is not None else "samples"
        if state["position"] >= self._units:
            raise checkpoint_schema.refuse(path, "position", f"is {state['position']}, past the data (an epoch is "
                                           f"{self._units} {unit}, and a position lies inside one)")
        if state["world_size"] == self.comm.world:
            step = state["epoch"] * self.steps_per_epoch + math.ceil(state["position"] / self.global_batch)
            if state["step"] != step:
                raise checkpoint_schema.refuse(path, "step", f"is {state['step']}, but epoch {state['epoch']} and "
                                               f"position {state['position']} are step {step} ({self.steps_per_epoch} "
                                               "steps an epoch)")

    def _load_shards(self, state: dict) -> None:
        """Resume ``sync="fsdp"``: the checkpoint's shards into the (sharded) model and its optimizer, on any
        number of workers."""
        path = self.resumed_from
        if state.get("sync") != "fsdp":
            raise checkpoint_schema.refuse(path, "sharded", f"is set, but the checkpoint's sync is "
                                           f"{state.get('sync')!r}")
        adapter_only = bool((lora.checkpoint_entry(state, path) or {}).get("adapter_only"))
        if adapter_only != bool((lora.trainer_entry(self.model) or {}).get("adapter_only")):
            held = "only a LoRA adapter" if adapter_only else "a whole model"
            raise TrainerError(f"{path}: the checkpoint holds {held}, and this model is "
                               f"{'not ' if adapter_only else ''}a LoRA model on a base from disk; pass the model it "
                               "was trained from, or resume=False to start fresh")
        from torch.distributed.checkpoint.api import CheckpointException
        try:
            load_shards(self.model, self.optimizer, path.parent / state["sharded"], adapter_only)
        except CheckpointFormatError as exc:
            raise self._way_on(exc, path) from exc
        except (RuntimeError, ValueError, KeyError, CheckpointException) as exc:  # (DCP's is a BaseException)
            raise TrainerError(f"{path}: its shards ({state['sharded']}) do not fit this model and optimizer: "
                               f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; pass the same "
                               "model and optimizer, or resume=False to start fresh") from exc

    def _restore(self, state: dict, worker: dict) -> None:
        path = self.resumed_from
        if state.get("sharded"):  # the optimizer came with the shards (_load_shards); checked as its own
            worker = {**worker, "optimizer": self.optimizer.state_dict()}
        try:
            self._check_states(state, worker)
        except CheckpointFormatError as exc:
            raise self._way_on(exc, path) from exc
        self.epoch, self.position, self.samples = state["epoch"], state["position"], state["samples"]
        self.train_time, self.batches = state["train_time"], worker.get("batches", 0)
        try:
            # torch loads another optimizer's groups without a word and fails at the first step: the
            # groups must carry every setting this optimizer's do.
            lacking = sorted({k for g in self.optimizer.param_groups for k in g}
                             - {k for g in worker["optimizer"].get("param_groups", []) for k in g})
            if lacking:
                raise ValueError(f"its parameter groups lack {', '.join(lacking)}")
            if not state.get("sharded"):  # (sharded: read into the optimizer already, in place)
                self.optimizer.load_state_dict(worker["optimizer"])
            if self.scheduler is not None and worker.get("scheduler") is not None:
                self.scheduler.load_state_dict(worker["scheduler"])
            if self._scaler is not None and worker.get("scaler") is not None:
                self._scaler.load_state_dict(worker["scaler"])
            if self.outer is not None and state.get("outer") is not None:
                self.outer.load_state_dict(state["outer"])
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise TrainerError(f"{path}: the checkpoint's optimizer or scheduler state does not fit "
                               f"this Trainer's ({type(self.optimizer).__name__}): {type(exc).__name__}: {exc}; "
                               "pass the same optimizer, or resume=False to start fresh") from exc
        if self.plan is not None and state.get("el_che"):
            el = state["el_che"]
            self.plan = Plan(el["anchor"], tuple(el["counts"]))
            self._ms = list(el["ms_per_batch"])
        if self._carried is not None and worker.get("carried") is not None:
            carried = worker["carried"]
            if len(carried) != len(self._carried) or any(c.shape != m.shape for c, m in zip(carried, self._carried)):
                raise TrainerError(f"{path}: the checkpoint's compressed remainder does not fit this model")
            with torch.no_grad():
                for mine, saved in zip(self._carried, carried):
                    mine.copy_(saved)
        if self._ahead and worker.get("behind") is not None:
            behind = worker["behind"]["start"]
            if len(behind) != len(self.trainable) or any(b.shape != p.shape for b, p in zip(behind, self.trainable)):
                raise TrainerError(f"{path}: the checkpoint's last window start does not fit this model")
            self._behind = [b.to(p.device, p.dtype) for b, p in zip(behind, self.trainable)]
            self._ahead_share = float(worker["behind"]["share"])
        if "rng" in worker:
            try:
                _set_rng_state(worker["rng"], self.device)
            except (ValueError, TypeError, RuntimeError) as exc:
                raise self._way_on(checkpoint_schema.refuse(path, "worker.rng", f"is not a state this machine's "
                                                            f"generators take ({exc})"), path) from exc
        else:
            _seed_everything(self.seed * 1_000_003 + self.comm.rank + 7919 * state["step"])

    def _check_states(self, state: dict, worker: dict) -> None:
        """What the schema cannot know alone: the optimizer, scheduler, scaler and outer states hold the same kinds
        of value as this Trainer's own (torch loads a string learning rate or a wrong-shaped moment without a word,
        and fails at the first step), and each parameter's moments its shape."""
        path, saved = self.resumed_from, worker["optimizer"]
        mine = self.optimizer.state_dict()
        if len(saved["param_groups"]) == len(mine["param_groups"]):  # (other groups: torch refuses, below)
            for i, (a, b) in enumerate(zip(saved["param_groups"], mine["param_groups"])):
                _same_kinds({k: v for k, v in a.items() if k != "params"}, b,
                            f"worker.optimizer.param_groups[{i}]", path)
        groups, own = saved["param_groups"], self.optimizer.param_groups
        if [len(g["params"]) for g in groups] == [len(g["params"]) for g in own]:  # (else torch refuses, below)
            cls = type(self.optimizer)
            made = [_one_step_states(cls, group, mine, path, i) for i, (group, mine) in enumerate(zip(groups, own))]
            alike: dict[int, tuple[str, dict]] = {}  # without a probe step: the first state of each rank seen
            for group, own_group, probe in zip(groups, own, made):
                for index, param in zip(group["params"], own_group["params"]):
                    self._check_param_state(saved["state"].get(index, {}), index, param, probe, alike)
        for field, theirs, ours in (("worker.scheduler", worker.get("scheduler"), self.scheduler),
                                    ("worker.scaler", worker.get("scaler"), self._scaler),
                                    ("outer", state.get("outer"), self.outer)):
            if theirs is not None and ours is not None:
                _same_kinds(theirs, ours.state_dict(), field, path)

    def _check_param_state(self, entry: dict, index: int, param: torch.Tensor, probe: dict[int, dict] | None,
                           alike: dict[int, tuple[str, dict]]) -> None:
        """One parameter's optimizer state holds what a step of this optimizer makes for a parameter of its rank
        (``probe``; without one, what the first state of that rank holds: Adafactor's differ by rank), a count for
        ``step``, and its moments in the parameter's shape; a state that lacks an entry or holds None where a tensor
        belongs loads without a word and fails at the next step."""
        if not entry:
            return  # no state yet: torch makes it at the next step
        path = self.resumed_from
        kinds = {key: _kind_of(value) for key, value in entry.items()}
        if probe is not None and param.dim() in probe:
            where, theirs = f"a step of {type(self.optimizer).__name__} makes", probe[param.dim()]
        else:
            first, theirs = alike.setdefault(param.dim(), (f"parameter {index}'s is", kinds))
            where = first
        for key in sorted(kinds.keys() | theirs.keys()):
            if kinds.get(key, "missing") != theirs.get(key, "missing"):
                raise checkpoint_schema.refuse(path, f"worker.optimizer.state[{index}].{key}",
                                               f"is {_a(kinds.get(key, 'missing'))}, where {where} "
                                               f"{_a(theirs.get(key, 'missing'))} (a parameter of rank {param.dim()})")
        for key, value in entry.items():
            field = f"worker.optimizer.state[{index}].{key}"
            if key == "step" and (_kind_of(value) != "number" or not 0 <= float(value) < math.inf):
                raise checkpoint_schema.refuse(path, field, f"is {checkpoint_schema._show(value)}, not a count")
            if key in _PARAM_SHAPED and value is not None and (
                    not isinstance(value, torch.Tensor) or value.shape != param.shape):
                raise checkpoint_schema.refuse(path, field, f"is {checkpoint_schema._show(value)}, but its "
                                               f"parameter has shape {tuple(param.shape)}")


def _regular(path: Path) -> bool:
    """A regular file itself (not a directory, not a link): what the trainer writes."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _checkpoints(directory: Path) -> list[Path]:
    """The main checkpoint files in ``directory``, oldest first: regular files named exactly
    ``step-XXXXXXXX[-SAMPLES].pt``; anything else (a directory, a link, another name) is not the trainer's."""
    found = [((int(m.group(1)), int(m.group(2) or -1)), p) for p in directory.glob("step-*.pt")
             if (m := _CHECKPOINT_RE.match(p.name)) and _regular(p)]
    return [p for _, p in sorted(found)]


def _checkpoint_set(main: Path) -> list[Path]:
    """A checkpoint's files by their exact names: the main file, then its workers' ``.rank-R.pt`` files, then its
    shard directory (``sync="fsdp"``)."""
    sides = sorted(p for p in main.parent.glob(f"{main.stem}.rank-*.pt")
                   if (m := _RANK_FILE_RE.match(p.name)) and m.group(1) == main.stem and _regular(p))
    shards = main.with_name(f"{main.stem}.dcp")
    return [main, *sides, *([shards] if shards.is_dir() and not shards.is_symlink() else [])]


def _remove(path: Path) -> None:
    """Remove one of a checkpoint set's files, or its shard directory."""
    if path.suffix == ".dcp":
        clear_shards(path)
    else:
        path.unlink(missing_ok=True)


def _finite(model: nn.Module) -> bool:
    """Whether this worker's parameters (its shards of a sharded model) are all finite."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return bool(torch.stack([torch.isfinite(p).all() for p in local]).all()) if local else True


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory`` (``step-XXXXXXXX.pt``), or None."""
    directory = Path(directory)
    found = _checkpoints(directory) if directory.is_dir() else []
    return found[-1] if found else None


def load_checkpoint(path: str | os.PathLike, kind: str = "main") -> dict:
    """Read a trainer checkpoint (see the module docstring for its keys); tensors land on the CPU. Every field is
    checked (:mod:`flodl_hf.core.checkpoint_schema`, with the ``lora`` entry); ``kind="side"`` reads another
    worker's ``.rank-R.pt`` file. Anything else is a CheckpointFormatError naming the file and the field."""
    path = Path(path)
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointFormatError(f"{path}: no trainer checkpoint (step-XXXXXXXX.pt) in this directory")
        path = found
    state = checkpoint_schema.read(path, kind)  # the one reader, shared with export --checkpoint
    if kind == "main":
        lora.checkpoint_entry(state, path)
    return state


# ---- writing, and what a killed write leaves -------------------------------------------------------

# A write goes to ``.NAME.tmp-HOST-PID`` beside NAME (the host: a shared checkpoint_dir sees several), then is
# renamed into place. A temporary whose writer is gone (a kill) is removed by the next start (every worker
# settles its own host's); ``.NAME.tmp-PID`` is what flodl-hf wrote before the host was named.
_TEMP_RE = re.compile(r"^\.(step-\d{8,}(?:-\d+)?(?:\.rank-\d+)?\.pt)\.tmp-(?:(?P<host>[A-Za-z0-9._-]+)-)?(?P<pid>\d+)$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{_host()}-{os.getpid()}")


def _remove_stale_temporaries(directory: Path) -> list[str]:
    """Remove the temporaries that killed checkpoint writes of this host left in ``directory``: regular files
    named exactly as :func:`_atomic_save` names them, whose writer (the pid) is gone or is this process, which
    writes nothing yet. Returns their names; nothing else is touched (another host's, a live writer's)."""
    if not directory.is_dir():
        return []
    host, removed = _host(), []
    for entry in sorted(directory.glob(".step-*.tmp-*")):
        m = _TEMP_RE.match(entry.name)
        if not m or m["host"] not in (None, host) or not _regular(entry):
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or not pid_alive(pid):
            entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed


def _disk_full(exc: BaseException) -> str | None:
    """What says the disk filled up in a failed write (its chain of exceptions), or None: an OSError ENOSPC or
    EDQUOT, or torch's zip writer stopping short (``unexpected pos``), which is what it raises when a write of
    its own fails."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            return os.strerror(exc.errno)
        exc = exc.__cause__ or exc.__context__
    return None


def _atomic_save(obj: dict, path: Path) -> None:
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)  # a failed write (a full disk) leaves nothing behind
        full = _disk_full(exc)
        if full is None and isinstance(exc, RuntimeError) and "unexpected pos" in str(exc):
            full = f"the write stopped short ({str(exc).strip()})"
        if full is None:
            raise
        error = CheckpointWriteError(f"{path}: cannot write this checkpoint, the disk is full ({full}). Nothing of "
                                     f"it was kept, and the earlier checkpoints in {path.parent} are intact: free "
                                     "space there (or give another checkpoint_dir) and run again to resume from the "
                                     "newest")
        error.errno = errno.ENOSPC  # (strerror and filename left unset: they would replace the message)
        raise error from exc


def _remove_checkpoints(directory: Path) -> list[str]:
    """Remove the trainer's checkpoint sets (main and rank files, regular files by their exact names only)
    from ``directory``; return the removed names, oldest first. Nothing else in the directory is touched."""
    if not directory.is_dir():
        return []
    mains = [p.name for p in _checkpoints(directory)]
    sides = sorted(p.name for p in directory.glob("step-*.pt") if _RANK_FILE_RE.match(p.name) and _regular(p))
    shards = sorted(p.name for p in directory.glob("step-*.dcp") if checkpoint_schema._SHARDS_RE.match(p.name)
                    and p.is_dir() and not p.is_symlink())
    for name in mains + sides + shards:
        _remove(directory / name)
    return shards + sides + mains


# ---- what the schema cannot know alone: the kinds of value this Trainer's own states hold ----------------

# Optimizer state entries that torch keeps per parameter, in its shape (SGD, Adam(W), Adamax, NAdam, RAdam,
# RMSprop, Adagrad, Adadelta, Rprop, ASGD): a moment of another shape loads, and fails at the first step.
_PARAM_SHAPED = frozenset({"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "square_avg",
                           "grad_avg", "acc_delta", "sum", "prev", "step_size", "ax"})


def _kind_of(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
        return "number"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (list, tuple)):
        return "list"
    return "dict" if isinstance(value, dict) else type(value).__name__


def _one_step_states(cls: type, group: dict, own: dict, path: Path, i: int) -> dict[int, dict] | None:
    """What one step of the optimizer's class makes of a saved group's settings (``group``), on tiny probes, one per
    rank of this Trainer's group ``own``: the kinds of value its state then holds, per rank. Torch checks settings
    when it builds an optimizer (a negative learning rate, a beta of 2) and when it steps (``capturable`` on the
    CPU), not when it loads a state_dict: where the saved settings fail and this Trainer's own do not, the
    checkpoint is refused. None where no probe steps at all (a step that needs a closure or sparse gradients)."""
    try:
        takes = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    except (TypeError, ValueError):
        return None
    made = _probe(cls, {k: v for k, v in group.items() if k in takes}, own["params"])
    if not isinstance(made, Exception):
        return made
    if isinstance(_probe(cls, {k: v for k, v in own.items() if k in takes}, own["params"]), Exception):
        return None
    raise checkpoint_schema.refuse(path, f"worker.optimizer.param_groups[{i}]", f"holds settings that "
                                   f"{cls.__name__} fails on ({type(made).__name__}: {made})") from made


def _probe(cls: type, settings: dict, params: list[torch.Tensor]) -> dict[int, dict] | Exception:
    """Build ``cls`` with ``settings`` on zero probes shaped like ``params``' ranks and step it once on zero
    gradients; the kinds of its state per rank, or what it raised."""
    like = params[0] if params else torch.zeros(())
    probes = {p.dim(): torch.zeros((2,) * p.dim(), dtype=like.dtype, device=like.device, requires_grad=True)
              for p in params}
    try:
        optimizer = cls(list(probes.values()), **settings)
        for probe in probes.values():
            probe.grad = torch.zeros_like(probe)
        optimizer.step()
    except Exception as exc:  # torch's own code on tiny probes: whatever it raises, that step fails
        return exc
    return {rank: {k: _kind_of(v) for k, v in optimizer.state[probe].items()} for rank, probe in probes.items()}


def _a(kind: str | None) -> str:
    return "missing" if kind == "missing" else "None" if kind is None else f"a {kind}"


def _same_kinds(saved: Any, mine: Any, field: str, path: Path) -> None:
    """``saved`` (a checkpoint's) holds the same kinds of value as ``mine`` (this Trainer's own state_dict) where
    has one: numbers where numbers are, lists of the same length, and so on down. Where this Trainer's is None
    (made on first use, or left to torch to choose), anything goes."""
    theirs, ours = _kind_of(saved), _kind_of(mine)
    if ours is None:
        return
    if theirs != ours:
        raise checkpoint_schema.refuse(path, field, f"is {checkpoint_schema._show(saved)}, where this Trainer's "
                                       f"holds a {ours}")
    if theirs == "list":
        if len(saved) != len(mine):
            raise checkpoint_schema.refuse(path, field, f"has {len(saved)} entries, this Trainer's {len(mine)}")
        for i, (a, b) in enumerate(zip(saved, mine)):
            _same_kinds(a, b, f"{field}[{i}]", path)
    elif theirs == "dict":
        for key in saved.keys() & mine.keys():
            _same_kinds(saved[key], mine[key], f"{field}.{key}", path)


def _check_model_fits(model: nn.Module, state: dict, path: Path | None) -> None:
    """Resume: a full checkpoint's ``model`` must hold this model's keys with its shapes, checked before
    any tensor is copied (``load_state_dict`` copies what fits before it reports what does not)."""
    if (lora.checkpoint_entry(state, path) or {}).get("adapter_only"):
        return  # flodl_hf.lora checks the adapter against the model
    mine, saved = model.state_dict(), state["model"]
    problems = [f"missing {k}" for k in mine if k not in saved][:3]
    problems += [f"unexpected {k}" for k in saved if k not in mine][:3]
    problems += [f"{k}: {tuple(saved[k].shape)} in the checkpoint, {tuple(v.shape)} in the model"
                 for k, v in mine.items() if k in saved and tuple(saved[k].shape) != tuple(v.shape)][:3]
    if problems:
        raise TrainerError(f"{path}: the checkpoint does not fit this model ({'; '.join(problems)}); "
                           "pass the model it was trained from, or resume=False to start fresh")


# ---- random number generators ------------------------------------------------------------------

def _seed_everything(seed: int) -> None:
    seed %= 2**63
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
