"""CLIP's vision tower alone (``clip_vision_model``), with and without its projection: at the odd head size (64-pixel
images in patches of 16), and at real width in patches of 16 (224 pixels, 197 positions)."""

from cases.clip import VISION_24, VISION_768

HEADS = ("base", "vision_projection")

CONFIGS = {
    "clip-vision-hd24": dict(model_type="clip_vision_model", **VISION_24),
    "clip-vision-768-p16": dict(model_type="clip_vision_model", **{**VISION_768, "patch_size": 16}),
}

VARIANT_HEADS = {"clip-vision-768-p16": ("vision_projection",)}
