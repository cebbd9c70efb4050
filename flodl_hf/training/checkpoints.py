"""The Trainer's checkpoints: writing them (worker 0's main file, the other workers' side files), their
rotation, finding and restoring the newest on resume, and the RNG states they carry.

Checkpoint format
-----------------
``checkpoint_dir/step-XXXXXXXX.pt`` (``torch.save``, loadable with ``weights_only=True``),
written by worker 0 to a temporary file and renamed into place. A later point of training with the
same step number (a live El Che window that ends inside the step) is ``step-XXXXXXXX-SAMPLES.pt``::

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
      "el_che": {"anchor": int, "counts": [int], "ms_per_batch": [float | None]} | None,
      "outer": DiLoCo outer SGD state_dict | None,
      "worker": worker 0's {"optimizer", "scheduler", "rng", "batches"[, "scaler"]},  # fp16: GradScaler
      "lora": None | {"config", "base": {"source", "weights_sha256"}, "adapter_only"},  # flodl_hf.lora
    }

A LoRA model (``flodl_hf.lora.add_lora``) whose base was loaded from disk saves only its trainable
tensors under ``"model"``; the base is referenced, and its sha256 checked on resume and export.

With several workers, each other worker first writes ``step-XXXXXXXX.rank-R.pt`` holding
``{"format", "version", "step", "worker": {...}}`` (under DDP without the optimizer and
scheduler, which equal worker 0's); the main file is written last, so its presence means
the set is complete. ``checkpoint_dir`` must be shared by all nodes. The newest main file
is resumed from; ``keep_checkpoints`` sets how many are kept.
"""

from __future__ import annotations

import os
import random
import re
import warnings
from pathlib import Path

import torch
from torch import nn

from flodl_hf import lora
from flodl_hf.core import checkpoint_schema
from flodl_hf.core.errors import CheckpointFormatError
from flodl_hf.training.sync import Plan, TrainerConfigError, TrainerError

__all__ = ["CheckpointsMixin", "latest_checkpoint", "load_checkpoint"]

CHECKPOINT_FORMAT = checkpoint_schema.FORMAT    # flodl_hf.core.checkpoint_schema holds the schema
CHECKPOINT_VERSION = checkpoint_schema.VERSION
_CHECKPOINT_RE = re.compile(r"^step-(\d{8,})(?:-(\d+))?\.pt$")  # step, then the samples of a later point


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
        if self.sync != "ddp" or comm.rank == 0:
            worker["optimizer"] = self.optimizer.state_dict()
            worker["scheduler"] = self.scheduler.state_dict() if self.scheduler is not None else None
            if self._scaler is not None:  # fp16: the loss scale and its growth count
                worker["scaler"] = self._scaler.state_dict()
        if comm.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
        comm.barrier()
        if comm.rank > 0:
            _atomic_save({"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": self.step,
                          "worker": worker}, directory / f"{name}.rank-{comm.rank}.pt")
        comm.barrier()  # every side file is in place before the main file commits the set
        if comm.rank != 0:
            return None
        config = getattr(self.model, "config", None)
        state = {
            "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
            "model": lora.trainer_model_state(self.model),   # a LoRA model: the adapter only
            "lora": lora.trainer_entry(self.model),          # its settings and base (source, sha256), else None
            "config": config.to_dict() if hasattr(config, "to_dict") else None,
            "source": str(getattr(self.model, "source_root", "") or "") or None,  # where it was loaded from
            "step": self.step, "epoch": self.epoch, "position": self.position, "samples": self.samples,
            "train_time": self.train_time, "seed": self.seed, "batch_size": self.batch_size,
            "world_size": comm.world, "sync": self.sync, "batching": self.batching, "max_tokens": self.max_tokens,
            "data_size": len(self.data), "shuffle": self.shuffle,
            "gradient_accumulation_steps": self.accumulation, "precision": self.precision,
            "num_items_in_batch": self._counting,  # a resume whose step counts otherwise scales its losses otherwise
            "el_che": {"anchor": self.plan.anchor, "counts": list(self.plan.counts), "ms_per_batch": self._ms}
            if self.plan is not None else None,
            "outer": self.outer.state_dict() if self.outer is not None else None,
            "worker": worker,
        }
        path = directory / f"{name}.pt"
        _atomic_save(state, path)
        self._log_event("checkpoint", step=self.step, path=str(path))
        # A NaN or inf loss trains on, as in transformers' Trainer; but a checkpoint whose weights are no longer
        # finite never rotates out the last one that was (this run's), so the run can be resumed from before it.
        finite = bool(torch.stack([torch.isfinite(p).all() for p in self.model.parameters()]).all())
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
            for f in directory.glob(f"{old.stem}.*"):
                f.unlink(missing_ok=True)
        return path

    def _check_same_settings(self) -> None:
        """Every worker must be given the same run: a seed, batch size or data of its own would deal
        samples twice or never, or stop one worker's collectives short of the others' (a gloo abort
        that names nothing). Compared once, at the start; every worker raises the same error."""
        if self.comm.world == 1:
            return
        mine = {"seed": self.seed, "batch_size": self.batch_size if self.batch_size is not None else -1,
                "data size": len(self.data), "shuffle": int(bool(self.shuffle)),
                "sync": ("ddp", "el-che", "none").index(self.sync), "epochs": self.epochs or -1,
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
            older = [p.name for p in _checkpoints(self.checkpoint_dir) if p != path]
            raise CheckpointFormatError(f"{exc}. Resuming reads the newest checkpoint: remove {path.name} (and its "
                                        f"step's .rank-*.pt files) to resume from "
                                        f"{older[-1] if older else 'nothing (no older checkpoint)'}, or pass "
                                        "resume=False to start fresh") from exc
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
        if state["world_size"] != world:
            warnings.warn(f"{path}: written by {state['world_size']} workers, resumed by {world}: data position "
                          "is kept, per-worker optimizer and RNG states are not, so the run is not bit-exact")
            worker = {k: v for k, v in worker.items() if k not in ("rng", "carried", "behind")}
            state["el_che"] = None
        elif rank > 0:
            side = path.with_name(f"{path.stem}.rank-{rank}.pt")
            extra = load_checkpoint(side)["worker"]
            worker = {**worker, **extra} if self.sync == "ddp" else extra
        self.resumed_from = path
        return state, worker

    def _restore(self, state: dict, worker: dict) -> None:
        self.epoch, self.position, self.samples = state["epoch"], state["position"], state["samples"]
        self.train_time, self.batches = state["train_time"], worker.get("batches", 0)
        try:
            # torch loads another optimizer's groups without a word and fails at the first step: the
            # groups must carry every setting this optimizer's do.
            lacking = sorted({k for g in self.optimizer.param_groups for k in g}
                             - {k for g in worker["optimizer"].get("param_groups", []) for k in g})
            if lacking:
                raise ValueError(f"its parameter groups lack {', '.join(lacking)}")
            self.optimizer.load_state_dict(worker["optimizer"])
            if self.scheduler is not None and worker.get("scheduler") is not None:
                self.scheduler.load_state_dict(worker["scheduler"])
            if self._scaler is not None and worker.get("scaler") is not None:
                self._scaler.load_state_dict(worker["scaler"])
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise TrainerError(f"{self.resumed_from}: the checkpoint's optimizer or scheduler state does not fit "
                               f"this Trainer's ({type(self.optimizer).__name__}): {type(exc).__name__}: {exc}; "
                               "pass the same optimizer, or resume=False to start fresh") from exc
        if self.outer is not None and state.get("outer") is not None:
            self.outer.load_state_dict(state["outer"])
        if self.plan is not None and state.get("el_che"):
            el = state["el_che"]
            self.plan = Plan(el["anchor"], tuple(el["counts"]))
            self._ms = list(el["ms_per_batch"])
        if self._carried is not None and worker.get("carried") is not None:
            carried = worker["carried"]
            if len(carried) != len(self._carried) or any(c.shape != m.shape for c, m in zip(carried, self._carried)):
                raise TrainerError(f"{self.resumed_from}: the checkpoint's compressed remainder does not fit this model")
            with torch.no_grad():
                for mine, saved in zip(self._carried, carried):
                    mine.copy_(saved)
        if self._ahead and worker.get("behind") is not None:
            behind = worker["behind"]["start"]
            if len(behind) != len(self.trainable) or any(b.shape != p.shape for b, p in zip(behind, self.trainable)):
                raise TrainerError(f"{self.resumed_from}: the checkpoint's last window start does not fit this model")
            self._behind = [b.to(p.device, p.dtype) for b, p in zip(behind, self.trainable)]
            self._ahead_share = float(worker["behind"]["share"])
        if "rng" in worker:
            _set_rng_state(worker["rng"], self.device)
        else:
            _seed_everything(self.seed * 1_000_003 + self.comm.rank + 7919 * state["step"])


def _checkpoints(directory: Path) -> list[Path]:
    found = [((int(m.group(1)), int(m.group(2) or -1)), p) for p in directory.glob("step-*.pt")
             if (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory`` (``step-XXXXXXXX.pt``), or None."""
    directory = Path(directory)
    found = _checkpoints(directory) if directory.is_dir() else []
    return found[-1] if found else None


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Read a trainer checkpoint (see the module docstring for its keys); tensors land on the CPU."""
    path = Path(path)
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointFormatError(f"{path}: no trainer checkpoint (step-XXXXXXXX.pt) in this directory")
        path = found
    return checkpoint_schema.read(path)  # the one reader, shared with export --checkpoint


def _atomic_save(obj: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (a full disk) leaves nothing behind
        raise


_RANK_FILE_RE = re.compile(r"^step-\d{8,}(?:-\d+)?\.rank-\d+\.pt$")


def _remove_checkpoints(directory: Path) -> list[str]:
    """Remove the trainer's checkpoint sets (main and rank files, by their names only) from ``directory``;
    return the removed names, oldest first. Nothing else in the directory is touched."""
    if not directory.is_dir():
        return []
    mains = [p.name for p in _checkpoints(directory)]
    sides = sorted(p.name for p in directory.glob("step-*.pt") if _RANK_FILE_RE.match(p.name))
    for name in sides + mains:
        (directory / name).unlink(missing_ok=True)
    return sides + mains


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
