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
import shutil
from dataclasses import fields as dataclass_fields

import pytest
import torch

from flodl_hf.auto import AutoConfig
from flodl_hf.errors import AdapterError, ConfigError
from flodl_hf.parity import check_parity, make_batch, quiet_transformers
from flodl_hf.registry import get_family

from cases import CASES
from helpers import (  # noqa: F401  (one_thread: a fixture)
    assert_generate_equal, assert_training_step_equal, dropout_acted, left_padded, make_checkpoint, model_pair,
    one_thread)
from test_lora import TARGETS, test_peft_round_trip_and_training_step as peft_round_trip
from test_tokenizer import compare
from test_tokenizer_dirs import PAIRS, SAMPLES, _done, _write_config, byte_level_bpe, saved_dir

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = {case_id: fields for case_id, _task, fields in CASES}
STARCODER2 = FIELDS["starcoder2-hd24-bias-window4-causal_lm"]
STARCODER2_PLAIN = FIELDS["starcoder2-hd24-nobias-untied-causal_lm"]
STABLELM = FIELDS["stablelm-hd24-qknorm-parallel-causal_lm"]
STABLELM_SEQ = FIELDS["stablelm-hd24-sequential-causal_lm"]
_SIZES = dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
              intermediate_size=160, vocab_size=512, max_position_embeddings=64)






@pytest.mark.parametrize("model_type", ["starcoder2", "stablelm"])
def test_config_defaults_are_transformers(model_type):
    """Every field both configs have, at its default (a config.json that leaves it out means the same)."""
    theirs = quiet_transformers().AutoConfig.for_model(model_type)
    ours = get_family(model_type).config_class()
    skip = {"raw", "attn_implementation", "id2label", "label2id", "rope_parameters", "rope_scaling", "rope_theta",
            "partial_rotary_factor"}  # RoPE as transformers fills it in: compared below
    names = [f.name for f in dataclass_fields(ours) if f.name not in skip and hasattr(theirs, f.name)]
    own = {"starcoder2": {"norm_epsilon", "use_bias", "residual_dropout", "embedding_dropout", "sliding_window"},
           "stablelm": {"layer_norm_eps", "use_qkv_bias", "qk_layernorm", "use_parallel_residual", "hidden_dropout"}}
    assert {"vocab_size", "num_key_value_heads", "tie_word_embeddings", "eos_token_id"} | own[model_type] <= set(names)
    for name in names:
        value = getattr(ours, name)
        assert getattr(value, "value", value) == getattr(theirs, name), name
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
    rotary = StableLmRotaryEmbedding(theirs)
    ours = StableLmModel(config)
    assert torch.equal(ours.inverse_frequencies(None, torch.device("cpu")), rotary.inv_freq)
    positions = torch.arange(40).unsqueeze(0)
    hidden = torch.zeros(1, 40, 96)
    for a, b in zip(ours.rotary(None, positions, hidden), rotary(hidden, positions), strict=True):
        assert torch.equal(a, b)


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
    (FIELDS["stablelm-hd24-qknorm-parallel-tokcls"], "tokcls", "sdpa"),  # no hidden_dropout given: 0.0, not 0.1
]


@pytest.mark.parametrize("fields,task,impl", TRAINING,
                         ids=["starcoder2-window", "starcoder2-plain", "stablelm-parallel", "stablelm-sequential",
                              "stablelm-tokcls"])
def test_training_with_dropouts_equals_transformers(fields, task, impl):
    """The same seed draws the same masks in the same order on both sides, so the loss and every gradient (tied
    embeddings' two contributions included) are torch.equal; and the dropouts did act."""
    source = make_checkpoint(fields, task)
    ours, theirs = model_pair(source, task, impl)
    ids, mask = left_padded(ours.config.vocab_size, low=3)
    labels = ids.masked_fill(mask == 0, -100) if task == "causal_lm" else (ids % 3).masked_fill(mask == 0, -100)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    loss = assert_training_step_equal(ours, theirs, batch)
    assert dropout_acted(ours, batch, loss) == (task == "causal_lm")  # the token classifier's dropout is hidden_dropout's 0.0


# ---- generation ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [STARCODER2, STABLELM_SEQ], ids=["starcoder2-window", "stablelm-sequential"])
@pytest.mark.parametrize("settings", [dict(num_beams=3, early_stopping=True),
                                      dict(do_sample=True, top_k=20, temperature=0.7)], ids=["beams", "sampled"])
@torch.inference_mode()
def test_generate_equals_transformers_with_left_padding(fields, settings):
    """Past StarCoder2's window of 4 (the cache keeps the last 3 tokens per layer) and StableLM's partial RoPE."""
    ours, theirs = model_pair(make_checkpoint(fields, "causal_lm"), impl="sdpa")
    ids, mask = left_padded(ours.config.vocab_size, low=3)
    assert_generate_equal(ours, theirs, ids, mask, **settings)


# ---- the tokenizer and LoRA ------------------------------------------------------------------------------------------

def _tokenizer_dir(model_type: str, tmp_path):
    """A byte-level BPE tokenizer.json whose tokenizer_config.json names no class: transformers picks it from
    config.json's model_type (TOKENIZER_MAPPING_NAMES)."""
    plain, done = byte_level_bpe("starcoder2-stablelm-vocab-merges", ["<|endoftext|>", "<|pad|>"])
    if not done:
        _write_config(plain, "gpt2", pad_token_id=None)
        plain = _done(plain)
    saved = saved_dir(plain, "starcoder2-stablelm-saved", tokenizer_class=None, pad_token="<|pad|>")
    root = tmp_path / model_type
    shutil.copytree(saved, root)
    _write_config(root, model_type, pad_token_id=1)
    return root


@pytest.mark.parametrize("model_type,class_name", [("starcoder2", "GPT2Tokenizer"),
                                                   ("stablelm", "TokenizersBackend")])
def test_tokenizer_class_from_the_model_type(model_type, class_name, tmp_path):
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    from flodl_hf.tokenizer import CLASS_FOR_MODEL_TYPE, AutoTokenizer
    assert CLASS_FOR_MODEL_TYPE[model_type] == TOKENIZER_MAPPING_NAMES[model_type] == class_name
    root = _tokenizer_dir(model_type, tmp_path)
    assert "tokenizer_class" not in json.loads((root / "tokenizer_config.json").read_text())
    ref = quiet_transformers().AutoTokenizer.from_pretrained(str(root))
    ours = AutoTokenizer.from_pretrained(root)
    assert type(ref).__name__ == class_name == ours.settings.class_name
    assert ours.get_vocab() == ref.get_vocab() and ours.pad_token_id == ref.pad_token_id
    extra = dict(return_offsets_mapping=True, return_special_tokens_mask=True)
    compare(ours, ref, model_type, SAMPLES, padding=True, **extra)
    questions, contexts = map(list, zip(*PAIRS))
    compare(ours, ref, f"{model_type} pairs", questions, contexts, padding=True, **extra)


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
