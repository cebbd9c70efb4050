"""Export: a checkpoint goes through our native modules and out again, HF-canonical.

``export(source, out)`` loads ``source`` (hub id, directory or weights file) into the
native model for its head, and writes ``out`` as transformers' ``save_pretrained``
would: ``config.json`` (the source's, lossless, with ``architectures`` naming the class
exported and a ``flodl_hf`` stamp naming the source), ``model.safetensors`` (sharded
above ``max_shard_size``, tied tensors written once under the name transformers keeps)
and the tokenizer files; the files that describe the model (model card, sentence-transformers
layout, the tokenizer's own files) are copied byte-identical by ``flodl_hf.roundtrip.carry``.
``export_checkpoint(ckpt, out)`` does the same for a checkpoint written by our trainer.

Every write is atomic: the directory is built as a hidden sibling of ``out`` and
renamed into place only when complete, so a failure or a kill never leaves a
half-written ``out``; an existing ``out`` is replaced only with ``force``.

The commands ``export``, ``verify-export``, ``verify-matrix`` and ``convert`` are in
``flodl_hf.commands``.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flodl_hf.roundtrip import carry
from flodl_hf.core import checkpoint_schema, io
from flodl_hf.auto import build_model, config_from_dict, load_model
from flodl_hf.core.config import BaseConfig
from flodl_hf.core.errors import CheckpointFormatError, InputError, UnsupportedModelError
from flodl_hf.core.fs import (STAMP_KEY, Protected, atomic_directory, check_out, local_source, protected_paths,
                              sha256_file, stage, written_files)
from flodl_hf.core.keys import expected, has_pooler, init_fresh, normalise
from flodl_hf.core.modeling import PreTrainedModel, load_weights
from flodl_hf.roundtrip.parity import quiet_transformers
from flodl_hf.core.registry import get_family, parse_architecture
from flodl_hf.core.registry import TaskField, hf_mapping, task_names

DTYPES = {"keep": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# transformers' Auto mapping per task (the class name it writes into ``architectures`` for a
# model_type), read from the task registry.
HF_MAPPINGS = TaskField("hf_mapping")
# Files that make a directory carry a tokenizer; any *.model (SentencePiece) counts too.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "merges.txt")
TRAINER_KEYS = checkpoint_schema.MODEL_KEYS
TRAINER_FORMAT = checkpoint_schema.FORMAT  # flodl_hf.training.checkpoints writes it


# ---- names: which class a (model_type, task) is, and back -------------------------------------

def _hf_mapping(task: str) -> dict[str, str]:
    return hf_mapping(task)


def architecture_name(model_type: str, task: str) -> str:
    """The class transformers instantiates (and writes into ``architectures``) for this model_type and head."""
    return _hf_mapping(task).get(model_type) or get_family(model_type).architecture(task)


def architecture_task(name: str, model_type: str) -> str:
    """'BertForMaskedLM' -> 'mlm'. Raises UnsupportedModelError for a head we do not build."""
    try:
        return parse_architecture(name)[1]
    except UnsupportedModelError as exc:
        for task in get_family(model_type).tasks:  # an alias family (camembert under roberta) is named by transformers' class
            if _hf_mapping(task).get(model_type) == name:
                return task
        raise UnsupportedModelError(f"{exc}. Pass head= (--head) to export another head.") from None


def resolve_task(config: BaseConfig, head: str, where: str) -> str:
    if head != "auto":
        if head not in task_names():
            raise InputError(f"head {head!r}: expected auto or one of {', '.join(task_names())}")
        return head
    architectures = config.architectures or []
    if not architectures:
        return "base"
    try:
        return architecture_task(architectures[0], config.model_type)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{where}: architectures[0] is {architectures[0]!r}: {exc}") from None


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InputError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- small shared helpers -----------------------------------------------------------------------

def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (stricter than torch.equal: NaN payloads and -0.0 count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
                       b.detach().cpu().contiguous().reshape(-1).view(torch.uint8))


def tokenizer_root(tokenizer: str | os.PathLike) -> Path:
    path = Path(tokenizer).expanduser()
    return path if path.is_dir() else io.resolve(tokenizer).root


def has_tokenizer(root: Path) -> bool:
    return any((root / name).is_file() for name in TOKENIZER_FILES) or any(root.glob("*.model"))


def carried_paths(plan: "carry.CarryPlan") -> list[Protected]:
    """Every file an export copies from its source, its --like or its --tokenizer: --out must keep clear of them."""
    return [(item.root / item.name, True) for item in plan.files]


# ---- tokenizer --------------------------------------------------------------------------------------

def write_tokenizer(source_root: Path, directory: Path) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json as transformers does.

    transformers converts a vocab.txt or a SentencePiece model into tokenizer.json; the
    SentencePiece model is copied along. Returns the files written ([] when the source has none).
    """
    source_root = Path(source_root)
    if not has_tokenizer(source_root):
        return []
    transformers = quiet_transformers()
    before = set(os.listdir(directory))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(source_root))
        tokenizer.save_pretrained(str(directory))
    except Exception as exc:  # transformers raises many kinds; all mean the same to the user
        raise CheckpointFormatError(
            f"{source_root}: has tokenizer files but transformers cannot read them "
            f"({type(exc).__name__}: {exc}). Fix or remove them, or pass tokenizer= (--tokenizer) "
            "pointing at a directory with a working tokenizer.") from exc
    # transformers 5 no longer writes this file; older tools still read it.
    (directory / "special_tokens_map.json").write_text(
        json.dumps(tokenizer.special_tokens_map, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    for model_file in sorted(source_root.glob("*.model")):
        shutil.copyfile(model_file, directory / model_file.name)
    return sorted(set(os.listdir(directory)) - before)


# ---- the model and its config ----------------------------------------------------------------------

def _complete_backbone(model: PreTrainedModel) -> tuple[PreTrainedModel, list[str]]:
    """A bare backbone gets the pooler transformers' AutoModel has, fresh, when the source had none.

    transformers' ``AutoModel`` always builds the pooler where the family has one, so an export
    without it would load with missing keys. The pooler is initialised as transformers would.
    """
    with torch.device("meta"):
        full = build_model(model.config, "base", add_pooling_layer=True)
    have = model.state_dict()
    extra = [k for k in full.state_dict() if k not in have]
    if not extra:
        return model, []
    full.load_state_dict(have, strict=False, assign=True)
    dtype = model.dtype
    for key in extra:
        owner_name, _, name = key.rpartition(".")
        owner = full.get_submodule(owner_name)
        meta = getattr(owner, name)
        setattr(owner, name, torch.nn.Parameter(torch.empty(meta.shape, dtype=dtype), requires_grad=meta.requires_grad))
        init_fresh(owner, name, getattr(model.config, "initializer_range", 0.02))
    warnings.warn(f"{', '.join(extra)} were not in the source and are newly initialised, as transformers' "
                  "AutoModel would do", stacklevel=3)
    return full.eval(), extra


def export_config(model: PreTrainedModel, task: str, stamp: dict[str, Any], cast: torch.dtype | None) -> dict:
    """The source config, lossless, with the exported class, the cast dtype and the stamp laid over it."""
    config = model.config.to_dict()
    source_type = model.config.raw.get("model_type")
    if source_type in model.family.model_types():  # an alias (camembert) keeps its own name
        config["model_type"] = source_type
    config["architectures"] = [architecture_name(config["model_type"], task)]
    if cast is not None:
        config["dtype"] = dtype_name(cast)
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype_name(cast)
    config[STAMP_KEY] = stamp
    return config


def _hf_names(model: PreTrainedModel, native_keys: list[str]) -> list[str]:
    key_map = model.family.key_map()
    return [key_map.to_hf(k) for k in native_keys]


@dataclass
class ExportResult:
    """What an export wrote and what a user should know about it."""

    out: Path
    architecture: str
    task: str
    files: list[str]
    tokenizer_files: list[str] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)  # copied byte-identical from the source (flodl_hf.roundtrip.carry)
    fresh: list[str] = field(default_factory=list)     # HF keys initialised fresh (not in the source)
    dropped: list[str] = field(default_factory=list)   # source keys the exported head does not use
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "out": str(self.out)}


def _write(model: PreTrainedModel, out: Path, force: bool, task: str, stamp: dict, cast: torch.dtype | None,
           max_shard_size: int | str, tok_root: Path | None, fresh: list[str], dropped: list[str],
           carried: carry.CarryPlan | None = None, protect: list[Protected] | None = None) -> ExportResult:
    notes: list[str] = []
    carried = carried or carry.CarryPlan()
    stamp = {**stamp, "task": task, "dtype": dtype_name(cast) if cast is not None else "keep",
             "fresh": fresh, "dropped": dropped, "carried_from": str(carried.description_root or "") or None,
             # where the tokenizer files came from (the source, --like or --tokenizer): check 5 compares with it
             "tokenizer_from": str(Path(tok_root).expanduser().absolute()) if tok_root is not None else None}
    config = export_config(model, task, stamp, cast)
    with atomic_directory(out, force, protect) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        stage("weights")
        (tmp / io.CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        stage("config")
        tokenizer_files = write_tokenizer(tok_root, tmp) if tok_root is not None else []
        carried.copy_into(tmp)  # the model card, sentence-transformers layout, the tokenizer's own files
        stamp["files_sha256"] = written_files(tmp)  # what verify-export's check 7 compares DIR with
        (tmp / io.CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        stage("tokenizer")
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
    if tok_root is None:
        notes.append("no tokenizer source: exported without tokenizer files (pass tokenizer= / --tokenizer)")
    elif not tokenizer_files:
        notes.append(f"{tok_root} has no tokenizer files: exported without them")
    notes += [n for n in (carried.note(), *carried.notes) if n]
    if fresh:
        notes.append(f"not in the source, initialised fresh (train before use): {', '.join(fresh)}")
    if dropped:
        notes.append(f"source weights the {task} head does not use, not exported: {', '.join(dropped)}")
    return ExportResult(Path(out).expanduser().absolute(), config["architectures"][0], task, files,
                        tokenizer_files, carried.names, fresh, dropped, notes)


def export(source: str | os.PathLike, out: str | os.PathLike, head: str = "auto", revision: str | None = None,
           dtype: str | torch.dtype = "keep", max_shard_size: int | str = "5GB", force: bool = False,
           tokenizer: str | os.PathLike | None = None, like: str | os.PathLike | None = None) -> ExportResult:
    """Load ``source`` natively and write it to ``out`` as an HF-canonical model directory.

    ``head``: auto (from ``architectures``) or a task; a head the source lacks is initialised
    fresh, as transformers would. ``dtype``: keep, float32, float16 or bfloat16. ``tokenizer``:
    where to take tokenizer files from (default: ``like``, else the source). ``like``: where to
    take the model card and sentence-transformers layout from (default: the source); see flodl_hf.roundtrip.carry.
    """
    cast = parse_dtype(dtype)
    io.parse_size(max_shard_size)  # a bad size fails before any work, as a bad out does
    out_path = check_out(out, force, local_source(source))  # fail before any heavy work (a download)
    ckpt = io.resolve(source, revision)
    like_dir = carry.like_root(like) if like is not None else None
    tok_root = tokenizer_root(tokenizer) if tokenizer is not None else like_dir or ckpt.root
    protect = protected_paths(ckpt, ckpt.root.is_dir() and not Path(source).expanduser().is_file(),
                              [tok_root] + ([like_dir] if like_dir is not None else []))
    check_out(out_path, force, protect)
    config = config_from_dict(io.read_json(ckpt.config_path, "config.json"), str(ckpt.config_path))
    task = resolve_task(config, head, str(ckpt.config_path))
    carried = carry.plan(like_dir or ckpt.root, tok_root, "--like" if like_dir else "the source")
    protect += carried_paths(carried)
    check_out(out_path, force, protect)
    on_disk = Path(source).expanduser().exists()  # else a hub id, now in the local cache at ckpt.root
    local = source if on_disk else ckpt.root
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fresh and unused keys are reported in the result instead
        model = load_model(local, task, dtype=cast, revision=revision, config=config)
        report = model.load_report
        fresh = _hf_names(model, report.fresh)
        if task == "base":
            model, extra = _complete_backbone(model)
            fresh += _hf_names(model, extra)
    commit = ckpt.root.name if ckpt.root.parent.name == "snapshots" else None
    stamp = {
        "version": _version(),
        "source": str(Path(source).expanduser().absolute()) if on_disk else str(source),
        "revision": revision,
        "commit": commit,
        "format": ckpt.format,
        "weights_sha256": {f.name: sha256_file(f) for f in ckpt.weight_files},
    }
    return _write(model, out_path, force, task, stamp, cast, max_shard_size, tok_root, fresh,
                  _hf_names(model, report.unused), carried, protect)


def _version() -> str:
    from flodl_hf.core.version import __version__
    return __version__


# ---- trainer checkpoints ------------------------------------------------------------------------------

def read_trainer_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, state_dict) of a checkpoint written by flodl_hf's trainer; anything else is refused
    (the rules are flodl_hf.core.checkpoint_schema's, shared with the trainer's own reader)."""
    path = Path(path).expanduser()
    return _trainer_model_part(checkpoint_schema.read(path), path)


def lora_base_paths(data: dict[str, Any], path: Path) -> list[Protected]:
    """The local base model directory a LoRA trainer checkpoint loads (its ``lora.base.source``), as a
    protected path: [] for a checkpoint without LoRA or whose base is a hub id."""
    from flodl_hf.lora import base_paths, checkpoint_entry
    entry = checkpoint_entry(data, path) or {}
    return base_paths((entry.get("base") or {}).get("source"))


def _trainer_model_part(data: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from flodl_hf.lora import checkpoint_entry
    if (checkpoint_entry(data, path) or {}).get("adapter_only"):  # LoRA: the referenced base, the adapter merged in
        from flodl_hf.roundtrip.adapters import merged_checkpoint_state
        data = {**data, "model": merged_checkpoint_state(data, path)}
    return checkpoint_schema.model_part(data, path)


def checkpoint_task(config: BaseConfig, state: dict[str, torch.Tensor], head: str, where: str) -> str:
    """The head a trainer checkpoint holds: ``head`` if given, else the one whose keys and shapes fit.

    ``architectures`` in a trainer's config may still name the class the backbone came from
    (a classifier trained on a base checkpoint), so the state_dict decides.
    """
    if head != "auto":
        return resolve_task(config, head, where)
    fits = []
    family = get_family(config.model_type)
    for task in family.tasks:
        try:
            with torch.device("meta"):
                model = build_model(config, task, add_pooling_layer=has_pooler(state), family=family)
        except UnsupportedModelError:
            continue
        shapes, aliases = expected(model)
        norm = normalise(model, dict(state), shapes, aliases)
        if set(norm) == set(shapes) and all(norm[k].shape == shapes[k] for k in shapes):
            fits.append(task)
    if not fits:
        raise CheckpointFormatError(f"{where}: its state_dict fits none of the {config.model_type} heads "
                                    f"({', '.join(family.tasks)}) exactly; pass head= (--head) to choose one")
    if len(fits) > 1:
        named = resolve_task(config, "auto", where) if config.architectures else None
        if named in fits:
            return named
        raise CheckpointFormatError(f"{where}: its state_dict fits several heads ({', '.join(fits)}); "
                                    "pass head= (--head) to choose one")
    return fits[0]


def export_checkpoint(ckpt: str | os.PathLike, out: str | os.PathLike, head: str = "auto",
                      dtype: str | torch.dtype = "keep", max_shard_size: int | str = "5GB", force: bool = False,
                      tokenizer: str | os.PathLike | None = None, like: str | os.PathLike | None = None
                      ) -> ExportResult:
    """Export a checkpoint written by our trainer (``{'model': state_dict, 'config': config.to_dict(), ...}``).

    ``tokenizer``: a directory or hub id to take the tokenizer files from (the checkpoint has none).
    ``like``: a directory to take the model card, sentence-transformers layout and tokenizer from.
    Without either, they come from the source the checkpoint records (flodl_hf.roundtrip.carry).
    """
    cast = parse_dtype(dtype)
    path = Path(ckpt).expanduser().absolute()
    tok_root = tokenizer_root(tokenizer) if tokenizer is not None else None
    protect: list[Protected] = [(path, True)] + ([(tok_root, True)] if tok_root is not None else [])
    io.parse_size(max_shard_size)
    out_path = check_out(out, force, protect)
    data = checkpoint_schema.read(path)
    protect += lora_base_paths(data, path)  # a LoRA checkpoint's base, loaded to merge the adapter into
    check_out(out_path, force, protect)
    config_dict, state = _trainer_model_part(data, path)
    config = config_from_dict(config_dict, f"{path} (config)")
    from flodl_hf.core.validate import check_config_fits
    check_config_fits(config, state, f"{path} (config)")
    task = checkpoint_task(config, state, head, str(path))
    tok_given = tokenizer_root(tokenizer) if tokenizer is not None else None
    desc_root, tok_root, why = carry.checkpoint_roots(path, tok_given, carry.like_root(like) if like else None)
    carried = carry.plan(desc_root, tok_root, why)
    if like is None:  # the base model's card describes the base, not this fine-tune
        carry.fine_tune_card(carried, path, data, architecture_name(config.model_type, task), task)
    protect += [(r, True) for r in (desc_root, tok_root) if r is not None] + carried_paths(carried)
    check_out(out_path, force, protect)
    if cast is not None:
        state = {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}
    with torch.device("meta"):
        model = build_model(config, task, add_pooling_layer=has_pooler(state))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = load_weights(model, state, str(path), allow_fresh_head=False)
    model.eval()
    fresh: list[str] = []
    if task == "base":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, extra = _complete_backbone(model)
        fresh = _hf_names(model, extra)
    stamp = {"version": _version(), "source": str(path), "revision": None, "commit": None,
             "format": "flodl-checkpoint", "weights_sha256": {path.name: sha256_file(path)}}
    return _write(model, out_path, force, task, stamp, cast, max_shard_size, tok_root, fresh,
                  _hf_names(model, report.unused), carried, protect)
