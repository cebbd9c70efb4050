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

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from flodl_hf.roundtrip import carry
from flodl_hf.core import checkpoint_schema, io
from flodl_hf.auto import build_model, config_from_dict, load_model
from flodl_hf.core.config import BaseConfig
from flodl_hf.core.errors import CheckpointFormatError, InputError, OutputExistsError, UnsupportedModelError
from flodl_hf.core.io import pid_alive
from flodl_hf.core.keys import expected, has_pooler, init_fresh, normalise
from flodl_hf.core.modeling import PreTrainedModel, load_weights
from flodl_hf.roundtrip.parity import quiet_transformers
from flodl_hf.core.registry import get_family, parse_architecture
from flodl_hf.core.task_registry import TaskField, hf_mapping, task_names

STAMP_KEY = "flodl_hf"
DTYPES = {"keep": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# transformers' Auto mapping per task (the class name it writes into ``architectures`` for a
# model_type), read from the task registry.
HF_MAPPINGS = TaskField("hf_mapping")
# Files that make a directory carry a tokenizer; any *.model (SentencePiece) counts too.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "merges.txt")
TRAINER_KEYS = checkpoint_schema.MODEL_KEYS
TRAINER_FORMAT = checkpoint_schema.FORMAT  # flodl_hf.training.trainer writes it


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

def written_files(directory: Path) -> dict[str, str]:
    """sha256 of every file of an export (relative paths), config.json's over its fields without the
    stamp (which holds this record): what the export wrote, for verify-export to find any edit since."""
    found = {}
    for rel in written_files_list(directory):
        path = directory / rel
        if rel == io.CONFIG_NAME:
            config = {k: v for k, v in json.loads(path.read_text(encoding="utf-8")).items() if k != STAMP_KEY}
            found[rel] = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
        else:
            found[rel] = sha256_file(path) if path.is_file() else f"link {os.readlink(path)}"
    return found


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file; a progress bar on stderr for files over 256 MB."""
    from tqdm.auto import tqdm
    digest = hashlib.sha256()
    size = Path(path).stat().st_size
    with open(path, "rb") as handle, tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {Path(path).name}",
                                          disable=size < 256 * 2**20, leave=False) as bar:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


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


# ---- atomic directories ---------------------------------------------------------------------------

_SCRATCH = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)-[0-9a-f]+$")
# A file a directory written by flodl-hf carries when its config.json cannot carry the stamp (convert).
WRITTEN_MARK = ".flodl-hf"
# Test hook: FLODL_HF_KILL_AT=<stage> SIGKILLs this process when the write reaches that stage, so a test
# can prove that a kill at any point leaves DIR old or new, never neither. STAGES lists them in order.
KILL_ENV = "FLODL_HF_KILL_AT"
STAGES = ("scratch", "weights", "config", "tokenizer", "written", "old-moved", "swapped", "cleaned")


def _stage(name: str) -> None:
    if os.environ.get(KILL_ENV) == name:
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux ``renameat2(a, b, flags)``: True when done, False where the platform or file system has no
    such call or flag (the caller falls back); any other failure raises OSError (errno set)."""
    if os.environ.get("FLODL_HF_NO_EXCHANGE") or not sys.platform.startswith("linux"):
        return False
    import ctypes
    import errno
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``). False where the
    platform or file system has no such call (then the caller falls back to two renames)."""
    return _renameat2(a, b, 2)  # RENAME_EXCHANGE


def _rename_no_replace(a: Path, b: Path) -> None:
    """Rename ``a`` to ``b`` only if ``b`` does not exist (Linux ``renameat2(RENAME_NOREPLACE)``); whatever
    is at ``b`` (even an empty directory) makes it OutputExistsError and is left untouched."""
    import errno
    clash = OutputExistsError(f"--out {b} appeared while the export was being written (another process?): it was "
                              "left untouched and nothing was written; pass --force to replace it, or choose another path")
    try:
        if _renameat2(a, b, 1):  # RENAME_NOREPLACE
            return
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise clash from None
        raise
    # no renameat2: the narrowest fallback (os.rename would replace an empty directory)
    if b.exists() or b.is_symlink():
        raise clash
    try:
        os.rename(a, b)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
            raise clash from None
        raise


# Room a scratch sibling's name needs beside the stem: ".", ".partial-", the pid, "-", 8 hex digits.
_NAME_MAX = 255
_SCRATCH_ROOM = 40


def _scratch_stem(name: str) -> str:
    """``name`` as it appears in a scratch sibling's name: itself, or for a name too long to take the
    ``.partial-PID-HEX`` suffix within NAME_MAX, a prefix and a hash of it (recover_scratch matches the same)."""
    raw = os.fsencode(name)
    if len(raw) + _SCRATCH_ROOM <= _NAME_MAX:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:16]
    prefix = raw[: _NAME_MAX - _SCRATCH_ROOM - 17].decode("utf-8", errors="ignore")
    return f"{prefix}~{digest}"


def recover_scratch(out: Path) -> list[str]:
    """Settle what a killed writer (its pid is gone) left beside ``out``; returns what was done.

    An orphaned ``.NAME.old-*`` is the previous DIR, moved aside just before the new one was renamed
    in: when DIR is missing it is renamed back (restored), never deleted; when DIR is there (the swap
    completed) it is removed. A ``.NAME.partial-*`` is an unfinished or superseded write: removed.
    """
    done: list[str] = []
    if not out.parent.is_dir():
        return done
    orphans = []
    for entry in out.parent.iterdir():
        match = _SCRATCH.match(entry.name)
        if match and match["name"] == _scratch_stem(out.name) and not pid_alive(int(match["pid"])) and not entry.is_symlink():
            orphans.append((match["kind"], entry))
    olds = sorted((e for k, e in orphans if k == "old"), key=lambda e: e.stat().st_mtime, reverse=True)
    if olds and not out.exists() and not out.is_symlink():
        olds[0].rename(out)
        done.append(f"restored {out} from {olds[0].name}")
        olds = olds[1:]
    for entry in [*olds, *(e for k, e in orphans if k == "partial")]:
        shutil.rmtree(entry, ignore_errors=True)
        done.append(f"removed {entry.name}")
    return done


def _json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def recorded_files(path: Path) -> set[str] | None:
    """The files (relative posix paths) flodl-hf recorded writing into the directory ``path``: an export's
    stamp (config.json's ``flodl_hf.files_sha256``), convert's WRITTEN_MARK or an adapter's side file
    (their ``files``). An empty directory records nothing and holds nothing; None where no record is found."""
    try:
        if not any(path.iterdir()):
            return set()
    except OSError:
        return None
    from flodl_hf.lora import BASE_STAMP
    config = _json_file(path / io.CONFIG_NAME)
    stamp = config.get(STAMP_KEY) if isinstance(config, dict) else None
    records = [stamp.get("files_sha256") if isinstance(stamp, dict) else None]
    for mark in (WRITTEN_MARK, BASE_STAMP):
        data = _json_file(path / mark) if (path / mark).is_file() else None
        records.append(data.get("files") if isinstance(data, dict) else None)
    found = [r for r in records if isinstance(r, (dict, list)) and all(isinstance(x, str) for x in r)]
    return set().union(*found) if found else None


def foreign_files(path: Path, recorded: set[str]) -> list[str]:
    """The files and links below ``path`` that are not in ``recorded``: what --force would otherwise delete."""
    return sorted(rel for p in path.rglob("*") if (p.is_file() or p.is_symlink())
                  and (rel := p.relative_to(path).as_posix()) not in recorded)


def written_files_list(directory: Path) -> list[str]:
    """The relative posix paths of every file below ``directory``: the record a writer leaves in its mark."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() or p.is_symlink())


Protected = tuple[Path, bool]  # (a path --out must keep clear of, also refuse --out inside it?)


def protected_paths(ckpt: io.Checkpoint, directory_source: bool, extra: list[Path] | None = None) -> list[Protected]:
    """What an export or convert reads: --out may neither be, contain, nor (for a directory source) lie
    inside any of it. Weight files count by their resolved path too (a hub snapshot links into blobs)."""
    out: list[Protected] = [(ckpt.root, directory_source), (ckpt.config_path, True)]
    out += [(f, True) for f in ckpt.weight_files]
    out += [(p, True) for p in extra or []]
    return out


def carried_paths(plan: "carry.CarryPlan") -> list[Protected]:
    """Every file an export copies from its source, its --like or its --tokenizer: --out must keep clear of them."""
    return [(item.root / item.name, True) for item in plan.files]


def local_source(source: str | os.PathLike) -> list[Protected]:
    """The protected path of a source given as a local path (before it is resolved); [] for a hub id."""
    path = Path(source).expanduser()
    return [(path, path.is_dir())] if path.exists() else []


def check_out(out: str | os.PathLike, force: bool, protect: list[Protected] | None = None) -> Path:
    """Refuse an unusable ``out`` before anything is written: a file, a symlink, an existing directory
    without ``force`` or (with it) one flodl-hf did not write, or a path overlapping what is read."""
    from flodl_hf.core.validate import file_above, overlap, real
    if not isinstance(out, (str, os.PathLike)) or not str(out):
        raise InputError(f"out must be a directory path, got {out!r}")
    path = Path(out).expanduser().absolute()
    long = [part for part in path.parts if len(os.fsencode(part)) > _NAME_MAX]
    if long:
        raise InputError(f"--out {path}: the name {long[0][:40]}... is {len(os.fsencode(long[0]))} bytes long, over "
                         f"the file system's limit of {_NAME_MAX}: choose a shorter name (nothing was written)")
    above = file_above(path)
    if above is not None:
        raise OutputExistsError(f"--out {path}: {above} is a file, not a directory (nothing was written)")
    for src, both_ways in protect or []:
        how = overlap(path, src)
        if how == "is inside" and not both_ways:
            continue
        if how:
            where = f" ({real(src)})" if real(src) != Path(src).absolute() else ""
            raise OutputExistsError(f"--out {path} {how} the source {src}{where}: choose a path outside the source "
                                    "(nothing was written or deleted)")
    if path.is_symlink():
        raise OutputExistsError(f"--out {path} is a symbolic link: pass the directory itself or another path "
                                "(nothing was written)")
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"--out {path} is an existing file, not a directory: choose another path "
                                "(nothing was written, the file is untouched)")
    if path.exists() and not force:
        raise OutputExistsError(f"--out {path} already exists: pass --force (force=True) to replace it, "
                                "or choose another path (nothing was written)")
    if path.exists():
        recorded = recorded_files(path)
        if recorded is None:
            raise OutputExistsError(f"--out {path} is a directory flodl-hf did not write (no '{STAMP_KEY}' stamp "
                                    "with its list of files in its config.json, nor a convert or adapter record): "
                                    "--force replaces only an empty directory or an earlier export, convert or "
                                    "adapter; choose another path (nothing was written or deleted)")
        foreign = foreign_files(path, recorded)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise OutputExistsError(f"--out {path} holds files flodl-hf did not write: {shown}. --force replaces "
                                    "only what an earlier export, convert or adapter wrote: move them out or choose "
                                    "another path (nothing was written or deleted)")
    return path


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike, force: bool = False,
                     protect: list[Protected] | None = None) -> Iterator[Path]:
    """Yield a hidden sibling of ``out`` to fill; swap it into place only if the block succeeds.

    At every instant ``out`` is the old directory or the complete new one: on Linux the two are
    exchanged in one ``renameat2(RENAME_EXCHANGE)``; elsewhere the old one is renamed aside first,
    and a writer killed between the two renames leaves it as ``.NAME.old-PID-*``, which the next
    write to ``out`` (``recover_scratch``) renames back. On any exception (KeyboardInterrupt included)
    the sibling is removed and ``out``, if it existed, is untouched.
    """
    path = check_out(out, force, protect)
    created = [p for p in path.parents if not (p.exists() or p.is_symlink())]  # deepest first
    path.parent.mkdir(parents=True, exist_ok=True)
    done = False
    tmp = None
    try:
        recover_scratch(path)
        check_out(path, force, protect)  # a restored DIR is judged like any other
        tag = f"{os.getpid()}-{secrets.token_hex(4)}"
        stem = _scratch_stem(path.name)
        tmp = path.with_name(f".{stem}.partial-{tag}")
        tmp.mkdir()  # plain mkdir: the umask applies, as for a directory save_pretrained creates
        _stage("scratch")
        yield tmp
        _stage("written")
        check_out(path, force, protect)  # it may have appeared meanwhile
        if not force or not (path.exists() or path.is_symlink()):
            _rename_no_replace(tmp, path)  # whatever appeared since the check is never replaced
            _stage("swapped")
        elif _exchange(tmp, path):  # tmp now holds the old directory
            _stage("swapped")
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            old = path.with_name(f".{stem}.old-{tag}")
            path.rename(old)
            _stage("old-moved")
            try:
                tmp.rename(path)
            except BaseException:
                old.rename(path)
                raise
            _stage("swapped")
            shutil.rmtree(old, ignore_errors=True)
        _stage("cleaned")
        done = True
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            for parent in created:  # the parents this write created, deepest first, only while empty
                try:
                    parent.rmdir()
                except OSError:
                    break


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
        _stage("weights")
        (tmp / io.CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _stage("config")
        tokenizer_files = write_tokenizer(tok_root, tmp) if tok_root is not None else []
        carried.copy_into(tmp)  # the model card, sentence-transformers layout, the tokenizer's own files
        stamp["files_sha256"] = written_files(tmp)  # what verify-export's check 7 compares DIR with
        (tmp / io.CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _stage("tokenizer")
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
    from flodl_hf import __version__
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
    from flodl_hf.lora import _base_protect, checkpoint_entry
    entry = checkpoint_entry(data, path) or {}
    return _base_protect((entry.get("base") or {}).get("source"))


def _trainer_model_part(data: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from flodl_hf.lora import checkpoint_entry
    if (checkpoint_entry(data, path) or {}).get("adapter_only"):  # LoRA: the referenced base, the adapter merged in
        from flodl_hf.lora import merged_checkpoint_state
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


if __name__ == "__main__":
    from flodl_hf.cli import main
    sys.exit(main(["export", *sys.argv[1:]]))
