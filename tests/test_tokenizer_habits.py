"""transformers' tokenizer habits, typed without thinking, take effect as in transformers: special-token and side
assignments, ``add_special_tokens`` / ``add_tokens`` with ``model.resize_token_embeddings(len(tok))``. Checked on
a WordPiece tokenizer built here and on the real SmolLM2 BPE tokenizer (its GGUF sample, read by transformers),
against transformers' tokenizer loaded from the same directory, in the same run."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
import torch

from flodl_hf import AutoTokenizer
from flodl_hf.core.errors import InputError
from flodl_hf.core.samples import SAMPLES, fetch
from helpers import CACHE, quiet_transformers
from test_tokenizer_dirs import wordpiece_vocab_dir

TEXTS = ["Hello world, the quick brown fox.", "Paris", "the capital of france is paris and berlin is germany"]


@functools.cache
def smollm2_dir() -> Path:
    """The SmolLM2 tokenizer as transformers reads it from the sample's GGUF file, saved as a tokenizer directory."""
    out = CACHE / "tokenizer-smollm2"
    if not (out / "tokenizer.json").is_file():
        sample = SAMPLES["smollm2"]
        root = sample.path if sample.path.is_dir() else fetch(["smollm2"])["smollm2"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = quiet_transformers().AutoTokenizer.from_pretrained(str(root), gguf_file=sample.members[0])
        tok.save_pretrained(str(out))
    return out


def _pair(kind: str):
    directory = smollm2_dir() if kind == "smollm2" else wordpiece_vocab_dir()
    return AutoTokenizer.from_pretrained(directory), quiet_transformers().AutoTokenizer.from_pretrained(str(directory))


def _same_batch(ours, theirs, **kwargs) -> None:
    got, want = ours(TEXTS, return_tensors="pt", **kwargs), theirs(TEXTS, return_tensors="pt", **kwargs)
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("kind", ["wordpiece", "smollm2"])
def test_pad_token_assignments_take_effect_as_in_transformers(kind):
    ours, theirs = _pair(kind)
    if theirs.pad_token is None:  # SmolLM2's GGUF names none: the usual first line before batching
        with pytest.raises(InputError, match="pad"):
            ours(TEXTS, padding=True)
    for tok in (ours, theirs):
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.sep_token
    assert ours.pad_token == theirs.pad_token and ours.pad_token_id == theirs.pad_token_id
    _same_batch(ours, theirs, padding=True)
    for tok in (ours, theirs):
        tok.padding_side = "left"
    assert ours.padding_side == theirs.padding_side == "left"
    _same_batch(ours, theirs, padding=True)
    for tok in (ours, theirs):
        tok.pad_token_id = 3
        tok.eos_token_id = 4
    assert (ours.pad_token, ours.eos_token, ours.pad_token_id) == (theirs.pad_token, theirs.eos_token, 3)
    _same_batch(ours, theirs, padding=True)
    for tok in (ours, theirs):
        tok.truncation_side = "left"
    _same_batch(ours, theirs, padding=True, truncation=True, max_length=4)
    for tok in (ours, theirs):
        tok.pad_token = None
    assert ours.pad_token is None and ours.pad_token_id is None and theirs.pad_token_id is None
    with pytest.raises(InputError, match="pad"):
        ours(TEXTS, padding=True)


@pytest.mark.parametrize("kind", ["wordpiece", "smollm2"])
def test_add_special_tokens_and_add_tokens_as_in_transformers(kind):
    ours, theirs = _pair(kind)
    special = {"pad_token": "<|mypad|>", "extra_special_tokens": ["<|a|>", "<|b|>"]}
    assert ours.add_special_tokens(special) == theirs.add_special_tokens(special) == 3
    assert ours.add_special_tokens({"pad_token": "<|mypad|>"}) == theirs.add_special_tokens({"pad_token": "<|mypad|>"})
    assert ours.add_tokens(["flodlword", "zzqq"]) == theirs.add_tokens(["flodlword", "zzqq"]) == 2
    assert ours.add_tokens("flodlword") == theirs.add_tokens("flodlword") == 0
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert ours.pad_token == theirs.pad_token and ours.pad_token_id == theirs.pad_token_id
    assert ours.extra_special_tokens == theirs.extra_special_tokens
    assert ours.extra_special_tokens_ids == theirs.extra_special_tokens_ids
    assert ours.all_special_tokens == theirs.all_special_tokens
    text = ["a flodlword <|a|> zzqq here", "<|b|> then"]
    assert torch.equal(ours(text, padding=True, return_tensors="pt")["input_ids"],
                       theirs(text, padding=True, return_tensors="pt")["input_ids"])
    ids = theirs(text[0])["input_ids"]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    more = {"extra_special_tokens": ["<|c|>"]}
    assert ours.add_special_tokens(more, replace_extra_special_tokens=False) == \
        theirs.add_special_tokens(more, replace_extra_special_tokens=False)
    assert ours.extra_special_tokens == theirs.extra_special_tokens == ["<|a|>", "<|b|>", "<|c|>"]


@pytest.mark.parametrize("name, value, match", [
    ("pad_token", 5, "string"),
    ("pad_token_id", 10**9, "not a token id"),
    ("pad_token_id", "3", "not a token id"),
    ("padding_side", "middle", "'left' or 'right'"),
    ("truncation_side", None, "'left' or 'right'"),
    ("model_max_length", 0, "positive integer"),
    ("extra_special_tokens", "<|a|>", "list"),
])
def test_an_assignment_transformers_would_store_and_fail_on_later_is_refused_now(name, value, match):
    ours = AutoTokenizer.from_pretrained(wordpiece_vocab_dir())
    before = (dict(ours.settings.special_tokens), ours.padding_side, ours.truncation_side, ours.model_max_length)
    with pytest.raises(InputError, match=match):
        setattr(ours, name, value)
    assert before == (dict(ours.settings.special_tokens), ours.padding_side, ours.truncation_side,
                      ours.model_max_length)


@pytest.mark.parametrize("call, match", [
    (lambda t: t.add_special_tokens({"pading_token": "x"}), "not a special token name"),
    (lambda t: t.add_special_tokens({"pad_token": 3}), "string"),
    (lambda t: t.add_special_tokens({"pad_token": "[NEW]", "extra_special_tokens": "<x>"}), "list"),
    (lambda t: t.add_special_tokens(["<x>"]), "dict"),
    (lambda t: t.add_tokens([1, 2]), "not a string"),
])
def test_a_bad_addition_changes_nothing(call, match):
    ours = AutoTokenizer.from_pretrained(wordpiece_vocab_dir())
    before = (len(ours), dict(ours.settings.special_tokens), list(ours.extra_special_tokens))
    with pytest.raises(InputError, match=match):
        call(ours)
    assert before == (len(ours), dict(ours.settings.special_tokens), list(ours.extra_special_tokens))
