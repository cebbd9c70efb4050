"""Ministral: Mistral's parts (no biases) at head_dim 24 (given: transformers' MinistralAttention needs it; hidden
96 / 4 heads, 2 KV heads: GQA 2:1) with a sliding first layer (window 4, narrower than the batch) and a full second
by layer_types; and real width (hidden 768, 12 heads x 64) with one layer, sliding by the default rule (window 4),
for the backbone and the causal LM."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls", "qa")

CONFIGS = {
    "ministral-hd24-window4-layertypes": dict(model_type="ministral", hidden_size=96, num_attention_heads=4,
                                              head_dim=24, num_key_value_heads=2, num_hidden_layers=2,
                                              intermediate_size=160, vocab_size=512, max_position_embeddings=64,
                                              pad_token_id=0, num_labels=3, sliding_window=4,
                                              layer_types=["sliding_attention", "full_attention"]),
    "ministral-768-1layer": dict(model_type="ministral", hidden_size=768, num_attention_heads=12, head_dim=64,
                                 num_key_value_heads=4, num_hidden_layers=1, intermediate_size=2048,
                                 vocab_size=4096, max_position_embeddings=64, pad_token_id=0, num_labels=3,
                                 sliding_window=4),
}

VARIANT_HEADS = {"ministral-768-1layer": ("base", "causal_lm")}
