"""Tasks in one line: ``fill_mask``, ``classify``, ``tag``, ``answer``, ``embed`` (and ``rank``).

Each gives what transformers' pipeline gives for the same checkpoint and inputs (for ``answer``:
transformers 4's question-answering pipeline, which transformers 5 dropped; for ``embed``:
sentence-transformers' pooling), with our native models underneath. Post-processing copies the
pipelines' own numpy/torch operations, in their order, so scores are equal, not merely close.

Beyond the pipelines: models and tokenizers are loaded once per process (keyed by source), many
texts are batched automatically without padding (sorted by length, equal lengths together:
``flodl_hf.batching``), and texts longer than the model's maximum are truncated with a warning
instead of failing inside the model. ``precision="exact"`` (the default) is float32, bit-identical
to transformers on every batch; ``"bf16"`` and ``"int8"`` are faster and change scores (opt-in,
measured in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from . import batching
from .errors import InputError, MissingHeadError, SourceNotFoundError
from .tokenizer import LARGE_INTEGER, AutoTokenizer, BatchEncoding, Tokenizer

DEFAULT_FILL_MASK_MODEL = "bert-base-uncased"
# Rows per forward pass, at most; None (the default): automatic, padding-free batches; or a
# flodl_hf.batching.BatchPolicy for full control.
BATCH_SIZE: int | None = None
BatchSize = int | batching.BatchPolicy | None
# "exact": float32, bit-identical to transformers on the same batch. The others are opt-in and change
# scores (docs/benchmarks.md has their speed and error): "bf16" runs under CPU autocast (matrix products
# in bfloat16; LayerNorm, softmax and the rest in float32); "int8" quantises every Linear layer's weights
# to int8 with dynamically quantised activations (torch.ao.quantization.quantize_dynamic).
PRECISIONS = ("exact", "bf16", "int8")
MASK_SPELLINGS = ("[MASK]", "<mask>")
AGGREGATIONS = ("none", "simple", "first", "average", "max")

Source = str | Path | nn.Module


# ---- loading, once per process --------------------------------------------------------------------

@dataclass
class Loaded:
    """A model with its tokenizer, the longest input both accept, and the precision it runs at."""

    model: nn.Module
    tokenizer: Tokenizer
    max_length: int
    source: str
    precision: str = "exact"


_MODELS: dict[tuple[str, str, str], nn.Module] = {}
_TOKENIZERS: dict[str, Tokenizer] = {}


def clear_cache() -> None:
    """Forget the models and tokenizers loaded so far (they are kept for the life of the process)."""
    _MODELS.clear()
    _TOKENIZERS.clear()


def max_input_length(model: nn.Module, tokenizer: Tokenizer) -> int:
    """The longest input, in tokens, that both the tokenizer and the model's position table accept."""
    limits = [tokenizer.model_max_length] if tokenizer.model_max_length <= LARGE_INTEGER else []
    config = getattr(model, "config", None)
    if config is not None and hasattr(model, "family"):
        limit = model.family.max_sequence_length(config)
        if limit:
            limits.append(int(limit))
    return min(limits) if limits else LARGE_INTEGER


def _load_with_head(source: str, task: str) -> nn.Module:
    """``load_model`` for a task one-liner: a checkpoint without the task's head is refused (the Auto
    classes would initialise one at random, with a warning; a one-liner would then predict noise)."""
    from .auto import load_model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_model(source, task)
    report = getattr(model, "load_report", None)
    prefix = getattr(model, "base_model_prefix", "") + "."
    head = [k for k in (report.fresh if report else []) if task != "base" and not k.startswith(prefix)]
    if head:
        raise MissingHeadError(f"{source}: has no {task} head (missing {', '.join(head)}), so "
                               f"{_TASK_FUNCTION.get(task, task)} cannot run on it: a head initialised at random "
                               "would predict noise. Pass a checkpoint fine-tuned for this task, or train one "
                               "(flodl_hf.AutoModelFor... with num_labels=) first")
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return model


_TASK_FUNCTION = {"mlm": "fill_mask", "seqcls": "classify", "tokcls": "tag", "qa": "answer", "base": "embed"}


def _check_top_k(top_k: object, name: str = "top_k", limit: int | None = None, allow_none: bool = False) -> None:
    if top_k is None and allow_none:
        return
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise InputError(f"{name}={top_k!r}: must be an integer >= 1" + (" (or None)" if allow_none else ""))
    if limit is not None and top_k > limit:
        raise InputError(f"{name}={top_k}: larger than the {limit} candidates (the vocabulary size)")


def _check_texts(items: list, what: str = "texts") -> None:
    for i, text in enumerate(items):
        if not isinstance(text, str):
            raise InputError(f"{what}[{i}] is a {type(text).__name__}: expected a string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InputError(f"{what}[{i}] is not valid Unicode text (a lone surrogate at {exc.start})") from None


def _check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise InputError(f"precision={precision!r}: expected one of {', '.join(map(repr, PRECISIONS))}")
    return precision


def quantize_int8(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose Linear layers hold int8 weights (dynamic activation quantisation)."""
    from torch.ao.quantization import quantize_dynamic
    with warnings.catch_warnings():  # torch's eager int8 API is deprecated in favour of torchao; it still works
        warnings.simplefilter("ignore")
        return quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8).eval()


def _precision_context(precision: str) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def load(model: Source, task: str, tokenizer: str | Path | Tokenizer | None = None,
         precision: str = "exact") -> Loaded:
    """The model for ``task`` ("mlm", "seqcls", "tokcls", "qa", "base") and its tokenizer, cached by source.

    ``precision``: "exact" (float32, the default), "bf16" or "int8" (opt-in, faster, scores change).
    """
    from .auto import load_model

    _check_precision(precision)
    if isinstance(model, nn.Module):
        if tokenizer is None:
            raise InputError("a model object was passed without its tokenizer: pass tokenizer= (a Tokenizer "
                             "or the directory it was saved in)")
        module, source = model.eval(), type(model).__name__
        if precision == "int8":
            module = quantize_int8(module)
    else:
        source = str(model)
        key = (source, task, "exact")
        if key not in _MODELS:
            _MODELS[key] = _load_with_head(source, task)
        if precision == "int8":
            if (source, task, "int8") not in _MODELS:
                _MODELS[(source, task, "int8")] = quantize_int8(_MODELS[key])
            key = (source, task, "int8")
        module = _MODELS[key]
    if not isinstance(tokenizer, Tokenizer):
        tok_source = str(tokenizer if tokenizer is not None else model)
        if tok_source not in _TOKENIZERS:
            _TOKENIZERS[tok_source] = AutoTokenizer.from_pretrained(tok_source)
        tokenizer = _TOKENIZERS[tok_source]
    return Loaded(module, tokenizer, max_input_length(module, tokenizer), source, precision)


# ---- batching ----------------------------------------------------------------------------------------

def _encode(loaded: Loaded, texts: Sequence[Any], pairs: Sequence[Any] | None = None, **kwargs: Any) -> BatchEncoding:
    """Tokenise without padding, truncating to the model's maximum with a warning."""
    tok = loaded.tokenizer
    enc = tok(list(texts), list(pairs) if pairs is not None else None, truncation=True,
              max_length=loaded.max_length, return_tensors=None, return_attention_mask=True, **kwargs)
    cut = [i for i, e in enumerate(enc.encodings) if e.overflowing]
    if cut:
        warnings.warn(f"{len(cut)} input(s) longer than {loaded.max_length} tokens were truncated to the model's "
                      f"maximum (first: #{cut[0]})", stacklevel=3)
    return enc


def _accepted(model: nn.Module) -> set[str]:
    """The inputs the model's forward takes, less those its backbone has no use for (token types)."""
    params = set(inspect.signature(model.forward).parameters)
    names = getattr(getattr(model, "backbone", model), "input_names", None)
    return params & set(names) if names is not None else params


def _run(loaded: Loaded, rows: list[dict[str, list]], batch_size: BatchSize, fields: dict[str, bool],
         positions: Any = None) -> list[dict]:
    """Forward every row and return, per row and in the original order, the output ``fields`` (name ->
    one value per token?), per-token ones cut back to the row's own length, and to the token
    ``positions(i)`` of row ``i`` when given (so a batch's outputs are not all kept alive).

    Rows are grouped by ``flodl_hf.batching``: sorted by length, equal lengths together, at most
    ``batch_size`` per forward pass (None: as many as its token budget allows; a ``BatchPolicy``:
    exactly that policy)."""
    if isinstance(batch_size, batching.BatchPolicy):
        policy = batch_size
    else:
        policy = batching.BatchPolicy.for_model(loaded.model, batch_size)
    model, tok = loaded.model, loaded.tokenizer
    keys = [k for k in batching.MODEL_INPUTS if k in _accepted(model)]
    results: list[dict | None] = [None] * len(rows)
    device = next(model.parameters()).device
    left = tok.padding_side == "left"
    # Logits at a few positions per row (fill-mask): the head runs on those tokens only (logits_at).
    at = positions is not None and list(fields) == ["logits"] and hasattr(model, "logits_at")
    with torch.inference_mode(), _precision_context(loaded.precision):
        for chunk, batch in batching.batches(rows, tok, policy, keys):
            width = batch["input_ids"].shape[1]
            if at:
                for i, logits in zip(chunk, _logits_at(model, batch, [rows[i] for i in chunk],
                                                       [positions(i) for i in chunk], left, device,
                                                       exact=loaded.precision == "exact")):
                    results[i] = {"logits": logits.float().cpu()}
                continue
            output = model(**{k: v.to(device) for k, v in batch.items()})
            values = {name: getattr(output, name) for name in fields}
            for j, i in enumerate(chunk):
                n = len(rows[i]["input_ids"])
                keep = slice(width - n, width) if left else slice(0, n)
                row = {}
                for name, per_token in fields.items():
                    value = values[name][j]
                    if per_token:
                        value = value[keep]
                        if positions is not None:
                            value = value[positions(i)]
                    row[name] = value.float().cpu()
                results[i] = row
    return results  # type: ignore[return-value]


def _logits_at(model: nn.Module, batch: dict[str, torch.Tensor], rows: list[dict[str, list]],
               positions: list[Sequence[int]], left: bool, device: torch.device,
               exact: bool = True) -> list[torch.Tensor]:
    """One batch through ``model.logits_at``: per row, the logits at its own token ``positions``."""
    width = batch["input_ids"].shape[1]
    at_rows, at_columns, counts = [], [], []
    for j, (row, wanted) in enumerate(zip(rows, positions)):
        offset = width - len(row["input_ids"]) if left else 0
        at_rows += [j] * len(wanted)
        at_columns += [offset + p for p in wanted]
        counts.append(len(wanted))
    logits = model.logits_at(torch.tensor(at_rows, device=device), torch.tensor(at_columns, device=device),
                             exact=exact, **{k: v.to(device) for k, v in batch.items()})
    return list(logits.split(counts))


def _rows(enc: BatchEncoding, keys: Iterable[str]) -> list[dict[str, list]]:
    keys = [k for k in keys if k in enc]
    return [{k: enc[k][i] for k in keys} for i in range(len(enc["input_ids"]))]


_MODEL_KEYS = batching.MODEL_INPUTS


# ---- fill-mask ------------------------------------------------------------------------------------------

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


def fill_mask(text_or_texts: str | Sequence[str], model: Source | None = None, top_k: int = 5,
              targets: str | Sequence[str] | None = None, tokenizer: str | Path | Tokenizer | None = None,
              batch_size: BatchSize = BATCH_SIZE, precision: str = "exact") -> list:
    """Fill the mask token(s): transformers' fill-mask output, a list of ``{score, token, token_str, sequence}``.

    Several masks in one text give one list per mask; a list of texts gives one result per text. Write
    the mask as ``[MASK]`` or ``<mask>``, whichever the model uses.
    """
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
    vocab = getattr(getattr(loaded.model, "config", None), "vocab_size", None)
    _check_top_k(top_k, limit=vocab)
    single = isinstance(text_or_texts, str)
    texts = [text_or_texts] if single else _as_list(text_or_texts)
    _check_texts(texts)
    if not texts:
        return []
    texts = [_with_model_mask(t, tok) for t in texts]
    enc = _encode(loaded, texts)
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
        top_k = target_ids.shape[0]
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


# ---- text classification ---------------------------------------------------------------------------------

def _np_sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _np_softmax(x: np.ndarray) -> np.ndarray:
    maxes = np.max(x, axis=-1, keepdims=True)
    shifted = np.exp(x - maxes)
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _as_list(texts: object, what: str = "texts") -> list:
    if isinstance(texts, (str, bytes, dict)) or not isinstance(texts, Iterable):
        raise InputError(f"{what} is a {type(texts).__name__}: expected a string or a list of strings")
    return list(texts)


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


# ---- token classification ---------------------------------------------------------------------------------

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


# ---- extractive question answering ---------------------------------------------------------------------

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
    loaded = load(model, "qa", tokenizer, precision)
    tok = loaded.tokenizer
    if isinstance(question, str) and isinstance(context, str):
        examples, single = [(question, context)], True
    elif isinstance(context, str):
        examples, single = [(q, context) for q in question], False
    else:
        questions = [question] * len(context) if isinstance(question, str) else list(question)
        if len(questions) != len(context):
            raise InputError(f"{len(questions)} questions for {len(context)} contexts")
        examples, single = list(zip(questions, context)), False
    _check_texts([q for q, _ in examples], "question")
    _check_texts([c for _, c in examples], "context")
    for q, c in examples:
        if not q or not c:
            raise InputError("question and context must both be non-empty")
    if max_seq_len is None:
        max_seq_len = min(tok.model_max_length, 384)
    max_seq_len = min(max_seq_len, loaded.max_length)
    if doc_stride is None:
        doc_stride = min(max_seq_len // 2, 128)
    if doc_stride > max_seq_len:
        raise InputError(f"doc_stride ({doc_stride}) is larger than max_seq_len ({max_seq_len})")

    question_first = tok.padding_side == "right"
    windows: list[tuple[int, Any, list, list[int]]] = []  # (example, encoding, p_mask, row)
    rows = []
    input_names = [n for n in tok.model_input_names if n in _MODEL_KEYS]
    for index, (q, c) in enumerate(examples):
        try:
            enc = tok(q if question_first else c, c if question_first else q, padding=False,
                      truncation="only_second" if question_first else "only_first", max_length=max_seq_len,
                      stride=doc_stride, return_tensors=None, return_token_type_ids=True,
                      return_overflowing_tokens=True, return_offsets_mapping=True, return_special_tokens_mask=True)
        except Exception as exc:  # tokenizers refuses a question that leaves no room for the context
            raise InputError(f"question {index}: too long for max_seq_len={max_seq_len} with "
                             f"doc_stride={doc_stride} ({exc})") from exc
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


# ---- sentence embeddings ----------------------------------------------------------------------------------

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


# ---- replaced-token detection (ELECTRA's discriminator) --------------------------------------------

def detect_replaced(texts: str | Sequence[str], model: Source, threshold: float = 0.5,
                    tokenizer: str | Path | Tokenizer | None = None, batch_size: BatchSize = BATCH_SIZE,
                    precision: str = "exact") -> list:
    """Per token, the probability that it was replaced (ELECTRA's ``pretraining`` discriminator).

    Each token (special tokens left out) is ``{"token", "score", "replaced", "start", "end"}``:
    ``score`` is ``sigmoid(logit)`` of ``ElectraForPreTraining``, ``replaced`` is ``score > threshold``,
    ``start``/``end`` are character offsets into the text. A list of texts gives one list per text.
    """
    loaded = load(model, "pretraining", tokenizer, precision)
    tok = loaded.tokenizer
    single = isinstance(texts, str)
    items = [texts] if single else list(texts)
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
        from .tokenizer import tokenizer_directory
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


# ---- CLI ----------------------------------------------------------------------------------------------

def _texts(args: argparse.Namespace) -> list[str]:
    texts = list(args.texts or [])
    if not texts:
        if sys.stdin.isatty():
            raise InputError("give texts as arguments, or one per line on stdin")
        texts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise InputError("no texts given (as arguments or on stdin)")
    return texts


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def _table(rows: list[dict], columns: Sequence[str]) -> None:
    def cell(value: Any) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)
    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


def _cmd_fill_mask(args: argparse.Namespace) -> int:
    texts = _texts(args)
    targets = args.targets.split(",") if args.targets else None
    results = fill_mask(texts, model=args.model, top_k=args.top_k, targets=targets, precision=args.precision)
    if args.json:
        _print_json(results)
        return 0
    for text, result in zip(texts, results):
        print(text)
        masks = result if result and isinstance(result[0], list) else [result]
        for n, rows in enumerate(masks, 1):
            if len(masks) > 1:
                print(f"mask {n}:")
            _table(rows, ("score", "token_str", "sequence"))
        print()
    return 0


def _cmd_classify(args: argparse.Namespace) -> int:
    texts = _texts(args)
    results = classify(texts, args.model, top_k=args.top_k, function_to_apply=args.function,
                       precision=args.precision)
    if args.json:
        _print_json(results)
        return 0
    rows = []
    for text, result in zip(texts, results):
        for r in (result if isinstance(result, list) else [result]):
            rows.append({"text": text if len(text) <= 60 else text[:57] + "...", **r})
    _table(rows, ("label", "score", "text"))
    return 0


def _cmd_tag(args: argparse.Namespace) -> int:
    texts = _texts(args)
    results = tag(texts, args.model, aggregation_strategy=args.aggregation, precision=args.precision)
    if args.json:
        _print_json(results)
        return 0
    key = "entity" if args.aggregation == "none" else "entity_group"
    for text, entities in zip(texts, results):
        print(text)
        _table([{"label": e[key], **e} for e in entities], ("label", "score", "word", "start", "end"))
        print()
    return 0


def _cmd_answer(args: argparse.Namespace) -> int:
    context = args.context
    if context is None:
        if sys.stdin.isatty():
            raise InputError("give the context with --context, or on stdin")
        context = sys.stdin.read().strip()
    questions = args.question[0] if len(args.question) == 1 else args.question
    results = answer(questions, context, args.model, top_k=args.top_k, max_answer_len=args.max_answer_len,
                     handle_impossible_answer=args.allow_no_answer, precision=args.precision)
    if args.json:
        _print_json(results)
        return 0
    results = [results] if len(args.question) == 1 else results
    for q, result in zip(args.question, results):
        print(q)
        _table(result if isinstance(result, list) else [result], ("score", "answer", "start", "end"))
        print()
    return 0


def _cmd_embed(args: argparse.Namespace) -> int:
    texts = _texts(args)
    if args.query is not None:
        ranked = rank(args.query, texts, args.model, pooling=args.pooling, normalize=not args.no_normalize,
                      precision=args.precision)
        if args.json:
            _print_json(ranked)
        else:
            print(f"query: {args.query}")
            _table(ranked, ("score", "text"))
        return 0
    vectors = embed(texts, args.model, pooling=args.pooling, normalize=not args.no_normalize, precision=args.precision)
    if args.json:
        _print_json([{"text": t, "embedding": v} for t, v in zip(texts, vectors.tolist())])
        return 0
    for text, v in zip(texts, vectors.tolist()):
        head = ", ".join(f"{x:+.4f}" for x in v[:4])
        print(f"[{head}, ...] dim={len(v)}  {text}")
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    def common(parser: argparse.ArgumentParser, texts: bool = True, model_default: str | None = None) -> None:
        if texts:
            parser.add_argument("texts", nargs="*", metavar="TEXT", help="texts (default: one per line on stdin)")
        parser.add_argument("--model", "-m", default=model_default, required=model_default is None,
                            help="a checkpoint directory, samples/<name>, or a hub id")
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
        parser.add_argument("--precision", choices=PRECISIONS, default="exact",
                            help="exact (float32, the default) or an opt-in faster one that changes scores")

    p = subparsers.add_parser("fill-mask", help="predict the masked word ([MASK] or <mask>)")
    common(p, model_default=DEFAULT_FILL_MASK_MODEL)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--targets", help="comma-separated candidate words")
    p.set_defaults(func=_cmd_fill_mask)

    p = subparsers.add_parser("classify", help="classify texts (sequence classification head)")
    common(p)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--function", choices=("softmax", "sigmoid", "none"), help="score function (default: as configured)")
    p.set_defaults(func=_cmd_classify)

    p = subparsers.add_parser("tag", help="tag tokens / named entities (token classification head)")
    common(p)
    p.add_argument("--aggregation", choices=AGGREGATIONS, default="simple")
    p.set_defaults(func=_cmd_tag)

    p = subparsers.add_parser("answer", help="extract the answer to a question from a context")
    common(p, texts=False)
    p.add_argument("--question", "-q", action="append", required=True, help="may be repeated")
    p.add_argument("--context", "-c", help="the context (default: stdin)")
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--max-answer-len", type=int, default=15)
    p.add_argument("--allow-no-answer", action="store_true", help="handle_impossible_answer")
    p.set_defaults(func=_cmd_answer)

    p = subparsers.add_parser("embed", help="sentence embeddings, or rank texts by similarity to --query")
    common(p)
    p.add_argument("--pooling", choices=("mean", "cls", "max"))
    p.add_argument("--no-normalize", action="store_true")
    p.add_argument("--query", help="rank the texts by cosine similarity to this one")
    p.set_defaults(func=_cmd_embed)
