"""SmolLM3: head_dim 24 (hidden 96 / 4 heads, 2 KV heads: GQA 2:1) with a NoPE second layer (no_rope_layer_interval
2) that slides (use_sliding_window, window 4, narrower than the batch: the default layer_types rule), attention
and MLP biases, tied (its default); a variant naming its NoPE layer (no_rope_layers, the first) and its sliding
layer (layer_types, the first) without use_sliding_window, untied; and real width (hidden 768, 12 heads x 64) with
one RoPE layer for the backbone and the causal LM."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls", "qa")

_SMALL = dict(model_type="smollm3", hidden_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              intermediate_size=160, vocab_size=512, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, num_labels=3)

CONFIGS = {
    "smollm3-hd24-nope-sliding-bias": dict(_SMALL, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=4,
                                           attention_bias=True, mlp_bias=True),
    "smollm3-hd24-nope-first-layertypes": dict(_SMALL, no_rope_layers=[0, 1], sliding_window=4,
                                               layer_types=["sliding_attention", "full_attention"],
                                               tie_word_embeddings=False,
                                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "smollm3-768-1layer": dict(model_type="smollm3", hidden_size=768, num_attention_heads=12, num_key_value_heads=4,
                               num_hidden_layers=1, intermediate_size=2048, vocab_size=4096,
                               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               num_labels=3),
}

VARIANT_HEADS = {"smollm3-768-1layer": ("base", "causal_lm"),
                 "smollm3-hd24-nope-first-layertypes": ("base", "causal_lm", "seqcls")}
