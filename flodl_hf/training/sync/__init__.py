"""The averaging plane and the synchronisation policies the trainer runs on it.

Everything here sits on ``torch.distributed``: gloo on CPU, NCCL between GPUs, and a
gloo group for averaging when a cohort mixes CPU and GPU workers. There is no transport
of our own. Two pure functions hold El Che's arithmetic (:func:`plan_window`, :func:`deal`)
so they can be tested without processes; :class:`Comm` wraps the few collectives the
trainer needs and turns a dead or silent peer into a :class:`WorkerLostError`.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from flodl_hf.core.errors import TrainerConfigError, TrainerError, WorkerLostError  # noqa: F401  (raised here, re-exported)


# ---- policies -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ElChe:
    """Local SGD whose cadence is set by the slowest worker.

    Per window the slowest worker runs ``anchor`` batches and every other worker as many as it
    does in the same time. Counts move only when the new value differs by more than
    ``dead_zone``; the anchor grows when averaging costs more than ``sync_share`` of a window
    and shrinks when it costs under ``sync_share * shrink_below`` (by at most a factor of two per
    window), within ``[min_anchor, max_anchor]``. ``adaptive=False`` keeps every worker at ``anchor`` batches
    per window: plain local SGD with a fixed cadence (DiLoCo's inner steps).

    ``combine`` is how a window's work becomes the next shared point:

    - ``"average"``: the samples-weighted mean of the workers' parameters. Safe at any window
      length, but a worker's progress counts only in proportion to its share: with speeds 3 : 1
      a window moves as ``3/4 * 3 + 1/4 * 1 = 2.5`` batches would, less than the fast worker
      alone does in the same time.
    - ``"sum"``: the start point plus every worker's change since it (``s + sum_r (x_r - s)``),
      the first-order equivalent of one worker running all the window's batches in a row, so
      the cohort's throughput is its progress (4 batches' worth at 3 : 1), to first order. It
      needs windows short enough for the changes to add (a few batches each) and one more copy
      of the parameters; docs/benchmarks.md measures what it gains.
    - ``"lead"``: one optimizer, worker 0's (the lead: launch the fastest device as rank 0).
      The lead trains as it would alone; every other worker only computes gradients, at the
      window's start, over its batches of the window (their mean by samples). As its window
      ends each sends them to the lead, whose receives were posted at its window's start
      (:meth:`Comm.lead_gradients`), so they land while the lead finishes its last batch; the
      lead takes their sum by samples as one more optimizer step and sends its parameters back
      (:meth:`Comm.lead_exchange`). So the others' batches cost the
      optimizer only their staleness, where ``"sum"`` adds separate optimizers' changes: on the SMS
      fine-tune at 3 : 1 the one-process replay (``scripts/sim_el_che.py``, ``stale``) needed
      1.07x the fast worker alone's samples to the target, ``"sum"`` 1.14x; live, on 10 seeds, it
      took 0.86x the fast worker alone's time where ``"sum"`` took 0.94x (with ``extrapolate`` and
      the gradients landing during the lead's last batch; 0.89x against 0.95x before them; 0.84x
      with the lead's side below). After the lead's window ends, a sync costs the lead its optimizer
      step: it starts its next window while its parameters travel to the others (43 ms for
      MiniLM's over gloo, where both ways took 70), and waits for those sends before its next
      step. In live windows the lead trains on until the others' gradients have landed, not only
      until their batches end: across a 1 Gbit/s link that took one optimizer from 1.13x the fast
      worker alone's time to 0.89x. Float buffers are the lead's. With
      ``compress="bf16"`` the gradients travel in bfloat16 (each other worker carries what the
      rounding leaves out to its next window's), and so does the lead's change since the shared
      point, which every worker, the lead too, adds to that point: all still end each sync with the
      same bits, for half the bytes each way. Not with ``nested``, ``overlap`` or an outer
      optimizer.

      ``extrapolate`` (on by default with ``"lead"``) takes the others' gradients where the lead
      is expected to be when it steps on them, not at the window's start: the start plus
      ``k / (k + 1)`` of the last window's move, ``k`` being the lead's batches in that window
      (the look-ahead of DANA, Hakimi et al. 2019, for the staleness of asynchronous SGD). The
      lead's move over a window changes slowly, so the gradient is taken closer to the point it
      is applied at: the replay at 3 : 1 needed 1.04x the fast worker alone's samples, against
      1.07x without (better on each of 6 seeds); live, on 5 seeds, the two were within the noise
      (598 and 602 samples). It costs each other worker one more copy of the
      trainable parameters (the last window's start) and one pass over them per window (in
      cache-sized blocks: 38 ms on 29.4M float32 elements);
      ``extrapolate=False`` takes the gradients at the window's start.

    ``windows`` is how a window's batches reach the workers:

    - ``"planned"``: each worker runs the plan's count of batches (from the measured speeds),
      dealt from the epoch's order in rank order. Deterministic: a run, and a resumed run,
      repeat bit for bit. A fresh cohort's first window is a one-batch probe, and whole
      batches of uneven length seldom fill a window evenly, so the first to finish waits.
    - ``"live"``: batches are claimed one at a time from a counter on the process group's
      store, in the epoch's order, and the window closes once every worker has run ``anchor``
      batches: the slowest sets the length and the others run as many as fit, with no speed
      estimate needed (no probe). A worker past its ``anchor`` starts another batch only if
      the window's batches per second gain by it: if it would end less than the window's time
      per batch after the slowest is expected to (:func:`live_overrun_ms`). Every sample is still trained on
      once per epoch and every worker holds the same parameters after each sync, but which
      worker trains on which batch depends on timing, so runs do not repeat bit for bit.

    ``compress="bf16"`` sends each worker's change of the trainable parameters since the
    window's start in bfloat16, half the bytes of float32 (torch's ``bf16_compress_hook`` does
    this for DDP's gradients): for hosts behind a slow link. What bfloat16 cannot carry of a
    worker's change stays with that worker (error feedback) and goes out with its next window's,
    so no change is lost, only delayed; the sum of the workers' bfloat16 changes is rounded to
    bfloat16 once more, not fed back. Every worker still ends a sync with the same bits. It
    keeps two more float32 copies of the trainable parameters (the start and the carried
    remainder) and costs four passes over them per sync, so on a fast link it saves little.
    ``None`` (the default) sends full precision.

    ``nested=True`` (live windows) stops a much slower worker from setting everyone's cadence.
    The cohort is split into tiers by speed. With 3 to 6 workers that happens inside the first
    window (:func:`probe_tiers`): once two or more workers have ended a batch and the rest are
    still in their first after twice the slowest of those, the rest are the outer tier, and the
    others go on in nested windows at once (every candidate inner tier's process group is made at
    the start, :func:`inner_candidates`). Otherwise, or with more workers, the first window probes
    the speeds (one batch of the slowest, whatever ``anchor`` says) and after it the cohort is
    split at the widest gap in speed (:func:`nest_tiers`):
    when the slower side is at least twice as slow as the faster and the faster side has two
    workers or more, the faster workers sync among themselves every window of their own (their
    slowest runs ``min_anchor`` batches), and the slower ones join them only at the outer window,
    ``anchor`` of their batches, adding their change to the inner tier's (``"sum"``), or averaged
    with it by samples (``"average"``: the inner tier weighs its samples of the whole outer window,
    and averages by samples at its own syncs too). ``nested=(inner_ranks, outer_ranks)`` names the
    tiers instead (a card you know is slow), and nests from the first window. With speeds
    1 : 1/3 : 1/12 the fast pair syncs every 3 + 1 batches and the slowest every 12 + 4 + 1, where
    flat windows would hold the pair to 12 + 4 between syncs. Evaluation, checkpoints and the
    record's windows happen at the outer syncs, where every worker holds the same parameters;
    DiLoCo's outer step too; worker 0, when inner, also evaluates at the inner syncs. The split
    is decided once per fit.

    ``overlap=True`` hides the sync behind the next window, for hosts behind a slow link. At a
    window's end only the window's statistics are gathered (a few numbers); the workers' changes
    go into an all-reduce that runs in the background while each worker goes on from its own end
    of the window, and land at the next window's end. Every worker keeps the shared point (its
    start plus every change that has landed, the same bits on all) and trains from it plus its
    own latest change, so the others' changes reach it one window late: at 3 : 1 on the SMS
    fine-tune that costs 1.08x to 1.09x the samples of ``"sum"`` (the bench, and
    ``scripts/sim_el_che.py --variants overlap``). Across a 1 Gbit/s link, where the sync took 15%
    of a window, El Che went from 1.12x to 1.07x the fast worker alone's time; on loopback (3%) it
    gains nothing (docs/benchmarks.md).
    Before an evaluation at the run's end, a checkpoint or a stop, the change in flight lands and
    every worker takes the shared point, so checkpoints and the trained model are synced as
    always; evaluations in between see worker 0's own parameters. It keeps three more copies of
    the trainable parameters. It works with either ``windows`` and ``compress``, not with
    ``nested`` or an outer optimizer (DiLoCo's step needs the window's combined change at once).
    """

    anchor: int = 4
    min_anchor: int = 1
    max_anchor: int = 64
    dead_zone: float = 0.10
    sync_share: float = 0.10
    shrink_below: float = 0.25
    adaptive: bool = True
    combine: str = "average"
    windows: str = "planned"
    compress: str | None = None
    nested: bool | tuple[tuple[int, ...], tuple[int, ...]] = False
    overlap: bool = False
    extrapolate: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.nested, bool):
            try:
                inner, outer = (tuple(sorted(int(r) for r in tier)) for tier in self.nested)
            except (TypeError, ValueError):
                raise TrainerConfigError(f"ElChe nested must be True, False or (inner ranks, outer ranks), "
                                         f"got {self.nested!r}") from None
            if len(inner) < 2 or not outer or set(inner) & set(outer) or min(inner + outer) < 0 \
                    or len(set(inner)) != len(inner) or len(set(outer)) != len(outer):
                raise TrainerConfigError(f"ElChe nested={self.nested!r}: the tiers must be disjoint ranks, "
                                         "two or more inner and one or more outer")
            object.__setattr__(self, "nested", (inner, outer))
        if self.nested and (self.windows != "live" or self.compress is not None):
            raise TrainerConfigError(f"ElChe nested={self.nested!r} needs windows='live', without compress; got "
                                     f"windows={self.windows!r}, compress={self.compress!r}")
        if self.overlap not in (True, False):
            raise TrainerConfigError(f"ElChe overlap must be True or False, got {self.overlap!r}")
        if self.overlap and self.nested:
            raise TrainerConfigError(f"ElChe overlap=True does not go with nested={self.nested!r}: the inner "
                                     "tier's syncs would land a window late in the outer one")
        if self.combine not in ("average", "sum", "lead"):
            raise TrainerConfigError(f"ElChe combine must be 'average', 'sum' or 'lead', got {self.combine!r}")
        if self.combine == "lead" and (self.nested or self.overlap):
            raise TrainerConfigError(f"ElChe combine='lead' sends parameters one way and gradients the other: not "
                                     f"with nested={self.nested!r} or overlap={self.overlap!r}")
        if self.extrapolate not in (None, True, False):
            raise TrainerConfigError(f"ElChe extrapolate must be None, True or False, got {self.extrapolate!r}")
        if self.extrapolate and self.combine != "lead":
            raise TrainerConfigError(f"ElChe extrapolate=True moves where the others take gradients for the lead: "
                                     f"it needs combine='lead', got combine={self.combine!r}")
        if self.extrapolate is None:
            object.__setattr__(self, "extrapolate", self.combine == "lead")
        if self.windows not in ("planned", "live"):
            raise TrainerConfigError(f"ElChe windows must be 'planned' or 'live', got {self.windows!r}")
        if self.compress not in (None, "bf16"):
            raise TrainerConfigError(f"ElChe compress must be None or 'bf16', got {self.compress!r}")
        if not 1 <= self.min_anchor <= self.anchor <= self.max_anchor:
            raise TrainerConfigError(
                f"ElChe needs 1 <= min_anchor <= anchor <= max_anchor, got "
                f"{self.min_anchor}, {self.anchor}, {self.max_anchor}")
        if not 0 < self.sync_share < 1 or not 0 <= self.shrink_below < 1 or self.dead_zone < 0:
            raise TrainerConfigError("ElChe needs 0 < sync_share < 1, 0 <= shrink_below < 1 and dead_zone >= 0")


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


@dataclass(frozen=True)
class DiLoCo:
    """Outer optimizer for El Che: the averaged change of a window is a pseudo-gradient for SGD.

    ``lr=1, momentum=0`` is plain averaging. ``reset_inner`` clears each worker's inner
    optimizer state after every outer step.
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    reset_inner: bool = False


@dataclass(frozen=True)
class Plan:
    """Batches per worker for the next window; ``counts[slowest] == anchor``."""

    anchor: int
    counts: tuple[int, ...]


def plan_window(ms_per_batch: Sequence[float | None], sync_ms: float | None, prev: Plan, cfg: ElChe) -> Plan:
    """The next window's plan from the measured time per batch (one per worker) and sync time.

    Pure: every worker calls it on the same all-gathered numbers and gets the same plan.
    ``sync_ms=None`` (not measured yet) keeps the anchor; a worker with no measurement yet
    (``None``) keeps the whole plan as it is.
    """
    if not cfg.adaptive or len(ms_per_batch) != len(prev.counts) or any(ms is None or not ms > 0 for ms in ms_per_batch):
        return prev
    slow = max(ms_per_batch)
    anchor = prev.anchor
    if sync_ms is not None:
        # The share is judged on a full window (anchor batches of the slowest), so a window cut
        # short at an epoch tail does not look sync-bound.
        share = sync_ms / (anchor * slow + sync_ms) if sync_ms > 0 else 0.0
        # Both moves aim at half the target share: inside the band, so noise does not flip it back.
        aim = cfg.sync_share / 2
        needed = math.ceil(sync_ms * (1 - aim) / (aim * slow))
        # At most a factor of two per window, so one noisy measurement cannot swing the cadence.
        if share > cfg.sync_share:
            anchor = min(max(anchor + 1, needed), 2 * anchor)
        elif share < cfg.sync_share * cfg.shrink_below:
            smaller = max(min(anchor - 1, needed), anchor // 2, cfg.min_anchor)
            # Whole batches cannot split a short window evenly (3.4 fast batches per slow one run as
            # 3, and the fast worker waits): shrink only as far as the sync and that rounding wait
            # together stay within the target share.
            # (Live windows have no planned counts to round.)
            while cfg.windows == "planned" and smaller < anchor and \
                    (sync_ms + rounding_wait(smaller, ms_per_batch)) / (smaller * slow + sync_ms) > cfg.sync_share:
                smaller += 1
            anchor = smaller
        anchor = min(max(anchor, cfg.min_anchor), cfg.max_anchor)
    counts = []
    for ms, old in zip(ms_per_batch, prev.counts):
        new = max(1, round(anchor * slow / ms))
        if anchor == prev.anchor and abs(new - old) <= cfg.dead_zone * old:
            new = old
        counts.append(new)
    return Plan(anchor, tuple(counts))


def live_overrun_ms(ms_per_batch: Sequence[float], sync_ms: float | None, anchor: int) -> float:
    """How long past the slowest worker's expected end a live window may run for one more batch.

    One more batch adds one batch to the window's ``W`` and ``overrun`` milliseconds to its length
    ``T`` (the others wait), so it raises the cohort's batches per second, ``(W + 1) / (T + overrun)``
    against ``W / T``, exactly when ``overrun < T / W``: the window's time per batch. ``T`` is
    ``anchor`` batches of the slowest plus the sync, ``W`` every worker's share of that time.
    Pure, like :func:`plan_window`: every worker computes it from the same smoothed speeds.
    """
    window = anchor * max(ms_per_batch)
    batches = sum(window / ms for ms in ms_per_batch)
    return (window + (sync_ms or 0.0)) / batches


NEST_GAP = 2.0  # nested windows: the slower tier is at least this many times slower than the faster


def nest_tiers(ms_per_batch: Sequence[float | None]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The (inner, outer) ranks of nested windows (``ElChe(nested=True)``), or None for flat windows.

    Workers sorted by time per batch are cut at the widest ratio between neighbours; the cut is
    taken when that ratio is at least :data:`NEST_GAP` and at least two workers are on the fast
    side (one fast worker alone would sync only with itself: that is the flat window). Pure:
    every worker gets the same tiers from the same all-gathered speeds.
    """
    if len(ms_per_batch) < 3 or any(ms is None or not ms > 0 for ms in ms_per_batch):
        return None
    order = sorted(range(len(ms_per_batch)), key=lambda r: (ms_per_batch[r], r))
    ratios = [ms_per_batch[order[i + 1]] / ms_per_batch[order[i]] for i in range(len(order) - 1)]
    cut = max(range(1, len(ratios)), key=lambda i: (ratios[i], -i))  # at least two on the fast side
    if ratios[cut] < NEST_GAP:
        return None
    return tuple(sorted(order[:cut + 1])), tuple(sorted(order[cut + 1:]))


def probe_tiers(ms_per_batch: Sequence[float | None], elapsed_ms: float) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Nested windows' tiers decided inside the first window (``ElChe(nested=True)``), or None for not yet.

    ``ms_per_batch`` holds the first batch's time of each worker that has ended one (None for the
    others), ``elapsed_ms`` the time since the window started. The workers still in their first
    batch are the outer tier once it has lasted :data:`NEST_GAP` times the slowest first batch
    that ended, and at least two have ended one: each of them is then at least that much slower
    than any of the inner tier, which :func:`nest_tiers` would also call a gap. Pure: the first
    worker to find tiers writes them for all (:meth:`Comm.settle`).
    """
    done = [r for r, ms in enumerate(ms_per_batch) if ms is not None]
    late = [r for r, ms in enumerate(ms_per_batch) if ms is None]
    if len(done) < 2 or not late or elapsed_ms < NEST_GAP * max(ms_per_batch[r] for r in done):
        return None
    return tuple(done), tuple(late)


# nested=True decides inside the first window for cohorts this small, their candidate subgroups made up front:
# 56 for 6 workers, made in 0.12 s on 127.0.0.1 here (25 for 5 in 0.05 s); 7 would need 119.
PROBE_MAX_WORLD = 6


def inner_candidates(world: int) -> list[tuple[int, ...]]:
    """Every inner tier :func:`probe_tiers` can return in a cohort of ``world`` (sets of 2 to
    ``world - 1`` ranks), in one fixed order: their process groups are made up front by every
    worker (``dist.new_group``'s rule), where the slowest worker is still in its first batch when
    the tiers are found. Empty above :data:`PROBE_MAX_WORLD` (3 groups for 3 workers, 10 for 4, 25 for
    5, 56 for 6)."""
    if not 3 <= world <= PROBE_MAX_WORLD:
        return []
    return [c for size in range(2, world) for c in itertools.combinations(range(world), size)]


def rounding_wait(anchor: int, ms_per_batch: Sequence[float]) -> float:
    """Milliseconds the first worker to finish waits for the last in a window of ``anchor``
    batches of the slowest, when each worker runs the whole number of batches nearest its share."""
    window = anchor * max(ms_per_batch)
    ends = [max(1, round(window / ms)) * ms for ms in ms_per_batch]
    return max(ends) - min(ends)


def split_by_speed(rates: Sequence[float], total: int) -> tuple[int, ...]:
    """Samples per worker of a balanced DDP step of ``total``, in proportion to ``rates`` (each
    worker's measured samples a second), so that the workers' gradients are ready together.

    Every worker gets at least one sample while ``total`` allows (a DDP worker joins every step's
    all-reduce, and one without a sample would add a gradient of nothing); the rest goes by the
    largest remainder, ties to the lower rank. Rates that are all zero or missing split evenly.
    Every worker computes the same split from the same gathered rates.
    """
    world = len(rates)
    if total < world:  # an epoch's tail: one sample each while they last
        return tuple(1 if r < total else 0 for r in range(world))
    weights = [r if r > 0 and math.isfinite(r) else 0.0 for r in rates]
    if sum(weights) <= 0:
        weights = [1.0] * world
    ideal = [total * w / sum(weights) for w in weights]
    sizes = [max(1, math.floor(x)) for x in ideal]
    while sum(sizes) > total:  # the floor of one took more than its share: the most over gives one back
        r = max((r for r in range(world) if sizes[r] > 1), key=lambda r: (sizes[r] - ideal[r], -r))
        sizes[r] -= 1
    for r in sorted(range(world), key=lambda r: (sizes[r] - ideal[r], r))[:total - sum(sizes)]:
        sizes[r] += 1
    return tuple(sizes)


def deal(counts: Sequence[int], batch_size: int, remaining: int) -> tuple[int, ...]:
    """Samples per worker for a window: ``counts`` batches each, clamped to ``remaining``.

    When fewer samples remain than the plan asks for, they are shared in proportion to the
    counts (largest remainder, ties to the lower rank), so none is skipped or seen twice and
    some workers may get zero; every worker still joins the window's averaging.
    """
    want = [c * batch_size for c in counts]
    total = sum(want)
    if remaining >= total:
        return tuple(want)
    parts = [divmod(remaining * w, total) for w in want]
    sizes = [q for q, _ in parts]
    left = remaining - sum(sizes)
    for r in sorted(range(len(want)), key=lambda r: (-parts[r][1], r))[:left]:
        sizes[r] += 1
    return tuple(sizes)


# ---- process groups -----------------------------------------------------------------------

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
        self._background: dict[torch.dtype, torch.Tensor] = {}  # those of an all-reduce left running

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

    def launch_window(self, parts: Sequence[tuple], stats: Sequence[float] = (), *,
                      into: Sequence[tuple] | None = None, background: bool = False) -> "PendingWindow":
        """Pack ``parts`` and start their all-reduce (:meth:`reduce_window`'s parts and stats);
        the returned :class:`PendingWindow`'s ``wait()`` lands it and returns the stats matrix.

        ``into`` lands part ``i`` somewhere else than in its own tensors: ``(targets, base)``, the
        sum written into ``targets``, plus ``base`` where given (``base`` may be ``targets``
        itself: ``targets += sum``). A part ``(tensors, weight, None, residuals)`` sends
        ``tensors`` as changes already taken, in bfloat16 with the remainder carried.
        ``background=True`` (``ElChe(overlap=True)``) starts the all-reduce without waiting
        for it, in buffers of its own, so the caller may change the part's tensors (and run
        other collectives) before ``wait()``."""
        row = torch.tensor([list(stats)], dtype=torch.float64)
        if self.world == 1:
            return PendingWindow(self, row, [])
        groups: dict[torch.dtype, list[tuple]] = {}
        for i, (tensors, weight, *rest) in enumerate(parts):
            starts = rest[0] if rest and rest[0] is not None else [None] * len(tensors)
            residuals = rest[1] if len(rest) > 1 else [None] * len(tensors)
            targets, bases = into[i] if into is not None and into[i] is not None else (tensors, starts)
            bases = [None] * len(tensors) if bases is None else bases
            for t, s, r, target, base in zip(tensors, starts, residuals, targets, bases, strict=True):
                if r is not None:
                    wire = torch.bfloat16  # the compressed changes travel in a buffer of their own
                else:
                    wire = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype
                groups.setdefault(wire, []).append((t, weight, s, r, target, base))
        # The stats ride in full precision: float32 (or float64) parameters' buffer, else their own.
        carrier = next((d for d in (torch.float32, torch.float64) if d in groups), None)
        if len(stats) and carrier is None:
            carrier = torch.float64
            groups[carrier] = []
        landings = []
        buffers = self._background if background else self._buffers
        for dtype, members in groups.items():
            extra = self.world * len(stats) if dtype == carrier else 0
            flat = self._buffer(dtype, sum(m[0].numel() for m in members) + extra, buffers)
            offset = 0
            with torch.no_grad():
                for t, w, s, r, _, _ in members:
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
                             group=self.plane, async_op=background)
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
            works.append(self._run("sending gradients to the lead", dist.isend, g, self._global(lead), group=self.plane))
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
                for t, _, _, _, target, base in members:
                    _unpack(flat[offset:offset + t.numel()], target, base)
                    offset += t.numel()
            if extra:
                gathered = flat[offset:].view(self.comm.world, width).to("cpu", torch.float64, copy=True)
        self._landings = []
        return gathered


def _by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _pack(view: torch.Tensor, t: torch.Tensor, weight: float, start: torch.Tensor | None) -> None:
    """Write ``weight * t`` (or ``weight * (t - start)``) into the flat buffer's ``view``.

    The same float ops as the unfused ``(t - start).to(dtype) * weight``: a change is taken in
    ``t``'s own dtype, a weight of 1 multiplies nothing (``x * 1.0`` is ``x``)."""
    src = t.detach().reshape(-1)
    if start is not None and (src.dtype != view.dtype or src.device != view.device):
        t.sub_(start)  # a low-precision change, in its own dtype; the start is added back in _unpack
        start = None
        src = t.detach().reshape(-1)
    if start is not None:
        torch.sub(src, start.reshape(-1), out=view)
    elif src.dtype == view.dtype and src.device == view.device and weight != 1.0:
        torch.mul(src, weight, out=view)
        return
    else:
        view.copy_(src)
    if weight != 1.0:
        view.mul_(weight)


BLOCK = 1 << 16  # elements per block of elementwise passes over parameters: 256 KiB of float32


def blocks(*tensors: torch.Tensor):
    """Flat views of ``tensors`` (as many elements each), block by block of :data:`BLOCK` where all
    are contiguous and on the CPU, else whole: a few elementwise passes over a block stay in cache,
    where whole tensors go to memory once a pass. On MiniLM-sized tensors the look-ahead took 38 ms
    in blocks and 82 whole, and the bfloat16 change the lead sends, taken and landed, 106 and 167;
    elementwise, the same bits."""
    if all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
        return zip(*(t.view(-1).split(BLOCK) for t in tensors))
    return [tensors]


def _pack_carried(view: torch.Tensor, t: torch.Tensor, weight: float, start: torch.Tensor | None,
                  residual: torch.Tensor) -> None:
    """Write ``weight * (t - start)`` plus what earlier windows left in ``residual`` into the
    low-precision ``view``, and keep in ``residual`` (float32) what the rounding leaves out.

    The change is taken in ``t``'s dtype (``start=None``: ``t`` is the change), widened, weighted
    and added to the carried remainder in float32; ``residual - view`` is then exact (a float32
    minus its own rounding to bfloat16 fits float32), so the sends add up to the changes over the
    run, less the last remainder."""
    src = t.detach().reshape(-1)
    tensors = (src, residual.view(-1), view) + (() if start is None else (start.reshape(-1),))
    for src, carried, out, *base in blocks(*tensors):
        change = (src if not base else torch.sub(src, base[0])).to(torch.float32)
        if weight != 1.0:  # (a change given as ``t`` itself is the caller's: weighed in a copy)
            change = change * weight if change is src else change.mul_(weight)
        carried.add_(change)
        out.copy_(carried)
        carried.sub_(out)


def _take_change(view: torch.Tensor, t: torch.Tensor, start: torch.Tensor) -> None:
    """``t = start + view`` (a low-precision change, widened: one rounding into ``t``'s dtype, as
    :func:`_unpack` does), then ``start = t``: the next shared point."""
    if t.is_contiguous() and start.is_contiguous() and view.device == t.device:
        for v, x, s in blocks(view.view(-1), t.view(-1), start.view(-1)):
            x.copy_(v)
            x.add_(s)
            s.copy_(x)
        return
    _unpack(view, t, start)
    start.copy_(t)


def _unpack(view: torch.Tensor, t: torch.Tensor, start: torch.Tensor | None) -> None:
    """Load the reduced ``view`` into ``t``, adding ``start`` back for a sum of changes."""
    view = view.view(t.shape)
    if start is None:
        t.copy_(view)
    elif start is t:  # t += sum (ElChe(overlap=True)'s shared point), one rounding into t's dtype
        t.add_(view.to(t.device))
    elif view.dtype == t.dtype and view.device == t.device:
        torch.add(view, start, out=t)
    else:
        t.copy_(view)
        t.add_(start)


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view(t.shape))
            offset += n


class OuterOptimizer:
    """DiLoCo's outer step: SGD on ``start - average`` over a copy of the parameters at the last sync."""

    def __init__(self, params: Sequence[torch.Tensor], cfg: DiLoCo) -> None:
        self.params = list(params)
        self.start = [p.detach().clone() for p in self.params]
        nesterov = cfg.nesterov and cfg.momentum > 0  # torch refuses Nesterov without momentum
        self.sgd = torch.optim.SGD(self.start, lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov)

    @torch.no_grad()
    def step(self) -> None:
        """Move the shared start point along the pseudo-gradient, then load it into the model."""
        for s, p in zip(self.start, self.params):
            s.grad = s - p
        self.sgd.step()
        for s, p in zip(self.start, self.params):
            s.grad = None
            p.copy_(s)

    def state_dict(self) -> dict:
        return self.sgd.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sgd.load_state_dict(state)
