"""SigLIP's text tower alone (``siglip_text_model``, its own task: transformers has no Auto class for it) at the odd
head size, with a projection of 40."""

from cases.siglip import TEXT_24

HEADS = ("text_model",)

CONFIGS = {"siglip-text-hd24": dict(model_type="siglip_text_model", **TEXT_24, projection_size=40)}
