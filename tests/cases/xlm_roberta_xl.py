"""XLM-RoBERTa-XL: real width (hidden 768, 12 heads x 64; the family's own defaults are 2560 x 36 layers) and head_dim
24 with an untied decoder and another pad id; every RoBERTa head."""

HEADS = ("base", "seqcls", "tokcls", "qa", "mlm", "mc")

CONFIGS = {
    "xlm-roberta-xl-768": dict(model_type="xlm-roberta-xl", hidden_size=768, num_attention_heads=12,
                               num_hidden_layers=2, intermediate_size=3072, vocab_size=1000,
                               max_position_embeddings=66, num_labels=3),
    "xlm-roberta-xl-hd24": dict(model_type="xlm-roberta-xl", hidden_size=96, num_attention_heads=4,
                                num_hidden_layers=2, intermediate_size=160, vocab_size=1000,
                                max_position_embeddings=40, tie_word_embeddings=False, pad_token_id=3,
                                num_labels=5),
}
