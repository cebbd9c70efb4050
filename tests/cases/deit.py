"""DeiT: real width (deit-base-distilled-patch16-224's fields, 2 layers: 198 tokens), and an odd head size.

``architectures`` is set because transformers 5.25's ``AutoModelForImageClassification.from_config`` picks among
DeiT's two classes by it and fails on a config without it (saving writes each model's own class name)."""

ARCH = ["DeiTForImageClassification"]

HEADS = ("base", "image_classification", "image_classification_teacher", "masked_image_modeling")

CONFIGS = {
    "deit-768": dict(model_type="deit", hidden_size=768, num_attention_heads=12, num_hidden_layers=2,
                     intermediate_size=3072, image_size=224, patch_size=16, num_labels=3,
                     architectures=ARCH),
    "deit-hd24": dict(model_type="deit", hidden_size=96, num_attention_heads=4, num_hidden_layers=2,
                      intermediate_size=160, image_size=32, patch_size=8, encoder_stride=8, num_labels=5,
                      layer_norm_eps=1e-6, architectures=ARCH),
}
