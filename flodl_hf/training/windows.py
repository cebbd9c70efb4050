"""El Che's windows (``sync="el-che"``): local steps paced by the slowest worker, in planned, live or nested
windows, and the syncs that end them (the weighted average, the sum of changes, the lead's step on the
others' gradients). What the windows run on is the fit's :class:`~flodl_hf.training.sync.Cadence` (``self.el_che``),
chosen at the start (:func:`~flodl_hf.training.sync.choose`) and after the first window."""

from __future__ import annotations

import math
import time
import warnings
from typing import Sequence

import torch

from flodl_hf.training.steps import _to_device
from flodl_hf.training.sync import (NEST_GAP, Comm, blocks, deal, live_overrun_ms, nest_tiers, plan_window,
                                    ms_text, probe_tiers, settle_windows)


class WindowsMixin:
    """:class:`~flodl_hf.training.trainer.Trainer`'s El Che loop: its windows, and the workers' batches and
    syncs in them. Its run state is the Trainer's (set in ``_setup``)."""

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
            stats = [batches, n, local_loss, compute_ms, prev["collective_ms"], prev["window_ms"], prev["pause_ms"],
                     prev["waited_ms"], *steady, *self._resources.sample()]  # (its sync_mem_mb: the last sync's)
            with self._resources.sync():  # the memory this sync allocates beyond what the worker held
                rows = self._average(weight_n / max(1, sum(sizes)), stats)
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
            if first and live and self._settle_windows():
                live = False
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
            self._log_event("choice", step=self.step, field="nested", value=False,
                            why=f"the first window's speeds ({ms_text(self._ms)} ms a batch) have no gap of "
                                f"{NEST_GAP:g}x with two workers or more on the fast side: flat windows")

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
        if self.el_che_asked.nested is not True and not isinstance(self.el_che_asked.nested, tuple):
            times = probe if probe is not None else self._ms
            self._log_event("choice", step=self.step, field="nested", value=[list(tiers[0]), list(tiers[1])],
                            why=f"ranks {list(tiers[1])} ran at least {NEST_GAP:g}x slower than ranks "
                                f"{list(tiers[0])} ({ms_text(times)} ms a first batch, none: still running)")

    def _settle_windows(self) -> bool:
        """After the first window: an even cohort's choices (:func:`~flodl_hf.training.sync.settle_windows`)."""
        settled = None if self._tiers is not None or (self.el_che.nested and not self._tiers_decided) else \
            settle_windows(self.el_che_asked, self.el_che, self._ms, self._tiers)
        if settled is None:
            return False
        lead, (self.el_che, why) = self._lead, settled
        self._live = False
        if lead and self.el_che.combine != "lead":  # every worker steps its own optimizer from here; averaged
            self._land_sent()
            self._lead, self._ahead, self._behind, self._moving = False, False, None, None
            if self.el_che.compress is not None:  # changes from the shared point; the gradients' remainders go
                self._start = [p.detach().clone() for p in self.trainable]
                self._carried = [torch.zeros_like(c) for c in self._carried]
            self._log_event("choice", step=self.step, field="combine", value=self.el_che.combine, why=why)
        self._log_event("choice", step=self.step, field="windows", value="planned", why=why)
        return True

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

    def _check_synced(self, where: str, comm: Comm | None = None) -> None:
        """``verify_sync``: every worker of ``comm`` (the cohort's) holds the same parameters and buffers."""
        (comm or self.comm).check_identical(list(self.model.parameters()) + self._float_buffers, where)

    # ---- combine="lead": the others' gradients, the lead's extrapolated start ----------------
    @torch.no_grad()
    def _look_ahead(self) -> None:
        """``ElChe(combine="lead")`` on a worker other than the lead, at a window's
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


def _copy_into(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``targets[i] = sources[i]`` in place (a window's start taken from the synced parameters)."""
    with torch.no_grad():
        for t, src in zip(targets, sources, strict=True):
            t.copy_(src)
