"""Gemma 2 (``model_type: gemma2``): Gemma (scaled embeddings, ``(1 + weight)`` RMSNorm, explicit ``head_dim``,
tied) with four norms per layer (``post_attention_layernorm`` closes the attention branch,
``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` wrap the MLP), scores scaled by
``query_pre_attn_scalar ** -0.5`` and softcapped (``tanh(s / cap) * cap``, ``attn_logit_softcapping``), the LM
head's logits softcapped likewise (``final_logit_softcapping``), sliding and full layers by ``layer_types``
(every other layer sliding by default), and the MLP's activation read from ``hidden_activation``. transformers
5.24 has no sdpa path for it (``_supports_sdpa = False``: it refuses ``attn_implementation="sdpa"``), so the
family declares eager only. Everything else is families/gemma.py and families/llama.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.config import Activation
from flodl_hf.core.decoder import KVCache, SwiGLU
from flodl_hf.heads.causal_lm import LMHead
from flodl_hf.core.layers import activation
from flodl_hf.core.modeling import HeadPart
from flodl_hf.core.registry import register

from .gemma import Gemma, GemmaConfig, GemmaModel
from .llama import FULL, SLIDING, LlamaAttention, LlamaConfig, LlamaDecoderLayer


@dataclass
class Gemma2Config(GemmaConfig):
    model_type: ClassVar[str] = "gemma2"
    returns_given_cache: ClassVar[bool] = True  # as its transformers *Model.forward
    enum_fields: ClassVar[dict[str, type]] = {"hidden_act": Activation, "hidden_activation": Activation}

    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int | None = 4
    hidden_activation: Activation = Activation.GELU_PYTORCH_TANH  # Gemma2MLP reads this one, not hidden_act
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0

    def layer_kinds(self) -> list[str]:
        if self.layer_types is not None:
            return list(self.layer_types)
        # Gemma2Config.__post_init__: layers 0, 2, 4, ... slide, the others are full
        return [SLIDING if (i + 1) % 2 else FULL for i in range(self.num_hidden_layers)]

    def window(self, kind: str) -> int | None:
        return self.sliding_window if kind == SLIDING else None


class Gemma2Attention(LlamaAttention):
    paths = ("eager",)  # Gemma2PreTrainedModel._supports_sdpa = False: softcapping has no sdpa path

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scaling = config.query_pre_attn_scalar ** -0.5  # Gemma2Attention.scaling
        self.softcap = config.attn_logit_softcapping


class Gemma2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: LlamaConfig, self_attn: nn.Module, mlp: nn.Module, norm_class: type[nn.Module]) -> None:
        super().__init__(config, self_attn, mlp, norm_class)
        self.pre_feedforward_layernorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        # Gemma2DecoderLayer.forward: each branch normed before and after, then added to its residual
        attn = self.self_attn(self.input_layernorm(hidden_states), rope, mask, cache)
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp)


class Gemma2Model(GemmaModel):
    attention_class = Gemma2Attention
    layer_class = Gemma2DecoderLayer

    @classmethod
    def make_mlp(cls, config: Gemma2Config) -> nn.Module:
        return SwiGLU(config.hidden_size, config.intermediate_size, activation(config.hidden_activation))


class SoftcappedLMHead(LMHead):
    """``lm_head`` then ``tanh(logits / cap) * cap`` (Gemma2ForCausalLM.forward), the loss taken on these."""

    def __init__(self, hidden_size: int, vocab_size: int, softcap: float | None) -> None:
        super().__init__(hidden_size, vocab_size)
        self.softcap = softcap

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if self.softcap is not None:
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        return logits


@register
class Gemma2(Gemma):
    model_type = "gemma2"
    arch = "Gemma2"
    config_class = Gemma2Config
    backbone_class = Gemma2Model
    attn_implementations = Gemma2Attention.paths

    @classmethod
    def causal_lm_head(cls, config: Gemma2Config) -> HeadPart:
        return SoftcappedLMHead(config.hidden_size, config.vocab_size, config.final_logit_softcapping)
