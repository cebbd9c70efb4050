"""Mixtral (``model_type: mixtral``): Mistral with a sparse mixture-of-experts MLP in every layer.

Mirrors ``transformers.models.mixtral.modeling_mixtral`` (5.25):
- ``mlp.gate`` (MixtralTopKRouter): ``F.linear`` to one logit per expert, softmax in float32, the top
  ``num_experts_per_tok`` probabilities renormalised to sum to one;
- ``mlp.experts`` (MixtralExperts): every expert's ``w1``/``w3`` stacked as one (experts, 2 x intermediate, hidden)
  ``gate_up_proj`` and its ``w2`` as one (experts, hidden, intermediate) ``down_proj``; run as transformers' default
  ``experts_implementation``, ``grouped_mm`` (integrations/moe.py ``grouped_mm_experts_forward``: token-expert pairs
  sorted by expert, ``grouped_mm`` up and down, weighted, unsorted, summed per token). transformers' other
  implementations (``eager``'s per-expert loop, ``batched_mm``) give other bits and are refused at load
  (``experts_implementation``, auto.py);
- files keep the per-expert layout (``block_sparse_moe.experts.{e}.w1/w2/w3.weight``, ``block_sparse_moe.gate``),
  which transformers converts at load and writes back on save: ``Mixtral.key_merges`` (keys.Merge), from which load
  merges and export splits; a file in the module layout (``mlp.experts.gate_up_proj``) loads as it is;
- ``router_jitter_noise`` in training multiplies the router's input by uniform noise, as MixtralSparseMoeBlock;
- ``output_router_logits`` (the config's, or the forward's keyword): the backbone returns each sparse layer's router
  logits (``router_logits``), the causal LM the load-balancing ``aux_loss`` (``load_balancing_loss_func``) and, with
  labels, adds ``router_aux_loss_coef`` times it to the loss.
Heads: transformers' five (base, causal_lm, seqcls, tokcls, qa), as Mistral's."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.errors import InputError
from flodl_hf.heads.causal_lm import ModelForCausalLM, keep_last
from flodl_hf.core.keys import Merge
from flodl_hf.core.layers import activation
from flodl_hf.core.outputs import BaseModelOutputWithPast, ModelOutput
from flodl_hf.core.registry import register

from .llama import LlamaModel
from .mistral import Mistral, MistralConfig


@dataclass
class MixtralConfig(MistralConfig):
    model_type: ClassVar[str] = "mixtral"
    returns_given_cache: ClassVar[bool] = True  # as its transformers *Model.forward
    default_theta: ClassVar[float] = 1_000_000.0

    rms_norm_eps: float = 1e-5
    sliding_window: int | None = None
    num_experts_per_tok: int = 2
    num_local_experts: int = 8
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MixtralConfig":
        # MixtralConfig.attribute_map: a config.json's num_experts sets num_local_experts (and wins over it, as the
        # alias set after the dataclass fields in transformers)
        return alias_from_dict(super().from_dict, data, "num_experts", "num_local_experts", alias_wins=True)

    @property
    def num_experts(self) -> int:
        """MixtralConfig.attribute_map's name for ``num_local_experts``."""
        return self.num_local_experts


def alias_from_dict(parent_from_dict: Callable[[dict[str, Any]], Any], data: dict[str, Any], alias: str, field: str,
                    alias_wins: bool) -> Any:
    """A config.json's ``attribute_map`` name ``alias`` read into the dataclass field ``field``: where both are given,
    the alias wins when transformers sets it after the fields (``alias_wins``), else the field; the config is written
    back as it came (``raw``)."""
    if alias in data and (alias_wins or field not in data):
        config = parent_from_dict({**data, field: data[alias]})
        config.raw = copy.deepcopy(dict(data))
        return config
    return parent_from_dict(data)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """integrations/moe.py ``_grouped_mm``: torch's grouped_mm where transformers uses it, else its fallback (one
    ``torch.mm`` per expert's rows into a zeroed output)."""
    x = x.to(weight.dtype)
    usable = (torch.cuda.get_device_capability(weight.device) >= (8, 0) if weight.device.type == "cuda"
              else weight.device.type == "cpu")
    if usable and hasattr(F, "grouped_mm"):
        return F.grouped_mm(x, weight, offs=offsets)
    if usable and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, weight, offs=offsets)
    out = torch.zeros(x.size(0), weight.size(2), device=x.device, dtype=x.dtype)
    start = 0
    for i, end in enumerate(offsets.tolist()):
        if start != end:
            out[start:end] = torch.mm(x[start:end], weight[i])
        start = end
    return out


class MixtralTopKRouter(nn.Module):
    """``weight`` (experts, hidden): the logits, and each token's top-k experts with their renormalised weights."""

    fresh_init = {"weight": "normal"}  # MixtralPreTrainedModel._init_weights: normal(initializer_range)

    def __init__(self, config: MixtralConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # MixtralTopKRouter.forward: softmax of the float32 logits, topk, divided in place by their sum
        logits = F.linear(hidden_states, self.weight)
        probs = F.softmax(logits.float(), dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return logits, top, index


class MixtralExperts(nn.Module):
    """Every expert's SwiGLU, stacked: ``gate_up_proj`` (experts, 2 x intermediate, hidden), ``down_proj``
    (experts, hidden, intermediate)."""

    fresh_init = {"gate_up_proj": "normal", "down_proj": "normal"}  # MixtralPreTrainedModel._init_weights

    def __init__(self, config: MixtralConfig, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * intermediate_size, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, intermediate_size))
        self.act = activation(config.hidden_act)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # grouped_mm_experts_forward: pairs sorted by expert, grouped up/down projections on the transposed weights,
        # weighted, put back in pair order and summed over each token's k pairs
        top_k, tokens, hidden = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        states = hidden_states[perm // top_k]
        weights = top_k_weights.reshape(-1)[perm]
        # histc on float ids on CPU and MPS, on int ids elsewhere, as transformers
        ids = expert_ids.float() if hidden_states.device.type in ("cpu", "mps") else expert_ids.int()
        counts = torch.histc(ids, bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = grouped_mm(states, self.gate_up_proj.transpose(-2, -1), offsets).chunk(2, dim=-1)
        out = grouped_mm(self.act(gate) * up, self.down_proj.transpose(-2, -1), offsets)
        out = out * weights.unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0), device=perm.device)
        return out[inverse].view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


class MixtralSparseMoeBlock(nn.Module):
    """The layer's MLP: the router (``gate``) picks each token's experts, ``experts`` runs them."""

    # PEFT 0.21's transformers-5 conversion for "mixtral": transformers 4's expert names in target_modules become
    # target_parameters (w1 and w3 together, fused at twice the rank); a string target_modules is resolved to
    # leaf names first (flodl_hf.lora.targets._resolve_moe_string)
    peft_moe_targets = {"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}
    peft_moe_fused = {"gate_up_proj": ("w1", "w3")}

    def __init__(self, config: MixtralConfig) -> None:
        super().__init__()
        self.jitter_noise = config.router_jitter_noise
        self.gate = MixtralTopKRouter(config)
        self.experts = MixtralExperts(config, config.intermediate_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # MixtralSparseMoeBlock.forward: the jitter (training only) multiplies the normed states in place
        batch, length, hidden = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        hidden_states = hidden_states.view(-1, hidden)
        _, weights, index = self.gate(hidden_states)
        return self.experts(hidden_states, index, weights).reshape(batch, length, hidden)


@dataclass
class MoeModelOutputWithPast(BaseModelOutputWithPast):
    router_logits: tuple[torch.Tensor, ...] | None = None  # each sparse layer's, with output_router_logits


@dataclass
class MoeCausalLMOutputWithPast(ModelOutput):
    """transformers' MoeCausalLMOutputWithPast, in its field order."""

    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None) -> torch.Tensor:
    """load_balancing_loss_func (Switch Transformer's aux loss), op for op: per layer, the softmax of the logits and
    their top-k; the picks counted (histc, or with a mask a scatter_add_ of it) and the probabilities summed, over
    every row or the unmasked ones; num_experts * sum(tokens_per_expert * router_prob_per_expert)."""
    if not router_logits:  # transformers fails with an IndexError here
        raise InputError("output_router_logits: no layer of this model is sparse (mlp_only_layers, decoder_sparse_step)")
    device = router_logits[0].device
    histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
    tokens = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows: Any = 0.0
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
        if flat_mask.numel() != router_logits[0].shape[0]:  # transformers fails with a shape error here
            raise InputError(f"output_router_logits: the attention mask covers {flat_mask.numel()} tokens, the router "
                             f"saw {router_logits[0].shape[0]} (a step on a KV cache); pass output_router_logits=False")
    for logits in router_logits:
        weights = F.softmax(logits.to(device), dim=-1)
        _, picks = torch.topk(weights, top_k, dim=-1)
        if attention_mask is None:
            tokens = tokens + torch.histc(picks.reshape(-1).to(histc_dtype), bins=num_experts, min=0, max=num_experts)
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            tokens = tokens + torch.zeros(num_experts, dtype=torch.float32, device=device).scatter_add_(
                0, picks.reshape(-1), flat_mask.repeat_interleave(top_k))
            probs = probs + (weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + flat_mask.sum()
    return torch.sum((tokens / rows) * (probs / rows).unsqueeze(0)) * num_experts


class MixtralModel(LlamaModel):
    """LLaMA's backbone with the sparse MoE MLP; with ``output_router_logits`` (the config's by default) its output
    carries each sparse layer's router logits, in layer order (transformers records MixtralTopKRouter's output 0)."""

    input_names = (*LlamaModel.input_names, "output_router_logits")

    @classmethod
    def make_mlp(cls, config: MixtralConfig) -> nn.Module:
        return MixtralSparseMoeBlock(config)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None, *,
                token_type_ids: torch.Tensor | None = None, past_key_values: Any = None,
                output_router_logits: bool | None = None) -> MoeModelOutputWithPast:
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        records: list[torch.Tensor] = []
        hooks = [layer.mlp.gate.register_forward_hook(lambda module, args, out: records.append(out[0]))
                 for layer in self.layers
                 if output_router_logits and isinstance(getattr(layer.mlp, "gate", None), MixtralTopKRouter)]
        try:
            out = super().forward(input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache,
                                  token_type_ids=token_type_ids, past_key_values=past_key_values)
        finally:
            for hook in hooks:
                hook.remove()
        return MoeModelOutputWithPast(last_hidden_state=out.last_hidden_state, cache=out.cache,
                                      router_logits=tuple(records) if output_router_logits else None)


class MixtralForCausalLM(ModelForCausalLM):
    """MixtralForCausalLM.forward, in its positional order (``output_router_logits`` before ``logits_to_keep``): with
    ``output_router_logits`` (the config's by default) the aux loss of the backbone's router logits, added to the loss
    times ``router_aux_loss_coef`` when there are labels."""

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, output_router_logits: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, *, token_type_ids: torch.Tensor | None = None,
                past_key_values: Any = None, cache_position: Any = None, shift_labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> MoeCausalLMOutputWithPast:
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        out = self.run_backbone(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                position_ids=position_ids, inputs_embeds=inputs_embeds, cache=cache,
                                past_key_values=past_key_values, use_cache=use_cache,
                                output_router_logits=output_router_logits)
        logits = self.head(keep_last(out.last_hidden_state, logits_to_keep), None, attention_mask)
        loss = aux_loss = None
        if labels is not None:
            loss = self.compute_loss(logits, labels=labels, shift_labels=shift_labels,
                                     num_items_in_batch=num_items_in_batch)
        if output_router_logits:
            aux_loss = load_balancing_loss(out.router_logits, self.config.num_experts,
                                           self.config.num_experts_per_tok, attention_mask)
            if labels is not None:  # MixtralForCausalLM.forward: loss += coef * aux_loss
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits, cache=out.cache,
                                         router_logits=out.router_logits)


@register
class Mixtral(Mistral):
    model_type = "mixtral"
    arch = "Mixtral"
    config_class = MixtralConfig
    backbone_class = MixtralModel
    task_models = {**Mistral.task_models, "causal_lm": MixtralForCausalLM}
    # transformers' conversion_mapping "mixtral": the hub's per-expert layout <-> the stacked module tensors
    key_merges = (
        Merge("mlp.gate.weight", ("block_sparse_moe.gate.weight",)),
        Merge("mlp.experts.gate_up_proj", ("block_sparse_moe.experts.{}.w1.weight",
                                           "block_sparse_moe.experts.{}.w3.weight"), dim=1),
        Merge("mlp.experts.down_proj", ("block_sparse_moe.experts.{}.w2.weight",)),
    )
