"""Phi (``model_type: phi``: Phi-1, Phi-1.5, Phi-2): LLaMA's decoder (families/llama.py: masks, KV cache, GQA, RoPE,
heads) with Phi's parts: biased ``q_proj`` / ``k_proj`` / ``v_proj`` and ``dense`` out; RoPE on the first
``partial_rotary_factor`` of each head (0.5 by default, read as StableLM reads it: the RoPE dict's, else the top-level
one); ``qk_layernorm`` (one LayerNorm with bias over the head size for all of q's heads, one for k's, after the
transpose); one ``input_layernorm`` per layer and the parallel residual ``resid_dropout(attn(ln(x))) +
resid_dropout(mlp(ln(x))) + x``; the biased ``fc1`` / ``fc2`` MLP with ``hidden_act`` (``gelu_new``); ``embd_pdrop``
on the embeddings (``embed_dropout``); ``final_layernorm``; the LM head ``lm_head`` with a bias (untied by default;
tied, only its weight follows ``embed_tokens``). Heads: causal_lm, seqcls, tokcls (transformers has no other).
Mirrors ``transformers.models.phi.modeling_phi`` (5.25). A ``head_dim`` other than hidden / heads runs as transformers
runs it, except with ``qk_layernorm`` (its norms are hidden / heads wide: transformers fails), which is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.config import Activation
from flodl_hf.core.decoder import KVCache
from flodl_hf.core.errors import ConfigError
from flodl_hf.core.layers import LazyBuffers, activation
from flodl_hf.core.modeling import Backbone, HeadPart
from flodl_hf.core.registry import register

from .gptj import GPTJLMHead
from .llama import Llama, LlamaAttention, LlamaConfig, LlamaModel
from .stablelm import PartialRotary


@dataclass
class PhiConfig(PartialRotary, LlamaConfig):
    model_type: ClassVar[str] = "phi"

    vocab_size: int = 51200
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    resid_pdrop: float = 0.0
    embd_pdrop: float = 0.0
    hidden_act: Activation = Activation.GELU_NEW
    max_position_embeddings: int = 2048
    layer_norm_eps: float = 1e-5
    qk_layernorm: bool = False
    partial_rotary_factor: float | None = 0.5  # PhiConfig.__post_init__'s default, moved into the RoPE dict

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.qk_layernorm and self.attention_head_dim != self.hidden_size // self.num_attention_heads:
            raise ConfigError(f"config field head_dim={self.head_dim!r} with qk_layernorm: PhiAttention's norms are "
                              f"hidden_size // num_attention_heads = {self.hidden_size // self.num_attention_heads} "
                              "wide (transformers fails on it at the first forward)")

    norm_eps = property(lambda self: self.layer_norm_eps)


class PhiAttention(LlamaAttention):
    """``q_proj k_proj v_proj dense`` (all biased), then ``q_layernorm`` / ``k_layernorm`` with ``qk_layernorm``."""

    def make_projections(self, config: PhiConfig, heads: int, kv: int) -> None:
        self.q_proj = nn.Linear(config.hidden_size, heads)
        self.k_proj = nn.Linear(config.hidden_size, kv)
        self.v_proj = nn.Linear(config.hidden_size, kv)
        self.dense = nn.Linear(heads, config.hidden_size)
        if config.qk_layernorm:
            self.q_layernorm = nn.LayerNorm(self.head_dim, eps=config.layer_norm_eps)
            self.k_layernorm = nn.LayerNorm(self.head_dim, eps=config.layer_norm_eps)

    def project(self, hidden_states: torch.Tensor,
                shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # PhiAttention.forward: the norms on the transposed (B, heads, S, d) q and k; handed back untransposed,
        # LLaMA's forward transposes them again (the same tensors)
        q, k, v = self.project_heads(hidden_states, shape)
        if self.config.qk_layernorm:
            q = self.q_layernorm(q.transpose(1, 2)).transpose(1, 2)
            k = self.k_layernorm(k.transpose(1, 2)).transpose(1, 2)
        return q, k, v

    def project_out(self, attn_output: torch.Tensor) -> torch.Tensor:
        return self.dense(attn_output)


class PhiMLP(nn.Module):
    def __init__(self, config: PhiConfig) -> None:
        super().__init__()
        self.activation_fn = activation(config.hidden_act)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(hidden_states)))


class PhiDecoderLayer(nn.Module):
    """PhiDecoderLayer: ``input_layernorm`` once, attention and MLP both on it, each through ``resid_dropout``."""

    def __init__(self, config: PhiConfig, self_attn: nn.Module, mlp: nn.Module, norm_class: type[nn.Module]) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm_class(config.hidden_size, eps=config.layer_norm_eps)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        attn = self.resid_dropout(self.self_attn(normed, rope, mask, cache))
        # PhiDecoderLayer.forward: (attn + mlp) + residual, the attention's dropout mask drawn first
        return attn + self.resid_dropout(self.mlp(normed)) + hidden_states


class PhiModel(LlamaModel):
    """``embed_tokens``, ``layers``, ``embed_dropout``, ``final_layernorm`` (PhiModel.__init__'s order); LLaMA's
    forward, RoPE, masks and cache."""

    attention_class = PhiAttention
    layer_class = PhiDecoderLayer
    norm_class = nn.LayerNorm

    def __init__(self, config: PhiConfig, add_pooling_layer: bool = False) -> None:
        Backbone.__init__(self, config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(self.layer_class(config, self.attention_class(config, i), self.make_mlp(config),
                                                     self.norm_class) for i in range(config.num_hidden_layers))
        self.embed_dropout = nn.Dropout(config.embd_pdrop)
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.inverse_frequencies = LazyBuffers(self._make_inverse_frequencies, self.rope_keys())

    norm = property(lambda self: self.final_layernorm)  # LLaMA's encode closes with self.norm

    @classmethod
    def make_mlp(cls, config: PhiConfig) -> nn.Module:
        return PhiMLP(config)

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # PhiModel.forward: embed_dropout on the embeddings, looked up or given
        return self.embed_dropout(super().embed(input_ids, token_type_ids, position_ids, inputs_embeds))

@register
class Phi(Llama):
    model_type = "phi"
    arch = "Phi"
    config_class = PhiConfig
    backbone_class = PhiModel
    tasks = ("base", "causal_lm", "seqcls", "tokcls")  # transformers has no Phi QA head

    @classmethod
    def causal_lm_head(cls, config: PhiConfig) -> HeadPart:
        return GPTJLMHead(config.hidden_size, config.vocab_size)  # PhiForCausalLM's lm_head has a bias
