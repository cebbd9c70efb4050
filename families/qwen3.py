"""Qwen3 (``model_type: qwen3``): Qwen2's config (sliding layers from ``max_window_layers`` or ``layer_types``)
with an explicit ``head_dim`` (128 by default), ``attention_bias`` on q, k, v and o (none on the MLP), and an
RMSNorm over each head of q and k (``q_norm``, ``k_norm``) before RoPE. Everything else is families/llama.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flodl_hf.decoder import RMSNorm
from flodl_hf.registry import register

from .llama import LlamaAttention, LlamaConfig, LlamaModel
from .qwen2 import Qwen2, Qwen2Config


@dataclass
class Qwen3Config(Qwen2Config):
    model_type: ClassVar[str] = "qwen3"

    head_dim: int | None = 128

    def biases(self) -> tuple[bool, bool, bool]:
        return self.attention_bias, self.attention_bias, False  # Qwen3Attention / Qwen3MLP


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project(self, hidden_states: torch.Tensor,
                shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Qwen3Attention.forward: q_norm(q_proj(h).view(shape)), k likewise, before the transpose and RoPE
        q, k, v = super().project(hidden_states, shape)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3Model(LlamaModel):
    attention_class = Qwen3Attention


@register
class Qwen3(Qwen2):
    model_type = "qwen3"
    arch = "Qwen3"
    config_class = Qwen3Config
    backbone_class = Qwen3Model
