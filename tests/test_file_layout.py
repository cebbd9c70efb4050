"""keys.FileLayout, the file layout a family declares by data (``Family.file_layout``), on its own: load puts a file in
the module layout (prefix dropped, renames, fused tensors split), export writes it back, and the KeyMap composes it
with its other declarations. Nomic BERT's and GTE's real layouts against transformers: tests/test_nomic_gte.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flodl_hf.core.errors import CheckpointFormatError
from flodl_hf.core.keys import FileLayout, KeyMap, normalise
from flodl_hf.core.registry import Family

LAYOUT = FileLayout(renames=(("encoder.layers", "layers"), ("emb_ln", "embeddings.LayerNorm")),
                    fused=(("attn.Wqkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),),
                    strip_prefix="new")
FILE = {"emb_ln.weight": torch.ones(4), "encoder.layers.0.attn.Wqkv.weight": torch.arange(24.0).reshape(6, 4),
        "encoder.layers.0.attn.Wqkv.bias": torch.arange(6.0), "encoder.layers.0.mlp.fc.weight": torch.zeros(2, 4)}
MODULES = {"embeddings.LayerNorm.weight", "layers.0.mlp.fc.weight",
           *(f"layers.0.self_attn.{p}_proj.{leaf}" for p in "qkv" for leaf in ("weight", "bias"))}


def test_load_puts_the_file_in_the_module_layout_and_save_writes_it_back():
    loaded = LAYOUT.load(FILE)
    assert loaded.keys() == MODULES
    assert torch.equal(loaded["layers.0.self_attn.k_proj.weight"], FILE["encoder.layers.0.attn.Wqkv.weight"][2:4])
    assert torch.equal(loaded["layers.0.self_attn.v_proj.bias"], torch.tensor([4.0, 5.0]))
    saved = LAYOUT.save(loaded)
    assert saved.keys() == FILE.keys() and all(torch.equal(saved[k], FILE[k]) for k in FILE)
    # the remote-code prefix is dropped on load, not written back; the module layout loads as it is
    assert LAYOUT.load({"new." + k: v for k, v in FILE.items()}).keys() == MODULES
    assert LAYOUT.load(loaded).keys() == MODULES


def test_a_fused_tensor_that_does_not_split_is_a_typed_error_naming_its_file_key():
    with pytest.raises(CheckpointFormatError, match=r"encoder\.layers\.0\.attn\.Wqkv\.weight .* divide by 3"):
        LAYOUT.load({"encoder.layers.0.attn.Wqkv.weight": torch.zeros(5, 4)})


def test_key_map_applies_the_layout_to_whole_files_and_keeps_module_names_per_key():
    key_map = KeyMap("enc", renames=(("layers.{}.mlp.fc.weight", "layers.{}.mlp.dense.weight"),),
                     legacy=((".gamma", ".weight"),), layout=LAYOUT)
    old = {("emb_ln.gamma" if k == "emb_ln.weight" else k): v for k, v in FILE.items()}
    native = {key_map.to_native(k): v for k, v in key_map.merge(old).items()}  # legacy after the layout's renames
    assert native.keys() == MODULES - {"layers.0.mlp.fc.weight"} | {"layers.0.mlp.dense.weight"}
    assert key_map.to_hf_state(native).keys() == FILE.keys()  # per key to_hf, then the layout
    assert key_map.to_hf("layers.0.self_attn.q_proj.weight") == "layers.0.self_attn.q_proj.weight"  # PEFT's names


class _Tiny(Family):
    model_type = "tiny_layout"
    prefix = "tiny"
    file_layout = FileLayout(renames=(("emb_ln", "norm"),))


def test_a_task_model_mounted_under_another_prefix_keeps_the_family_layout():
    model = nn.Module()
    model.other = nn.Module()
    model.other.norm = nn.LayerNorm(4)
    model.family, model.base_model_prefix = _Tiny, "other"
    assert _Tiny.key_map().layout is _Tiny.file_layout
    state = normalise(model, {"emb_ln.weight": torch.ones(4), "emb_ln.bias": torch.zeros(4)})
    assert state.keys() == {"other.norm.weight", "other.norm.bias"}
