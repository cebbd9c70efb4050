"""ELECTRA: real width with embedding_size == hidden_size (no projection, as electra-base), head_dim 24
with embedding_size 40 < hidden 96 (embeddings_project, as electra-small), and the last-token summary
with tanh for multiple choice; every core head plus the discriminator (pretraining)."""

HEADS = ("base", "seqcls", "tokcls", "qa", "mlm", "mc", "pretraining")

CONFIGS = {
    "electra-768": dict(model_type="electra", hidden_size=768, embedding_size=768, num_attention_heads=12,
                        num_hidden_layers=2, intermediate_size=3072, vocab_size=1024, max_position_embeddings=64,
                        num_labels=3),
    "electra-proj-hd24": dict(model_type="electra", hidden_size=96, embedding_size=40, num_attention_heads=4,
                              num_hidden_layers=2, intermediate_size=160, vocab_size=512, max_position_embeddings=64,
                              num_labels=5, hidden_act="gelu_new", summary_type="mean"),
    # the multiple-choice summary's other branch: the last token (cls_index without an index), tanh
    "electra-lastsum-hd24": dict(model_type="electra", hidden_size=96, embedding_size=96, num_attention_heads=4,
                                 num_hidden_layers=2, intermediate_size=160, vocab_size=512,
                                 max_position_embeddings=64, num_labels=2, summary_type="cls_index",
                                 summary_activation="tanh"),
}
