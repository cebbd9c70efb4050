"""OLMo 3: OLMo 2's parts (q/k norms over the whole projections, post-norm layers) at head_dim 24 (hidden 96 /
4 heads, 2 KV heads: GQA 2:1), a sliding first layer (window 4, narrower than the batch) and a full second, a RoPE
per layer kind (linear x2 at theta 10000 on the full layer, theta 500 on the sliding one), attention_bias, untied;
and real width (hidden 768, 12 heads x 64) with one layer (sliding by the default layer_types rule, window 4) for
the backbone and the causal LM. No tokcls or QA head (transformers has none)."""

HEADS = ("base", "causal_lm", "seqcls")

CONFIGS = {
    "olmo3-hd24-sliding-2rope": dict(model_type="olmo3", hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                     num_hidden_layers=2, intermediate_size=160, vocab_size=512,
                                     max_position_embeddings=64, pad_token_id=0, eos_token_id=2, num_labels=3,
                                     attention_bias=True, sliding_window=4,
                                     layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                         "rope_theta": 10000.0},
                                                      "sliding_attention": {"rope_type": "default",
                                                                            "rope_theta": 500.0}}),
    "olmo3-768-1layer": dict(model_type="olmo3", hidden_size=768, num_attention_heads=12, num_hidden_layers=1,
                             intermediate_size=2048, vocab_size=4096, max_position_embeddings=64, pad_token_id=0,
                             eos_token_id=2, num_labels=3, sliding_window=4),
}

VARIANT_HEADS = {"olmo3-768-1layer": ("base", "causal_lm")}
