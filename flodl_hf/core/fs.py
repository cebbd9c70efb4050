"""Writing directories safely: --out checks, atomic swaps, the records of what flodl-hf wrote, and hashes.

Every writer of a directory (export, convert, an adapter's save, the trainer's exports) goes through
``check_out`` before anything is written and ``atomic_directory`` for the write itself, so at every instant
``--out`` is the old directory or the complete new one, and ``--force`` replaces only a directory whose every
file flodl-hf recorded writing (``recorded_files``).
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
from pathlib import Path
from typing import Any, Iterator

from flodl_hf.core import io
from flodl_hf.core.errors import InputError, OutputExistsError
from flodl_hf.core.io import pid_alive
from flodl_hf.core.validate import file_above, overlap, real

# The key of an export's stamp in its config.json (the source, the task, and the sha256 of each file written).
STAMP_KEY = "flodl_hf"
# An adapter directory's side file (flodl_hf.lora writes it): its record of the files written lives there.
ADAPTER_MARK = "flodl_hf_base.json"


# ---- records of what was written -----------------------------------------------------------------

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


# ---- atomic directories ---------------------------------------------------------------------------

_SCRATCH = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)-[0-9a-f]+$")
# A file a directory written by flodl-hf carries when its config.json cannot carry the stamp (convert).
WRITTEN_MARK = ".flodl-hf"
# Test hook: FLODL_HF_KILL_AT=<stage> SIGKILLs this process when the write reaches that stage, so a test
# can prove that a kill at any point leaves DIR old or new, never neither. STAGES lists them in order.
KILL_ENV = "FLODL_HF_KILL_AT"
STAGES = ("scratch", "weights", "config", "tokenizer", "written", "old-moved", "swapped", "cleaned")


def stage(name: str) -> None:
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
    config = _json_file(path / io.CONFIG_NAME)
    stamp = config.get(STAMP_KEY) if isinstance(config, dict) else None
    records = [stamp.get("files_sha256") if isinstance(stamp, dict) else None]
    for mark in (WRITTEN_MARK, ADAPTER_MARK):
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


def local_source(source: str | os.PathLike) -> list[Protected]:
    """The protected path of a source given as a local path (before it is resolved); [] for a hub id."""
    path = Path(source).expanduser()
    return [(path, path.is_dir())] if path.exists() else []


def check_out(out: str | os.PathLike, force: bool, protect: list[Protected] | None = None) -> Path:
    """Refuse an unusable ``out`` before anything is written: a file, a symlink, an existing directory
    without ``force`` or (with it) one flodl-hf did not write, or a path overlapping what is read."""
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
        stage("scratch")
        yield tmp
        stage("written")
        check_out(path, force, protect)  # it may have appeared meanwhile
        if not force or not (path.exists() or path.is_symlink()):
            _rename_no_replace(tmp, path)  # whatever appeared since the check is never replaced
            stage("swapped")
        elif _exchange(tmp, path):  # tmp now holds the old directory
            stage("swapped")
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            old = path.with_name(f".{stem}.old-{tag}")
            path.rename(old)
            stage("old-moved")
            try:
                tmp.rename(path)
            except BaseException:
                old.rename(path)
                raise
            stage("swapped")
            shutil.rmtree(old, ignore_errors=True)
        stage("cleaned")
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
