"""Qwen2-MoE: a sparse mixture-of-experts MLP with a sigmoid-gated shared expert (router softmax in float32, top-k
renormalised with ``norm_topk_prob``, the stacked experts run as transformers' default grouped_mm). Real width
(hidden 1024, 16 heads x 64, 4 KV heads) with 4 experts, top 2, for the backbone and the causal LM; head_dim 24 with
4 experts, top 2, renormalised, q/k/v biases and a dense second layer (``mlp_only_layers``; two layers keep PEFT's
all-linear under its 20 targets, past which PEFT shortens target_modules) on every head; head_dim
24 with 6 experts, top 3, not renormalised, sparse every second layer (``decoder_sparse_step`` 2), a sliding
window (4) on layer 0, no biases, tied embeddings."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls", "qa")

_SMALL = dict(model_type="qwen2_moe", hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=160, moe_intermediate_size=64, shared_expert_intermediate_size=128,
              max_position_embeddings=64, pad_token_id=0, num_labels=3)

CONFIGS = {
    "qwen2_moe-1024-4experts": dict(model_type="qwen2_moe", hidden_size=1024, num_attention_heads=16,
                                    num_key_value_heads=4, num_hidden_layers=2, intermediate_size=1024,
                                    moe_intermediate_size=256, shared_expert_intermediate_size=512, vocab_size=8000,
                                    max_position_embeddings=64, pad_token_id=0, num_labels=3, num_experts=4,
                                    num_experts_per_tok=2),
    "qwen2_moe-hd24-4experts-norm-dense1": dict(_SMALL, num_hidden_layers=2, vocab_size=1000, num_experts=4,
                                                num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe-hd24-6experts-top3-step2-window4": dict(_SMALL, num_hidden_layers=3, vocab_size=1000, num_experts=6,
                                                       num_experts_per_tok=3, decoder_sparse_step=2,
                                                       use_sliding_window=True, sliding_window=4,
                                                       max_window_layers=2, qkv_bias=False,
                                                       tie_word_embeddings=True),
}

# heads each variant is built for (default: HEADS)
VARIANT_HEADS = {"qwen2_moe-1024-4experts": ("base", "causal_lm"),
                 "qwen2_moe-hd24-6experts-top3-step2-window4": ("causal_lm", "seqcls")}
