"""Sequence classification: one vector per sequence -> ``num_labels`` logits."""

from __future__ import annotations

import torch
from torch import nn

from flodl_hf.core.modeling import HeadPart, TaskModel
from flodl_hf.core.outputs import SequenceClassifierOutput
from flodl_hf.core.registry import register_task_model


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


@register_task_model
class ModelForSequenceClassification(TaskModel):
    task = "seqcls"

    @classmethod
    def default_head(cls, family, config) -> HeadPart:
        """BERT's head, ``classifier(dropout(pooler_output))``, dropout from ``Family.classifier_dropout``."""
        return PooledClassifier(config.hidden_size, config.num_labels, family.classifier_dropout(config))

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
