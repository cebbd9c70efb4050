"""XLM-RoBERTa-XL (``model_type: xlm-roberta-xl``: facebook/xlm-roberta-xl, -xxl): RoBERTa (its positions and heads)
with no LayerNorm after the embeddings sum, pre-LN layers (the attention as RoBERTa-PreLayerNorm's, its LayerNorm
named ``self_attn_layer_norm``; the MLP's LayerNorm on the layer, ``LayerNorm``, before ``intermediate``; the MLP's
``output`` without dropout), and the final ``LayerNorm`` inside the encoder (``encoder.LayerNorm``, after the layers).
``XLMRobertaXLForCausalLM`` (``is_decoder``) is refused, as RoBERTa's.

Mirrors ``transformers.models.xlm_roberta_xl.modeling_xlm_roberta_xl`` (5.25); the pre-LN attention is
families/roberta_prelayernorm.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.families.bert import BertEncoder, BertIntermediate, BertLayer
from flodl_hf.families.roberta import Roberta, RobertaConfig, RobertaEmbeddings, RobertaModel
from flodl_hf.families.roberta_prelayernorm import RobertaPreLayerNormAttention
from flodl_hf.core.registry import register


@dataclass
class XLMRobertaXLConfig(RobertaConfig):
    model_type: ClassVar[str] = "xlm-roberta-xl"

    vocab_size: int = 250880
    hidden_size: int = 2560
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    intermediate_size: int = 10240
    max_position_embeddings: int = 514
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-5


class XLMRobertaXLEmbeddings(RobertaEmbeddings):
    """RoBERTa's embeddings without their LayerNorm: ``dropout((word + token_type) + position)``."""

    def __init__(self, config: XLMRobertaXLConfig) -> None:
        super().__init__(config)
        del self.LayerNorm

    def normalize(self, embeddings: torch.Tensor) -> torch.Tensor:
        return embeddings


class XLMRobertaXLAttention(RobertaPreLayerNormAttention):
    norm_name = "self_attn_layer_norm"


class XLMRobertaXLOutput(nn.Module):
    """``dense(x) + residual``: no dropout, no LayerNorm."""

    def __init__(self, config: XLMRobertaXLConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.dense(hidden_states) + residual


class XLMRobertaXLLayer(BertLayer):
    """``attention``, ``intermediate``, ``output`` and the MLP's ``LayerNorm``, in transformers' order."""

    def __init__(self, config: XLMRobertaXLConfig) -> None:
        nn.Module.__init__(self)
        self.attention = XLMRobertaXLAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = XLMRobertaXLOutput(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None, **extra) -> torch.Tensor:
        # XLMRobertaXLLayer.feed_forward_chunk: output(intermediate(LayerNorm(a)), a) over the attention's a
        attended = self.attention(hidden_states, mask, **extra)
        return self.output(self.intermediate(self.LayerNorm(attended)), attended)


class XLMRobertaXLEncoder(BertEncoder):
    """The layers, then ``LayerNorm`` (XLMRobertaXLEncoder.forward)."""

    layer_class = XLMRobertaXLLayer

    def __init__(self, config: XLMRobertaXLConfig) -> None:
        super().__init__(config)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, masks: list[torch.Tensor | None], **extra) -> torch.Tensor:
        return self.LayerNorm(super().forward(hidden_states, masks, **extra))


class XLMRobertaXLModel(RobertaModel):
    embeddings_class = XLMRobertaXLEmbeddings
    encoder_class = XLMRobertaXLEncoder


@register
class XLMRobertaXL(Roberta):
    model_type = "xlm-roberta-xl"
    arch = "XLMRobertaXL"
    config_class = XLMRobertaXLConfig
    backbone_class = XLMRobertaXLModel
