"""The trainer across hosts: two network namespaces on one machine (flodl_hf.testing.netns).

Each host runs ``flodl-hf train --nnodes 2 --node-rank i --rdzv-endpoint 10.213.0.1:PORT``
inside its namespace; traffic stays on the namespaces' own link. Every run has a deadline
and the cluster is removed on the way out, so a failure is an error, never a hang or a
leftover namespace. Needs root and iproute2; skips otherwise.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from flodl_hf.training.records import load_tree
from flodl_hf.training.sync.choice import SLOW_LINK_MB_S, SYNC_SHARE_SLOW
from flodl_hf.testing import netns
from flodl_hf.training.launch import launch

ROOT = Path(__file__).resolve().parents[1]
_WHY = netns.available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"multi-host tests: {_WHY}")
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}

# One script for every scenario: argv[1] is a JSON config, argv[2] the output directory.
SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path
    import torch
    from torch import nn
    from flodl_hf.training.trainer import DiLoCo, ElChe, Trainer

    cfg, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    rank, node = int(os.environ["RANK"]), int(os.environ.get("GROUP_RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n = cfg.get("n", 1200)
    x = torch.randn(n, 8)
    data = [(x[i], x[i].sin().sum(0, keepdim=True)) for i in range(n)]
    width = cfg.get("width", 16)
    model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))
    ms = cfg.get("ms", [0, 0])[rank]  # per-batch sleep: the uneven pair

    def step(model, batch):
        if ms:
            time.sleep(ms / 1000)
        if cfg.get("die") == node and not (out / "back").exists() and list((out / "ck").glob("step-*.pt")):
            time.sleep(60)  # waits here to be killed with its host
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    sync = cfg["sync"]
    if sync == "fsdp":  # the script's own group: the Trainer leaves it open, to put the shards together after fit
        import torch.distributed as dist
        from datetime import timedelta
        dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.get("timeout", 20)))
    if sync == "el-che":  # planned windows, averaged (cfg["el_che"] changes or adds fields); the rest El Che's choice
        sync = ElChe(**{"windows": "planned", "combine": "average", **cfg.get("el_che", {})})
    logs = out / ("logs" if node == 0 else f"logs-node{node}")  # no log dir shared between hosts
    t = Trainer(model, step, lambda p: torch.optim.SGD(p, lr=0.02), data, batch_size=4,
                max_steps=cfg["steps"], sync=sync, outer=DiLoCo() if cfg.get("diloco") else None,
                verify_sync=sync not in ("ddp", "fsdp"), log_dir=logs,
                checkpoint_dir=out / "ck" if cfg.get("ck") else None,
                checkpoint_every=cfg.get("ck"), progress=False, report=False, timeout=cfg.get("timeout", 20),
                log_every=5)
    summary = t.fit()
    # sync="fsdp": every worker takes part in putting the whole tensors together from the shards.
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(params, out / "params.pt")
        (out / "summary.json").write_text(json.dumps({"summary": summary, "history": t.history, "attempt": attempt,
                                                      "resumed_from": str(t.resumed_from)}, default=str))
    # torch 2.13 (CPU, gloo) sometimes aborts a process at interpreter exit, after everything has run:
    # "terminate called without an active exception", exit -6 (a plain 20-line torch DDP script under
    # torchrun, no flodl-hf in it, did so in 2 of 10 runs). The run is over here; leave without
    # static destructors, as tests/test_trainer_dist.py's harness does (docs/trainer.md).
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
''')


def _prepare(tmp_path: Path, cfg: dict) -> tuple[Path, list[str]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return script, [json.dumps(cfg), str(tmp_path)]


def _port() -> int:
    return random.randint(29500, 32000)  # inside the cluster's own namespaces: nothing else listens there


def _start(cluster: netns.Cluster, tmp_path: Path, script: Path, args: list[str], port: int,
           extra: tuple[str, ...] = (), max_restarts: int = 0, hosts=(0, 1), suffix: str = "") -> list:
    """Start the hosts' launches, host 0 first: the others once its rendezvous store listens,
    so a loaded machine's slow start cannot run out the store's connect timeout."""
    procs = []
    for i in hosts:
        cmd = cluster.torchrun_cmd(i, script, args, port=port, max_restarts=max_restarts, extra=extra)
        with open(tmp_path / f"host{i}{suffix}.log", "wb") as log:
            procs.append(cluster.popen(i, cmd, env={"GLOO_SOCKET_IFNAME": "eth0", **ENV}, stdout=log,
                                       stderr=subprocess.STDOUT))
        if i == 0:
            end = time.monotonic() + 60
            while time.monotonic() < end and f":{port} " not in cluster.run(0, ["ss", "-ltnH"]).stdout:
                assert procs[0].poll() is None, netns.read(tmp_path / "host0.log")[-3000:]
                time.sleep(0.2)
    return procs


def _run_cluster(tmp_path: Path, cfg: dict, deadline: float = 120, **links) -> str:
    script, args = _prepare(tmp_path, cfg)
    with netns.Cluster(2, **links) as cluster:
        shaping = cluster.shaping
        procs = _start(cluster, tmp_path, script, args, _port())
        codes = cluster.wait(procs, timeout=deadline)
    assert codes == [0, 0], f"exit codes {codes}\n" + "\n".join(
        netns.read(tmp_path / f"host{i}.log")[-3000:] for i in range(2))
    return shaping


def _summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "summary.json").read_text())


def _windows(summary: dict) -> list[dict]:
    return [r for r in summary["history"] if r.get("event") == "train"]


def test_cluster_is_isolated_and_removed():
    with netns.Cluster(2) as cluster:
        names = list(cluster.names) + [cluster.bridge_ns]
        # Host 0 reaches host 1 over the link: a one-line TCP echo.
        server = cluster.popen(1, [sys.executable, "-c", "import socket; s = socket.create_server(('"
                                   f"{cluster.address(1)}', 29411)); c, _ = s.accept(); c.sendall(c.recv(5))"])
        client = ("import socket, time\nfor _ in range(100):\n    try:\n        c = socket.create_connection(('"
                  f"{cluster.address(1)}', 29411), timeout=2); break\n    except OSError: time.sleep(0.1)\n"
                  "c.sendall(b'hello'); print(c.recv(5).decode())")
        done = cluster.run(0, [sys.executable, "-c", client])
        assert done.stdout.strip() == "hello", done.stderr
        assert server.wait(timeout=10) == 0
        # The link's addresses exist only inside the namespaces.
        root = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        assert netns.SUBNET not in root
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in left for n in names)


def test_ddp_and_fsdp_two_hosts_equal_two_workers_on_one_host(tmp_path):
    cfg = {"sync": "ddp", "steps": 40}
    hosts, sharded, local = tmp_path / "hosts", tmp_path / "sharded", tmp_path / "local"
    hosts.mkdir(), sharded.mkdir(), local.mkdir()
    _run_cluster(hosts, cfg)
    # The model sharded across the two hosts (each holds half of every parameter): reduce-scatter and
    # all-reduce sum the same two gradients, so its end is DDP's within 1e-6.
    _run_cluster(sharded, {**cfg, "sync": "fsdp"})
    script, args = _prepare(local, cfg)
    assert launch(script, args, workers=2, env=ENV, timeout=120) == 0
    two_hosts, one_host = torch.load(hosts / "params.pt"), torch.load(local / "params.pt")
    assert all(torch.equal(two_hosts[k], one_host[k]) for k in one_host)
    fsdp = torch.load(sharded / "params.pt")
    diff = max((fsdp[k] - one_host[k]).abs().max().item() for k in one_host)
    print(f"FSDP on 2 hosts vs DDP on 1 host, 40 SGD steps: max abs diff {diff:.3g}")
    assert diff <= 1e-6
    assert all(_summary(d)["summary"]["step"] == 40 for d in (hosts, sharded, local))


@pytest.mark.parametrize("windows", ["planned", "live"])
def test_el_che_uneven_hosts_and_one_record_tree(tmp_path, windows):
    # Host 1 sleeps 3x as long per batch (4 and 12 ms: each batch's own work, the same on both, brings the
    # ratio to 2.5 on a busy machine, and nearer 1 the busier it is). verify_sync makes every sync check that both hosts
    # hold bit-identical parameters (a TrainerError otherwise). Live windows claim their batches
    # from the counter on node 0's store, across the link.
    _run_cluster(tmp_path, {"sync": "el-che", "steps": 120, "ms": [4, 12], "el_che": {"windows": windows}})
    summary = _summary(tmp_path)
    windows_ = _windows(summary)
    fast, slow = (sum(w["batches"][r] for w in windows_[2:]) for r in (0, 1))
    print(f"El Che ({windows} windows), 2 hosts: batches fast {fast}, slow {slow}, ratio {fast / slow:.2f}")
    assert 1.3 < fast / slow < 6
    assert summary["summary"]["samples"] == 120 * 2 * 4  # max_steps' data, each sample once
    tree = load_tree(tmp_path / "logs")
    hosts = sorted(p for p in tree if p and "/" not in p)
    # The namespaces share a hostname: the node rank tells the two hosts apart.
    assert len(hosts) == 2 and hosts[0].endswith("-n0") and hosts[1].endswith("-n1")
    assert f"{hosts[0]}/rank-0" in tree and f"{hosts[1]}/rank-1" in tree
    assert not (tmp_path / "logs-node1").exists()  # host 1 was given its own dir and wrote nothing


def test_el_che_diloco_anchor_grows_behind_a_slow_link(tmp_path):
    # 100 Mbit/s and 5 ms each way, and 125k parameters (0.5 MB): the setup broadcast of the weights
    # reads the link as slow, so El Che sends bfloat16 changes and aims at a sync share of 30%; a sync
    # still costs tens of ms, far more than a 1-batch window, so the anchor must grow until the sync
    # share is under that target. Where the kernel lacks sch_netem the link has the rate and no delay.
    shaping = _run_cluster(tmp_path, {"sync": "el-che", "diloco": True, "steps": 900, "n": 12000, "ms": [2, 6],
                                      "width": 12500}, rate="100mbit", delay="5ms")
    print("link:", shaping)
    start = next(r for r in load_tree(tmp_path / "logs")[""] if r["event"] == "start")["el_che"]
    print("El Che:", start["chose"], start["link"])
    assert start["link"]["hosts"] == 2 and start["link"]["slow"], start["link"]
    assert start["link"]["mb_per_s"] < SLOW_LINK_MB_S, start["link"]
    assert (start["chose"]["compress"], start["chose"]["sync_share"]) == ("bf16", SYNC_SHARE_SLOW), start
    assert (start["chose"]["combine"], start["chose"]["anchor"]) == ("average", None), start  # DiLoCo's
    windows = [w for w in _windows(_summary(tmp_path)) if "sync_ms" in w]
    shares = [w["sync_ms"] / max(w["window_ms"]) for w in windows]
    anchors = [w["anchor"] for w in windows]
    print("anchors", anchors)
    print("sync shares", [round(s, 3) for s in shares])
    assert anchors[-1] >= 4 * anchors[0]
    assert min(shares[-3:]) < SYNC_SHARE_SLOW < shares[0]
    fast, slow = (sum(w["batches"][r] for w in windows[3:]) for r in (0, 1))
    assert 1.3 < fast / slow < 6


def _survivor_stops(tmp_path: Path, victim: int, how: str, store_timeout: float,
                    sync: str = "el-che") -> tuple[list, float, str]:
    cfg = {"sync": sync, "steps": 100000, "n": 4000, "ms": [3, 3], "timeout": 5}
    script, args = _prepare(tmp_path, cfg)
    with netns.Cluster(2) as cluster:
        procs = _start(cluster, tmp_path, script, args, _port(), extra=("--store-timeout", str(store_timeout)))
        end = time.monotonic() + 90
        while time.monotonic() < end and not (tmp_path / "logs" / "records.jsonl").is_file():
            time.sleep(0.5)
        time.sleep(3)  # a few windows in
        assert all(p.poll() is None for p in procs), "a host ended before the fault"
        if how == "killed":
            assert cluster.kill_host(victim) >= 2  # its torchrun and its worker
        else:  # the host vanishes without closing a socket (cable, power)
            subprocess.run(["ip", "-n", cluster.bridge_ns, "link", "set", f"p{victim}", "down"], check=True)
        t = time.monotonic()
        survivor = 1 - victim
        code = cluster.wait([procs[survivor]], timeout=60)
        took = time.monotonic() - t
    return code, took, netns.read(tmp_path / f"host{survivor}.log")


@pytest.mark.parametrize("sync", ["el-che", "fsdp"])
def test_host_killed_survivor_stops_with_worker_lost(tmp_path, sync):
    code, took, log = _survivor_stops(tmp_path, victim=1, how="killed", store_timeout=15, sync=sync)
    print(f"{sync}, host 1 killed: host 0's launch exited {code} after {took:.1f}s")
    assert code[0] not in (None, 0), log[-3000:]
    assert "WorkerLostError" in log


def test_store_host_vanishes_survivor_torchrun_ends(tmp_path):
    # Node 0 (the rendezvous store) goes silent: the surviving agent would block in a store
    # read for the kernel's TCP retransmission timeout; flodl-hf train ends it.
    code, took, log = _survivor_stops(tmp_path, victim=0, how="silent", store_timeout=5)
    print(f"host 0 cut off: host 1's launch exited {code} after {took:.1f}s")
    assert code[0] not in (None, 0), log[-3000:]
    assert "WorkerLostError" in log and "no longer answers" in log


def test_host_that_comes_back_resumes_from_last_checkpoint(tmp_path):
    cfg = {"sync": "el-che", "steps": 150, "ms": [2, 2], "ck": 20, "die": 1, "timeout": 10}
    script, args = _prepare(tmp_path, cfg)
    with netns.Cluster(2) as cluster:
        port = _port()
        logs = [tmp_path / "host0.log", tmp_path / "host1-back.log"]
        procs = _start(cluster, tmp_path, script, args, port, max_restarts=1)
        end = time.monotonic() + 90
        while time.monotonic() < end and not list((tmp_path / "ck").glob("step-*.pt")):
            time.sleep(0.3)
        time.sleep(1)
        assert cluster.kill_host(1) >= 2
        (tmp_path / "back").write_text("")
        procs[1:] = _start(cluster, tmp_path, script, args, port, max_restarts=1, hosts=(1,), suffix="-back")
        codes = cluster.wait(procs, timeout=120)
    assert codes == [0, 0], f"{codes}\n{netns.read(logs[0])[-3000:]}\n{netns.read(logs[1])[-2000:]}"
    summary = _summary(tmp_path)
    assert summary["summary"]["step"] == 150
    assert "step-" in summary["resumed_from"]  # the restarted run began from the last checkpoint


def test_cluster_removed_after_an_error_and_stale_ones_cleaned():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.Cluster(2) as cluster:
            sleeper = cluster.popen(1, ["sleep", "600"])
            names = list(cluster.names) + [cluster.bridge_ns]
            raise RuntimeError("boom")
    assert sleeper.wait(timeout=10) is not None  # killed with its namespace
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in left for n in names)
    # A namespace left by a harness process that is gone (pid 2**22 + 1 is above pid_max's default).
    stale, other = f"{netns.PREFIX}-{2**22 + 1}-dead-h0", "otherprefix-1-h0"
    for ns in (stale, other):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        assert stale in netns.cleanup_stale()
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in left and other in left  # only its own prefix is touched
    finally:
        for ns in (stale, other):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
