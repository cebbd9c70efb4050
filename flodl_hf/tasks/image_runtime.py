"""The image tasks' runtime: a model and its image processor loaded once per process, images to pixel values as
the image pipelines prepare them, and the forward loop in batches formed as the text tasks form them.

Pixels: a path is opened and a PIL image turned by its EXIF orientation and converted to RGB (``load_image``, as
the pipelines do), an array or tensor goes to the processor as it is; then the model's image processor
(flodl_hf.vision, equal to transformers' PIL backend). Batches: images of one pixel shape are grouped, and each
group cut by ``flodl_hf.tasks.batching.plan`` with every image counted as its patch tokens (the text tasks' cost
model and ``batch_size``, with a budget of ``IMAGE_MAX_TOKENS`` a pass). A batch is an ordinary batch: our
models equal transformers' on it; against the pipelines' one image per pass, scores move by ulps (within 1e-6
measured), as for the text tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from flodl_hf.core.errors import ImageError
from flodl_hf.core.modeling import PLAIN_RECORD, config_sets_forward_defaults
from flodl_hf.tasks import batching
from flodl_hf.tasks.runtime import BatchSize, Source, _precision_context, load_module
from flodl_hf.vision import AutoImageProcessor, ImageProcessor
from flodl_hf.vision.images import for_pipeline, is_image, name_of

_PROCESSORS: dict[str, ImageProcessor] = {}
# Patch tokens in one pass, at most (the text tasks' 1024 is set by masked-LM logits, which images do not have).
# Measured on the 20 ImageNet photos through a ViT-base classifier (197 tokens an image), 2 busy cores: one image a
# pass 0.32 images/s, 1024 tokens (5 images) 0.80, 2048 (10) 1.16, 4096 (20) 1.12 (scripts/bench_image.py).
IMAGE_MAX_TOKENS = 2048


@dataclass
class LoadedImages:
    """A model with its image processor, and the precision it runs at."""

    model: nn.Module
    processor: ImageProcessor
    source: str
    precision: str = "exact"


def load_images(model: Source, task: str, processor: str | Path | ImageProcessor | None = None,
                precision: str = "exact", function: str | None = None) -> LoadedImages:
    """The model for ``task`` and its image processor (``processor``, else the model's own), cached by source."""
    missing = None if processor is not None else (
        "a model object was passed without its image processor: pass processor= (an ImageProcessor, or the "
        "directory holding its preprocessor_config.json)")
    module, source = load_module(model, task, precision, function or task, missing)
    if not isinstance(processor, ImageProcessor):
        where = str(processor if processor is not None else model)
        if where not in _PROCESSORS:
            _PROCESSORS[where] = AutoImageProcessor.from_pretrained(where)
        processor = _PROCESSORS[where]
    return LoadedImages(module, processor, source, precision)


def as_images(images: Any) -> tuple[list, bool]:
    """(a list of images, whether one image was given): one image, or a list or tuple of them."""
    if is_image(images) and not (isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 4):
        return [images], True
    if isinstance(images, (np.ndarray, torch.Tensor)):
        return list(images), False
    if isinstance(images, (list, tuple)):
        return list(images), False
    raise ImageError(f"images is a {type(images).__name__}: expected a path, a PIL image, an array or tensor, or a "
                     "list of them")


def pixel_rows(loaded: LoadedImages, images: Sequence[Any]) -> list[torch.Tensor]:
    """Each image's (C, H, W) pixel values, prepared as the pipelines prepare an image (``load_image``), then
    through the model's processor."""
    out = []
    for i, image in enumerate(images):
        where = name_of(image, i)
        array = loaded.processor.preprocess_one(for_pipeline(image, where), where)
        out.append(torch.from_numpy(np.ascontiguousarray(array)))
    return out


def _tokens(config: Any, shape: torch.Size) -> int:
    """An image's length for the batch planner: its patches plus one (the CLS token)."""
    patch = getattr(config, "patch_size", None) or getattr(getattr(config, "vision_config", None), "patch_size", 16)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    return (shape[-2] // patch) * (shape[-1] // patch) + 1


def run_images(loaded: LoadedImages, rows: list[torch.Tensor], batch_size: BatchSize,
               forward: Callable[[nn.Module, torch.Tensor, dict], torch.Tensor]) -> list[torch.Tensor]:
    """``forward(model, pixel_values, plain)`` on batches of ``rows``; one float32 CPU result per row, in order."""
    model = loaded.model
    policy = batch_size if isinstance(batch_size, batching.BatchPolicy) \
        else batching.BatchPolicy.for_model(getattr(model, "vision_model", model), batch_size,
                                            max_tokens=IMAGE_MAX_TOKENS)
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault((tuple(row.shape), row.dtype), []).append(i)
    results: list[torch.Tensor | None] = [None] * len(rows)
    device = next(model.parameters()).device
    plain = PLAIN_RECORD if config_sets_forward_defaults(model.config) else {}
    with torch.inference_mode(), _precision_context(loaded.precision):
        for (shape, _), members in groups.items():
            lengths = [_tokens(model.config, torch.Size(shape))] * len(members)
            for batch in batching.plan(lengths, policy):
                chunk = [members[j] for j in batch]
                pixels = torch.stack([rows[i] for i in chunk]).to(device)
                out = forward(model, pixels, plain)
                for j, i in enumerate(chunk):
                    results[i] = out[j].float().cpu()
    return results  # type: ignore[return-value]

