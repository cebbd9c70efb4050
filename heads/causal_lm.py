"""Causal language modelling: next-token logits from a decoder, with a KV cache.

The task (``causal_lm``, transformers' ``AutoModelForCausalLM``) is registered here, as a task the decoder
families declare (``core=False``: the verify matrix asks only them). The head is ``lm_head``, a bias-free
linear tied to the input embeddings when ``tie_word_embeddings`` is true. Generation (``generate``,
``generation_config``, and the generation_config.json that ``save_pretrained`` writes) is inherited from
``flodl_hf.generation.GenerationMixin``, as transformers' causal LMs inherit its ``GenerationMixin``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.modeling import HeadPart, TaskModel
from flodl_hf.core.outputs import CausalLMOutput
from flodl_hf.core.registry import Task, register_task, register_task_model
from flodl_hf.generation import GenerationMixin


class LMHead(HeadPart):
    """``lm_head(hidden_states)``: LlamaForCausalLM's head (no bias)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden_states)


def causal_lm_loss(model: Any, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None,
                   num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """transformers.loss.loss_utils.ForCausalLMLoss: float32 logits, labels padded by one ``ignore_index`` and
    shifted left (token t predicts label t + 1) unless ``shift_labels`` are given (then used as they are), mean
    cross entropy over the labels that are not ignored; with ``num_items_in_batch`` (fixed_cross_entropy), the
    sum divided by it."""
    logits = logits.float()
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, logits.shape[-1])
    shift_labels = shift_labels.view(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def keep_last(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """modeling_utils.slice_logits_to_keep: the last ``n`` positions (0: all), or the positions a tensor names."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return hidden[:, logits_to_keep, :]


class ModelForCausalLM(GenerationMixin, TaskModel):
    task = "causal_lm"

    def get_output_embeddings(self) -> nn.Module:
        return self.head.output_embeddings()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0, *,
                token_type_ids: torch.Tensor | None = None, past_key_values: Any = None,
                cache_position: Any = None, shift_labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | int | None = None) -> CausalLMOutput:
        """Logits for the kept positions; ``cache`` in (a KVCache, or per-layer (keys, values);
        ``past_key_values`` is transformers' older name for it) and out (the cache after this step, when
        ``use_cache``, which defaults to the config's). With ``labels``, ForCausalLMLoss, which takes
        ``shift_labels`` and ``num_items_in_batch``. ``cache_position`` is taken and unused, as transformers
        5.24's LLaMA, Mistral and Qwen2 take it (positions come from ``position_ids``, else the cache's length)."""
        out = self.run_backbone(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                position_ids=position_ids, inputs_embeds=inputs_embeds,
                                cache=cache, past_key_values=past_key_values, use_cache=use_cache)
        logits = self.head(keep_last(out.last_hidden_state, logits_to_keep), None, attention_mask)
        loss = None
        if labels is not None:
            loss = self.compute_loss(logits, labels=labels, shift_labels=shift_labels,
                                     num_items_in_batch=num_items_in_batch)
        return CausalLMOutput(loss=loss, logits=logits, cache=out.cache)


register_task_model(ModelForCausalLM)
CAUSAL_LM = register_task(Task(
    "causal_lm", "ForCausalLM", "AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", CausalLMOutput,
    "causal_lm_head", "flodl_hf.heads.causal_lm:ModelForCausalLM", causal_lm_loss, core=False))
