"""Task losses, as transformers computes them, op for op: the task registry (``flodl_hf.core.registry``) names
one per task, and ``TaskModel.compute_loss`` calls it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flodl_hf.core.config import ProblemType

def counted_items(model: Any, num_items_in_batch: Any) -> Any:
    """``num_items_in_batch`` where transformers' model of this family and task hands it to its loss, else None.

    transformers' task heads all take ``num_items_in_batch`` (through ``**kwargs``, for gradient accumulation);
    only those whose loss is ``self.loss_function(..., **kwargs)`` read it, and there the loss is the sum over
    the batch divided by it (``transformers.loss.loss_utils.fixed_cross_entropy``). Which heads those are
    differs per family (ModernBERT's masked LM and QA, the decoders' QA and causal LM; no BERT-lineage head),
    so the family says so once, in ``Family.num_items_tasks``; every other head accepts it and ignores it."""
    if num_items_in_batch is None:
        return None
    return num_items_in_batch if model.task in model.family.num_items_tasks else None


def fixed_cross_entropy(source: torch.Tensor, target: torch.Tensor, num_items_in_batch: Any = None,
                        ignore_index: int = -100) -> torch.Tensor:
    """transformers.loss.loss_utils.fixed_cross_entropy: the mean, or the sum divided by ``num_items_in_batch``."""
    if num_items_in_batch is None:
        return F.cross_entropy(source, target, ignore_index=ignore_index)
    loss = F.cross_entropy(source, target, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def token_loss(model: Any, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """Cross entropy over every token, label -100 ignored (masked LM, token classification); where the family
    counts items (``counted_items``), transformers' ForMaskedLMLoss: float logits, sum / num_items_in_batch."""
    counted = counted_items(model, num_items_in_batch)
    if counted is None:
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.to(logits.device).view(-1))
    logits = logits.float()
    return fixed_cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1).to(logits.device), counted)


def choice_loss(model: Any, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """Cross entropy over the choices; ``num_items_in_batch`` is ignored (every family's transformers head does)."""
    return F.cross_entropy(logits, labels.to(logits.device))


def sequence_loss(model: Any, logits: torch.Tensor, labels: torch.Tensor,
                  num_items_in_batch: Any = None) -> torch.Tensor:
    """The family's rule (transformers' shared one unless the family has its own, as DeBERTa does);
    ``num_items_in_batch`` is ignored, as every family's transformers head ignores it (the decoders' generic
    head calls ``loss_function`` without it)."""
    return model.family.sequence_loss(logits, labels.to(logits.device), model.config)


def span_loss(model: Any, logits: tuple[torch.Tensor, torch.Tensor], start_positions: torch.Tensor,
              end_positions: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """Mean of start and end cross entropies; positions outside the sequence are clamped to an ignored index.
    Where the family counts items (``counted_items``), each is the sum / num_items_in_batch, as
    ForQuestionAnsweringLoss."""
    start_logits, end_logits = logits
    if start_positions.dim() > 1:
        start_positions = start_positions.squeeze(-1)
    if end_positions.dim() > 1:
        end_positions = end_positions.squeeze(-1)
    ignored = start_logits.size(1)
    start_positions = start_positions.to(start_logits.device).clamp(0, ignored)
    end_positions = end_positions.to(end_logits.device).clamp(0, ignored)
    counted = counted_items(model, num_items_in_batch)
    return (fixed_cross_entropy(start_logits, start_positions, counted, ignore_index=ignored)
            + fixed_cross_entropy(end_logits, end_positions, counted, ignore_index=ignored)) / 2


def problem_of(num_labels: int, labels: torch.Tensor, problem_type: ProblemType | None) -> ProblemType:
    """transformers' rule: regression for one label, single-label for integer labels, else multi-label."""
    if problem_type is not None:
        return problem_type
    if num_labels == 1:
        return ProblemType.REGRESSION
    return ProblemType.SINGLE_LABEL if labels.dtype in (torch.long, torch.int) else ProblemType.MULTI_LABEL


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor,
                                 problem_type: ProblemType | None) -> torch.Tensor:
    """transformers' rule (``problem_of``), each kind's loss."""
    num_labels = logits.size(-1)
    problem_type = problem_of(num_labels, labels, problem_type)
    if problem_type == ProblemType.REGRESSION:
        if num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze())
        return F.mse_loss(logits, labels)
    if problem_type == ProblemType.SINGLE_LABEL:
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels)


def image_classification_loss(model: Any, logits: torch.Tensor, labels: torch.Tensor,
                              num_items_in_batch: Any = None) -> torch.Tensor:
    """transformers' ForImageClassification loss (loss_utils: its sequence-classification rule), which hands
    ``num_items_in_batch`` to the single-label cross entropy where the family counts items (``counted_items``)."""
    labels = labels.to(logits.device)
    counted = counted_items(model, num_items_in_batch)
    num_labels = logits.size(-1)
    if counted is not None and problem_of(num_labels, labels, model.config.problem_type) == ProblemType.SINGLE_LABEL:
        return fixed_cross_entropy(logits.view(-1, num_labels), labels.view(-1), counted)
    return sequence_classification_loss(logits, labels, model.config.problem_type)


def masked_image_loss(model: Any, reconstruction: torch.Tensor, pixel_values: torch.Tensor,
                      bool_masked_pos: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """SimMIM's loss as ViTForMaskedImageModeling computes it: the L1 distance of the rebuilt pixels over the
    masked patches (each patch's mask repeated over its pixels), divided by the masked pixels (+ 1e-5) and the
    channels; ``num_items_in_batch`` is ignored, as there."""
    config = model.config
    patch = config.patch_size if isinstance(config.patch_size, int) else config.patch_size[0]
    size = (config.image_size if isinstance(config.image_size, int) else config.image_size[0]) // patch
    masked = bool_masked_pos.reshape(-1, size, size)
    mask = masked.repeat_interleave(patch, 1).repeat_interleave(patch, 2).unsqueeze(1).contiguous()
    distance = F.l1_loss(pixel_values, reconstruction, reduction="none")
    return (distance * mask).sum() / (mask.sum() + 1e-5) / config.num_channels
