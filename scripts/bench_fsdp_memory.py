"""Measure memory on a SmolLM2-135M-shaped llama (random weights), two gloo workers on the CPU.

1. El Che's window sync: the memory a worker allocates for one sync beyond what it held before it (the record's
   ``sync_mem_mb``: the peak resident set inside the sync less the resident set at its start; on a GPU the
   allocator's peak less its allocated bytes), per window, against the parameters' size.
2. ``sync="fsdp"`` against ``sync="ddp"``: the bytes each worker holds of parameters, gradients and optimizer
   state after a step (the local shards under FSDP), and each worker's peak resident set over the run.

    python scripts/bench_fsdp_memory.py                  # 30 layers (134.5M parameters), 2 workers
    python scripts/bench_fsdp_memory.py --layers 2       # a quick look
    python scripts/bench_fsdp_memory.py --part el-che    # one part only (el-che, fsdp)

The model is built from the config alone (no download): hidden 576, 9 heads and 3 KV heads, intermediate 1536,
vocab 49152, tied embeddings, as SmolLM2-135M's config.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOLLM2_135M = dict(model_type="llama", hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
                    rope_theta=10000.0, tie_word_embeddings=True, hidden_act="silu", pad_token_id=None)
SEQ = 32


def build(layers: int) -> torch.nn.Module:
    """The llama of SmolLM2-135M's shape with ``layers`` layers, random weights from seed 0."""
    from flodl_hf.auto import build_model, config_from_dict
    config = config_from_dict({**SMOLLM2_135M, "num_hidden_layers": layers})
    model = build_model(config, "causal_lm")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # the RMSNorm weights
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def data(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def step(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def _worker(rank: int, world: int, port: int, layers: int, parts: list[str], out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    from flodl_hf.training.records import load_tree
    from flodl_hf.training.sync.fsdp import local_bytes
    from flodl_hf.training.trainer import ElChe, Trainer
    result: dict = {"parameters": sum(p.numel() for p in build(1).parameters())}
    if "el-che" in parts:
        model = build(layers)
        result["parameters"] = sum(p.numel() for p in model.parameters())
        log = Path(out) / "el-che"
        Trainer(model, step, adamw, data(64), batch_size=1, max_steps=6, sync=ElChe(anchor=2),
                log_dir=log, progress=False, report=False, timeout=600).fit()
        if rank == 0:
            tree = load_tree(log)
            result["el_che"] = {path: [{k: r.get(k) for k in ("step", "rss_mb", "mem_peak_mb", "sync_mem_mb")}
                                       for r in records if r.get("event") == "train"]
                                for path, records in tree.items() if "rank-" in path}
        del model
    if "fsdp" in parts:
        for sync in ("ddp", "fsdp"):
            model = build(layers)
            log = Path(out) / sync
            t = Trainer(model, step, adamw, data(16), batch_size=1, max_steps=2, sync=sync, log_dir=log,
                        progress=False, report=False, timeout=600, log_every=1)
            t.fit()
            result[sync] = local_bytes(t.model, t.optimizer)
            if rank == 0:
                tree = load_tree(log)
                result[sync + "_peak_mb"] = {p: max(r.get("mem_peak_mb") or 0 for r in rs if r.get("event") == "train")
                                             for p, rs in tree.items() if "rank-" in p}
            del model, t
    Path(out, f"result-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--part", choices=("el-che", "fsdp", "all"), default="all")
    args = parser.parse_args()
    parts = ["el-che", "fsdp"] if args.part == "all" else [args.part]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as out:
        mp.spawn(_worker, args=(args.workers, port, args.layers, parts, out), nprocs=args.workers)
        results = [json.loads(Path(out, f"result-{r}.json").read_text()) for r in range(args.workers)]
    n = results[0]["parameters"]
    mib = n * 4 / 2**20
    print(f"model: llama of SmolLM2-135M's shape, {args.layers} layers, {n / 1e6:.1f}M parameters "
          f"({mib:.0f} MiB in float32); {args.workers} workers, gloo, CPU")
    if "el_che" in results[0]:
        print("\nEl Che, ElChe(anchor=2), AdamW: per window (a row's sync_mem_mb is the sync that "
              "began the window: the first row has none)")
        for path, rows in results[0]["el_che"].items():
            for r in rows:
                sync = r["sync_mem_mb"]
                share = f" = {sync / mib:.2f} x parameters" if sync is not None else ""
                print(f"  {path} step {r['step']}: rss {r['rss_mb']:.0f} MiB, peak {r['mem_peak_mb']:.0f} MiB, "
                      f"sync {'-' if sync is None else f'{sync:.1f}'} MiB{share}")
    if "ddp" in results[0]:
        print("\nbytes held per worker after 2 steps (AdamW): parameters, gradients, optimizer state (MiB)")
        for sync in ("ddp", "fsdp"):
            for r, res in enumerate(results):
                b = res[sync]
                print(f"  {sync:4s} worker {r}: " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in b.items())
                      + f"; total {sum(b.values()) / 2**20:.1f}")
            print(f"  {sync} peak resident set per worker (MiB): {results[0][sync + '_peak_mb']}")


if __name__ == "__main__":
    main()
