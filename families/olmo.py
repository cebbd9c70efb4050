"""OLMo (``model_type: olmo``: OLMo 1): LLaMA (families/llama.py) with a LayerNorm that has no weight and no bias, its
epsilon fixed at 1e-5 and computed in float32 (``OlmoLayerNorm``, for ``input_layernorm``,
``post_attention_layernorm`` and ``norm``), ``attention_bias`` on q, k, v and o (none on the MLP), ``clip_qkv``
(q, k and v clamped to ``[-clip_qkv, clip_qkv]`` right after their projections), other defaults, OLMo 2's RoPE
dtypes (float32 cos and sin, q and k cast back after the turn), and a given cache returned whatever ``use_cache`` says
(Phi's forward). Heads: causal_lm and seqcls (transformers has no
other). Mirrors ``transformers.models.olmo.modeling_olmo`` (5.25)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.registry import register

from .llama import Llama, LlamaAttention, LlamaConfig, LlamaModel
from .olmo2 import Olmo2Attention, Olmo2Model

OLMO_LAYER_NORM_EPS = 1e-5  # OlmoLayerNorm's, whatever the config says (OlmoConfig has no epsilon field)


@dataclass
class OlmoConfig(LlamaConfig):
    model_type: ClassVar[str] = "olmo"

    vocab_size: int = 50304
    pad_token_id: int | None = 1
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 50279
    clip_qkv: float | None = None
    # clip_qkv: finite and > 0 or null (the config table), stricter than transformers, whose clamp to [c, -c] would
    # set every q, k and v to -c

    norm_eps = property(lambda self: OLMO_LAYER_NORM_EPS)

    def biases(self) -> tuple[bool, bool, bool]:
        return self.attention_bias, self.attention_bias, False  # OlmoAttention / OlmoMLP


class OlmoLayerNorm(nn.Module):
    """OlmoLayerNorm: ``F.layer_norm`` in float32 without weight or bias, cast back; no parameters."""

    def __init__(self, hidden_size: int, eps: float = OLMO_LAYER_NORM_EPS) -> None:
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        return F.layer_norm(hidden_states.to(torch.float32), self.normalized_shape, None, None, eps=self.eps).to(dtype)


class OlmoAttention(LlamaAttention):
    def project_heads(self, hidden_states: torch.Tensor,
                      shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        clip = self.config.clip_qkv
        if clip is not None:  # OlmoAttention.forward: each projection clamped before the per-head view
            q, k, v = (t.clamp(min=-clip, max=clip) for t in (q, k, v))
        return q.view(shape), k.view(shape), v.view(shape)

    rotate = Olmo2Attention.rotate  # modeling_olmo.apply_rotary_pos_emb: q and k cast back to their dtypes


class OlmoModel(LlamaModel):
    attention_class = OlmoAttention
    norm_class = OlmoLayerNorm
    rotary = Olmo2Model.rotary  # OlmoRotaryEmbedding.forward: cos and sin left in float32


@register
class Olmo(Llama):
    model_type = "olmo"
    arch = "Olmo"
    config_class = OlmoConfig
    backbone_class = OlmoModel
    tasks = ("base", "causal_lm", "seqcls")  # transformers has OlmoForCausalLM and OlmoForSequenceClassification
