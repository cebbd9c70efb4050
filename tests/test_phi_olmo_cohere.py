"""Phi's, OLMo's and Cohere's own checks against transformers 5.25 in the same run: the config defaults, Phi's RoPE
fields as PhiConfig reads them (the partial factor and theta in the dict or at the top level), what each config
refuses, each family-specific option shown to change the logits (so the parity tables would catch its loss), Cohere's
interleaved cos and sin, training with every dropout on, a Hub-style
Phi checkpoint (top-level RoPE fields) loaded and exported as ``save_pretrained`` writes it (a tied head keeps its
bias), generation with beams and sampling, LoRA both ways with PEFT on the causal LM, and the tokenizer class read
from the model type. The forwards on both paths, every head, the losses, caches, greedy generation with left padding,
dtype casts, gradients and export round trips are in the shared tables (tests/cases/phi.py, olmo.py, cohere.py);
a given cache returned without ``use_cache`` is in tests/test_decoder.py, for every decoder."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from flodl_hf.auto import AutoConfig, load_model
from flodl_hf.core.errors import AdapterError, ConfigError
from flodl_hf.roundtrip.parity import check_parity, make_batch, quiet_transformers

from decoder_checks import (assert_left_padded_generate_equal, assert_rotary_equal,
                            assert_tokenizer_class_from_the_model_type, assert_training_with_dropouts_equal,
                            byte_level_tokenizer_dir, case_fields, generate_settings,
                            with_top_level_rope)
from helpers import (  # noqa: F401  (one_thread: a fixture)
    assert_config_defaults_equal, assert_same_output, export_as_save_pretrained, left_padded, make_checkpoint,
    model_pair, one_thread, transformers_loaded)
from test_lora import TARGETS, test_peft_round_trip_and_training_step as peft_round_trip

pytestmark = pytest.mark.usefixtures("one_thread")

PHI = case_fields("phi-hd24-qknorm")
PHI_TIED = case_fields("phi-hd24-plain-tied")
OLMO = case_fields("olmo-hd24-clip-bias")
OLMO_TIED = case_fields("olmo-hd24-noclip-tied")
COHERE = case_fields("cohere-hd24-qknorm-bias")
COHERE_PLAIN = case_fields("cohere-hd24-plain-untied")
_SIZES = dict(hidden_size=96, num_attention_heads=4, num_hidden_layers=1, intermediate_size=160, vocab_size=512,
              max_position_embeddings=64)
OWN = {"phi": {"resid_pdrop", "embd_pdrop", "layer_norm_eps", "qk_layernorm", "hidden_act"},
       "olmo": {"clip_qkv", "attention_bias", "pad_token_id", "eos_token_id"},
       "cohere": {"logit_scale", "layer_norm_eps", "use_qk_norm", "tie_word_embeddings", "bos_token_id"}}


@pytest.mark.parametrize("model_type", ["phi", "olmo", "cohere"])
def test_config_defaults_are_transformers(model_type):
    """Every field both configs have, at its default (a config.json that leaves it out means the same)."""
    ours, theirs, _ = assert_config_defaults_equal(  # RoPE and the KV heads as transformers fills them in: below
        model_type, {"rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "num_key_value_heads"},
        {"vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"} | OWN[model_type])
    assert ours.kv_heads == theirs.num_key_value_heads
    assert ours.rope().theta == theirs.rope_parameters["rope_theta"]
    assert ours.rotary_dim == int(ours.attention_head_dim * theirs.rope_parameters.get("partial_rotary_factor", 1.0))


# ---- Phi's RoPE fields and what the configs refuse -------------------------------------------------------------------

ROPES = {
    "defaults": {},  # 0.5 of the head, theta 10000
    "top-level": dict(partial_rotary_factor=0.25, rope_theta=5000.0),  # the Hub's Phi-1 / Phi-2 spelling
    "dict-wins": dict(partial_rotary_factor=0.25, rope_theta=5000.0,
                      rope_parameters={"rope_type": "default", "rope_theta": 3000.0, "partial_rotary_factor": 1.0}),
    "dict-without-factor": dict(partial_rotary_factor=0.25, rope_parameters={"rope_type": "default"}),
    "linear-scaling": dict(rope_scaling={"type": "linear", "factor": 2.0}),
}


@pytest.mark.parametrize("name", list(ROPES))
@torch.inference_mode()
def test_phi_rope_fields_turn_the_dimensions_transformers_turns(name):
    """Our rotated dimensions, inverse frequencies, cos and sin equal PhiRotaryEmbedding's and PhiAttention's
    rotary_ndims for the same config.json fields."""
    from transformers.models.phi.modeling_phi import PhiAttention, PhiRotaryEmbedding

    from flodl_hf.families.phi import PhiConfig, PhiModel
    fields = {**_SIZES, **ROPES[name]}
    theirs = quiet_transformers().PhiConfig(**copy.deepcopy(fields))
    config = PhiConfig.from_dict({"model_type": "phi", **copy.deepcopy(fields)})
    assert config.rotary_dim == PhiAttention(theirs, 0).rotary_ndims
    assert_rotary_equal(PhiModel(config), PhiRotaryEmbedding(theirs))


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}], ids=["default", "linear"])
@torch.inference_mode()
def test_cohere_interleaved_cos_and_sin_are_transformers(scaling):
    """CohereRotaryEmbedding doubles the frequencies with repeat_interleave (LLaMA's cat would fail here)."""
    from transformers.models.cohere.modeling_cohere import CohereRotaryEmbedding

    from flodl_hf.families.cohere import CohereConfig, CohereModel
    fields = {**_SIZES, **({"rope_parameters": scaling} if scaling else {})}
    assert_rotary_equal(CohereModel(CohereConfig.from_dict({"model_type": "cohere", **copy.deepcopy(fields)})),
                        CohereRotaryEmbedding(quiet_transformers().CohereConfig(**copy.deepcopy(fields))))


@pytest.mark.parametrize("model_type,bad,field", [
    ("phi", dict(partial_rotary_factor=0.3), "partial_rotary_factor"),  # 7 dimensions: transformers fails
    ("phi", dict(partial_rotary_factor=None), "partial_rotary_factor"),
    ("phi", dict(head_dim=32, qk_layernorm=True), "head_dim"),  # its norms are hidden / heads wide
    ("phi", dict(hidden_act="gelu_10"), "hidden_act"),
    ("phi", dict(resid_pdrop=1.5), "resid_pdrop"),
    ("olmo", dict(clip_qkv=-1.0), "clip_qkv"),
    ("olmo", dict(clip_qkv="8"), "clip_qkv"),
    ("olmo", dict(num_key_value_heads=3), "num_key_value_heads"),
    ("cohere", dict(logit_scale=None), "logit_scale"),
    ("cohere", dict(layer_norm_eps=None), "layer_norm_eps"),
])
def test_config_refuses_what_transformers_would_not_run_so(tmp_path, model_type, bad, field):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **_SIZES, **bad}))
    with pytest.raises(ConfigError, match=field):
        AutoConfig.from_pretrained(tmp_path)


def test_phi_runs_a_head_dim_of_its_own_as_transformers():
    """Without q/k norms a config.json ``head_dim`` is read (q, k, v 4 x 32 wide from hidden 96), as transformers."""
    fields = {"model_type": "phi", **_SIZES, "head_dim": 32, "pad_token_id": 0}
    ids, mask = left_padded(fields["vocab_size"], low=3)
    result = check_parity(make_checkpoint(fields, "causal_lm"), "causal_lm", "eager",
                          batch={"input_ids": ids, "attention_mask": mask})
    assert result.exact, result.diffs


# ---- each option acts ------------------------------------------------------------------------------------------------

OPTIONS = [(PHI, "qk_layernorm", False), (OLMO, "clip_qkv", None), (COHERE, "use_qk_norm", False),
           (COHERE, "logit_scale", 1.0)]


@pytest.mark.parametrize("fields,name,off", OPTIONS, ids=[f"{f['model_type']}-{n}" for f, n, _ in OPTIONS])
@torch.inference_mode()
def test_each_option_changes_the_logits(fields, name, off):
    """With the option turned off on our side only (its weights, if any, left unused), the logits leave
    transformers': the parity tables would fail if that op were dropped."""
    source = make_checkpoint(fields, "causal_lm")
    ours, theirs = model_pair(source, impl="eager")
    batch = {**make_batch(ours.config, "causal_lm"), "use_cache": False}
    reference = theirs(**batch).logits
    assert torch.equal(ours(**batch).logits, reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the q/k norms' weights, unused without them
        plain = load_model(source, "causal_lm", dtype=torch.float32, attn_implementation="eager", **{name: off}).eval()
    assert getattr(plain.config, name) == off
    assert not torch.equal(plain(**batch).logits, reference), name


# ---- training with every dropout on ----------------------------------------------------------------------------------

TRAINING = [
    (dict(PHI, resid_pdrop=0.1, embd_pdrop=0.1, attention_dropout=0.1), "causal_lm", "eager", True),
    (dict(PHI_TIED, resid_pdrop=0.1, embd_pdrop=0.1, attention_dropout=0.1), "causal_lm", "sdpa", True),
    (case_fields("phi-hd24-qknorm", "tokcls"), "tokcls", "sdpa", True),  # GenericForTokenClassification's 0.1
    (dict(OLMO, attention_dropout=0.1), "causal_lm", "sdpa", True),  # clamped q, k, v: zero gradients there
    (dict(COHERE, attention_dropout=0.1), "causal_lm", "eager", True),  # tied, scaled logits
    (COHERE_PLAIN, "causal_lm", "sdpa", False),
]


@pytest.mark.parametrize("fields,task,impl,dropout", TRAINING,
                         ids=["phi-qknorm", "phi-tied", "phi-tokcls", "olmo-clip", "cohere-qknorm", "cohere-plain"])
def test_training_step_equals_transformers(fields, task, impl, dropout):
    """The same seed draws the same masks in the same order on both sides, so the loss and every gradient (tied
    embeddings' two contributions included) are torch.equal; and the dropouts did act."""
    assert_training_with_dropouts_equal(fields, task, impl, low=3, dropout=dropout)


# ---- a Hub-style Phi checkpoint, and export --------------------------------------------------------------------------

def _hub_style(tmp_path, fields: dict):
    """The causal LM as Phi-2's repository spells its config: ``partial_rotary_factor`` and ``rope_theta`` at the top
    level, no ``rope_parameters``."""
    return with_top_level_rope(fields, tmp_path / "hub-phi", "partial_rotary_factor", "rope_theta")


@pytest.mark.parametrize("fields", [PHI, PHI_TIED], ids=["untied", "tied"])
@torch.inference_mode()
def test_hub_phi_loads_and_exports_as_transformers(tmp_path, fields):
    """transformers loads the same files with nothing missing or unexpected; the outputs equal; the export writes
    save_pretrained's keys (a tied head: ``lm_head.bias`` kept, ``lm_head.weight`` left out), the source's RoPE
    spelling, and verifies at diff 0."""
    source = _hub_style(tmp_path, fields)
    ours = load_model(source, "causal_lm", dtype=torch.float32).eval()
    theirs, info = transformers_loaded(source, "causal_lm")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert ours.config.rotary_dim == (12 if fields is PHI else 6)
    assert_same_output(ours, theirs, "causal_lm")
    written, result = export_as_save_pretrained(source, tmp_path)
    assert "lm_head.bias" in written and ("lm_head.weight" in written) == (fields is PHI)
    config = json.loads((result.out / "config.json").read_text())
    assert "rope_parameters" not in config and config["partial_rotary_factor"] == (0.5 if fields is PHI else 0.25)


@pytest.mark.parametrize("fields", [OLMO_TIED, COHERE], ids=["olmo-tied", "cohere-tied"])
def test_tied_export_writes_save_pretrained_keys(tmp_path, fields):
    written, _ = export_as_save_pretrained(make_checkpoint(fields, "causal_lm"), tmp_path)
    assert "lm_head.weight" not in written and "model.embed_tokens.weight" in written
    if fields is OLMO_TIED:  # the parameter-free LayerNorms write nothing
        assert not any("layernorm" in key or key.startswith("model.norm") for key in written)


# ---- generation ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,impl", [(PHI, "sdpa"), (OLMO, "eager"), (COHERE, "sdpa")],
                         ids=["phi", "olmo", "cohere"])
@generate_settings()
def test_generate_equals_transformers_with_left_padding(fields, impl, settings):
    assert_left_padded_generate_equal(fields, impl, settings, low=3, model_generate=True)


# ---- the tokenizer and LoRA ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type,class_name", [("phi", "GPT2Tokenizer"), ("olmo", "GPTNeoXTokenizer"),
                                                   ("cohere", "CohereTokenizer")])
def test_tokenizer_class_from_the_model_type(model_type, class_name, tmp_path):
    root = byte_level_tokenizer_dir("starcoder2-stablelm", model_type, tmp_path)
    assert_tokenizer_class_from_the_model_type(root, model_type, class_name)


@pytest.mark.parametrize("fields", [PHI, OLMO, COHERE], ids=["phi", "olmo", "cohere"])
def test_lora_on_the_causal_lm_both_ways_with_peft(fields, tmp_path):
    """test_lora's round trip (PEFT's adapter in, a training step, ours out to PEFT, merged) on the causal LM, every
    linear layer targeted (test_lora's table runs the sequence classifiers); the default targets are PEFT's: q_proj,
    v_proj, fc1 and fc2 for Phi, none for OLMo and Cohere (a typed refusal, as PEFT raises)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT

    from flodl_hf import lora
    model_type = fields["model_type"]
    peft_round_trip("causal_lm", fields, TARGETS[model_type][1], 8, True, tmp_path)
    if model_type in PEFT:
        assert lora.default_targets(model_type) == list(PEFT[model_type]) == ["q_proj", "v_proj", "fc1", "fc2"]
    else:
        with pytest.raises(AdapterError, match="target_modules"):
            lora.default_targets(model_type)
