"""Trainer gradient accumulation and mixed precision, each against torch written out in the test.

``gradient_accumulation_steps=k`` follows transformers' Trainer: one optimizer step takes k
micro-batches per worker, each loss divided by the step's count of micro-batches before
backward. ``precision="bf16"|"fp16"`` runs the closure under ``torch.autocast``; fp16 scales the
loss with ``torch.amp.GradScaler``. Small MLPs on the CPU; the DDP case runs two gloo workers
through tests/test_trainer_dist.py's harness.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flodl_hf.distributed import ElChe
from flodl_hf.trainer import Trainer, TrainerConfigError, TrainerError, load_checkpoint

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
    from flodl_hf.trainer import length_batches
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
    fit(a, data, batch_size=4, epochs=1, precision="bf16", sync=ElChe(anchor=2, adaptive=False), opt=sgd)
    fit(b, data, batch_size=4, epochs=1, precision="bf16", opt=sgd)
    ref = mlp()
    replay(ref, data, batch=4, k=1, epochs=1, autocast=torch.bfloat16, opt=sgd, sched=None, clip=None)
    assert torch.equal(flat(a), flat(ref)) and torch.equal(flat(b), flat(ref))
