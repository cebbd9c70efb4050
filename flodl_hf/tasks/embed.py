"""``embed`` (sentence-transformers' pooling and normalisation) and ``rank`` (cosine order)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..errors import InputError
from ..tokenizer import Tokenizer
from .runtime import BATCH_SIZE, BatchSize, Loaded, Source, _MODEL_KEYS, _as_list, _check_texts, _check_top_k, _encode, _rows, _run, load


def _sentence_transformers_settings(root: Path | None) -> dict[str, Any]:
    """What a sentence-transformers checkpoint says about itself (max_seq_length, pooling, lowercasing)."""
    out: dict[str, Any] = {}
    if root is None:
        return out
    for name in ("sentence_bert_config.json", "1_Pooling/config.json"):
        try:
            out.update(json.loads((root / name).read_text()))
        except (OSError, ValueError):
            pass
    return out


def _pooling_from(settings: dict) -> str:
    if settings.get("pooling_mode_cls_token"):
        return "cls"
    if settings.get("pooling_mode_max_tokens"):
        return "max"
    return "mean"


def embed(texts: str | Sequence[str], model: Source, pooling: str | None = None, normalize: bool = True,
          tokenizer: str | Path | Tokenizer | None = None, batch_size: BatchSize = BATCH_SIZE,
          precision: str = "exact") -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them for the same checkpoint.

    ``pooling``: "mean" over the attention mask, "cls" (first token) or "max"; by default what the
    checkpoint's ``1_Pooling/config.json`` says, else "mean". ``normalize``: unit length (L2). The
    input limit is the checkpoint's ``sentence_bert_config.json`` ``max_seq_length`` when it has one.
    Returns a float tensor: (dim,) for one text, (n, dim) for a list.
    """
    loaded = load(model, "base", tokenizer, precision)
    root = None
    if not isinstance(model, nn.Module):
        from ..tokenizer import tokenizer_directory
        root = tokenizer_directory(model)
    settings = _sentence_transformers_settings(root)
    pooling = (pooling or _pooling_from(settings)).lower()
    if pooling not in ("mean", "cls", "max"):
        raise InputError(f"pooling={pooling!r}: expected 'mean', 'cls' or 'max'")
    if settings.get("max_seq_length"):
        loaded = Loaded(loaded.model, loaded.tokenizer, min(loaded.max_length, int(settings["max_seq_length"])),
                        loaded.source, loaded.precision)
    single = isinstance(texts, str)
    items = [texts] if single else _as_list(texts)
    _check_texts(items)
    if settings.get("do_lower_case"):
        items = [t.lower() for t in items]
    if not items:  # an empty batch: an empty (0, dim) result, as sentence-transformers gives
        config = loaded.model.config
        width = getattr(config, "hidden_size", None) or getattr(config, "dim", 0)
        return torch.empty((0, width), dtype=torch.float32)
    enc = _encode(loaded, items)
    rows = _rows(enc, _MODEL_KEYS)
    outputs = _run(loaded, rows, batch_size, {"last_hidden_state": True})
    vectors = []
    for row, out in zip(rows, outputs):
        # sentence_transformers.models.Pooling on one (unpadded) row, in its order of operations
        tokens = out["last_hidden_state"][None]
        mask = torch.tensor(row["attention_mask"])[None].unsqueeze(-1).expand(tokens.size()).to(tokens.dtype)
        if pooling == "cls":
            vector = tokens[:, 0]
        elif pooling == "max":
            vector = torch.max(tokens.masked_fill(mask == 0, -1e9), 1)[0]
        else:
            vector = torch.sum(tokens * mask, 1) / torch.clamp(mask.sum(1), min=1e-9)
        vectors.append(vector)
    result = torch.cat(vectors)
    if normalize:
        result = torch.nn.functional.normalize(result, p=2, dim=1)
    return result[0] if single else result


def rank(query: str, texts: Sequence[str], model: Source, top_k: int | None = None, **embed_options: Any) -> list[dict]:
    """Texts ranked by cosine similarity of their embeddings to ``query``: ``{index, text, score}``, best first."""
    texts = _as_list(texts)
    _check_texts([query], "query")
    _check_texts(texts)
    _check_top_k(top_k, allow_none=True)
    if not texts:
        raise InputError("rank: no texts to rank")
    vectors = embed([query, *texts], model, **{"normalize": True, **embed_options})
    vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
    scores = (vectors[1:] @ vectors[0]).tolist()
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    return [{"index": i, "text": texts[i], "score": scores[i]} for i in order[:top_k]]
