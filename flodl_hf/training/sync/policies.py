"""El Che's and DiLoCo's policies, and the pure arithmetic of their windows.

:class:`ElChe` and :class:`DiLoCo` are the configurations the trainer takes; the functions here
(:func:`plan_window`, :func:`deal`, the nested windows' tiers, ...) hold El Che's arithmetic as
pure functions, so every worker computes the same answer from the same gathered numbers and they
can be tested without processes. :class:`OuterOptimizer` is DiLoCo's outer step.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from flodl_hf.core.errors import TrainerConfigError


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
    if not cfg.adaptive or len(ms_per_batch) != len(prev.counts) \
            or any(ms is None or not ms > 0 for ms in ms_per_batch):
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


def probe_tiers(ms_per_batch: Sequence[float | None],
                elapsed_ms: float) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
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
