"""OPT (``model_type: opt``: facebook/opt-125m ... opt-66b): LLaMA's decoder (families/llama.py: its masks, KV cache,
attention paths and heads) with learned absolute positions counted along the attention mask (``embed_positions``:
a table of ``max_position_embeddings + 2`` rows read at ``position + 2``; a padded token sits at -1, so row 1), no
RoPE, LayerNorm before each branch (``do_layer_norm_before``, with a ``final_layer_norm`` closing the stack) or after
each residual add (opt-350m: post-LN, no final norm), q scaled by ``head_dim ** -0.5`` after ``q_proj`` (the
attention then runs at scale 1), ``q_proj k_proj v_proj out_proj`` and the ReLU ``fc1``/``fc2`` MLP, all with
``enable_bias``, LayerNorms without parameters when ``layer_norm_elementwise_affine`` is false, ``dropout`` after each
branch (none on the embeddings), ``attention_dropout``, ``layerdrop`` (a layer skipped in training), and a
``word_embed_proj_dim`` narrower than the layers (opt-350m: ``project_in`` after the token embeddings,
``project_out`` after the stack; the heads read the projected width). The backbone is ``decoder.`` under ``model.``;
``lm_head`` is tied to ``embed_tokens``. Heads: causal_lm, seqcls and qa (transformers has no other).

Mirrors ``transformers.models.opt.modeling_opt`` (5.25); config names and defaults as ``OPTConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.config import Activation, BaseConfig
from flodl_hf.core.decoder import KVCache
from flodl_hf.heads.causal_lm import ModelForCausalLM
from flodl_hf.core.layers import activation
from flodl_hf.core.modeling import Backbone, positional_order
from flodl_hf.core.registry import register

from .llama import (FULL, DecoderForQuestionAnswering, DecoderForSequenceClassification, Llama, LlamaAttention,
                    LlamaModel)


@dataclass
class OPTConfig(BaseConfig):
    model_type: ClassVar[str] = "opt"
    enum_fields: ClassVar[dict[str, type]] = {"activation_function": Activation}
    returns_given_cache: ClassVar[bool] = True  # as its transformers *Model.forward

    vocab_size: int = 50272
    hidden_size: int = 768
    num_hidden_layers: int = 12
    ffn_dim: int = 3072
    max_position_embeddings: int = 2048
    do_layer_norm_before: bool = True
    _remove_final_layer_norm: bool = False
    word_embed_proj_dim: int | None = None  # None: hidden_size (OPTConfig.__post_init__), read as embed_dim
    dropout: float = 0.1
    attention_dropout: float = 0.0
    num_attention_heads: int = 12
    activation_function: Activation = Activation.RELU
    layerdrop: float = 0.0
    init_std: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = 1
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 2
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    tie_word_embeddings: bool = True

    @property
    def embed_dim(self) -> int:
        """The token embeddings' and the heads' width: ``word_embed_proj_dim``, else ``hidden_size``."""
        return self.word_embed_proj_dim if self.word_embed_proj_dim is not None else self.hidden_size

    # what LLaMA's shared parts read
    kv_heads = property(lambda self: self.num_attention_heads)
    attention_head_dim = property(lambda self: self.hidden_size // self.num_attention_heads)

    def layer_kinds(self) -> list[str]:
        return [FULL] * self.num_hidden_layers

    def window(self, kind: str) -> int | None:
        return None

    def rope_key(self, kind: str) -> str | None:
        return None


def layer_norm(config: OPTConfig) -> nn.LayerNorm:
    """OPT's LayerNorms: torch's default epsilon, parameters unless ``layer_norm_elementwise_affine`` is false."""
    return nn.LayerNorm(config.hidden_size, elementwise_affine=config.layer_norm_elementwise_affine)


class OPTAttention(LlamaAttention):
    """``k_proj v_proj q_proj out_proj`` (transformers' order), q times ``head_dim ** -0.5`` right after ``q_proj``,
    the attention at scale 1 (OPTAttention.forward hands ``scaling=1.0`` to the attention interface)."""

    def __init__(self, config: OPTConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_scaling = self.head_dim ** -0.5
        self.scaling = 1.0

    def make_projections(self, config: OPTConfig, heads: int, kv: int) -> None:
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.enable_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.enable_bias)
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.enable_bias)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.enable_bias)

    def project_heads(self, hidden_states: torch.Tensor,
                      shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # OPTAttention.forward: q_proj(h) * scaling, before the per-head view
        q = self.q_proj(hidden_states) * self.q_scaling
        return q.view(shape), self.k_proj(hidden_states).view(shape), self.v_proj(hidden_states).view(shape)

    def project_out(self, attn_output: torch.Tensor) -> torch.Tensor:
        return self.out_proj(attn_output)


class OPTDecoderLayer(nn.Module):
    """OPTDecoderLayer: its modules in its order; LayerNorm before each branch (``do_layer_norm_before``) or after
    each residual add; ``dropout`` on each branch; the MLP on the tokens flattened to (B * S, hidden), as
    transformers runs it. ``layerdrop`` is drawn outside it, by the backbone (``OPTModel.drops_layer``), as
    OPTDecoder.forward draws it before each layer."""

    def __init__(self, config: OPTConfig, self_attn: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.do_layer_norm_before = config.do_layer_norm_before
        self.dropout = config.dropout
        self.activation_fn = activation(config.activation_function)
        self.self_attn_layer_norm = layer_norm(config)
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = nn.Linear(config.ffn_dim, config.hidden_size, bias=config.enable_bias)
        self.final_layer_norm = layer_norm(config)

    def forward(self, hidden_states: torch.Tensor, rope: None, mask: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        pre = self.do_layer_norm_before
        residual = hidden_states
        attn = self.self_attn(self.self_attn_layer_norm(hidden_states) if pre else hidden_states, rope, mask, cache)
        hidden_states = residual + F.dropout(attn, p=self.dropout, training=self.training)
        if not pre:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        # OPTDecoderLayer.forward: the MLP on (B * S, hidden), the residual added there, then viewed back
        shape = hidden_states.shape
        residual = hidden_states = hidden_states.reshape(-1, hidden_states.size(-1))
        if pre:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(self.activation_fn(self.fc1(hidden_states)))
        hidden_states = (residual + F.dropout(hidden_states, p=self.dropout, training=self.training)).view(shape)
        return hidden_states if pre else self.final_layer_norm(hidden_states)


class OPTLearnedPositionalEmbedding(nn.Embedding):
    """The position table, ``max_position_embeddings + 2`` rows, read at ``position_ids + 2``."""

    offset = 2

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings + self.offset, embedding_dim)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(position_ids + self.offset)


class OPTDecoder(nn.Module):
    """OPTDecoder's modules, in its order: ``embed_tokens``, ``embed_positions``, ``project_out``, ``project_in``
    (both only with a ``word_embed_proj_dim`` other than ``hidden_size``), ``final_layer_norm`` (pre-LN only, unless
    ``_remove_final_layer_norm``), ``layers``."""

    def __init__(self, config: OPTConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.embed_dim, config.pad_token_id)
        self.embed_positions = OPTLearnedPositionalEmbedding(config.max_position_embeddings, config.hidden_size)
        projected = config.embed_dim != config.hidden_size
        self.project_out = nn.Linear(config.hidden_size, config.embed_dim, bias=False) if projected else None
        self.project_in = nn.Linear(config.embed_dim, config.hidden_size, bias=False) if projected else None
        self.final_layer_norm = (layer_norm(config) if config.do_layer_norm_before
                                 and not config._remove_final_layer_norm else None)
        self.layers = nn.ModuleList(layers)

    def close(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """After the layers: ``final_layer_norm``, then ``project_out``, each where there is one."""
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states if self.project_out is None else self.project_out(hidden_states)


# OPTModel.forward's positional order (cache third, position_ids last)
@positional_order("input_ids", "attention_mask", "cache", "inputs_embeds", "use_cache", "position_ids")
class OPTModel(LlamaModel):
    """``decoder`` (OPTModel's one child); LLaMA's forward, masks and cache, positions from the attention mask."""

    exits_early = False  # its transformers forward runs every layer, whatever num_hidden_layers says
    attention_class = OPTAttention
    layer_class = OPTDecoderLayer
    norm_class = nn.LayerNorm

    def __init__(self, config: OPTConfig, add_pooling_layer: bool = False) -> None:
        Backbone.__init__(self, config)  # OPTModel.__init__'s modules, not LLaMA's
        self.decoder = OPTDecoder(config, [self.layer_class(config, self.attention_class(config, i))
                                           for i in range(config.num_hidden_layers)])

    # LLaMA's encode runs self.layers and closes with self.norm
    layers = property(lambda self: self.decoder.layers)
    norm = property(lambda self: self.decoder.close)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.decoder.embed_tokens

    def drops_layer(self) -> bool:
        # OPTDecoder.forward: in training, a torch.rand([]) before each layer skips it below layerdrop
        layerdrop = self.config.layerdrop
        return self.training and layerdrop > 0.0 and bool(torch.rand([]) < layerdrop)

    def rotary_embeddings(self, keys: list[str | None], position_ids: torch.Tensor,
                          hidden: torch.Tensor) -> dict[str | None, None]:
        return {None: None}

    def default_positions(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None,
                          past: int) -> torch.Tensor:
        # OPTDecoder.forward: cumsum of the mask (all ones over the past and this step without one), times the mask,
        # minus 1 (a padded token: -1), this step's columns
        if attention_mask is None:
            attention_mask = torch.ones(inputs.shape[0], past + inputs.shape[1], device=inputs.device)
        positions = torch.cumsum(attention_mask, dim=1)
        return (positions * attention_mask - 1).long()[:, past:]

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # OPTDecoder.forward: project_in(embed_tokens(ids)) + embed_positions(positions); no dropout
        decoder = self.decoder
        if inputs_embeds is None:
            inputs_embeds = decoder.embed_tokens(input_ids)
        positions = decoder.embed_positions(position_ids)
        if decoder.project_in is not None:
            inputs_embeds = decoder.project_in(inputs_embeds)
        return inputs_embeds + positions.to(inputs_embeds.device)


# ---- task models: transformers' OPT positional orders over LLaMA's heads -------------------------------------

@positional_order("input_ids", "attention_mask", "cache", "inputs_embeds", "labels", "use_cache", "position_ids",
                  "logits_to_keep")
class OPTForCausalLM(ModelForCausalLM):
    pass


@positional_order("input_ids", "attention_mask", "cache", "inputs_embeds", "labels", "use_cache", "position_ids")
class OPTForSequenceClassification(DecoderForSequenceClassification):
    pass


@positional_order("input_ids", "attention_mask", "cache", "inputs_embeds", "start_positions", "end_positions",
                  "use_cache", "position_ids")
class OPTForQuestionAnswering(DecoderForQuestionAnswering):
    """The backbone under ``model.`` (OPTForQuestionAnswering's), not LLaMA's QA ``transformer.``."""


@register
class OPT(Llama):
    model_type = "opt"
    arch = "OPT"
    prefix = "model"
    config_class = OPTConfig
    backbone_class = OPTModel
    tasks = ("base", "causal_lm", "seqcls", "qa")  # transformers has no OPTForTokenClassification
    task_models = {"causal_lm": OPTForCausalLM, "seqcls": OPTForSequenceClassification, "qa": OPTForQuestionAnswering}
    # only OPTForCausalLM's loss is self.loss_function(..., **kwargs); its QA head computes its own
    num_items_tasks = frozenset({"causal_lm"})

    @classmethod
    def max_sequence_length(cls, config: OPTConfig) -> int | None:
        return config.max_position_embeddings  # the embed_positions table, less its offset

    @classmethod
    def head_width(cls, config: OPTConfig) -> int:
        return config.embed_dim  # the heads read the projected width (word_embed_proj_dim)
