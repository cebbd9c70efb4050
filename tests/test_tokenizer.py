"""AutoTokenizer: exactly transformers' input_ids, token_type_ids, attention_mask and offsets for the same
directory, over every tokenizer layout our families ship (see test_tokenizer_dirs.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flodl_hf import AutoTokenizer, InputError
from flodl_hf.tokenization import RECIPES, Tokenizer
from helpers import quiet_transformers
from test_tokenizer_dirs import PAIRS, SAMPLES, all_dirs, saved_dir, wordpiece_vocab_dir

DIRS = all_dirs()

# Call variants compared field by field (each also with return_offsets_mapping and special_tokens_mask).
CALLS = [
    dict(padding=True),
    dict(padding="max_length", max_length=40, truncation=True),
    dict(truncation=True, max_length=6, padding="longest"),
    dict(padding=True, add_special_tokens=False),
    dict(padding=True, padding_side="left"),
    dict(padding=True, pad_to_multiple_of=8),
    dict(padding=True, return_token_type_ids=True),
]
PAIR_CALLS = [
    dict(padding=True),
    dict(padding=True, truncation="only_second", max_length=16),
    dict(padding=True, truncation="longest_first", max_length=12),
    dict(truncation="only_second", max_length=24, stride=4, return_overflowing_tokens=True, padding=True),
]


@pytest.fixture(scope="module")
def reference():
    transformers = quiet_transformers()
    cache = {}

    def load(name):
        if name not in cache:
            cache[name] = transformers.AutoTokenizer.from_pretrained(str(DIRS[name]))
        return cache[name]
    return load


def assert_same(ours: dict, theirs, where: str) -> None:
    theirs = dict(theirs)
    assert sorted(ours) == sorted(theirs), f"{where}: fields {sorted(ours)} != {sorted(theirs)}"
    for key in theirs:
        a, b = ours[key], theirs[key]
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where}: {key}\n{a}\n{b}"
        else:
            assert a == b, f"{where}: {key}\n{a}\n{b}"


def compare(ours, ref, where: str, *args, **kwargs) -> None:
    """Same fields, or both refuse (a window too short for the stride, say)."""
    try:
        expected = ref(*args, return_tensors="pt", **kwargs)
    except Exception:  # noqa: BLE001 - whatever transformers raises, we must refuse too
        try:
            ours(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - tokenizers' Rust panics are BaseExceptions
            return
        pytest.fail(f"{where}: transformers refused this call, we did not")
    assert_same(ours(*args, **kwargs), expected, where)


@pytest.mark.parametrize("name", list(DIRS))
def test_same_as_transformers(name, reference):
    ref = reference(name)
    ours = AutoTokenizer.from_pretrained(DIRS[name])
    for attr in ("model_max_length", "model_input_names", "padding_side", "truncation_side", "all_special_tokens",
                 "all_special_ids", "vocab_size", *(f"{n}{s}" for n in ("bos_token", "eos_token", "unk_token",
                 "sep_token", "pad_token", "cls_token", "mask_token") for s in ("", "_id"))):
        assert getattr(ours, attr) == getattr(ref, attr), f"{name}: {attr}"
    assert len(ours) == len(ref) and ours.get_vocab() == ref.get_vocab(), name
    extra = dict(return_offsets_mapping=True, return_special_tokens_mask=True)
    for kwargs in CALLS:
        compare(ours, ref, f"{name} {kwargs}", SAMPLES, **kwargs, **extra)
    questions, contexts = map(list, zip(*PAIRS))
    for kwargs in PAIR_CALLS:
        compare(ours, ref, f"{name} pairs {kwargs}", questions, contexts, **kwargs, **extra)
    for text in SAMPLES:  # unbatched, lists not tensors
        assert_same(ours(text, return_tensors=None, **extra), ref(text, **extra), f"{name} {text!r}")
        assert ours.tokenize(text) == ref.tokenize(text), f"{name} {text!r}"
        ids = ref(text)["input_ids"]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
            assert ours.convert_ids_to_tokens(ids, skip) == ref.convert_ids_to_tokens(ids, skip)
    assert_same(ours(list(PAIRS), padding=True), ref(list(PAIRS), padding=True, return_tensors="pt"), "tuples")
    masked = f"Paris is the {ref.mask_token} of France."
    assert_same(ours(masked, return_tensors=None), ref(masked), f"{name} mask")
    tokens = ref.convert_ids_to_tokens(ref(SAMPLES[6])["input_ids"])
    assert ours.convert_tokens_to_string(tokens) == ref.convert_tokens_to_string(tokens)


def test_every_recipe_is_exercised():
    classes = {AutoTokenizer.from_pretrained(d).settings.class_name for d in DIRS.values()}
    assert set(RECIPES) <= classes


def test_tokenizer_json_loads_without_transformers_conversion(monkeypatch):
    """A directory with tokenizer.json and a known class is built by our recipe, not by transformers."""
    import flodl_hf.tokenization.loading as module

    def refuse(*args, **kwargs):
        raise AssertionError("transformers was asked to convert a tokenizer.json directory")
    monkeypatch.setattr(module, "_from_transformers", refuse)
    for name, directory in DIRS.items():
        if (directory / "tokenizer.json").is_file():
            assert isinstance(AutoTokenizer.from_pretrained(directory), Tokenizer), name


def test_config_options_override_tokenizer_json(tmp_path, reference):
    """transformers rebuilds the pipeline from tokenizer_config.json: a stale tokenizer.json normaliser
    (lowercase on, in a cased config) and a stale post-processor must not leak through."""
    target = tmp_path / "stale"
    shutil.copytree(DIRS["bert/cased-config"], target)
    data = json.loads((target / "tokenizer.json").read_text())
    data["normalizer"]["lowercase"] = True
    data["post_processor"] = None
    (target / "tokenizer.json").write_text(json.dumps(data))
    transformers = quiet_transformers()
    ref = transformers.AutoTokenizer.from_pretrained(str(target))
    ours = AutoTokenizer.from_pretrained(target)
    assert_same(ours(SAMPLES, padding=True), ref(SAMPLES, padding=True, return_tensors="pt"), "stale json")
    assert ours.tokenize("Paris CAFÉ") == ref.tokenize("Paris CAFÉ")


def test_options_passed_to_from_pretrained(reference):
    transformers = quiet_transformers()
    directory = DIRS["bert/tokenizer.json"]
    ref = transformers.AutoTokenizer.from_pretrained(str(directory), do_lower_case=False)
    ours = AutoTokenizer.from_pretrained(directory, do_lower_case=False)
    assert_same(ours(SAMPLES, padding=True), ref(SAMPLES, padding=True, return_tensors="pt"), "do_lower_case=False")


def test_truncation_uses_model_max_length():
    ours = AutoTokenizer.from_pretrained(DIRS["bert/cased-config"])
    assert ours.model_max_length == 24
    long = " ".join(["paris"] * 100)
    assert ours(long, truncation=True)["input_ids"].shape == (1, 24)
    assert ours(long)["input_ids"].shape[1] > 24


def test_unequal_lengths_without_padding_is_a_clear_error():
    ours = AutoTokenizer.from_pretrained(wordpiece_vocab_dir())
    with pytest.raises(InputError, match="padding=True"):
        ours(["a", "a much longer text than the first"])
    assert ours(["a", "a b c"], return_tensors=None)["input_ids"][0][0] == ours.cls_token_id


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(FileNotFoundError, match="no usable tokenizer"):
        AutoTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("model_name", ["botchan_en_unigram_1000.model", "botchan_en_bpe_1000.model"])
def test_real_sentencepiece_models(tmp_path, model_name):
    """The real SentencePiece models of the sentencepiece sources (`flodl-hf samples fetch botchan`)."""
    from flodl_hf.core import samples
    botchan = samples.local_path("botchan")
    if botchan is None:
        pytest.skip("samples/botchan is not in the cache (run `flodl-hf samples fetch botchan`)")
    text = (botchan / "botchan.txt").read_text(encoding="utf-8").splitlines()
    lines = [line for line in text if line.strip()][100:164]
    transformers = quiet_transformers()
    # (ALBERT's class needs [CLS] and [SEP] pieces in the model, which the botchan models do not have.)
    for family, filename in {"xlm-roberta": "sentencepiece.bpe.model", "deberta-v2": "spm.model"}.items():
        raw = tmp_path / f"{family}-raw"
        raw.mkdir()
        shutil.copy(botchan / model_name, raw / filename)
        (raw / "config.json").write_text(json.dumps({"model_type": family}))
        for directory in (raw, saved_dir(raw, f"botchan-{family}-{model_name}")):
            ref = transformers.AutoTokenizer.from_pretrained(str(directory))
            ours = AutoTokenizer.from_pretrained(directory)
            kwargs = dict(padding=True, truncation=True, max_length=64, return_offsets_mapping=True)
            assert_same(ours(lines, **kwargs), ref(lines, return_tensors="pt", **kwargs), f"{family} {directory}")
            saved_dir.cache_clear()
