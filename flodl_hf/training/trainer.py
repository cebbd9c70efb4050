"""Fine-tuning with one step closure, from one CPU to many uneven workers.

The user writes ``step(model, batch) -> loss``; :class:`Trainer` owns the rest: the loop,
backward, clipping, optimizer and scheduler steps, device placement, data sharding,
synchronisation, evaluation, checkpoints and the record of the run. The same script runs
as one process or as N processes under ``torchrun`` (or ``flodl-hf train --workers N``).

Synchronisation (``sync=``)
    ``"ddp"``     DistributedDataParallel: gradients all-reduced every step; with
                  ``balance=True`` each step's samples are split by the workers' measured speeds,
                  and each worker's loss weighted by its share (the step's mean gradient).
    ``"el-che"``  local SGD paced by the slowest worker (:class:`~flodl_hf.training.sync.ElChe`);
                  parameters averaged by samples at the end of each window, optionally
                  followed by an outer optimizer (``outer=DiLoCo(...)``).
    ``"none"``    no synchronisation (one process, or independent workers on their shards).

Steps. One step is ``world_size * batch_size * gradient_accumulation_steps`` samples of the
epoch, as one DDP step takes: ``steps_per_epoch = ceil(len(data) / (world_size * batch_size * k))``
and ``max_steps`` is the same amount of data whatever ``sync`` is. With
``gradient_accumulation_steps=k`` (DDP, none) each worker runs the closure on k micro-batches of
``batch_size``, each loss divided by the step's count of them before backward (transformers'
rule; the epoch's last step may hold fewer), then one optimizer and scheduler step; under DDP
the first k-1 run in ``no_sync()``. Under El Che a worker's optimizer (and scheduler) steps once
per local batch, so a fast worker takes more of them than a slow one.

Token-weighted losses. A closure ``step(model, batch, num_items_in_batch)`` gets the optimizer step's
count of label items, counted as transformers' Trainer counts it (``_get_num_items_in_batch``: a batch's
``shift_labels``, else ``labels[..., 1:]`` where the model's loss shifts labels, else ``labels``; the
entries that are not -100), from the step's micro-batches collated first; or ``count_items(batch)``. Its
loss is then not divided by k; under DDP with ``average_tokens_across_devices`` (the default, as
transformers') the count is summed over the workers and each loss multiplied by the world size, so the
step's gradient is that of the exact token mean of the global step.

Precision (``precision="bf16"`` or ``"fp16"``). The closure (and ``eval_fn``) runs under
``torch.autocast``; parameters, gradients and optimizer state stay float32. fp16 scales the loss
with ``torch.amp.GradScaler``: gradients unscaled before clipping, an overflowing step skipped
(the scheduler with it), the scaler's state in the checkpoint.

Data. Each epoch is ``torch.randperm(len(data))`` from a generator seeded by ``(seed, epoch)``
(``shuffle=False``: in order). A step or window deals the next stretch of that order to the
workers, in rank order, each its share (DDP: one batch each; El Che: the plan's batches;
El Che with ``windows="live"``: one batch at a time to whichever worker claims it next).
The last window of an epoch is clamped to what remains, so no sample is skipped or repeated;
under DDP a worker left without a sample at the tail repeats the epoch's first one.

Padding-free batches (``batching="length", max_tokens=N``). :func:`length_batches` cuts the
data, sorted by length, into batches of at most ``N`` padded tokens, once per run; each epoch
shuffles their order with ``(seed, epoch)``. The unit of dealing is then a batch: a DDP step is
one batch per worker, an El Che window the plan's count of batches per worker (averaged by the
samples they hold), ``steps_per_epoch = ceil(batches / world_size)`` and ``position`` counts batches.

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

Record of the run
-----------------
In ``log_dir`` (default: ``checkpoint_dir``), worker 0 writes the record tree
(:mod:`flodl_hf.training.records`): ``records.jsonl`` (the root rollup, plus ``start``, ``eval``,
``checkpoint`` and ``end`` events), ``host-<name>/records.jsonl`` and
``host-<name>/rank-<r>/records.jsonl``, one line per log point or El Che window, from the
numbers every worker sends in the window's all-gather; and at the end ``run.html``, the whole
tree in one page (:mod:`flodl_hf.training.report`). ``portal=True`` serves it live (:mod:`flodl_hf.training.portal`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from flodl_hf.training.sync import (NEST_GAP, Comm, DiLoCo, ElChe, OuterOptimizer, Plan, TrainerConfigError,
                                    TrainerError, WorkerLostError, blocks, deal, inner_candidates, live_overrun_ms,
                                    nest_tiers, plan_window, probe_tiers, split_by_speed)
from flodl_hf.core import checkpoint_schema
from flodl_hf.training import embedding_grads
from flodl_hf import lora
from flodl_hf.core.errors import CheckpointFormatError, InputError
from flodl_hf.core.validate import file_above

__all__ = ["Trainer", "ElChe", "DiLoCo", "TrainerError", "TrainerConfigError", "WorkerLostError",
           "length_batches", "latest_checkpoint", "load_checkpoint", "launch"]

CHECKPOINT_FORMAT = checkpoint_schema.FORMAT    # flodl_hf.core.checkpoint_schema holds the schema
CHECKPOINT_VERSION = checkpoint_schema.VERSION
_CHECKPOINT_RE = re.compile(r"^step-(\d{8,})(?:-(\d+))?\.pt$")  # step, then the samples of a later point

StepFn = Callable[[nn.Module, Any], Any]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class Trainer:
    """Train ``model`` with the user's ``step(model, batch)`` closure.

    ``optimizer`` is a factory over parameters (``lambda ps: torch.optim.AdamW(ps, lr=2e-5)``)
    and ``scheduler`` one over the optimizer, so each worker builds its own. ``data`` is any
    sized, indexable collection; ``collate_fn`` turns a list of its items into a batch
    (default: ``torch.utils.data.default_collate``). ``batch_size`` is per worker.
    ``eval_fn(model)`` runs on worker 0 in eval mode without gradients and returns a number or
    a dict of numbers; ``stop_when(metrics)`` may end the run after an evaluation.
    ``sync`` is ``"ddp"``, ``"el-che"`` (or an :class:`ElChe`), or ``"none"``; ``outer`` a
    :class:`DiLoCo` for El Che; ``balance=True`` splits DDP steps by the workers' speeds. ``timeout``
    (seconds) bounds every collective when the trainer starts the process group itself (from
    torchrun's environment), and the silence of worker 0's heartbeat while the others wait for its
    evaluation, which may take any time. ``portal=True`` (or a port)
    serves the run's record live from worker 0 while it trains (:mod:`flodl_hf.training.portal`).
    ``gradient_accumulation_steps`` (transformers' name) makes each optimizer step take that many
    micro-batches of ``batch_size`` per worker; ``precision="bf16"|"fp16"`` runs the closure under
    ``torch.autocast`` (fp16 with a ``GradScaler``), as transformers' ``bf16=True``/``fp16=True``.
    A ``step(model, batch, num_items_in_batch)`` gets the step's count of label items (transformers' rule,
    or ``count_items(batch)`` per micro-batch) and its loss is not divided by the micro-batches;
    ``average_tokens_across_devices`` sums the count over DDP workers (see the module docstring).
    """

    def __init__(self, model: nn.Module, step: StepFn, optimizer: OptimizerFactory, data: Sequence, *,
                 batch_size: int | None = None, epochs: int | None = None, max_steps: int | None = None,
                 scheduler: SchedulerFactory | None = None, eval_fn: Callable[[nn.Module], Any] | None = None,
                 eval_every: int | None = None, sync: str | ElChe = "ddp", outer: DiLoCo | None = None,
                 checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
                 keep_checkpoints: int = 2, resume: bool = True, seed: int = 0, shuffle: bool = True,
                 collate_fn: Callable[[list], Any] | None = None, grad_clip: float | None = None,
                 device: str | torch.device | None = None, log_dir: str | os.PathLike | None = None,
                 log_every: int = 10, progress: bool = True, report: bool = True, tensorboard: bool = False,
                 stop_when: Callable[[dict], bool] | None = None, timeout: float = 300.0,
                 verify_sync: bool = False, portal: bool | int = False, batching: str = "fixed",
                 max_tokens: int | None = None, lengths: Sequence[int] | None = None,
                 balance: bool = False, gradient_accumulation_steps: int = 1,
                 precision: str | None = None, count_items: Callable[[Any], Any] | None = None,
                 average_tokens_across_devices: bool = True) -> None:
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise TrainerConfigError("data must be sized and indexable (a list, a map-style Dataset); "
                                     f"got {type(data).__name__}")
        if len(data) == 0:
            raise TrainerConfigError("data is empty")
        if batch_size is None and batching != "length":
            raise TrainerConfigError("give batch_size= (per worker), or batching='length' with max_tokens=")
        if epochs is None and max_steps is None:
            raise TrainerConfigError("give epochs= or max_steps= (or both: the run stops at the first)")
        for name, value in (("batch_size", batch_size), ("epochs", epochs), ("max_steps", max_steps),
                            ("eval_every", eval_every), ("checkpoint_every", checkpoint_every),
                            ("log_every", log_every), ("keep_checkpoints", keep_checkpoints)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise TrainerConfigError(f"{name} must be a positive int, got {value!r}")
        k = gradient_accumulation_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise TrainerConfigError(f"gradient_accumulation_steps must be an int >= 1 (micro-batches per optimizer "
                                     f"step), got {k!r}")
        if precision not in (None, "bf16", "fp16"):
            raise TrainerConfigError(f"precision must be None (float32), 'bf16' or 'fp16', got {precision!r}")
        if isinstance(sync, str):
            if sync not in ("ddp", "el-che", "none"):
                raise TrainerConfigError(f"sync must be 'ddp', 'el-che', 'none' or an ElChe, got {sync!r}")
            el_che = ElChe() if sync == "el-che" else None
        elif isinstance(sync, ElChe):
            el_che, sync = sync, "el-che"
        else:
            raise TrainerConfigError(f"sync must be 'ddp', 'el-che', 'none' or an ElChe, got {type(sync).__name__}")
        if balance and (sync != "ddp" or batching != "fixed"):
            raise TrainerConfigError("balance=True splits each DDP step's samples by the workers' speeds: it "
                                     f"needs sync='ddp' and batching='fixed' (got sync={sync!r}, "
                                     f"batching={batching!r})")
        self.balance = bool(balance)
        # El Che's windows plan, time and claim the batch as the unit of a worker's optimizer step, and its
        # syncs combine what those steps did: accumulation would change every one of those units.
        if k > 1 and sync == "el-che":
            raise TrainerConfigError(f"gradient_accumulation_steps={k} does not go with sync='el-che': a window's "
                                     "batches are already its workers' steps between syncs; raise batch_size or "
                                     "ElChe(anchor=...) instead, or use sync='ddp'")
        # fp16's loss scale skips the steps whose gradients overflow; El Che's windows (and the lead's step on
        # the others' gradients) count and combine steps that would then not have happened.
        if precision == "fp16" and sync == "el-che":
            raise TrainerConfigError("precision='fp16' does not go with sync='el-che' (its gradient scaler skips "
                                     "overflowing steps that the windows count and combine); use precision='bf16', "
                                     "which needs no scaler")
        self.accumulation, self.precision = k, precision
        # A step(model, batch, num_items_in_batch) gets the optimizer step's count of label items and its loss
        # is taken as already divided by it (transformers' model_accepts_loss_kwargs, loss_is_scaled_for_ga).
        self._counting = _takes_num_items(step)
        if count_items is not None and not callable(count_items):
            raise TrainerConfigError(f"count_items must be a function batch -> count, got {type(count_items).__name__}")
        if count_items is not None and not self._counting:
            raise TrainerConfigError("count_items= counts num_items_in_batch for a step that takes it: give step a "
                                     "num_items_in_batch parameter (step(model, batch, num_items_in_batch))")
        if not isinstance(average_tokens_across_devices, bool):
            raise TrainerConfigError(f"average_tokens_across_devices must be a bool, got "
                                     f"{average_tokens_across_devices!r}")
        self.count_items, self.average_tokens_across_devices = count_items, average_tokens_across_devices
        if outer is not None and sync != "el-che":
            raise TrainerConfigError("outer=DiLoCo(...) averages windows: it needs sync='el-che'")
        if outer is not None and el_che.combine == "lead":
            raise TrainerConfigError("ElChe(combine='lead') does not go with outer=DiLoCo(...): the lead's "
                                     "optimizer already takes the others' work as steps")
        if outer is not None and el_che.overlap:
            raise TrainerConfigError("ElChe(overlap=True) does not go with outer=DiLoCo(...): the outer step "
                                     "needs the window's combined change at the window's end")
        if batching not in ("fixed", "length"):
            raise TrainerConfigError(f"batching must be 'fixed' or 'length', got {batching!r}")
        if batching == "length":
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise TrainerConfigError(f"batching='length' needs max_tokens, a positive int; got {max_tokens!r}")
            lengths = list(lengths) if lengths is not None else [_item_length(data, i) for i in range(len(data))]
            if len(lengths) != len(data) or any(not isinstance(n, int) or n < 1 for n in lengths):
                raise TrainerConfigError(f"lengths must hold one positive int per item of data ({len(data)})")
        elif max_tokens is not None or lengths is not None:
            raise TrainerConfigError("max_tokens= and lengths= are for batching='length'")
        self.batching, self.max_tokens, self.lengths = batching, max_tokens, lengths
        if checkpoint_every is not None and checkpoint_dir is None:
            raise TrainerConfigError("checkpoint_every needs checkpoint_dir")
        if eval_fn is None and (eval_every is not None or stop_when is not None):
            raise TrainerConfigError(f"{'eval_every' if eval_every is not None else 'stop_when'} needs eval_fn "
                                     "(the evaluation it acts on)")
        if grad_clip is not None and (isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float))
                                      or not math.isfinite(grad_clip) or grad_clip < 0):
            raise TrainerConfigError(f"grad_clip must be a positive number (the gradients' max norm), or None or 0 "
                                     f"for no clipping; got {grad_clip!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TrainerConfigError(f"seed must be an int, got {seed!r}")
        for name, where in (("checkpoint_dir", checkpoint_dir), ("log_dir", log_dir)):
            if where is not None and Path(where).exists() and not Path(where).is_dir():
                raise TrainerConfigError(f"{name} {where} exists and is not a directory")
            above = file_above(where) if where is not None else None
            if above is not None:
                raise TrainerConfigError(f"{name} {where}: {above} is a file, not a directory")
        self.model, self.step_fn, self.optimizer_factory, self.data = model, step, optimizer, data
        self.batch_size, self.epochs, self.max_steps = batch_size, epochs, max_steps
        self.scheduler_factory, self.eval_fn, self.eval_every = scheduler, eval_fn, eval_every
        self.sync, self.el_che, self.outer_cfg = sync, el_che, outer
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every, self.keep_checkpoints, self.resume = checkpoint_every, keep_checkpoints, resume
        self._last_finite: Path | None = None  # this run's newest checkpoint with finite weights
        self.seed, self.shuffle, self.device_arg = seed, shuffle, device
        self.grad_clip = grad_clip or None  # 0: no clipping, as transformers' max_grad_norm=0
        self.collate_fn = collate_fn or torch.utils.data.default_collate
        log_dir = log_dir if log_dir is not None else checkpoint_dir
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.log_every, self.progress, self.report, self.tensorboard = log_every, progress, report, tensorboard
        self.stop_when, self.timeout, self.verify_sync = stop_when, timeout, verify_sync
        if portal is not False and self.log_dir is None:
            raise TrainerConfigError("portal= serves the run's records: it needs log_dir (or checkpoint_dir)")
        # True: the default port; an int: that port (0: any free one). The URL is printed.
        self.portal = None if portal is False else (8765 if portal is True else int(portal))
        # Run state, set in fit(); saved in checkpoints.
        self.epoch = self.position = self.samples = self.batches = 0
        self.train_time = 0.0
        self.resumed_from: Path | None = None
        self._fitted = False
        self.history: list[dict] = []   # rolled-up records (every worker; eval records on worker 0)
        self.records: list[dict] = []   # this worker's records

    # ---- public ------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Steps done: whole epochs, plus this epoch's dealt samples in units of one DDP step."""
        return self.epoch * self.steps_per_epoch + math.ceil(self.position / self.global_batch)

    def fit(self) -> dict:
        """Train until ``epochs`` or ``max_steps`` (or ``stop_when``); return a summary. Once per
        Trainer: to train on, build a new one on the same ``checkpoint_dir`` (it resumes)."""
        if self._fitted:
            raise TrainerError("fit() already ran on this Trainer; build a new Trainer to train again "
                               "(on the same checkpoint_dir it resumes where this one ended)")
        self._fitted = True
        self.comm, self.device = Comm.connect(self.device_arg, self.timeout)
        try:
            self._setup()
            self._log_event("start", **self._describe())
            # The CPU embeddings' gradient tables are kept between steps (embedding_grads: the same bits,
            # no fresh zeroed table a step); not under DDP, whose reducer holds the gradients it averages.
            with embedding_grads.reused(self.model, enabled=self.device.type == "cpu" and self.wrapped is self.model):
                if self.sync == "el-che":
                    self._run_windows()
                else:
                    self._run_steps()
            summary = self._finish()
            self._release_groups()
        except BaseException as exc:
            if getattr(self, "_log", None) is not None and self._log.tree is not None:
                self._log.tree.event({"event": "end", "step": self.step, "status": "lost",
                                      "error": f"{type(exc).__name__}: {exc}"})
            raise
        finally:
            if getattr(self, "_bar", None) is not None:
                self._bar.close()
            if getattr(self, "_log", None) is not None:
                self._log.close()
            if getattr(self, "_portal", None) is not None:
                self._portal.stop()
        self.comm.close()
        return summary

    # ---- setup -------------------------------------------------------------------------------
    def _setup(self) -> None:
        comm = self.comm
        if self.sync == "ddp" and comm.world > 1 and not comm.same_device_type:
            raise TrainerConfigError("sync='ddp' needs every worker on the same kind of device; "
                                     "a cohort mixing CPU and GPU workers can use sync='el-che'")
        if self.batching == "length":
            # The unit of dealing is a batch: one per worker per DDP step, the plan's counts per window.
            self._batches = length_batches(self.lengths, self.max_tokens, self.seed, max_size=self.batch_size)
            self._units, self._unit_batch = len(self._batches), 1
        else:
            self._batches, self._units, self._unit_batch = None, len(self.data), self.batch_size
        self._check_same_settings()
        # One step: every worker's ``gradient_accumulation_steps`` micro-batches, one optimizer step.
        self.global_batch = comm.world * self._unit_batch * self.accumulation
        self.steps_per_epoch = math.ceil(self._units / self.global_batch)
        ends = []
        if self.epochs is not None:
            ends.append((self.epochs, 0))
        if self.max_steps is not None:
            ends.append((self.max_steps // self.steps_per_epoch,
                         self.max_steps % self.steps_per_epoch * self.global_batch))
        self.end = min(ends)
        self.total_steps = self.end[0] * self.steps_per_epoch + math.ceil(self.end[1] / self.global_batch)

        self.model.to(self.device)
        self.model.train()
        self._acc_dtype = torch.float32 if self.device.type == "mps" else torch.float64  # MPS has no float64
        # precision: the closure runs under autocast; weights, gradients and the optimizer stay float32.
        self._amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        self._scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        # num_items_in_batch: whether labels are counted shifted (a causal LM's), and whether the count is summed
        # over the workers with each loss times the world size (DDP averages the gradients), as transformers does.
        self._shifts = _loss_shifts_labels(self.model)
        self._across = self.sync == "ddp" and comm.world > 1 and self.average_tokens_across_devices
        if self._counting and (self.accumulation > 1 or self._across):
            ignored = _ignores_num_items(self.model)
            if ignored is not None and comm.rank == 0:
                warnings.warn(f"step takes num_items_in_batch, so its loss is taken as already divided by the step's "
                              f"count (not divided by gradient_accumulation_steps"
                              f"{', and multiplied by the world size' if self._across else ''}); but {ignored} "
                              "ignores num_items_in_batch, as transformers' head does, so a loss it returns stays a "
                              "mean and its gradients grow with that factor (transformers' Trainer does the same). "
                              "Drop num_items_in_batch from step, or compute the loss from it in step",
                              stacklevel=3)
        self._float_buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        self.plan = Plan(self.el_che.anchor, (self.el_che.anchor,) * comm.world) if self.el_che else None
        self._ms: list[float | None] = [None] * comm.world
        # Live windows deal batches from a counter on the store (ElChe.windows): no plan, no probe.
        self._live = self.el_che is not None and self.el_che.windows == "live" and comm.world > 1
        if self._live and isinstance(self.el_che.nested, tuple) and \
                sorted(sum(self.el_che.nested, ())) != list(range(comm.world)):
            raise TrainerConfigError(f"ElChe nested={self.el_che.nested!r}: the tiers must hold every rank "
                                     f"0..{comm.world - 1} once")
        self._eval_waits = False  # the other workers wait for worker 0's evaluations on the store
        if comm.world > 1:
            # Live windows' counters and evaluations' heartbeats on the store are named after this fit, from
            # worker 0's clock: a store that outlives the fit (a torchrun restart, fits in a row) never mixes
            # them up. The others wait for an evaluation where every worker evaluates at the same points.
            rows = comm.gather_floats([time.time_ns() % 2**52, self.eval_fn is not None, self.eval_every or 0])
            self._run_key = str(int(rows[0, 0]))
            self._eval_waits = bool((rows[:, 1:] == rows[0, 1:]).all()) and self.eval_fn is not None
            if not self._eval_waits and bool(rows[0, 1]) and comm.rank == 0:
                warnings.warn("eval_fn (or eval_every) differs between the workers: the others wait for worker "
                              "0's evaluations in their next collective, so each must fit in `timeout`; give "
                              "every worker the same eval_fn and eval_every for a wait of any length")
        self._sync_ema: float | None = None
        # combine="lead", on the lead: how long after the slowest's expected end (by the smoothed speeds
        # and the window's anchor) the others' gradients land, seconds (live windows: it trains on until
        # then; None: not measured yet). Measured from that end, not the window's start, so it holds when
        # the anchor changes: an 8-batch window's gradients land later than a 2-batch one's.
        self._landing: float | None = None
        self._expected_end: float | None = None  # this live window's slowest expected end (perf_counter)
        # balance=True: each worker's samples a second (an average over steps, the same on every worker),
        # when its gradients were last ready (the DDP hook's stamp) and its last optimizer step's seconds.
        self._rates: list[float] | None = None
        self._ready_at, self._opt_s = None, 0.0
        # Nested windows (ElChe.nested): (inner ranks, outer ranks) once decided, the inner tier's Comm
        # (None on an outer worker) and the inner window's start; this window's inner syncs and their ms.
        self._tiers_decided, self._tiers, self._inner, self._inner_start = False, None, None, None
        self._inner_syncs, self._inner_ms, self._inner_samples = 0, 0.0, 0
        # An evaluation at an inner sync: its stop_when answer (shared at the outer sync), its seconds.
        self._stop_pending, self._window_eval_s = False, 0.0
        self._claimed = [0, 0]  # units and samples claimed in this (inner) live window
        # nested=True in a small cohort: every candidate inner tier's process group, made now by all,
        # so the tiers can be found inside the first window while the slowest is still in its batch.
        self._candidates: dict[tuple[int, ...], Comm | None] = {}
        if self._live and self.el_che.nested is True:
            self._candidates = {ranks: comm.subgroup(ranks) for ranks in inner_candidates(comm.world)}

        if self.checkpoint_dir is not None and not self.resume and comm.rank == 0:
            # A fresh run in a directory holding an earlier run's checkpoints: they go, as its records
            # do, or pruning (by step) would keep them over this run's and a later resume take them.
            removed = _remove_checkpoints(self.checkpoint_dir)
            if removed:
                warnings.warn(f"resume=False: removed {len(removed)} checkpoint file(s) of an earlier run from "
                              f"{self.checkpoint_dir} (newest {removed[-1]})")
        checkpoint = self._find_resume()
        if checkpoint is not None:
            state, worker = checkpoint
            _check_model_fits(self.model, state, self.resumed_from)  # before any tensor is copied
            try:
                lora.load_trainer_state(self.model, state, str(self.resumed_from))  # LoRA: the adapter only
            except RuntimeError as exc:
                raise TrainerError(f"{self.resumed_from}: the checkpoint does not fit this model: {exc}") from exc
        if self.sync == "ddp" and comm.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.wrapped: nn.Module = nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
            if self.balance:
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
                self._allreduce_hook = allreduce_hook
                self.wrapped.register_comm_hook(None, self._stamp_ready)
        else:
            self.wrapped = self.model
            # Workers start from worker 0's weights (DDP does this itself).
            comm.broadcast_(list(self.model.parameters()) + list(self.model.buffers()))
        params = [p for p in self.wrapped.parameters() if p.requires_grad]
        if not params:
            raise TrainerConfigError(f"model: {type(self.model).__name__} has no parameter that requires grad")
        self.optimizer = self.optimizer_factory(params)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TrainerConfigError(f"optimizer(params) must return a torch.optim.Optimizer, got "
                                     f"{type(self.optimizer).__name__}")
        self.scheduler = self.scheduler_factory(self.optimizer) if self.scheduler_factory else None
        self.outer = OuterOptimizer(self.trainable, self.outer_cfg) if self.outer_cfg else None
        # combine="sum" adds each worker's change to the window's shared start, and compress="bf16" sends
        # changes whatever the combine: DiLoCo's start when there is an outer step, else a copy of its
        # own; None when the sync sends the parameters themselves.
        el_che = self.el_che if comm.world > 1 else None
        changes = el_che is not None and (el_che.combine == "sum" or el_che.compress is not None or el_che.overlap)
        self._start = None if not changes else (
            self.outer.start if self.outer is not None else [p.detach().clone() for p in self.trainable])
        # What bfloat16 did not carry of this worker's changes yet (ElChe.compress), sent with the next.
        self._carried = ([torch.zeros_like(p, dtype=torch.float32) for p in self.trainable]
                         if el_che is not None and el_che.compress is not None else None)
        # ElChe(combine="lead", extrapolate=True), on the others: the last window's start, and the share
        # of the last window's move the lead makes before it steps on their gradients (set at each sync).
        self._ahead = el_che is not None and el_che.combine == "lead" and el_che.extrapolate and comm.rank > 0
        self._behind: list[torch.Tensor] | None = None
        self._moving = None  # combine="lead", on the lead: the others' gradients on their way (posted receives)
        self._sent = None  # combine="lead", on the lead: its parameters still on their way to the others
        self._ahead_share = 1.0
        if checkpoint is not None:
            self._restore(state, worker)
        else:
            _seed_everything(self.seed * 1_000_003 + comm.rank)
        # ElChe(overlap=True): the shared point (the same bits on every worker), this worker's change of
        # the window just ended (what it sends), and the all-reduce left running (PendingWindow).
        overlap = el_che is not None and el_che.overlap
        self._anchor = [p.detach().clone() for p in self.trainable] if overlap else None
        self._delta = [torch.empty_like(p) for p in self.trainable] if overlap else None
        self._pending = None
        # ElChe(combine="lead"): worker 0 holds the optimizer, the others send it gradients.
        self._lead, self._lead_warned = el_che is not None and el_che.combine == "lead", False
        from flodl_hf.training.records import Resources, decode_name, encode_name, host_names, local_identity
        host, node = local_identity()
        ids = comm.gather_floats([float(node), *encode_name(host)])  # the tree's host names, once
        hosts = host_names([(decode_name(row[1:]), int(row[0])) for row in ids.tolist()])
        self._resources = Resources(self.device)
        resumed_at = (self.step, self.train_time) if self.resumed_from else None  # records after it are dropped
        self._log = _RunLog(self.log_dir, comm.rank, hosts, self.tensorboard, truncate_after=resumed_at)
        self._portal = None
        if self.portal is not None and comm.rank == 0:
            from flodl_hf.training.portal import start_portal
            try:
                self._portal = start_portal(self.log_dir, port=self.portal)
                print(f"flodl-hf portal: {self._portal.url}", flush=True)
            except InputError as exc:  # a busy port must not stop the run (the other workers would wait)
                warnings.warn(f"portal not started: {exc}; training goes on, `flodl-hf portal {self.log_dir}` "
                              "serves the run from another shell")
        self._bar = None
        if self.progress and comm.rank == 0:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=self.total_steps, initial=self.step, unit="step", desc="train",
                             dynamic_ncols=True)
        self._stop = False
        self._saved_step = self.step if self.resumed_from else -1  # the last checkpoint's step number
        self._saved_at = (self.epoch, self.position) if self.resumed_from else None  # and its point
        self._evaluated_at: tuple[int, int] | None = None  # (epoch, position) of the last evaluation
        self._eval_s = 0.0
        self._fit_start = time.perf_counter()
        self._perm_epoch, self._perm = -1, None
        if self._live and isinstance(self.el_che.nested, tuple):  # tiers named by the user: nested at once
            self._set_tiers(self.el_che.nested)

    def _describe(self) -> dict:
        return {"sync": self.sync, "world_size": self.comm.world, "batch_size": self.batch_size,
                "batching": self.batching, "max_tokens": self.max_tokens,
                "batches_per_epoch": self._units if self._batches is not None else None,
                "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps, "balance": self.balance,
                "gradient_accumulation_steps": self.accumulation, "precision": self.precision,
                "num_items_in_batch": self._counting,  # step takes the step's count of label items
                "samples_per_epoch": len(self.data), "seed": self.seed, "device": str(self.device),
                "el_che": dataclasses.asdict(self.el_che) if self.el_che else None,
                "outer": dataclasses.asdict(self.outer_cfg) if self.outer_cfg else None,
                "resumed_from": str(self.resumed_from) if self.resumed_from else None}

    # ---- data --------------------------------------------------------------------------------
    def _order(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                self._perm = torch.randperm(self._units, generator=gen)
            else:
                self._perm = torch.arange(self._units)
            self._perm_epoch = self.epoch
        return self._perm

    def _remaining(self) -> int:
        """Samples left in this epoch before the run's end."""
        stop = self.end[1] if self.epoch == self.end[0] else self._units
        return stop - self.position

    def _done(self) -> bool:
        return self._stop or (self.epoch, self.position) >= self.end

    def _advance(self, units: int, samples: int | None = None) -> None:
        """Move the epoch's position by ``units`` (samples, or batches under batching='length')."""
        self.position += units
        self.samples += units if samples is None else samples
        if self.position >= self._units:
            self.epoch, self.position = self.epoch + 1, 0

    def _chunks(self, start: int, count: int, split: bool = False) -> list[torch.Tensor]:
        """The index tensors of ``count`` units from ``start`` of this epoch's order: one tensor of
        samples (``split``: cut into batches), or under batching='length' one tensor per batch."""
        order = self._order()[start:start + count]
        if self._batches is not None:
            return [self._batches[int(b)] for b in order]
        if not len(order):
            return []
        return list(order.split(self.batch_size)) if split else [order]

    def _samples_in(self, start: int, count: int) -> int:
        if self._batches is None:
            return count
        return sum(len(self._batches[int(b)]) for b in self._order()[start:start + count])

    def _batch(self, indices: torch.Tensor) -> Any:
        return _to_device(self.collate_fn([self.data[i] for i in indices.tolist()]), self.device)

    # ---- one batch ---------------------------------------------------------------------------
    def _train_batch(self, indices: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        """One batch as one optimizer step (El Che's unit): see :meth:`_train_step`."""
        return self._train_step([indices], [weight])[0]

    def _train_step(self, chunks: Sequence[torch.Tensor], weights: Sequence[float] | None = None) -> list[torch.Tensor]:
        """One optimizer step on the micro-batches ``chunks``: forward and backward for each, the
        gradients accumulated, then clipping, the optimizer and scheduler steps; returns each
        micro-batch's loss to log (as the closure gave it; see :meth:`_counted`).

        Before backward a micro-batch's loss is divided by the step's count of micro-batches, as
        transformers' Trainer divides by ``current_gradient_accumulation_steps`` (the last step of an
        epoch may hold fewer); ``weights`` (``balance=True``) scale it instead. A closure that takes
        ``num_items_in_batch`` gets the step's count instead, and its loss is not divided (:meth:`_counted`).
        Under DDP all but the last micro-batch run in ``no_sync()``, so the gradients are all-reduced once a step."""
        self.optimizer.zero_grad(set_to_none=True)
        count, losses = len(chunks), []
        batches, total, items = self._counted(chunks, weights) if self._counting else ([None] * count, None, None)
        for j, indices in enumerate(chunks):
            weight = 1.0 if weights is None else weights[j]
            divide = count if weights is None else 1
            if total is not None:  # the loss is the step's sum over its items already: no division by k
                weight, divide = (0.0 if weight == 0 else float(self.comm.world) if self._across else 1.0), 1
            quiet = self.wrapped is not self.model and j < count - 1
            try:
                with self.wrapped.no_sync() if quiet else contextlib.nullcontext():
                    loss = self._forward_backward(indices, weight, divide, batches[j], total)
            except RuntimeError as exc:  # DDP all-reduces in backward (and syncs buffers in forward)
                if self.wrapped is not self.model and _collective_failed(exc):
                    raise self.comm.lost("DDP's gradient all-reduce", exc) from exc
                raise
            if total is not None and items[j] > 0:  # logged as the micro-batch's own mean over its items
                loss = loss * (float(total) / items[j])
            losses.append(loss)
            self.batches += 1
        self._optimizer_step()
        return losses

    def _counted(self, chunks: Sequence[torch.Tensor], weights: Sequence[float] | None) -> tuple[list, Any, list]:
        """``num_items_in_batch`` for a step whose closure takes it, as transformers' Trainer counts it
        (``Trainer.get_batch_samples`` and ``_get_num_items_in_batch``, transformers 5.24 trainer.py:2289-2367):
        the step's micro-batches collated first (kept on the host), each counted by :meth:`_count_items`,
        the counts summed over the step and, under DDP with ``average_tokens_across_devices``, over the workers.
        Returns the collated batches, the count (a 0-dim int64 tensor on the device, or None where a batch
        cannot be counted: the loss is then divided by k, as transformers does) and each micro-batch's own count.
        A micro-batch of weight 0 (``balance=True``: a worker without a sample joining DDP's step) counts none."""
        batches = [self.collate_fn([self.data[i] for i in indices.tolist()]) for indices in chunks]
        items = [self._count_items(b) for b in batches]
        known = all(n is not None for n in items)
        items = [0 if not known or (weights is not None and weights[j] == 0) else int(n) for j, n in enumerate(items)]
        total = sum(items) if known else None
        if self._across:  # every worker takes the same path: a worker that cannot count makes all divide by k
            rows = self.comm.gather_floats([-1.0 if total is None else float(total)])[:, 0]
            total = None if bool((rows < 0).any()) else int(rows.sum())
        return batches, (None if total is None else torch.tensor(total, device=self.device)), items

    def _count_items(self, batch: Any) -> int | None:
        """One collated micro-batch's items: ``count_items(batch)`` if given, else transformers' rule (trainer.py:
        2331-2343): a mapping's ``shift_labels`` where it has them, else its ``labels[..., 1:]`` where the
        model's loss shifts labels (a causal LM), else its ``labels``; the entries that are not -100. None
        where the batch has no ``labels`` (not a mapping, or without the key)."""
        if self.count_items is not None:
            n = self.count_items(batch)
        else:
            if not isinstance(batch, Mapping) or "labels" not in batch:
                return None
            labels = batch["shift_labels"] if "shift_labels" in batch else \
                batch["labels"][..., 1:] if self._shifts else batch["labels"]
            try:
                n = labels.ne(-100).sum()
            except (TypeError, AttributeError):
                return None
        if n is None:
            return None
        n = int(n)
        if n < 0:
            raise TrainerConfigError(f"count_items returned {n}: a count of label items must be >= 0")
        return n

    def _closure(self, batch: Any, num_items: torch.Tensor | None = None) -> torch.Tensor:
        """The user's step on ``batch`` (``num_items_in_batch=`` when it takes it); its scalar loss."""
        if self._counting:
            return _loss_of(self.step_fn(self.wrapped, batch, num_items_in_batch=num_items))
        return _loss_of(self.step_fn(self.wrapped, batch))

    def _forward_backward(self, indices: torch.Tensor, weight: float = 1.0, divide: int = 1, batch: Any = None,
                          num_items: torch.Tensor | None = None) -> torch.Tensor:
        """The closure on one batch (``batch``, collated already, or collated here from ``indices``) under the
        run's autocast, and backward on its loss times ``weight`` and divided by ``divide`` (through the fp16
        gradient scaler); returns the loss as given."""
        with self._autocast():
            data = self._batch(indices) if batch is None else _to_device(batch, self.device)
            loss = self._closure(data, num_items)
        scaled = loss if weight == 1.0 else loss * weight
        scaled = scaled if divide == 1 else scaled / divide
        (scaled if self._scaler is None else self._scaler.scale(scaled)).backward()
        return loss.detach()

    def _autocast(self):
        """``precision``'s autocast (bf16, fp16), or nothing for float32."""
        if self._amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._amp_dtype)

    def _optimizer_step(self) -> None:
        """Clipping, the optimizer and scheduler steps, on the gradients in place."""
        if self._sent is not None:  # combine="lead": the parameters the last sync sent are read until they land
            self._land_sent()
        t0 = time.perf_counter()
        scaler = self._scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # the clip sees the true gradients
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.trainable, self.grad_clip)
        stepped = True
        if scaler is None:
            self.optimizer.step()
        else:
            # A step whose gradients overflowed is skipped and the scale lowered; the scheduler then
            # stays where it is, as transformers' Trainer does (accelerate's optimizer_step_was_skipped).
            scale = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            stepped = scaler.get_scale() >= scale
        if self.scheduler is not None and stepped:
            self.scheduler.step()
        self._opt_s = time.perf_counter() - t0

    @torch.no_grad()
    def _look_ahead(self) -> None:
        """``ElChe(combine="lead", extrapolate=True)`` on a worker other than the lead, at a window's
        start: move the parameters (the lead's, from the last sync) on by ``self._ahead_share`` of
        the last window's move, where the lead is expected to be when it steps on this window's
        gradients, and keep the start for the next window. The first window after a fresh start
        has no move to go by."""
        if self._behind is None:
            self._behind = [p.detach().clone() for p in self.trainable]
            return
        for p, before in zip(self.trainable, self._behind):
            # In blocks that stay in cache, the three passes read and write memory once (on the slow
            # worker's path: 38 ms on MiniLM-sized tensors, where whole tensors took 82).
            for now, then in blocks(p.data, before):
                move = torch.sub(now, then)
                then.copy_(now)
                now.add_(move, alpha=self._ahead_share)

    def _grad_batch(self, indices: torch.Tensor, seen: int) -> torch.Tensor:
        """``ElChe(combine="lead")`` on a worker other than the lead: forward and backward only, at
        the window's start, the gradient kept as the window's mean by samples (``seen`` samples
        of the window before this batch); the lead takes it at the window's end."""
        if self._counting:  # one batch, its own count: the loss is its mean (see _counted)
            batches, total, _ = self._counted([indices], None)
            batch = _to_device(batches[0], self.device)
        else:
            batch, total = None, None
        with self._autocast():
            loss = self._closure(self._batch(indices) if batch is None else batch, total)
        n = len(indices)
        if seen == 0:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        else:
            with torch.no_grad():
                for p in self.trainable:
                    if p.grad is not None:
                        p.grad.mul_(seen / (seen + n))
            (loss * (n / (seen + n))).backward()
        self.batches += 1
        return loss.detach()

    def _stamp_ready(self, state, bucket):  # unannotated: DDP checks a hook's annotations at run time
        """DDP's comm hook under ``balance=True``: the plain all-reduce (divided by the world size), and
        the time this worker's last bucket of gradients is ready, its backward's end before any wait for
        the others' buckets: what its speed is measured on."""
        if bucket.is_last():
            self._sync_device()
            self._ready_at = time.perf_counter()
        return self._allreduce_hook(state, bucket)

    def _balanced_sizes(self) -> tuple[int, ...]:
        """This DDP step's samples per worker under ``balance=True``: the step's share of the epoch split
        by the measured rates (evenly until there are some)."""
        total = min(self.global_batch, self._remaining())
        return split_by_speed(self._rates or [1.0] * self.comm.world, total)

    def _measure_rates(self, samples: int, busy_s: float) -> None:
        """Gather every worker's samples and busy seconds of the step just taken (its optimizer step
        before, then collate, forward and backward up to its gradients' readiness) and fold their rates
        into the running average, the same on every worker. A worker without a sample keeps its rate."""
        rows = self.comm.gather_floats([samples, busy_s]).tolist()
        seen = [n / s if n > 0 and s > 0 else None for n, s in rows]
        if self._rates is None:
            if any(r is None for r in seen):
                return
            self._rates = seen
            return
        self._rates = [old if new is None else 0.5 * old + 0.5 * new for old, new in zip(self._rates, seen)]

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- DDP and none: one batch per worker per step -----------------------------------------
    def _run_steps(self) -> None:
        comm = self.comm
        loss_sum = torch.zeros((), dtype=self._acc_dtype, device=self.device)
        acc = self._fresh_acc()
        logged = self.step
        balance = self.balance and comm.world > 1
        k = self.accumulation
        while not self._done():
            # Each worker's share of the step: a stretch of the epoch's order (k micro-batches of
            # batch_size, or k length batches), in rank order; balance=True splits by speed instead.
            sizes = self._balanced_sizes() if balance else deal([k] * comm.world, self._unit_batch, self._remaining())
            start = self.position + sum(sizes[:comm.rank])
            if balance:  # this worker's share, in k micro-batches of near-equal size
                chunks = [c for c in self._chunks(start, sizes[comm.rank])[0].tensor_split(k) if len(c)] \
                    if sizes[comm.rank] else []
            else:
                chunks = self._chunks(start, sizes[comm.rank], split=True)
            if not chunks and self.sync == "ddp":
                chunks = [self._chunks(0, 1)[0][:1]]  # every DDP worker must join the step's all-reduce
            # balance=True: each micro-batch's loss weighted by its share of the step, so that DDP's mean over
            # workers is the mean over the step's samples (a worker without a sample adds nothing). A counted
            # step (num_items_in_batch) needs only the zeros: its losses are shares of the step's count.
            weights = [comm.world * (len(c) if sizes[comm.rank] else 0) / sum(sizes) for c in chunks] \
                if balance else None
            opt_before = self._opt_s
            t0 = time.perf_counter()
            for indices, loss in zip(chunks, self._train_step(chunks, weights) if chunks else []):
                loss_sum += loss.to(self._acc_dtype) * len(indices)
                acc["batches"] += 1
                acc["samples"] += len(indices)
            acc["compute_ms"] += (time.perf_counter() - t0) * 1e3
            if balance:
                self._measure_rates(sizes[comm.rank], opt_before + (self._ready_at or time.perf_counter()) - t0)
            before = self.step
            self._advance(sum(sizes), self._samples_in(self.position, sum(sizes)))
            if self._crossed(before, self.log_every) or self._done():
                self._log_steps(loss_sum, acc)
                loss_sum.zero_()
                acc = self._fresh_acc()
                logged = self.step
            self._after(before)
        if logged != self.step:  # stopped early between log points (every worker alike)
            self._log_steps(loss_sum, acc)
        self._open = None

    def _fresh_acc(self) -> dict:
        self._open = {"batches": 0, "samples": 0, "compute_ms": 0.0, "since": time.perf_counter(),
                      "eval_s": self._eval_s}
        return self._open

    def _train_time_now(self) -> float:
        """Training time up to now: what the log points added, plus the steps since the last one."""
        acc = getattr(self, "_open", None)
        if acc is None:
            return self.train_time
        return self.train_time + time.perf_counter() - acc["since"] - (self._eval_s - acc["eval_s"])

    def _log_steps(self, loss_sum: torch.Tensor, acc: dict) -> None:
        self._sync_device()
        wall = time.perf_counter() - acc["since"] - (self._eval_s - acc["eval_s"])
        self.train_time += wall
        local_loss = loss_sum.item()
        rows = self.comm.gather_floats([acc["batches"], acc["samples"], local_loss, acc["compute_ms"],
                                        *self._resources.sample()])
        mine = {"batches": acc["batches"], "samples": acc["samples"],
                "loss": local_loss / acc["samples"] if acc["samples"] else None,
                "compute_ms": acc["compute_ms"],
                "ms_per_batch": acc["compute_ms"] / acc["batches"] if acc["batches"] else None,
                "samples_per_s": acc["samples"] / wall if wall > 0 else None}
        self._record(mine, rows, wall, {})

    # ---- El Che: windows paced by the slowest worker -----------------------------------------
    def _run_windows(self) -> None:
        comm = self.comm
        # This worker's previous window: its collective (waiting included), its length, and
        # the pause before it (evaluation, checkpoint), reported to all in the next window's row.
        prev = {"collective_ms": 0.0, "window_ms": 0.0, "pause_ms": 0.0, "waited_ms": 0.0}
        pause_ms = 0.0
        first = True  # the first window after (re)starting: warm-up, and no sync measured yet
        # The sync that ended it allocated the sync's buffers: reported in the next window, it is not
        # the sync's time (MiniLM's first took 270 ms where the next took 155, and grew the anchor).
        warm_sync = True
        # A fresh adaptive cohort knows no speeds: its first window is one batch per worker, the
        # cheapest measurement (the fast workers wait for one slow batch, not for ``anchor`` of them).
        live = self._live
        probe = comm.world > 1 and self.el_che.adaptive and not live and all(ms is None for ms in self._ms)
        while not self._done():
            window_start = time.perf_counter()
            self._inner_syncs, self._inner_ms, self._window_eval_s = 0, 0.0, 0.0
            self._waited_ms = 0.0  # the lead's wait for the others' gradients inside the window: idle
            self._window_start = window_start
            if live:
                key = self._window_key = f"flodl-hf/el-che/{self._run_key}/{self.epoch}/{self.position}"
                probing = self._tiers is None and first and self.el_che.nested is True and \
                    not self._tiers_decided and all(ms is None for ms in self._ms)
                in_window = probing and bool(self._candidates)  # tiers found inside this window
                if in_window:
                    chunks = self._probe_chunks(key, window_start)
                elif self._tiers is None:
                    # nested=True splits the cohort on measured speeds: until then a one-batch probe of
                    # the slowest, not a flat window of ``anchor`` of its batches (at 1 : 1/3 : 1/12 with
                    # anchor 4 that window ran 48 + 16 + 4 batches, a whole epoch on the bench's data).
                    chunks = self._live_chunks(key, window_start, anchor=1 if probing else None)
                elif self._inner is not None:  # nested windows: an inner worker
                    chunks = self._nested_chunks(key, window_start)
                else:  # nested windows: an outer worker runs its anchor and no more
                    chunks = self._live_chunks(key, window_start, self._tiers[1], overrun=False)
            else:
                counts = (1,) * comm.world if first and probe else self.plan.counts
                units = deal(counts, self._unit_batch, self._remaining())
                # Samples per worker (the averaging weights), known to all from the shared order.
                sizes = [self._samples_in(self.position + sum(units[:r]), units[r]) for r in range(comm.world)]
                chunks = self._chunks(self.position + sum(units[:comm.rank]), units[comm.rank], split=True)
            loss_sum = torch.zeros((), dtype=self._acc_dtype, device=self.device)
            batches = n = 0
            first_done = None  # when the window's first batch ended: later ones are past warm-up
            follow = self._lead and comm.rank > 0  # combine="lead": gradients only, for the lead
            if self._ahead:
                self._look_ahead()
            if self._lead and comm.rank == 0:  # the others' gradients land while the lead computes
                self._moving = comm.lead_gradients(self.trainable, compress=self._carried is not None)
                if live and comm.plane_device.type == "cpu":
                    # A thread waits for them, so the lead's live window knows when they have landed
                    # (gloo; a NCCL work's wait returns before the data is in, so there the window
                    # ends when the others are done, as in the other combines).
                    self._moving.watch()
            for chunk in chunks:
                loss = self._grad_batch(chunk, n) if follow else self._train_batch(chunk)
                loss_sum += loss.to(self._acc_dtype) * len(chunk)
                batches += 1
                n += len(chunk)
                if first_done is None:
                    self._sync_device()
                    first_done = time.perf_counter()
            self._sync_device()
            end = time.perf_counter()
            # Nested windows' inner syncs, and evaluations at them, are not the batches' time.
            inside = self._inner_ms + self._window_eval_s * 1e3 + self._waited_ms
            compute_ms = (end - window_start) * 1e3 - inside
            steady = (batches - 1, (end - first_done) * 1e3 - inside) if batches > 1 else (0, 0.0)
            local_loss = loss_sum.item()

            t = time.perf_counter()
            # Nested windows with evaluations at inner syncs: the outer tier waits for the inner tier on
            # the store, while worker 0's evaluation beats, not in the outer sync's collective, which
            # would give up after ``timeout``.
            arrival = live and self._eval_waits and self._tiers is not None and 0 in self._tiers[0]
            if arrival and comm.rank == 0:
                comm.arrive(f"{key}/arrived")
            elif arrival and comm.rank in self._tiers[1]:
                comm.wait_for_arrival(f"{key}/arrived", f"{key}/alive",
                                      "waiting for the inner tier (worker 0's evaluation) before the outer sync",
                                      self.timeout)
            weight_n = n
            if live:
                if self._inner is not None:  # nested: the inner tier weighs its samples once, through its first
                    weight_n = self._inner_samples if self._inner.rank == 0 else 0
                # The averaging weights are known only now: one small all-gather (not for "sum").
                sizes = (self.comm.gather_floats([weight_n])[:, 0].int().tolist()
                         if self.el_che.combine == "average" else [n] * comm.world)
            rows = self._average(weight_n / max(1, sum(sizes)),
                                 [batches, n, local_loss, compute_ms, prev["collective_ms"],
                                  prev["window_ms"], prev["pause_ms"], prev["waited_ms"], *steady,
                                  *self._resources.sample()])
            if live:
                if comm.rank == 0:  # every worker is past its last read: the window's keys can go
                    comm.drop_keys([f"{key}/cursor", f"{key}/done"] + (
                        [f"{key}/arrived", f"{key}/alive"] if arrival else []) + (
                        [f"{key}/tiers", f"{key}/probed"] + [f"{key}/ms{r}" for r in range(comm.world)]
                        if in_window else []))
                units_done = int(rows[:, 0 if self._batches is not None else 1].sum())
                total = int(rows[:, 1].sum())
            else:
                units_done, total = sum(units), sum(sizes)
            collective_ms = (time.perf_counter() - t) * 1e3 + self._waited_ms
            timing = None if first else _window_timing(rows[:, 4:8])
            for r in range(comm.world):
                # The first window after (re)starting carries warm-up costs (allocations, caches):
                # its speeds come from the batches after each worker's first where it ran several;
                # a one-batch probe's warm-up stretches every worker alike, and the next windows refine it.
                steady = first and comm.world > 1 and rows[r, 8] > 0
                done, ms_sum = (rows[r, 8], rows[r, 9]) if steady else (rows[r, 0], rows[r, 3])
                if done > 0:
                    ms = float(ms_sum / done)
                    old = self._ms[r]
                    # Half the weight on the newest smooths jitter; a change of more than a quarter is
                    # a new regime (warm-up over, a device throttled), taken at once rather than chased.
                    self._ms[r] = ms if old is None or not 0.75 <= ms / old <= 1.25 else (old + ms) / 2
            if (timing is not None and not warm_sync) or comm.world == 1:
                sync = timing["sync_ms"] if timing is not None else 0.0
                self._sync_ema = sync if self._sync_ema is None else (self._sync_ema + sync) / 2
            self.plan = plan_window(self._ms, self._sync_ema, self.plan, self.el_che)
            if live and self.el_che.nested and not self._tiers_decided and None not in self._ms:
                self._decide_tiers()
            if self._lead and not self._lead_warned and None not in self._ms and min(self._ms) < 0.8 * self._ms[0]:
                self._lead_warned = True
                if comm.rank == 0:
                    fastest = min(range(comm.world), key=lambda r: self._ms[r])
                    warnings.warn(f"ElChe(combine='lead'): worker 0 holds the optimizer, but worker {fastest} is "
                                  f"faster ({self._ms[fastest]:.0f} against {self._ms[0]:.0f} ms a batch); the "
                                  "others' batches count as one stale step a window, so start the fastest "
                                  "device as rank 0")
            warm_sync, first = first, False

            wall = time.perf_counter() - window_start - self._window_eval_s  # inner syncs' evaluations out
            self.train_time += wall
            prev = {"collective_ms": collective_ms, "window_ms": wall * 1e3, "pause_ms": pause_ms,
                    "waited_ms": self._waited_ms}
            before = self.step
            self._advance(units_done, total)
            if self._done():  # overlap: the last change lands before the final evaluation
                self._drain()
            mine = {"batches": batches, "samples": n, "loss": local_loss / n if n else None,
                    "compute_ms": compute_ms, "ms_per_batch": compute_ms / batches if batches else None,
                    "samples_per_s": n / compute_ms * 1e3 if batches else None,
                    "collective_ms": collective_ms, "window_ms": wall * 1e3}
            if self._tiers is not None:  # nested windows
                mine["tier"] = "inner" if self._inner is not None else "outer"
                if self._inner is not None:
                    mine.update(inner_syncs=self._inner_syncs, inner_sync_ms=self._inner_ms)
            self._record(mine, rows, wall, timing or {})
            t = time.perf_counter()
            if self._tiers is not None and self.stop_when is not None:  # an inner sync's evaluation said stop
                self._stop = self.comm.any_flag(self._stop_pending)
            self._after(before)
            pause_ms = (time.perf_counter() - t) * 1e3
        self._drain()  # overlap: a stop_when stop without a checkpoint
        self._land_sent()  # combine="lead": the last sync's parameters have landed before the run ends

    def _live_chunks(self, key: str, window_start: float, members: Sequence[int] | None = None,
                     anchor: int | None = None, done_key: str | None = None, overrun: bool = True):
        """This worker's batches of a live window (``ElChe(windows="live")``), claimed as it goes.

        The counter at ``key/cursor`` hands out the window's batches in the epoch's order, each
        once; a worker that has run ``anchor`` batches adds one to ``done_key`` (``key/done``) and
        goes on only while some worker of ``members`` (all, by default) has not, and while one more
        batch of its own would end less than :func:`~flodl_hf.training.sync.live_overrun_ms` after
        the slowest member's expected end (by the smoothed speeds): the overrun that still raises
        the window's batches per second. ``overrun=False`` stops at ``anchor``. A worker that finds
        the epoch (or the run) exhausted marks itself done too, so the window always closes.
        ``ElChe(combine="lead")``'s lead goes on until the others' gradients have landed rather
        than until they are done, with the same allowance past when they landed in the windows before.
        Where that allowance says stop, it waits for them at most until they are due plus the wait one
        more batch would cost the others, then runs one more and asks again: a slowest batch that runs
        long costs the lead no idle time past that.
        """
        comm = self.comm
        members = range(comm.world) if members is None else members
        anchor = self.plan.anchor if anchor is None else anchor
        done_key = done_key or f"{key}/done"
        available = math.ceil(self._remaining() / self._unit_batch)
        ms = [self._ms[r] for r in members]
        known = all(m is not None for m in ms)
        slowest_end = window_start + anchor * max(ms) / 1e3 if known else None
        mine = self._ms[comm.rank] if known else None
        # One more batch pays while it ends within the window's time per batch of the slowest's end.
        allowed = live_overrun_ms(ms, self._sync_ema if len(ms) == comm.world else None, anchor) if known else None
        done, marked = 0, False
        # combine="lead", on the lead: the window ends when the others' gradients have landed, not when
        # their batches end: across a slow link they take a while, and the lead trains on meanwhile.
        moving = self._moving if self._lead and comm.rank == 0 and overrun and self._moving is not None \
            and self._moving.watched else None
        if moving is not None:
            self._expected_end = slowest_end
        while True:
            if done >= anchor:
                # Mark this worker done once (the add returns the count), then read the count.
                finished = comm.counter(done_key, 0 if marked else 1)
                marked = True
                end = slowest_end
                if moving is not None:
                    if moving.landed_at is not None:
                        return
                    if self._landing is not None and known:
                        end = slowest_end + self._landing
                elif finished >= len(ms) or not overrun:
                    return
                if end is not None and time.perf_counter() + (mine - allowed) / 1e3 > end:
                    if moving is None:
                        return  # another batch would keep the others waiting longer than it is worth
                    # The lead waits for the gradients only while that is worth it: until they are due,
                    # plus the wait one more batch would cost the others. Later than that the slowest's
                    # batch ran long, and the lead trains on rather than idle until they land.
                    waited = time.perf_counter()
                    landed = moving.wait(max(end - waited, 0.0) + max(mine - allowed, 0.0) / 1e3)
                    self._waited_ms += (time.perf_counter() - waited) * 1e3
                    if landed:
                        return
            claim = comm.counter(f"{key}/cursor", 1) - 1
            if claim >= available:
                if not marked:
                    comm.counter(done_key, 1)
                return
            yield from self._claimed_chunks(claim)
            done += 1

    def _claimed_chunks(self, claim: int):
        """The chunks of the live window's batch number ``claim`` (from the window's counter),
        counted in ``self._claimed`` (units, samples)."""
        start = claim * self._unit_batch
        count = min(self._unit_batch, self._remaining() - start)
        self._claimed[0] += 1 if self._batches is not None else count       # units (nested windows' count)
        self._claimed[1] += self._samples_in(self.position + start, count)  # samples
        yield from self._chunks(self.position + start, count, split=True)

    def _probe_chunks(self, key: str, window_start: float):
        """The first window of ``ElChe(nested=True)`` in a cohort with candidate subgroups: batches
        claimed from the live counter, and the tiers found while the slowest is still in its
        first batch.

        After its first batch each worker publishes that batch's time; after every batch it reads
        the decision at ``key/tiers``, and proposes one where it has none: the tiers of
        :func:`~flodl_hf.training.sync.probe_tiers` once the workers still in their first batch have
        taken ``NEST_GAP`` times the slowest finished one, or ``"flat"`` once every worker has
        ended a batch (or the epoch's batches are all claimed). The first proposal wins
        (:meth:`Comm.settle`), so all act on the same one. On tiers, an outer worker ends its
        window there (one batch: the probe) and an inner worker goes on in nested windows of the
        inner tier from this window's start, its batches so far counted in the first inner
        window. On ``"flat"`` the window ends as a flat one, and the tiers come from its speeds."""
        comm = self.comm
        available = math.ceil(self._remaining() / self._unit_batch)
        decision, probed = f"{key}/tiers", f"{key}/probed"
        self._claimed = [0, 0]
        mine = None  # this worker's first batch, ms (published once)
        while True:
            state = ""
            if mine is not None:
                state = comm.settle(decision, "")
                if not state:
                    ended = comm.counter(probed, 0)
                    elapsed = (time.perf_counter() - window_start) * 1e3
                    if ended >= comm.world:
                        state = comm.settle(decision, "flat")
                    elif ended >= 2 and elapsed >= NEST_GAP * mine:  # worth reading the others' times
                        tiers = probe_tiers(self._first_batch_ms(key), elapsed)
                        if tiers is not None:
                            state = comm.settle(decision, "|".join(",".join(map(str, tier)) for tier in tiers))
            claim = None
            if not state:
                claim = comm.counter(f"{key}/cursor", 1) - 1
                if claim >= available:  # the epoch's batches are all out: no nesting in this window
                    state = comm.settle(decision, "flat")
            if state == "flat":
                return
            if state:
                inner, outer = (tuple(int(r) for r in tier.split(",")) for tier in state.split("|"))
                self._set_tiers((inner, outer), start=self._start, probe=self._first_batch_ms(key))
                if self._inner is None:
                    comm.counter(f"{key}/done", 1)  # the inner tier's signal that the outer tier is done
                    return
                yield from self._nested_chunks(key, window_start, carried=list(self._claimed))
                return
            began = time.perf_counter()
            yield from self._claimed_chunks(claim)
            if mine is None:
                mine = max((time.perf_counter() - began) * 1e3, 1e-3)
                comm.counter(f"{key}/ms{comm.rank}", max(1, round(mine * 1e3)))  # in microseconds
                comm.counter(probed, 1)

    def _first_batch_ms(self, key: str) -> list[float | None]:
        """The first-batch times the probe's workers published (microseconds on the store), None
        for a worker still in its first batch."""
        times = [self.comm.counter(f"{key}/ms{r}", 0) for r in range(self.comm.world)]
        return [t / 1e3 if t > 0 else None for t in times]

    def _decide_tiers(self) -> None:
        """Nested windows' tiers from the smoothed speeds (:func:`~flodl_hf.training.sync.nest_tiers`),
        once per fit; the inner tier's process group is made here, by every worker."""
        self._tiers_decided = True
        tiers = nest_tiers(self._ms)
        if tiers is not None:
            self._set_tiers(tiers)
        else:
            self._release_groups(keep=None)  # flat windows: no subgroup kept

    def _set_tiers(self, tiers: tuple[tuple[int, ...], tuple[int, ...]], start=None, probe=None) -> None:
        """Nest: the inner tier's process group (made up front where it is a candidate), and for
        ``"sum"`` the inner windows' start (``start``: this window's, when found inside it).
        ``probe``: the first batches' times that found the tiers, for the record."""
        self._tiers_decided = True
        self._tiers = tiers
        self._inner = self._candidates[tiers[0]] if tiers[0] in self._candidates else self.comm.subgroup(tiers[0])
        self._release_groups(keep=self._inner)
        if self._inner is not None and self.el_che.combine == "sum":  # an average sends no changes
            self._inner_start = [p.detach().clone() for p in (self.trainable if start is None else start)]
        found = {} if probe is None else {"found": "in the first window", "first_batch_ms": [
            None if ms is None else round(ms, 3) for ms in probe]}
        self._log_event("nested", inner=list(tiers[0]), outer=list(tiers[1]),
                        ms_per_batch=[None if ms is None else round(ms, 3) for ms in self._ms], **found)

    def _release_groups(self, keep: Comm | None = None) -> None:
        """Destroy the candidate inner tiers' process groups but ``keep`` (the inner tier's), once the
        tiers are settled; at the fit's end, the inner tier's too (each fit makes its own)."""
        for sub in list(self._candidates.values()) + ([self._inner] if keep is None else []):
            if sub is not None and sub is not keep:
                sub.release()
        self._candidates = {}

    def _nested_chunks(self, key: str, window_start: float, carried: list[int] | None = None):
        """An inner worker's batches of a nested window (``ElChe(nested=True)``): live windows of
        the inner tier, each closed by a sync of the inner tier, until the outer tier is done.

        After each inner window the inner tier's first worker decides for all (its answer rides
        the inner sync): it stops when the outer tier has marked ``key/done``, when the epoch's
        batches are all claimed, when an evaluation said stop, or when the outer tier is expected
        (by the smoothed speeds) to finish within ``share`` of an inner window from now, ``share``
        being the outer tier's part of the cohort's batches per second. Waiting ``r`` there costs
        the inner tier's throughput for ``r``, one more inner window costs the outer tier's for the
        rest of it, so that is the cheaper side. An outer tier past its expected end is late by an
        unknown amount: the inner tier runs on rather than wait for it, for up to ``timeout``
        seconds, after which the outer sync finds out whether it is lost. Worker 0, when inner,
        evaluates at the inner syncs that cross ``eval_every``: the inner tier's parameters are a
        model every inner worker holds, so the run's curve is not sampled only at the slowest
        worker's pace. With ``stop_when`` the inner tier waits for its answer and, on a stop, goes
        to the outer sync at once. The outer tier trains on through such an evaluation, and waits
        for its end on the store if done first. Inner sync time is counted in
        ``self._inner_ms``, not in the batches' time. ``carried``: the units and samples this worker
        ran in the window before the tiers were found (:meth:`_probe_chunks`), counted in the first
        inner window, whose start is then the window's (already in ``self._inner_start``)."""
        comm, inner, (inner_ranks, outer_ranks) = self.comm, self._inner, self._tiers
        available = math.ceil(self._remaining() / self._unit_batch)
        known = None not in self._ms  # not in the first window of tiers named up front
        outer_end = window_start + self.plan.anchor * max(self._ms[r] for r in outer_ranks) / 1e3 if known else 0.0
        share = sum(1 / self._ms[r] for r in outer_ranks) / sum(1 / ms for ms in self._ms) if known else 0.0
        if self._inner_start is not None and carried is None:
            _copy_into(self._inner_start, self.trainable)
        j, units, samples, last_step = 0, 0, 0, self.step
        self._inner_samples = 0  # the inner tier's samples this outer window (its weight in an average)
        while True:
            start = time.perf_counter()
            self._claimed = list(carried) if j == 0 and carried is not None else [0, 0]
            yield from self._live_chunks(key, start, inner_ranks, self.el_che.min_anchor, f"{key}/in{j}")
            t = time.perf_counter()
            stop = 0.0
            if inner.rank == 0:
                stop = float(comm.counter(f"{key}/done", 0) >= len(outer_ranks)
                             or comm.counter(f"{key}/cursor", 0) >= available
                             or 0 <= outer_end - t < (t - start) * share or self._stop_pending
                             # `timeout` past its expected end, an outer worker is taken for lost: the
                             # outer sync's collective then reports it (WorkerLostError), not the epoch's end
                             or t - (outer_end if known else window_start) > self.timeout)
            if self.el_che.combine == "sum":
                part = (self.trainable, 1.0, self._inner_start)
            else:  # the inner tier's samples-weighted average (equal weights if none ran a batch)
                sizes = inner.gather_floats([self._claimed[1]])[:, 0]
                total = float(sizes.sum())
                part = (self.trainable, self._claimed[1] / total if total > 0 else 1.0 / inner.world)
            rows = inner.reduce_window([part, (self._float_buffers, 1.0 / inner.world)], [stop, *self._claimed])
            if inner.rank == 0:  # every inner worker is past its last read of this inner window's count
                comm.drop_keys([f"{key}/in{j}"])
            if self._inner_start is not None:
                _copy_into(self._inner_start, self.trainable)
            if self.verify_sync:
                self._check_synced(f"an inner sync at step {self.step}", inner)
            self._inner_syncs += 1
            self._inner_ms += (time.perf_counter() - t) * 1e3
            units += int(rows[:, 1].sum())
            samples += int(rows[:, 2].sum())
            self._inner_samples = samples
            if rows[0, 0] > 0:
                return
            step = self.epoch * self.steps_per_epoch + math.ceil((self.position + units) / self.global_batch)
            every = self.eval_every
            if self.eval_fn is not None and every is not None and step // every > last_step // every \
                    and 0 in inner_ranks:
                now = self.train_time + time.perf_counter() - self._window_start - self._window_eval_s
                self._evaluate((step, self.samples + samples, now))
                if self._stop_pending:
                    return
            last_step = step
            j += 1

    def _average(self, weight: float, stats: list[float]) -> torch.Tensor:
        """Combine the window: the samples-weighted average of the trainable parameters
        (``combine="average"``, this worker weighing ``weight``) or the start point plus every worker's change (``"sum"``), the
        equal average of float buffers, then the outer step; returns every worker's ``stats``
        row. Integer buffers (position ids, BatchNorm's counter) are taken from worker 0 once,
        at the start, and not combined. ``compress="bf16"`` sends the (weighted) changes since
        the start in bfloat16, with what it leaves out carried to the next window."""
        comm = self.comm
        if self._anchor is not None:
            return self._overlap(weight, stats)
        if self._lead:
            return self._lead_sync(stats)
        start = self._start
        if start is None:
            rows = comm.reduce_window([(self.trainable, weight),
                                       (self._float_buffers, 1.0 / comm.world)], stats)
        else:
            # Each worker's change since the shared start (bits every worker agrees on), summed, added back;
            # an average weighs the changes (the weights sum to one, so it is the weighted mean).
            part = (self.trainable, 1.0 if self.el_che.combine == "sum" else weight, start)
            if self._inner is not None and self._inner.rank > 0:
                part = (self.trainable, 0.0, start)  # nested: the inner tier's one change, sent once
            if self._carried is not None:
                part += (self._carried,)
            rows = comm.reduce_window([part, (self._float_buffers, 1.0 / comm.world)], stats)
            if self.outer is None:
                _copy_into(start, self.trainable)
        if self.outer is not None:
            self.outer.step()
            if self.outer_cfg.reset_inner:
                self.optimizer.state.clear()
        if self.verify_sync:
            self._check_synced(f"the sync ending at step {self.step}")
        return rows

    def _overlap(self, weight: float, stats: list[float]) -> torch.Tensor:
        """``ElChe(overlap=True)``'s sync: gather the window's numbers (one small all-reduce, the
        window's end for every worker), land the previous window's summed changes in the shared
        point, start this window's in the background, and go on from the shared point plus this
        worker's own change. The others' changes of this window land at the next window's end."""
        comm = self.comm
        rows = comm.reduce_window([], stats)
        self._land()
        with torch.no_grad():
            for d, p, s in zip(self._delta, self.trainable, self._start):
                torch.sub(p, s, out=d)
        w = 1.0 if self.el_che.combine == "sum" else weight
        part = (self._delta, w) if self._carried is None else (self._delta, w, None, self._carried)
        self._pending = comm.launch_window([part, (self._float_buffers, 1.0 / comm.world)],
                                           into=[(self._anchor, self._anchor), None], background=True)
        with torch.no_grad():
            for p, a, d in zip(self.trainable, self._anchor, self._delta):
                torch.add(a, d, out=p)
        _copy_into(self._start, self.trainable)
        return rows

    def _lead_sync(self, stats: list[float]) -> torch.Tensor:
        """``ElChe(combine="lead")``'s sync: the others send their gradients to the lead (whose
        receives were posted at its window's start), then the window's numbers are gathered; the
        lead weighs the gradients by the others' samples, takes their sum as one more optimizer
        step and sends its parameters back to all (``compress``: its change, in bfloat16)."""
        comm = self.comm
        # The others send their gradients before they know the window's samples: the lead weighs them.
        compress = self._carried is not None  # compress="bf16": gradients, and the lead's change, in bfloat16
        moving = self._moving if comm.rank == 0 else comm.lead_gradients(
            self.trainable, [p.grad for p in self.trainable], carried=self._carried, compress=compress)
        self._moving = None
        rows = comm.gather_floats(stats)
        if comm.rank == 0 and moving is not None and moving.watched:  # live windows
            comm.land(moving, "receiving gradients from the other workers")
            # When the gradients landed, after the slowest's expected end: the lead trains on until then.
            if self._expected_end is not None:
                landed = moving.landed_at - self._expected_end
                self._landing = landed if self._landing is None else (self._landing + landed) / 2
            self._expected_end = None
        others = float(rows[1:, 1].sum())  # the samples the other workers' gradients hold
        weights = [float(rows[r, 1]) / others if r > 0 and others > 0 else 0.0 for r in range(comm.world)]
        # The lead's k steps, then this step: the next window's gradients are due k / (k + 1) of the way.
        k = float(rows[0, 0])
        self._ahead_share = k / (k + 1) if others > 0 else 1.0

        def step(grads: list[torch.Tensor]) -> None:
            if others > 0:
                for p, g in zip(self.trainable, grads):
                    p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
                self._optimizer_step()

        # The lead goes on while its parameters travel: it waits for them before its next step.
        sent = comm.lead_exchange(self.trainable + self._float_buffers, moving, weights, step,  # float buffers: no gradient
                                  start=self._start if compress else None, carried=self._carried if compress else None,
                                  background=True)
        self._sent = sent
        self.optimizer.zero_grad(set_to_none=True)
        if self.verify_sync:
            self._check_synced(f"the lead's step ending at step {self.step}")
        return rows

    def _land_sent(self) -> None:
        """``combine="lead"``, on the lead: wait for the parameters its last sync left on their way."""
        sent, self._sent = self._sent, None
        if sent is not None:
            self.comm.land(sent, "sending the lead's parameters")

    def _land(self) -> bool:
        """Overlap: wait for the all-reduce in flight, if any, and add it to the shared point."""
        if self._pending is None:
            return False
        pending, self._pending = self._pending, None
        pending.wait()
        if self.verify_sync:
            self.comm.check_identical(self._anchor, f"the overlapped sync landing at step {self.step}")
        return True

    def _drain(self) -> None:
        """Overlap: land the change in flight, and every worker takes the shared point (the same bits)."""
        if self._land():
            _copy_into(self.trainable, self._anchor)
            _copy_into(self._start, self._anchor)
            if self.verify_sync:
                self._check_synced(f"the overlapped sync drained at step {self.step}")

    def _check_synced(self, where: str, comm: Comm | None = None) -> None:
        """``verify_sync``: every worker of ``comm`` (the cohort's) holds the same parameters and buffers."""
        (comm or self.comm).check_identical(list(self.model.parameters()) + self._float_buffers, where)

    # ---- after each step or window: log, evaluate, checkpoint --------------------------------
    def _crossed(self, before: int, every: int | None) -> bool:
        return every is not None and self.step // every > before // every

    def _after(self, before: int) -> None:
        if self._bar is not None:
            self._bar.update(self.step - before)
        if self.eval_fn is not None and (self._crossed(before, self.eval_every) or self._done()):
            self._evaluate()
        if self.checkpoint_dir is not None and (self._crossed(before, self.checkpoint_every) or self._done()):
            self._drain()  # overlap: a checkpoint holds the shared point, nothing in flight
            self.save_checkpoint()

    def _record(self, mine: dict, rows: torch.Tensor, wall: float, timing: dict) -> None:
        """Write this worker's record and the rolled-up one (``rows``: per-worker batches,
        samples, loss sum, compute ms, ..., then four resource numbers; ``timing``: El Che's
        previous-window overheads). Worker 0 writes the record tree from ``rows``."""
        lr = self.optimizer.param_groups[0].get("lr")
        common = {"step": self.step, "epoch": self.epoch, "time": round(self.train_time, 4)}
        record = {**common, "rank": self.comm.rank, **mine, "lr": lr}
        self.records.append(record)
        batches, samples = rows[:, 0], rows[:, 1]
        n = float(samples.sum())
        rolled = {**common, "event": "train", "samples": self.samples,
                  "loss": float(rows[:, 2].sum()) / n if n else None,
                  "samples_per_s": n / wall if wall > 0 else None, "lr": lr,
                  "batches": batches.int().tolist(),
                  "batch_share": (batches / batches.sum().clamp(min=1)).tolist(),
                  "worker_samples_per_s": [float(s / c * 1e3) if c > 0 else None
                                           for s, c in zip(samples.tolist(), rows[:, 3].tolist())]}
        if self._tiers is not None:  # nested windows: which ranks are inner, which outer
            rolled["tiers"] = [list(tier) for tier in self._tiers]
        if self.plan is not None:
            rolled.update(anchor=self.plan.anchor, **timing)
            if not self._live:  # live windows have no plan
                rolled["plan"] = list(self.plan.counts)
        self.history.append(rolled)
        self._log.window(rolled, rows, wall, timing)
        if self._bar is not None and rolled["loss"] is not None:
            self._bar.set_postfix(loss=f"{rolled['loss']:.4f}",
                                  samples_s=f"{rolled['samples_per_s']:.0f}", refresh=False)

    def _evaluate(self, inner: tuple[int, int, float] | None = None) -> None:
        """Evaluate on worker 0 and share ``stop_when``'s answer. The other workers wait for it on the
        store (:meth:`Comm.wait_for_peer`) while worker 0's heartbeat goes on, however long it takes.
        ``inner``: (step, samples, training time) of an inner sync of nested windows, called by the
        inner tier only: worker 0 evaluates the inner tier's parameters, the inner tier shares the
        answer (``_stop_pending``), and the outer tier learns it at the outer sync; the inner workers
        wait for it on the store as well, and the outer tier waits for the inner tier's arrival before
        the outer sync (:meth:`Comm.wait_for_arrival`) while worker 0's heartbeat goes on."""
        step = self.step if inner is None else inner[0]
        if inner is None:  # (an inner sync's evaluation is of other parameters than the outer sync's at its step)
            # Once per point of training, not per step number: live windows end anywhere in a step
            # of ``global_batch`` samples, so the window that ends the epoch can share its step number
            # with the one before, and the final parameters would go unevaluated.
            point = (self.epoch, self.position)
            if self._evaluated_at == point:
                return
            self._evaluated_at = point
        metrics: dict = {}
        stop = False
        # The other workers wait for an outer evaluation on the store, not in their next collective, for
        # as long as worker 0's heartbeat goes on: ``timeout`` bounds a silence, not the evaluation.
        # At an inner sync of nested windows, the inner tier waits so, and worker 0's beats also move
        # the window's ``alive`` counter, which the outer tier watches before the outer sync.
        shared = self._eval_waits
        key = also = readers = None
        if shared and inner is None:
            key = f"flodl-hf/eval/{self._run_key}/{self.epoch}/{self.position}"
        elif shared:
            key, also = f"{self._window_key}/eval{self._inner_syncs}", f"{self._window_key}/alive"
            readers = self._inner.world - 1
        if self.comm.rank == 0:
            beat = self.comm.heartbeat(key, min(1.0, self.timeout / 10), also) if shared else None
            ok = False  # an eval_fn that raises ends the others' wait at once
            try:
                metrics, eval_s = self._evaluate_here(step, inner)
                stop = bool(self.stop_when(metrics)) if self.stop_when is not None else False
                ok = True
            finally:
                if beat is not None:
                    beat.end(ok)
            if inner is not None:
                self._window_eval_s += eval_s
        elif shared:
            t, what = time.perf_counter(), f"waiting for worker 0's evaluation at step {step}"
            if not self.comm.wait_for_peer(key, what, self.timeout, readers):
                raise self.comm.lost(what, TrainerError("worker 0's eval_fn or stop_when raised (its log says what)"),
                                     time.perf_counter() - t)
            waited = time.perf_counter() - t
            self._eval_s += waited  # the evaluation's pause is not training time here either
            if inner is not None:  # nor the batches' time of this window
                self._window_eval_s += waited
        if self.stop_when is not None:
            if inner is None:
                self._stop = self.comm.any_flag(stop or self._stop_pending)
            else:  # the inner tier waits for the answer, as every worker does at an outer sync
                self._stop_pending = self._inner.any_flag(stop)

    def _evaluate_here(self, step: int, inner: tuple[int, int, float] | None) -> tuple[dict, float]:
        """Run ``eval_fn`` on this worker (worker 0) and record it; its metrics and seconds."""
        now = self._train_time_now() if inner is None else inner[2]  # the eval's place on the training clock
        t = time.perf_counter()
        was_training = self.model.training
        self.model.eval()
        devices = [self.device.index] if self.device.type == "cuda" else []
        # Evaluation must not move the training RNG (torch's, Python's, NumPy's: a collate_fn may draw from
        # any), or turning it on would change training and resuming would not be bit-exact.
        host_rng = _host_rng_state()
        try:
            # Under the run's autocast, as transformers' Trainer evaluates (accelerate wraps the forward).
            with torch.random.fork_rng(devices=devices), torch.no_grad(), self._autocast():
                out = self.eval_fn(self.model)
        finally:
            self.model.train(was_training)
            _set_host_rng_state(host_rng)
        metrics = _metrics(out)
        eval_s = time.perf_counter() - t
        self._eval_s += eval_s
        record = {"event": "eval", "step": step, "epoch": self.epoch, "time": round(now, 4),
                  "samples": self.samples if inner is None else inner[1], "eval_s": round(eval_s, 4), **metrics}
        self.history.append(record)
        self._log.event(record)
        if self._bar is not None:
            self._bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        return metrics, eval_s

    # ---- checkpoints -------------------------------------------------------------------------
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

    # ---- end ---------------------------------------------------------------------------------
    def _finish(self) -> dict:
        last = next((r for r in reversed(self.history) if r.get("event") == "train"), {})
        evals = [r for r in self.history if r.get("event") == "eval"]
        summary = {"step": self.step, "epoch": self.epoch, "samples": self.samples,
                   "train_time": self.train_time, "wall_time": time.perf_counter() - self._fit_start,
                   "loss": last.get("loss"), "batches": self.batches,
                   "eval": {k: v for k, v in evals[-1].items() if k not in _EVAL_FIELDS}
                   if evals else None,
                   "stopped_early": self._stop, "checkpoint": None, "report": None}
        if self.checkpoint_dir is not None and self.comm.rank == 0:
            latest = latest_checkpoint(self.checkpoint_dir)
            summary["checkpoint"] = str(latest) if latest else None
        self._log.finish()
        self._log_event("end", **{k: v for k, v in summary.items() if k not in ("report",)}, status="finished")
        self._log.close()
        if self.report and self.log_dir is not None and self.comm.rank == 0:
            from flodl_hf.training.report import write_report
            summary["report"] = str(write_report(self.log_dir))
        return summary

    def _log_event(self, event: str, **fields: Any) -> None:
        if self.comm.rank == 0:
            record = {"event": event, **fields}
            if event != "start":
                self.history.append(record)
            self._log.event(record) if getattr(self, "_log", None) is not None else None


# ---- checkpoints -------------------------------------------------------------------------------

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


def _copy_into(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``targets[i] = sources[i]`` in place (a window's start taken from the synced parameters)."""
    with torch.no_grad():
        for t, src in zip(targets, sources, strict=True):
            t.copy_(src)


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


# ---- small helpers -----------------------------------------------------------------------------

def _window_timing(prev: torch.Tensor) -> dict:
    """Overheads of the previous window from each worker's (collective, window, pause[, waited]) ms.

    The worker that reached the collective last waited least, so the shortest collective is
    the averaging itself (sync) and the rest of each worker's collective is idle. A worker
    that paused less than another (worker 0 evaluates) waits that difference too: that wait is
    taken out of its idle time and of its window. ``waited`` is the part of a worker's collective
    spent waiting before it (``combine="lead"``'s lead, for the others' gradients): idle, never
    the sync, even where the others then waited for it in turn.
    """
    collective, window, pause = prev[:, 0], prev[:, 1], prev[:, 2]
    waited = prev[:, 3] if prev.shape[1] > 3 else torch.zeros_like(collective)
    sync = float((collective - waited).min())
    lag = pause.max() - pause
    return {"sync_ms": sync, "idle_ms": (collective - sync - lag).clamp(min=0).tolist(),
            "window_ms": (window - lag).clamp(min=1e-9).tolist()}


def length_batches(lengths: Sequence[int], max_tokens: int, seed: int = 0,
                   max_size: int | None = None) -> list[torch.Tensor]:
    """Index batches of texts of similar length, each padded to its longest under ``max_tokens``.

    Items are sorted by length (ties broken by a permutation drawn from ``seed``) and cut
    greedily: a batch takes the next item while ``count x longest <= max_tokens`` (and, with
    ``max_size``, ``count <= max_size``); an item longer than the budget is a batch alone. The
    set of batches is fixed for the run (the trainer shuffles their order each epoch), so a
    resumed run deals exactly the same batches.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    tiebreak = torch.randperm(len(lengths), generator=gen).tolist()
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], tiebreak[i]))
    batches, current, longest = [], [], 0
    for i in order:
        wide = max(longest, lengths[i])
        if current and ((len(current) + 1) * wide > max_tokens or (max_size and len(current) >= max_size)):
            batches.append(torch.tensor(current))
            current, wide = [], lengths[i]
        current.append(i)
        longest = wide
    if current:
        batches.append(torch.tensor(current))
    return batches


def _item_length(data: Sequence, i: int) -> int:
    """An item's token count for batching='length': its ``input_ids`` (a mapping's, or a tuple's first part)."""
    item = data[i]
    ids = item.get("input_ids") if isinstance(item, Mapping) else (item[0] if isinstance(item, (tuple, list)) else None)
    if ids is None or not hasattr(ids, "__len__"):
        raise TrainerConfigError(f"batching='length' cannot tell data[{i}]'s length ({type(item).__name__}); pass "
                                 "lengths= (one token count per item) or items with input_ids")
    return len(ids)


def _collective_failed(exc: BaseException) -> bool:
    """A RuntimeError from gloo or NCCL (a peer gone, a timeout), not from the user's own graph."""
    text = str(exc)
    return any(mark in text for mark in ("gloo", "NCCL", "Connection reset", "Connection closed", "Timed out waiting",
                                         "collective mismatch", "ProcessGroup"))


def _takes_num_items(step: Callable) -> bool:
    """Whether ``step`` has a ``num_items_in_batch`` parameter (by name: ``**kwargs`` alone does not say
    that its loss uses the count)."""
    try:
        param = inspect.signature(step).parameters.get("num_items_in_batch")
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                inspect.Parameter.KEYWORD_ONLY)


def _loss_shifts_labels(model: nn.Module) -> bool:
    """Whether ``model``'s loss shifts its labels (token t predicts label t + 1), so that the items of
    ``num_items_in_batch`` are ``labels[..., 1:]``: ours when their task is ``causal_lm``; a transformers
    model when its ``loss_type`` maps to ForCausalLMLoss and it is not an encoder-decoder (trainer.py:534-544)."""
    task = getattr(model, "task", None)
    if isinstance(task, str):
        return task == "causal_lm"
    loss_type = getattr(model, "loss_type", None)
    if not isinstance(loss_type, str):
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    return LOSS_MAPPING.get(loss_type) is ForCausalLMLoss and \
        not getattr(getattr(model, "config", None), "is_encoder_decoder", False)


def _ignores_num_items(model: nn.Module) -> str | None:
    """``"<Model>'s <task> head"`` where ``model`` is ours and its head ignores ``num_items_in_batch``
    (``Family.num_items_tasks`` lacks its task, as transformers' head of that family ignores it), else None."""
    task, family = getattr(model, "task", None), getattr(model, "family", None)
    tasks = getattr(family, "num_items_tasks", None)
    if not isinstance(task, str) or tasks is None or task in tasks:
        return None
    return f"{type(model).__name__}'s {task} head"


def _loss_of(out: Any) -> torch.Tensor:
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TrainerConfigError("step(model, batch) must return a scalar loss tensor or an output with .loss; "
                                 f"got {type(out).__name__}" + ("" if loss is None else f" whose loss is {loss!r}"))
    if not loss.requires_grad:
        raise TrainerConfigError("step(model, batch) returned a loss that does not require grad: compute it from "
                                 "the model's output, outside torch.no_grad()")
    return loss.reshape(())


_EVAL_FIELDS = ("event", "step", "epoch", "time", "samples", "eval_s")  # the evaluation record's own


def _metrics(out: Any) -> dict:
    """``eval_fn``'s result as metrics: a mapping of numbers, one number (``eval``), or None."""
    if out is None:
        return {}
    metrics = {}
    for key, value in (out.items() if isinstance(out, Mapping) else [("eval", out)]):
        key = str(key)
        if key in _EVAL_FIELDS:
            raise TrainerConfigError(f"eval_fn returned a metric named {key!r}, a field of the evaluation record "
                                     f"({', '.join(_EVAL_FIELDS)}): give it another name")
        try:
            metrics[key] = float(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TrainerConfigError(f"eval_fn's {key!r} must be a number (or a one-element tensor), got "
                                     f"{type(value).__name__}") from exc
    return metrics


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        moved = {k: _to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)
        except Exception:  # a mapping type that cannot be rebuilt from a dict
            return moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    if hasattr(batch, "to") and callable(batch.to):
        return batch.to(device)
    return batch


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


def _host_rng_state() -> tuple:
    """Python's and NumPy's generator states (None for NumPy where it is not installed)."""
    try:
        import numpy as np
        numpy_state = np.random.get_state()
    except ImportError:
        numpy_state = None
    return random.getstate(), numpy_state


def _set_host_rng_state(state: tuple) -> None:
    python, numpy_state = state
    random.setstate(python)
    if numpy_state is not None:
        import numpy as np
        np.random.set_state(numpy_state)


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


class _RunLog:
    """Worker 0's record tree (:class:`~flodl_hf.training.records.TreeWriter`) and optional TensorBoard;
    on other workers it writes nothing (their numbers reach worker 0 in the all-gathers)."""

    def __init__(self, log_dir: Path | None, rank: int, hosts: Sequence[str], tensorboard: bool,
                 truncate_after: tuple[int, float] | None) -> None:
        self.tree, self.tb = None, None
        if log_dir is None or rank != 0:
            return
        from flodl_hf.training.records import TreeWriter
        self.tree = TreeWriter(log_dir, hosts, truncate_after=truncate_after)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(log_dir / "tensorboard"))
            except ImportError:
                warnings.warn("tensorboard=True but tensorboard is not installed; skipping TensorBoard logs")

    def window(self, rolled: dict, rows: torch.Tensor, wall: float, timing: dict) -> None:
        """One log point or window: each rank's numbers from its row of the all-gather."""
        if self.tree is None:
            return
        from flodl_hf.training.records import resource_fields
        ranks = []
        for r, row in enumerate(rows.tolist()):
            batches, samples, loss_sum, compute_ms = row[:4]
            numbers = {"samples": int(samples), "batches": int(batches),
                       "loss": loss_sum / samples if samples else None,
                       "samples_per_s": samples / wall if wall > 0 else None,
                       "ms_per_batch": compute_ms / batches if batches else None, "compute_ms": compute_ms,
                       "lr": rolled.get("lr"),
                       **resource_fields(row[-4:])}
            if timing:  # El Che: the previous window's overheads
                numbers.update(sync_ms=timing["sync_ms"], idle_ms=timing["idle_ms"][r],
                               window_ms=timing["window_ms"][r],
                               idle_share=timing["idle_ms"][r] / timing["window_ms"][r])
            if "plan" in rolled:
                numbers["planned"] = rolled["plan"][r]
            if "tiers" in rolled:
                numbers["tier"] = "inner" if r in rolled["tiers"][0] else "outer"
            ranks.append(numbers)
        common = {k: rolled[k] for k in ("step", "epoch", "time")}
        extra = {k: rolled[k] for k in ("anchor",) if k in rolled}
        self.tree.window(common, ranks, extra_root=extra)
        self._tensorboard(rolled)

    def finish(self) -> None:
        if self.tree is not None:
            self.tree.finish()

    def event(self, record: dict) -> None:
        if self.tree is not None:
            self.tree.event(record)
            self._tensorboard(record)

    def _tensorboard(self, record: dict) -> None:
        if self.tb is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch", "rank"):
                    self.tb.add_scalar(f"{record.get('event', 'train')}/{key}", value, record["step"])

    def close(self) -> None:
        if self.tree is not None:
            self.tree.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None


# ---- launcher ----------------------------------------------------------------------------------

def launch(script: str | os.PathLike, args: Sequence[str] = (), *, workers: int = 1, max_restarts: int = 0,
           env: Mapping[str, str] | None = None, timeout: float | None = None, nnodes: int = 1,
           node_rank: int = 0, rdzv_endpoint: str | None = None, local_addr: str | None = None,
           store_timeout: float = 15.0) -> int:
    """Run ``script`` as ``workers`` processes per node with torchrun; return torchrun's exit code.

    One node (``nnodes=1``): a standalone rendezvous on this machine. Several nodes: every node
    runs this with the same ``nnodes`` and ``rdzv_endpoint`` (``HOST:PORT`` of node 0, which
    hosts the c10d rendezvous store) and its own ``node_rank``; ``local_addr`` is the address the
    other nodes reach this one at (default: what its hostname resolves to).

    ``store_timeout`` (seconds) bounds each of the elastic agent's rendezvous-store calls. A
    store host that dies without closing its sockets (power, network) otherwise leaves the
    surviving agents blocked in their monitor loop's store read for the c10d default of 60 s
    per call, then again in the rendezvous shutdown: measured on two network namespaces,
    still running 150 s after their workers had raised WorkerLostError. ``timeout`` (seconds)
    kills the whole launch, workers included, and raises TrainerError.
    """
    script = Path(script)
    if not script.is_file():
        raise InputError(f"training script {script} not found")
    if workers < 1:
        raise InputError(f"--workers must be at least 1, got {workers}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise InputError(f"--node-rank must be in [0, --nnodes), got {node_rank} with --nnodes {nnodes}")
    if nnodes > 1 and not rdzv_endpoint:
        raise InputError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if not store_timeout > 0:
        raise InputError(f"--store-timeout must be positive, got {store_timeout}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={workers}",
           f"--max-restarts={max_restarts}"]
    if nnodes == 1 and not rdzv_endpoint:
        cmd.append("--standalone")
    else:
        # Node 0 hosts the store: said explicitly, since torchrun's guess compares the endpoint
        # with the hostname, which several namespaces (or NAT'd hosts) share or do not match.
        conf = f"is_host={int(node_rank == 0)},read_timeout={math.ceil(store_timeout)}," \
               f"close_timeout={math.ceil(store_timeout)}"
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-conf={conf}"]
        if local_addr:
            cmd.append(f"--local-addr={local_addr}")
    cmd += [str(script), *args]
    # Workers sharing the rendezvous store can read a dead worker's address after a restart
    # (pytorch/pytorch#135712); a store of their own per attempt avoids it.
    env = {**({} if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in os.environ else
              {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}), **(env or {})}
    # With a timeout the launch gets its own session, so the workers can be killed with it.
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=timeout is not None)
    try:
        return _watch(proc, timeout, max_restarts, store_timeout if nnodes > 1 or rdzv_endpoint else None)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise TrainerError(f"{script}: training did not finish within {timeout:.0f}s; its processes were killed")
    except KeyboardInterrupt:
        proc.wait()  # torchrun got the same Ctrl-C and stops its workers
        raise


def _children(pid: int) -> set[int]:
    """The running child processes of ``pid``, exited but unreaped ones left out (Linux /proc)."""
    found = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(c) for c in f.read().split())
    except OSError:
        pass
    running = set()
    for child in found:
        try:
            with open(f"/proc/{child}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):  # a blocked agent does not reap its dead workers
            running.add(child)
    return running


def _watch(proc: subprocess.Popen, timeout: float | None, max_restarts: int, store_timeout: float | None) -> int:
    """Wait for torchrun; end it when it outlives its last allowed set of workers.

    Multi-node only (``store_timeout`` set): once torchrun's workers have exited
    ``max_restarts + 1`` times, the agent has nothing left but to report and close the
    rendezvous; if it is still running ``store_timeout + 5`` s later it is blocked on a
    store host that vanished without closing its sockets (measured: the c10d store client's
    read then waits for the kernel's TCP retransmission timeout, many minutes, whatever
    ``read_timeout`` says), so it is killed and the launch returns 1.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    if store_timeout is None or not sys.platform.startswith("linux"):
        return proc.wait(timeout=timeout)
    had_workers, exits, idle_since = False, 0, None
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() > deadline:
                raise
        workers = _children(proc.pid)
        if workers:
            had_workers, idle_since = True, None
            continue
        if had_workers:
            had_workers, exits, idle_since = False, exits + 1, time.monotonic()
        if exits > max_restarts and idle_since is not None and time.monotonic() - idle_since > store_timeout + 5:
            proc.kill()
            proc.wait()
            print(f"flodl-hf train: torchrun was still running {time.monotonic() - idle_since:.0f}s after its "
                  "workers exited: its rendezvous store (node 0) no longer answers; ended it", file=sys.stderr)
            return 1
