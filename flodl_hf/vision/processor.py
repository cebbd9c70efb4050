"""The image processors of ViT, DeiT, BiT (DINOv2's), CLIP and SigLIP, read from ``preprocessor_config.json``.

``ImageProcessor(images, return_tensors="pt")["pixel_values"]`` is ``torch.equal`` to transformers'
``AutoImageProcessor.from_pretrained(src, use_fast=False)`` (its PIL backend, ``*ImageProcessorPil``): the same
defaults per processor class, the same reading of the file (a null field takes the class default, an int ``size``
is square or a shortest edge by ``default_to_square``), and the same steps in the same order: resize through Pillow
with the configured resample, center crop, rescale, normalize (flodl_hf.vision.transforms). transformers' fast
processors run on torchvision, a different resampler; their pixels are not these (docs/images.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flodl_hf.core import io
from flodl_hf.core.errors import ConfigError, ImageError
from flodl_hf.vision import transforms
from flodl_hf.vision.images import channels_first, flat_list, name_of

PROCESSOR_FILE = "preprocessor_config.json"
STANDARD = (0.5, 0.5, 0.5)  # transformers' IMAGENET_STANDARD_MEAN and _STD
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_STD
BILINEAR, BICUBIC = 2, 3

_SHORT_CROPPED = {"resample": BICUBIC, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "size": {"shortest_edge": 224},
                  "default_to_square": False, "crop_size": {"height": 224, "width": 224}, "do_center_crop": True,
                  "do_convert_rgb": True}
# Each processor class's defaults (its *ImageProcessorPil class attributes); every other field is None there.
CLASSES: dict[str, dict[str, Any]] = {
    "ViTImageProcessor": {"resample": BILINEAR, "image_mean": STANDARD, "image_std": STANDARD,
                          "size": {"height": 224, "width": 224}},
    "DeiTImageProcessor": {"resample": BICUBIC, "image_mean": STANDARD, "image_std": STANDARD,
                           "size": {"height": 256, "width": 256}, "crop_size": {"height": 224, "width": 224},
                           "do_center_crop": True},
    "BitImageProcessor": _SHORT_CROPPED,
    "CLIPImageProcessor": _SHORT_CROPPED,
    "SiglipImageProcessor": {"resample": BICUBIC, "image_mean": STANDARD, "image_std": STANDARD,
                             "size": {"height": 224, "width": 224}, "default_to_square": False,
                             "do_convert_rgb": True},
}
COMMON = {"do_resize": True, "do_rescale": True, "do_normalize": True, "rescale_factor": 1 / 255,
          "default_to_square": True}
# config.json's model_type -> its processor class, for a preprocessor_config.json that names none
MODEL_TYPES = {"vit": "ViTImageProcessor", "deit": "DeiTImageProcessor", "dinov2": "BitImageProcessor",
               "dinov2_with_registers": "BitImageProcessor", "clip": "CLIPImageProcessor",
               "siglip": "SiglipImageProcessor"}
FLAGS = ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb", "default_to_square")
VALUES = ("size", "crop_size", "resample", "rescale_factor", "image_mean", "image_std")
SIZE_KEYS = ({"height", "width"}, {"shortest_edge"}, {"shortest_edge", "longest_edge"})


def _size(value: Any, square: bool, field: str, where: str) -> dict[str, int]:
    """``get_size_dict``: an int is square (or a shortest edge when ``square`` is False), a pair is (height,
    width), a dict must hold one of the key sets this processor resizes by."""
    if isinstance(value, bool):
        value = None
    if isinstance(value, int):
        value = {"height": value, "width": value} if square else {"shortest_edge": value}
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        value = {"height": value[0], "width": value[1]}
    if not isinstance(value, dict) or set(value) not in SIZE_KEYS:
        raise ConfigError(f"{where}: field {field!r} is {value!r}; expected an int, [height, width], or a dict with "
                          "'height' and 'width', 'shortest_edge', or 'shortest_edge' and 'longest_edge'")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value.values()):
        raise ConfigError(f"{where}: field {field!r} is {value!r}; its sizes must be positive integers")
    return dict(value)


def _numbers(value: Any, field: str, where: str) -> float | tuple[float, ...]:
    ok = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if ok(value):
        return float(value)
    if isinstance(value, (list, tuple)) and value and all(ok(v) for v in value):
        return tuple(float(v) for v in value)
    raise ConfigError(f"{where}: field {field!r} is {value!r}; expected a number or a list of numbers")


class ImageProcessor:
    """One image processor: its class name, the file's fields, and the settings resolved from both."""

    def __init__(self, kind: str, fields: dict[str, Any] | None = None, where: str = "image processor") -> None:
        if kind not in CLASSES:
            raise ConfigError(f"{where}: image processor {kind!r} is not supported; supported: "
                              + ", ".join(sorted(CLASSES)))
        self.kind = kind
        self.fields = dict(fields or {})
        settings = {**COMMON, **CLASSES[kind]}
        # transformers sets every field of the file, a null too (it then stands for "off" or "unset", not for
        # the class default); fields it does not know are kept and play no part
        settings.update({k: v for k, v in self.fields.items() if k in (*FLAGS, *VALUES)})
        for flag in FLAGS:
            if settings.get(flag) is not None and not isinstance(settings[flag], bool):
                raise ConfigError(f"{where}: field {flag!r} is {settings[flag]!r}; expected true or false")
        self.do_resize, self.do_rescale = bool(settings["do_resize"]), bool(settings["do_rescale"])
        self.do_normalize, self.do_center_crop = bool(settings["do_normalize"]), bool(settings.get("do_center_crop"))
        self.do_convert_rgb = bool(settings.get("do_convert_rgb"))
        size, crop, resample = settings.get("size"), settings.get("crop_size"), settings.get("resample")
        self.size = None if size is None else _size(size, bool(settings["default_to_square"]), "size", where)
        self.crop_size = None if crop is None else _size(crop, True, "crop_size", where)
        if self.crop_size is not None and set(self.crop_size) != {"height", "width"}:
            raise ConfigError(f"{where}: field 'crop_size' is {crop!r}; a crop needs 'height' and 'width'")
        if resample is not None and (isinstance(resample, bool) or resample not in range(6)):
            raise ConfigError(f"{where}: field 'resample' is {resample!r}; expected one of PIL's filters 0..5")
        self.resample = resample
        mean, std, factor = (settings.get(k) for k in ("image_mean", "image_std", "rescale_factor"))
        self.image_mean = None if mean is None else _numbers(mean, "image_mean", where)
        self.image_std = None if std is None else _numbers(std, "image_std", where)
        self.rescale_factor = None if factor is None else _numbers(factor, "rescale_factor", where)
        if isinstance(self.rescale_factor, tuple):
            raise ConfigError(f"{where}: field 'rescale_factor' is {factor!r}; expected a number")
        # validate_preprocess_arguments, at load time
        for on, needed in ((self.do_resize, ("size", "resample")), (self.do_center_crop, ("crop_size",)),
                           (self.do_rescale, ("rescale_factor",)), (self.do_normalize, ("image_mean", "image_std"))):
            missing = [name for name in needed if on and getattr(self, name) is None]
            if missing:
                raise ConfigError(f"{where}: field {missing[0]!r} is missing or null, and the processor needs it "
                                  f"(its do_ switch is on)")

    # ---- loading and saving -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, source: str | os.PathLike, revision: str | None = None) -> "ImageProcessor":
        """The processor of a model directory (its ``preprocessor_config.json``), a path to that file, a hub id
        or ``samples/<name>``. The class comes from ``image_processor_type`` (a ``Fast``/``Pil`` suffix dropped),
        else ``feature_extractor_type`` (as ``...ImageProcessor``), else config.json's ``model_type``."""
        path = Path(source).expanduser()
        if path.is_file():
            file, root = path, path.parent
        else:
            root = path if path.is_dir() else io.resolve(source, revision).root
            file = root / PROCESSOR_FILE
        if not file.is_file():
            raise ConfigError(f"{file}: not found; an image model's directory holds its {PROCESSOR_FILE}")
        fields = io.read_json(file, PROCESSOR_FILE)
        return cls(kind_of(fields, root, file), fields, str(file))

    def save_pretrained(self, directory: str | os.PathLike, push_to_hub: bool = False, **kwargs: Any) -> str:
        """``preprocessor_config.json`` in ``directory`` (made if missing): the fields read, with the class."""
        from flodl_hf.core import validate
        out = validate.save_directory(directory, "image processor", push_to_hub, kwargs)
        fields = {**self.fields, "image_processor_type": self.kind}
        fields.pop("feature_extractor_type", None)
        target = out / PROCESSOR_FILE
        scratch = out / f".{PROCESSOR_FILE}.{os.getpid()}.tmp"
        scratch.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
        os.replace(scratch, target)
        return str(target)

    # ---- processing ---------------------------------------------------------------------------------

    def preprocess_one(self, image: Any, where: str) -> np.ndarray:
        """One image through the steps, as ``PilBackend._preprocess`` runs them: resize, center crop, rescale,
        normalize."""
        array = channels_first(image, self.do_convert_rgb, where)
        if self.do_resize:
            height, width = transforms.output_size(array.shape[-2], array.shape[-1], self.size)
            array = transforms.resize(array, height, width, self.resample, where)
        if self.do_center_crop:
            array = transforms.center_crop(array, self.crop_size["height"], self.crop_size["width"])
        if self.do_rescale:
            array = transforms.rescale(array, self.rescale_factor)
        if self.do_normalize:
            array = transforms.normalize(array, self.image_mean, self.image_std, where)
        return array

    def __call__(self, images: Any, return_tensors: str | None = None) -> dict[str, Any]:
        """``{"pixel_values": ...}`` for one image or a batch: a (B, C, H, W) tensor with ``return_tensors="pt"``,
        an array with ``"np"``, else a list of (C, H, W) arrays."""
        batch = flat_list(images)
        if not batch:
            raise ImageError("no images given")
        arrays = [self.preprocess_one(image, name_of(image, i)) for i, image in enumerate(batch)]
        if return_tensors is None:
            return {"pixel_values": arrays}
        if return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors={return_tensors!r}: expected 'pt', 'np' or None")
        shapes = {a.shape for a in arrays}
        if len(shapes) > 1:
            raise ImageError(f"the images come out in {len(shapes)} shapes ({', '.join(map(str, sorted(shapes)))}) "
                             "and cannot be stacked; pass return_tensors=None, or set a crop or a fixed size")
        stacked = np.array(arrays)
        return {"pixel_values": torch.from_numpy(stacked) if return_tensors == "pt" else stacked}

    preprocess = __call__

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.kind}, size={self.size}, crop_size={self.crop_size}, "
                f"resample={self.resample}, convert_rgb={self.do_convert_rgb})")


def kind_of(fields: dict[str, Any], root: Path, file: Path) -> str:
    """The processor class a file names (``Fast``/``Pil`` dropped), or config.json's model_type's; remote code
    (``auto_map``) is refused."""
    if isinstance(fields.get("auto_map"), dict) and ("AutoImageProcessor" in fields["auto_map"]
                                                     or "AutoFeatureExtractor" in fields["auto_map"]):
        raise ConfigError(f"{file}: field 'auto_map' asks for remote code; flodl-hf never runs it")
    kind = fields.get("image_processor_type")
    if kind is None and fields.get("feature_extractor_type") is not None:
        kind = fields["feature_extractor_type"]
        kind = kind.replace("FeatureExtractor", "ImageProcessor") if isinstance(kind, str) else kind
    if kind is not None:
        if not isinstance(kind, str):
            raise ConfigError(f"{file}: field 'image_processor_type' is {kind!r}; expected a class name")
        for suffix in ("Fast", "Pil"):
            kind = kind[:-len(suffix)] if kind.endswith(suffix) else kind
        return kind
    config = root / io.CONFIG_NAME
    model_type = io.read_json(config, io.CONFIG_NAME).get("model_type") if config.is_file() else None
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ConfigError(f"{file}: field 'image_processor_type' is missing, and "
                      + (f"{config}'s model_type {model_type!r} names no image processor" if config.is_file()
                         else f"there is no {io.CONFIG_NAME} beside it to tell the class"))


class AutoImageProcessor:
    """``AutoImageProcessor.from_pretrained(src)``: the processor of a source, as transformers' with
    ``use_fast=False``."""

    def __init__(self) -> None:
        raise TypeError("AutoImageProcessor is built with AutoImageProcessor.from_pretrained(source)")

    @staticmethod
    def from_pretrained(source: str | os.PathLike, revision: str | None = None, **kwargs: Any) -> ImageProcessor:
        kwargs.pop("use_fast", None)  # transformers' fast processors are torchvision's; these are the PIL ones
        backend = kwargs.pop("backend", None)
        if backend not in (None, "pil"):
            raise ValueError(f"backend={backend!r}: flodl-hf's processors are transformers' PIL backend ('pil')")
        if kwargs:
            raise TypeError(f"AutoImageProcessor.from_pretrained() got unexpected keyword arguments: "
                            f"{', '.join(sorted(kwargs))}")
        return ImageProcessor.from_pretrained(source, revision)
