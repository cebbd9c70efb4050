"""transformers' habits, typed without thinking: the calls the quick tour and the task guides (text, token and
sequence classification, question answering, masked and causal LM, LoRA) make on models, configs and tokenizers.
Each works as in transformers, compared with transformers in the same run (same results, same files, same outputs),
or is a typed error naming what flodl-hf does not do. docs/habits.md is the table, one row per test here.

Models: tiny BERT (seqcls, tokcls, qa, mlm) and LLaMA causal LMs built with transformers (``make_checkpoint``), with
the WordPiece tokenizer's vocabulary size where a tokenizer feeds them. Tokenizers: the WordPiece tokenizer built
from a vocab.txt, and transformers' saves of it and of the byte-level BPE one.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flodl_hf import AutoConfig, AutoModel, AutoTokenizer
from flodl_hf.auto import load_model
from flodl_hf.core.errors import InputError, UnsupportedFeatureError
from flodl_hf.core.validate import tree_hash
from flodl_hf.roundtrip.matrix import tiny_config
from flodl_hf.roundtrip.parity import REFERENCE_CLASSES
from helpers import one_thread  # noqa: F401  (the fixture)
from helpers import assert_training_step_equal, make_checkpoint, model_pair, quiet_transformers
from test_tokenizer_dirs import bpe_vocab_dir, saved_dir, wordpiece_vocab_dir

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]

TEXTS = ["Hello world, the quick brown fox.", "Paris", "the capital of france is paris and berlin is germany"]
ID2LABEL = {0: "NEGATIVE", 1: "NEUTRAL", 2: "POSITIVE"}
LABEL2ID = {"NEGATIVE": 0, "NEUTRAL": 1, "POSITIVE": 2}
# (model_type, task, config changes): the models most rows run on
MODELS = {"bert-seqcls": ("bert", "seqcls", {}), "bert-mlm": ("bert", "mlm", {}),
          "llama": ("llama", "causal_lm", {}), "llama-tied": ("llama", "causal_lm", {"tie_word_embeddings": True})}


def _tokenizers(directory: Path | None = None):
    """Ours and transformers' tokenizer of ``directory`` (the WordPiece one by default)."""
    directory = directory or wordpiece_vocab_dir()
    return AutoTokenizer.from_pretrained(directory), quiet_transformers().AutoTokenizer.from_pretrained(str(directory))


def _source(name: str) -> tuple[Path, str]:
    """A tiny checkpoint of ``MODELS[name]`` whose vocabulary is the WordPiece tokenizer's; (directory, task)."""
    model_type, task, changes = MODELS[name]
    vocab = len(AutoTokenizer.from_pretrained(wordpiece_vocab_dir()))
    return make_checkpoint({**tiny_config(model_type, None, task), "vocab_size": vocab, **changes}, task), task


def _models(name: str):
    source, task = _source(name)
    return model_pair(source, task)


def _same_parameters(ours, theirs) -> None:
    """Every parameter and buffer of the state dicts, under the same names, torch.equal."""
    a, b = ours.state_dict(), theirs.state_dict()
    assert set(a) == set(b)
    assert [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])] == []


def _tied(model) -> bool:
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


# ---- models ---------------------------------------------------------------------------------------------------

def test_config_id2label_names_the_prediction_as_in_transformers():
    source, task = _source("bert-seqcls")
    kw = {"num_labels": 3, "id2label": ID2LABEL, "label2id": LABEL2ID}
    ours = load_model(source, task, **kw).eval()
    theirs = quiet_transformers().AutoModelForSequenceClassification.from_pretrained(str(source), **kw).eval()
    assert (ours.config.id2label, ours.config.label2id, ours.config.num_labels) == \
        (theirs.config.id2label, theirs.config.label2id, theirs.config.num_labels)
    ours_tok, their_tok = _tokenizers()
    with torch.no_grad():
        got = ours(**ours_tok(TEXTS[0], return_tensors="pt")).logits
        want = theirs(**their_tok(TEXTS[0], return_tensors="pt")).logits
    assert torch.equal(got, want)
    assert ours.config.id2label[got.argmax().item()] == theirs.config.id2label[want.argmax().item()]


@pytest.mark.parametrize("name", ["bert-seqcls", "bert-mlm", "llama", "llama-tied"])
def test_num_parameters_counts_as_transformers(name):
    ours, theirs = _models(name)
    for kw in ({}, {"exclude_embeddings": True}, {"only_trainable": True}):
        assert ours.num_parameters(**kw) == theirs.num_parameters(**kw), kw
    for model in (ours, theirs):  # a frozen backbone, as a fine-tuning script freezes it
        for parameter in getattr(model, model.base_model_prefix).parameters():
            parameter.requires_grad_(False)
    assert ours.num_parameters(only_trainable=True) == theirs.num_parameters(only_trainable=True)


@pytest.mark.parametrize("name", ["bert-seqcls", "bert-mlm", "llama", "llama-tied"])
def test_input_and_output_embeddings_are_transformers_modules(name):
    ours, theirs = _models(name)
    assert torch.equal(ours.get_input_embeddings().weight, theirs.get_input_embeddings().weight)
    out, ref = ours.get_output_embeddings(), theirs.get_output_embeddings()
    assert (out is None) == (ref is None)
    if ref is not None:
        assert type(out) is type(ref) and torch.equal(out.weight, ref.weight)
    assert _tied(ours) == _tied(theirs)


@pytest.mark.parametrize("cast", ["bfloat16", "half"])
def test_dtype_casts_give_transformers_outputs(cast):
    ours, theirs = _models("llama")
    for model in (ours, theirs):
        returned = model.to(torch.bfloat16) if cast == "bfloat16" else model.half()
        assert returned is model
    assert ours.dtype == theirs.dtype == (torch.bfloat16 if cast == "bfloat16" else torch.float16)
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


def test_train_and_eval_switch_dropout_as_transformers():
    source, task = _source("bert-seqcls")
    ours, theirs = model_pair(source, task, hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.2)
    ours_tok, _ = _tokenizers()
    batch = {**ours_tok(TEXTS, padding=True, return_tensors="pt"), "labels": torch.tensor([0, 1, 2])}
    assert ours.train() is ours and all(m.training for m in ours.modules())
    train_loss = assert_training_step_equal(ours, theirs, batch)  # the same dropout masks from the same seed
    assert ours.eval() is ours and not any(m.training for m in ours.modules())
    theirs.eval()
    with torch.no_grad():
        first, again, ref = ours(**batch).loss, ours(**batch).loss, theirs(**batch).loss
    assert torch.equal(first, again) and torch.equal(first, ref) and not torch.equal(first, train_loss)


@pytest.mark.parametrize("name", ["bert-seqcls", "bert-mlm", "llama", "llama-tied"])
def test_save_pretrained_writes_transformers_files_and_transformers_loads_them(name, tmp_path):
    ours, theirs = _models(name)
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(str(tmp_path / "theirs"))
    names = sorted(p.name for p in (tmp_path / "theirs").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == names
    assert set(load_file(tmp_path / "ours" / "model.safetensors")) == \
        set(load_file(tmp_path / "theirs" / "model.safetensors"))
    _, task = _source(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = getattr(quiet_transformers(), REFERENCE_CLASSES[task]).from_pretrained(str(tmp_path / "ours"))
    _same_parameters(reloaded, theirs)
    assert _tied(reloaded) == _tied(theirs)


@pytest.mark.parametrize("mean_resizing", [False, True], ids=["normal", "mean"])
@pytest.mark.parametrize("name", ["bert-mlm", "bert-seqcls", "llama", "llama-tied"])
def test_resize_token_embeddings_after_adding_tokens_as_transformers(name, mean_resizing, tmp_path):
    ours, theirs = _models(name)
    ours_tok, their_tok = _tokenizers()
    for tok in (ours_tok, their_tok):
        tok.add_tokens(["flodlword", "zzqq"])
        tok.add_special_tokens({"pad_token": "<|mypad|>"})
    before = ours.get_input_embeddings().weight.detach().clone()
    torch.manual_seed(11)
    ref = theirs.resize_token_embeddings(len(their_tok), mean_resizing=mean_resizing)
    torch.manual_seed(11)
    got = ours.resize_token_embeddings(len(ours_tok), mean_resizing=mean_resizing)
    assert got is ours.get_input_embeddings() and tuple(got.weight.shape) == tuple(ref.weight.shape)
    assert got.num_embeddings == ref.num_embeddings == len(ours_tok) and got.padding_idx == ref.padding_idx
    assert torch.equal(got.weight[:before.shape[0]], before)  # old rows kept bit for bit
    _same_parameters(ours, theirs)  # new rows, the output layer (and its bias) as transformers made them
    assert _tied(ours) == _tied(theirs)
    assert ours.config.vocab_size == theirs.config.vocab_size == len(ours_tok)
    text = ["a flodlword zzqq here", "zzqq"]
    batch = ours_tok(text, padding=True, return_tensors="pt", return_token_type_ids=False)
    assert torch.equal(batch["input_ids"], their_tok(text, padding=True, return_tensors="pt")["input_ids"])
    with torch.no_grad():
        assert torch.equal(ours(**batch).logits, theirs(**batch).logits)
    torch.manual_seed(3)
    theirs.resize_token_embeddings(len(their_tok), pad_to_multiple_of=8, mean_resizing=mean_resizing)
    torch.manual_seed(3)
    ours.resize_token_embeddings(len(ours_tok), pad_to_multiple_of=8, mean_resizing=mean_resizing)
    _same_parameters(ours, theirs)
    assert ours.config.vocab_size == theirs.config.vocab_size and ours.config.vocab_size % 8 == 0
    ours.save_pretrained(tmp_path)  # what transformers then loads: the resized model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = type(theirs).from_pretrained(str(tmp_path))
    _same_parameters(reloaded, theirs)


@pytest.mark.parametrize("call, match", [
    (lambda m: m.resize_token_embeddings(0), "new_num_tokens=0"),
    (lambda m: m.resize_token_embeddings(10, pad_to_multiple_of=2.5), "pad_to_multiple_of=2.5"),
    (lambda m: m.resize_token_embeddings("400"), "new_num_tokens='400'"),
])
def test_resize_token_embeddings_bad_sizes_are_input_errors(call, match):
    ours, _ = _models("bert-mlm")
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(InputError, match=match):
        call(ours)
    assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items())


def test_resize_token_embeddings_refuses_an_untied_vocabulary_bias():
    """An untied BERT masked LM holds ``cls.predictions.bias`` apart from its decoder: transformers replaces it by
    the new decoder's bias (RoBERTa's keeps its old size), so it is refused, before anything changes."""
    source = make_checkpoint({**tiny_config("bert", None, "mlm"), "tie_word_embeddings": False}, "mlm")
    ours, _ = model_pair(source, "mlm")
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(UnsupportedFeatureError, match=r"cls\.predictions\.bias .*tie_word_embeddings"):
        ours.resize_token_embeddings(200)
    assert ours.config.vocab_size == 128 and all(torch.equal(before[k], v) for k, v in ours.state_dict().items())


def _hub_target(what: str):
    """A model, config or tokenizer to push."""
    if what == "model":
        return _models("llama")[0]
    return AutoConfig.from_pretrained(_source("llama")[0]) if what == "config" else _tokenizers()[0]


@pytest.mark.parametrize("what", ["model", "config", "tokenizer"])
@pytest.mark.parametrize("how", ["push_to_hub", "save_pretrained(push_to_hub=True)"])
def test_push_to_hub_is_refused_naming_the_two_steps_instead(what, how, tmp_path):
    target = _hub_target(what)
    before = tree_hash(tmp_path)
    with pytest.raises(UnsupportedFeatureError, match=rf"{what}\.push_to_hub.*no network.*{what}\.save_pretrained"
                                                      r".*huggingface_hub"):
        if how == "push_to_hub":
            target.push_to_hub("me/my-model")
        else:
            target.save_pretrained(tmp_path / "out", push_to_hub=True, repo_id="me/my-model")
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize("call, match", [
    (lambda m: m.add_adapter({"r": 8}), r"add_adapter.*lora\.add_lora"),
    (lambda m: m.load_adapter("adapter/"), r"load_adapter.*lora\.load_adapter.*adapter="),
])
def test_peft_integration_calls_are_refused_naming_ours(call, match):
    ours, _ = _models("llama")
    with pytest.raises(UnsupportedFeatureError, match=match):
        call(ours)


def test_generate_then_batch_decode_as_the_causal_lm_guide():
    ours, theirs = _models("llama")
    ours_tok, their_tok = _tokenizers()
    prompt = "the capital of france is"
    inputs = ours_tok(prompt, return_tensors="pt").input_ids
    assert torch.equal(inputs, their_tok(prompt, return_tensors="pt").input_ids)
    settings = {"max_new_tokens": 6, "do_sample": True, "top_k": 50, "top_p": 0.95, "pad_token_id": 0}
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = theirs.generate(inputs, **settings)
    torch.manual_seed(5)
    got = ours.generate(inputs, **settings)
    assert torch.equal(got, want)
    decoded = [tok.batch_decode(ids, skip_special_tokens=True) for tok, ids in ((ours_tok, got), (their_tok, want))]
    assert decoded[0] == decoded[1]


def test_fill_the_mask_as_the_masked_lm_guide():
    ours, theirs = _models("bert-mlm")
    ours_tok, their_tok = _tokenizers()
    text = f"the capital of france is {ours_tok.mask_token} and berlin is germany"
    answers = []
    for model, tok in ((ours, ours_tok), (theirs, their_tok)):
        inputs = tok(text, return_tensors="pt")
        mask_token_index = torch.where(inputs["input_ids"] == tok.mask_token_id)[1]
        with torch.no_grad():
            logits = model(**inputs).logits
        top_3 = torch.topk(logits[0, mask_token_index, :], 3, dim=1).indices[0].tolist()
        answers.append([text.replace(tok.mask_token, tok.decode([token])) for token in top_3])
    assert answers[0] == answers[1]


# ---- tokenizers -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("skip", [False, True])
def test_decode_and_batch_decode_as_transformers(skip):
    ours, theirs = _tokenizers()
    ids = theirs(TEXTS, padding=True, return_tensors="pt")["input_ids"]
    assert ours.batch_decode(ids, skip_special_tokens=skip) == theirs.batch_decode(ids, skip_special_tokens=skip)
    assert ours.batch_decode(ids.tolist(), skip_special_tokens=skip) == \
        theirs.batch_decode(ids.tolist(), skip_special_tokens=skip)
    assert ours.decode(ids[0], skip_special_tokens=skip) == theirs.decode(ids[0], skip_special_tokens=skip)
    assert ours.decode(ids[2].tolist(), skip_special_tokens=skip) == theirs.decode(ids[2].tolist(),
                                                                                     skip_special_tokens=skip)


def test_convert_ids_to_tokens_as_transformers():
    ours, theirs = _tokenizers()
    ids = theirs(TEXTS[0])["input_ids"]
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids[1]) == theirs.convert_ids_to_tokens(ids[1])
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
        theirs.convert_ids_to_tokens(ids, skip_special_tokens=True)
    assert ours.convert_tokens_to_ids(ours.convert_ids_to_tokens(ids)) == ids


def test_len_and_vocab_size_as_transformers():
    ours, theirs = _tokenizers()
    assert (len(ours), ours.vocab_size) == (len(theirs), theirs.vocab_size)
    for tok in (ours, theirs):
        tok.add_tokens(["flodlword"])
        tok.add_special_tokens({"extra_special_tokens": ["<|a|>"]})
    assert (len(ours), ours.vocab_size) == (len(theirs), theirs.vocab_size)
    assert len(ours) == ours.vocab_size + 2


def test_padded_truncated_tensor_batch_feeds_the_model_as_transformers():
    ours, theirs = _models("bert-seqcls")
    ours_tok, their_tok = _tokenizers()
    got = ours_tok(TEXTS, padding=True, truncation=True, max_length=8, return_tensors="pt")
    want = their_tok(TEXTS, padding=True, truncation=True, max_length=8, return_tensors="pt")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(ours(**got).logits, theirs(**want).logits)


def test_without_return_tensors_a_batch_is_tensors_or_a_typed_error():
    """flodl-hf's ``return_tensors`` defaults to "pt" (transformers': None, lists). A batch of unequal lengths
    without padding is an InputError naming both ways out; ``return_tensors=None`` gives transformers' lists."""
    ours, theirs = _tokenizers()
    with pytest.raises(InputError, match=r"padding=True.*return_tensors=None"):
        ours(TEXTS, truncation=True)
    assert dict(ours(TEXTS, truncation=True, return_tensors=None)) == dict(theirs(TEXTS, truncation=True))
    assert torch.equal(ours(TEXTS[0])["input_ids"], theirs(TEXTS[0], return_tensors="pt")["input_ids"])


def _align_labels(tok, examples: dict, **kw) -> dict:
    """The token classification guide's tokenize_and_align_labels, as written there."""
    tokenized_inputs = tok(examples["tokens"], truncation=True, is_split_into_words=True, **kw)
    labels = []
    for i, label in enumerate(examples["ner_tags"]):
        word_ids = tokenized_inputs.word_ids(batch_index=i)
        previous_word_idx, label_ids = None, []
        for word_idx in word_ids:
            if word_idx is None:
                label_ids.append(-100)
            elif word_idx != previous_word_idx:
                label_ids.append(label[word_idx])
            else:
                label_ids.append(-100)
            previous_word_idx = word_idx
        labels.append(label_ids)
    tokenized_inputs["labels"] = labels
    return tokenized_inputs


def test_words_to_tokens_and_labels_as_the_token_classification_guide():
    ours, theirs = _tokenizers()
    examples = {"tokens": [["@paulwalk", "It", "'s", "the", "view", "Empire", "State", "Building"], ["Paris", "!"]],
                "ner_tags": [[0, 0, 0, 0, 0, 7, 8, 8], [7, 0]]}
    got, want = _align_labels(ours, examples, return_tensors=None), _align_labels(theirs, examples)
    assert dict(got) == dict(want)
    one = ours(examples["tokens"][0], is_split_into_words=True, return_tensors=None)
    ref = theirs(examples["tokens"][0], is_split_into_words=True)
    assert dict(one) == dict(ref) and one.word_ids() == ref.word_ids()
    assert ours.convert_ids_to_tokens(one["input_ids"]) == theirs.convert_ids_to_tokens(ref["input_ids"])
    pairs = ours(examples["tokens"], [["x", "y"], ["z"]], is_split_into_words=True, padding=True)
    ref = theirs(examples["tokens"], [["x", "y"], ["z"]], is_split_into_words=True, padding=True, return_tensors="pt")
    assert all(torch.equal(pairs[k], ref[k]) for k in ref) and pairs.word_ids(1) == ref.word_ids(1)
    with pytest.raises(InputError, match=r"is_split_into_words=True: text\[0\] is a str"):
        ours(TEXTS[0], is_split_into_words=True)


def test_question_answering_guide_windows_and_answer_as_transformers():
    source = make_checkpoint({**tiny_config("bert", None, "qa"), "vocab_size": len(_tokenizers()[0])}, "qa")
    ours, theirs = model_pair(source, "qa")
    ours_tok, their_tok = _tokenizers()
    questions, contexts = ["what is the capital of france ?"], ["the capital of france is paris and berlin is germany"]
    kw = {"max_length": 24, "truncation": "only_second", "return_offsets_mapping": True, "padding": "max_length"}
    got, want = ours_tok(questions, contexts, **kw), their_tok(questions, contexts, return_tensors="pt", **kw)
    assert torch.equal(got.pop("offset_mapping"), want.pop("offset_mapping"))
    assert got.sequence_ids(0) == want.sequence_ids(0) and all(torch.equal(got[k], want[k]) for k in want)
    with torch.no_grad():
        a, b = ours(**got), theirs(**want)
    assert torch.equal(a.start_logits, b.start_logits) and torch.equal(a.end_logits, b.end_logits)
    spans = [(out.start_logits.argmax(), out.end_logits.argmax()) for out in (a, b)]
    assert ours_tok.decode(got.input_ids[0, spans[0][0]:spans[0][1] + 1]) == \
        their_tok.decode(want.input_ids[0, spans[1][0]:spans[1][1] + 1])


def _same_batch(got, want) -> None:
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key])), key


def test_the_guides_data_collators_take_our_tokenizer_as_transformers():
    """DataCollatorWithPadding (text classification), DataCollatorForTokenClassification and
    DataCollatorForLanguageModeling (masked LM) call ``tokenizer.pad`` and ``get_special_tokens_mask``."""
    transformers = quiet_transformers()
    ours, theirs = _tokenizers()
    examples = {"tokens": [["@paulwalk", "It", "'s", "the", "view"], ["Paris", "!"], ["Empire", "State", "Building"]],
                "ner_tags": [[0, 0, 0, 0, 0], [7, 0], [7, 8, 8]]}
    for make, kw in ((transformers.DataCollatorWithPadding, {"pad_to_multiple_of": 8}),
                     (transformers.DataCollatorForTokenClassification, {}),
                     (transformers.DataCollatorForLanguageModeling, {"mlm_probability": 0.3})):
        batches = []
        for tok in (ours, theirs):
            if make is transformers.DataCollatorForTokenClassification:
                aligned = _align_labels(tok, examples, **({"return_tensors": None} if tok is ours else {}))
                features = [{k: v[i] for k, v in aligned.items()} for i in range(3)]
            else:
                features = [dict(tok(t, truncation=True, **({"return_tensors": None} if tok is ours else {})))
                            for t in TEXTS]
            torch.manual_seed(0)
            batches.append(make(tokenizer=tok, **kw)(features))
        _same_batch(*batches)
    for side in ("left", "right"):
        features = [dict(theirs(t)) for t in TEXTS]
        _same_batch(ours.pad(features, padding_side=side, return_tensors="pt"),
                    theirs.pad(features, padding_side=side, return_tensors="pt"))
        _same_batch(ours.pad(features[0], padding="max_length", max_length=12, padding_side=side),
                    theirs.pad(features[0], padding="max_length", max_length=12, padding_side=side))


TOKENIZER_DIRS = {"wordpiece/vocab.txt": wordpiece_vocab_dir,
                  "bert/cased-config": lambda: saved_dir(wordpiece_vocab_dir(), "bert-cased-config",
                                                         do_lower_case=False, model_max_length=24),
                  "roberta/vocab+merges": bpe_vocab_dir,
                  "TokenizersBackend": lambda: saved_dir(wordpiece_vocab_dir(), "bert-tokenizers-backend",
                                                         tokenizer_class="TokenizersBackend")}


@pytest.mark.parametrize("kind", list(TOKENIZER_DIRS))
def test_tokenizer_save_pretrained_writes_transformers_files_and_both_reload_them(kind, tmp_path):
    ours, theirs = _tokenizers(TOKENIZER_DIRS[kind]())
    for tok in (ours, theirs):
        tok.add_tokens(["flodlword", "zzqq"])
        tok.add_special_tokens({"extra_special_tokens": ["<|a|>"]})
        tok.pad_token = tok.eos_token or tok.sep_token
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    texts = ["a flodlword <|a|> zzqq here", *TEXTS]
    written = ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(str(tmp_path / "theirs"))  # before it pads: its backend keeps a call's padding, and saves it
    assert [Path(p).name for p in written] == ["tokenizer_config.json", "chat_template.jinja", "tokenizer.json"]
    files = [sorted(p.name for p in (tmp_path / d).iterdir()) for d in ("ours", "theirs")]
    assert files[0] == files[1]
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "ours" / name).read_text() == (tmp_path / "theirs" / name).read_text(), name
    mine, ref = (json.loads((tmp_path / d / "tokenizer_config.json").read_text()) for d in ("ours", "theirs"))
    loaded = ("is_local", "local_files_only")  # transformers' load-time keywords, which it writes back
    assert {k: v for k, v in ref.items() if k not in loaded} == {k: v for k, v in mine.items() if k not in loaded}
    ours.padding_side = "left"  # kept by both readers of our files (transformers 5.25 drops it from its own)
    ours.save_pretrained(tmp_path / "ours")
    reference = theirs(texts, padding=True, padding_side="left", return_tensors="pt")
    for reload in (AutoTokenizer.from_pretrained, quiet_transformers().AutoTokenizer.from_pretrained):
        again = reload(str(tmp_path / "ours"))
        got = again(texts, padding=True, return_tensors="pt")
        assert set(got) == set(reference) and all(torch.equal(got[k], reference[k]) for k in reference)
        assert (again.pad_token, len(again), again.padding_side) == (theirs.pad_token, len(theirs), "left")
        assert again.chat_template == theirs.chat_template


def test_tokenizer_save_pretrained_refuses_a_template_name_outside_its_folder(tmp_path):
    ours, _ = _tokenizers()
    ours.chat_template = {"default": "{{ 1 }}", "../../evil": "{{ 2 }}"}
    with pytest.raises(InputError, match=r"chat template name '\.\./\.\./evil'"):
        ours.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- configs --------------------------------------------------------------------------------------------------

def test_config_save_pretrained_is_read_by_autoconfig_as_transformers_own(tmp_path):
    source, _ = _source("bert-seqcls")
    ours, theirs = AutoConfig.from_pretrained(source), quiet_transformers().AutoConfig.from_pretrained(str(source))
    for config in (ours, theirs):
        config.num_labels = 5
        config.hidden_dropout_prob = 0.25
    ours.save_pretrained(tmp_path / "ours" / "new")  # made as transformers makes it
    theirs.save_pretrained(str(tmp_path / "theirs"))
    read = [quiet_transformers().AutoConfig.from_pretrained(str(tmp_path / d)).to_dict()
            for d in ("ours/new", "theirs")]
    for fields in read:
        fields.pop("_name_or_path")
    assert read[0] == read[1]


def test_config_to_dict_holds_transformers_values():
    """Every field ours returns has transformers' value (as config.json writes it: id2label's keys are strings);
    the fields left out are the ones transformers adds with their defaults."""
    source, _ = _source("bert-seqcls")
    ours, theirs = AutoConfig.from_pretrained(source), quiet_transformers().AutoConfig.from_pretrained(str(source))
    mine, ref = ours.to_dict(), json.loads(theirs.to_json_string(use_diff=False))
    assert {k: ref[k] for k in mine} == mine
    assert set(ref) - set(mine) <= {"_name_or_path", "chunk_size_feed_forward", "is_encoder_decoder",
                                    "output_attentions", "output_hidden_states", "problem_type", "return_dict"}


def test_config_num_labels_assignment_builds_that_head_as_transformers():
    source, task = _source("bert-mlm")[0], "seqcls"  # a checkpoint without a classifier, as the guides start
    ours, theirs = AutoConfig.from_pretrained(source), quiet_transformers().AutoConfig.from_pretrained(str(source))
    ours.num_labels = theirs.num_labels = 5
    assert (ours.id2label, ours.label2id) == (theirs.id2label, theirs.label2id)
    model = load_model(source, task, config=ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = quiet_transformers().AutoModelForSequenceClassification.from_pretrained(str(source), config=theirs)
    assert model.classifier.weight.shape == ref.classifier.weight.shape == (5, 32)
    assert model.config.id2label == ref.config.id2label


def test_autoconfig_keywords_then_from_config_as_the_quick_tour():
    source, _ = _source("bert-seqcls")
    kw = {"num_attention_heads": 8, "hidden_dropout_prob": 0.3, "num_labels": 5}
    ours = AutoConfig.from_pretrained(source, **kw)
    theirs = quiet_transformers().AutoConfig.from_pretrained(str(source), **kw)
    assert {k: getattr(ours, k) for k in kw} == {k: getattr(theirs, k) for k in kw}
    assert (ours.id2label, ours.label2id) == (theirs.id2label, theirs.label2id)
    model, ref = AutoModel.from_config(ours), quiet_transformers().AutoModel.from_config(theirs)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    with pytest.raises(InputError, match="num_hidden_layerz"):
        AutoConfig.from_pretrained(source, num_hidden_layerz=3)
