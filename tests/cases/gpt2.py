"""GPT-2: hidden 96 with head_dim 24 (4 heads), n_inner 160, vocab 512, pad id 0 (GPT-2 has none by default: the
sequence classifier needs one for a batch), the LM head tied to wte, learned positions (n_positions 64),
``gelu_new``; and the same at real width (n_embd 768, 12 heads x 64) with one layer for the backbone and the
causal LM (and the double heads, GPT2DoubleHeadsModel). A third variant switches on every scaling option: scale_attn_by_inverse_layer_idx, no
scale_attn_weights, reorder_and_upcast_attn (eager only, where transformers reads it) and gelu (erf)."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls", "qa", "double_heads")

_SMALL = dict(model_type="gpt2", n_embd=96, n_head=4, n_layer=2, n_inner=160, vocab_size=512, n_positions=64,
              pad_token_id=0, num_labels=3)

CONFIGS = {
    "gpt2-hd24": _SMALL,
    "gpt2-768-1layer": dict(model_type="gpt2", n_embd=768, n_head=12, n_layer=1, vocab_size=4096, n_positions=64,
                            pad_token_id=0, num_labels=3),
    "gpt2-hd24-scalings": dict(_SMALL, scale_attn_weights=False, scale_attn_by_inverse_layer_idx=True,
                               reorder_and_upcast_attn=True, activation_function="gelu", layer_norm_epsilon=1e-6),
}

# heads each variant is built for (default: HEADS)
VARIANT_HEADS = {"gpt2-768-1layer": ("base", "causal_lm", "double_heads"), "gpt2-hd24-scalings": ("base", "causal_lm")}
