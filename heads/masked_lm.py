"""Masked language modelling: vocabulary logits per token; label -100 is ignored in the loss.

The LM head part is the family's (names and layer order differ per family); the
decoder is tied to the input embeddings unless ``tie_word_embeddings`` is false.
"""

from __future__ import annotations

import torch

from flodl_hf.core.layers import gather_rows
from flodl_hf.core.modeling import TaskModel
from flodl_hf.core.outputs import MaskedLMOutput
from flodl_hf.core.registry import register_task_model


@register_task_model
class ModelForMaskedLM(TaskModel):
    task = "mlm"

    def get_output_embeddings(self):
        return self.head.output_embeddings()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                num_items_in_batch: torch.Tensor | int | None = None) -> MaskedLMOutput:
        """``num_items_in_batch`` (transformers' gradient-accumulation count) changes the loss only where the
        family's transformers head reads it (``Family.num_items_tasks``; ``losses.counted_items``)."""
        logits, loss = self.logits_and_loss(labels, num_items_in_batch, input_ids=input_ids,
                                            attention_mask=attention_mask, token_type_ids=token_type_ids,
                                            position_ids=position_ids, inputs_embeds=inputs_embeds)
        return MaskedLMOutput(loss=loss, logits=logits)

    def logits_at(self, rows: torch.Tensor, columns: torch.Tensor, input_ids: torch.Tensor | None = None,
                  attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                  exact: bool = True, **inputs) -> torch.Tensor:
        """The vocabulary logits at tokens ``(rows[i], columns[i])`` only, (N, vocab): what
        ``forward(...).logits[rows, columns]`` holds, bit for bit. The LM head (a vocabulary-wide matrix
        product, a quarter of a BERT-base forward) runs on those tokens only where that was proven
        bit-equal on this machine for this shape class (``flodl_hf.core.layers.gather_rows``); otherwise on
        every token. ``exact=False`` (fast precisions) always takes the shortcut."""
        out = self.run_backbone(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                **inputs)
        hidden = out.last_hidden_state
        return gather_rows(lambda picked: self.head(picked, None, None), self.head, hidden,
                            rows * hidden.shape[1] + columns,
                            lambda: self.head(hidden, out.pooler_output, attention_mask), exact=exact)
