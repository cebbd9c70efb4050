"""What the parity table does not show for ELECTRA, MPNet and ModernBERT: their tasks (detect_replaced,
fill_mask, embed with a sentence-transformers pooling config), ModernBERT's older config spelling and
its window, padding-free batching through sliding-window layers, and their tokenizers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flodl_hf import AutoTokenizer, classify, detect_replaced, embed, fill_mask, load_model
from flodl_hf.auto import AutoConfig
from flodl_hf.roundtrip.parity import check_parity, make_batch, quiet_transformers

from cases import CASES
from helpers import CACHE, make_checkpoint, one_thread  # noqa: F401  (the fixture)
from test_batching import WIDE, _formed_batches, texts
from test_tasks import LABELS, TEXTS, TOKENIZERS, pipeline, task_dir
from test_tokenizer_dirs import all_dirs, corpus

BERT_TOK, BPE_TOK = TOKENIZERS[0], TOKENIZERS[1]
MODERNBERT_SMALL = dict(num_hidden_layers=4, local_attention=8)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/helpers.py


def _case(case_id: str) -> tuple[str, dict]:
    return next((task, fields) for cid, task, fields in CASES if cid == case_id)


# ---- ELECTRA ----------------------------------------------------------------------------------------

def test_detect_replaced_is_the_discriminator():
    """Scores are sigmoid(ElectraForPreTraining logits) on each non-special token, offsets the tokenizer's."""
    transformers = quiet_transformers()
    directory = task_dir(BERT_TOK, "pretraining", model_type="electra", embedding_size=16)
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModelForPreTraining.from_pretrained(str(directory), dtype=torch.float32).eval()
    assert type(model).__name__ == "ElectraForPreTraining"
    results = detect_replaced(TEXTS, directory, batch_size=1)
    for text, tokens in zip(TEXTS, results):
        enc = tok(text, return_tensors="pt", return_offsets_mapping=True, return_special_tokens_mask=True)
        offsets, special = enc.pop("offset_mapping")[0], enc.pop("special_tokens_mask")[0]
        with torch.inference_mode():
            scores = torch.sigmoid(model(**enc).logits[0])
        keep = [j for j in range(len(special)) if not special[j]]
        assert [t["score"] for t in tokens] == [scores[j].item() for j in keep]
        assert [(t["start"], t["end"]) for t in tokens] == [tuple(offsets[j].tolist()) for j in keep]
        assert [t["replaced"] for t in tokens] == [scores[j].item() > 0.5 for j in keep]
    assert detect_replaced(TEXTS[0], directory, threshold=2.0, batch_size=1)[0]["replaced"] is False


# ---- fill-mask on each new masked LM --------------------------------------------------------------

@pytest.mark.parametrize("model_type,tokenizer,extra", [
    ("electra", BERT_TOK, {"embedding_size": 16}),  # the generator
    ("mpnet", BPE_TOK, {}),
    ("modernbert", BPE_TOK, MODERNBERT_SMALL),
], ids=["electra", "mpnet", "modernbert"])
def test_fill_mask_matches_pipeline(model_type, tokenizer, extra):
    directory = task_dir(tokenizer, "mlm", model_type=model_type, **extra)
    pipe = pipeline("fill-mask", directory)
    mask = pipe.tokenizer.mask_token
    for text, top_k in ((f"Paris is the {mask} of France.", 3), (f"The {mask} brown fox jumps over the {mask} dog.", 2)):
        assert fill_mask(text, model=directory, top_k=top_k, batch_size=1) == pipe(text, top_k=top_k), text


# ---- MPNet: embed with a sentence-transformers pooling config -----------------------------------------

def test_mpnet_embed_follows_1_pooling_config(tmp_path):
    """A sentence-transformers MPNet directory (1_Pooling: mean) embeds to transformers' mean-pooled,
    normalised vector; switching the config to cls changes the vector accordingly."""
    transformers = quiet_transformers()
    base = task_dir(BPE_TOK, "base", model_type="mpnet")
    directory = tmp_path / "st-mpnet"
    shutil.copytree(base, directory)
    (directory / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModel.from_pretrained(str(directory), dtype=torch.float32).eval()
    expected_mean, expected_cls = [], []
    for text in TEXTS:  # sentence_transformers.models.Pooling (mean), then Normalize
        features = tok(text, return_tensors="pt")
        with torch.inference_mode():
            tokens = model(**features).last_hidden_state
        mask = features["attention_mask"].unsqueeze(-1).expand(tokens.size()).to(tokens.dtype)
        mean = torch.sum(tokens * mask, 1) / torch.clamp(mask.sum(1), min=1e-9)
        expected_mean.append(torch.nn.functional.normalize(mean, p=2, dim=1))
        expected_cls.append(torch.nn.functional.normalize(tokens[:, 0], p=2, dim=1))
    assert torch.equal(embed(TEXTS, directory, batch_size=1), torch.cat(expected_mean))
    pooling.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    from flodl_hf.tasks import clear_cache
    clear_cache()
    assert torch.equal(embed(TEXTS, str(directory), batch_size=1), torch.cat(expected_cls))


# ---- ModernBERT: config spellings and the window ------------------------------------------------------

def test_modernbert_reads_the_older_config_spelling(tmp_path):
    """A config.json with global_attn_every_n_layers / global_rope_theta / local_rope_theta (and no
    layer_types / rope_parameters) reads as transformers reads it, and stays exact."""
    task, fields = _case("modernbert-bias-mean-hd24-base")
    src = make_checkpoint(fields, task)
    old = tmp_path / "old-spelling"
    shutil.copytree(src, old)
    config = json.loads((old / "config.json").read_text())
    assert config["layer_types"][:3] == ["full_attention", "sliding_attention", "full_attention"]
    for name in ("layer_types", "rope_parameters"):
        config.pop(name)
    config.update(global_attn_every_n_layers=2, global_rope_theta=80_000.0, local_rope_theta=5_000.0)
    (old / "config.json").write_text(json.dumps(config))
    ours = AutoConfig.from_pretrained(old)
    theirs = quiet_transformers().AutoConfig.from_pretrained(str(old))
    assert ours.layer_kinds() == theirs.layer_types
    assert [ours.rope_theta(k) for k in ("full_attention", "sliding_attention")] == \
        [theirs.rope_parameters[k]["rope_theta"] for k in ("full_attention", "sliding_attention")] == [80_000.0, 5_000.0]
    for impl in ("sdpa", "eager"):
        result = check_parity(old, "base", impl)
        assert result.exact, (impl, result.diffs)


@torch.inference_mode()
def test_modernbert_window_masks_the_parity_batch():
    """The parity cases' window (5 either side) is narrower than the 13-token batch: widening it changes
    the output, so the sliding layers are tested with a mask that masks."""
    task, fields = _case("modernbert-768-base")
    model = load_model(make_checkpoint(fields, task), "base", dtype=torch.float32)
    batch = make_batch(model.config, "base")
    narrow = model(**batch).last_hidden_state
    model.config.local_attention = 64
    wide = model(**batch).last_hidden_state
    assert not torch.equal(narrow, wide)


def test_modernbert_padding_free_batches_equal_transformers_on_those_batches():
    """classify's own batches (padded and padding-free, mixed lengths past the window) through 4 layers
    with sliding windows of 4 tokens either side: each equals transformers on that batch."""
    transformers = quiet_transformers()
    extra = {"problem_type": "single_label_classification", "id2label": LABELS["seqcls"]}
    directory = task_dir(BPE_TOK, "seqcls", model_type="modernbert", **{**WIDE, **MODERNBERT_SMALL}, **extra)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(str(directory), dtype=torch.float32)
    theirs.eval()
    from flodl_hf.tasks import load
    loaded = load(directory, "seqcls")
    items = texts(80, seed=3)
    formed, enc = _formed_batches(loaded, items)
    assert any(not bool(b["attention_mask"].all()) for _, b in formed)
    assert max(b["input_ids"].shape[1] for _, b in formed) > 2 * 4 + 1  # longer than a window
    expected = {}
    with torch.inference_mode():
        for indices, batch in formed:
            a, b = loaded.model(**batch).logits, theirs(**batch).logits
            assert torch.equal(a, b), f"batch of {len(indices)} x {batch['input_ids'].shape[1]}"
            for j, i in enumerate(indices):
                expected[i] = b[j].tolist()
    ours = classify(items, directory, top_k=None, function_to_apply="none")
    for i, result in enumerate(ours):
        assert {r["label"]: r["score"] for r in result} == \
            {LABELS["seqcls"][k]: v for k, v in enumerate(expected[i])}, i


# ---- tokenizers -------------------------------------------------------------------------------------

def _tokenizer_dir(name: str, build) -> Path:
    out = CACHE / "tokenizers" / name
    if not (out / "tokenizer_config.json").is_file():
        work = out.with_name(out.name + ".tmp")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        build(work)
        shutil.rmtree(out, ignore_errors=True)
        work.rename(out)
    return out


def _mpnet_tokenizer(work):
    """MPNetTokenizer from a WordPiece vocabulary with MPNet's special tokens, saved by transformers."""
    transformers = quiet_transformers()
    words = [line for line in (all_dirs()["bert/vocab.txt"] / "vocab.txt").read_text().splitlines()
             if not line.startswith("[")]
    (work / "vocab.txt").write_text("\n".join(["<s>", "<pad>", "</s>", "[UNK]", *words, "<mask>"]) + "\n")
    (work / "config.json").write_text(json.dumps({"model_type": "mpnet"}))
    transformers.AutoTokenizer.from_pretrained(str(work)).save_pretrained(str(work))


def _modernbert_tokenizer(work):
    """ModernBERT's kind: a byte-level BPE tokenizer.json with [CLS] $A [SEP] ($B [SEP]) around it, read
    by PreTrainedTokenizerFast (tokenizer_config.json names that class, as ModernBERT-base's does)."""
    from tokenizers import ByteLevelBPETokenizer, processors
    transformers = quiet_transformers()
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    bpe = ByteLevelBPETokenizer(add_prefix_space=False, trim_offsets=True)
    bpe.train_from_iterator(corpus(), vocab_size=500, min_frequency=2, special_tokens=specials)
    bpe.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", bpe.token_to_id("[CLS]")), ("[SEP]", bpe.token_to_id("[SEP]"))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, unk_token="[UNK]",
                                                cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                                                mask_token="[MASK]", model_input_names=["input_ids", "attention_mask"])
    fast.save_pretrained(str(work))
    (work / "config.json").write_text(json.dumps({"model_type": "modernbert"}))


@pytest.mark.parametrize("name,build", [("mpnet", _mpnet_tokenizer), ("modernbert", _modernbert_tokenizer)])
def test_tokenizer_equals_transformers(name, build):
    directory = _tokenizer_dir(f"{name}-1", build)
    theirs = quiet_transformers().AutoTokenizer.from_pretrained(str(directory))
    ours = AutoTokenizer.from_pretrained(directory)
    pairs = [TEXTS[:3], TEXTS[1:4]]
    for kwargs in ({}, {"text_pair": pairs[1]}):
        texts_ = pairs[0]
        a = ours(texts_, padding=True, return_offsets_mapping=True, return_tensors="pt", **kwargs)
        b = theirs(texts_, padding=True, return_offsets_mapping=True, return_tensors="pt", **kwargs)
        assert set(a) == set(b), (set(a), set(b))
        for key in b:
            assert torch.equal(a[key], b[key]), key
    assert ours.mask_token == theirs.mask_token and ours.pad_token_id == theirs.pad_token_id


def test_modernbert_sparse_prediction_is_its_own_task_model():
    """sparse_prediction (ModernBERT's own masked-LM forward, a Family.task_models entry): with labels, the
    logits at the labelled tokens only and the loss on them, equal to transformers'; without, the full head."""
    from flodl_hf.families.modernbert import ModernBertForMaskedLM
    task, fields = _case("modernbert-bias-mean-hd24-mlm")
    src = make_checkpoint({**fields, "sparse_prediction": True}, task)
    ours = load_model(src, "mlm", dtype=torch.float32)
    assert type(ours) is ModernBertForMaskedLM
    theirs = quiet_transformers().AutoModelForMaskedLM.from_pretrained(str(src), dtype=torch.float32).eval()
    batch = make_batch(ours.config, "mlm")
    labels = torch.full_like(batch["input_ids"], -100)
    labels[0, [1, 4, 7]] = torch.tensor([5, 6, 7])
    labels[1, 2] = 9
    a, b = ours(**batch, labels=labels), theirs(**batch, labels=labels)
    assert a.logits.shape == (4, ours.config.vocab_size)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    with torch.inference_mode():
        assert torch.equal(ours(**batch).logits, theirs(**batch).logits)


def test_cli_detect_replaced_json_is_the_library_result(capsys):
    from flodl_hf.cli import main
    directory = task_dir(BERT_TOK, "pretraining", model_type="electra", embedding_size=16)
    assert main(["detect-replaced", TEXTS[0], TEXTS[1], "--model", str(directory), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == detect_replaced(TEXTS[:2], directory)
    assert main(["detect-replaced", TEXTS[0], "--model", str(directory)]) == 0
    assert "replaced" in capsys.readouterr().out
