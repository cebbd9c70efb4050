"""The image one-liners against transformers' pipelines in the same run: ``classify_image`` against
``pipeline("image-classification")`` (the same labels in the same order, scores within 1e-6), every batch our
runtime forms ``torch.equal`` to transformers on that batch, ``embed_image`` against DINOv2's ``pooler_output``, and
the ``classify-image`` command. Models at real width (ViT-base: hidden 768, patch 16, 224 px), 2 layers."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flodl_hf.cli import main
from flodl_hf.core import samples
from flodl_hf.core.errors import ImageError, MissingHeadError
from flodl_hf.roundtrip.parity import quiet_transformers
from flodl_hf.tasks import runtime
from flodl_hf.tasks.image import classify_image, embed_image
from helpers import make_checkpoint, one_thread  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

VIT = dict(model_type="vit", hidden_size=768, num_attention_heads=12, num_hidden_layers=2, intermediate_size=3072,
           image_size=224, patch_size=16, num_labels=7, id2label={str(i): f"kind {i}" for i in range(7)})
DINOV2 = dict(model_type="dinov2", hidden_size=768, num_attention_heads=12, num_hidden_layers=2, image_size=224,
              patch_size=14, mlp_ratio=4)
VIT_PROCESSOR = {"image_processor_type": "ViTImageProcessor", "resample": 2, "size": {"height": 224, "width": 224},
                 "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
DINOV2_PROCESSOR = {"image_processor_type": "BitImageProcessor", "size": {"shortest_edge": 256},
                    "crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "resample": 3,
                    "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def with_processor(fields: dict, task: str, processor: dict, out: Path) -> Path:
    shutil.copytree(make_checkpoint(fields, task), out)
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    return out


@pytest.fixture(scope="module")
def vit(tmp_path_factory) -> Path:
    return with_processor(VIT, "image_classification", VIT_PROCESSOR, tmp_path_factory.mktemp("vit") / "m")


def photos(n: int) -> list:
    """Real photos (samples/images' ImageNet JPEGs, as paths) when fetched, else generated images of odd sizes."""
    folder = samples.local_path("images")
    if folder is not None:
        return [str(p) for p in sorted(folder.glob("imagenet_*.jpg"))[:n]]
    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 256, (90 + 7 * i, 130 - 5 * i, 3), dtype=np.uint8)) for i in range(n)]


def same_ranking(ours: list, theirs: list) -> None:
    assert [r["label"] for r in ours] == [r["label"] for r in theirs]
    assert max(abs(a["score"] - b["score"]) for a, b in zip(ours, theirs)) <= 1e-6


def test_classify_image_equals_the_pipeline(vit, tmp_path):
    transformers = quiet_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = transformers.pipeline("image-classification", model=str(vit), device="cpu")
    images = photos(4)
    rgba = Image.fromarray(np.random.RandomState(2).randint(0, 256, (40, 50, 4), dtype=np.uint8))
    array = np.random.RandomState(3).randint(0, 256, (64, 48, 3), dtype=np.uint8)
    mixed = images[:3] + [rgba, array]
    for a, b in zip(classify_image(mixed, model=vit), pipe(mixed)):
        same_ranking(a, b)
        assert len(a) == 5
    # one image: a list of dicts, exactly the pipeline's (one image per pass on both sides)
    assert classify_image(images[0], model=vit, top_k=3) == pipe(images[0], top_k=3)
    assert len(classify_image(images[0], model=vit, top_k=50)) == 7  # clipped to the labels, as there
    ours = classify_image(images, model=vit, function_to_apply="sigmoid", batch_size=4)
    for a, b in zip(ours, pipe(images, function_to_apply="sigmoid")):
        same_ranking(a, b)
    assert classify_image([], model=vit) == []


def test_every_image_batch_equals_transformers_on_that_batch(vit):
    transformers = quiet_transformers()
    reference = transformers.AutoModelForImageClassification.from_pretrained(str(vit)).eval()
    model = runtime._MODELS.get((str(vit), "image_classification", "exact"))
    if model is None:
        classify_image(photos(1), model=vit)
        model = runtime._MODELS[(str(vit), "image_classification", "exact")]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = model.register_forward_hook(lambda m, args, kwargs, out: seen.append((kwargs["pixel_values"], out.logits)),
                                       with_kwargs=True)
    try:
        classify_image(photos(7), model=vit, batch_size=3)
    finally:
        hook.remove()
    assert sorted(len(p) for p, _ in seen) == [1, 3, 3]  # batch_size caps the rows of a pass
    with torch.inference_mode():
        for pixels, logits in seen:
            assert torch.equal(logits, reference(pixel_values=pixels).logits)


def test_embed_image_is_dinov2_pooler_output(tmp_path):
    transformers = quiet_transformers()
    model = with_processor(DINOV2, "base", DINOV2_PROCESSOR, tmp_path / "dinov2")
    images = photos(3)
    ours = embed_image(images, model=model)
    processor = transformers.AutoImageProcessor.from_pretrained(str(model), use_fast=False)
    reference = transformers.AutoModel.from_pretrained(str(model)).eval()
    loaded = [Image.open(p).convert("RGB") if isinstance(p, str) else p for p in images]
    with torch.inference_mode():
        expected = reference(**processor(loaded, return_tensors="pt")).pooler_output
    assert ours.shape == (3, 768) and torch.equal(ours, expected)
    normal = embed_image(images, model=model, normalize=True)
    assert torch.allclose(normal.norm(dim=-1), torch.ones(3))


def test_bad_images_and_headless_models_are_refused(vit, tmp_path):
    (tmp_path / "notes.png").write_text("not pixels")
    with pytest.raises(ImageError, match=r"image 1 \(.*notes.png\): not an image"):
        classify_image(photos(1) + [str(tmp_path / "notes.png")], model=vit)
    headless = with_processor(DINOV2, "base", DINOV2_PROCESSOR, tmp_path / "dinov2")
    with pytest.raises(MissingHeadError, match="classify_image"):
        classify_image(photos(1), model=headless)


def test_cli_classify_image(vit, tmp_path, capsys):
    images = [p for p in photos(2) if isinstance(p, str)]
    if not images:
        for i, image in enumerate(photos(2)):
            image.save(tmp_path / f"photo{i}.png")
            images.append(str(tmp_path / f"photo{i}.png"))
    assert main(["classify-image", *images, "--model", str(vit), "--top-k", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == classify_image(images, model=vit, top_k=2)
    assert main(["classify-image", str(tmp_path / "missing.jpg"), "--model", str(vit)]) == 2
    assert "image 0 (" in (err := capsys.readouterr().err) and "missing.jpg): no such file" in err
