"""Qwen2: LLaMA's parts with q/k/v biases, tied embeddings, and a sliding second layer (window 4), head_dim
24, GQA 2:1, vocab 32000."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls", "qa")

CONFIGS = {
    "qwen2-hd24-sliding": dict(model_type="qwen2", hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=2, intermediate_size=160, vocab_size=32000,
                               max_position_embeddings=64, pad_token_id=0, num_labels=3, tie_word_embeddings=True,
                               use_sliding_window=True, sliding_window=4, max_window_layers=1),
}
