"""Checks the decoder families' own test files share: each decoder's narrow variant and a variant's case fields and
model pair, a training step with the dropouts on over a left-padded batch, generation on one, and the tokenizer
class read from the model type. Each compares against transformers in the same run (tests/helpers.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flodl_hf.roundtrip.parity import quiet_transformers

from cases import CASES
from helpers import (assert_generate_equal, assert_model_generate_equal, assert_training_step_equal, dropout_acted,
                     left_padded, make_checkpoint, model_pair)

# each decoder family's narrow variant (head_dim 24), every head it has in tests/cases
NARROW = {"llama": "llama-hd24-bias-tied-llama3", "mistral": "mistral-hd24-window4", "qwen2": "qwen2-hd24-sliding",
          "qwen3": "qwen3-hd24-qknorm-sliding", "phi3": "phi3-hd24-partial-window4",
          "gemma": "gemma-hd24-scaled-bias", "gemma2": "gemma2-hd24-softcap-sliding",
          "gemma3_text": "gemma3_text-hd24-qknorm-2rope", "gpt2": "gpt2-hd24",
          "gpt_neox": "gpt_neox-hd24", "olmo2": "olmo2-hd24-qknorm-postnorm", "granite": "granite-hd24-multipliers",
          "starcoder2": "starcoder2-hd24-bias-window4", "stablelm": "stablelm-hd24-qknorm-parallel",
          "gptj": "gptj-hd24", "opt": "opt-hd24", "mixtral": "mixtral-hd24-4experts-top2",
          "qwen2_moe": "qwen2_moe-hd24-4experts-norm-dense1",
          "qwen3_moe": "qwen3_moe-hd24-4experts-norm-bias-dense1", "olmoe": "olmoe-hd24-4experts-norm-bias",
          "phi": "phi-hd24-qknorm", "olmo": "olmo-hd24-clip-bias", "cohere": "cohere-hd24-qknorm-bias",
          "smollm3": "smollm3-hd24-nope-sliding-bias", "olmo3": "olmo3-hd24-sliding-2rope",
          "ministral": "ministral-hd24-window4-layertypes"}


def case_fields(variant: str, task: str = "causal_lm") -> dict:
    """The config fields of tests/cases' case ``{variant}-{task}``."""
    return next(f for case_id, t, f in CASES if case_id == f"{variant}-{task}")


def case_pair(variant: str, impl: str = "sdpa", task: str = "causal_lm", **overrides):
    """helpers.model_pair on the checkpoint of case ``{variant}-{task}``."""
    return model_pair(make_checkpoint(case_fields(variant, task), task), task, impl, **overrides)


@torch.inference_mode()
def assert_rotary_equal(ours, rotary) -> None:
    """Our backbone's inverse frequencies, and its cos and sin over 40 positions, torch.equal those of transformers'
    rotary embedding ``rotary`` (hidden size 96)."""
    assert torch.equal(ours.inverse_frequencies(None, torch.device("cpu")), rotary.inv_freq)
    positions = torch.arange(40).unsqueeze(0)
    hidden = torch.zeros(1, 40, 96)
    for a, b in zip(ours.rotary(None, positions, hidden), rotary(hidden, positions), strict=True):
        assert torch.equal(a, b)


def with_top_level_rope(fields: dict, out: Path, factor: str, theta: str) -> Path:
    """A copy at ``out`` of the causal LM checkpoint of ``fields`` whose config.json gives the RoPE's partial factor
    and theta at the top level, under the names ``factor`` and ``theta`` (no ``rope_parameters``), as older hub
    repositories spell them."""
    source = make_checkpoint(fields, "causal_lm")
    shutil.copytree(source, out)
    config = json.loads((source / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update({factor: rope["partial_rotary_factor"], theta: rope["rope_theta"]})
    (out / "config.json").write_text(json.dumps(config))
    return out


# ---- training with the dropouts on ---------------------------------------------------------------------------------

def training_batch(vocab: int, task: str = "causal_lm", low: int = 1) -> dict:
    """helpers.left_padded's batch (ids from ``low``) with per-token labels, the pads ignored: the ids themselves for
    the causal LM, the ids modulo 3 for a token classifier."""
    ids, mask = left_padded(vocab, low=low)
    labels = ids if task == "causal_lm" else ids % 3
    return dict(input_ids=ids, attention_mask=mask, labels=labels.masked_fill(mask == 0, -100))


def assert_training_with_dropouts_equal(fields: dict, task: str = "causal_lm", impl: str = "sdpa", low: int = 1,
                                        dropout: bool = True):
    """One training step on ``training_batch``: the same seed draws the same masks in the same order on both sides,
    so the loss and every gradient are torch.equal (helpers.assert_training_step_equal); and the dropouts acted
    (the eval-mode loss differs) exactly when ``dropout``. Returns our model."""
    ours, theirs = model_pair(make_checkpoint(fields, task), task, impl)
    batch = training_batch(ours.config.vocab_size, task, low)
    loss = assert_training_step_equal(ours, theirs, batch)
    assert dropout_acted(ours, batch, loss) == dropout
    return ours


# ---- generation -----------------------------------------------------------------------------------------------------

GENERATE_SETTINGS = {"beams": dict(num_beams=3, early_stopping=True),
                     "sampled": dict(do_sample=True, top_k=20, temperature=0.7)}


def generate_settings(**more: dict):
    """Parametrises ``settings`` over beam search and sampling (and ``more``), the names as ids."""
    settings = {**GENERATE_SETTINGS, **more}
    return pytest.mark.parametrize("settings", list(settings.values()), ids=list(settings))


@torch.inference_mode()
def assert_left_padded_generate_equal(fields: dict, impl: str, settings: dict, low: int = 1,
                                      model_generate: bool = False) -> None:
    """Our generate on helpers.left_padded's batch (rows of 9, 6 and 3 tokens, ids from ``low``) equals
    transformers' from the same seed (helpers.assert_generate_equal); with ``model_generate``, ``model.generate``
    too, eos 2 as there."""
    ours, theirs = model_pair(make_checkpoint(fields, "causal_lm"), impl=impl)
    ids, mask = left_padded(ours.config.vocab_size, low=low)
    assert_generate_equal(ours, theirs, ids, mask, **settings)
    if model_generate:
        assert_model_generate_equal(ours, theirs, ids, mask, eos_token_id=2, **settings)


# ---- the tokenizer class --------------------------------------------------------------------------------------------

def byte_level_tokenizer_dir(name: str, model_type: str, tmp_path: Path) -> Path:
    """A byte-level BPE tokenizer.json (``name``'s vocabulary and merges, ``<|endoftext|>`` and ``<|pad|>``) whose
    tokenizer_config.json names no class, under a config.json of ``model_type``: transformers picks the class from
    the model type (TOKENIZER_MAPPING_NAMES)."""
    from test_tokenizer_dirs import _done, _write_config, byte_level_bpe, saved_dir
    plain, done = byte_level_bpe(f"{name}-vocab-merges", ["<|endoftext|>", "<|pad|>"])
    if not done:
        _write_config(plain, "gpt2", pad_token_id=None)
        plain = _done(plain)
    saved = saved_dir(plain, f"{name}-saved", tokenizer_class=None, pad_token="<|pad|>")
    root = tmp_path / model_type
    shutil.copytree(saved, root)
    _write_config(root, model_type, pad_token_id=1)
    return root


def assert_tokenizer_class_from_the_model_type(root: Path, model_type: str, class_name: str) -> None:
    """``root``'s tokenizer_config.json names no class: our class for ``model_type`` is transformers' (neither
    mapping it, as smollm3, means transformers' fallback), ours and AutoTokenizer's load as ``class_name``, and the
    vocabulary, pad id and every call on SAMPLES and PAIRS (offsets and special-token masks on) are equal."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    from test_tokenizer import compare
    from test_tokenizer_dirs import PAIRS, SAMPLES

    from flodl_hf.tokenization import CLASS_FOR_MODEL_TYPE, AutoTokenizer
    mapped = TOKENIZER_MAPPING_NAMES.get(model_type)
    assert CLASS_FOR_MODEL_TYPE.get(model_type) == mapped and mapped in (class_name, None)
    assert "tokenizer_class" not in json.loads((root / "tokenizer_config.json").read_text())
    ref = quiet_transformers().AutoTokenizer.from_pretrained(str(root))
    ours = AutoTokenizer.from_pretrained(root)
    assert type(ref).__name__ == class_name == ours.settings.class_name
    assert ours.get_vocab() == ref.get_vocab() and ours.pad_token_id == ref.pad_token_id
    extra = dict(return_offsets_mapping=True, return_special_tokens_mask=True)
    compare(ours, ref, model_type, SAMPLES, padding=True, **extra)
    questions, contexts = map(list, zip(*PAIRS))
    compare(ours, ref, f"{model_type} pairs", questions, contexts, padding=True, **extra)
