"""Trainer gradient accumulation and mixed precision, each against torch written out in the test.

``gradient_accumulation_steps=k`` follows transformers' Trainer: one optimizer step takes k
micro-batches per worker, each loss divided by the step's count of micro-batches before
backward. ``precision="bf16"|"fp16"`` runs the closure under ``torch.autocast``; fp16 scales the
loss with ``torch.amp.GradScaler``. Small MLPs on the CPU; the DDP case runs two gloo workers
through tests/test_trainer_dist.py's harness.

A ``step(model, batch, num_items_in_batch)`` gets the step's count of label items, as transformers'
Trainer counts it, and its loss is not divided by k: tested on a tiny LLaMA (ours, and transformers' in
transformers' own Trainer) against loops written out.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flodl_hf.training.sync import ElChe
from flodl_hf.training.checkpoints import load_checkpoint
from flodl_hf.training.trainer import Trainer, TrainerConfigError, TrainerError

from test_trainer_dist import Points, flat, mlp, mse_step, sgd, spawn

collate = torch.utils.data.default_collate


def perm(n: int, seed: int, epoch: int) -> list[int]:
    """The trainer's order of an epoch: randperm from a generator seeded by (seed, epoch)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def fit(model, data, **kw) -> Trainer:
    base = dict(progress=False, report=False, sync="none")
    t = Trainer(model, kw.pop("step", mse_step), kw.pop("opt", adamw), data, **{**base, **kw})
    t.fit()
    return t


def replay(model, data, *, batch: int, k: int, epochs: int, seed: int = 0, clip: float | None = 1.0,
           opt=adamw, sched=warmup, autocast: torch.dtype | None = None, scaler=None, loss_fn=mse_step) -> int:
    """transformers' loop, written out: per step k micro-batches of ``batch`` from the epoch's order,
    each (loss / micro-batches in the step).backward(), then clip, step, scheduler, zero_grad.
    Returns the optimizer steps taken (fp16 steps the scaler skipped included, and counted in
    ``replay.skipped``)."""
    replay.skipped = 0
    optimizer = opt(model.parameters())
    scheduler = sched(optimizer) if sched else None
    steps = 0
    for epoch in range(epochs):
        order = perm(len(data), seed, epoch)
        for start in range(0, len(data), batch * k):
            micro = [order[i:i + batch] for i in range(start, min(start + batch * k, len(data)), batch)]
            for idx in micro:
                with torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False):
                    loss = loss_fn(model, collate([data[i] for i in idx]))
                loss = loss / len(micro)
                (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.unscale_(optimizer)
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            stepped = True
            if scaler:
                scale = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                stepped = scaler.get_scale() >= scale
                replay.skipped += not stepped
            else:
                optimizer.step()
            if scheduler and stepped:
                scheduler.step()
            optimizer.zero_grad()
            steps += 1
    return steps


# ---- gradient accumulation: one process ------------------------------------------------------------

@pytest.mark.parametrize("k,batch", [(2, 3), (3, 2)])
def test_accumulation_equals_transformers_loop_written_out(k, batch):
    """22 samples: steps of 6, the epoch's last holding 4 (k=2, batch 3: micro-batches of 3 and 1;
    k=3, batch 2: two micro-batches, so their losses are divided by 2, not 3)."""
    data = Points(22)
    model, ref = mlp(), mlp()
    t = fit(model, data, batch_size=batch, gradient_accumulation_steps=k, epochs=2, scheduler=warmup,
            grad_clip=1.0, seed=5)
    steps = replay(ref, data, batch=batch, k=k, epochs=2, seed=5)
    assert t.steps_per_epoch == 4 and t.step == steps == 8
    assert torch.equal(flat(model), flat(ref))


def test_accumulating_b_twice_is_close_to_one_batch_of_2b():
    """A mean loss without dropout: k=2 batches of 4 give the gradient of one batch of 8, up to the
    order of the sums."""
    data = Points(40)
    a, b = mlp(), mlp()
    fit(a, data, batch_size=4, gradient_accumulation_steps=2, epochs=2, opt=sgd)
    fit(b, data, batch_size=8, epochs=2, opt=sgd)
    assert not torch.equal(flat(a), flat(mlp()))
    torch.testing.assert_close(flat(a), flat(b), rtol=0, atol=1e-6)


def test_steps_scheduler_and_records_count_optimizer_steps():
    data = Points(50)  # steps of 4 x 3 = 12 samples: 5 a epoch, the last with 2 samples (one micro-batch)
    calls: list[int] = []
    seen: list[tuple[float, int]] = []

    def counted(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: calls.append(s) or 1.0)

    def step(model, batch):
        loss = mse_step(model, batch)
        seen.append((loss.item(), len(batch[0])))
        return loss

    t = fit(mlp(), data, step=step, batch_size=4, gradient_accumulation_steps=3, epochs=2, scheduler=counted,
            log_every=100)
    assert (t.steps_per_epoch, t.total_steps, t.step) == (5, 10, 10)
    assert calls == list(range(11))  # built at step 0, then stepped once per optimizer step
    assert len(seen) == 2 * (4 * 3 + 1)  # the closure runs once per micro-batch
    train = [r for r in t.history if r.get("event") == "train"]
    assert len(train) == 1 and train[0]["samples"] == 100 and train[0]["batches"] == [26]
    # The logged loss is the closure's (undivided) losses, weighted by their samples.
    expected = sum(loss * n for loss, n in seen) / sum(n for _, n in seen)
    assert train[0]["loss"] == pytest.approx(expected, rel=1e-6)

    calls.clear()
    t = fit(mlp(), data, batch_size=4, gradient_accumulation_steps=3, max_steps=7, scheduler=counted)
    assert (t.total_steps, t.step, t.samples) == (7, 7, 50 + 2 * 12)
    assert calls == list(range(8))


def test_resume_with_accumulation_is_bit_exact_and_another_k_is_refused(tmp_path):
    class Dropped(nn.Module):  # dropout: the restored RNG matters
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))

        def forward(self, x):
            return self.net(x)

    data = Points(30)  # steps of 8: 4 a epoch, the last holding 6 (micro-batches of 4 and 2)
    kw = dict(batch_size=4, gradient_accumulation_steps=2, scheduler=warmup, grad_clip=1.0, seed=1)
    straight = Dropped()
    fit(straight, data, max_steps=7, checkpoint_dir=tmp_path / "a", **kw)
    fit(Dropped(), data, max_steps=3, checkpoint_dir=tmp_path / "b", **kw)
    assert load_checkpoint(tmp_path / "b")["gradient_accumulation_steps"] == 2
    assert load_checkpoint(tmp_path / "b")["position"] == 24  # three steps of 8 samples
    resumed = Dropped()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # the checkpoint must overwrite all of it
    t = fit(resumed, data, max_steps=7, checkpoint_dir=tmp_path / "b", **kw)
    assert t.resumed_from == tmp_path / "b" / "step-00000003.pt" and t.step == 7
    assert torch.equal(flat(resumed), flat(straight))
    with pytest.raises(TrainerError, match="gradient_accumulation_steps=2 but this Trainer has "
                                           "gradient_accumulation_steps=4"):
        fit(Dropped(), data, max_steps=9, checkpoint_dir=tmp_path / "b", **{**kw, "gradient_accumulation_steps": 4})


@pytest.mark.parametrize("value", [0, -1, True, 2.5, "2", None])
def test_bad_accumulation_values_are_refused(value):
    with pytest.raises(TrainerConfigError, match="gradient_accumulation_steps"):
        Trainer(mlp(), mse_step, sgd, Points(8), batch_size=2, epochs=1, gradient_accumulation_steps=value)


def test_accumulation_with_el_che_and_fp16_with_el_che_are_refused():
    for sync in ("el-che", ElChe(anchor=2)):
        with pytest.raises(TrainerConfigError, match="gradient_accumulation_steps=2 does not go with sync='el-che'"):
            Trainer(mlp(), mse_step, sgd, Points(8), batch_size=2, epochs=1, sync=sync, gradient_accumulation_steps=2)
        with pytest.raises(TrainerConfigError, match="precision='fp16' does not go with sync='el-che'"):
            Trainer(mlp(), mse_step, sgd, Points(8), batch_size=2, epochs=1, sync=sync, precision="fp16")
    with pytest.raises(TrainerConfigError, match="precision"):
        Trainer(mlp(), mse_step, sgd, Points(8), batch_size=2, epochs=1, precision="float16")


def test_length_batches_accumulate_k_consecutive_batches():
    """batching='length': a step is k consecutive length batches of the epoch's shuffled order."""
    lengths = [1 + (i * 7) % 9 for i in range(30)]
    data = [(i, torch.randn(8, generator=torch.Generator().manual_seed(i)), torch.ones(1)) for i in range(30)]
    seen: list[list[int]] = []

    def step(model, batch):
        seen.append(batch[0].tolist())
        return mse_step(model, batch)

    t = fit(mlp(), data, step=step, batching="length", max_tokens=24, lengths=lengths,
            gradient_accumulation_steps=2, epochs=1, seed=2, opt=sgd)
    from flodl_hf.training.trainer import length_batches
    batches = length_batches(lengths, 24, 2)
    order = perm(len(batches), 2, 0)
    assert seen == [batches[b].tolist() for b in order]
    assert t.steps_per_epoch == -(-len(batches) // 2) and t.step == t.steps_per_epoch


# ---- gradient accumulation: DDP over two workers ---------------------------------------------------

def _ddp(rank: int, out: str) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    synced = {"backwards": 0, "closures": 0}

    def counting(state, bucket):
        if bucket.is_last():
            synced["backwards"] += 1
        return allreduce_hook(state, bucket)

    def step(model, batch):
        if synced["closures"] == 0:  # the DDP wrapper, before its first backward
            model.register_comm_hook(None, counting)
        synced["closures"] += 1
        return mse_step(model, batch)

    model = mlp()
    t = Trainer(model, step, sgd, Points(96), batch_size=4, gradient_accumulation_steps=2, max_steps=6,
                sync="ddp", progress=False, report=False, timeout=30)
    t.fit()
    balanced = mlp()
    Trainer(balanced, mse_step, sgd, Points(96), batch_size=4, gradient_accumulation_steps=2, max_steps=6,
            sync="ddp", balance=True, progress=False, report=False, timeout=30).fit()
    try:  # each worker given its own k: refused on both, before any sample is dealt
        Trainer(mlp(), mse_step, sgd, Points(96), batch_size=4, gradient_accumulation_steps=1 + rank, max_steps=2,
                sync="ddp", progress=False, report=False, timeout=30).fit()
        mismatch = None
    except TrainerConfigError as exc:
        mismatch = str(exc)
    return {"params": flat(model), "balanced": flat(balanced), "steps": t.step, "mismatch": mismatch, **synced}


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
def test_ddp_accumulation_all_reduces_once_a_step_and_keeps_the_global_mean(tmp_path):
    res = spawn(_ddp, tmp_path, deadline=120.0)
    for key in ("params", "balanced"):
        assert torch.equal(res[0][key], res[1][key]), f"{key}: workers differ"
    for r in (0, 1):  # two micro-batches a step, one all-reduce: the first ran in no_sync()
        assert (res[r]["steps"], res[r]["closures"], res[r]["backwards"]) == (6, 12, 6)
        assert "gradient_accumulation_steps differs between the workers" in (res[r]["mismatch"] or ""), res[r]
    # One process on the same global batches of 2 workers x 2 micro-batches x 4 samples: equal micro-batches
    # make DDP's mean of the workers' means of micro-batch means the mean over the step's 16 samples.
    data, ref = Points(96), mlp()  # one epoch of 6 steps
    opt = sgd(ref.parameters())
    order = perm(96, 0, 0)
    for s in range(6):
        opt.zero_grad()
        mse_step(ref, collate([data[i] for i in order[s * 16:(s + 1) * 16]])).backward()
        opt.step()
    for key in ("params", "balanced"):
        torch.testing.assert_close(res[0][key], flat(ref), rtol=0, atol=1e-6, msg=key)


# ---- mixed precision -------------------------------------------------------------------------------

def test_bf16_steps_equal_an_autocast_loop_written_out():
    data = Points(24)
    losses: list[torch.Tensor] = []

    def step(model, batch):
        loss = mse_step(model, batch)
        losses.append(loss.detach())
        return loss

    model, ref = mlp(), mlp()
    fit(model, data, step=step, batch_size=4, gradient_accumulation_steps=2, epochs=1, precision="bf16",
        scheduler=warmup, grad_clip=1.0)
    first = perm(24, 0, 0)[:4]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = mse_step(mlp(), collate([data[i] for i in first]))
    assert torch.equal(losses[0], expected.detach())
    replay(ref, data, batch=4, k=2, epochs=1, autocast=torch.bfloat16)
    assert torch.equal(flat(model), flat(ref))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not torch.equal(flat(model), flat(fit(mlp(), data, batch_size=4, gradient_accumulation_steps=2,
                                                 epochs=1, scheduler=warmup, grad_clip=1.0).model))


def _overflowing(model, batch):
    """mse, with a loss so large on the samples 0..3 that its fp16 backward overflows."""
    loss = mse_step(model, batch)
    return loss * 1e30 if int(batch[0].min()) < 4 else loss


def test_fp16_grad_scaler_equals_a_scaler_loop_written_out():
    # 8 steps of 8. The first steps overflow at the initial scale of 2^16 (the scale halves until the
    # gradients fit), and the step holding samples 0..3 overflows whatever the scale: each is skipped.
    data = Points(64)
    calls: list[int] = []

    def counted(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: calls.append(s) or 1.0 / (s + 1))

    model, ref = mlp(), mlp()
    t = fit(model, data, step=_overflowing, batch_size=4, gradient_accumulation_steps=2, epochs=1,
            precision="fp16", scheduler=counted, grad_clip=1.0)
    scaler = torch.amp.GradScaler("cpu")
    ref_calls = len(calls)
    replay(ref, data, batch=4, k=2, epochs=1, autocast=torch.float16, scaler=scaler, loss_fn=_overflowing,
           sched=counted)
    assert t.step == 8 and torch.equal(flat(model), flat(ref))
    assert t._scaler.get_scale() == scaler.get_scale() == 2.0 ** (16 - replay.skipped)
    assert 2 <= replay.skipped < 8
    assert ref_calls == len(calls) - ref_calls == 1 + 8 - replay.skipped  # the scheduler skips with the optimizer
    assert not torch.equal(flat(model), flat(mlp()))


def test_fp16_resume_is_bit_exact_and_restores_the_scaler(tmp_path):
    data = Points(40)  # 5 steps of 8 per epoch; samples 0..3 overflow once an epoch
    kw = dict(step=_overflowing, batch_size=4, gradient_accumulation_steps=2, precision="fp16",
              scheduler=warmup, grad_clip=1.0, seed=4)
    straight = mlp()
    a = fit(straight, data, max_steps=8, checkpoint_dir=tmp_path / "a", **kw)
    fit(mlp(), data, max_steps=4, checkpoint_dir=tmp_path / "b", **kw)
    saved = load_checkpoint(tmp_path / "b")
    assert saved["precision"] == "fp16" and saved["worker"]["scaler"]["scale"] < 2.0 ** 16
    resumed = mlp()
    b = fit(resumed, data, max_steps=8, checkpoint_dir=tmp_path / "b", **kw)
    assert b.resumed_from is not None and b.step == 8
    assert torch.equal(flat(resumed), flat(straight))
    assert b._scaler.state_dict() == a._scaler.state_dict()
    assert a._scaler.get_scale() < saved["worker"]["scaler"]["scale"]  # steps skipped after the checkpoint too
    with pytest.raises(TrainerError, match="precision='fp16' but this Trainer has precision='bf16'"):
        fit(mlp(), data, max_steps=9, checkpoint_dir=tmp_path / "b", **{**kw, "precision": "bf16"})


def test_bf16_under_el_che_autocasts_each_local_step():
    """El Che keeps a batch as a step; bf16 only wraps the closure. One process: the same steps as sync='none'."""
    data = Points(24)
    a, b = mlp(), mlp()
    fit(a, data, batch_size=4, epochs=1, precision="bf16", sync=ElChe(anchor=2), opt=sgd)
    fit(b, data, batch_size=4, epochs=1, precision="bf16", opt=sgd)
    ref = mlp()
    replay(ref, data, batch=4, k=1, epochs=1, autocast=torch.bfloat16, opt=sgd, sched=None, clip=None)
    assert torch.equal(flat(a), flat(ref)) and torch.equal(flat(b), flat(ref))


# ---- num_items_in_batch: token-weighted losses, as transformers' Trainer ---------------------------
#
# A step(model, batch, num_items_in_batch) gets the optimizer step's count of label items (transformers'
# _get_num_items_in_batch: shift_labels, else labels[..., 1:] for a causal LM, else labels; != -100),
# summed over the step's micro-batches (and under DDP over the workers, each loss then times the world
# size), and its loss is not divided by k.

TINY_LLAMA = dict(model_type="llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                  num_hidden_layers=1, intermediate_size=48, vocab_size=64, max_position_embeddings=32,
                  pad_token_id=0, num_labels=3)
# Right-padded rows of 8 tokens whose lengths differ, so micro-batches of 2 hold unequal token counts.
LENGTHS = [8, 2, 3, 7, 5, 8, 2, 6, 4, 8, 3, 5, 7, 2, 6, 8]


def lm_data(n: int = 12, seqcls: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    rows = []
    for i in range(n):
        length = LENGTHS[i % len(LENGTHS)]
        ids = torch.zeros(8, dtype=torch.long)
        ids[:length] = torch.randint(1, TINY_LLAMA["vocab_size"], (length,), generator=gen)
        mask = (ids != 0).long()
        labels = torch.tensor(-100 if i % 5 == 4 else i % 3) if seqcls else ids.masked_fill(mask == 0, -100)
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def tiny(task: str, transformers_model: bool = False):
    from flodl_hf.auto import load_model
    from helpers import make_checkpoint
    source = make_checkpoint(TINY_LLAMA, task)
    if transformers_model:
        from flodl_hf.roundtrip.parity import reference_model
        return reference_model(source, task, "sdpa").train()
    return load_model(source, task, dtype=torch.float32)


def counted_step(model, batch, num_items_in_batch):
    return model(**batch, num_items_in_batch=num_items_in_batch)


def mean_step(model, batch):
    return model(**batch)


def lm_replay(model, data, *, batch: int, k: int, epochs: int = 1, seed: int = 0, count=None, opt=adamw,
              steps: int | None = None) -> list[int]:
    """transformers' loop with num_items_in_batch, written out: per optimizer step the micro-batches
    collated, ``count(micro-batch)`` summed over them and passed to the model, each loss backward
    undivided; then clip, step, scheduler, zero_grad. Returns the counts."""
    optimizer = opt(model.parameters())
    scheduler = warmup(optimizer)
    counts, done = [], 0
    for epoch in range(epochs):
        order = perm(len(data), seed, epoch)
        for start in range(0, len(data), batch * k):
            micro = [collate([data[i] for i in order[j:j + batch]])
                     for j in range(start, min(start + batch * k, len(data)), batch)]
            n = sum(count(mb) for mb in micro)
            counts.append(int(n))
            for mb in micro:
                model(**mb, num_items_in_batch=n).loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            done += 1
            if done == steps:
                return counts
    return counts


def shifted(mb):
    return mb["labels"][..., 1:].ne(-100).sum()


def test_causal_lm_counts_the_steps_tokens_as_transformers_and_it_matters():
    """k=2 micro-batches of unequal token counts: the trainer's step is the hand loop's (the exact token
    mean of the step), and differs from dividing each micro-batch's mean by k."""
    data = lm_data(12)  # 3 steps of 2 x 2 rows
    seen: list[int] = []
    means: list[float] = []  # each micro-batch's mean over its own tokens

    def step(model, batch, num_items_in_batch):
        seen.append(int(num_items_in_batch))
        out = counted_step(model, batch, num_items_in_batch)
        means.append(out.loss.item() * int(num_items_in_batch) / int(shifted(batch)))
        return out

    model = tiny("causal_lm")
    kw = dict(batch_size=2, gradient_accumulation_steps=2, epochs=1, seed=3, scheduler=warmup, grad_clip=1.0)
    t = fit(model, data, step=step, **kw)
    ref = tiny("causal_lm")
    counts = lm_replay(ref, data, batch=2, k=2, seed=3, count=shifted)
    assert t.step == 3 and seen == [n for n in counts for _ in range(2)]  # the step's count, given to each
    micro = [shifted(collate([data[i] for i in perm(12, 3, 0)[j:j + 2]])) for j in range(0, 12, 2)]
    assert any(micro[2 * s] != micro[2 * s + 1] for s in range(3)), "the micro-batches must differ in tokens"
    assert counts == [int(micro[2 * s] + micro[2 * s + 1]) for s in range(3)]
    assert torch.equal(flat(model), flat(ref))
    mean = fit(tiny("causal_lm"), data, step=mean_step, **kw).model  # today's rule: each mean divided by k
    assert (flat(mean) - flat(model)).abs().max() > 1e-4
    # The logged loss is each micro-batch's mean over its own tokens, weighted by its samples, as without
    # the count (what a closure without num_items_in_batch returns).
    train = [r for r in t.history if r.get("event") == "train"]
    assert len(train) == 1 and train[0]["loss"] == pytest.approx(sum(means) / len(means), rel=1e-6)


def test_shift_labels_and_count_items_override_the_rule():
    """A batch's shift_labels are counted as they are; count_items= replaces the rule."""
    data = lm_data(8)
    for row in data:
        row["shift_labels"] = torch.cat([row["labels"][1:], torch.tensor([-100])])
        row["shift_labels"][0] = -100  # one fewer item than labels[..., 1:] holds
    seen: list[int] = []

    def step(model, batch, num_items_in_batch):
        seen.append(int(num_items_in_batch))
        return counted_step(model, batch, num_items_in_batch)

    fit(tiny("causal_lm"), data, step=step, batch_size=2, gradient_accumulation_steps=2, max_steps=1,
        shuffle=False)
    assert seen == [int(sum(r["shift_labels"].ne(-100).sum() for r in data[:4]))] * 2
    seen.clear()
    fit(tiny("causal_lm"), data, step=step, batch_size=2, gradient_accumulation_steps=2, max_steps=1,
        shuffle=False, count_items=lambda b: b["attention_mask"].sum())
    assert seen == [int(sum(r["attention_mask"].sum() for r in data[:4]))] * 2


def test_seqcls_counts_labels_unshifted_as_transformers():
    """Labels of shape [B]: the count is the labels that are not -100 (no shift). The LLaMA sequence head
    ignores the count, as transformers' does, so its mean losses are added undivided (transformers' Trainer
    does the same), and the trainer says so."""
    data = lm_data(12, seqcls=True)
    seen: list[int] = []

    def step(model, batch, num_items_in_batch):
        seen.append(int(num_items_in_batch))
        return counted_step(model, batch, num_items_in_batch)

    model = tiny("seqcls")
    with pytest.warns(UserWarning, match="ignores num_items_in_batch"):
        fit(model, data, step=step, batch_size=2, gradient_accumulation_steps=2, epochs=1, seed=3,
            scheduler=warmup, grad_clip=1.0)
    ref = tiny("seqcls")
    counts = lm_replay(ref, data, batch=2, k=2, seed=3, count=lambda mb: mb["labels"].ne(-100).sum())
    assert seen == [n for n in counts for _ in range(2)] and counts != [4, 4, 4]  # two labels are -100
    assert torch.equal(flat(model), flat(ref))


def test_without_labels_the_count_is_none_and_the_loss_divided_by_k():
    """A batch transformers cannot count (a tuple, no labels): num_items_in_batch=None, each loss divided by
    the step's micro-batches, as without the parameter; count_items= counts it instead."""
    data = Points(22)
    given: list = []

    def step(model, batch, num_items_in_batch):
        given.append(num_items_in_batch)
        return mse_step(model, batch)

    model, ref = mlp(), mlp()
    fit(model, data, step=step, batch_size=3, gradient_accumulation_steps=2, epochs=2, scheduler=warmup,
        grad_clip=1.0, seed=5)
    replay(ref, data, batch=3, k=2, epochs=2, seed=5)
    assert set(given) == {None} and torch.equal(flat(model), flat(ref))

    def summed(model, batch, num_items_in_batch):  # a sum over samples divided by the step's count
        _, x, y = batch
        return ((model(x) - y) ** 2).sum() / num_items_in_batch

    a, b = mlp(), mlp()
    fit(a, Points(40), step=summed, batch_size=4, gradient_accumulation_steps=2, epochs=2, opt=sgd,
        count_items=lambda batch: len(batch[0]))
    fit(b, Points(40), batch_size=8, epochs=2, opt=sgd)
    torch.testing.assert_close(flat(a), flat(b), rtol=0, atol=1e-6)
    with pytest.raises(TrainerConfigError, match="count_items= counts num_items_in_batch for a step that takes it"):
        Trainer(mlp(), mse_step, sgd, Points(8), batch_size=2, epochs=1, count_items=len)
    with pytest.raises(TrainerConfigError, match="average_tokens_across_devices must be a bool"):
        Trainer(mlp(), step, sgd, Points(8), batch_size=2, epochs=1, average_tokens_across_devices=1)


def test_resume_with_counted_items_is_bit_exact(tmp_path):
    data = lm_data(12)  # 3 steps an epoch
    kw = dict(step=counted_step, batch_size=2, gradient_accumulation_steps=2, scheduler=warmup, grad_clip=1.0,
              seed=1)
    straight = tiny("causal_lm")
    fit(straight, data, max_steps=5, checkpoint_dir=tmp_path / "a", **kw)
    fit(tiny("causal_lm"), data, max_steps=2, checkpoint_dir=tmp_path / "b", **kw)
    resumed = tiny("causal_lm")
    t = fit(resumed, data, max_steps=5, checkpoint_dir=tmp_path / "b", **kw)
    assert t.resumed_from == tmp_path / "b" / "step-00000002.pt" and t.step == 5
    assert torch.equal(flat(resumed), flat(straight))
    # The checkpoint says the step counted: a resume whose step does not (its losses then divided by k) is refused
    assert load_checkpoint(tmp_path / "b")["num_items_in_batch"] is True
    with pytest.raises(TrainerError, match="written by a step that takes num_items_in_batch, and this Trainer's "
                                           "step does not"):
        fit(tiny("causal_lm"), data, max_steps=7, checkpoint_dir=tmp_path / "b", **{**kw, "step": mean_step})
    # A checkpoint from before the field was recorded resumes as before (nothing to compare)
    newest = tmp_path / "b" / "step-00000005.pt"
    state = torch.load(newest, weights_only=False)
    del state["num_items_in_batch"]
    torch.save(state, newest)
    t = fit(tiny("causal_lm"), data, max_steps=6, checkpoint_dir=tmp_path / "b", **{**kw, "step": mean_step})
    assert t.resumed_from == newest and t.step == 6


def test_length_batches_and_el_che_pass_the_count():
    """batching='length': a micro-batch is a length batch, counted alike. El Che (k=1): each batch's own
    count, so its loss is its mean: the same steps as sync='none' with k=1."""
    data = lm_data(12)
    seen: list[int] = []

    def step(model, batch, num_items_in_batch):
        seen.append(int(num_items_in_batch))
        return counted_step(model, batch, num_items_in_batch)

    t = fit(tiny("causal_lm"), data, step=step, batching="length", max_tokens=16, lengths=[8] * 12,
            gradient_accumulation_steps=2, epochs=1, seed=2)
    from flodl_hf.training.trainer import length_batches
    batches = length_batches([8] * 12, 16, 2)
    order = perm(len(batches), 2, 0)
    expected = [int(sum(shifted(collate([data[i] for i in batches[b].tolist()])) for b in order[s:s + 2]))
                for s in range(0, len(order), 2)]
    assert t.step == len(expected) and seen == [n for n in expected for _ in range(2)]
    a, b = tiny("causal_lm"), tiny("causal_lm")
    fit(a, data, step=counted_step, batch_size=2, epochs=1, sync=ElChe(anchor=2), opt=sgd)
    fit(b, data, step=mean_step, batch_size=2, epochs=1, opt=sgd)
    torch.testing.assert_close(flat(a), flat(b), rtol=0, atol=1e-6)


# ---- num_items_in_batch under DDP ------------------------------------------------------------------

def _ddp_counted(rank: int, out: str) -> dict:
    import warnings
    warnings.simplefilter("ignore")
    seen: list[int] = []

    def step(model, batch, num_items_in_batch):
        seen.append(int(num_items_in_batch))
        return counted_step(model, batch, num_items_in_batch)

    results = {}
    runs = (("params", {}), ("balanced", {"balance": True}), ("local", {"average_tokens_across_devices": False}))
    for key, kw in runs:
        model = tiny("causal_lm")
        Trainer(model, step, sgd, lm_data(16), batch_size=2, gradient_accumulation_steps=2, epochs=1,
                sync="ddp", progress=False, report=False, timeout=30, **kw).fit()
        results[key] = flat(model)
    return {**results, "seen": seen}


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
def test_ddp_sums_the_count_over_workers_and_multiplies_the_loss_by_the_world(tmp_path):
    tiny("causal_lm")  # the checkpoint cached before the workers read it
    res = spawn(_ddp_counted, tmp_path, deadline=180.0)
    for key in ("params", "balanced"):
        assert torch.equal(res[0][key], res[1][key]), f"{key}: workers differ"
    # One process: each step's 8 rows (2 workers x 2 micro-batches x 2), the count over all of them, each
    # micro-batch's sum / count added: the token mean of the global step, however the workers split it.
    data, ref = lm_data(16), tiny("causal_lm")
    opt = sgd(ref.parameters())
    order = perm(16, 0, 0)
    counts = []
    for s in range(2):
        micro = [collate([data[i] for i in order[s * 8 + j:s * 8 + j + 2]]) for j in range(0, 8, 2)]
        n = sum(shifted(mb) for mb in micro)
        counts.append(int(n))
        for mb in micro:
            ref(**mb, num_items_in_batch=n).loss.backward()
        opt.step()
        opt.zero_grad()
    assert res[0]["seen"][:4] == res[1]["seen"][:4] == [counts[0]] * 2 + [counts[1]] * 2
    for key in ("params", "balanced"):
        torch.testing.assert_close(res[0][key], flat(ref), rtol=0, atol=1e-6, msg=key)
    # average_tokens_across_devices=False: each worker divides by its own count, DDP averages the two.
    assert torch.equal(res[0]["local"], res[1]["local"])
    local = tiny("causal_lm")
    opt = sgd(local.parameters())
    for s in range(2):
        for r in range(2):
            micro = [collate([data[i] for i in order[s * 8 + r * 4 + j:s * 8 + r * 4 + j + 2]]) for j in (0, 2)]
            n = sum(shifted(mb) for mb in micro)
            assert res[r]["seen"][-4 + 2 * s:][:2] == [int(n)] * 2
            for mb in micro:
                (local(**mb, num_items_in_batch=n).loss / 2).backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(res[0]["local"], flat(local), rtol=0, atol=1e-6)
    assert not torch.allclose(res[0]["local"], res[0]["params"], rtol=0, atol=1e-6)


# ---- against transformers' Trainer -----------------------------------------------------------------

def test_two_steps_equal_transformers_trainer_with_gradient_accumulation(tmp_path):
    """transformers.Trainer (gradient_accumulation_steps=2, num_items_in_batch counted over the step) and
    ours on the same transformers LlamaForCausalLM, rows in order on both sides, the same AdamW and
    constant schedule, clipping at 1.0: the same parameters after 2 optimizer steps. Our own LLaMA, trained
    the same way, lands on the same bits (its gradients are transformers', tests/test_grad_parity.py); a
    tolerance here would hide a wrong item count, which clipping and Adam shrink to 4e-6."""
    pytest.importorskip("accelerate")
    import transformers
    from torch.utils.data import SequentialSampler
    data = lm_data(8)

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    def constant(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    theirs = tiny("causal_lm", transformers_model=True)
    opt = adamw(theirs.parameters())
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
        max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0, seed=0)
    trainer = InOrder(model=theirs, args=args, train_dataset=data, optimizers=(opt, constant(opt)))
    assert trainer.model_accepts_loss_kwargs and trainer._loss_shifts_labels
    trainer.train()

    hf_in_ours = tiny("causal_lm", transformers_model=True)
    t = fit(hf_in_ours, data, step=counted_step, batch_size=2, gradient_accumulation_steps=2, max_steps=2,
            shuffle=False, scheduler=constant, grad_clip=1.0)
    assert t.step == 2 and t._shifts  # transformers' model: its loss_type says it shifts
    assert torch.equal(flat(hf_in_ours), flat(theirs))
    ours = tiny("causal_lm")
    fit(ours, data, step=counted_step, batch_size=2, gradient_accumulation_steps=2, max_steps=2,
        shuffle=False, scheduler=constant, grad_clip=1.0)
    assert torch.equal(flat(ours), flat(theirs))  # a tolerance would hide a wrong count (unshifted: 3.9e-6)
