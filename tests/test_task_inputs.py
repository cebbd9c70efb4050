"""Task inputs at their edges: what the pipelines answer, ours answers identically; what they cannot (a
tokenizers panic, a raw TypeError), ours refuses with an InputError naming the argument.

References run in the same process on the same small checkpoints as tests/test_tasks.py: transformers'
text-classification and fill-mask pipelines, and transformers 4.57's question-answering rule
(tests/test_tasks.py::v4_answer; transformers 5 has no question-answering pipeline).
"""

from __future__ import annotations

import math
import warnings

import pytest

from flodl_hf import InputError, answer, classify, fill_mask
from flodl_hf.tasks import detect_replaced
from helpers import quiet_transformers, one_thread  # noqa: F401  (the fixture)
from test_tasks import CONTEXT, LABELS, QUESTIONS, TEXTS, TOKENIZERS, pipeline, plain, short_copy, task_dir, v4_answer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/helpers.py

BERT = TOKENIZERS[0]


@pytest.fixture(scope="module")
def qa():
    """The QA checkpoint with transformers' own tokenizer and model (the v4_answer reference's inputs)."""
    transformers = quiet_transformers()
    directory = task_dir(BERT, "qa")
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModelForQuestionAnswering.from_pretrained(str(directory)).eval()
    return directory, model, tok


@pytest.fixture(scope="module")
def seqcls():
    directory = task_dir(BERT, "seqcls", problem_type="single_label_classification", id2label=LABELS["seqcls"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return directory, pipeline("text-classification", directory)


# ---- answer: windows (doc_stride against the room the question leaves) ----------------------------------

def _room(tok, question: str, max_seq_len: int) -> int:
    """The context tokens per window: max_seq_len less the question and a pair's special tokens."""
    question_tokens = len(tok(question, add_special_tokens=False)["input_ids"])
    return max_seq_len - tok.num_special_tokens_to_add(pair=True) - question_tokens


def test_answer_stride_below_the_room_matches_and_at_the_room_is_an_input_error(qa):
    directory, model, tok = qa
    question, max_seq_len = QUESTIONS[0], 40
    room = _room(tok, question, max_seq_len)
    assert 1 < room < max_seq_len
    # The largest stride tokenizers takes: the same answer as the reference
    ok = dict(max_seq_len=max_seq_len, doc_stride=room - 1, top_k=3)
    assert answer(question, CONTEXT, directory, batch_size=1, **ok) == v4_answer(question, CONTEXT, model, tok, **ok)
    # One more: transformers' rule ends in a tokenizers panic (a BaseException, not an Exception) ...
    bad = dict(max_seq_len=max_seq_len, doc_stride=room)
    with pytest.raises(BaseException) as panic:
        v4_answer(question, CONTEXT, model, tok, **bad)
    assert not isinstance(panic.value, Exception)
    # ... ours says which argument, before tokenising
    with pytest.raises(InputError, match=rf"doc_stride={room} must be below {room}.*max_seq_len={max_seq_len}"):
        answer(question, CONTEXT, directory, **bad)


def test_answer_default_stride_with_a_long_question_is_an_input_error(qa):
    directory, _, _ = qa
    with pytest.raises(InputError, match=r"doc_stride=64 \(the default"):
        answer("where " * 20 + "?", CONTEXT, directory)  # 128 positions: max_seq_len 128, doc_stride 64


def test_answer_large_stride_is_fine_when_the_context_fits_one_window(qa):
    directory, model, tok = qa
    context = "John Smith is a teacher in Paris. He likes coffee."
    options = dict(max_seq_len=128, doc_stride=120)  # far above the room, but nothing is cut
    assert answer(QUESTIONS[2], context, directory, batch_size=1, **options) == \
        v4_answer(QUESTIONS[2], context, model, tok, **options)


def test_answer_question_leaving_no_room_is_an_input_error(qa):
    directory, _, _ = qa
    with pytest.raises(InputError, match=r"question is \d+ tokens.*no room.*max_seq_len=48"):
        answer("what " * 60 + "?", CONTEXT, directory, max_seq_len=48, doc_stride=8)
    with pytest.raises(InputError, match=r"question\[1\] is \d+ tokens"):
        answer([QUESTIONS[0], "what " * 60 + "?"], CONTEXT, directory, max_seq_len=48, doc_stride=8)


@pytest.mark.parametrize("doc_stride", [-1, 1.5, True, "8"])
def test_answer_rejects_a_bad_doc_stride(qa, doc_stride):
    with pytest.raises(InputError, match=r"doc_stride=.*must be an integer >= 0"):
        answer(QUESTIONS[0], CONTEXT, qa[0], doc_stride=doc_stride)


@pytest.mark.parametrize("max_seq_len", [0, -5, 1.5, "64"])
def test_answer_rejects_a_bad_max_seq_len(qa, max_seq_len):
    with pytest.raises(InputError, match="max_seq_len"):
        answer(QUESTIONS[0], CONTEXT, qa[0], max_seq_len=max_seq_len)


# ---- answer: question and context -------------------------------------------------------------------

@pytest.mark.parametrize("question,context,named", [
    (None, "John is here.", "question is a NoneType"),
    ("Who?", None, "context is None"),
    ("Who?", 5, "context is a int"),
    (5, "John is here.", "question is a int"),
    (["Who?", None], "John is here.", r"question\[1\] is a NoneType"),
    ("Who?", ["John is here.", 3], r"context\[1\] is a int"),
    (b"Who?", "John is here.", "question is a bytes"),
    ({"question": "Who?"}, "John is here.", "question is a dict while context is given"),
    ({"question": "Who?"}, None, "missing 'context'"),
    (["Who?", "What?"], ["John is here."] * 3, "2 questions for 3 contexts"),
    ("", "John is here.", "non-empty"),
])
def test_answer_rejects_bad_questions_and_contexts(qa, question, context, named):
    with pytest.raises(InputError, match=named):
        answer(question, context, qa[0])


def test_answer_takes_the_pipelines_example_dicts(qa):
    directory, model, tok = qa
    windows = dict(max_seq_len=48, doc_stride=16)
    example = {"question": QUESTIONS[0], "context": CONTEXT}
    expected = v4_answer(QUESTIONS[0], CONTEXT, model, tok, **windows)
    assert answer(example, None, directory, batch_size=1, **windows) == expected
    assert answer([example, {"question": QUESTIONS[1], "context": CONTEXT}], None, directory, batch_size=1,
                  **windows) == [expected, v4_answer(QUESTIONS[1], CONTEXT, model, tok, **windows)]
    # A generator of questions is a list of questions
    assert answer((q for q in QUESTIONS[:1]), CONTEXT, directory, batch_size=1, **windows) == [expected]


# ---- classify: text pairs, item by item as the pipeline ----------------------------------------------------

@pytest.mark.parametrize("items", [
    [{"text": "c"}, {"text": "a", "text_pair": "b"}],  # a pair after a single text was scored as "a" alone
    [{"text": "a", "text_pair": "b"}, {"text": "c"}],  # a single text after a pair was refused
    [{"text": QUESTIONS[1], "text_pair": ""}, {"text": "a", "text_pair": None}, "plain text",
     {"text": QUESTIONS[0], "text_pair": CONTEXT[:80]}],
], ids=["single-then-pair", "pair-then-single", "empty-and-none-pairs"])
def test_classify_mixed_pairs_match_the_pipeline(seqcls, items):
    directory, pipe = seqcls
    expected = plain(pipe(items, top_k=None))
    assert classify(items, directory, top_k=None, batch_size=1) == expected
    assert classify(items, directory, batch_size=1) == plain(pipe(items))
    # Each item alone too (a dict alone gives a dict, as the pipeline does)
    for item, scores in zip(items, expected):
        if isinstance(item, dict):
            assert classify(item, directory, top_k=None, batch_size=1) == scores
    # Batched automatically: the same labels, scores within float noise (tests/test_tasks.py's 1e-6)
    batched = classify(items, directory, top_k=None)
    assert [[r["label"] for r in x] for x in batched] == [[r["label"] for r in x] for x in expected]
    assert max(abs(a["score"] - b["score"]) for x, y in zip(batched, expected) for a, b in zip(x, y)) <= 1e-6


def test_classify_empty_text_pair_is_a_single_text(seqcls):
    directory, pipe = seqcls
    item = {"text": "a", "text_pair": ""}
    assert classify(item, directory, top_k=None, batch_size=1) == plain(pipe(item, top_k=None)) == \
        classify("a", directory, top_k=None, batch_size=1)


@pytest.mark.parametrize("items,named", [
    ([{"text": "a"}, {"text_pair": "b"}], r"texts\[1\].*missing 'text'"),
    ([{"text": "a", "text_pair": 5}], r"texts\[0\]\['text_pair'\] is a int"),
    (["a", 5], r"texts\[1\] is a int"),
    ([{"text": None}], r"texts\[0\] is a NoneType"),
])
def test_classify_rejects_bad_items(seqcls, items, named):
    with pytest.raises(InputError, match=named):
        classify(items, seqcls[0])


# ---- classify and fill_mask: the pipelines' tokenizer arguments --------------------------------------------------

def test_classify_truncation_matches_the_pipeline_where_it_answers(seqcls):
    """With model_max_length 24: what the pipeline answers, ours answers identically; where it fails (a long
    text untruncated: an index error in the model; a strategy the inputs cannot take: a tokenizers error),
    ours raises an InputError naming the argument."""
    directory = short_copy(seqcls[0], 24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = pipeline("text-classification", directory)
    long = CONTEXT * 2
    inputs = [TEXTS[0], long, {"text": long, "text_pair": "x y"}, {"text": "x y", "text_pair": long}]
    answered = 0
    for options in (dict(truncation=True), dict(truncation="only_first"), dict(truncation="only_second"),
                    dict(truncation=True, max_length=20), dict(truncation=False), dict(truncation="longest_first")):
        for item in inputs:
            try:
                expected = plain(pipe(item, **options))
            except Exception:  # noqa: BLE001 - the pipeline fails on this one
                with pytest.raises(InputError, match=r"truncation="):
                    classify(item, directory, batch_size=1, **options)
                continue
            assert classify(item, directory, batch_size=1, **options) == expected, (item, options)
            assert classify([item], directory, top_k=None, batch_size=1, **options) == \
                plain(pipe([item], top_k=None, **options))
            answered += 1
    assert answered >= 12
    with pytest.raises(InputError, match="truncation='left'"):
        classify(TEXTS[0], directory, truncation="left")
    with pytest.raises(InputError, match="max_length=0"):
        classify(TEXTS[0], directory, truncation=True, max_length=0)


def test_fill_mask_tokenizer_kwargs_match_the_pipeline():
    directory = short_copy(task_dir(BERT, "mlm"), 24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = pipeline("fill-mask", directory)
    text = "Paris is the [MASK] of France. " + "a b c " * 30
    for kwargs in ({"truncation": True}, {"truncation": True, "max_length": 12}):
        assert fill_mask(text, directory, tokenizer_kwargs=kwargs, batch_size=1) == pipe(text, tokenizer_kwargs=kwargs)
        assert fill_mask([text, "[MASK]"], directory, tokenizer_kwargs=kwargs, batch_size=1) == \
            [pipe(text, tokenizer_kwargs=kwargs), pipe("[MASK]", tokenizer_kwargs=kwargs)]
    with pytest.raises(InputError, match="truncation=False: input #0 is"):
        fill_mask(text, directory, tokenizer_kwargs={"truncation": False})
    with pytest.raises(InputError, match="tokenizer_kwargs: 'padding' not supported"):
        fill_mask(text, directory, tokenizer_kwargs={"padding": True})
    with pytest.raises(InputError, match="tokenizer_kwargs is a list"):
        fill_mask(text, directory, tokenizer_kwargs=[("truncation", True)])


# ---- detect_replaced ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def electra():
    return task_dir(BERT, "pretraining", model_type="electra", embedding_size=16)


@pytest.mark.parametrize("texts,kwargs,named", [
    (None, {}, "texts is a NoneType"),
    (5, {}, "texts is a int"),
    ({"some key": 1}, {}, "texts is a dict"),
    (["ok", 3], {}, r"texts\[1\] is a int"),
    ("a b", {"threshold": "x"}, "threshold='x'"),
    ("a b", {"threshold": None}, "threshold=None"),
    ("a b", {"threshold": True}, "threshold=True"),
    ("a b", {"threshold": math.nan}, "threshold=nan"),
])
def test_detect_replaced_rejects_bad_input(electra, texts, kwargs, named):
    with pytest.raises(InputError, match=named):
        detect_replaced(texts, electra, **kwargs)


def test_detect_replaced_threshold_and_lists(electra):
    one = detect_replaced("the quick brown fox", electra, batch_size=1)
    assert detect_replaced(["the quick brown fox"], electra, batch_size=1) == [one]
    assert detect_replaced([], electra) == []
    for threshold in (0, 1, 0.5):  # an int threshold is a number too
        marked = detect_replaced("the quick brown fox", electra, threshold=threshold, batch_size=1)
        assert [t["replaced"] for t in marked] == [t["score"] > threshold for t in one]


# ---- fill_mask: targets cap top_k before the vocabulary does --------------------------------------------------

def test_fill_mask_targets_cap_top_k_before_the_vocabulary():
    directory = task_dir(BERT, "mlm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = pipeline("fill-mask", directory)
    text = "Paris is the [MASK] of France."
    targets = ["paris", "dog"]
    expected = pipe(text, targets=targets, top_k=1000)
    assert len(expected) == 2
    assert fill_mask(text, directory, targets=targets, top_k=1000, batch_size=1) == expected
    with pytest.raises(InputError, match="top_k=1000: larger than the"):
        fill_mask(text, directory, top_k=1000)  # no targets: the vocabulary (400 tokens) is the limit
