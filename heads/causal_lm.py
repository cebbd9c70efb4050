"""Causal language modelling: next-token logits from a decoder, with a KV cache.

The task (``causal_lm``, transformers' ``AutoModelForCausalLM``) is registered here, as a task the decoder
families declare (``core=False``: the verify matrix asks only them). The head is ``lm_head``, a bias-free
linear tied to the input embeddings when ``tie_word_embeddings`` is true.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.modeling import HeadPart, TaskModel
from flodl_hf.outputs import CausalLMOutput
from flodl_hf.task_registry import Task, register_task


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


def causal_lm_loss(model: Any, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """transformers.loss.loss_utils.ForCausalLMLoss: float32 logits, labels padded by one ``ignore_index`` and
    shifted left (token t predicts label t + 1), mean cross entropy over the labels that are not ignored."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, logits.shape[-1])
    shift_labels = shift_labels.view(-1).to(logits.device)
    return F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="mean")


def keep_last(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """modeling_utils.slice_logits_to_keep: the last ``n`` positions (0: all), or the positions a tensor names."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return hidden[:, logits_to_keep, :]


class ModelForCausalLM(TaskModel):
    task = "causal_lm"

    def get_output_embeddings(self) -> nn.Module:
        return self.head.output_embeddings()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                token_type_ids: torch.Tensor | None = None, past_key_values: Any = None) -> CausalLMOutput:
        """Logits for the kept positions; ``cache`` in (a KVCache, or per-layer (keys, values);
        ``past_key_values`` is transformers' older name for it) and out (the cache after this step, when
        ``use_cache``, which defaults to the config's)."""
        out = self.run_backbone(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                position_ids=position_ids, inputs_embeds=inputs_embeds,
                                cache=cache, past_key_values=past_key_values, use_cache=use_cache)
        logits = self.head(keep_last(out.last_hidden_state, logits_to_keep), None, attention_mask)
        loss = None
        if labels is not None:
            loss = self.compute_loss(logits, labels=labels)
        return CausalLMOutput(loss=loss, logits=logits, cache=out.cache)


CAUSAL_LM = register_task(Task(
    "causal_lm", "ForCausalLM", "AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", CausalLMOutput,
    "causal_lm_head", "flodl_hf.heads.causal_lm:ModelForCausalLM", causal_lm_loss, core=False))
