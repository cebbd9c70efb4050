"""verify-export's image processor check: the pixels an export's ``preprocessor_config.json`` gives.

On the probe images (an ImageNet photo of ``samples/images`` when fetched, and two images generated here: an odd
size in RGB and one with transparency), three processors must give ``torch.equal`` pixel values: ours on DIR,
transformers' on DIR (``use_fast=False``, its PIL backend) and transformers' on the source, when the source has one.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from flodl_hf.core import samples
from flodl_hf.roundtrip.parity import make_batch, quiet_transformers
from flodl_hf.vision import PROCESSOR_FILE, AutoImageProcessor


def probe_images(alpha: bool = True) -> tuple[list, str]:
    """(images, what they are): a real photo when ``samples/images`` is fetched, and generated ones always; the
    transparent one converted to RGB (as ``load_image`` converts) unless ``alpha``, for a processor that does
    not convert images itself."""
    rng = np.random.RandomState(0)
    rows = np.linspace(0, 255, 61, dtype=np.float64)[:, None, None]
    odd = (rows + rng.randint(0, 64, (61, 47, 3))).clip(0, 255).astype(np.uint8)
    rgba = np.dstack([odd[:40, :40], rng.randint(0, 256, (40, 40), dtype=np.uint8)])
    transparent = Image.fromarray(rgba) if alpha else Image.fromarray(rgba).convert("RGB")
    images = [Image.fromarray(odd), transparent]
    what = f"a generated 61x47 RGB and a 40x40 {'RGBA' if alpha else 'RGBA-made-RGB'} image"
    folder = samples.local_path("images")
    photos = sorted(folder.glob("imagenet_*.jpg")) if folder is not None else []
    if photos:  # first, so a batch of fewer rows than probes still holds the photo
        with Image.open(photos[0]) as photo:
            images.insert(0, photo.convert("RGB"))
        what = f"{photos[0].name} (samples/images), " + what
    return images, what


def pixel_values(processor, images: list) -> torch.Tensor:
    """One image at a time (a processor without a crop gives each its own size), flattened and joined."""
    return torch.cat([processor(image, return_tensors="pt")["pixel_values"].flatten() for image in images])


def compare_processors(directory: Path, source_root: Path | None) -> tuple[str, str] | None:
    """("PASS" or "FAIL", detail), or None when neither DIR nor the source has an image processor."""
    has_source = source_root is not None and (source_root / PROCESSOR_FILE).is_file()
    if not (directory / PROCESSOR_FILE).is_file():
        return None if not has_source else ("FAIL", f"the source has {PROCESSOR_FILE}, DIR has none")
    ours_processor = AutoImageProcessor.from_pretrained(directory)
    images, what = probe_images(ours_processor.do_convert_rgb)
    transformers = quiet_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = pixel_values(transformers.AutoImageProcessor.from_pretrained(str(directory), use_fast=False), images)
        reference = None
        if has_source:
            reference = pixel_values(transformers.AutoImageProcessor.from_pretrained(str(source_root), use_fast=False),
                                     images)
    ours = pixel_values(ours_processor, images)
    if not torch.equal(ours, theirs):
        return "FAIL", f"ours and transformers' processors on DIR differ on {what}"
    if reference is not None and not torch.equal(theirs, reference):
        return "FAIL", f"DIR's processor and the source's differ on {what}"
    against = "= the source's" if reference is not None else "(no source processor to compare with)"
    return "PASS", (f"pixel values ({ours.numel()} floats) torch.equal: ours on DIR = transformers' on DIR {against}; "
                    f"{what}")


def image_inputs(directory: Path, config: Any, task: str) -> tuple[dict[str, torch.Tensor], str] | None:
    """verify-export's inputs for an image model with a processor: ``make_batch``'s batch with its pixel values
    replaced by the probe images through DIR's processor (ours), one per row (repeated if the batch has more rows
    than there are probes); None when DIR has no processor or the model takes no pixels, or when the processor's
    images are not the size the model's batch has (then the random pixels stay)."""
    if not (directory / PROCESSOR_FILE).is_file():
        return None
    batch = make_batch(config, task)
    if "pixel_values" not in batch:
        return None
    processor = AutoImageProcessor.from_pretrained(directory)
    images, what = probe_images(processor.do_convert_rgb)
    rows = [processor(image, return_tensors="pt")["pixel_values"] for image in images]
    if {tuple(r.shape[1:]) for r in rows} != {tuple(batch["pixel_values"].shape[1:])}:
        return None
    count = batch["pixel_values"].shape[0]
    batch["pixel_values"] = torch.cat(rows)[torch.arange(count) % len(rows)]
    return batch, f"{count} images from {what}, through DIR's image processor"
