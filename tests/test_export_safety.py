"""Export safety: what an export, an adapter export, convert and verify-export must never do (replace
the model an adapter depends on, replace a directory that appeared meanwhile, leave directories behind,
crash on a long name or a broken tokenizer) and false FAILs verify-export must not report."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from flodl_hf.core import checkpoint_schema
from flodl_hf import lora
from flodl_hf.auto import load_model
from flodl_hf.cli import main
from flodl_hf.roundtrip.adapters import export_adapter
from flodl_hf.roundtrip.convert import convert
from flodl_hf.core.errors import CheckpointFormatError, InputError, OutputExistsError
from flodl_hf.roundtrip.export import export, export_checkpoint
from flodl_hf.roundtrip.matrix import tiny_config
from flodl_hf.core.validate import tree_hash
from flodl_hf.roundtrip.verify import FAIL, PASS, verify_export
from helpers import make_checkpoint, one_thread, quiet_transformers  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]

WORDS = "the quick brown fox jumps over lazy dog near river bank hello world".split()


def _tiny(task: str, model_type: str = "bert") -> Path:
    return make_checkpoint(tiny_config(model_type, None, task), task)


def _module(name: str):
    return importlib.import_module(name)


def _vocab(words) -> str:
    return "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, "##s"]) + "\n"


def _wordpiece_source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(_tiny("mlm"), src)
    (src / "vocab.txt").write_text(_vocab(WORDS))
    return src


def _no_scratch(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if p.name.startswith(".") and (".partial-" in p.name or ".old-" in p.name)]


def _lora_checkpoint(tmp_path: Path, source_entry) -> tuple[Path, Path]:
    """(an earlier export used as a LoRA base, a trainer checkpoint of an adapter on it)."""
    base = tmp_path / "basemodel"
    export(_tiny("seqcls"), base)
    model = lora.add_lora(load_model(base, "seqcls"), r=4, alpha=8, target_modules=["query", "value"])
    data = {**checkpoint_schema.header(), "model": lora.trainer_model_state(model), "config": model.config.to_dict(),
            "lora": lora.trainer_entry(model), "source": source_entry(base)}
    ckpt = tmp_path / "run" / "step-1.pt"
    ckpt.parent.mkdir()
    torch.save(data, str(ckpt))
    return base, ckpt


# ---- 1, 2: an export never replaces the base model a LoRA checkpoint depends on ---------------------------

def test_adapter_export_refuses_to_replace_its_base(tmp_path):
    base, ckpt = _lora_checkpoint(tmp_path, str)
    before = tree_hash(base)
    with pytest.raises(OutputExistsError, match="basemodel"):
        export_adapter(ckpt, base, force=True)
    with pytest.raises(OutputExistsError):
        export_adapter(ckpt, base / "adapter", force=True)  # nor write inside it
    assert main(["export", "--checkpoint", str(ckpt), "--adapter", "--out", str(base), "--force"]) == 2
    assert tree_hash(base) == before and _no_scratch(tmp_path)
    assert export_adapter(ckpt, tmp_path / "adapter").is_dir()  # elsewhere it works


def test_merge_refuses_to_replace_its_base_when_the_checkpoint_names_no_source(tmp_path):
    base, ckpt = _lora_checkpoint(tmp_path, lambda base: None)
    before = tree_hash(base)
    with pytest.raises(OutputExistsError, match="basemodel"):
        export_checkpoint(ckpt, base, force=True)
    assert tree_hash(base) == before and _no_scratch(tmp_path)


# ---- 3: without force, what appears at --out during the write is never replaced --------------------------

def test_a_directory_appearing_at_out_during_the_write_is_left_alone(tmp_path, monkeypatch):
    m = _module("flodl_hf.core.fs")
    out = tmp_path / "out"
    written, real_check, real_stage = [], m.check_out, m.stage

    def stage(name):
        written.append(name == "written")
        real_stage(name)

    def check_out(path, force, protect=None):  # another writer lands just after the last check
        result = real_check(path, force, protect)
        if written and written[-1] and not out.exists():
            out.mkdir()
            (out / "someone_elses.txt").write_text("precious")
        return result

    monkeypatch.setattr(m, "stage", stage)
    monkeypatch.setattr(m, "check_out", check_out)
    with pytest.raises(OutputExistsError, match="appeared"):
        export(_tiny("seqcls"), out)
    assert sorted(p.name for p in out.iterdir()) == ["someone_elses.txt"] and _no_scratch(tmp_path)


def test_no_replace_rename_refuses_even_an_empty_directory(tmp_path):
    m = _module("flodl_hf.core.fs")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("x")
    (tmp_path / "b").mkdir()
    with pytest.raises(OutputExistsError):
        m._rename_no_replace(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a" / "f").is_file() and not any((tmp_path / "b").iterdir())


# ---- 4: verify-export check 3 compares weights, not where mmap placed them ---------------------------------

def test_check3_passes_on_a_resharded_source(tmp_path):
    """The same weights memory-mapped from two differently laid out files gave a 4e-9 logits diff."""
    transformers = quiet_transformers()
    model = transformers.ElectraForPreTraining.from_pretrained(str(_tiny("pretraining", "electra")))
    model.save_pretrained(str(tmp_path / "src"), max_shard_size="20KB")
    export(tmp_path / "src", tmp_path / "out")
    report = verify_export(tmp_path / "out")
    assert report.check(3).status == PASS, report.format_table()
    assert report.ok, report.format_table()


# ---- 5: a damaged tokenizer in DIR is check 5's FAIL row, not a traceback ---------------------------------

def test_verify_with_a_broken_tokenizer_fails_check5_and_prints_the_table(tmp_path, capsys):
    export(_wordpiece_source(tmp_path), tmp_path / "out")
    (tmp_path / "out" / "tokenizer.json").write_text("{broken")
    report = verify_export(tmp_path / "out")
    assert report.check(5).status == FAIL and "tokenizer.json" in report.check(5).detail
    assert report.check(1).status == PASS and not report.ok
    assert main(["verify-export", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert "tokenizer ids equal" in captured.out and "Traceback" not in captured.err


# ---- 6: a long --out name -----------------------------------------------------------------------------------

def test_long_out_names(tmp_path):
    src = _tiny("seqcls")
    out = tmp_path / ("x" * 240)  # a valid name: the scratch sibling's must fit NAME_MAX too
    export(src, out)
    assert (out / "config.json").is_file() and _no_scratch(tmp_path)
    export(src, out, force=True)
    assert _no_scratch(tmp_path)
    with pytest.raises(InputError, match="--out"):
        export(src, tmp_path / ("y" * 256))
    m = _module("flodl_hf.core.fs")
    stem = m._scratch_stem(out.name)
    dead = tmp_path / f".{stem}.partial-{2**22 + 1}-0badc0de"  # beyond pid_max: a dead writer's
    dead.mkdir()
    assert m.recover_scratch(out) and not dead.exists()


# ---- 7: a failed export removes the parents it created --------------------------------------------------------

def test_failed_export_leaves_no_parent_directories(tmp_path):
    src = _wordpiece_source(tmp_path)
    (src / "tokenizer.json").write_text("{not json")
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "keep").mkdir()  # existed before: stays
    with pytest.raises(CheckpointFormatError):
        export(src, tmp_path / "deep" / "keep" / "a" / "b" / "out")
    assert sorted(p.name for p in (tmp_path / "deep").rglob("*")) == ["keep"]


# ---- 8: check 5 compares with the tokenizer the export used -----------------------------------------------------

def test_check5_compares_with_the_tokenizer_export_was_given(tmp_path):
    src = _wordpiece_source(tmp_path)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    (tok / "vocab.txt").write_text(_vocab(list(reversed(WORDS))))
    export(src, tmp_path / "out", tokenizer=tok)
    stamp = json.loads((tmp_path / "out" / "config.json").read_text())["flodl_hf"]
    assert stamp["tokenizer_from"] == str(tok)
    report = verify_export(tmp_path / "out")
    assert report.check(5).status == PASS and str(tok) in report.check(5).detail, report.format_table()
    assert report.ok


# ---- convert of a weights file copies only HF's own files from its folder ----------------------------------------

def test_convert_of_a_file_copies_only_hf_files(tmp_path):
    folder = tmp_path / "Downloads"
    folder.mkdir()
    shutil.copy(_tiny("seqcls") / "config.json", folder)
    state = quiet_transformers().BertForSequenceClassification.from_pretrained(str(_tiny("seqcls"))).state_dict()
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "vocab.txt").write_text(_vocab(WORDS))
    (folder / "my_passwords.txt").write_text("hunter2")
    (folder / "bank_statement.json").write_text("{}")
    result = convert(folder / "pytorch_model.bin", tmp_path / "out")
    assert sorted(result.copied) == ["config.json", "vocab.txt"]
    assert not (tmp_path / "out" / "my_passwords.txt").exists()


# ---- 9: --force replaces only the files an earlier write recorded ---------------------------------------------------

def _tree(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))


@pytest.mark.parametrize("writer", ["convert", "adapter"])
def test_force_rewrites_its_own_directory_but_never_a_file_added_to_it(tmp_path, writer):
    """convert and an adapter export record the files they wrote: --force writes the directory again,
    and refuses (naming the file, leaving everything as it was) once a file of the user's is added."""
    if writer == "convert":
        folder = tmp_path / "bin"
        folder.mkdir()
        shutil.copy(_tiny("seqcls") / "config.json", folder)
        state = quiet_transformers().BertForSequenceClassification.from_pretrained(str(_tiny("seqcls"))).state_dict()
        torch.save(state, folder / "pytorch_model.bin")
        write = lambda: convert(folder, tmp_path / "out", force=True)  # noqa: E731
    else:
        _, ckpt = _lora_checkpoint(tmp_path, str)
        write = lambda: export_adapter(ckpt, tmp_path / "out", force=True)  # noqa: E731
    write()
    first = _tree(tmp_path / "out")
    write()  # an earlier write of its own is replaced
    assert _tree(tmp_path / "out") == first and _no_scratch(tmp_path)
    (tmp_path / "out" / "sub").mkdir()
    (tmp_path / "out" / "sub" / "mine.txt").write_text("x")
    before = tree_hash(tmp_path / "out")
    with pytest.raises(OutputExistsError, match=r"did not write: sub/mine\.txt"):
        write()
    assert tree_hash(tmp_path / "out") == before and _no_scratch(tmp_path)
