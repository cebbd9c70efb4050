"""Granite: granite-3.0's multipliers (embedding 12, attention 0.015625 in place of 24 ** -0.5, residual 0.22,
logits divided by 8), head_dim 24 (hidden 96 / 4 heads), GQA 2:1, attention and MLP biases, tied embeddings; the
causal LM is transformers' only head."""

HEADS = ("base", "causal_lm")

CONFIGS = {
    "granite-hd24-multipliers": dict(model_type="granite", hidden_size=96, num_attention_heads=4,
                                     num_key_value_heads=2, num_hidden_layers=2, intermediate_size=160,
                                     vocab_size=512, max_position_embeddings=64, pad_token_id=0, num_labels=3,
                                     attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                     embedding_multiplier=12.0, attention_multiplier=0.015625,
                                     residual_multiplier=0.22, logits_scaling=8.0),
}
