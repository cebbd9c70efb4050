"""Multiple choice: inputs (B, choices, S); one score per choice."""

from __future__ import annotations

import torch

from flodl_hf.modeling import TaskModel
from flodl_hf.outputs import MultipleChoiceModelOutput


def _flat(t: torch.Tensor | None, keep: int) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1, *t.shape[-keep:])


class ModelForMultipleChoice(TaskModel):
    task = "mc"

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
