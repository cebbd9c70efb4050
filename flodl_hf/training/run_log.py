"""What the Trainer records as it runs: each log point's or El Che window's record, evaluations on worker 0
(which the other workers wait for on the store), events, and worker 0's record tree and TensorBoard."""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import torch

from flodl_hf.training.sync import TrainerConfigError, TrainerError


class RecordMixin:
    """:class:`~flodl_hf.training.trainer.Trainer`'s records, evaluations and events. Its run state is the
    Trainer's (set in ``_setup``)."""

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
        if self.comm.rank == 0 or (self.sync == "fsdp" and inner is None):  # a sharded model: every worker
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
        if self.comm.rank != 0:  # sync="fsdp": every worker evaluated the sharded model, worker 0 records it
            return metrics, eval_s
        record = {"event": "eval", "step": step, "epoch": self.epoch, "time": round(now, 4),
                  "samples": self.samples if inner is None else inner[1], "eval_s": round(eval_s, 4), **metrics}
        self.history.append(record)
        self._log.event(record)
        if self._bar is not None:
            self._bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        return metrics, eval_s

    def _log_event(self, event: str, **fields: Any) -> None:
        if self.comm.rank == 0:
            record = {"event": event, **fields}
            if event != "start":
                self.history.append(record)
            self._log.event(record) if getattr(self, "_log", None) is not None else None


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
        from flodl_hf.training.records import RESOURCE_FIELDS, resource_fields
        ranks = []
        for r, row in enumerate(rows.tolist()):
            batches, samples, loss_sum, compute_ms = row[:4]
            numbers = {"samples": int(samples), "batches": int(batches),
                       "loss": loss_sum / samples if samples else None,
                       "samples_per_s": samples / wall if wall > 0 else None,
                       "ms_per_batch": compute_ms / batches if batches else None, "compute_ms": compute_ms,
                       "lr": rolled.get("lr"),
                       **resource_fields(row[-len(RESOURCE_FIELDS):])}
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
