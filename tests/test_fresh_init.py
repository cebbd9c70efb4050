"""Fresh (not loaded) parameters start as transformers' ``_init_weights`` starts them (``from_config``, every
head): norms at one (a class named ``*LayerNorm`` / ``*RMSNorm``: LLaMA's RMSNorm, Cohere's and DeBERTa's
LayerNorms; Gemma's (1 + w) RMSNorm at zero), biases at zero, weights drawn normal(initializer_range) with an
embedding's padding row at zero (kept by a tied decoder), Mixtral's and Qwen2-MoE's routers and stacked experts
drawn too (zero experts would be dead: their product is zero and so is every gradient reaching them), GPT-2's
residual projections at initializer_range / sqrt(2 n_layer), ModernBERT's truncated normals per layer kind.
Compared with transformers' ``from_config`` in the same run, parameter by parameter, by kind (all ones, all zeros,
or drawn with the same spread, truncation and zero rows); the draws themselves are not meant to be equal."""

from __future__ import annotations

import warnings

import pytest
import torch

from flodl_hf.auto import AutoConfig, AutoModel, AutoModelForCausalLM, auto_classes, load_model
from flodl_hf.roundtrip.parity import quiet_transformers
from flodl_hf.core.registry import get_task

from cases import CASES
from helpers import make_checkpoint


def _first_cases() -> list:
    """Per family, its first variant below real width, with every head it is built for."""
    first: dict[str, str] = {}
    out = []
    for case_id, task, fields in CASES:
        variant = case_id.removesuffix(f"-{task}")
        if "768" in case_id or "1024" in case_id or first.setdefault(fields["model_type"], variant) != variant:
            continue
        out.append(pytest.param(task, dict(fields), id=f"{fields['model_type']}-{task}"))
    return out


def _kind(tensor: torch.Tensor) -> str:
    if torch.all(tensor == 1):
        return "ones"
    if torch.all(tensor == 0):
        return "zeros"
    return "drawn"


def _reference(task: str, fields: dict):
    """transformers' task model from the config, as ``from_config`` builds it (GPT-2's double heads: its class)."""
    transformers = quiet_transformers()
    cls = getattr(transformers, get_task(task).auto_class)
    config = transformers.AutoConfig.for_model(**fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(cls, "from_config"):
            return cls.from_config(config, dtype=torch.float32)
        return cls._from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("task,fields", _first_cases())
def test_fresh_parameters_start_as_transformers_starts_them(task, fields):
    """Every parameter of every head's fresh model, against transformers' from_config: the same kind (ones, zeros,
    drawn); a drawn one with the same spread (std within 25%), the same truncation (ModernBERT's draws cut at two
    standard deviations: max / std under 2.4, which 1024 normal draws exceed but with odds of 1e-10) and the same
    zero rows (an embedding's padding row: zero after the default draw, drawn by ModernBERT's; a tied decoder
    keeps the embeddings' start)."""
    torch.manual_seed(0)
    ours = auto_classes()[task].from_config(AutoConfig.for_model(**fields))
    theirs = _reference(task, fields)
    reference = {k: v for k, v in theirs.state_dict().items() if v.is_floating_point()}
    # file keys, and module keys where transformers holds a tensor its files split (Mixtral's stacked experts)
    candidates = {**ours.state_dict(), **ours.hf_state_dict()}
    mine = {k: v for k, v in candidates.items() if k in reference}
    assert len(mine) >= len(reference) * 0.9, sorted(set(reference) - set(mine))
    for key, tensor in mine.items():
        ref = reference[key]
        expected = _kind(ref)
        assert _kind(tensor) == expected, f"{key}: ours {_kind(tensor)}, transformers' {expected}"
        if expected != "drawn":
            continue
        if tensor.numel() >= 256:
            assert abs(tensor.std().item() / ref.std().item() - 1) < 0.25, \
                f"{key}: std {tensor.std().item():.4g}, transformers' {ref.std().item():.4g}"
        if tensor.numel() >= 1024:
            cut = [(t.abs().max() / t.std()).item() < 2.4 for t in (tensor, ref)]
            assert cut[0] == cut[1], f"{key}: truncated {cut[0]}, transformers' {cut[1]}"
        if tensor.dim() == 2:
            zero_rows = [bool((t == 0).all(dim=-1).any()) for t in (tensor, ref)]
            assert zero_rows[0] == zero_rows[1], f"{key}: a zero row {zero_rows[0]}, transformers' {zero_rows[1]}"


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


@pytest.mark.parametrize("task", ["seqcls", "mlm"])
def test_a_head_the_checkpoint_lacks_starts_as_transformers_starts_it(task):
    """A ModernBERT base checkpoint loaded for a head: the head's weights (keys.init_fresh) drawn as transformers'
    from_pretrained draws them: the classifier truncated at hidden ** -0.5, the prediction head's dense at
    initializer_range / sqrt(2 layers) (before, both normal(initializer_range))."""
    fields = dict(next(f for c, _, f in CASES if c == "modernbert-768-base"))
    source = make_checkpoint(fields, "base")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_model(source, task)
        theirs = getattr(quiet_transformers(), get_task(task).auto_class).from_pretrained(source, dtype=torch.float32)
    fresh = ["head.dense.weight"] + (["classifier.weight"] if task == "seqcls" else [])
    mine, reference = ours.state_dict(), theirs.state_dict()
    for key in fresh:
        a, b = mine[key], reference[key]
        assert abs(a.std().item() / b.std().item() - 1) < 0.25, f"{key}: {a.std().item():.4g}, {b.std().item():.4g}"
        assert (a.abs().max() / a.std()).item() < 2.4 and (b.abs().max() / b.std()).item() < 2.4, key
