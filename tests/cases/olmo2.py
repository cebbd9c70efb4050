"""OLMo 2: q_norm / k_norm over the whole projections (widths 96 and 48: GQA 2:1), post-norm layers, head_dim 24
(hidden 96 / 4 heads), attention_bias on q, k, v and o, untied, rms_norm_eps its 1e-5 default; no tokcls or QA
head (transformers has none)."""

HEADS = ("base", "causal_lm", "seqcls")

CONFIGS = {
    "olmo2-hd24-qknorm-postnorm": dict(model_type="olmo2", hidden_size=96, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=2, intermediate_size=160,
                                       vocab_size=512, max_position_embeddings=64, pad_token_id=0,
                                       eos_token_id=2, num_labels=3, attention_bias=True),
}
