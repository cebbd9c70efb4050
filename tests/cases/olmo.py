"""OLMo (1): the parameter-free LayerNorms, head_dim 24 (hidden 96 / 4 heads, 2 KV heads: GQA 2:1),
``clip_qkv`` 0.5 (tight enough that the perturbed projections are clamped), attention_bias on q, k, v and o, untied;
a variant without clipping or biases, tied; and real width (hidden 768, 12 heads x 64) with one layer for the
backbone and the causal LM. No tokcls or QA head (transformers has none)."""

HEADS = ("base", "causal_lm", "seqcls")

_SMALL = dict(model_type="olmo", hidden_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              intermediate_size=160, vocab_size=512, max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
              num_labels=3, clip_qkv=0.5, attention_bias=True)

CONFIGS = {
    "olmo-hd24-clip-bias": _SMALL,
    "olmo-hd24-noclip-tied": dict(_SMALL, clip_qkv=None, attention_bias=False, tie_word_embeddings=True),
    "olmo-768-1layer": dict(model_type="olmo", hidden_size=768, num_attention_heads=12, num_hidden_layers=1,
                            intermediate_size=2048, vocab_size=4096, max_position_embeddings=64, pad_token_id=0,
                            eos_token_id=2, num_labels=3, clip_qkv=8.0),
}

VARIANT_HEADS = {"olmo-768-1layer": ("base", "causal_lm"), "olmo-hd24-noclip-tied": ("base", "causal_lm")}
