"""``Tokenizer.pad`` and ``get_special_tokens_mask``: what transformers' data collators call on a tokenizer.

Written from ``tokenization_utils_base.py`` (5.25: ``pad``, ``_pad``, ``get_special_tokens_mask``), so that the task
guides' ``DataCollatorWithPadding(tokenizer)``, ``DataCollatorForTokenClassification`` and
``DataCollatorForLanguageModeling`` run with a flodl-hf tokenizer and give what they give with transformers' own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from flodl_hf.core.errors import InputError

if TYPE_CHECKING:
    from flodl_hf.tokenization.tokenizer import Tokenizer


def as_tensor(key: str, value: list, kind: str) -> Any:
    """``value`` (lists of ids) as one torch tensor, or a numpy array for ``kind`` "np"; sequences of different
    lengths are an InputError naming the field and both ways out."""
    lengths = {len(v) for v in value if isinstance(v, list)}
    if len(lengths) > 1:
        raise InputError(f"cannot make one tensor of '{key}': sequences have different lengths {sorted(lengths)}; "
                         "pass padding=True (and truncation=True for long texts), or return_tensors=None for lists "
                         "(flodl-hf's default is return_tensors='pt'; transformers' is None)")
    tensor = torch.tensor(value, dtype=torch.long)
    return tensor.numpy() if kind == "np" else tensor


def _plain(value: Any) -> Any:
    """Tensors and arrays as Python lists (transformers' ``to_py_obj``)."""
    if isinstance(value, torch.Tensor) or hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _pad_one(tok: "Tokenizer", inputs: dict, max_length: int | None, strategy: str, multiple: int | None,
             side: str | None, return_attention_mask: bool | None) -> dict:
    """transformers' ``_pad`` on one example."""
    if return_attention_mask is None:
        return_attention_mask = "attention_mask" in tok.model_input_names
    main = tok.model_input_names[0]
    ids = inputs[main]
    if strategy == "longest":
        max_length = len(ids)
    if max_length is not None and multiple is not None and max_length % multiple != 0:
        max_length = (max_length // multiple + 1) * multiple
    if return_attention_mask and "attention_mask" not in inputs:
        inputs["attention_mask"] = [1] * len(ids)
    if strategy == "do_not_pad" or len(ids) == max_length:
        return inputs
    n = max_length - len(ids)
    side = side if side is not None else tok.padding_side
    if side not in ("left", "right"):
        raise InputError(f"pad: padding_side={side!r}: expected 'left' or 'right'")
    fills = {"attention_mask": 0, "token_type_ids": tok.pad_token_type_id, "special_tokens_mask": 1,
             main: tok.pad_token_id}
    for key, fill in fills.items():
        if key in inputs and (key != "attention_mask" or return_attention_mask):
            inputs[key] = inputs[key] + [fill] * n if side == "right" else [fill] * n + inputs[key]
    return inputs


def pad(tok: "Tokenizer", encoded_inputs: Any, padding: bool | str = True, max_length: int | None = None,
        pad_to_multiple_of: int | None = None, padding_side: str | None = None,
        return_attention_mask: bool | None = None, return_tensors: str | None = None) -> dict[str, Any]:
    """transformers' ``tokenizer.pad``: one encoded example or a batch (a dict of lists, or a list of dicts, as a
    collator hands it), padded with the pad token (mask 0, token type ``pad_token_type_id``, special mask 1);
    tensors in give tensors out unless ``return_tensors`` says otherwise."""
    if isinstance(encoded_inputs, (list, tuple)) and encoded_inputs and isinstance(encoded_inputs[0], Mapping):
        encoded_inputs = {key: [example[key] for example in encoded_inputs] for key in encoded_inputs[0].keys()}
    if not isinstance(encoded_inputs, Mapping):
        raise InputError(f"pad takes an encoding or a list of encodings, not {type(encoded_inputs).__name__}")
    encoded_inputs = dict(encoded_inputs)
    main = tok.model_input_names[0]
    if main not in encoded_inputs:
        raise InputError(f"pad: the encodings hold no {main!r} (they have {sorted(encoded_inputs)})")
    required = encoded_inputs[main]
    if required is None or len(required) == 0:
        if return_attention_mask:
            encoded_inputs["attention_mask"] = []
        return encoded_inputs
    first = next((item[0] for item in required if isinstance(item, (list, tuple)) and len(item)), required[0])
    if isinstance(first, torch.Tensor) or hasattr(first, "tolist"):
        return_tensors = return_tensors or ("pt" if isinstance(first, torch.Tensor) else "np")
    encoded_inputs = {k: _plain(v) for k, v in encoded_inputs.items()}
    strategy, _, max_length = tok._strategies(padding, None, max_length)
    required = encoded_inputs[main]
    if required and not isinstance(required[0], (list, tuple)):
        out = _pad_one(tok, encoded_inputs, max_length, strategy, pad_to_multiple_of, padding_side,
                       return_attention_mask)
        return {k: as_tensor(k, [v], return_tensors)[0] if return_tensors else v for k, v in out.items()}
    if any(len(v) != len(required) for v in encoded_inputs.values()):
        raise InputError("pad: the fields of the batch hold different numbers of examples")
    if strategy == "longest":
        max_length, strategy = max(len(ids) for ids in required), "max_length"
    batch: dict[str, list] = {}
    for i in range(len(required)):
        row = _pad_one(tok, {k: v[i] for k, v in encoded_inputs.items()}, max_length, strategy, pad_to_multiple_of,
                       padding_side, return_attention_mask)
        for key, value in row.items():
            batch.setdefault(key, []).append(value)
    return {k: as_tensor(k, v, return_tensors) for k, v in batch.items()} if return_tensors else batch


def get_special_tokens_mask(tok: "Tokenizer", token_ids_0: list[int], token_ids_1: list[int] | None = None,
                            already_has_special_tokens: bool = False) -> list[int]:
    """1 for each special token of ``token_ids_0`` (a sequence already formatted with them), as transformers; the
    unformatted case, which transformers leaves to its slow classes, is an InputError."""
    if not already_has_special_tokens:
        raise InputError("get_special_tokens_mask: pass already_has_special_tokens=True with ids the tokenizer made "
                         "(or return_special_tokens_mask=True when tokenizing), as transformers' fast tokenizers take")
    if token_ids_1 is not None:
        raise InputError("get_special_tokens_mask: no second sequence with already_has_special_tokens=True")
    special = set(tok.all_special_ids)
    return [1 if int(i) in special else 0 for i in token_ids_0]
