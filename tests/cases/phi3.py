"""Phi-3: fused qkv_proj and gate_up_proj, RoPE on 18 of head_dim 24 (partial_rotary_factor 0.75, top-level
as older configs write it), a sliding window (4) on every layer, GQA 2:1, vocab 32000; no QA head. And longrope
(Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) on the same 18 dimensions: 9 short and 9 long factors,
original_max_position_embeddings 8 against max_position_embeddings 64 (so an attention factor of sqrt(2)), no
window: the shared batches (13 tokens) run past 8, on the long frequencies; tests/test_phi3_longrope.py runs both
sides of the switch."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls")

# factors as the real checkpoints' (short near 1, long growing with the wavelength), not round numbers
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.02, 1.05, 1.1, 1.18, 1.3, 1.45, 1.62, 1.8],
                long_factor=[1.0, 1.25, 1.7, 2.4, 3.9, 6.5, 11.0, 19.5, 32.0])

CONFIGS = {
    "phi3-hd24-partial-window4": dict(model_type="phi3", hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, intermediate_size=160, vocab_size=32000,
                                      max_position_embeddings=64, pad_token_id=0, num_labels=3,
                                      partial_rotary_factor=0.75, sliding_window=4),
    "phi3-hd24-longrope": dict(model_type="phi3", hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=2, intermediate_size=160, vocab_size=32000,
                               max_position_embeddings=64, original_max_position_embeddings=8, pad_token_id=0,
                               num_labels=3, partial_rotary_factor=0.75, rope_parameters=LONGROPE),
}
