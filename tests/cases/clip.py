"""CLIP's dual model (``clip``): at real width (both towers hidden 768, 12 heads of 64, 2 layers; 224-pixel images in
patches of 32; EOS pooling by eos_token_id), and at an odd head size (96, 4 heads of 24) with the legacy eos_token_id 2
(argmax pooling) and erf GELU. Each tower alone: tests/cases/clip_text_model.py, clip_vision_model.py."""

TEXT_768 = dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=2, intermediate_size=3072,
                vocab_size=1024, max_position_embeddings=32, projection_dim=512, bos_token_id=1022,
                eos_token_id=1023)
VISION_768 = dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=2, intermediate_size=3072,
                  image_size=224, patch_size=32, projection_dim=512)
TEXT_24 = dict(hidden_size=96, num_attention_heads=4, num_hidden_layers=2, intermediate_size=160, vocab_size=512,
               max_position_embeddings=24, projection_dim=40, eos_token_id=2, hidden_act="gelu",
               layer_norm_eps=1e-6)
VISION_24 = dict(hidden_size=96, num_attention_heads=4, num_hidden_layers=2, intermediate_size=160, image_size=64,
                 patch_size=16, projection_dim=40, layer_norm_eps=1e-6)

HEADS = ("base",)

CONFIGS = {
    "clip-hd24": dict(model_type="clip", text_config=TEXT_24, vision_config=VISION_24, projection_dim=40,
                      logit_scale_init_value=1.5),
    "clip-768": dict(model_type="clip", text_config=TEXT_768, vision_config=VISION_768, projection_dim=512),
}
