"""OLMo 2's and Granite's own checks against transformers 5.24 in the same run: the config defaults, each Granite
multiplier shown to change the logits (so the parity tables would catch its loss), Granite's embedding multiplier
on given ``inputs_embeds``, sampled and greedy ``model.generate``, LoRA both ways with PEFT on the causal LM (PEFT
has no default targets for either), and the tokenizer class read from the model type. The forwards on both paths,
every head, the losses, caches, dtype casts, gradients and export round trips are in the shared tables
(tests/cases/olmo2.py, tests/cases/granite.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.core.errors import AdapterError, ConfigError
from flodl_hf.roundtrip.parity import make_batch

from decoder_checks import assert_tokenizer_class_from_the_model_type, byte_level_tokenizer_dir, case_fields, case_pair
from helpers import assert_config_defaults_equal, assert_model_generate_equal, make_checkpoint
from test_decoder import _left_padded
from test_lora import TARGETS, test_peft_round_trip_and_training_step as peft_round_trip

OLMO2, GRANITE = "olmo2-hd24-qknorm-postnorm", "granite-hd24-multipliers"
MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


@pytest.mark.parametrize("model_type", ["olmo2", "granite"])
def test_config_defaults_are_transformers(model_type):
    """Every field both configs have, at its default (a config.json that leaves it out means the same)."""
    ours, theirs, names = assert_config_defaults_equal(  # RoPE and the KV heads as transformers fills them in: below
        model_type, {"rope_parameters", "rope_scaling", "rope_theta", "num_key_value_heads"},
        {"vocab_size", "rms_norm_eps", "pad_token_id", "eos_token_id", "attention_bias"})
    assert ours.kv_heads == theirs.num_key_value_heads
    assert ours.rope().theta == theirs.rope_parameters["rope_theta"]
    if model_type == "granite":
        assert set(MULTIPLIERS) <= set(names)


@pytest.mark.parametrize("name", MULTIPLIERS)
def test_each_granite_multiplier_changes_the_logits(name):
    """With one multiplier set back to 1 on our side only, the logits leave transformers': the parity tables'
    Granite case would fail if that op were dropped."""
    ours, theirs = case_pair(GRANITE)
    batch = {**make_batch(ours.config, "causal_lm"), "use_cache": False}
    with torch.inference_mode():
        reference = theirs(**batch).logits
        assert torch.equal(ours(**batch).logits, reference)
        plain, _ = case_pair(GRANITE, **{name: 1.0})
        assert getattr(plain.config, name) == 1.0
        assert not torch.equal(plain(**batch).logits, reference), name


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_granite_scales_given_inputs_embeds(impl):
    """GraniteModel.forward multiplies ``inputs_embeds`` whether looked up or given; the hidden states start
    from the scaled ones."""
    ours, theirs = case_pair(GRANITE, impl)
    batch = make_batch(ours.config, "causal_lm")
    embeds = torch.randn(*batch["input_ids"].shape, ours.config.hidden_size, generator=torch.Generator().manual_seed(3))
    kwargs = dict(inputs_embeds=embeds, attention_mask=batch["attention_mask"], use_cache=False,
                  output_hidden_states=True)
    with torch.inference_mode():
        a, b = ours(**kwargs), theirs(**kwargs)
    assert torch.equal(a.logits, b.logits)
    assert len(a.hidden_states) == len(b.hidden_states)
    assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states))
    assert torch.equal(a.hidden_states[0], embeds * 12.0)


@pytest.mark.parametrize("variant,impl", [(OLMO2, "sdpa"), (GRANITE, "eager")])
def test_model_generate_greedy_and_sampled_equal_transformers(variant, impl):
    """``model.generate`` on a left-padded batch: greedy, and sampled from the same seed (Granite's logits
    scaling and the temperature both reshape the distribution drawn from)."""
    ours, theirs = case_pair(variant, impl)
    ids, mask = _left_padded(ours.config.vocab_size)
    settings = [dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
                dict(do_sample=True, top_k=0)]
    for kwargs in settings:
        assert_model_generate_equal(ours, theirs, ids, mask, **kwargs)


@pytest.mark.parametrize("variant", [OLMO2, GRANITE])
def test_lora_on_the_causal_lm_both_ways_with_peft(variant, tmp_path):
    """test_lora's round trip (PEFT's adapter in, a training step, ours out to PEFT, merged) on the causal LM, every
    projection targeted; test_lora's table runs OLMo 2's seqcls. Without target_modules both refuse, as PEFT."""
    fields = case_fields(variant)
    peft_round_trip("causal_lm", fields, TARGETS[fields["model_type"]][1], 8, True, tmp_path)
    from flodl_hf import lora
    with pytest.raises(AdapterError, match="target_modules"):
        lora.default_targets(fields["model_type"])


@pytest.mark.parametrize("model_type", ["olmo2", "granite"])
def test_tokenizer_class_from_the_model_type(model_type, tmp_path):
    """TOKENIZER_MAPPING_NAMES: TokenizersBackend for both."""
    root = byte_level_tokenizer_dir("olmo2-granite", model_type, tmp_path)
    assert_tokenizer_class_from_the_model_type(root, model_type, "TokenizersBackend")


def test_granite_refuses_a_zero_logits_scaling(tmp_path):
    root = tmp_path / "granite"
    shutil.copytree(make_checkpoint(case_fields(GRANITE), "causal_lm"), root)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "logits_scaling": 0}))
    with pytest.raises(ConfigError, match="logits_scaling"):
        load_model(root, "causal_lm")
