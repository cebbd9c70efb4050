"""SigLIP's vision tower alone (``siglip_vision_model``) at the odd head size, with its attention-pooling head and
without it (``vision_use_head`` false: no pooled state)."""

from cases.siglip import VISION_24

HEADS = ("base",)

CONFIGS = {
    "siglip-vision-hd24": dict(model_type="siglip_vision_model", **VISION_24),
    "siglip-vision-nohead-hd24": dict(model_type="siglip_vision_model", **VISION_24, vision_use_head=False),
}
