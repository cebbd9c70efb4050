"""El Che's choices (issue 56), with injected measurements: for each cohort shape the bench runs (2x, 3x,
2x across a link) and the edges around them, what ``sync="el-che"`` chooses and why; a field the user sets
is kept. The trainer makes the same calls on the numbers it gathers (test_trainer_dist runs them live)."""

from __future__ import annotations

import dataclasses

import pytest

from flodl_hf.training.sync import Cadence, ElChe, Link, choose, nest_tiers, probe_tiers, settle_windows
from flodl_hf.training.sync.choice import EVEN, SLOW_LINK_MB_S, describe
from flodl_hf.training.trainer import TrainerConfigError

LOOPBACK = Link(hosts=1, mb_per_s=790.0)   # gloo on 127.0.0.1, MiniLM's weights (measured here: 730 to 860)
GIGABIT = Link(hosts=2, mb_per_s=112.0)    # two network namespaces behind a 1 Gbit/s tbf link


def test_the_pair_on_one_host_gets_one_optimizer_in_live_windows():
    cadence, why = choose(ElChe(), 2, LOOPBACK)
    assert (cadence.combine, cadence.windows, cadence.compress, cadence.nested) == ("lead", "live", None, False)
    assert cadence.adaptive and cadence.anchor == 1 and cadence.sync_share == 0.10
    # One optimizer keeps one batch of the slowest a window: a costly sync does not grow it.
    assert cadence.max_anchor == 1 and "one batch" in why["anchor"]
    from flodl_hf.training.sync import Plan, plan_window
    assert plan_window([40.0, 44.0], 30.0, Plan(1, (1, 1)), cadence).anchor == 1
    assert choose(ElChe(combine="sum"), 2, LOOPBACK)[0].max_anchor == 64
    assert "790 MB/s" in why["compress"] and "2 worker" in why["nested"]


def test_the_pair_across_a_slow_link_sends_bfloat16_and_allows_a_larger_sync_share():
    cadence, why = choose(ElChe(), 2, GIGABIT)
    assert (cadence.combine, cadence.windows, cadence.compress) == ("lead", "live", "bf16")
    assert cadence.sync_share == 0.30
    assert "112 MB/s" in why["compress"] and f"{SLOW_LINK_MB_S:.0f}" in why["compress"]
    # Between hosts the rate decides: a fast link sends float32.
    assert choose(ElChe(), 2, Link(hosts=2, mb_per_s=1200.0))[0].compress is None
    assert choose(ElChe(), 2, Link(hosts=1, mb_per_s=None))[0].compress is None  # not measured: full precision
    # One host is never a slow link: a small model's broadcast there measures latency, not bytes.
    assert not Link(hosts=1, mb_per_s=0.6).slow and Link(hosts=2, mb_per_s=0.6).slow


def test_three_workers_nest_when_the_probe_finds_tiers_and_sum_within_them():
    cadence, _ = choose(ElChe(), 3, LOOPBACK)
    assert (cadence.combine, cadence.windows, cadence.nested) == ("sum", "live", True)
    # The 3x cohort's speeds (1 : 1/3 : 1/12): the first batches the probe sees, then the smoothed speeds.
    assert probe_tiers([800.0, 2400.0, None], 4900.0) == ((0, 1), (2,))
    assert nest_tiers([800.0, 2400.0, 9600.0]) == ((0, 1), (2,))
    # Three even workers: no tier, flat windows, and planned from the second window.
    assert nest_tiers([800.0, 820.0, 790.0]) is None
    settled = settle_windows(ElChe(), cadence, [800.0, 820.0, 790.0], None)
    assert settled is not None and settled[0].windows == "planned" and settled[0].nested is False


def test_three_workers_behind_a_slow_link_compress_rather_than_nest():
    cadence, why = choose(ElChe(), 3, GIGABIT)
    assert (cadence.compress, cadence.nested, cadence.combine) == ("bf16", False, "lead")
    assert "full precision" in why["nested"]


def test_diloco_averages_and_a_fixed_anchor_is_local_sgd():
    cadence, why = choose(ElChe(), 2, LOOPBACK, outer=True)
    assert cadence.combine == "average" and "DiLoCo" in why["combine"]
    assert choose(ElChe(), 3, LOOPBACK, outer=True)[0].nested is True  # nested averages are supported
    fixed, why = choose(ElChe(anchor=3), 2, LOOPBACK)
    assert (fixed.anchor, fixed.adaptive, fixed.windows, fixed.combine) == (3, False, "planned", "average")
    assert choose(ElChe(anchor=3), 3, LOOPBACK)[0].nested is False  # planned windows do not nest
    with pytest.raises(TrainerConfigError, match="lead.*DiLoCo"):
        choose(ElChe(combine="lead"), 2, LOOPBACK, outer=True)


def test_a_field_set_by_the_user_is_kept_and_said_so():
    asked = ElChe(anchor=2, sync_share=0.2, windows="live", combine="sum", compress="bf16", nested=False)
    cadence, why = choose(asked, 3, LOOPBACK)
    assert (cadence.anchor, cadence.sync_share, cadence.windows, cadence.combine, cadence.compress,
            cadence.nested) == (2, 0.2, "live", "sum", "bf16", False)
    assert all(why[f] == "asked" for f in ("sync_share", "windows", "combine", "compress", "nested"))
    assert choose(ElChe(compress="none"), 2, GIGABIT)[0].compress is None
    assert choose(ElChe(combine="lead"), 3, LOOPBACK)[0].nested is False  # one optimizer does not nest
    tiers = choose(ElChe(nested=((0, 1), (2,))), 3, GIGABIT)[0]
    assert tiers.nested == ((0, 1), (2,)) and tiers.compress is None and tiers.combine == "sum"
    # A choice the windows cannot run is refused, naming why the other field was chosen.
    with pytest.raises(TrainerConfigError, match="planned"):
        choose(ElChe(nested=True, anchor=2), 3, LOOPBACK)
    assert settle_windows(ElChe(windows="live"), cadence, [10.0, 10.0, 10.0], None) is None


@pytest.mark.parametrize("ms, planned", [([800.0, 2400.0], False), ([800.0, 830.0], True),
                                         ([800.0, 800.0 * EVEN * 1.01], False), ([800.0, None], False)])
def test_windows_turn_planned_only_for_an_even_cohort(ms, planned):
    cadence, _ = choose(ElChe(), 2, LOOPBACK)
    settled = settle_windows(ElChe(), cadence, ms, None)
    assert (settled is not None) == planned
    if planned:
        # An even pair is averaged: one optimizer would take every other batch as a stale step.
        assert settled[0].windows == "planned" and settled[0].combine == "average" and "even" in settled[1]
        assert settled[0].max_anchor == 64
        kept = settle_windows(ElChe(combine="lead"), choose(ElChe(combine="lead"), 2, LOOPBACK)[0], ms, None)
        assert kept[0].combine == "lead"  # asked: kept
    # Tiers found, or live windows asked: the windows stay live.
    assert settle_windows(ElChe(), cadence, [800.0, 810.0], ((0, 1), (2,))) is None


def test_the_record_says_what_was_asked_chosen_and_measured():
    asked = ElChe(nested=((0, 1), (2,)))
    cadence, why = choose(asked, 3, LOOPBACK)
    record = describe(asked, cadence, why, LOOPBACK)
    assert record["asked"]["nested"] == [[0, 1], [2]] and record["asked"]["combine"] == "auto"
    assert record["chose"] == {"anchor": None, "sync_share": 0.10, "windows": "live", "combine": "sum",
                               "compress": "none", "nested": [[0, 1], [2]]}
    assert record["link"] == {"hosts": 1, "mb_per_s": 790.0, "slow": False}
    assert set(record["why"]) == {"anchor", "sync_share", "windows", "combine", "compress", "nested"}


def test_elche_has_six_public_fields_and_refuses_bad_values():
    assert [f.name for f in dataclasses.fields(ElChe)] == ["anchor", "sync_share", "windows", "combine",
                                                          "compress", "nested"]
    for kw in ({"windows": "dynamic"}, {"combine": "mean"}, {"compress": "fp8"}, {"compress": None},
               {"nested": "yes"}, {"anchor": 0}, {"sync_share": 1.0}):
        with pytest.raises(TrainerConfigError, match=next(iter(kw))):
            ElChe(**kw)
    assert Cadence().max_anchor == 64 and Cadence().dead_zone == 0.10
