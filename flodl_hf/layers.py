"""Numerical building blocks shared by every family.

Exactness against transformers (CPU, float32, ``torch.equal``) needs the same
ops in the same order; ../shared/PARITY_NOTES.md has the measurements. In short:
``F.linear`` (never ``x @ W.T + b``), ``F.gelu``, ``F.layer_norm``, and
``F.scaled_dot_product_attention`` with HF's scale for sdpa, HF's literal order
for eager.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import Activation

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # transformers.activations.NewGELUActivation, literally: F.gelu(approximate="tanh") is ~5e-7 away.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    # transformers.activations.FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _gelu_python(x: torch.Tensor) -> torch.Tensor:
    # transformers.activations.GELUActivation(use_gelu_python=True)
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[Activation, Callable[[torch.Tensor], torch.Tensor]] = {
    Activation.GELU: F.gelu,
    Activation.GELU_NEW: _gelu_new,
    Activation.GELU_PYTORCH_TANH: lambda x: F.gelu(x, approximate="tanh"),
    Activation.GELU_FAST: _gelu_fast,
    Activation.GELU_PYTHON: _gelu_python,
    Activation.QUICK_GELU: _quick_gelu,
    Activation.RELU: F.relu,
    Activation.SILU: F.silu,
    Activation.SWISH: F.silu,
    Activation.TANH: torch.tanh,
    Activation.LINEAR: lambda x: x,
}


def activation(act: Activation | str) -> Callable[[torch.Tensor], torch.Tensor]:
    return ACTIVATIONS[Activation.parse(act)]


def check_attn_implementation(name: str) -> str:
    if name not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={name!r}: expected one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    return name


def extended_attention_mask(attention_mask: torch.Tensor | None, impl: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The 2-D padding mask in the form each attention path takes, or None when nothing is padded.

    sdpa: bool (B, 1, 1, S), True = attend. eager: additive float (B, 1, 1, S) with
    ``finfo.min`` at padded keys, as ``transformers.masking_utils`` builds it.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() == 4:  # already prepared by the caller
        return attention_mask
    keep = attention_mask.bool()
    if bool(keep.all()):
        return None
    keep = keep[:, None, None, :]
    if impl == "sdpa":
        return keep
    return torch.where(keep, torch.tensor(0.0, dtype=dtype, device=keep.device),
                       torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=keep.device))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, impl: str,
           dropout_p: float = 0.0, scaling: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention over (B, heads, S, head_dim) in HF's op order; returns (B, S, heads*head_dim)."""
    if scaling is None:
        scaling = q.size(-1) ** -0.5
    if impl == "sdpa":
        # transformers.integrations.sdpa_attention.sdpa_attention_forward
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scaling)
    else:
        # transformers.models.bert.modeling_bert.eager_attention_forward: (qk^T * s) + mask, softmax, @ v
        weights = torch.matmul(q, k.transpose(2, 3)) * scaling
        if mask is not None:
            weights = weights + mask
        weights = F.softmax(weights, dim=-1)
        if dropout_p:
            weights = F.dropout(weights, p=dropout_p, training=True)
        out = torch.matmul(weights, v)
    out = out.transpose(1, 2).contiguous()
    return out.reshape(*out.shape[:2], -1)


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, S, H) -> (B, heads, S, head_dim) as a view, exactly as HF's ``view(...).transpose(1, 2)``."""
    return x.view(*x.shape[:-1], -1, head_dim).transpose(1, 2)


@torch.no_grad()
def init_weights(module: nn.Module, std: float) -> None:
    """transformers' default ``_init_weights`` for fresh (not loaded) modules."""
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Conv1d)):  # Conv1d: DeBERTa-v2's ConvLayer, as transformers inits it
            sub.weight.normal_(mean=0.0, std=std)
            if sub.bias is not None:
                sub.bias.zero_()
        elif isinstance(sub, nn.Embedding):
            sub.weight.normal_(mean=0.0, std=std)
            if sub.padding_idx is not None:
                sub.weight[sub.padding_idx].zero_()
        elif isinstance(sub, nn.LayerNorm):
            if sub.weight is not None:
                sub.weight.fill_(1.0)
            if sub.bias is not None:
                sub.bias.zero_()
        for name, param in sub.named_parameters(recurse=False):
            # bare parameters (e.g. an LM head's output bias) start at zero
            if not isinstance(sub, (nn.Linear, nn.Conv1d, nn.Embedding, nn.LayerNorm)):
                param.zero_()


# ---- computing a per-token head on some rows only -----------------------------------------------------
#
# A per-token head (an LM head: dense, activation, LayerNorm, a vocabulary-wide decoder) on the few rows a
# task reads gives the same bits as on every row, if each row of ``F.linear`` is computed by the same
# kernel either way. On CPU it is not for every row count: MKL's sgemm splits the rows between threads
# and finishes short remainders differently. Measured here (torch 2.13 CPU, F.linear at widths 96 to 4096,
# 30522 outputs, rows sliced out of 4096): with 1, 3 and 4 threads only 1-3 rows differ; with 2 and 8 threads
# 1-3, 5-7 and 9-11 rows; with 16 threads also 17-19 and 25-27. Multiples of 8 rows never differed, nor
# did any count from 8 rows per thread up. So the gathered rows are padded to a multiple of 8, and the
# shortcut is taken only when the full pass has a row count of the same kind. tests/test_batching.py
# checks the result against transformers' full head on batches of many shapes.

ROW_MULTIPLE = 8


def rows_are_exact(rows: int) -> bool:
    """Whether ``F.linear`` computes each of ``rows`` rows as it would among any other such count."""
    return rows % ROW_MULTIPLE == 0 or rows >= ROW_MULTIPLE * max(2, torch.get_num_threads())


def gather_rows(hidden: torch.Tensor, flat_index: torch.Tensor) -> torch.Tensor | None:
    """The rows ``flat_index`` of ``hidden`` (..., H) flattened to (N, H), padded with repeats of row 0 to
    a multiple of ``ROW_MULTIPLE``; None when the full pass's row count is not exact (compute every row)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    n = flat_index.numel()
    padded = -(-max(n, 1) // ROW_MULTIPLE) * ROW_MULTIPLE
    if not rows_are_exact(flat.shape[0]) or padded >= flat.shape[0]:
        return None
    if padded > n:
        flat_index = torch.cat([flat_index, flat_index.new_zeros(padded - n)])
    return flat.index_select(0, flat_index)
