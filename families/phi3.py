"""Phi-3 (``model_type: phi3``): Mistral's layout (no biases; a window on every layer when ``sliding_window`` is
set, none by default) with q, k and v in one ``qkv_proj`` and gate and up in one ``gate_up_proj``, each one
``F.linear`` then transformers' slices, as transformers runs them; RoPE on the first ``partial_rotary_factor``
of each head; dropout (``resid_pdrop``) on each branch before its residual add; no QA head. RoPE ``default`` or
``longrope`` (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini; its old names ``su`` / ``yarn`` read as longrope, as
Phi3Config does): short frequencies while ``max(position_ids) + 1 <= original_max_position_embeddings`` (the
top-level field, 4096 by default, which wins over a nested one), long ones past it, cos and sin times the attention
factor (decoder.Rope, LlamaModel.rotary); and, as Phi3ForCausalLM.prepare_inputs_for_generation, generation drops
the cache and runs the whole sequence again once it reaches ``original_max_position_embeddings + 1`` tokens
(``Phi3Model.drops_cache``, which generate.py asks). Everything else is families/llama.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from flodl_hf.core.decoder import KVCache, Rope, _factors, _number
from flodl_hf.core.errors import ConfigError
from flodl_hf.core.layers import activation
from flodl_hf.core.registry import register

from .llama import LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaModel
from .mistral import Mistral, MistralConfig


@dataclass
class Phi3Config(MistralConfig):
    model_type: ClassVar[str] = "phi3"
    rope_types: ClassVar[tuple[str, ...]] = ("default", "longrope")  # Phi3Config.validate_rope refuses the others

    vocab_size: int = 32064
    hidden_size: int = 3072
    intermediate_size: int = 8192
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    eos_token_id: int | list[int] | None = 32000
    pad_token_id: int | None = 32000
    sliding_window: int | None = None
    resid_pdrop: float = 0.0
    partial_rotary_factor: float | None = None
    original_max_position_embeddings: int = 4096  # longrope's switch, and generation's cache drop

    def __post_init__(self) -> None:
        super().__post_init__()  # resolves the RoPE (rope()): a bad field fails at load, naming itself
        _ = self.rotary_dim  # a bad partial_rotary_factor fails at load, naming itself
        self._check_factor_lists()

    @property
    def _partial_factor(self) -> float:
        # Phi3Config.convert_rope_params_to_dict: the RoPE dict's partial_rotary_factor, else the top-level one
        params = self.rope_scaling or self.rope_parameters or {}
        factor = params.get("partial_rotary_factor", self.partial_rotary_factor)
        return 1.0 if factor is None else _number(factor, "partial_rotary_factor")

    @property
    def rotary_dim(self) -> int:
        return int(self.attention_head_dim * self._partial_factor)

    def rope(self, key: str | None = None) -> Rope:
        """Phi3Config.convert_rope_params_to_dict: the old type names ``su`` and ``yarn`` become ``longrope``. The
        top-level original_max_position_embeddings (default 4096) is the one used, whatever the dict says
        (standardize_rope_params' Phi3 exception), also for an ``su`` dict without one of its own: transformers
        5.25 renames before standardizing, so the top-level field fills it (5.24 standardized first and failed
        with a KeyError)."""
        scaling, parameters = self.rope_scaling, self.rope_parameters
        given = scaling or parameters
        if isinstance(given, dict) and given.get("rope_type", given.get("type")) in ("su", "yarn"):
            given = {**given, "rope_type": "longrope"}
            scaling, parameters = (given, parameters) if scaling else (scaling, given)
        return Rope.resolve(parameters, scaling, self.rope_theta, self.default_theta, self.max_position_embeddings,
                            self.original_max_position_embeddings, self.rope_types)

    def _check_factor_lists(self) -> None:
        """Phi3Config.validate_rope: a short_factor / long_factor that is given (whatever the RoPE type) is a list of
        numbers, half as long as the rotated dimensions it counts (hidden_size // num_attention_heads times the
        partial factor); the frequencies are computed over head_dim's, so a list must fit both."""
        given = self.rope_scaling or self.rope_parameters
        if not isinstance(given, dict):
            return
        source = "rope_scaling" if self.rope_scaling else "rope_parameters"
        counted = int(self.hidden_size // self.num_attention_heads * self._partial_factor) // 2
        for name in ("short_factor", "long_factor"):
            if given.get(name) is None:
                continue
            values = _factors(given[name], f"{source}.{name}")
            for n in dict.fromkeys((counted, self.rotary_dim // 2)):
                if len(values) != n:
                    raise ConfigError(f"config field {source}.{name} has {len(values)} entries: expected {n}, one "
                                      "per pair of rotated dimensions")


class Phi3Attention(LlamaAttention):
    def make_projections(self, config: LlamaConfig, heads: int, kv: int) -> None:
        self.o_proj = nn.Linear(heads, config.hidden_size, bias=False)
        self.qkv_proj = nn.Linear(config.hidden_size, heads + 2 * kv, bias=False)
        self.qkv_split = (heads, heads + kv)

    def project_heads(self, hidden_states: torch.Tensor,
                      shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Phi3Attention.forward: one product, then q, k and v sliced out of it and viewed per head
        qkv = self.qkv_proj(hidden_states)
        q_end, k_end = self.qkv_split
        return qkv[..., :q_end].view(shape), qkv[..., q_end:k_end].view(shape), qkv[..., k_end:].view(shape)


class Phi3MLP(nn.Module):
    def __init__(self, config: Phi3Config) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.activation_fn = activation(config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Phi3MLP.forward: one product, chunked into gate and up, then up * act(gate)
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class Phi3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Phi3Config, self_attn: nn.Module, mlp: nn.Module, norm_class: type[nn.Module]) -> None:
        super().__init__(config, self_attn, mlp, norm_class)
        self.resid_attn_dropout = nn.Dropout(config.resid_pdrop)
        self.resid_mlp_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache: KVCache | None) -> torch.Tensor:
        # Phi3DecoderLayer.forward: LLaMA's, with each branch's dropout before its residual add
        attn = self.self_attn(self.input_layernorm(hidden_states), rope, mask, cache)
        hidden_states = hidden_states + self.resid_attn_dropout(attn)
        return hidden_states + self.resid_mlp_dropout(self.mlp(self.post_attention_layernorm(hidden_states)))


class Phi3Model(LlamaModel):
    attention_class = Phi3Attention
    layer_class = Phi3DecoderLayer

    def drops_cache(self, length: int, past: int) -> bool:
        """Phi3ForCausalLM.prepare_inputs_for_generation: once the sequences reach original_max_position_embeddings
        + 1 tokens (``length``, left padding included) while the cache holds no more than that many (``past``),
        generation drops the cache and runs the whole sequences again, so that a longrope model's keys all turn
        with its long frequencies. transformers does it for every Phi-3, whatever its RoPE."""
        old = self.config.original_max_position_embeddings
        return length >= old + 1 and past <= old

    @classmethod
    def make_mlp(cls, config: Phi3Config) -> nn.Module:
        return Phi3MLP(config)


@register
class Phi3(Mistral):
    model_type = "phi3"
    arch = "Phi3"
    config_class = Phi3Config
    backbone_class = Phi3Model
    tasks = ("base", "causal_lm", "seqcls", "tokcls")  # transformers has no Phi3ForQuestionAnswering
