"""Worker 0's evaluation and the other workers' wait: gloo on 127.0.0.1, two workers.

The other workers wait for an evaluation on the store while worker 0's heartbeat goes on, so an
evaluation longer than ``timeout`` is no lost worker; a worker 0 that dies or freezes in it still
is, within about ``timeout``. The harness is test_trainer_dist's (spawned workers, a deadline).
"""

from __future__ import annotations

import os
import re
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flodl_hf.training.sync import ElChe
from flodl_hf.training.trainer import WorkerLostError
from test_trainer_dist import flat, mlp, run, spawn

TIMEOUT = 4.0  # the process group's and the trainer's
LONG = 1.5 * TIMEOUT  # an evaluation that outlasts every collective's timeout by seconds

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _lost_in_eval(rank: int, how: str) -> dict:
    """An El Che run whose worker 0 is lost in its first evaluation: ``killed``, or ``frozen`` in C
    code that holds the GIL, so the process (and the store it hosts) lives on but its heartbeat
    thread stops. Worker 1's error and when it came."""
    def eval_fn(model):
        if how == "killed":
            os._exit(3)
        re.match(r"(a+)+$", "a" * 40 + "b")  # hours; the harness kills the process once worker 1 is done
        return 0.0

    start = time.monotonic()
    try:
        run(mlp(), n=64, epochs=2, eval_fn=eval_fn if rank == 0 else (lambda m: 0.0), eval_every=2,
            sync=ElChe(anchor=2), timeout=TIMEOUT)
    except WorkerLostError as exc:
        return {"error": str(exc), "after": time.monotonic() - start}
    return {"error": None}


def _first_call_long():
    """An ``eval_fn`` whose first call sleeps ``LONG``; each returns the calls so far and a parameter sum."""
    calls = 0

    def eval_fn(model):
        nonlocal calls
        calls += 1
        if calls == 1:
            time.sleep(LONG)
        return {"calls": calls, "w": float(model[0].weight.sum())}
    return eval_fn


def _long_eval_then_frozen(rank: int, out: str) -> dict:
    """DDP, then El Che's live windows with ``stop_when``, each with a first evaluation of ``LONG``
    seconds; then a run whose worker 0 freezes in its evaluation (it saves its results first)."""
    result = {}
    for name, sync, stop_when in (("ddp", "ddp", None),
                                  ("live", ElChe(windows="live", combine="average"), lambda m: m["calls"] >= 2)):
        start = time.monotonic()
        t = run(mlp(), sync=sync, n=64, epochs=2, eval_fn=_first_call_long(), eval_every=4, stop_when=stop_when,
                timeout=TIMEOUT)
        result[name] = {"params": flat(t.model), "history": t.history, "step": t.step,
                        "total": t.total_steps, "wall": time.monotonic() - start}
    if rank == 0:
        torch.save(result, Path(out) / "long-0.pt")
    result["frozen"] = _lost_in_eval(rank, "frozen")
    return result


@pytest.fixture(scope="module")
def long_then_frozen(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("long-then-frozen")
    res = spawn(_long_eval_then_frozen, out, pg_timeout=TIMEOUT, deadline=120.0, wait_for=(1,))
    return {0: torch.load(out / "long-0.pt", weights_only=False), 1: res[1]}


def test_an_evaluation_longer_than_timeout_is_waited_for(long_then_frozen):
    res = long_then_frozen
    for name in ("ddp", "live"):
        r0, r1 = res[0][name], res[1][name]
        assert torch.equal(r0["params"], r1["params"]), name
        evals = [r for r in r0["history"] if r.get("event") == "eval"]
        assert evals and evals[0]["eval_s"] >= LONG, (name, evals)
        assert r1["wall"] >= LONG  # worker 1 waited for it, rather than failing after TIMEOUT
    # stop_when's answer (the second evaluation) reached both workers: the same early step.
    live0, live1 = res[0]["live"], res[1]["live"]
    assert live0["step"] == live1["step"] < live0["total"]
    assert [r["calls"] for r in live0["history"] if r.get("event") == "eval"] == [1, 2]
    assert res[0]["ddp"]["step"] == res[0]["ddp"]["total"]


def _lost(rank: int, out: str, how: str) -> dict:
    return _lost_in_eval(rank, how)


def _check_lost(found: dict, how: str) -> None:
    error, after = found["error"], found.get("after")
    assert error is not None and re.search(r"waiting for worker 0's evaluation at step \d+ failed", error), error
    assert after < TIMEOUT + 6, found
    print(f"{how}: WorkerLostError after {after:.1f} s")


def test_worker_0_frozen_in_its_evaluation_is_found_by_its_heartbeat(long_then_frozen):
    found = long_then_frozen[1]["frozen"]
    _check_lost(found, "frozen")
    assert "no heartbeat" in found["error"], found  # the store still answered: the beats stopped


def test_worker_0_killed_in_its_evaluation_is_an_error_not_a_hang(tmp_path):
    _check_lost(spawn(_lost, tmp_path, "killed", pg_timeout=TIMEOUT, deadline=90.0, wait_for=(1,))[1], "killed")


def _short_runs(rank: int, out: str) -> dict:
    """``eval_fn`` on worker 0 only (the others wait in their next collective, as before); then a
    run whose last evaluation (50 ms: worker 1 is asleep between polls when it ends) is the last
    thing before the process exits, which takes down the store worker 0 hosts."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        one = run(mlp(), n=32, epochs=1, eval_fn=(lambda m: 0.0) if rank == 0 else None, sync="none")
    t = run(mlp(), n=32, epochs=1, eval_fn=lambda m: time.sleep(0.05) or 0.0, sync="none")
    return {"warned": [str(w.message) for w in warned if "eval_fn" in str(w.message)],
            "steps": (one.step, t.step), "evals": sum(r.get("event") == "eval" for r in t.history)}


def test_worker_0_waits_until_its_last_evaluation_is_read(tmp_path):
    res = spawn(_short_runs, tmp_path, pg_timeout=TIMEOUT, deadline=60.0)
    assert res[0]["steps"] == res[1]["steps"] == (4, 4) and (res[0]["evals"], res[1]["evals"]) == (1, 0), res
    assert len(res[0]["warned"]) == 1 and "differs between the workers" in res[0]["warned"][0], res[0]
    assert res[1]["warned"] == []


# ---- nested windows: an evaluation at an inner sync ------------------------------------------

NESTED = ElChe(anchor=1, windows="live", combine="sum", nested=((0, 1), (2,)))


def _paced_step(rank: int):
    """Worker 0 10 ms a batch, worker 1 30 ms (the inner tier), worker 2 one second (the outer tier):
    the inner tier syncs, and worker 0 evaluates, many times while worker 2 runs its one batch."""
    from test_trainer_dist import mse_step

    def step(model, batch):
        time.sleep((0.010, 0.030, 1.0)[rank])
        return mse_step(model, batch)
    return step


def _nested_long_eval(rank: int, out: str) -> dict:
    """Worker 0's first evaluation, at an inner sync, lasts ``LONG``: worker 1 (inner) waits for it
    at the inner sync, worker 2 (outer) before the outer sync, each for longer than ``timeout``."""
    start = time.monotonic()
    t = run(mlp(), step=_paced_step(rank), sync=NESTED, n=96, epochs=1, eval_fn=_first_call_long(), eval_every=1,
            timeout=TIMEOUT, verify_sync=True)
    return {"params": flat(t.model), "history": t.history, "records": t.records, "samples": t.samples,
            "wall": time.monotonic() - start}


def test_an_inner_sync_evaluation_longer_than_timeout_is_waited_for(tmp_path):
    res = spawn(_nested_long_eval, tmp_path, pg_timeout=TIMEOUT, deadline=120.0, world=3)
    assert torch.equal(res[0]["params"], res[1]["params"]) and torch.equal(res[0]["params"], res[2]["params"])
    evals = [r for r in res[0]["history"] if r.get("event") == "eval"]
    assert evals and evals[0]["eval_s"] >= LONG, evals
    # the long evaluation came at an inner sync: within the first window, before its outer sync
    assert res[0]["records"][0].get("inner_syncs", 0) >= 1, res[0]["records"][0]
    assert res[0]["samples"] == res[1]["samples"] == res[2]["samples"] == 96
    for r in (1, 2):
        assert res[r]["wall"] >= LONG, (r, res[r]["wall"])


def _nested_killed(rank: int, out: str) -> dict:
    """Worker 0 dies in its first evaluation, at an inner sync."""
    def eval_fn(model):
        if rank == 0:
            os._exit(3)
        return 0.0

    start = time.monotonic()
    try:
        run(mlp(), step=_paced_step(rank), sync=NESTED, n=96, epochs=1, eval_fn=eval_fn, eval_every=1,
            timeout=TIMEOUT)
    except WorkerLostError as exc:
        return {"error": str(exc), "after": time.monotonic() - start}
    return {"error": None}


def test_worker_0_killed_in_an_inner_sync_evaluation_is_an_error_for_both_tiers(tmp_path):
    res = spawn(_nested_killed, tmp_path, pg_timeout=TIMEOUT, deadline=90.0, wait_for=(1, 2), world=3)
    for r in (1, 2):
        assert res[r]["error"] is not None and res[r]["after"] < TIMEOUT + 8, (r, res[r])
    # worker 0 hosts the store here: its death is seen at the next store call, wherever each worker is
    assert "waiting for worker 0's evaluation" in res[1]["error"], res[1]
