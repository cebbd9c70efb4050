"""Test fixtures: checkpoints generated locally with transformers (random weights, every
parameter perturbed so LayerNorms and biases are not trivial), saved with save_pretrained."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from flodl_hf.roundtrip.parity import REFERENCE_CLASSES, quiet_transformers, reference_model
from flodl_hf.roundtrip.matrix import generate_checkpoint

CACHE = Path(os.environ.get("FLODL_HF_TEST_CACHE", Path(__file__).resolve().parent.parent / ".test-cache"))


def make_checkpoint(config_fields: dict, task: str, seed: int = 0, root: Path | None = None,
                    perturb: float = 0.05) -> Path:
    """flodl_hf.roundtrip.matrix.generate_checkpoint, cached by (config, task, seed, transformers version)."""
    transformers = quiet_transformers()
    key = hashlib.sha1(json.dumps([config_fields, task, seed, perturb, transformers.__version__],
                                  sort_keys=True).encode()).hexdigest()[:16]
    out = Path(root or CACHE) / f"{config_fields['model_type']}-{task}-{key}"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    generate_checkpoint(config_fields, task, tmp, seed=seed, perturb=perturb)
    tmp.rename(out)
    return out


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, and far faster on a busy machine (no spin-waiting).
    A module takes it for all its tests with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def model_pair(source, task: str = "causal_lm", impl: str = "sdpa", dtype: torch.dtype = torch.float32, **overrides):
    """Ours and transformers' model of ``source`` for ``task`` on attention path ``impl``, in ``dtype``, both in
    eval mode (load warnings hidden); ``overrides`` (config fields) go to both loaders."""
    from flodl_hf.auto import load_model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_model(source, task, dtype=dtype, attn_implementation=impl, **overrides).eval()
        if dtype == torch.float32 and not overrides:
            theirs = reference_model(source, task, impl)
        else:
            theirs = getattr(quiet_transformers(), REFERENCE_CLASSES[task]).from_pretrained(
                str(source), dtype=dtype, attn_implementation=impl, **overrides).eval()
    return ours, theirs


def assert_config_defaults_equal(model_type: str, skip=(), present=(), ours_value=getattr):
    """Our config class's defaults against transformers' config for ``model_type``: every field both have but
    ``skip`` (those transformers fills in, compared by the caller) and the bookkeeping ones is equal (an enum by its
    value; ``ours_value`` reads ours), ``present`` among them. Returns our config, transformers' and the names."""
    from dataclasses import fields

    from flodl_hf.core.registry import get_family
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = quiet_transformers().AutoConfig.for_model(model_type)
    ours = get_family(model_type).config_class()
    skip = {"raw", "attn_implementation", "id2label", "label2id", *skip}
    names = [f.name for f in fields(ours) if f.name not in skip and hasattr(theirs, f.name)]
    assert set(present) <= set(names)
    for name in names:
        value = ours_value(ours, name)
        assert getattr(value, "value", value) == getattr(theirs, name), name
    return ours, theirs, names


def left_padded(vocab: int, lengths=(9, 6, 3), seed: int = 1, low: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of random ids in [low, vocab) with rows of ``lengths`` real tokens, and its mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(low, vocab, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


def seeded_backward(models, batch: dict) -> list[torch.Tensor]:
    """One forward and backward of each model on ``batch``, its gradients set to None first and the seed set to 0
    before the forward (so the dropouts draw the same masks on each); the losses, detached."""
    losses = []
    for model in models:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out = model(**batch)
        out.loss.backward()
        losses.append(out.loss.detach())
    return losses


def assert_training_step_equal(ours, theirs, batch: dict) -> torch.Tensor:
    """One train-mode forward and backward of each model on ``batch`` from the same seed: the loss and every
    parameter's gradient torch.equal, parameters paired in order (transformers' names through our key map).
    Returns our loss."""
    ours.train(), theirs.train()
    losses = seeded_backward((ours, theirs), batch)
    assert torch.equal(*losses), (losses[0].item(), losses[1].item())
    key_map = ours.family.key_map()
    for (name, p), (their_name, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert key_map.to_hf(name) == key_map.to_hf(key_map.to_native(their_name)), (name, their_name)
        assert torch.equal(p.grad, q.grad), name
    return losses[0]


def assert_recorded_step_equal(theirs, batch: dict, loss: torch.Tensor, grads: dict) -> None:
    """A loss and gradients recorded during our trainer's step on ``batch`` (gradients by parameter name)
    torch.equal to transformers' model ``theirs`` on that batch (its names match ours here)."""
    theirs.zero_grad(set_to_none=True)
    ref = theirs(**batch)
    ref.loss.backward()
    assert torch.equal(loss, ref.loss.detach())
    ref_grads = {n: p.grad for n, p in theirs.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads)
    assert [n for n in grads if not torch.equal(grads[n], ref_grads[n])] == []


def dropout_acted(model, batch: dict, loss: torch.Tensor) -> bool:
    """Whether ``model`` in eval mode gives another loss on ``batch`` than ``loss`` (taken in train mode)."""
    model.eval()
    torch.manual_seed(0)
    return not torch.equal(model(**batch).loss, loss)


def assert_generate_equal(ours, theirs, ids: torch.Tensor, mask: torch.Tensor, **settings) -> None:
    """transformers' generate and ours from the same seed give the same ids (pad 0, eos 2, 8 new tokens)."""
    from flodl_hf.generation.generate import generate_ids
    settings = {"max_new_tokens": 8, "pad_token_id": 0, "eos_token_id": 2, **settings}
    torch.manual_seed(7)
    reference = theirs.generate(input_ids=ids, attention_mask=mask, **settings)
    torch.manual_seed(7)
    assert torch.equal(generate_ids(ours, ids, mask, **settings), reference)


def assert_model_generate_equal(ours, theirs, ids: torch.Tensor, mask: torch.Tensor, **settings) -> None:
    """``model.generate``, transformers' and ours, from the same seed give the same ids (pad 0, no eos, 8 new
    tokens unless ``settings`` say otherwise)."""
    settings = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 8, "eos_token_id": [], "pad_token_id": 0,
                **settings}
    torch.manual_seed(7)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = theirs.generate(**settings)
    torch.manual_seed(7)
    assert torch.equal(ours.generate(**settings), reference), settings


def transformers_loaded(source, task: str):
    """transformers' model of ``source`` for ``task`` (sdpa, float32, eval) and its loading info (missing,
    unexpected and mismatched keys)."""
    from flodl_hf.roundtrip.parity import REFERENCE_CLASSES as classes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = getattr(quiet_transformers(), classes[task]).from_pretrained(
            str(source), output_loading_info=True, attn_implementation="sdpa", dtype=torch.float32)
    return model.eval(), info


def assert_same_output(ours, theirs, task: str) -> None:
    """On the parity batch of ``task``: the logits (causal_lm) or the last hidden state (base) torch.equal."""
    from flodl_hf.roundtrip.parity import make_batch
    batch = make_batch(ours.config, task)
    key = "logits" if task == "causal_lm" else "last_hidden_state"
    assert torch.equal(getattr(ours(**batch), key), getattr(theirs(**batch), key))


def export_as_save_pretrained(source, out: Path) -> tuple[set[str], object]:
    """Export ``source`` (a causal LM) to ``out``: the written keys equal those transformers' save_pretrained
    writes for the same checkpoint, and verify-export passes at diff 0. Returns the keys and the export result."""
    from safetensors.torch import load_file
    from flodl_hf.roundtrip.export import export
    from flodl_hf.roundtrip.verify import verify_export
    result = export(source, out / "ours")
    written = set(load_file(str(result.out / "model.safetensors")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet_transformers().AutoModelForCausalLM.from_pretrained(str(source)).save_pretrained(str(out / "theirs"))
    assert written == set(load_file(str(out / "theirs" / "model.safetensors")))
    report = verify_export(result.out)
    assert report.ok and report.max_abs_diff == 0.0, report.format_table()
    return written, result
