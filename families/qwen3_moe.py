"""Qwen3-MoE (``model_type: qwen3_moe``): Qwen3's attention (per-head ``q_norm``/``k_norm``, ``head_dim``,
``attention_bias`` on q, k, v and o) with Qwen2-MoE's router and experts and no shared expert.

Mirrors ``transformers.models.qwen3_moe.modeling_qwen3_moe`` (5.25), on the parts of families/qwen3.py,
families/qwen2_moe.py and families/mixtral.py:
- ``mlp.gate`` (Qwen3MoeTopKRouter): Qwen2-MoE's (float32 softmax, top ``num_experts_per_tok``, renormalised only
  with ``norm_topk_prob``); ``mlp.experts``: ``num_experts`` experts of width ``moe_intermediate_size``, stacked and
  run as Mixtral's (grouped_mm); files hold them per expert (``mlp.experts.{e}.gate_proj/up_proj/down_proj``, as
  Qwen2-MoE's ``key_merges``);
- a layer is sparse unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` (then a dense SwiGLU of
  width ``intermediate_size``), as Qwen2-MoE's;
- ``head_dim`` is not a Qwen3MoeConfig field: a config.json's is read, else ``hidden_size // num_attention_heads``;
- the window: with ``use_sliding_window``, ``sliding_window`` on every layer (Qwen3MoeModel picks its mask from
  ``sliding_window`` alone; ``max_window_layers`` is not read); a ``layer_types`` is refused;
- ``num_experts`` is ``num_local_experts``, as Qwen3MoeConfig.attribute_map (save_pretrained writes the latter).
``output_router_logits`` returns the sparse layers' router logits and the aux loss, as Mixtral's. Heads: base,
causal_lm, seqcls, tokcls, qa."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from flodl_hf.core.decoder import SwiGLU
from flodl_hf.core.errors import ConfigError
from flodl_hf.core.layers import activation
from flodl_hf.core.registry import register

from .llama import FULL, SLIDING
from .mixtral import MixtralExperts, MixtralForCausalLM, MixtralModel, alias_from_dict
from .qwen2_moe import Qwen2Moe, Qwen2MoeConfig, Qwen2MoeTopKRouter
from .qwen3 import Qwen3, Qwen3Attention, Qwen3Config


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    model_type: ClassVar[str] = "qwen3_moe"
    returns_given_cache: ClassVar[bool] = True  # as its transformers *Model.forward

    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_key_value_heads: int | None = 4
    head_dim: int | None = None
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_local_experts: int = 128
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: list[int] | None = None

    def __post_init__(self) -> None:
        if self.layer_types is not None:  # Qwen3MoeModel never reads it (its DynamicCache would)
            raise ConfigError("config field layer_types: Qwen3-MoE has none (a window, with use_sliding_window, is "
                              "on every layer)")
        super().__post_init__()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Qwen3MoeConfig":
        # Qwen3MoeConfig.attribute_map: a config.json's num_experts sets num_local_experts (which wins over it)
        return alias_from_dict(super().from_dict, data, "num_experts", "num_local_experts", alias_wins=False)

    @property
    def num_experts(self) -> int:
        """Qwen3MoeConfig.attribute_map's name for ``num_local_experts``."""
        return self.num_local_experts

    def layer_kinds(self) -> list[str]:
        """Qwen3MoeModel: the sliding mask on every layer when there is a window (use_sliding_window)."""
        return [SLIDING if self.effective_window() is not None else FULL] * self.num_hidden_layers

    sparse = Qwen2MoeConfig.sparse  # Qwen3MoeDecoderLayer: Qwen2MoeDecoderLayer's rule


class Qwen3MoeSparseMoeBlock(nn.Module):
    """The router (``gate``, Qwen2-MoE's) and the stacked experts of width ``intermediate_size``; no shared expert."""

    # PEFT 0.21's MoE conversion ("qwen3_moe" and "olmoe" map to "qwen2_moe"'s): these target_modules names become
    # target_parameters (gate_proj and up_proj together, fused at twice the rank); a string target_modules is
    # resolved to leaf names first (flodl_hf.lora.targets._resolve_moe_string)
    peft_moe_targets = {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                        "down_proj": "down_proj"}
    peft_moe_fused = {"gate_up_proj": ("gate_proj", "up_proj")}
    gate_first: ClassVar[bool] = False  # the modules' (parameters') order: Qwen3MoeSparseMoeBlock builds experts first

    def __init__(self, config: Any, intermediate_size: int) -> None:
        super().__init__()
        if self.gate_first:
            self.gate = Qwen2MoeTopKRouter(config)
        self.experts = MixtralExperts(config, intermediate_size)
        if not self.gate_first:
            self.gate = Qwen2MoeTopKRouter(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Qwen3MoeSparseMoeBlock.forward (OlmoeSparseMoeBlock's too): the flat states routed, run, reshaped back
        batch, length, hidden = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden)
        _, weights, index = self.gate(hidden_states)
        return self.experts(hidden_states, index, weights).reshape(batch, length, hidden)


class Qwen3MoeModel(MixtralModel):
    attention_class = Qwen3Attention

    @classmethod
    def layer_mlp(cls, config: Qwen3MoeConfig, layer_idx: int) -> nn.Module:
        # Qwen3MoeDecoderLayer: the sparse block, or Qwen3MoeMLP of width intermediate_size
        if config.sparse(layer_idx):
            return Qwen3MoeSparseMoeBlock(config, config.moe_intermediate_size)
        return SwiGLU(config.hidden_size, config.intermediate_size, activation(config.hidden_act))


@register
class Qwen3Moe(Qwen3):
    model_type = "qwen3_moe"
    arch = "Qwen3Moe"
    config_class = Qwen3MoeConfig
    backbone_class = Qwen3MoeModel
    # Qwen3MoeForQuestionAnswering keeps its backbone under "transformer", as Qwen3's (LlamaForQuestionAnswering)
    task_models = {**Qwen3.task_models, "causal_lm": MixtralForCausalLM}
    key_merges = Qwen2Moe.key_merges  # transformers' conversion_mapping: "qwen3_moe" is "qwen2_moe"'s
