"""The trainer's embedding gradients, added into the table of the step before (flodl_hf.training.embedding_grads).

Each step's gradients are compared with transformers' on the same batch (torch.equal), at MiniLM's
width (30,522 x 384) where the saving is real, with a sequence classifier (untied embeddings, the
table must be reused) and a masked LM (word embeddings tied to the decoder). The table is never one
that someone else still holds.
"""

from __future__ import annotations

import random
import weakref

import pytest
import torch
from torch import nn

from flodl_hf.tasks import batching
from flodl_hf.training import embedding_grads
from flodl_hf.auto import load_model
from flodl_hf.roundtrip.parity import reference_model
from flodl_hf.training.trainer import Trainer

from helpers import assert_recorded_step_equal, make_checkpoint

WIDE = {"model_type": "bert", "hidden_size": 384, "num_hidden_layers": 1, "num_attention_heads": 6,
        "intermediate_size": 1536, "vocab_size": 30522, "max_position_embeddings": 128, "num_labels": 2,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def texts(n: int, seed: int) -> list[dict]:
    """Texts of several lengths whose words repeat (a word's rows add up in token order)."""
    rng = random.Random(seed)
    common = [rng.randint(1, 30521) for _ in range(40)]
    out = []
    for _ in range(n):
        ids = [rng.choice(common) if rng.random() < 0.6 else rng.randint(1, 30521) for _ in range(rng.randint(3, 40))]
        out.append({"input_ids": ids, "label": rng.randint(0, 1)})
    return out


def collate_for(task: str):
    def collate(items: list[dict]) -> dict:
        rows = [{"input_ids": x["input_ids"], "attention_mask": [1] * len(x["input_ids"])} for x in items]
        batch = batching.collate(rows, {"input_ids": 0, "attention_mask": 0})  # 0: BERT's pad_token_id
        if task == "mlm":
            labels = batch["input_ids"].clone()
            labels[batch["attention_mask"] == 0] = -100
            return {**batch, "labels": labels}
        return {**batch, "labels": torch.tensor([x["label"] for x in items])}
    return collate


@pytest.mark.parametrize("task", ["seqcls", "mlm"])
def test_each_step_equals_transformers_and_the_table_is_reused(task):
    source = make_checkpoint(WIDE, task)
    ours = load_model(source, task, dtype=torch.float32)
    theirs = reference_model(source, task, "sdpa").train()
    words = ours.get_input_embeddings()
    seen, grads_seen, tables = [], [], []

    def step(model, batch):
        out = model(**batch)
        seen.append((batch, out.loss.detach().clone()))
        return out

    def optimizer(params):  # lr 0: every batch meets the same weights
        opt = torch.optim.SGD(params, lr=0.0)

        def record(*_):
            grads_seen.append({n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None})
            tables.append(words.weight.grad.data_ptr())
        opt.register_step_pre_hook(record)
        return opt

    t = Trainer(ours, step, optimizer, texts(24, seed=1), batch_size=6, epochs=1, sync="none",
                collate_fn=collate_for(task), progress=False, report=False, seed=3)
    t.fit()
    assert len(seen) == len(grads_seen) == 4
    for (batch, loss), grads in zip(seen, grads_seen):
        assert_recorded_step_equal(theirs, batch, loss, grads)
    if task == "seqcls":  # one table for all steps; with the tied decoder the sum may land elsewhere
        assert len(set(tables)) == 1
    # After fit the modules are plain nn.Embedding again, holding no table.
    assert all(type(m) is nn.Embedding and "_flodl_table" not in vars(m)
               for m in ours.modules() if isinstance(m, nn.Embedding))


def _pair(vocab: int, width: int, seed: int = 0) -> tuple[nn.Embedding, nn.Embedding]:
    torch.manual_seed(seed)
    plain = nn.Embedding(vocab, width, padding_idx=0)
    kept = nn.Embedding(vocab, width, padding_idx=0)
    kept.weight.data.copy_(plain.weight.data)
    return plain, kept


def _backward(module: nn.Embedding, ids: torch.Tensor, upstream: torch.Tensor) -> None:
    (module(ids) * upstream).sum().backward()


@pytest.mark.parametrize("threads", [1, 2])
def test_gradients_equal_plain_embeddings_at_minilm_width(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain, kept = _pair(30522, 384)
        gen = torch.Generator().manual_seed(threads)
        with embedding_grads.reused(kept) as modules:
            assert modules == [kept]
            ptrs = set()
            for step in range(4):
                high = 50 if step % 2 else 30522  # many repeats of few words, then the whole vocabulary
                ids = torch.randint(0, high, (8, 48), generator=gen)
                ids[:, -6:] = 0  # padding
                upstream = torch.randn(8, 48, 384, generator=gen)
                plain.zero_grad(set_to_none=True)
                kept.zero_grad(set_to_none=True)
                _backward(plain, ids, upstream)
                _backward(kept, ids.to(torch.int32), upstream)
                assert torch.equal(plain.weight.grad, kept.weight.grad)
                ptrs.add(kept.weight.grad.data_ptr())
            assert len(ptrs) == 1
    finally:
        torch.set_num_threads(before)


def test_a_table_someone_holds_is_never_written():
    plain, kept = _pair(1000, 64)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 1000, (4, 16), generator=gen), torch.randn(4, 16, 64, generator=gen))
               for _ in range(5)]
    with embedding_grads.reused(kept):
        _backward(kept, *batches[0])
        held = kept.weight.grad  # a caller keeps the gradient by name
        copy = held.clone()
        kept.zero_grad(set_to_none=True)
        _backward(kept, *batches[1])
        assert torch.equal(held, copy) and kept.weight.grad.data_ptr() != held.data_ptr()
        view = kept.weight.grad[3:5]  # ...or only a view of it
        copy = view.clone()
        second = kept.weight.grad.data_ptr()
        kept.zero_grad(set_to_none=True)
        _backward(kept, *batches[2])
        assert torch.equal(view, copy) and kept.weight.grad.data_ptr() != second
        del held, view
        third = kept.weight.grad.data_ptr()
        kept.zero_grad(set_to_none=True)
        _backward(kept, *batches[3])
        assert kept.weight.grad.data_ptr() == third  # no one holds it: taken again
        # Accumulation (the gradient is still there): a table added to it, as nn.Embedding's backward
        # gives; the next micro-batch's table is that one again.
        added = []
        kept.weight.register_hook(lambda g: added.append(weakref.ref(g)))  # a weak name: no hold
        plain.zero_grad(set_to_none=True)
        _backward(plain, *batches[3])
        for ids, upstream in batches[4:] + batches[:2]:
            _backward(kept, ids, upstream)
            _backward(plain, ids, upstream)
            assert torch.equal(plain.weight.grad, kept.weight.grad)
        assert len(added) == 3 and added[0]() is not None and all(r() is added[0]() for r in added)
        assert added[0]().data_ptr() != kept.weight.grad.data_ptr()
    assert type(kept) is nn.Embedding


def test_only_plain_cpu_embeddings_that_train_are_taken():
    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    model = nn.ModuleDict({"plain": nn.Embedding(10, 4), "frozen": nn.Embedding(10, 4),
                           "sparse": nn.Embedding(10, 4, sparse=True), "renorm": nn.Embedding(10, 4, max_norm=1.0),
                           "freq": nn.Embedding(10, 4, scale_grad_by_freq=True), "sub": Scaled(10, 4),
                           "bf16": nn.Embedding(10, 4).to(torch.bfloat16)})
    model["frozen"].weight.requires_grad_(False)
    with embedding_grads.reused(model) as modules:
        assert modules == [model["plain"]]
        with torch.no_grad():  # no graph: nn.Embedding's own forward
            assert model["plain"](torch.tensor([1, 2])).grad_fn is None
    with embedding_grads.reused(model, enabled=False) as modules:
        assert modules == []
