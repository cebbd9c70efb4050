"""StarCoder2: hidden 96 with head_dim 24 (4 heads, 2 KV heads: GQA 2:1), intermediate 160, vocab 512, biases on every
linear layer (``use_bias``, its default), LayerNorm with ``norm_epsilon`` 1e-6, a sliding window (4) narrower than the
13-token parity batch, tied embeddings (its default), ``gelu_pytorch_tanh``; and a variant without biases or window,
untied, with ``gelu`` and a RoPE theta of 5000. No QA head (transformers has none)."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls")

_SMALL = dict(model_type="starcoder2", hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, intermediate_size=160, vocab_size=512, max_position_embeddings=64, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, num_labels=3, norm_epsilon=1e-6, sliding_window=4)

CONFIGS = {
    "starcoder2-hd24-bias-window4": _SMALL,
    "starcoder2-hd24-nobias-untied": dict(_SMALL, use_bias=False, sliding_window=None, tie_word_embeddings=False,
                                          hidden_act="gelu", rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 5000.0}),
}

VARIANT_HEADS = {"starcoder2-hd24-nobias-untied": ("base", "causal_lm")}
