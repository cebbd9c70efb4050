"""SigLIP's dual model (``siglip``): at real width (hidden 768, 12 heads of 64, 2 layers per tower; 224-pixel images in
patches of 16) and at an odd head size (96, 4 heads of 24; 64-pixel images in patches of 16). Each tower alone:
tests/cases/siglip_text_model.py, siglip_vision_model.py."""

TEXT_768 = dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=2, intermediate_size=3072,
                vocab_size=1024, max_position_embeddings=16)
VISION_768 = dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=2, intermediate_size=3072,
                  image_size=224, patch_size=16)
TEXT_24 = dict(hidden_size=96, num_attention_heads=4, num_hidden_layers=2, intermediate_size=160, vocab_size=512,
               max_position_embeddings=16, layer_norm_eps=1e-5)
VISION_24 = dict(hidden_size=96, num_attention_heads=4, num_hidden_layers=2, intermediate_size=160, image_size=64,
                 patch_size=16, hidden_act="gelu")

HEADS = ("base",)

CONFIGS = {
    # the scores pair the text head's output (projection_size: the text width by default) with the pooled image
    "siglip-hd24": dict(model_type="siglip", text_config=TEXT_24, vision_config=VISION_24),
    "siglip-768": dict(model_type="siglip", text_config=TEXT_768, vision_config=VISION_768),
}
