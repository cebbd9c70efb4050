"""``tag``: transformers' token-classification pipeline output, with its aggregation strategies."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from flodl_hf.core.errors import InputError
from flodl_hf.tokenization import LARGE_INTEGER, Tokenizer
from flodl_hf.tasks.runtime import (BATCH_SIZE, BatchSize, Source, _MODEL_KEYS, _as_list, _check_texts, _encode,
                                    _rows, _run, load)


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


def _merge_overlapping(entities: list[dict]) -> list[dict]:
    """TokenClassificationPipeline.aggregate_overlapping_entities: the entities of overlapping windows
    (``stride``), sorted by start; of two that overlap the longer wins, then the higher score."""
    if not entities:
        return entities
    entities = sorted(entities, key=lambda x: x["start"])
    merged, previous = [], entities[0]
    for entity in entities:
        if previous["start"] <= entity["start"] < previous["end"]:
            length, previous_length = entity["end"] - entity["start"], previous["end"] - previous["start"]
            if length > previous_length or length == previous_length and entity["score"] > previous["score"]:
                previous = entity
        else:
            merged.append(previous)
            previous = entity
    merged.append(previous)
    return merged


def _check_words(items: list, single: bool) -> None:
    for i, words in enumerate(items):
        _check_texts(list(words), "texts" if single else f"texts[{i}]")


def _windows(loaded, item, words: bool, delimiter: str, stride: int | None) -> dict:
    """One text's windows as the pipeline's preprocess tokenises it: the sentence, and per window the model
    row, ids, offsets into the sentence, and special-tokens mask. ``stride``: overlapping windows of the
    model's length, padded to the longest (return_overflowing_tokens, padding=True); pre-split words are
    joined with ``delimiter`` and each token's offsets moved to its word's place in the joined sentence."""
    tok = loaded.tokenizer
    limit = loaded.max_length if loaded.max_length < LARGE_INTEGER else None
    sentence = delimiter.join(item) if words else item
    backend = tok.backend_tokenizer
    if limit is None:
        backend.no_truncation()
    else:
        backend.enable_truncation(limit, stride=stride or 0, strategy="longest_first", direction=tok.truncation_side)
    if stride is not None:
        backend.enable_padding(direction=tok.padding_side, pad_id=tok.pad_token_id,
                               pad_type_id=tok.pad_token_type_id, pad_token=tok.pad_token)
    else:
        backend.no_padding()
    try:
        encoding = backend.encode_batch([list(item) if words else item], is_pretokenized=words,
                                        add_special_tokens=True)[0]
    finally:
        backend.no_truncation()
        backend.no_padding()
    windows = [encoding] + (list(encoding.overflowing) if stride is not None else [])
    if stride is None and encoding.overflowing:
        warnings.warn(f"1 input(s) longer than {loaded.max_length} tokens were truncated to the model's maximum",
                      stacklevel=4)
    starts = []
    if words:
        at = 0
        for word in item:
            starts.append(at)
            at += len(word) + len(delimiter)
    keys = [k for k in _MODEL_KEYS if k in ("input_ids", "attention_mask") or k in tok.model_input_names]
    out = []
    for e in windows:
        offsets = list(e.offsets)
        if words:
            offsets = [(a + starts[w], b + starts[w]) if w is not None else (a, b)
                       for (a, b), w in zip(offsets, e.word_ids)]
        row = {"input_ids": e.ids, "attention_mask": e.attention_mask, "token_type_ids": e.type_ids}
        out.append({"row": {k: row[k] for k in keys if k in row}, "ids": e.ids, "offsets": offsets,
                    "special": e.special_tokens_mask})
    return {"sentence": sentence, "windows": out}


def tag(texts: str | Sequence[str] | Sequence[Sequence[str]], model: Source, aggregation_strategy: str | None = None,
        ignore_labels: Sequence[str] | None = None, tokenizer: str | Path | Tokenizer | None = None,
        batch_size: BatchSize = BATCH_SIZE, precision: str = "exact", stride: int | None = None,
        is_split_into_words: bool = False, delimiter: str | None = None) -> list:
    """Tag tokens (named entities...): transformers' token-classification output.

    ``aggregation_strategy`` is "none" by default, as in the pipeline: one ``{entity, score, index, word,
    start, end}`` per token. With "simple", "first", "average" or "max", tokens are grouped into
    ``{entity_group, score, word, start, end}``. ``start``/``end`` are character offsets into the original
    text. Labels in ``ignore_labels`` (default ``["O"]``) are left out.

    ``stride``: texts longer than the model are tagged whole, in overlapping windows of the model's length
    (``stride`` tokens of overlap), as the pipeline does. ``is_split_into_words=True``: each text is a list of
    words (a single list of words gives a list of one result, as the pipeline), joined with ``delimiter``
    (default " ") for ``word`` and the offsets.
    """
    strategy = "none" if aggregation_strategy is None else str(aggregation_strategy).lower()
    if strategy not in AGGREGATIONS:
        raise InputError(f"aggregation_strategy={aggregation_strategy!r}: expected one of {', '.join(AGGREGATIONS)}")
    if stride is not None and (not isinstance(stride, int) or isinstance(stride, bool) or stride < 0):
        raise InputError(f"stride={stride!r}: must be an integer >= 0 (or None)")
    if stride is not None and aggregation_strategy is not None and strategy == "none":
        raise InputError(f'stride={stride} tags the whole text in windows, which aggregation_strategy="none" '
                         "does not allow (as in the pipeline): choose simple, first, average or max")
    if not isinstance(is_split_into_words, bool):
        raise InputError(f"is_split_into_words={is_split_into_words!r}: must be True or False")
    if delimiter is not None and not isinstance(delimiter, str):
        raise InputError(f"delimiter={delimiter!r}: must be a string")
    loaded = load(model, "tokcls", tokenizer, precision)
    tok = loaded.tokenizer
    if strategy in ("first", "average", "max") and not tok.is_fast:
        raise InputError("word aggregation needs a tokenizer with offsets")
    if stride is not None and loaded.max_length < LARGE_INTEGER:
        room = loaded.max_length - tok.backend_tokenizer.num_special_tokens_to_add(False)
        if stride >= room:
            raise InputError(f"stride={stride} must be below {room}: the tokens a window of the model's "
                             f"{loaded.max_length} holds besides its special tokens")
    if is_split_into_words:
        # The pipeline: a list of words is one text (its result comes as a list of one), lists of them several
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
            raise InputError(f"is_split_into_words=True: texts is a {type(texts).__name__}; expected a list of words, "
                             "or a list of such lists")
        words_given = isinstance(texts, (list, tuple)) and texts and all(isinstance(t, (list, tuple)) for t in texts)
        items = _as_list(texts) if words_given or not texts else [_as_list(texts)]
        _check_words(items, not words_given)
        single = False
    else:
        single = isinstance(texts, str)
        items = [texts] if single else _as_list(texts)
        _check_texts(items)
    if not items:
        return []
    ignore = list(ignore_labels) if ignore_labels is not None else ["O"]
    id2label = loaded.model.config.id2label
    if stride is None and not is_split_into_words:
        enc = _encode(loaded, items, return_offsets_mapping=True, return_special_tokens_mask=True)
        texts_windows = [{"sentence": text, "windows": [
            {"row": row, "ids": enc["input_ids"][i], "offsets": enc["offset_mapping"][i],
             "special": enc["special_tokens_mask"][i]}]} for i, (text, row) in enumerate(
                 zip(items, _rows(enc, _MODEL_KEYS)))]
    else:
        texts_windows = [_windows(loaded, item, is_split_into_words, " " if delimiter is None else delimiter, stride)
                         for item in items]
    flat = [w for t in texts_windows for w in t["windows"]]
    outputs = iter(_run(loaded, [w["row"] for w in flat], batch_size, {"logits": True}))
    results = []
    for t in texts_windows:
        entities = []
        for w in t["windows"]:
            entities += _tag_one(t["sentence"], w["ids"], w["offsets"], w["special"], next(outputs)["logits"].numpy(),
                                 tok, id2label, strategy, ignore)
        results.append(_merge_overlapping(entities) if len(t["windows"]) > 1 else entities)
    return results[0] if single else results
