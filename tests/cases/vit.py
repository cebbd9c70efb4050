"""ViT: real width (vit-base-patch16-224's fields, 2 layers: 197 tokens), and an odd head size (head_dim 24) at
another image and patch size with gelu_new."""

HEADS = ("base", "image_classification", "masked_image_modeling")

CONFIGS = {
    "vit-768": dict(model_type="vit", hidden_size=768, num_attention_heads=12, num_hidden_layers=2,
                    intermediate_size=3072, image_size=224, patch_size=16, num_labels=3),
    "vit-hd24": dict(model_type="vit", hidden_size=96, num_attention_heads=4, num_hidden_layers=2,
                     intermediate_size=160, image_size=40, patch_size=8, encoder_stride=8, num_labels=5,
                     hidden_act="gelu_new", layer_norm_eps=1e-6, qkv_bias=False),
}
