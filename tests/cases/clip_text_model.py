"""CLIP's text tower alone (``clip_text_model``) at the odd head size, with and without its projection: pooled by the
legacy eos_token_id 2 (argmax), and by an eos_token_id in the vocabulary (its first position)."""

from cases.clip import TEXT_24

HEADS = ("base", "text_projection")

CONFIGS = {
    "clip-text-hd24": dict(model_type="clip_text_model", **TEXT_24),
    "clip-text-eos-hd24": dict(model_type="clip_text_model", **{**TEXT_24, "eos_token_id": 500}),
}

VARIANT_HEADS = {"clip-text-eos-hd24": ("text_projection",)}
