"""Gradient checkpointing (flodl_hf.core.checkpointing) against transformers' with checkpointing on.

One table driven by the registry's cases: each family's smallest case with a loss (causal LM, else masked LM, else
sequence classification, else image classification: the vision families, CLIP and SigLIP) and BERT's masked LM at
real width. With every dropout of the config at 0.1, one training
step with checkpointing on, reentrant and not, has a loss and gradients torch.equal to transformers' with
checkpointing on (the same weights, batch and seed: each recompute redraws its masks from the saved RNG state), and
to ours with checkpointing off; the layers really ran twice.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from cases import CASES
from decoder_checks import training_batch
from helpers import dropout_acted, make_checkpoint, model_pair, one_thread, seeded_backward  # noqa: F401
from flodl_hf.core.checkpointing import checkpoint_layers
from flodl_hf.core.errors import InputError, UnsupportedFeatureError
from flodl_hf.core.registry import get_family
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers

pytestmark = pytest.mark.usefixtures("one_thread")

REFUSED = ("albert", "mpnet")  # transformers' AlbertModel and MPNetModel have no gradient checkpointing
LOSS_TASKS = ("causal_lm", "mlm", "seqcls", "image_classification")


def _width(fields: dict) -> int:
    fields = fields.get("vision_config", fields)  # CLIP's and SigLIP's classifiers sit on the vision tower
    return next(fields[k] for k in ("hidden_size", "n_embd", "dim", "d_model") if k in fields)


def _table() -> list[tuple[str, str, dict]]:
    """Per model_type, its narrowest case of the first task in LOSS_TASKS it has; and BERT's at real width."""
    best: dict[str, tuple[str, str, dict]] = {}
    for case_id, task, fields in CASES:
        kind = fields["model_type"]
        if task not in LOSS_TASKS or kind in REFUSED:
            continue
        key = (LOSS_TASKS.index(task), _width(fields))
        old = best.get(kind)
        if old is None or key < (LOSS_TASKS.index(old[1]), _width(old[2])):
            best[kind] = (case_id, task, fields)
    real = next(case for case in CASES if case[0] == "bert-768-mlm")
    return [*sorted(best.values()), real]


TABLE = _table()


def dropouts(model_type: str, p: float = 0.1) -> dict:
    """Every float dropout field of transformers' config for ``model_type`` at ``p`` (LayerDrop left out)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = quiet_transformers().AutoConfig.for_model(model_type).to_dict()
    return {k: p for k, v in config.items()
            if ("drop" in k or "pdrop" in k) and "layerdrop" not in k and isinstance(v, float)}


def _batch(model, task: str) -> dict:
    if task == "image_classification":  # pixels, and a label per image
        batch = make_batch(model.config, task)
        batch["labels"] = torch.arange(next(iter(batch.values())).shape[0]) % model.config.num_labels
        return batch
    batch = training_batch(model.config.vocab_size, "causal_lm" if task == "mlm" else task)
    if task == "seqcls":
        batch["labels"] = torch.arange(batch["input_ids"].shape[0]) % model.config.num_labels
    return batch


def _pair(fields: dict, task: str):
    """Ours and transformers' on the family's first attention path (sdpa where it has one), the dropouts on. A dual
    model's dropouts live in its towers' configs (CLIP, SigLIP): there they are written into the checkpoint."""
    path = get_family(fields["model_type"]).attn_implementations[0]
    if "vision_config" in fields:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tower = quiet_transformers().AutoConfig.for_model(fields["model_type"]).vision_config.model_type
        fields = {**fields, "vision_config": {**fields["vision_config"], **dropouts(tower)}}
        return model_pair(make_checkpoint(fields, task), task, path)
    return model_pair(make_checkpoint(fields, task), task, path, **dropouts(fields["model_type"]))


def _calls(layer: nn.Module) -> list[int]:
    """A counter of the calls of ``layer``'s first child (inside its checkpoint; the layer's own hooks are not)."""
    count = [0]
    next(layer.children()).register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_step_equal(ours, theirs, batch: dict) -> torch.Tensor:
    """One seeded train-mode step of each: the loss and every gradient torch.equal, parameters paired in order
    under the file's names (helpers.assert_training_step_equal, where a parameter may have no gradient on both
    sides: an unused pooler, a frozen embedding). Returns our loss."""
    ours.train(), theirs.train()
    losses = seeded_backward((ours, theirs), batch)
    assert torch.equal(*losses), (losses[0].item(), losses[1].item())
    key_map = ours.family.key_map()
    for (name, p), (their_name, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert key_map.to_hf(name) == key_map.to_hf(key_map.to_native(their_name)), (name, their_name)
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    return losses[0]


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("case_id, task, fields", TABLE, ids=[case[0] for case in TABLE])
def test_checkpointed_step_equals_transformers_and_ours_without(case_id, task, fields, reentrant):
    ours, theirs = _pair(fields, task)
    batch = _batch(ours, task)
    ours.train()
    torch.manual_seed(0)
    plain = ours(**batch).loss
    plain.backward()
    plain_grads = _grads(ours)
    calls = _calls(checkpoint_layers(ours)[0])
    for model in (ours, theirs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5.25 names it activation_checkpointing_*
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert ours.is_gradient_checkpointing
    theirs.train()
    try:
        seeded_backward((theirs,), batch)
    except RuntimeError as error:
        # DeBERTa-v2's encoder hands each layer the normalised rel_embeddings by keyword: the reentrant variant
        # backpropagates through their LayerNorm once per layer and fails on the second, in transformers as here
        assert reentrant and "second time" in str(error)
        ours.train()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            seeded_backward((ours,), batch)
        return
    loss = assert_step_equal(ours, theirs, batch)
    assert calls[0] == 2  # the forward, and its recompute in the backward
    assert torch.equal(loss, plain.detach())
    grads = _grads(ours)
    assert grads.keys() == plain_grads.keys()
    assert [n for n in grads if not torch.equal(grads[n], plain_grads[n])] == []
    assert dropout_acted(ours, batch, loss)  # the masks mattered


def _llama():
    case_id, task, fields = next(case for case in TABLE if case[2]["model_type"] == "llama")
    return _pair(fields, task)


def test_off_in_eval_without_grad_and_after_disable():
    ours, _ = _llama()
    batch = _batch(ours, "causal_lm")
    calls = _calls(checkpoint_layers(ours)[0])
    ours.gradient_checkpointing_enable()
    ours.eval()
    ours(**batch).loss.backward()
    ours.train()
    with torch.no_grad():
        ours(**batch)
    assert calls[0] == 2  # eval mode and no_grad: the layers run once
    ours.gradient_checkpointing_disable()
    assert not ours.is_gradient_checkpointing and not ours.is_activation_checkpointing
    ours(**batch).loss.backward()
    assert calls[0] == 3


def test_use_cache_is_dropped_in_training_as_transformers():
    ours, theirs = _llama()
    batch = _batch(ours, "causal_lm")
    for model in (ours, theirs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
        model.train()
    with pytest.warns(UserWarning, match="use_cache=True.*incompatible with gradient checkpointing"):
        out = ours(**batch, use_cache=True)
    assert out.cache is None and theirs(**batch, use_cache=True).cache is None
    ours.eval()
    assert ours(**batch, use_cache=True).cache is not None  # not checkpointing: the cache as before


def test_a_given_cache_is_left_unwritten_as_transformers():
    """A cache handed to a checkpointed layer in training is dropped there (a warning names the layer): the recompute
    would write it twice. LLaMA returns the cache it was given, unwritten, as transformers' does."""
    ours, theirs = _llama()
    batch = _batch(ours, "causal_lm")
    for model in (ours, theirs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable()
        model.train()
    torch.manual_seed(0)  # the same dropout masks on both sides
    with pytest.warns(UserWarning, match=r"Caching is incompatible with gradient checkpointing in \w+.*`cache=None`"):
        out = ours(**batch, cache=ours.backbone.new_cache())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        reference = theirs(**batch, cache=quiet_transformers().DynamicCache(config=theirs.config))
    assert out.cache.get_seq_length() == reference.cache.get_seq_length() == 0
    assert torch.equal(out.logits, reference.logits)


def test_reentrant_reaches_layers_behind_a_frozen_embedding():
    """The input hook (enable_input_require_grads, as transformers installs it) makes the reentrant variant pass
    gradients into the layers when the embedding is frozen (LoRA's case): equal to transformers'."""
    ours, theirs = _llama()
    batch = _batch(ours, "causal_lm")
    for model in (ours, theirs):
        model.get_input_embeddings().weight.requires_grad_(False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable({"use_reentrant": True})
    assert_step_equal(ours, theirs, batch)
    assert checkpoint_layers(ours)[0].self_attn.q_proj.weight.grad is not None
    ours.disable_input_require_grads()
    ours.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: none of the inputs have requires_grad=True
        ours(**batch).loss.backward()
    assert checkpoint_layers(ours)[0].self_attn.q_proj.weight.grad is None  # the hook was what carried them


def test_lora_with_checkpointing_equals_lora_without():
    from flodl_hf.lora import add_lora
    ours, _ = _llama()
    add_lora(ours, r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    batch = _batch(ours, "causal_lm")
    ours.train()
    torch.manual_seed(0)
    ours(**batch).loss.backward()
    plain = _grads(ours)
    ours.zero_grad(set_to_none=True)
    ours.gradient_checkpointing_enable({"use_reentrant": True})
    torch.manual_seed(0)
    ours(**batch).loss.backward()
    grads = _grads(ours)
    assert plain and all("lora_" in name for name in plain)
    assert grads.keys() == plain.keys() and all(torch.equal(grads[n], plain[n]) for n in grads)


def test_a_deep_copy_checkpoints_its_own_layers():
    ours, _ = _llama()
    ours.gradient_checkpointing_enable()
    twin = copy.deepcopy(ours)
    calls, twin_calls = _calls(checkpoint_layers(ours)[0]), _calls(checkpoint_layers(twin)[0])
    twin.train()
    twin(**_batch(twin, "causal_lm")).loss.backward()
    assert (calls[0], twin_calls[0]) == (0, 2)


@pytest.mark.parametrize("model_type", REFUSED)
def test_families_without_checkpointing_in_transformers_are_refused(model_type):
    case_id, task, fields = next(case for case in CASES if case[2]["model_type"] == model_type)
    ours, theirs = _pair(fields, task)
    with pytest.raises(ValueError, match="does not support"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        theirs.gradient_checkpointing_enable()
    with pytest.raises(UnsupportedFeatureError, match=r"(AlbertModel|MPNetModel) does not support gradient"):
        ours.gradient_checkpointing_enable()
    assert not ours.is_gradient_checkpointing


@pytest.mark.parametrize("call, match", [
    (lambda m: m.gradient_checkpointing_enable(["use_reentrant"]), "gradient_checkpointing_kwargs="),
    (lambda m: m.gradient_checkpointing_enable(every_n_layers=0), "every_n_layers=0"),
])
def test_bad_arguments_are_input_errors(call, match):
    ours, _ = _llama()
    with pytest.raises(InputError, match=match):
        call(ours)
    assert not ours.is_gradient_checkpointing
