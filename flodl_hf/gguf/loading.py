"""A GGUF file in: its config dict (as transformers' ``gguf_file=`` builds it) and its tensors, dequantised one at a
time from the memory map into float32 under transformers' key names, ready for the strict loader.

Tensor names are mapped with the ``gguf`` package's own table (``gguf.get_tensor_name_map``), asked for each key the
family's causal LM holds, as transformers asks it; the values llama.cpp's converter changed (LLaMA's q/k row order,
Gemma's ``w + 1`` norms, GPT-2's transposed Conv1D weights, stacked experts) are undone as transformers undoes them,
in float32 numpy, so the loaded tensors are transformers' bits.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from flodl_hf.core.errors import CheckpointFormatError, SourceNotFoundError, UnsupportedModelError
from flodl_hf.gguf.archs import ARCHS, TOKEN_IDS, Arch, arch_for, qk_heads, supported, unpermute
from flodl_hf.gguf.reader import GGUFFile, _gguf, open_gguf


def gguf_path(source: str | os.PathLike | None, gguf_file: str | os.PathLike) -> Path:
    """Where ``from_pretrained(source, gguf_file=...)`` reads: ``gguf_file`` inside the directory ``source``, or
    ``gguf_file`` itself when it is a path to a file (transformers' two forms). A hub id is not fetched here."""
    direct = Path(gguf_file).expanduser()
    if direct.is_file():
        return direct
    if source is not None:
        inside = Path(str(source)).expanduser() / str(gguf_file)
        if inside.is_file():
            return inside
        where = f"{inside}"
    else:
        where = f"{direct}"
    raise SourceNotFoundError(f"{where}: no such GGUF file (gguf_file= is a file inside the source directory or a "
                              "path to one; flodl-hf fetches no GGUF from the hub: download it first)")


def architecture(file: GGUFFile) -> Arch:
    """The table entry of the file's general.architecture; an UnsupportedModelError naming it otherwise."""
    arch = file.require("general.architecture")
    entry = arch_for(arch)
    if entry is None:
        raise UnsupportedModelError(f"{file.path}: GGUF architecture {arch!r} (general.architecture) is not "
                                    f"supported; supported: {supported()}")
    return entry


def config_dict(file: GGUFFile) -> dict[str, Any]:
    """The config dict transformers builds from the file's metadata (``load_gguf_checkpoint``'s "config")."""
    arch = architecture(file)
    prefix = f"{file.metadata['general.architecture']}."
    data: dict[str, Any] = {"model_type": arch.model_type,
                            "tie_word_embeddings": "output.weight" not in file.tensors, **arch.defaults}
    if arch.model_type == "stablelm":  # transformers reads these two from the tensors present
        data["use_qkv_bias"] = any(n.endswith(("attn_q.bias", "attn_k.bias", "attn_v.bias")) for n in file.tensors)
        data["use_parallel_residual"] = not any("ffn_norm" in n for n in file.tensors)
    name = file.get("general.name")
    if name is not None:
        data["_model_name_or_path"] = name
    for key, field in arch.keys.items():
        if prefix + key in file.metadata:
            data[field] = file.metadata[prefix + key]
    for key, field in TOKEN_IDS.items():
        if key in file.metadata:
            data[field] = file.metadata[key]
    if "vocab_size" not in data:
        tokens = file.metadata.count("tokenizer.ggml.tokens")
        if tokens:
            data["vocab_size"] = tokens
    for required in ("num_hidden_layers", "n_layer"):
        value = data.get(required)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointFormatError(f"{file.path}: metadata field {prefix}block_count is {value!r}, expected a "
                                        "positive layer count")
    return data


def layer_count(data: dict[str, Any]) -> int:
    return int(data.get("num_hidden_layers") or data.get("n_layer") or 0)


def name_map(arch: Arch, hf_keys: list[str], layers: int) -> dict[str, str]:
    """GGUF tensor name -> transformers key, from gguf's table asked for each key (stacked experts: their two or
    one GGUF tensors)."""
    gguf = _gguf()
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.gguf)
    table = gguf.get_tensor_name_map(arch_id, layers)
    out: dict[str, str] = {}
    for key in hf_keys:
        if arch.experts and key.endswith(".mlp.experts.gate_up_proj"):
            block = key.split(".")[2]
            out[f"blk.{block}.ffn_gate_exps.weight"] = out[f"blk.{block}.ffn_up_exps.weight"] = key
            continue
        stem, _, suffix = key.rpartition(".")
        if suffix not in ("weight", "bias"):
            stem, suffix = key, ""
        found = table.get_name(stem)
        if found is not None:
            out[found + ("." + suffix if suffix else "")] = key
    return out


# Rows dequantised at a time: gguf's dequantisers make temporaries several times their output, so a large tensor
# (a 49152 x 576 embedding) is done in slices into one float32 array, never whole.
_CHUNK_VALUES = 1 << 20


def dequantize(file: GGUFFile, name: str) -> np.ndarray:
    """One tensor as float32 numpy (its own array: never a view of the map), dequantised by gguf from the memory
    map a slice of rows at a time."""
    gguf = _gguf()
    tensor = file.tensors[name]
    data = tensor.data
    try:
        if data.ndim == 0 or data.size == 0:
            return np.array(gguf.quants.dequantize(data, tensor.tensor_type), dtype=np.float32)
        rows = data.reshape(-1, data.shape[-1])
        first = gguf.quants.dequantize(rows[:1], tensor.tensor_type)
        out = np.empty((rows.shape[0], first.shape[-1]), dtype=np.float32)
        step = max(1, _CHUNK_VALUES // max(1, first.shape[-1]))
        for start in range(0, rows.shape[0], step):
            out[start:start + step] = gguf.quants.dequantize(rows[start:start + step], tensor.tensor_type)
    except Exception as exc:  # noqa: BLE001 - gguf's quantisers raise many kinds on bad blocks
        raise CheckpointFormatError(f"{file.path}: tensor {name} cannot be dequantised ({type(exc).__name__}: "
                                    f"{exc})") from None
    return out.reshape(*data.shape[:-1], first.shape[-1])


def _undo(arch: Arch, name: str, values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """llama.cpp's value transforms undone, as transformers' tensor processors undo them."""
    if arch.permute_qk and (heads := qk_heads(name, config)) is not None:
        values = unpermute(values, heads)
    if arch.norm_offset and "norm.weight" in name:
        values = values - 1
    if name.endswith(arch.transposed):
        values = values.T
    if arch.experts and "ffn_gate_inp_shexp" in name:
        values = np.expand_dims(values, axis=0)
    return values


def hf_tensors(file: GGUFFile, arch: Arch, config: dict[str, Any], hf_keys: list[str]) -> Iterator[tuple[str, Any]]:
    """(transformers key, float32 tensor) for each tensor of the file, dequantised one at a time; a tensor the
    table does not map is skipped, as transformers skips it (the strict loader then names what is missing)."""
    names = name_map(arch, hf_keys, layer_count(config))
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name in file.tensors:
        key = names.get(name)
        if key is None:
            continue
        values = _undo(arch, name, dequantize(file, name), config)
        file.release()
        if key.endswith(".mlp.experts.gate_up_proj"):  # gate first, then up, along dim 1 (transformers' order)
            parts = halves.setdefault(key, {})
            parts["gate" if "ffn_gate_exps" in name else "up"] = values
            if len(parts) < 2:
                continue
            values = np.concatenate([parts.pop("gate"), parts.pop("up")], axis=1)
            del halves[key]
        yield key, torch.from_numpy(np.ascontiguousarray(values))


def read_tensors(file: GGUFFile, arch: Arch, config: dict[str, Any], hf_keys: list[str],
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every mapped tensor of the file, float32 (or ``dtype``), keyed as transformers' checkpoint keys them."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in hf_tensors(file, arch, config, hf_keys):
        out[key] = tensor if dtype is None or dtype == tensor.dtype else tensor.to(dtype)
    return out


__all__ = ["ARCHS", "architecture", "config_dict", "gguf_path", "hf_tensors", "name_map", "open_gguf",
           "read_tensors"]
