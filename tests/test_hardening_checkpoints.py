"""The trainer's checkpoints under what goes wrong on real disks: a user's own files beside them, a write killed
halfway, a checkpoint edited by hand or written by another program, a pickle that asks for code, a full disk.

The properties: rotation and ``resume=False`` remove only the trainer's own files (exact names, regular files);
the next start removes what a killed write left and nothing else; a checkpoint that breaks the schema is a
``CheckpointFormatError`` naming the file and the field, for the trainer and for ``export --checkpoint`` alike
(hypothesis fuzzes the reader with mutations of a real checkpoint); a full disk is a ``CheckpointWriteError``
naming the file, and the earlier checkpoints stay byte for byte.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_hf.core.errors import CheckpointFormatError, CheckpointWriteError, FlodlHFError
from flodl_hf.roundtrip.export import read_trainer_checkpoint
from flodl_hf.training import checkpoints
from flodl_hf.training.checkpoints import latest_checkpoint, load_checkpoint
from test_trainer import Indexed, Net, trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TESTS = Path(__file__).resolve().parent


def _fit(directory: Path, steps: int, **kw: Any) -> dict:
    """A toy run checkpointing every step (40 samples, 5 steps an epoch)."""
    return trainer(Net(0), Indexed(40), directory, max_steps=steps, checkpoint_every=1, sync="none", **kw).fit()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- 1. rotation and resume=False remove the trainer's own files only --------------------------------------

USER_FILES = ["step-00000001.pt.bak", "step-00000001.notes.txt", "step-00000002.onnx", "step-00000001.rank-1.pt.old",
              "step-00000002-best.pt", "step-00000001.pt~"]


def test_rotation_removes_only_the_trainers_own_files(tmp_path):
    for name in USER_FILES:
        (tmp_path / name).write_text("mine")
    (tmp_path / "step-00000001.d").mkdir()  # a user's directory named like a checkpoint's files
    (tmp_path / "step-00000001.d" / "keep.txt").write_text("mine")
    (tmp_path / "step-00000002.rank-1.pt").mkdir()  # even exactly like a side file's
    _fit(tmp_path, 4, keep_checkpoints=2)
    assert all((tmp_path / name).read_text() == "mine" for name in USER_FILES)
    assert (tmp_path / "step-00000001.d" / "keep.txt").read_text() == "mine"
    assert (tmp_path / "step-00000002.rank-1.pt").is_dir()
    assert sorted(p.name for p in tmp_path.glob("step-*.pt") if p.is_file()) == [
        "step-00000002-best.pt", "step-00000003.pt", "step-00000004.pt"]


def test_lookalike_directories_and_links_are_neither_resumed_nor_removed(tmp_path):
    _fit(tmp_path, 2)
    (tmp_path / "step-00000009.pt").mkdir()  # newer by its name, but a directory
    (tmp_path / "step-00000009.pt" / "mine.txt").write_text("mine")
    target = tmp_path.parent / f"{tmp_path.name}-elsewhere.pt"
    target.write_text("mine")
    (tmp_path / "step-00000008.pt").symlink_to(target)
    t = trainer(Net(0), Indexed(40), tmp_path, max_steps=3, checkpoint_every=1, sync="none")
    t.fit()
    assert t.resumed_from == tmp_path / "step-00000002.pt"
    with pytest.warns(UserWarning, match=r"removed 2 checkpoint file\(s\)"):
        trainer(Net(0), Indexed(40), tmp_path, max_steps=1, sync="none", resume=False).fit()
    assert (tmp_path / "step-00000009.pt" / "mine.txt").read_text() == "mine"
    assert (tmp_path / "step-00000008.pt").is_symlink() and target.read_text() == "mine"
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000001.pt"


# ---- 2. what a killed write leaves ----------------------------------------------------------------------------

KILLED = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from test_trainer import Indexed, Net, trainer

def dying(obj, f):  # a checkpoint write killed halfway
    f.write(b"PK half a checkpoint")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = dying
trainer(Net(0), Indexed(40), {directory!r}, max_steps=3, checkpoint_every=1, sync="none").fit()
"""


def test_a_killed_write_leaves_a_temporary_that_the_next_start_removes(tmp_path):
    _fit(tmp_path, 2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", KILLED.format(tests=str(TESTS), directory=str(tmp_path))], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    left = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(left) == 1 and left[0].startswith(".step-00000003.pt.tmp-"), left
    killed = left[0]
    stem, pid = killed.rsplit("-", 1)
    others = [f"{stem}-{os.getppid()}",                                   # a live writer's (not this process)
              f".step-00000003.pt.tmp-another.host-{pid}",                # another host's: its pid is not ours to judge
              ".step-00000003.pt.tmp-notes", "step-00000003.pt.tmp-1"]    # a user's, named otherwise
    for name in others:
        (tmp_path / name).write_text("mine")
    (tmp_path / f".step-00000004.pt.tmp-{pid}").mkdir()  # a directory, named as a temporary of old
    with pytest.warns(UserWarning, match=rf"removed 1 temporary file\(s\) that a killed checkpoint write left "
                                         rf".*: {re.escape(killed)}$"):
        summary = _fit(tmp_path, 3)
    assert not (tmp_path / killed).exists()
    assert all((tmp_path / name).read_text() == "mine" for name in others)
    assert (tmp_path / f".step-00000004.pt.tmp-{pid}").is_dir()
    assert summary["step"] == 3 and load_checkpoint(tmp_path)["step"] == 3


# ---- 3. a checkpoint that breaks the schema: a typed error naming the file and the field ----------------------

def _replace(node: Any, path: tuple, value: Any) -> Any:
    """``node`` with the entry at ``path`` (keys and indices) set to ``value``, or removed where ``value`` is
    ``DELETE``; copied along the path only (a tuple stays a tuple). A path that is not there changes nothing."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(node, dict) and key in node:
        node = dict(node)
        if not rest and value is DELETE:
            del node[key]
        else:
            node[key] = _replace(node[key], rest, value)
    elif isinstance(node, (list, tuple)) and isinstance(key, int) and key < len(node) and value is not DELETE:
        items = list(node)
        items[key] = _replace(items[key], rest, value)
        node = items if isinstance(node, list) else tuple(items)
    return node


def _set(*path: Any, to: Any) -> Callable[[dict], dict]:
    return lambda data: _replace(data, path, to)


DELETE = object()

# (name, edit, the field the message names, whether export reads the field too)
EDITS = [
    ("no-worker", _set("worker", to=DELETE), "'worker'", False),
    ("worker-a-list", _set("worker", to=[]), "'worker'", True),
    ("no-optimizer", _set("worker", "optimizer", to=DELETE), "'worker.optimizer'", False),
    ("optimizer-a-string", _set("worker", "optimizer", to="adamw"), "'worker.optimizer'", True),
    ("lr-a-string", _set("worker", "optimizer", "param_groups", 0, "lr", to="fast"), "param_groups[0].lr", False),
    ("moment-of-another-shape", _set("worker", "optimizer", "state", 0, "exp_avg", to=torch.zeros(3)),
     "state[0].exp_avg", False),
    ("scheduler-epoch-a-string", _set("worker", "scheduler", "last_epoch", to="two"),
     "'worker.scheduler.last_epoch'", False),
    ("model-entry-a-string", _set("model", "body.0.weight", to="w"), "model entry 'body.0.weight'", True),
    ("model-entry-a-list", _set("model", "norm.running_mean", to=[0.0] * 6), "model entry 'norm.running_mean'", True),
    ("negative-epoch", _set("epoch", to=-1), "'epoch'", True),
    ("epoch-a-float", _set("epoch", to=0.0), "'epoch'", True),
    ("position-past-the-data", _set("position", to=400), "'position'", True),
    ("step-not-its-point", _set("step", to=7), "'step'", False),
    ("step-a-string", _set("step", to="2"), "'step'", True),
    ("samples-missing", _set("samples", to=DELETE), "'samples'", False),
    ("train-time-nan", _set("train_time", to=float("nan")), "'train_time'", True),
    ("world-size-zero", _set("world_size", to=0), "'world_size'", True),
    ("sync-unknown", _set("sync", to="all-reduce"), "'sync'", True),
    ("el-che-counts-a-string", _set("el_che", to={"anchor": 2, "counts": "22", "ms_per_batch": [None]}),
     "'el_che.counts'", True),
    ("batches-a-float", _set("worker", "batches", to=2.5), "'worker.batches'", True),
    ("rng-torch-a-list", _set("worker", "rng", "torch", to=[1, 2, 3]), "'worker.rng.torch'", True),
    ("rng-python-short", _set("worker", "rng", "python", to=[3, [0] * 10, None]), "'worker.rng.python'", True),
    ("lora-a-string", _set("lora", to="r=8"), "'lora'", True),
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real run's checkpoint (step 2), written once; each test edits a copy."""
    directory = tmp_path_factory.mktemp("run")
    _fit(directory, 2, keep_checkpoints=1)
    return directory


def _edited(run_dir: Path, tmp: Path, edit: Callable[[dict], dict]) -> Path:
    data = edit(torch.load(run_dir / "step-00000002.pt", weights_only=True))
    path = tmp / "step-00000002.pt"
    torch.save(data, path)
    return path


@pytest.mark.parametrize("name,edit,field,export_reads", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_checkpoint_is_refused_naming_the_file_and_the_field(run_dir, tmp_path, name, edit, field,
                                                                       export_reads):
    path = _edited(run_dir, tmp_path, edit)
    with pytest.raises(CheckpointFormatError) as info:
        trainer(Net(1), Indexed(40), tmp_path, max_steps=3, checkpoint_every=1, sync="none").fit()
    message = str(info.value)
    assert str(path) in message and field in message, message
    assert "or pass resume=False to start fresh" in message
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".pt") == [path.name]  # nothing written
    if export_reads:  # export --checkpoint reads by the same schema
        with pytest.raises(CheckpointFormatError) as info:
            read_trainer_checkpoint(path)
        assert str(path) in str(info.value) and field in str(info.value), str(info.value)


def test_a_side_file_is_read_by_the_schema_too(run_dir, tmp_path):
    main = torch.load(run_dir / "step-00000002.pt", weights_only=True)
    side = tmp_path / "step-00000002.rank-1.pt"
    good = {"format": main["format"], "version": 1, "step": 2, "worker": {"rng": main["worker"]["rng"], "batches": 2}}
    torch.save(good, side)
    assert load_checkpoint(side, kind="side")["step"] == 2
    for edit, field in ((_set("worker", to=DELETE), "'worker'"), (_set("step", to=-2), "'step'"),
                        (_set("worker", "rng", "torch", to="x"), "'worker.rng.torch'")):
        torch.save(edit(good), side)
        with pytest.raises(CheckpointFormatError, match=f"{side.name}: field {field}"):
            load_checkpoint(side, kind="side")


# ---- 3b. fuzzing the reader: mutations of a real checkpoint ---------------------------------------------------

FUZZ = settings(max_examples=120, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into the checkpoint's dicts and short lists (a long list, a tensor: a leaf)."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(node, (list, tuple)) and len(node) <= 8:
        for i, value in enumerate(node):
            out += _paths(value, prefix + (i,))
    return out


JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                  st.integers(), max_size=2),
    st.tuples(st.integers(), st.text(max_size=2)),
    st.sampled_from([torch.zeros(0), torch.ones(2, 3), torch.tensor([7], dtype=torch.int64), torch.tensor(1.5),
                     torch.zeros(5056, dtype=torch.uint8), torch.zeros(16, 6)]))


@pytest.fixture(scope="module")
def real(run_dir) -> tuple[dict, list[tuple]]:
    data = torch.load(run_dir / "step-00000002.pt", weights_only=True)
    return data, _paths(data)


@contextlib.contextmanager
def _mutated(real, picks):
    """A real checkpoint with the picked fields replaced or deleted, saved in a fresh directory."""
    data, paths = real
    for index, value, delete in picks:
        data = _replace(data, paths[index % len(paths)], DELETE if delete else value)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step-00000002.pt"
        torch.save(data, path)
        yield path


@FUZZ
@given(picks=st.lists(st.tuples(st.integers(0, 10**6), JUNK, st.booleans()), min_size=1, max_size=3))
def test_fuzz_the_checkpoint_reader(real, picks):
    """Whatever the mutations, load_checkpoint and export's reader load the file or raise a
    CheckpointFormatError naming it; never another exception type."""
    with _mutated(real, picks) as path:
        for reader in (load_checkpoint, read_trainer_checkpoint):
            try:
                state = reader(path)
            except CheckpointFormatError as exc:
                assert str(path) in str(exc), str(exc)
            else:
                if reader is load_checkpoint:
                    _usable(state)


def _usable(state: dict) -> None:
    """What a resume reads straight from a checkpoint the trainer's reader let through, and how it uses it."""
    for key in ("step", "epoch", "position", "samples", "world_size"):
        assert type(state[key]) is int and state[key] >= (key == "world_size"), key
    assert state["position"] < state.get("data_size", state["position"] + 1)
    assert isinstance(state["train_time"], (int, float)) and state["train_time"] >= 0
    assert all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state["model"].items())
    worker = state["worker"]
    assert isinstance(worker["optimizer"], dict) and isinstance(worker["optimizer"]["param_groups"], list)
    assert isinstance(worker.get("batches", 0), int) and isinstance(worker.get("scheduler", {}), (dict, type(None)))
    assert "rng" not in worker or (isinstance(worker["rng"], dict)
                                   and isinstance(worker["rng"].get("torch"), torch.Tensor))


@settings(FUZZ, max_examples=40)
@given(picks=st.lists(st.tuples(st.integers(0, 10**6), JUNK, st.booleans()), min_size=1, max_size=2))
def test_fuzz_a_resume_from_a_mutated_checkpoint(real, picks):
    """Through the whole resume and one more step: a clean run, or a flodl-hf error naming the file."""
    with _mutated(real, picks) as path:
        tmp = str(path.parent)
        try:
            trainer(Net(1), Indexed(40), tmp, max_steps=3, sync="none", log_dir=Path(tmp) / "log").fit()
        except FlodlHFError as exc:
            assert str(path) in str(exc), str(exc)


# ---- 4. a pickle that asks for code ---------------------------------------------------------------------------

class _Runs:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Custom:
    pass


def test_a_pickle_that_asks_for_code_is_named_so(tmp_path):
    marker = tmp_path / "ran"
    for payload, named in ((_Runs(marker), "posix.system"), (_Custom(), "test_hardening_checkpoints._Custom")):
        path = tmp_path / "step-00000001.pt"
        torch.save({"format": "flodl-hf/trainer-checkpoint", "version": 1, "model": {"w": payload}}, path)
        for reader in (load_checkpoint, read_trainer_checkpoint):
            with pytest.raises(CheckpointFormatError) as info:
                reader(path)
            message = str(info.value)
            assert f"{path}: refused: its pickle asks for code ({named})" in message, message
            assert "truncated" not in message
    assert not marker.exists()
    path.write_bytes(path.read_bytes()[:200])  # a truncated file is still called one
    with pytest.raises(CheckpointFormatError, match="not a readable trainer checkpoint"):
        load_checkpoint(path)


# ---- 5. a full disk -------------------------------------------------------------------------------------------

class _FillingFile:
    """A file object whose writes fail with ENOSPC once ``room`` bytes are written, as a full disk's do."""

    def __init__(self, f: Any, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def __enter__(self) -> "_FillingFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.f.close()


def _chain(exc: BaseException | None) -> list[BaseException]:
    out = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def test_a_full_disk_is_a_typed_error_and_the_earlier_checkpoints_stay(tmp_path, monkeypatch):
    _fit(tmp_path, 2)
    before = {p.name: _digest(p) for p in tmp_path.glob("step-*.pt")}
    monkeypatch.setattr(checkpoints, "open", lambda path, mode: _FillingFile(open(path, mode), 4096), raising=False)
    with pytest.raises(CheckpointWriteError) as info:
        _fit(tmp_path, 3)
    message = str(info.value)
    assert str(tmp_path / "step-00000003.pt") in message and "the disk is full" in message, message
    assert "earlier checkpoints" in message and info.value.errno == errno.ENOSPC
    assert any("unexpected pos" in str(e) for e in _chain(info.value))  # torch's own error, at its own write
    assert {p.name: _digest(p) for p in tmp_path.glob("step-*.pt")} == before  # intact, byte for byte
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    monkeypatch.undo()
    assert _fit(tmp_path, 3)["step"] == 3  # with room again, the run resumes from step 2


def test_a_real_full_tmpfs(tmp_path):
    """The same on a real 1 MiB tmpfs (root only): torch raises its ``unexpected pos``, we name the full disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        _fit(disk, 1, log_dir=tmp_path / "log")
        first = _digest(disk / "step-00000001.pt")
        size = (disk / "step-00000001.pt").stat().st_size
        with open(disk / "filler", "wb", buffering=0) as f:  # fill the disk, then leave less room than a
            try:                                                # checkpoint takes
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        os.truncate(disk / "filler", (disk / "filler").stat().st_size - size // 2)
        with pytest.raises(CheckpointWriteError, match=r"step-00000002\.pt: cannot write this checkpoint, the disk "
                                                       r"is full \(No space left on device\)") as info:
            _fit(disk, 2, log_dir=tmp_path / "log")
        assert any("unexpected pos" in str(e) for e in _chain(info.value))  # what torch raised
        assert _digest(disk / "step-00000001.pt") == first
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "step-00000001.pt"]
    finally:
        subprocess.run(["umount", str(disk)], check=True)
