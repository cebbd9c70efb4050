"""StableLM (``model_type: stablelm``: StableLM-3B-4E1T, StableLM 2...): LLaMA's decoder (families/llama.py: masks,
KV cache, GQA, the SwiGLU MLP without biases, heads) with LayerNorm (``layer_norm_eps``) for the norms, a bias on
q, k and v with ``use_qkv_bias`` (never on ``o_proj``), heads of ``hidden_size // num_attention_heads``, RoPE on
the first ``partial_rotary_factor`` of each head (0.25 by default), and two options: ``qk_layernorm`` (a LayerNorm
without bias per head of q and of k, ``q_layernorm.norms.<head>``, on the transposed heads before RoPE) and
``use_parallel_residual`` (``x + attn(ln(x)) + dropout(mlp(ln(x)))``, one norm; the sequential form has
``post_attention_layernorm``), ``hidden_dropout`` on the MLP branch. Heads: causal_lm, seqcls, tokcls (transformers
has no other). Mirrors ``transformers.models.stablelm.modeling_stablelm`` (5.24); RoPE fields as
``StableLmConfig`` reads them (the RoPE dict's ``rope_theta`` / ``partial_rotary_factor``, else the top-level ones,
else 10000 and 0.25)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from flodl_hf.core.decoder import KVCache, _number
from flodl_hf.core.errors import ConfigError
from flodl_hf.core.modeling import HeadPart
from flodl_hf.core.registry import register

from .llama import Llama, LlamaAttention, LlamaConfig, LlamaModel, ScoreHead, check_heads_from_hidden


class PartialRotary:
    """RoPE on the first ``partial_rotary_factor`` of each head, as StableLmConfig and PhiConfig read it
    (``convert_rope_params_to_dict``: the RoPE dict's, else the top-level field, whose default each config sets); a
    null factor and an odd rotated count refused. A config mixin, before LlamaConfig in the bases."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rotary_dim % 2:  # transformers' cos and sin would be one dimension wider than the rotated slice
            raise ConfigError(f"config field partial_rotary_factor: {self.attention_head_dim} x "
                              f"{self._partial_factor} = {self.rotary_dim} rotated dimensions, an odd number "
                              "(transformers fails on it at the first forward)")

    @property
    def _partial_factor(self) -> float:
        given = self.rope_scaling or self.rope_parameters
        params = given if isinstance(given, dict) else {}
        factor = params.get("partial_rotary_factor", self.partial_rotary_factor)
        if factor is None:  # transformers' attention reads rope_parameters["partial_rotary_factor"]: a KeyError
            raise ConfigError("config field partial_rotary_factor is null")
        return _number(factor, "partial_rotary_factor")

    @property
    def rotary_dim(self) -> int:
        return int(self.attention_head_dim * self._partial_factor)  # StableLmAttention.rotary_ndims, PhiAttention's


@dataclass
class StableLmConfig(PartialRotary, LlamaConfig):
    model_type: ClassVar[str] = "stablelm"

    vocab_size: int = 50304
    intermediate_size: int = 6912
    hidden_size: int = 2560
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    max_position_embeddings: int = 4096
    layer_norm_eps: float = 1e-5
    use_qkv_bias: bool = False
    qk_layernorm: bool = False
    use_parallel_residual: bool = False
    hidden_dropout: float = 0.0
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
    pad_token_id: int | None = None
    partial_rotary_factor: float | None = 0.25  # StableLmConfig.__post_init__'s default, moved into the RoPE dict

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StableLmConfig":
        config = super().from_dict(data)
        check_heads_from_hidden(data, config, "StableLM")
        return config

    norm_eps = property(lambda self: self.layer_norm_eps)
    attention_head_dim = property(lambda self: self.hidden_size // self.num_attention_heads)

    def biases(self) -> tuple[bool, bool, bool]:
        return self.use_qkv_bias, False, False  # StableLmAttention (o_proj without), StableLmMLP without


class StableLmLayerNormPerHead(nn.Module):
    """One LayerNorm (no bias) per head, over (B, heads, S, head_dim) split along the heads."""

    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim, eps=eps, bias=False) for _ in range(num_heads))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        heads = torch.split(hidden_states, 1, dim=1)
        return torch.cat([norm(h) for norm, h in zip(self.norms, heads, strict=True)], dim=1)


class StableLmAttention(LlamaAttention):
    def make_projections(self, config: StableLmConfig, heads: int, kv: int) -> None:
        super().make_projections(config, heads, kv)
        if config.qk_layernorm:  # StableLmAttention.__init__: built after o_proj
            self.q_layernorm = StableLmLayerNormPerHead(self.head_dim, config.num_attention_heads,
                                                        config.layer_norm_eps)
            self.k_layernorm = StableLmLayerNormPerHead(self.head_dim, config.kv_heads, config.layer_norm_eps)

    def project(self, hidden_states: torch.Tensor,
                shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # StableLmAttention.forward: the norms on the transposed heads (B, heads, S, d); handed back untransposed,
        # LLaMA's forward transposes them again (the same tensors)
        q, k, v = self.project_heads(hidden_states, shape)
        if self.config.qk_layernorm:
            q = self.q_layernorm(q.transpose(1, 2)).transpose(1, 2)
            k = self.k_layernorm(k.transpose(1, 2)).transpose(1, 2)
        return q, k, v


class StableLmDecoderLayer(nn.Module):
    """StableLmDecoderLayer: its modules in its order; the parallel or the sequential residual."""

    def __init__(self, config: StableLmConfig, self_attn: nn.Module, mlp: nn.Module,
                 norm_class: type[nn.Module]) -> None:
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm_class(config.hidden_size, eps=config.layer_norm_eps)
        if not self.use_parallel_residual:
            self.post_attention_layernorm = norm_class(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        attn = self.self_attn(hidden_states, rope, mask, cache)
        if self.use_parallel_residual:  # (residual + attn) + mlp, in transformers' order
            return residual + attn + self.dropout(self.mlp(hidden_states))
        residual = residual + attn
        return residual + self.dropout(self.mlp(self.post_attention_layernorm(residual)))


class StableLmModel(LlamaModel):
    exits_early = False  # its transformers forward runs every layer, whatever num_hidden_layers says
    attention_class = StableLmAttention
    layer_class = StableLmDecoderLayer
    norm_class = nn.LayerNorm

    def hidden_state_modules(self) -> list[nn.Module]:
        return list(self.layers)  # the layers (the per-head norms' lists are not innermost-list layers)

@register
class StableLm(Llama):
    model_type = "stablelm"
    arch = "StableLm"
    config_class = StableLmConfig
    backbone_class = StableLmModel
    tasks = ("base", "causal_lm", "seqcls", "tokcls")  # transformers has no StableLM QA head

    @classmethod
    def token_head(cls, config: StableLmConfig) -> HeadPart:
        # GenericForTokenClassification: classifier_dropout, else config.hidden_dropout (a StableLmConfig field,
        # 0.0 by default: set whether config.json has it or not)
        dropout = config.raw.get("classifier_dropout")
        return ScoreHead(config.hidden_size, config.num_labels, bias=config.raw.get("token_classification_bias", True),
                         dropout=config.hidden_dropout if dropout is None else dropout)
