"""Trainer in one process: El Che's pure arithmetic, bit-exact resume, checkpoints, records, CLI."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from flodl_hf.training.sync import (Cadence, ElChe, Plan, deal, inner_candidates, nest_tiers, plan_window, probe_tiers,
                                    split_by_speed)
from flodl_hf.training.records import load_tree
from flodl_hf.training.report import write_report
from flodl_hf.core.errors import CheckpointFormatError, FlodlHFError, InputError
from flodl_hf.commands.train import register_cli
from flodl_hf.training.checkpoints import latest_checkpoint, load_checkpoint
from flodl_hf.training.launch import launch
from flodl_hf.training.trainer import DiLoCo, Trainer, TrainerConfigError, TrainerError


# ---- El Che plan (pure) --------------------------------------------------------------------------

# The cadence arithmetic runs on the Cadence a fit chose (ElChe's choices made); planned windows, from 4.
CFG = Cadence(anchor=4, windows="planned", min_anchor=1, max_anchor=16)


def test_plan_equal_speeds_gives_anchor_everywhere():
    plan = plan_window([10.0, 10.0, 10.0], 2.0, Plan(4, (4, 4, 4)), CFG)
    assert plan == Plan(4, (4, 4, 4))


def test_plan_counts_follow_speed_of_slowest():
    plan = plan_window([10.0, 30.0, 15.0], 4.0, Plan(4, (4, 4, 4)), CFG)
    assert plan.anchor == 4
    assert plan.counts == (12, 4, 8)


def test_plan_dead_zone_keeps_counts_within_ten_percent():
    prev = Plan(4, (12, 4))
    assert plan_window([10.5, 30.0], 4.0, prev, CFG).counts == (12, 4)  # ideal 11: within 10% of 12
    assert plan_window([12.0, 30.0], 4.0, prev, CFG).counts == (10, 4)  # ideal 10: moves


def test_plan_anchor_grows_when_sync_is_costly_and_shrinks_when_cheap():
    grown = plan_window([10.0, 10.0], 5.0, Plan(4, (4, 4)), CFG)  # share 5/45 > 10%
    assert grown.anchor > 4
    share = 5.0 / (grown.anchor * 10.0 + 5.0)
    assert CFG.sync_share * CFG.shrink_below <= share <= CFG.sync_share
    assert grown.counts == (grown.anchor, grown.anchor)
    shrunk = plan_window([10.0, 10.0], 0.1, Plan(8, (8, 8)), CFG)  # share 0.1% << 2.5%
    assert 1 <= shrunk.anchor < 8
    kept = plan_window([10.0, 10.0], 2.0, Plan(4, (4, 4)), CFG)  # 4.8%: inside the band
    assert kept.anchor == 4


def test_plan_does_not_shrink_into_windows_that_whole_batches_cannot_fill():
    # Measured on MiniLM: fast 801 ms, slow 2773 ms per batch, sync 139 ms. At anchor 2 the fast worker
    # runs 7 batches and the sync is 2.4% of the window (under 2.5%: a shrink). At anchor 1 it would run 3
    # (3.46 fit) and wait 370 ms: with the sync that is 17% of the window, over the 10% target.
    from flodl_hf.training.sync import rounding_wait
    assert rounding_wait(1, [801.0, 2773.0]) == pytest.approx(2773 - 3 * 801)
    assert rounding_wait(2, [801.0, 2773.0]) == pytest.approx(7 * 801 - 2 * 2773)
    kept = plan_window([801.0, 2773.0], 139.0, Plan(2, (7, 2)), Cadence(anchor=2, windows="planned"))
    assert kept == Plan(2, (7, 2))
    # Even speeds split any window evenly: the same cheap sync shrinks it as before.
    assert plan_window([2773.0, 2773.0], 139.0, Plan(2, (2, 2)), Cadence(anchor=2, windows="planned")).anchor == 1
    # Live windows have no planned counts to round: the cheap sync shrinks them.
    assert plan_window([801.0, 2773.0], 139.0, Plan(2, (7, 2)), Cadence(anchor=2, windows="live")).anchor == 1


def test_live_overrun_is_where_one_more_batch_stops_paying():
    # Measured on MiniLM at 3 : 1: fast 801 ms, slow 2773 ms per batch, sync 139 ms. A window of one slow
    # batch holds 2773/801 + 1 batches in 2773 + 139 ms; one more batch that overruns the slowest's end by
    # d raises batches per second exactly while d is under the window's time per batch.
    from flodl_hf.training.sync import live_overrun_ms
    ms, sync = [801.0, 2773.0], 139.0
    allowed = live_overrun_ms(ms, sync, 1)
    batches, length = 2773 / 801 + 1, 2773 + sync
    assert allowed == pytest.approx(length / batches)
    assert 0.5 * 801 < allowed < 801  # the old rule (half a batch) stopped short of it
    for d in (0.9 * allowed, 0.99 * allowed):
        assert (batches + 1) / (length + d) > batches / length
    for d in (1.01 * allowed, 1.1 * allowed):
        assert (batches + 1) / (length + d) < batches / length
    # Longer windows and more workers: the same rule, from the whole cohort's share of the window.
    three = [801.0, 2400.0, 9600.0]
    assert live_overrun_ms(three, None, 2) == pytest.approx(2 * 9600 / sum(2 * 9600 / m for m in three))
    assert live_overrun_ms(three, 500.0, 2) > live_overrun_ms(three, 0.0, 2)


def test_plan_anchor_moves_at_most_twofold_per_window():
    assert plan_window([10.0, 10.0], 500.0, Plan(4, (4, 4)), CFG).anchor == 8
    assert plan_window([10.0, 10.0], 0.0, Plan(12, (12, 12)), CFG).anchor == 6


def test_plan_anchor_stays_within_bounds():
    cfg = Cadence(anchor=4, min_anchor=2, max_anchor=6)
    assert plan_window([1.0, 1.0], 1000.0, Plan(4, (4, 4)), cfg).anchor == 6
    assert plan_window([1.0, 1.0], 0.0, Plan(4, (4, 4)), cfg).anchor == 2


def test_plan_without_measurements_or_adaptation_is_unchanged():
    prev = Plan(4, (4, 4))
    assert plan_window([None, 10.0], 1.0, prev, CFG) == prev
    assert plan_window([10.0, 30.0], 1.0, prev, Cadence(anchor=4, adaptive=False)) == prev
    assert plan_window([10.0, 10.0], None, Plan(4, (4, 4)), CFG).anchor == 4  # sync unknown: anchor kept


def test_plan_is_pure():
    ms, prev = [7.0, 21.0], Plan(3, (3, 3))
    assert plan_window(ms, 0.5, prev, CFG) == plan_window(list(ms), 0.5, prev, CFG)
    assert ms == [7.0, 21.0] and prev == Plan(3, (3, 3))


def _simulate_epoch(ms_per_batch: list[float], samples: int, batch_size: int, cfg: Cadence,
                    jitter: float = 0.0, seed: int = 0) -> list[tuple[int, ...]]:
    """The trainer's cadence loop with injected timings instead of a clock: deal a window, "measure" each
    worker's ms per batch (with multiplicative jitter), plan the next one. The first window is warm-up
    (not measured), as in ``Trainer._run_windows``. Returns each window's batch counts."""
    rng = random.Random(seed)
    plan, remaining, windows, first = Plan(cfg.anchor, (cfg.anchor,) * len(ms_per_batch)), samples, [], True
    while remaining > 0:
        sizes = deal(plan.counts, batch_size, remaining)
        remaining -= sum(sizes)
        batches = tuple(-(-s // batch_size) for s in sizes)
        windows.append(batches)
        measured = [ms * (1 + rng.uniform(-jitter, jitter)) for ms in ms_per_batch]
        sync_ms = 0.05 * max(measured) * plan.anchor
        if not first:
            plan = plan_window(measured, sync_ms, plan, cfg)
        first = False
    return windows


@pytest.mark.parametrize("jitter", [0.0, 0.3])
def test_cadence_follows_the_speed_ratio_with_injected_timings(jitter):
    """What test_trainer_dist's uneven run shows with real sleeps, without the machine's clock: a worker
    three times slower runs a third of the batches, the epoch's 250 samples are all dealt, and noise of
    +-30% per measurement (a loaded machine) moves the split by little."""
    planned = Cadence(anchor=2, windows="planned")
    windows = _simulate_epoch([4.0, 12.0], samples=250, batch_size=4, cfg=planned, jitter=jitter)
    assert windows[0] == windows[1] == (2, 2)  # warm-up, then the first timed window at the start plan
    fast, slow = sum(w[0] for w in windows[2:]), sum(w[1] for w in windows[2:])
    ratio = fast / slow
    assert (2.7 <= ratio <= 3.3) if jitter == 0 else (2.3 <= ratio <= 3.7), (fast, slow)
    three = _simulate_epoch([4.0, 12.0, 48.0], samples=2000, batch_size=4, cfg=planned, jitter=jitter)
    late = three[len(three) // 2:]
    shares = [sum(w[r] for w in late) for r in range(3)]
    assert shares[0] / shares[2] >= 8 and shares[1] / shares[2] >= 2.5, shares


def test_elche_rejects_inconsistent_bounds():
    for bad in (0, -1, 65, 2.0, True):
        with pytest.raises(TrainerConfigError, match="anchor"):
            ElChe(anchor=bad)
    with pytest.raises(TrainerConfigError):
        Cadence(anchor=8, max_anchor=4)
    for bad in (0, 1, 1.5, True, "0.1"):
        with pytest.raises(TrainerConfigError, match="sync_share"):
            ElChe(sync_share=bad)


def test_window_timing_splits_collective_into_sync_and_idle():
    from flodl_hf.training.windows import _window_timing
    # (collective, window, pause) ms: worker 1 arrived last (its collective is the averaging itself);
    # worker 0 also paused 10 ms to evaluate, which worker 1 waited out inside its collective.
    timing = _window_timing(torch.tensor([[30.0, 100.0, 10.0], [15.0, 110.0, 0.0]], dtype=torch.float64))
    assert timing["sync_ms"] == 15.0
    assert timing["idle_ms"] == [15.0, 0.0]
    assert timing["window_ms"] == [100.0, 100.0]
    # (collective, window, pause, waited): the lead waited 300 ms for the gradients, then ran one more
    # batch, which the slow worker waited out (900 ms) before the 80 ms sync. Its shorter collective
    # (380) is not the sync: both waits are idle.
    timing = _window_timing(torch.tensor([[380.0, 5000.0, 0.0, 300.0], [980.0, 5000.0, 0.0, 0.0]], dtype=torch.float64))
    assert timing["sync_ms"] == 80.0
    assert timing["idle_ms"] == [300.0, 900.0]


# ---- dealing samples ---------------------------------------------------------------------------

def test_deal_full_window():
    assert deal([3, 1], 4, 100) == (12, 4)


def test_deal_epoch_tail_is_proportional_and_complete():
    assert deal([3, 1], 4, 10) == (8, 2)
    assert deal([1, 1], 4, 5) == (3, 2)
    assert deal([3, 1], 4, 1) == (1, 0)  # a worker may get nothing; it still joins the average


def test_deal_never_skips_or_overshoots():
    rng = random.Random(0)
    for _ in range(500):
        counts = [rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
        bs, remaining = rng.randint(1, 8), rng.randint(1, 200)
        sizes = deal(counts, bs, remaining)
        assert sum(sizes) == min(remaining, bs * sum(counts))
        assert all(0 <= s <= c * bs for s, c in zip(sizes, counts))


def test_split_by_speed_follows_the_rates():
    assert split_by_speed([30.0, 10.0], 16) == (12, 4)
    assert split_by_speed([1.0, 1.0], 16) == (8, 8)
    assert split_by_speed([0.0, 0.0], 5) == (3, 2)  # no rates yet: even, ties to the lower rank
    assert split_by_speed([12.0, 4.0, 1.0], 17) == (12, 4, 1)
    # Every worker keeps a sample (it joins the step's all-reduce), taken from the one most over its share.
    assert split_by_speed([1000.0, 1.0], 16) == (15, 1)
    assert split_by_speed([1000.0, 1.0, 1.0], 4) == (2, 1, 1)
    # An epoch's tail with fewer samples than workers: one each while they last.
    assert split_by_speed([5.0, 1.0, 1.0], 2) == (1, 1, 0)


def test_split_by_speed_is_complete_and_close_to_the_rates():
    rng = random.Random(0)
    for _ in range(500):
        rates = [rng.uniform(0.1, 50.0) for _ in range(rng.randint(1, 6))]
        total = rng.randint(1, 300)
        sizes = split_by_speed(rates, total)
        assert sum(sizes) == total and len(sizes) == len(rates)
        if total >= len(rates):
            assert min(sizes) >= 1
            for n, r in zip(sizes, rates):  # within one sample of the share, or at the floor of one
                assert n == 1 or abs(n - total * r / sum(rates)) < 1 + len(rates), (rates, total, sizes)


def test_balance_needs_ddp_and_fixed_batches():
    data = [torch.zeros(2)] * 8
    for kw in ({"sync": "el-che"}, {"sync": "none"}, {"batching": "length", "max_tokens": 8, "lengths": [1] * 8}):
        with pytest.raises(TrainerConfigError, match="balance"):
            Trainer(nn.Linear(2, 1), lambda m, b: m(b).sum(), lambda p: torch.optim.SGD(p, lr=0.1), data,
                    batch_size=2, epochs=1, balance=True, **kw)


# ---- a tiny task ---------------------------------------------------------------------------------

class Indexed(torch.utils.data.Dataset):
    """Regression data whose items carry their index, so tests can see who trained on what."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = self.x @ torch.randn(6, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"index": i, "x": self.x[i], "y": self.y[i]}


class Config:
    def to_dict(self) -> dict:
        return {"model_type": "toy", "hidden_size": 16}


class Net(nn.Module):
    def __init__(self, init_seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(init_seed)
        self.config = Config()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))
        self.norm = nn.BatchNorm1d(6)  # a float buffer and an int buffer

    def forward(self, x, y=None):
        pred = self.body(self.norm(x))
        return SimpleNamespace(loss=nn.functional.mse_loss(pred, y) if y is not None else None, logits=pred)


def net_step(model, batch):
    return model(batch["x"], batch["y"])  # an output with .loss


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))


def noisy_eval(model):
    torch.rand(3)  # evaluation that draws random numbers must not shift training's RNG
    data = Indexed(32, seed=1)
    return {"eval_loss": nn.functional.mse_loss(model.body(model.norm(data.x)), data.y).item()}


def trainer(model, data, tmp, **kw) -> Trainer:
    base = dict(batch_size=8, scheduler=warmup, grad_clip=1.0, progress=False, report=False, seed=3)
    return Trainer(model, net_step, adamw, data, checkpoint_dir=tmp, **{**base, **kw})


def same_state(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_evaluation_once_per_point_of_training_not_per_step_number(tmp_path):
    """Live El Che windows end anywhere inside a step of ``global_batch`` samples, so two points of
    training can share a step number (positions 5 and 8 of 8-sample steps are both step 1). The
    final window's evaluation must not be skipped as if it were the one before; the same point is
    still evaluated once."""
    t = trainer(Net(0), Indexed(16), tmp_path, max_steps=1, sync="none", eval_fn=noisy_eval, eval_every=1)
    t.fit()
    evals = lambda: [r for r in t.history if r.get("event") == "eval"]  # noqa: E731
    done = len(evals())
    t.epoch, t.position, t.samples = 0, 5, 5
    step = t.step
    t._evaluate()
    t.position, t.samples = 8, 8
    assert t.step == step  # the same step number, a later point
    t._evaluate()
    t._evaluate()  # the same point again: not evaluated twice
    assert [r["samples"] for r in evals()[done:]] == [5, 8]


# ---- resume --------------------------------------------------------------------------------------

def test_resume_is_bit_exact(tmp_path):
    data = Indexed(60)  # 8 steps per epoch: the run crosses an epoch boundary and its tail
    straight = Net(0)
    trainer(straight, data, tmp_path / "a", max_steps=10, sync="none", eval_fn=noisy_eval, eval_every=3).fit()

    first = Net(0)
    trainer(first, data, tmp_path / "b", max_steps=5, sync="none", eval_fn=noisy_eval, eval_every=3).fit()
    second = Net(1)  # initialised differently: the checkpoint must overwrite all of it
    assert not same_state(second, straight)
    t = trainer(second, data, tmp_path / "b", max_steps=10, sync="none", eval_fn=noisy_eval, eval_every=3)
    summary = t.fit()
    assert t.resumed_from == tmp_path / "b" / "step-00000005.pt"
    assert summary["step"] == 10
    assert same_state(second, straight)


def test_resume_el_che_with_diloco_is_bit_exact(tmp_path):
    data = Indexed(48)
    sync = ElChe(anchor=2)
    outer = DiLoCo(lr=0.7, momentum=0.9, nesterov=True)
    straight = Net(0)
    trainer(straight, data, tmp_path / "a", max_steps=10, sync=sync, outer=outer).fit()
    trainer(Net(0), data, tmp_path / "b", max_steps=4, sync=sync, outer=outer).fit()
    resumed = Net(2)
    trainer(resumed, data, tmp_path / "b", max_steps=10, sync=sync, outer=outer).fit()
    assert same_state(resumed, straight)
    assert load_checkpoint(tmp_path / "b")["outer"]["state"]  # the outer momentum travels


def test_resume_false_starts_fresh_and_mismatch_is_refused(tmp_path):
    data = Indexed(40)
    trainer(Net(0), data, tmp_path, max_steps=3, sync="none").fit()
    t = trainer(Net(0), data, tmp_path, max_steps=3, sync="none", resume=False)
    t.fit()
    assert t.resumed_from is None
    with pytest.raises(TrainerError, match="batch_size"):
        trainer(Net(0), data, tmp_path, max_steps=6, sync="none", batch_size=4).fit()


# ---- checkpoints ---------------------------------------------------------------------------------

def test_checkpoint_at_a_later_point_of_the_same_step_number_gets_its_own_name(tmp_path):
    """Positions 12 and 16 of 8-sample steps are both step 2 (a live El Che window can end inside a
    step). The later point is checkpointed too, under a name that sorts after the first and never
    overwrites it; the same point is written once; pruning and resume see the order."""
    t = trainer(Net(0), Indexed(24), tmp_path, max_steps=1, sync="none", keep_checkpoints=2)
    t.fit()
    assert latest_checkpoint(tmp_path).name == "step-00000001.pt"
    t.epoch, t.position, t.samples = 0, 12, 12
    first = t.save_checkpoint()
    with torch.no_grad():
        t.model.body[0].weight.add_(1.0)  # the later point's parameters differ
    t.position, t.samples = 16, 16
    assert t.step == 2
    later = t.save_checkpoint()
    assert t.save_checkpoint() is None  # the same point again
    assert (first.name, later.name) == ("step-00000002.pt", "step-00000002-16.pt")
    assert {p.name for p in tmp_path.glob("*.pt")} == {first.name, later.name}  # step 1 pruned
    assert latest_checkpoint(tmp_path) == later
    saved = load_checkpoint(tmp_path)
    assert (saved["step"], saved["position"], saved["samples"]) == (2, 16, 16)
    assert torch.equal(saved["model"]["body.0.weight"], t.model.body[0].weight)
    assert not torch.equal(load_checkpoint(first)["model"]["body.0.weight"], t.model.body[0].weight)
    again = trainer(Net(1), Indexed(24), tmp_path, max_steps=2, sync="none", keep_checkpoints=2)
    again.fit()  # resumes at the later point, already at max_steps: nothing to train, nothing written
    assert again.resumed_from == later and (again.position, again.samples) == (16, 16)
    assert latest_checkpoint(tmp_path) == later


def test_checkpoint_format_and_pruning(tmp_path):
    model = Net(0)
    trainer(model, Indexed(40), tmp_path, max_steps=9, checkpoint_every=2, keep_checkpoints=2, sync="none").fit()
    names = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".pt")
    assert names == ["step-00000008.pt", "step-00000009.pt"]
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically: no temporary files left
    state = torch.load(latest_checkpoint(tmp_path), weights_only=True)
    assert state["format"] == "flodl-hf/trainer-checkpoint" and state["version"] == 1
    assert state["config"] == Config().to_dict()
    assert state["model"].keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state["model"].items())
    assert state["step"] == 9 and state["samples"] == 72 and state["epoch"] == 1 and state["position"] == 32
    assert {"optimizer", "scheduler", "rng"} <= state["worker"].keys()


def test_checkpoint_config_is_none_without_model_config(tmp_path):
    model = nn.Linear(6, 1)
    data = [(torch.randn(6), torch.randn(1)) for _ in range(16)]
    Trainer(model, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), lambda p: torch.optim.SGD(p, lr=0.1),
            data, batch_size=4, epochs=1, checkpoint_dir=tmp_path, progress=False, report=False).fit()
    assert load_checkpoint(tmp_path)["config"] is None


def test_load_checkpoint_refuses_foreign_files(tmp_path):
    torch.save({"weights": torch.ones(1)}, tmp_path / "step-00000001.pt")
    with pytest.raises(CheckpointFormatError, match="not a flodl-hf trainer checkpoint"):
        load_checkpoint(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointFormatError, match="no trainer checkpoint"):
        load_checkpoint(tmp_path / "empty")


# ---- data and steps ------------------------------------------------------------------------------

@pytest.mark.parametrize("sync", ["none", "ddp", ElChe(anchor=3)])
def test_every_sample_once_per_epoch(sync):
    seen: list[int] = []

    def step(model, batch):
        seen.extend(batch["index"].tolist())
        return net_step(model, batch)

    t = Trainer(Net(0), step, adamw, Indexed(37), batch_size=5, epochs=2, sync=sync, progress=False)
    summary = t.fit()
    assert sorted(seen[:37]) == list(range(37)) and sorted(seen[37:]) == list(range(37))
    assert seen[:37] != seen[37:]  # reshuffled each epoch
    assert summary["step"] == 2 * 8 and summary["samples"] == 74


def test_step_may_return_a_tensor_or_dict_but_not_garbage():
    data = [(torch.randn(6), torch.randn(1)) for _ in range(8)]
    model = nn.Linear(6, 1)
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    Trainer(model, lambda m, b: {"loss": nn.functional.mse_loss(m(b[0]), b[1])}, sgd, data, batch_size=4,
            max_steps=1, progress=False).fit()
    with pytest.raises(TrainerConfigError, match="scalar loss"):
        Trainer(model, lambda m, b: m(b[0]), sgd, data, batch_size=4, max_steps=1, progress=False).fit()


def test_configuration_errors_are_typed():
    data = Indexed(8)
    with pytest.raises(TrainerConfigError, match="epochs"):
        Trainer(Net(), net_step, adamw, data, batch_size=2)
    with pytest.raises(TrainerConfigError, match="el-che"):
        Trainer(Net(), net_step, adamw, data, batch_size=2, epochs=1, outer=DiLoCo())
    with pytest.raises(TrainerConfigError, match="sync"):
        Trainer(Net(), net_step, adamw, data, batch_size=2, epochs=1, sync="allreduce")
    with pytest.raises(TrainerConfigError, match="indexable"):
        Trainer(Net(), net_step, adamw, iter(range(3)), batch_size=2, epochs=1)
    assert issubclass(TrainerConfigError, FlodlHFError) and issubclass(TrainerError, FlodlHFError)


def test_stop_when_ends_the_run_after_an_evaluation(tmp_path):
    t = trainer(Net(0), Indexed(64), tmp_path, epochs=50, sync="none", eval_fn=noisy_eval, eval_every=2,
                stop_when=lambda m: True)
    summary = t.fit()
    assert summary["step"] == 2 and summary["stopped_early"]
    assert latest_checkpoint(tmp_path).name == "step-00000002.pt"


def test_evaluations_sit_on_the_training_clock_between_log_points(tmp_path):
    """Each eval's ``time`` is the training time up to it, also between log points (a time to a
    target read from the eval records is not rounded down to the last log point)."""
    def slow_step(model, batch):
        import time
        time.sleep(0.02)
        return net_step(model, batch)

    t = Trainer(Net(0), slow_step, adamw, Indexed(64), batch_size=8, epochs=1, sync="none", log_every=4,
                eval_fn=noisy_eval, eval_every=1, progress=False, report=False)
    t.fit()
    times = [r["time"] for r in t.history if r.get("event") == "eval"]
    assert len(times) == 8 and all(b - a >= 0.015 for a, b in zip(times, times[1:])), times
    train = [r["time"] for r in t.history if r.get("event") == "train"]
    assert abs(times[-1] - train[-1]) < 0.01 and abs(times[3] - train[0]) < 0.01  # the clocks agree
    with pytest.raises(TrainerConfigError, match="combine"):
        ElChe(combine="mean")
    with pytest.raises(TrainerConfigError, match="windows"):
        ElChe(windows="dynamic")
    with pytest.raises(TrainerConfigError, match="compress"):
        ElChe(compress="fp8")
    for removed in ("overlap", "extrapolate", "adaptive", "min_anchor", "max_anchor", "dead_zone", "shrink_below"):
        with pytest.raises(TypeError, match=removed):
            ElChe(**{removed: True})
    for kw in ({"windows": "live", "nested": True}, {"nested": ((0, 1), (2,))}):
        with pytest.raises(TrainerConfigError, match="combine='lead'.*not with"):
            ElChe(combine="lead", **kw)
    assert ElChe(combine="lead", compress="bf16").compress == "bf16"  # bfloat16 both ways (tested in test_trainer_dist)
    with pytest.raises(TrainerConfigError, match="combine='lead'.*DiLoCo"):
        Trainer(Net(0), slow_step, adamw, Indexed(64), batch_size=8, epochs=1, sync=ElChe(combine="lead"),
                outer=DiLoCo(), progress=False, report=False)
    assert len(dataclasses.fields(ElChe)) <= 6  # issue 56: at most six public fields


def test_compressed_pack_of_a_given_change_leaves_it_untouched():
    """ElChe(combine="lead", compress="bf16") hands the packer a worker's own gradient (a change already
    taken), which it goes on using: a weight other than 1 is applied to a copy, and the remainder carries
    the rest."""
    from flodl_hf.training.sync.packing import _pack_carried
    change = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-3
    kept, residual = change.clone(), torch.zeros(1000)
    view = torch.empty(1000, dtype=torch.bfloat16)
    _pack_carried(view, change, 0.25, None, residual)
    assert torch.equal(change, kept)
    assert torch.equal(view.float() + residual, change * 0.25)


def test_lead_gradients_widen_once_landed_in_the_watching_thread():
    """ElChe(combine="lead", compress="bf16"), on the lead: the thread watching the others' gradients
    widens them into the float32 buffers it was given once they have landed (exact, once), so the
    lead's sync finds them summable; a failed receive leaves them as they came."""
    from flodl_hf.training.sync import LeadGradients

    class Work:
        def __init__(self, fail: bool = False):
            self.fail = fail

        def wait(self):
            if self.fail:
                raise RuntimeError("connection closed")

    g = torch.Generator().manual_seed(0)
    landed = {1: [torch.randn(5, 3, generator=g).to(torch.bfloat16), torch.randn(7, generator=g).to(torch.bfloat16)]}
    wide = {1: [torch.full((5, 3), float("nan")), torch.full((7,), float("nan"))]}
    flight = LeadGradients([Work(), Work()], dict(landed), wide={1: list(wide[1])})
    flight.watch()
    flight._watcher.join()
    assert flight.landed_at is not None and flight.wide is None
    assert all(t is w for t, w in zip(flight.tensors[1], wide[1]))  # the kept buffers, no new tensors
    assert all(t.dtype == torch.float32 and torch.equal(t, b.float()) for t, b in zip(flight.tensors[1], landed[1]))
    flight.widen()  # once: nothing left to widen
    assert all(t is w for t, w in zip(flight.tensors[1], wide[1]))
    failed = LeadGradients([Work(), Work(fail=True)], dict(landed), wide={1: list(wide[1])})
    failed.watch()
    failed._watcher.join()
    assert isinstance(failed._error, RuntimeError) and failed.wide is not None
    assert all(t.dtype == torch.bfloat16 for t in failed.tensors[1])


def test_diloco_identity_in_one_process_equals_plain_local_sgd():
    data = Indexed(40)
    plain, outer = Net(0), Net(0)
    for model, out in ((plain, None), (outer, DiLoCo(lr=1.0, momentum=0.0))):
        Trainer(model, net_step, lambda p: torch.optim.SGD(p, lr=0.05), data, batch_size=4, epochs=1,
                sync=ElChe(anchor=2), outer=out, progress=False).fit()
    for a, b in zip(plain.parameters(), outer.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


# ---- record of the run ---------------------------------------------------------------------------

def test_records_and_report(tmp_path):
    t = trainer(Net(0), Indexed(48), tmp_path, epochs=2, sync="el-che", eval_fn=noisy_eval, eval_every=4,
                report=True, log_every=2)
    summary = t.fit()
    tree = load_tree(tmp_path)
    host = next(p for p in tree if p.startswith("host-") and "/" not in p)
    assert list(tree) == ["", host, f"{host}/rank-0"]
    run = tree[""]
    events = [r["event"] for r in run]
    assert events[0] == "start" and events[-1] == "end" and "eval" in events and "checkpoint" in events
    assert run[-1]["status"] == "finished" and run[-1]["children"][host]["status"] == "finished"
    train = [r for r in run if r["event"] == "train"]
    assert train[-1]["step"] == summary["step"] == 12
    assert {"loss", "samples_per_s", "batches", "anchor", "ranks", "alive", "min", "max", "children"} <= train[0].keys()
    assert train[0]["min"]["samples_per_s"]["who"] == f"{host}/rank-0"
    assert {"sync_ms", "idle_share"} <= train[1].keys()  # overheads of the window before
    # The in-memory rolled-up history keeps the per-worker lists.
    assert {"batch_share", "plan", "idle_ms", "window_ms"} <= [r for r in t.history if r["event"] == "train"][1].keys()
    rank = [r for r in tree[f"{host}/rank-0"] if r["event"] == "train"]
    assert sum(r["samples"] for r in rank) == 96 and rank[-1]["loss"] == pytest.approx(train[-1]["loss"])
    assert {"cpu_pct", "rss_mb", "ms_per_batch", "lr"} <= rank[-1].keys()
    # Each rollup line carries its children's latest summaries: the host's names rank-0.
    host_train = [r for r in tree[host] if r["event"] == "train"]
    assert [r["children"]["rank-0"]["step"] for r in host_train] == [r["step"] for r in rank]
    assert [r["children"]["rank-0"]["loss"] for r in host_train] == [r["loss"] for r in rank]
    page = Path(summary["report"])
    assert page.name == "run.html"
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "<svg" not in text.split("<script>")[0]
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing to fetch


def test_resumed_run_drops_records_after_its_checkpoint(tmp_path):
    """After the checkpoint's point: a later step, or its step at a later training time."""
    data = Indexed(40)
    trainer(Net(0), data, tmp_path, max_steps=4, sync="none", log_every=1).fit()
    rank_file = next(tmp_path.glob("host-*/rank-0/records.jsonl"))
    saved = load_checkpoint(tmp_path)["train_time"]
    with rank_file.open("a") as f:  # as if the run had gone on, then crashed mid-line; the first
        # record is a live El Che window that ended inside the checkpoint's step, after it
        f.write(json.dumps({"event": "train", "step": 4, "time": round(saved + 0.5, 4), "loss": 0.0}) + "\n"
                + json.dumps({"event": "train", "step": 5, "loss": 0.0}) + "\n" + '{"event": "tra')
    trainer(Net(0), data, tmp_path, max_steps=6, sync="none", log_every=1).fit()
    steps = [r["step"] for r in load_tree(tmp_path)[rank_file.parent.relative_to(tmp_path).as_posix()]
             if r["event"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]


# ---- misuse: a typed error before anything is lost ------------------------------------------------

def test_fresh_run_removes_an_earlier_runs_checkpoints_and_nothing_else(tmp_path):
    trainer(Net(0), Indexed(40), tmp_path, max_steps=10, checkpoint_every=5, sync="none").fit()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match=r"resume=False: removed 2 checkpoint file\(s\)"):
        t = trainer(Net(0), Indexed(40), tmp_path, max_steps=3, checkpoint_every=1, sync="none", resume=False)
        summary = t.fit()
    # pruning by step no longer keeps the earlier run's step 10 over this run's, nor does a resume take it
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["step-00000002.pt", "step-00000003.pt"]
    assert Path(summary["checkpoint"]).name == "step-00000003.pt"
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_grad_clip_seed_and_directories_are_checked_up_front(tmp_path):
    for bad in (-1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(TrainerConfigError, match="grad_clip"):
            trainer(Net(0), Indexed(16), tmp_path, max_steps=1, grad_clip=bad)
    for bad in (None, 1.5):
        with pytest.raises(TrainerConfigError, match="seed must be an int"):
            trainer(Net(0), Indexed(16), tmp_path, max_steps=1, seed=bad)
    (tmp_path / "file").write_text("")
    with pytest.raises(TrainerConfigError, match="checkpoint_dir .*file exists and is not a directory"):
        trainer(Net(0), Indexed(16), tmp_path / "file", max_steps=1)
    with pytest.raises(TrainerConfigError, match="log_dir .*file exists and is not a directory"):
        trainer(Net(0), Indexed(16), tmp_path / "ck", max_steps=1, log_dir=tmp_path / "file")
    with pytest.raises(TrainerConfigError, match="eval_every needs eval_fn"):
        trainer(Net(0), Indexed(16), tmp_path / "ck", max_steps=1, eval_every=1)
    for bad, match in (("gpu", "'gpu' is not a torch device"), ("cuda:99", "'cuda:99': this machine has")):
        with pytest.raises(TrainerConfigError, match=match):
            trainer(Net(0), Indexed(16), tmp_path / "ck", max_steps=1, device=bad).fit()
    with pytest.raises(TrainerConfigError, match="stop_when needs eval_fn"):
        trainer(Net(0), Indexed(16), tmp_path / "ck", max_steps=1, stop_when=lambda m: True)
    assert not (tmp_path / "ck").exists()
    # 0 means no clipping, as transformers' max_grad_norm=0: the same weights as None
    a, b = Net(0), Net(0)
    trainer(a, Indexed(16), tmp_path / "a", max_steps=2, sync="none", grad_clip=0).fit()
    trainer(b, Indexed(16), tmp_path / "b", max_steps=2, sync="none", grad_clip=None).fit()
    assert same_state(a, b)


def test_fit_runs_once_per_trainer(tmp_path):
    t = trainer(Net(0), Indexed(16), tmp_path, max_steps=1, sync="none")
    t.fit()
    with pytest.raises(TrainerError, match="fit\\(\\) already ran"):
        t.fit()


def test_resume_refuses_other_data_or_shuffle(tmp_path):
    trainer(Net(0), Indexed(40), tmp_path, max_steps=4, sync="none").fit()
    with pytest.raises(TrainerError, match="data_size=40 but this Trainer has data_size=8"):
        trainer(Net(0), Indexed(8), tmp_path, max_steps=6, sync="none").fit()
    with pytest.raises(TrainerError, match="shuffle=True but this Trainer has shuffle=False"):
        trainer(Net(0), Indexed(40), tmp_path, max_steps=6, sync="none", shuffle=False).fit()


def test_resume_into_another_model_or_optimizer_is_refused_and_leaves_the_model_alone(tmp_path):
    trainer(Net(0), Indexed(40), tmp_path, max_steps=2, sync="none").fit()
    other = Net(5)
    other.body[3] = nn.Linear(16, 2)  # another head: the first layer would fit, the last does not
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(TrainerError, match=r"step-00000002.pt: the checkpoint does not fit this model \(body.3"):
        trainer(other, Indexed(40), tmp_path, max_steps=4, sync="none").fit()
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # nothing copied
    sgd = Trainer(Net(0), net_step, lambda p: torch.optim.SGD(p, lr=0.1), Indexed(40), batch_size=8, max_steps=2,
                  checkpoint_dir=tmp_path / "sgd", sync="none", progress=False, report=False)
    sgd.fit()
    with pytest.raises(TrainerError, match="optimizer or scheduler state does not fit this Trainer's \\(Adam\\)"):
        Trainer(Net(0), net_step, lambda p: torch.optim.Adam(p), Indexed(40), batch_size=8, max_steps=4,
                checkpoint_dir=tmp_path / "sgd", sync="none", progress=False, report=False).fit()


def test_user_callables_that_cannot_train_get_typed_errors(tmp_path):
    with pytest.raises(TrainerConfigError, match="must return a torch.optim.Optimizer, got object"):
        Trainer(Net(0), net_step, lambda p: object(), Indexed(16), batch_size=8, max_steps=1, sync="none",
                progress=False, report=False).fit()
    frozen = Net(0).requires_grad_(False)
    with pytest.raises(TrainerConfigError, match="Net has no parameter that requires grad"):
        Trainer(frozen, net_step, adamw, Indexed(16), batch_size=8, max_steps=1, sync="none",
                progress=False, report=False).fit()
    with pytest.raises(TrainerConfigError, match="does not require grad"):
        Trainer(Net(0), lambda m, b: torch.tensor(1.0), adamw, Indexed(16), batch_size=8, max_steps=1,
                sync="none", progress=False, report=False).fit()


def test_eval_fn_results_are_checked_and_the_model_goes_back_to_training(tmp_path):
    for result, match in (({"acc": "x"}, "eval_fn's 'acc' must be a number"),
                          ({"acc": torch.ones(2)}, "eval_fn's 'acc' must be a number"),
                          ({"step": 99}, "a metric named 'step'"), ({"samples": 1.0}, "a metric named 'samples'")):
        with pytest.raises(TrainerConfigError, match=match):
            trainer(Net(0), Indexed(16), tmp_path / "a", max_steps=1, sync="none", resume=False,
                    eval_fn=lambda m, r=result: r).fit()
    model = Net(0)

    def broken(m):
        raise ZeroDivisionError("the user's own")
    with pytest.raises(ZeroDivisionError):
        trainer(model, Indexed(16), tmp_path / "b", max_steps=1, sync="none", eval_fn=broken).fit()
    assert model.training
    summary = trainer(Net(0), Indexed(16), tmp_path / "c", max_steps=1, sync="none",
                      eval_fn=lambda m: {"acc": torch.tensor(0.5)}).fit()
    assert summary["eval"] == {"acc": 0.5}  # the metrics only, not the record's own fields


def test_a_failed_checkpoint_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    import flodl_hf.training.checkpoints as trainer_module

    def full_disk(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(trainer_module.torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        trainer(Net(0), Indexed(16), tmp_path, max_steps=1, sync="none").fit()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".pt") or ".tmp-" in p.name]


def test_a_diverged_loss_is_recorded_as_null_in_strict_json(tmp_path):
    def nan_step(model, batch):
        return model(batch["x"], batch["y"]).loss * float("nan")
    Trainer(Net(0), nan_step, adamw, Indexed(16), batch_size=8, max_steps=2, sync="none", log_every=1,
            log_dir=tmp_path, progress=False, report=False).fit()
    for file in tmp_path.rglob("records.jsonl"):
        for line in file.read_text().splitlines():
            json.loads(line, parse_constant=lambda c: pytest.fail(f"{file}: {c} in {line}"))
    rank = next(tmp_path.glob("host-*/rank-0/records.jsonl"))
    assert [json.loads(x)["loss"] for x in rank.read_text().splitlines() if '"train"' in x][0] is None


def test_old_layout_is_read_as_a_tree(tmp_path):
    rows = [{"event": "start", "world_size": 2}, {"event": "train", "step": 1, "loss": 1.0},
            {"event": "train", "step": 2, "loss": 0.5}]
    (tmp_path / "run.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for w in range(2):
        (tmp_path / f"worker-{w}.jsonl").write_text(json.dumps({"step": 2, "rank": w, "loss": 0.5 + w}) + "\n")
    tree = load_tree(tmp_path)
    assert list(tree) == ["", "host-local", "host-local/rank-0", "host-local/rank-1"]
    assert tree["host-local/rank-1"][0]["loss"] == 1.5 and tree["host-local/rank-1"][0]["status"] == "finished"
    assert [r["step"] for r in tree["host-local"]] == [1, 2]
    assert "host-local/rank-1" in write_report(tmp_path).read_text()


def test_tensorboard_is_optional(tmp_path):
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        with pytest.warns(UserWarning, match="tensorboard is not installed"):
            trainer(Net(0), Indexed(16), tmp_path, max_steps=1, sync="none", tensorboard=True).fit()
    else:
        trainer(Net(0), Indexed(16), tmp_path, max_steps=2, sync="none", tensorboard=True, log_every=1).fit()
        assert list((tmp_path / "tensorboard").iterdir())


# ---- command line --------------------------------------------------------------------------------

def test_train_command_parses_script_arguments():
    import argparse
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--workers", "3", "run.py", "--lr", "3e-5", "data.csv"])
    assert (args.workers, args.script, args.script_args) == (3, "run.py", ["--lr", "3e-5", "data.csv"])
    assert args.func is not None


def test_launch_refuses_a_missing_script(tmp_path):
    with pytest.raises(InputError, match="not found"):
        launch(tmp_path / "nope.py", workers=2)


def test_nest_tiers_cuts_at_the_widest_gap_with_two_fast_workers_or_more():
    assert nest_tiers([10.0, 30.0, 120.0]) == ((0, 1), (2,))        # 1 : 1/3 : 1/12
    assert nest_tiers([120.0, 10.0, 30.0]) == ((1, 2), (0,))        # any rank may be the slowest
    assert nest_tiers([10.0, 11.0, 100.0, 105.0]) == ((0, 1), (2, 3))
    assert nest_tiers([10.0, 30.0, 31.0, 100.0]) == ((0, 1, 2), (3,))
    assert nest_tiers([10.0, 40.0, 50.0]) is None                   # one fast worker: flat windows
    assert nest_tiers([10.0, 12.0, 19.0]) is None                   # under NEST_GAP
    assert nest_tiers([10.0, 30.0]) is None and nest_tiers([10.0, None, 120.0]) is None


def test_probe_tiers_nest_the_workers_still_in_their_first_batch_once_they_are_twice_as_slow():
    assert probe_tiers([10.0, 30.0, None], 59.0) is None                 # the slowest may yet be under 2x
    assert probe_tiers([10.0, 30.0, None], 60.0) == ((0, 1), (2,))       # 1 : 1/3 : (at least 1/6)
    assert probe_tiers([None, 12.0, 10.0], 30.0) == ((1, 2), (0,))       # any rank may be the slowest
    assert probe_tiers([10.0, 11.0, None, None], 25.0) == ((0, 1), (2, 3))
    assert probe_tiers([10.0, None, None], 500.0) is None                # one fast worker: flat windows
    assert probe_tiers([10.0, 30.0, 40.0], 500.0) is None                # all ended one: after the window
    # Every tier it can return has a process group made up front (3 workers: 3 pairs; 4: 6 pairs, 4 triples).
    assert inner_candidates(3) == [(0, 1), (0, 2), (1, 2)] and len(inner_candidates(4)) == 10
    assert len(inner_candidates(5)) == 25 and len(inner_candidates(6)) == 56
    assert inner_candidates(2) == [] and inner_candidates(7) == []
    for world in (3, 4, 5, 6):
        for finished in inner_candidates(world):
            ms = [10.0 if r in finished else None for r in range(world)]
            assert probe_tiers(ms, 20.0)[0] in inner_candidates(world)


def test_nested_needs_live_windows_without_compress():
    for bad in (dict(windows="planned"), dict(compress="bf16"), dict(windows="live", combine="sum", compress="bf16")):
        with pytest.raises(TrainerConfigError, match="nested=True"):
            ElChe(nested=True, **bad)
    assert ElChe(nested=True).nested and ElChe(nested=True, windows="live", combine="sum").nested
    live = dict(windows="live", combine="sum")
    assert ElChe(nested=[[1, 0], (2,)], **live).nested == ((0, 1), (2,))
    for bad in ([[0], [1]], [[0, 1], []], [[0, 1], [1, 2]], [[0, 0], [2]], "01/2", [[0, "x"], [2]], [[0, 1]]):
        with pytest.raises(TrainerConfigError, match="nested"):
            ElChe(nested=bad, **live)


def test_evaluation_moves_no_host_rng_that_a_collate_fn_draws_from():
    """Turning evaluation on changes no training step, whichever generator eval_fn draws from (torch's,
    Python's, NumPy's) and whichever a collate_fn draws from."""
    import numpy as np

    def collate(items):
        batch = torch.utils.data.default_collate(items)
        batch["x"] = batch["x"] + 0.1 * random.random() + 0.1 * float(np.random.rand()) + 0.1 * float(torch.rand(()))
        return batch

    def run(draw):
        model = Net(0)
        extra = {} if draw is None else {"eval_fn": lambda m: (draw(), 0.0)[1], "eval_every": 2}
        Trainer(model, net_step, lambda p: torch.optim.AdamW(p, lr=1e-2), Indexed(64), batch_size=8, max_steps=8,
                collate_fn=collate, sync="none", progress=False, report=False, **extra).fit()
        return model.state_dict()

    plain = run(None)
    for draw in (lambda: torch.rand(3), random.random, np.random.rand):
        evaluated = run(draw)
        assert all(torch.equal(plain[k], evaluated[k]) for k in plain)


def test_a_non_finite_run_keeps_its_last_finite_checkpoint(tmp_path):
    """A NaN loss trains on (as transformers' Trainer), but rotation never deletes the last checkpoint whose
    weights are finite, and the run says so."""
    calls = {"n": 0}

    def step(model, batch):
        calls["n"] += 1
        loss = net_step(model, batch).loss
        return loss * float("nan") if calls["n"] == 3 else loss

    with pytest.warns(RuntimeWarning, match=r"step-00000002\.pt, the last checkpoint with finite weights"):
        Trainer(Net(0), step, lambda p: torch.optim.AdamW(p, lr=1e-2), Indexed(64), batch_size=8, max_steps=6,
                sync="none", checkpoint_dir=tmp_path, checkpoint_every=1, keep_checkpoints=2, progress=False,
                report=False).fit()
    names = sorted(p.name for p in tmp_path.glob("step-*.pt"))
    assert names == ["step-00000002.pt", "step-00000005.pt", "step-00000006.pt"]
    state = load_checkpoint(tmp_path / "step-00000002.pt")["model"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_bool_counts_are_refused():
    for name in ("batch_size", "max_steps", "keep_checkpoints"):
        settings = {"batch_size": 8, "max_steps": 2, name: True}
        with pytest.raises(TrainerConfigError, match=name):
            Trainer(Net(0), net_step, lambda p: torch.optim.SGD(p, lr=0.1), Indexed(16), sync="none",
                    progress=False, report=False, **settings)


def test_a_corrupt_newest_checkpoint_names_the_way_on(tmp_path):
    """The resume reads the newest checkpoint; a damaged one is a typed error naming it, the older one to
    resume from once it is removed, and resume=False."""
    make = lambda: Trainer(Net(0), net_step, lambda p: torch.optim.SGD(p, lr=0.1), Indexed(64), batch_size=8,  # noqa: E731
                           max_steps=4, sync="none", checkpoint_dir=tmp_path, checkpoint_every=2, progress=False,
                           report=False)
    make().fit()
    newest = latest_checkpoint(tmp_path)
    newest.write_bytes(newest.read_bytes()[:100])  # a truncated file
    with pytest.raises(CheckpointFormatError, match=rf"remove {newest.name} .* step-00000002\.pt, or pass resume=False"):
        make().fit()
    newest.unlink()
    assert make().fit()["step"] == 4  # resumed from step 2
