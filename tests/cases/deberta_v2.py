"""DeBERTa-v2/v3: v3-style at real width (768, 12 heads of 64) and at head_dim 24, then one
variant per option that changes the computation, at head_dim 24 (hidden 96, 4 heads).

The parity batch is 13 tokens long, so relative distances reach 12: ``position_buckets=8``
puts most of them in log buckets, and ``max_relative_positions=6`` clamps them.
"""

HEADS = ("base", "seqcls", "tokcls", "qa", "mlm", "mc")

_COMMON = dict(model_type="deberta-v2", num_hidden_layers=2, vocab_size=1000, max_position_embeddings=64)
_V3 = dict(relative_attention=True, position_buckets=256, pos_att_type="p2c|c2p", share_att_key=True,
           norm_rel_ebd="layer_norm", position_biased_input=False, type_vocab_size=0, max_relative_positions=-1)
_768 = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_labels=3)
_HD24 = dict(hidden_size=96, num_attention_heads=4, intermediate_size=160, num_labels=5)


def _variant(**fields) -> dict:
    return {**_COMMON, **_HD24, **_V3, "position_buckets": 8, **fields}


CONFIGS = {
    "deberta-v3-768": {**_COMMON, **_768, **_V3},
    # lm_predictions head at real width, where F.linear and its matmul(h, W.t()) + bias differ
    "deberta-nonlegacy-768": {**_COMMON, **_768, **_V3, "legacy": False},
    "deberta-v3-hd24": _variant(pos_att_type=["p2c", "c2p"], hidden_act="gelu_new"),
    # v2-xlarge style: ConvLayer after layer 0 (grouped here, to cover conv_groups)
    "deberta-v2xl-conv": _variant(conv_kernel_size=3, conv_act="gelu", conv_groups=2),
    "deberta-c2p-noshare": _variant(pos_att_type="c2p", share_att_key=False, norm_rel_ebd="none",
                                    position_buckets=-1, max_relative_positions=6),
    "deberta-p2c": _variant(pos_att_type=["p2c"], pooler_hidden_act="tanh", layer_norm_eps=1e-12),
    "deberta-noshare": _variant(share_att_key=False, position_biased_input=True),
    "deberta-norel": _variant(relative_attention=False, pos_att_type=None, norm_rel_ebd="none",
                              position_biased_input=True),
    # factorised embeddings: embed_proj up to hidden_size; the legacy MLM head narrows back down
    "deberta-embproj": _variant(embedding_size=64),
    "deberta-types": _variant(type_vocab_size=2, position_biased_input=True),
    # untied: decoder weight and bias are their own tensors (transformers 5 unties both)
    "deberta-untied": _variant(tie_word_embeddings=False),
}
