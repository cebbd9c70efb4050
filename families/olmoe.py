"""OLMoE (``model_type: olmoe``): LLaMA's pre-norm layers with OLMo 2-style q/k norms (one RMSNorm over each whole
projection, before the per-head view), ``clip_qkv``, and a sparse mixture-of-experts MLP in every layer.

Mirrors ``transformers.models.olmoe.modeling_olmoe`` (5.25), on Mixtral's and Qwen3-MoE's parts:
- ``self_attn.q_norm`` over ``hidden_size``, ``self_attn.k_norm`` over ``(hidden_size // heads) * kv_heads``: LLaMA's
  RMSNorm (the cast before the weight, unlike Olmo2RMSNorm); then, with ``clip_qkv``, the normed q, k and v clamped
  to ``[-clip_qkv, clip_qkv]``; RoPE's cos and sin in the states' dtype, as LLaMA's;
- ``attention_bias`` on q, k, v and o (none on the experts);
- ``mlp`` (OlmoeSparseMoeBlock): the router as Qwen2-MoE's (``norm_topk_prob``) and ``num_experts`` stacked experts
  of width ``intermediate_size`` run as Mixtral's (grouped_mm), in every layer, no shared expert; files hold them
  per expert (``mlp.experts.{e}.gate_proj/up_proj/down_proj``, as Qwen2-MoE's ``key_merges``);
- ``num_local_experts`` is ``num_experts``, as OlmoeConfig.attribute_map;
- the norms' widths assume ``head_dim == hidden_size // num_attention_heads``: another ``head_dim`` is refused.
``output_router_logits`` returns the router logits and the aux loss, as Mixtral's. Heads: base and causal_lm
(transformers has no other)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from flodl_hf.core.decoder import RMSNorm
from flodl_hf.core.errors import ConfigError
from flodl_hf.core.registry import register

from .llama import Llama, LlamaAttention, LlamaConfig
from .mixtral import MixtralForCausalLM, MixtralModel, alias_from_dict
from .qwen2_moe import Qwen2Moe
from .qwen3_moe import Qwen3MoeSparseMoeBlock


@dataclass
class OlmoeConfig(LlamaConfig):
    model_type: ClassVar[str] = "olmoe"

    vocab_size: int = 50304
    hidden_size: int = 2048
    intermediate_size: int = 2048
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 1
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 50279
    clip_qkv: float | None = None
    num_experts_per_tok: int = 8
    num_experts: int = 64
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.01
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim is not None and self.head_dim != self.hidden_size // self.num_attention_heads:
            # OlmoeAttention: q_norm is hidden_size wide, q_proj heads * head_dim (transformers fails at load)
            raise ConfigError(f"config field head_dim={self.head_dim!r}: OLMoE's q/k norms need hidden_size // "
                              f"num_attention_heads={self.hidden_size // self.num_attention_heads}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OlmoeConfig":
        # OlmoeConfig.attribute_map: a config.json's num_local_experts sets num_experts (and wins over it)
        return alias_from_dict(super().from_dict, data, "num_local_experts", "num_experts", alias_wins=True)

    def biases(self) -> tuple[bool, bool, bool]:
        return self.attention_bias, self.attention_bias, False  # OlmoeAttention / OlmoeExperts


class OlmoeAttention(LlamaAttention):
    def make_projections(self, config: OlmoeConfig, heads: int, kv: int) -> None:
        super().make_projections(config, heads, kv)
        # OlmoeAttention.__init__: the norms over the whole projections, built after o_proj
        self.q_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(config.hidden_size // config.num_attention_heads * config.kv_heads,
                              eps=config.rms_norm_eps)

    def project_heads(self, hidden_states: torch.Tensor,
                      shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # OlmoeAttention.forward: q_norm(q_proj(h)), k_norm(k_proj(h)), v_proj(h), each clamped with clip_qkv,
        # then the per-head view
        q = self.q_norm(self.q_proj(hidden_states))
        k = self.k_norm(self.k_proj(hidden_states))
        v = self.v_proj(hidden_states)
        clip = self.config.clip_qkv
        if clip is not None:
            q, k, v = (t.clamp(min=-clip, max=clip) for t in (q, k, v))
        return q.view(shape), k.view(shape), v.view(shape)


class OlmoeSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    gate_first = True  # OlmoeSparseMoeBlock.__init__: gate, then experts


class OlmoeModel(MixtralModel):
    attention_class = OlmoeAttention

    @classmethod
    def make_mlp(cls, config: OlmoeConfig) -> nn.Module:
        return OlmoeSparseMoeBlock(config, config.intermediate_size)


@register
class Olmoe(Llama):
    model_type = "olmoe"
    arch = "Olmoe"
    config_class = OlmoeConfig
    backbone_class = OlmoeModel
    tasks = ("base", "causal_lm")  # transformers has OlmoeModel and OlmoeForCausalLM
    task_models = {**Llama.task_models, "causal_lm": MixtralForCausalLM}
    key_merges = Qwen2Moe.key_merges  # transformers' conversion_mapping: "olmoe" is "qwen2_moe"'s
