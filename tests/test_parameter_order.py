"""Our models list their parameters in transformers' order, so a clipped training step is bit-equal to theirs.

``torch.nn.utils.clip_grad_norm_`` (which transformers' Trainer calls at ``max_grad_norm=1.0`` by default)
sums the per-parameter gradient norms in ``model.parameters()`` order; float addition is not associative, so
a model whose gradients are ``torch.equal`` to transformers' but whose parameters are listed in another
order gets a total norm one ulp away in some batches, clips by another coefficient, and steps to other
weights. ``named_parameters`` follows the order in which ``__init__`` registered the modules: RoBERTa's
embeddings register ``position_embeddings`` last, ELECTRA's ``embeddings_project`` comes before the encoder,
DeBERTa's ``pooler`` before its ``classifier``, XLM-RoBERTa's and CamemBERT's task classes build their head
before the backbone (``Family.head_before_backbone``). Tied parameters appear once, under their first name.
"""

from __future__ import annotations

import pytest
import torch

from flodl_hf.auto import load_model
from flodl_hf.roundtrip.parity import make_batch, reference_model

from cases import CASES
from helpers import make_checkpoint, one_thread  # noqa: F401  (fixture)
from test_api_gaps import EVERY_FAMILY_AND_TASK

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = {case_id: fields for case_id, _, fields in CASES}


def _pair(case: str, task: str):
    source = make_checkpoint(FIELDS[f"{case}-{task}"], task)
    return (load_model(source, task, dtype=torch.float32, attn_implementation="eager"),
            reference_model(source, task, "eager"))


@pytest.mark.parametrize("case,task", EVERY_FAMILY_AND_TASK, ids=["-".join(c) for c in EVERY_FAMILY_AND_TASK])
def test_parameter_order_is_transformers(case, task):
    ours, theirs = _pair(case, task)
    key_map = ours.family.key_map()
    mine = [key_map.to_hf(n) for n, _ in ours.named_parameters()]
    # both under the file's keys (GPT-NeoX's lm_head is embed_out.weight there, as transformers saves it)
    reference = [key_map.to_hf(key_map.to_native(n)) for n, _ in theirs.named_parameters()]
    assert len(mine) == len(reference) and set(mine) == set(reference), \
        f"ours only {sorted(set(mine) - set(reference))}, theirs only {sorted(set(reference) - set(mine))}"
    first = next((i for i, (a, b) in enumerate(zip(mine, reference)) if a != b), None)
    assert first is None, f"order differs at position {first}: {mine[first]} (ours), {reference[first]} (theirs)"


def _smallest(model_type: str, task: str) -> str:
    return next(case for case, t in EVERY_FAMILY_AND_TASK
                if t == task and FIELDS[f"{case}-{t}"]["model_type"] == model_type)


# two encoder heads whose order was not transformers' (RoBERTa's embeddings; DeBERTa-v2's pooler and classifier),
# where the old order summed the total norm to another float at the first step
CLIPPED = [("roberta", "seqcls"), ("deberta-v2", "seqcls")]


@pytest.mark.parametrize("model_type,task", CLIPPED, ids=["-".join(c) for c in CLIPPED])
def test_clipped_adamw_steps_equal_transformers(model_type, task):
    """Five Trainer-like steps in training mode (dropout on, the same seed on both sides): the loss, the total
    norm clip_grad_norm_ returns, and every parameter after clipping at 1.0 and an AdamW step, torch.equal."""
    ours, theirs = _pair(_smallest(model_type, task), task)
    key_map = ours.family.key_map()
    pairs = [(key_map.to_hf(n), p, theirs.get_parameter(key_map.to_hf(n))) for n, p in ours.named_parameters()]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for m in (ours, theirs):
        m.train()
    for step in range(5):
        batch = make_batch(ours.config, task, lengths=(13, 8 + step), seed=step)
        labels = torch.tensor([1, 0]) if task in ("seqcls", "mc") else None
        losses, norms = [], []
        for model, optimizer in zip((ours, theirs), optimizers):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            loss = model(**batch, labels=labels).loss
            loss.backward()
            losses.append(loss.detach())
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            optimizer.step()
        assert torch.equal(*losses), f"step {step}: loss {losses[0].item()} != {losses[1].item()}"
        assert torch.equal(*norms), f"step {step}: total norm differs by {(norms[0] - norms[1]).item():.1e}"
        for name, mine, reference in pairs:
            assert torch.equal(mine, reference), \
                f"step {step}: {name} differs by {(mine - reference).abs().max().item():.1e}"
