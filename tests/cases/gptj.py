"""GPT-J: hidden 96 with head_dim 24 (4 heads), RoPE on the first 8 of 24 dimensions (GPT-J-6B turns 64 of 256),
n_inner 160, vocab 512, pad id 0 (GPT-J has none by default: the sequence classifier needs one for a batch),
``gelu_new``, the LM head with a bias, untied; a variant turning whole heads (rotary_dim 24) with ``gelu``, tied
embeddings (the head's bias stays its own) and layer_norm_epsilon 1e-6; and real width (hidden 768, 12 heads x 64,
rotary_dim 16) with one layer for the backbone and the causal LM. Transformers has no GPT-J token classifier."""

HEADS = ("base", "causal_lm", "seqcls", "qa")

_SMALL = dict(model_type="gptj", n_embd=96, n_head=4, n_layer=2, n_inner=160, rotary_dim=8, vocab_size=512,
              n_positions=64, pad_token_id=0, num_labels=3)

CONFIGS = {
    "gptj-hd24": _SMALL,
    "gptj-hd24-fullrot-tied": dict(_SMALL, rotary_dim=24, activation_function="gelu", tie_word_embeddings=True,
                                   layer_norm_epsilon=1e-6),
    "gptj-768-1layer": dict(model_type="gptj", n_embd=768, n_head=12, n_layer=1, rotary_dim=16, vocab_size=4096,
                            n_positions=64, pad_token_id=0, num_labels=3),
}

# heads each variant is built for (default: HEADS)
VARIANT_HEADS = {"gptj-768-1layer": ("base", "causal_lm"), "gptj-hd24-fullrot-tied": ("base", "causal_lm", "seqcls")}
