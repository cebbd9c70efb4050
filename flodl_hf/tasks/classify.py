"""``classify``: transformers' text-classification pipeline output."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from flodl_hf.core.errors import InputError
from flodl_hf.tokenization import Tokenizer, check_text
from flodl_hf.tasks.runtime import (BATCH_SIZE, BatchSize, Source, _MODEL_KEYS, _as_list, _check_texts, _check_top_k,
                                    _encode, _np_sigmoid, _np_softmax, _rows, _run, load)


def _split_pairs(texts: list) -> tuple[list[str], list[str | None]]:
    """Each item's text and pair (None for a single text). The pipeline tokenises each dict on its own, as
    ``tokenizer(**item)``, and transformers encodes a single text when ``text_pair`` is absent, None or ""."""
    firsts: list = []
    seconds: list = []
    for i, item in enumerate(texts):
        if isinstance(item, dict):
            if "text" not in item:
                raise InputError(f"texts[{i}]: a text pair is a dict with keys 'text' and 'text_pair' "
                                 f"(missing 'text'; keys: {sorted(map(str, item))})")
            pair = item.get("text_pair")
            firsts.append(item["text"])
            seconds.append(pair if pair is not None and pair != "" else None)
        elif isinstance(item, str):
            firsts.append(item)
            seconds.append(None)
        else:
            raise InputError(f"texts[{i}] is a {type(item).__name__}: expected strings, or dicts "
                             "{'text': ..., 'text_pair': ...} for pairs")
    return firsts, seconds


def _encode_rows(loaded, firsts: list[str], seconds: list[str | None], **tokenizer_kwargs) -> list[dict[str, list]]:
    """Model rows in the items' order: single texts and pairs are tokenised apart (each as it would be alone)."""
    rows: list = [None] * len(firsts)
    singles = [i for i, pair in enumerate(seconds) if pair is None]
    pairs = [i for i, pair in enumerate(seconds) if pair is not None]
    if singles:
        for i, row in zip(singles, _rows(_encode(loaded, [firsts[i] for i in singles], **tokenizer_kwargs), _MODEL_KEYS)):
            rows[i] = row
    if pairs:
        for i, row in zip(pairs, _rows(_encode(loaded, [firsts[i] for i in pairs], [seconds[i] for i in pairs], **tokenizer_kwargs),
                                       _MODEL_KEYS)):
            rows[i] = row
    return rows


class _Unset:
    def __repr__(self) -> str:
        return "<top_k not given>"


_NOT_GIVEN = _Unset()  # the pipeline tells "top_k not passed" (its legacy shapes) from an explicit top_k=1


def classify(texts: str | dict | Sequence[str | dict], model: Source, top_k: int | None = _NOT_GIVEN,  # type: ignore[assignment]
             function_to_apply: str | None = None, tokenizer: str | Path | Tokenizer | None = None,
             batch_size: BatchSize = BATCH_SIZE, precision: str = "exact", truncation: bool | str | None = None,
             max_length: int | None = None) -> list:
    """Classify texts: transformers' text-classification output, in the pipeline's shapes.

    Without ``top_k``: the best ``{label, score}`` per text (``[{...}]`` for one string, ``{...}`` for one
    ``{"text", "text_pair"}`` dict, one dict per item of a list). With ``top_k`` (an int, or ``None`` for every
    label; ``top_k=1`` included): a sorted list per text (the list itself for a single input). Scores are the
    softmax (single-label), the sigmoid (multi-label, or one label) or the raw logits (regression), unless
    ``function_to_apply`` ("softmax", "sigmoid", "none") says otherwise. ``truncation`` / ``max_length`` are
    the pipeline's tokenizer arguments (by default, inputs longer than the model are cut with a warning).
    """
    legacy = top_k is _NOT_GIVEN
    if legacy:
        top_k = 1
    _check_top_k(top_k, allow_none=True)
    loaded = load(model, "seqcls", tokenizer, precision)
    single = isinstance(texts, (str, dict))
    items = [texts] if single else _as_list(texts)
    if not items:
        return []
    firsts, seconds = _split_pairs(items)
    _check_texts(firsts)
    for i, pair in enumerate(seconds):
        if pair is not None:
            check_text(pair, f"texts[{i}]['text_pair']")
    outputs = _run(loaded, _encode_rows(loaded, firsts, seconds, truncation=truncation, max_length=max_length),
                   batch_size, {"logits": False})
    config = loaded.model.config
    problem = getattr(getattr(config, "problem_type", None), "value", getattr(config, "problem_type", None))
    function = (function_to_apply or "").lower() or None
    if function is None:  # TextClassificationPipeline.postprocess's rule
        if problem == "regression":
            function = "none"
        elif problem == "multi_label_classification" or config.num_labels == 1:
            function = "sigmoid"
        else:
            function = "softmax"
    if function not in ("sigmoid", "softmax", "none"):
        raise InputError(f"function_to_apply={function_to_apply!r}: expected 'sigmoid', 'softmax' or 'none'")
    results = []
    for out in outputs:
        logits = out["logits"].numpy()
        scores = _np_sigmoid(logits) if function == "sigmoid" else _np_softmax(logits) if function == "softmax" \
            else logits
        if legacy:  # TextClassificationPipeline.postprocess with _legacy=True
            results.append({"label": config.id2label[scores.argmax().item()], "score": scores.max().item()})
            continue
        ranked = sorted(({"label": config.id2label[i], "score": s.item()} for i, s in enumerate(scores)),
                        key=lambda x: x["score"], reverse=True)
        results.append(ranked[:top_k] if top_k is not None else ranked)
    if single and (not legacy or isinstance(texts, dict)):
        return results[0]  # the pipeline's shapes: a str without top_k gives [{...}], a pair dict gives {...}
    return results
