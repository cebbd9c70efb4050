"""The record of a run as a tree whose paths are file paths.

::

    RUN/records.jsonl                              the root rollup (plus start/eval/checkpoint/end events)
    RUN/host-<name>/records.jsonl                  one host's rollup
    RUN/host-<name>/rank-<r>/records.jsonl         one worker

A node's path is its directory under RUN (``""`` for the root, ``"host-a"``,
``"host-a/rank-3"``). Each line is one record: ``t`` (Unix time), ``time`` (training
seconds), ``step``, ``epoch``, ``level``, ``name``, ``status``, the level's metrics and, in a
rollup, ``children``: each child's latest summary, so one record draws a node and its grid.

Rank 0 writes the whole tree from the per-window numbers the trainer all-gathers anyway, so
no shared filesystem is assumed and a multi-host run sends only these small rows.

Runs written before the tree (``run.jsonl`` and ``worker-R.jsonl``) are read as a tree by
:func:`load_tree` (one host, ``host-local``), without rewriting them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import time
from pathlib import Path
from typing import Iterable, Sequence

RECORDS = "records.jsonl"
LEVELS = ("root", "host", "rank")
# Metrics of a rank; the rollup sums the first group and averages the second.
SUMMED = ("samples_per_s", "samples", "batches", "rss_mb", "gpu_mem_mb", "mem_peak_mb")
AVERAGED = ("lr", "ms_per_batch", "sync_ms", "idle_share", "cpu_pct", "gpu_util", "sync_mem_mb")
# Kept with who they were, over the node's ranks: the slowest rank, the idlest, the heaviest.
EXTREMES = ("samples_per_s", "ms_per_batch", "idle_share", "loss", "cpu_pct", "rss_mb", "mem_peak_mb", "sync_mem_mb")
# The numbers one child's summary carries in its parent's record.
SUMMARY = ("status", "step", "t", "loss", "samples_per_s", "ms_per_batch", "idle_share", "cpu_pct", "rss_mb",
           "gpu_mem_mb", "mem_peak_mb", "sync_mem_mb", "alive", "dead")
# The numbers Resources.sample() gives, in the order of the trainer's all-gather rows (at their end).
RESOURCE_FIELDS = ("cpu_pct", "rss_mb", "gpu_util", "gpu_mem_mb", "mem_peak_mb", "sync_mem_mb")
IDLE_SHARE = 0.5  # a rank that waits half its window or more is shown as idle
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")
NODE_RE = re.compile(r"^(host-[A-Za-z0-9._-]+(/rank-\d+)?)?$")


# ---- naming ----------------------------------------------------------------------------------

def local_identity() -> tuple[str, int]:
    """This process's (hostname, torchrun node rank): what names its host in the tree."""
    return socket.gethostname(), int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")) or 0)


def host_names(identities: Sequence[tuple[str, int]]) -> list[str]:
    """Each rank's host name in the tree: its hostname, plus ``-n<node rank>`` when two nodes
    share a hostname (network namespaces on one machine do)."""
    def clean(host: str) -> str:
        return _NAME_RE.sub("-", host).strip("-.") or "host"

    nodes: dict[str, set[tuple[str, int]]] = {}  # by cleaned name: the distinct (hostname, node) behind it
    for host, node in identities:
        nodes.setdefault(clean(host), set()).add((host, node))
    return [f"{clean(host)}-n{node}" if len(nodes[clean(host)]) > 1 else clean(host) for host, node in identities]


def encode_name(name: str, width: int = 64) -> list[float]:
    """A hostname as ``width`` numbers, so it can travel in the trainer's all-gather of floats."""
    codes = [float(b) for b in name.encode("utf-8")[:width]]
    return codes + [0.0] * (width - len(codes))


def decode_name(codes: Iterable[float]) -> str:
    return bytes(int(c) for c in codes if int(c) > 0).decode("utf-8", errors="replace")


def rank_path(host: str, rank: int) -> str:
    return f"host-{host}/rank-{rank}"


def level_of(path: str) -> str:
    return LEVELS[0 if not path else path.count("/") + 1]


# ---- reading ---------------------------------------------------------------------------------

def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of one JSONL file. A half-written last line (a run in progress) and lines that
    are not JSON objects are skipped, never fatal."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    return parse_lines(data)[0]


def parse_lines(data: bytes) -> tuple[list[dict], int]:
    """Records in ``data`` and how many bytes of it were complete lines (the rest is an
    unfinished line, to be read again once its newline is written)."""
    end = data.rfind(b"\n") + 1
    out = []
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            out.append(_finite(record))  # a foreign NaN or Infinity reads as null, as the trainer writes it
    return out, end


def _in_run(run: Path, file: Path) -> bool:
    """``file`` is a file of the run directory itself: not a link to one outside it."""
    return file.is_file() and file.resolve().is_relative_to(run.resolve())


def tree_paths(run: str | os.PathLike) -> list[str]:
    """Every node's path in ``run`` (root first, then hosts, each followed by its ranks)."""
    run = Path(run)
    if not (run / RECORDS).is_file() and _legacy_files(run):
        return list(_legacy_tree(run))
    paths = [""] if _in_run(run, run / RECORDS) else []
    for host in sorted(run.glob("host-*")):
        if _in_run(run, host / RECORDS) and NODE_RE.match(host.name):
            paths.append(host.name)
            ranks = [p for p in host.glob("rank-*") if _in_run(run, p / RECORDS) and NODE_RE.match(f"{host.name}/{p.name}")]
            paths += [f"{host.name}/{p.name}" for p in sorted(ranks, key=lambda p: int(p.name[5:]))]
    return paths


def load_tree(run: str | os.PathLike) -> dict[str, list[dict]]:
    """Every node's records, by path; a run in the old layout is read as a one-host tree."""
    run = Path(run)
    if not (run / RECORDS).is_file() and _legacy_files(run):
        return _legacy_tree(run)
    return {p: read_records(run / p / RECORDS) for p in tree_paths(run)}


def _legacy_files(run: Path) -> bool:
    return _in_run(run, run / "run.jsonl") or any(_in_run(run, p) for p in run.glob("worker-*.jsonl"))


def _legacy_tree(run: Path) -> dict[str, list[dict]]:
    """A run written as ``run.jsonl`` + ``worker-R.jsonl`` (before the tree), as a tree in memory."""
    root = [dict(r, level="root", name="run") for r in read_records(run / "run.jsonl")] \
        if _in_run(run, run / "run.jsonl") else []
    ranks = {}
    for p in run.glob("worker-*.jsonl"):
        if not _in_run(run, p):
            continue
        try:
            rank = int(p.stem.split("-")[1])
        except ValueError:
            continue
        ranks[rank] = [dict(r, event="train", level="rank", name=f"rank-{rank}", status="training")
                       for r in read_records(p)]
    for records in ranks.values():
        if records:
            records[-1]["status"] = "finished"
    tree = {"": root, "host-local": [dict(r, level="host", name="local") for r in root if r.get("event") == "train"]}
    tree.update({f"host-local/rank-{r}": ranks[r] for r in sorted(ranks)})
    for record in tree[""] + tree["host-local"]:
        record.setdefault("children", {})
    return tree


# ---- rollups ---------------------------------------------------------------------------------

def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def rollup(ranks: dict[str, dict], prefix: str = "") -> dict:
    """One level's numbers from its ranks' records (by path relative to the level): sums,
    averages (loss weighted by samples), min and max with who, alive and dead counts."""
    alive = {k: r for k, r in ranks.items() if r.get("status") != "lost"}
    out: dict = {"ranks": len(ranks), "alive": len(alive), "dead": len(ranks) - len(alive)}
    for key in SUMMED:
        vals = [v for r in alive.values() if (v := _num(r.get(key))) is not None]
        if vals:
            out[key] = sum(vals)
    for key in AVERAGED:
        vals = [v for r in alive.values() if (v := _num(r.get(key))) is not None]
        if vals:
            out[key] = sum(vals) / len(vals)
    weighted = [(v, _num(r.get("samples")) or 0.0) for r in alive.values() if (v := _num(r.get("loss"))) is not None]
    total = sum(w for _, w in weighted)
    if weighted:
        out["loss"] = sum(v * w for v, w in weighted) / total if total else sum(v for v, _ in weighted) / len(weighted)
    lo, hi = {}, {}
    for key in EXTREMES:
        vals = [(v, who) for who, r in alive.items() if (v := _num(r.get(key))) is not None]
        if vals:
            v, who = min(vals, key=lambda x: x[0])
            lo[key] = {"v": v, "who": prefix + who}
            v, who = max(vals, key=lambda x: x[0])
            hi[key] = {"v": v, "who": prefix + who}
    out["min"], out["max"] = lo, hi
    return out


def summary(record: dict) -> dict:
    """A child's one-line summary inside its parent's record."""
    return {k: record[k] for k in SUMMARY if k in record}


def child_statuses(children: dict[str, dict], rates: dict[str, float | None]) -> None:
    """Mark, among running children, the slowest (least samples/s of its ranks) and the idle ones."""
    running = {k: c for k, c in children.items() if c.get("status") in ("training", "idle")}
    for c in running.values():
        c["status"] = "idle" if (_num(c.get("idle_share")) or 0.0) >= IDLE_SHARE else "training"
    timed = [(v, k) for k in running if (v := rates.get(k)) is not None]
    if len(timed) > 1:
        running[min(timed)[1]]["status"] = "slowest"


# ---- writing (rank 0) ------------------------------------------------------------------------

def _finite(value):
    """``value`` with every NaN or infinite float as None: records are strict JSON (the portal's
    responses and the page's ``JSON.parse`` refuse ``NaN``), and a diverged loss reads as a gap."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _after_point(record: dict, point: int | tuple[int, float]) -> bool:
    """Whether ``record`` was logged after ``point`` (a step, or (step, training time)). Times are
    compared as records round them (4 decimals); a record without a time is placed by its step."""
    step, time_ = point if isinstance(point, tuple) else (point, None)
    mine = record.get("step", 0)
    if mine != step or time_ is None or not isinstance(record.get("time"), (int, float)):
        return mine > step
    return record["time"] > round(time_, 4)


class TreeWriter:
    """Writes the whole tree from rank 0: one line per level per window, from every rank's row."""

    def __init__(self, run: str | os.PathLike, hosts: Sequence[str],
                 truncate_after: int | tuple[int, float] | None = None) -> None:
        """``truncate_after``: a resumed run's checkpoint, its step or ``(step, training time)``.
        What the interrupted run logged after that point is dropped: a later step, or the same
        step at a later training time (a live El Che window can end inside the checkpoint's step);
        ``None`` starts the files afresh."""
        self.run, self.hosts = Path(run), list(hosts)
        self.paths = [rank_path(h, r) for r, h in enumerate(self.hosts)]
        self.host_paths = list(dict.fromkeys(f"host-{h}" for h in self.hosts))
        self.total_steps: int | None = None
        self._origin: tuple[int, float] | None = None  # (step, time) of this run's first window, for the ETA
        self._files: dict[str, object] = {}
        self._last: dict[str, dict] = {}
        self.run.mkdir(parents=True, exist_ok=True)
        for path in ["", *self.host_paths, *self.paths]:
            file = self.run / path / RECORDS
            file.parent.mkdir(parents=True, exist_ok=True)
            if truncate_after is not None and file.exists():
                # A resumed run drops what the interrupted one logged after its checkpoint.
                kept = [r for r in read_records(file) if not _after_point(r, truncate_after)]
                file.write_text("".join(json.dumps(r) + "\n" for r in kept))
            elif truncate_after is None and file.exists():
                file.unlink()
            self._files[path] = open(file, "a")
        for old in self.run.glob("host-*/**/" + RECORDS):  # nodes of an earlier run with another layout
            node = old.parent.relative_to(self.run).as_posix()
            if node not in self._files and truncate_after is None and NODE_RE.match(node):
                old.unlink()

    def write(self, path: str, record: dict) -> None:
        f = self._files.get(path)
        if f is None:  # closed: the run is over
            return
        f.write(json.dumps(_finite(record), separators=(",", ":")) + "\n")
        f.flush()
        if record.get("event") == "train":
            self._last[path] = record

    def event(self, record: dict) -> dict:
        """A root-level event (start, eval, checkpoint, end): the root file only."""
        record = {"t": round(time.time(), 3), **record, "level": "root", "name": "run"}
        if record.get("event") == "start":
            self.total_steps = record.get("total_steps")
        if record.get("event") == "end" and "" in self._last:
            last = self._last[""]
            children = {k: {**c, "status": record.get("status", "finished")} for k, c in last["children"].items()}
            record = {**{k: v for k, v in last.items() if k not in ("event", "t", "eta_s")}, **record,
                      "children": children, "eta_s": 0 if record.get("status") == "finished" else None}
        self.write("", record)
        return record

    def window(self, common: dict, ranks: Sequence[dict], status: str = "training",
               extra_root: dict | None = None) -> dict:
        """Write one window: every rank's record, each host's rollup, the root's; return the root's.

        ``common`` has ``step``, ``epoch``, ``time``; ``ranks[r]`` is rank r's metrics."""
        t = round(time.time(), 3)
        if self._origin is None:
            self._origin = (common["step"], common["time"])
        base = {"event": "train", "t": t, **common, "eta_s": self._eta(common)}  # the run's ETA, at every level
        leaf = {}
        for r, (path, numbers) in enumerate(zip(self.paths, ranks)):
            record = {**base, "level": "rank", "name": f"rank-{r}", "rank": r, "host": self.hosts[r],
                      "status": numbers.get("status", status), **{k: v for k, v in numbers.items() if k != "status"}}
            if record["status"] == "training" and (_num(record.get("idle_share")) or 0.0) >= IDLE_SHARE:
                record["status"] = "idle"
            leaf[path] = record
            self.write(path, record)
        host_records = {}
        for hp in self.host_paths:
            mine = {p[len(hp) + 1:]: rec for p, rec in leaf.items() if p.startswith(hp + "/")}
            record = {**base, "level": "host", "name": hp[5:], **self._status(mine.values(), status), **rollup(mine)}
            children = {k: summary(v) for k, v in mine.items()}
            child_statuses(children, {k: _num(v.get("samples_per_s")) for k, v in mine.items()})
            record["children"] = children
            host_records[hp] = record
            self.write(hp, record)
        root = {**base, "level": "root", "name": "run", **self._status(leaf.values(), status),
                **rollup({p: rec for p, rec in leaf.items()})}
        children = {k: summary(v) for k, v in host_records.items()}
        # A host's rate here is its slowest rank's, so "slowest" points at where the slowest rank is.
        child_statuses(children, {k: v["min"].get("samples_per_s", {}).get("v") for k, v in host_records.items()})
        root["children"] = children
        root.update(extra_root or {})
        self.write("", root)
        return root

    def finish(self) -> None:
        """Every host and rank ends with a record whose status is ``finished`` (the root's is the end event)."""
        t = round(time.time(), 3)
        for path in [*self.paths, *self.host_paths]:
            last = self._last.get(path)
            if last is None:
                continue
            record = {**last, "event": "end", "t": t, "status": "finished"}
            if "children" in record:
                record["children"] = {k: {**c, "status": "finished"} for k, c in record["children"].items()}
            self.write(path, record)

    def _status(self, records: Iterable[dict], status: str) -> dict:
        states = [r.get("status") for r in records]
        if status != "training":
            return {"status": status}
        return {"status": "training" if any(s in ("training", "idle") for s in states) else
                ("lost" if states and all(s == "lost" for s in states) else "training")}

    def _eta(self, common: dict) -> float | None:
        if self.total_steps is None or self._origin is None:
            return None
        step0, time0 = self._origin
        done, spent = common["step"] - step0, common["time"] - time0
        if done <= 0 or spent <= 0:
            return None
        return round(max(self.total_steps - common["step"], 0) * spent / done, 2)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}


# ---- this process's resources ----------------------------------------------------------------

class Resources:
    """What a worker uses, sampled once a log point or window (:data:`RESOURCE_FIELDS`): CPU % since the last
    sample, resident memory, GPU utilisation and allocated memory where there is one; the window's peak memory
    (CUDA's allocator peak on a GPU, the peak resident set on the CPU), and the most memory one sync allocated
    beyond what the worker held before it (:meth:`sync`; NaN where no sync was measured). NaN where unknown."""

    def __init__(self, device=None) -> None:
        self.device = device
        self._cuda = device is not None and getattr(device, "type", None) == "cuda"
        self._last = (time.perf_counter(), time.process_time())
        self._peak = math.nan  # the window's peak before the last reset (a sync resets it)
        self._sync = math.nan  # the largest transient of this window's syncs
        self._reset_peak()

    def _now_mb(self) -> float:
        if self._cuda:
            import torch
            return torch.cuda.memory_allocated(self.device) / 2**20
        return _rss_mb()

    def _peak_mb(self) -> float:
        if self._cuda:
            import torch
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return _status_mb("VmHWM")

    def _reset_peak(self) -> None:
        if self._cuda:
            import torch
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_rss_peak()

    @contextlib.contextmanager
    def sync(self):
        """Measure one sync: the peak memory inside it less the memory held when it began."""
        self._peak = _max(self._peak, self._peak_mb())
        before = self._now_mb()
        self._reset_peak()
        try:
            yield
        finally:
            peak = self._peak_mb()
            self._peak = _max(self._peak, peak)
            self._sync = _max(self._sync, max(0.0, peak - before))

    def sample(self) -> list[float]:
        now, cpu = time.perf_counter(), time.process_time()
        wall = now - self._last[0]
        cpu_pct = (cpu - self._last[1]) / wall * 100 if wall > 0 else math.nan
        self._last = (now, cpu)
        gpu_util = gpu_mem = math.nan
        if self._cuda:
            import torch
            gpu_mem = torch.cuda.memory_allocated(self.device) / 2**20
            try:
                gpu_util = float(torch.cuda.utilization(self.device))
            except Exception:  # needs pynvml / amdsmi; memory is still known
                pass
        peak, sync = _max(self._peak, self._peak_mb()), self._sync
        self._peak, self._sync = math.nan, math.nan
        self._reset_peak()
        return [cpu_pct, _rss_mb(), gpu_util, gpu_mem, peak, sync]


def _max(a: float, b: float) -> float:
    """The larger of two readings, either of which may be NaN (unknown)."""
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


def _status_mb(field: str) -> float:
    """A memory field of /proc/self/status (``VmHWM``: the peak resident set), MiB; NaN off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 2**10
    except (OSError, ValueError, IndexError):
        pass
    return math.nan


def _reset_rss_peak() -> None:
    """Start the peak resident set (VmHWM) over from the current one (Linux's clear_refs, value 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak stays the process's
        pass


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        try:
            import resource
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # peak, KiB on Linux, bytes on macOS
            return peak / (2**20 if os.uname().sysname == "Darwin" else 2**10)
        except Exception:
            return math.nan


def resource_fields(values: Sequence[float]) -> dict:
    """The numbers of :meth:`Resources.sample` as record fields (unknown ones left out)."""
    out = {}
    for key, v in zip(RESOURCE_FIELDS, values):
        if (v := _num(v)) is not None:
            out[key] = round(v, 2)
    return out
