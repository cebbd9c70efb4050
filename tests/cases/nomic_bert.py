"""Nomic BERT: real width (nomic-embed-text's hidden 768, 12 heads x 64, silu, theta 1000) with one layer, and
head_dim 24 with the options that change the computation: two token types, ``gelu_new``, an untied decoder, linear
RoPE scaling in today's ``rope_parameters`` spelling with another theta, another epsilon. Every head transformers
has for it (no QA, no multiple choice). The other RoPE types are in tests/test_nomic_gte.py."""

HEADS = ("base", "seqcls", "tokcls", "mlm")

CONFIGS = {
    "nomic_bert-768": dict(model_type="nomic_bert", hidden_size=768, num_attention_heads=12, num_hidden_layers=1,
                           intermediate_size=3072, vocab_size=1000, max_position_embeddings=64, num_labels=3),
    "nomic_bert-hd24-linear-untied": dict(model_type="nomic_bert", hidden_size=96, num_attention_heads=4,
                                          num_hidden_layers=2, intermediate_size=160, vocab_size=1000,
                                          max_position_embeddings=64, hidden_act="gelu_new", layer_norm_eps=1e-5,
                                          tie_word_embeddings=False, num_labels=5,
                                          rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
}
