"""ALBERT (``model_type: albert``): BERT with factorised embeddings and layers shared by group.

Mirrors ``transformers.models.albert.modeling_albert``: embeddings at
``embedding_size`` are projected to ``hidden_size`` by ``encoder.embedding_hidden_mapping_in``;
``num_hidden_layers`` steps run through ``num_hidden_groups`` groups of ``inner_group_num``
layers each; the pooler is a flat ``pooler`` Linear + tanh; the masked-LM head
``predictions`` runs back down to ``embedding_size`` before the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.config import Activation
from flodl_hf.families.bert import Bert, BertConfig, BertEmbeddings, BertModel, BertSelfAttention
from flodl_hf.core.layers import activation
from flodl_hf.core.modeling import HeadPart
from flodl_hf.core.outputs import BaseModelOutput
from flodl_hf.core.registry import register


@dataclass
class AlbertConfig(BertConfig):
    model_type: ClassVar[str] = "albert"

    vocab_size: int = 30000
    embedding_size: int = 128
    hidden_size: int = 4096
    num_hidden_layers: int = 12
    num_hidden_groups: int = 1
    num_attention_heads: int = 64
    intermediate_size: int = 16384
    inner_group_num: int = 1
    hidden_act: Activation = Activation.GELU_NEW
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    classifier_dropout_prob: float | None = 0.1


class AlbertEmbeddings(BertEmbeddings):
    def __init__(self, config: AlbertConfig) -> None:
        super().__init__(config, width=config.embedding_size)


class AlbertAttention(BertSelfAttention):
    """BERT's self-attention plus ALBERT's flat output: ``LayerNorm(x + dropout(dense(attention)))``."""

    def __init__(self, config: AlbertConfig) -> None:
        super().__init__(config)
        self.output_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        attended = super().forward(hidden_states, mask)
        return self.LayerNorm(hidden_states + self.output_dropout(self.dense(attended)))


class AlbertLayer(nn.Module):
    """``full_layer_layer_norm(ffn_output(act(ffn(a))) + a)``; HF's layer has a dropout its forward never applies."""

    def __init__(self, config: AlbertConfig) -> None:
        super().__init__()
        self.full_layer_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = AlbertAttention(config)
        self.ffn = nn.Linear(config.hidden_size, config.intermediate_size)
        self.ffn_output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.activation = activation(config.hidden_act)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        attended = self.attention(hidden_states, mask)
        return self.full_layer_layer_norm(self.ffn_output(self.activation(self.ffn(attended))) + attended)


class AlbertLayerGroup(nn.Module):
    def __init__(self, config: AlbertConfig) -> None:
        super().__init__()
        self.albert_layers = nn.ModuleList(AlbertLayer(config) for _ in range(config.inner_group_num))

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.albert_layers:
            hidden_states = layer(hidden_states, mask)
        return hidden_states


class AlbertTransformer(nn.Module):
    def __init__(self, config: AlbertConfig) -> None:
        super().__init__()
        self.num_hidden_layers = config.num_hidden_layers
        self.num_hidden_groups = config.num_hidden_groups
        self.embedding_hidden_mapping_in = nn.Linear(config.embedding_size, config.hidden_size)
        self.albert_layer_groups = nn.ModuleList(AlbertLayerGroup(config) for _ in range(config.num_hidden_groups))

    def forward(self, hidden_states: torch.Tensor, masks: list[torch.Tensor | None]) -> torch.Tensor:
        hidden_states = self.embedding_hidden_mapping_in(hidden_states)
        for i in range(self.num_hidden_layers):
            # AlbertTransformer.forward's rule, float division and all
            group_idx = int(i / (self.num_hidden_layers / self.num_hidden_groups))
            hidden_states = self.albert_layer_groups[group_idx](hidden_states, masks[i])
        return hidden_states


class AlbertPooler(nn.Linear):
    """HF's flat ``pooler`` Linear followed by ``pooler_activation`` (tanh) on the first token."""

    def __init__(self, config: AlbertConfig) -> None:
        super().__init__(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(hidden_states[:, 0]))


class AlbertModel(BertModel):
    output_record = BaseModelOutput  # AlbertModel has no cross-attention: BaseModelOutputWithPooling
    embeddings_class = AlbertEmbeddings
    encoder_class = AlbertTransformer
    pooler_class = AlbertPooler
    supports_gradient_checkpointing = False  # AlbertModel has none


class AlbertMLMHead(nn.Module):
    """dense (hidden -> embedding size), act, LayerNorm, decoder (embedding size -> vocabulary)."""

    def __init__(self, config: AlbertConfig) -> None:
        super().__init__()
        self.LayerNorm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.dense = nn.Linear(config.hidden_size, config.embedding_size)
        self.decoder = nn.Linear(config.embedding_size, config.vocab_size)
        self.activation = activation(config.hidden_act)
        # HF ties decoder.bias to predictions.bias only with tie_word_embeddings; untied, predictions.bias
        # is a separate tensor that the forward never reads (and the file holds both).
        self.bias = self.decoder.bias if config.tie_word_embeddings else nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.LayerNorm(self.activation(self.dense(hidden_states))))


class AlbertMLMHeadPart(HeadPart):
    """Mounts ``predictions.*`` at the root of the masked-LM model."""

    def __init__(self, config: AlbertConfig) -> None:
        super().__init__()
        self.predictions = AlbertMLMHead(config)

    def output_embeddings(self) -> nn.Module:
        return self.predictions.decoder

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.predictions(hidden_states)


@register
class Albert(Bert):
    model_type = "albert"
    arch = "Albert"
    prefix = "albert"
    config_class = AlbertConfig
    backbone_class = AlbertModel
    task_models = {}  # the shared task models: transformers' ALBERT takes labels sixth (no cross-attention inputs)

    @classmethod
    def classifier_dropout(cls, config: AlbertConfig) -> float:
        value = config.classifier_dropout_prob
        return value if value is not None else config.hidden_dropout_prob

    @classmethod
    def lm_head(cls, config: AlbertConfig) -> HeadPart:
        return AlbertMLMHeadPart(config)
