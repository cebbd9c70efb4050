"""Benchmark: wall time to a target held-out accuracy, fine-tuning MiniLM into a spam classifier
with uneven workers.

The task: all-MiniLM-L6-v2 (``samples/minilm``, 22M parameters) with a fresh 2-label head,
fine-tuned on the SMS Spam Collection (``samples/sms-spam``; deduplicated, shuffled once with
seed 0: ``--train`` messages to train on, ``--held-out`` to evaluate), AdamW lr 5e-5, batch 16
per worker, texts cut at 64 tokens. The figure is training time (evaluation excluded) until the
held-out accuracy first reaches ``--target``, and the held-out accuracy then.

Arms, for each cohort: the fast worker alone; DDP; El Che; El Che + DiLoCo. Cohorts: ``2x``
(speeds 1 : 1/3) and ``3x`` (1 : 1/3 : 1/12, a card behind a PCIe x1 riser as in the flodl
flagship run). Every worker is one process with one thread, talking gloo on 127.0.0.1.

Making a worker k times slower without letting it take the fast one's CPU:
- ``sleep`` (default, works everywhere): after each optimizer step the worker sleeps (k - 1)
  times what that batch took it (forward, backward, step). Sleeping takes no CPU, so the fast
  worker keeps its core; and since the sleep scales with the worker's own compute, the ratio
  holds whatever the machine's load does to both.
- ``cgroup`` (cgroup v2 with the cpu controller, root): the worker runs in its own cgroup with
  ``cpu.max`` = 1/k of a core. The kernel enforces it, as a slower device would be, but a
  quota only slows a worker that would otherwise have a whole core: on a machine with fewer
  free cores than workers the ratio is not k. ``both`` applies the two.

    python scripts/bench_trainer.py                       # 3 seeds, both cohorts, every arm
    python scripts/bench_trainer.py --seeds 1 --cohorts 2x --target 0.97

Tables go to stdout and ``out/bench_trainer/table.md``; each run's ``run.html`` under
``out/bench_trainer/``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
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
from flodl_hf.records import load_tree  # noqa: E402

COHORTS = {"2x": (1.0, 3.0), "3x": (1.0, 3.0, 12.0)}  # each worker's slowdown k
ARMS = ("fast worker alone", "DDP", "El Che", "El Che + DiLoCo")
BATCH, LR, MAX_LEN = 16, 5e-5, 64
CGROUP = Path("/sys/fs/cgroup")


# ---- data ---------------------------------------------------------------------------------------

def load_sms(n_train: int, n_held: int) -> tuple[list, list]:
    from flodl_hf.samples import sample_path
    with open(sample_path("sms-spam") / "sms-spam.csv", newline="", encoding="utf-8") as f:
        rows = list({r["text"]: (r["text"], int(r["spam"])) for r in csv.DictReader(f)}.values())
    random.Random(0).shuffle(rows)
    if n_train + n_held > len(rows):
        raise SystemExit(f"--train + --held-out must be at most {len(rows)}")
    return rows[:n_train], rows[-n_held:]


def encode(tok, rows: list) -> list[tuple[list[int], int]]:
    enc = tok([t for t, _ in rows], truncation=True, max_length=MAX_LEN, return_tensors=None)
    return [(ids, label) for ids, (_, label) in zip(enc["input_ids"], rows)]


def collate(items: list) -> dict:
    width = max(len(ids) for ids, _ in items)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (row, _) in enumerate(items):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([y for _, y in items])}


# ---- throttles ----------------------------------------------------------------------------------

def cgroup_available() -> bool:
    controllers = CGROUP / "cgroup.controllers"
    return controllers.is_file() and "cpu" in controllers.read_text().split() and os.access(CGROUP, os.W_OK)


def cgroup_limit(pid: int, k: float, name: str) -> Path:
    """Put ``pid`` in a cgroup of its own with ``cpu.max`` = 1/k of a core; return the cgroup."""
    group = CGROUP / f"flodl-hf-bench-{os.getpid()}-{name}"
    group.mkdir(exist_ok=True)
    period = 100_000
    (group / "cpu.max").write_text(f"{max(1000, int(period / k))} {period}\n")
    (group / "cgroup.procs").write_text(f"{pid}\n")
    return group


# ---- one worker ---------------------------------------------------------------------------------

def worker(rank: int, world: int, port: int, arm: str, ks: tuple[float, ...], seed: int, args: dict,
           out: str, throttle: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
    from flodl_hf import AutoModelForSequenceClassification, AutoTokenizer, DiLoCo, ElChe, Trainer
    import warnings
    tok = AutoTokenizer.from_pretrained("samples/minilm")
    train_rows, held_rows = load_sms(args["train"], args["held_out"])
    train, held = encode(tok, train_rows), encode(tok, held_rows)
    torch.manual_seed(seed)  # the fresh head
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForSequenceClassification.from_pretrained("samples/minilm", num_labels=2)
    k = ks[rank]
    began = [0.0]

    def step(model, batch):
        began[0] = time.perf_counter()
        return model(**batch)

    def optimizer(params):
        opt = torch.optim.AdamW(params, lr=LR)
        if k > 1 and throttle in ("sleep", "both"):
            # (k - 1) times this batch's own compute: the worker is k times slower whatever the load.
            opt.register_step_post_hook(lambda *_: time.sleep((k - 1) * (time.perf_counter() - began[0])))
        return opt

    @torch.no_grad()
    def evaluate(model):
        correct, loss = 0, 0.0
        for i in range(0, len(held), 64):
            batch = collate(held[i:i + 64])
            out_ = model(**batch)
            loss += out_.loss.item() * len(batch["labels"])
            correct += (out_.logits.argmax(-1) == batch["labels"]).sum().item()
        return {"accuracy": correct / len(held), "eval_loss": loss / len(held)}

    sync = {"fast worker alone": "none", "DDP": "ddp"}.get(arm, ElChe(anchor=2))
    started = time.monotonic()
    trainer = Trainer(model, step, optimizer, train, batch_size=BATCH, epochs=args["epochs"], sync=sync,
                      outer=DiLoCo() if arm == "El Che + DiLoCo" else None, seed=seed, collate_fn=collate,
                      eval_fn=evaluate, eval_every=max(1, args["eval_every"] // (world * BATCH)),
                      stop_when=lambda m: m["accuracy"] >= args["target"] or time.monotonic() - started > args["cap"],
                      log_dir=out, log_every=5, progress=False, report=True, timeout=120)
    trainer.fit()
    if world > 1:
        dist.destroy_process_group()


def run_once(cohort: str, arm: str, seed: int, args: dict, out: Path, throttle: str) -> dict:
    ks = COHORTS[cohort][:1] if arm == "fast worker alone" else COHORTS[cohort]
    world = len(ks)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world, port, arm, ks, seed, args, str(out), throttle))
             for r in range(world)]
    groups = []
    for r, p in enumerate(procs):
        p.start()
        if throttle in ("cgroup", "both") and ks[r] > 1:
            groups.append(cgroup_limit(p.pid, ks[r], f"{out.name}-r{r}"))
    try:
        for p in procs:
            p.join(args["cap"] * 3 + 300)
            if p.is_alive():
                p.kill()
                raise RuntimeError(f"{cohort} {arm} seed {seed}: a worker did not finish")
            if p.exitcode != 0:
                raise RuntimeError(f"{cohort} {arm} seed {seed}: a worker failed (exit {p.exitcode})")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for g in groups:
            try:
                g.rmdir()
            except OSError:
                pass
    return summarize(out, args["target"], world)


def summarize(out: Path, target: float, world: int) -> dict:
    tree = load_tree(out)
    evals = [r for r in tree[""] if r.get("event") == "eval"]
    hit = next((r for r in evals if r["accuracy"] >= target), None)
    ranks = [[r for r in tree[p] if r.get("event") == "train"] for p in sorted(tree) if p.count("/") == 1]
    result = {"time": hit["time"] if hit else None, "accuracy": (hit or (evals[-1] if evals else {})).get("accuracy"),
              "last_time": evals[-1]["time"] if evals else None, "windows": None, "sync": None, "idle": None,
              "fast_ms": statistics.median(r["ms_per_batch"] for r in ranks[0] if r.get("ms_per_batch"))}
    timed = [[r for r in rank if r.get("window_ms")] for rank in ranks]  # El Che windows
    if timed and timed[0]:
        result["windows"] = [statistics.mean(r["batches"] for r in timed[w]) for w in range(world)]
        result["sync"] = sum(r["sync_ms"] for r in timed[0]) / sum(r["window_ms"] for r in timed[0])
        result["idle"] = [sum(r["idle_ms"] for r in timed[w]) / sum(r["window_ms"] for r in timed[w])
                          for w in range(world)]
    return result


# ---- tables -------------------------------------------------------------------------------------

def mean_sd(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    sd = f" ± {format(statistics.stdev(values), fmt)}" if len(values) > 1 else ""
    return f"{format(statistics.mean(values), fmt)}{sd}"


def table(cohort: str, results: dict[str, list[dict]]) -> str:
    base = [r["time"] for r in results.get("fast worker alone", []) if r["time"] is not None]
    lines = [f"Cohort {cohort} (speeds " + " : ".join(f"1/{k:g}" if k > 1 else "1" for k in COHORTS[cohort]) + ")",
             "", "| arm | time to target, s | vs fast alone | held-out accuracy | per-seed times, s "
             "| batches per window | sync share | idle share |", "|---|---|---|---|---|---|---|---|"]
    for arm, runs in results.items():
        times = [r["time"] for r in runs if r["time"] is not None]
        missing = len(runs) - len(times)
        ratio = f"{statistics.mean(times) / statistics.mean(base):.2f}x" if times and base else "-"
        shown = mean_sd(times, ".1f") + (f" ({missing} not reached)" if missing else "")
        per_seed = ", ".join(f"{r['time']:.1f}" if r["time"] is not None else "-" for r in runs)
        acc = mean_sd([100 * r["accuracy"] for r in runs if r["accuracy"] is not None], ".2f")
        wins = [r["windows"] for r in runs if r["windows"]]
        win = " / ".join(f"{statistics.mean(w[i] for w in wins):.1f}" for i in range(len(wins[0]))) if wins else "-"
        syncs = [r["sync"] for r in runs if r["sync"] is not None]
        sync = f"{statistics.mean(syncs):.1%}" if syncs else ("in backward" if arm == "DDP" else "-")
        idles = [r["idle"] for r in runs if r["idle"]]
        idle = " / ".join(f"{statistics.mean(i[w] for i in idles):.0%}" for w in range(len(idles[0]))) if idles else "-"
        lines.append(f"| {arm} | {shown} | {ratio} | {acc}% | {per_seed} | {win} | {sync} | {idle} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--cohorts", nargs="*", default=list(COHORTS), choices=list(COHORTS))
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--target", type=float, default=0.975, help="held-out accuracy to reach")
    parser.add_argument("--train", type=int, default=3000, help="training messages")
    parser.add_argument("--held-out", type=int, default=500, help="held-out messages")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=160, help="evaluate every this many samples")
    parser.add_argument("--cap", type=float, default=600.0, help="stop a run after this many seconds")
    parser.add_argument("--throttle", choices=["sleep", "cgroup", "both"], default="sleep")
    parser.add_argument("--out", type=Path, default=Path("out/bench_trainer"))
    args = parser.parse_args(argv)
    if args.throttle != "sleep" and not cgroup_available():
        raise SystemExit("--throttle cgroup needs cgroup v2 with the cpu controller, writable (root)")
    conf = {"target": args.target, "train": args.train, "held_out": args.held_out, "epochs": args.epochs,
            "eval_every": args.eval_every, "cap": args.cap}
    load_start = os.getloadavg()[0]
    texts = []
    for cohort in args.cohorts:
        results: dict[str, list[dict]] = {arm: [] for arm in args.arms}
        for seed in range(args.seeds):
            for arm in args.arms:
                out = args.out / f"{cohort}-{arm.replace(' + ', '-').replace(' ', '-').lower()}-seed{seed}"
                out.mkdir(parents=True, exist_ok=True)
                for old in out.rglob("records.jsonl"):
                    old.unlink()
                result = run_once(cohort, arm, seed, conf, out, args.throttle)
                results[arm].append(result)
                shown = f"{result['time']:.1f} s" if result["time"] is not None else "not reached"
                print(f"{cohort} seed {seed} {arm}: {shown}, accuracy {result['accuracy']} "
                      f"(load {os.getloadavg()[0]:.1f}; {out / 'run.html'})", flush=True)
        texts.append(table(cohort, results))
        (args.out / f"results-{cohort}.json").write_text(json.dumps(results, indent=1))
    head = (f"MiniLM spam fine-tune: target held-out accuracy {args.target:.1%} on {args.held_out} messages; "
            f"{args.train} training messages, {args.epochs} epoch(s) at most; {args.seeds} seed(s); batch {BATCH} "
            f"per worker; throttle {args.throttle}; load average {load_start:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end.")
    text = head + "\n\n" + "\n\n".join(texts)
    print("\n" + text)
    (args.out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
