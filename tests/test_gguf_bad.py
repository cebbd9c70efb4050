"""Bad GGUF files: each gets a typed error (flodl_hf.core.errors) naming the file and the field or tensor at fault,
promptly and without a large allocation: a truncated file, a bad magic or version, a tensor running past the end,
an unknown quantisation type, a metadata array of absurd length, a tokenizer without tokens. And the GGUF reader
fuzzed beside the safetensors header reader (tests/test_fuzz.py's settings): whatever the bytes, a FlodlHFError or a
file read, never another exception and never a hang."""

from __future__ import annotations

import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flodl_hf import AutoModelForCausalLM, AutoTokenizer
from flodl_hf.core.errors import CheckpointFormatError, ConfigError, FlodlHFError
from flodl_hf.gguf.reader import open_gguf

from test_fuzz import FUZZ


def small_gguf(path: Path, tokens: list[str] | None = None) -> Path:
    """A small llama GGUF with gguf's writer: metadata, an F32 and a Q8_0 tensor, a tokenizer of ``tokens``."""
    import gguf
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c", "d"] if tokens is None else tokens)
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    weights = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return path


def _patched(tmp_path: Path, at: int, fmt: str, value: int, name: str = "bad.gguf") -> Path:
    blob = bytearray(small_gguf(tmp_path / "good.gguf").read_bytes())
    struct.pack_into(fmt, blob, at, value)
    (tmp_path / name).write_bytes(bytes(blob))
    return tmp_path / name


def _tensor_entry(blob: bytes, name: str) -> int:
    """The offset just past a tensor's name in the tensor table (its n_dims follows)."""
    return blob.index(name.encode()) + len(name)


def test_a_good_file_reads(tmp_path):
    file = open_gguf(small_gguf(tmp_path / "good.gguf"))
    assert set(file.tensors) == {"output_norm.weight", "token_embd.weight"}
    assert file.metadata.count("tokenizer.ggml.tokens") == 4


@pytest.mark.parametrize("keep", [0, 3, 20, 100, -40, -1])
def test_a_truncated_file(tmp_path, keep):
    """Cut inside the header, the metadata, the tensor table and the data: each a CheckpointFormatError naming the
    file (the data cut: the tensor that runs past the end)."""
    blob = small_gguf(tmp_path / "good.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(blob[:keep] if keep >= 0 else blob[:len(blob) + keep])
    with pytest.raises(CheckpointFormatError, match="cut.gguf") as info:
        open_gguf(path)
    if keep < 0:
        assert "token_embd.weight" in str(info.value) and "past the end" in str(info.value)


def test_a_bad_magic_and_version(tmp_path):
    with pytest.raises(CheckpointFormatError, match=r"bad.gguf: not a GGUF file: the magic is b'GGUX'"):
        open_gguf(_magic(tmp_path))
    with pytest.raises(CheckpointFormatError, match=r"v9.gguf: GGUF version 9"):
        open_gguf(_patched(tmp_path, 4, "<I", 9, "v9.gguf"))


def _magic(tmp_path: Path) -> Path:
    blob = bytearray(small_gguf(tmp_path / "good.gguf").read_bytes())
    blob[:4] = b"GGUX"
    (tmp_path / "bad.gguf").write_bytes(bytes(blob))
    return tmp_path / "bad.gguf"


def test_a_tensor_past_the_end(tmp_path):
    """A tensor's data offset moved past the end of the file: the error names the tensor."""
    blob = small_gguf(tmp_path / "good.gguf").read_bytes()
    at = _tensor_entry(blob, "token_embd.weight") + 4 + 2 * 8 + 4  # n_dims, two dims, type: then the offset
    path = _patched(tmp_path, at, "<Q", 1 << 40, "far.gguf")
    with pytest.raises(CheckpointFormatError, match="far.gguf.*token_embd.weight"):
        open_gguf(path)


def test_an_unknown_quantisation_type(tmp_path):
    blob = small_gguf(tmp_path / "good.gguf").read_bytes()
    at = _tensor_entry(blob, "token_embd.weight") + 4 + 2 * 8
    with pytest.raises(CheckpointFormatError, match=r"type.gguf: tensor token_embd.weight has ggml type 99"):
        open_gguf(_patched(tmp_path, at, "<I", 99, "type.gguf"))


def test_a_metadata_array_of_absurd_length(tmp_path):
    """tokenizer.ggml.tokens claims 2**60 entries: refused at once (no list of that length is made)."""
    blob = small_gguf(tmp_path / "good.gguf").read_bytes()
    at = blob.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4  # value type, element type
    path = _patched(tmp_path, at, "<Q", 1 << 60, "long.gguf")
    start = time.monotonic()
    with pytest.raises(CheckpointFormatError, match=r"long.gguf: metadata field tokenizer.ggml.tokens declares 1152"):
        open_gguf(path)
    assert time.monotonic() - start < 5


def test_a_tokenizer_without_tokens(tmp_path):
    path = small_gguf(tmp_path / "empty.gguf", tokens=[])
    with pytest.raises(ConfigError, match=r"empty.gguf: metadata field tokenizer.ggml.tokens is (empty|missing)"):
        AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)


def test_a_missing_file_and_a_model_without_its_fields(tmp_path):
    with pytest.raises(FlodlHFError, match="nowhere.gguf"):
        AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="nowhere.gguf")
    small_gguf(tmp_path / "good.gguf")
    with pytest.raises(FlodlHFError, match="good.gguf"):  # no hidden size, heads...: the config names the file
        AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="good.gguf")


# ---- fuzzing, beside the safetensors header reader ------------------------------------------------------------------

_GOOD = small_gguf(Path(tempfile.mkdtemp()) / "seed.gguf").read_bytes()


@st.composite
def gguf_files(draw) -> bytes:
    """A valid small GGUF with bytes overwritten, cut or inserted; or raw bytes after the magic."""
    kind = draw(st.sampled_from(["mutated", "cut", "raw"]))
    if kind == "raw":
        return b"GGUF" + draw(st.binary(max_size=200))
    blob = bytearray(_GOOD)
    if kind == "cut":
        return bytes(blob[:draw(st.integers(0, len(blob)))])
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(blob) - 8))
        blob[at:at + 8] = draw(st.binary(min_size=8, max_size=8))
    return bytes(blob)


@FUZZ
@given(gguf_files())
def test_gguf_reader(blob: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.gguf"
        path.write_bytes(blob)
        start = time.monotonic()
        try:
            file = open_gguf(path)
            for key in file.metadata:
                file.metadata[key]
        except FlodlHFError:
            pass
        assert time.monotonic() - start < 10
