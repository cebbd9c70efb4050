"""XLM-RoBERTa: real width and odd head size (the family is RoBERTa's; this proves the registration)."""

HEADS = ("base", "seqcls", "tokcls", "qa", "mlm", "mc")

CONFIGS = {
    "xlm-roberta-768": dict(model_type="xlm-roberta", hidden_size=768, num_attention_heads=12, num_hidden_layers=2,
                            intermediate_size=3072, vocab_size=1000, max_position_embeddings=66, type_vocab_size=1,
                            layer_norm_eps=1e-5, num_labels=3),
    "xlm-roberta-hd24": dict(model_type="xlm-roberta", hidden_size=96, num_attention_heads=4, num_hidden_layers=2,
                             intermediate_size=160, vocab_size=1000, max_position_embeddings=40, num_labels=5),
}
