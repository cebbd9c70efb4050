"""StarCoder2's and StableLM's own checks against transformers 5.24 in the same run: the config defaults, StableLM's
RoPE fields as StableLmConfig reads them (the partial factor and theta in the dict or at the top level, linear and
llama3 on the partial dimensions), what StableLM's config refuses, training with every dropout on (StarCoder2's
embedding, residual and attention dropouts; StableLM's hidden dropout on both residual forms), StableLM's token
classifier dropout (its config's ``hidden_dropout``), the per-head q/k LayerNorms shown to act, generation with
beams and sampling, the tokenizer class read from the model type, and LoRA (PEFT's default for StableLM, none for
StarCoder2). The forwards on both paths, every head, the losses, caches, greedy generation with left padding,
dtype casts, gradients and export round trips are in the shared tables (tests/cases/starcoder2.py, stablelm.py)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from flodl_hf.auto import AutoConfig
from flodl_hf.core.errors import AdapterError, ConfigError
from flodl_hf.roundtrip.parity import check_parity, make_batch, quiet_transformers

from decoder_checks import (assert_left_padded_generate_equal, assert_rotary_equal,
                            assert_tokenizer_class_from_the_model_type, assert_training_with_dropouts_equal,
                            byte_level_tokenizer_dir, case_fields, generate_settings)
from helpers import (  # noqa: F401  (one_thread: a fixture)
    assert_config_defaults_equal, left_padded, make_checkpoint, model_pair, one_thread)
from test_lora import TARGETS, test_peft_round_trip_and_training_step as peft_round_trip

pytestmark = pytest.mark.usefixtures("one_thread")

STARCODER2 = case_fields("starcoder2-hd24-bias-window4")
STARCODER2_PLAIN = case_fields("starcoder2-hd24-nobias-untied")
STABLELM = case_fields("stablelm-hd24-qknorm-parallel")
STABLELM_SEQ = case_fields("stablelm-hd24-sequential")
_SIZES = dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
              intermediate_size=160, vocab_size=512, max_position_embeddings=64)


@pytest.mark.parametrize("model_type", ["starcoder2", "stablelm"])
def test_config_defaults_are_transformers(model_type):
    """Every field both configs have, at its default (a config.json that leaves it out means the same)."""
    own = {"starcoder2": {"norm_epsilon", "use_bias", "residual_dropout", "embedding_dropout", "sliding_window"},
           "stablelm": {"layer_norm_eps", "use_qkv_bias", "qk_layernorm", "use_parallel_residual", "hidden_dropout"}}
    ours, theirs, _ = assert_config_defaults_equal(  # RoPE as transformers fills it in: compared below
        model_type, {"rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"},
        {"vocab_size", "num_key_value_heads", "tie_word_embeddings", "eos_token_id"} | own[model_type])
    assert ours.rope().theta == theirs.rope_parameters["rope_theta"]
    assert ours.rotary_dim == int(ours.attention_head_dim * theirs.rope_parameters.get("partial_rotary_factor", 1.0))


# ---- StableLM's RoPE fields ------------------------------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5}
ROPES = {
    "defaults": {},  # 0.25 of the head, theta 10000
    "top-level": dict(partial_rotary_factor=0.5, rope_theta=5000.0),  # StableLM-3B / StableLM 2's spelling
    "dict-wins": dict(partial_rotary_factor=0.5, rope_theta=5000.0,
                      rope_parameters={"rope_type": "default", "rope_theta": 3000.0, "partial_rotary_factor": 1.0}),
    "dict-without-factor": dict(partial_rotary_factor=0.5, rope_parameters={"rope_type": "default"}),
    "linear-scaling": dict(partial_rotary_factor=0.5, rope_scaling={"type": "linear", "factor": 2.0}),
    "llama3": dict(rope_parameters=LLAMA3),
}


@pytest.mark.parametrize("name", list(ROPES))
@torch.inference_mode()
def test_stablelm_rope_fields_turn_the_dimensions_transformers_turns(name):
    """Our rotated dimensions, inverse frequencies, cos and sin equal those of StableLmRotaryEmbedding and
    StableLmAttention.rotary_ndims for the same config.json fields."""
    from transformers.models.stablelm.modeling_stablelm import StableLmAttention, StableLmRotaryEmbedding

    from flodl_hf.families.stablelm import StableLmConfig, StableLmModel
    fields = {**_SIZES, **ROPES[name]}
    theirs = quiet_transformers().StableLmConfig(**copy.deepcopy(fields))
    config = StableLmConfig.from_dict({"model_type": "stablelm", **copy.deepcopy(fields)})
    assert config.rotary_dim == StableLmAttention(theirs, 0).rotary_ndims
    assert_rotary_equal(StableLmModel(config), StableLmRotaryEmbedding(theirs))


@pytest.mark.parametrize("name", ["linear-scaling", "llama3", "dict-wins"])
def test_stablelm_scaled_ropes_run_as_transformers(name):
    fields = {"model_type": "stablelm", **_SIZES, "num_hidden_layers": 2, "pad_token_id": 0, "qk_layernorm": True,
              **ROPES[name]}
    source = make_checkpoint(fields, "causal_lm")
    ids, mask = left_padded(fields["vocab_size"], low=3)
    result = check_parity(source, "causal_lm", "sdpa", batch={"input_ids": ids, "attention_mask": mask})
    assert result.exact, result.diffs


@pytest.mark.parametrize("bad,field", [
    (dict(head_dim=32), "head_dim"),  # transformers' RoPE would read it, its attention not
    (dict(partial_rotary_factor=0.3), "partial_rotary_factor"),  # 7 dimensions: transformers fails at the forward
    (dict(partial_rotary_factor=None), "partial_rotary_factor"),
    (dict(rope_parameters={"rope_type": "proportional", "factor": 2.0}), "rope_type"),
    (dict(hidden_dropout=1.5), "hidden_dropout"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
])
def test_stablelm_config_refuses_what_transformers_would_not_run_so(tmp_path, bad, field):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "stablelm", **_SIZES, **bad}))
    with pytest.raises(ConfigError, match=field):
        AutoConfig.from_pretrained(tmp_path)


@torch.inference_mode()
def test_stablelm_per_head_norms_act_and_are_transformers():
    """k_layernorm has one norm per KV head (2 here), q_layernorm one per query head; putting one head's weight
    back to ones on both sides changes the logits, and both sides still agree."""
    ours, theirs = model_pair(make_checkpoint(STABLELM, "causal_lm"), impl="eager")
    attention = ours.model.layers[0].self_attn
    assert len(attention.q_layernorm.norms) == 4 and len(attention.k_layernorm.norms) == 2
    assert all(n.bias is None for n in attention.k_layernorm.norms)
    batch = {**make_batch(ours.config, "causal_lm"), "use_cache": False}
    before = ours(**batch).logits
    assert torch.equal(before, theirs(**batch).logits)
    for model in (ours, theirs):
        model.model.layers[0].self_attn.k_layernorm.norms[1].weight.fill_(1.0)
    after = ours(**batch).logits
    assert not torch.equal(after, before)
    assert torch.equal(after, theirs(**batch).logits)


# ---- training with every dropout on ----------------------------------------------------------------------------------

TRAINING = [
    (dict(STARCODER2, embedding_dropout=0.1, residual_dropout=0.1, attention_dropout=0.1), "causal_lm", "eager"),
    (dict(STARCODER2_PLAIN, embedding_dropout=0.1, residual_dropout=0.1, attention_dropout=0.1), "causal_lm", "sdpa"),
    (dict(STABLELM, hidden_dropout=0.1, attention_dropout=0.1), "causal_lm", "sdpa"),
    (dict(STABLELM_SEQ, hidden_dropout=0.1, attention_dropout=0.1), "causal_lm", "eager"),
    (case_fields("stablelm-hd24-qknorm-parallel", "tokcls"), "tokcls", "sdpa"),  # no hidden_dropout given: 0.0, not 0.1
]


@pytest.mark.parametrize("fields,task,impl", TRAINING,
                         ids=["starcoder2-window", "starcoder2-plain", "stablelm-parallel", "stablelm-sequential",
                              "stablelm-tokcls"])
def test_training_with_dropouts_equals_transformers(fields, task, impl):
    """The same seed draws the same masks in the same order on both sides, so the loss and every gradient (tied
    embeddings' two contributions included) are torch.equal; and the dropouts did act (none in the token classifier,
    whose dropout is hidden_dropout's 0.0)."""
    assert_training_with_dropouts_equal(fields, task, impl, low=3, dropout=task == "causal_lm")


# ---- generation ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [STARCODER2, STABLELM_SEQ], ids=["starcoder2-window", "stablelm-sequential"])
@generate_settings()
def test_generate_equals_transformers_with_left_padding(fields, settings):
    """Past StarCoder2's window of 4 (the cache keeps the last 3 tokens per layer) and StableLM's partial RoPE."""
    assert_left_padded_generate_equal(fields, "sdpa", settings, low=3)


# ---- the tokenizer and LoRA ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type,class_name", [("starcoder2", "GPT2Tokenizer"),
                                                   ("stablelm", "TokenizersBackend")])
def test_tokenizer_class_from_the_model_type(model_type, class_name, tmp_path):
    root = byte_level_tokenizer_dir("starcoder2-stablelm", model_type, tmp_path)
    assert_tokenizer_class_from_the_model_type(root, model_type, class_name)


@pytest.mark.parametrize("fields", [STARCODER2, STABLELM], ids=["starcoder2", "stablelm"])
def test_lora_on_the_causal_lm_both_ways_with_peft(fields, tmp_path):
    """test_lora's round trip (PEFT's adapter in, a training step, ours out to PEFT, merged) on the causal LM, every
    projection targeted (test_lora's table runs the sequence classifiers); the default targets are PEFT's: q_proj and
    v_proj for StableLM, none for StarCoder2 (a typed refusal, as PEFT raises)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT

    from flodl_hf import lora
    model_type = fields["model_type"]
    peft_round_trip("causal_lm", fields, TARGETS[model_type][1], 8, True, tmp_path)
    if model_type in PEFT:
        assert lora.default_targets(model_type) == list(PEFT[model_type]) == ["q_proj", "v_proj"]
    else:
        with pytest.raises(AdapterError, match="target_modules"):
            lora.default_targets(model_type)
