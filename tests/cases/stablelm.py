"""StableLM: hidden 96 with head_dim 24 (4 heads, 2 KV heads: GQA 2:1), intermediate 160, vocab 512, per-head q/k
LayerNorms (``qk_layernorm``), the parallel residual, RoPE on half of each head (``partial_rotary_factor`` 0.5 at the
top level, as StableLM 2's config.json spells it), q/k/v biases (``use_qkv_bias``); and the sequential residual
without q/k norms or biases, the default 0.25 partial factor (6 of 24 dimensions), ``layer_norm_eps`` 1e-6 and tied
embeddings. No QA head (transformers has none)."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls")

_SMALL = dict(model_type="stablelm", hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, intermediate_size=160, vocab_size=512, max_position_embeddings=64, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, num_labels=3, qk_layernorm=True, use_parallel_residual=True,
              use_qkv_bias=True, partial_rotary_factor=0.5, rope_theta=5000.0)

CONFIGS = {
    "stablelm-hd24-qknorm-parallel": _SMALL,
    "stablelm-hd24-sequential": dict(_SMALL, qk_layernorm=False, use_parallel_residual=False, use_qkv_bias=False,
                                     partial_rotary_factor=0.25, layer_norm_eps=1e-6, tie_word_embeddings=True),
}

VARIANT_HEADS = {"stablelm-hd24-sequential": ("base", "causal_lm", "seqcls")}
