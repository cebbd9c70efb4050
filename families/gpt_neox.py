"""GPT-NeoX (``model_type: gpt_neox``: Pythia, GPT-NeoX-20B...): LLaMA's decoder (families/llama.py: its masks, KV
cache, attention paths and heads) with LayerNorm (``input_layernorm``, ``post_attention_layernorm``,
``final_layer_norm``, ``layer_norm_eps``), q, k and v from one ``query_key_value`` laid out per head (viewed to
heads x 3 * head_size, then chunked), ``dense`` out (both with ``attention_bias``), the biased ``dense_h_to_4h`` /
``dense_4h_to_h`` MLP with ``hidden_act``, RoPE on the first ``partial_rotary_factor`` of each head, dropouts
(``hidden_dropout`` on the embeddings and on each branch, ``attention_dropout``), and the parallel residual
``x + attn(ln1(x)) + mlp(ln2(x))`` (``use_parallel_residual``; the sequential form when false). The backbone sits
under ``gpt_neox.`` (``embed_in``); the LM head is ``lm_head``, stored as ``embed_out.weight`` (transformers'
conversion mapping, both ways), untied by default. Old checkpoints' ``attention.bias`` / ``attention.masked_bias`` /
``attention.rotary_emb.inv_freq`` buffers are skipped, as transformers drops them.

Mirrors ``transformers.models.gpt_neox.modeling_gpt_neox`` (5.24); config names as ``GPTNeoXConfig``: RoPE from
``rope_scaling`` or ``rope_parameters``, else ``rotary_emb_base`` (10000) and ``rotary_pct`` (0.25), as its
``convert_rope_params_to_dict`` (a top-level ``rope_theta`` or ``partial_rotary_factor`` is ignored there, and here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from flodl_hf.core.config import Activation, BaseConfig
from flodl_hf.core.decoder import ROPE_TYPES, KVCache, Rope, _number
from flodl_hf.heads import TokenClassifier
from flodl_hf.heads.causal_lm import ModelForCausalLM
from flodl_hf.core.layers import LazyBuffers, activation
from flodl_hf.core.modeling import Backbone, HeadPart, positional_order
from flodl_hf.core.registry import register

from .gpt2 import GPT2ForQuestionAnswering, GPT2ForTokenClassification
from .llama import (FULL, DecoderForSequenceClassification, Llama, LlamaAttention, LlamaModel,
                    check_heads_from_hidden)


@dataclass
class GPTNeoXConfig(BaseConfig):
    model_type: ClassVar[str] = "gpt_neox"
    enum_fields: ClassVar[dict[str, type]] = {"hidden_act": Activation}
    rope_types: ClassVar[tuple[str, ...]] = ROPE_TYPES
    returns_given_cache: ClassVar[bool] = True  # as its transformers *Model.forward

    vocab_size: int = 50432
    hidden_size: int = 6144
    num_hidden_layers: int = 44
    num_attention_heads: int = 64
    intermediate_size: int = 24576
    hidden_act: Activation = Activation.GELU
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    classifier_dropout: float = 0.1
    max_position_embeddings: int = 2048
    layer_norm_eps: float = 1e-5
    use_cache: bool = True
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    use_parallel_residual: bool = True
    attention_bias: bool = True
    rope_parameters: dict[str, Any] | None = None
    rope_scaling: dict[str, Any] | None = None  # the older spelling, which wins (convert_rope_params_to_dict)
    rotary_pct: float | None = None  # read into the RoPE dict's partial_rotary_factor when it has none
    rotary_emb_base: float | None = None  # likewise its rope_theta

    def __post_init__(self) -> None:
        super().__post_init__()
        _ = self.rotary_dim  # a bad partial factor fails at load, naming itself
        self.rope()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GPTNeoXConfig":
        config = super().from_dict(data)
        check_heads_from_hidden(data, config, "GPT-NeoX")
        return config

    # what LLaMA's shared parts read
    kv_heads = property(lambda self: self.num_attention_heads)
    attention_head_dim = property(lambda self: self.hidden_size // self.num_attention_heads)

    @property
    def _rope_dict(self) -> tuple[dict, str]:
        given = self.rope_scaling or self.rope_parameters
        return (given if isinstance(given, dict) else {}), ("rope_scaling" if self.rope_scaling else "rope_parameters")

    @property
    def partial_rotary_factor(self) -> float:
        """GPTNeoXConfig.convert_rope_params_to_dict: the RoPE dict's, else ``rotary_pct``, else 0.25."""
        params, source = self._rope_dict
        if "partial_rotary_factor" in params:
            return _number(params["partial_rotary_factor"], f"{source}.partial_rotary_factor")
        return 0.25 if self.rotary_pct is None else _number(self.rotary_pct, "rotary_pct")

    @property
    def rotary_dim(self) -> int:
        return int(self.attention_head_dim * self.partial_rotary_factor)  # GPTNeoXAttention.rotary_ndims

    def rope(self, key: str | None = None) -> Rope:
        """The dict's ``rope_theta``, else ``rotary_emb_base``, else 10000 (transformers' default_theta)."""
        return Rope.resolve(self.rope_parameters, self.rope_scaling, self.rotary_emb_base, 10_000.0,
                            self.max_position_embeddings, self.raw.get("original_max_position_embeddings"),
                            self.rope_types)

    def layer_kinds(self) -> list[str]:
        return [FULL] * self.num_hidden_layers

    def window(self, kind: str) -> int | None:
        return None

    def rope_key(self, kind: str) -> str | None:
        return None


class GPTNeoXAttention(LlamaAttention):
    """``query_key_value`` viewed per head, then q, k, v chunked from each head's 3 * head_size; ``dense`` out."""

    def make_projections(self, config: GPTNeoXConfig, heads: int, kv: int) -> None:
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)

    def project_heads(self, hidden_states: torch.Tensor,
                      shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # GPTNeoXAttention.forward: view(*input_shape, -1, 3 * head_size), then chunk(3, dim=-1) (LLaMA's forward
        # transposes each chunk: the same views as transformers' transpose-then-chunk)
        qkv = self.query_key_value(hidden_states).view(*shape[:-1], 3 * self.head_dim)
        return qkv.chunk(3, dim=-1)

    def project_out(self, attn_output: torch.Tensor) -> torch.Tensor:
        return self.dense(attn_output)


class GPTNeoXMLP(nn.Module):
    def __init__(self, config: GPTNeoXConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(hidden_states)))


class GPTNeoXLayer(nn.Module):
    """GPTNeoXLayer: its modules in its order; the parallel or the sequential residual."""

    def __init__(self, config: GPTNeoXConfig, attention: nn.Module, mlp: nn.Module,
                 norm_class: type[nn.Module]) -> None:
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = norm_class(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = norm_class(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_dropout = nn.Dropout(config.hidden_dropout)
        self.post_mlp_dropout = nn.Dropout(config.hidden_dropout)
        self.attention = attention
        self.mlp = mlp

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        attn = self.post_attention_dropout(self.attention(self.input_layernorm(hidden_states), rope, mask, cache))
        if self.use_parallel_residual:  # (mlp + attn) + x, in transformers' order
            mlp = self.post_mlp_dropout(self.mlp(self.post_attention_layernorm(hidden_states)))
            return mlp + attn + hidden_states
        attn = attn + hidden_states
        return self.post_mlp_dropout(self.mlp(self.post_attention_layernorm(attn))) + attn


# GPTNeoXModel.forward's positional order (inputs_embeds before cache)
@positional_order("input_ids", "attention_mask", "position_ids", "inputs_embeds", "cache", "use_cache")
class GPTNeoXModel(LlamaModel):
    """``embed_in``, ``emb_dropout``, ``layers``, ``final_layer_norm``; LLaMA's forward, RoPE, masks and cache."""

    exits_early = False  # its transformers forward runs every layer, whatever num_hidden_layers says
    attention_class = GPTNeoXAttention
    layer_class = GPTNeoXLayer
    norm_class = nn.LayerNorm

    def __init__(self, config: GPTNeoXConfig, add_pooling_layer: bool = False) -> None:
        Backbone.__init__(self, config)  # GPTNeoXModel.__init__'s modules, in its order
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)  # no padding_idx
        self.emb_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(self.layer_class(config, self.attention_class(config, i), self.make_mlp(config),
                                                     self.norm_class) for i in range(config.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.inverse_frequencies = LazyBuffers(self._make_inverse_frequencies, self.rope_keys())

    norm = property(lambda self: self.final_layer_norm)  # LLaMA's encode closes with self.norm

    @classmethod
    def make_mlp(cls, config: GPTNeoXConfig) -> nn.Module:
        return GPTNeoXMLP(config)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_in

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.emb_dropout(self.embed_in(input_ids) if inputs_embeds is None else inputs_embeds)


# ---- task models: transformers' GPT-NeoX positional orders over LLaMA's (and GPT-2's) heads -------------------

@positional_order("input_ids", "attention_mask", "position_ids", "inputs_embeds", "cache", "labels", "use_cache",
                  "logits_to_keep")
class GPTNeoXForCausalLM(ModelForCausalLM):
    pass


@positional_order("input_ids", "attention_mask", "position_ids", "inputs_embeds", "cache", "labels", "use_cache")
class GPTNeoXForSequenceClassification(DecoderForSequenceClassification):
    pass


class GPTNeoXForTokenClassification(GPT2ForTokenClassification):
    """GPT-2's positional order (input_ids, cache, attention_mask, token_type_ids, ...), which GPT-NeoX's class
    shares; token types are refused, as by every RoPE decoder here (transformers' class takes and drops them)."""


class GPTNeoXForQuestionAnswering(GPT2ForQuestionAnswering):
    """GPT-2's positional order (input_ids, attention_mask, token_type_ids, ...), shared; token types refused."""


@register
class GPTNeoX(Llama):
    model_type = "gpt_neox"
    arch = "GPTNeoX"
    prefix = "gpt_neox"
    config_class = GPTNeoXConfig
    backbone_class = GPTNeoXModel
    task_models = {"causal_lm": GPTNeoXForCausalLM, "seqcls": GPTNeoXForSequenceClassification,
                   "tokcls": GPTNeoXForTokenClassification, "qa": GPTNeoXForQuestionAnswering}
    # only GPTNeoXForCausalLM's loss is self.loss_function(..., **kwargs); its QA head computes its own
    num_items_tasks = frozenset({"causal_lm"})
    # the module is lm_head, its key in a file embed_out.weight: transformers' conversion mapping renames it so on
    # load and back on save_pretrained, and so do load and export here
    key_renames = (("embed_out.weight", "lm_head.weight"),)
    # the old per-layer buffers some checkpoints carry, which transformers drops
    ignored_keys = (r"(^|\.)attention\.(bias|masked_bias|rotary_emb\.inv_freq)$",)

    @classmethod
    def token_head(cls, config: GPTNeoXConfig) -> HeadPart:
        # GPTNeoXForTokenClassification: classifier(Dropout(classifier_dropout)(h)), with a bias
        return TokenClassifier(config.hidden_size, config.num_labels, config.classifier_dropout)
