"""A decoder out to a GGUF file, as llama.cpp's ``convert_hf_to_gguf.py`` writes one: its tensor names (the ``gguf``
package's table), its metadata keys (``general.architecture``, ``{arch}.context_length``, the RoPE and norm
parameters...), its value transforms (LLaMA's q/k row order, Gemma's ``w + 1`` norms, GPT-2's transposed Conv1D
weights, stacked experts split), the tokenizer (``tokenizer.ggml.*``, flodl_hf.roundtrip.gguf_vocab) and the chat
template, written with ``gguf.GGUFWriter`` and quantised with gguf's quantisers.

The file is written beside OUT under a hidden name and renamed into place, so OUT is never a partial file; ``--force``
replaces only a GGUF that flodl-hf wrote (its metadata carries ``flodl_hf.source``).
"""

from __future__ import annotations

import os
import secrets
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from flodl_hf.core.errors import InputError, OutputExistsError, UnsupportedModelError
from flodl_hf.core.validate import file_above
from flodl_hf.gguf.archs import ARCHS, Arch, permute, qk_heads, supported
from flodl_hf.gguf.loading import name_map
from flodl_hf.gguf.reader import _gguf

# --outtype -> the ggml type of the 2-D weights (1-D tensors, norms and biases, stay F32 as llama.cpp keeps them).
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# llama.cpp's general.file_type (LlamaFileType) of each
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "bf16": 32}
STAMP = "flodl_hf.source"  # the metadata key that marks a GGUF flodl-hf wrote (what --force may replace)


def qtype(outtype: str) -> Any:
    if outtype not in OUTTYPES:
        raise InputError(f"--outtype {outtype!r}: expected one of {', '.join(OUTTYPES)}")
    return _gguf().GGMLQuantizationType[outtype.upper()]


def _rope_theta(data: dict[str, Any]) -> float | None:
    """The RoPE base of a config dict: top level, else transformers 5's rope_parameters (a per-layer-kind dict:
    the full layers')."""
    if data.get("rope_theta") is not None:
        return data["rope_theta"]
    params = data.get("rope_parameters") or {}
    params = params.get("full_attention", params) if isinstance(params, dict) else {}
    return params.get("rope_theta")


def field_values(model_type: str, data: dict[str, Any]) -> dict[str, Any]:
    """The config fields GGUF metadata carries, with the values transformers' config defaults fill in."""
    heads = data.get("num_attention_heads") or data.get("n_head")
    hidden = data.get("hidden_size") or data.get("n_embd")
    values = {**data, "rope_theta": _rope_theta(data)}
    values.setdefault("num_key_value_heads", heads)
    if values.get("head_dim") is None and heads:
        values["head_dim"] = hidden // heads
    if model_type == "gpt2":
        values["n_ctx"] = data.get("n_positions")
        values["feed_forward_length"] = data.get("n_inner") or 4 * hidden
    return values


def metadata(arch: Arch, data: dict[str, Any], name: str, outtype: str) -> dict[str, tuple[str, Any]]:
    """key -> (gguf value kind, value): general.*, and {arch}.* from the table entry's keys, inverted."""
    values = field_values(arch.model_type, data)
    out: dict[str, tuple[str, Any]] = {
        "general.architecture": ("string", arch.gguf),
        "general.type": ("string", "model"),
        "general.name": ("string", name),
        "general.file_type": ("uint32", FILE_TYPES[outtype]),
        "general.quantization_version": ("uint32", 2),
    }
    for key, name_ in arch.keys.items():
        value = values.get(name_)
        if value is None or isinstance(value, (list, dict)):
            continue
        kind = "float32" if isinstance(value, float) or key.endswith(("freq_base", "epsilon")) else "uint32"
        out[f"{arch.gguf}.{key}"] = (kind, float(value) if kind == "float32" else int(value))
    if arch.experts:
        prefix = f"{arch.gguf}."
        for key, name_ in (("expert_feed_forward_length", "moe_intermediate_size"),
                           ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
            if values.get(name_):
                out[prefix + key] = ("uint32", int(values[name_]))
    return out


def _hf_state(model: Any) -> dict[str, torch.Tensor]:
    """The model's tensors under transformers' keys (stacked experts kept stacked), ties written once."""
    key_map = model.family.key_map()
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict(keep_vars=False).items():
        if id(tensor) in seen or tensor.untyped_storage().data_ptr() in seen:
            continue
        seen.add(tensor.untyped_storage().data_ptr())
        out[key_map.to_hf(key)] = tensor
    if model.config.raw.get("tie_word_embeddings", getattr(model.config, "tie_word_embeddings", False)):
        out.pop("lm_head.weight", None)
    return out


def gguf_tensors(arch: Arch, model: Any) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 numpy) for each tensor, llama.cpp's transforms applied, in the model's order."""
    state = _hf_state(model)
    data = field_values(arch.model_type, model.config.to_dict())
    layers = int(data.get("num_hidden_layers") or data.get("n_layer"))
    names = name_map(arch, list(state), layers)
    by_key: dict[str, list[str]] = {}
    for gguf_name, key in names.items():
        by_key.setdefault(key, []).append(gguf_name)
    missing = [k for k in state if k not in by_key]
    if missing:
        raise UnsupportedModelError(f"{model.config.model_type}: no GGUF tensor name for {', '.join(missing[:5])} "
                                    f"(gguf's table for {arch.gguf})")
    for key, tensor in state.items():
        values = tensor.detach().to(torch.float32).cpu().numpy()
        gguf_names = sorted(by_key[key])
        if len(gguf_names) == 2:  # stacked gate and up experts: gate first along dim 1
            gate, up = np.split(values, 2, axis=1)
            yield next(n for n in gguf_names if "gate" in n), np.ascontiguousarray(gate)
            yield next(n for n in gguf_names if "_up_" in n), np.ascontiguousarray(up)
            continue
        name = gguf_names[0]
        if arch.permute_qk and (heads := qk_heads(name, data)) is not None:
            values = permute(values, heads)
        if arch.norm_offset and "norm.weight" in name:
            values = values + 1
        if name.endswith(arch.transposed):
            values = values.T
        if arch.experts and "ffn_gate_inp_shexp" in name:
            values = values.reshape(-1)
        yield name, np.ascontiguousarray(values, dtype=np.float32)


def quantise(name: str, values: np.ndarray, outtype: str) -> tuple[np.ndarray, Any]:
    """The tensor in ``outtype`` as llama.cpp picks: 1-D tensors and norms stay F32; a row that is not a whole
    number of blocks falls back to F16 (F32 for f32 files)."""
    gguf = _gguf()
    types = gguf.GGMLQuantizationType
    want = qtype(outtype)
    if values.ndim <= 1 or name.endswith("norm.weight") or want == types.F32:
        return values, types.F32
    block = gguf.GGML_QUANT_SIZES[want][0]
    if values.shape[-1] % block:
        want = types.F16
    return gguf.quants.quantize(values, want), want


@dataclass
class GGUFExport:
    """What was written: the file, its architecture and type, its tensor count, and notes for the user."""

    out: Path
    architecture: str
    outtype: str
    tensors: int
    notes: list[str] = field(default_factory=list)


def check_out_file(out: str | os.PathLike, force: bool, protect: list[Path]) -> Path:
    """Refuse an unusable OUT.gguf before anything is written: not a .gguf name, a directory, a link, a file
    inside a source, or an existing file (without --force, or with it one flodl-hf did not write)."""
    path = Path(out).expanduser().absolute()
    if path.suffix != ".gguf":
        raise InputError(f"--gguf {path}: the output name must end in .gguf")
    above = file_above(path)
    if above is not None:
        raise OutputExistsError(f"--gguf {path}: {above} is a file, not a directory (nothing was written)")
    for src in protect:
        src = Path(src).absolute()
        if path == src or src in path.parents:
            raise OutputExistsError(f"--gguf {path} is inside the source {src}: choose a path outside it "
                                    "(nothing was written)")
    if path.is_symlink() or path.is_dir():
        raise OutputExistsError(f"--gguf {path} is a {'link' if path.is_symlink() else 'directory'}: choose another "
                                "path (nothing was written)")
    if path.exists():
        if not force:
            raise OutputExistsError(f"--gguf {path} already exists: pass --force (force=True) to replace it, or "
                                    "choose another path (nothing was written)")
        if not _ours(path):
            raise OutputExistsError(f"--gguf {path} is a file flodl-hf did not write (no {STAMP} in its metadata): "
                                    "--force replaces only an earlier GGUF export; choose another path (nothing was "
                                    "written or deleted)")
    return path


def _ours(path: Path) -> bool:
    from flodl_hf.gguf.reader import open_gguf
    try:
        return STAMP in open_gguf(path).metadata
    except Exception:  # noqa: BLE001 - anything unreadable is not ours
        return False


def write_gguf(arch: Arch, model: Any, out: Path, outtype: str, vocab: dict[str, tuple[str, Any]],
               source: str, name: str) -> int:
    """Write ``model`` to ``out`` through a hidden sibling renamed into place; returns the tensor count."""
    gguf = _gguf()
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    try:
        writer = gguf.GGUFWriter(str(tmp), arch.gguf, use_temp_file=False)
        entries = metadata(arch, model.config.to_dict(), name, outtype)
        entries.pop("general.architecture")  # the writer adds it
        entries.update(vocab)
        entries[STAMP] = ("string", source)
        for key, (kind, value) in entries.items():
            getattr(writer, f"add_{kind}")(key, value) if kind != "array" else writer.add_array(key, value)
        for gguf_name, values in gguf_tensors(arch, model):
            data, kind = quantise(gguf_name, values, outtype)
            plain = kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
            writer.add_tensor(gguf_name, data, raw_dtype=None if plain else kind)
            count += 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return count


def arch_of(model_type: str) -> Arch:
    arch = ARCHS.get(model_type)
    if arch is None:
        raise UnsupportedModelError(f"model_type {model_type!r} has no GGUF architecture here; supported: "
                                    f"{', '.join(sorted(ARCHS))} (GGUF: {supported()})")
    return arch


def export_gguf(source: str | os.PathLike, out: str | os.PathLike, outtype: str = "f16", force: bool = False,
                checkpoint: bool = False, tokenizer: str | os.PathLike | None = None) -> GGUFExport:
    """Write the decoder ``source`` (an HF directory, or with ``checkpoint`` a flodl-hf trainer checkpoint) to the
    GGUF file ``out`` at ``outtype``, with the tokenizer and chat template of ``tokenizer`` (default: the source)."""
    from flodl_hf.roundtrip.gguf_vocab import vocab_metadata
    qtype(outtype)
    src = Path(source).expanduser()
    protect = [src] if src.exists() else []
    path = check_out_file(out, force, protect)
    model, tok_source = _load(source, checkpoint)
    arch = arch_of(model.config.model_type)
    vocab = vocab_metadata(tokenizer or tok_source, model.config)
    name = Path(str(source)).name
    count = write_gguf(arch, model, path, outtype, vocab, str(src.absolute()) if src.exists() else str(source), name)
    notes = []
    if arch.model_type == "qwen3_moe" and not getattr(model.config, "norm_topk_prob", True):
        notes.append("llama.cpp (and transformers reading a GGUF) renormalise Qwen3-MoE's top-k weights; this source "
                     "does not (norm_topk_prob false), so the file's model routes differently")
    return GGUFExport(path, arch.gguf, outtype, count, notes)


def _load(source: str | os.PathLike, checkpoint: bool) -> tuple[Any, str | os.PathLike]:
    """The causal LM of ``source`` and where its tokenizer is (a checkpoint: the source it records)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not checkpoint:
            from flodl_hf.auto import load_model
            return load_model(source, "causal_lm"), source
        return checkpoint_model(source)


def checkpoint_model(path: str | os.PathLike) -> tuple[Any, Path]:
    """A flodl-hf trainer checkpoint's causal LM (a LoRA one with its adapter merged in) and the source directory it
    records (for the tokenizer), as ``export --checkpoint`` reads one."""
    from flodl_hf.auto import build_model, config_from_dict
    from flodl_hf.core import checkpoint_schema
    from flodl_hf.core.modeling import load_weights
    from flodl_hf.roundtrip.carry import recorded_source
    from flodl_hf.roundtrip.export import _trainer_model_part
    path = Path(path).expanduser().absolute()
    config_dict, state = _trainer_model_part(checkpoint_schema.read(path), path)
    config = config_from_dict(config_dict, f"{path} (config)")
    with torch.device("meta"):
        model = build_model(config, "causal_lm")
    load_weights(model, state, str(path), allow_fresh_head=False)
    return model.eval(), recorded_source(path) or path.parent
