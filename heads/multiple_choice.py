"""Multiple choice: inputs (B, choices, S); one score per choice."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flodl_hf.core.layers import activation
from flodl_hf.core.modeling import HeadPart, TaskModel
from flodl_hf.core.outputs import MultipleChoiceModelOutput
from flodl_hf.core.registry import register_task_model
from flodl_hf.heads.sequence_classification import PooledClassifier


def _flat(t: torch.Tensor | None, keep: int) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1, *t.shape[-keep:])


@register_task_model
class ModelForMultipleChoice(TaskModel):
    task = "mc"

    @classmethod
    def default_head(cls, family, config) -> HeadPart:
        """BERT's choice head: one score per choice from the pooled output, ``classifier(dropout(pooler_output))``."""
        return PooledClassifier(config.hidden_size, 1, family.classifier_dropout(config))

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                num_items_in_batch: torch.Tensor | int | None = None) -> MultipleChoiceModelOutput:
        """``num_items_in_batch`` is taken as transformers' heads take it, and ignored as theirs ignore it."""
        num_choices = input_ids.shape[1] if input_ids is not None else inputs_embeds.shape[1]
        out = self.run_backbone(input_ids=_flat(input_ids, 1), attention_mask=_flat(attention_mask, 1),
                                token_type_ids=_flat(token_type_ids, 1), position_ids=_flat(position_ids, 1),
                                inputs_embeds=_flat(inputs_embeds, 2))
        logits = self.head(out.last_hidden_state, out.pooler_output, _flat(attention_mask, 1))
        logits = logits.view(-1, num_choices)
        loss = None
        if labels is not None:
            loss = self.compute_loss(logits, labels=labels, num_items_in_batch=num_items_in_batch)
        return MultipleChoiceModelOutput(loss=loss, logits=logits)


class SequenceSummary(nn.Module):
    """transformers' ``SequenceSummary`` (ELECTRA's ``ElectraSequenceSummary``, GPT-2's ``GPT2SequenceSummary``): one
    vector per sequence (``summary_type``: first, last, mean, or cls_index: the token ``cls_index`` names, the last
    one without it), then ``first_dropout``, the ``summary`` projection (``summary_use_proj``: to ``num_labels``
    with ``summary_proj_to_labels``, else to the hidden size), ``summary_activation`` and ``last_dropout``. A
    dropout of probability 0 draws nothing, as transformers' ``nn.Identity`` there."""

    def __init__(self, config: Any, num_labels: int) -> None:
        super().__init__()
        self.summary_type = config.summary_type
        self.summary: nn.Module = nn.Identity()
        if config.summary_use_proj:
            out = num_labels if config.summary_proj_to_labels and num_labels > 0 else config.hidden_size
            self.summary = nn.Linear(config.hidden_size, out)
        self.activation = activation(config.summary_activation) if config.summary_activation else nn.Identity()
        self.first_dropout = nn.Dropout(config.summary_first_dropout)
        self.last_dropout = nn.Dropout(config.summary_last_dropout)

    def forward(self, hidden_states: torch.Tensor, cls_index: torch.Tensor | None = None) -> torch.Tensor:
        # SequenceSummary.forward: pick, first_dropout, summary, activation, last_dropout
        if self.summary_type == "first":
            output = hidden_states[:, 0]
        elif self.summary_type == "mean":
            output = hidden_states.mean(dim=1)
        elif self.summary_type == "last":
            output = hidden_states[:, -1]
        else:  # cls_index: gather along the sequence (the last position where no index is given)
            if cls_index is None:
                index = torch.full_like(hidden_states[..., :1, :], hidden_states.shape[-2] - 1, dtype=torch.long)
            else:
                index = cls_index[..., None, None].expand(*cls_index.shape, 1, hidden_states.shape[-1])
            output = hidden_states.gather(-2, index).squeeze(-2)
        return self.last_dropout(self.activation(self.summary(self.first_dropout(output))))
