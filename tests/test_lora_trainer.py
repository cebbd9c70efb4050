"""LoRA through the trainer: only trainable parameters reach the optimizer, checkpoints hold only the adapter
and a reference to the base, resume is bit-exact, and the checkpoint exports as a PEFT adapter (peft loads it,
outputs equal) or merged (verify-export passes)."""

from __future__ import annotations

import warnings

import pytest
import torch

peft = pytest.importorskip("peft")

from flodl_hf import lora
from flodl_hf.auto import load_model
from flodl_hf.cli import main
from flodl_hf.core.errors import AdapterBaseMismatchError
from flodl_hf.roundtrip.adapters import export_adapter
from flodl_hf.roundtrip.parity import make_batch, reference_model
from flodl_hf.training.checkpoints import latest_checkpoint, load_checkpoint
from flodl_hf.training.trainer import Trainer
from flodl_hf.roundtrip.verify import verify_export

from cases import CASES
from helpers import make_checkpoint

FIELDS = next(f for c, t, f in CASES if c == "bert-hd24-seqcls")


def _data(config, n: int = 24) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, config.vocab_size, (n, 10), generator=gen)
    labels = torch.randint(0, config.num_labels, (n,), generator=gen)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(10, dtype=torch.long), "labels": labels[i]}
            for i in range(n)]


def _step(model, batch):
    return model(**batch)


def _lora_model(source, seed: int):
    model = load_model(source, "seqcls")
    torch.manual_seed(seed)
    return lora.add_lora(model, r=4, alpha=8, target_modules=["query", "value"])


def _run(model, data, directory, max_steps, factory=None):
    factory = factory or (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    return Trainer(model, _step, factory, data, batch_size=4, max_steps=max_steps, sync="none", seed=2,
                   checkpoint_dir=directory, progress=False, report=False, grad_clip=1.0)


def test_lora_training_checkpoints_resume_and_export(tmp_path):
    warnings.simplefilter("ignore")
    source = make_checkpoint(FIELDS, "seqcls")
    straight = _lora_model(source, 0)
    data = _data(straight.config)
    given = []

    def spy(params):
        params = list(params)
        given.extend(params)
        return torch.optim.AdamW(params, lr=1e-2)

    _run(straight, data, tmp_path / "a", 8, spy).fit()
    trainable = [p for p in straight.parameters() if p.requires_grad]
    assert len(given) == len(trainable) and all(p.requires_grad for p in given)

    _run(_lora_model(source, 0), data, tmp_path / "b", 4).fit()
    ckpt = latest_checkpoint(tmp_path / "b")
    state = load_checkpoint(ckpt)
    adapter_keys = set(lora.adapter_state(straight))
    assert set(state["model"]) == adapter_keys
    assert adapter_keys == {k for k in straight.state_dict() if "lora_" in k or k.startswith("classifier.")}
    assert state["lora"]["base"]["source"] == str(source.absolute())
    assert state["lora"]["base"]["weights_sha256"]
    full = sum(t.numel() for t in straight.state_dict().values())
    assert sum(t.numel() for t in state["model"].values()) < full / 10

    resumed = _lora_model(source, 7)  # another init: the checkpoint must overwrite all of the adapter
    t = _run(resumed, data, tmp_path / "b", 8)
    t.fit()
    assert t.resumed_from == ckpt
    a, b = straight.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # Out as a PEFT adapter (the CLI calls export_adapter): peft loads it, outputs equal ours.
    final = latest_checkpoint(tmp_path / "b")
    assert main(["export", "--checkpoint", str(final), "--out", str(tmp_path / "adapter"), "--adapter"]) == 0
    theirs = peft.PeftModel.from_pretrained(reference_model(source, "seqcls", "sdpa"), str(tmp_path / "adapter"))
    saved = set(peft.utils.load_peft_weights(str(tmp_path / "adapter")))
    assert saved == set(peft.utils.get_peft_model_state_dict(theirs))
    batch = make_batch(straight.config, "seqcls")
    with torch.no_grad():
        assert torch.equal(straight.eval()(**batch).logits, theirs.eval()(**batch).logits)
    assert main(["verify-export", str(tmp_path / "adapter")]) == 0  # peft loads it; ours == peft's

    # Merged: an HF-canonical directory that verify-export passes (weights equal the merge, native == HF).
    assert main(["export", "--checkpoint", str(final), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged = verify_export(tmp_path / "merged")
    assert merged.ok and merged.check(2).status == "PASS" and merged.check(4).status == "PASS", merged.format_table()

    assert main(["export", "--hub", str(source), "--out", str(tmp_path / "x"), "--adapter"]) == 2  # typed error
    assert not (tmp_path / "x").exists()

    # A base whose weights changed since training is refused, on resume and on export.
    data_ck = torch.load(str(final), weights_only=True)
    data_ck["lora"]["base"]["weights_sha256"] = {"model.safetensors": "0" * 64}
    torch.save(data_ck, str(final))
    with pytest.raises(AdapterBaseMismatchError, match="sha256"):
        _run(_lora_model(source, 0), data, tmp_path / "b", 12).fit()
    with pytest.raises(AdapterBaseMismatchError, match="sha256"):
        export_adapter(final, tmp_path / "adapter2")
