"""StarCoder2 (``model_type: starcoder2``): LLaMA's decoder (families/llama.py: masks, KV cache, GQA, RoPE, heads)
with LayerNorm (``norm_epsilon``) for the three norms, a bias on every linear layer with ``use_bias`` (q, k, v, o
and the MLP), the plain MLP ``c_proj(act(c_fc(h)))`` (``hidden_act``, ``gelu_pytorch_tanh`` by default), three
dropouts (``embedding_dropout`` on the input embeddings, ``residual_dropout`` after ``o_proj`` and after
``c_proj``, ``attention_dropout`` on the weights), a sliding window on every layer when ``sliding_window`` is set
(as Mistral's), and tied embeddings by default. Heads: causal_lm, seqcls, tokcls (transformers has no other).
Mirrors ``transformers.models.starcoder2.modeling_starcoder2`` (5.24)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.config import Activation
from flodl_hf.core.layers import activation
from flodl_hf.core.registry import register

from .llama import Llama, LlamaAttention, LlamaConfig, LlamaModel


@dataclass
class Starcoder2Config(LlamaConfig):
    model_type: ClassVar[str] = "starcoder2"
    returns_given_cache: ClassVar[bool] = False  # as its transformers *Model.forward

    vocab_size: int = 49152
    hidden_size: int = 3072
    intermediate_size: int = 12288
    num_hidden_layers: int = 30
    num_attention_heads: int = 24
    num_key_value_heads: int | None = 2
    hidden_act: Activation = Activation.GELU_PYTORCH_TANH
    max_position_embeddings: int = 4096
    initializer_range: float = 0.018042
    norm_epsilon: float = 1e-5
    bos_token_id: int | None = 50256
    eos_token_id: int | list[int] | None = 50256
    pad_token_id: int | None = None
    sliding_window: int | None = None
    residual_dropout: float = 0.0
    embedding_dropout: float = 0.0
    use_bias: bool = True
    tie_word_embeddings: bool = True

    @property
    def norm_eps(self) -> float:
        return self.norm_epsilon

    def biases(self) -> tuple[bool, bool, bool]:
        return self.use_bias, self.use_bias, self.use_bias

    def window(self, kind: str) -> int | None:
        # Starcoder2Model.forward: create_sliding_window_causal_mask whenever sliding_window is set; DynamicCache
        # then keeps sliding layers
        return self.sliding_window


class Starcoder2Attention(LlamaAttention):
    def project_out(self, attn_output: torch.Tensor) -> torch.Tensor:
        # Starcoder2Attention.forward: o_proj, then the residual dropout
        return nn.functional.dropout(self.o_proj(attn_output), p=self.config.residual_dropout, training=self.training)


class Starcoder2MLP(nn.Module):
    def __init__(self, config: Starcoder2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.use_bias)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.use_bias)
        self.act = activation(config.hidden_act)
        self.residual_dropout = config.residual_dropout

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.c_proj(self.act(self.c_fc(hidden_states)))
        return nn.functional.dropout(hidden_states, p=self.residual_dropout, training=self.training)


class Starcoder2Model(LlamaModel):
    attention_class = Starcoder2Attention
    norm_class = nn.LayerNorm

    @classmethod
    def make_mlp(cls, config: Starcoder2Config) -> nn.Module:
        return Starcoder2MLP(config)

    def embed(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
              attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # Starcoder2Model.forward: the embeddings (looked up or given), then embedding_dropout
        hidden = super().embed(input_ids, token_type_ids, position_ids, inputs_embeds)
        return nn.functional.dropout(hidden, p=self.config.embedding_dropout, training=self.training)


@register
class Starcoder2(Llama):
    model_type = "starcoder2"
    arch = "Starcoder2"
    config_class = Starcoder2Config
    backbone_class = Starcoder2Model
    tasks = ("base", "causal_lm", "seqcls", "tokcls")  # transformers has no StarCoder2 QA head
