"""Tokenizer directories built at test time, offline: a WordPiece vocab.txt, a byte-level BPE vocab.json +
merges.txt, and SentencePiece unigram / BPE models, each laid out as the family ships it (vocab or
SentencePiece model only), and as transformers' save_pretrained writes it (tokenizer.json +
tokenizer_config.json). Shared by test_tokenizer.py and test_tasks.py; cached beside the test checkpoints.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import random
import shutil
from pathlib import Path
from typing import Callable

import pytest

from flodl_hf import AutoTokenizer
from flodl_hf.core.errors import ConfigError
from flodl_hf.tokenization import VERY_LARGE_INTEGER
from helpers import CACHE, quiet_transformers

BUILD_VERSION = "1"  # bump when a builder changes
WORDS = ("the quick brown fox jumps over lazy dog paris is capital of france berlin germany london england "
         "river city house music played loud night morning coffee tea bread cheese wine water school teacher "
         "student book read write learn tomorrow yesterday today hello world running runner unbelievable "
         "transformers tokenizer embedding question answer context model sentence spam message free prize "
         "call now win cash meeting lunch office phone number john smith mary anne new york san francisco "
         "apple google microsoft company president minister weather sunny rainy cold warm").split()
EXTRA = ["café", "naïve", "Ünïcödé", "résumé", "東京", "北京", "東京タワー", "emoji 🙂", "don't", "it's",
         "U.S.A.", "3.14", "1,000", "e-mail", "(brackets)", "\"quoted\"", "``tex quotes''", "tab\tseparated",
         "new\nline"]


def corpus(n: int = 600, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(EXTRA))
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", "?", "!", "", ","]))
    return lines


# Inputs the comparisons run on: odd spaces, accents, CJK, emojis, tabs/newlines, special tokens in text, empty.
SAMPLES = [
    "Paris is the capital of France.",
    "The QUICK brown fox jumps over the lazy dog!",
    "  leading and trailing spaces   ",
    "multiple   spaces\tand\ttabs\nand newlines",
    "Café naïve résumé Ünïcödé",
    "東京 and 北京 are cities; 東京タワー too.",
    "emoji 🙂 in text, don't panic: it's 3.14 or 1,000 e-mail (brackets) \"quoted\" ``tex''",
    "unbelievabletransformerstokenizer supercalifragilistic",
    "",
    "a",
]
PAIRS = [("Where is Paris?", "Paris is the capital of France."),
         ("What is it?", "  It is   a fox. " * 6)]


def _root() -> Path:
    transformers = quiet_transformers()
    key = hashlib.sha1(f"{BUILD_VERSION}-{transformers.__version__}".encode()).hexdigest()[:10]
    root = CACHE / f"tokenizers-{key}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _write_config(directory: Path, model_type: str, **extra) -> None:
    (directory / "config.json").write_text(json.dumps({"model_type": model_type, **extra}))


def _fresh(name: str) -> tuple[Path, bool]:
    """(the finished directory, True), or (a private work directory that _done publishes, False)."""
    out = _root() / name
    if (out / ".done").is_file():
        return out, True
    work = out.with_name(f"{name}.tmp{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work, False


def _done(work: Path) -> Path:
    """Publish a work directory under its final name, atomically (another process may have won)."""
    (work / ".done").write_text("ok")
    out = work.with_name(work.name.rsplit(".tmp", 1)[0])
    if out.exists() and not (out / ".done").is_file():
        shutil.rmtree(out, ignore_errors=True)
    try:
        work.rename(out)
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
    return out


@functools.lru_cache(maxsize=None)
def wordpiece_vocab_dir() -> Path:
    """bert: vocab.txt + config.json only (uncased WordPiece, as bert-base-uncased ships its vocabulary)."""
    out, done = _fresh("bert-vocab-only")
    if done:
        return out
    from tokenizers import BertWordPieceTokenizer
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(corpus(), vocab_size=400, min_frequency=1,
                            special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    (out / "vocab.txt").write_text("".join(token + "\n" for token, _ in vocab), encoding="utf-8")
    _write_config(out, "bert")
    return _done(out)


def byte_level_bpe(name: str, special_tokens: list[str]) -> tuple[Path, bool]:
    """``_fresh(name)``, with a byte-level BPE vocab.json + merges.txt trained on the corpus in it when new."""
    out, done = _fresh(name)
    if not done:
        from tokenizers import ByteLevelBPETokenizer
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator(corpus(), vocab_size=500, min_frequency=2, special_tokens=special_tokens)
        tok.save_model(str(out))
    return out, done


@functools.lru_cache(maxsize=None)
def bpe_vocab_dir() -> Path:
    """roberta: vocab.json + merges.txt + config.json only (byte-level BPE)."""
    out, done = byte_level_bpe("roberta-vocab-merges", ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    if done:
        return out
    _write_config(out, "roberta", pad_token_id=1)
    return _done(out)


def _train_spm(model_type: str, **kwargs) -> bytes:
    import sentencepiece as spm
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_writer=buffer, vocab_size=240,
                                   hard_vocab_limit=False,
                                   model_type=model_type, character_coverage=1.0, minloglevel=2,
                                   num_threads=1, **kwargs)
    return buffer.getvalue()


# How each family lays out its SentencePiece model (piece ids of the real checkpoints' models).
SPM_LAYOUTS = {
    # ALBERT spiece.model: <pad>=0 <unk>=1 [CLS]=2 [SEP]=3 [MASK]=4
    "albert": ("spiece.model", dict(pad_id=0, unk_id=1, bos_id=-1, eos_id=-1,
                                    control_symbols=["[CLS]", "[SEP]", "[MASK]"])),
    # XLM-R sentencepiece.bpe.model (a unigram model despite its name): <unk>=0 <s>=1 </s>=2
    "xlm-roberta": ("sentencepiece.bpe.model", dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)),
    # DeBERTa-v3 spm.model: [PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3, [MASK] added after the vocabulary
    "deberta-v2": ("spm.model", dict(pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="[PAD]", bos_piece="[CLS]",
                                     eos_piece="[SEP]", unk_piece="[UNK]")),
}


@functools.lru_cache(maxsize=None)
def spm_dir(family: str, model_type: str = "unigram") -> Path:
    """A SentencePiece model (+ config.json) laid out as ``family`` ships it; no tokenizer.json."""
    out, done = _fresh(f"{family}-spm-{model_type}")
    if done:
        return out
    filename, layout = SPM_LAYOUTS[family]
    (out / filename).write_bytes(_train_spm(model_type, **layout))
    _write_config(out, family, pad_token_id=1 if family == "xlm-roberta" else 0)
    return _done(out)


@functools.lru_cache(maxsize=None)
def deberta_bpe_dir() -> Path:
    """DeBERTa v1 (microsoft/deberta-base's layout): a byte-level BPE vocab.json + merges.txt with
    [CLS]/[SEP]/[PAD]/[MASK], read by transformers' DebertaTokenizer."""
    out, done = byte_level_bpe("deberta-v1-vocab-merges", ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"])
    if done:
        return out
    (out / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False, "vocab_type": "gpt2"}))
    _write_config(out, "deberta", pad_token_id=0)
    return _done(out)


@functools.lru_cache(maxsize=None)
def saved_dir(source: Path, name: str | None = None, **config_changes) -> Path:
    """transformers' AutoTokenizer for ``source``, written back with save_pretrained (tokenizer.json +
    tokenizer_config.json), then tokenizer_config.json edited by ``config_changes`` (None deletes a key)."""
    out, done = _fresh(name or f"{source.name}-saved")
    if done:
        return out
    transformers = quiet_transformers()
    transformers.AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(out))
    shutil.copy(source / "config.json", out / "config.json")
    if config_changes:
        path = out / "tokenizer_config.json"
        config = json.loads(path.read_text())
        for key, value in config_changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        path.write_text(json.dumps(config, indent=2))
    return _done(out)


def all_dirs() -> dict[str, Path]:
    """Every tokenizer directory the comparisons run on, by a readable name."""
    bert, roberta = wordpiece_vocab_dir(), bpe_vocab_dir()
    dirs = {"bert/vocab.txt": bert, "bert/tokenizer.json": saved_dir(bert),
            "bert/cased-config": saved_dir(bert, "bert-cased-config", do_lower_case=False, model_max_length=24),
            "distilbert/tokenizer.json": saved_dir(bert, "distilbert-class", tokenizer_class="DistilBertTokenizer"),
            "roberta/vocab+merges": roberta, "roberta/tokenizer.json": saved_dir(roberta),
            "roberta/prefix-space": saved_dir(roberta, "roberta-prefix-space", add_prefix_space=True),
            "deberta/vocab+merges": deberta_bpe_dir(), "deberta/tokenizer.json": saved_dir(deberta_bpe_dir())}
    for family in SPM_LAYOUTS:
        for kind in ("unigram", "bpe"):
            spm = spm_dir(family, kind)
            dirs[f"{family}/{kind}.model"] = spm
            dirs[f"{family}/{kind}/tokenizer.json"] = saved_dir(spm)
    dirs["albert/cased-config"] = saved_dir(spm_dir("albert"), "albert-cased", do_lower_case=False, keep_accents=True)
    dirs["deberta-v2/lower-punct"] = saved_dir(spm_dir("deberta-v2"), "deberta-lower-punct", do_lower_case=True,
                                               split_by_punct=True)
    return dirs


# ---- bad tokenizer files are refused at load, naming the file and the field -----------------------------

def _edited_bert(tmp_path: Path, config: dict | None = None, model: Callable | None = None) -> Path:
    """A copy of the saved BERT directory, tokenizer_config.json updated with ``config``, tokenizer.json's
    model section edited in place by ``model``."""
    target = tmp_path / "bert"
    shutil.copytree(saved_dir(wordpiece_vocab_dir()), target)
    if config:
        path = target / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if model:
        path = target / "tokenizer.json"
        data = json.loads(path.read_text())
        model(data["model"])
        path.write_text(json.dumps(data))
    return target


@pytest.mark.parametrize("key", ["truncation_side", "padding_side"])
@pytest.mark.parametrize("value", [5, "middle", None])
def test_bad_padding_or_truncation_side_is_refused_at_load(tmp_path, key, value):
    directory = _edited_bert(tmp_path, {key: value})
    with pytest.raises(ConfigError, match=rf"tokenizer_config\.json: {key} is .*'left' or 'right'"):
        AutoTokenizer.from_pretrained(directory)
    with pytest.raises(ConfigError, match=rf"from_pretrained option {key}"):
        AutoTokenizer.from_pretrained(saved_dir(wordpiece_vocab_dir()), **{key: value})
    AutoTokenizer.from_pretrained(_edited_bert(tmp_path / "ok", {key: "left"}))


@pytest.mark.parametrize("key, value", [(key, value) for key in ("clean_up_tokenization_spaces",
                                        "split_special_tokens", "do_lower_case") for value in ("false", 0, None)
                                        if not (key == "clean_up_tokenization_spaces" and value is None)])
def test_a_switch_that_is_not_a_bool_is_refused_at_load(tmp_path, key, value):
    """bool("false") is True: the string would have turned the switch on without a word."""
    with pytest.raises(ConfigError, match=rf"tokenizer_config\.json: {key} is .*expected true or false"):
        AutoTokenizer.from_pretrained(_edited_bert(tmp_path, {key: value}))
    with pytest.raises(ConfigError, match=rf"from_pretrained option {key}"):
        AutoTokenizer.from_pretrained(saved_dir(wordpiece_vocab_dir()), **{key: value})
    assert getattr(AutoTokenizer.from_pretrained(_edited_bert(tmp_path / "ok", {key: True})).settings,
                   key, True) is True


def test_null_switches_that_transformers_loads_load_and_model_input_names_must_be_names(tmp_path):
    AutoTokenizer.from_pretrained(_edited_bert(tmp_path / "null", {"strip_accents": None}))
    ours = AutoTokenizer.from_pretrained(_edited_bert(tmp_path / "off", {"clean_up_tokenization_spaces": None}))
    assert not ours.settings.clean_up_tokenization_spaces
    for i, names in enumerate(["input_ids", [], ["input_ids", 3]]):
        with pytest.raises(ConfigError, match=r"tokenizer_config\.json: model_input_names is .*list of input names"):
            AutoTokenizer.from_pretrained(_edited_bert(tmp_path / str(i), {"model_input_names": names}))


def test_special_token_of_wrong_type_or_missing_from_the_vocab_is_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: unk_token is 5 \(int\)"):
        AutoTokenizer.from_pretrained(_edited_bert(tmp_path / "int", {"unk_token": 5}))
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: mask_token is \{'lstrip': True\}"):
        AutoTokenizer.from_pretrained(_edited_bert(tmp_path / "dict", {"mask_token": {"lstrip": True}}))
    no_unk = _edited_bert(tmp_path / "vocab", model=lambda m: m["vocab"].pop("[UNK]"))
    with pytest.raises(ConfigError, match=r"tokenizer\.json: the model's vocab lacks its unk_token '\[UNK\]'"):
        AutoTokenizer.from_pretrained(no_unk)
    raw = tmp_path / "vocab-txt"  # the same for a vocab.txt that transformers converts
    shutil.copytree(wordpiece_vocab_dir(), raw)
    lines = (raw / "vocab.txt").read_text(encoding="utf-8").splitlines()
    (raw / "vocab.txt").write_text("".join(f"{t}\n" for t in lines if t != "[UNK]"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"vocab\.txt: the model's vocab lacks its unk_token '\[UNK\]'"):
        AutoTokenizer.from_pretrained(raw)
    # an AddedToken object, as transformers writes one, still loads
    token = {"__type": "AddedToken", "content": "[UNK]", "lstrip": False, "rstrip": False, "normalized": False,
             "single_word": False, "special": True}
    assert AutoTokenizer.from_pretrained(_edited_bert(tmp_path / "added", {"unk_token": token})).unk_token == "[UNK]"


@pytest.mark.parametrize("value", ["abc", -3, 12.5, True, [512]])
def test_bad_model_max_length_names_tokenizer_config(tmp_path, value):
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: model_max_length is .*non-negative integer"):
        AutoTokenizer.from_pretrained(_edited_bert(tmp_path, {"model_max_length": value}))


def test_model_max_length_as_transformers_writes_it_still_loads(tmp_path):
    """An int, the 'no limit' int(1e30), and 1e30 or 512.0 as floats (older transformers wrote floats)."""
    for i, value in enumerate([512, VERY_LARGE_INTEGER, 1e30, 512.0]):
        ours = AutoTokenizer.from_pretrained(_edited_bert(tmp_path / str(i), {"model_max_length": value}))
        assert ours.model_max_length == int(value)


def assert_byte_level_tokenizer_equal(ours, ref, name: str, variants: tuple[dict, ...]) -> None:
    """A byte-level BPE tokenizer of a decoder against transformers': its settings, vocabulary, every call variant
    (with offsets and special-token masks) on SAMPLES, pairs, single texts and decode."""
    from test_tokenizer import assert_same, compare
    for attr in ("model_input_names", "padding_side", "all_special_tokens", "vocab_size", "bos_token_id",
                 "eos_token_id", "unk_token_id", "pad_token_id"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert ours.get_vocab() == ref.get_vocab()
    extra = dict(return_offsets_mapping=True, return_special_tokens_mask=True)
    for kwargs in variants:
        compare(ours, ref, f"{name} {kwargs}", SAMPLES, **kwargs, **extra)
    questions, contexts = map(list, zip(*PAIRS))
    compare(ours, ref, f"{name} pairs", questions, contexts, padding=True, **extra)
    for text in SAMPLES:
        assert_same(ours(text, return_tensors=None, **extra), ref(text, **extra), f"{name} {text!r}")
        ids = ref(text)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids)
