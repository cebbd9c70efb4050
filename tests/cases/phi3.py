"""Phi-3: fused qkv_proj and gate_up_proj, RoPE on 18 of head_dim 24 (partial_rotary_factor 0.75, top-level
as older configs write it), a sliding window (4) on every layer, GQA 2:1, vocab 32000; no QA head."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls")

CONFIGS = {
    "phi3-hd24-partial-window4": dict(model_type="phi3", hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=160, vocab_size=32000,
                                      max_position_embeddings=64, pad_token_id=0, num_labels=3,
                                      partial_rotary_factor=0.75, sliding_window=4),
}
