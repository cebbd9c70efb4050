"""The steps of an image processor on one (C, H, W) array, each in the order and dtypes of transformers'
``image_transforms`` (``resize`` through Pillow, ``center_crop``, ``rescale``, ``normalize``) as its PIL backend
calls them: the same values, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import numpy as np
from PIL import Image

from flodl_hf.core.errors import ImageError


def output_size(height: int, width: int, size: dict[str, int]) -> tuple[int, int]:
    """(height, width) after resizing, as ``PilBackend.resize`` picks it from ``size``: ``shortest_edge`` with
    ``longest_edge`` (``get_size_with_aspect_ratio``), ``shortest_edge`` alone (``get_resize_output_image_size``,
    torchvision's rule), or ``height`` and ``width``."""
    if size.get("shortest_edge") and size.get("longest_edge"):
        return _with_aspect_ratio(height, width, size["shortest_edge"], size["longest_edge"])
    if size.get("shortest_edge"):
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)
    return size["height"], size["width"]


def _with_aspect_ratio(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """``get_size_with_aspect_ratio``: the short edge to ``size`` unless the long edge would pass ``max_size``."""
    raw = None
    low, high = float(min(height, width)), float(max(height, width))
    if high / low * size > max_size:
        raw = max_size * low / high
        size = int(round(raw))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        return (int(raw * height / width) if raw is not None else int(size * height / width)), size
    return size, (int(raw * width / height) if raw is not None else int(size * width / height))


def _needs_scaling(image: np.ndarray, where: str) -> bool:
    """``_rescale_for_pil_conversion``: whether a float image in [0, 1] is scaled to [0, 255] for Pillow."""
    if image.dtype == np.uint8:
        return False
    if np.allclose(image, image.astype(int)):
        if np.all(image >= 0) and np.all(image <= 255):
            return False
        raise ImageError(f"{where}: values outside [0, 255] ([{image.min()}, {image.max()}]) cannot be resized "
                         "through an 8-bit image")
    if np.all(image >= 0) and np.all(image <= 1):
        return True
    raise ImageError(f"{where}: float values outside [0, 1] ([{image.min()}, {image.max()}]) cannot be resized "
                     "through an 8-bit image")


def rescale(image: np.ndarray, scale: float) -> np.ndarray:
    """``rescale``: in float64, then float32."""
    return (image.astype(np.float64) * scale).astype(np.float32)


def resize(image: np.ndarray, height: int, width: int, resample: int, where: str) -> np.ndarray:
    """``resize`` of a (C, H, W) array: to an 8-bit PIL image (a float image in [0, 1] scaled by 255 first, one
    channel squeezed), Pillow's ``resize`` with ``resample``, and back (scaled by 1 / 255 if it was scaled)."""
    scaled = _needs_scaling(image, where)
    pixels = np.moveaxis(image, 0, -1)
    if pixels.shape[-1] == 1:
        pixels = np.squeeze(pixels, axis=-1)
    if scaled:
        pixels = rescale(pixels, 255)
    try:
        picture = Image.fromarray(pixels.astype(np.uint8))
    except (TypeError, ValueError) as exc:
        raise ImageError(f"{where}: Pillow cannot hold an image of shape {tuple(image.shape)} ({exc})") from None
    out = np.array(picture.resize((width, height), resample=resample, reducing_gap=None))
    if out.ndim == 2:
        out = out[..., None]
    out = np.moveaxis(out, -1, 0)
    return rescale(out, 1 / 255) if scaled else out


def center_crop(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """``center_crop`` of a (C, H, W) array: the middle window, padded with zeros where the image is smaller."""
    rows, cols = image.shape[-2:]
    top, left = (rows - height) // 2, (cols - width) // 2
    bottom, right = top + height, left + width
    if top >= 0 and bottom <= rows and left >= 0 and right <= cols:
        return image[..., top:bottom, left:right]
    new_rows, new_cols = max(height, rows), max(width, cols)
    padded = np.zeros_like(image, shape=image.shape[:-2] + (new_rows, new_cols))
    top_pad, left_pad = math.ceil((new_rows - rows) / 2), math.ceil((new_cols - cols) / 2)
    padded[..., top_pad:top_pad + rows, left_pad:left_pad + cols] = image
    top, bottom, left, right = top + top_pad, bottom + top_pad, left + left_pad, right + left_pad
    return padded[..., max(0, top):min(new_rows, bottom), max(0, left):min(new_cols, right)]


def normalize(image: np.ndarray, mean: float | Collection[float], std: float | Collection[float],
              where: str) -> np.ndarray:
    """``normalize`` of a (C, H, W) array: ``(image - mean) / std`` per channel, in float32 (or the image's own
    float dtype), as ``((image.T - mean) / std).T``."""
    channels = image.shape[0]
    if not np.issubdtype(image.dtype, np.floating):
        image = image.astype(np.float32)
    columns = []
    for name, value in (("image_mean", mean), ("image_std", std)):
        values = list(value) if isinstance(value, Collection) else [value] * channels
        if len(values) != channels:
            raise ImageError(f"{where}: has {channels} channel(s) where {name} has {len(values)}; "
                             "convert it to RGB first (a greyscale or RGBA image), or set do_convert_rgb")
        columns.append(np.array(values, dtype=image.dtype))
    return ((image.T - columns[0]) / columns[1]).T
