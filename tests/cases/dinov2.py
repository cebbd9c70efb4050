"""DINOv2: real width at patch 16 and 224 pixels (2 layers), and an odd head size with the SwiGLU MLP, layer scale
and patch 14 (with registers: tests/cases/dinov2_with_registers.py)."""

HEADS = ("base", "image_classification")

CONFIGS = {
    "dinov2-768": dict(model_type="dinov2", hidden_size=768, num_attention_heads=12, num_hidden_layers=2,
                       image_size=224, patch_size=16, num_labels=3, layerscale_value=0.5),
    "dinov2-swiglu-hd24": dict(model_type="dinov2", hidden_size=96, num_attention_heads=4, num_hidden_layers=2,
                               image_size=42, patch_size=14, num_labels=5, use_swiglu_ffn=True, mlp_ratio=3,
                               layerscale_value=0.1, hidden_act="gelu_new"),
}
