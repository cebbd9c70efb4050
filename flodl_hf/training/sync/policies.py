"""El Che's and DiLoCo's policies, and the pure arithmetic of their windows.

:class:`DiLoCo` is a configuration the trainer takes (:class:`ElChe` and the choices made for it
are in :mod:`flodl_hf.training.sync.choice`); the functions here (:func:`plan_window`,
:func:`deal`, the nested windows' tiers, ...) hold El Che's arithmetic as pure functions, so every
worker computes the same answer from the same gathered numbers and they can be tested without
processes. :class:`OuterOptimizer` is DiLoCo's outer step.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from flodl_hf.training.sync.choice import Cadence


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


def plan_window(ms_per_batch: Sequence[float | None], sync_ms: float | None, prev: Plan, cfg: Cadence) -> Plan:
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
