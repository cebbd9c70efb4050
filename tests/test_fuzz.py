"""Property-based fuzzing of the three readers that take bytes from a checkpoint directory first: the
safetensors header reader, the shard index reader and config.json parsing.

The property: whatever the bytes, the library either reads them or raises one of its own errors
(``FlodlHFError``), promptly; never another exception type, never a hang. Examples are bounded and
derandomized (a fixed sequence, the same in every run, no example database), so a CI run is
reproducible and takes seconds.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from flodl_hf.core import io
from flodl_hf.auto import AutoConfig, build_model
from flodl_hf.core.errors import FlodlHFError
from flodl_hf.core.modeling import meta_device
from flodl_hf.core.registry import get_family, supported_model_types

FUZZ = settings(max_examples=150, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "X9", ""]
json_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)


def _read_all(path: Path) -> None:
    try:
        io.load_tensors(io.resolve(path))
    except FlodlHFError:
        pass


# ---- safetensors header ------------------------------------------------------------------------------

tensor_entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(DTYPES) | json_scalars,
    "shape": st.lists(st.integers(-2, 2**40) | json_scalars, max_size=4) | json_scalars,
    "data_offsets": st.lists(st.integers(-5, 2**62) | json_scalars, max_size=3) | json_scalars,
})
headers = st.dictionaries(st.text(min_size=1, max_size=10), tensor_entries | json_values, max_size=4)


@st.composite
def safetensors_files(draw) -> bytes:
    kind = draw(st.sampled_from(["structured", "raw", "mutated"]))
    if kind == "raw":
        return draw(st.binary(max_size=200))
    if kind == "structured":
        header = json.dumps(draw(headers)).encode()
        declared = draw(st.sampled_from([len(header), len(header) + 1, 0, 2**63, len(header) - 1])) \
            if draw(st.booleans()) else len(header)
        return struct.pack("<Q", max(declared, 0) % 2**64) + header + draw(st.binary(max_size=64))
    # a valid file with a few bytes changed or cut off
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2, dtype=torch.int64)},
                  str(path))
        data = bytearray(path.read_bytes())
    for position, value in draw(st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)), max_size=4)):
        data[position] = value
    return bytes(data[:draw(st.integers(0, len(data)))])


@FUZZ
@given(safetensors_files())
def test_safetensors_header_reader(blob: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        path.write_bytes(blob)
        _read_all(path)


# ---- shard index ------------------------------------------------------------------------------------------

shard_names = st.sampled_from(["model-00001-of-00001.safetensors", "../x.safetensors", "/etc/passwd", "", ".",
                               "sub/../model-00001-of-00001.safetensors", "missing.safetensors", "a\x00b"]) \
    | st.text(max_size=12)
indexes = st.one_of(
    json_values,
    st.fixed_dictionaries({"weight_map": st.dictionaries(st.sampled_from(["a", "b", "c"]) | st.text(max_size=5),
                                                         shard_names | json_scalars, max_size=4) | json_values}),
    st.fixed_dictionaries({"metadata": json_values, "weight_map": st.just({"a": "model-00001-of-00001.safetensors",
                                                                         "b": "model-00001-of-00001.safetensors"})}),
)


@FUZZ
@given(indexes, st.booleans(), st.binary(max_size=8))
def test_index_reader(index: object, as_json: bool, noise: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        root.mkdir()
        save_file({"a": torch.zeros(2), "b": torch.ones(3)}, str(root / "model-00001-of-00001.safetensors"))
        text = json.dumps(index).encode() if as_json else json.dumps(index).encode()[:-1] + noise
        (root / io.SAFE_INDEX).write_bytes(text)
        _read_all(root)


# ---- config.json --------------------------------------------------------------------------------------------

FIELDS = ["model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
          "intermediate_size", "pad_token_id", "layer_norm_eps", "hidden_dropout_prob", "hidden_act", "id2label",
          "label2id", "problem_type", "tie_word_embeddings", "max_position_embeddings", "type_vocab_size",
          "classifier_dropout", "auto_map", "embedding_size", "num_hidden_groups", "pos_att_type", "relative_attention",
          "n_layers", "dim", "n_heads", "position_embedding_type", "initializer_range", "is_decoder", "dtype"]
configs = st.fixed_dictionaries(
    {"model_type": st.sampled_from(supported_model_types()) | json_values},
    optional={name: json_values | st.integers(-3, 64) for name in FIELDS if name != "model_type"},
)


@FUZZ
@given(configs, st.sampled_from(["json", "bytes"]), st.binary(max_size=16))
def test_config_parsing(config: dict, form: str, noise: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        data = json.dumps(config).encode()
        path.write_bytes(data if form == "json" else data[: len(data) // 2] + noise)
        try:
            config = AutoConfig.from_pretrained(path)
            with meta_device():  # a config that parses builds (on meta: no memory, no time) or says why not
                build_model(config, "base")
        except FlodlHFError:
            pass


@pytest.mark.parametrize("model_type", supported_model_types())
def test_config_fuzz_reaches_every_family(model_type: str) -> None:
    """The fuzzed configs are not all refused on the first field: each family's defaults parse and build."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps({"model_type": model_type}))
        with meta_device():
            task = get_family(model_type).tasks[0]  # "base", or a family's own (SigLIP's text tower)
            assert build_model(AutoConfig.from_pretrained(path), task).config.model_type
