"""Gemma2: attention and final logit softcapping (caps small enough to bite on random weights),
query_pre_attn_scalar 20 (scaling not head_dim's), four (1 + weight) norms per layer, a sliding first layer
(window 4, narrower than the batch) and a full second, head_dim 24 given explicitly, GQA 2:1, attention_bias,
tied embeddings; eager only (transformers has no sdpa path for it); no QA head."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls")

CONFIGS = {
    "gemma2-hd24-softcap-sliding": dict(model_type="gemma2", hidden_size=80, num_attention_heads=4, head_dim=24,
                                        num_key_value_heads=2, num_hidden_layers=2, intermediate_size=160,
                                        vocab_size=512, max_position_embeddings=64, pad_token_id=0, num_labels=3,
                                        attention_bias=True, query_pre_attn_scalar=20, sliding_window=4,
                                        attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
}
