"""OPT: hidden 96 with head_dim 24 (4 heads), ffn 160, vocab 512, pad id 1 (OPT's), the pre-LN layers with a
final LayerNorm (opt-125m's layout), the LM head tied to embed_tokens; the post-LN layers (opt-350m: no final
LayerNorm) with a narrower ``word_embed_proj_dim`` (``project_in`` / ``project_out``, the heads on the projected
width), ``gelu``, no biases and parameter-free LayerNorms; and real width (hidden 768, 12 heads x 64) with one
layer for the backbone and the causal LM."""

HEADS = ("base", "causal_lm", "seqcls", "qa")

_SMALL = dict(model_type="opt", hidden_size=96, num_attention_heads=4, num_hidden_layers=2, ffn_dim=160,
              vocab_size=512, max_position_embeddings=64, pad_token_id=1, num_labels=3)

CONFIGS = {
    "opt-hd24": _SMALL,
    "opt-hd24-postln-project": dict(_SMALL, do_layer_norm_before=False, word_embed_proj_dim=64,
                                    activation_function="gelu"),
    "opt-hd24-nobias-noaffine": dict(_SMALL, enable_bias=False, layer_norm_elementwise_affine=False),
    "opt-768-1layer": dict(model_type="opt", hidden_size=768, num_attention_heads=12, num_hidden_layers=1,
                           ffn_dim=3072, vocab_size=4096, max_position_embeddings=64, pad_token_id=1,
                           num_labels=3),
}

# heads each variant is built for (default: HEADS)
VARIANT_HEADS = {"opt-768-1layer": ("base", "causal_lm"), "opt-hd24-nobias-noaffine": ("base", "causal_lm")}
