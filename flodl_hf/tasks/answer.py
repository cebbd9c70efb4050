"""``answer``: transformers 4's question-answering pipeline rule on our QA logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from flodl_hf.core.errors import InputError
from flodl_hf.tokenization import Tokenizer, check_text
from flodl_hf.tasks.runtime import (BATCH_SIZE, BatchSize, Source, _MODEL_KEYS, _as_list, _check_texts, _check_top_k,
                                    _run, load)


def _decode_spans(start: np.ndarray, end: np.ndarray, topk: int, max_answer_len: int,
                  undesired: np.ndarray) -> tuple:
    # transformers 4.57 pipelines/question_answering.py: decode_spans
    if start.ndim == 1:
        start = start[None]
    if end.ndim == 1:
        end = end[None]
    outer = np.matmul(np.expand_dims(start, -1), np.expand_dims(end, 1))
    candidates = np.tril(np.triu(outer), max_answer_len - 1)
    flat = candidates.flatten()
    if topk == 1:
        order = [np.argmax(flat)]
    elif len(flat) < topk:
        order = np.argsort(-flat)
    else:
        idx = np.argpartition(-flat, topk)[0:topk]
        order = idx[np.argsort(-flat[idx])]
    starts, ends = np.unravel_index(order, candidates.shape)[1:]
    wanted = np.isin(starts, undesired.nonzero()) & np.isin(ends, undesired.nonzero())
    starts, ends = starts[wanted], ends[wanted]
    return starts, ends, candidates[0, starts, ends]


def _select_starts_ends(start: np.ndarray, end: np.ndarray, p_mask: list, attention_mask: np.ndarray,
                        min_null_score: float, top_k: int, handle_impossible_answer: bool,
                        max_answer_len: int) -> tuple:
    # transformers 4.57 pipelines/question_answering.py: select_starts_ends. Softmax over context tokens only.
    undesired = np.abs(np.array(p_mask) - 1) & attention_mask
    mask = undesired == 0.0
    start = np.where(mask, -10000.0, start)
    end = np.where(mask, -10000.0, end)
    start = np.exp(start - start.max(axis=-1, keepdims=True))
    start = start / start.sum()
    end = np.exp(end - end.max(axis=-1, keepdims=True))
    end = end / end.sum()
    if handle_impossible_answer:
        min_null_score = min(min_null_score, (start[0, 0] * end[0, 0]).item())
    start[0, 0] = end[0, 0] = 0.0
    starts, ends, scores = _decode_spans(start, end, top_k, max_answer_len, undesired)
    return starts, ends, scores, min_null_score


def _char_span(encoding, s: int, e: int, sequence_index: int) -> tuple[int, int]:
    """Whole words around the token span (QuestionAnsweringPipeline.get_indices, align_to_words)."""
    try:
        start = encoding.word_to_chars(encoding.token_to_word(s), sequence_index=sequence_index)[0]
        end = encoding.word_to_chars(encoding.token_to_word(e), sequence_index=sequence_index)[1]
    except Exception:  # noqa: BLE001 - tokenizers without words keep to offsets, as the pipeline does
        start, end = encoding.offsets[s][0], encoding.offsets[e][1]
    return start, end


def _is_example(item: object) -> bool:
    """The QA pipeline's other input forms: a dict {"question", "context"} or a SquadExample."""
    return isinstance(item, dict) or (hasattr(item, "question_text") and hasattr(item, "context_text"))


def _from_example(item: object, where: str) -> tuple:
    if isinstance(item, dict):
        missing = [k for k in ("question", "context") if k not in item]
        if missing:
            raise InputError(f"{where}: a question-answering example is a dict with keys 'question' and 'context' "
                             f"(missing {', '.join(map(repr, missing))})")
        return item["question"], item["context"]
    return item.question_text, item.context_text


def _examples(question: object, context: object) -> tuple[list[tuple[str, str]], bool]:
    """(question, context) pairs and whether one answer (not a list) is returned, with every input checked:
    a string or a list of strings each (one context for many questions, or one question for many contexts,
    or as many of each); or, with context=None, the QA pipeline's example form: a dict
    ``{"question": ..., "context": ...}`` (or a SquadExample), or a list of them."""
    if context is None and question is not None and (_is_example(question) or (
            not isinstance(question, (str, bytes)) and isinstance(question, (list, tuple)) and question
            and all(_is_example(q) for q in question))):
        single = _is_example(question)
        items = [question] if single else list(question)
        examples = [_from_example(item, "question" if single else f"question[{i}]") for i, item in enumerate(items)]
    else:
        if _is_example(question):
            raise InputError(f"question is a {type(question).__name__} while context is given: pass question and "
                             "context as strings (or lists of strings), or the example "
                             "{'question': ..., 'context': ...} alone with context=None")
        if context is None:
            raise InputError("context is None: expected a string or a list of strings")
        one_question, one_context = isinstance(question, str), isinstance(context, str)
        questions = [question] if one_question else _as_list(question, "question")
        contexts = [context] if one_context else _as_list(context, "context")
        if one_question and one_context:
            examples, single = [(question, context)], True
        elif one_context:
            examples, single = [(q, context) for q in questions], False
        elif one_question:
            examples, single = [(question, c) for c in contexts], False
        else:
            if len(questions) != len(contexts):
                raise InputError(f"{len(questions)} questions for {len(contexts)} contexts: pass as many of each, "
                                 "or one question (or one context) for all")
            examples, single = list(zip(questions, contexts)), False
    for what, index in (("question", 0), ("context", 1)):
        values = [example[index] for example in examples]
        if single:
            check_text(values[0], what)
        else:
            _check_texts(values, what)
    for i, (q, c) in enumerate(examples):
        if not q or not c:
            where = "" if single else f"[{i}]"
            raise InputError(f"question{where} and context{where} must both be non-empty")
    return examples, single


def _check_windows(tok: Tokenizer, examples: list[tuple[str, str]], question_first: bool, max_seq_len: int,
                   doc_stride: int, stride_given: bool) -> None:
    """Refuse, before the windowed tokenisation, what tokenizers would panic on (a pyo3 PanicException, a
    BaseException) or refuse: a context cut into windows needs ``doc_stride`` below the room the question
    and the special tokens leave for it in ``max_seq_len``, and that room must be at least one token."""
    firsts = [q if question_first else c for q, c in examples]
    seconds = [c if question_first else q for q, c in examples]
    enc = tok(firsts, seconds, truncation=False, padding=False, return_tensors=None,
              return_attention_mask=False, return_token_type_ids=False)  # one batched call for every pair
    for index, encoding in enumerate(enc.encodings):
        ids = encoding.sequence_ids
        n_question = sum(1 for s in ids if s == (0 if question_first else 1))
        n_context = sum(1 for s in ids if s == (1 if question_first else 0))
        specials = len(ids) - n_question - n_context
        if len(ids) <= max_seq_len:
            continue  # one window: nothing is cut, any stride works
        room = max_seq_len - specials - n_question
        name = "question" if len(examples) == 1 else f"question[{index}]"
        if room < 1:
            raise InputError(f"{name} is {n_question} tokens: with {specials} special tokens it leaves no room for "
                             f"the context in max_seq_len={max_seq_len}. Shorten the question or raise max_seq_len")
        if doc_stride >= room:
            default = "" if stride_given else " (the default, min(max_seq_len // 2, 128))"
            raise InputError(f"doc_stride={doc_stride}{default} must be below {room}, the tokens of context per "
                             f"window: max_seq_len={max_seq_len} less {name}'s {n_question} tokens and {specials} "
                             f"special tokens. Pass a smaller doc_stride (at most {room - 1}), a larger "
                             "max_seq_len, or a shorter question")


def answer(question: str | Sequence[str], context: str | Sequence[str], model: Source, top_k: int = 1,
           max_answer_len: int = 15, doc_stride: int | None = None, max_seq_len: int | None = None,
           handle_impossible_answer: bool = False, tokenizer: str | Path | Tokenizer | None = None,
           batch_size: BatchSize = BATCH_SIZE, precision: str = "exact") -> dict | list:
    """Extract the answer span from ``context``: transformers 4's question-answering output,
    ``{score, start, end, answer}`` (a list when ``top_k > 1``; one result per question for lists).

    Start and end are softmaxed over the context tokens only; a span's score is p_start x p_end, with
    end >= start and at most ``max_answer_len`` tokens. A long context is cut into windows of
    ``max_seq_len`` tokens (default ``min(384, model_max_length)``) overlapping by ``doc_stride``
    (default ``min(max_seq_len // 2, 128)``), and the best spans over all windows win.
    """
    _check_top_k(top_k)
    _check_top_k(max_answer_len, "max_answer_len")
    if max_answer_len < 1:
        raise InputError(f"max_answer_len={max_answer_len}: must be at least 1")
    if max_seq_len is not None:
        _check_top_k(max_seq_len, "max_seq_len")
    if doc_stride is not None and (not isinstance(doc_stride, int) or isinstance(doc_stride, bool) or doc_stride < 0):
        raise InputError(f"doc_stride={doc_stride!r}: must be an integer >= 0 (the tokens two windows of a long "
                         "context share)")
    examples, single = _examples(question, context)
    loaded = load(model, "qa", tokenizer, precision)
    tok = loaded.tokenizer
    if max_seq_len is None:
        max_seq_len = min(tok.model_max_length, 384)
    max_seq_len = min(max_seq_len, loaded.max_length)
    stride_given = doc_stride is not None
    if doc_stride is None:
        doc_stride = min(max_seq_len // 2, 128)
    if doc_stride > max_seq_len:
        raise InputError(f"doc_stride ({doc_stride}) is larger than max_seq_len ({max_seq_len})")
    question_first = tok.padding_side == "right"
    _check_windows(tok, examples, question_first, max_seq_len, doc_stride, stride_given)

    windows: list[tuple[int, Any, list, list[int]]] = []  # (example, encoding, p_mask, row)
    rows = []
    input_names = [n for n in tok.model_input_names if n in _MODEL_KEYS]
    for index, (q, c) in enumerate(examples):
        try:
            enc = tok(q if question_first else c, c if question_first else q, padding=False,
                      truncation="only_second" if question_first else "only_first", max_length=max_seq_len,
                      stride=doc_stride, return_tensors=None, return_token_type_ids=True,
                      return_overflowing_tokens=True, return_offsets_mapping=True, return_special_tokens_mask=True)
        except BaseException as exc:  # _check_windows refuses these first; tokenizers' panics are BaseExceptions
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise
            raise InputError(f"question[{index}]: too long for max_seq_len={max_seq_len} with "
                             f"doc_stride={doc_stride} ({exc})") from None
        for span in range(len(enc["input_ids"])):
            # QuestionAnsweringPipeline.preprocess: 1 where the answer cannot be, except the CLS token
            p_mask = [tok_seq != 1 if question_first else 0 for tok_seq in enc.sequence_ids(span)]
            if tok.cls_token_id is not None:
                for cls_index in np.nonzero(np.array(enc["input_ids"][span]) == tok.cls_token_id)[0]:
                    p_mask[cls_index] = 0
            windows.append((index, enc.encodings[span], p_mask, enc["attention_mask"][span]))
            rows.append({k: enc[k][span] for k in input_names})
    outputs = _run(loaded, rows, batch_size, {"start_logits": True, "end_logits": True})

    pre_topk = top_k * 2 + 10  # some candidates are dropped when aligned to words
    sequence_index = 1 if question_first else 0
    results = []
    for index, (_, c) in enumerate(examples):
        min_null_score = 1000000.0
        answers: list[dict] = []
        for (owner, encoding, p_mask, attention), out in zip(windows, outputs):
            if owner != index:
                continue
            starts, ends, scores, min_null_score = _select_starts_ends(
                out["start_logits"].numpy()[None], out["end_logits"].numpy()[None], p_mask,
                np.array([attention]), min_null_score, pre_topk, handle_impossible_answer, max_answer_len)
            for s, e, score in zip(starts, ends, scores):
                start, end = _char_span(encoding, s, e, sequence_index)
                text = c[start:end]
                same = next((a for a in answers if a["answer"].lower() == text.lower()), None)
                if same:
                    same["score"] += score.item()
                else:
                    answers.append({"score": score.item(), "start": start, "end": end, "answer": text})
        if handle_impossible_answer:
            answers.append({"score": min_null_score, "start": 0, "end": 0, "answer": ""})
        answers = sorted(answers, key=lambda x: x["score"], reverse=True)[:top_k]
        results.append(answers[0] if len(answers) == 1 else answers)
    return results[0] if single else results
