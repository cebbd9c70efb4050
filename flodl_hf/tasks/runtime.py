"""The tasks' runtime: models and tokenizers loaded once per process, automatic padding-free
batching (``flodl_hf.tasks.batching``), precisions, and the forward loop every task shares.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from flodl_hf.tasks import batching
from flodl_hf.core.errors import InputError, MissingHeadError, WeightsMismatchError
from flodl_hf.core.modeling import PLAIN_RECORD, config_sets_forward_defaults
from flodl_hf.tokenization import LARGE_INTEGER, AutoTokenizer, BatchEncoding, Tokenizer, check_text


# Rows per forward pass, at most; None (the default): automatic, padding-free batches; or a
# flodl_hf.tasks.batching.BatchPolicy for full control.
BATCH_SIZE: int | None = None


BatchSize = int | batching.BatchPolicy | None


# "exact": float32, bit-identical to transformers on the same batch. The others are opt-in and change
# scores (docs/benchmarks.md has their speed and error): "bf16" runs under CPU autocast (matrix products
# in bfloat16; LayerNorm, softmax and the rest in float32); "int8" quantises every Linear layer's weights
# to int8 with dynamically quantised activations (torch.ao.quantization.quantize_dynamic).
PRECISIONS = ("exact", "bf16", "int8")


Source = str | Path | nn.Module


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


def _load_with_head(source: str, task: str, function: str) -> nn.Module:
    """``load_model`` for a task one-liner (``function``, named in the errors): a checkpoint without the task's
    head is refused (the Auto classes would initialise one at random, with a warning; a one-liner would then
    predict noise)."""
    from flodl_hf.auto import load_model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = load_model(source, task)
        except WeightsMismatchError as exc:
            # A token classifier has no pooler, which classify's head needs: the load fails on the base model's
            # keys, but what is wrong is the task (the checkpoint's architectures says which it was trained for).
            trained_for = _architecture_task(_raw_config(source))
            if trained_for in _TASK_FUNCTION and trained_for != task:
                raise _wrong_task(source, function, trained_for) from exc
            raise
    report = getattr(model, "load_report", None)
    prefix = getattr(model, "base_model_prefix", "") + "."
    head = [k for k in (report.fresh if report else []) if task != "base" and not k.startswith(prefix)]
    trained_for = _architecture_task(getattr(getattr(model, "config", None), "raw", None))
    if not head and {task, trained_for} == {"seqcls", "tokcls"}:  # both heads are `classifier`, of one shape
        raise _wrong_task(source, function, trained_for)
    if head:
        raise MissingHeadError(f"{source}: has no {task} head (missing {', '.join(head)}), so "
                               f"{function} cannot run on it: a head initialised at random "
                               "would predict noise. Pass a checkpoint fine-tuned for this task, or train one "
                               "(flodl_hf.AutoModelFor... with num_labels=) first")
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return model


_SCORES = {"seqcls": "whole texts", "tokcls": "tokens", "qa": "answer spans", "mlm": "masked tokens"}


def _wrong_task(source: str, function: str, trained_for: str) -> MissingHeadError:
    return MissingHeadError(f"{source}: config.json's architectures names a {trained_for} model, so "
                            f"{function} cannot run on it: its head was trained to score "
                            f"{_SCORES.get(trained_for, trained_for)}. Pass a checkpoint fine-tuned for this task")


def _raw_config(source: str) -> dict | None:
    """``source``'s config.json, or None where it cannot be read (the load's own error stands then)."""
    from flodl_hf.core import io
    try:
        return io.read_json(io.resolve(source).config_path, "config.json")
    except Exception:  # noqa: BLE001 - only a hint for a better error; the original one is raised otherwise
        return None


def _architecture_task(raw: dict | None) -> str | None:
    """The task of a config's ``architectures[0]`` (``BertForSequenceClassification``: seqcls), if known."""
    from flodl_hf.core.registry import parse_architecture
    from flodl_hf.core.errors import UnsupportedModelError
    names = (raw if isinstance(raw, dict) else {}).get("architectures") or []
    try:
        return parse_architecture(names[0])[1] if isinstance(names, list) and names and isinstance(names[0], str) \
            else None
    except UnsupportedModelError:
        return None


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
        check_text(text, f"{what}[{i}]")


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


def load_module(model: Source, task: str, precision: str, function: str, missing: str | None) -> tuple[nn.Module, str]:
    """(the model for ``task``, its source name): a source loaded once and cached (its int8 copy beside it), or a
    model object in eval mode. ``missing``: the InputError for a model object passed without what it needs (its
    tokenizer or its image processor); ``function`` names the one-liner in a wrong-head error."""
    _check_precision(precision)
    if isinstance(model, nn.Module):
        if missing is not None:
            raise InputError(missing)
        module, source = model.eval(), type(model).__name__
        return (quantize_int8(module) if precision == "int8" else module), source
    source = str(model)
    key = (source, task, "exact")
    if key not in _MODELS:
        _MODELS[key] = _load_with_head(source, task, function)
    if precision == "int8":
        if (source, task, "int8") not in _MODELS:
            _MODELS[(source, task, "int8")] = quantize_int8(_MODELS[key])
        key = (source, task, "int8")
    return _MODELS[key], source


def load(model: Source, task: str, tokenizer: str | Path | Tokenizer | None = None,
         precision: str = "exact", function: str | None = None) -> Loaded:
    """The model for ``task`` ("mlm", "seqcls", "tokcls", "qa", "base") and its tokenizer, cached by source.

    ``precision``: "exact" (float32, the default), "bf16" or "int8" (opt-in, faster, scores change).
    ``function``: the one-liner to name in a wrong-head error (by default the task's own: seqcls's is classify).
    """
    missing = None if tokenizer is not None else (
        "a model object was passed without its tokenizer: pass tokenizer= (a Tokenizer or the directory it was "
        "saved in)")
    module, source = load_module(model, task, precision, function or _TASK_FUNCTION.get(task, task), missing)
    if not isinstance(tokenizer, Tokenizer):
        tok_source = str(tokenizer if tokenizer is not None else model)
        if tok_source not in _TOKENIZERS:
            _TOKENIZERS[tok_source] = AutoTokenizer.from_pretrained(tok_source)
        tokenizer = _TOKENIZERS[tok_source]
    return Loaded(module, tokenizer, max_input_length(module, tokenizer), source, precision)


TRUNCATIONS = (True, False, "longest_first", "only_first", "only_second", "do_not_truncate")


def _check_truncation(truncation: object, name: str = "truncation") -> None:
    if truncation is not None and not any(truncation is t or (isinstance(t, str) and truncation == t)
                                          for t in TRUNCATIONS):
        raise InputError(f"{name}={truncation!r}: expected True, False, 'longest_first', 'only_first', "
                         "'only_second' or 'do_not_truncate'")


def _encode(loaded: Loaded, texts: Sequence[Any], pairs: Sequence[Any] | None = None,
            truncation: bool | str | None = None, max_length: int | None = None, **kwargs: Any) -> BatchEncoding:
    """Tokenise without padding, truncating to the model's maximum with a warning.

    ``truncation`` as a pipeline's tokenizer argument: None (ours: the model's maximum, with a warning), a
    truncation strategy or True (to ``max_length``, else the model's maximum, silently: it was asked for), or
    False / "do_not_truncate" (none: an input longer than the model accepts is an InputError naming it)."""
    tok = loaded.tokenizer
    _check_truncation(truncation)
    if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1):
        raise InputError(f"max_length={max_length!r}: must be an integer >= 1")
    # No limit from the tokenizer nor the model (RoPE positions, a tokenizer without model_max_length): none
    limit = loaded.max_length if loaded.max_length < LARGE_INTEGER else None
    if truncation is False or truncation == "do_not_truncate":
        enc = tok(list(texts), list(pairs) if pairs is not None else None, truncation=False,
                  return_tensors=None, return_attention_mask=True, **kwargs)
        too_long = [i for i, ids in enumerate(enc["input_ids"]) if limit is not None and len(ids) > limit]
        if too_long:
            raise InputError(f"truncation={truncation!r}: input #{too_long[0]} is {len(enc['input_ids'][too_long[0]])} "
                             f"tokens, more than the model's maximum of {limit}; pass truncation=True to cut it")
        return enc
    if max_length is not None:
        limit = max_length if limit is None else min(limit, max_length)
    strategy = "longest_first" if truncation in (None, True) else truncation
    try:
        enc = tok(list(texts), list(pairs) if pairs is not None else None,
                  truncation=strategy if limit is not None else False, max_length=limit, return_tensors=None,
                  return_attention_mask=True, **kwargs)
    except Exception as exc:  # noqa: BLE001 - tokenizers' own error for a strategy the inputs cannot take
        if truncation is None:
            raise
        raise InputError(f"truncation={truncation!r}" + (f", max_length={max_length}" if max_length else "")
                         + f": the tokenizer cannot truncate these inputs that way ({exc})") from None
    cut = [i for i, e in enumerate(enc.encodings) if e.overflowing]
    if cut and truncation is None and max_length is None:
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

    Rows are grouped by ``flodl_hf.tasks.batching``: sorted by length, equal lengths together, at most
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
    # the plain record whatever config.json sets as the forward's defaults (transformers' return_dict & co.)
    plain = PLAIN_RECORD if config_sets_forward_defaults(model.config) else {}
    with torch.inference_mode(), _precision_context(loaded.precision):
        for chunk, batch in batching.batches(rows, tok, policy, keys):
            width = batch["input_ids"].shape[1]
            if at:
                for i, logits in zip(chunk, _logits_at(model, batch, [rows[i] for i in chunk],
                                                       [positions(i) for i in chunk], left, device,
                                                       exact=loaded.precision == "exact")):
                    results[i] = {"logits": logits.float().cpu()}
                continue
            output = model(**{k: v.to(device) for k, v in batch.items()}, **plain)
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
