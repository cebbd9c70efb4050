"""``fill_mask``: transformers' fill-mask pipeline output, the LM head run at the masks only."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from flodl_hf.core.errors import InputError, SourceNotFoundError
from flodl_hf.tokenization import Tokenizer
from flodl_hf.tasks.runtime import (BATCH_SIZE, BatchSize, Source, _MODEL_KEYS, _as_list, _check_texts, _check_top_k,
                                    _encode, _rows, _run, load)


DEFAULT_FILL_MASK_MODEL = "bert-base-uncased"


MASK_SPELLINGS = ("[MASK]", "<mask>")


def _with_model_mask(text: str, tok: Tokenizer) -> str:
    """Accept either spelling of the mask token; the model's own one is what is tokenised."""
    for spelling in MASK_SPELLINGS:
        if spelling != tok.mask_token and tok.backend_tokenizer.token_to_id(spelling) is None:
            text = text.replace(spelling, tok.mask_token)
    return text


def _target_ids(tok: Tokenizer, targets: str | Sequence[str]) -> np.ndarray:
    """transformers' FillMaskPipeline.get_target_ids: a target not in the vocabulary is replaced by its
    first token (with a warning), or dropped when it has none."""
    if isinstance(targets, str):
        targets = [targets]
    vocab = tok.get_vocab()
    ids = []
    for target in targets:
        index = vocab.get(target)
        if index is None:
            found = tok(target, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False,
                        max_length=1, truncation=True, return_tensors=None)["input_ids"]
            if len(found) == 0:
                warnings.warn(f"The specified target token `{target}` does not exist in the model vocabulary. "
                              "We cannot replace it with anything meaningful, ignoring it", stacklevel=3)
                continue
            index = found[0]
            warnings.warn(f"The specified target token `{target}` does not exist in the model vocabulary. "
                          f"Replacing with `{tok.convert_ids_to_tokens(index)}`.", stacklevel=3)
        ids.append(index)
    ids = list(set(ids))  # the pipeline's order, which decides ties
    if not ids:
        raise InputError("targets: none of the targets can be predicted by this model")
    return np.array(ids)


TOKENIZER_KWARGS = ("truncation", "max_length")


def _tokenizer_kwargs(kwargs: object) -> dict:
    """The pipeline's ``tokenizer_kwargs``, of which ours takes the truncation ones; any other key is refused
    by name (rather than tokenising differently from what was asked)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InputError(f"tokenizer_kwargs is a {type(kwargs).__name__}: expected a dict such as "
                         "{'truncation': True}")
    other = sorted(str(k) for k in kwargs if k not in TOKENIZER_KWARGS)
    if other:
        raise InputError(f"tokenizer_kwargs: {', '.join(map(repr, other))} not supported (only "
                         f"{' and '.join(map(repr, TOKENIZER_KWARGS))})")
    return dict(kwargs)


def fill_mask(text_or_texts: str | Sequence[str], model: Source | None = None, top_k: int = 5,
              targets: str | Sequence[str] | None = None, tokenizer: str | Path | Tokenizer | None = None,
              batch_size: BatchSize = BATCH_SIZE, precision: str = "exact",
              tokenizer_kwargs: dict | None = None) -> list:
    """Fill the mask token(s): transformers' fill-mask output, a list of ``{score, token, token_str, sequence}``.

    Several masks in one text give one list per mask; a list of texts gives one result per text. Write
    the mask as ``[MASK]`` or ``<mask>``, whichever the model uses. ``tokenizer_kwargs`` as the pipeline's:
    ``truncation`` and ``max_length`` (by default, texts longer than the model are cut with a warning).
    """
    tokenizer_kwargs = _tokenizer_kwargs(tokenizer_kwargs)
    source = DEFAULT_FILL_MASK_MODEL if model is None else model
    try:
        loaded = load(source, "mlm", tokenizer, precision)
    except SourceNotFoundError as exc:
        if model is not None:
            raise
        raise SourceNotFoundError(
            f"fill_mask's default model is the hub id {DEFAULT_FILL_MASK_MODEL!r}, which cannot be reached and is "
            "not cached. Pass model= a local checkpoint directory (e.g. one written by save_pretrained), or run "
            "`flodl-hf samples fetch splade` once and pass model='samples/splade'.") from exc
    tok = loaded.tokenizer
    if tok.mask_token is None:
        raise InputError(f"{loaded.source}: the tokenizer defines no mask token, so it cannot fill masks")
    _check_top_k(top_k)  # against the vocabulary below, once targets (which cap it) are known
    single = isinstance(text_or_texts, str)
    texts = [text_or_texts] if single else _as_list(text_or_texts)
    _check_texts(texts)
    if not texts:
        return []
    texts = [_with_model_mask(t, tok) for t in texts]
    enc = _encode(loaded, texts, **tokenizer_kwargs)
    for text, ids in zip(texts, enc["input_ids"]):
        if tok.mask_token_id not in ids:
            whole = tok(text, truncation=False, return_tensors=None, return_attention_mask=False)["input_ids"]
            if tok.mask_token_id in whole:
                raise InputError(f"the mask token ({tok.mask_token}) in {text[:60]!r}... is at token "
                                 f"{whole.index(tok.mask_token_id)}, past the model's maximum of {loaded.max_length} "
                                 "tokens: it was cut off by truncation. Shorten the text before the mask")
            raise InputError(f"no mask token ({tok.mask_token}) in {text!r}: write {' or '.join(MASK_SPELLINGS)} "
                             "where the word to predict goes")
    target_ids = _target_ids(tok, targets) if targets is not None else None
    if target_ids is not None and target_ids.shape[0] < top_k:
        top_k = target_ids.shape[0]  # FillMaskPipeline.postprocess: targets cap top_k before any other limit
    if target_ids is None:
        _check_top_k(top_k, limit=getattr(getattr(loaded.model, "config", None), "vocab_size", None))
    mask_id = tok.mask_token_id
    masked = [[p for p, t in enumerate(ids) if t == mask_id] for ids in enc["input_ids"]]
    # Only the masked positions' logits are kept (a row of vocabulary logits per token would not fit in memory).
    outputs = _run(loaded, _rows(enc, _MODEL_KEYS), batch_size, {"logits": True}, positions=masked.__getitem__)
    results = []
    for ids, out in zip(enc["input_ids"], outputs):
        # transformers' FillMaskPipeline.postprocess, on this row (out["logits"] holds the masked rows only)
        input_ids = torch.tensor(ids)
        masked_index = torch.nonzero(input_ids == tok.mask_token_id, as_tuple=False).squeeze(-1)
        probs = out["logits"].softmax(dim=-1)
        if target_ids is not None:
            probs = probs[..., target_ids]
        values, predictions = probs.topk(top_k)
        rows = []
        one_mask = values.shape[0] == 1
        for i, (row_values, row_predictions) in enumerate(zip(values.tolist(), predictions.tolist())):
            row = []
            for score, p in zip(row_values, row_predictions):
                tokens = input_ids.numpy().copy()
                if target_ids is not None:
                    p = target_ids[p].tolist()
                tokens[masked_index[i]] = p
                tokens = tokens[np.where(tokens != tok.pad_token_id)]
                row.append({"score": score, "token": p, "token_str": tok.decode([p]),
                            "sequence": tok.decode(tokens.tolist(), skip_special_tokens=one_mask)})
            rows.append(row)
        results.append(rows[0] if one_mask else rows)
    return results[0] if single else results
