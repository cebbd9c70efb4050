"""Image classification: the image's tokens -> ``num_labels`` logits (``AutoModelForImageClassification``).

The head part is the family's (ViT's and DeiT's read the CLS token; DINOv2's the CLS token beside the mean of the
patch tokens); the loss is transformers' ``ForImageClassification`` rule (``losses.image_classification_loss``)."""

from __future__ import annotations

import torch
from torch import nn

from flodl_hf.core.modeling import HeadPart, TaskModel
from flodl_hf.core.outputs import ImageClassifierOutput
from flodl_hf.core.registry import register_task_model


class ClsTokenClassifier(HeadPart):
    """``classifier(h[:, 0, :])`` (ViTForImageClassification)."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden_states: torch.Tensor, pooler_output: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.classifier(hidden_states[:, 0, :])


@register_task_model
class ModelForImageClassification(TaskModel):
    task = "image_classification"

    @classmethod
    def default_head(cls, family, config) -> HeadPart:
        """ViT's head: a linear layer on the CLS token's last hidden state."""
        return ClsTokenClassifier(config.hidden_size, config.num_labels)

    def forward(self, pixel_values: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                interpolate_pos_encoding: bool | None = None, attention_mask: torch.Tensor | None = None, *,
                num_items_in_batch: torch.Tensor | int | None = None) -> ImageClassifierOutput:
        """``num_items_in_batch`` divides the single-label loss's sum where the family's transformers head hands
        it to ``loss_function`` (``Family.num_items_tasks``)."""
        logits, loss = self.logits_and_loss(labels, num_items_in_batch, pixel_values=pixel_values,
                                            interpolate_pos_encoding=interpolate_pos_encoding,
                                            attention_mask=attention_mask)
        return ImageClassifierOutput(loss=loss, logits=logits)
