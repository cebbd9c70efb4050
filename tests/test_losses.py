"""Losses (and their gradients) equal transformers' for every head, with transformers' label rules."""

from __future__ import annotations

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.core.registry import get_task
from flodl_hf.roundtrip.parity import make_batch, reference_model

from cases import CASES
from helpers import make_checkpoint

pytestmark = pytest.mark.range_end  # also run at the other end of the supported range


def _labels(task: str, config, batch, variant: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = batch.get("input_ids", batch.get("pixel_values"))  # the rows; an image model takes pixel_values
    if task == "masked_image_modeling":  # the pixels are the target; the batch's bool_masked_pos selects
        return {}
    if task in ("seqcls", "image_classification"):
        n = config.num_labels
        if variant == "regression":
            return {"labels": torch.randn(ids.shape[0], n, generator=gen)}
        if variant == "multi":
            return {"labels": torch.randint(0, 2, (ids.shape[0], n), generator=gen).float()}
        if variant == "soft":  # DeBERTa without problem_type: float rows are soft targets
            return {"labels": torch.softmax(torch.randn(ids.shape[0], n, generator=gen), -1)}
        if variant == "negative":  # DeBERTa without problem_type: rows labelled < 0 are dropped
            return {"labels": torch.tensor([-1, 1])}
        return {"labels": torch.randint(0, n, (ids.shape[0],), generator=gen)}
    if task in ("tokcls", "mlm"):
        n = config.num_labels if task == "tokcls" else config.vocab_size
        labels = torch.randint(0, n, ids.shape, generator=gen)
        return {"labels": labels.masked_fill(batch["attention_mask"] == 0, -100)}
    if task == "qa":
        # one position past the end: transformers clamps it to an ignored index
        return {"start_positions": torch.tensor([1, ids.shape[1] + 5]), "end_positions": torch.tensor([3, 2])}
    if task == "mc":
        return {"labels": torch.tensor([1, 0])}
    if task == "causal_lm":  # the ids themselves, pads ignored; the loss shifts them (token t predicts t + 1)
        return {"labels": ids.masked_fill(batch["attention_mask"] == 0, -100)}
    if task == "double_heads":  # GPT-2's: the LM labels (shifted inside) and one right choice per row
        return {"labels": ids.masked_fill(batch["attention_mask"] == 0, -100), "mc_labels": torch.tensor([1, 0])}
    if task == "pretraining":  # replaced (1) or original (0) per token; BCE over the active ones
        return {"labels": torch.randint(0, 2, ids.shape, generator=gen)}
    raise AssertionError(task)


def _width(fields: dict) -> int:
    return fields.get("hidden_size", fields.get("dim", 768))


def _one_case_per_family_and_head():
    """The narrowest variant of each family, for each head: the head code is what is under test."""
    chosen: dict[tuple[str, str], tuple[str, dict]] = {}
    for case_id, task, fields in CASES:
        key = (fields["model_type"], task)
        if get_task(task).loss is not None and (key not in chosen or _width(fields) < _width(chosen[key][1])):
            chosen[key] = (case_id, fields)
    for (model_type, task), (case_id, fields) in chosen.items():
        variants = ("single", "multi", "regression") if task in ("seqcls", "image_classification") else ("default",)
        if task == "seqcls" and model_type in ("deberta-v2", "deberta"):
            variants += ("soft", "negative")
        for variant in variants:
            yield pytest.param(task, fields, variant, id=f"{case_id}-{variant}")


@pytest.mark.parametrize("task,fields,variant", list(_one_case_per_family_and_head()))
def test_loss_and_gradients_equal_transformers(task, fields, variant):
    if variant == "regression":
        fields = {**fields, "problem_type": "regression"}
    elif variant == "multi":
        fields = {**fields, "problem_type": "multi_label_classification"}
    source = make_checkpoint(fields, task)
    ours = load_model(source, task, dtype=torch.float32)
    theirs = reference_model(source, task, "eager")
    ours.set_attn_implementation("eager")
    batch = make_batch(ours.config, task)
    batch.update(_labels(task, ours.config, batch, variant))
    loss_ours = ours(**batch).loss
    loss_theirs = theirs(**batch).loss
    assert torch.equal(loss_ours, loss_theirs), (loss_ours.item(), loss_theirs.item())
    loss_ours.backward()
    loss_theirs.backward()
    grads_theirs = dict(theirs.named_parameters(remove_duplicate=False))
    compared = 0
    for name, param in ours.named_parameters():
        other = grads_theirs[name].grad
        if param.grad is None:
            assert other is None or not other.any(), name
            continue
        assert torch.equal(param.grad, other), f"{name}: {(param.grad - other).abs().max().item()}"
        compared += 1
    assert compared > 10
