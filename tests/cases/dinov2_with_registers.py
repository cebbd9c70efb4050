"""DINOv2 with registers: an odd head size with three register tokens (the layers are DINOv2's, whose cases
cover real width)."""

HEADS = ("base", "image_classification")

CONFIGS = {
    "dinov2-registers-hd24": dict(model_type="dinov2_with_registers", hidden_size=96, num_attention_heads=4,
                                  num_hidden_layers=2, image_size=32, patch_size=8, num_labels=2,
                                  num_register_tokens=3),
}
