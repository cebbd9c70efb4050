"""RoBERTa-PreLayerNorm (``model_type: roberta-prelayernorm``: andreasmadsen/efficient_mlm_*): RoBERTa (its embeddings,
positions and heads) with pre-LN layers: the attention is ``output.dense(self(LayerNorm(h)))`` then dropout, plus the
un-normed ``h``; the MLP is ``output.dense(act(dense(LayerNorm(h))))`` then dropout, plus ``h`` (the LayerNorm inside
``intermediate``); no LayerNorm after either residual add, and one ``LayerNorm`` on the encoder's output, a child of the
model (``roberta_prelayernorm.LayerNorm``), before the pooler. ``RobertaPreLayerNormForCausalLM`` (``is_decoder``) is
refused, as RoBERTa's.

Mirrors ``transformers.models.roberta_prelayernorm.modeling_roberta_prelayernorm`` (5.25). XLM-RoBERTa-XL
(families/xlm_roberta_xl.py) is the same layer with its norms named and placed otherwise, and builds on this file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.families.bert import BertEncoder, BertLayer, BertSelfAttention
from flodl_hf.families.roberta import Roberta, RobertaConfig, RobertaModel
from flodl_hf.core.layers import activation
from flodl_hf.core.modeling import mount_last
from flodl_hf.core.registry import register


@dataclass
class RobertaPreLayerNormConfig(RobertaConfig):
    model_type: ClassVar[str] = "roberta-prelayernorm"


class PreLayerNormOutput(nn.Module):
    """``dropout(dense(x)) + residual``: no LayerNorm after the residual add (RobertaPreLayerNormSelfOutput /
    RobertaPreLayerNormOutput; XLM-RoBERTa-XL's attention output)."""

    def __init__(self, in_size: int, config: RobertaConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.dense(hidden_states)) + residual


class RobertaPreLayerNormAttention(nn.Module):
    """``self``, ``output`` and the LayerNorm before them, named ``norm_name`` (XLM-RoBERTa-XL:
    ``self_attn_layer_norm``); the residual is the un-normed input."""

    norm_name: ClassVar[str] = "LayerNorm"

    def __init__(self, config: RobertaConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = PreLayerNormOutput(config.hidden_size, config)
        self.add_module(self.norm_name, nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps))

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None, **extra) -> torch.Tensor:
        # RobertaPreLayerNormAttention.forward: self(LayerNorm(h)), then output(., h)
        normed = self.get_submodule(self.norm_name)(hidden_states)
        return self.output(self.self(normed, mask, **extra), hidden_states)


class RobertaPreLayerNormIntermediate(nn.Module):
    """``act(dense(LayerNorm(x)))``, its modules in transformers' order."""

    def __init__(self, config: RobertaConfig) -> None:
        super().__init__()
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(self.LayerNorm(hidden_states)))


class RobertaPreLayerNormLayer(BertLayer):
    """BERT's layer (``output(intermediate(a), a)`` over the attention's ``a``) built from the pre-LN parts."""

    def __init__(self, config: RobertaConfig) -> None:
        nn.Module.__init__(self)
        self.attention = RobertaPreLayerNormAttention(config)
        self.intermediate = RobertaPreLayerNormIntermediate(config)
        self.output = PreLayerNormOutput(config.intermediate_size, config)


class RobertaPreLayerNormEncoder(BertEncoder):
    layer_class = RobertaPreLayerNormLayer


class RobertaPreLayerNormModel(RobertaModel):
    """RoBERTa's backbone with the pre-LN layers and ``LayerNorm`` on the encoder's output (registered after the
    encoder, before the pooler, as transformers')."""

    encoder_class = RobertaPreLayerNormEncoder

    def __init__(self, config: RobertaPreLayerNormConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config, add_pooling_layer)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if self.pooler is not None:
            mount_last(self, "pooler")

    def encode(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # RobertaPreLayerNormModel.forward: LayerNorm(encoder(embeddings)), then the pooler
        return self.LayerNorm(super().encode(hidden, attention_mask, position_ids))


@register
class RobertaPreLayerNorm(Roberta):
    model_type = "roberta-prelayernorm"
    arch = "RobertaPreLayerNorm"
    prefix = "roberta_prelayernorm"
    config_class = RobertaPreLayerNormConfig
    backbone_class = RobertaPreLayerNormModel
