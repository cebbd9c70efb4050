"""Padding-free training: Trainer(batching="length", max_tokens=...).

Texts of similar length are batched together under a token budget, each batch padded only to
its own longest text. Each batch's loss and gradients are compared with transformers' on the
same batch (torch.equal), and a resumed run is compared with a straight one bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from flodl_hf.tasks import batching
from flodl_hf.auto import load_model
from flodl_hf.roundtrip.parity import reference_model
from flodl_hf.training.trainer import ElChe, Trainer, TrainerConfigError, length_batches

from helpers import assert_recorded_step_equal, make_checkpoint

SMALL = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 64, "vocab_size": 256, "max_position_embeddings": 64, "num_labels": 2,
         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def texts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.choice([rng.randint(3, 8), rng.randint(9, 20), rng.randint(21, 60)])
        out.append({"input_ids": [rng.randint(5, 255) for _ in range(length)], "label": rng.randint(0, 1)})
    return out


def collate(items: list[dict]) -> dict:
    """Padded to the batch's longest text with zeros (flodl_hf.tasks.batching.collate), and the labels."""
    rows = [{"input_ids": x["input_ids"], "attention_mask": [1] * len(x["input_ids"])} for x in items]
    batch = batching.collate(rows, {"input_ids": 0, "attention_mask": 0})
    return {**batch, "labels": torch.tensor([x["label"] for x in items])}


def test_length_batches_cover_every_item_once_under_the_budget():
    lengths = [len(x["input_ids"]) for x in texts(300)]
    batches = length_batches(lengths, max_tokens=256, seed=3, max_size=32)
    seen = torch.cat(batches).tolist()
    assert sorted(seen) == list(range(300))
    for b in batches:
        longest = max(lengths[i] for i in b.tolist())
        assert len(b) <= 32 and (len(b) * longest <= 256 or len(b) == 1)
    padded = sum(len(b) * max(lengths[i] for i in b.tolist()) for b in batches)
    # Against batches of the same sizes in random order: far fewer padded tokens.
    shuffled = torch.randperm(300, generator=torch.Generator().manual_seed(0)).tolist()
    cuts, at = [], 0
    for b in batches:
        cuts.append(shuffled[at:at + len(b)])
        at += len(b)
    assert padded < 0.7 * sum(len(c) * max(lengths[i] for i in c) for c in cuts)
    assert [b.tolist() for b in length_batches(lengths, 256, seed=3, max_size=32)] == [b.tolist() for b in batches]
    assert [b.tolist() for b in length_batches(lengths, 256, seed=4, max_size=32)] != [b.tolist() for b in batches]


def test_each_batch_loss_and_gradients_equal_transformers():
    source = make_checkpoint(SMALL, "seqcls")
    ours = load_model(source, "seqcls", dtype=torch.float32, attn_implementation="eager")
    theirs = reference_model(source, "seqcls", "eager").train()
    data = texts(60)
    seen, grads_seen = [], []

    def step(model, batch):
        out = model(**batch)
        seen.append((batch, out.loss.detach().clone()))
        return out

    def optimizer(params):  # lr 0: the weights stay put, so every batch meets the same model
        opt = torch.optim.SGD(params, lr=0.0)
        opt.register_step_pre_hook(lambda *_: grads_seen.append(
            {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}))
        return opt

    t = Trainer(ours, step, optimizer, data, batching="length", max_tokens=160, epochs=1, sync="none",
                collate_fn=collate, progress=False, report=False, seed=5)
    summary = t.fit()
    assert summary["samples"] == 60 and summary["batches"] == len(t._batches) > 4
    assert len(seen) == len(grads_seen) == summary["batches"]
    widths = set()
    for (batch, loss), grads in zip(seen, grads_seen):
        assert batch["input_ids"].numel() <= 160 or len(batch["input_ids"]) == 1
        assert bool(batch["attention_mask"][:, -1].any())  # padded to its own longest text, no further
        widths.add(batch["input_ids"].shape[1])
        assert_recorded_step_equal(theirs, batch, loss, grads)
    assert len(widths) > 3  # batches of several lengths, not one padded width


class Bag(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.out = nn.Embedding(256, 16), nn.Linear(16, 2)

    def forward(self, input_ids, attention_mask, labels):
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.emb(input_ids) * mask).sum(1) / mask.sum(1)
        return nn.functional.cross_entropy(self.out(torch.nn.functional.dropout(pooled, 0.1, self.training)), labels)


def _run(model, data, directory, max_steps, **kw):
    return Trainer(model, lambda m, b: m(**b), lambda p: torch.optim.AdamW(p, lr=1e-2), data, batching="length",
                   max_tokens=120, max_steps=max_steps, collate_fn=collate, checkpoint_dir=directory,
                   progress=False, report=False, seed=1, **kw)


@pytest.mark.parametrize("sync", ["none", "el-che"])
def test_length_batching_resumes_bit_exactly(tmp_path, sync):
    data = texts(90, seed=2)
    kw = {"sync": ElChe(anchor=2)} if sync == "el-che" else {"sync": "none"}
    straight = Bag(0)
    t = _run(straight, data, tmp_path / "a", 30, **kw)
    t.fit()
    assert t.steps_per_epoch == len(t._batches) < 90 / 4  # steps are batches, across epochs
    _run(Bag(0), data, tmp_path / "b", 11, **kw).fit()
    resumed = Bag(3)
    r = _run(resumed, data, tmp_path / "b", 30, **kw)
    summary = r.fit()
    assert r.resumed_from is not None and summary["step"] == 30
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))


def test_length_batching_needs_a_budget_and_lengths():
    with pytest.raises(TrainerConfigError, match="max_tokens"):
        Trainer(Bag(0), lambda m, b: m(**b), torch.optim.SGD, texts(4), batching="length", epochs=1)
    with pytest.raises(TrainerConfigError, match="lengths"):
        Trainer(Bag(0), lambda m, b: m(**b), torch.optim.SGD, [torch.zeros(3)] * 4, batching="length",
                max_tokens=10, epochs=1)
    with pytest.raises(TrainerConfigError, match="batch_size"):
        Trainer(Bag(0), lambda m, b: m(**b), torch.optim.SGD, texts(4), epochs=1)
