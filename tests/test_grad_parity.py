"""The training step against transformers for every decoder family: loss, every parameter's gradient, the
parameters' order, and one clipped AdamW step, all ``torch.equal`` (CPU, float32).

The forward parity table (tests/test_parity.py) cannot see the backward: an op whose forward is exact can
still sum its gradient in another order (a fused GQA kernel against repeat_kv, a tied matrix's two
contributions, a loss reduced another way). Here each case loads the same checkpoint natively and with
transformers in this process, runs the head's loss on right-padded, left-padded and unpadded batches in
training mode (the same seed before each forward, so any dropout draws the same mask), and compares the
gradients of every parameter. The parameters' order is compared too: ``clip_grad_norm_`` sums the
per-parameter norms in that order, so a model whose gradients are equal but whose parameters are listed
in another order clips by a coefficient one ulp away and steps to other weights.
"""

from __future__ import annotations

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.roundtrip.parity import make_batch, reference_model
from flodl_hf.core.registry import get_family

from cases import CASES
from helpers import make_checkpoint, seeded_backward

pytestmark = pytest.mark.range_end  # also run at the other end of the supported range

PADDINGS = ("right", "left", "none")


def _decoder_cases():
    """Each decoder family's first case per head (the narrowest variants come first in tests/cases), on one
    attention path, the paths alternating over the heads so that each family runs both where it has both."""
    seen = set()
    for case_id, task, fields in CASES:
        family = get_family(fields["model_type"])
        if not family.supports("causal_lm") or task == "base" or (family.model_type, task) in seen:
            continue  # decoders; the bare backbone has no loss
        seen.add((family.model_type, task))
        paths = family.attn_implementations
        impl = paths[sum(1 for m, _ in seen if m == family.model_type) % len(paths)]
        yield pytest.param(task, fields, impl, id=f"{case_id}-{impl}")


def _batch(config, task: str, padding: str) -> dict[str, torch.Tensor]:
    """make_batch's two rows (13 and 8 tokens), right-padded, moved to the left, or both at 13 with no mask;
    with the head's labels (the pad positions ignored where the labels are per token)."""
    batch = make_batch(config, task, lengths=(13, 13) if padding == "none" else (13, 8))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if padding == "left":
        order = torch.argsort(mask, dim=-1, stable=True)  # the pad positions first, each row's tokens in order
        ids, mask = ids.gather(-1, order), mask.gather(-1, order)
    batch = {"input_ids": ids} if padding == "none" else {"input_ids": ids, "attention_mask": mask}
    gen = torch.Generator().manual_seed(1)
    if task in ("causal_lm", "double_heads"):  # GPT-2's double heads: (B, choices, S), the LM loss is out.loss
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    elif task == "seqcls":
        batch["labels"] = torch.randint(0, config.num_labels, (ids.shape[0],), generator=gen)
    elif task == "tokcls":
        batch["labels"] = torch.randint(0, config.num_labels, ids.shape, generator=gen).masked_fill(mask == 0, -100)
    elif task == "qa":
        batch["start_positions"] = torch.randint(0, 8, (ids.shape[0],), generator=gen)
        batch["end_positions"] = torch.randint(0, 8, (ids.shape[0],), generator=gen)
    else:
        raise AssertionError(f"no labels for {task}")
    return batch


@pytest.mark.parametrize("task,fields,impl", list(_decoder_cases()))
def test_training_step_equals_transformers(task, fields, impl):
    source = make_checkpoint(fields, task)
    family = get_family(fields["model_type"])
    ours = load_model(source, task, dtype=torch.float32, attn_implementation=impl).train()
    theirs = reference_model(source, task, impl if len(family.attn_implementations) > 1 else None).train()
    key_map = ours.family.key_map()
    names = [key_map.to_hf(n) for n, _ in ours.named_parameters()]
    reference = list(theirs.named_parameters())
    # both under the file's keys (GPT-NeoX's lm_head is embed_out.weight there, as transformers saves it)
    assert names == [key_map.to_hf(key_map.to_native(n)) for n, _ in reference], \
        "parameter order differs from transformers'"
    pairs = [(name, p, q) for name, (_, p), (_, q) in zip(names, ours.named_parameters(), reference)]

    for padding in PADDINGS:
        losses = seeded_backward((ours, theirs), _batch(ours.config, task, padding))
        assert torch.equal(*losses), f"{padding}: loss {losses[0].item()} != {losses[1].item()}"
        for name, mine, reference in pairs:
            assert (mine.grad is None) == (reference.grad is None), f"{padding}: {name} has a gradient on one side"
            if mine.grad is not None:
                assert torch.equal(mine.grad, reference.grad), \
                    f"{padding}: {name} grad differs by {(mine.grad - reference.grad).abs().max().item()}"

    # one transformers-Trainer-like step on the last batch's gradients: clip at 1.0, then AdamW
    for model in (ours, theirs):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    for name, mine, reference in pairs:
        assert torch.equal(mine, reference), f"after the step: {name} differs by {(mine - reference).abs().max().item()}"
