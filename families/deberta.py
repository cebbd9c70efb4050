"""DeBERTa (v1, ``model_type: deberta``): DeBERTa-v2's model with v1's attention and LayerNorm.

What differs from ``families/deberta_v2.py``: the self-attention (a fused, bias-free ``in_proj`` split per
head, ``q_bias`` / ``v_bias``, the query divided by the scale, (B, heads, S, d) matmuls, a relative window
of ``min(S, max_relative_positions)`` each side, ``pos_proj`` without bias and ``pos_q_proj`` scaled
before p2c, optional talking heads); the hand-written ``DebertaLayerNorm`` in the embeddings and the
layers (the MLM heads keep ``nn.LayerNorm``); no log buckets, no ConvLayer, no LayerNorm on
``rel_embeddings``; and no multiple-choice head. Embeddings, encoder, ContextPooler and both MLM heads
are v2's. One attention path, as in transformers, following
https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/models/deberta/modeling_deberta.py
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.errors import ConfigError
from flodl_hf.core.layers import record_attention
from flodl_hf.core.registry import register

from .deberta_v2 import (DebertaV2, DebertaV2Attention, DebertaV2Config, DebertaV2Embeddings, DebertaV2Encoder,
                         DebertaV2Layer, DebertaV2Model, DisentangledSelfAttention, scaled_size_sqrt)


@dataclass
class DebertaConfig(DebertaV2Config):
    """HF's DebertaConfig defaults; the fields its modeling code reads with ``getattr`` (``embedding_size``,
    ``cls_dropout``, ``pooler_hidden_size``, ``talking_head``) are v2's fields or added here."""

    model_type: ClassVar[str] = "deberta"

    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    talking_head: bool = False                   # head_logits_proj / head_weights_proj mix the heads

    def __post_init__(self) -> None:
        # DisentangledSelfAttention scales by 1 + len(pos_att_type), every entry counted, and matches c2p/p2c
        # case-sensitively in a list: only distinct lowercase c2p/p2c entries mean what v2's parsing means.
        value = self.pos_att_type
        if value is not None and not isinstance(value, tuple):
            items = ([x.strip() for x in value.lower().split("|")] if isinstance(value, str)
                     else [getattr(x, "value", x) for x in value])
            if any(x not in ("c2p", "p2c") for x in items) or len(set(items)) != len(items):
                raise ConfigError(f"config field pos_att_type={value!r}: DeBERTa (v1) counts every entry in its "
                                  "attention scale, so only distinct 'c2p' and 'p2c' entries are supported")
        super().__post_init__()

    # v2-only options: transformers' DeBERTa v1 never reads them
    @property
    def log_buckets(self) -> int:
        return -1

    @property
    def conv_size(self) -> int:
        return 0

    @property
    def norm_rel_ebd_terms(self) -> list[str]:
        return ["none"]


class DebertaLayerNorm(nn.LayerNorm):
    """modeling_deberta.DebertaLayerNorm: the formula by hand (in float32), not F.layer_norm (they differ
    in the last bits). An ``nn.LayerNorm`` for everything else (init, casts, keys)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_type = hidden_states.dtype
        hidden_states = hidden_states.float()
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) / torch.sqrt(variance + self.eps)
        return self.weight * hidden_states.to(input_type) + self.bias


class DebertaEmbeddings(DebertaV2Embeddings):
    def __init__(self, config: DebertaConfig) -> None:
        super().__init__(config)
        self.LayerNorm = DebertaLayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class DebertaSelfAttention(DisentangledSelfAttention):
    """modeling_deberta.DisentangledSelfAttention, on (B, heads, S, head_dim) tensors."""

    def make_projections(self, config: DebertaConfig, all_heads: int) -> None:
        self.in_proj = nn.Linear(config.hidden_size, all_heads * 3, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(all_heads))
        self.v_bias = nn.Parameter(torch.zeros(all_heads))
        self.max_relative = config.max_relative
        if self.relative_attention:
            if self.c2p:
                self.pos_proj = nn.Linear(config.hidden_size, all_heads, bias=False)
            if self.p2c:
                self.pos_q_proj = nn.Linear(config.hidden_size, all_heads)
        # talking heads: nn.Linear over the permuted 4-D scores and probs. transformers' own output then moves by
        # ~1e-9 with the weights' requires_grad (matmul folds the batch dims or not): exact against transformers
        # run the same way (tests/test_deberta_v1.py), which is why the shared tables leave it out
        mixed = config.talking_head
        self.head_logits_proj = nn.Linear(self.num_heads, self.num_heads, bias=False) if mixed else None
        self.head_weights_proj = nn.Linear(self.num_heads, self.num_heads, bias=False) if mixed else None

    def split(self, x: torch.Tensor) -> torch.Tensor:
        # transpose_for_scores: a (B, heads, S, -1) view, not made contiguous
        return x.view(*x.shape[:-1], self.num_heads, -1).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor, keep: torch.Tensor | None,
                relative_pos: torch.Tensor | None = None, rel_embeddings: torch.Tensor | None = None) -> torch.Tensor:
        # in_proj is laid out per head (q, k, v of head 0, then head 1...): split the heads, then chunk
        query, key, value = self.split(self.in_proj(hidden_states)).chunk(3, dim=-1)
        query = query + self.split(self.q_bias[None, None, :])
        value = value + self.split(self.v_bias[None, None, :])
        # DisentangledSelfAttention.forward: the query is divided by the scale, then matmul(q, k^T) + rel_att
        scale = scaled_size_sqrt(query.size(-1), self.scale_factor)
        query = query / scale.to(dtype=query.dtype)
        scores = torch.matmul(query, key.transpose(-1, -2))
        if self.relative_attention:
            scores = scores + self.relative_bias(query, key, relative_pos, self.pos_dropout(rel_embeddings), scale)
        if self.head_logits_proj is not None:
            scores = self.head_logits_proj(scores.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        if keep is not None:
            scores = scores.masked_fill(~keep, torch.finfo(query.dtype).min)
        probs = self.dropout(F.softmax(scores, dim=-1))
        if self.head_weights_proj is not None:
            probs = self.head_weights_proj(probs.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        record_attention(probs)
        context = torch.matmul(probs, value).permute(0, 2, 1, 3).contiguous()
        return context.view(*context.shape[:2], -1)

    def relative_bias(self, query: torch.Tensor, key: torch.Tensor, relative_pos: torch.Tensor,
                      rel_embeddings: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | int:
        # DisentangledSelfAttention.disentangled_att_bias: the window is min(S, max_relative_positions) each
        # side of the table's centre; c2p is not divided again (the query already was), p2c's pos_query is
        span = min(max(query.size(-2), key.size(-2)), self.max_relative)
        relative_pos = relative_pos.unsqueeze(1).long()  # (1, 1, S, S)
        rel_embeddings = rel_embeddings[self.max_relative - span: self.max_relative + span, :].unsqueeze(0)
        score = 0
        if self.c2p:
            pos_key = self.split(self.pos_proj(rel_embeddings))
            c2p = torch.matmul(query, pos_key.transpose(-1, -2))
            c2p_pos = torch.clamp(relative_pos + span, 0, span * 2 - 1)
            c2p = torch.gather(c2p, dim=-1, index=c2p_pos.expand(
                [query.size(0), query.size(1), query.size(2), relative_pos.size(-1)]))
            score = score + c2p
        if self.p2c:
            pos_query = self.split(self.pos_q_proj(rel_embeddings))
            pos_query /= scaled_size_sqrt(pos_query.size(-1), self.scale_factor)  # in place, as there: autograd
            p2c_pos = torch.clamp(-relative_pos + span, 0, span * 2 - 1)
            p2c = torch.matmul(key, pos_query.transpose(-1, -2).to(dtype=key.dtype))
            p2c = torch.gather(p2c, dim=-1, index=p2c_pos.expand(
                [query.size(0), query.size(1), key.size(-2), key.size(-2)])).transpose(-1, -2)
            score += p2c  # in place on c2p's tensor where there is one, as there
        return score


class DebertaAttention(DebertaV2Attention):
    self_attention_class = DebertaSelfAttention

    def __init__(self, config: DebertaConfig) -> None:
        super().__init__(config)
        self.output.LayerNorm = DebertaLayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class DebertaLayer(DebertaV2Layer):
    attention_class = DebertaAttention

    def __init__(self, config: DebertaConfig) -> None:
        super().__init__(config)
        self.output.LayerNorm = DebertaLayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class DebertaEncoder(DebertaV2Encoder):
    layer_class = DebertaLayer


class DebertaModel(DebertaV2Model):
    embeddings_class = DebertaEmbeddings
    encoder_class = DebertaEncoder


@register
class Deberta(DebertaV2):
    """Every head transformers has for v1: no multiple choice (there is no DebertaForMultipleChoice)."""

    model_type = "deberta"
    arch = "Deberta"
    config_class = DebertaConfig
    backbone_class = DebertaModel
    tasks = ("base", "seqcls", "tokcls", "qa", "mlm")
