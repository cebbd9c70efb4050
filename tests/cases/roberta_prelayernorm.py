"""RoBERTa-PreLayerNorm: real width (efficient_mlm's fields: hidden 768, 12 heads x 64, layer_norm_eps 1e-5, one
token type), and head_dim 24 with two token types, ``gelu_new`` and the default epsilon (1e-12); every RoBERTa head."""

HEADS = ("base", "seqcls", "tokcls", "qa", "mlm", "mc")

CONFIGS = {
    "roberta-prelayernorm-768": dict(model_type="roberta-prelayernorm", hidden_size=768, num_attention_heads=12,
                                     num_hidden_layers=2, intermediate_size=3072, vocab_size=1000,
                                     max_position_embeddings=66, type_vocab_size=1, layer_norm_eps=1e-5,
                                     num_labels=3),
    "roberta-prelayernorm-hd24": dict(model_type="roberta-prelayernorm", hidden_size=96, num_attention_heads=4,
                                      num_hidden_layers=2, intermediate_size=160, vocab_size=1000,
                                      max_position_embeddings=40, type_vocab_size=2, hidden_act="gelu_new",
                                      num_labels=5),
}
