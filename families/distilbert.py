"""DistilBERT (``model_type: distilbert``): BERT without token types or pooler, under its own names.

Mirrors ``transformers.models.distilbert.modeling_distilbert``: config fields
``dim``/``n_layers``/``n_heads``/``hidden_dim``/``activation``; LayerNorm eps fixed
at 1e-12; embeddings ``word + position``; each block is
``sa_layer_norm(attention + x)`` then ``output_layer_norm(ffn + x)``. Sinusoidal
position tables are stored in the checkpoint and loaded as they are, like HF.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.config import Activation, BaseConfig
from flodl_hf.core.errors import ConfigError
from flodl_hf.families.bert import BertEncoder
from flodl_hf.heads import (ModelForMaskedLM, ModelForMultipleChoice, ModelForQuestionAnswering,
                            ModelForSequenceClassification, ModelForTokenClassification)
from flodl_hf.core.keys import LEGACY_LAYERNORM
from flodl_hf.core.layers import activation, attend, split_heads
from flodl_hf.core.modeling import Backbone, HeadPart, positional_order
from flodl_hf.core.registry import Family, register

EPS = 1e-12  # DistilBERT hard-codes it; there is no config field


@dataclass
class DistilBertConfig(BaseConfig):
    model_type: ClassVar[str] = "distilbert"
    enum_fields: ClassVar[dict[str, type]] = {"activation": Activation}

    vocab_size: int = 30522
    max_position_embeddings: int = 512
    sinusoidal_pos_embds: bool = False
    n_layers: int = 6
    n_heads: int = 12
    dim: int = 768
    hidden_dim: int = 4 * 768
    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation: Activation = Activation.GELU
    qa_dropout: float = 0.1
    seq_classif_dropout: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dim % self.n_heads:
            raise ConfigError(f"config: dim={self.dim} is not a multiple of n_heads={self.n_heads}")

    # transformers' attribute_map: the shared heads and encoder read these names
    @property
    def hidden_size(self) -> int:
        return self.dim

    @property
    def num_attention_heads(self) -> int:
        return self.n_heads

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layers


class Embeddings(nn.Module):
    def __init__(self, config: DistilBertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.dim, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.dim)
        self.LayerNorm = nn.LayerNorm(config.dim, eps=EPS)
        self.dropout = nn.Dropout(config.dropout)
        self.sinusoidal = config.sinusoidal_pos_embds

    @torch.no_grad()
    def init_fresh_weights(self, std: float) -> None:
        """DistilBertPreTrainedModel._init_weights: with sinusoidal_pos_embds, the position table is
        create_sinusoidal_embeddings' (pos / 10000 ** (2 (j // 2) / dim) in float64, sin on even columns, cos on
        odd ones, cast to float32)."""
        if not self.sinusoidal:
            return
        table = self.position_embeddings.weight
        n_pos, dim = table.shape
        j = torch.arange(dim, dtype=torch.float64)
        angles = torch.arange(n_pos, dtype=torch.float64)[:, None] / torch.pow(10000.0, 2 * (j // 2) / dim)
        table[:, 0::2] = torch.sin(angles[:, 0::2]).to(table.dtype)
        table[:, 1::2] = torch.cos(angles[:, 1::2]).to(table.dtype)

    def forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                position_ids: torch.Tensor | None) -> torch.Tensor:
        if input_ids is not None:
            inputs_embeds = self.word_embeddings(input_ids)
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None, :]
        return self.dropout(self.LayerNorm(inputs_embeds + self.position_embeddings(position_ids)))


class DistilBertSelfAttention(nn.Module):
    """``out_lin(attention(q_lin(x), k_lin(x), v_lin(x)))``."""

    def __init__(self, config: DistilBertConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.dim // config.n_heads
        self.q_lin = nn.Linear(config.dim, config.dim)
        self.k_lin = nn.Linear(config.dim, config.dim)
        self.v_lin = nn.Linear(config.dim, config.dim)
        self.out_lin = nn.Linear(config.dim, config.dim)
        self.dropout = nn.Dropout(config.attention_dropout)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q = split_heads(self.q_lin(hidden_states), self.head_dim)
        k = split_heads(self.k_lin(hidden_states), self.head_dim)
        v = split_heads(self.v_lin(hidden_states), self.head_dim)
        p = self.dropout.p if self.training else 0.0
        return self.out_lin(attend(q, k, v, mask, self.config.attn_implementation, p, self.head_dim ** -0.5))


class FFN(nn.Module):
    def __init__(self, config: DistilBertConfig) -> None:
        super().__init__()
        self.dropout = nn.Dropout(config.dropout)
        self.lin1 = nn.Linear(config.dim, config.hidden_dim)
        self.lin2 = nn.Linear(config.hidden_dim, config.dim)
        self.activation = activation(config.activation)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.lin2(self.activation(self.lin1(hidden_states))))


class TransformerBlock(nn.Module):
    def __init__(self, config: DistilBertConfig) -> None:
        super().__init__()
        self.attention = DistilBertSelfAttention(config)
        self.sa_layer_norm = nn.LayerNorm(config.dim, eps=EPS)
        self.ffn = FFN(config)
        self.output_layer_norm = nn.LayerNorm(config.dim, eps=EPS)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        attended = self.sa_layer_norm(self.attention(hidden_states, mask) + hidden_states)
        return self.output_layer_norm(self.ffn(attended) + attended)


class Transformer(BertEncoder):
    """``layer.{i}``, as BERT's encoder, of DistilBERT blocks."""

    layer_class = TransformerBlock


# transformers' positional order: inputs_embeds third, position_ids last (after the labels)
@positional_order("input_ids", "attention_mask", "inputs_embeds", "position_ids")
class DistilBertModel(Backbone):
    """The bare encoder: ``last_hidden_state`` only (DistilBERT has no pooler)."""

    def __init__(self, config: DistilBertConfig, add_pooling_layer: bool = False) -> None:
        super().__init__(config)
        self.embeddings = Embeddings(config)
        self.transformer = Transformer(config)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def num_layers(self) -> int:
        return self.config.n_layers

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.embeddings(input_ids, inputs_embeds, position_ids)

    def encode(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.transformer(hidden, self.layer_masks(attention_mask, hidden))


class PreClassifierHead(HeadPart):
    """``classifier(dropout(relu(pre_classifier(h[:, 0]))))``: sequence classification and multiple choice."""

    def __init__(self, dim: int, num_outputs: int, dropout: float) -> None:
        super().__init__()
        self.pre_classifier = nn.Linear(dim, dim)
        self.classifier = nn.Linear(dim, num_outputs)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.classifier(self.dropout(F.relu(self.pre_classifier(hidden_states[:, 0]))))


class DistilBertMLMHead(HeadPart):
    """``vocab_projector(vocab_layer_norm(act(vocab_transform(h))))``, mounted at the model root."""

    def __init__(self, config: DistilBertConfig) -> None:
        super().__init__()
        self.activation = activation(config.activation)
        self.vocab_transform = nn.Linear(config.dim, config.dim)
        self.vocab_layer_norm = nn.LayerNorm(config.dim, eps=EPS)
        self.vocab_projector = nn.Linear(config.dim, config.vocab_size)

    def output_embeddings(self) -> nn.Module:
        return self.vocab_projector

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.vocab_projector(self.vocab_layer_norm(self.activation(self.vocab_transform(hidden_states))))


@positional_order("input_ids", "attention_mask", "inputs_embeds", "labels", "position_ids")
class DistilBertForSequenceClassification(ModelForSequenceClassification):
    """The shared task model in transformers' positional order for DistilBERT's."""


@positional_order("input_ids", "attention_mask", "inputs_embeds", "labels", "position_ids")
class DistilBertForTokenClassification(ModelForTokenClassification):
    """The shared task model in transformers' positional order for DistilBERT's."""


@positional_order("input_ids", "attention_mask", "inputs_embeds", "start_positions", "end_positions",
                  "position_ids")
class DistilBertForQuestionAnswering(ModelForQuestionAnswering):
    """The shared task model in transformers' positional order for DistilBERT's."""


@positional_order("input_ids", "attention_mask", "inputs_embeds", "labels", "position_ids")
class DistilBertForMaskedLM(ModelForMaskedLM):
    """The shared task model in transformers' positional order for DistilBERT's."""


@positional_order("input_ids", "attention_mask", "inputs_embeds", "labels", "position_ids")
class DistilBertForMultipleChoice(ModelForMultipleChoice):
    """The shared task model in transformers' positional order for DistilBERT's."""


@register
class DistilBert(Family):
    model_type = "distilbert"
    arch = "DistilBert"
    prefix = "distilbert"
    legacy_suffixes = LEGACY_LAYERNORM
    config_class = DistilBertConfig
    backbone_class = DistilBertModel
    task_models = {"seqcls": DistilBertForSequenceClassification, "tokcls": DistilBertForTokenClassification,
                   "qa": DistilBertForQuestionAnswering, "mlm": DistilBertForMaskedLM,
                   "mc": DistilBertForMultipleChoice}

    @classmethod
    def classifier_dropout(cls, config: DistilBertConfig) -> float:
        return config.dropout  # the token-classification head's

    @classmethod
    def sequence_head(cls, config: DistilBertConfig) -> HeadPart:
        return PreClassifierHead(config.dim, config.num_labels, config.seq_classif_dropout)

    @classmethod
    def multiple_choice_head(cls, config: DistilBertConfig) -> HeadPart:
        return PreClassifierHead(config.dim, 1, config.seq_classif_dropout)

    @classmethod
    def span_head(cls, config: DistilBertConfig) -> HeadPart:
        from flodl_hf.heads import SpanClassifier
        return SpanClassifier(config.dim, config.num_labels, config.qa_dropout)

    @classmethod
    def lm_head(cls, config: DistilBertConfig) -> HeadPart:
        return DistilBertMLMHead(config)
