r"""Benchmark: wall time to a target held-out accuracy, fine-tuning MiniLM into a spam classifier with uneven workers.

The task: all-MiniLM-L6-v2 (``samples/minilm``, 22M parameters) with a fresh 2-label head, fine-tuned on the SMS
Spam Collection (``samples/sms-spam``; deduplicated, shuffled once with seed 0: ``--train`` messages to train on,
``--held-out`` to evaluate), AdamW lr 5e-5, batch 16 per worker, texts cut at 64 tokens. The figure is training time
(evaluation excluded) until the held-out accuracy first reaches ``--target``, and the held-out accuracy then.

Arms, for each cohort: the fast worker alone (the same run in every cohort: run once per seed, shared by the
cohorts); DDP; El Che (``ElChe()`` with nothing set: the trainer chooses combine, windows, compression, nesting, sync
share and anchor from what it measures; the tables' "chose" column says what it took); El Che + DiLoCo (``ElChe()``,
``outer=DiLoCo()``: outer Nesterov SGD on the averaged change). ``--combine --windows --anchor --sync-share
--compress --nested`` set that field in those two (left out, the trainer chooses). Run only when named in
``--arms``, each one override of the default: "El Che, sum" (``combine="sum", nested=False``: flat windows, every
worker its own optimizer, the changes summed), "El Che, one optimizer" (``combine="lead"``), "El Che, flat"
(``nested=False``), "El Che, tiers named" (``nested=nest_tiers(slowdowns)``: 3x only, flat elsewhere), "El Che,
planned" (``windows="planned"``), "El Che, full precision" (``compress="none"``), "El Che, bf16"
(``compress="bf16"``), "DDP, balanced" (``Trainer(balance=True)``, the fast worker alone's batch split by speed).

Cohorts: ``2x`` (speeds 1 : 1/3), ``3x`` (1 : 1/3 : 1/12, a card behind a PCIe x1 riser as in the flodl flagship
run), ``2x-netns``: the 2x pair with each worker a host of its own, a network namespace (``flodl_hf.testing.netns``,
root), torchrun across a link shaped by ``--link-rate`` and ``--link-delay``. Every worker is one process with one
thread, talking gloo (on 127.0.0.1 outside the namespaces). The target is a held-out accuracy (``--target``) or,
smoother on a few hundred messages, a held-out loss (``--target-loss``), checked every ``--eval-every`` samples.
Evaluation is off every arm's clock: the other workers wait for worker 0's, and a throttled worker that trains on
through one (an outer worker of nested windows) has its sleep stand still meanwhile. ``--peak``: no stop at the
target (only at ``--cap``), and a table of each arm's best and last held-out loss, best accuracy, how long it held
(from the first evaluation at it to the last within 0.4 points), final accuracy, and the time each arm spent at or
below the fast worker alone's best loss.

Making a worker k times slower without letting it take the fast one's CPU:
- ``sleep`` (default, works everywhere): before each batch the worker sleeps (k - 1) times the CPU time its previous
  batch took (collate, forward, backward, step; the training thread's own, not gloo's threads), so the wait lands
  before the gradient sync (DDP) or the window's, never inside another worker's evaluation. CPU time, because
  waiting in DDP's all-reduce takes none: a wall-clock measure would feed each worker's sleep with the others' (at 1
  : 1/3 : 1/12 DDP steps grew to 34 s, then gloo's timeout). Sleeping takes no CPU, so the fast worker keeps its
  core, and the ratio holds whatever the machine's load does to both. A worker that never steps (all but worker 0
  when the run's combine is "lead", asked or chosen) has its batch's work end with backward.
- ``cgroup`` (root; cgroup v2's cpu controller, or v1's): the worker runs in its own cgroup limited to 1/k of a core
  (``cpu.max``; v1: ``cpu.cfs_quota_us``). The kernel enforces it, as a slower device would, but a quota only slows
  a worker that would otherwise have a whole core: with fewer free cores than workers the ratio is not k. ``both``
  applies the two.
- ``lead`` (a diagnostic): each batch of a slower worker takes k times worker 0's smoothed batch time (through the
  rendezvous store), not k times its own work. With ``sleep`` at k = 3 the slow worker's windows ran 3.1 to 3.3x the
  fast batch a batch; this paces the batch itself at 3x, to measure what the excess costs (10 seeds: 3.08x;
  docs/benchmarks.md).

    # issue 56's bench: 5 seeds, every cohort (root for 2x-netns), the default arms
    python scripts/bench_trainer.py --seeds 5 --cohorts 2x 3x 2x-netns --target-loss 0.10
    python scripts/bench_trainer.py --summarize --seeds 5 --cohorts 2x 3x 2x-netns --target-loss 0.10
    python scripts/bench_trainer.py --seeds 1 --cohorts 2x --target 0.97
    python scripts/bench_trainer.py --seeds 5 --cohorts 2x --fused --target-loss 0.10 \
        --arms "fast worker alone" "El Che" "El Che, sum" "El Che, one optimizer" "El Che, planned"
    python scripts/bench_trainer.py --cohorts 3x --target-loss 0.10 \
        --arms "fast worker alone" "El Che" "El Che, flat" "El Che, tiers named"
    python scripts/bench_trainer.py --cohorts 2x-netns --target-loss 0.10 \
        --arms "fast worker alone" "El Che" "El Che, full precision" "El Che, bf16"
    python scripts/bench_trainer.py --cohorts 2x --combine sum --windows planned --target-loss 0.10
    # the peak: no stop at the target, 3 epochs of 1000 messages
    python scripts/bench_trainer.py --peak --seeds 2 --cohorts 2x --arms "fast worker alone" "El Che" \
        "El Che + DiLoCo" --train 1000 --epochs 3 --eval-every 200 --cap 400 --out out/bench_peak

Tables go to stdout and ``out/bench_trainer/table.md``; each run's ``run.html`` under ``out/bench_trainer/``.
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
from collections import Counter
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flodl_hf.tasks import batching  # noqa: E402
from flodl_hf.training.records import load_tree  # noqa: E402

COHORTS = {"2x": (1.0, 3.0), "3x": (1.0, 3.0, 12.0), "2x-netns": (1.0, 3.0)}  # each worker's slowdown k
NETNS = {"2x-netns"}  # one network namespace per worker (flodl_hf.testing.netns), torchrun across them
ARMS = ("fast worker alone", "DDP", "El Che", "El Che + DiLoCo")
ALONE = "fast worker alone"  # one worker, the same run in every cohort: once per seed, shared by the cohorts
EL_CHE_ARMS = ("El Che", "El Che + DiLoCo")  # ElChe() with the options' fields set, the rest the trainer's
# Run only when named (--arms): each an explicit override of the default ElChe() (None: not El Che).
MORE_ARMS = {"El Che, sum": {"combine": "sum", "nested": False}, "El Che, one optimizer": {"combine": "lead"},
             "El Che, flat": {"nested": False}, "El Che, tiers named": {"nested": "named"},
             "El Che, planned": {"windows": "planned"}, "El Che, full precision": {"compress": "none"},
             "El Che, bf16": {"compress": "bf16"}, "DDP, balanced": None}
EL_CHE_FIELDS = ("anchor", "sync_share", "windows", "combine", "compress", "nested")  # the options that set them
BATCH, LR, MAX_LEN = 16, 5e-5, 64
CGROUP = Path("/sys/fs/cgroup")


# ---- data ---------------------------------------------------------------------------------------

def load_sms(n_train: int, n_held: int) -> tuple[list, list]:
    from flodl_hf.core.samples import sample_path
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
    """Padded to the batch's longest text with zeros (flodl_hf.tasks.batching.collate), and the labels."""
    rows = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids, _ in items]
    batch = batching.collate(rows, {"input_ids": 0, "attention_mask": 0})
    return {**batch, "labels": torch.tensor([y for _, y in items])}


# ---- throttles ----------------------------------------------------------------------------------

CGROUP_V1_CPU = CGROUP / "cpu"  # cgroup v1's cpu controller: the same CFS bandwidth limit as cpu.max


def cgroup_version() -> int | None:
    """2 for cgroup v2 with the cpu controller, 1 for cgroup v1's cpu controller, None: neither (or not root)."""
    controllers = CGROUP / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split() and os.access(CGROUP, os.W_OK):
        return 2
    if (CGROUP_V1_CPU / "cpu.cfs_quota_us").is_file() and os.access(CGROUP_V1_CPU, os.W_OK):
        return 1
    return None


def cgroup_path(name: str) -> Path:
    return (CGROUP if cgroup_version() == 2 else CGROUP_V1_CPU) / f"flodl-hf-bench-{name}"


def cgroup_limit(pid: int, k: float, name: str) -> Path:
    """Put ``pid`` in a cgroup of its own limited to 1/k of a core (CFS bandwidth: ``cpu.max`` on v2,
    ``cpu.cfs_quota_us`` on v1); return the cgroup, which the parent removes once the run is over."""
    version = cgroup_version()
    group = cgroup_path(name)
    group.mkdir(exist_ok=True)
    period = 100_000
    quota = max(1000, int(period / k))
    if version == 2:
        (group / "cpu.max").write_text(f"{quota} {period}\n")
    else:
        (group / "cpu.cfs_period_us").write_text(f"{period}\n")
        (group / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (group / "cgroup.procs").write_text(f"{pid}\n")
    return group


# ---- one worker ---------------------------------------------------------------------------------

def worker(rank: int, world: int, port: int, arm: str, ks: tuple[float, ...], seed: int, args: dict,
           out: str, throttle: str) -> None:
    torch.set_num_threads(1)
    if world > 1:  # port None: under torchrun, which set the rendezvous environment
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}" if port else "env://", rank=rank,
                                world_size=world, timeout=timedelta(seconds=120))
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
    if k > 1 and throttle in ("cgroup", "both"):
        cgroup_limit(os.getpid(), k, f"{Path(out).name}-r{rank}")  # the worker limits itself: also under torchrun
    began, last = [0.0], [0.0]
    store = dist.distributed_c10d._get_default_store() if world > 1 else None
    EVALUATING = "bench/evaluating"  # worker 0 adds 1 while it evaluates

    def throttle_sleep(seconds: float) -> None:
        # Evaluation is off every arm's clock. Where the others wait for worker 0's evaluation
        # (stop_when's answer) nothing trains meanwhile; an outer worker of nested windows trains on
        # through it, so its sleep stands still while worker 0 evaluates: the emulated device pauses.
        if store is None:
            time.sleep(seconds)
            return
        left = seconds
        while left > 0:
            busy = store.add(EVALUATING, 0) > 0
            chunk = min(0.05, left)
            time.sleep(chunk)
            if not busy:
                left -= chunk

    LEAD_MS = "bench/lead-batch-s"  # --throttle lead: worker 0's smoothed batch time, in seconds
    fresh, lead_ema = [False], [0.0]

    def timed_collate(items):
        # The throttle sleeps at the start of a batch, for (k - 1) times the previous batch's own work,
        # so the wait comes before this batch's gradient sync (DDP) or the window's (El Che), never
        # hidden in another worker's evaluation.
        if k > 1 and throttle in ("sleep", "both") and last[0]:
            throttle_sleep((k - 1) * last[0])
        elif k > 1 and throttle == "lead" and last[0]:
            # The diagnostic throttle: this batch is to take k times worker 0's (its smoothed batch
            # time, published through the store), its own work (the previous batch's) included.
            lead = float(store.get(LEAD_MS)) if store is not None and store.check([LEAD_MS]) else None
            throttle_sleep(max(0.0, k * lead - last[0]) if lead else (k - 1) * last[0])
        began[0] = time.thread_time()  # a batch's own work starts with building it
        fresh[0] = True
        return collate(items)

    def step(model, batch):
        return model(**batch)

    built = [None]  # the Trainer, once built: its el_che holds the resolved combine, asked or chosen

    def never_steps() -> bool:  # combine "lead": the workers but worker 0 only compute gradients
        return rank > 0 and getattr(getattr(built[0], "el_che", None), "combine", None) == "lead"

    def optimizer(params):
        opt = torch.optim.AdamW(params, lr=LR, fused=args.get("fused", False))

        def throttle_hook(*_):
            # This batch's own work (collate, forward, backward, step) in the training thread's CPU time
            # (a device's speed; not gloo's threads, which may run a sync meanwhile): waiting for the
            # other workers (DDP's all-reduce inside backward) takes none, so a worker's sleep never
            # feeds on another's. The next batch's sleep scales with it, so the worker is k times
            # slower whatever the load. The very first batch has no previous one to scale with: it
            # sleeps after itself, so that it too takes k times its work.
            first = not last[0]
            last[0] = time.thread_time() - began[0]
            if throttle == "lead" and rank == 0 and store is not None and fresh[0]:
                # Worker 0 publishes its batch time (not its step on the others' gradients, which
                # follows no batch of its own): half the weight on the newest.
                lead_ema[0] = last[0] if not lead_ema[0] else (lead_ema[0] + last[0]) / 2
                store.set(LEAD_MS, repr(lead_ema[0]))
            fresh[0] = False
            if first and k > 1 and throttle in ("sleep", "both", "lead"):
                throttle_sleep((k - 1) * last[0])

        def after_backward(_):  # a worker that never steps: its batch's own work ends with backward, when the
            if never_steps():  # first parameter's gradient (the embeddings', the last reached) lands
                throttle_hook()

        def after_step(*_):
            if not never_steps():
                throttle_hook()

        # Called while the Trainer is built, before the combine is resolved: both hooks go in, never_steps() says
        # which counts.
        if world > 1 and rank > 0 and params[0].requires_grad:
            params[0].register_post_accumulate_grad_hook(after_backward)
        opt.register_step_post_hook(after_step)
        return opt

    held.sort(key=lambda item: len(item[0]))  # batches of similar length: less padding, same answers

    @torch.no_grad()
    def evaluate(model):
        if store is not None:
            store.add(EVALUATING, 1)
        try:
            return held_out(model)
        finally:
            if store is not None:
                store.add(EVALUATING, -1)

    def held_out(model):
        correct, loss = 0, 0.0
        for i in range(0, len(held), 64):
            batch = collate(held[i:i + 64])
            out_ = model(**batch)
            loss += out_.loss.item() * len(batch["labels"])
            correct += (out_.logits.argmax(-1) == batch["labels"]).sum().item()
        return {"accuracy": correct / len(held), "eval_loss": loss / len(held)}

    fields = el_che_fields(arm, args, ks)
    el_che = ElChe(**fields) if fields is not None else None
    sync = {ALONE: "none", "DDP": "ddp", "DDP, balanced": "ddp"}.get(arm, el_che)
    balance = arm == "DDP, balanced"
    batch = max(1, BATCH // world) if balance else BATCH  # balanced: a step of BATCH samples, as one worker's
    started = time.monotonic()
    trainer = Trainer(model, step, optimizer, train, batch_size=batch, epochs=args["epochs"], sync=sync,
                      outer=DiLoCo() if arm == "El Che + DiLoCo" else None, seed=seed, collate_fn=timed_collate,
                      eval_fn=evaluate, eval_every=max(1, args["eval_every"] // (world * batch)), balance=balance,
                      stop_when=lambda m: (not args.get("peak") and reached(m, args))  # --peak: only the cap
                      or time.monotonic() - started > args["cap"],
                      log_dir=out, log_every=5, progress=False, report=True, timeout=120)
    built[0] = trainer  # before fit: the hooks read the run's combine, the user's or the trainer's choice
    trainer.fit()
    if world > 1:
        dist.destroy_process_group()


def el_che_fields(arm: str, args: dict, ks: tuple[float, ...]) -> dict | None:
    """The ElChe fields ``arm`` sets (None: not an El Che arm): the options' in the two El Che arms, the arm's own
    override in the others; the trainer chooses the rest. ``nested``: "auto" is True (tiers found in the first
    window), "named" the tiers :func:`flodl_hf.training.sync.nest_tiers` cuts from the slowdowns (False if none)."""
    fields = {f: args[f] for f in EL_CHE_FIELDS if args.get(f) is not None} if arm in EL_CHE_ARMS \
        else dict(MORE_ARMS[arm]) if MORE_ARMS.get(arm) is not None else None
    if fields and fields.get("nested") in ("auto", "named"):
        from flodl_hf.training.sync import nest_tiers
        fields["nested"] = True if fields["nested"] == "auto" else (nest_tiers(list(ks)) or False)
    return fields


def reached(metrics: dict, args: dict) -> bool:
    """The target: held-out loss at most ``target_loss`` when given, else accuracy at least ``target``."""
    if args.get("target_loss") is not None:
        return metrics["eval_loss"] <= args["target_loss"]
    return metrics["accuracy"] >= args["target"]


def interpolate(before: tuple[float, float] | None, hit: tuple[float, float], goal: float) -> float:
    """Where a measure first reaches ``goal``, linear between the last ``(x, value)`` short of it
    (``before``; None when the first evaluation already reached it) and the first at it (``hit``):
    evaluations fall every few batches, seconds apart at El Che's window ends, so every arm gets
    the same rule."""
    if before is None or before[1] == hit[1]:
        return hit[0]
    return before[0] + (hit[0] - before[0]) * (before[1] - goal) / (before[1] - hit[1])


def run_netns(cohort: str, arm: str, ks: tuple, seed: int, args: dict, out: Path, throttle: str) -> dict:
    """One worker per network namespace, each a host of its own, torchrun across the shaped link."""
    from flodl_hf.testing.netns import Cluster
    if throttle in ("cgroup", "both"):  # `ip netns exec` mounts a sysfs of its own: no cgroup tree in there
        raise SystemExit(f"cohort {cohort} runs with --throttle sleep or lead only")
    job = out / "worker.json"
    job.write_text(json.dumps({"arm": arm, "ks": ks, "seed": seed, "args": args, "out": str(out),
                               "throttle": throttle}))
    with Cluster(len(ks), rate=args["link_rate"], delay=args["link_delay"]) as cluster:
        args["shaping"] = cluster.shaping
        (out / "shaping.txt").write_text(cluster.shaping + "\n")
        procs = [cluster.torchrun(i, __file__, ["--worker", str(job)], port=29500, log=out / f"host-{i}.log")
                 for i in range(len(ks))]
        codes = cluster.wait(procs, timeout=args["cap"] * 3 + 300)
    if codes != [0] * len(ks):
        logs = "\n".join((out / f"host-{i}.log").read_text()[-2000:] for i in range(len(ks)))
        raise RuntimeError(f"{cohort} {arm} seed {seed}: hosts exited {codes}\n{logs}")
    return summarize(out, args, len(ks))


def torchrun_worker(job: Path) -> None:
    """A worker started by torchrun inside a namespace (``--worker JOB``)."""
    cfg = json.loads(job.read_text())
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, cfg["arm"], tuple(cfg["ks"]), cfg["seed"],
           cfg["args"], cfg["out"], cfg["throttle"])
    # torch 2.13 with gloo can abort at interpreter exit after a finished run (docs/trainer.md).
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def run_once(cohort: str, arm: str, seed: int, args: dict, out: Path, throttle: str) -> dict:
    ks = COHORTS[cohort][:1] if arm == "fast worker alone" else COHORTS[cohort]
    world = len(ks)
    if cohort in NETNS and world > 1:
        return run_netns(cohort, arm, ks, seed, args, out, throttle)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world, port, arm, ks, seed, args, str(out), throttle))
             for r in range(world)]
    groups = [cgroup_path(f"{out.name}-r{r}") for r in range(world)] if throttle in ("cgroup", "both") else []
    for p in procs:
        p.start()
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
    return summarize(out, args, world)


def has_records(out: Path) -> bool:
    return (out / "records.jsonl").is_file()


def summarize(out: Path, args: dict, world: int) -> dict:
    tree = load_tree(out)
    tree.setdefault("", [])
    evals = [r for r in tree[""] if r.get("event") == "eval"]
    i = next((i for i, r in enumerate(evals) if reached(r, args)), None)
    hit = evals[i] if i is not None else None
    ranks = [[r for r in tree[p] if r.get("event") == "train"] for p in sorted(tree) if p.count("/") == 1]
    at = hit or (evals[-1] if evals else {})
    fast = [r["ms_per_batch"] for r in (ranks[0] if ranks else []) if r.get("ms_per_batch")]
    samples, seen = {}, 0
    for r in tree[""]:
        if r.get("event") == "train":  # the root's train records hold each log point's or window's samples
            seen += int(r["samples"])
            samples[r["step"]] = seen
    time_ = None
    if hit is not None:
        key = "eval_loss" if args.get("target_loss") is not None else "accuracy"
        goal = args["target_loss"] if key == "eval_loss" else args["target"]
        before = (evals[i - 1]["time"], evals[i - 1][key]) if i > 0 else None
        time_ = interpolate(before, (hit["time"], hit[key]), goal)
    # An evaluation records its samples (one at a nested window's inner sync has no train record at its step).
    result = {"time": time_, "time_at_eval": hit["time"] if hit else None,
              "samples": at.get("samples", samples.get(at.get("step"))),
              "accuracy": at.get("accuracy"), "eval_loss": at.get("eval_loss"), "shaping": args.get("shaping"),
              "last_time": evals[-1]["time"] if evals else None, "windows": None, "sync": None, "idle": None,
              "fast_ms": statistics.median(fast) if fast else None, "chose": chosen(tree[""]), "peak": peak(evals)}
    # Samples a step per worker (DDP; under balance=True the split the speeds gave).
    result["split"] = [sum(r["samples"] for r in rank) / max(1, sum(r["batches"] for r in rank)) for rank in ranks]
    timed = [[r for r in rank if r.get("window_ms")] for rank in ranks]  # El Che windows
    if timed and timed[0]:
        result["windows"] = [statistics.mean(r["batches"] for r in timed[w]) for w in range(world)]
        result["sync"] = sum(r["sync_ms"] for r in timed[0]) / sum(r["window_ms"] for r in timed[0])
        result["idle"] = [sum(r["idle_ms"] for r in timed[w]) / sum(r["window_ms"] for r in timed[w])
                          for w in range(world)]
    return result


def chosen(root: list[dict]) -> str | None:
    """What El Che ran with, in short ("lead, live, bf16, share 0.1"): the start record's ``el_che["chose"]``,
    each field as the later "choice" events left it; None where no choice was recorded (older runs)."""
    el_che = next((r.get("el_che") for r in root if r.get("event") == "start"), None)
    el_che = el_che if isinstance(el_che, dict) else {}
    start = el_che.get("chose") if isinstance(el_che.get("chose"), dict) else None
    events = [r for r in root if r.get("event") == "choice" and r.get("field")]
    if start is None and not events:
        return None
    chose = {**(start or {}), **{r["field"]: r.get("value") for r in events}}  # a later choice overrides
    parts = [str(chose[f]) for f in ("combine", "windows", "compress") if chose.get(f) not in (None, "auto", "none")]
    nested = chose.get("nested")
    parts += ["nested " + " / ".join(",".join(map(str, tier)) for tier in nested)] if isinstance(nested, list) \
        else ["nested"] if nested is True else []
    parts += [f"share {chose['sync_share']:g}"] if isinstance(chose.get("sync_share"), (int, float)) else []
    parts += [f"anchor {chose['anchor']}"] if isinstance(chose.get("anchor"), int) else []  # fixed: local SGD
    return ", ".join(parts) or "-"


HELD = 0.004  # --peak's "held": accuracy within 0.4 points of the run's best (2 messages of 500)


def peak(evals: list[dict]) -> dict | None:
    """A run's peak: its best held-out loss and when, the last one, its best accuracy, how long that held
    (from the first evaluation at it to the last within ``HELD`` of it) and the final accuracy; ``curve``:
    the (training time, held-out loss) of every evaluation."""
    curve = [(r["time"], r["eval_loss"]) for r in evals if r.get("time") is not None and r.get("eval_loss") is not None]
    accs = [(r["time"], r["accuracy"]) for r in evals if r.get("time") is not None and r.get("accuracy") is not None]
    if not curve or not accs:
        return None
    at, best = min(curve, key=lambda point: point[1])  # the first evaluation at the best
    best_acc = max(a for _, a in accs)
    first = next(t for t, a in accs if a == best_acc)
    held = max(t for t, a in accs if a >= best_acc - HELD - 1e-9) - first
    return {"best_loss": best, "best_at": at, "last_loss": curve[-1][1], "rise": curve[-1][1] - best,
            "best_accuracy": best_acc, "held": held, "final_accuracy": accs[-1][1], "curve": curve}


def time_below(curve: list, goal: float) -> tuple[float | None, float]:
    """When a loss curve first reaches ``goal`` and the training time it spends at or below it (linear between
    evaluations)."""
    spans = [(t0 if l0 <= goal else t0 + (t1 - t0) * (l0 - goal) / (l0 - l1),
              t1 if l1 <= goal else t0 + (t1 - t0) * (goal - l0) / (l1 - l0))
             for (t0, l0), (t1, l1) in zip(curve, curve[1:]) if min(l0, l1) <= goal]
    spans = spans or [(t, t) for t, loss in curve[:1] if loss <= goal]
    return (spans[0][0] if spans else None), sum(b - a for a, b in spans)


# ---- tables -------------------------------------------------------------------------------------

def mean_sd(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    sd = f" ± {format(statistics.stdev(values), fmt)}" if len(values) > 1 else ""
    return f"{format(statistics.mean(values), fmt)}{sd}"


def table(cohort: str, results: dict[str, list[dict]], note: str = "") -> str:
    base = [r["time"] for r in results.get(ALONE, []) if r["time"] is not None]
    lines = [f"Cohort {cohort} ({speeds(cohort)}){note}",
             "", "| arm | time to target, s | vs fast alone | per-seed times, s | samples to target "
             "| held-out accuracy | held-out loss | batches per window | sync share | idle share | chose |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, runs in results.items():
        times = [r["time"] for r in runs if r["time"] is not None]
        missing = len(runs) - len(times)
        ratio = f"{statistics.mean(times) / statistics.mean(base):.2f}x" if times and base else "-"
        shown = mean_sd(times, ".1f") + (f" ({missing} not reached)" if missing else "")
        per_seed = ", ".join(f"{r['time']:.1f}" if r["time"] is not None else f"> {r['last_time'] or 0:.0f}"
                             for r in runs) or "-"
        acc = percent([r["accuracy"] for r in runs if r["accuracy"] is not None])
        loss = mean_sd([r["eval_loss"] for r in runs if r["eval_loss"] is not None], ".3f")
        n = mean_sd([r["samples"] for r in runs if r["time"] is not None and r.get("samples")], ".0f")
        wins = [r["windows"] for r in runs if r["windows"]]
        win = " / ".join(f"{statistics.mean(w[i] for w in wins):.1f}" for i in range(len(wins[0]))) if wins else "-"
        splits = [r["split"] for r in runs if r.get("split")]
        if arm == "DDP, balanced" and splits:  # no windows: the samples a step each worker took
            win = " / ".join(f"{statistics.mean(sp[i] for sp in splits):.1f}" for i in range(len(splits[0])))
            win += " samples a step"
        syncs = [r["sync"] for r in runs if r["sync"] is not None]
        sync = f"{statistics.mean(syncs):.1%}" if syncs else ("in backward" if arm.startswith("DDP") else "-")
        idles = [r["idle"] for r in runs if r["idle"]]
        idle = " / ".join(f"{statistics.mean(i[w] for i in idles):.0%}" for w in range(len(idles[0]))) if idles \
            else "-"
        lines.append(f"| {arm} | {shown} | {ratio} | {per_seed} | {n} | {acc} | {loss} | {win} | {sync} | {idle} "
                     f"| {chose_cell(arm, runs)} |")
    return "\n".join(lines)


def speeds(cohort: str) -> str:
    return "speeds " + " : ".join(f"1/{k:g}" if k > 1 else "1" for k in COHORTS[cohort])


def percent(values: list[float]) -> str:
    return mean_sd([100 * v for v in values], ".2f") + ("%" if values else "")


def chose_cell(arm: str, runs: list[dict]) -> str:
    """The El Che arms' choice: one, or each distinct one with its count of seeds ("-": not recorded)."""
    if not arm.startswith("El Che"):
        return ""
    counts = Counter(r.get("chose") or "-" for r in runs)
    return next(iter(counts)) if len(counts) == 1 else "; ".join(f"{c} ({n})" for c, n in counts.items())


def peak_table(cohort: str, results: dict[str, list[dict]]) -> str:
    """--peak: each arm's best held-out loss and accuracy, what came after, and how it fared against the
    fast worker alone's best loss."""
    lines = [f"Cohort {cohort} ({speeds(cohort)}), the peak: trained through the epochs, no stop at the target",
             "", "| arm | best loss | at, s | last loss | rise | best accuracy | held, s | final accuracy "
             "| per-seed best loss times, s |", "|---|---|---|---|---|---|---|---|---|"]
    peaks = {arm: ps for arm, runs in results.items() if (ps := [r["peak"] for r in runs if r.get("peak")])}
    for arm, ps in peaks.items():
        def col(key: str, fmt: str) -> str:
            return mean_sd([p[key] for p in ps], fmt)
        at = ", ".join(f"{p['best_at']:.1f}" for p in ps)
        lines.append(f"| {arm} | {col('best_loss', '.4f')} | {col('best_at', '.1f')} | {col('last_loss', '.4f')} "
                     f"| {col('rise', '.4f')} | {percent([p['best_accuracy'] for p in ps])} | {col('held', '.1f')} "
                     f"| {percent([p['final_accuracy'] for p in ps])} | {at} |")
    base = [p["best_loss"] for p in peaks.get(ALONE, [])]
    if not base:
        return "\n".join(lines)
    goal = statistics.mean(base)
    lines += ["", f"Against the fast worker alone's best held-out loss, {goal:.4f} (mean over seeds; training time, "
              "the loss linear between evaluations):", "",
              "| arm | went below | first at or below, s | time at or below, s | per-seed time at or below, s |",
              "|---|---|---|---|---|"]
    for arm, ps in peaks.items():
        below = [time_below(p["curve"], goal) for p in ps]
        went = sum(p["best_loss"] < goal for p in ps)
        firsts = [f for f, _ in below if f is not None]
        per_seed = ", ".join(f"{t:.1f}" for _, t in below)
        lines.append(f"| {arm} | {went} of {len(ps)} | {mean_sd(firsts, '.1f')} "
                     f"| {mean_sd([t for _, t in below], '.1f')} | {per_seed} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds first-seed .. first-seed + seeds - 1 (more seeds into the same --out later)")
    parser.add_argument("--cohorts", nargs="*", default=list(COHORTS), choices=list(COHORTS))
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS) + list(MORE_ARMS))
    parser.add_argument("--target", type=float, default=0.975, help="held-out accuracy to reach")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="held-out loss to reach instead (smoother than accuracy on a few hundred messages)")
    parser.add_argument("--peak", action="store_true", help="train through --epochs (no stop at the target, only "
                        "at --cap) and add the peak's table (best and last loss, best accuracy and how long it held)")
    parser.add_argument("--train", type=int, default=3000, help="training messages")
    parser.add_argument("--held-out", type=int, default=500, help="held-out messages")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--eval-every", type=int, default=48, help="evaluate every this many samples")
    parser.add_argument("--cap", type=float, default=100.0,
                        help="stop a run after this many seconds of wall time (evaluations included)")
    parser.add_argument("--throttle", choices=["sleep", "cgroup", "both", "lead"], default="sleep",
                        help="lead: a diagnostic, each batch k times worker 0's rather than k times its own work")
    el_che = parser.add_argument_group("El Che's fields", "set in the arms El Che and El Che + DiLoCo only; "
                                       "left out (the default), the trainer chooses from what it measures")
    el_che.add_argument("--combine", choices=["average", "sum", "lead"])
    el_che.add_argument("--windows", choices=["live", "planned"], help="batches dealt as workers go, or planned")
    el_che.add_argument("--anchor", type=int, help="fixed: every worker runs that many batches a window (local SGD)")
    el_che.add_argument("--sync-share", type=float, help="the anchor grows while the sync takes more of a window")
    el_che.add_argument("--compress", choices=["none", "bf16"], help="bf16: the changes sent in bfloat16")
    el_che.add_argument("--nested", nargs="?", const="auto", choices=["auto", "named"],
                        help="nested windows: 'auto' (nested=True, tiers from the first window's speeds) or 'named' "
                             "(the tiers nest_tiers cuts from the cohort's slowdowns)")
    parser.add_argument("--link-rate", default="1gbit", help="the netns cohort's link rate (tc)")
    parser.add_argument("--link-delay", default="5ms", help="the netns cohort's link delay, each way (tc netem)")
    parser.add_argument("--fused", action="store_true",
                        help="torch's fused AdamW (transformers.Trainer's default; 11 ms a step on MiniLM where "
                             "the for-loop default takes 94), in every arm")
    parser.add_argument("--out", type=Path, default=Path("out/bench_trainer"))
    parser.add_argument("--summarize", action="store_true", help="rebuild the tables from the records under --out")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a torchrun worker of the netns cohort
    args = parser.parse_args(argv)
    if args.worker is not None:
        torchrun_worker(args.worker)
    if args.throttle in ("cgroup", "both") and cgroup_version() is None:
        raise SystemExit("--throttle cgroup needs the cpu controller of cgroup v2 (or v1), writable (root)")
    conf = {"target": args.target, "train": args.train, "held_out": args.held_out, "epochs": args.epochs,
            "eval_every": args.eval_every, "cap": args.cap, "peak": args.peak, "fused": args.fused,
            "target_loss": args.target_loss, "link_rate": args.link_rate, "link_delay": args.link_delay,
            **{f: getattr(args, f) for f in EL_CHE_FIELDS}}
    load_start = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    texts = []
    alone: dict[int, dict | None] = {}  # the fast worker alone's result by seed: once, shared by the cohorts
    for cohort in args.cohorts:
        results: dict[str, list[dict]] = {arm: [] for arm in args.arms}
        conf.pop("shaping", None)
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for arm in args.arms:
                if arm == ALONE and seed in alone:  # once per seed, shared by the cohorts
                    results[arm] += [dict(alone[seed])] if alone[seed] else []
                    continue
                out, result = run_dir(args.out, cohort, arm, seed), None
                if args.summarize and arm == ALONE:  # in the first cohort's folder of the invocation that ran it
                    out = next((d for d in (run_dir(args.out, c, arm, seed) for c in (*args.cohorts, *COHORTS))
                                if has_records(d)), out)
                if args.summarize and not has_records(out):
                    print(f"{out}: no records, left out", file=sys.stderr)
                elif args.summarize:  # the tables again from the runs' records
                    if (out / "shaping.txt").is_file():
                        conf["shaping"] = (out / "shaping.txt").read_text().strip()
                    result = summarize(out, conf, 1 if arm == ALONE else len(COHORTS[cohort]))
                else:
                    out.mkdir(parents=True, exist_ok=True)
                    for old in out.rglob("records.jsonl"):
                        old.unlink()
                    result = run_once(cohort, arm, seed, conf, out, args.throttle)
                    shown = f"{result['time']:.1f} s" if result["time"] is not None else "not reached"
                    shown += f", best loss {result['peak']['best_loss']:.4f}" if args.peak and result["peak"] else ""
                    shown += f", chose {result['chose'] or '-'}" if arm.startswith("El Che") else ""
                    loss = f"{result['eval_loss']:.4f}" if result["eval_loss"] is not None else "-"
                    print(f"{cohort} seed {seed} {arm}: {shown}, accuracy {result['accuracy']}, loss {loss} "
                          f"(load {os.getloadavg()[0]:.1f}; {out / 'run.html'})", flush=True)
                if arm == ALONE:
                    alone[seed] = result
                results[arm] += [result] if result else []
        notes = ([f"one worker per network-namespace host, link {conf.get('shaping')}; the fast worker alone "
                  "runs outside the namespaces"] if cohort in NETNS else [])
        notes += ["the fast worker alone: measured once per seed, shared by the cohorts"] if ALONE in args.arms else []
        texts.append(table(cohort, results, "".join(f"; {n}" for n in notes)))
        if args.peak:
            texts.append(peak_table(cohort, results))
        (args.out / f"results-{cohort}.json").write_text(json.dumps(results, indent=1))
    goal = (f"held-out loss {args.target_loss:g}" if args.target_loss is not None
            else f"held-out accuracy {args.target:.1%}")
    asked = ", ".join(f"{f}={conf[f]}" for f in EL_CHE_FIELDS if conf[f] is not None)
    head = (f"MiniLM spam fine-tune: target {goal} on {args.held_out} messages"
            f"{' (--peak: no stop at it, only at the cap)' if args.peak else ''}; {args.train} training messages, "
            f"{args.epochs} epoch(s) at most, cap {args.cap:g} s; {args.seeds} seed(s); batch {BATCH} per worker "
            f"(DDP, balanced: {BATCH} a step); {'fused ' if args.fused else ''}AdamW; throttle {args.throttle}; "
            f"El Che: {asked or 'the trainer chooses'}; load average {load_start:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end.")
    text = head + "\n\n" + "\n\n".join(texts)
    print("\n" + text)
    (args.out / "table.md").write_text(text + "\n")
    return 0


def run_dir(root: Path, cohort: str, arm: str, seed: int) -> Path:
    return root / f"{cohort}-{arm.replace(' + ', '-').replace(',', '').replace(' ', '-').lower()}-seed{seed}"


if __name__ == "__main__":
    sys.exit(main())
