"""Qwen3: per-head q/k norms, head_dim 24 given explicitly (hidden 80 is not heads x head_dim), attention_bias
on q, k, v and o, GQA 2:1, tied embeddings, and a sliding second layer (window 4) named by layer_types."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls", "qa")

CONFIGS = {
    "qwen3-hd24-qknorm-sliding": dict(model_type="qwen3", hidden_size=80, num_attention_heads=4, head_dim=24,
                                      num_key_value_heads=2, num_hidden_layers=2, intermediate_size=160,
                                      vocab_size=32000, max_position_embeddings=64, pad_token_id=0, num_labels=3,
                                      tie_word_embeddings=True, attention_bias=True, use_sliding_window=True,
                                      sliding_window=4, layer_types=["full_attention", "sliding_attention"]),
}
