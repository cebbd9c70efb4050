"""Round trip: export then verify-export for every registered family x head, and every bad input.

Checkpoints are generated locally with transformers (``helpers.make_checkpoint``), from each
family's parity configs (``tests/cases``) shrunk to tiny sizes by ``flodl_hf.roundtrip.matrix.tiny_config``:
the first variant of a family with every head, the other variants with seqcls and mlm.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import cases
from flodl_hf.core import io
from flodl_hf.auto import load_model
from flodl_hf.cli import main
from flodl_hf.core.errors import (CheckpointFormatError, ConfigError, OutputExistsError, SourceNotFoundError,
                                  UnsupportedModelError)
from flodl_hf.core.fs import sha256_file
from flodl_hf.roundtrip.export import export, export_checkpoint
from flodl_hf.roundtrip.parity import REFERENCE_CLASSES
from flodl_hf.core.registry import get_family, supported_model_types
from flodl_hf.roundtrip.matrix import tiny_config, verify_matrix
from flodl_hf.core.validate import tree_hash
from flodl_hf.roundtrip.verify import FAIL, PASS, SKIP, verify_export
from helpers import make_checkpoint, quiet_transformers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _variants() -> dict[str, list[tuple[str, dict]]]:
    """model_type -> [(variant, transformers config fields)] from tests/cases."""
    out: dict[str, list[tuple[str, dict]]] = {}
    for info in sorted(pkgutil.iter_modules(cases.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"cases.{info.name}")
        for variant, fields in module.CONFIGS.items():
            out.setdefault(fields["model_type"], []).append((variant, fields))
    return out


def _round_trip_params():
    variants = _variants()
    for model_type in supported_model_types():
        for i, (variant, fields) in enumerate(variants.get(model_type) or [(model_type, {})]):
            tasks = get_family(model_type).tasks
            for task in tasks if i == 0 else [t for t in ("seqcls", "mlm", "causal_lm") if t in tasks]:
                yield pytest.param(task, tiny_config(model_type, fields, task), id=f"{variant}-{task}")


def _tiny(task: str, model_type: str = "bert") -> Path:
    return make_checkpoint(tiny_config(model_type, None, task), task)


def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def _loading_info(directory: Path, task: str) -> dict:
    transformers = quiet_transformers()
    _, info = getattr(transformers, REFERENCE_CLASSES[task]).from_pretrained(str(directory), output_loading_info=True)
    return {k: v for k, v in info.items() if v}


def _module(name: str):
    """The module itself: ``import flodl_hf.roundtrip.export as m`` would give a function if the package re-exports one."""
    return importlib.import_module(name)


def _statuses(report) -> dict[int, str]:
    return {c.number: c.status for c in report.checks}


def _no_scratch(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if p.name.startswith(".") and (".partial-" in p.name or ".old-" in p.name)]


# ---- the round trip, over the registry ------------------------------------------------------------------

@pytest.mark.parametrize("task,fields", list(_round_trip_params()))
def test_round_trip(tmp_path, task, fields):
    src = make_checkpoint(fields, task)
    result = export(src, tmp_path / "out")
    out = result.out
    # a causal LM's directory carries transformers' generation_config.json, and the export keeps it
    generation = ["generation_config.json"] if (src / "generation_config.json").is_file() else []
    assert result.files == ["config.json", *generation, "model.safetensors"]
    assert result.task == task and not result.fresh and not result.dropped
    # config.json: the source's, field for field, plus the stamp
    config = _config(out)
    stamp = config.pop("flodl_hf")
    assert config == _config(src)
    assert stamp["source"] == str(src) and stamp["dtype"] == "keep"
    assert stamp["weights_sha256"] == {"model.safetensors": sha256_file(src / "model.safetensors")}
    # tied tensors written once, as transformers writes them: the same key set
    assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(src / "model.safetensors")))
    assert _loading_info(out, task) == {}
    report = verify_export(out)
    assert report.ok, report.format_table()
    assert _statuses(report) == {1: PASS, 2: PASS, 3: PASS, 4: PASS, 5: SKIP, 7: PASS}
    assert report.max_abs_diff == 0.0


# ---- shapes of export: shards, dtypes, other heads, tokenizers ----------------------------------------

def test_sharded_export(tmp_path):
    src = _tiny("mlm")
    result = export(src, tmp_path / "out", max_shard_size="40KB")
    shards = [f for f in result.files if f.endswith(".safetensors")]
    assert len(shards) > 1 and io.SAFE_INDEX in result.files
    index = json.loads((result.out / io.SAFE_INDEX).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in load_file(str(src / "model.safetensors")).values())
    assert _loading_info(result.out, "mlm") == {}
    assert verify_export(result.out).ok


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dtype_cast(tmp_path, dtype):
    src = _tiny("seqcls")
    result = export(src, tmp_path / "out", dtype=dtype)
    tensors = load_file(str(result.out / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {getattr(torch, dtype)}
    config = _config(result.out)
    assert config["dtype"] == dtype and config["flodl_hf"]["dtype"] == dtype
    report = verify_export(result.out)
    assert report.ok, report.format_table()
    assert "cast to" in report.check(2).detail


def test_fresh_head_from_base(tmp_path):
    result = export(_tiny("base"), tmp_path / "out", head="seqcls")
    assert result.architecture == "BertForSequenceClassification"
    assert set(result.fresh) == {"classifier.weight", "classifier.bias"}
    assert _loading_info(result.out, "seqcls") == {}
    report = verify_export(result.out)
    assert report.ok, report.format_table()
    assert "fresh" in report.check(2).detail and "backbones compared" in report.check(3).detail


def test_base_from_mlm_gets_the_pooler_transformers_has(tmp_path):
    result = export(_tiny("mlm"), tmp_path / "out", head="base")
    assert result.architecture == "BertModel"
    assert set(result.fresh) == {"pooler.dense.weight", "pooler.dense.bias"}
    assert any(k.startswith("cls.") for k in result.dropped)
    assert _loading_info(result.out, "base") == {}
    assert verify_export(result.out).ok


def test_base_from_seqcls_drops_the_head(tmp_path):
    result = export(_tiny("seqcls"), tmp_path / "out", head="base")
    assert set(result.dropped) == {"classifier.weight", "classifier.bias"} and not result.fresh
    report = verify_export(result.out)
    assert report.ok and report.check(3).status == PASS


def _wordpiece_source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(_tiny("mlm"), src)
    words = "the quick brown fox jumps over lazy dog near river bank hello world".split()
    (src / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, "##s"]) + "\n")
    return src


def _sentencepiece_source(tmp_path: Path) -> Path:
    import sentencepiece as spm
    src = tmp_path / "spsrc"
    shutil.copytree(_tiny("mlm"), src)
    words = "the quick brown fox jumps over lazy dog near river bank hello world".split()
    text = tmp_path / "text.txt"
    text.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(9)) for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(src / "spiece"), vocab_size=40,
                                   pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, minloglevel=2,
                                   user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"])
    (src / "spiece.vocab").unlink()
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "AlbertTokenizer"}))
    return src


@pytest.mark.parametrize("kind", ["wordpiece", "sentencepiece"])
def test_tokenizer_converted(tmp_path, kind):
    src = _wordpiece_source(tmp_path) if kind == "wordpiece" else _sentencepiece_source(tmp_path)
    result = export(src, tmp_path / "out")
    expected = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    if kind == "sentencepiece":
        expected.add("spiece.model")
        assert (result.out / "spiece.model").read_bytes() == (src / "spiece.model").read_bytes()
    assert set(result.tokenizer_files) == expected
    assert json.loads((result.out / "special_tokens_map.json").read_text())["mask_token"] == "[MASK]"
    transformers = quiet_transformers()
    texts = ["the quick brown fox", "hello river world near the bank"]
    ours = transformers.AutoTokenizer.from_pretrained(str(result.out))(texts)
    theirs = transformers.AutoTokenizer.from_pretrained(str(src))(texts)
    assert dict(ours) == dict(theirs)
    report = verify_export(result.out, prompts=texts)
    assert report.ok, report.format_table()
    assert report.check(5).status == PASS and "prompt" in report.inputs


def test_no_tokenizer_is_said(tmp_path, capsys):
    assert main(["export", "--hub", str(_tiny("tokcls")), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "has no tokenizer files: exported without them" in printed
    assert "verify-export" in printed


def test_alias_family_keeps_its_name(tmp_path):
    if "camembert" not in supported_model_types():
        pytest.skip("camembert is not registered")
    result = export(_tiny("mlm", "camembert"), tmp_path / "out")
    config = _config(result.out)
    assert config["model_type"] == "camembert" and config["architectures"] == ["CamembertForMaskedLM"]


# ---- trainer checkpoints ---------------------------------------------------------------------------------

def _trainer_checkpoint(tmp_path: Path, task: str = "seqcls", architectures: list[str] | None = None) -> Path:
    model = load_model(_tiny(task))
    config = model.config.to_dict()
    if architectures is not None:
        config["architectures"] = architectures
    path = tmp_path / "step-00000010.pt"
    torch.save({"format": "flodl-hf/trainer-checkpoint", "version": 1, "model": model.state_dict(),
                "config": config, "step": 10, "worker": {"rng": {"torch": torch.get_rng_state()}}}, path)
    return path


def test_export_trainer_checkpoint(tmp_path):
    ckpt = _trainer_checkpoint(tmp_path)
    result = export_checkpoint(ckpt, tmp_path / "out")
    assert result.architecture == "BertForSequenceClassification"
    assert _config(result.out)["flodl_hf"]["format"] == "flodl-checkpoint"
    report = verify_export(result.out)
    assert report.ok, report.format_table()
    assert _statuses(report) == {1: PASS, 2: PASS, 3: SKIP, 4: PASS, 5: SKIP, 7: PASS}
    report = verify_export(result.out, no_source=True)
    assert report.ok and _statuses(report) == {1: PASS, 2: SKIP, 3: SKIP, 4: PASS, 5: SKIP, 7: PASS}


def test_trainer_checkpoint_head_from_its_weights(tmp_path, capsys):
    # A classifier trained on a base checkpoint: its config still says BertModel.
    ckpt = _trainer_checkpoint(tmp_path, "tokcls", architectures=["BertModel"])
    tok = _wordpiece_source(tmp_path)
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out"), "--tokenizer", str(tok)]) == 0
    assert "BertForTokenClassification" in capsys.readouterr().out
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert main(["verify-export", str(tmp_path / "out"), "--no-source", "--prompt", "the lazy dog"]) == 0


# ---- atomic writes ---------------------------------------------------------------------------------------

def test_failure_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("injected failure after the weights were written")

    monkeypatch.setattr(_module("flodl_hf.roundtrip.export"), "write_tokenizer", boom)
    with pytest.raises(RuntimeError, match="injected"):
        export(_tiny("qa"), tmp_path / "out")
    assert not (tmp_path / "out").exists() and _no_scratch(tmp_path)
    # with --force over an earlier export, the old DIR survives a failed export untouched
    monkeypatch.undo()
    export(_tiny("seqcls"), tmp_path / "out")
    before = tree_hash(tmp_path / "out")
    monkeypatch.setattr(_module("flodl_hf.roundtrip.export"), "write_tokenizer", boom)
    with pytest.raises(RuntimeError, match="injected"):
        export(_tiny("qa"), tmp_path / "out", force=True)
    assert tree_hash(tmp_path / "out") == before and _no_scratch(tmp_path)


def test_kill_leaves_no_dir(tmp_path):
    out, src = tmp_path / "out", _tiny("qa")
    script = f"""
import importlib, os, signal
e = importlib.import_module("flodl_hf.roundtrip.export")  # the module, even if flodl_hf re-exports a function named export
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
e.write_tokenizer = die
e.export({str(src)!r}, {str(out)!r})
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists() and not _no_scratch(tmp_path)  # only a hidden partial sibling is left
    export(src, out)  # the next export to the same DIR succeeds and removes it
    assert _no_scratch(tmp_path) and verify_export(out).ok


def test_force_replaces(tmp_path):
    """--force replaces an empty directory or an earlier export, edits to its files included; a file added
    to it, or a directory of the user's, is refused and left as it was."""
    (tmp_path / "out").mkdir()
    result = export(_tiny("seqcls"), tmp_path / "out", force=True)
    (result.out / "model.safetensors").write_text("edited")  # a file the export wrote: --force may replace it
    (result.out / "notes").mkdir()
    (result.out / "notes" / "mine.txt").write_text("x")  # a file the export did not write
    before = sorted(p.relative_to(result.out).as_posix() for p in result.out.rglob("*"))
    with pytest.raises(OutputExistsError, match=r"did not write: notes/mine\.txt"):
        export(_tiny("qa"), tmp_path / "out", force=True)
    assert sorted(p.relative_to(result.out).as_posix() for p in result.out.rglob("*")) == before
    shutil.rmtree(result.out / "notes")
    result = export(_tiny("qa"), tmp_path / "out", force=True)
    assert (result.out / "model.safetensors").read_bytes() != b"edited" and verify_export(result.out).ok
    assert _no_scratch(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(OutputExistsError, match="did not write"):
        export(_tiny("qa"), tmp_path / "mine", force=True)
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


# ---- verify-export notices what changed --------------------------------------------------------------------

def test_verify_catches_a_changed_weight(tmp_path, capsys):
    result = export(_tiny("mlm"), tmp_path / "out")
    path = result.out / "model.safetensors"
    tensors = load_file(str(path))
    tensors["bert.encoder.layer.0.output.dense.bias"][0] += 1e-3
    save_file(tensors, str(path), metadata={"format": "pt"})
    report = verify_export(result.out)
    assert not report.ok
    assert _statuses(report)[2] == FAIL and "output.dense.bias" in report.check(2).detail
    assert _statuses(report)[3] == FAIL and _statuses(report)[4] == PASS
    assert main(["verify-export", str(result.out)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_catches_a_changed_source(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(_tiny("tokcls"), src)
    result = export(src, tmp_path / "out")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["classifier.bias"] += 1.0
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    report = verify_export(result.out)
    assert report.check(2).status == FAIL and "changed since the export" in report.check(2).detail
    assert report.check(3).status == FAIL


def test_verify_json_and_explicit_source(tmp_path, capsys):
    src = _tiny("qa")
    result = export(src, tmp_path / "out")
    assert main(["verify-export", str(result.out), "--source", str(src), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and [c["status"] for c in data["checks"]] == [PASS, PASS, PASS, PASS, SKIP, PASS]


# ---- bad input ---------------------------------------------------------------------------------------------

def test_out_is_an_existing_file(tmp_path):
    target = tmp_path / "file"
    target.write_text("mine")
    for force in (False, True):
        with pytest.raises(OutputExistsError, match="existing file"):
            export(_tiny("qa"), target, force=force)
    assert target.read_text() == "mine"
    assert main(["export", "--hub", str(_tiny("qa")), "--out", str(target)]) == 2


def test_existing_dir_without_force(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("x")
    with pytest.raises(OutputExistsError, match="--force"):
        export(_tiny("qa"), tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]
    assert main(["export", "--hub", str(_tiny("qa")), "--out", str(tmp_path / "out")]) == 2
    assert "already exists" in capsys.readouterr().err


def _sharded_source(tmp_path: Path) -> Path:
    result = export(_tiny("mlm"), tmp_path / "sharded", max_shard_size="40KB")
    return result.out


def test_corrupt_shard(tmp_path):
    src = _sharded_source(tmp_path)
    shard = src / "model-00002-of-0000{}.safetensors".format(len(list(src.glob("model-*.safetensors"))))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointFormatError, match="model-00002"):
        export(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _no_scratch(tmp_path)


def test_index_names_a_missing_shard(tmp_path):
    src = _sharded_source(tmp_path)
    next(src.glob("model-00001-*.safetensors")).unlink()
    with pytest.raises(CheckpointFormatError, match="names shard"):
        export(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_verify_without_config_or_weights(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        verify_export(tmp_path / "empty")
    (tmp_path / "noweights").mkdir()
    shutil.copy(_tiny("qa") / "config.json", tmp_path / "noweights")
    with pytest.raises(SourceNotFoundError, match="no weights"):
        verify_export(tmp_path / "noweights")
    assert main(["verify-export", str(tmp_path / "empty")]) == 2


def test_unsupported_head(tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(_tiny("mlm"), src)
    config = _config(src)
    config["architectures"] = ["BertForPreTraining"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="BertForPreTraining"):
        export(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # an explicit head works: the MLM part of a pre-training checkpoint
    assert export(src, tmp_path / "out", head="mlm").architecture == "BertForMaskedLM"
    config = _config(tmp_path / "out")
    config["architectures"] = ["BertForNextSentencePrediction"]
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="BertForNextSentencePrediction"):
        verify_export(tmp_path / "out")
    assert main(["verify-export", str(tmp_path / "out")]) == 2
    assert "not supported" in capsys.readouterr().err


class NotATensor:
    pass


@pytest.mark.parametrize("kind", ["state_dict", "pickle", "text", "no_config"])
def test_checkpoint_not_ours(tmp_path, kind):
    path = tmp_path / "ckpt.pt"
    if kind == "state_dict":
        torch.save(load_model(_tiny("qa")).state_dict(), path)
    elif kind == "pickle":
        torch.save({"model": NotATensor(), "config": {}}, path)
    elif kind == "text":
        path.write_text("not a checkpoint")
    else:
        torch.save({"model": {"w": torch.zeros(1)}, "config": None}, path)
    why = {"state_dict": "no format=", "pickle": "objects other than tensors", "text": "truncated, or other bytes",
           "no_config": "no format="}[kind]
    with pytest.raises(CheckpointFormatError, match=f"{path.name}: .*{why}"):
        export_checkpoint(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["export", "--checkpoint", str(path), "--out", str(tmp_path / "out")]) == 2


def test_out_is_the_source(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(_tiny("qa"), src)
    with pytest.raises(OutputExistsError, match="source"):
        export(src, src, force=True)
    assert (src / "model.safetensors").is_file()


# ---- the matrix --------------------------------------------------------------------------------------------

def test_verify_matrix_reduced(tmp_path, capsys):
    """The suite's gate: every registered family with the masked-LM head (tied weights, family LM heads)."""
    result = verify_matrix(heads=["mlm"], out_dir=tmp_path / "m", progress=False)
    assert result.ok, result.format_table()
    assert [c.model_type for c in result.cells] == supported_model_types()
    data = json.loads(result.json_path.read_text())
    assert data["ok"] and len(data["cells"]) == len(supported_model_types())
    page = result.html_path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "PASS" in page
    assert main(["verify-matrix", "--families", "bert", "--heads", "qa", "--out", str(tmp_path / "cli")]) == 0
    printed = capsys.readouterr().out
    assert "bert" in printed and "PASS" in printed and "1 cells: 1 PASS" in printed


def test_verify_matrix_reports_a_broken_cell(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(_module("flodl_hf.roundtrip.matrix"), "export", broken)
    result = verify_matrix(families=["bert"], heads=["base"], out_dir=tmp_path / "m", progress=False)
    assert not result.ok and result.cells[0].status == "ERROR" and "injected" in result.cells[0].detail
    assert "ERROR" in result.html_path.read_text()
    with pytest.raises(UnsupportedModelError, match="funnel"):
        verify_matrix(families=["funnel"], out_dir=None)


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(flodl_hf="x"), "'flodl_hf' is a str"),
    (lambda c: c["flodl_hf"].update(source=5), "flodl_hf.source is 5"),
    (lambda c: c["flodl_hf"].update(dtype="float99"), "flodl_hf.dtype is 'float99'"),
    (lambda c: c["flodl_hf"].update(weights_sha256=["a"]), "flodl_hf.weights_sha256"),
])
def test_verify_refuses_an_edited_stamp_naming_the_field(tmp_path, edit, field):
    out = export(_tiny("seqcls"), tmp_path / "out").out
    config = _config(out)
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"config.json: field {field}"):
        verify_export(out)
    assert main(["verify-export", str(out)]) == 2


def test_verify_finds_any_edit_made_after_the_export(tmp_path):
    """Check 7: labels, a special token, a vocabulary file, an added file: none changes the logits on the
    prompts, so checks 1 to 5 pass; each is found by the sha256s the export recorded."""
    src = tmp_path / "src"
    shutil.copytree(_tiny("seqcls"), src)
    out = export(src, tmp_path / "out").out
    assert verify_export(out).check(7).status == PASS
    config = _config(out)
    labels = config["id2label"]
    config["id2label"] = {**labels, "0": labels["1"], "1": labels["0"]}  # two labels swapped
    (out / "config.json").write_text(json.dumps(config))
    report = verify_export(out)
    assert report.check(7).status == FAIL and "changed: config.json" in report.check(7).detail
    assert not report.ok and _statuses(report)[4] == PASS  # the logits alone would not have shown it
    out2 = export(src, tmp_path / "out2").out
    (out2 / "extra.bin").write_bytes(b"x")
    weights = load_file(str(out2 / "model.safetensors"))
    first = sorted(weights)[0]
    weights[first] = weights[first] + 1
    save_file(weights, str(out2 / "model.safetensors"), metadata={"format": "pt"})
    detail = verify_export(out2).check(7).detail
    assert detail == "changed: model.safetensors; added: extra.bin (since the export)"
    assert main(["verify-export", str(out2)]) == 1

