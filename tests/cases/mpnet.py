"""MPNet: real width (all-mpnet-base-v2's fields) and head_dim 24. The parity batch is 13 tokens, so
relative distances reach 12: past max_exact (8), into the log buckets."""

HEADS = ("base", "seqcls", "tokcls", "qa", "mlm", "mc")

CONFIGS = {
    "mpnet-768": dict(model_type="mpnet", hidden_size=768, num_attention_heads=12, num_hidden_layers=2,
                      intermediate_size=3072, vocab_size=1000, max_position_embeddings=66, num_labels=3),
    "mpnet-hd24": dict(model_type="mpnet", hidden_size=96, num_attention_heads=4, num_hidden_layers=2,
                       intermediate_size=160, vocab_size=1000, max_position_embeddings=40, num_labels=5,
                       hidden_act="gelu_new", layer_norm_eps=1e-5),
}
