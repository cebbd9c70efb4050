"""``classify``: transformers' text-classification pipeline output."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..errors import InputError
from ..tokenizer import Tokenizer
from .runtime import BATCH_SIZE, BatchSize, Source, _MODEL_KEYS, _as_list, _check_texts, _check_top_k, _encode, _np_sigmoid, _np_softmax, _rows, _run, load


def _split_pairs(texts: list) -> tuple[list[str], list[str] | None]:
    if all(isinstance(t, dict) for t in texts):
        try:
            return [t["text"] for t in texts], [t["text_pair"] for t in texts] if "text_pair" in texts[0] else None
        except KeyError as exc:
            raise InputError(f"a text pair is a dict with keys 'text' and 'text_pair' (missing {exc})") from None
    if not all(isinstance(t, str) for t in texts):
        raise InputError("texts: expected strings, or dicts {'text': ..., 'text_pair': ...} for pairs")
    return texts, None


def classify(texts: str | dict | Sequence[str | dict], model: Source, top_k: int | None = 1,
             function_to_apply: str | None = None, tokenizer: str | Path | Tokenizer | None = None,
             batch_size: BatchSize = BATCH_SIZE, precision: str = "exact") -> list:
    """Classify texts: transformers' text-classification output.

    ``top_k=1`` (the default) gives one ``{label, score}`` per text (a list of one for a single text, as
    the pipeline does); another ``top_k`` (``None``: every label) gives a sorted list per text. Scores are
    the softmax (single-label), the sigmoid (multi-label, or one label) or the raw logits (regression),
    unless ``function_to_apply`` ("softmax", "sigmoid", "none") says otherwise.
    """
    _check_top_k(top_k, allow_none=True)
    loaded = load(model, "seqcls", tokenizer, precision)
    single = isinstance(texts, (str, dict))
    items = [texts] if single else _as_list(texts)
    if not items:
        return []
    firsts, seconds = _split_pairs(items)
    _check_texts(firsts)
    if seconds is not None:
        _check_texts(seconds, "text_pair")
    enc = _encode(loaded, firsts, seconds)
    outputs = _run(loaded, _rows(enc, _MODEL_KEYS), batch_size, {"logits": False})
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
        if top_k == 1:
            results.append({"label": config.id2label[scores.argmax().item()], "score": scores.max().item()})
            continue
        ranked = sorted(({"label": config.id2label[i], "score": s.item()} for i, s in enumerate(scores)),
                        key=lambda x: x["score"], reverse=True)
        results.append(ranked[:top_k] if top_k is not None else ranked)
    if single and (top_k != 1 or isinstance(texts, dict)):
        return results[0]  # the pipeline's shapes: a str gives [{...}] at top_k=1, a pair dict gives {...}
    return results
