"""GPT-NeoX's own checks against transformers (and its tokenizer) in the same run: the RoPE fields as GPTNeoXConfig
reads them (``rotary_pct`` / ``rotary_emb_base``, the RoPE dict winning, the top-level ``rope_theta`` and
``partial_rotary_factor`` ignored, linear and llama3 on the partial dimensions), the fused ``query_key_value``'s
per-head layout, a hub-style checkpoint (Pythia's config spelling, ``embed_out``, the old attention buffers) loading
and exporting as transformers', training with every dropout on (both residual forms, tied and untied), generation
with beams and sampling, the tokenizer, and PEFT's default LoRA target. The forwards, heads, losses, caches, greedy
generation with left padding, export round trips and LoRA are in the shared tables (tests/cases/gpt_neox.py)."""

from __future__ import annotations

import copy
import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from flodl_hf import AutoTokenizer
from flodl_hf.auto import AutoConfig, load_model
from flodl_hf.core.errors import ConfigError, InputError
from flodl_hf.roundtrip.parity import check_parity, make_batch, quiet_transformers

from decoder_checks import (assert_left_padded_generate_equal, assert_rotary_equal,
                            assert_training_with_dropouts_equal, case_fields, generate_settings, with_top_level_rope)
from helpers import (  # noqa: F401  (one_thread: a fixture)
    assert_same_output, export_as_save_pretrained, left_padded, make_checkpoint, model_pair, one_thread,
    transformers_loaded)
from test_tokenizer_dirs import _done, assert_byte_level_tokenizer_equal, _write_config, byte_level_bpe, saved_dir

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = case_fields("gpt_neox-hd24")
SEQUENTIAL = case_fields("gpt_neox-hd24-sequential")
_SIZES = dict(hidden_size=96, num_attention_heads=4, num_hidden_layers=1, intermediate_size=160, vocab_size=512,
              max_position_embeddings=64)


# ---- RoPE: the fields as GPTNeoXConfig reads them ---------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5}
ROPES = {
    "defaults": {},  # 0.25 of the head, theta 10000
    "pythia": dict(rotary_pct=0.5, rotary_emb_base=5000),
    "top-level-ignored": dict(rope_theta=777.0, partial_rotary_factor=0.5),  # transformers ignores both
    "dict-wins": dict(rotary_pct=0.5, rotary_emb_base=5000,
                      rope_parameters={"rope_type": "default", "rope_theta": 3000.0, "partial_rotary_factor": 1.0}),
    "linear-scaling": dict(rotary_pct=0.5, rope_scaling={"type": "linear", "factor": 2.0}),
    "llama3": dict(rope_parameters=LLAMA3),
}


@pytest.mark.parametrize("name", list(ROPES))
@torch.inference_mode()
def test_rope_fields_turn_the_dimensions_transformers_turns(name):
    """Our rotated dimensions, inverse frequencies, cos and sin equal those of transformers' GPTNeoXRotaryEmbedding
    and GPTNeoXAttention.rotary_ndims for the same config.json fields."""
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXRotaryEmbedding

    from flodl_hf.families.gpt_neox import GPTNeoXConfig, GPTNeoXModel
    fields = {**_SIZES, **ROPES[name]}
    transformers = quiet_transformers()
    theirs = transformers.GPTNeoXConfig(**copy.deepcopy(fields))
    config = GPTNeoXConfig.from_dict({"model_type": "gpt_neox", **copy.deepcopy(fields)})
    assert config.rotary_dim == GPTNeoXAttention(theirs, 0).rotary_ndims
    assert_rotary_equal(GPTNeoXModel(config), GPTNeoXRotaryEmbedding(theirs))


@pytest.mark.parametrize("name", ["linear-scaling", "llama3", "top-level-ignored"])
def test_scaled_and_oddly_spelled_ropes_run_as_transformers(name):
    fields = {"model_type": "gpt_neox", **_SIZES, "num_hidden_layers": 2, "pad_token_id": 0, **ROPES[name]}
    source = make_checkpoint(fields, "causal_lm")
    ids, mask = left_padded(fields["vocab_size"])
    result = check_parity(source, "causal_lm", "sdpa", batch={"input_ids": ids, "attention_mask": mask})
    assert result.exact, result.diffs


@pytest.mark.parametrize("bad,field", [
    (dict(head_dim=32), "head_dim"),  # transformers' RoPE would read it, its attention not
    (dict(rope_parameters={"rope_type": "proportional", "factor": 2.0}), "rope_type"),
    (dict(rotary_pct="half"), "rotary_pct"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": None}), "partial_rotary_factor"),
    (dict(hidden_dropout=1.5), "hidden_dropout"),
    (dict(hidden_act="nope"), "hidden_act"),
])
def test_config_refuses_what_transformers_would_run_otherwise(tmp_path, bad, field):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", **_SIZES, **bad}))
    with pytest.raises(ConfigError, match=field):
        AutoConfig.from_pretrained(tmp_path)


# ---- the fused query_key_value ----------------------------------------------------------------------------------

@torch.inference_mode()
def test_query_key_value_is_laid_out_per_head():
    """q, k, v are chunked from each head's 3 * head_size slice, as GPTNeoXAttention.forward views them (a flat
    split of the 3 * hidden outputs would give other tensors)."""
    ours, theirs = model_pair(make_checkpoint(SMALL, "causal_lm"))
    hidden = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(0))
    mine = [t.transpose(1, 2) for t in ours.backbone.layers[0].attention.project(hidden, (2, 5, -1, 24))]
    qkv = theirs.gpt_neox.layers[0].attention.query_key_value(hidden)
    reference = qkv.view(2, 5, -1, 3 * 24).transpose(1, 2).chunk(3, dim=-1)
    assert all(torch.equal(a, b) for a, b in zip(mine, reference, strict=True))
    flat = [t.view(2, 5, -1, 24).transpose(1, 2) for t in qkv.split(96, dim=-1)]
    assert not torch.equal(mine[0], flat[0])


# ---- a hub-style checkpoint --------------------------------------------------------------------------------------

def _hub_style(tmp_path, lm_head_key: str = "embed_out.weight"):
    """The causal LM as Pythia's repositories hold it: config.json with rotary_pct / rotary_emb_base (no
    rope_parameters), the head as ``embed_out.weight``, every layer's old ``attention.bias`` (the causal tril),
    ``attention.masked_bias`` and ``attention.rotary_emb.inv_freq`` buffers."""
    out = with_top_level_rope(SMALL, tmp_path / "hub-pythia", "rotary_pct", "rotary_emb_base")
    state = load_file(str(make_checkpoint(SMALL, "causal_lm") / "model.safetensors"))
    assert "embed_out.weight" in state  # what transformers' save_pretrained writes
    state[lm_head_key] = state.pop("embed_out.weight")
    n = SMALL["max_position_embeddings"]
    for i in range(SMALL["num_hidden_layers"]):
        state[f"gpt_neox.layers.{i}.attention.bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
        state[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        state[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(3)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("task,lm_head_key", [("causal_lm", "embed_out.weight"), ("causal_lm", "lm_head.weight"),
                                              ("base", "embed_out.weight")])
@torch.inference_mode()
def test_hub_checkpoint_loads_as_transformers(tmp_path, task, lm_head_key):
    source = _hub_style(tmp_path, lm_head_key)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = load_model(source, task, dtype=torch.float32).eval()
    # the buffers go without a word; the bare backbone leaves the head unused, and says so
    assert [str(w.message).rpartition(": ")[2] for w in caught] == ([] if task == "causal_lm" else ["lm_head.weight"])
    theirs, info = transformers_loaded(source, task)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.endswith(("embed_out.weight", "lm_head.weight")) for k in info["unexpected_keys"]), info
    assert ours.config.rotary_dim == 6
    assert_same_output(ours, theirs, task)


def test_export_of_a_hub_checkpoint_writes_transformers_keys(tmp_path):
    written, result = export_as_save_pretrained(_hub_style(tmp_path), tmp_path)
    assert "embed_out.weight" in written and not any(k.endswith(("attention.bias", "masked_bias", "inv_freq"))
                                                     for k in written)
    config = json.loads((result.out / "config.json").read_text())
    assert config["rotary_pct"] == 0.25 and "rope_parameters" not in config  # the source's spelling, as it came


# ---- training with every dropout on -------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,impl", [(SMALL, "eager"), (SEQUENTIAL, "sdpa")], ids=["parallel", "sequential-tied"])
def test_training_with_dropouts_equals_transformers(fields, impl):
    """hidden_dropout (embeddings, both branches) and attention_dropout on: the same seed draws the same masks in
    the same order on both sides, so the loss and every gradient (the tied embed_in's two contributions included)
    are torch.equal; a model whose branch dropouts drew in another order would not be."""
    ours = assert_training_with_dropouts_equal({**fields, "hidden_dropout": 0.1, "attention_dropout": 0.1}, impl=impl)
    assert ours.config.tie_word_embeddings is fields.get("tie_word_embeddings", False)


# ---- generation -----------------------------------------------------------------------------------------------------

@generate_settings()
def test_generate_equals_transformers_with_left_padding(settings):
    assert_left_padded_generate_equal(SEQUENTIAL, "sdpa", settings)


@torch.inference_mode()
def test_token_types_are_refused():
    ours, _ = model_pair(make_checkpoint(SMALL, "causal_lm"))
    batch = make_batch(ours.config, "causal_lm")
    with pytest.raises(InputError, match="token_type_ids"):
        ours(**batch, token_type_ids=torch.zeros_like(batch["input_ids"]))


# ---- the tokenizer and the LoRA default -----------------------------------------------------------------------------

def _neox_vocab_dir():
    out, done = byte_level_bpe("gpt_neox-vocab-merges", ["<|endoftext|>", "<|padding|>"])
    if done:
        return out
    _write_config(out, "gpt_neox", pad_token_id=None)
    return _done(out)


@pytest.mark.parametrize("name", ["vocab+merges", "tokenizer.json", "pad+prefix-space"])
def test_tokenizer_equals_transformers(name):
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    from flodl_hf.tokenization import CLASS_FOR_MODEL_TYPE
    assert CLASS_FOR_MODEL_TYPE["gpt_neox"] == TOKENIZER_MAPPING_NAMES["gpt_neox"]
    plain = _neox_vocab_dir()
    directory = {"vocab+merges": plain, "tokenizer.json": saved_dir(plain, "gpt_neox-saved"),
                 "pad+prefix-space": saved_dir(plain, "gpt_neox-pad-prefix", pad_token="<|endoftext|>",
                                               add_prefix_space=True)}[name]
    transformers = quiet_transformers()
    ref = transformers.AutoTokenizer.from_pretrained(str(directory))
    ours = AutoTokenizer.from_pretrained(directory)
    assert type(ref).__name__ == "GPTNeoXTokenizer" and ours.settings.class_name == "GPTNeoXTokenizer"
    assert_byte_level_tokenizer_equal(ours, ref, name, (
        dict(padding=True), dict(padding=True, padding_side="left"), dict(truncation=True, max_length=6)))


def test_generate_texts_equal_the_text_generation_pipeline(tmp_path):
    """Pythia's tokenizer layout (tokenizer.json, ``<|padding|>`` as the pad token): the records equal the
    pipeline's, greedy, for a list of prompts (left-padded into one batch here, one at a time there)."""
    from flodl_hf.tasks.generate import generate
    from flodl_hf.tasks.runtime import clear_cache
    root = tmp_path / "model"
    shutil.copytree(make_checkpoint(SMALL, "causal_lm"), root)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(saved_dir(_neox_vocab_dir(), "gpt_neox-saved") / name, root / name)
    clear_cache()
    transformers = quiet_transformers()
    pipe = transformers.pipeline("text-generation", model=str(root), tokenizer=str(root))
    prompts = ["It was the fourth day", "Paris is"]
    ours = generate(prompts, str(root), do_sample=False, max_new_tokens=5, eos_token_id=[])
    assert ours == pipe(prompts, do_sample=False, max_new_tokens=5, eos_token_id=[])


def test_lora_default_target_is_pefts():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT

    from flodl_hf import lora
    assert lora.default_targets("gpt_neox") == list(PEFT["gpt_neox"]) == ["query_key_value"]
