"""Benchmark: padding-free training against transformers.Trainer, fine-tuning MiniLM on SMS spam.

Same data (``--train`` SMS messages, shuffled once with seed 0; ``--held-out`` to evaluate), same
checkpoint (``samples/minilm`` with a fresh 2-label head drawn from the same seed), AdamW at the
same learning rate with no warm-up or decay, the same epochs, texts cut at 64 tokens, one
thread, one process. Arms:
- flodl-hf ``Trainer(batching="length", max_tokens=batch x mean length)``: length-grouped batches,
  each padded only to its own longest text, in shuffled order;
- transformers.Trainer with its default collator (``DataCollatorWithPadding``: each random batch
  of ``--batch`` padded to its longest text);
- transformers.Trainer grouping by length (``train_sampling_strategy="group_by_length"``, formerly
  ``group_by_length=True``).
The figure is training wall time (evaluation excluded), and the held-out accuracy after training.
Both sides step torch's fused AdamW (``fused=True``; transformers.Trainer's default optimizer,
``adamw_torch_fused``): on MiniLM, one thread, its step takes 10.5 ms where the default for-loop
AdamW takes 94, which over 50 steps is 4 s of a 21 s run, so the optimizers must match. Both clip
the gradients' norm at 1.0 (transformers.Trainer's default ``max_grad_norm``; our ``grad_clip``),
17 ms a step, 0.9 s over the run: without it on our side the comparison flattered us. The arms
run ``--repeats`` times in rotating order (ours first, then second, then third...), and each arm's
figure is the median of its runs.
Needs ``accelerate`` (transformers.Trainer's dependency; bench only: ``pip install -e '.[bench]'``).

    python scripts/bench_padding_free.py [--train 1500 --epochs 1 --batch 16]
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flodl_hf.tasks import batching  # noqa: E402

MAX_LEN = 64
MAX_GRAD_NORM = 1.0  # transformers.Trainer's default (max_grad_norm), so both sides clip: 17 ms a step on MiniLM


def rows(n_train: int, n_held: int) -> tuple[list, list]:
    from flodl_hf.core.samples import sample_path
    with open(sample_path("sms-spam") / "sms-spam.csv", newline="", encoding="utf-8") as f:
        found = list({r["text"]: (r["text"], int(r["spam"])) for r in csv.DictReader(f)}.values())
    random.Random(0).shuffle(found)
    return found[:n_train], found[-n_held:]


def encode(tok, items: list) -> list[dict]:
    enc = tok([t for t, _ in items], truncation=True, max_length=MAX_LEN, return_tensors=None)
    return [{"input_ids": ids, "label": y} for ids, (_, y) in zip(enc["input_ids"], items)]


def collate(items: list[dict]) -> dict:
    """Padded to the batch's longest text with zeros (flodl_hf.tasks.batching.collate), and the labels."""
    rows = [{"input_ids": x["input_ids"], "attention_mask": [1] * len(x["input_ids"])} for x in items]
    batch = batching.collate(rows, {"input_ids": 0, "attention_mask": 0})
    return {**batch, "labels": torch.tensor([x["label"] for x in items])}


@torch.no_grad()
def accuracy(model, held: list[dict]) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(held), 64):
        batch = collate(held[i:i + 64])
        labels = batch.pop("labels")
        correct += (model(**batch).logits.argmax(-1) == labels).sum().item()
    return correct / len(held)


def ours(train: list[dict], held: list[dict], args) -> dict:
    from flodl_hf import AutoModelForSequenceClassification, Trainer
    torch.manual_seed(args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForSequenceClassification.from_pretrained("samples/minilm", num_labels=2)
    budget = round(args.batch * statistics.mean(len(x["input_ids"]) for x in train))
    t = Trainer(model, lambda m, b: m(**b), lambda p: torch.optim.AdamW(p, lr=args.lr, fused=True), train,
                batching="length", max_tokens=budget, epochs=args.epochs, collate_fn=collate, sync="none",
                grad_clip=MAX_GRAD_NORM, seed=args.seed, progress=False, report=False)
    summary = t.fit()
    return {"time": summary["train_time"], "accuracy": accuracy(model, held), "steps": summary["batches"],
            "detail": f"max_tokens {budget}, grad_clip {MAX_GRAD_NORM:g}"}


def theirs(train: list[dict], held: list[dict], args, group_by_length: bool) -> dict:
    import transformers
    transformers.logging.set_verbosity_error()
    from flodl_hf.core.samples import sample_path  # noqa: F401  (samples/minilm resolves through our loader)
    from flodl_hf.core import io
    source = str(io.resolve("samples/minilm").root)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(source, num_labels=2,
                                                                             dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(source)
    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch, num_train_epochs=args.epochs,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01,
            max_grad_norm=MAX_GRAD_NORM,
            optim="adamw_torch_fused",
            train_sampling_strategy="group_by_length" if group_by_length else "random", save_strategy="no", report_to=[], logging_strategy="no",
            disable_tqdm=True, seed=args.seed, use_cpu=True, dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=train,
                                       data_collator=transformers.DataCollatorWithPadding(tok))
        start = time.perf_counter()
        result = trainer.train()
        took = time.perf_counter() - start
    return {"time": took, "accuracy": accuracy(model, held), "steps": result.global_step,
            "detail": "group_by_length" if group_by_length else "DataCollatorWithPadding"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=1500)
    parser.add_argument("--held-out", type=int, default=500)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, in rotating order")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from flodl_hf import AutoTokenizer
    tok = AutoTokenizer.from_pretrained("samples/minilm")
    train_rows, held_rows = rows(args.train, args.held_out)
    train, held = encode(tok, train_rows), encode(tok, held_rows)
    load = os.getloadavg()[0]
    arms = {
        "flodl-hf, batching='length'": lambda: ours(train, held, args),
        "transformers.Trainer, default collator": lambda: theirs(train, held, args, False),
        "transformers.Trainer, group_by_length": lambda: theirs(train, held, args, True),
    }
    names = list(arms)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:  # each arm takes each turn
            runs[name].append(arms[name]())
            print(f"{name}: {runs[name][-1]['time']:.1f} s", flush=True)
    results = {}
    for name, got in runs.items():
        middle = sorted(got, key=lambda r: r["time"])[(len(got) - 1) // 2]
        results[name] = {**middle, "time": statistics.median(r["time"] for r in got),
                         "times": [r["time"] for r in got]}
    base = results["flodl-hf, batching='length'"]
    print(f"\nMiniLM on SMS spam: {args.train} messages, {args.epochs} epoch(s), batch {args.batch}, lr {args.lr}, "
          f"{args.threads} thread(s); held-out {args.held_out}; load average {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end.\n")
    print("| arm | train time, s (median) | runs, s | flodl-hf / this | optimizer steps | held-out accuracy | detail |")
    print("|---|---|---|---|---|---|---|")
    for arm, r in results.items():
        runs_s = ", ".join(f"{x:.1f}" for x in r["times"])
        print(f"| {arm} | {r['time']:.1f} | {runs_s} | {base['time'] / r['time']:.2f} | {r['steps']} | "
              f"{r['accuracy']:.2%} | {r['detail']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
