"""Mistral: LLaMA's parts with no biases and a sliding window (4) narrower than the 13-token parity batch,
head_dim 24, GQA 2:1, vocab 32000."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls", "qa")

CONFIGS = {
    "mistral-hd24-window4": dict(model_type="mistral", hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=2, intermediate_size=160, vocab_size=32000,
                                 max_position_embeddings=64, pad_token_id=0, num_labels=3, sliding_window=4),
}
