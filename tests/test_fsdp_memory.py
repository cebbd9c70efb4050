"""Memory you can see: each worker's peak memory per window and what one sync allocates beyond what the worker
held (:class:`flodl_hf.training.records.Resources`), their rollups, and their place in the portal's page."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from flodl_hf.training import page
from flodl_hf.training.records import RESOURCE_FIELDS, SUMMARY, Resources, resource_fields, rollup

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (peak RSS)")

MIB = 2**20


def _touch(mib: int) -> torch.Tensor:
    """A tensor of ``mib`` MiB whose pages are all written (resident)."""
    return torch.ones(mib * MIB // 4)


def test_sync_measures_what_it_allocates_beyond_the_steady_state():
    res = Resources(torch.device("cpu"))
    first = res.sample()
    assert len(first) == len(RESOURCE_FIELDS)
    assert math.isnan(first[RESOURCE_FIELDS.index("sync_mem_mb")])  # no sync yet
    kept = _touch(32)  # held before the sync: steady state, not the sync's
    with res.sync():
        buffer = _touch(96)  # a transient: allocated and freed inside the sync
        del buffer
    fields = resource_fields(res.sample())
    assert 90 <= fields["sync_mem_mb"] < 96 + 24, fields  # the 96 MiB buffer, not the 32 held before
    assert fields["mem_peak_mb"] >= fields["rss_mb"] + 90  # the window's peak saw it; the RSS after it did not
    del kept


def test_peak_starts_over_each_window():
    res = Resources(torch.device("cpu"))
    res.sample()
    big = _touch(128)
    del big
    high = resource_fields(res.sample())
    low = resource_fields(res.sample())  # a window without the allocation
    assert high["mem_peak_mb"] >= low["mem_peak_mb"] + 100, (high, low)
    assert "sync_mem_mb" not in low  # no sync measured: left out, not zero


def test_rollup_sums_peaks_and_names_the_heaviest_sync():
    ranks = {"rank-0": {"mem_peak_mb": 1000.0, "sync_mem_mb": 10.0},
             "rank-1": {"mem_peak_mb": 1500.0, "sync_mem_mb": 530.0}}
    out = rollup(ranks, prefix="host-a/")
    assert out["mem_peak_mb"] == 2500.0
    assert out["max"]["sync_mem_mb"] == {"v": 530.0, "who": "host-a/rank-1"}
    assert out["max"]["mem_peak_mb"]["who"] == "host-a/rank-1"
    assert {"mem_peak_mb", "sync_mem_mb", "rss_mb", "gpu_mem_mb"} <= set(SUMMARY)  # in the children's grid


def test_portal_page_draws_the_memory_columns():
    text = page.SCRIPT  # the page's script: its charts and its children's grid
    for key in ("mem_peak_mb", "sync_mem_mb"):
        assert f'key: "{key}"' in text  # a chart
        assert f"c.{key}" in text  # a row of the children's grid
