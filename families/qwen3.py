"""Qwen3 (``model_type: qwen3``): Qwen2's config (sliding layers from ``max_window_layers`` or ``layer_types``)
with an explicit ``head_dim`` (128 by default), ``attention_bias`` on q, k, v and o (none on the MLP), and an
RMSNorm over each head of q and k (``q_norm``, ``k_norm``) before RoPE. Everything else is families/llama.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


from flodl_hf.core.decoder import RMSNorm
from flodl_hf.core.registry import register

from .llama import LlamaAttention, LlamaModel
from .qwen2 import Qwen2, Qwen2Config


@dataclass
class Qwen3Config(Qwen2Config):
    model_type: ClassVar[str] = "qwen3"

    head_dim: int | None = 128

    def biases(self) -> tuple[bool, bool, bool]:
        return self.attention_bias, self.attention_bias, False  # Qwen3Attention / Qwen3MLP


class Qwen3Attention(LlamaAttention):
    qk_norm = RMSNorm  # Qwen3Attention: q_norm(q_proj(h).view(shape)), k likewise, before the transpose and RoPE


class Qwen3Model(LlamaModel):
    attention_class = Qwen3Attention


@register
class Qwen3(Qwen2):
    model_type = "qwen3"
    arch = "Qwen3"
    config_class = Qwen3Config
    backbone_class = Qwen3Model
