"""What a window's combine costs in samples, measured without any timing: El Che's windows replayed
in one process.

``scripts/bench_trainer.py`` measures time to a target, where the cohort's batch rate and its
per-sample progress are mixed with timing noise. This script isolates the second. It replays a
3 : 1 cohort's windows in one process, in turn: each window, the "fast" worker runs 3 batches and
the "slow" one 1 (``--pattern``), both from the window's start. The batches come from the epoch's
order, exactly as the fast worker alone would see them. It then reports the samples needed to reach
the held-out loss target (``--target-loss``), interpolated between evaluations at every window's
end, for each way of combining a window (``--variants``):

- ``seq``: one worker runs every batch in a row (the fast worker alone: the reference);
- ``stale``: one optimizer, but each window's last batch takes its gradient at the window's start:
  the staleness a window costs, with nothing else changed; ``ElChe(combine="lead")``'s arithmetic;
- ``ahead``: ``stale`` with the stale gradient taken where the lead is expected to be when it steps on
  it: the window's start plus 3/4 of the previous window's move (the lead's 3 steps of its 4), the
  look-ahead ``ElChe(combine="lead")`` always takes; ``ahead-1``: plus the whole move;
- ``early``: ``ahead`` with the stale step taken as soon as the slow gradient lands, while the
  lead's next batch is under way; that batch's gradient, taken before the stale step, is the lead's
  first step of the next window. The lead never waits and the others never wait for its batch to
  end, at the price of one lead gradient a window one step stale. Measured, and not built
  (docs/benchmarks.md);
- ``lazy``: ``stale`` with the sync left one step short, the form of ``ElChe(combine="lead")`` that
  would need one exchange, not two in a row: each window's last gradient is taken at the window's start
  as it was before the previous window's stale step, and that step is the fast worker's first of the
  next window. Measured, and not built (docs/benchmarks.md);
- ``sum``: El Che's ``combine="sum"``: each worker has its own AdamW, and the window's start plus
  both changes is the next start;
- ``sum-state``: ``sum``, and the optimizers' moments combined in the same way (``beta**n`` decay of
  the start's moments, plus each worker's own additions; the step counts summed), so that both
  workers start each window with the same optimizer state, as one worker running the window
  would have it;
- ``overlap``: ``sum`` with each window's sync overlapped with the next window (``ElChe(overlap=True)``,
  removed in 0.4.0: docs/benchmarks.md): a worker goes on
  from its own end of the window, and the others' changes of a window are added one window later
  (when that sync would have arrived). Every worker holds the same sum but for its own latest change;
  worker 0's parameters are evaluated, as in the bench;
- ``nested``: ``ElChe(nested=True)`` for three or more workers (``--pattern 12,4,1``): the slowest
  worker's window spans k of the others' (k: the second slowest's count, here 4 windows of 3 + 1),
  which sum among themselves at each; the slowest's change is added at the end. Evaluations at the
  inner syncs count the slowest's batches in flight by the share of them run by then.

The task is bench_trainer's: MiniLM (``samples/minilm``) with a fresh 2-label head, SMS spam,
3,000 training messages and 500 held out, AdamW lr 5e-5, batch 16, texts cut at 64 tokens.

    python scripts/sim_el_che.py                       # 6 seeds x 5 variants, both cores (about 19 min)
    python scripts/sim_el_che.py --seeds 2 --variants seq sum
    python scripts/sim_el_che.py --variants ahead ahead-1      # the look-ahead (about 7 min)
    python scripts/sim_el_che.py --variants seq ahead early    # the stale step as the gradient lands (about 10 min)
    python scripts/sim_el_che.py --seeds 3 --variants seq sum nested --pattern 12,4,1 --max-batches 136
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

VARIANTS = ("seq", "stale", "ahead", "ahead-1", "early", "lazy", "lazy-ahead", "sum", "sum-state", "overlap", "nested")
BATCH, LR = 16, 5e-5


def crossing(history: list[tuple[int, float]], target: float) -> float | None:
    """Samples at which the held-out loss first reaches ``target`` (bench_trainer's rule)."""
    import bench_trainer as bt
    for i, (samples, loss) in enumerate(history):
        if loss <= target:
            return float(bt.interpolate(history[i - 1] if i else None, (samples, loss), target))
    return None


def replay(variant: str, seed: int, pattern: tuple[int, ...], target: float, max_batches: int) -> dict:
    """One run of ``variant``: the held-out loss after every window, until under ``target`` (by 0.015)."""
    import torch
    import bench_trainer as bt
    from flodl_hf import AutoModelForSequenceClassification, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained("samples/minilm")
    train_rows, held_rows = bt.load_sms(3000, 500)
    train, held = bt.encode(tok, train_rows), bt.encode(tok, held_rows)
    held.sort(key=lambda item: len(item[0]))
    torch.manual_seed(seed)  # the fresh head, as in bench_trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForSequenceClassification.from_pretrained("samples/minilm", num_labels=2)
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    batches = [[train[i] for i in order[j:j + BATCH]] for j in range(0, len(order), BATCH)]

    @torch.no_grad()
    def evaluate(m) -> float:
        m.eval()
        loss = 0.0
        for i in range(0, len(held), 64):
            batch = bt.collate(held[i:i + 64])
            loss += m(**batch).loss.item() * len(batch["labels"])
        m.train()
        return loss / len(held)

    def combine(group, start) -> None:
        """Every worker in ``group`` takes the start plus the group's summed changes."""
        with torch.no_grad():
            shared = [s.clone() for s in start]
            for m in group:
                for total, p, s in zip(shared, m.parameters(), start):
                    total += p - s
            for m in group:
                for p, total in zip(m.parameters(), shared):
                    p.copy_(total)

    def train_step(m, opt, items) -> None:
        m(**bt.collate(items)).loss.backward()
        opt.step()
        opt.zero_grad()

    def gradient_ahead(m, opt, items, before: list, alpha: float) -> tuple[list, list]:
        """The window's start, and the gradient of ``items`` taken at it moved on by ``alpha`` of the
        move since ``before`` (the last window's start; none in the first window); the parameters
        are put back at the start."""
        start = [p.detach().clone() for p in m.parameters()]
        if alpha and before:
            with torch.no_grad():
                for p, s, b in zip(m.parameters(), start, before):
                    p.add_(s - b, alpha=alpha)
        m(**bt.collate(items)).loss.backward()
        grads = [p.grad.clone() for p in m.parameters()]
        opt.zero_grad()
        with torch.no_grad():
            for p, s in zip(m.parameters(), start):
                p.copy_(s)
        return start, grads

    def step_on(m, opt, grads: list) -> None:
        """One optimizer step on gradients taken elsewhere."""
        for p, g in zip(m.parameters(), grads):
            p.grad = g
        opt.step()
        opt.zero_grad()

    workers = 1 if variant in ("seq", "stale", "ahead", "ahead-1", "early", "lazy", "lazy-ahead") else len(pattern)
    models = [model] + [copy.deepcopy(model) for _ in range(workers - 1)]
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    for m in models:
        m.train()
    torch.manual_seed(seed + 1)  # dropout
    window, position, history = sum(pattern), 0, []
    behind: list = []  # lazy-ahead: the last window's shared start
    pending: list = []  # overlap: the changes of the window whose sync is still in flight
    carried: list = []  # early: the lead's gradient under way when the stale step was taken
    drawn = 0  # early: batches drawn from the epoch's order (one ahead of those applied)
    while position + window <= max_batches:
        if variant == "seq":
            for _ in range(window):
                train_step(models[0], opts[0], batches[position])
                position += 1
        elif variant in ("stale", "ahead", "ahead-1"):
            # The window's last gradient at the window's start (stale), or ahead: plus the share of the
            # previous window's move that the lead makes before the stale step (3 of 4 steps; ahead-1: all).
            m, opt = models[0], opts[0]
            alpha = {"stale": 0.0, "ahead": (window - 1) / window, "ahead-1": 1.0}[variant]
            start, stale = gradient_ahead(m, opt, batches[position + window - 1], pending, alpha)
            for _ in range(window - 1):
                train_step(m, opt, batches[position])
                position += 1
            step_on(m, opt, stale)
            pending = start
            position += 1
        elif variant == "early":
            # ``ahead``, with the stale step taken as soon as the slow gradient lands, while the lead's
            # next batch is under way: that batch's gradient, at the params before the stale step, is
            # applied first in the next window (the lead never waits, and the others never wait for
            # the lead's batch to end).
            m, opt = models[0], opts[0]
            start, stale = gradient_ahead(m, opt, batches[drawn], pending, (window - 1) / window)
            drawn += 1
            fresh = window - 1
            if carried:
                step_on(m, opt, carried)
                fresh -= 1
            for _ in range(fresh):
                train_step(m, opt, batches[drawn])
                drawn += 1
            m(**bt.collate(batches[drawn])).loss.backward()  # under way as the slow gradient lands
            drawn += 1
            carried = [p.grad.clone() for p in m.parameters()]
            opt.zero_grad()
            step_on(m, opt, stale)
            pending = start
            position += window
        elif variant in ("lazy", "lazy-ahead"):
            m, opt = models[0], opts[0]
            start = [p.detach().clone() for p in m.parameters()]
            if variant == "lazy-ahead" and behind:  # plus the whole move between the last two shared starts
                with torch.no_grad():
                    for p, s, before in zip(m.parameters(), start, behind):
                        p.add_(s - before)
            behind = start
            m(**bt.collate(batches[position + window - 1])).loss.backward()  # at the shared start
            stale = [p.grad.clone() for p in m.parameters()]
            opt.zero_grad()
            with torch.no_grad():
                for p, s in zip(m.parameters(), start):
                    p.copy_(s)
            if pending:  # the previous window's stale step, the fast worker's first of this one
                for p, g in zip(m.parameters(), pending):
                    p.grad = g
                opt.step()
                opt.zero_grad()
            for _ in range(window - 1):
                train_step(m, opt, batches[position])
                position += 1
            pending = stale
            position += 1
        elif variant == "nested":
            # The slowest worker's window spans k of the others' (k: the second slowest's count), which
            # sum among themselves every window of their own; the slowest's change joins at the end.
            *inner, slow = pattern
            k = inner[-1]
            big_start = [p.detach().clone() for p in models[0].parameters()]
            done_before = position
            slow_positions = list(range(position + window - slow, position + window))
            for i in range(k):
                start = [p.detach().clone() for p in models[0].parameters()]
                for m, opt, count in zip(models[:-1], opts[:-1], inner):
                    for _ in range(count // k):
                        train_step(m, opt, batches[position])
                        position += 1
                combine(models[:-1], start)
                if i < k - 1:  # the slowest's batches in flight count by the time they have run
                    loss = evaluate(models[0])
                    history.append(((position + (i + 1) / k * slow) * BATCH, loss))
                    if loss < target - 0.015:
                        break
            else:
                m = models[-1]
                with torch.no_grad():
                    for p, s in zip(m.parameters(), big_start):
                        p.copy_(s)
                for at in slow_positions:
                    train_step(m, opts[-1], batches[at])
                position = done_before + window
                with torch.no_grad():  # the others' summed change, and the slowest's
                    for total, q, s in zip(models[0].parameters(), m.parameters(), big_start):
                        total += q - s
                    for other in models[1:]:
                        for p, total in zip(other.parameters(), models[0].parameters()):
                            p.copy_(total)
            if history and history[-1][1] < target - 0.015:
                break
        elif variant == "overlap":
            starts = [[p.detach().clone() for p in m.parameters()] for m in models]
            for m, opt, count in zip(models, opts, pattern):
                for _ in range(count):
                    train_step(m, opt, batches[position])
                    position += 1
            changes = [[p.detach() - s for p, s in zip(m.parameters(), st)] for m, st in zip(models, starts)]
            with torch.no_grad():  # the previous window's changes of the others arrive now
                for i, m in enumerate(models):
                    for j, late in enumerate(pending):
                        if j != i:
                            for p, d in zip(m.parameters(), late):
                                p += d
            pending = changes
        else:
            start = [p.detach().clone() for p in models[0].parameters()]
            state_start = copy.deepcopy(opts[0].state_dict()["state"])
            for m, opt, count in zip(models, opts, pattern):
                for _ in range(count):
                    train_step(m, opt, batches[position])
                    position += 1
            combine(models, start)
            if variant == "sum-state":
                beta1, beta2 = opts[0].param_groups[0]["betas"]
                states = [opt.state_dict()["state"] for opt in opts]
                combined = {}
                for key, first in states[0].items():
                    before = state_start.get(key)
                    entry = {}
                    for name, value in first.items():
                        if name == "step":
                            entry[name] = (before["step"] if before else torch.zeros(())) + window
                            continue
                        beta = beta1 if name == "exp_avg" else beta2
                        z = before[name] if before else torch.zeros_like(value)
                        entry[name] = beta ** window * z + sum(st[key][name] - beta ** n * z
                                                               for st, n in zip(states, pattern))
                    combined[key] = entry
                for opt in opts:
                    sd = opt.state_dict()
                    sd["state"] = {k: {n: v.clone() for n, v in e.items()} for k, e in combined.items()}
                    opt.load_state_dict(sd)
        loss = evaluate(models[0])
        history.append((position * BATCH, loss))
        if loss < target - 0.015:
            break
    return {"variant": variant, "seed": seed, "pattern": list(pattern), "history": history,
            "samples": crossing(history, target)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--variants", nargs="*", default=[v for v in VARIANTS if v not in ("nested", "lazy", "ahead", "ahead-1")],
                        choices=list(VARIANTS),
                        help="default: every variant of flat windows but lazy, ahead and ahead-1 "
                             "(nested is for --pattern 12,4,1)")
    parser.add_argument("--pattern", default="3,1", help="batches per worker in a window, fastest first")
    parser.add_argument("--target-loss", type=float, default=0.10)
    parser.add_argument("--max-batches", type=int, default=64, help="give up on a run after this many batches")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument("--out", type=Path, default=Path("out/sim_el_che"))
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    pattern = tuple(int(x) for x in args.pattern.split(","))
    if args.one:  # one run, in a process of its own
        print(json.dumps(replay(args.one[0], int(args.one[1]), pattern, args.target_loss, args.max_batches)))
        return 0
    from flodl_hf.core.samples import sample_path
    sample_path("minilm"), sample_path("sms-spam")  # fails early, with its message, when not fetched
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(v, s) for s in range(args.seeds) for v in args.variants]

    def run(job):
        variant, seed = job
        cmd = [sys.executable, __file__, "--one", variant, str(seed), "--pattern", args.pattern,
               "--target-loss", str(args.target_loss), "--max-batches", str(args.max_batches)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{variant} seed {seed}: {result['samples']}", flush=True)
        return result

    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run, jobs))
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    ref = [r["samples"] for r in results if r["variant"] == "seq" and r["samples"] is not None]
    lines = [f"Samples to held-out loss {args.target_loss:g}, windows of {' + '.join(map(str, pattern))} batches, "
             f"{args.seeds} seeds:", "",
             "| variant | samples to target | vs seq | per seed |", "|---|---|---|---|"]
    from bench_trainer import mean_sd
    for variant in args.variants:
        got = [r["samples"] for r in results if r["variant"] == variant]
        reached = [x for x in got if x is not None]
        ratio = f"{statistics.mean(reached) / statistics.mean(ref):.3f}" if reached and ref else "-"
        seeds = ", ".join("-" if x is None else f"{x:.0f}" for x in got)
        lines.append(f"| {variant} | {mean_sd(reached, '.0f')} | {ratio} | {seeds} |")
    text = "\n".join(lines)
    print("\n" + text)
    (args.out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
