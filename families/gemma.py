"""Gemma (``model_type: gemma``): LLaMA with the token embeddings scaled by ``sqrt(hidden_size)`` (in the
weights' dtype, inside the embedding, so ``inputs_embeds`` are taken as given), an RMSNorm computed in float32
and scaled by ``1 + weight``, the ``gelu_pytorch_tanh`` MLP (a config's legacy ``gelu`` means it, as
transformers reads it), an explicit ``head_dim``, ``attention_bias`` on q, k, v and o, tied embeddings, and no
QA head. ``use_bidirectional_attention`` is refused. Everything else is families/llama.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.config import Activation
from flodl_hf.core.errors import ConfigError
from flodl_hf.core.layers import LazyBuffers, cast_lazy_buffers
from flodl_hf.core.registry import register

from .llama import Llama, LlamaConfig, LlamaModel


@dataclass
class GemmaConfig(LlamaConfig):
    model_type: ClassVar[str] = "gemma"
    returns_given_cache: ClassVar[bool] = False  # as its transformers *Model.forward

    vocab_size: int = 256000
    hidden_size: int = 3072
    intermediate_size: int = 24576
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 16
    head_dim: int | None = 256
    hidden_act: Activation = Activation.GELU_PYTORCH_TANH
    max_position_embeddings: int = 8192
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 2
    tie_word_embeddings: bool = True
    use_bidirectional_attention: bool | None = None

    def __post_init__(self) -> None:
        if self.hidden_act in ("gelu", Activation.GELU):  # GemmaConfig.__post_init__: the legacy spelling
            self.hidden_act = Activation.GELU_PYTORCH_TANH
        super().__post_init__()
        if self.use_bidirectional_attention:
            raise ConfigError("config field use_bidirectional_attention=true (non-causal Gemma) is not supported")

    def biases(self) -> tuple[bool, bool, bool]:
        return self.attention_bias, self.attention_bias, False  # GemmaAttention / GemmaMLP


class GemmaRMSNorm(nn.Module):
    """GemmaRMSNorm: the norm in float32, times ``1 + weight`` in float32, then back to the input dtype."""

    fresh_init = {"weight": "zeros"}  # GemmaPreTrainedModel._init_weights: zeros, 1-centred by (1 + weight)

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = x.float()
        output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + self.eps)
        return (output * (1.0 + self.weight.float())).type_as(x)


class GemmaTextScaledWordEmbedding(nn.Embedding):
    """The embedding times ``sqrt(embedding_dim)`` cast to the weights' dtype. transformers keeps the scale in a
    non-persistent float32 buffer that casts round; ours is a ``LazyBuffers`` (made at first use, so a meta
    build holds none) that this module's ``_apply`` hands every cast, as the buffer gets it."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.scalar_embed_scale = embedding_dim ** 0.5
        self.embed_scale = LazyBuffers(self._make_scale)

    def _make_scale(self, _key: None, device: torch.device | None) -> torch.Tensor:
        return torch.tensor(self.scalar_embed_scale, device=device)

    def _apply(self, fn, recurse: bool = True):
        cast_lazy_buffers(self, fn)
        return super()._apply(fn, recurse)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale(None, self.weight.device).to(self.weight.dtype)


class GemmaModel(LlamaModel):
    embedding_class = GemmaTextScaledWordEmbedding
    norm_class = GemmaRMSNorm


@register
class Gemma(Llama):
    model_type = "gemma"
    arch = "Gemma"
    config_class = GemmaConfig
    backbone_class = GemmaModel
    tasks = ("base", "causal_lm", "seqcls", "tokcls")  # transformers has no GemmaForQuestionAnswering
