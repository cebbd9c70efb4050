"""Sequence classification: one vector per sequence -> ``num_labels`` logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flodl_hf.core.config import ProblemType
from flodl_hf.core.modeling import HeadPart, TaskModel
from flodl_hf.core.outputs import SequenceClassifierOutput


class PooledClassifier(HeadPart):
    """``classifier(dropout(pooler_output))``: BERT's and ALBERT's head, and most multiple-choice heads."""

    uses_pooler = True

    def __init__(self, hidden_size: int, num_outputs: int, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, num_outputs)

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.classifier(self.dropout(pooler_output))


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor,
                                 problem_type: ProblemType | None) -> torch.Tensor:
    """transformers' rule: regression for one label, single-label for integer labels, else multi-label."""
    num_labels = logits.size(-1)
    if problem_type is None:
        if num_labels == 1:
            problem_type = ProblemType.REGRESSION
        elif labels.dtype in (torch.long, torch.int):
            problem_type = ProblemType.SINGLE_LABEL
        else:
            problem_type = ProblemType.MULTI_LABEL
    if problem_type == ProblemType.REGRESSION:
        if num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze())
        return F.mse_loss(logits, labels)
    if problem_type == ProblemType.SINGLE_LABEL:
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels)


class ModelForSequenceClassification(TaskModel):
    task = "seqcls"

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                num_items_in_batch: torch.Tensor | int | None = None) -> SequenceClassifierOutput:
        """``num_items_in_batch`` is taken as transformers' heads take it, and ignored as every family's
        transformers sequence classifier ignores it."""
        logits, loss = self.logits_and_loss(labels, num_items_in_batch, input_ids=input_ids,
                                            attention_mask=attention_mask, token_type_ids=token_type_ids,
                                            position_ids=position_ids, inputs_embeds=inputs_embeds)
        if labels is not None:
            # the family may return the logits its loss read (DeBERTa-v2's regression)
            logits = self.family.sequence_logits(logits, labels, self.config)
        return SequenceClassifierOutput(loss=loss, logits=logits)
