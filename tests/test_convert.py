"""convert: pytorch_model.bin (single or sharded, tied tensors sharing storage) to safetensors."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flodl_hf.core import io
from flodl_hf.cli import main
from flodl_hf.roundtrip.convert import convert
from flodl_hf.core.errors import CheckpointFormatError, OutputExistsError
from flodl_hf.roundtrip.parity import make_batch
from flodl_hf.auto import AutoConfig
from flodl_hf.roundtrip.matrix import tiny_config
from helpers import make_checkpoint, quiet_transformers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(task: str = "mlm") -> tuple[Path, dict[str, torch.Tensor]]:
    """A transformers checkpoint and its full state_dict (tied decoder included, sharing storage)."""
    src = make_checkpoint(tiny_config("bert", None, task), task)
    transformers = quiet_transformers()
    model = transformers.AutoModelForMaskedLM.from_pretrained(str(src))
    return src, model.state_dict()


def _bin_dir(tmp_path: Path, shards: int = 1) -> Path:
    """What older transformers wrote: torch.save(state_dict), tied tensors sharing storage."""
    src, state = _state()
    out = tmp_path / "bin"
    out.mkdir(parents=True)
    shutil.copy(src / "config.json", out)
    (out / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\n")
    (out / "README.md").write_text("a model card\n")
    (out / "extra").mkdir()
    (out / "extra" / "notes.txt").write_text("kept\n")
    if shards == 1:
        torch.save(state, out / io.BIN_SINGLE)
        return out
    keys = list(state)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in keys[i::shards]}
        torch.save(part, out / name)
        weight_map.update({k: name for k in part})
    (out / io.BIN_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def _outputs_equal(a: Path, b: Path) -> None:
    transformers = quiet_transformers()
    batch = make_batch(AutoConfig.from_pretrained(str(a)), "mlm")
    with torch.inference_mode():
        out_a = transformers.AutoModelForMaskedLM.from_pretrained(str(a), dtype=torch.float32).eval()(**batch)
        out_b = transformers.AutoModelForMaskedLM.from_pretrained(str(b), dtype=torch.float32).eval()(**batch)
    assert torch.equal(out_a.logits, out_b.logits)


def test_shared_storage_fixture_really_shares(tmp_path):
    _, state = _state()
    with pytest.raises(RuntimeError, match="share memory"):
        save_file(state, str(tmp_path / "x.safetensors"))


def test_convert_single_bin(tmp_path):
    src = _bin_dir(tmp_path)
    result = convert(src, tmp_path / "out")
    out = result.out
    assert result.weight_files == [io.SAFE_SINGLE]
    assert sorted(result.copied) == ["README.md", "config.json", "extra/notes.txt", "vocab.txt"]
    assert (out / "extra" / "notes.txt").read_text() == "kept\n" and not (out / io.BIN_SINGLE).exists()
    assert any("cls.predictions.decoder.weight" in g for g in result.shared)
    original = torch.load(src / io.BIN_SINGLE, weights_only=True)
    written = load_file(str(out / io.SAFE_SINGLE))
    assert set(written) == set(original)
    assert all(torch.equal(written[k], original[k]) and written[k].dtype == original[k].dtype for k in original)
    _, info = quiet_transformers().AutoModelForMaskedLM.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.values())
    _outputs_equal(src, out)


def test_convert_sharded_bin(tmp_path, capsys):
    src = _bin_dir(tmp_path, shards=3)
    assert main(["convert", str(src), "--out", str(tmp_path / "out"), "--max-shard-size", "40KB"]) == 0
    printed = capsys.readouterr().out
    assert "byte-identical" in printed and "shared storage" in printed
    out = tmp_path / "out"
    index = json.loads((out / io.SAFE_INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not list(out.glob("*.bin")) and not (out / io.BIN_INDEX).exists()
    _outputs_equal(src, out)


def test_bitwise_check_catches_a_bad_write(tmp_path, monkeypatch):
    convert_module = importlib.import_module("flodl_hf.roundtrip.convert")  # not a re-exported function
    real = convert_module.io.save_safetensors

    def corrupting(tensors, directory, max_shard_size="5GB", metadata=None):
        paths = real(tensors, directory, max_shard_size, metadata)
        data = load_file(str(paths[0]))
        key = next(iter(data))
        data[key].view(-1)[0] += 1
        save_file(data, str(paths[0]), metadata={"format": "pt"})
        return paths

    monkeypatch.setattr(convert_module.io, "save_safetensors", corrupting)
    with pytest.raises(CheckpointFormatError, match="not byte-identical"):
        convert(_bin_dir(tmp_path), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_convert_bad_inputs(tmp_path):
    src = _bin_dir(tmp_path)
    with pytest.raises(CheckpointFormatError, match="already safetensors"):
        convert(make_checkpoint(tiny_config("bert", None, "mlm"), "mlm"), tmp_path / "o1")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputExistsError, match="existing file"):
        convert(src, tmp_path / "file")
    (tmp_path / "o2").mkdir()
    with pytest.raises(OutputExistsError, match="already exists"):
        convert(src, tmp_path / "o2")
    assert convert(src, tmp_path / "o2", force=True).tensors > 0
    corrupt = tmp_path / "corrupt"
    shutil.copytree(src, corrupt)
    (corrupt / io.BIN_SINGLE).write_bytes((src / io.BIN_SINGLE).read_bytes()[:500])
    with pytest.raises(CheckpointFormatError, match="corrupt or truncated"):
        convert(corrupt, tmp_path / "o3")
    sharded = _bin_dir(tmp_path / "s", shards=2)
    next(sharded.glob("pytorch_model-00002-*.bin")).unlink()
    with pytest.raises(CheckpointFormatError, match="names shard"):
        convert(sharded, tmp_path / "o4")
    assert not (tmp_path / "o3").exists() and not (tmp_path / "o4").exists()
