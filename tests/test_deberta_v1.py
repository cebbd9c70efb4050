"""DeBERTa (v1) checks the shared tables cannot express: talking heads, long batches, its own loss rule,
config parsing, its byte-level BPE tokenizer (DebertaTokenizer), and zero-shot NLI and fill-mask against the
pipelines."""

from __future__ import annotations

import shutil

import pytest

from flodl_hf import AutoTokenizer, fill_mask, zero_shot
from flodl_hf.auto import AutoConfig
from flodl_hf.core.errors import ConfigError
from flodl_hf.roundtrip.parity import check_parity, make_batch

from cases.deberta import CONFIGS
from helpers import make_checkpoint, one_thread, quiet_transformers  # noqa: F401  (the fixture)
from test_losses import test_loss_and_gradients_equal_transformers as loss_and_gradients
from test_tokenizer import assert_same
from test_tokenizer_dirs import PAIRS, SAMPLES, deberta_bpe_dir

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("task", ["base", "seqcls"])
def test_talking_heads(task):
    """head_logits_proj / head_weights_proj (transformers reads ``talking_head`` with getattr). transformers' own
    output with them moves by 4.5e-8 with whether the weights are inference tensors or require grad (matmul folds
    the permuted 4-D scores differently): compared here on one load, and through verify-export below."""
    source = make_checkpoint({**CONFIGS["deberta1-hd24"], "pos_att_type": "p2c", "talking_head": True}, task)
    assert check_parity(source, task, "eager").exact


def test_talking_heads_export_verifies(tmp_path):
    """verify-export loads transformers' model of the source as it loads the export's (outside inference mode):
    with talking heads, a model loaded inside it computed 1e-9 away from the same weights loaded outside."""
    from flodl_hf.roundtrip.export import export
    from flodl_hf.roundtrip.verify import verify_export

    source = make_checkpoint({**CONFIGS["deberta1-hd24"], "pos_att_type": "p2c", "talking_head": True}, "seqcls")
    report = verify_export(export(source, tmp_path / "out").out)
    assert report.ok and report.max_abs_diff == 0.0, report.format_table()


@pytest.mark.parametrize("variant,length", [("deberta1-hd24", 70), ("deberta1-c2p-embproj", 40)])
def test_long_padded_batch(variant, length):
    """Past max_relative_positions=6 (the window stops growing) and past max_position_embeddings=64 (relative
    positions only: no table to run out of, as in transformers); or all inside the window (-1: 64)."""
    source = make_checkpoint(CONFIGS[variant], "base")
    config = AutoConfig.from_pretrained(source)
    batch = make_batch(config, "base", lengths=(length, 23, 1))
    assert check_parity(source, "base", "eager", batch=batch).exact
    del batch["attention_mask"]  # transformers builds an all-ones mask; we skip the masking
    assert check_parity(source, "base", "eager", batch=batch).exact


@pytest.mark.parametrize("variant", ["soft", "negative"])
def test_sequence_loss_rule(variant):
    """DebertaForSequenceClassification's own rule without problem_type, as v2's (tests/test_losses.py)."""
    loss_and_gradients("seqcls", CONFIGS["deberta1-hd24"], variant)


def test_pos_att_type_parsing():
    assert AutoConfig.for_model("deberta", pos_att_type="C2P|p2c").to_dict()["pos_att_type"] == ["c2p", "p2c"]
    assert AutoConfig.for_model("deberta", pos_att_type=["p2c"]).to_dict()["pos_att_type"] == ["p2c"]
    # v1 scales by 1 + len(pos_att_type) and matches list entries case-sensitively: v2's leniency would differ
    for value in ("none", "c2p|c2p", ["C2P"], "c2p|p2p"):
        with pytest.raises(ConfigError, match="pos_att_type"):
            AutoConfig.for_model("deberta", pos_att_type=value)
    # v2-only options are ignored, as transformers' v1 ignores them
    config = AutoConfig.for_model("deberta", position_buckets=8, conv_kernel_size=3, norm_rel_ebd="layer_norm",
                                  relative_attention=True, max_relative_positions=6)
    assert (config.att_span, config.conv_size, config.norm_rel_ebd_terms) == (6, 0, ["none"])
    assert config.to_dict()["position_buckets"] == 8


def test_tokenizer_same_as_transformers(tmp_path):
    """As shipped (vocab.json + merges.txt) and as save_pretrained writes it (tokenizer.json)."""
    transformers = quiet_transformers()
    raw = deberta_bpe_dir()
    saved = tmp_path / "saved"
    transformers.AutoTokenizer.from_pretrained(str(raw)).save_pretrained(str(saved))
    shutil.copy(raw / "config.json", saved / "config.json")
    extra = dict(return_offsets_mapping=True, return_special_tokens_mask=True, padding=True)
    questions, contexts = map(list, zip(*PAIRS))
    for directory in (raw, saved):
        ref = transformers.AutoTokenizer.from_pretrained(str(directory))
        assert type(ref).__name__ == "DebertaTokenizer"
        ours = AutoTokenizer.from_pretrained(directory)
        for args in ((SAMPLES,), (questions, contexts)):
            for kwargs in ({}, dict(truncation=True, max_length=12)):
                assert_same(ours(*args, **kwargs, **extra), ref(*args, return_tensors="pt", **kwargs, **extra),
                            f"{directory.name} {kwargs}")


def model_dir(tmp_path, task: str, **fields):
    """A small deberta1-hd24 checkpoint for ``task`` with the DebertaTokenizer files beside it."""
    fields = {**{k: v for k, v in CONFIGS["deberta1-hd24"].items() if k != "num_labels"}, "vocab_size": 500,
              "pad_token_id": 0, "max_position_embeddings": 128, **fields}
    directory = tmp_path / task
    shutil.copytree(make_checkpoint(fields, task), directory)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(deberta_bpe_dir() / name, directory / name)
    return directory


def test_zero_shot_matches_pipeline(tmp_path):
    """deberta-large-mnli's shape at small size: uppercase MNLI labels, a DebertaTokenizer (pairs as
    [CLS] a [SEP] [SEP] b [SEP], token_type_ids given to a model without token types)."""
    transformers = quiet_transformers()
    id2label = {0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"}
    directory = model_dir(tmp_path, "seqcls", id2label=id2label, label2id={v: k for k, v in id2label.items()})
    pipe = transformers.pipeline("zero-shot-classification", model=str(directory), device="cpu")
    texts = ["Paris is the capital of France.", "John Smith lives in New York and works for Google.", "hello"]
    labels = ["sport", "politics", "cooking", "travel"]
    assert pipe.entailment_id == 2
    one = dict(batch_size=1)
    assert zero_shot(texts, labels, directory, **one) == pipe(texts, candidate_labels=labels)
    assert zero_shot(texts, labels, directory, multi_label=True, **one) == \
        pipe(texts, candidate_labels=labels, multi_label=True)


def test_fill_mask_matches_pipeline(tmp_path):
    """[MASK] takes the space before it (lstrip), as DebertaTokenizer declares it."""
    directory = model_dir(tmp_path, "mlm")
    pipe = quiet_transformers().pipeline("fill-mask", model=str(directory), device="cpu")
    for text in ("Paris is the [MASK] of France.", "[MASK] brown fox jumps over the [MASK] dog"):
        assert fill_mask(text, model=directory, top_k=3, batch_size=1) == pipe(text, top_k=3), text
