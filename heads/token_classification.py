"""Token classification: ``num_labels`` logits per token; label -100 is ignored in the loss."""

from __future__ import annotations

import torch
from torch import nn

from flodl_hf.core.modeling import HeadPart, TaskModel
from flodl_hf.core.outputs import TokenClassifierOutput
from flodl_hf.core.registry import register_task_model


class TokenClassifier(HeadPart):
    """``classifier(dropout(hidden_states))``: the token head of every BERT-lineage family."""

    def __init__(self, hidden_size: int, num_labels: int, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.classifier(self.dropout(hidden_states))


@register_task_model
class ModelForTokenClassification(TaskModel):
    task = "tokcls"

    @classmethod
    def default_head(cls, family, config) -> HeadPart:
        """``classifier(dropout(hidden_states))``, dropout from ``Family.classifier_dropout``."""
        return TokenClassifier(config.hidden_size, config.num_labels, family.classifier_dropout(config))

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                num_items_in_batch: torch.Tensor | int | None = None) -> TokenClassifierOutput:
        """``num_items_in_batch`` is taken as transformers' heads take it; it changes the loss only where the
        family's transformers head reads it (``Family.num_items_tasks``)."""
        logits, loss = self.logits_and_loss(labels, num_items_in_batch, input_ids=input_ids,
                                            attention_mask=attention_mask, token_type_ids=token_type_ids,
                                            position_ids=position_ids, inputs_embeds=inputs_embeds)
        return TokenClassifierOutput(loss=loss, logits=logits)
