"""Extractive question answering: start and end logits per token."""

from __future__ import annotations

import torch
from torch import nn

from flodl_hf.core.modeling import HeadPart, TaskModel
from flodl_hf.core.outputs import QuestionAnsweringModelOutput
from flodl_hf.core.registry import register_task_model


class SpanClassifier(HeadPart):
    """``qa_outputs(dropout(hidden_states))`` -> (B, S, num_labels), num_labels being 2 (start, end)
    as in transformers' config. Dropout is 0 except where a family sets it."""

    def __init__(self, hidden_size: int, num_labels: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.qa_outputs = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.qa_outputs(self.dropout(hidden_states))


@register_task_model
class ModelForQuestionAnswering(TaskModel):
    task = "qa"

    @classmethod
    def default_head(cls, family, config) -> HeadPart:
        """``qa_outputs`` over every token, ``num_labels`` (2: start, end) wide."""
        return SpanClassifier(config.hidden_size, config.num_labels)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, start_positions: torch.Tensor | None = None,
                end_positions: torch.Tensor | None = None, *,
                num_items_in_batch: torch.Tensor | int | None = None) -> QuestionAnsweringModelOutput:
        """``num_items_in_batch`` changes the loss only where the family's transformers head reads it
        (``Family.num_items_tasks``: ModernBERT's, the decoders'): each side's sum divided by it."""
        return self.spans(self.run_backbone(input_ids=input_ids, attention_mask=attention_mask,
                                            token_type_ids=token_type_ids, position_ids=position_ids,
                                            inputs_embeds=inputs_embeds),
                          attention_mask, start_positions, end_positions, num_items_in_batch)

    def spans(self, out, attention_mask: torch.Tensor | None, start_positions: torch.Tensor | None,
              end_positions: torch.Tensor | None, num_items_in_batch: torch.Tensor | int | None
              ) -> QuestionAnsweringModelOutput:
        """The head on the backbone's output ``out``: start and end logits, and the loss given both positions."""
        logits = self.head(out.last_hidden_state, out.pooler_output, attention_mask)
        start_logits, end_logits = logits.split(1, dim=-1)
        start_logits = start_logits.squeeze(-1).contiguous()
        end_logits = end_logits.squeeze(-1).contiguous()
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = self.compute_loss((start_logits, end_logits), start_positions=start_positions,
                                     end_positions=end_positions, num_items_in_batch=num_items_in_batch)
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits)
