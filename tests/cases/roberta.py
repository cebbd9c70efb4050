"""RoBERTa: real width (roberta-base's fields), odd head size with token types, and an untied decoder."""

HEADS = ("base", "seqcls", "tokcls", "qa", "mlm", "mc")

CONFIGS = {
    "roberta-768": dict(model_type="roberta", hidden_size=768, num_attention_heads=12, num_hidden_layers=2,
                        intermediate_size=3072, vocab_size=1000, max_position_embeddings=66, type_vocab_size=1,
                        layer_norm_eps=1e-5, num_labels=3),
    "roberta-hd24": dict(model_type="roberta", hidden_size=96, num_attention_heads=4, num_hidden_layers=2,
                         intermediate_size=160, vocab_size=1000, max_position_embeddings=40, type_vocab_size=2,
                         hidden_act="gelu_new", num_labels=5),
    "roberta-untied-hd24": dict(model_type="roberta", hidden_size=96, num_attention_heads=4, num_hidden_layers=2,
                                intermediate_size=160, vocab_size=1000, max_position_embeddings=40,
                                tie_word_embeddings=False, pad_token_id=3, num_labels=2),
}
