"""MPNet (``model_type: mpnet``): RoBERTa's positions and heads, a relative position bias, no token types.

Mirrors ``transformers.models.mpnet.modeling_mpnet`` (the family of sentence-transformers'
all-mpnet-base-v2). What differs from RoBERTa:
- no token types; positions count non-pad tokens from ``padding_idx + 1`` with
  ``padding_idx`` fixed at 1 (``MPNetEmbeddings``), whatever ``pad_token_id`` says;
- attention is MPNet's own (transformers has only this path, eager): projections ``q k v o``,
  scores divided by ``sqrt(head_dim)``, then the relative position bias, then the mask;
- the bias is bucketed (``MPNetEncoder.relative_position_bucket``, 32 buckets whatever the
  config says) from ``encoder.relative_attention_bias``, computed once per forward and shared by
  every layer;
- every head drops out with ``hidden_dropout_prob`` (transformers reads no ``classifier_dropout``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.families.bert import BertEncoder, BertLayer, BertModel
from flodl_hf.families.roberta import Roberta, RobertaConfig, RobertaEmbeddings
from flodl_hf.heads import (ModelForMaskedLM, ModelForMultipleChoice, ModelForQuestionAnswering,
                            ModelForSequenceClassification, ModelForTokenClassification)
from flodl_hf.core.layers import record_attention, split_heads
from flodl_hf.core.modeling import positional_order
from flodl_hf.core.outputs import BaseModelOutput
from flodl_hf.core.registry import register

PADDING_IDX = 1  # MPNetEmbeddings.padding_idx, fixed


@dataclass
class MPNetConfig(RobertaConfig):
    model_type: ClassVar[str] = "mpnet"

    vocab_size: int = 30527
    max_position_embeddings: int = 512
    type_vocab_size: int = 0  # MPNet has no token types
    relative_attention_num_buckets: int = 32


class MPNetEmbeddings(nn.Module):
    """``(word + position)``, LayerNorm, dropout; RoBERTa's position ids from ``padding_idx`` 1."""

    position_ids = RobertaEmbeddings.position_ids

    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.padding_idx = PADDING_IDX
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=PADDING_IDX)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                padding_idx=PADDING_IDX)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, **_: torch.Tensor | None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if position_ids is None:
            position_ids = self.position_ids(input_ids, inputs_embeds)
        return self.dropout(self.LayerNorm(inputs_embeds + self.position_embeddings(position_ids)))


class MPNetSelfAttention(nn.Module):
    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        all_heads = self.head_dim * config.num_attention_heads
        self.q = nn.Linear(config.hidden_size, all_heads)
        self.k = nn.Linear(config.hidden_size, all_heads)
        self.v = nn.Linear(config.hidden_size, all_heads)
        self.o = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None,
                position_bias: torch.Tensor | None = None) -> torch.Tensor:
        q = split_heads(self.q(hidden_states), self.head_dim)
        k = split_heads(self.k(hidden_states), self.head_dim)
        v = split_heads(self.v(hidden_states), self.head_dim)
        # MPNetSelfAttention.forward: (qk^T / sqrt(d)) += bias, + mask, softmax, @ v
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(self.head_dim)
        if position_bias is not None:
            scores += position_bias
        if mask is not None:
            scores = scores + mask
        probs = self.dropout(F.softmax(scores, dim=-1))
        record_attention(probs)
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return self.o(context.view(*context.shape[:2], -1))


class MPNetAttention(nn.Module):
    """``LayerNorm(dropout(attn(x)) + x)``."""

    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.attn = MPNetSelfAttention(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None,
                position_bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.attn(hidden_states, mask, position_bias)) + hidden_states)


class MPNetLayer(BertLayer):
    """BERT's layer (intermediate, output) around MPNet's attention; the bias reaches it as a keyword."""

    attention_class = MPNetAttention


def relative_position_bucket(relative_position: torch.Tensor, num_buckets: int = 32,
                             max_distance: int = 128) -> torch.Tensor:
    """MPNetEncoder.relative_position_bucket, op for op (the log bucket is computed in float32)."""
    n = -relative_position
    num_buckets //= 2
    ret = (n < 0).to(torch.long) * num_buckets
    n = torch.abs(n)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    val_if_large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                                * (num_buckets - max_exact)).to(torch.long)
    val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
    return ret + torch.where(is_small, n, val_if_large)


class MPNetEncoder(BertEncoder):
    layer_class = MPNetLayer

    def __init__(self, config: MPNetConfig) -> None:
        super().__init__(config)
        self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_attention_heads)

    def position_bias(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, heads, S, S), once per forward (MPNetEncoder.compute_position_bias; 32 buckets, as HF calls it)."""
        bsz, length = hidden_states.shape[:2]
        pos = torch.arange(length, dtype=torch.long, device=hidden_states.device)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None])
        values = self.relative_attention_bias(buckets).permute([2, 0, 1]).unsqueeze(0)
        return values.expand((bsz, -1, length, length)).contiguous()

    def forward(self, hidden_states: torch.Tensor, masks: list[torch.Tensor | None]) -> torch.Tensor:
        return super().forward(hidden_states, masks, position_bias=self.position_bias(hidden_states))


# transformers' positional order: position_ids third (MPNet has no token types; one given by keyword is an InputError)
ORDER = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")


@positional_order(*ORDER)
class MPNetModel(BertModel):
    output_record = BaseModelOutput  # MPNetModel has no cross-attention: BaseModelOutputWithPooling
    input_names = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")
    embeddings_class = MPNetEmbeddings
    encoder_class = MPNetEncoder
    supports_gradient_checkpointing = False  # MPNetModel has none


@positional_order(*ORDER, "labels")
class MPNetForSequenceClassification(ModelForSequenceClassification):
    """The shared task model in transformers' positional order for MPNet's."""


@positional_order(*ORDER, "labels")
class MPNetForTokenClassification(ModelForTokenClassification):
    """The shared task model in transformers' positional order for MPNet's."""


@positional_order(*ORDER, "start_positions", "end_positions")
class MPNetForQuestionAnswering(ModelForQuestionAnswering):
    """The shared task model in transformers' positional order for MPNet's."""


@positional_order(*ORDER, "labels")
class MPNetForMaskedLM(ModelForMaskedLM):
    """The shared task model in transformers' positional order for MPNet's."""


@positional_order(*ORDER, "labels")
class MPNetForMultipleChoice(ModelForMultipleChoice):
    """The shared task model in transformers' positional order for MPNet's."""


@register
class MPNet(Roberta):
    model_type = "mpnet"
    arch = "MPNet"
    prefix = "mpnet"
    config_class = MPNetConfig
    backbone_class = MPNetModel
    attn_implementations = ("eager",)  # transformers has only MPNet's own attention
    none_is_config_default = True  # output_hidden_states if not None else config.output_hidden_states
    task_models = {"seqcls": MPNetForSequenceClassification, "tokcls": MPNetForTokenClassification,
                   "qa": MPNetForQuestionAnswering, "mlm": MPNetForMaskedLM, "mc": MPNetForMultipleChoice}

    @classmethod
    def classifier_dropout(cls, config: MPNetConfig) -> float:
        return config.hidden_dropout_prob

    @classmethod
    def multiple_choice_head(cls, config: MPNetConfig):
        from flodl_hf.heads import PooledClassifier
        return PooledClassifier(config.hidden_size, 1, config.hidden_dropout_prob)

    @classmethod
    def max_sequence_length(cls, config: MPNetConfig) -> int:
        return config.max_position_embeddings - PADDING_IDX - 1
