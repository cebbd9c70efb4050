"""Qwen3-MoE: Qwen3's per-head q/k norms with Qwen2-MoE's router and stacked experts, no shared expert (router
softmax in float32, top-k renormalised with ``norm_topk_prob``, the experts run as transformers' default
grouped_mm). Real width (hidden 768, 12 heads x 64, 4 KV heads), one layer with 4 experts, top 2, for the backbone
and the causal LM; head_dim 24 given explicitly (hidden 80 is not heads x head_dim) with 4 experts, top 2,
renormalised, ``attention_bias`` on q, k, v and o and a dense second layer (``mlp_only_layers``) on every head;
head_dim 24 with 6 experts, top 3, not renormalised, sparse every second layer (``decoder_sparse_step`` 2), a
sliding window (4) on every layer (``use_sliding_window``) and tied embeddings."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls", "qa")

_SMALL = dict(model_type="qwen3_moe", hidden_size=80, num_attention_heads=4, head_dim=24, num_key_value_heads=2,
              intermediate_size=160, moe_intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
              num_labels=3)

CONFIGS = {
    "qwen3_moe-768-1layer": dict(model_type="qwen3_moe", hidden_size=768, num_attention_heads=12,
                                 num_key_value_heads=4, num_hidden_layers=1, intermediate_size=1024,
                                 moe_intermediate_size=256, vocab_size=8000, max_position_embeddings=64,
                                 pad_token_id=0, num_labels=3, num_experts=4, num_experts_per_tok=2),
    "qwen3_moe-hd24-4experts-norm-bias-dense1": dict(_SMALL, num_hidden_layers=2, vocab_size=1000, num_experts=4,
                                                     num_experts_per_tok=2, norm_topk_prob=True,
                                                     attention_bias=True, mlp_only_layers=[1]),
    "qwen3_moe-hd24-6experts-top3-step2-window4": dict(_SMALL, num_hidden_layers=3, vocab_size=1000, num_experts=6,
                                                       num_experts_per_tok=3, decoder_sparse_step=2,
                                                       use_sliding_window=True, sliding_window=4,
                                                       tie_word_embeddings=True),
}

# heads each variant is built for (default: HEADS)
VARIANT_HEADS = {"qwen3_moe-768-1layer": ("base", "causal_lm"),
                 "qwen3_moe-hd24-6experts-top3-step2-window4": ("causal_lm", "seqcls")}
