"""Benchmark: wall time to a target held-out loss with two uneven workers on this machine.

Arms (same model, data, seed and target): the fast worker alone; DDP with equal shards;
El Che; El Che + DiLoCo. Worker 1 is made 3x slower by sleeping, after each optimizer step,
twice the time its batch took. Every process runs one thread; workers talk over gloo on
127.0.0.1. The figure is training time (evaluation excluded) until the held-out loss first
reaches the target, over several seeds: mean and spread. Also: batches per window, the
share of a window spent averaging, each worker's idle share, the slowdown El Che measured (the
sleep also waits for a free core, so on a busy machine it exceeds 3x) and the fast worker's own
time per batch: both workers share this machine's cores, so the fast one runs slower beside the
slow one than alone, which a real second device would not cause.

    python scripts/bench_trainer.py                # 3 seeds, table to stdout and out/bench_trainer/
    python scripts/bench_trainer.py --seeds 1 --cap 30

The task: a 64-256-256-10 GELU MLP (85k parameters) learning the labels a fixed random
teacher (64-64-10, tanh) draws from its softmax; AdamW lr 3e-4, batch 32 per worker. After a
quick first drop the held-out loss falls slowly and noisily: the regime where more samples
per second help, and where the target (default 0.74) sits.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flodl_hf.records import load_tree  # noqa: E402
from flodl_hf.trainer import DiLoCo, Trainer  # noqa: E402

ARMS = {
    "fast worker alone": {"world": 1, "sync": "none"},
    "DDP (equal shards)": {"world": 2, "sync": "ddp"},
    "El Che": {"world": 2, "sync": "el-che"},
    "El Che + DiLoCo": {"world": 2, "sync": "el-che", "outer": True},
}
BATCH = 32
LR = 3e-4
EVAL_EVERY_SAMPLES = 3200
N_TRAIN, N_HELD_OUT = 100_000, 4096


# ---- task --------------------------------------------------------------------------------------

class TeacherData(torch.utils.data.Dataset):
    """Inputs from N(0, 1); labels drawn from a fixed random teacher MLP's softmax (so the loss has a floor)."""

    def __init__(self, n: int, split_seed: int) -> None:
        g = torch.Generator().manual_seed(1234)
        w1, w2 = torch.randn(64, 64, generator=g) / 8, torch.randn(64, 10, generator=g) / 2
        g.manual_seed(split_seed)
        self.x = torch.randn(n, 64, generator=g)
        logits = torch.tanh(self.x @ w1) @ w2 * 3
        self.y = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(1)
        self.floor = float(-(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean())

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def make_model(seed: int, width: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))


def loss_step(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def calibrate(width: int, batch: int) -> float:
    """Seconds per training batch on one thread."""
    torch.set_num_threads(1)
    model = make_model(0, width)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data = TeacherData(batch, 7)
    for i in range(120):
        if i == 20:
            start = time.perf_counter()
        opt.zero_grad()
        loss_step(model, (data.x, data.y)).backward()
        opt.step()
    return (time.perf_counter() - start) / 100


# ---- one run -----------------------------------------------------------------------------------

def worker(rank: int, world: int, port: int, arm: str, seed: int, target: float, cap: float, out: str,
           width: int, batch: int) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    spec = ARMS[arm]
    train, held = TeacherData(N_TRAIN, 1), TeacherData(N_HELD_OUT, 2)

    began = [0.0]

    def step(model, batch):
        began[0] = time.perf_counter()
        return loss_step(model, batch)

    def optimizer(params):
        opt = torch.optim.AdamW(params, lr=LR)
        if rank == 1:
            # The injected slowness: after each optimizer step, sleep twice what the batch took
            # (forward, backward, step), so this worker is 3x slower whatever the machine's load.
            opt.register_step_post_hook(lambda *_: time.sleep(2 * (time.perf_counter() - began[0])))
        return opt

    def evaluate(model):
        return {"eval_loss": nn.functional.cross_entropy(model(held.x), held.y).item()}

    started = time.monotonic()
    trainer = Trainer(make_model(seed, width), step, optimizer, train,
                      batch_size=batch, max_steps=10**7, sync=spec["sync"],
                      outer=DiLoCo() if spec.get("outer") else None, seed=seed,
                      eval_fn=evaluate, eval_every=max(1, EVAL_EVERY_SAMPLES // (world * batch)),
                      stop_when=lambda m: m["eval_loss"] <= target or time.monotonic() - started > cap,
                      log_dir=out, log_every=20, progress=False, report=True, timeout=60)
    trainer.fit()
    if world > 1:
        dist.destroy_process_group()


def run_once(arm: str, seed: int, target: float, cap: float, out: Path, width: int, batch: int) -> dict:
    world = ARMS[arm]["world"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world, port, arm, seed, target, cap, str(out), width, batch))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(cap * 3 + 120)
        if p.is_alive():
            p.kill()
            raise RuntimeError(f"{arm} seed {seed}: a worker did not finish")
        if p.exitcode != 0:
            raise RuntimeError(f"{arm} seed {seed}: a worker failed (exit {p.exitcode})")
    return summarize(out, target)


def summarize(out: Path, target: float) -> dict:
    tree = load_tree(out)
    evals = [r for r in tree[""] if r.get("event") == "eval"]
    hit = next((r for r in evals if r["eval_loss"] <= target), None)
    ranks = [[r for r in tree[p] if r.get("event") == "train"] for p in tree if p.count("/") == 1]
    fast = ranks[0]
    result = {"time": hit["time"] if hit else None, "steps": hit["step"] if hit else None,
              # worker 0's own speed; under DDP its compute includes waiting in the all-reduce
              "fast_ms": statistics.median(r["ms_per_batch"] for r in fast if r.get("ms_per_batch")),
              "last_time": evals[-1]["time"] if evals else None, "windows": None, "sync": None, "idle": {},
              "slowdown": None}
    timed = [[r for r in rank if r.get("window_ms")] for rank in ranks]  # El Che windows
    if timed[0]:
        world = len(ranks)
        result["windows"] = [statistics.mean(r["batches"] for r in timed[w]) for w in range(world)]
        result["sync"] = sum(r["sync_ms"] for r in timed[0]) / sum(r["window_ms"] for r in timed[0])
        result["idle"] = {w: sum(r["idle_ms"] for r in timed[w]) / sum(r["window_ms"] for r in timed[w])
                          for w in range(world)}
        pairs = [(a["ms_per_batch"], b["ms_per_batch"]) for a, b in zip(timed[0], timed[-1])
                 if a.get("ms_per_batch") and b.get("ms_per_batch")]
        result["slowdown"] = statistics.median(b / a for a, b in pairs) if pairs else None
    return result


# ---- table -------------------------------------------------------------------------------------

def fmt_times(times: list[float | None], cap: float) -> str:
    done = [t for t in times if t is not None]
    if len(done) < len(times):
        return f"not reached in {len(times) - len(done)}/{len(times)} (cap {cap:.0f} s)" + (
            f"; others {statistics.mean(done):.1f} s" if done else "")
    spread = f" ± {statistics.stdev(done):.1f}" if len(done) > 1 else ""
    return f"{statistics.mean(done):.1f}{spread} s (min {min(done):.1f}, max {max(done):.1f})"


def table(results: dict[str, list[dict]], cap: float) -> str:
    lines = ["| arm | time to target (mean ± sd) | fast worker ms / batch | batches per window (fast / slow) "
             "| measured slowdown | sync share | idle (fast / slow) |", "|---|---|---|---|---|---|---|"]
    for arm, runs in results.items():
        windows = [r["windows"] for r in runs if r["windows"]]
        win = " / ".join(f"{statistics.mean(w[i] for w in windows):.1f}" for i in range(2)) if windows else "-"
        slow = [r["slowdown"] for r in runs if r.get("slowdown")]
        slowdown = f"{statistics.mean(slow):.2f}x" if slow else "-"
        syncs = [r["sync"] for r in runs if r["sync"] is not None]
        sync = f"{statistics.mean(syncs):.1%}" if syncs else ("in backward" if ARMS[arm]["world"] > 1 else "-")
        idles = [r["idle"] for r in runs if r["idle"]]
        idle = " / ".join(f"{statistics.mean(i[k] for i in idles):.1%}" for k in (0, 1)) if idles else "-"
        fast_ms = "-" if arm.startswith("DDP") else f"{statistics.mean(r['fast_ms'] for r in runs):.2f}"
        lines.append(f"| {arm} | {fmt_times([r['time'] for r in runs], cap)} | {fast_ms} | {win} | {slowdown} "
                     f"| {sync} | {idle} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.74, help="held-out cross-entropy to reach")
    parser.add_argument("--cap", type=float, default=60.0, help="give up on a run after this many seconds")
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--width", type=int, default=256, help="hidden width of the MLP")
    parser.add_argument("--batch", type=int, default=BATCH, help="batch size per worker")
    parser.add_argument("--out", type=Path, default=Path("out/bench_trainer"))
    args = parser.parse_args(argv)

    per_batch = calibrate(args.width, args.batch)
    print(f"one batch takes {per_batch * 1e3:.2f} ms on one thread here; load average {os.getloadavg()[0]:.1f}",
          flush=True)
    results: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    for seed in range(args.seeds):
        for arm in args.arms:
            out = args.out / f"{arm.split(' (')[0].replace(' ', '-').replace('+', 'plus').lower()}-seed{seed}"
            out.mkdir(parents=True, exist_ok=True)
            result = run_once(arm, seed, args.target, args.cap, out, args.width, args.batch)
            results[arm].append(result)
            shown = f"{result['time']:.1f} s" if result["time"] is not None else "not reached"
            print(f"seed {seed} {arm}: {shown} (report: {out / 'run.html'})", flush=True)
    text = (f"Target held-out loss {args.target} (floor {TeacherData(N_HELD_OUT, 2).floor:.3f}); {args.seeds} "
            f"seed(s); MLP width {args.width}; batch {args.batch} per worker; about {per_batch * 1e3:.1f} ms per batch on the fast worker, "
            f"worker 1 3x slower; load average {os.getloadavg()[0]:.1f} at the end.\n\n"
            + table(results, args.cap))
    print("\n" + text)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
