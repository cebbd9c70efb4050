"""OLMo 2 (``model_type: olmo2``): LLaMA with post-norm layers (no ``input_layernorm``: each branch's output goes
through ``post_attention_layernorm`` / ``post_feedforward_layernorm`` before its residual add), an RMSNorm over
the whole q and k projections (``q_norm``, ``k_norm``: every head at once, before the per-head view, unlike Qwen3's),
``attention_bias`` on q, k, v and o (none on the MLP), other defaults, and two dtype details that only a cast model
sees: its RMSNorm casts after the weight (``(weight * x).to(dtype)``), and RoPE's cos and sin stay float32, the
rotated q and k cast back to their dtype. Heads: causal_lm and seqcls (transformers has no other). Everything else
is families/llama.py; mirrors ``transformers.models.olmo2.modeling_olmo2`` (5.24)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.decoder import KVCache, RMSNorm, apply_rotary_pos_emb, rotary_cos_sin
from flodl_hf.core.registry import register

from .llama import Llama, LlamaAttention, LlamaConfig, LlamaModel


@dataclass
class Olmo2Config(LlamaConfig):
    model_type: ClassVar[str] = "olmo2"

    vocab_size: int = 50304
    pad_token_id: int | None = 1
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 50279
    rms_norm_eps: float = 1e-5

    def biases(self) -> tuple[bool, bool, bool]:
        return self.attention_bias, self.attention_bias, False  # Olmo2Attention / Olmo2MLP


class Olmo2RMSNorm(RMSNorm):
    """Olmo2RMSNorm: LLaMA's, but the weight multiplies in float32 and the product is cast (the order matters
    below float32 only)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class Olmo2Attention(LlamaAttention):
    def make_projections(self, config: LlamaConfig, heads: int, kv: int) -> None:
        super().make_projections(config, heads, kv)
        # Olmo2Attention.__init__: the norms over the whole projections, built after o_proj
        self.q_norm = Olmo2RMSNorm(heads, eps=config.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(kv, eps=config.rms_norm_eps)

    def project_heads(self, hidden_states: torch.Tensor,
                      shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Olmo2Attention.forward: q_norm(q_proj(h)) and k_norm(k_proj(h)), then the per-head view
        q = self.q_norm(self.q_proj(hidden_states))
        k = self.k_norm(self.k_proj(hidden_states))
        return q.view(shape), k.view(shape), self.v_proj(hidden_states).view(shape)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # modeling_olmo2.apply_rotary_pos_emb: float32 cos and sin, the results cast back to q's and k's dtypes
        q_type, k_type = q.dtype, k.dtype
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q.to(q_type), k.to(k_type)


class Olmo2DecoderLayer(nn.Module):
    """A post-norm layer: ``h + post_attention_layernorm(self_attn(h))``, then
    ``h + post_feedforward_layernorm(mlp(h))`` (Olmo2DecoderLayer.forward; its modules in transformers' order)."""

    def __init__(self, config: Olmo2Config, self_attn: nn.Module, mlp: nn.Module, norm_class: type[nn.Module]) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.post_attention_layernorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = norm_class(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        hidden_states = hidden_states + self.post_attention_layernorm(self.self_attn(hidden_states, rope, mask, cache))
        return hidden_states + self.post_feedforward_layernorm(self.mlp(hidden_states))


class Olmo2Model(LlamaModel):
    attention_class = Olmo2Attention
    layer_class = Olmo2DecoderLayer
    norm_class = Olmo2RMSNorm

    def rotary(self, key: str | None, position_ids: torch.Tensor,
               hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Olmo2RotaryEmbedding.forward: cos and sin are not cast to the hidden states' dtype
        inv_freq, scaling = self.rope_frequencies(key, position_ids, hidden.device)
        return rotary_cos_sin(inv_freq, position_ids, torch.float32, scaling)


@register
class Olmo2(Llama):
    model_type = "olmo2"
    arch = "Olmo2"
    config_class = Olmo2Config
    backbone_class = Olmo2Model
    tasks = ("base", "causal_lm", "seqcls")  # transformers has Olmo2ForCausalLM and Olmo2ForSequenceClassification
