"""DeBERTa (v1): deberta-base's layout at real width (768, 12 heads of 64) and at head_dim 24, then one
variant per option that changes the computation, at head_dim 24 (hidden 96, 4 heads).

The parity batch is 13 tokens long: ``max_relative_positions=6`` makes the relative window narrower than
the sequence (transformers' ``min(S, max_relative_positions)``); -1 keeps it at the sequence length.
"""

HEADS = ("base", "seqcls", "tokcls", "qa", "mlm")

_COMMON = dict(model_type="deberta", num_hidden_layers=2, vocab_size=1000, max_position_embeddings=64)
# microsoft/deberta-base and deberta-large-mnli: relative attention, c2p|p2c, no absolute positions
_BASE = dict(relative_attention=True, pos_att_type="c2p|p2c", position_biased_input=False, max_relative_positions=-1,
             type_vocab_size=0, layer_norm_eps=1e-7)
_768 = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_labels=3)
_HD24 = dict(hidden_size=96, num_attention_heads=4, intermediate_size=160, num_labels=5)


def _variant(**fields) -> dict:
    return {**_COMMON, **_HD24, **_BASE, **fields}


CONFIGS = {  # the first variant is the one tests/test_export.py round-trips for every head
    "deberta1-hd24": _variant(pos_att_type=["p2c", "c2p"], hidden_act="gelu_new", max_relative_positions=6),
    "deberta1-768": {**_COMMON, **_768, **_BASE},
    # absolute positions and token types; factorised embeddings (embed_proj) under an untied legacy MLM head
    "deberta1-c2p-embproj": _variant(pos_att_type="c2p", position_biased_input=True, type_vocab_size=2,
                                     embedding_size=64, tie_word_embeddings=False, pooler_hidden_act="tanh"),
    # p2c alone, a window narrower than the batch; the lm_predictions MLM head. (talking_head: tests/test_deberta_v1.py)
    "deberta1-p2c-nonlegacy": _variant(pos_att_type=["p2c"], max_relative_positions=6, legacy=False),
    "deberta1-norel": _variant(relative_attention=False, pos_att_type=None, position_biased_input=True),
}
# The head code is v2's (tests/cases/deberta_v2.py runs it on every head): the other variants test the backbone
VARIANT_HEADS = {"deberta1-768": ("base", "seqcls", "mlm"), "deberta1-c2p-embproj": ("base", "tokcls", "mlm"),
                 "deberta1-p2c-nonlegacy": ("base", "qa", "mlm"), "deberta1-norel": ("base", "seqcls")}
