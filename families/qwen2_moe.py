"""Qwen2-MoE (``model_type: qwen2_moe``): Qwen2 with a sparse mixture-of-experts MLP and a gated shared expert.

Mirrors ``transformers.models.qwen2_moe.modeling_qwen2_moe`` (5.25), on Mixtral's parts (families/mixtral.py):
- ``mlp.gate`` (Qwen2MoeTopKRouter): softmax in float32, top ``num_experts_per_tok``, renormalised only with
  ``norm_topk_prob``, then cast to the logits' dtype;
- ``mlp.experts``: ``num_experts`` experts of width ``moe_intermediate_size``, stacked and run as Mixtral's
  (grouped_mm, transformers' default); files hold them per expert (``mlp.experts.{e}.gate_proj/up_proj/down_proj``),
  merged on load and split on export (``Qwen2Moe.key_merges``);
- ``mlp.shared_expert`` (a SwiGLU of width ``shared_expert_intermediate_size``) times
  ``sigmoid(mlp.shared_expert_gate(h))``, added to the experts' output;
- a layer is sparse unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` (then a dense SwiGLU of
  width ``intermediate_size``), as Qwen2MoeDecoderLayer;
- q/k/v biases with ``qkv_bias``, none on o_proj; sliding layers, with ``use_sliding_window``, the even-indexed ones
  below ``max_window_layers`` (Qwen2MoeConfig's ``layer_types``), or those ``layer_types`` names.
``output_router_logits`` returns the sparse layers' router logits and the aux loss, as Mixtral's. Heads: base,
causal_lm, seqcls, tokcls, qa."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.decoder import SwiGLU
from flodl_hf.core.keys import Merge
from flodl_hf.core.layers import activation
from flodl_hf.core.registry import register

from .llama import FULL, SLIDING, DecoderForQuestionAnswering
from .mixtral import MixtralExperts, MixtralForCausalLM, MixtralModel, MixtralTopKRouter
from .qwen2 import Qwen2, Qwen2Config


@dataclass
class Qwen2MoeConfig(Qwen2Config):
    model_type: ClassVar[str] = "qwen2_moe"
    # Qwen2MoeConfig writes sliding_window 0 without use_sliding_window (a window in use must still be positive)
    unset_values: ClassVar[dict[str, tuple[Any, ...]]] = {"sliding_window": (0,)}

    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 16
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    num_experts_per_tok: int = 4
    num_experts: int = 60
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: list[int] | None = None
    qkv_bias: bool = True

    def biases(self) -> tuple[bool, bool, bool]:
        return self.qkv_bias, False, False  # Qwen2MoeAttention: q/k/v with qkv_bias, o_proj without; MLPs without

    def layer_kinds(self) -> list[str]:
        """Qwen2MoeConfig.__post_init__: with use_sliding_window, the even-indexed layers below max_window_layers."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return [SLIDING if (i + 1) % 2 and i < self.max_window_layers and self.use_sliding_window else FULL
                for i in range(self.num_hidden_layers)]

    def sparse(self, layer_idx: int) -> bool:
        """Qwen2MoeDecoderLayer: an MoE MLP unless in mlp_only_layers or off the decoder_sparse_step."""
        return (layer_idx not in (self.mlp_only_layers or []) and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


class Qwen2MoeTopKRouter(MixtralTopKRouter):
    def __init__(self, config: Qwen2MoeConfig) -> None:
        super().__init__(config)
        self.norm_topk_prob = config.norm_topk_prob

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Qwen2MoeTopKRouter.forward: float32 softmax, topk, renormalised in place with norm_topk_prob, then the
        # weights cast to the logits' dtype
        logits = F.linear(hidden_states, self.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: Qwen2MoeConfig) -> None:
        super().__init__()
        self.gate = Qwen2MoeTopKRouter(config)
        self.experts = MixtralExperts(config, config.moe_intermediate_size)
        self.shared_expert = SwiGLU(config.hidden_size, config.shared_expert_intermediate_size,
                                    activation(config.hidden_act))
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Qwen2MoeSparseMoeBlock.forward: shared expert, routed experts, then experts + sigmoid(gate) * shared
        batch, length, hidden = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden)
        shared = self.shared_expert(hidden_states)
        _, weights, index = self.gate(hidden_states)
        out = self.experts(hidden_states, index, weights)
        shared = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return (out + shared).reshape(batch, length, hidden)


class Qwen2MoeModel(MixtralModel):
    @classmethod
    def layer_mlp(cls, config: Qwen2MoeConfig, layer_idx: int) -> nn.Module:
        # Qwen2MoeDecoderLayer: the sparse block, or Qwen2MoeMLP of width intermediate_size
        if config.sparse(layer_idx):
            return Qwen2MoeSparseMoeBlock(config)
        return SwiGLU(config.hidden_size, config.intermediate_size, activation(config.hidden_act))


@register
class Qwen2Moe(Qwen2):
    model_type = "qwen2_moe"
    arch = "Qwen2Moe"
    config_class = Qwen2MoeConfig
    backbone_class = Qwen2MoeModel
    # Qwen2MoeForQuestionAnswering keeps its backbone under "model" (GenericForQuestionAnswering)
    task_models = {**Qwen2.task_models, "qa": DecoderForQuestionAnswering, "causal_lm": MixtralForCausalLM}
    # transformers' conversion_mapping "qwen2_moe": the per-expert layout <-> the stacked module tensors
    key_merges = (
        Merge("mlp.experts.gate_up_proj", ("mlp.experts.{}.gate_proj.weight", "mlp.experts.{}.up_proj.weight"),
              dim=1),
        Merge("mlp.experts.down_proj", ("mlp.experts.{}.down_proj.weight",)),
    )
