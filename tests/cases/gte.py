"""GTE (Alibaba's "new" architecture, gte-multilingual-base): real width (hidden 768, 12 heads x 64, one token type,
theta 160000) with one layer, and head_dim 24 with the options that change the computation: no token types at all
(``type_vocab_size`` 0, as gte-base-en-v1.5), ``silu``, an untied decoder, RoPE from the older ``rope_scaling`` +
``rope_theta`` spelling (dynamic NTK). Every head transformers has for it (no QA, no multiple choice)."""

HEADS = ("base", "seqcls", "tokcls", "mlm")

CONFIGS = {
    "gte-768": dict(model_type="gte", hidden_size=768, num_attention_heads=12, num_hidden_layers=1,
                    intermediate_size=3072, vocab_size=1000, max_position_embeddings=64, num_labels=3),
    "gte-hd24-notypes-dynamic-untied": dict(model_type="gte", hidden_size=96, num_attention_heads=4,
                                            num_hidden_layers=2, intermediate_size=160, vocab_size=1000,
                                            max_position_embeddings=8, type_vocab_size=0, hidden_act="silu",
                                            tie_word_embeddings=False, num_labels=5,
                                            rope_scaling={"type": "dynamic", "factor": 2.0}, rope_theta=20000.0),
}
