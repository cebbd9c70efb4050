"""ViT, DeiT and DINOv2 beyond the parity table (tests/cases), each against transformers in the same run, torch.equal:
every recorded output (hidden states, attentions, tuples), positions resized to other image sizes
(``interpolate_pos_encoding``; DINOv2 always, patch 14 at 518 pixels), the mask token on the backbones, a training
step with dropout and stochastic depth, DeiT's teacher through ``AutoModelForImageClassification``, the configs'
defaults, and typed errors for bad pixels."""

from __future__ import annotations

import inspect

import pytest
import torch

import flodl_hf
from flodl_hf.core.errors import InputError
from flodl_hf.core.registry import get_family
from flodl_hf.roundtrip.parity import image_batch, quiet_transformers

from cases.deit import CONFIGS as DEIT
from cases.dinov2 import CONFIGS as DINOV2
from cases.dinov2_with_registers import CONFIGS as REGISTERS
from cases.vit import CONFIGS as VIT
from helpers import (assert_config_defaults_equal, dropout_acted, make_checkpoint, model_pair,  # noqa: F401
                     one_thread, seeded_backward)  # one_thread: the fixture

pytestmark = pytest.mark.usefixtures("one_thread")

# each family's narrow variant, with the head that reads the most of its backbone
NARROW = {
    "vit": (VIT["vit-hd24"], "masked_image_modeling"),
    "deit": (DEIT["deit-hd24"], "image_classification_teacher"),
    "dinov2": (DINOV2["dinov2-swiglu-hd24"], "image_classification"),
    "dinov2_with_registers": (REGISTERS["dinov2-registers-hd24"], "image_classification"),
}
# DINOv2 at its released patch and size (dinov2-small's 518 pixels, a 37 x 37 position grid), narrow and 2 layers
DINOV2_518 = dict(model_type="dinov2", hidden_size=96, num_attention_heads=4, num_hidden_layers=2, image_size=518,
                  patch_size=14, num_labels=3)


def _pixels(config, height: int, width: int, rows: int = 2, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, config.num_channels, height, width, generator=gen)


def _assert_records_equal(mine, theirs) -> int:
    """Every field transformers returns, tensors and tuples of tensors, torch.equal; the number compared."""
    compared = 0
    for name, value in theirs.items():
        ours = getattr(mine, name)
        values = value if isinstance(value, tuple) else (value,)
        ours = ours if isinstance(ours, tuple) else (ours,)
        assert len(ours) == len(values), name
        for a, b in zip(ours, values):
            assert torch.equal(a, b), f"{name}: {(a - b).abs().max().item()}"
            compared += 1
    return compared


@pytest.mark.parametrize("model_type", list(NARROW))
def test_hidden_states_attentions_and_tuples_equal_transformers(model_type):
    fields, task = NARROW[model_type]
    ours, theirs = model_pair(make_checkpoint(fields, task), task, "eager")
    batch = image_batch(ours.config, task)
    options = {"output_hidden_states": True, "output_attentions": True}
    mine, ref = ours(**batch, **options), theirs(**batch, **options)
    layers = fields["num_hidden_layers"]
    assert len(ref.hidden_states) == layers + 1 and len(ref.attentions) == layers
    # the last hidden state is the last layer's output, before the final norm (transformers does not tie them)
    assert _assert_records_equal(mine, ref) >= 2 * layers + 2
    for a, b in zip(ours(**batch, return_dict=False), theirs(**batch, return_dict=False), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fields,sizes", [
    pytest.param(VIT["vit-768"], [(256, 256)], id="vit-768"),
    pytest.param(VIT["vit-hd24"], [(56, 48), (24, 24), (40, 40)], id="vit-hd24"),
    pytest.param(DEIT["deit-hd24"], [(48, 40)], id="deit-hd24"),
])
def test_interpolate_pos_encoding_at_other_sizes(fields, sizes):
    ours, theirs = model_pair(make_checkpoint(fields, "base"), "base", "sdpa")
    for height, width in sizes:
        pixels = _pixels(ours.config, height, width)
        mine = ours(pixel_values=pixels, interpolate_pos_encoding=True)
        ref = theirs(pixel_values=pixels, interpolate_pos_encoding=True)
        assert _assert_records_equal(mine, ref) == 2, (height, width)
    with pytest.raises(InputError, match="interpolate_pos_encoding=True"):
        ours(pixel_values=_pixels(ours.config, 48, 48))


@pytest.mark.parametrize("fields,task,sizes", [
    pytest.param(DINOV2_518, "image_classification", [(518, 518), (224, 224), (280, 392)], id="dinov2-p14-518"),
    pytest.param(REGISTERS["dinov2-registers-hd24"], "base", [(48, 48), (40, 24)], id="registers"),
])
def test_dinov2_resizes_its_positions_to_every_image(fields, task, sizes):
    ours, theirs = model_pair(make_checkpoint(fields, task), task, "sdpa")
    for height, width in sizes:
        pixels = _pixels(ours.config, height, width, rows=1)
        assert _assert_records_equal(ours(pixel_values=pixels), theirs(pixel_values=pixels)) >= 1, (height, width)


def test_mask_token_on_the_backbones():
    """DINOv2's backbone has its mask token (bool_masked_pos equal to transformers'); ViT's has one only for masked
    image modeling, and a bool_masked_pos given to the bare one is a typed error naming it."""
    fields = REGISTERS["dinov2-registers-hd24"]
    for source_fields in (DINOV2["dinov2-swiglu-hd24"], fields):
        ours, theirs = model_pair(make_checkpoint(source_fields, "base"), "base", "eager")
        batch = image_batch(ours.config, "masked_image_modeling")
        assert _assert_records_equal(ours(**batch), theirs(**batch)) == 2
    vit, _ = model_pair(make_checkpoint(VIT["vit-hd24"], "base"), "base", "sdpa")
    batch = image_batch(vit.config, "masked_image_modeling")
    with pytest.raises(InputError, match="bool_masked_pos"):
        vit(**batch)


@pytest.mark.parametrize("fields,impl", [
    pytest.param({**VIT["vit-768"], "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}, "sdpa",
                 id="vit-768-dropout"),
    pytest.param({**DINOV2["dinov2-swiglu-hd24"], "drop_path_rate": 0.3, "hidden_dropout_prob": 0.1}, "eager",
                 id="dinov2-drop-path"),
])
def test_training_step_equals_transformers(fields, impl):
    """Loss and every gradient in train mode (dropout, DINOv2's stochastic depth drawn from the same seed)."""
    ours, theirs = model_pair(make_checkpoint(fields, "image_classification"), "image_classification", impl)
    batch = image_batch(ours.config, "image_classification")
    batch["labels"] = torch.tensor([1, 2])
    ours.train(), theirs.train()
    losses = seeded_backward((ours, theirs), batch)
    assert torch.equal(*losses), (losses[0].item(), losses[1].item())
    if fields["model_type"] == "dinov2":
        assert dropout_acted(ours, batch, losses[0])
    compared = 0
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name  # DINOv2's mask token: unused without bool_masked_pos
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name
            compared += 1
    assert compared > 20


def test_auto_image_classification_reads_deit_s_teacher():
    source = make_checkpoint(DEIT["deit-hd24"], "image_classification_teacher")
    ours = flodl_hf.AutoModelForImageClassification.from_pretrained(source)
    theirs = quiet_transformers().AutoModelForImageClassification.from_pretrained(str(source)).eval()
    assert type(ours).__name__ == type(theirs).__name__ == "DeiTForImageClassificationWithTeacher"
    batch = image_batch(ours.config, "image_classification")
    assert _assert_records_equal(ours(**batch), theirs(**batch)) == 3


@pytest.mark.parametrize("model_type", list(NARROW))
def test_config_defaults_equal_transformers(model_type):
    assert_config_defaults_equal(model_type, skip=("pooler_output_size",),
                                 present=("image_size", "patch_size", "num_channels", "qkv_bias"))


@pytest.mark.parametrize("pixels,match", [
    (torch.zeros(1, 4, 40, 40), "4 channels"),
    (torch.zeros(1, 2, 40, 40), "2 channels"),
    (torch.zeros(3, 40, 40), "shape"),
    (torch.zeros(1, 3, 40, 40, dtype=torch.uint8), "dtype"),
    ([[0.0]], "is a list"),
    (torch.zeros(1, 3, 32, 40), "32x40"),
])
def test_bad_pixels_are_typed_errors(pixels, match):
    ours, _ = model_pair(make_checkpoint(VIT["vit-hd24"], "image_classification"), "image_classification")
    with pytest.raises(InputError, match=match) as err:
        ours(pixel_values=pixels)
    assert "pixel_values" in str(err.value)


def test_forwards_take_transformers_positional_order():
    """Every vision task model's positional inputs are those of transformers' class of the same name."""
    def positional(fn) -> list[str]:
        return [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]

    transformers = quiet_transformers()
    for model_type in NARROW:
        family = get_family(model_type)
        for task in family.tasks:
            theirs = getattr(transformers, family.architecture(task))
            assert positional(family.model_class(task).forward) == positional(theirs.forward), (model_type, task)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_attention_mask_over_the_tokens(impl):
    """An attention mask over the tokens (the special tokens and the patches) masks keys as transformers' bidirectional
    mask does; one of another length is a typed error naming it."""
    ours, theirs = model_pair(make_checkpoint(VIT["vit-hd24"], "image_classification"), "image_classification", impl)
    batch = image_batch(ours.config, "image_classification")
    mask = torch.ones(2, 26, dtype=torch.long)
    mask[1, 20:] = 0
    assert _assert_records_equal(ours(**batch, attention_mask=mask), theirs(**batch, attention_mask=mask)) == 1
    with pytest.raises(InputError, match="attention_mask"):
        ours(**batch, attention_mask=mask[:, :25])
