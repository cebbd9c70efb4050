"""Gemma: scaled embeddings (sqrt(80), not a power of two), the (1 + weight) float32 RMSNorm, the
gelu_pytorch_tanh MLP, head_dim 24 given explicitly (hidden 80 is not heads x head_dim), attention_bias, GQA 2:1,
tied embeddings, vocab 32000; no QA head."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls")

CONFIGS = {
    "gemma-hd24-scaled-bias": dict(model_type="gemma", hidden_size=80, num_attention_heads=4, head_dim=24,
                                   num_key_value_heads=2, num_hidden_layers=2, intermediate_size=160,
                                   vocab_size=32000, max_position_embeddings=64, pad_token_id=0, num_labels=3,
                                   attention_bias=True),
}
