"""Launching a training script as N worker processes per node under torchrun (``flodl-hf train``), and
watching torchrun so that a launch whose rendezvous store vanished ends."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Sequence

from flodl_hf.core.errors import InputError
from flodl_hf.training.sync import TrainerError

__all__ = ["launch"]


def launch(script: str | os.PathLike, args: Sequence[str] = (), *, workers: int = 1, max_restarts: int = 0,
           env: Mapping[str, str] | None = None, timeout: float | None = None, nnodes: int = 1,
           node_rank: int = 0, rdzv_endpoint: str | None = None, local_addr: str | None = None,
           store_timeout: float = 15.0) -> int:
    """Run ``script`` as ``workers`` processes per node with torchrun; return torchrun's exit code.

    One node (``nnodes=1``): a standalone rendezvous on this machine. Several nodes: every node
    runs this with the same ``nnodes`` and ``rdzv_endpoint`` (``HOST:PORT`` of node 0, which
    hosts the c10d rendezvous store) and its own ``node_rank``; ``local_addr`` is the address the
    other nodes reach this one at (default: what its hostname resolves to).

    ``store_timeout`` (seconds) bounds each of the elastic agent's rendezvous-store calls. A
    store host that dies without closing its sockets (power, network) otherwise leaves the
    surviving agents blocked in their monitor loop's store read for the c10d default of 60 s
    per call, then again in the rendezvous shutdown: measured on two network namespaces,
    still running 150 s after their workers had raised WorkerLostError. ``timeout`` (seconds)
    kills the whole launch, workers included, and raises TrainerError.
    """
    script = Path(script)
    if not script.is_file():
        raise InputError(f"training script {script} not found")
    if workers < 1:
        raise InputError(f"--workers must be at least 1, got {workers}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise InputError(f"--node-rank must be in [0, --nnodes), got {node_rank} with --nnodes {nnodes}")
    if nnodes > 1 and not rdzv_endpoint:
        raise InputError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if not store_timeout > 0:
        raise InputError(f"--store-timeout must be positive, got {store_timeout}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={workers}",
           f"--max-restarts={max_restarts}"]
    if nnodes == 1 and not rdzv_endpoint:
        cmd.append("--standalone")
    else:
        # Node 0 hosts the store: said explicitly, since torchrun's guess compares the endpoint
        # with the hostname, which several namespaces (or NAT'd hosts) share or do not match.
        conf = f"is_host={int(node_rank == 0)},read_timeout={math.ceil(store_timeout)}," \
               f"close_timeout={math.ceil(store_timeout)}"
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-conf={conf}"]
        if local_addr:
            cmd.append(f"--local-addr={local_addr}")
    cmd += [str(script), *args]
    # Workers sharing the rendezvous store can read a dead worker's address after a restart
    # (pytorch/pytorch#135712); a store of their own per attempt avoids it.
    env = {**({} if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in os.environ else
              {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}), **(env or {})}
    # With a timeout the launch gets its own session, so the workers can be killed with it.
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=timeout is not None)
    try:
        return _watch(proc, timeout, max_restarts, store_timeout if nnodes > 1 or rdzv_endpoint else None)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise TrainerError(f"{script}: training did not finish within {timeout:.0f}s; its processes were killed")
    except KeyboardInterrupt:
        proc.wait()  # torchrun got the same Ctrl-C and stops its workers
        raise


def _children(pid: int) -> set[int]:
    """The running child processes of ``pid``, exited but unreaped ones left out (Linux /proc)."""
    found = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(c) for c in f.read().split())
    except OSError:
        pass
    running = set()
    for child in found:
        try:
            with open(f"/proc/{child}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):  # a blocked agent does not reap its dead workers
            running.add(child)
    return running


def _watch(proc: subprocess.Popen, timeout: float | None, max_restarts: int, store_timeout: float | None) -> int:
    """Wait for torchrun; end it when it outlives its last allowed set of workers.

    Multi-node only (``store_timeout`` set): once torchrun's workers have exited
    ``max_restarts + 1`` times, the agent has nothing left but to report and close the
    rendezvous; if it is still running ``store_timeout + 5`` s later it is blocked on a
    store host that vanished without closing its sockets (measured: the c10d store client's
    read then waits for the kernel's TCP retransmission timeout, many minutes, whatever
    ``read_timeout`` says), so it is killed and the launch returns 1.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    if store_timeout is None or not sys.platform.startswith("linux"):
        return proc.wait(timeout=timeout)
    had_workers, exits, idle_since = False, 0, None
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() > deadline:
                raise
        workers = _children(proc.pid)
        if workers:
            had_workers, idle_since = True, None
            continue
        if had_workers:
            had_workers, exits, idle_since = False, exits + 1, time.monotonic()
        if exits > max_restarts and idle_since is not None and time.monotonic() - idle_since > store_timeout + 5:
            proc.kill()
            proc.wait()
            print(f"flodl-hf train: torchrun was still running {time.monotonic() - idle_since:.0f}s after its "
                  "workers exited: its rendezvous store (node 0) no longer answers; ended it", file=sys.stderr)
            return 1
