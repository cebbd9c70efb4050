"""N hosts on one machine: one Linux network namespace per host, linked through a bridge.

::

    with Cluster(2, rate="100mbit", delay="5ms") as c:   # needs root, `ip` and `tc`
        procs = [c.torchrun(i, "train.py", ["out"], port=29400) for i in range(2)]
        codes = c.wait(procs, timeout=120)

Layout. Every namespace the harness makes is named ``<prefix>-<pid>-<tag>-...`` (default
prefix ``flodlhf``): one ``...-br`` holding the bridge ``br0``, and one ``...-h<i>`` per host.
Host ``i`` has ``lo`` and ``eth0`` (``10.213.0.<i+1>/24``), the far end of a veth pair whose
near end sits on the bridge, inside the bridge's namespace. Nothing is created in the root
namespace: the veth pairs are made inside the bridge namespace with their peer placed
straight into the host's, so the addresses exist only inside these namespaces and no
route leads out of them. Traffic stays on these links (and each namespace's own loopback).

``tc netem`` (``rate``, ``delay``, ``loss``) shapes both ends of each host's link: what a host
sends is shaped on its ``eth0``, what it receives on the bridge port, so a 5 ms link adds
5 ms each way. Kernels built without ``sch_netem`` (this project's CI machines among them)
get the rate from ``tbf`` and no delay or loss; :attr:`Cluster.shaping` says which.

Cleanup. Leaving the ``with`` block (normally, on an exception, or after a timeout) SIGKILLs
every process still inside the namespaces and deletes them, which removes their links too.
:func:`cleanup_stale` deletes namespaces left by a harness process that no longer runs (it
reads the owner's pid from the name) and touches only names with this prefix.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from flodl_hf.core.errors import FlodlHFError
from flodl_hf.core.io import pid_alive

__all__ = ["Cluster", "NetnsError", "available", "cleanup_stale", "PREFIX", "SUBNET"]

PREFIX = "flodlhf"
SUBNET = "10.213.0"  # host i is SUBNET.<i+1>; the bridge namespace has no address


class NetnsError(FlodlHFError):
    """A namespace, link or qdisc could not be set up (the failing command and its stderr)."""


def available() -> str | None:
    """None when the harness can run here, else why not (for ``pytest.skip``)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_all(ns: str) -> None:
    """SIGKILL every process inside ``ns`` until none is left (bounded: a few seconds)."""
    for _ in range(50):
        pids = [p for p in _pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _delete(ns: str) -> None:
    _kill_all(ns)
    _ip("netns", "del", ns, check=False)


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete ``<prefix>-<pid>-...`` namespaces whose owner pid no longer runs; return their names."""
    removed = []
    for ns in _namespaces():
        parts = ns.split("-")
        if len(parts) >= 3 and parts[0] == prefix and parts[1].isdigit() and not pid_alive(int(parts[1])):
            _delete(ns)
            removed.append(ns)
    return removed


class Cluster:
    """``hosts`` network namespaces on one bridge; a context manager that always removes them.

    ``rate`` (``"100mbit"``), ``delay`` (``"5ms"``) and ``loss`` (``"0.1%"``) are tc netem
    arguments applied to every link, each direction. Where the kernel lacks ``sch_netem``
    (some container kernels), ``fallback=True`` shapes the rate with ``tbf`` and leaves delay
    and loss out; :attr:`shaping` says what was applied (``fallback=False``: NetnsError).
    """

    def __init__(self, hosts: int, *, rate: str | None = None, delay: str | None = None,
                 loss: str | None = None, fallback: bool = True, prefix: str = PREFIX) -> None:
        if not 1 <= hosts <= 200:
            raise NetnsError(f"hosts must be between 1 and 200, got {hosts}")
        if "-" in prefix or not prefix.isalnum():
            raise NetnsError(f"prefix must be alphanumeric (no '-'), got {prefix!r}")
        self.hosts, self.prefix = hosts, prefix
        self.netem = [a for key, v in (("rate", rate), ("delay", delay), ("loss", loss)) if v for a in (key, v)]
        self.rate, self.delay, self.loss, self.fallback = rate, delay, loss, fallback
        self.shaping = "none"  # what was applied to the links, once entered
        self.tag = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.tag}-br"
        self.names = [f"{self.tag}-h{i}" for i in range(hosts)]
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []

    # ---- lifetime ----------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        cleanup_stale(self.prefix)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        br = self.bridge_ns
        _ip("netns", "add", br)
        self._made.append(br)
        _ip("-n", br, "link", "set", "lo", "up")
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Made inside the bridge namespace, its peer put straight into the host's.
            _ip("-n", br, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", br, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", br, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            for where, dev in ((ns, "eth0"), (br, f"p{i}")) if self.netem else ():
                self._shape(where, dev)

    def _shape(self, ns: str, dev: str) -> None:
        """netem on one end of a link; where the kernel has no sch_netem, tbf for the rate alone."""
        def tc(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *args],
                                  capture_output=True, text=True, timeout=30)
        done = tc("netem", *self.netem)
        if done.returncode == 0:
            self.shaping = "netem " + " ".join(self.netem)
            return
        if "unknown" not in done.stderr or not self.fallback:
            raise NetnsError(f"tc netem {' '.join(self.netem)} on {ns}/{dev} failed: {done.stderr.strip()}")
        missing = [f"{k} {v}" for k, v in (("delay", self.delay), ("loss", self.loss)) if v]
        self.shaping = (f"tbf rate {self.rate}" if self.rate else "none") + \
            (f" (this kernel has no sch_netem: {', '.join(missing)} not applied)" if missing else "")
        if self.rate:
            done = tc("tbf", "rate", self.rate, "burst", "64kb", "latency", "400ms")
            if done.returncode != 0:
                raise NetnsError(f"tc tbf rate {self.rate} on {ns}/{dev} failed: {done.stderr.strip()}")

    def close(self) -> None:
        """Kill every process in the namespaces and delete them (their links go with them)."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for ns in reversed(self._made):
            _delete(ns)
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._made.clear()

    # ---- use ---------------------------------------------------------------------------------
    def address(self, host: int) -> str:
        """Host ``host``'s address on the cluster's link (it exists only inside its namespace)."""
        return f"{SUBNET}.{host + 1}"

    def popen(self, host: int, cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
              stdout=None, stderr=None, cwd: str | os.PathLike | None = None) -> subprocess.Popen:
        """Start ``cmd`` inside host ``host``'s namespace, in a session of its own."""
        if not 0 <= host < self.hosts:
            raise NetnsError(f"no host {host} in a cluster of {self.hosts}")
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], *cmd], env={**os.environ, **(env or {})},
                                stdout=stdout, stderr=stderr, cwd=cwd, start_new_session=True)
        self._procs.append(proc)
        return proc

    def run(self, host: int, cmd: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a short command inside host ``host``'s namespace and return its output."""
        return subprocess.run(["ip", "netns", "exec", self.names[host], *cmd], capture_output=True, text=True,
                              timeout=timeout)

    def torchrun_cmd(self, host: int, script: str | os.PathLike, args: Sequence[str] = (), *, port: int = 29400,
                     nproc: int = 1, max_restarts: int = 0, extra: Sequence[str] = ()) -> list[str]:
        """The ``flodl-hf train`` command line for host ``host`` (torchrun, c10d rendezvous on host 0)."""
        return [sys.executable, "-m", "flodl_hf.cli", "train", "--workers", str(nproc), "--nnodes", str(self.hosts),
                "--node-rank", str(host), "--rdzv-endpoint", f"{self.address(0)}:{port}",
                "--local-addr", self.address(host), "--max-restarts", str(max_restarts), *extra,
                str(script), *args]

    def torchrun(self, host: int, script: str | os.PathLike, args: Sequence[str] = (), *, port: int = 29400,
                 nproc: int = 1, max_restarts: int = 0, env: Mapping[str, str] | None = None,
                 log: str | os.PathLike | None = None) -> subprocess.Popen:
        """Start host ``host``'s torchrun (through ``flodl-hf train``); ``log`` gets its output."""
        out = open(log, "wb") if log is not None else None
        try:
            # gloo binds to the link, not to whatever the shared hostname resolves to.
            env = {"GLOO_SOCKET_IFNAME": "eth0", **(env or {})}
            return self.popen(host, self.torchrun_cmd(host, script, args, port=port, nproc=nproc,
                                                      max_restarts=max_restarts),
                              env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
        finally:
            if out is not None:
                out.close()

    def kill_host(self, host: int) -> int:
        """SIGKILL every process inside host ``host``'s namespace (a host lost); return how many."""
        pids = _pids(self.names[host])
        _kill_all(self.names[host])
        return len(pids)

    def wait(self, procs: Sequence[subprocess.Popen], timeout: float) -> list[int | None]:
        """Each process's exit code, waiting at most ``timeout`` seconds in all (None: still running)."""
        end = time.monotonic() + timeout
        codes: list[int | None] = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.01, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes


def read(path: str | os.PathLike) -> str:
    """A log file's text, or '' when it is not there (for assertion messages)."""
    p = Path(path)
    return p.read_text(errors="replace") if p.is_file() else ""
