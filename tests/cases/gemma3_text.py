"""Gemma3 (text): per-head (1 + weight) q/k norms, two RoPEs (the sliding first layer at theta 500, the full second
at theta 50000 with linear scaling 2), a window of 4 (narrower than the batch), query_pre_attn_scalar 20, final logit
softcapping 3 (attn_logit_softcapping 2 is set and, as in transformers 5.24, not applied), four norms per layer,
head_dim 24 given explicitly, GQA 2:1, attention_bias, tied embeddings; no token-classification or QA head."""

HEADS = ("base", "causal_lm", "seqcls")

CONFIGS = {
    "gemma3_text-hd24-qknorm-2rope": dict(
        model_type="gemma3_text", hidden_size=80, num_attention_heads=4, head_dim=24, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=160, vocab_size=512, max_position_embeddings=64, pad_token_id=0,
        num_labels=3, attention_bias=True, query_pre_attn_scalar=20, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        rope_theta=50000.0, rope_local_base_freq=500.0, rope_scaling={"rope_type": "linear", "factor": 2.0}),
}
