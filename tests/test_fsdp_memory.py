"""Memory you can see: each worker's peak memory per window and what one sync allocates beyond what the worker
held (:class:`flodl_hf.training.records.Resources`), their rollups, and their place in the portal's page."""

from __future__ import annotations

import sys

import pytest

from flodl_hf.training import page
from flodl_hf.training.records import SUMMARY, rollup

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (peak RSS)")


# Run in a fresh interpreter: a long process (the test suite) keeps freed heap pages resident, and a new buffer can
# reuse them without raising the resident set, so the readings below would see nothing (seen in a full run: 0 MiB).
_MEASURE = """
import json, math, torch
from flodl_hf.training.records import RESOURCE_FIELDS, Resources, resource_fields
MIB = 2**20
touch = lambda mib: torch.ones(mib * MIB // 4)  # every page written: resident
res = Resources(torch.device("cpu"))
first = res.sample()
kept = touch(32)  # held before the sync: steady state, not the sync's
with res.sync():
    buffer = touch(96)  # a transient: allocated and freed inside the sync
    del buffer
sync = resource_fields(res.sample())
big = touch(128)  # a window with a 128 MiB allocation, then one without
del big
high = resource_fields(res.sample())
low = resource_fields(res.sample())
print(json.dumps({"fields": len(first) == len(RESOURCE_FIELDS),
                  "first_sync_nan": math.isnan(first[RESOURCE_FIELDS.index("sync_mem_mb")]),
                  "sync": sync, "high": high, "low": low}))
"""


@pytest.fixture(scope="module")
def measured() -> dict:
    import json
    import os
    import subprocess
    from pathlib import Path
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sync_measures_what_it_allocates_beyond_the_steady_state(measured):
    assert measured["fields"] and measured["first_sync_nan"]  # no sync yet: NaN, not zero
    fields = measured["sync"]
    assert 90 <= fields["sync_mem_mb"] < 96 + 24, fields  # the 96 MiB buffer, not the 32 held before
    assert fields["mem_peak_mb"] >= fields["rss_mb"] + 90  # the window's peak saw it; the RSS after it did not


def test_peak_starts_over_each_window(measured):
    high, low = measured["high"], measured["low"]
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
