"""The averaging plane: :class:`Comm` wraps the few ``torch.distributed`` collectives the trainer needs.

gloo on CPU, NCCL between GPUs, and a gloo group for averaging when a cohort mixes CPU and GPU
workers. A dead or silent peer becomes a :class:`WorkerLostError`. Also here: the point-to-point
works of ``ElChe(combine="lead")`` (:class:`LeadGradients`), the store's heartbeats
(:class:`Heartbeat`) and a window's all-reduce in flight (:class:`PendingWindow`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from flodl_hf.core.errors import TrainerConfigError, TrainerError, WorkerLostError
from flodl_hf.training.sync.packing import _by_dtype, _pack, _pack_carried, _take_change, _unflatten_into, _unpack


def _wire(t: torch.Tensor) -> torch.dtype:
    """The dtype a gradient travels in between workers: float32 for float16 and bfloat16."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


@dataclass
class LeadGradients:
    """Point-to-point works in flight, and the tensors they fill or read (kept alive until done):
    the other workers' gradients on their way to the lead (:meth:`Comm.lead_gradients`; on the
    lead one list per other worker), or the lead's parameters on their way back
    (:meth:`Comm.lead_exchange` with ``background``)."""

    works: list
    tensors: dict[int, list[torch.Tensor]]
    landed_at: float | None = None  # with watch(): when they had all landed (time.perf_counter)
    # On the lead, with compress: float32 buffers (kept between windows, like ``tensors``) that
    # the bfloat16 gradients are widened into once they have landed (:meth:`widen`).
    wide: dict[int, list[torch.Tensor]] | None = None
    _watcher: threading.Thread | None = field(default=None, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    def watch(self) -> None:
        """Wait for the works in a thread of this one's own, so that ``landed_at`` says when they have
        all landed, without blocking: gloo's works do not report it (``is_completed`` stays False
        until someone waits). :meth:`Comm.land` joins the thread. The thread also widens compressed
        gradients once they are in, while the lead's batch under way ends."""
        def wait() -> None:
            try:
                for work in self.works:
                    work.wait()
            except BaseException as exc:  # raised again in the caller's thread by Comm.land
                self._error = exc
            self.landed_at = time.perf_counter()
            if self._error is None:
                self.widen()

        self._watcher = threading.Thread(target=wait, name="flodl-hf gradients to the lead", daemon=True)
        self._watcher.start()

    @property
    def watched(self) -> bool:
        """Whether :meth:`watch` started a thread waiting for these works."""
        return self._watcher is not None

    def wait(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for the :meth:`watch` thread to end (the works done, the gradients
        widened, or an error kept for :meth:`Comm.land`); whether it has."""
        self._watcher.join(max(seconds, 0.0))
        return not self._watcher.is_alive()

    def widen(self) -> None:
        """Copy landed bfloat16 gradients into the float32 buffers of ``wide`` and take those as
        ``tensors`` (once; exact). Into buffers kept between windows: converting into fresh
        tensors took 71 ms a window on MiniLM (a 2-core AMD EPYC), copying into kept ones 11."""
        if self.wide is None:
            return
        with torch.no_grad():
            for r, landed in self.tensors.items():
                for into, t in zip(self.wide[r], landed):
                    into.copy_(t)
        self.tensors, self.wide = self.wide, None


def default_backend() -> str:
    """gloo on CPU; NCCL for CUDA tensors with gloo kept for CPU ones. ``FLODL_HF_BACKEND`` overrides."""
    if os.environ.get("FLODL_HF_BACKEND"):
        return os.environ["FLODL_HF_BACKEND"]
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def resolve_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    """``None`` picks this worker's GPU (``LOCAL_RANK``) when there is one, else the CPU."""
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise TrainerConfigError(f"device {device!r} is not a torch device ('cpu', 'cuda', 'cuda:1', ...)") from exc
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0 or (device.index is not None and device.index >= count):
                raise TrainerConfigError(f"device {str(device)!r}: this machine has {count} CUDA device(s)")
            if device.index is None:
                device = torch.device("cuda", local_rank % count)
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class Comm:
    """Rank, world size and the collectives of the averaging plane.

    ``plane`` is a group whose backend takes tensors on ``plane_device``: the model's GPU when
    every worker has one and the default backend speaks NCCL, else the CPU through gloo.
    A one-worker Comm makes every collective a no-op.
    """

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0, plane=None,
                 plane_device: torch.device = torch.device("cpu"), timeout: float = 0.0,
                 owns_group: bool = False) -> None:
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.plane, self.plane_device = plane, plane_device
        self.timeout, self.owns_group = timeout, owns_group
        self.same_device_type = True
        self._buffers: dict[torch.dtype, torch.Tensor] = {}  # reduce_window's, one per dtype

    @classmethod
    def connect(cls, device: str | torch.device | None, timeout: float) -> tuple["Comm", torch.device]:
        """Join (or start, from torchrun's environment) the process group; pick this worker's device."""
        owns = False
        if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group(backend=default_backend(), timeout=timedelta(seconds=timeout))
            owns = True
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            return cls(local_rank=local, owns_group=owns), resolve_device(device, local)
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        dev = resolve_device(device, local)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # NCCL works on the current device
        backend = str(dist.get_backend())
        # Only gloo takes CPU tensors; a NCCL-only default group gets a gloo group beside it.
        gloo = None if "gloo" in backend else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        # The timeout is ours only where we made the group; else it is whatever the script chose.
        comm = cls(rank, world, local, gloo, torch.device("cpu"), timeout if owns or gloo else 0.0, owns)
        kinds = comm.gather_floats([1.0 if dev.type == "cuda" else 0.0])[:, 0]
        comm.same_device_type = bool((kinds == kinds[0]).all())
        if dev.type == "cuda" and bool((kinds == 1).all()) and "nccl" in backend:
            comm.plane, comm.plane_device = None, dev
        return comm, dev

    def subgroup(self, ranks: Sequence[int]) -> "Comm | None":
        """A Comm over ``ranks`` only (its own process group), or None on a worker outside them.

        Every worker must call it with the same ranks (``dist.new_group``'s rule). The store
        (:meth:`counter`) stays the default group's, shared by all."""
        ranks = sorted(ranks)
        backend = "gloo" if self.plane is not None else None
        group = self._run("making a process group", dist.new_group, ranks, backend=backend,
                          timeout=timedelta(seconds=self.timeout) if self.timeout else None)
        if self.rank not in ranks:
            return None
        sub = Comm(ranks.index(self.rank), len(ranks), self.local_rank, group, self.plane_device, self.timeout)
        sub.same_device_type = self.same_device_type
        return sub

    def release(self) -> None:
        """Destroy the process group of a :meth:`subgroup` no collective will use again (local:
        ``dist.destroy_process_group`` of a group other than the default one waits for no one)."""
        if self.plane is not None and dist.is_initialized():
            dist.destroy_process_group(self.plane)
            self.plane = None

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    # ---- collectives, each failing with WorkerLostError ----------------------------------
    def _run(self, what: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            raise self.lost(what, exc, time.perf_counter() - start) from exc

    def lost(self, what: str, exc: BaseException, waited: float | None = None) -> WorkerLostError:
        """The WorkerLostError for a collective (``what``) that failed with ``exc``."""
        limit = f"{self.timeout:g}s" if self.timeout else "the process group's"
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        after = f" after {waited:.1f}s" if waited is not None else ""
        return WorkerLostError(
            f"worker {self.rank}/{self.world}: {what} failed{after}: another worker died or stopped answering, "
            f"or ran longer than the timeout ({limit}) in its own work. "
            "Check the other workers' logs; under torchrun with --max-restarts the run resumes from the last "
            f"checkpoint. Cause: {cause}")

    def gather_floats(self, values: Sequence[float]) -> torch.Tensor:
        """All-gather one row of numbers per worker: a ``(world, len(values))`` float64 CPU tensor."""
        row = torch.tensor([list(values)], dtype=torch.float64)
        if self.world == 1:
            return row
        row = row.to(self.plane_device)
        out = [torch.empty_like(row) for _ in range(self.world)]
        self._run("gathering worker statistics", dist.all_gather, out, row, group=self.plane)
        return torch.cat(out).cpu()

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` on every worker with worker ``src``'s values."""
        if self.world == 1:
            return
        for _, group in _by_dtype(tensors).items():
            flat = torch.cat([t.detach().reshape(-1).to(self.plane_device) for t in group])
            self._run("broadcasting parameters", dist.broadcast, flat, src, group=self.plane)
            _unflatten_into(flat, group)

    def average_(self, tensors: Sequence[torch.Tensor], weight: float) -> None:
        """In place: every worker ends with ``sum_r weight_r * x_r``; the weights sum to 1."""
        self.reduce_window([(tensors, weight)])

    def reduce_window(self, parts: Sequence[tuple], stats: Sequence[float] = ()) -> torch.Tensor:
        """Weighted sums in place, with every worker's ``stats`` row riding along.

        For each ``(tensors, weight)`` part (floating-point tensors), every worker ends with
        ``sum_r weight_r * x_r``. A part ``(tensors, weight, starts)`` sums changes instead:
        every worker ends with ``start + sum_r weight_r * (x_r - start)``, the starts being the
        same bits on every worker. A part ``(tensors, weight, starts, residuals)`` sends its
        changes in bfloat16 (``ElChe(compress="bf16")``): each worker sends ``c_r =
        bf16(weight_r * (x_r - start) + residual_r)``, keeps ``residual_r`` (float32, its own)
        as what that rounding left out, and every worker ends with ``start + bf16(sum_r c_r)``.
        Returns the ``(world, len(stats))`` float64 matrix of all workers' rows. All of it is
        one all-reduce per dtype (low-precision tensors are summed in float32), since on gloo
        each collective costs a millisecond or more whatever its size; and every worker
        receives the same bits. The tensors are packed into one buffer per dtype, kept between
        windows, with the change and the weight computed on the way in and the start added back
        on the way out: on MiniLM's 22M parameters that is three passes over them, not six.
        """
        return self.launch_window(parts, stats).wait()

    def launch_window(self, parts: Sequence[tuple], stats: Sequence[float] = ()) -> "PendingWindow":
        """Pack ``parts`` and start their all-reduce (:meth:`reduce_window`'s parts and stats);
        the returned :class:`PendingWindow`'s ``wait()`` lands it and returns the stats matrix."""
        row = torch.tensor([list(stats)], dtype=torch.float64)
        if self.world == 1:
            return PendingWindow(self, row, [])
        groups: dict[torch.dtype, list[tuple]] = {}
        for i, (tensors, weight, *rest) in enumerate(parts):
            starts = rest[0] if rest and rest[0] is not None else [None] * len(tensors)
            residuals = rest[1] if len(rest) > 1 else [None] * len(tensors)
            for t, s, r in zip(tensors, starts, residuals, strict=True):
                if r is not None:
                    wire = torch.bfloat16  # the compressed changes travel in a buffer of their own
                else:
                    wire = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype
                groups.setdefault(wire, []).append((t, weight, s, r))
        # The stats ride in full precision: float32 (or float64) parameters' buffer, else their own.
        carrier = next((d for d in (torch.float32, torch.float64) if d in groups), None)
        if len(stats) and carrier is None:
            carrier = torch.float64
            groups[carrier] = []
        landings = []
        for dtype, members in groups.items():
            extra = self.world * len(stats) if dtype == carrier else 0
            flat = self._buffer(dtype, sum(m[0].numel() for m in members) + extra, self._buffers)
            offset = 0
            with torch.no_grad():
                for t, w, s, r in members:
                    if r is None:
                        _pack(flat[offset:offset + t.numel()], t, w, s)
                    else:
                        _pack_carried(flat[offset:offset + t.numel()], t, w, s, r)
                    offset += t.numel()
                if extra:
                    # Each worker writes its row into its own slots; the sum is then a gather.
                    slots = flat[offset:].view(self.world, len(stats))
                    slots.zero_()
                    slots[self.rank] = row[0].to(dtype)
            work = self._run("averaging parameters", dist.all_reduce, flat, dist.ReduceOp.SUM,
                             group=self.plane)
            landings.append((members, flat, work, extra, len(stats)))
        return PendingWindow(self, row, landings)

    def lead_gradients(self, graded: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None = None,
                       lead: int = 0, carried: Sequence[torch.Tensor] | None = None,
                       compress: bool = False) -> "LeadGradients | None":
        """Start moving the other workers' gradients to worker ``lead``, for :meth:`lead_exchange`.

        On the lead: post one receive per tensor of ``graded`` and per other worker, into buffers
        kept between windows. Call it at the window's start, before the gradients exist: they then
        land while the lead computes (gloo moves them in its own threads), and only the lead's
        parameters travel after the window's end. On the others: send ``grads`` (one per tensor of
        ``graded``, None: zeros), as soon as they are final. Low-precision gradients travel in
        float32. ``compress`` (every worker alike; the others give ``carried``, one float32 tensor
        per gradient) sends them in bfloat16, plus what earlier windows' rounding left in
        ``carried``, which keeps what this rounding leaves out (error feedback). None on a single
        worker."""
        if self.world == 1:
            return None
        plane = self.plane_device
        if self.rank == lead:
            buffers = {r: [self._buffer(("lead grad", r, i), p.numel(), self._buffers,
                                        torch.bfloat16 if compress else _wire(p)).view(p.shape)
                           for i, p in enumerate(graded)] for r in range(self.world) if r != lead}
            works = [self._run("receiving gradients from worker", dist.irecv, t, self._global(r), group=self.plane)
                     for r, into in buffers.items() for t in into]
            wide = {r: [self._buffer(("lead grad wide", r, i), t.numel(), self._buffers, torch.float32).view(t.shape)
                        for i, t in enumerate(into)] for r, into in buffers.items()} if compress else None
            return LeadGradients(works, buffers, wide=wide)
        if grads is None or len(grads) != len(graded):
            raise TrainerConfigError(f"lead_gradients on worker {self.rank}: one gradient (or None) per tensor, "
                                     f"{len(graded)} of them")
        if compress and (carried is None or len(carried) != len(graded)):
            raise TrainerConfigError(f"lead_gradients on worker {self.rank}: compress needs one carried "
                                     f"remainder per gradient, {len(graded)} of them")
        outgoing, works = [], []
        for i, (p, g) in enumerate(zip(graded, grads)):
            g = (torch.zeros(p.shape, dtype=_wire(p), device=plane) if g is None
                 else g.detach().to(plane, _wire(g)).contiguous())
            if compress:  # packed tensor by tensor, each sent at once: the packing overlaps the sends
                view = self._buffer(("lead grad out", i), g.numel(), self._buffers, torch.bfloat16)
                with torch.no_grad():
                    _pack_carried(view, g, 1.0, None, carried[i])
                g = view.view(g.shape)
            outgoing.append(g)
            works.append(self._run("sending gradients to the lead", dist.isend, g, self._global(lead),
                                   group=self.plane))
        return LeadGradients(works, {self.rank: outgoing})

    def lead_exchange(self, params: Sequence[torch.Tensor], moving: "LeadGradients | None", weights: Sequence[float],
                      step: Callable[[list[torch.Tensor]], None], lead: int = 0,
                      start: Sequence[torch.Tensor] | None = None, carried: Sequence[torch.Tensor] | None = None,
                      background: bool = False) -> "LeadGradients | None":
        """``ElChe(combine="lead")``'s sync, after :meth:`lead_gradients` (``moving``): worker
        ``lead`` waits for the others' gradients, calls ``step`` on ``sum_r weights[r] * g_r``
        (added in rank order; a weight of 1 adds the gradient as it came, so one other worker's
        arrives bit for bit), then sends its ``params`` back to all: every worker ends with the
        lead's bits. ``params`` starts with the tensors the gradients are for; the rest (float
        buffers) only go from the lead to the others.

        ``start`` (with ``compress`` in :meth:`lead_gradients`): the shared point every worker
        holds, one tensor per gradient, the same bits on all. The lead then sends its change since
        it in bfloat16, plus the remainder it ``carried`` from earlier windows (error feedback),
        and every worker, the lead too, takes ``start`` plus that rounded change as its parameters
        and as the next ``start``: all end with the same bits, half the bytes on the way back.

        ``background=True``: the lead does not wait for its sends. It returns them in flight (a
        :class:`LeadGradients` of the works and the tensors they read, float buffers from copies)
        and goes on to its next window, while gloo's threads move the parameters; it must
        :meth:`finish` their works before it changes its parameters (its next optimizer step). The
        others wait for them as before. None elsewhere.

        Point-to-point, one send per tensor, with no packing: on gloo, MiniLM's 126 tensors went
        one way and back in 57 ms, where packed into one buffer they took 121 and the packed
        all-reduce of a window's changes 136 (``scripts/bench_sync.py``)."""
        if self.world == 1:
            return None
        peers = [r for r in range(self.world) if r != lead]
        plane = self.plane_device

        shared = len(start) if start is not None else 0  # sent as bfloat16 changes from ``start``
        if self.rank != lead:
            self.land(moving, "sending gradients to the lead")
            landing = [self._buffer(("lead params in", i), p.numel(), self._buffers, torch.bfloat16) if i < shared
                       else p.data if p.is_contiguous() and p.device == plane else
                       torch.empty(p.shape, dtype=p.dtype, device=plane) for i, p in enumerate(params)]
            works = [self._run("receiving the lead's parameters", dist.irecv, t, self._global(lead), group=self.plane)
                     for t in landing]
            with torch.no_grad():  # each tensor taken as it lands, while the next ones travel
                for i, (p, t, work) in enumerate(zip(params, landing, works)):
                    self._run("receiving the lead's parameters", work.wait)
                    if i < shared:
                        _take_change(t, p.data, start[i])
                    elif t is not p.data:
                        p.copy_(t)
            return None
        self.land(moving, "receiving gradients from the other workers")
        moving.widen()  # compress: summed in float32 (a watching thread has widened them already)
        summed = moving.tensors[peers[0]]
        with torch.no_grad():
            for n, r in enumerate(peers):
                more = moving.tensors[r]
                if weights[r] != 1.0:
                    for t in more:
                        t.mul_(weights[r])
                if n:
                    for total, t in zip(summed, more):
                        total.add_(t)
        graded = params[:len(summed)]
        step([t if t.device == p.device else t.to(p.device) for t, p in zip(summed, graded)])
        outgoing, works = [], []
        with torch.no_grad():
            for i, p in enumerate(params):
                if i < shared:  # the change since the shared point, rounded with the remainder carried
                    view = self._buffer(("lead params out", i), p.numel(), self._buffers, torch.bfloat16)
                    _pack_carried(view, p.data, 1.0, start[i], carried[i])
                    _take_change(view, p.data, start[i])
                    t = view
                elif background and i >= len(graded):  # a float buffer: the next forward may change it
                    t = p.detach().to(plane, copy=True).contiguous()
                else:
                    t = p.detach().to(plane).contiguous()
                outgoing.append(t)
                # Sent as soon as packed: the next tensors' packing overlaps this one's travel (each
                # peer still gets the tensors in order, as its receives were posted).
                works += [self._run("sending the lead's parameters", dist.isend, t, self._global(r), group=self.plane)
                          for r in peers]
        if background:
            return LeadGradients(works, {lead: outgoing})
        self.finish(works)
        return None

    def land(self, flight: LeadGradients, what: str) -> None:
        """Wait until every work of ``flight`` is done (joining its :meth:`LeadGradients.watch`
        thread, if any), then drop the works: a gloo receive waited on twice waits for another message."""
        if not flight.watched:
            self.finish(flight.works, what)
        else:
            def joined() -> None:
                flight._watcher.join()
                if flight._error is not None:
                    raise flight._error

            self._run(what, joined)
        flight.works = []

    def finish(self, works: Sequence, what: str = "sending the lead's parameters") -> None:
        """Wait for point-to-point works in flight (those :meth:`lead_exchange` left running with
        ``background``), each failing with :class:`WorkerLostError`."""
        for work in works:
            self._run(what, work.wait)

    def _global(self, rank: int) -> int:
        """The default group's rank of this Comm's ``rank`` (point-to-point calls take those)."""
        return rank if self.plane is None else dist.get_global_rank(self.plane, rank)

    def _buffer(self, key, numel: int, buffers: dict, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The buffer for ``key`` (a dtype, or a name and ``dtype``), kept between windows."""
        flat = buffers.get(key)
        if flat is None or flat.numel() != numel or (dtype is not None and flat.dtype != dtype):
            flat = buffers[key] = torch.empty(numel, dtype=dtype or key, device=self.plane_device)
        return flat

    def counter(self, key: str, add: int, what: str = "updating the window's shared counter") -> int:
        """Add ``add`` to the integer at ``key`` on the process group's store; return the new value.

        Atomic across workers (the store serialises it), so ``counter(k, 1) - 1`` hands out
        0, 1, 2, ... once each; ``add=0`` reads. One round trip to the store's host.
        """
        store = dist.distributed_c10d._get_default_store()
        return int(self._run(what, store.add, key, add))

    def settle(self, key: str, proposal: str, what: str = "settling a shared decision") -> str:
        """The value at ``key`` on the store, set to ``proposal`` if it is still unset or empty:
        the first worker to propose wins, and every worker reads the winner (``""`` proposes
        nothing, a read). One round trip to the store's host."""
        store = dist.distributed_c10d._get_default_store()
        got = self._run(what, store.compare_set, key, "", proposal)
        return got.decode() if isinstance(got, bytes) else str(got)

    def drop_keys(self, keys: Sequence[str]) -> None:
        """Delete store keys no worker reads any more (a closed window's counters)."""
        store = dist.distributed_c10d._get_default_store()
        for key in keys:
            self._run("clearing the window's shared counter", store.delete_key, key)

    def heartbeat(self, key: str, interval: float, also: str | None = None) -> "Heartbeat":
        """Announce work the other workers wait for through :meth:`wait_for_peer` (worker 0's
        evaluation), and beat ``key/beat`` on the store every ``interval`` seconds from a thread of
        its own until :meth:`Heartbeat.end`; ``also``, a second counter beaten alike (a nested
        window's ``alive``, which the outer tier watches through :meth:`wait_for_arrival`)."""
        for beat in (f"{key}/beat", also):
            if beat is not None:
                self.counter(beat, 1, "announcing work the other workers wait for")
        return Heartbeat(self, key, interval, also)

    def wait_for_peer(self, key: str, what: str, timeout: float, readers: int | None = None) -> bool:
        """Wait for the end a peer's :class:`Heartbeat` publishes at ``key/done``, however long its
        work takes while its beats go on; whether the work succeeded. Raise :class:`WorkerLostError`
        once the beats have stopped for ``timeout`` seconds (counted from this call until the first
        one is seen), or at once when the store's host is gone. Polled every 5 ms at first, less
        often as the wait goes on, at least every ``min(1, timeout / 10)`` seconds. The last of the
        ``readers`` (every worker but the peer by default; a nested window's inner tier but worker 0
        for an evaluation at its inner sync) to read the end tells the peer at ``key/read``."""
        outcome = self._await(f"{key}/done", f"{key}/beat", what, timeout)
        if self.counter(f"{key}/readers", 1, what) == (self.world - 1 if readers is None else readers):
            self.settle(f"{key}/read", "1", what)
        return outcome == "done"

    def wait_for_arrival(self, key: str, alive: str, what: str, timeout: float) -> None:
        """Wait until ``key`` is set on the store (:meth:`arrive`), for as long as the counter
        ``alive`` moves (a :class:`Heartbeat`'s ``also``); raise :class:`WorkerLostError` once it has
        been still for ``timeout`` seconds, or at once when the store's host is gone. A nested
        window's outer tier waits so for the inner tier before the outer sync, while worker 0
        evaluates at an inner sync for longer than a collective may wait."""
        self._await(key, alive, what, timeout)

    def arrive(self, key: str) -> None:
        """Set ``key`` on the store: what :meth:`wait_for_arrival` waits for."""
        self.settle(key, "1", "announcing the end of the inner tier's windows")

    def _await(self, key: str, beats_key: str, what: str, timeout: float) -> str:
        """Poll the store until ``key`` holds a value, and return it, while the counter ``beats_key``
        moves at least every ``timeout`` seconds."""
        interval = min(1.0, timeout / 10)
        start = seen_at = time.perf_counter()
        beats, pause = -1, min(0.005, interval)
        while not (outcome := self.settle(key, "", what)):
            now_beats, now = self.counter(beats_key, 0, what), time.perf_counter()
            if now_beats != beats:
                beats, seen_at = now_beats, now
            elif now - seen_at > timeout:
                raise self.lost(what, TimeoutError(f"no heartbeat for {now - seen_at:.1f}s (timeout {timeout:g}s)"),
                                now - start)
            time.sleep(pause)
            pause = min(2 * pause, interval)
        return outcome

    def any_flag(self, flag: bool) -> bool:
        """True on every worker if it is true on any."""
        if self.world == 1:
            return flag
        return bool(self.gather_floats([float(flag)]).max() > 0)

    def barrier(self) -> None:
        if self.world > 1:
            self.gather_floats([0.0])

    def check_identical(self, tensors: Sequence[torch.Tensor], where: str) -> None:
        """Raise TrainerError unless every worker holds bit-identical ``tensors``."""
        digest = hashlib.blake2b(digest_size=6)
        for t in tensors:
            digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        mine = float(int.from_bytes(digest.digest(), "little"))  # 48 bits fit a float64 exactly
        seen = self.gather_floats([mine])[:, 0]
        if not bool((seen == seen[0]).all()):
            raise TrainerError(f"workers hold different parameters after {where}: digests {seen.tolist()}")


class Heartbeat:
    """The beats of :meth:`Comm.heartbeat`: a daemon thread adds 1 to ``key/beat`` on the store every
    ``interval`` seconds, so a waiting worker tells work that runs long from a process that died or
    froze (its beats stop; a store hosted in that process stops answering). Beats from a thread
    prove the process alive, not that the work advances: work stuck while its process runs is
    waited for, and C code holding the GIL for longer than the waiters' ``timeout`` reads as frozen."""

    def __init__(self, comm: Comm, key: str, interval: float, also: str | None = None) -> None:
        self.comm, self.key = comm, key
        self._stop = threading.Event()
        store = dist.distributed_c10d._get_default_store()
        beats = [f"{key}/beat"] + ([also] if also is not None else [])

        def beat() -> None:
            while not self._stop.wait(interval):
                try:
                    for name in beats:
                        store.add(name, 1)
                except RuntimeError:  # the store's host is gone: the waiting workers see it themselves
                    return

        self._thread = threading.Thread(target=beat, name="flodl-hf heartbeat", daemon=True)
        self._thread.start()

    def end(self, ok: bool) -> None:
        """Stop beating and publish the end for :meth:`Comm.wait_for_peer`: ``ok``, whether the work
        succeeded. Then, on success, wait until every other worker has read it (a store this process
        hosts must outlive their reads: the run may end here) and delete the keys."""
        self._stop.set()
        self._thread.join()
        comm, key = self.comm, self.key
        comm.settle(f"{key}/done", "done" if ok else "failed", "publishing the end of work the others wait for")
        if ok:
            store = dist.distributed_c10d._get_default_store()
            comm._run("waiting for the other workers to read the end of its work", store.wait, [f"{key}/read"])
            comm.drop_keys([f"{key}/{name}" for name in ("beat", "done", "readers", "read")])


class PendingWindow:
    """A window's all-reduce, started by :meth:`Comm.launch_window`; ``wait()`` lands it once."""

    def __init__(self, comm: Comm, row: torch.Tensor, landings: list) -> None:
        self.comm, self._row, self._landings = comm, row, landings

    def wait(self) -> torch.Tensor:
        """Wait for the all-reduce, write the sums where they go; return every worker's stats row."""
        gathered = self._row
        for members, flat, work, extra, width in self._landings:
            if work is not None:
                self.comm._run("averaging parameters", work.wait)
            offset = 0
            with torch.no_grad():
                for t, _, s, _ in members:
                    _unpack(flat[offset:offset + t.numel()], t, s)
                    offset += t.numel()
            if extra:
                gathered = flat[offset:].view(self.comm.world, width).to("cpu", torch.float64, copy=True)
        self._landings = []
        return gathered
