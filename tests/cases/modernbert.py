"""ModernBERT: real width (modernbert-base's hidden 768, 12 heads, intermediate 1152) and head_dim 24
with every bias on and mean pooling. Each has at least 4 layers, so full layers follow sliding ones,
and a window (local_attention 10: 5 tokens either side) narrower than the 13-token parity batch, so
the window masks. Special ids are moved into the small vocabularies."""

HEADS = ("base", "seqcls", "tokcls", "qa", "mlm", "mc")

_IDS = dict(pad_token_id=3, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)

CONFIGS = {
    "modernbert-768": dict(model_type="modernbert", hidden_size=768, num_attention_heads=12, num_hidden_layers=4,
                           intermediate_size=1152, vocab_size=1024, max_position_embeddings=64, local_attention=10,
                           num_labels=3, **_IDS),
    # old config spelling on the way in (transformers saves it as layer_types / rope_parameters):
    # full attention every 2nd layer, other thetas
    "modernbert-bias-mean-hd24": dict(model_type="modernbert", hidden_size=96, num_attention_heads=4,
                                      num_hidden_layers=5, intermediate_size=160, vocab_size=512,
                                      max_position_embeddings=64, local_attention=10, num_labels=5,
                                      attention_bias=True, mlp_bias=True, norm_bias=True, classifier_bias=True,
                                      classifier_pooling="mean", hidden_activation="gelu_new",
                                      global_attn_every_n_layers=2, global_rope_theta=80_000.0,
                                      local_rope_theta=5_000.0, **_IDS),
}
