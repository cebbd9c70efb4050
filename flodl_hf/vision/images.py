"""Images in: file paths, PIL images, numpy arrays and torch tensors, brought to channels-first numpy arrays as
transformers' PIL-backed image processors bring them (``image_utils.load_image``, ``make_flat_list_of_images``,
``PilBackend.process_image``, ``image_transforms.convert_to_rgb``, ``infer_channel_dimension_format``).

Decoding is Pillow's: nothing here re-implements a codec. Where transformers would fail on an image (a channel
layout it cannot infer, an unreadable file), the error is an ImageError naming the image by its path or its index.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from flodl_hf.core.errors import ImageError

FIRST, LAST = "channels_first", "channels_last"
CHANNEL_COUNTS = (1, 3, 4)  # the counts PilBackend.process_image infers a layout from


def name_of(image: Any, index: int) -> str:
    """How an error names an image: its index in the batch, and its path when it came from a file."""
    if isinstance(image, (str, os.PathLike)):
        return f"image {index} ({os.fspath(image)})"
    if isinstance(image, (np.ndarray, torch.Tensor)):
        return f"image {index} (a {type(image).__name__} of shape {tuple(image.shape)})"
    return f"image {index}"


def is_image(value: Any) -> bool:
    """One image or a batch of them, as transformers' ``is_valid_image`` and its fetch step accept."""
    return isinstance(value, (Image.Image, np.ndarray, torch.Tensor, str, os.PathLike))


def flat_list(images: Any) -> list[Any]:
    """A flat list of single images, as ``make_flat_list_of_images`` (expected_ndims 3) forms it: one image, a
    list of images, a 4-D array or tensor (a batch), or a list of such lists, flattened."""
    if isinstance(images, (list, tuple)):
        if images and all(isinstance(item, (list, tuple)) for item in images):
            return [image for group in images for image in flat_list(group)]
        out: list[Any] = []
        for image in images:
            if isinstance(image, (np.ndarray, torch.Tensor)) and image.ndim == 4:
                out.extend(list(image))
            else:
                out.append(image)
        return out
    if isinstance(images, (np.ndarray, torch.Tensor)) and images.ndim == 4:
        return list(images)
    return [images]


def open_image(path: str | os.PathLike, where: str) -> Image.Image:
    """A file decoded by Pillow in full, as ``load_image`` opens one (orientation from EXIF, then RGB)."""
    file = Path(path).expanduser()
    if str(path).startswith(("http://", "https://")):
        raise ImageError(f"{where}: a URL; flodl-hf makes no network access, download the image and pass its path")
    if not file.exists():
        raise ImageError(f"{where}: no such file")
    if not file.is_file():
        raise ImageError(f"{where}: not a regular file")
    try:
        with Image.open(file) as opened:
            opened.load()
            image = ImageOps.exif_transpose(opened)
            return image.convert("RGB")
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{where}: past PIL's decompression-bomb limit ({exc}); refused. If the file is trusted, "
                         "raise PIL.Image.MAX_IMAGE_PIXELS first") from None
    except UnidentifiedImageError:
        raise ImageError(f"{where}: not an image Pillow can read") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError(f"{where}: corrupt or truncated image ({type(exc).__name__}: {exc})") from None


def for_pipeline(image: Any, where: str) -> Image.Image:
    """What the image pipelines hand their processor (``load_image``): a path opened, a PIL image turned by its
    EXIF orientation and converted to RGB. Arrays and tensors are taken as they are (the pipelines refuse them)."""
    if isinstance(image, (str, os.PathLike)):
        return open_image(image, where)
    if isinstance(image, Image.Image):
        check_size(image.height, image.width, where)
        return ImageOps.exif_transpose(image).convert("RGB")
    if isinstance(image, (np.ndarray, torch.Tensor)):
        return image
    raise ImageError(f"{where}: a {type(image).__name__}; expected a path, a PIL image, a numpy array or a tensor")


def check_size(height: int, width: int, where: str) -> None:
    if height < 1 or width < 1:
        raise ImageError(f"{where}: an empty image ({height}x{width} pixels)")


def infer_layout(array: np.ndarray, where: str, counts: Sequence[int] = CHANNEL_COUNTS) -> str:
    """``infer_channel_dimension_format``: channels first when the first axis could be the channels (even when
    the last could be too), else last when the last could be; else an ImageError."""
    if array.ndim != 3:
        raise ImageError(f"{where}: {array.ndim} dimensions; an image has 2 (height, width) or 3 (with channels)")
    if array.shape[0] in counts:
        return FIRST
    if array.shape[-1] in counts:
        return LAST
    raise ImageError(f"{where}: cannot tell its channels from its shape {tuple(array.shape)}: neither the first "
                     f"nor the last axis has {' or '.join(map(str, counts))} channels")


def _pil_to_rgb(image: Image.Image) -> np.ndarray:
    """``convert_to_rgb`` of a PIL image: transparency composited onto white, then RGB (H, W, 3)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.array(image.convert("RGB"))


def _array_to_rgb(array: np.ndarray, where: str) -> np.ndarray:
    """``convert_to_rgb`` of an array, in its own layout: one channel repeated, four composited onto white."""
    axis = -1 if infer_layout(array, where) == LAST else 0
    image = np.moveaxis(array, axis, -1)
    channels = image.shape[-1]
    if channels == 1:
        rgb = np.repeat(image, 3, axis=-1)
    elif channels == 4:
        if np.issubdtype(image.dtype, np.floating) and (image.min() < 0.0 or image.max() > 1.0):
            raise ImageError(f"{where}: a float RGBA image with values outside [0, 1] "
                             f"([{image.min()}, {image.max()}]) cannot be composited")
        white = 255 if np.issubdtype(image.dtype, np.integer) else 1.0
        alpha = image[..., 3:4] / white
        mixed = alpha * image[..., :3] + (1 - alpha) * white
        rgb = np.round(mixed).astype(image.dtype) if white == 255 else mixed.astype(image.dtype)
    else:
        rgb = image
    return np.moveaxis(rgb, -1, axis)


def channels_first(image: Any, convert_rgb: bool, where: str) -> np.ndarray:
    """One image as a (C, H, W) array, as ``PilBackend.process_image`` prepares it: RGB conversion first when
    asked (so a PIL image keeps its mode), a 2-D image given one channel, the layout of an array inferred."""
    if isinstance(image, (str, os.PathLike)):
        image = open_image(image, where)
    if isinstance(image, Image.Image):
        check_size(image.height, image.width, where)
        array = _pil_to_rgb(image) if convert_rgb else np.array(image)
        if array.ndim == 2:
            return array[None]
        return np.moveaxis(array, -1, 0)
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise ImageError(f"{where}: a {type(image).__name__}; expected a path, a PIL image, a numpy array or a "
                         "torch tensor")
    if image.ndim not in (2, 3):
        raise ImageError(f"{where}: {image.ndim} dimensions; an image has 2 (height, width) or 3 (with channels)")
    if image.size == 0:
        raise ImageError(f"{where}: an empty image (shape {tuple(image.shape)})")
    if convert_rgb:
        if image.ndim == 2:  # convert_to_rgb infers a layout, and a 2-D array has none
            raise ImageError(f"{where}: a 2-D array has no channel axis to convert to RGB; pass (H, W, 1) or a "
                             "PIL image")
        image = _array_to_rgb(image, where)
    if image.ndim == 2:
        return image[None]
    return np.moveaxis(image, -1, 0) if infer_layout(image, where) == LAST else image
