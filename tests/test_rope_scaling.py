"""The RoPE scalings transformers' rotary modules compute for every LLaMA-style decoder: ``linear``, ``yarn`` and
``dynamic`` (NTK), against transformers in the same run (longrope: tests/test_phi3_longrope.py; llama3: the shared
tables).

- yarn: the inverse frequencies and attention factor (given; from mscale / mscale_all_dim; from the factor; the
  factor read from the two lengths when null), truncated and not, other betas; the forward of every RoPE decoder
  family at head_dim 24 and of LLaMA at 1024 / 16 x 64, torch.equal.
- dynamic: state that lives with the model, as ``dynamic_frequency_update`` keeps it: a run of forwards that grow
  past max_position_embeddings, shrink (the frequencies of the longest stay) and drop under it (back to the first
  ones), each torch.equal to transformers' run of the same forwards on its own model; cached greedy generation
  across max_position_embeddings equal to ``model.generate`` (the frequencies change at every step there).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from flodl_hf.auto import AutoConfig, load_model
from flodl_hf.core.decoder import Rope
from flodl_hf.core.errors import ConfigError
from flodl_hf.generation.generate import generate_ids
from flodl_hf.roundtrip.parity import quiet_transformers, reference_model

from cases import CASES
from helpers import left_padded, make_checkpoint, one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

START = 8  # max_position_embeddings of the dynamic cases, and yarn's original_max_position_embeddings

# every family whose rotary module takes ROPE_INIT_FUNCTIONS (Phi3 refuses all but longrope; GPT-2 has no RoPE,
# GPT-J its own sinusoid table)
FAMILIES = {"llama": "llama-hd24-bias-tied-llama3", "mistral": "mistral-hd24-window4",
            "qwen2": "qwen2-hd24-sliding", "qwen3": "qwen3-hd24-qknorm-sliding", "gemma": "gemma-hd24-scaled-bias",
            "gemma2": "gemma2-hd24-softcap-sliding", "gemma3_text": "gemma3_text-hd24-qknorm-2rope",
            "gpt_neox": "gpt_neox-hd24", "olmo2": "olmo2-hd24-qknorm-postnorm",
            "granite": "granite-hd24-multipliers", "starcoder2": "starcoder2-hd24-bias-window4",
            "stablelm": "stablelm-hd24-qknorm-parallel",
            "smollm3": "smollm3-hd24-nope-sliding-bias", "ministral": "ministral-hd24-window4-layertypes",
            "llama-768": "llama-1024-gqa"}

YARN = {
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=START),
    "yarn-mscale-untruncated": dict(rope_type="yarn", factor=3.0, original_max_position_embeddings=START,
                                    mscale=0.7, mscale_all_dim=0.4, truncate=False, beta_fast=16, beta_slow=2),
    "yarn-attention-factor": dict(rope_type="yarn", factor=2.5, original_max_position_embeddings=START,
                                  attention_factor=0.8),
    "yarn-factor-from-lengths": dict(rope_type="yarn", factor=None, original_max_position_embeddings=START),
}
DYNAMIC = dict(rope_type="dynamic", factor=3.0)


def _fields(variant: str) -> dict:
    fields = next(f for case_id, t, f in CASES if case_id == f"{variant}-causal_lm")
    return json.loads(json.dumps(fields))  # transformers' config fills nested RoPE dicts in place: keep ours clean


def _with_rope(variant: str, rope: dict, **changes) -> dict:
    """The case's fields with ``rope`` in place of its RoPE (Gemma3: on its global layers, the sliding ones keep
    theirs), theta and partial rotary factor carried into the dict."""
    fields = _fields(variant)
    theta = fields.pop("rope_theta", None)
    fields.pop("rope_scaling", None)
    fields.update(changes)
    old = fields.get("rope_parameters") or {}
    if fields["model_type"] == "gemma3_text":  # the case's global theta; the sliding layers' rope_local_base_freq
        fields["rope_parameters"] = {"full_attention": {"rope_theta": theta, **rope},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": fields.pop("rope_local_base_freq")}}
    else:
        keep = {k: old[k] for k in ("rope_theta", "partial_rotary_factor") if k in old}
        fields["rope_parameters"] = {**keep, **rope}
    return fields


def _pair(fields: dict, impl: str = "sdpa"):
    impl = "eager" if fields["model_type"] == "gemma2" else impl  # transformers' Gemma2 has no sdpa path
    source = make_checkpoint(fields, "causal_lm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_model(source, "causal_lm", dtype=torch.float32, attn_implementation=impl).eval()
        theirs = reference_model(source, "causal_lm", impl)
    return ours, theirs


def _batch(fields: dict, lengths: tuple[int, ...], seed: int = 1) -> dict:
    ids, mask = left_padded(fields["vocab_size"], lengths, seed=seed)
    return {"input_ids": ids, "attention_mask": mask}


def _assert_logits_equal(ours, theirs, batch: dict) -> None:
    with torch.no_grad():
        a, b = ours(**batch).logits, theirs(**batch).logits
    assert torch.equal(a, b), (a - b).abs().max().item()


@pytest.mark.parametrize("rope", list(YARN))
def test_yarn_frequencies_and_attention_factor_are_transformers(rope):
    modeling_rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = quiet_transformers()
    fields = _with_rope("llama-1024-gqa", YARN[rope], max_position_embeddings=4 * START)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in fields.items() if k != "model_type"},
                                               model_type="llama")
    theirs, attention = modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config, None)
    ours = Rope.resolve(fields["rope_parameters"], None, None, 10_000.0, fields["max_position_embeddings"])
    assert ours.attention_scaling == attention
    assert torch.equal(ours.inverse_frequencies(64), theirs)


# the scalars are the family-independent part: LLaMA runs every yarn case, each other family two
YARN_CASES = [("llama", rope) for rope in YARN] + [(family, rope) for family in FAMILIES if family != "llama"
                                                  for rope in ("yarn", "yarn-mscale-untruncated")]


@pytest.mark.parametrize("family,rope", YARN_CASES)
def test_yarn_forward_equals_transformers(family, rope):
    fields = _with_rope(FAMILIES[family], YARN[rope], max_position_embeddings=4 * START)
    ours, theirs = _pair(fields)
    _assert_logits_equal(ours, theirs, _batch(fields, (2 * START + 3, START, 3)))


DYNAMIC_RUN = [(5, 3), (START + 3, 4), (2 * START, START + 1), (START + 2, 2), (6, 4), (2 * START + 1, 5)]


# the state is the backbone's, not the attention path's: three families run both paths
DYNAMIC_CASES = [(family, "sdpa") for family in FAMILIES] + [(family, "eager") for family in
                                                             ("llama", "gemma3_text", "gpt_neox")]


@pytest.mark.parametrize("family,impl", DYNAMIC_CASES)
def test_dynamic_forwards_follow_transformers_state(family, impl):
    """One model each, a run of forwards: under, past, further past, back between (the longest's frequencies stay),
    under again (the first ones back), past again."""
    fields = _with_rope(FAMILIES[family], DYNAMIC, max_position_embeddings=START)
    ours, theirs = _pair(fields, impl)
    for step, lengths in enumerate(DYNAMIC_RUN):
        _assert_logits_equal(ours, theirs, _batch(fields, lengths, seed=step))


def test_dynamic_frequencies_change_the_logits_past_the_start():
    """Past max_position_embeddings the dynamic frequencies are not the first ones (so the equalities above
    can fail), and under it they are."""
    fields = _with_rope("llama-hd24-bias-tied-llama3", DYNAMIC, max_position_embeddings=START)
    plain = {**fields, "rope_parameters": {"rope_type": "default", "rope_theta": fields["rope_parameters"].get(
        "rope_theta", 10_000.0)}}
    dynamic, _ = _pair(fields)
    default = load_model(make_checkpoint(plain, "causal_lm"), "causal_lm", dtype=torch.float32).eval()
    with torch.no_grad():
        short, long = _batch(fields, (6, 3)), _batch(fields, (2 * START, 3))
        assert torch.equal(dynamic(**short).logits, default(**short).logits)
        assert not torch.equal(dynamic(**long).logits, default(**long).logits)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "stablelm"])
def test_dynamic_generation_across_the_start_equals_transformers(family):
    """Greedy, cached: every step is a forward one token longer, so past max_position_embeddings the frequencies
    are recomputed at each step, while the cached keys keep the ones they turned with."""
    fields = _with_rope(FAMILIES[family], DYNAMIC, max_position_embeddings=START)
    ours, theirs = _pair(fields)
    ids, mask = left_padded(fields["vocab_size"], (6, 4))
    settings = dict(max_new_tokens=2 * START, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = theirs.generate(input_ids=ids, attention_mask=mask, **settings)
        got = generate_ids(ours, ids, mask, **settings)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("rope,field", [
    (dict(rope_type="yarn"), "factor"),
    (dict(rope_type="dynamic"), "factor"),
    (dict(rope_type="linear"), "factor"),
    (dict(rope_type="yarn", factor=2.0, beta_fast="32"), "beta_fast"),
    (dict(rope_type="yarn", factor=2.0, mscale=True), "mscale"),
    (dict(rope_type="yarn", factor=2.0, truncate="yes"), "truncate"),
    (dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=0), "original_max_position_embeddings"),
    (dict(rope_type="dynamic", factor="3"), "factor"),
])
def test_bad_scaling_fields_are_typed(tmp_path, rope, field):
    fields = _with_rope("llama-hd24-bias-tied-llama3", {})
    fields["rope_parameters"] = rope
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ConfigError, match=field):
        AutoConfig.from_pretrained(tmp_path)
