"""El Che's configuration, and the choices the trainer makes for it from what it measures.

:class:`ElChe` is what a user writes: six fields, each ``None`` or ``"auto"`` by default, which
leaves the choice to the trainer. :func:`choose` makes the choices at the start of a fit, from
the cohort's size, DiLoCo, and the link the setup broadcast of the weights measured, into a
:class:`Cadence`: the concrete settings the windows run on. :func:`settle_windows` makes the one
choice left for after the first window, from the workers' measured speeds; the tiers of nested
windows are found from the same speeds (:func:`~flodl_hf.training.sync.policies.nest_tiers`,
:func:`~flodl_hf.training.sync.policies.probe_tiers`). All are pure: every worker makes the same
choice from the same gathered numbers, and the tests inject the numbers.

What each rule rests on is measured in docs/benchmarks.md ("El Che that tunes itself").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence, Union

from flodl_hf.core.errors import TrainerConfigError

AUTO = "auto"
# A link that moves less than this, measured by the setup broadcast of the weights, is a network between hosts,
# not one host's memory: gloo on 127.0.0.1 moved 730 to 860 MB/s here (MiniLM's 92 MB), 460 with both cores busy
# with other work; a 1 Gbit/s link moves at most 125.
SLOW_LINK_MB_S = 200.0
SYNC_SHARE = 0.10        # the anchor grows while the sync takes more of a window than this (a fast link)
SYNC_SHARE_SLOW = 0.30   # behind a slow link: short windows are worth more than a small sync share
EVEN = 1.10              # speeds within this ratio: an even cohort, which planned windows serve as well as live ones

Nested = Union[bool, str, tuple]


@dataclass(frozen=True)
class ElChe:
    """Local SGD whose cadence is set by the slowest worker: ``sync="el-che"``.

    Every field's default leaves its choice to the trainer, which makes it from what it measures
    and records it, with the measurement, in the run's start record and portal (``el_che``):

    - ``anchor``: batches of the slowest worker per window. ``None``: from 1, grown while the sync
      takes more than ``sync_share`` of a window and shrunk when it takes under a quarter of that.
      An int fixes it, and every worker then runs ``anchor`` batches a window, in planned windows
      and averaged: plain local SGD with a fixed cadence (DiLoCo's inner steps).
    - ``sync_share``: ``None``: 0.10 on a fast link, 0.30 on a slow one (between hosts, where the setup
      broadcast of the weights moved under 200 MB/s): behind a slow link, short windows are worth more than a
      small sync share.
    - ``windows``: ``"live"`` (batches claimed from a counter as workers go; the window closes once
      the slowest has run the anchor, the others run as many as fit) or ``"planned"`` (each worker
      runs the count its measured speed gives, dealt in rank order: deterministic, a resumed run
      repeats bit for bit). ``"auto"``: live, and planned from the second window when the first
      measured every worker within 10% of the others; planned with a fixed anchor.
    - ``combine``: how a window's work becomes the next shared point: ``"lead"`` (one optimizer,
      worker 0's: the others compute gradients, taken ahead to where the lead will step on them,
      and the lead takes their sum as one more step), ``"sum"`` (each worker's change since the
      window's start, added) or ``"average"`` (the samples-weighted mean of the parameters).
      ``"auto"``: ``"average"`` with ``outer=DiLoCo(...)`` or a fixed anchor, ``"sum"`` where
      windows may nest, ``"lead"`` otherwise, and ``"average"`` from the second window in an even cohort.
    - ``compress``: ``"bf16"`` sends the changes (and the lead's gradients) in bfloat16, what it
      cannot carry fed back into the next window's; ``"none"`` sends float32. ``"auto"``: bfloat16
      on a slow link.
    - ``nested``: ``True`` splits the cohort into tiers by speed when one side is at least twice
      as slow (found inside the first window), so a much slower worker joins only every few of
      the others' syncs; ``(inner_ranks, outer_ranks)`` names the tiers; ``False`` keeps flat
      windows. ``"auto"``: ``True`` for three workers or more in live windows at full precision.

    docs/trainer.md describes each; docs/benchmarks.md measures each against the default.
    """

    anchor: int | None = None
    sync_share: float | None = None
    windows: str = AUTO
    combine: str = AUTO
    compress: str = AUTO
    nested: Nested = AUTO

    def __post_init__(self) -> None:
        if self.anchor is not None and (isinstance(self.anchor, bool) or not isinstance(self.anchor, int)
                                        or not 1 <= self.anchor <= Cadence.max_anchor):
            raise TrainerConfigError(f"ElChe anchor must be None (the sync share sets it) or an int in 1.."
                                     f"{Cadence.max_anchor}, got {self.anchor!r}")
        if self.sync_share is not None and (isinstance(self.sync_share, bool)
                                            or not isinstance(self.sync_share, (int, float))
                                            or not 0 < self.sync_share < 1):
            raise TrainerConfigError(f"ElChe sync_share must be None (chosen from the link) or in (0, 1), "
                                     f"got {self.sync_share!r}")
        for name, allowed in (("windows", ("planned", "live")), ("combine", ("average", "sum", "lead")),
                              ("compress", ("none", "bf16"))):
            value = getattr(self, name)
            if value != AUTO and value not in allowed:
                raise TrainerConfigError(f"ElChe {name} must be 'auto' or one of {', '.join(map(repr, allowed))}, "
                                         f"got {value!r}")
        nested = self.nested
        if not isinstance(nested, bool) and nested != AUTO:
            try:
                inner, outer = (tuple(sorted(int(r) for r in tier)) for tier in nested)
            except (TypeError, ValueError):
                raise TrainerConfigError(f"ElChe nested must be 'auto', True, False or (inner ranks, outer ranks), "
                                         f"got {nested!r}") from None
            if len(inner) < 2 or not outer or set(inner) & set(outer) or min(inner + outer) < 0 \
                    or len(set(inner)) != len(inner) or len(set(outer)) != len(outer):
                raise TrainerConfigError(f"ElChe nested={nested!r}: the tiers must be disjoint ranks, "
                                         "two or more inner and one or more outer")
            object.__setattr__(self, "nested", (inner, outer))
        nesting = self.nested not in (False, AUTO)
        if nesting and (self.windows == "planned" or self.compress == "bf16"):
            raise TrainerConfigError(f"ElChe nested={self.nested!r} runs live windows at full precision; got "
                                     f"windows={self.windows!r}, compress={self.compress!r}")
        if nesting and self.combine == "lead":
            raise TrainerConfigError(f"ElChe combine='lead' keeps one optimizer for a flat cohort: not with "
                                     f"nested={self.nested!r}")


@dataclass(frozen=True)
class Cadence:
    """The settings a fit's windows run on: an :class:`ElChe` with every choice made (:func:`choose`).

    The trainer's ``el_che``; :func:`~flodl_hf.training.sync.policies.plan_window` reads it. The last
    four are constants of the cadence arithmetic, fields so the tests can vary them."""

    anchor: int = 1
    adaptive: bool = True
    sync_share: float = SYNC_SHARE
    windows: str = "live"
    combine: str = "lead"
    compress: str | None = None
    nested: bool | tuple = False
    min_anchor: int = 1
    max_anchor: int = 64
    dead_zone: float = 0.10
    shrink_below: float = 0.25

    def __post_init__(self) -> None:
        if not 1 <= self.min_anchor <= self.anchor <= self.max_anchor:
            raise TrainerConfigError(f"El Che needs 1 <= min_anchor <= anchor <= max_anchor, got "
                                     f"{self.min_anchor}, {self.anchor}, {self.max_anchor}")


@dataclass(frozen=True)
class Link:
    """What the trainer knows of the workers' link at the start of a fit: the hosts (distinct host
    names and torchrun nodes; network namespaces count apart) and the rate the setup broadcast of
    the weights moved, MB/s (the slowest worker's; None where it was not measured)."""

    hosts: int = 1
    mb_per_s: float | None = None

    @property
    def slow(self) -> bool:
        """Between hosts and under :data:`SLOW_LINK_MB_S`. One host is never a slow link: a small model's
        broadcast is all latency there (0.1 to 2 MB/s for the tests' 644-byte MLP on 127.0.0.1)."""
        return self.hosts > 1 and self.mb_per_s is not None and self.mb_per_s < SLOW_LINK_MB_S


def choose(cfg: ElChe, world: int, link: Link, outer: bool = False) -> tuple[Cadence, dict[str, str]]:
    """The fit's :class:`Cadence` from ``cfg`` (a field that is not ``None``/``"auto"`` is kept as
    asked), the cohort's size, its link and whether DiLoCo steps on the windows (``outer``); and,
    per field, why. Raises :class:`TrainerConfigError` on a combination the windows cannot run."""
    why: dict[str, str] = {}
    rate = (f"the setup broadcast of the weights moved {link.mb_per_s:.0f} MB/s" if link.mb_per_s is not None
            else "the link was not measured")
    nesting_asked = cfg.nested not in (False, AUTO)

    if cfg.compress != AUTO:
        compress, why["compress"] = (None if cfg.compress == "none" else "bf16"), "asked"
    elif nesting_asked:
        compress, why["compress"] = None, "nested windows send full precision"
    elif link.slow:
        compress, why["compress"] = "bf16", f"{rate}, under {SLOW_LINK_MB_S:.0f}: half the bytes a sync"
    else:
        compress, why["compress"] = None, f"{rate}: full precision"

    if cfg.sync_share is not None:
        share, why["sync_share"] = float(cfg.sync_share), "asked"
    elif link.slow:
        share, why["sync_share"] = SYNC_SHARE_SLOW, f"{rate}: a slow link, where short windows gain more"
    else:
        share, why["sync_share"] = SYNC_SHARE, f"{rate}: a fast link"

    fixed = cfg.anchor is not None
    why["anchor"] = "asked: a fixed cadence" if fixed else "from 1, moved by the sync's share of a window"

    if cfg.windows != AUTO:
        windows, why["windows"] = cfg.windows, "asked"
    elif fixed:
        windows, why["windows"] = "planned", "a fixed anchor: every worker runs it, in rank order"
    else:
        windows, why["windows"] = "live", "the speeds are not known yet: batches claimed as the workers go"

    if cfg.nested != AUTO:
        nested, why["nested"] = cfg.nested, "asked"
    elif world < 3:
        nested, why["nested"] = False, f"{world} worker(s): no tier to nest"
    elif windows != "live" or compress is not None or cfg.combine == "lead":
        nested, why["nested"] = False, "nested windows need live windows at full precision, and no lead"
    else:
        nested, why["nested"] = True, f"{world} workers: tiers found in the first window if one is twice as slow"

    if cfg.combine != AUTO:
        combine, why["combine"] = cfg.combine, "asked"
    elif outer:
        combine, why["combine"] = "average", "DiLoCo steps on the averaged change"
    elif fixed:
        combine, why["combine"] = "average", "a fixed anchor: local SGD's average"
    elif nested:
        combine, why["combine"] = "sum", "windows may nest: the outer tier's change adds to the inner's"
    else:
        combine, why["combine"] = "lead", "a flat cohort: one optimizer takes the others' gradients"

    if combine == "lead" and outer:
        raise TrainerConfigError("ElChe(combine='lead') does not go with outer=DiLoCo(...): the lead's optimizer "
                                 "already takes the others' work as steps")
    if nested and (windows != "live" or compress is not None):
        raise TrainerConfigError(f"ElChe nested={nested!r} runs live windows at full precision; got "
                                 f"windows={windows!r} ({why['windows']}), compress={compress!r} "
                                 f"({why['compress']})")
    # One optimizer makes the others' batches of a window one step on their mean: windows longer than one batch of
    # the slowest cost it steps. The anchor stays at 1 (measured: the pair's seeds whose anchor grew to 2 took 672
    # and 704 samples where those at 1 took 592 to 640; an even pair of ViTs whose anchor grew to 4 reached 79.4%
    # held-out accuracy where one worker alone reached 88.9%).
    lead_cap = combine == "lead" and not fixed
    if lead_cap:
        why["anchor"] = "one optimizer: one batch of the slowest a window, whatever the sync's share"
    cadence = Cadence(anchor=cfg.anchor or 1, adaptive=not fixed, sync_share=share, windows=windows,
                      combine=combine, compress=compress, nested=nested, max_anchor=1 if lead_cap else 64)
    return cadence, why


def settle_windows(cfg: ElChe, cadence: Cadence, ms_per_batch: Sequence[float | None],
                   tiers: tuple | None) -> tuple[Cadence, str] | None:
    """After the first window: planned windows for an even cohort, where ``cfg.windows`` left the
    choice to the trainer. Returns the new cadence and why, or None to keep it.

    Even means every worker within :data:`EVEN` of the fastest: live windows then gain no batch
    over planned ones, and planned windows need no claim on the store per batch (a round trip to
    worker 0's host across a link) and deal the same batches to the same workers in every run."""
    if cfg.windows != AUTO or cadence.windows != "live" or tiers is not None or len(ms_per_batch) < 2 \
            or any(ms is None or not ms > 0 for ms in ms_per_batch):
        return None
    spread = max(ms_per_batch) / min(ms_per_batch)
    if spread > EVEN:
        return None
    why = f"the first window measured the workers within {spread:.2f}x of each other: an even cohort"
    if cadence.combine == "lead" and cfg.combine == AUTO:
        # One optimizer pays where the others are slower: the fast worker trains as it would alone and a slow
        # worker's batches add a stale step. In an even cohort every other batch would be a stale step (an even
        # pair of ViTs at lr 1e-3: 80.9% held-out accuracy, against 88.9% alone and 89.0% averaged).
        return replace(cadence, windows="planned", nested=False, combine="average", max_anchor=64), \
            why + ": planned windows, averaged (one optimizer would take every other batch as a stale step)"
    return replace(cadence, windows="planned", nested=False), why


def describe(cfg: ElChe, cadence: Cadence, why: dict[str, str], link: Link) -> dict:
    """The run record's ``el_che``: what was asked, what was chosen, why, and the link measured."""
    asked = plain(vars(cfg))
    chose = plain({"anchor": None if cadence.adaptive else cadence.anchor, "sync_share": cadence.sync_share,
                   "windows": cadence.windows, "combine": cadence.combine, "compress": cadence.compress or "none",
                   "nested": cadence.nested})
    return {"asked": asked, "chose": chose, "why": dict(why),
            "link": {"hosts": link.hosts, "mb_per_s": link.mb_per_s, "slow": link.slow}}


def ms_text(ms: Sequence[float | None]) -> str:
    """Times per batch for a choice's reason: whole milliseconds, ``none`` for a worker not measured yet."""
    return ", ".join("none" if m is None else f"{m:.0f}" for m in ms)


def plain(value):
    """Tuples as lists, all the way down: what a record or a checkpoint's JSON-like state holds."""
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value
