"""GPT-NeoX: hidden 96 with head_dim 24 (4 heads), intermediate 160, vocab 512, pad id 0 (GPT-NeoX has none by
default: the sequence classifier needs one for a batch), RoPE on 6 of 24 dimensions (Pythia's ``rotary_pct`` 0.25
and ``rotary_emb_base``, the older top-level spelling), the parallel residual, untied; the sequential residual
(``use_parallel_residual`` false) with no attention bias, tied embeddings, ``gelu_new`` and RoPE on 12 dimensions
through ``rope_parameters``; and real width (hidden 768, 12 heads x 64) with one layer for the backbone and the
causal LM."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls", "qa")

_SMALL = dict(model_type="gpt_neox", hidden_size=96, num_attention_heads=4, num_hidden_layers=2,
              intermediate_size=160, vocab_size=512, max_position_embeddings=64, pad_token_id=0, num_labels=3,
              rotary_pct=0.25, rotary_emb_base=5000)

CONFIGS = {
    "gpt_neox-hd24": _SMALL,
    "gpt_neox-hd24-sequential": dict(_SMALL, use_parallel_residual=False, attention_bias=False,
                                     tie_word_embeddings=True, hidden_act="gelu_new", layer_norm_eps=1e-6,
                                     rope_parameters={"rope_type": "default", "rope_theta": 20000.0,
                                                      "partial_rotary_factor": 0.5}),
    "gpt_neox-768-1layer": dict(model_type="gpt_neox", hidden_size=768, num_attention_heads=12, num_hidden_layers=1,
                                intermediate_size=3072, vocab_size=4096, max_position_embeddings=64,
                                pad_token_id=0, num_labels=3),
}

# heads each variant is built for (default: HEADS)
VARIANT_HEADS = {"gpt_neox-768-1layer": ("base", "causal_lm"),
                 "gpt_neox-hd24-sequential": ("base", "causal_lm", "seqcls", "tokcls")}
