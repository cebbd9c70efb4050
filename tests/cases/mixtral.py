"""Mixtral: a sparse mixture-of-experts MLP in every layer (router softmax in float32, top-k renormalised, the
stacked experts run as transformers' default grouped_mm). Real width (hidden 1024, 16 heads x 64, 4 KV heads) with
4 experts, top 2, for the backbone and the causal LM; head_dim 24 with 4 experts, top 2, GQA 2:1 on every head
(vocab 1000: its parity batch routes 11 to 18 token slots to each expert in each layer);
and head_dim 24 with 6 experts, top 3 (three weighted outputs summed per token), a sliding window (4) narrower than
the parity batch and tied embeddings."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls", "qa")

CONFIGS = {
    "mixtral-1024-4experts": dict(model_type="mixtral", hidden_size=1024, num_attention_heads=16,
                                  num_key_value_heads=4, num_hidden_layers=2, intermediate_size=512, vocab_size=8000,
                                  max_position_embeddings=64, pad_token_id=0, num_labels=3, num_local_experts=4,
                                  num_experts_per_tok=2),
    "mixtral-hd24-4experts-top2": dict(model_type="mixtral", hidden_size=96, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=2, intermediate_size=160,
                                       vocab_size=1000, max_position_embeddings=64, pad_token_id=0, num_labels=3,
                                       num_local_experts=4, num_experts_per_tok=2),
    "mixtral-hd24-6experts-top3-window4": dict(model_type="mixtral", hidden_size=96, num_attention_heads=4,
                                               num_key_value_heads=2, num_hidden_layers=2, intermediate_size=160,
                                               vocab_size=512, max_position_embeddings=64, pad_token_id=0,
                                               num_labels=3, num_local_experts=6, num_experts_per_tok=3,
                                               sliding_window=4, tie_word_embeddings=True),
}

# heads each variant is built for (default: HEADS)
VARIANT_HEADS = {"mixtral-1024-4experts": ("base", "causal_lm"),
                 "mixtral-hd24-6experts-top3-window4": ("causal_lm", "seqcls")}
