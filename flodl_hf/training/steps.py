"""The Trainer's optimizer steps: the user's closure on a batch, backward, clipping, the optimizer and
scheduler steps, and the loop of ``sync="ddp"`` and ``"none"``: one batch (or ``gradient_accumulation_steps``
micro-batches) per worker per step."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
from torch import nn

from flodl_hf.training.sync import TrainerConfigError, deal, split_by_speed


class StepsMixin:
    """:class:`~flodl_hf.training.trainer.Trainer`'s batches and optimizer steps, and its DDP (or unsynchronised)
    loop. Its run state is the Trainer's (set in ``_setup``)."""

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
            try:
                with self._quiet() if j < count - 1 else contextlib.nullcontext():
                    loss = self._forward_backward(indices, weight, divide, batches[j], total)
            except RuntimeError as exc:  # DDP all-reduces in backward (FSDP gathers and reduce-scatters)
                if self._collective_steps and _collective_failed(exc):
                    raise self.comm.lost("DDP's gradient all-reduce" if self.sync == "ddp" else
                                         "FSDP's all-gather or reduce-scatter", exc) from exc
                raise
            if total is not None and items[j] > 0:  # logged as the micro-batch's own mean over its items
                loss = loss * (float(total) / items[j])
            losses.append(loss)
            self.batches += 1
        self._optimizer_step()
        return losses

    @property
    def _collective_steps(self) -> bool:
        """Whether forward and backward run collectives (DDP, FSDP across workers)."""
        return self.sync in ("ddp", "fsdp") and self.comm.world > 1

    def _quiet(self):
        """The context of a micro-batch before a step's last: its gradients are not reduced yet."""
        if self.sync == "fsdp" and self.comm.world > 1:
            from flodl_hf.training.sync.fsdp import no_gradient_sync
            return no_gradient_sync(self.model)
        return self.wrapped.no_sync() if self.wrapped is not self.model else contextlib.nullcontext()

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
            if not chunks and self.sync in ("ddp", "fsdp"):
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
