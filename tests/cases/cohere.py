"""Cohere: head_dim 24 (hidden 96 / 4 heads, 2 KV heads: GQA 2:1) with the per-head q/k norms (``use_qk_norm``), q, k,
v and o biases, ``logit_scale`` 0.125, tied (its default); a variant without q/k norms or biases, untied, with
``layer_norm_eps`` 1e-6; and real width (hidden 768, 12 heads x 64) with one layer for the backbone and the causal LM.
Transformers has no other Cohere head."""

HEADS = ("base", "causal_lm")

_SMALL = dict(model_type="cohere", hidden_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              intermediate_size=160, vocab_size=512, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, use_qk_norm=True, attention_bias=True, logit_scale=0.125)

CONFIGS = {
    "cohere-hd24-qknorm-bias": _SMALL,
    "cohere-hd24-plain-untied": dict(_SMALL, use_qk_norm=False, attention_bias=False, tie_word_embeddings=False,
                                     layer_norm_eps=1e-6),
    "cohere-768-1layer": dict(model_type="cohere", hidden_size=768, num_attention_heads=12, num_hidden_layers=1,
                              intermediate_size=2048, vocab_size=4096, max_position_embeddings=64, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2),
}
