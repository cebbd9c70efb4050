"""``detect_replaced``: ELECTRA's discriminator, a replaced-token score per token."""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Sequence

import torch

from flodl_hf.core.errors import InputError
from flodl_hf.tokenization import Tokenizer
from flodl_hf.tasks.runtime import (BATCH_SIZE, BatchSize, Source, _MODEL_KEYS, _as_list, _check_texts, _encode,
                                    _rows, _run, load)


def _check_threshold(threshold: object) -> None:
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or math.isnan(threshold):
        raise InputError(f"threshold={threshold!r}: must be a number (a token is replaced when its score is above it)")


def detect_replaced(texts: str | Sequence[str], model: Source, threshold: float = 0.5,
                    tokenizer: str | Path | Tokenizer | None = None, batch_size: BatchSize = BATCH_SIZE,
                    precision: str = "exact") -> list:
    """Per token, the probability that it was replaced (ELECTRA's ``pretraining`` discriminator).

    Each token (special tokens left out) is ``{"token", "score", "replaced", "start", "end"}``:
    ``score`` is ``sigmoid(logit)`` of ``ElectraForPreTraining``, ``replaced`` is ``score > threshold``,
    ``start``/``end`` are character offsets into the text. A list of texts gives one list per text.
    """
    _check_threshold(threshold)
    single = isinstance(texts, str)
    items = [texts] if single else _as_list(texts)
    _check_texts(items)
    loaded = load(model, "pretraining", tokenizer, precision)
    tok = loaded.tokenizer
    if not items:
        return []
    enc = _encode(loaded, items, return_offsets_mapping=True, return_special_tokens_mask=True)
    outputs = _run(loaded, _rows(enc, _MODEL_KEYS), batch_size, {"logits": True})
    results = []
    for i in range(len(items)):
        scores = torch.sigmoid(outputs[i]["logits"]).tolist()
        ids, special = enc["input_ids"][i], enc["special_tokens_mask"][i]
        tokens = tok.convert_ids_to_tokens(ids)
        results.append([{"token": tokens[j], "score": scores[j], "replaced": scores[j] > threshold,
                         "start": int(enc["offset_mapping"][i][j][0]), "end": int(enc["offset_mapping"][i][j][1])}
                        for j in range(len(ids)) if not special[j]])
    return results[0] if single else results
