"""Cohere (``model_type: cohere``: Command-R): LLaMA (families/llama.py: masks, KV cache, GQA, the SwiGLU MLP,
``attention_bias`` on q, k, v and o) with Cohere's parts: ``CohereLayerNorm`` (a weight and no bias, mean and variance
in float32, as that class computes them) for ``input_layernorm`` and ``norm``; one norm per layer and the parallel
residual ``x + attn(ln(x)) + mlp(ln(x))``; RoPE on interleaved pairs (the frequencies doubled with
``repeat_interleave``, q and k turned in float32 and cast back); ``use_qk_norm`` (a CohereLayerNorm over each head of q
and of k, its weight (heads, head_dim), before the transpose); and the logits times ``logit_scale``, the loss taken on
them; tied embeddings by default. Heads: causal_lm only (transformers has no other). Mirrors
``transformers.models.cohere.modeling_cohere`` (5.25)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.decoder import KVCache, rotary_cos_sin
from flodl_hf.heads.causal_lm import LMHead
from flodl_hf.core.modeling import HeadPart
from flodl_hf.core.registry import register

from .gptj import rotate_every_two
from .llama import Llama, LlamaAttention, LlamaConfig, LlamaModel


@dataclass
class CohereConfig(LlamaConfig):
    model_type: ClassVar[str] = "cohere"
    default_theta: ClassVar[float] = 500_000.0  # CohereConfig.default_theta

    vocab_size: int = 256000
    hidden_size: int = 8192
    intermediate_size: int = 22528
    logit_scale: float = 0.0625  # CohereConfig's float | None: a null fails there (logits * None), refused here
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    max_position_embeddings: int = 8192
    layer_norm_eps: float = 1e-5
    pad_token_id: int | None = 0
    bos_token_id: int | None = 5
    eos_token_id: int | list[int] | None = 255001
    tie_word_embeddings: bool = True
    use_qk_norm: bool = False

    norm_eps = property(lambda self: self.layer_norm_eps)

    def biases(self) -> tuple[bool, bool, bool]:
        return self.attention_bias, self.attention_bias, False  # CohereAttention / CohereMLP


class CohereLayerNorm(nn.Module):
    """CohereLayerNorm: mean and variance in float32, ``weight * normed`` in float32, cast back; no bias.
    ``hidden_size`` may be a shape: (heads, head_dim) for the per-head q and k norms."""

    def __init__(self, hidden_size: int | tuple[int, ...], eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # CohereLayerNorm.forward, op for op (a hand-written LayerNorm: F.layer_norm's bits differ)
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)


class CohereAttention(LlamaAttention):
    def make_projections(self, config: CohereConfig, heads: int, kv: int) -> None:
        super().make_projections(config, heads, kv)
        if config.use_qk_norm:  # CohereAttention.__init__: built after o_proj, one weight row per head
            self.q_norm = CohereLayerNorm((config.num_attention_heads, self.head_dim), eps=config.layer_norm_eps)
            self.k_norm = CohereLayerNorm((config.kv_heads, self.head_dim), eps=config.layer_norm_eps)

    def project(self, hidden_states: torch.Tensor,
                shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.project_heads(hidden_states, shape)
        if self.config.use_qk_norm:  # CohereAttention.forward: on the (B, S, heads, d) views, before the transpose
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # modeling_cohere.apply_rotary_pos_emb: q and k in float32, pairs of adjacent dimensions, cast back
        dtype = q.dtype
        q, k = q.float(), k.float()
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = (q * cos) + (rotate_every_two(q) * sin)
        k_embed = (k * cos) + (rotate_every_two(k) * sin)
        return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)


class CohereDecoderLayer(nn.Module):
    """CohereDecoderLayer: ``input_layernorm`` once, attention and MLP both on it."""

    def __init__(self, config: CohereConfig, self_attn: nn.Module, mlp: nn.Module,
                 norm_class: type[nn.Module]) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm_class(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        attn = self.self_attn(normed, rope, mask, cache)
        return hidden_states + attn + self.mlp(normed)  # CohereDecoderLayer.forward: (residual + attn) + mlp


class CohereModel(LlamaModel):
    attention_class = CohereAttention
    layer_class = CohereDecoderLayer
    norm_class = CohereLayerNorm

    def rotary(self, key: str | None, position_ids: torch.Tensor,
               hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # CohereRotaryEmbedding.forward: LLaMA's, but the frequencies doubled with repeat_interleave (not cat)
        inv_freq, scaling = self.rope_frequencies(key, position_ids, hidden.device)
        return rotary_cos_sin(inv_freq, position_ids, hidden.dtype, scaling, interleaved=True)


class CohereLMHead(LMHead):
    """``lm_head(h) * logit_scale`` (CohereForCausalLM.forward)."""

    def __init__(self, hidden_size: int, vocab_size: int, logit_scale: float) -> None:
        super().__init__(hidden_size, vocab_size)
        self.logit_scale = logit_scale

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden_states) * self.logit_scale


@register
class Cohere(Llama):
    model_type = "cohere"
    arch = "Cohere"
    config_class = CohereConfig
    backbone_class = CohereModel
    tasks = ("base", "causal_lm")  # transformers has CohereForCausalLM only

    @classmethod
    def causal_lm_head(cls, config: CohereConfig) -> HeadPart:
        return CohereLMHead(config.hidden_size, config.vocab_size, config.logit_scale)
