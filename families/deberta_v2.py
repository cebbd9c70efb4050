"""DeBERTa-v2 and v3 (``model_type: deberta-v2``): BERT's layer with disentangled attention.

What differs from BERT: the embeddings (optional positions and token types, ``embed_proj``,
multiplied by the mask), the self-attention (content plus c2p/p2c relative terms over shared
``rel_embeddings``, pairwise mask), the ConvLayer after layer 0, the ContextPooler that lives in
the sequence and multiple-choice heads, and two masked-LM heads. Layer, attention wrapper,
FFN and output sub-layers are BERT's (HF's names match). There is no sdpa path in transformers,
so every model runs the op order of
https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/models/deberta_v2/modeling_deberta_v2.py
(see PARITY_NOTES.md, DeBERTa section).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.config import Activation
from flodl_hf.core.errors import ConfigError
from flodl_hf.heads import PooledClassifier, TokenClassifier
from flodl_hf.core.layers import activation, record_attention
from flodl_hf.core.modeling import HeadPart, PreTrainedModel, mount_last
from flodl_hf.core.outputs import BaseModelOutput
from flodl_hf.core.keys import LEGACY_LAYERNORM
from flodl_hf.core.registry import Family, register

from .bert import (BertAttention, BertConfig, BertEncoder, BertLayer, BertLMPredictionHead, BertMLMHead,
                   BertModel, BertPredictionHeadTransform)


class PosAttType(str, Enum):
    """The relative terms of ``pos_att_type``: content-to-position and position-to-content."""

    C2P = "c2p"
    P2C = "p2c"

    @classmethod
    def parse(cls, value: Any, where: str = "pos_att_type") -> tuple["PosAttType", ...]:
        """``"p2c|c2p"`` or ``["p2c", "c2p"]`` -> the set of terms, as a tuple in file order ("none": empty)."""
        items = value.lower().split("|") if isinstance(value, str) else list(value)
        terms: list[PosAttType] = []
        for item in items:
            name = str(item.value if isinstance(item, cls) else item).strip().lower()
            if name in ("", "none"):
                continue
            try:
                term = cls(name)
            except ValueError:
                raise ConfigError(f"config field {where}={value!r}: {name!r} is not supported "
                                  f"(known: {', '.join(t.value for t in cls)})") from None
            if term not in terms:
                terms.append(term)
        return tuple(terms)


@dataclass
class DebertaV2Config(BertConfig):
    """HF's DebertaV2Config fields and defaults, plus those its modeling code reads with ``getattr``."""

    model_type: ClassVar[str] = "deberta-v2"
    enum_fields: ClassVar[dict[str, type]] = {"hidden_act": Activation, "conv_act": Activation,
                                              "pooler_hidden_act": Activation, "pos_att_type": PosAttType}

    vocab_size: int = 128100
    hidden_size: int = 1536
    num_hidden_layers: int = 24
    num_attention_heads: int = 24
    intermediate_size: int = 6144
    type_vocab_size: int = 0                     # 0: no token_type_embeddings
    layer_norm_eps: float = 1e-7
    relative_attention: bool = False
    max_relative_positions: int = -1             # < 1: max_position_embeddings
    position_buckets: int = -1                   # > 0: log buckets, and the span of rel_embeddings
    pos_att_type: tuple[PosAttType, ...] | None = None
    share_att_key: bool = False                  # relative terms use query_proj/key_proj, not pos_*_proj
    norm_rel_ebd: str = "none"                   # "layer_norm": LayerNorm on rel_embeddings
    position_biased_input: bool = True           # absolute position embeddings added to the input
    embedding_size: int | None = None            # None: hidden_size; otherwise embed_proj maps it up
    conv_kernel_size: int = 0                    # > 0: ConvLayer after layer 0 (v2-xlarge and up)
    conv_groups: int = 1
    conv_act: Activation = Activation.TANH
    pooler_hidden_size: int | None = None        # None: hidden_size (HF fills it in)
    pooler_dropout: float = 0.0
    pooler_hidden_act: Activation = Activation.GELU
    cls_dropout: float | None = None             # sequence/choice classifier dropout; None: hidden_dropout_prob
    legacy: bool = True                          # masked-LM head: cls.predictions (True) or lm_predictions

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = set(self.norm_rel_ebd_terms) - {"none", "layer_norm"}
        if unknown:
            raise ConfigError(f"config field norm_rel_ebd={self.norm_rel_ebd!r}: {', '.join(sorted(unknown))} "
                              "is not supported (known: none, layer_norm)")

    @property
    def norm_rel_ebd_terms(self) -> list[str]:
        return [x.strip() for x in self.norm_rel_ebd.lower().split("|")]

    @property
    def embedding_dim(self) -> int:
        return self.embedding_size or self.hidden_size

    @property
    def max_relative(self) -> int:
        return self.max_relative_positions if self.max_relative_positions >= 1 else self.max_position_embeddings

    # The v2-only options the shared modules read, as properties (DeBERTa v1, ``families/deberta.py``, has
    # none of them and returns their off value whatever its config.json says, as transformers ignores them).
    @property
    def log_buckets(self) -> int:
        """Log-bucket count (HF's ``position_buckets``); <= 0: plain relative distances."""
        return self.position_buckets

    @property
    def conv_size(self) -> int:
        """The ConvLayer's kernel after layer 0; 0: no ConvLayer."""
        return self.conv_kernel_size

    @property
    def att_span(self) -> int:
        """Relative distances kept each side (HF's ``pos_ebd_size``); rel_embeddings has twice as many rows."""
        return self.log_buckets if self.log_buckets > 0 else self.max_relative

    def has(self, term: PosAttType) -> bool:
        return term in (self.pos_att_type or ())


# ---- relative positions --------------------------------------------------------------------

def make_log_bucket_position(relative_pos: torch.Tensor, bucket_size: int, max_position: int) -> torch.Tensor:
    # modeling_deberta_v2.make_log_bucket_position, literally: the bucket arithmetic runs in float32.
    sign = torch.sign(relative_pos)
    mid = bucket_size // 2
    abs_pos = torch.where((relative_pos < mid) & (relative_pos > -mid),
                          torch.tensor(mid - 1).type_as(relative_pos), torch.abs(relative_pos))
    log_pos = torch.ceil(torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, relative_pos.type_as(log_pos), log_pos * sign)


def build_relative_position(size: int, bucket_size: int, max_position: int, device: torch.device) -> torch.Tensor:
    """(1, size, size) long: query position minus key position, log-bucketed when ``bucket_size > 0``."""
    ids = torch.arange(size, dtype=torch.long, device=device)
    rel = ids[:, None] - ids[None, :]
    if bucket_size > 0 and max_position > 0:
        rel = make_log_bucket_position(rel, bucket_size, max_position)
    return rel.to(torch.long).unsqueeze(0)


def scaled_size_sqrt(head_dim: int, scale_factor: int) -> torch.Tensor:
    # modeling_deberta_v2.scaled_size_sqrt: a float32 tensor, not a Python float.
    return torch.sqrt(torch.tensor(head_dim, dtype=torch.float) * scale_factor)


# ---- backbone ------------------------------------------------------------------------------

class DebertaV2Embeddings(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        size = config.embedding_dim
        self.word_embeddings = nn.Embedding(config.vocab_size, size, padding_idx=config.pad_token_id)
        self.position_embeddings = (nn.Embedding(config.max_position_embeddings, size)
                                    if config.position_biased_input else None)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, size) if config.type_vocab_size > 0 else None
        self.embed_proj = nn.Linear(size, config.hidden_size, bias=False) if size != config.hidden_size else None
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None,
                position_ids: torch.Tensor | None, mask: torch.Tensor | None,
                inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        # DebertaV2Embeddings.forward: (word + position) + token_type, embed_proj, LayerNorm, then * mask
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        embeddings = inputs_embeds
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None, :]
            embeddings = embeddings + self.position_embeddings(position_ids.long())
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.embed_proj is not None:
            embeddings = self.embed_proj(embeddings)
        embeddings = self.LayerNorm(embeddings)
        if mask is not None:  # transformers multiplies by an all-ones mask too; x * 1.0 is x
            embeddings = embeddings * mask.unsqueeze(2).to(embeddings.dtype)
        return self.dropout(embeddings)


class DisentangledSelfAttention(nn.Module):
    """Content-to-content attention plus the c2p and p2c relative terms, on (B*heads, S, head_dim) tensors."""

    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.c2p, self.p2c = config.has(PosAttType.C2P), config.has(PosAttType.P2C)
        self.scale_factor = 1 + self.c2p + self.p2c
        self.relative_attention = config.relative_attention
        if self.relative_attention:
            self.att_span = config.att_span
            self.pos_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.make_projections(config, config.head_dim * self.num_heads)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def make_projections(self, config: DebertaV2Config, all_heads: int) -> None:
        """The content projections, then those of the relative terms (v1 overrides both: fused ``in_proj``)."""
        self.query_proj = nn.Linear(config.hidden_size, all_heads)
        self.key_proj = nn.Linear(config.hidden_size, all_heads)
        self.value_proj = nn.Linear(config.hidden_size, all_heads)
        self.share_att_key = config.share_att_key
        if self.relative_attention and not self.share_att_key:
            if self.c2p:
                self.pos_key_proj = nn.Linear(config.hidden_size, all_heads)
            if self.p2c:
                self.pos_query_proj = nn.Linear(config.hidden_size, all_heads)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        # DisentangledSelfAttention.transpose_for_scores: (B, S, H) -> contiguous (B*heads, S, head_dim)
        x = x.view(*x.shape[:-1], self.num_heads, -1)
        return x.permute(0, 2, 1, 3).contiguous().view(-1, x.size(1), x.size(-1))

    def forward(self, hidden_states: torch.Tensor, keep: torch.Tensor | None,
                relative_pos: torch.Tensor | None = None, rel_embeddings: torch.Tensor | None = None) -> torch.Tensor:
        query = self.split(self.query_proj(hidden_states))
        key = self.split(self.key_proj(hidden_states))
        value = self.split(self.value_proj(hidden_states))
        # A CPU 0-dim tensor, as transformers makes it: on CUDA, x / (CPU scalar tensor) runs as
        # x * (1 / scale), while x / (CUDA tensor) divides elementwise (up to 8e-6 apart at hidden 768
        # on an H200). On the CPU both are the same division.
        scale = scaled_size_sqrt(query.size(-1), self.scale_factor)
        # DisentangledSelfAttention.forward: k^T / scale before the bmm; then + (c2p/scale + p2c/scale)
        scores = torch.bmm(query, key.transpose(-1, -2) / scale.to(dtype=query.dtype))
        if self.relative_attention:
            scores = scores + self.relative_bias(query, key, relative_pos, self.pos_dropout(rel_embeddings), scale)
        scores = scores.view(-1, self.num_heads, scores.size(-2), scores.size(-1))
        if keep is not None:
            scores = scores.masked_fill(~keep, torch.finfo(query.dtype).min)
        probs = self.dropout(F.softmax(scores, dim=-1))
        record_attention(probs)
        context = torch.bmm(probs.view(-1, probs.size(-2), probs.size(-1)), value)
        context = context.view(-1, self.num_heads, context.size(-2), context.size(-1)).permute(0, 2, 1, 3).contiguous()
        return context.view(*context.shape[:2], -1)

    def relative_bias(self, query: torch.Tensor, key: torch.Tensor, relative_pos: torch.Tensor,
                      rel_embeddings: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | int:
        # DisentangledSelfAttention.disentangled_attention_bias, term by term in the same order
        span = self.att_span
        rel_embeddings = rel_embeddings[0: span * 2, :].unsqueeze(0)
        repeat = query.size(0) // self.num_heads
        relative_pos = relative_pos.unsqueeze(1)  # (1, 1, S, S)
        score = 0
        if self.c2p:
            proj = self.key_proj if self.share_att_key else self.pos_key_proj
            pos_key = self.split(proj(rel_embeddings)).repeat(repeat, 1, 1)
            c2p = torch.bmm(query, pos_key.transpose(-1, -2))
            c2p_pos = torch.clamp(relative_pos + span, 0, span * 2 - 1)
            c2p = torch.gather(c2p, dim=-1, index=c2p_pos.squeeze(0).expand(
                [query.size(0), query.size(1), relative_pos.size(-1)]))
            score = score + c2p / scale.to(dtype=c2p.dtype)
        if self.p2c:
            proj = self.query_proj if self.share_att_key else self.pos_query_proj
            pos_query = self.split(proj(rel_embeddings)).repeat(repeat, 1, 1)
            p2c_pos = torch.clamp(-relative_pos + span, 0, span * 2 - 1)
            p2c = torch.bmm(key, pos_query.transpose(-1, -2))
            p2c = torch.gather(p2c, dim=-1, index=p2c_pos.squeeze(0).expand(
                [query.size(0), key.size(-2), key.size(-2)])).transpose(-1, -2)
            score = score + p2c / scale.to(dtype=p2c.dtype)
        return score


class DebertaV2Attention(BertAttention):
    self_attention_class = DisentangledSelfAttention


class DebertaV2Layer(BertLayer):
    attention_class = DebertaV2Attention


class ConvLayer(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        kernel = config.conv_kernel_size
        self.conv = nn.Conv1d(config.hidden_size, config.hidden_size, kernel, padding=(kernel - 1) // 2,
                              groups=config.conv_groups)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.act = activation(config.conv_act)

    def forward(self, hidden_states: torch.Tensor, residual_states: torch.Tensor,
                input_mask: torch.Tensor | None) -> torch.Tensor:
        # ConvLayer.forward: conv, zero padded rows, act(dropout), LayerNorm(residual + out), * mask
        out = self.conv(hidden_states.permute(0, 2, 1).contiguous()).permute(0, 2, 1).contiguous()
        if input_mask is not None:
            out = out.masked_fill((1 - input_mask).bool().unsqueeze(-1), 0)
        out = self.LayerNorm(residual_states + self.act(self.dropout(out)))
        if input_mask is not None:
            out = out * input_mask.unsqueeze(2).to(out.dtype)
        return out


class DebertaV2Encoder(BertEncoder):
    """BERT's layer stack, plus the shared relative embeddings and the optional ConvLayer."""

    layer_class = DebertaV2Layer

    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__(config)
        self.relative_attention = config.relative_attention
        self.position_buckets, self.max_relative = config.log_buckets, config.max_relative
        if self.relative_attention:
            self.rel_embeddings = nn.Embedding(config.att_span * 2, config.hidden_size)
        self.LayerNorm = (nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
                          if "layer_norm" in config.norm_rel_ebd_terms else None)
        self.conv = ConvLayer(config) if config.conv_size > 0 else None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        keep = None
        if attention_mask is not None:
            # DebertaV2Encoder.get_attention_mask: pairwise (B, 1, S, S), query and key both real
            extended = attention_mask[:, None, None, :]
            keep = (extended * extended.squeeze(-2).unsqueeze(-1)).bool()
        relative_pos = rel_embeddings = None
        if self.relative_attention:
            relative_pos = build_relative_position(hidden_states.size(-2), self.position_buckets,
                                                   self.max_relative, hidden_states.device)
            # DebertaV2Encoder.get_rel_embedding: normalised once per forward, shared by every layer
            rel_embeddings = self.rel_embeddings.weight
            if self.LayerNorm is not None:
                rel_embeddings = self.LayerNorm(rel_embeddings)
        embedded = hidden_states
        for i, layer in enumerate(self.layer):
            hidden_states = layer(hidden_states, keep, relative_pos=relative_pos, rel_embeddings=rel_embeddings)
            if i == 0 and self.conv is not None:
                hidden_states = self.conv(embedded, hidden_states, attention_mask)
        return hidden_states


class DebertaV2Model(BertModel):
    """The bare encoder: ``last_hidden_state`` only (the ContextPooler belongs to the heads)."""

    output_record = BaseModelOutput  # DebertaV2Model has no cross-attention
    embeddings_class = DebertaV2Embeddings
    encoder_class = DebertaV2Encoder

    def __init__(self, config: DebertaV2Config, add_pooling_layer: bool = False) -> None:
        # The flag is part of the backbone contract; a checkpoint's "pooler.*" keys belong to a head here.
        super().__init__(config, add_pooling_layer=False)

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be (batch, seq); got shape {tuple(attention_mask.shape)}")
        # the embeddings are multiplied by the mask after LayerNorm (DebertaV2Embeddings.forward)
        return self.embeddings(input_ids, token_type_ids, position_ids, attention_mask, inputs_embeds)

    def encode(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # its own pairwise mask, built inside the encoder (DebertaV2Encoder.get_attention_mask)
        return self.encoder(hidden, attention_mask)

    def hidden_state_modules(self) -> list[nn.Module]:
        # DebertaV2Encoder.forward records layer 0's output after the ConvLayer, whose first input is the
        # embeddings' output: record the conv in layer 0's place
        layers = list(self.encoder.layer)
        return layers if self.encoder.conv is None else [self.encoder.conv, *layers[1:]]

    def checkpoint_layers(self) -> list[nn.Module]:
        return list(self.encoder.layer)  # the DebertaV2Layers (flodl_hf.core.checkpointing), not the conv


# ---- heads -------------------------------------------------------------------------------

class ContextPooler(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        size = config.pooler_hidden_size or config.hidden_size
        self.dense = nn.Linear(size, size)
        self.dropout = nn.Dropout(config.pooler_dropout)
        self.act = activation(config.pooler_hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # ContextPooler.forward: dropout before dense, then pooler_hidden_act
        return self.act(self.dense(self.dropout(hidden_states[:, 0])))


class ContextPooledClassifier(PooledClassifier):
    """``classifier(dropout(pooler(h)))`` with the ContextPooler at the model root (``pooler.dense``)."""

    uses_pooler = False

    def __init__(self, config: DebertaV2Config, num_outputs: int) -> None:
        super().__init__(config.hidden_size, num_outputs, DebertaV2.classifier_dropout(config))
        self.pooler = ContextPooler(config)
        mount_last(self, "classifier", "dropout")  # transformers' order: pooler, classifier, dropout

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(hidden_states, self.pooler(hidden_states), attention_mask)


class LegacyDebertaV2MLMHead(BertMLMHead):
    """``cls.predictions.*``: BERT's head, except that its transform narrows to embedding_size
    (LegacyDebertaV2PredictionHeadTransform). Tied as BERT's: decoder weight and bias."""

    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__(config)
        size = config.embedding_dim
        if size != config.hidden_size:
            predictions = self.cls.predictions = BertLMPredictionHead(config, size)
            predictions.transform.dense = nn.Linear(config.hidden_size, size)
            predictions.transform.LayerNorm = nn.LayerNorm(size, eps=config.layer_norm_eps)


class DebertaV2LMPredictionHead(BertPredictionHeadTransform):
    """``lm_predictions.lm_head``: dense, act, LayerNorm, then the input embeddings (read, not tied) and ``bias``."""

    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__(config)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: torch.Tensor, word_embeddings: nn.Embedding) -> torch.Tensor:
        # DebertaV2LMPredictionHead.forward: matmul(h, W.t()) + bias, not F.linear
        return torch.matmul(super().forward(hidden_states), word_embeddings.weight.t()) + self.bias


class DebertaV2OnlyMLMHead(nn.Module):
    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.lm_head = DebertaV2LMPredictionHead(config)


class DebertaV2MLMHead(HeadPart):
    """Mounts ``lm_predictions.lm_head.*``; holds the backbone unregistered, to read its input embeddings."""

    def __init__(self, config: DebertaV2Config) -> None:
        super().__init__()
        self.lm_predictions = DebertaV2OnlyMLMHead(config)

    def bind(self, backbone: PreTrainedModel) -> None:
        object.__setattr__(self, "backbone", backbone)

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_predictions.lm_head(hidden_states, self.backbone.get_input_embeddings())


@register
class DebertaV2(Family):
    model_type = "deberta-v2"
    arch = "DebertaV2"
    prefix = "deberta"
    legacy_suffixes = LEGACY_LAYERNORM
    config_class = DebertaV2Config
    backbone_class = DebertaV2Model
    attn_implementations = ("eager",)
    float_position_ids = True  # DebertaV2Embeddings.forward: position_embeddings(position_ids.long())
    none_is_config_default = True  # output_hidden_states if not None else config.output_hidden_states

    @classmethod
    def classifier_dropout(cls, config: DebertaV2Config) -> float:
        return config.cls_dropout if config.cls_dropout is not None else config.hidden_dropout_prob

    @classmethod
    def sequence_head(cls, config: DebertaV2Config) -> HeadPart:
        return ContextPooledClassifier(config, config.num_labels)

    @classmethod
    def multiple_choice_head(cls, config: DebertaV2Config) -> HeadPart:
        return ContextPooledClassifier(config, 1)

    @classmethod
    def token_head(cls, config: DebertaV2Config) -> HeadPart:
        # transformers uses hidden_dropout_prob here, not cls_dropout
        return TokenClassifier(config.hidden_size, config.num_labels, config.hidden_dropout_prob)

    @classmethod
    def sequence_loss(cls, logits: torch.Tensor, labels: torch.Tensor, config: DebertaV2Config) -> torch.Tensor:
        """DebertaV2ForSequenceClassification.forward: without problem_type, rows with a negative label
        are dropped and float label rows are soft targets; with it, the shared rule."""
        if config.problem_type is not None:
            return super().sequence_loss(logits, labels, config)
        num_labels = logits.size(-1)
        if num_labels == 1:
            return F.mse_loss(logits.view(-1).to(labels.dtype), labels.view(-1))
        if labels.dim() == 1 or labels.size(-1) == 1:
            label_index = (labels >= 0).nonzero()
            labels = labels.long()
            if label_index.size(0) == 0:
                return torch.tensor(0).to(logits)
            kept = torch.gather(logits, 0, label_index.expand(label_index.size(0), logits.size(1)))
            labels = torch.gather(labels, 0, label_index.view(-1))
            return F.cross_entropy(kept.view(-1, num_labels).float(), labels.view(-1))
        return -((F.log_softmax(logits, -1) * labels).sum(-1)).mean()

    @classmethod
    def sequence_logits(cls, logits: torch.Tensor, labels: torch.Tensor, config: DebertaV2Config) -> torch.Tensor:
        # DebertaV2ForSequenceClassification.forward: regression returns logits.view(-1).to(labels.dtype)
        if config.problem_type is None and logits.size(-1) == 1:
            return logits.view(-1).to(labels.dtype)
        return logits

    @classmethod
    def lm_head(cls, config: DebertaV2Config) -> HeadPart:
        if config.legacy:
            return LegacyDebertaV2MLMHead(config)
        if config.embedding_dim != config.hidden_size:
            raise ConfigError(f"config: legacy=false multiplies by the input embeddings, so it needs "
                              f"embedding_size ({config.embedding_dim}) == hidden_size ({config.hidden_size})")
        return DebertaV2MLMHead(config)
