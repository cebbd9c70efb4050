"""The image processors against transformers' (``AutoImageProcessor.from_pretrained(src, use_fast=False)``, its
PIL backend) in the same run: real photos (foolbox's ImageNet JPEGs and CIFAR PNGs, when fetched) and odd images
made here (1x1, 1xN, 16-bit, greyscale, RGBA, palette, arrays and tensors in both layouts); where transformers
fails on an image, ours fails too, with an ImageError naming it. Bad files and configs get typed errors."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flodl_hf.core import samples
from flodl_hf.core.errors import ConfigError, ImageError
from flodl_hf.roundtrip.parity import quiet_transformers
from flodl_hf.vision import AutoImageProcessor, ImageProcessor

# Each processor class with its defaults, and the files of real checkpoints of each kind as the hub holds them
# (legacy int sizes and feature_extractor_type included).
CONFIGS = {
    "vit": {"image_processor_type": "ViTImageProcessor"},
    "vit-hub": {"do_normalize": True, "do_resize": True, "feature_extractor_type": "ViTFeatureExtractor",
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "size": 224},
    "deit": {"image_processor_type": "DeiTImageProcessor"},
    "deit-hub": {"crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
                 "feature_extractor_type": "DeiTFeatureExtractor", "image_mean": [0.485, 0.456, 0.406],
                 "image_std": [0.229, 0.224, 0.225], "resample": 3, "size": 256},
    "bit": {"image_processor_type": "BitImageProcessor"},
    "dinov2-hub": {"crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "do_convert_rgb": True,
                   "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.485, 0.456, 0.406],
                   "image_std": [0.229, 0.224, 0.225], "image_processor_type": "BitImageProcessor", "resample": 3,
                   "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 256}},
    "clip": {"image_processor_type": "CLIPImageProcessor"},
    "clip-hub": {"crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
                 "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": [0.48145466, 0.4578275, 0.40821073],
                 "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "size": 224},
    "siglip": {"image_processor_type": "SiglipImageProcessor"},
    "siglip-odd": {"image_processor_type": "SiglipImageProcessorFast", "size": {"height": 37, "width": 51},
                   "resample": 0, "do_convert_rgb": None},
    "clip-long": {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 40, "longest_edge": 48},
                  "crop_size": {"height": 50, "width": 30}, "resample": 1},
}


@pytest.fixture(scope="module")
def processors(tmp_path_factory) -> dict[str, tuple[ImageProcessor, object]]:
    transformers = quiet_transformers()
    root = tmp_path_factory.mktemp("processors")
    out = {}
    for name, fields in CONFIGS.items():
        (root / name).mkdir()
        (root / name / "preprocessor_config.json").write_text(json.dumps(fields))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = transformers.AutoImageProcessor.from_pretrained(str(root / name), use_fast=False)
        out[name] = (AutoImageProcessor.from_pretrained(root / name), theirs)
    return out


def compare(ours: ImageProcessor, theirs, images) -> bool:
    """True when both give the same pixel values (dtype and bits); False when both fail (ours with an
    ImageError); any other outcome fails the test."""
    try:
        expected = theirs(images, return_tensors="pt")["pixel_values"]
    except (ValueError, TypeError, OSError):
        with pytest.raises(ImageError, match=r"image \d"):
            ours(images, return_tensors="pt")
        return False
    got = ours(images, return_tensors="pt")["pixel_values"]
    assert got.dtype == expected.dtype and torch.equal(got, expected), (ours, got.shape, expected.shape)
    return True


def odd_images(tmp: Path) -> dict[str, object]:
    rng = np.random.RandomState(0)
    rgb = rng.randint(0, 256, (5, 9, 3), dtype=np.uint8)
    rgba = np.dstack([rgb, rng.randint(0, 256, (5, 9), dtype=np.uint8)])
    palette = Image.fromarray(rgb).convert("P")
    transparent = palette.copy()
    transparent.info["transparency"] = int(np.asarray(palette)[0, 0])
    deep = rng.randint(0, 65536, (6, 8)).astype(np.uint16)
    Image.fromarray(deep).save(tmp / "deep.png")
    Image.fromarray(rgb[..., 0]).save(tmp / "grey.png")
    Image.fromarray(rgba).save(tmp / "rgba.png")
    chw = np.ascontiguousarray(rgb.transpose(2, 0, 1))
    return {
        "1x1": Image.fromarray(rgb[:1, :1]), "1x7": Image.fromarray(rgb[:1, :7]), "7x1": Image.fromarray(rgb[:, :1]),
        "grey": Image.fromarray(rgb[..., 0]), "rgba": Image.fromarray(rgba), "la": Image.fromarray(rgba).convert("LA"),
        "palette": palette, "palette-transparent": transparent, "bilevel": Image.fromarray(rgb[..., 0]).convert("1"),
        "16-bit": Image.open(tmp / "deep.png"), "16-bit-path": str(tmp / "deep.png"),
        "grey-path": str(tmp / "grey.png"), "rgba-path": str(tmp / "rgba.png"),
        "numpy-hwc": rgb, "numpy-chw": chw, "numpy-1x1x3": rgb[:1, :1], "numpy-1x7x3": rgb[:1, :7],
        "numpy-hw1": rgb[..., :1], "numpy-rgba": rgba, "numpy-float": rgb.astype(np.float32) / 255,
        "tensor-chw": torch.from_numpy(chw), "tensor-float": torch.from_numpy(chw).float() / 255,
        "tensor-2-channels": torch.from_numpy(chw[:2].copy()),
        "tensor-4-channels": torch.from_numpy(np.ascontiguousarray(rgba.transpose(2, 0, 1))),
        "batch-4d": torch.from_numpy(np.stack([chw, chw[:, ::-1].copy()])),
    }


def test_odd_images_equal_transformers(processors, tmp_path):
    images = odd_images(tmp_path)
    equal = {(name, kind) for name, (ours, theirs) in processors.items() for kind, image in images.items()
             if compare(ours, theirs, image)}
    # what converts to RGB (BiT, CLIP, SigLIP) takes every odd image but a tensor whose channels cannot be told
    for name in ("bit", "clip", "siglip", "dinov2-hub"):
        assert {kind for n, kind in equal if n == name} == set(images) - {"tensor-2-channels"}, name
    # ViT and DeiT convert nothing: a greyscale, RGBA or palette image fails there as in transformers, while a
    # path is opened as RGB (load_image) and works
    for name in ("vit", "deit-hub"):
        kinds = {kind for n, kind in equal if n == name}
        assert {"1x1", "1x7", "7x1", "16-bit-path", "grey-path", "rgba-path", "numpy-hwc", "tensor-float",
                "batch-4d"} <= kinds
        assert not kinds & {"grey", "rgba", "palette", "tensor-4-channels", "tensor-2-channels"}
    assert len(equal) >= 200


def real_images(pattern: str) -> list[Path]:
    path = samples.local_path("images")
    if path is None:
        pytest.skip(f"samples/images is not in the cache {samples.cache_dir()} (run `flodl-hf samples fetch images`)")
    found = sorted(path.glob(pattern))
    assert len(found) == 20
    return found


def test_real_photos_equal_transformers(processors):
    """The 20 ImageNet JPEGs (512x512) and 20 CIFAR-10 PNGs (32x32), as one batch of paths and as PIL images."""
    photos = real_images("imagenet_*.jpg") + real_images("cifar10_*.png")
    for name in ("vit-hub", "deit-hub", "dinov2-hub", "clip-hub", "siglip"):  # one of each class, as the hub has it
        ours, theirs = processors[name]
        assert compare(ours, theirs, [str(p) for p in photos])
        assert compare(ours, theirs, [Image.open(p) for p in photos[::7]])
    greys = real_images("mnist_*.png")[:5]
    assert compare(*processors["clip"], [Image.open(p) for p in greys])  # converted: greyscale to RGB
    assert not compare(*processors["vit"], [Image.open(p) for p in greys])  # not converted: fails in both


def jpeg_bytes(size: int = 64) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.RandomState(1).randint(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


def test_bad_images_get_typed_errors_naming_them(processors, tmp_path, monkeypatch):
    ours = processors["clip"][0]
    good = jpeg_bytes()
    files = {"truncated.jpg": good[:len(good) // 2], "corrupt.jpg": good[:20] + b"\0" * 50 + good[70:],
             "notes.jpg": b"these are not pixels\n", "empty.png": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "good.jpg").write_bytes(good)
    before = sorted(p.name for p in tmp_path.iterdir())
    cases = {str(tmp_path / "truncated.jpg"): "corrupt or truncated", str(tmp_path / "corrupt.jpg"): "corrupt",
             str(tmp_path / "notes.jpg"): "not an image", str(tmp_path / "empty.png"): "not an image",
             str(tmp_path / "folder.png"): "not a regular file", str(tmp_path / "missing.png"): "no such file",
             "https://example.com/cat.png": "no network"}
    for path, why in cases.items():
        with pytest.raises(ImageError, match="image 1 .*" + why) as caught:
            ours([str(tmp_path / "good.jpg"), path])
        assert path in str(caught.value)
    for image, why in ((Image.new("RGB", (0, 0)), "empty"), (np.zeros((0, 4, 3), np.uint8), "empty"),
                       (torch.zeros(2, 8, 8, dtype=torch.uint8), "cannot tell its channels"),
                       (torch.zeros(1, 2, 3, 4, 4), "5 dimensions")):
        with pytest.raises(ImageError, match="image 2 .*" + why if not isinstance(image, Image.Image) else why):
            ours([str(tmp_path / "good.jpg"), str(tmp_path / "good.jpg"), image])
    for bad in (torch.zeros(4, 8, 8, dtype=torch.uint8), torch.zeros(2, 8, 8, dtype=torch.uint8)):  # 3 expected
        with pytest.raises(ImageError, match=r"image 0 \(a Tensor of shape"):
            processors["vit"][0](bad)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64 x 64 is past twice the limit: PIL's bomb error
    with pytest.raises(ImageError, match="good.jpg.*decompression-bomb"):
        ours(str(tmp_path / "good.jpg"))
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize("fields, why", [
    ({"do_resize": True}, "'image_processor_type' is missing"),
    ({"image_processor_type": "ConvNextImageProcessor"}, "ConvNextImageProcessor' is not supported"),
    ({"image_processor_type": 7}, "'image_processor_type' is 7"),
    ({"image_processor_type": "ViTImageProcessor", "size": "big"}, "'size' is 'big'"),
    ({"image_processor_type": "ViTImageProcessor", "size": {"height": 224}}, "'size'"),
    ({"image_processor_type": "ViTImageProcessor", "size": {"height": 0, "width": 4}}, "positive"),
    ({"image_processor_type": "CLIPImageProcessor", "crop_size": {"shortest_edge": 4}}, "'crop_size'"),
    ({"image_processor_type": "ViTImageProcessor", "resample": 9}, "'resample' is 9"),
    ({"image_processor_type": "ViTImageProcessor", "image_mean": "grey"}, "'image_mean' is 'grey'"),
    ({"image_processor_type": "ViTImageProcessor", "rescale_factor": [1, 2]}, "'rescale_factor'"),
    ({"image_processor_type": "ViTImageProcessor", "do_resize": "yes"}, "'do_resize' is 'yes'"),
    ({"image_processor_type": "ViTImageProcessor", "auto_map": {"AutoImageProcessor": "x.Y"}}, "remote code"),
])
def test_bad_preprocessor_config_names_the_file_and_field(tmp_path, fields, why):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(fields))
    with pytest.raises(ConfigError, match=why) as caught:
        AutoImageProcessor.from_pretrained(tmp_path)
    assert "preprocessor_config.json" in str(caught.value)


def test_unreadable_or_absent_config_and_the_model_type_fallback(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="preprocessor_config.json.*not valid JSON"):
        AutoImageProcessor.from_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()
    with pytest.raises(ConfigError, match="preprocessor_config.json: not found"):
        AutoImageProcessor.from_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"do_resize": True}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "dinov2"}))
    assert AutoImageProcessor.from_pretrained(tmp_path / "preprocessor_config.json").kind == "BitImageProcessor"


def test_save_pretrained_is_read_back_by_transformers(processors, tmp_path):
    ours = processors["clip-long"][0]
    written = ours.save_pretrained(tmp_path / "out")
    assert Path(written).name == "preprocessor_config.json" and sorted(p.name for p in (tmp_path / "out").iterdir()) \
        == ["preprocessor_config.json"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = quiet_transformers().AutoImageProcessor.from_pretrained(str(tmp_path / "out"), use_fast=False)
    assert compare(AutoImageProcessor.from_pretrained(tmp_path / "out"), theirs, odd_images(tmp_path)["numpy-hwc"])
