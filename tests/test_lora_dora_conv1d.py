"""DoRA on GPT-2's Conv1D layers (c_attn, c_proj, c_fc; PEFT's fan_in_fan_out) against PEFT's get_peft_model on
transformers' GPT2LMHeadModel, at head_dim 24 and at real width (hidden 768): the init (same seed: A, B and the
magnitude, under PEFT's names), PEFT's adapter loaded here, a training step with LoRA dropout in train mode (loss,
gradients, updated weights), our adapter loaded by PEFT (the same file bits), merge and unmerge, merge_and_unload
and a trainer checkpoint exported as an adapter, all torch.equal to PEFT in the same run."""

from __future__ import annotations

import warnings

import pytest
import torch

peft = pytest.importorskip("peft")

from safetensors.torch import load_file

from flodl_hf.core import checkpoint_schema
from flodl_hf import lora
from flodl_hf.auto import load_model
from flodl_hf.roundtrip.adapters import export_adapter
from flodl_hf.roundtrip.parity import make_batch, reference_model

from cases import CASES
from helpers import make_checkpoint
from test_lora import _equal_fields, _peft_name, _peft_trainable, _perturb, assert_step_equal_to_peft

TARGETS = ["c_attn", "c_proj", "c_fc"]
TASK = "causal_lm"


def _state(peft_model) -> dict[str, torch.Tensor]:
    """A PeftModel's state_dict under our keys."""
    return {_peft_name(k): v for k, v in peft_model.state_dict().items()}


def _assert_states_equal(ours, theirs: dict[str, torch.Tensor]) -> None:
    mine = ours.state_dict()
    assert mine.keys() == theirs.keys(), sorted(mine.keys() ^ theirs.keys())
    differ = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert not differ, differ


@pytest.mark.parametrize("case_id,r,dropout", [
    pytest.param("gpt2-hd24-causal_lm", 4, 0.2, id="gpt2-hd24"),
    pytest.param("gpt2-768-1layer-causal_lm", 8, 0.1, id="gpt2-768"),
])
def test_dora_on_conv1d_is_peft_s_both_ways(case_id, r, dropout, tmp_path):
    warnings.simplefilter("ignore")
    fields = next(f for c, t, f in CASES if c == case_id)
    source = make_checkpoint(fields, TASK)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=TARGETS, use_dora=True,
                             task_type="CAUSAL_LM")

    # init, the same seed: A (kaiming), B (zeros) and the magnitude (the column norms of the (in, out) weight)
    base = reference_model(source, TASK, "eager")
    torch.manual_seed(0)
    theirs = peft.get_peft_model(base, config)
    fresh = load_model(source, TASK)
    torch.manual_seed(0)
    lora.add_lora(fresh, r=r, alpha=2 * r, dropout=dropout, target_modules=TARGETS, use_dora=True)
    layers = lora.lora_layers(fresh)  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    assert len(layers) == 4 * fields["n_layer"] and all(isinstance(m, lora.LoraConv1D) for m in layers.values())
    _assert_states_equal(fresh, _state(theirs))
    assert {n for n, p in fresh.named_parameters() if p.requires_grad} == \
        {_peft_name(n) for n, _ in _peft_trainable(theirs)}
    c_fc = layers["transformer.h.0.mlp.c_fc"]
    assert c_fc.lora_magnitude_vector.shape == (c_fc.weight.shape[1],)  # one per output: a column of (in, out)

    # In: PEFT's adapter (perturbed: B non-zero, the magnitude off the norm) loads here, outputs equal
    _perturb(_peft_trainable(theirs), 1)
    theirs.save_pretrained(str(tmp_path / "from-peft"))
    ours = load_model(source, TASK, adapter=tmp_path / "from-peft")
    ours.set_attn_implementation("eager")
    assert sorted(ours.lora_config.targeted) == sorted(layers) and ours.lora_config.use_dora
    _assert_states_equal(ours, _state(theirs))
    batch = make_batch(ours.config, TASK)
    ours.eval(), theirs.eval()
    with torch.no_grad():
        _equal_fields(ours(**batch), theirs(**batch))

    # a training step with LoRA dropout live (DoRA recomputes the base product on the dropped-out input)
    assert isinstance(lora.lora_layers(ours)["transformer.h.0.mlp.c_fc"].lora_dropout, torch.nn.Dropout)
    assert_step_equal_to_peft(ours, theirs, TASK, batch)
    trained = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trained.items()}
    with torch.no_grad():  # the step itself (SGD), on both
        for _, p in [*trained.items(), *_peft_trainable(theirs)]:
            p.sub_(0.5 * p.grad)
    assert all(not torch.equal(p, before[n]) for n, p in trained.items())
    _assert_states_equal(ours, _state(theirs))
    ours.eval(), theirs.eval()
    with torch.no_grad():
        _equal_fields(ours(**batch), theirs(**batch))

    # Out: our adapter directory, PEFT's keys and bits; PEFT loads it
    out = lora.save_adapter(ours, tmp_path / "to-peft")
    theirs.save_pretrained(str(tmp_path / "peft-after"))
    mine, peft_file = (load_file(str(d / lora.ADAPTER_WEIGHTS)) for d in (out, tmp_path / "peft-after"))
    assert sorted(mine) == sorted(peft_file) and any(k.endswith(".lora_magnitude_vector") for k in mine)
    assert all(torch.equal(mine[k], peft_file[k]) for k in mine), [k for k in mine
                                                                   if not torch.equal(mine[k], peft_file[k])]
    back = peft.PeftModel.from_pretrained(reference_model(source, TASK, "eager"), str(out)).eval()
    with torch.no_grad():
        _equal_fields(ours(**batch), back(**batch))

    # merge (DoRA's factor [1, out] on the (in, out) weight) and unmerge: PEFT's bits, outputs equal when merged
    with torch.no_grad():
        lora.merge(ours), theirs.merge_adapter()
        assert all(layer.merged for layer in lora.lora_layers(ours).values())
        _assert_states_equal(ours, _state(theirs))
        _equal_fields(ours(**batch), theirs(**batch))
        lora.unmerge(ours), theirs.unmerge_adapter()
        _assert_states_equal(ours, _state(theirs))
        _equal_fields(ours(**batch), theirs(**batch))

    # a trainer checkpoint of the DoRA model exports the same adapter
    data = {**checkpoint_schema.header(), "model": lora.trainer_model_state(ours), "config": ours.config.to_dict(),
            "lora": lora.trainer_entry(ours)}
    torch.save(data, str(tmp_path / "step-1.pt"))
    exported = load_file(str(export_adapter(tmp_path / "step-1.pt", tmp_path / "exported") / lora.ADAPTER_WEIGHTS))
    assert sorted(exported) == sorted(peft_file) and all(torch.equal(exported[k], peft_file[k]) for k in exported)

    # merge_and_unload: HF's keys, PEFT's bits
    merged_theirs = theirs.merge_and_unload()
    hf = dict(merged_theirs.state_dict())
    merged_ours = lora.merge_and_unload(ours)
    for key, tensor in merged_ours.state_dict().items():
        assert torch.equal(tensor, hf[key]), key
    with torch.no_grad():
        _equal_fields(merged_ours(**batch), merged_theirs(**batch))
