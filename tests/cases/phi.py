"""Phi: hidden 96 with head_dim 24 (4 heads, 2 KV heads: GQA 2:1), intermediate 160, vocab 512, per-head q/k
LayerNorms (``qk_layernorm``), RoPE on 12 of 24 dimensions (the default ``partial_rotary_factor`` 0.5), ``gelu_new``,
untied; a variant without q/k norms, ``gelu``, tied embeddings (the LM head's bias stays its own), RoPE on 6
dimensions through ``rope_parameters`` and ``layer_norm_eps`` 1e-6; and real width (hidden 768, 12 heads x 64, RoPE
on 32 of 64 dimensions) with one layer for the backbone and the causal LM. No QA head
(transformers has none)."""

HEADS = ("base", "causal_lm", "seqcls", "tokcls")

_SMALL = dict(model_type="phi", hidden_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              intermediate_size=160, vocab_size=512, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, num_labels=3, qk_layernorm=True)

CONFIGS = {
    "phi-hd24-qknorm": _SMALL,
    "phi-hd24-plain-tied": dict(_SMALL, qk_layernorm=False, num_key_value_heads=4, hidden_act="gelu",
                                tie_word_embeddings=True, layer_norm_eps=1e-6,
                                rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                 "partial_rotary_factor": 0.25}),
    "phi-768-1layer": dict(model_type="phi", hidden_size=768, num_attention_heads=12, num_hidden_layers=1,
                           intermediate_size=3072, vocab_size=4096, max_position_embeddings=64, pad_token_id=0,
                           num_labels=3),
}

# heads each variant is built for (default: HEADS)
VARIANT_HEADS = {"phi-768-1layer": ("base", "causal_lm"), "phi-hd24-plain-tied": ("base", "causal_lm", "seqcls")}
