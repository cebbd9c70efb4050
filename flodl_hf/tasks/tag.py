"""``tag``: transformers' token-classification pipeline output, with its aggregation strategies."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import InputError
from ..tokenizer import Tokenizer
from .runtime import BATCH_SIZE, BatchSize, Source, _MODEL_KEYS, _as_list, _check_texts, _encode, _rows, _run, load


AGGREGATIONS = ("none", "simple", "first", "average", "max")


def _subword_test(tok: Tokenizer, strategy: str):
    """TokenClassificationPipeline.gather_pre_entities' test for 'this token continues a word'."""
    if getattr(tok.backend_tokenizer.model, "continuing_subword_prefix", None):
        return lambda word, ref, sentence, start: len(word) != len(ref)
    if strategy in ("first", "average", "max"):
        warnings.warn("Tokenizer does not support real words, using fallback heuristic", UserWarning, stacklevel=4)
    return lambda word, ref, sentence, start: start > 0 and " " not in sentence[start - 1:start + 1]


def _tag_one(sentence: str, ids: list[int], offsets: list, special: list[int], logits: np.ndarray,
             tok: Tokenizer, id2label: dict, strategy: str, ignore: list[str]) -> list[dict]:
    # transformers' TokenClassificationPipeline.postprocess / gather_pre_entities / aggregate, for one text
    maxes = np.max(logits, axis=-1, keepdims=True)
    shifted = np.exp(logits - maxes)
    scores = shifted / shifted.sum(axis=-1, keepdims=True)
    is_subword_of = _subword_test(tok, strategy)
    pre = []
    for idx, token_scores in enumerate(scores):
        if special[idx]:
            continue
        word = tok.convert_ids_to_tokens(int(ids[idx]))
        start, end = offsets[idx]
        ref = sentence[start:end]
        is_subword = is_subword_of(word, ref, sentence, start)
        if int(ids[idx]) == tok.unk_token_id:
            word, is_subword = ref, False
        pre.append({"word": word, "scores": token_scores, "start": start, "end": end, "index": idx,
                    "is_subword": is_subword})
    if strategy in ("none", "simple"):
        entities = []
        for p in pre:
            best = p["scores"].argmax()
            entities.append({"entity": id2label[best], "score": p["scores"][best], "index": p["index"],
                             "word": p["word"], "start": p["start"], "end": p["end"]})
    else:
        entities, group = [], None
        for p in pre:
            if group is None:
                group = [p]
            elif p["is_subword"]:
                group.append(p)
            else:
                entities.append(_aggregate_word(group, strategy, tok, id2label))
                group = [p]
        if group is not None:
            entities.append(_aggregate_word(group, strategy, tok, id2label))
    if strategy != "none":
        entities = _group_entities(entities, tok)
    kept = [e for e in entities if e.get("entity") not in ignore and e.get("entity_group") not in ignore]
    return [{k: (float(v) if isinstance(v, np.floating) else v) for k, v in e.items()} for e in kept]


def _aggregate_word(entities: list[dict], strategy: str, tok: Tokenizer, id2label: dict) -> dict:
    word = tok.convert_tokens_to_string([e["word"] for e in entities])
    if strategy == "first":
        scores = entities[0]["scores"]
        idx = scores.argmax()
        score = scores[idx]
    elif strategy == "max":
        scores = max(entities, key=lambda e: e["scores"].max())["scores"]
        idx = scores.argmax()
        score = scores[idx]
    else:  # average
        average = np.nanmean(np.stack([e["scores"] for e in entities]), axis=0)
        idx = average.argmax()
        score = average[idx]
    return {"entity": id2label[idx], "score": score, "word": word, "start": entities[0]["start"],
            "end": entities[-1]["end"]}


def _tag_of(name: str) -> tuple[str, str]:
    if name.startswith("B-"):
        return "B", name[2:]
    if name.startswith("I-"):
        return "I", name[2:]
    return "I", name


def _group_entities(entities: list[dict], tok: Tokenizer) -> list[dict]:
    def group(members: list[dict]) -> dict:
        return {"entity_group": members[0]["entity"].split("-", 1)[-1],
                "score": np.mean(np.nanmean([e["score"] for e in members])),
                "word": tok.convert_tokens_to_string([e["word"] for e in members]),
                "start": members[0]["start"], "end": members[-1]["end"]}
    groups, current = [], []
    for entity in entities:
        if not current:
            current.append(entity)
            continue
        bi, tag = _tag_of(entity["entity"])
        _, last_tag = _tag_of(current[-1]["entity"])
        if tag == last_tag and bi != "B":
            current.append(entity)
        else:
            groups.append(group(current))
            current = [entity]
    if current:
        groups.append(group(current))
    return groups


def tag(texts: str | Sequence[str], model: Source, aggregation_strategy: str = "simple",
        ignore_labels: Sequence[str] | None = None, tokenizer: str | Path | Tokenizer | None = None,
        batch_size: BatchSize = BATCH_SIZE, precision: str = "exact") -> list:
    """Tag tokens (named entities...): transformers' token-classification output.

    Each entity has ``entity_group`` (or ``entity`` with ``aggregation_strategy="none"``), ``score``,
    ``word``, and ``start``/``end`` character offsets into the original text. Strategies: none, simple,
    first, average, max. Labels in ``ignore_labels`` (default ``["O"]``) are left out.
    """
    strategy = str(aggregation_strategy).lower()
    if strategy not in AGGREGATIONS:
        raise InputError(f"aggregation_strategy={aggregation_strategy!r}: expected one of {', '.join(AGGREGATIONS)}")
    loaded = load(model, "tokcls", tokenizer, precision)
    tok = loaded.tokenizer
    if strategy in ("first", "average", "max") and not tok.is_fast:
        raise InputError("word aggregation needs a tokenizer with offsets")
    single = isinstance(texts, str)
    items = [texts] if single else _as_list(texts)
    _check_texts(items)
    if not items:
        return []
    enc = _encode(loaded, items, return_offsets_mapping=True, return_special_tokens_mask=True)
    outputs = _run(loaded, _rows(enc, _MODEL_KEYS), batch_size, {"logits": True})
    ignore = list(ignore_labels) if ignore_labels is not None else ["O"]
    id2label = loaded.model.config.id2label
    results = [_tag_one(text, enc["input_ids"][i], enc["offset_mapping"][i], enc["special_tokens_mask"][i],
                        outputs[i]["logits"].numpy(), tok, id2label, strategy, ignore)
               for i, text in enumerate(items)]
    return results[0] if single else results
