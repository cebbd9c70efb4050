"""Fresh (not loaded) parameters start as transformers' ``_init_weights`` starts them (``AutoModel.from_config``):
norms at one (a class named ``*LayerNorm`` / ``*RMSNorm``: LLaMA's RMSNorm, Cohere's and DeBERTa's LayerNorms;
Gemma's (1 + w) RMSNorm at zero), biases at zero, weights drawn normal(initializer_range), Mixtral's and
Qwen2-MoE's routers and stacked experts drawn too (zero experts would be dead: their product is zero and so is
every gradient reaching them). Compared with transformers' ``from_config`` in the same run, parameter by parameter,
by kind (all ones, all zeros, or drawn with the same spread); the draws themselves are not meant to be equal."""

from __future__ import annotations

import warnings

import pytest
import torch

from flodl_hf.auto import AutoConfig, AutoModel, AutoModelForCausalLM
from flodl_hf.parity import quiet_transformers

from cases import CASES


# Weights transformers draws with a spread of their own, which ours draw at initializer_range (docs/design.md, not
# done): GPT-2's residual projections at initializer_range / sqrt(2 n_layer); ModernBERT's truncated normals
# scaled per layer kind.
SCALED = {"gpt2": ("c_proj.weight",), "modernbert": ("Wo.weight", "Wi.weight", "Wqkv.weight", "embeddings.tok_embeddings.weight")}


def _first_cases() -> list:
    seen, out = set(), []
    for case_id, task, fields in CASES:
        if fields["model_type"] not in seen and "768" not in case_id and "1024" not in case_id:
            seen.add(fields["model_type"])
            out.append(pytest.param(dict(fields), id=fields["model_type"]))
    return out


def _kind(tensor: torch.Tensor) -> str:
    if torch.all(tensor == 1):
        return "ones"
    if torch.all(tensor == 0):
        return "zeros"
    return "drawn"


@pytest.mark.parametrize("fields", _first_cases())
def test_fresh_parameters_start_as_transformers_starts_them(fields):
    std = fields.get("initializer_range", 0.02)
    torch.manual_seed(0)
    ours = AutoModel.from_config(AutoConfig.for_model(**fields))
    transformers = quiet_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(**fields), dtype=torch.float32)
    reference = {k: v for k, v in theirs.state_dict().items() if v.is_floating_point()}
    # file keys, and module keys where transformers holds a tensor its files split (Mixtral's stacked experts)
    candidates = {**ours.state_dict(), **ours.hf_state_dict()}
    mine = {k: v for k, v in candidates.items() if k in reference}
    assert len(mine) >= len(reference) * 0.9, sorted(set(reference) - set(mine))
    for key, tensor in mine.items():
        expected = _kind(reference[key])
        assert _kind(tensor) == expected, f"{key}: ours {_kind(tensor)}, transformers' {expected}"
        if expected == "drawn" and tensor.numel() >= 256 and not key.endswith(SCALED.get(fields["model_type"], ())):
            assert abs(tensor.std().item() / reference[key].std().item() - 1) < 0.25, key


@pytest.mark.parametrize("variant", ["mixtral-hd24-4experts-top2", "qwen2_moe-hd24-4experts-norm-dense1",
                                     "llama-hd24-bias-tied-llama3"])
def test_a_fresh_model_trains_every_expert_and_norm(variant):
    fields = dict(next(f for c, _, f in CASES if c == f"{variant}-causal_lm"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields)).train()
    ids = torch.randint(1, fields["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not dead, dead


def test_a_fresh_sinusoidal_distilbert_has_transformers_table():
    fields = dict(next(f for c, _, f in CASES if c == "distilbert-sinusoidal-hd24-base"))
    ours = AutoModel.from_config(AutoConfig.for_model(**fields))
    transformers = quiet_transformers()
    theirs = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(**fields), dtype=torch.float32)
    table = ours.embeddings.position_embeddings.weight
    assert torch.equal(table, theirs.embeddings.position_embeddings.weight)
