"""config.json's ``num_labels`` against its ``id2label``, read as the installed transformers reads it. transformers
changed the rule inside our supported range (5.3 lets id2label win, 5.4 on takes num_labels and drops the names), so
every case is compared with the installed transformers in the same run; CI runs this file at both ends of the
range (the ``range_end`` marker)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from flodl_hf import AutoConfig, AutoModelForSequenceClassification
from flodl_hf.core.errors import FlodlHFError
from helpers import make_checkpoint, quiet_transformers

pytestmark = pytest.mark.range_end

BERT = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 37, "vocab_size": 99, "max_position_embeddings": 64}


@pytest.mark.parametrize("fields", [
    {"num_labels": 3, "id2label": {"0": "neg", "1": "pos"}, "label2id": {"neg": 0, "pos": 1}},
    {"num_labels": 1, "id2label": {"0": "neg", "1": "pos"}},
    {"num_labels": 2, "id2label": {"0": "neg", "1": "pos"}},
    {"num_labels": 4},
    {"id2label": {"0": "a", "1": "b", "2": "c"}},
    {},
], ids=["more-num_labels", "fewer-num_labels", "equal", "num_labels-only", "id2label-only", "neither"])
def test_labels_are_read_as_the_installed_transformers_reads_them(tmp_path, fields):
    data = {**BERT, **fields}
    (tmp_path / "config.json").write_text(json.dumps(data))
    ours = AutoConfig.from_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = quiet_transformers().AutoConfig.from_pretrained(str(tmp_path))
    assert ours.num_labels == theirs.num_labels
    # transformers leaves label2id None where config.json has none; ours is id2label's inverse then
    assert ours.id2label == theirs.id2label
    assert ours.label2id == (theirs.label2id or {name: i for i, name in theirs.id2label.items()})


def test_a_classifier_with_more_num_labels_than_names_loads_where_transformers_loads_it(tmp_path):
    """A fine-tuned classifier whose config.json gives num_labels 3, names for 2, and weights for 3 rows: transformers
    from 5.4 loads it (labels LABEL_0..2), and so do we, with equal logits; where the installed transformers refuses
    it (id2label wins, 2 rows), we refuse it too, with a typed error naming the classifier's shape."""
    source = make_checkpoint({**BERT, "num_labels": 3}, "seqcls")
    work = tmp_path / "clf"
    shutil.copytree(source, work)
    config = json.loads((work / "config.json").read_text())
    config.update(id2label={"0": "neg", "1": "pos"}, label2id={"neg": 0, "pos": 1}, num_labels=3)
    (work / "config.json").write_text(json.dumps(config))
    transformers = quiet_transformers()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = transformers.AutoModelForSequenceClassification.from_pretrained(str(work)).eval()
    except Exception:  # noqa: BLE001 (transformers refuses with its own errors)
        with pytest.raises(FlodlHFError, match="classifier"):
            AutoModelForSequenceClassification.from_pretrained(work)
        return
    ours = AutoModelForSequenceClassification.from_pretrained(work)
    assert ours.config.id2label == theirs.config.id2label
    ids = torch.tensor([[2, 17, 31, 44, 3]])
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)
