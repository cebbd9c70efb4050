"""DistilBERT: real width with learned positions; odd head size with sinusoidal tables (stored, then perturbed)."""

HEADS = ("base", "seqcls", "tokcls", "qa", "mlm", "mc")

CONFIGS = {
    "distilbert-768": dict(model_type="distilbert", dim=768, n_heads=12, n_layers=2, hidden_dim=3072,
                           vocab_size=1000, max_position_embeddings=64, sinusoidal_pos_embds=False, num_labels=3),
    "distilbert-sinusoidal-hd24": dict(model_type="distilbert", dim=96, n_heads=4, n_layers=2, hidden_dim=160,
                                       vocab_size=1000, max_position_embeddings=64, sinusoidal_pos_embds=True,
                                       activation="gelu_new", num_labels=5),
}
