"""DeBERTa-v2 checks the parity table cannot express: other batch shapes, config parsing, export."""

from __future__ import annotations

import pytest
import torch

from flodl_hf.auto import AutoConfig, load_model
from flodl_hf.core.errors import ConfigError
from flodl_hf.families.deberta_v2 import PosAttType
from flodl_hf.roundtrip.parity import check_parity, make_batch, reference_model

from cases.deberta_v2 import CONFIGS
from helpers import make_checkpoint


@pytest.mark.parametrize("variant", ["deberta-v3-hd24", "deberta-c2p-noshare", "deberta-v2xl-conv"])
def test_long_padded_batch(variant):
    """40 tokens: distances far beyond the buckets (log buckets) and the clamp, three padded rows."""
    source = make_checkpoint(CONFIGS[variant], "base")
    config = AutoConfig.from_pretrained(source)
    result = check_parity(source, "base", "eager", batch=make_batch(config, "base", lengths=(40, 23, 1)))
    assert result.exact, result.diffs


@pytest.mark.parametrize("task", ["base", "mlm"])
def test_no_attention_mask(task):
    """transformers builds an all-ones mask; we skip the masking, which must change nothing."""
    source = make_checkpoint(CONFIGS["deberta-v2xl-conv"], task)
    config = AutoConfig.from_pretrained(source)
    batch = make_batch(config, task, lengths=(11, 11))
    del batch["attention_mask"]
    assert check_parity(source, task, "eager", batch=batch).exact


def test_pos_att_type_parsing():
    config = AutoConfig.for_model("deberta-v2", pos_att_type="P2C | c2p", hidden_size=96, num_attention_heads=4)
    assert config.pos_att_type == (PosAttType.P2C, PosAttType.C2P)
    assert config.to_dict()["pos_att_type"] == ["p2c", "c2p"]
    assert AutoConfig.for_model("deberta-v2", pos_att_type=["c2p"]).pos_att_type == (PosAttType.C2P,)
    assert AutoConfig.for_model("deberta-v2", pos_att_type="none").pos_att_type == ()
    with pytest.raises(ConfigError, match="p2p"):
        AutoConfig.for_model("deberta-v2", pos_att_type="p2c|p2p")
    with pytest.raises(ConfigError, match="norm_rel_ebd"):
        AutoConfig.for_model("deberta-v2", norm_rel_ebd="batch_norm")


def test_nonlegacy_head_needs_hidden_size_embeddings():
    from flodl_hf.auto import AutoModelForMaskedLM
    config = AutoConfig.for_model("deberta-v2", legacy=False, embedding_size=64, hidden_size=96,
                                  num_attention_heads=4, num_hidden_layers=1, vocab_size=100)
    with pytest.raises(ConfigError, match="embedding_size"):
        AutoModelForMaskedLM.from_config(config)


@pytest.mark.parametrize("variant", ["deberta-embproj", "deberta-nonlegacy-768", "deberta-untied"])
@torch.inference_mode()
def test_save_pretrained_loads_in_transformers(variant, tmp_path):
    """Export writes what transformers reads back, ties included, with the same logits."""
    source = make_checkpoint(CONFIGS[variant], "mlm")
    ours = load_model(source, "mlm", dtype=torch.float32)
    ours.save_pretrained(tmp_path)
    theirs = reference_model(tmp_path, "mlm", None)
    batch = make_batch(ours.config, "mlm")
    assert torch.equal(ours(**batch).logits, theirs(**batch).logits)
