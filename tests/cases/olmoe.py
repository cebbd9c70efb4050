"""OLMoE: LLaMA's pre-norm layers with RMSNorms over the whole q and k projections (before the per-head view),
``clip_qkv`` after them, and a sparse mixture-of-experts MLP in every layer (router softmax in float32, top-k
renormalised with ``norm_topk_prob``, the stacked experts run as transformers' default grouped_mm). Real width
(hidden 768, 12 heads x 64, 4 KV heads), one layer with 4 experts, top 2; head_dim 24 with 4 experts, top 2,
renormalised, ``attention_bias`` on q, k, v and o; head_dim 24 with 6 experts, top 3, not renormalised,
``clip_qkv`` (0.5: it clamps some of the normed q, k and v) and tied embeddings. Heads: base and causal_lm (all
transformers has)."""

HEADS = ("base", "causal_lm")

_SMALL = dict(model_type="olmoe", hidden_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              intermediate_size=64, vocab_size=1000, max_position_embeddings=64, pad_token_id=0, num_labels=3)

CONFIGS = {
    "olmoe-768-1layer": dict(model_type="olmoe", hidden_size=768, num_attention_heads=12, num_key_value_heads=4,
                             num_hidden_layers=1, intermediate_size=256, vocab_size=8000, max_position_embeddings=64,
                             pad_token_id=0, num_labels=3, num_experts=4, num_experts_per_tok=2),
    "olmoe-hd24-4experts-norm-bias": dict(_SMALL, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                          attention_bias=True),
    "olmoe-hd24-6experts-top3-clip": dict(_SMALL, num_experts=6, num_experts_per_tok=3, clip_qkv=0.5,
                                          tie_word_embeddings=True),
}
