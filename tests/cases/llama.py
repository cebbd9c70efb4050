"""LLaMA: real width (hidden 1024, 16 heads x 64, 4 KV heads, vocab 32000, untied) for the backbone and the
causal LM only (a vocabulary-wide checkpoint per head is slow to build), and head_dim 24 with every
option that changes the computation on every head: GQA 2:1, attention and MLP biases, tied embeddings,
llama3 RoPE in today's rope_parameters spelling; and the older rope_scaling + rope_theta spelling,
without GQA, untied, head_dim 40."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls", "qa")

_LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=16)

CONFIGS = {
    "llama-1024-gqa": dict(model_type="llama", hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                           num_hidden_layers=2, intermediate_size=2816, vocab_size=32000, max_position_embeddings=64,
                           pad_token_id=0, num_labels=3),
    "llama-hd24-bias-tied-llama3": dict(model_type="llama", hidden_size=96, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=2, intermediate_size=160,
                                        vocab_size=32000, max_position_embeddings=64, pad_token_id=0, num_labels=3,
                                        attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                        rope_parameters={**_LLAMA3, "rope_theta": 500000.0}),
    "llama-hd40-rope_scaling": dict(model_type="llama", hidden_size=120, num_attention_heads=3, head_dim=40,
                                    num_hidden_layers=2, intermediate_size=200, vocab_size=32000,
                                    max_position_embeddings=64, pad_token_id=0, num_labels=3,
                                    rope_scaling={"type": "llama3", **{k: v for k, v in _LLAMA3.items()
                                                                       if k != "rope_type"}},
                                    rope_theta=50000.0),
}

# heads each variant is built for (default: HEADS)
VARIANT_HEADS = {"llama-1024-gqa": ("base", "causal_lm"), "llama-hd40-rope_scaling": ("causal_lm", "seqcls")}
