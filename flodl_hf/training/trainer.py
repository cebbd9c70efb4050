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
    ``"fsdp"``    FSDP2 (``torch.distributed.fsdp.fully_shard``): every layer and the root sharded, each
                  worker holding 1/world of the parameters, gradients and optimizer state; gradients
                  reduce-scattered (averaged) every step; evaluation on every worker, its record from worker 0;
                  sharded checkpoints (:mod:`flodl_hf.training.sync.fsdp`).
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

Checkpoints
-----------
``checkpoint_dir/step-XXXXXXXX.pt``, written by worker 0 to a temporary file and renamed into place, with a
side file per other worker; the newest is resumed from. Their format: :mod:`flodl_hf.training.checkpoints`.

Record of the run
-----------------
In ``log_dir`` (default: ``checkpoint_dir``), worker 0 writes the record tree
(:mod:`flodl_hf.training.records`): ``records.jsonl`` (the root rollup, plus ``start``, ``eval``,
``checkpoint`` and ``end`` events), ``host-<name>/records.jsonl`` and
``host-<name>/rank-<r>/records.jsonl``, one line per log point or El Che window, from the
numbers every worker sends in the window's all-gather; and at the end ``run.html``, the whole
tree in one page (:mod:`flodl_hf.training.report`). ``portal=True`` serves it live (:mod:`flodl_hf.training.portal`).

The Trainer's parts: its batches, optimizer steps and DDP loop (:mod:`flodl_hf.training.steps`), El Che's
windows (:mod:`flodl_hf.training.windows`), checkpoints (:mod:`flodl_hf.training.checkpoints`) and the record
as it runs (:mod:`flodl_hf.training.run_log`); :func:`flodl_hf.training.launch.launch` starts the workers.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from flodl_hf import lora
from flodl_hf.core.errors import InputError
from flodl_hf.core.validate import file_above
from flodl_hf.training import embedding_grads
from flodl_hf.training.checkpoints import (CheckpointsMixin, _check_model_fits, _remove_checkpoints,
                                           _remove_stale_temporaries, _seed_everything, latest_checkpoint)
from flodl_hf.training.run_log import _EVAL_FIELDS, RecordMixin, _RunLog
from flodl_hf.training.steps import StepsMixin, _ignores_num_items, _loss_shifts_labels, _takes_num_items, _to_device
from flodl_hf.training.sync import (Cadence, Comm, DiLoCo, ElChe, Link, OuterOptimizer, Plan, TrainerConfigError,
                                    TrainerError, WorkerLostError, choose, inner_candidates)
from flodl_hf.training.sync.choice import describe
from flodl_hf.training.sync.fsdp import refuse_replicas, shard_model
from flodl_hf.training.windows import WindowsMixin

__all__ = ["Trainer", "ElChe", "DiLoCo", "TrainerError", "TrainerConfigError", "WorkerLostError", "length_batches"]

StepFn = Callable[[nn.Module, Any], Any]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class Trainer(StepsMixin, WindowsMixin, CheckpointsMixin, RecordMixin):
    """Train ``model`` with the user's ``step(model, batch)`` closure.

    ``optimizer`` is a factory over parameters (``lambda ps: torch.optim.AdamW(ps, lr=2e-5)``)
    and ``scheduler`` one over the optimizer, so each worker builds its own. ``data`` is any
    sized, indexable collection; ``collate_fn`` turns a list of its items into a batch
    (default: ``torch.utils.data.default_collate``). ``batch_size`` is per worker.
    ``eval_fn(model)`` runs on worker 0 (every worker under ``sync="fsdp"``) in eval mode without gradients and
    returns a number or a dict of numbers; ``stop_when(metrics)`` may end the run after an evaluation.
    ``sync`` is ``"ddp"``, ``"fsdp"``, ``"el-che"`` (or an :class:`ElChe`), or ``"none"``; ``outer`` a
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
            if sync not in ("ddp", "el-che", "none", "fsdp"):
                raise TrainerConfigError(f"sync must be 'ddp', 'fsdp', 'el-che', 'none' or an ElChe, got {sync!r}")
            el_che = ElChe() if sync == "el-che" else None
        elif isinstance(sync, ElChe):
            el_che, sync = sync, "el-che"
        else:
            raise TrainerConfigError(f"sync must be 'ddp', 'fsdp', 'el-che', 'none' or an ElChe, got "
                                     f"{type(sync).__name__}")
        if sync == "fsdp" and outer is not None:
            raise refuse_replicas("outer=DiLoCo(...)")
        if sync == "fsdp" and precision == "fp16":  # FSDP's MixedPrecisionPolicy is bf16's; fp16 needs a scaler
            raise TrainerConfigError("precision='fp16' does not go with sync='fsdp' (its gradient scaler does not "
                                     "reach the sharded gradients); use precision='bf16', which needs no scaler")
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
        # The user's ElChe (its fields left to "auto" are chosen in _setup) and the Cadence chosen from it.
        self.sync, self.el_che_asked, self.el_che, self.outer_cfg = sync, el_che, None, outer
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
            with embedding_grads.reused(self.model, enabled=self.device.type == "cpu" and self.wrapped is self.model
                                        and self.sync != "fsdp"):
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
        if self.checkpoint_dir is not None:  # before any collective, so before any worker writes a checkpoint
            stale = _remove_stale_temporaries(self.checkpoint_dir)
            if stale:
                warnings.warn(f"removed {len(stale)} temporary file(s) that a killed checkpoint write left in "
                              f"{self.checkpoint_dir}: {', '.join(stale)}")
        if self.sync in ("ddp", "fsdp") and comm.world > 1 and not comm.same_device_type:
            raise TrainerConfigError(f"sync={self.sync!r} needs every worker on the same kind of device; "
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
        self._across = self.sync in ("ddp", "fsdp") and comm.world > 1 and self.average_tokens_across_devices
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
        self.plan, self._live = None, False  # El Che's: set once its choices are made (_choose_cadence)
        self._ms: list[float | None] = [None] * comm.world
        asked = self.el_che_asked.nested if self.el_che_asked is not None else None
        if isinstance(asked, tuple) and sorted(sum(asked, ())) != list(range(comm.world)):
            raise TrainerConfigError(f"ElChe nested={asked!r}: the tiers must hold every rank 0..{comm.world - 1} once")
        self._eval_waits = False  # the other workers wait for worker 0's evaluations on the store
        if comm.world > 1:
            # Live windows' counters and evaluations' heartbeats on the store are named after this fit, from
            # worker 0's clock: a store that outlives the fit (a torchrun restart, fits in a row) never mixes
            # them up. The others wait for an evaluation where every worker evaluates at the same points.
            rows = comm.gather_floats([time.time_ns() % 2**52, self.eval_fn is not None, self.eval_every or 0])
            self._run_key = str(int(rows[0, 0]))
            self._eval_waits = bool((rows[:, 1:] == rows[0, 1:]).all()) and self.eval_fn is not None \
                and self.sync != "fsdp"  # a sharded model is evaluated by every worker together
            if not self._eval_waits and bool(rows[0, 1]) and comm.rank == 0 and self.sync != "fsdp":
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

        if self.checkpoint_dir is not None and not self.resume and comm.rank == 0:
            # A fresh run in a directory holding an earlier run's checkpoints: they go, as its records
            # do, or pruning (by step) would keep them over this run's and a later resume take them.
            removed = _remove_checkpoints(self.checkpoint_dir)
            if removed:
                warnings.warn(f"resume=False: removed {len(removed)} checkpoint file(s) of an earlier run from "
                              f"{self.checkpoint_dir} (newest {removed[-1]})")
        checkpoint = self._find_resume()
        if checkpoint is not None and not checkpoint[0].get("sharded"):  # (shards: read into the sharded model)
            state, worker = checkpoint
            _check_model_fits(self.model, state, self.resumed_from)  # before any tensor is copied
            try:
                lora.load_trainer_state(self.model, state, str(self.resumed_from))  # LoRA: the adapter only
            except RuntimeError as exc:
                raise TrainerError(f"{self.resumed_from}: the checkpoint does not fit this model: {exc}") from exc
        from flodl_hf.training.records import decode_name, encode_name, host_names, local_identity
        host, node = local_identity()
        ids = comm.gather_floats([float(node), *encode_name(host)])  # the tree's host names, once
        self._hosts = host_names([(decode_name(row[1:]), int(row[0])) for row in ids.tolist()])
        self._broadcast_s = 0.0
        if self.sync == "ddp" and comm.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.wrapped: nn.Module = nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
            if self.balance:
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
                self._allreduce_hook = allreduce_hook
                self.wrapped.register_comm_hook(None, self._stamp_ready)
        else:
            self.wrapped = self.model
            # Workers start from worker 0's weights (DDP does this itself), timed from a point every worker has
            # reached: El Che's measure of the link.
            comm.barrier()
            began = time.perf_counter()
            comm.broadcast_(list(self.model.parameters()) + list(self.model.buffers()))
            self._broadcast_s = time.perf_counter() - began
            if self.sync == "fsdp" and comm.world > 1:  # each worker keeps its shard of worker 0's weights
                shard_model(self.model, self.device, comm.world, self.precision)
                self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        params = [p for p in self.wrapped.parameters() if p.requires_grad]
        if not params:
            raise TrainerConfigError(f"model: {type(self.model).__name__} has no parameter that requires grad")
        self.optimizer = self.optimizer_factory(params)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TrainerConfigError(f"optimizer(params) must return a torch.optim.Optimizer, got "
                                     f"{type(self.optimizer).__name__}")
        self.scheduler = self.scheduler_factory(self.optimizer) if self.scheduler_factory else None
        if checkpoint is not None:
            state, worker = checkpoint
            if state.get("sharded"):
                self._load_shards(state)
        self.outer = OuterOptimizer(self.trainable, self.outer_cfg) if self.outer_cfg else None
        if self.sync == "el-che":
            self._choose_cadence(checkpoint[0] if checkpoint is not None else None)
        # combine="sum" adds each worker's change to the window's shared start, and compress="bf16" sends
        # changes whatever the combine: DiLoCo's start when there is an outer step, else a copy of its
        # own; None when the sync sends the parameters themselves.
        el_che = self.el_che if comm.world > 1 else None
        changes = el_che is not None and (el_che.combine == "sum" or el_che.compress is not None)
        self._start = None if not changes else (
            self.outer.start if self.outer is not None else [p.detach().clone() for p in self.trainable])
        # What bfloat16 did not carry of this worker's changes yet (ElChe.compress), sent with the next.
        self._carried = ([torch.zeros_like(p, dtype=torch.float32) for p in self.trainable]
                         if el_che is not None and el_che.compress is not None else None)
        # ElChe(combine="lead"), on the others: the last window's start, and the share of the last window's
        # move the lead makes before it steps on their gradients (set at each sync).
        self._ahead = el_che is not None and el_che.combine == "lead" and comm.rank > 0
        self._behind: list[torch.Tensor] | None = None
        self._moving = None  # combine="lead", on the lead: the others' gradients on their way (posted receives)
        self._sent = None  # combine="lead", on the lead: its parameters still on their way to the others
        self._ahead_share = 1.0
        if checkpoint is not None:
            self._restore(state, worker)
        else:
            _seed_everything(self.seed * 1_000_003 + comm.rank)
        # ElChe(combine="lead"): worker 0 holds the optimizer, the others send it gradients.
        self._lead, self._lead_warned = el_che is not None and el_che.combine == "lead", False
        from flodl_hf.training.records import Resources
        hosts = self._hosts
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

    def _choose_cadence(self, state: dict | None) -> None:
        """El Che's choices for this fit (:func:`~flodl_hf.training.sync.choose`) from the cohort and the link
        the setup broadcast measured (the slowest worker's time, so every worker chooses the same); a resumed
        fit asked the same keeps its checkpoint's. Then what they set up: the plan, live windows, the
        candidate inner tiers of nested windows."""
        comm = self.comm
        asked = self.el_che_asked
        seconds = float(comm.gather_floats([self._broadcast_s])[:, 0].max())
        size = sum(t.numel() * t.element_size() for t in list(self.model.parameters()) + list(self.model.buffers()))
        link = Link(len(set(self._hosts)), size / 1e6 / seconds if comm.world > 1 and seconds > 0 else None)
        saved = (state or {}).get("el_che") or {}
        record = describe(asked, Cadence(), {}, link)["asked"]
        if saved.get("cadence") and saved.get("asked") == record:
            kept = dict(saved["cadence"])
            if isinstance(kept["nested"], list):
                kept["nested"] = tuple(tuple(tier) for tier in kept["nested"])
            cadence = Cadence(**kept)
            why = dict.fromkeys(("anchor", "sync_share", "windows", "combine", "compress", "nested"),
                                f"resumed: chosen by the run that wrote {self.resumed_from}")
        else:
            cadence, why = choose(asked, comm.world, link, outer=self.outer_cfg is not None)
        self.el_che = cadence
        self._el_che_record = describe(asked, cadence, why, link)
        self.plan = Plan(cadence.anchor, (cadence.anchor,) * comm.world)
        # Live windows deal batches from a counter on the store (Cadence.windows): no plan, no probe.
        self._live = cadence.windows == "live" and comm.world > 1
        if self._live and cadence.nested is True:
            # Every candidate inner tier's process group, made now by all, so the tiers can be found inside the
            # first window while the slowest is still in its first batch.
            self._candidates = {ranks: comm.subgroup(ranks) for ranks in inner_candidates(comm.world)}

    def _describe(self) -> dict:
        return {"sync": self.sync, "world_size": self.comm.world, "batch_size": self.batch_size,
                "batching": self.batching, "max_tokens": self.max_tokens,
                "batches_per_epoch": self._units if self._batches is not None else None,
                "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps, "balance": self.balance,
                "gradient_accumulation_steps": self.accumulation, "precision": self.precision,
                "num_items_in_batch": self._counting,  # step takes the step's count of label items
                "samples_per_epoch": len(self.data), "seed": self.seed, "device": str(self.device),
                "el_che": self._el_che_record if self.el_che is not None else None,
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

    # ---- after each step or window: log, evaluate, checkpoint --------------------------------
    def _crossed(self, before: int, every: int | None) -> bool:
        return every is not None and self.step // every > before // every

    def _after(self, before: int) -> None:
        if self._bar is not None:
            self._bar.update(self.step - before)
        if self.eval_fn is not None and (self._crossed(before, self.eval_every) or self._done()):
            self._evaluate()
        if self.checkpoint_dir is not None and (self._crossed(before, self.checkpoint_every) or self._done()):
            self.save_checkpoint()

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


# ---- data --------------------------------------------------------------------------------------

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
