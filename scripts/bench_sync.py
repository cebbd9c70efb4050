"""Benchmark: El Che's window sync (``Comm.reduce_window``) on MiniLM-sized parameters, two workers.

Side by side in one run, on the same tensors: the packed sum of changes the trainer runs
(``combine="sum"``: the change written straight into a buffer kept between windows, the start
added back on the way out) against the unfused form it replaced (subtract in place, multiply by
the weight, concatenate, all-reduce, copy back, add the start). Both give the same bits; the
script checks that, then prints the median milliseconds of each and their ratio. It also times
``ElChe(compress="bf16")``'s sync (the changes sent in bfloat16, the remainder carried), and
how far its result lands from the float32 one; and ``ElChe(combine="lead")``'s exchange (worker
1's gradients to worker 0, then worker 0's parameters back, after a gather of the window's
numbers; the lead's optimizer step between them is not timed), whole, and as the trainer runs it:
the lead's receives posted at the window's start and the gradients sent as the others' windows
end, so that only the parameters travel after the lead's window ends (a 300 ms sleep stands for the
lead's last batch; the time after it is timed).

    python scripts/bench_sync.py                 # 22.7M float32 parameters (all-MiniLM-L6-v2), 15 rounds
    python scripts/bench_sync.py --params 110e6  # BERT-base
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flodl_hf.training.sync import Comm  # noqa: E402


def shapes(total: int) -> list[tuple[int, ...]]:
    """A transformer's mix: square weights, biases and norms of hidden 384, to ``total`` parameters."""
    out, n = [], 0
    while n < total:
        for shape in ((384, 384), (384,), (1536, 384), (1536,), (384, 1536), (384,), (384,)):
            out.append(shape)
            n += torch.Size(shape).numel()
    return out


def unfused(comm: Comm, params: list[torch.Tensor], start: list[torch.Tensor], stats: list[float]) -> None:
    for p, s in zip(params, start):
        p.sub_(s)
    pieces = [p.reshape(-1) * 1.0 for p in params]
    slots = torch.zeros(comm.world, len(stats))
    slots[comm.rank] = torch.tensor(stats)
    flat = torch.cat(pieces + [slots.reshape(-1)])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    for p, s in zip(params, start):
        p.add_(s)


def worker(rank: int, port: int, total: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    comm = Comm(rank, 2, rank, None, torch.device("cpu"), 120.0)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in shapes(total)]
    moved = [s + 1e-3 * torch.randn(s.shape, generator=torch.Generator().manual_seed(rank)) for s in start]
    stats = [float(rank)] * 14
    a, b = [t.clone() for t in moved], [t.clone() for t in moved]
    comm.reduce_window([(a, 1.0, start)], stats)
    unfused(comm, b, start, stats)
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    carried = [torch.zeros_like(t) for t in moved]
    c = [t.clone() for t in moved]
    comm.reduce_window([(c, 1.0, start, carried)], stats)
    off = max((x - y).abs().max().item() for x, y in zip(a, c))
    change = max((x - s).abs().max().item() for x, s in zip(a, start))
    times = {"packed": [], "unfused": [], "bf16": [], "lead": [], "lead, landed": []}
    with torch.no_grad():
        for _ in range(rounds):
            for name in times:
                params = [t.clone() for t in moved]
                dist.barrier()
                if name == "lead, landed":  # posted and sent while the lead still computes
                    moving = comm.lead_gradients(params, None if rank == 0 else moved)
                    time.sleep(0.3)
                t0 = time.perf_counter()
                if name == "lead, landed":
                    comm.gather_floats(stats)
                    comm.lead_exchange(params, moving, [1.0, 1.0], lambda grads: None)
                elif name == "packed":
                    comm.reduce_window([(params, 1.0, start)], stats)
                elif name == "bf16":
                    comm.reduce_window([(params, 1.0, start, carried)], stats)
                elif name == "lead":
                    comm.gather_floats(stats)
                    moving = comm.lead_gradients(params, None if rank == 0 else moved)
                    comm.lead_exchange(params, moving, [1.0, 1.0], lambda grads: None)
                else:
                    unfused(comm, params, start, stats)
                times[name].append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        packed, plain, half, lead, landed = (statistics.median(times[k])
                                             for k in ("packed", "unfused", "bf16", "lead", "lead, landed"))
        n = sum(t.numel() for t in start)
        Path(out).write_text(f"{n / 1e6:.1f}M float32 parameters, 2 workers (gloo, 127.0.0.1), {rounds} rounds: "
                             f"packed {packed:.0f} ms, unfused {plain:.0f} ms, ratio {packed / plain:.2f}; "
                             f"same bits: {same}\n"
                             f"compress='bf16': {half:.0f} ms ({half / packed:.2f}x packed); max abs off the float32 "
                             f"sum {off:.1e}, where the summed change reaches {change:.1e}\n"
                             f"combine='lead': {lead:.0f} ms ({lead / packed:.2f}x packed); after the gradients "
                             f"landed during the lead's last batch: {landed:.0f} ms ({landed / packed:.2f}x packed)\n")
    dist.barrier()
    os._exit(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=22.7e6)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path("out/bench_sync.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, port, int(args.params), args.rounds, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    print(out.read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
