"""BERT (``model_type: bert``): the parent of the lineage.

Module names equal ``transformers.models.bert.modeling_bert``'s, so ``state_dict()``
keys are HF's keys. The op order follows it too (PARITY_NOTES.md): embeddings sum
as ``(word + token_type) + position``; each sub-layer is ``LayerNorm(dense(x) + residual)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.config import Activation, BaseConfig
from flodl_hf.core.errors import ConfigError
from flodl_hf.heads import ModelForMaskedLM
from flodl_hf.core.keys import LEGACY_LAYERNORM
from flodl_hf.core.layers import activation, attend, split_heads
from flodl_hf.core.modeling import Backbone, HeadPart, positional_order
from flodl_hf.core.outputs import BaseModelOutputWithPoolingAndCrossAttentions
from flodl_hf.core.registry import Family, register

@dataclass
class BertConfig(BaseConfig):
    model_type: ClassVar[str] = "bert"
    enum_fields: ClassVar[dict[str, type]] = {"hidden_act": Activation}

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: Activation = Activation.GELU
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    position_embedding_type: str = "absolute"
    is_decoder: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"config: hidden_size={self.hidden_size} is not a multiple of "
                              f"num_attention_heads={self.num_attention_heads}")
        if self.position_embedding_type != "absolute":
            raise ConfigError(f"config: position_embedding_type={self.position_embedding_type!r} is not "
                              "supported (only 'absolute')")
        if self.is_decoder:
            raise ConfigError("config: is_decoder=true (causal BERT) is not supported; flodl-hf runs encoders")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig, width: int | None = None) -> None:
        super().__init__()
        width = width or config.hidden_size  # ALBERT embeds at embedding_size
        self.word_embeddings = nn.Embedding(config.vocab_size, width, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, width)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, width)
        self.LayerNorm = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def position_ids(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """Absolute positions 0..S-1 (RoBERTa overrides this and nothing else)."""
        return torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None, :]

    def forward(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if position_ids is None:
            position_ids = self.position_ids(input_ids, inputs_embeds)
        if token_type_ids is None:
            token_type_ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        return self.dropout(self.normalize(embeddings))

    def normalize(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The LayerNorm over the summed embeddings (XLM-RoBERTa-XL has none: its layers norm first)."""
        return self.LayerNorm(embeddings)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        all_heads = self.head_dim * config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, all_heads)
        self.key = nn.Linear(config.hidden_size, all_heads)
        self.value = nn.Linear(config.hidden_size, all_heads)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q = split_heads(self.query(hidden_states), self.head_dim)
        k = split_heads(self.key(hidden_states), self.head_dim)
        v = split_heads(self.value(hidden_states), self.head_dim)
        p = self.dropout.p if self.training else 0.0
        return attend(q, k, v, mask, self.config.attn_implementation, p, self.head_dim ** -0.5)


class BertSelfOutput(nn.Module):
    """``LayerNorm(dropout(dense(x)) + residual)``; also BERT's FFN output (``BertOutput``)."""

    def __init__(self, in_size: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + residual)


class BertAttention(nn.Module):
    self_attention_class: ClassVar[type[nn.Module]] = BertSelfAttention

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = self.self_attention_class(config)
        self.output = BertSelfOutput(config.hidden_size, config)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None, **extra) -> torch.Tensor:
        return self.output(self.self(hidden_states, mask, **extra), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = activation(config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden_states))


class BertLayer(nn.Module):
    attention_class: ClassVar[type[nn.Module]] = BertAttention

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = self.attention_class(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config.intermediate_size, config)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None, **extra) -> torch.Tensor:
        attended = self.attention(hidden_states, mask, **extra)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    layer_class: ClassVar[type[nn.Module]] = BertLayer

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(self.layer_class(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor, masks: list[torch.Tensor | None], **extra) -> torch.Tensor:
        for layer, mask in zip(self.layer, masks, strict=True):
            hidden_states = layer(hidden_states, mask, **extra)
        return hidden_states


class BertPooler(nn.Module):
    """``tanh(dense(h[:, 0]))``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))


class BertModel(Backbone):
    """The bare encoder: ``last_hidden_state`` and, with the pooler, ``pooler_output``."""

    output_record = BaseModelOutputWithPoolingAndCrossAttentions  # BertModel may be built with cross-attention
    embeddings_class: ClassVar[type[nn.Module]] = BertEmbeddings
    encoder_class: ClassVar[type[nn.Module]] = BertEncoder
    pooler_class: ClassVar[type[nn.Module]] = BertPooler

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.embeddings = self.embeddings_class(config)
        self.encoder = self.encoder_class(config)
        self.pooler = self.pooler_class(config) if add_pooling_layer else None

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids,
                               position_ids=position_ids, inputs_embeds=inputs_embeds)

    def encode(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(hidden, self.layer_masks(attention_mask, hidden))

    def pool(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.pooler(hidden) if self.pooler is not None else None


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = activation(config.hidden_act)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden_states)))


class BertLMPredictionHead(nn.Module):
    """transform, then ``decoder``. Tied (the default), ``bias`` *is* ``decoder.bias`` and HF writes it
    once as ``cls.predictions.bias``; with ``tie_word_embeddings=False`` transformers 5 unties both
    (forward then uses ``decoder.bias``), and so do we."""

    def __init__(self, config: BertConfig, hidden_size: int | None = None) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(hidden_size or config.hidden_size, config.vocab_size)
        self.bias = self.decoder.bias if config.tie_word_embeddings else nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(hidden_states))


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config)


class BertMLMHead(HeadPart):
    """Mounts ``cls.predictions.*`` at the root of the masked-LM model."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.cls = BertOnlyMLMHead(config)

    def output_embeddings(self) -> nn.Module:
        return self.cls.predictions.decoder

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.cls.predictions(hidden_states)


@positional_order("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")
class BertForMaskedLM(ModelForMaskedLM):
    """The shared masked LM with ``labels`` by keyword only: BERT's and RoBERTa's transformers forward has
    ``encoder_hidden_states`` and ``encoder_attention_mask`` (cross-attention, which flodl-hf does not run)
    sixth and seventh, and ``labels`` eighth."""


@register
class Bert(Family):
    model_type = "bert"
    arch = "Bert"
    prefix = "bert"
    config_class = BertConfig
    backbone_class = BertModel
    legacy_suffixes = LEGACY_LAYERNORM  # TF-era checkpoints (samples/splade) name LayerNorm gamma/beta
    task_models = {"mlm": BertForMaskedLM}

    @classmethod
    def lm_head(cls, config: BertConfig) -> HeadPart:
        return BertMLMHead(config)
