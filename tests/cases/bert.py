"""BERT: real width (768, 12 heads of 64) and odd head size (96, 4 heads of 24)."""

HEADS = ("base", "seqcls", "tokcls", "qa", "mlm", "mc")

CONFIGS = {
    "bert-768": dict(model_type="bert", hidden_size=768, num_attention_heads=12, num_hidden_layers=2,
                     intermediate_size=3072, vocab_size=1024, max_position_embeddings=64, num_labels=3),
    "bert-hd24": dict(model_type="bert", hidden_size=96, num_attention_heads=4, num_hidden_layers=2,
                      intermediate_size=160, vocab_size=512, max_position_embeddings=64, num_labels=5,
                      hidden_act="gelu_new", layer_norm_eps=1e-7),
}
