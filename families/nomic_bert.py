"""Nomic BERT (``model_type: nomic_bert``: nomic-ai/nomic-embed-text-v1 / v1.5): a post-norm BERT encoder with RoPE
instead of a position table, bias-free ``q_proj k_proj v_proj o_proj`` and a SwiGLU MLP.

Mirrors ``transformers.models.nomic_bert.modeling_nomic_bert`` (5.25), whose parts are JinaEmbeddingsV3's:
- embeddings are ``LayerNorm((word + token_type))`` then dropout: no positions (RoPE turns q and k instead);
- each layer is post-norm: ``post_attention_layernorm(h + dropout(self_attn(h)))`` then
  ``post_mlp_layernorm(h + dropout(mlp(h)))``; the attention is LLaMA's projections and RoPE (``head_dim`` given, or
  hidden / heads) with BERT's attention functions (eager: the softmax in the scores' dtype; sdpa, never causal);
  the MLP is ``down_proj(act(gate_proj(h)) * up_proj(h))`` (GemmaMLP, ``hidden_act`` silu by default);
- RoPE as LlamaRotaryEmbedding, with its scalings (linear, dynamic, yarn, llama3), read from ``rope_parameters`` or
  the older ``rope_scaling`` + ``rope_theta`` (default theta 1000), through LLaMA's own RoPE code;
- heads: ``pooler`` + ``classifier`` (seqcls: the pooler only there, ``add_pooling_layer`` is False elsewhere),
  ``classifier`` per token (tokcls), BERT's ``cls.predictions`` with its norm named ``layer_norm`` (mlm).

Files are written in the original layout: transformers' conversion mapping (``conversion_mapping.py``: the
``nomic_bert`` entry) renames ``emb_ln``, ``encoder.layers``, ``attn.out_proj``, ``fc11 fc12 fc2``, ``norm1 norm2``
and splits the fused ``attn.Wqkv`` at load, and its save_pretrained writes them back: ``NomicBert.file_layout``
(keys.FileLayout) declares that, the key map applies it both ways (GTE, families/gte.py, declares its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from flodl_hf.core.config import Activation, BaseConfig
from flodl_hf.core.decoder import ROPE_TYPES, Rope, SwiGLU
from flodl_hf.core.errors import ConfigError
from flodl_hf.families.bert import BertLMPredictionHead, BertMLMHead, BertPooler, BertPredictionHeadTransform
from flodl_hf.families.llama import LlamaAttention, LlamaModel
from flodl_hf.core.keys import FileLayout
from flodl_hf.core.layers import LazyBuffers, activation, attend
from flodl_hf.core.modeling import Backbone, HeadPart, PreTrainedModel
from flodl_hf.core.registry import Family, register


# ---- config ----------------------------------------------------------------------------------------------

@dataclass
class NomicBertConfig(BaseConfig):
    model_type: ClassVar[str] = "nomic_bert"
    enum_fields: ClassVar[dict[str, type]] = {"hidden_act": Activation}
    default_theta: ClassVar[float] = 1000.0  # NomicBertConfig.default_theta
    # NomicBertConfig.__post_init__ writes head_dim (hidden / heads when absent); GteConfig has no such field
    sets_head_dim: ClassVar[bool] = True
    # an Embedding of type_vocab_size rows is always built (GTE builds none for 0)
    token_types_optional: ClassVar[bool] = False

    vocab_size: int = 30528
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: Activation = Activation.SILU
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    max_position_embeddings: int = 2048
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    rope_parameters: dict[str, Any] | None = None
    head_dim: int | None = None
    # the older spelling, read when rope_parameters is absent (PreTrainedConfig.convert_rope_params_to_dict)
    rope_scaling: dict[str, Any] | None = None
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim is None and self.sets_head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim is not None and (self.head_dim < 1 or self.head_dim % 2):
            # rotate_half and the cos/sin tables need an even head (transformers fails at the first forward)
            raise ConfigError(f"config ({self.model_type}): field head_dim={self.head_dim} must be even and > 0 "
                              "(RoPE turns pairs of dimensions)")
        if self.type_vocab_size < 1 and not self.token_types_optional:
            raise ConfigError(f"config ({self.model_type}): field type_vocab_size={self.type_vocab_size}: "
                              f"{type(self).__name__} embeds token types (type 0 by default), so it needs at least 1")
        self.rope()  # a bad rope field fails at load, naming itself

    # derived, not written back
    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return self.attention_head_dim

    def biases(self) -> tuple[bool, bool, bool]:
        """(q/k/v, o_proj, MLP) biases: none (NomicBertAttention, GemmaMLP)."""
        return False, False, False

    def rope(self, key: str | None = None) -> Rope:
        """The one RoPE (LlamaRotaryEmbedding's types; longrope and others are a ConfigError naming the field)."""
        return Rope.resolve(self.rope_parameters, self.rope_scaling, self.rope_theta, self.default_theta,
                            self.max_position_embeddings, self.raw.get("original_max_position_embeddings"),
                            ROPE_TYPES)


# ---- backbone --------------------------------------------------------------------------------------------

class NomicBertEmbeddings(nn.Module):
    """``dropout(LayerNorm(word + token_type))`` (JinaEmbeddingsV3Embeddings.forward); no token types at all where
    ``type_vocab_size`` is 0 (GTE only)."""

    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = (nn.Embedding(config.type_vocab_size, config.hidden_size)
                                      if config.type_vocab_size else None)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None,
                inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(embeddings.shape[:-1], dtype=torch.long, device=embeddings.device)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(embeddings))


class NomicBertAttention(LlamaAttention):
    """LLaMA's ``q_proj k_proj v_proj o_proj`` and RoPE (biases from ``config.biases()``), attending as
    JinaEmbeddingsV3Attention does: BERT's eager function (scores * scale + mask, softmax in their dtype) or sdpa,
    never causal."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        p = self.config.attention_probs_dropout_prob if self.training else 0.0
        return attend(q, k, v, mask, self.config.attn_implementation, p, self.scaling)


class NomicBertLayer(nn.Module):
    """Post-norm: ``post_attention_layernorm(h + dropout(self_attn(h)))``, then ``post_mlp_layernorm(h +
    dropout(mlp(h)))``, modules registered in JinaEmbeddingsV3Layer's order."""

    attention_class: ClassVar[type[nn.Module]] = NomicBertAttention

    def __init__(self, config: NomicBertConfig, mlp: nn.Module, layer_idx: int) -> None:
        super().__init__()
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.post_mlp_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.mlp = mlp
        self.self_attn = self.attention_class(config, layer_idx)
        self.post_mlp_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None) -> torch.Tensor:
        # JinaEmbeddingsV3Layer.forward: residual + dropout(sub-layer), then the norm
        attended = hidden_states + self.post_attention_dropout(self.self_attn(hidden_states, rope, mask, None))
        hidden_states = self.post_attention_layernorm(attended)
        return self.post_mlp_layernorm(hidden_states + self.post_mlp_dropout(self.mlp(hidden_states)))


class NomicBertModel(Backbone):
    """``last_hidden_state`` after the last layer (no final norm) and, with ``add_pooling_layer``, ``pooler_output``
    (BERT's pooler, registered before the layers, as NomicBertModel registers it)."""

    embeddings_class: ClassVar[type[nn.Module]] = NomicBertEmbeddings
    layer_class: ClassVar[type[nn.Module]] = NomicBertLayer

    # RoPE exactly as LLaMA's backbone computes it (NomicBertRotaryEmbedding is LlamaRotaryEmbedding): the inverse
    # frequencies per config.rope(), dynamic_rope_update's recomputation, cos/sin with the attention scaling
    _make_inverse_frequencies = LlamaModel._make_inverse_frequencies
    rotary = LlamaModel.rotary
    rope_frequencies = LlamaModel.rope_frequencies
    _dynamic_frequencies = LlamaModel._dynamic_frequencies

    def __init__(self, config: NomicBertConfig, add_pooling_layer: bool = False) -> None:
        super().__init__(config)
        self.embeddings = self.embeddings_class(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.layers = nn.ModuleList(self.layer_class(config, self.make_mlp(config), i)
                                    for i in range(config.num_hidden_layers))
        self.inverse_frequencies = LazyBuffers(self._make_inverse_frequencies)

    @classmethod
    def make_mlp(cls, config: NomicBertConfig) -> nn.Module:
        """GemmaMLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``, no biases."""
        return SwiGLU(config.hidden_size, config.intermediate_size, activation(config.hidden_act))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.embeddings(input_ids, token_type_ids, inputs_embeds)

    def encode(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:  # NomicBertModel.forward: arange(S)[None, :]
            position_ids = torch.arange(hidden.shape[1], dtype=torch.long, device=hidden.device)[None, :]
        rope = self.rotary(None, position_ids, hidden)  # one (cos, sin) for every layer
        for layer, mask in zip(self.layers, self.layer_masks(attention_mask, hidden), strict=True):
            hidden = layer(hidden, rope, mask)
        return hidden

    def pool(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.pooler(hidden) if self.pooler is not None else None


# ---- heads ----------------------------------------------------------------------------------------------

class NomicBertPredictionHeadTransform(BertPredictionHeadTransform):
    """BERT's ``layer_norm(act(dense(h)))``, its norm named ``layer_norm`` (NomicBertPredictionHeadTransform)."""

    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__(config)
        self.layer_norm = self.LayerNorm
        del self.LayerNorm

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(self.transform_act_fn(self.dense(hidden_states)))


class NomicBertLMPredictionHead(BertLMPredictionHead):
    """BERT's: ``decoder(transform(h))``, ``bias`` tied to ``decoder.bias`` (untied with the embeddings)."""

    def __init__(self, config: NomicBertConfig) -> None:
        nn.Module.__init__(self)
        self.transform = NomicBertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = self.decoder.bias if config.tie_word_embeddings else nn.Parameter(torch.zeros(config.vocab_size))


class NomicBertOnlyMLMHead(nn.Module):
    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        self.predictions = NomicBertLMPredictionHead(config)


class NomicBertMLMHead(BertMLMHead):
    """Mounts ``cls.predictions.*`` at the root of the masked-LM model."""

    def __init__(self, config: NomicBertConfig) -> None:
        HeadPart.__init__(self)
        self.cls = NomicBertOnlyMLMHead(config)


# ---- family ---------------------------------------------------------------------------------------------

@register
class NomicBert(Family):
    model_type = "nomic_bert"
    arch = "NomicBert"
    prefix = "nomic_bert"
    config_class = NomicBertConfig
    backbone_class = NomicBertModel
    tasks = ("base", "seqcls", "tokcls", "mlm")  # transformers has no QA or multiple choice for it
    float_position_ids = True  # RoPE: position_ids[..., None].float()
    ignored_keys = (r"inv_freq$",)  # _keys_to_ignore_on_load_unexpected: inv_freq, original_inv_freq
    # transformers' "legacy" renaming, which its loader applies to every model (after the layout's renames here,
    # so emb_ln.gamma loads too, as in transformers)
    legacy_suffixes = (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias"))
    file_layout = FileLayout(
        renames=(("encoder.layers", "layers"), ("emb_ln", "embeddings.LayerNorm"),
                 ("attn.out_proj", "self_attn.o_proj"), ("fc11", "up_proj"), ("fc12", "gate_proj"), ("fc2", "down_proj"),
                 ("norm1", "post_attention_layernorm"), ("norm2", "post_mlp_layernorm")),
        fused=(("attn.Wqkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),))

    @classmethod
    def build(cls, config: BaseConfig, task: str = "base", add_pooling_layer: bool = True) -> PreTrainedModel:
        # NomicBertModel(config) has add_pooling_layer=False: AutoModel builds no pooler (a sequence classifier's
        # file loads into it with the pooler unused, as transformers reports it)
        return super().build(config, task, add_pooling_layer=False if task == "base" else add_pooling_layer)

    @classmethod
    def max_sequence_length(cls, config: NomicBertConfig) -> int | None:
        return None  # RoPE, no position table: transformers runs inputs past max_position_embeddings

    @classmethod
    def lm_head(cls, config: NomicBertConfig) -> HeadPart:
        return NomicBertMLMHead(config)
