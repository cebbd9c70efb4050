"""The one-line tasks against transformers, on checkpoints generated here.

Each task runs on the same local checkpoint and inputs as transformers' pipeline (fill-mask,
text-classification, token-classification), as transformers 4's question-answering rule applied to
AutoModelForQuestionAnswering logits, and as sentence-transformers' pooling applied to AutoModel
output. With ``batch_size=1`` every input is forwarded alone, as the pipelines do, and results are
equal: same labels, tokens, spans and offsets, and the same float scores (``==``, not closeness),
because our models are bit-exact and the post-processing repeats the pipelines' own operations.

Automatic batching pads each batch to its longest row; on CPU that changes the float result of a
padded row by a few ulps, because the kernels see other shapes (measured max abs diff of scores,
batched vs one at a time: 1.9e-9 fill-mask and 3.0e-8 classification on these checkpoints; 4.8e-7
fill-mask on the real SPLADE sample, 1.6e-7 on real MiniLM embeddings). The batching tests allow 1e-6.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import flodl_hf
from flodl_hf import InputError, answer, classify, embed, fill_mask, rank, tag
from flodl_hf.core.registry import supported_model_types
from flodl_hf.tasks import clear_cache, load
from helpers import CACHE, make_checkpoint, quiet_transformers, one_thread  # noqa: F401  (the fixture)
from test_tokenizer_dirs import all_dirs

DIRS = all_dirs()
# Tokenizers of three kinds in front of BERT models: WordPiece ([MASK], token types), byte-level BPE
# (<mask>, no token types, no "##" so words are guessed from spaces) and SentencePiece unigram.
TOKENIZERS = ["bert/tokenizer.json", "roberta/tokenizer.json", "albert/unigram/tokenizer.json"]
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=128)
LABELS = {"seqcls": {0: "NEG", 1: "POS", 2: "NEU"},
          "tokcls": {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}}
TEXTS = ["Paris is the capital of France.", "John Smith lives in New York and works for Google.",
         "mary anne read a book", "Unbelievable! Transformers tokenizer café", "hello"]
CONTEXT = ("John Smith is a teacher in Paris. He likes coffee and reads a book every morning. " * 3
           + "Mary Anne works for Google in San Francisco, where the weather is sunny. "
           + "The capital of France is Paris, and Berlin is the capital of Germany. " * 2)
QUESTIONS = ["Where does Mary Anne work?", "What is the capital of France?", "Who is a teacher?"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/helpers.py


def task_dir(tokenizer: str, task: str, model_type: str = "bert", **config) -> Path:
    """make_checkpoint's model for ``task`` with the tokenizer files of ``tokenizer`` beside it."""
    transformers = quiet_transformers()
    tok_dir = DIRS[tokenizer]
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    fields = {"model_type": model_type, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id, **SMALL, **config}
    if task in LABELS and "id2label" not in config:
        fields["id2label"] = LABELS[task]
    ckpt = make_checkpoint(fields, task)
    def build(work: Path) -> None:
        shutil.copytree(ckpt, work)
        for f in tok_dir.iterdir():
            if f.name not in ("config.json", ".done"):
                shutil.copy(f, work / f.name)
        (work / ".done").write_text("ok")
    return _published(CACHE / f"task-{ckpt.name}-{tokenizer.replace('/', '_')}", build)


def _published(out: Path, build) -> Path:
    """``out``, built once by ``build(work)`` in a directory of this process's own and renamed into place (a
    concurrent test process may publish it first)."""
    if not (out / ".done").is_file():
        work = out.with_name(f"{out.name}.tmp{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        build(work)
        shutil.rmtree(out, ignore_errors=True)
        try:
            work.rename(out)
        except OSError:  # another process published it first
            shutil.rmtree(work, ignore_errors=True)
    return out


def short_copy(directory: Path, model_max_length: int) -> Path:
    """``directory`` with its tokenizer_config.json's model_max_length lowered: long texts then overflow the
    tokenizer (windows, truncation) as they would a real model's 512."""
    def build(work: Path) -> None:
        shutil.copytree(directory, work)  # .done included: the copy is published whole
        config = json.loads((work / "tokenizer_config.json").read_text())
        (work / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": model_max_length}))
    return _published(CACHE / f"{directory.name}-max{model_max_length}", build)


def pipeline(kind: str, directory: Path):
    transformers = quiet_transformers()
    return transformers.pipeline(kind, model=str(directory), device="cpu")


def plain(value):
    """Pipeline output with numpy scalars as Python numbers (ours are Python numbers already)."""
    return json.loads(json.dumps(value, default=lambda x: x.item()))


# ---- fill-mask ------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_fill_mask_matches_pipeline(tokenizer):
    directory = task_dir(tokenizer, "mlm")
    pipe = pipeline("fill-mask", directory)
    mask = pipe.tokenizer.mask_token
    texts = [f"Paris is the {mask} of France.", f"The {mask} brown fox jumps over the {mask} dog.",
             f"{mask}", f"hello world, {mask}!"]
    for text, top_k in zip(texts, (1, 3, 5, 2)):
        assert fill_mask(text, model=directory, top_k=top_k, batch_size=1) == pipe(text, top_k=top_k), text
    targets = ["paris", "fox", "dog", "zzzqqq"]  # the last is not in the vocabulary: replaced by its first token
    with pytest.warns(UserWarning, match="does not exist in the model vocabulary"):
        ours = fill_mask(texts[0], model=directory, targets=targets, batch_size=1)
    assert ours == pipe(texts[0], targets=targets)
    # A list gives one result per text (one list per mask where a text has several)
    assert fill_mask(texts, model=directory, batch_size=1) == [pipe(t) for t in texts]


def test_fill_mask_accepts_either_mask_spelling():
    bert, roberta = task_dir("bert/tokenizer.json", "mlm"), task_dir("roberta/tokenizer.json", "mlm")
    assert fill_mask("Paris is the <mask> of France.", bert) == fill_mask("Paris is the [MASK] of France.", bert)
    assert fill_mask("Paris is the [MASK] of France.", roberta) == fill_mask("Paris is the <mask> of France.", roberta)


def test_fill_mask_without_mask_is_a_clear_error():
    with pytest.raises(InputError, match=r"no mask token \(\[MASK\]\)"):
        fill_mask("Paris is the capital of France.", task_dir("bert/tokenizer.json", "mlm"))


def test_fill_mask_default_model_offline_says_what_to_do(monkeypatch):
    from flodl_hf.core import io
    from flodl_hf.core.errors import SourceNotFoundError

    def offline(repo_id, revision, subfolder="", **hub_options):
        raise SourceNotFoundError(f"cannot resolve '{repo_id}': offline")
    monkeypatch.setattr(io, "_download", offline)
    with pytest.raises(SourceNotFoundError, match="samples/splade"):
        fill_mask("Paris is the [MASK] of France.")


def test_tasks_read_their_record_whatever_the_configs_forward_defaults(tmp_path):
    """A config.json asking every forward for hidden states and tuples (transformers honours them) changes no
    one-liner's result: the tasks ask for the plain record. (output_attentions in the config also loads the
    eager path, as transformers does: other kernels, tests/test_from_pretrained_kwargs.py.)"""
    from flodl_hf.tasks.runtime import clear_cache
    plain = {"seqcls": task_dir("bert/tokenizer.json", "seqcls", problem_type="single_label_classification",
                                id2label=LABELS["seqcls"]),
             "tokcls": task_dir("bert/tokenizer.json", "tokcls"), "mlm": task_dir("bert/tokenizer.json", "mlm")}
    expected = {"seqcls": classify(TEXTS[:2], str(plain["seqcls"])), "tokcls": tag(TEXTS[:2], str(plain["tokcls"])),
                "mlm": fill_mask("paris is the [MASK] of france.", model=str(plain["mlm"]), top_k=2)}
    for task, directory in plain.items():
        edited = tmp_path / task
        shutil.copytree(directory, edited)
        config = json.loads((edited / "config.json").read_text())
        (edited / "config.json").write_text(json.dumps({**config, "output_hidden_states": True,
                                                        "return_dict": False}))
        clear_cache()
        got = {"seqcls": lambda: classify(TEXTS[:2], str(edited)), "tokcls": lambda: tag(TEXTS[:2], str(edited)),
               "mlm": lambda: fill_mask("paris is the [MASK] of france.", model=str(edited), top_k=2)}[task]()
        assert got == expected[task], task


# ---- text classification ----------------------------------------------------------------------------

# Scores depend on the problem type, tokenisation on the tokenizer: each is varied on its own.
CLASSIFY_CASES = [(TOKENIZERS[0], "single_label_classification"), (TOKENIZERS[0], "multi_label_classification"),
                  (TOKENIZERS[0], "regression"), (TOKENIZERS[1], "single_label_classification"),
                  (TOKENIZERS[2], "multi_label_classification")]


@pytest.mark.parametrize("tokenizer,problem", CLASSIFY_CASES)
def test_classify_matches_pipeline(tokenizer, problem):
    labels = {0: "SCORE"} if problem == "regression" else LABELS["seqcls"]
    directory = task_dir(tokenizer, "seqcls", problem_type=problem, id2label=labels)
    pipe = pipeline("text-classification", directory)
    assert classify(TEXTS[0], directory, batch_size=1) == plain(pipe(TEXTS[0]))
    assert classify(TEXTS, directory, batch_size=1) == plain(pipe(TEXTS))
    assert classify(TEXTS[1], directory, top_k=2, batch_size=1) == plain(pipe(TEXTS[1], top_k=2))
    assert classify(TEXTS, directory, top_k=None, batch_size=1) == plain(pipe(TEXTS, top_k=None))
    pair = {"text": QUESTIONS[1], "text_pair": TEXTS[0]}
    assert classify(pair, directory, batch_size=1) == plain(pipe(pair))
    # An explicit top_k=1 is not the default: the pipeline nests (a list per input), as for any other top_k
    for inputs in (TEXTS[0], TEXTS, pair, [pair, TEXTS[1]]):
        assert classify(inputs, directory, top_k=1, batch_size=1) == plain(pipe(inputs, top_k=1)), inputs
        assert classify(inputs, directory, batch_size=1) == plain(pipe(inputs)), inputs
    if (tokenizer, problem) == CLASSIFY_CASES[0]:
        for function in ("softmax", "sigmoid", "none"):
            assert classify(TEXTS, directory, function_to_apply=function, batch_size=1) == \
                plain(pipe(TEXTS, function_to_apply=function))


def test_num_labels_without_id2label_names_the_labels_as_transformers_does(tmp_path):
    """config.json with num_labels and no id2label: transformers reads LABEL_0... LABEL_{n-1}; we read 2
    labels and refused the 3-output head as a weights mismatch."""
    directory = tmp_path / "three"
    shutil.copytree(task_dir(TOKENIZERS[0], "seqcls", id2label={0: "a", 1: "b", 2: "c"}), directory)
    config = json.loads((directory / "config.json").read_text())
    for key in ("id2label", "label2id"):
        config.pop(key, None)
    (directory / "config.json").write_text(json.dumps({**config, "num_labels": 3}))
    ours = classify(TEXTS, directory, top_k=None, batch_size=1)
    assert ours == plain(pipeline("text-classification", directory)(TEXTS, top_k=None))
    assert {r["label"] for r in ours[0]} == {"LABEL_0", "LABEL_1", "LABEL_2"}
    # ids with a gap leave an output without a name: the pipeline fails on a KeyError, we at load
    config["id2label"] = {"0": "a", "2": "b", "5": "c"}
    (directory / "config.json").write_text(json.dumps(config))
    clear_cache()
    with pytest.raises(flodl_hf.ConfigError, match=r"config\.json: id2label's ids are \[0, 2, 5\]"):
        classify(TEXTS, directory)


# ---- token classification ---------------------------------------------------------------------------

@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_tag_matches_pipeline(tokenizer):
    directory = task_dir(tokenizer, "tokcls")
    pipe = pipeline("token-classification", directory)
    # The default is the pipeline's, "none": one entity per token, with its index
    default = tag(TEXTS, directory, batch_size=1)
    assert default == plain(pipe(TEXTS)) and all("index" in e for entities in default for e in entities)
    assert tag(TEXTS[1], directory, batch_size=1) == pipe(TEXTS[1])  # float == numpy float32 score
    for strategy in ("none", "simple", "first", "average", "max"):
        ours = tag(TEXTS, directory, aggregation_strategy=strategy, batch_size=1)
        assert ours == plain(pipe(TEXTS, aggregation_strategy=strategy)), strategy
        assert any(ours), f"{strategy}: the random head tagged nothing; the comparison would be empty"
        for text, entities in zip(TEXTS, ours):
            for e in entities:  # offsets index the original text
                assert 0 <= e["start"] <= e["end"] <= len(text)
    assert tag(TEXTS[1], directory, ignore_labels=[], batch_size=1) == plain(pipe(TEXTS[1], ignore_labels=[]))
    assert tag(TEXTS[1], directory, ignore_labels=[], aggregation_strategy="simple", batch_size=1) == \
        plain(pipe(TEXTS[1], ignore_labels=[], aggregation_strategy="simple"))


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_tag_stride_and_split_words_match_pipeline(tokenizer):
    """stride: overlapping windows of model_max_length (24 here) merged as the pipeline merges them;
    is_split_into_words: lists of words, offsets into the words joined by the delimiter."""
    directory = short_copy(task_dir(tokenizer, "tokcls"), 24)
    pipe = pipeline("token-classification", directory)
    long = CONTEXT[:300]
    for options in (dict(stride=4), dict(stride=8, aggregation_strategy="simple"),
                    dict(stride=0, aggregation_strategy="average"), dict(stride=6, aggregation_strategy="max")):
        ours = tag(long, directory, batch_size=1, **options)
        assert ours == plain(pipe(long, **options)), options
        assert ours and max(e["end"] for e in ours) > len(long) // 2, "the windows reach past the first"
    words, more = TEXTS[1].split(), TEXTS[2].split()
    for inputs in (words, [words, more], [words * 4]):
        for options in (dict(), dict(aggregation_strategy="first"), dict(aggregation_strategy="simple", delimiter="--"),
                        dict(aggregation_strategy="first", stride=4)):
            expected = plain(pipe(inputs, is_split_into_words=True, **options))
            assert tag(inputs, directory, is_split_into_words=True, batch_size=1, **options) == expected, options


def test_tag_refuses_strides_the_pipeline_cannot_take():
    directory = short_copy(task_dir("bert/tokenizer.json", "tokcls"), 24)
    pipe = pipeline("token-classification", directory)
    room = 24 - 2  # [CLS] and [SEP]
    with pytest.raises(BaseException):  # transformers: a tokenizers panic (not an Exception)
        pipe(CONTEXT, stride=room, aggregation_strategy="simple")
    for stride in (room, 24, 100):
        with pytest.raises(InputError, match=rf"stride={stride} must be below {room}"):
            tag(CONTEXT, directory, stride=stride, aggregation_strategy="simple")
    assert tag(CONTEXT[:200], directory, stride=room - 1, aggregation_strategy="simple", batch_size=1) == \
        plain(pipe(CONTEXT[:200], stride=room - 1, aggregation_strategy="simple"))
    with pytest.raises(ValueError, match="stride"):
        pipe(CONTEXT, stride=4, aggregation_strategy="none")
    with pytest.raises(InputError, match='stride=4.*aggregation_strategy="none"'):
        tag(CONTEXT, directory, stride=4, aggregation_strategy="none")
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(InputError, match="stride="):
            tag(CONTEXT, directory, stride=bad, aggregation_strategy="simple")
    with pytest.raises(InputError, match=r"is_split_into_words=True: texts is a str"):
        tag("a b", directory, is_split_into_words=True)


# ---- question answering ----------------------------------------------------------------------------

def v4_answer(question, context, model, tok, top_k=1, max_answer_len=15, doc_stride=128, max_seq_len=384,
              handle_impossible_answer=False):
    """transformers 4.57's QuestionAnsweringPipeline (fast tokenizer, align_to_words) on transformers'
    own tokenizer and AutoModelForQuestionAnswering logits, one window at a time."""
    question_first = tok.padding_side == "right"
    enc = tok(question if question_first else context, context if question_first else question,
              padding="do_not_pad", truncation="only_second" if question_first else "only_first",
              max_length=max_seq_len, stride=doc_stride, return_token_type_ids=True, return_overflowing_tokens=True,
              return_offsets_mapping=True, return_special_tokens_mask=True)
    min_null_score, answers = 1000000, []
    for span in range(len(enc["input_ids"])):
        p_mask = [t != 1 if question_first else 0 for t in enc.sequence_ids(span)]
        for cls_index in np.nonzero(np.array(enc["input_ids"][span]) == tok.cls_token_id)[0]:
            p_mask[cls_index] = 0
        inputs = {k: torch.tensor([enc[k][span]]) for k in tok.model_input_names}
        with torch.no_grad():
            out = model(**inputs)
        attention = inputs["attention_mask"].numpy()
        undesired = np.abs(np.array(p_mask) - 1) & attention
        start = np.where(undesired == 0.0, -10000.0, out.start_logits)
        end = np.where(undesired == 0.0, -10000.0, out.end_logits)
        start = np.exp(start - start.max(axis=-1, keepdims=True))
        start = start / start.sum()
        end = np.exp(end - end.max(axis=-1, keepdims=True))
        end = end / end.sum()
        if handle_impossible_answer:
            min_null_score = min(min_null_score, (start[0, 0] * end[0, 0]).item())
        start[0, 0] = end[0, 0] = 0.0
        outer = np.matmul(np.expand_dims(start, -1), np.expand_dims(end, 1))
        candidates = np.tril(np.triu(outer), max_answer_len - 1)
        flat = candidates.flatten()
        k = top_k * 2 + 10
        if k == 1:
            order = [np.argmax(flat)]
        elif len(flat) < k:
            order = np.argsort(-flat)
        else:
            idx = np.argpartition(-flat, k)[0:k]
            order = idx[np.argsort(-flat[idx])]
        starts, ends = np.unravel_index(order, candidates.shape)[1:]
        keep = np.isin(starts, undesired.nonzero()) & np.isin(ends, undesired.nonzero())
        e_span = enc.encodings[span]
        for s, e, score in zip(starts[keep], ends[keep], candidates[0, starts[keep], ends[keep]]):
            try:
                a = e_span.word_to_chars(e_span.token_to_word(s), sequence_index=1 if question_first else 0)[0]
                b = e_span.word_to_chars(e_span.token_to_word(e), sequence_index=1 if question_first else 0)[1]
            except Exception:
                a, b = e_span.offsets[s][0], e_span.offsets[e][1]
            same = [x for x in answers if x["answer"].lower() == context[a:b].lower()]
            if same:
                same[0]["score"] += score.item()
            else:
                answers.append({"score": score.item(), "start": a, "end": b, "answer": context[a:b]})
    if handle_impossible_answer:
        answers.append({"score": min_null_score, "start": 0, "end": 0, "answer": ""})
    answers = sorted(answers, key=lambda x: x["score"], reverse=True)[:top_k]
    return answers[0] if len(answers) == 1 else answers


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_answer_matches_transformers_4_rule(tokenizer):
    transformers = quiet_transformers()
    directory = task_dir(tokenizer, "qa")
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModelForQuestionAnswering.from_pretrained(str(directory)).eval()
    windows = dict(max_seq_len=48, doc_stride=16)  # the context spans several windows
    assert len(tok(QUESTIONS[0], CONTEXT, truncation="only_second", max_length=48, stride=16,
                   return_overflowing_tokens=True)["input_ids"]) > 3
    questions = QUESTIONS if tokenizer == TOKENIZERS[0] else QUESTIONS[:1]
    for question in questions:
        for options in (dict(), dict(top_k=3), dict(top_k=2, max_answer_len=4, handle_impossible_answer=True)):
            ours = answer(question, CONTEXT, directory, batch_size=1, **windows, **options)
            assert ours == v4_answer(question, CONTEXT, model, tok, **windows, **options), (question, options)
            for a in (ours if isinstance(ours, list) else [ours]):
                assert CONTEXT[a["start"]:a["end"]] == a["answer"]
    assert answer(questions, CONTEXT, directory, batch_size=1, **windows) == \
        [v4_answer(q, CONTEXT, model, tok, **windows) for q in questions]


def test_answer_rejects_bad_windows():
    directory = task_dir("bert/tokenizer.json", "qa")
    with pytest.raises(InputError, match="doc_stride"):
        answer(QUESTIONS[0], CONTEXT, directory, max_seq_len=32, doc_stride=64)


# ---- embeddings ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_embed_matches_sentence_transformers_math(tokenizer):
    transformers = quiet_transformers()
    directory = task_dir(tokenizer, "base")
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModel.from_pretrained(str(directory)).eval()
    for pooling in ("mean", "cls", "max"):
        for normalize in (True, False):
            expected = []
            for text in TEXTS:  # sentence_transformers.models.Pooling, then Normalize
                features = tok(text, return_tensors="pt", truncation="longest_first")
                with torch.no_grad():
                    tokens = model(**features).last_hidden_state
                mask = features["attention_mask"].unsqueeze(-1).expand(tokens.size()).to(tokens.dtype)
                if pooling == "mean":
                    vector = torch.sum(tokens * mask, 1) / torch.clamp(mask.sum(1), min=1e-9)
                elif pooling == "cls":
                    vector = tokens[:, 0]
                else:
                    vector = torch.max(tokens.masked_fill(mask == 0, -1e9), 1)[0]
                expected.append(torch.nn.functional.normalize(vector, p=2, dim=1) if normalize else vector)
            ours = embed(TEXTS, directory, pooling=pooling, normalize=normalize, batch_size=1)
            assert torch.equal(ours, torch.cat(expected)), (pooling, normalize)
    assert embed(TEXTS[0], directory, batch_size=1).shape == (SMALL["hidden_size"],)


def test_rank_orders_by_cosine_similarity():
    directory = task_dir("bert/tokenizer.json", "base")
    ranked = rank(TEXTS[0], TEXTS, directory)
    assert ranked[0]["text"] == TEXTS[0] and abs(ranked[0]["score"] - 1.0) < 1e-5
    assert [r["score"] for r in ranked] == sorted((r["score"] for r in ranked), reverse=True)
    vectors = embed(TEXTS, directory)
    assert ranked[1]["score"] == pytest.approx(float(vectors[0] @ vectors[ranked[1]["index"]]), abs=1e-6)


# ---- batching, truncation, caching ---------------------------------------------------------------------

def test_batching_changes_scores_by_float_noise_only():
    """Padded batches (sorted by length) against one text at a time: same answers, scores within 1e-6."""
    mlm = task_dir("bert/tokenizer.json", "mlm")
    texts = [t.replace("capital", "[MASK]").replace("read", "[MASK]") for t in TEXTS if "capital" in t or "read" in t]
    texts += [f"{t} [MASK]" for t in TEXTS]
    one, batched = fill_mask(texts, mlm, batch_size=1), fill_mask(texts, mlm, batch_size=4)
    assert [[r["token"] for r in x] for x in one] == [[r["token"] for r in x] for x in batched]
    assert max(abs(a["score"] - b["score"]) for x, y in zip(one, batched) for a, b in zip(x, y)) <= 1e-6
    seqcls = task_dir("bert/tokenizer.json", "seqcls", problem_type="single_label_classification",
                      id2label=LABELS["seqcls"])
    one, batched = classify(TEXTS, seqcls, top_k=None, batch_size=1), classify(TEXTS, seqcls, top_k=None)
    assert [[r["label"] for r in x] for x in one] == [[r["label"] for r in x] for x in batched]
    assert max(abs(a["score"] - b["score"]) for x, y in zip(one, batched) for a, b in zip(x, y)) <= 1e-6


def test_long_inputs_are_truncated_with_a_warning():
    directory = task_dir("bert/tokenizer.json", "seqcls", problem_type="single_label_classification",
                         id2label=LABELS["seqcls"])
    long = " ".join(["paris is the capital of france"] * 100)  # far beyond 128 positions
    with pytest.warns(UserWarning, match="truncated to the model's maximum"):
        result = classify([long, TEXTS[0]], directory)
    assert len(result) == 2 and all("label" in r for r in result)


def test_models_are_loaded_once():
    clear_cache()
    directory = task_dir("bert/tokenizer.json", "mlm")
    first = load(directory, "mlm")
    assert load(directory, "mlm").model is first.model and load(directory, "mlm").tokenizer is first.tokenizer


def test_model_objects_need_their_tokenizer():
    directory = task_dir("bert/tokenizer.json", "mlm")
    model = flodl_hf.AutoModelForMaskedLM.from_pretrained(directory)
    with pytest.raises(InputError, match="tokenizer="):
        fill_mask("a [MASK]", model=model)
    assert fill_mask("a [MASK]", model=model, tokenizer=directory) == fill_mask("a [MASK]", model=directory)


# Every registered family behind the tasks: its usual tokenizer kind, a small config.
FAMILY_CASES = {
    "bert": ("bert/tokenizer.json", {}),
    "distilbert": ("distilbert/tokenizer.json", dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64)),
    "roberta": ("roberta/tokenizer.json", dict(max_position_embeddings=130)),
    "camembert": ("roberta/tokenizer.json", dict(max_position_embeddings=130)),
    "xlm-roberta": ("xlm-roberta/unigram/tokenizer.json", dict(max_position_embeddings=130)),
    "albert": ("albert/unigram/tokenizer.json", dict(embedding_size=16)),
    "deberta-v2": ("deberta-v2/unigram/tokenizer.json",
                   dict(relative_attention=True, position_buckets=8, pos_att_type="p2c|c2p", share_att_key=True,
                        norm_rel_ebd="layer_norm", position_biased_input=False, type_vocab_size=0,
                        max_relative_positions=-1)),
}


@pytest.mark.parametrize("model_type", list(FAMILY_CASES))
def test_every_family_fills_masks_as_the_pipeline(model_type):
    """Tasks are generic: each family (with or without token types) gets only the inputs it takes."""
    if model_type not in supported_model_types():
        pytest.skip(f"the {model_type} family is not registered")
    tokenizer, config = FAMILY_CASES[model_type]
    directory = task_dir(tokenizer, "mlm", model_type=model_type, **config)
    pipe = pipeline("fill-mask", directory)
    text = f"Paris is the {pipe.tokenizer.mask_token} of France."
    assert fill_mask(text, directory, top_k=3, batch_size=1) == pipe(text, top_k=3)


# ---- CLI, as a user runs it ---------------------------------------------------------------------------

def flodl_hf_command(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("flodl-hf") or str(Path(sys.executable).with_name("flodl-hf"))
    # One thread, as the in-process side runs (one_thread): the thread count changes float results by ulps.
    return subprocess.run([exe, *args], input=stdin, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})


def test_cli_fill_mask_json_matches_library():
    directory = str(task_dir("bert/tokenizer.json", "mlm"))
    done = flodl_hf_command("fill-mask", "Paris is the [MASK] of France.", "--model", directory, "--top-k", "2",
                            "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == fill_mask(["Paris is the [MASK] of France."], directory, top_k=2)


def test_cli_errors_are_one_line_and_exit_2(capsys):
    from flodl_hf.cli import main
    directory = str(task_dir("bert/tokenizer.json", "mlm"))
    assert main(["fill-mask", "no mask here", "--model", directory]) == 2
    assert "error: no mask token" in capsys.readouterr().err


def test_cli_classify_and_tag_read_stdin():
    seqcls = str(task_dir("bert/tokenizer.json", "seqcls", problem_type="single_label_classification",
                          id2label=LABELS["seqcls"]))
    done = flodl_hf_command("classify", "--model", seqcls, "--json", stdin="\n".join(TEXTS[:2]) + "\n")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == classify(TEXTS[:2], seqcls)  # no --top-k: one dict per text
    done = flodl_hf_command("classify", "--model", seqcls, "--json", "--top-k", "1",
                            stdin="\n".join(TEXTS[:2]) + "\n")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == classify(TEXTS[:2], seqcls, top_k=1)  # nested, as the pipeline
    tokcls = str(task_dir("bert/tokenizer.json", "tokcls"))
    done = flodl_hf_command("tag", TEXTS[1], "--model", tokcls, "--aggregation", "first")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == TEXTS[1] and "label" in done.stdout.splitlines()[1]


def test_cli_answer_and_embed():
    qa = str(task_dir("bert/tokenizer.json", "qa"))
    done = flodl_hf_command("answer", "--question", QUESTIONS[0], "--model", qa, "--json", stdin=CONTEXT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == answer(QUESTIONS[0], CONTEXT.strip(), qa)
    base = str(task_dir("bert/tokenizer.json", "base"))
    done = flodl_hf_command("embed", *TEXTS[:3], "--model", base, "--query", TEXTS[0], "--json")
    assert done.returncode == 0, done.stderr
    assert [r["index"] for r in json.loads(done.stdout)] == [r["index"] for r in rank(TEXTS[0], TEXTS[:3], base)]
