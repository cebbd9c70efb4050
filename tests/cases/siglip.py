"""SigLIP: the dual model at real width (hidden 768, 12 heads of 64, 2 layers per tower; 224-pixel images in patches
of 16) and at an odd head size (96, 4 heads of 24; 64-pixel images in patches of 16; the text tower alone with a projection of 40); each
tower alone at the odd size, the vision tower also without its attention-pooling head."""

_TEXT_768 = dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=2, intermediate_size=3072,
                 vocab_size=1024, max_position_embeddings=16)
_VISION_768 = dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=2, intermediate_size=3072,
                   image_size=224, patch_size=16)
_TEXT_24 = dict(hidden_size=96, num_attention_heads=4, num_hidden_layers=2, intermediate_size=160, vocab_size=512,
                max_position_embeddings=16, projection_size=40, layer_norm_eps=1e-5)
_VISION_24 = dict(hidden_size=96, num_attention_heads=4, num_hidden_layers=2, intermediate_size=160, image_size=64,
                  patch_size=16, hidden_act="gelu")

HEADS = ("base",)

CONFIGS = {
    "siglip-768": dict(model_type="siglip", text_config=_TEXT_768, vision_config=_VISION_768),
    # the scores pair the text head's output with the pooled image: projection_size is the vision width here
    "siglip-hd24": dict(model_type="siglip", text_config={**_TEXT_24, "projection_size": 96}, vision_config=_VISION_24),
    "siglip-text-hd24": dict(model_type="siglip_text_model", **_TEXT_24),
    "siglip-vision-hd24": dict(model_type="siglip_vision_model", **_VISION_24),
    "siglip-vision-nohead-hd24": dict(model_type="siglip_vision_model", **_VISION_24, vision_use_head=False),
}

VARIANT_HEADS = {"siglip-text-hd24": ("text_model",)}
