"""Export keeps the whole checkpoint: the model card, the sentence-transformers layout and the
tokenizer's own files are carried byte-identical (flodl_hf.roundtrip.carry), and nothing else.

The sentence-transformers models are real ones: samples/minilm (when fetched) and one built and
saved here by sentence-transformers itself on a tiny checkpoint generated with transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from flodl_hf.roundtrip import carry
from flodl_hf.core import samples
from flodl_hf.auto import load_model
from flodl_hf.cli import main
from flodl_hf.core.errors import CheckpointFormatError, ConfigError
from flodl_hf.roundtrip.export import export, export_checkpoint
from flodl_hf.roundtrip.parity import quiet_transformers
from flodl_hf.training.trainer import Trainer
from flodl_hf.roundtrip.matrix import tiny_config
from flodl_hf.roundtrip.verify import PASS, SKIP, verify_export
from helpers import make_checkpoint

pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer, models  # noqa: E402

WORDS = "the quick brown fox jumps over lazy dog near river bank hello world".split()
PROMPTS = ["the quick brown fox jumps over the lazy dog", "hello world", "near the river bank"]
# Files a source may hold that an export must never carry: old weights, scripts, data lists,
# dotfiles, and a folder modules.json does not name.
STRAY = {"pytorch_model.bin": b"old weights", "tf_model.h5": b"old weights", "onnx/model.onnx": b"old weights",
         "train_script.py": b"print('train')\n", "data_config.json": b"[]\n", ".cache-marker": b"x",
         "9_Unused/config.json": b"{}\n", "notes/todo.txt": b"stray\n"}


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _modules(directory: Path) -> list[str]:
    model = SentenceTransformer(str(directory), device="cpu")
    return [type(m).__name__ for m in model]


def _encode(directory: Path) -> torch.Tensor:
    model = SentenceTransformer(str(directory), device="cpu")
    return model.encode(PROMPTS, convert_to_tensor=True, show_progress_bar=False)


def _no_scratch(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if p.name.startswith(".")]


@pytest.fixture(scope="module")
def st_source(tmp_path_factory) -> Path:
    """A sentence-transformers model (Transformer -> Pooling -> Dense -> Normalize) saved by
    sentence-transformers itself, with a model card, a generation config and stray files."""
    work = tmp_path_factory.mktemp("st")
    base = work / "base"
    shutil.copytree(make_checkpoint(tiny_config("bert"), "base"), base)
    (base / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s"]) + "\n")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = models.Transformer(str(base), max_seq_length=32)
        modules = [transformer, models.Pooling(transformer.get_word_embedding_dimension(), "mean"),
                   models.Dense(32, 16), models.Normalize()]
        SentenceTransformer(modules=modules, device="cpu").save(str(work / "src"))
    src = work / "src"
    quiet_transformers().AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(src))
    shutil.copyfile(base / "vocab.txt", src / "vocab.txt")
    (src / "README.md").write_text("---\nlicense: apache-2.0\nlibrary_name: sentence-transformers\n---\n# tiny\n")
    (src / "generation_config.json").write_text('{"_from_model_config": true}\n')
    (src / "added_tokens.json").write_text("{}\n")
    for name, data in STRAY.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    return src


# ---- sentence-transformers models ----------------------------------------------------------------------

def test_minilm_loads_as_the_source_in_sentence_transformers(tmp_path):
    path = samples.local_path("minilm")
    if path is None:
        pytest.skip("samples/minilm is not in the cache (run `flodl-hf samples fetch`)")
    result = export("samples/minilm", tmp_path / "out")
    assert _modules(result.out) == _modules(path) == ["Transformer", "Pooling", "Normalize"]
    assert torch.equal(_encode(result.out), _encode(path))
    ours, theirs = _files(result.out), _files(path)
    carried = {"README.md", "modules.json", "1_Pooling/config.json", "sentence_bert_config.json",
               "config_sentence_transformers.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.txt"}
    assert set(result.carried) == carried
    assert all(ours[name] == theirs[name] for name in carried)
    # the training-data list and the sample marker describe no model a library reads: not carried
    assert set(ours) == carried | {"config.json", "model.safetensors"}


def test_generated_sentence_model_round_trip(tmp_path, st_source, capsys):
    out = tmp_path / "out"
    assert main(["export", "--hub", str(st_source), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "carried byte-identical" in printed and "2_Dense/ (2 files)" in printed
    ours, theirs = _files(out), _files(st_source)
    carried = {"README.md", "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json",
               "generation_config.json", "added_tokens.json", "1_Pooling/config.json", "2_Dense/config.json",
               "2_Dense/model.safetensors", "3_Normalize/config.json", "tokenizer.json", "tokenizer_config.json",
               "vocab.txt"}
    assert carried <= set(theirs)
    assert {n for n in ours if n in theirs and ours[n] == theirs[n]} >= carried
    assert set(ours) == carried | {"config.json", "model.safetensors", "special_tokens_map.json"}
    assert not set(ours) & set(STRAY)
    assert _modules(out) == _modules(st_source) == ["Transformer", "Pooling", "Dense", "Normalize"]
    assert torch.equal(_encode(out), _encode(st_source))
    report = verify_export(out, prompts=PROMPTS)
    assert report.ok, report.format_table()
    check = report.check(6)
    assert check.status == PASS and check.max_abs_diff == 0.0
    assert "Transformer -> Pooling -> Dense -> Normalize" in check.detail
    assert main(["verify-export", str(out)]) == 0
    assert "sentence-transformers" in capsys.readouterr().out


def test_verify_fails_an_export_that_lost_the_layout(tmp_path, st_source):
    result = export(st_source, tmp_path / "out")
    (result.out / "modules.json").unlink()
    report = verify_export(result.out)
    assert not report.ok and report.check(6).status == "FAIL"
    assert "has no modules.json" in report.check(6).detail


def test_verify_fails_when_embeddings_differ(tmp_path, st_source):
    result = export(st_source, tmp_path / "out")
    pooling = result.out / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    assert config["pooling_mode"] == "mean"  # sentence-transformers 6's key
    config["pooling_mode"] = "cls"
    pooling.write_text(json.dumps(config))
    report = verify_export(result.out)
    check = report.check(6)
    assert not report.ok and check.status == "FAIL" and "max abs diff" in check.detail and check.max_abs_diff > 0


@pytest.mark.parametrize("dtype,head", [("bfloat16", "auto"), ("keep", "seqcls")])
def test_cast_or_other_head_encodes_as_the_source(tmp_path, st_source, dtype, head):
    # a cast export against the source cast alike; a fresh head: sentence-transformers reads the backbone
    result = export(st_source, tmp_path / "out", dtype=dtype, head=head)
    assert "modules.json" in result.carried
    report = verify_export(result.out)
    assert report.ok, report.format_table()
    assert report.check(6).status == PASS


# ---- a plain model with a model card ---------------------------------------------------------------------

def test_model_card_is_carried_and_no_sentence_check(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(make_checkpoint(tiny_config("bert"), "mlm"), src)
    card = "---\nlicense: mit\n---\n# A card\n\nWith a licence.\n".encode()
    (src / "README.md").write_bytes(card)
    (src / "LICENSE").write_bytes(b"MIT License\n")
    (src / "pytorch_model.bin").write_bytes(b"old weights")
    result = export(src, tmp_path / "out")
    assert result.carried == ["LICENSE", "README.md"]
    assert (result.out / "README.md").read_bytes() == card
    assert (result.out / "LICENSE").read_bytes() == b"MIT License\n"
    assert not (result.out / "pytorch_model.bin").exists()
    report = verify_export(result.out)
    assert report.ok and 6 not in {c.number for c in report.checks}  # not a sentence-transformers model


# ---- safety: nothing from outside the source, nothing written on refusal ---------------------------------

def _copy(st_source: Path, tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(st_source, src, symlinks=True)
    return src


@pytest.mark.parametrize("path", ["../outside", "/etc", "1_Pooling/../../outside", "C:\\models\\pool"])
def test_module_path_leaving_the_directory_is_refused(tmp_path, st_source, path):
    src = _copy(st_source, tmp_path)
    modules = json.loads((src / "modules.json").read_text())
    modules[1]["path"] = path
    (src / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("not yours")
    with pytest.raises(ConfigError, match=r"entry 1 .*leaves the model directory"):
        export(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _no_scratch(tmp_path)


@pytest.mark.parametrize("what", ["card", "module file", "module folder"])
def test_symlink_out_of_the_source_is_refused(tmp_path, st_source, what):
    src = _copy(st_source, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text('{"secret": 1}')
    if what == "card":
        (src / "README.md").unlink()
        (src / "README.md").symlink_to(outside / "config.json")
    elif what == "module file":
        (src / "1_Pooling" / "config.json").unlink()
        (src / "1_Pooling" / "config.json").symlink_to(outside / "config.json")
    else:
        shutil.rmtree(src / "1_Pooling")
        (src / "1_Pooling").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointFormatError, match="outside the source"):
        export(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _no_scratch(tmp_path)


def test_symlink_inside_the_source_is_followed(tmp_path, st_source):
    src = _copy(st_source, tmp_path)
    (src / "cards").mkdir()
    (src / "README.md").rename(src / "cards" / "card.md")
    (src / "README.md").symlink_to(Path("cards") / "card.md")
    result = export(src, tmp_path / "out")
    assert not (result.out / "README.md").is_symlink()
    assert (result.out / "README.md").read_bytes() == (st_source / "README.md").read_bytes()
    assert not (result.out / "cards").exists()


def test_hub_snapshot_links_into_blobs_are_followed(tmp_path, st_source):
    # huggingface_hub's cache: snapshots/<commit>/<file> are symlinks to ../../blobs/<hash>.
    repo = tmp_path / "models--acme--tiny"
    snapshot = repo / "snapshots" / ("c" * 40)
    (repo / "blobs").mkdir(parents=True)
    for i, (name, data) in enumerate(_files(st_source).items()):
        blob = repo / "blobs" / f"{i:040d}"
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    result = export(snapshot, tmp_path / "out")
    assert {"README.md", "modules.json", "2_Dense/model.safetensors"} <= set(result.carried)
    ours, theirs = _files(result.out), _files(st_source)
    assert all(ours[n] == theirs[n] and not (result.out / n).is_symlink() for n in result.carried)


def test_module_folders_named_twice_are_carried_once(tmp_path, st_source):
    src = _copy(st_source, tmp_path)
    modules = json.loads((src / "modules.json").read_text())
    modules.insert(2, {**modules[1], "idx": 9, "name": "again", "path": "./1_Pooling"})
    (src / "modules.json").write_text(json.dumps(modules))
    result = export(src, tmp_path / "out")
    assert result.carried.count("1_Pooling/config.json") == 1
    assert (result.out / "modules.json").read_bytes() == (src / "modules.json").read_bytes()


def test_transformer_outside_the_root_is_not_carried(tmp_path, st_source):
    src = _copy(st_source, tmp_path)
    modules = json.loads((src / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"  # the older layout: its weights would come from there
    (src / "modules.json").write_text(json.dumps(modules))
    result = export(src, tmp_path / "out")
    assert "modules.json" not in result.carried and not any(n.startswith("1_Pooling") for n in result.carried)
    assert any("places the Transformer in 0_Transformer/" in n for n in result.notes)
    assert "README.md" in result.carried


# ---- trainer checkpoints ---------------------------------------------------------------------------------

def _train_one_step(source: Path, directory: Path) -> Path:
    model = load_model(source, "base")
    data = [{"input_ids": torch.tensor([2, 5, 6, 3]), "attention_mask": torch.ones(4, dtype=torch.long)}] * 4

    def step(m, batch):
        return m(**batch).last_hidden_state.pow(2).mean()

    Trainer(model, step, lambda p: torch.optim.SGD(p, lr=0.01), data, batch_size=2, max_steps=1,
            checkpoint_dir=directory, progress=False, report=False).fit()
    return next(directory.glob("step-*.pt"))


def test_checkpoint_carries_from_its_recorded_source(tmp_path, st_source):
    ckpt = _train_one_step(st_source, tmp_path / "run")
    assert torch.load(ckpt, weights_only=True)["source"] == str(st_source.absolute())
    result = export_checkpoint(ckpt, tmp_path / "out")
    assert any("the checkpoint's recorded source" in n for n in result.notes)
    ours, theirs = _files(result.out), _files(st_source)
    assert {"modules.json", "2_Dense/model.safetensors", "vocab.txt"} <= set(result.carried)
    assert all(ours[n] == theirs[n] for n in result.carried)
    assert not set(ours) & set(STRAY)
    # the base's card describes the base: the fine-tune gets a card of its own, read back by huggingface_hub
    assert "README.md" not in result.carried and ours["README.md"] != theirs["README.md"]
    card = ModelCard.load(result.out / "README.md")
    base = ModelCard.load(st_source / "README.md").data
    assert base.license == "apache-2.0" and card.data.license == base.license
    assert card.data.library_name == "transformers" and "flodl-hf" in card.data.tags
    assert card.data.base_model is None and str(st_source) in card.text  # a local base: named in the text only
    assert "fine-tuned version of" in card.text and "1 step" in card.text and ckpt.name in card.text
    assert any("README.md written for the fine-tune" in n for n in result.notes)
    report = verify_export(result.out)
    assert report.ok, report.format_table()
    assert report.check(6).status == PASS and "embeddings not compared" in report.check(6).detail
    assert report.check(3).status == SKIP


def test_checkpoint_like_dir_and_no_source(tmp_path, st_source, capsys):
    ckpt = _train_one_step(st_source, tmp_path / "run")
    data = torch.load(ckpt, weights_only=True)
    card_only = tmp_path / "card"
    card_only.mkdir()
    (card_only / "README.md").write_text("# the fine-tune\n")
    result = export_checkpoint(ckpt, tmp_path / "like", like=card_only)
    assert result.carried == ["README.md"] and any("(--like)" in n for n in result.notes)
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "cli"), "--like", str(card_only)]) == 0
    assert f"README.md from {card_only} (--like)" in capsys.readouterr().out
    assert (tmp_path / "cli" / "README.md").read_text() == "# the fine-tune\n"
    del data["source"]
    bare = tmp_path / "bare.pt"
    torch.save(data, bare)
    result = export_checkpoint(bare, tmp_path / "bare")
    assert result.carried == [] and any("records no source" in n for n in result.notes)
    os.remove(bare)


def test_checkpoint_of_a_hub_base_names_it_as_base_model(tmp_path):
    """A base loaded from a hub cache snapshot is named by its repo id in the fine-tune's card; a base whose
    card has no metadata gives a card without licence."""
    snapshot = tmp_path / "hub" / "models--acme--tiny-bert" / "snapshots" / "0123abcd"
    shutil.copytree(make_checkpoint(tiny_config("bert"), "base"), snapshot)
    (snapshot / "README.md").write_text("# tiny\nno metadata here\n")
    ckpt = _train_one_step(snapshot, tmp_path / "run")
    result = export_checkpoint(ckpt, tmp_path / "out")
    card = ModelCard.load(result.out / "README.md")
    assert card.data.base_model == "acme/tiny-bert" and card.data.license is None
    assert "https://huggingface.co/acme/tiny-bert" in card.text and "no metadata here" not in card.text
    assert verify_export(result.out, source=None).check(7).status == PASS
    # a sample that is a copy of a hub repo is named as that repo
    assert carry.hub_id(samples.SAMPLES["minilm"].path) == "sentence-transformers/all-MiniLM-L6-v2"
    assert carry.hub_id(snapshot.parent) is None and carry.hub_id(tmp_path) is None


def test_sentencepiece_model_and_tokenizer_config_are_the_sources(tmp_path):
    import sentencepiece as spm
    src = tmp_path / "src"
    shutil.copytree(make_checkpoint(tiny_config("albert"), "mlm"), src)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(8)) for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "sp"), vocab_size=40, pad_id=0,
                                   unk_id=1, bos_id=-1, eos_id=-1, minloglevel=2,
                                   user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"])
    shutil.copyfile(tmp_path / "sp.model", src / "spiece.model")
    config = b'{"tokenizer_class": "AlbertTokenizer", "do_lower_case": true, "model_max_length": 64}'
    (src / "tokenizer_config.json").write_bytes(config)
    result = export(src, tmp_path / "out")
    assert {"spiece.model", "tokenizer_config.json"} <= set(result.carried)
    assert (result.out / "spiece.model").read_bytes() == (src / "spiece.model").read_bytes()
    assert (result.out / "tokenizer_config.json").read_bytes() == config  # transformers' rewrite is replaced
    assert "tokenizer.json" in result.tokenizer_files  # converted by transformers: the source has none
    transformers = quiet_transformers()
    texts = ["the quick brown fox", "hello river world near the bank"]
    ours = transformers.AutoTokenizer.from_pretrained(str(result.out))(texts)
    assert dict(ours) == dict(transformers.AutoTokenizer.from_pretrained(str(src))(texts))


def test_hub_export_like_takes_the_layout_from_there(tmp_path, st_source):
    src = tmp_path / "plain"
    shutil.copytree(make_checkpoint(tiny_config("bert"), "base"), src)
    result = export(src, tmp_path / "out", like=st_source)
    assert {"modules.json", "2_Dense/model.safetensors", "vocab.txt"} <= set(result.carried)
    assert any(f"from {st_source} (--like)" in n for n in result.notes)
    report = verify_export(result.out)
    assert report.ok, report.format_table()
    assert report.check(6).status == PASS and "the layout came from" in report.check(6).detail
