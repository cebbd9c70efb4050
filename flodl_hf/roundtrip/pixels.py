"""verify-export's image processor check: the pixels an export's ``preprocessor_config.json`` gives.

On the probe images (an ImageNet photo of ``samples/images`` when fetched, and two images generated here: an odd
size in RGB and one with transparency), three processors must give ``torch.equal`` pixel values: ours on DIR,
transformers' on DIR (``use_fast=False``, its PIL backend) and transformers' on the source, when the source has one.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from flodl_hf.core import samples
from flodl_hf.roundtrip.parity import quiet_transformers
from flodl_hf.vision import PROCESSOR_FILE, AutoImageProcessor


def probe_images() -> tuple[list, str]:
    """(images, what they are): generated ones always, and a real photo when ``samples/images`` is fetched."""
    rng = np.random.RandomState(0)
    rows = np.linspace(0, 255, 61, dtype=np.float64)[:, None, None]
    odd = (rows + rng.randint(0, 64, (61, 47, 3))).clip(0, 255).astype(np.uint8)
    rgba = np.dstack([odd[:40, :40], rng.randint(0, 256, (40, 40), dtype=np.uint8)])
    images, what = [Image.fromarray(odd), Image.fromarray(rgba)], "a generated 61x47 RGB and a 40x40 RGBA image"
    folder = samples.local_path("images")
    photos = sorted(folder.glob("imagenet_*.jpg")) if folder is not None else []
    if photos:
        with Image.open(photos[0]) as photo:
            images.append(photo.convert("RGB"))
        what += f", and {photos[0].name} (samples/images)"
    return images, what


def pixel_values(processor, images: list) -> torch.Tensor:
    """One image at a time (a processor without a crop gives each its own size), flattened and joined."""
    return torch.cat([processor(image, return_tensors="pt")["pixel_values"].flatten() for image in images])


def compare_processors(directory: Path, source_root: Path | None) -> tuple[str, str] | None:
    """("PASS" or "FAIL", detail), or None when neither DIR nor the source has an image processor."""
    has_source = source_root is not None and (source_root / PROCESSOR_FILE).is_file()
    if not (directory / PROCESSOR_FILE).is_file():
        return None if not has_source else ("FAIL", f"the source has {PROCESSOR_FILE}, DIR has none")
    images, what = probe_images()
    transformers = quiet_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = pixel_values(transformers.AutoImageProcessor.from_pretrained(str(directory), use_fast=False), images)
        reference = None
        if has_source:
            reference = pixel_values(transformers.AutoImageProcessor.from_pretrained(str(source_root), use_fast=False),
                                     images)
    ours = pixel_values(AutoImageProcessor.from_pretrained(directory), images)
    if not torch.equal(ours, theirs):
        return "FAIL", f"ours and transformers' processors on DIR differ on {what}"
    if reference is not None and not torch.equal(theirs, reference):
        return "FAIL", f"DIR's processor and the source's differ on {what}"
    against = "= the source's" if reference is not None else "(no source processor to compare with)"
    return "PASS", (f"pixel values ({ours.numel()} floats) torch.equal: ours on DIR = transformers' on DIR {against}; "
                    f"{what}")
