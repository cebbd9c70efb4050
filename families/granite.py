"""Granite (``model_type: granite``): LLaMA with four multipliers, each where transformers applies it: the input
embeddings (the token embeddings or the ``inputs_embeds`` given) times ``embedding_multiplier``, the attention
scores scaled by ``attention_multiplier`` (in place of ``head_dim ** -0.5``), each branch times
``residual_multiplier`` before its residual add, and the LM head's logits divided by ``logits_scaling`` (the loss
taken on these). Heads: causal_lm only (transformers has no other). Everything else is families/llama.py; mirrors
``transformers.models.granite.modeling_granite`` (5.24)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.decoder import KVCache
from flodl_hf.heads.causal_lm import LMHead
from flodl_hf.core.modeling import HeadPart
from flodl_hf.core.registry import register

from .llama import Llama, LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaModel


@dataclass
class GraniteConfig(LlamaConfig):
    model_type: ClassVar[str] = "granite"

    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    # each finite and > 0 (the config table), stricter than transformers: logits_scaling 0 divides the logits by 0,
    # and a multiplier of 0 or below silences or flips what it scales


class GraniteAttention(LlamaAttention):
    def __init__(self, config: GraniteConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scaling = config.attention_multiplier  # GraniteAttention.scaling


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: GraniteConfig, self_attn: nn.Module, mlp: nn.Module,
                 norm_class: type[nn.Module]) -> None:
        super().__init__(config, self_attn, mlp, norm_class)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        # GraniteDecoderLayer.forward: residual + branch * residual_multiplier, for both branches
        attn = self.self_attn(self.input_layernorm(hidden_states), rope, mask, cache)
        hidden_states = hidden_states + attn * self.residual_multiplier
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)) * self.residual_multiplier


class GraniteModel(LlamaModel):
    attention_class = GraniteAttention
    layer_class = GraniteDecoderLayer

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # GraniteModel.forward: inputs_embeds = inputs_embeds * embedding_multiplier, given or looked up
        return super().embed(input_ids, token_type_ids, position_ids, inputs_embeds) * self.config.embedding_multiplier


class ScaledLMHead(LMHead):
    """``lm_head(h) / logits_scaling`` (GraniteForCausalLM.forward)."""

    def __init__(self, hidden_size: int, vocab_size: int, logits_scaling: float) -> None:
        super().__init__(hidden_size, vocab_size)
        self.logits_scaling = logits_scaling

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden_states) / self.logits_scaling


@register
class Granite(Llama):
    model_type = "granite"
    arch = "Granite"
    config_class = GraniteConfig
    backbone_class = GraniteModel
    tasks = ("base", "causal_lm")  # transformers has GraniteForCausalLM only

    @classmethod
    def causal_lm_head(cls, config: GraniteConfig) -> HeadPart:
        return ScaledLMHead(config.hidden_size, config.vocab_size, config.logits_scaling)
