"""ALBERT: real width (albert-base's fields); odd head size with 2 groups of 2 inner layers over 3 layers
(groups 0, 0, 1 by HF's rule) and embedding_size != hidden_size; an untied decoder."""

HEADS = ("base", "seqcls", "tokcls", "qa", "mlm", "mc")

CONFIGS = {
    "albert-768": dict(model_type="albert", hidden_size=768, num_attention_heads=12, num_hidden_layers=2,
                       intermediate_size=3072, embedding_size=128, vocab_size=1000, max_position_embeddings=64,
                       num_labels=3),
    "albert-groups-hd24": dict(model_type="albert", hidden_size=96, num_attention_heads=4, num_hidden_layers=3,
                               num_hidden_groups=2, inner_group_num=2, intermediate_size=160, embedding_size=40,
                               vocab_size=1000, max_position_embeddings=64, num_labels=5),
    "albert-untied-hd24": dict(model_type="albert", hidden_size=96, num_attention_heads=4, num_hidden_layers=2,
                               intermediate_size=160, embedding_size=32, vocab_size=1000, max_position_embeddings=64,
                               tie_word_embeddings=False, hidden_act="gelu", num_labels=2),
}
