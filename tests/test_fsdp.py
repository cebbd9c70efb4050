"""``Trainer(sync="fsdp")`` on two gloo workers: a llama of two layers sharded with FSDP2 ends where DDP ends
(max abs diff), holds half of DDP's bytes, clips by the global norm, trains only a LoRA adapter, evaluates on
every worker, and checkpoints in shards that resume bit-exact, load on one worker, and export."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flodl_hf.core.errors import CheckpointFormatError, TrainerConfigError
from flodl_hf.training.trainer import DiLoCo, ElChe, Trainer

from helpers import make_checkpoint, one_thread  # noqa: F401  (fixture)
from test_trainer_dist import spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

LLAMA = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=96, vocab_size=128, max_position_embeddings=32, pad_token_id=0)
SEQ, N = 8, 32


def _data(n: int = N) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, LLAMA["vocab_size"], (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _step(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _model(source: str, lora: bool = False):
    from flodl_hf.auto import load_model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(source, "causal_lm")
    if lora:
        from flodl_hf import lora as lora_mod
        torch.manual_seed(1)
        model = lora_mod.add_lora(model, r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    return model


def _fit(source: str, sync: str, lora: bool = False, **kw) -> Trainer:
    base = dict(batch_size=2, progress=False, report=False, timeout=60, max_steps=4, grad_clip=0.5, sync=sync)
    t = Trainer(_model(source, lora), _step, kw.pop("opt", _adamw), _data(), **{**base, **kw})
    t.fit()
    return t


def _full(t: Trainer) -> dict[str, torch.Tensor]:
    from flodl_hf.training.sync.fsdp import full_state_dict
    return full_state_dict(t.model)


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _scenario(rank: int, out: str, source: str) -> dict:
    from flodl_hf.training.sync.fsdp import local_bytes
    root = Path(out)
    res: dict = {}
    # DDP and FSDP on the same data, clipped (grad_clip=0.5 is below every step's norm here).
    ddp, fsdp = _fit(source, "ddp"), _fit(source, "fsdp")
    res["ddp_vs_fsdp"] = _diff(_full(ddp), _full(fsdp))
    res["sharded"] = all(type(p).__name__ == "DTensor" for p in fsdp.model.parameters())
    res["bytes_ddp"], res["bytes_fsdp"] = local_bytes(ddp.model, ddp.optimizer), local_bytes(fsdp.model, fsdp.optimizer)
    # Accumulation: the first micro-batch's backward reduces nothing, the second reduces their sum.
    res["accumulated"] = _diff(_full(_fit(source, "ddp", gradient_accumulation_steps=2)),
                               _full(_fit(source, "fsdp", gradient_accumulation_steps=2)))
    # Evaluation runs on every worker (the forward gathers the shards); worker 0 records it.
    calls = []

    def evaluate(model):
        calls.append(1)
        return {"loss": float(_step(model, torch.utils.data.default_collate(_data()[:4])))}
    ev = _fit(source, "fsdp", max_steps=2, eval_fn=evaluate, eval_every=1)
    res["eval_calls"], res["eval_records"] = len(calls), sum(r.get("event") == "eval" for r in ev.history)
    # Sharded checkpoints: four steps straight, and two then two more resumed; a bit-exact end.
    straight = _fit(source, "fsdp", checkpoint_dir=root / "straight", checkpoint_every=2)
    res["step2"] = _full(_fit(source, "fsdp", max_steps=2, checkpoint_dir=root / "ck", checkpoint_every=2))
    resumed = _fit(source, "fsdp", checkpoint_dir=root / "ck", checkpoint_every=2)
    res["resumed_from"] = str(resumed.resumed_from)
    res["resume_equal"] = all(torch.equal(a, b) for a, b in zip(_full(straight).values(), _full(resumed).values()))
    # LoRA on the sharded model: only the adapter trains, as under DDP.
    lora_ddp, lora_fsdp = _fit(source, "ddp", lora=True), _fit(source, "fsdp", lora=True)
    res["lora_diff"] = _diff(_full(lora_ddp), _full(lora_fsdp))
    res["lora_full"] = _full(lora_fsdp)
    res["lora_trainable"] = sorted(n for n, p in lora_fsdp.model.named_parameters() if p.requires_grad)
    # bf16 through FSDP's MixedPrecisionPolicy: float32 shards, a run close to float32's.
    bf16 = _fit(source, "fsdp", precision="bf16")
    res["bf16_dtypes"] = {p.dtype for p in bf16.model.parameters()}
    res["bf16_vs_fp32"] = _diff(_full(bf16), _full(fsdp))
    # El Che's records carry the memory columns: each window's peak, and what its sync allocated.
    from flodl_hf.training.records import load_tree
    _fit(source, ElChe(anchor=2), max_steps=6, log_dir=root / "el-che")
    if rank == 0:
        res["el_che_rows"] = {p: [r for r in rs if r.get("event") == "train"]
                              for p, rs in load_tree(root / "el-che").items() if "rank-" in p}
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    source = make_checkpoint(LLAMA, "causal_lm")
    out = tmp_path_factory.mktemp("fsdp")
    return spawn(_scenario, out, str(source), deadline=400.0, pg_timeout=60.0), out, source


def test_fsdp_equals_ddp_and_holds_half_the_bytes(runs):
    res, _, _ = runs
    for r in (0, 1):
        # Reduce-scatter sums the two workers' gradients as all-reduce does (two terms: one order), so the
        # parameters after 4 AdamW steps, clipped by the global norm, agree to the bit here; the bound is 1e-6.
        assert res[r]["ddp_vs_fsdp"] <= 1e-6, res[r]["ddp_vs_fsdp"]
        assert res[r]["sharded"]
    ddp, fsdp = res[0]["bytes_ddp"], res[0]["bytes_fsdp"]
    print(f"FSDP vs DDP, 4 AdamW steps clipped: max abs diff {res[0]['ddp_vs_fsdp']:.3g}; bytes per worker "
          f"DDP {ddp}, FSDP {[res[r]['bytes_fsdp'] for r in (0, 1)]}")
    for part in ("parameters", "gradients", "optimizer"):
        shares = [res[r]["bytes_fsdp"][part] / ddp[part] for r in (0, 1)]
        assert all(0.45 <= s <= 0.55 for s in shares), (part, shares)  # 1/world, dim 0 padded
    assert res[0]["ddp_vs_fsdp"] == res[1]["ddp_vs_fsdp"]
    assert res[0]["accumulated"] <= 1e-6, res[0]["accumulated"]
    assert fsdp["parameters"] + res[1]["bytes_fsdp"]["parameters"] >= ddp["parameters"]


def test_fsdp_evaluates_on_every_worker_and_records_on_worker_0(runs):
    res, _, _ = runs
    assert res[0]["eval_calls"] == res[1]["eval_calls"] == 2
    assert res[0]["eval_records"] == 2 and res[1]["eval_records"] == 0


def test_fsdp_trains_only_the_lora_adapter(runs):
    res, _, _ = runs
    print(f"LoRA, FSDP vs DDP: max abs diff {res[0]['lora_diff']:.3g}")
    assert res[0]["lora_diff"] <= 1e-6, res[0]["lora_diff"]
    trainable = res[0]["lora_trainable"]
    assert trainable and all("lora_" in n for n in trainable)
    full, start = res[0]["lora_full"], _model(str(runs[2]), lora=True).state_dict()  # the workers' start
    assert full.keys() == start.keys()
    base = [k for k in start if "lora_" not in k]
    assert base and all(torch.equal(full[k], start[k]) for k in base)  # the base never moved
    assert any(not torch.equal(full[k], torch.zeros_like(full[k])) for k in full if "lora_B" in k)  # B trained


def test_fsdp_bf16_keeps_float32_shards(runs):
    res, _, _ = runs
    print(f"bf16 vs float32 under FSDP: max abs diff {res[0]['bf16_vs_fp32']:.3g}")
    assert res[0]["bf16_dtypes"] == {torch.float32}
    assert 0 < res[0]["bf16_vs_fp32"] < 5e-2  # bf16 compute moved the weights, not far


def test_fsdp_checkpoint_resumes_bit_exact_reshards_and_exports(runs, tmp_path):
    res, out, source = runs
    assert res[0]["resume_equal"] and res[1]["resume_equal"]
    assert Path(res[0]["resumed_from"]).name == "step-00000002.pt"
    ck = out / "ck"  # step 2 (and the resumed run's step 4, newest)
    for name in ("step-00000004.pt", "step-00000004.rank-1.pt"):
        (ck / name).rename(tmp_path / name)  # so that a resume takes step 2
    assert sorted(p.name for p in (ck / "step-00000002.dcp").iterdir()) == [".metadata", "__0_0.distcp",
                                                                          "__1_0.distcp"]
    # Another world size: one worker loads the two workers' shards whole (DCP reshards), optimizer state too.
    with pytest.warns(UserWarning, match="resumed by 1"):
        one = Trainer(_model(str(source)), _step, _adamw, _data(), batch_size=2, max_steps=2, sync="fsdp",
                      checkpoint_dir=ck, progress=False, report=False)
        one.fit()
    state = one.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in res[0]["step2"].items())
    assert all(s["exp_avg"].shape == p.shape for p, s in one.optimizer.state.items())
    # export --checkpoint reads the shards on one CPU process and writes an HF directory verify-export passes.
    from flodl_hf.cli import main
    from flodl_hf.roundtrip.export import read_trainer_checkpoint
    from flodl_hf.roundtrip.verify import verify_export
    assert main(["export", "--checkpoint", str(ck / "step-00000002.pt"), "--out", str(tmp_path / "hf")]) == 0
    verify_export(tmp_path / "hf")
    # The main file alone (its shard directory not copied with it) is refused, naming the directory.
    import shutil
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(ck / "step-00000002.pt", alone / "step-00000002.pt")
    with pytest.raises(CheckpointFormatError, match=r"step-00000002\.dcp: the sharded checkpoint's directory"):
        read_trainer_checkpoint(alone / "step-00000002.pt")
    from safetensors.torch import load_file
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(exported["model.layers.0.self_attn.q_proj.weight"],
                       res[0]["step2"]["model.layers.0.self_attn.q_proj.weight"])


def test_el_che_records_each_sync_memory(runs):
    res, _, _ = runs
    rows = res[0]["el_che_rows"]
    assert len(rows) == 2
    for windows in rows.values():
        assert all(r["mem_peak_mb"] >= r["rss_mb"] > 0 for r in windows)
        synced = [r["sync_mem_mb"] for r in windows[1:]]  # a window's row holds the sync that began it
        assert synced and all(s >= 0 for s in synced)
        assert "sync_mem_mb" not in windows[0]


def test_fsdp_refuses_replicas_and_bad_shards(tmp_path):
    with pytest.raises(TrainerConfigError, match=r"sync='fsdp'.*outer=DiLoCo"):
        Trainer(torch.nn.Linear(2, 2), _step, _adamw, _data(), batch_size=2, max_steps=1, sync="fsdp",
                outer=DiLoCo())
    with pytest.raises(TrainerConfigError, match="fp16"):
        Trainer(torch.nn.Linear(2, 2), _step, _adamw, _data(), batch_size=2, max_steps=1, sync="fsdp",
                precision="fp16")
    from flodl_hf.core.sharded_checkpoint import read_model
    bad = tmp_path / "step-00000001.dcp"
    bad.mkdir()
    with pytest.raises(CheckpointFormatError, match=r"\.metadata"):
        read_model(bad)
    import pickle
    (bad / ".metadata").write_bytes(pickle.dumps(print))  # a pickle that asks for code
    with pytest.raises(CheckpointFormatError, match="refused"):
        read_model(bad)


@pytest.mark.usefixtures("one_thread")
def test_fsdp_on_one_worker_rotates_and_resumes_its_shards(tmp_path):
    # One process: nothing is sharded, the checkpoints are DCP's all the same (one shard file each).
    source = str(make_checkpoint(LLAMA, "causal_lm"))
    straight = _fit(source, "fsdp", max_steps=3, checkpoint_dir=tmp_path / "a", checkpoint_every=1)
    _fit(source, "fsdp", max_steps=2, checkpoint_dir=tmp_path / "b", checkpoint_every=1)
    resumed = _fit(source, "fsdp", max_steps=3, checkpoint_dir=tmp_path / "b", checkpoint_every=1)
    assert resumed.resumed_from.name == "step-00000002.pt"
    # keep_checkpoints=2: step 1's main file and its shard directory went together.
    assert sorted(p.name for p in (tmp_path / "b").glob("step-*")) == [
        "step-00000002.dcp", "step-00000002.pt", "step-00000003.dcp", "step-00000003.pt"]
    assert all(torch.equal(a, b) for a, b in zip(straight.model.state_dict().values(),
                                                  resumed.model.state_dict().values()))
