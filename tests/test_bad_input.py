"""Bad input, as an attacker or a careless user would give it: one table of cases, grouped by entry point.

Every case builds its bad input under ``tmp_path`` (from checkpoints transformers wrote,
``helpers.make_checkpoint``), calls one public entry point, and asserts three things:
the exception type; that the message names the file, key or field at fault; and that
nothing was written or deleted (``tree_hash`` of ``tmp_path``, which holds the source and
``--out``, and of any source outside it, before and after). The tests after the table cover
what is not an error: the atomic swap under SIGKILL, formats real checkpoints use, the tied
decoder against transformers, empty task inputs and the registry.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from flodl_hf import AutoConfig, AutoTokenizer, answer, classify, embed, fill_mask, rank, tag, zero_shot
from flodl_hf.core import io
from flodl_hf.auto import AutoModelForMaskedLM, load_model
from flodl_hf.roundtrip.convert import convert
from flodl_hf.core.errors import (CheckpointFormatError, ConfigError, InputError, MissingHeadError,
                                  OutputExistsError, RegistryError, SourceNotFoundError, UnsupportedModelError,
                                  WeightsMismatchError)
from flodl_hf.core.fs import KILL_ENV, STAGES, recover_scratch
from flodl_hf.roundtrip.export import export, export_checkpoint
from flodl_hf.core.validate import tree_hash
from flodl_hf.roundtrip.matrix import tiny_config
from helpers import CACHE as CACHE_DIR, make_checkpoint, quiet_transformers

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _tiny(task: str = "mlm", model_type: str = "bert") -> Path:
    return make_checkpoint(tiny_config(model_type, None, task), task)


# ---- building bad checkpoints -------------------------------------------------------------------------

EXT = {"safetensors": "safetensors", "bin": "bin"}
STEM = {"safetensors": "model", "bin": "pytorch_model"}
INDEX = {"safetensors": io.SAFE_INDEX, "bin": io.BIN_INDEX}


def _save(tensors: dict, path: Path, fmt: str) -> None:
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    else:
        torch.save(tensors, path)


def source(tmp: Path, task: str = "mlm", fmt: str = "safetensors", shards: int = 1, model_type: str = "bert",
           name: str = "src") -> Path:
    """A copy of a tiny transformers checkpoint under ``tmp``, its weights in ``fmt``, in ``shards`` files."""
    orig = _tiny(task, model_type)
    dst = tmp / name
    dst.mkdir()
    shutil.copy(orig / "config.json", dst / "config.json")
    tensors = load_file(orig / "model.safetensors")
    if shards == 1:
        _save(tensors, dst / f"{STEM[fmt]}.{EXT[fmt]}", fmt)
        return dst
    keys = sorted(tensors)
    size = math.ceil(len(keys) / shards)
    weight_map = {}
    for i in range(shards):
        shard = f"{STEM[fmt]}-{i + 1:05d}-of-{shards:05d}.{EXT[fmt]}"
        part = keys[i * size:(i + 1) * size]
        _save({k: tensors[k] for k in part}, dst / shard, fmt)
        weight_map.update(dict.fromkeys(part, shard))
    (dst / INDEX[fmt]).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def shard_name(fmt: str, i: int = 1, n: int = 2) -> str:
    return f"{STEM[fmt]}-{i:05d}-of-{n:05d}.{EXT[fmt]}"


def edit_index(src: Path, fmt: str, change: Callable[[dict], Any]) -> None:
    path = src / INDEX[fmt]
    data = json.loads(path.read_text())
    new = change(data)
    data = data if new is None else new
    path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())


def keys_of(src: Path, fmt: str, shard: str) -> list[str]:
    data = json.loads((src / INDEX[fmt]).read_text())["weight_map"]
    return sorted(k for k, v in data.items() if v == shard)


def _read(path: Path, fmt: str) -> dict:
    return load_file(path) if fmt == "safetensors" else torch.load(path, weights_only=True)


def edit_config(src: Path, **changes: Any) -> None:
    path = src / "config.json"
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is DELETE:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


DELETE = object()


# ---- the table ---------------------------------------------------------------------------------------------

@dataclass
class Case:
    entry: str                                   # the public entry point the case calls
    name: str
    make: Callable[[Path], Path]                 # builds the bad input under tmp, returns the source
    call: Callable[[Path, Path], Any]            # (source, tmp) -> the call
    error: type[BaseException]
    named: Callable[[Path, Path], str] | str     # what the message must name (file, key or field)
    kind: int                                    # the issue's case class (1 data loss ... 6 typed errors)

    @property
    def id(self) -> str:
        return f"{self.entry}:{self.name}"


CASES: list[Case] = []
KIND = 0  # the class of the cases declared next
KINDS = {1: "data loss in export/convert", 2: "reads outside the checkpoint", 3: "silently wrong model",
         4: "hang or huge allocation", 5: "formats real checkpoints use", 6: "typed errors elsewhere"}


def case(entry: str, name: str, make, call, error, named, kind: int | None = None) -> None:
    CASES.append(Case(entry, name, make, call, error, named, kind or KIND))


# Entry points a checkpoint source goes through.
LOADERS: dict[str, Callable[[Path, Path], Any]] = {
    "AutoModelForMaskedLM.from_pretrained": lambda s, t: AutoModelForMaskedLM.from_pretrained(s),
    "export": lambda s, t: export(s, t / "out"),
}


def _out(src: Path, tmp: Path) -> Path:
    return tmp / "out"


# ---- 2. nothing outside the checkpoint is read: shard indexes (safetensors and .bin) ------------------

def _index_cases(fmt: str) -> list[tuple[str, Callable[[Path], Path], type, Callable[[Path, Path], str] | str]]:
    s1, s2 = shard_name(fmt, 1), shard_name(fmt, 2)
    out: list = []

    def sharded(tmp: Path) -> Path:
        return source(tmp, fmt=fmt, shards=2)

    def outside(kind: str):
        def make(tmp: Path) -> Path:
            src = sharded(tmp)
            stolen = tmp / f"outside.{EXT[fmt]}"
            shutil.copy(src / s1, stolen)
            if kind == "dotdot":
                edit_index(src, fmt, lambda d: d["weight_map"].update({k: f"../outside.{EXT[fmt]}"
                                                                       for k in keys_of(src, fmt, s1)}))
            elif kind == "absolute":
                edit_index(src, fmt, lambda d: d["weight_map"].update({k: str(stolen) for k in keys_of(src, fmt, s1)}))
            elif kind == "symlink":
                (src / s1).unlink()
                (src / s1).symlink_to(stolen)
            elif kind == "dotdot-inside":  # sub/../../outside: '..' is refused even where it would come back
                edit_index(src, fmt, lambda d: d["weight_map"].update({k: f"sub/../../outside.{EXT[fmt]}"
                                                                       for k in keys_of(src, fmt, s1)}))
            return src
        return make
    out.append(("shard-dotdot", outside("dotdot"), CheckpointFormatError, "../outside"))
    out.append(("shard-absolute", outside("absolute"), CheckpointFormatError, "outside"))
    out.append(("shard-symlink-out", outside("symlink"), CheckpointFormatError, s1))
    out.append(("shard-sub-dotdot", outside("dotdot-inside"), CheckpointFormatError, "sub/../../outside"))

    def key_unnamed(tmp: Path) -> Path:
        src = sharded(tmp)
        key = keys_of(src, fmt, s2)[0]
        edit_index(src, fmt, lambda d: (d["weight_map"].pop(key), None)[1])
        return src
    out.append(("key-in-unnamed-shard", key_unnamed, CheckpointFormatError,
                lambda s, t: keys_of_original(fmt, s2)[0]))

    def key_moved(tmp: Path) -> Path:
        src = sharded(tmp)
        key = keys_of(src, fmt, s2)[0]
        edit_index(src, fmt, lambda d: d["weight_map"].update({key: s1}))
        return src
    out.append(("key-assigned-elsewhere", key_moved, CheckpointFormatError, lambda s, t: keys_of_original(fmt, s2)[0]))

    def key_twice(tmp: Path) -> Path:
        src = sharded(tmp)
        first = _read(src / s1, fmt)
        second = _read(src / s2, fmt)
        key = sorted(first)[0]
        second[key] = first[key] + 1.0  # a different value: which one would win?
        _save(second, src / s2, fmt)
        return src
    out.append(("key-in-two-shards", key_twice, CheckpointFormatError, lambda s, t: keys_of_original(fmt, s1)[0]))

    def key_absent(tmp: Path) -> Path:
        src = sharded(tmp)
        edit_index(src, fmt, lambda d: d["weight_map"].update({"bert.extra.weight": s1}))
        return src
    out.append(("key-missing-from-its-shard", key_absent, CheckpointFormatError, "bert.extra.weight"))

    def missing_shard(tmp: Path) -> Path:
        src = sharded(tmp)
        (src / s2).unlink()
        return src
    out.append(("shard-file-missing", missing_shard, CheckpointFormatError, s2))

    def shape(value: Any, label: str):
        def make(tmp: Path) -> Path:
            src = sharded(tmp)
            if isinstance(value, bytes):
                (src / INDEX[fmt]).write_bytes(value)
            else:
                edit_index(src, fmt, lambda d: value(d) if callable(value) else value)
            return src
        out.append((label, make, CheckpointFormatError, INDEX[fmt]))
    shape(lambda d: {"weight_map": list(d["weight_map"])}, "weight_map-list")
    shape(lambda d: {"weight_map": s1}, "weight_map-string")
    shape(lambda d: {"weight_map": {k: 1 for k in d["weight_map"]}}, "weight_map-int-values")
    shape(lambda d: {"weight_map": {k: None for k in d["weight_map"]}}, "weight_map-null-values")
    shape(lambda d: {"weight_map": {k: [v] for k, v in d["weight_map"].items()}}, "weight_map-list-values")
    shape({"weight_map": {}}, "weight_map-empty")
    shape({"metadata": {}}, "no-weight_map")
    shape([1, 2], "index-array")
    shape(b"{\"weight_map\": ", "index-truncated-json")
    shape(b"\xff\xfe\x00{bad", "index-not-utf8")
    shape(b"", "index-empty-file")
    shape(lambda d: {"weight_map": {k: f"{v}\x00" for k, v in d["weight_map"].items()}}, "shard-name-nul")
    shape(lambda d: {"weight_map": {k: "" for k in d["weight_map"]}}, "shard-name-empty")
    shape(lambda d: {"weight_map": {k: "." for k in d["weight_map"]}}, "shard-name-dot")
    return out


def keys_of_original(fmt: str, shard: str) -> list[str]:
    """The keys ``source(..., shards=2)`` puts in ``shard`` (deterministic: sorted keys, split in two)."""
    keys = sorted(load_file(_tiny("mlm") / "model.safetensors"))
    half = math.ceil(len(keys) / 2)
    return keys[:half] if shard == shard_name(fmt, 1) else keys[half:]


KIND = 2
for _fmt in ("safetensors", "bin"):
    for _name, _make, _error, _named in _index_cases(_fmt):
        for _entry, _call in LOADERS.items():
            case(_entry, f"{_fmt}-{_name}", _make, _call, _error, _named)
        if _fmt == "bin":
            case("convert", f"bin-{_name}", _make, lambda s, t: convert(s, t / "out"), _error, _named)


# ---- 1. export / convert never lose data ---------------------------------------------------------------

def _export_into(where: Callable[[Path, Path], Path], force: bool = True, **kw: Any):
    return lambda s, t: export(s, where(s, t), force=force, **kw)


def _src_and_old_export(tmp: Path) -> Path:
    src = source(tmp)
    export(src, tmp / "out")
    return src


def _user_dir(tmp: Path) -> Path:
    src = source(tmp)
    (tmp / "out").mkdir()
    (tmp / "out" / "thesis.tex").write_text("years of work")
    return src


def _with_link(tmp: Path) -> Path:
    src = source(tmp)
    (tmp / "link").symlink_to(src)
    return src


def _with_parent_link(tmp: Path) -> Path:
    src = source(tmp)
    (tmp / "plink").symlink_to(tmp)
    return src


def _single_file(tmp: Path) -> Path:
    return source(tmp) / "model.safetensors"


def _with_tokenizer_dir(tmp: Path) -> Path:
    src = source(tmp)
    (tmp / "tok").mkdir()
    (tmp / "tok" / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    return src


KIND = 1
OUT_CASES = [
    ("out-is-source", lambda s, t: s, "is the source"),
    ("out-is-source-no-force", lambda s, t: s, "is the source"),
    ("out-is-parent-of-source", lambda s, t: t, "contains the source"),
    ("out-is-grandparent", lambda s, t: t.parent, "contains the source"),
    ("out-is-source-via-dotdot", lambda s, t: s / ".." / s.name, "is the source"),
    ("out-inside-source", lambda s, t: s / "exported", "is inside the source"),
    ("out-deep-inside-source", lambda s, t: s / "a" / "b", "is inside the source"),
    ("out-trailing-dot", lambda s, t: s / ".", "is the source"),
]
for _name, _where, _named in OUT_CASES:
    _force = not _name.endswith("no-force")
    case("export", _name, source, _export_into(_where, _force), OutputExistsError, _named)
    case("convert", _name, lambda t: source(t, fmt="bin"), lambda s, t, w=_where, f=_force: convert(s, w(s, t), force=f),
         OutputExistsError, _named)
case("export", "out-is-symlink-to-source", _with_link, _export_into(lambda s, t: t / "link"), OutputExistsError,
     "is the source")
case("convert", "out-is-symlink-to-source", _with_link, lambda s, t: convert(s, t / "link", force=True),
     OutputExistsError, "is the source")
case("export", "out-through-symlinked-parent", _with_parent_link,
     _export_into(lambda s, t: t / "plink" / s.name), OutputExistsError, "is the source")
case("export", "out-user-dir-force", _user_dir, _export_into(_out), OutputExistsError, "did not write")
case("export", "out-user-dir-no-force", _user_dir, _export_into(_out, force=False), OutputExistsError, "already exists")
case("convert", "out-user-dir-force", lambda t: (_user_dir(t), shutil.rmtree(t / "src"), source(t, fmt="bin"))[2],
     lambda s, t: convert(s, t / "out", force=True), OutputExistsError, "did not write")
case("export", "out-old-export-no-force", _src_and_old_export, _export_into(_out, force=False), OutputExistsError,
     "already exists")
case("export", "out-is-a-file", lambda t: (source(t), (t / "out").write_text("mine"))[0], _export_into(_out),
     OutputExistsError, "existing file")
case("export", "out-is-symlink-to-empty-dir", lambda t: ((t / "e").mkdir(), (t / "out").symlink_to(t / "e"),
                                                         source(t))[2], _export_into(_out), OutputExistsError,
     "symbolic link")
case("export", "out-contains-tokenizer-source", _with_tokenizer_dir,
     lambda s, t: export(s, t / "tok" / "..", force=True, tokenizer=t / "tok"), OutputExistsError, "the source")
case("export", "single-file-out-is-its-dir", _single_file, _export_into(lambda s, t: s.parent), OutputExistsError,
     "the source")
case("export", "single-file-out-is-parent", _single_file, _export_into(lambda s, t: t), OutputExistsError,
     "the source")
case("export", "single-file-out-is-the-file", _single_file, _export_into(lambda s, t: s), OutputExistsError,
     "the source")


def _bin_with_link_out(tmp: Path) -> Path:
    src = source(tmp, fmt="bin")
    (tmp / "secret.txt").write_text("private")
    (src / "notes.txt").symlink_to(tmp / "secret.txt")
    return src


case("convert", "side-file-symlink-out", _bin_with_link_out, lambda s, t: convert(s, t / "out"),
     CheckpointFormatError, "notes.txt", kind=2)
case("convert", "already-safetensors", source, lambda s, t: convert(s, t / "out"), CheckpointFormatError,
     "model.safetensors", kind=6)


# ---- 3/4. config.json: typed errors naming the field -----------------------------------------------------

KIND = 3
CONFIG_CASES: list[tuple[str, dict, str, type]] = [
    ("layers-float", {"num_hidden_layers": 2.0}, "num_hidden_layers", ConfigError),
    ("layers-string", {"num_hidden_layers": "2"}, "num_hidden_layers", ConfigError),
    ("layers-list", {"num_hidden_layers": [2]}, "num_hidden_layers", ConfigError),
    ("layers-bool", {"num_hidden_layers": True}, "num_hidden_layers", ConfigError),
    ("layers-negative", {"num_hidden_layers": -1}, "num_hidden_layers", ConfigError),
    ("layers-null", {"num_hidden_layers": None}, "num_hidden_layers", ConfigError),
    ("hidden-zero", {"hidden_size": 0}, "hidden_size", ConfigError),
    ("hidden-negative", {"hidden_size": -32}, "hidden_size", ConfigError),
    ("hidden-2pow40", {"hidden_size": 2**40}, "hidden_size", ConfigError),
    ("hidden-float", {"hidden_size": 32.5}, "hidden_size", ConfigError),
    ("hidden-not-multiple-of-heads", {"hidden_size": 33}, "num_attention_heads", ConfigError),
    ("heads-zero", {"num_attention_heads": 0}, "num_attention_heads", ConfigError),
    ("heads-string", {"num_attention_heads": "4"}, "num_attention_heads", ConfigError),
    ("vocab-zero", {"vocab_size": 0}, "vocab_size", ConfigError),
    ("vocab-negative", {"vocab_size": -1}, "vocab_size", ConfigError),
    ("vocab-string", {"vocab_size": "99"}, "vocab_size", ConfigError),
    ("vocab-huge", {"vocab_size": 2**62}, "vocab_size", ConfigError),
    ("pad-negative", {"pad_token_id": -1}, "pad_token_id", ConfigError),
    ("pad-past-vocab", {"pad_token_id": 10**6}, "pad_token_id", ConfigError),
    ("pad-float", {"pad_token_id": 1.5}, "pad_token_id", ConfigError),
    ("eps-zero", {"layer_norm_eps": 0}, "layer_norm_eps", ConfigError),
    ("eps-negative", {"layer_norm_eps": -1e-12}, "layer_norm_eps", ConfigError),
    ("eps-nan", {"layer_norm_eps": float("nan")}, "layer_norm_eps", ConfigError),
    ("eps-inf", {"layer_norm_eps": float("inf")}, "layer_norm_eps", ConfigError),
    ("eps-string", {"layer_norm_eps": "1e-12"}, "layer_norm_eps", ConfigError),
    ("dropout-above-one", {"hidden_dropout_prob": 1.5}, "hidden_dropout_prob", ConfigError),
    ("dropout-negative", {"attention_probs_dropout_prob": -0.1}, "attention_probs_dropout_prob", ConfigError),
    ("dropout-string", {"hidden_dropout_prob": "0.1"}, "hidden_dropout_prob", ConfigError),
    ("classifier-dropout-2", {"classifier_dropout": 2}, "classifier_dropout", ConfigError),
    ("intermediate-zero", {"intermediate_size": 0}, "intermediate_size", ConfigError),
    ("positions-zero", {"max_position_embeddings": 0}, "max_position_embeddings", ConfigError),
    ("type-vocab-negative", {"type_vocab_size": -1}, "type_vocab_size", ConfigError),
    ("hidden-act-unknown", {"hidden_act": "swishy"}, "hidden_act", ConfigError),
    ("hidden-act-int", {"hidden_act": 5}, "hidden_act", ConfigError),
    ("id2label-list", {"id2label": ["a", "b"]}, "id2label", ConfigError),
    ("id2label-bad-ids", {"id2label": {"x": "a"}}, "id2label", ConfigError),
    ("problem-type-bogus", {"problem_type": "bogus"}, "problem_type", ConfigError),
    ("tie-flag-string", {"tie_word_embeddings": "yes"}, "tie_word_embeddings", ConfigError),
    ("model-type-int", {"model_type": 5}, "model_type", ConfigError),
    ("model-type-list", {"model_type": ["bert"]}, "model_type", ConfigError),
    ("model-type-unknown", {"model_type": "gpt9"}, "gpt9", UnsupportedModelError),
    ("architectures-string", {"architectures": "BertForMaskedLM", "model_type": DELETE}, "architectures",
     ConfigError),
    ("architectures-ints", {"architectures": [1], "model_type": DELETE}, "architectures", ConfigError),
    ("no-type-no-architectures", {"architectures": DELETE, "model_type": DELETE}, "model_type", ConfigError),
    ("auto-map", {"auto_map": {"AutoModel": "x.Model"}}, "auto_map", ConfigError),
    ("decoder", {"is_decoder": True}, "is_decoder", ConfigError),
]
FAMILY_CONFIG_CASES = [
    ("distilbert", "n_layers-float", {"n_layers": 2.5}, "n_layers"),
    ("distilbert", "dim-zero", {"dim": 0}, "dim"),
    ("distilbert", "n_heads-zero", {"n_heads": 0}, "n_heads"),
    ("distilbert", "dim-not-multiple", {"dim": 33}, "n_heads"),
    ("distilbert", "dropout-above-one", {"dropout": 3.0}, "dropout"),
    ("albert", "groups-zero", {"num_hidden_groups": 0}, "num_hidden_groups"),
    ("albert", "embedding-zero", {"embedding_size": 0}, "embedding_size"),
    ("albert", "inner-group-zero", {"inner_group_num": 0}, "inner_group_num"),
    ("deberta-v2", "eps-zero", {"layer_norm_eps": 0.0}, "layer_norm_eps"),
    ("roberta", "pad-past-vocab", {"pad_token_id": 10**5}, "pad_token_id"),
]


def _config_src(changes: dict, model_type: str = "bert"):
    def make(tmp: Path) -> Path:
        src = source(tmp, model_type=model_type)
        edit_config(src, **changes)
        return src
    return make


for _name, _changes, _named, _error in CONFIG_CASES:
    _kind = 4 if _name in ("hidden-2pow40", "vocab-huge") else 3
    case("AutoConfig.from_pretrained", _name, _config_src(_changes), lambda s, t: AutoConfig.from_pretrained(s),
         _error, _named, _kind)
    case("load_model", _name, _config_src(_changes), lambda s, t: load_model(s), _error, _named, _kind)
for _mt, _name, _changes, _named in FAMILY_CONFIG_CASES:
    case("AutoConfig.from_pretrained", f"{_mt}-{_name}", _config_src(_changes, _mt),
         lambda s, t: AutoConfig.from_pretrained(s), ConfigError, _named)
KIND = 4
for _name, _changes, _named in [("layers-10e6", {"num_hidden_layers": 10**6}, "num_hidden_layers"),
                                ("layers-one-too-many", {"num_hidden_layers": 3}, "num_hidden_layers")]:
    case("load_model", _name, _config_src(_changes), lambda s, t: load_model(s), ConfigError, _named)
    case("export", _name, _config_src(_changes), lambda s, t: export(s, t / "out"), ConfigError, _named)
case("load_model", "distilbert-layers-10e6", _config_src({"n_layers": 10**6}, "distilbert"),
     lambda s, t: load_model(s), ConfigError, "n_layers")
case("load_model", "albert-groups-10e6", _config_src({"num_hidden_groups": 10**6}, "albert"),
     lambda s, t: load_model(s), ConfigError, "num_hidden_groups")
KIND = 3
case("load_model", "hidden-wider-than-file", _config_src({"hidden_size": 64}), lambda s, t: load_model(s),
     WeightsMismatchError, "bert.embeddings.word_embeddings.weight")


def _config_file(content: bytes | None):
    def make(tmp: Path) -> Path:
        src = source(tmp)
        (src / "config.json").unlink()
        if content is None:
            (src / "config.json").mkdir()
        else:
            (src / "config.json").write_bytes(content)
        return src
    return make


KIND = 6
for _name, _content in [("config-is-a-directory", None), ("config-not-utf8", b"\xff\xfe{}"),
                        ("config-not-json", b"{model_type: bert"), ("config-array", b"[1, 2]"),
                        ("config-empty", b""), ("config-deep-nesting", b"[" * 100000 + b"]" * 100000),
                        ("config-string", b"\"bert\"")]:
    case("AutoConfig.from_pretrained", _name, _config_file(_content), lambda s, t: AutoConfig.from_pretrained(s),
         ConfigError, "config.json")
    case("load_model", _name, _config_file(_content), lambda s, t: load_model(s), ConfigError, "config.json")
case("export", "config-is-a-directory", _config_file(None), lambda s, t: export(s, t / "out"), ConfigError,
     "config.json")


# ---- 5. weights files -------------------------------------------------------------------------------------

def _weights(mutate: Callable[[dict], dict], fmt: str = "safetensors"):
    def make(tmp: Path) -> Path:
        src = source(tmp, fmt=fmt)
        path = src / f"{STEM[fmt]}.{EXT[fmt]}"
        data = mutate(_read(path, fmt))
        if isinstance(data, bytes):
            path.write_bytes(data)
        elif fmt == "bin":
            torch.save(data, path)
        else:
            _save(data, path, fmt)
        return src
    return make


def _int_tensor(key: str):
    def mutate(d: dict) -> dict:
        d[key] = d[key].to(torch.int64)
        return d
    return mutate


KIND = 5
LN = "bert.embeddings.LayerNorm.weight"
for _fmt in ("safetensors", "bin"):
    case("load_model", f"{_fmt}-int-tensor-for-float", _weights(_int_tensor(LN), _fmt), lambda s, t: load_model(s),
         CheckpointFormatError, LN)
    case("load_model", f"{_fmt}-bool-tensor-for-float", _weights(lambda d: {**d, LN: d[LN] > 0}, _fmt),
         lambda s, t: load_model(s), CheckpointFormatError, LN)
    case("load_model", f"{_fmt}-complex-tensor-for-float", _weights(lambda d: {**d, LN: d[LN].to(torch.complex64)}, _fmt),
         lambda s, t: load_model(s), CheckpointFormatError, LN)
    case("load_model", f"{_fmt}-shape-mismatch", _weights(lambda d: {**d, LN: torch.zeros(3)}, _fmt),
         lambda s, t: load_model(s), WeightsMismatchError, LN)
    case("load_model", f"{_fmt}-missing-key", _weights(lambda d: {k: v for k, v in d.items() if k != LN}, _fmt),
         lambda s, t: load_model(s), WeightsMismatchError, LN)
    case("load_model", f"{_fmt}-truncated", _weights(lambda d: b"", _fmt), lambda s, t: load_model(s),
         CheckpointFormatError, f"{STEM[_fmt]}.{EXT[_fmt]}")
    case("load_model", f"{_fmt}-garbage", _weights(lambda d: b"\x00\x01garbage" * 50, _fmt), lambda s, t: load_model(s),
         CheckpointFormatError, f"{STEM[_fmt]}.{EXT[_fmt]}")
    case("export", f"{_fmt}-int-tensor-for-float", _weights(_int_tensor(LN), _fmt), lambda s, t: export(s, t / "out"),
         CheckpointFormatError, LN)


def _cut_file(fraction: float, fmt: str, legacy: bool = False):
    def make(tmp: Path) -> Path:
        src = source(tmp, fmt=fmt)
        path = src / f"{STEM[fmt]}.{EXT[fmt]}"
        if legacy:
            torch.save(_read(path, fmt), path, _use_new_zipfile_serialization=False)
        data = path.read_bytes()
        path.write_bytes(data[:int(len(data) * fraction)])
        return src
    return make


case("load_model", "bin-zip-cut-in-half", _cut_file(0.5, "bin"), lambda s, t: load_model(s), CheckpointFormatError,
     "pytorch_model.bin")
case("load_model", "bin-legacy-cut-in-half", _cut_file(0.5, "bin", legacy=True), lambda s, t: load_model(s),
     CheckpointFormatError, "legacy")
case("load_model", "safetensors-cut-in-half", _cut_file(0.5, "safetensors"), lambda s, t: load_model(s),
     CheckpointFormatError, "model.safetensors")
case("load_model", "safetensors-header-only", _cut_file(0.02, "safetensors"), lambda s, t: load_model(s),
     CheckpointFormatError, "model.safetensors")
case("load_model", "bin-int-keys", _weights(lambda d: {1: v for v in d.values()}, "bin"), lambda s, t: load_model(s),
     CheckpointFormatError, "key 1")
case("load_model", "bin-a-list", _weights(lambda d: list(d.values()), "bin"), lambda s, t: load_model(s),
     CheckpointFormatError, "pytorch_model.bin")
case("load_model", "bin-non-tensor-value", _weights(lambda d: {**d, "x": 3}, "bin"), lambda s, t: load_model(s),
     CheckpointFormatError, "'x'")
case("load_model", "weights-is-a-directory", lambda t: (lambda s: ((s / "model.safetensors").unlink(),
                                                                   (s / "model.safetensors").mkdir(), s)[2])(source(t)),
     lambda s, t: load_model(s), SourceNotFoundError, "src")


# ---- trainer checkpoints --------------------------------------------------------------------------------

def _trainer(payload: Callable[[dict, dict], Any]):
    def make(tmp: Path) -> Path:
        orig = _tiny("seqcls")
        state = load_file(orig / "model.safetensors")
        config = json.loads((orig / "config.json").read_text())
        path = tmp / "ckpt.pt"
        # the trainer's header (flodl_hf.core.checkpoint_schema): a file without it is not a trainer checkpoint
        torch.save({"format": "flodl-hf/trainer-checkpoint", "version": 1, **payload(state, config)}, path)
        return path
    return make


KIND = 6
case("export_checkpoint", "int-keys", _trainer(lambda s, c: {"model": {i: v for i, v in enumerate(s.values())},
                                                              "config": c}),
     lambda s, t: export_checkpoint(s, t / "out"), CheckpointFormatError, "model entry 0")
case("export_checkpoint", "model-a-list", _trainer(lambda s, c: {"model": list(s.values()), "config": c}),
     lambda s, t: export_checkpoint(s, t / "out"), CheckpointFormatError, "'model'")
case("export_checkpoint", "config-a-list", _trainer(lambda s, c: {"model": s, "config": [c]}),
     lambda s, t: export_checkpoint(s, t / "out"), CheckpointFormatError, "'config'")
case("export_checkpoint", "config-bad-field", _trainer(lambda s, c: {"model": s, "config": {**c, "hidden_size": 0}}),
     lambda s, t: export_checkpoint(s, t / "out"), ConfigError, "hidden_size")
case("export_checkpoint", "config-10e6-layers",
     _trainer(lambda s, c: {"model": s, "config": {**c, "num_hidden_layers": 10**6}}),
     lambda s, t: export_checkpoint(s, t / "out"), ConfigError, "num_hidden_layers", kind=4)
case("export_checkpoint", "config-int-keys", _trainer(lambda s, c: {"model": s, "config": {**c, 7: "x"}}),
     lambda s, t: export_checkpoint(s, t / "out"), ConfigError, "7")
KIND = 1
case("export_checkpoint", "out-is-the-checkpoint", _trainer(lambda s, c: {"model": s, "config": c}),
     lambda s, t: export_checkpoint(s, s, force=True), OutputExistsError, "ckpt.pt")
case("export_checkpoint", "out-contains-the-checkpoint", _trainer(lambda s, c: {"model": s, "config": c}),
     lambda s, t: export_checkpoint(s, t, force=True), OutputExistsError, "ckpt.pt")


# ---- 3. forward inputs ----------------------------------------------------------------------------------

_MODELS: dict[str, torch.nn.Module] = {}


def _model(task: str = "mlm", model_type: str = "bert") -> torch.nn.Module:
    key = f"{model_type}-{task}"
    if key not in _MODELS:
        _MODELS[key] = load_model(_tiny(task, model_type))
    return _MODELS[key]


def _ids(n: int = 6, batch: int = 2) -> torch.Tensor:
    return torch.arange(1, n + 1).repeat(batch, 1)


def _nothing(tmp: Path) -> Path:
    return tmp


KIND = 3
FORWARD_CASES: list[tuple[str, Callable[[], Any], str]] = [
    ("mask-shape", lambda: _model()(input_ids=_ids(), attention_mask=torch.ones(2, 5, dtype=torch.long)),
     "attention_mask"),
    ("mask-batch", lambda: _model()(input_ids=_ids(), attention_mask=torch.ones(3, 6, dtype=torch.long)),
     "attention_mask"),
    ("mask-a-list", lambda: _model()(input_ids=_ids(), attention_mask=[[1] * 6] * 2), "attention_mask"),
    ("token-types-shape", lambda: _model()(input_ids=_ids(), token_type_ids=torch.zeros(2, 7, dtype=torch.long)),
     "token_type_ids"),
    ("token-type-past-table", lambda: _model()(input_ids=_ids(), token_type_ids=torch.full((2, 6), 5)),
     "type_vocab_size"),
    ("id-past-vocab", lambda: _model()(input_ids=_ids() + 10**6), "vocab_size"),
    ("id-negative", lambda: _model()(input_ids=-_ids()), "vocab_size"),
    ("too-long", lambda: _model()(input_ids=_ids(n=10**4, batch=1)), "max_position_embeddings"),
    ("float-ids", lambda: _model()(input_ids=_ids().float()), "input_ids"),
    ("ids-a-list", lambda: _model()(input_ids=[[1, 2, 3]]), "input_ids"),
    ("ids-1d", lambda: _model()(input_ids=torch.arange(1, 5)), "input_ids"),
    ("positional-mask-shape", lambda: _model("base")(_ids(), torch.ones(2, 3)), "attention_mask"),
    ("seqcls-id-past-vocab", lambda: _model("seqcls")(input_ids=_ids() + 10**6), "vocab_size"),
    ("roberta-too-long", lambda: _model("mlm", "roberta")(input_ids=_ids(n=10**3, batch=1) % 50 + 3),
     "max_position_embeddings"),
    ("distilbert-mask-shape", lambda: _model("seqcls", "distilbert")(input_ids=_ids(),
                                                                     attention_mask=torch.ones(2, 2)), "attention_mask"),
]
for _name, _call, _named in FORWARD_CASES:
    case("forward", _name, _nothing, lambda s, t, c=_call: c(), InputError, _named)


# ---- 6. tokenizers -----------------------------------------------------------------------------------------

def _tokenizer_src(files: dict[str, bytes | None]):
    """A tiny checkpoint beside a WordPiece tokenizer whose files are replaced by ``files`` (None: removed)."""
    def make(tmp: Path) -> Path:
        from test_tasks import task_dir
        src = tmp / "src"
        shutil.copytree(task_dir("bert/tokenizer.json", "mlm"), src)
        for name, content in files.items():
            if (src / name).exists():
                (src / name).unlink()
            if content is not None:
                (src / name).write_bytes(content)
        return src
    return make


KIND = 6
TOKENIZER_FILE_CASES = [
    ("tokenizer-json-not-json", {"tokenizer.json": b"{\"model\": "}, "tokenizer.json"),
    ("tokenizer-json-array", {"tokenizer.json": b"[]"}, "tokenizer.json"),
    ("tokenizer-json-model-list", {"tokenizer.json": b"{\"model\": []}"}, "tokenizer.json"),
    ("tokenizer-json-no-model", {"tokenizer.json": b"{\"version\": \"1.0\"}"}, "tokenizer.json"),
    ("tokenizer-json-model-wrong", {"tokenizer.json": b"{\"model\": {\"type\": \"WordPiece\", \"vocab\": 5}}"},
     "tokenizer.json"),
    ("tokenizer-json-not-utf8", {"tokenizer.json": b"\xff\xfe\xfd"}, "tokenizer.json"),
    ("tokenizer-config-not-json", {"tokenizer_config.json": b"{oops"}, "tokenizer_config.json"),
    ("tokenizer-config-array", {"tokenizer_config.json": b"[1]"}, "tokenizer_config.json"),
    ("vocab-empty", {"tokenizer.json": None, "vocab.txt": b""}, "vocab.txt"),
    ("vocab-blank-lines", {"tokenizer.json": None, "vocab.txt": b"\n\n  \n"}, "vocab.txt"),
    ("vocab-binary", {"tokenizer.json": None, "vocab.txt": b"\x89PNG\r\n\x1a\n\x00\x00\xff\xd8"}, "vocab.txt"),
    ("vocab-nul-bytes", {"tokenizer.json": None, "vocab.txt": b"[PAD]\n\x00\x00\n"}, "vocab.txt"),
]
for _name, _files, _named in TOKENIZER_FILE_CASES:
    case("AutoTokenizer.from_pretrained", _name, _tokenizer_src(_files),
         lambda s, t: AutoTokenizer.from_pretrained(s), ConfigError, _named)
case("AutoTokenizer.from_pretrained", "tokenizer-json-a-directory",
     lambda t: (lambda s: ((s / "tokenizer.json").unlink(), (s / "tokenizer.json").mkdir(), s)[2])(
         _tokenizer_src({})(t)), lambda s, t: AutoTokenizer.from_pretrained(s), ConfigError, "tokenizer.json")

_TOK: dict[str, Any] = {}


def _tok():
    if "bert" not in _TOK:
        from test_tasks import task_dir
        _TOK["bert"] = AutoTokenizer.from_pretrained(task_dir("bert/tokenizer.json", "mlm"))
    return _TOK["bert"]


TOKENIZER_INPUT_CASES = [
    ("text-none", lambda: _tok()(None), "text"),
    ("text-int", lambda: _tok()(5), "text"),
    ("text-bytes", lambda: _tok()(b"hello"), "text"),
    ("batch-with-int", lambda: _tok()(["hello", 3]), "text[1]"),
    ("batch-with-none", lambda: _tok()(["hello", None]), "text[1]"),
    ("lone-surrogate", lambda: _tok()("bad \ud800 text"), "text[0]"),
    ("batch-lone-surrogate", lambda: _tok()(["ok", "bad \udfff"]), "text[1]"),
    ("pair-int", lambda: _tok()("hello", 5), "text_pair"),
    ("batch-pair-with-int", lambda: _tok()(["a", "b"], ["c", 4]), "text_pair[1]"),
    ("pair-batch-length", lambda: _tok()(["a", "b"], ["c"]), "text_pair"),
]
for _name, _call, _named in TOKENIZER_INPUT_CASES:
    case("Tokenizer.__call__", _name, _nothing, lambda s, t, c=_call: c(), InputError, _named)


# ---- 6. tasks -----------------------------------------------------------------------------------------------

def _task(tokenizer: str, task: str) -> Path:
    from test_tasks import task_dir
    return task_dir(tokenizer, task)


BERT = "bert/tokenizer.json"
TASK_CASES: list[tuple[str, str, Callable[[], Any], type, str]] = [
    ("fill_mask", "top_k-zero", lambda: fill_mask("a [MASK].", _task(BERT, "mlm"), top_k=0), InputError, "top_k"),
    ("fill_mask", "top_k-negative", lambda: fill_mask("a [MASK].", _task(BERT, "mlm"), top_k=-1), InputError, "top_k"),
    ("fill_mask", "top_k-past-vocab", lambda: fill_mask("a [MASK].", _task(BERT, "mlm"), top_k=10**9), InputError,
     "top_k"),
    ("fill_mask", "top_k-string", lambda: fill_mask("a [MASK].", _task(BERT, "mlm"), top_k="5"), InputError, "top_k"),
    ("fill_mask", "top_k-float", lambda: fill_mask("a [MASK].", _task(BERT, "mlm"), top_k=1.5), InputError, "top_k"),
    ("fill_mask", "mask-cut-by-truncation", lambda: fill_mask("word " * 400 + "[MASK].", _task(BERT, "mlm")),
     InputError, "truncation"),
    ("fill_mask", "no-mask", lambda: fill_mask("no mask here", _task(BERT, "mlm")), InputError, "no mask token"),
    ("fill_mask", "texts-int", lambda: fill_mask(5, _task(BERT, "mlm")), InputError, "texts"),
    ("fill_mask", "texts-with-none", lambda: fill_mask(["a [MASK]", None], _task(BERT, "mlm")), InputError,
     "texts[1]"),
    ("fill_mask", "on-a-classifier", lambda: fill_mask("a [MASK].", _task(BERT, "seqcls")), MissingHeadError,
     "cls.predictions"),
    ("classify", "on-a-masked-lm", lambda: classify("hello", _task(BERT, "mlm")), MissingHeadError, "classifier"),
    ("classify", "top_k-zero", lambda: classify("hello", _task(BERT, "seqcls"), top_k=0), InputError, "top_k"),
    ("classify", "top_k-negative", lambda: classify("hello", _task(BERT, "seqcls"), top_k=-1), InputError, "top_k"),
    ("classify", "texts-int", lambda: classify(7, _task(BERT, "seqcls")), InputError, "texts"),
    ("classify", "lone-surrogate", lambda: classify(["\ud800"], _task(BERT, "seqcls")), InputError, "texts[0]"),
    ("classify", "pair-missing-key", lambda: classify([{"text": "a"}, {"txt": "b"}], _task(BERT, "seqcls")),
     InputError, "text"),
    ("tag", "on-a-masked-lm", lambda: tag("hello", _task(BERT, "mlm")), MissingHeadError, "classifier"),
    ("tag", "texts-with-int", lambda: tag(["a", 1], _task(BERT, "tokcls")), InputError, "texts[1]"),
    ("tag", "bad-aggregation", lambda: tag("a", _task(BERT, "tokcls"), aggregation_strategy="most"), InputError,
     "aggregation_strategy"),
    ("answer", "on-a-classifier", lambda: answer("who?", "me", _task(BERT, "seqcls")), MissingHeadError, "qa_outputs"),
    ("answer", "top_k-zero", lambda: answer("who?", "me", _task(BERT, "qa"), top_k=0), InputError, "top_k"),
    ("answer", "top_k-none", lambda: answer("who?", "me", _task(BERT, "qa"), top_k=None), InputError, "top_k"),
    ("answer", "context-int", lambda: answer("who?", [5], _task(BERT, "qa")), InputError, "context"),
    ("answer", "max_answer_len-zero", lambda: answer("who?", "me", _task(BERT, "qa"), max_answer_len=0), InputError,
     "max_answer_len"),
    ("embed", "texts-with-none", lambda: embed(["a", None], _task(BERT, "mlm")), InputError, "texts[1]"),
    ("embed", "bad-pooling", lambda: embed("a", _task(BERT, "mlm"), pooling="median"), InputError, "pooling"),
    ("rank", "top_k-negative", lambda: rank("q", ["a"], _task(BERT, "mlm"), top_k=-1), InputError, "top_k"),
    ("rank", "no-texts", lambda: rank("q", [], _task(BERT, "mlm")), InputError, "texts"),
    ("zero_shot", "on-a-masked-lm", lambda: zero_shot("hello", ["a", "b"], _task(BERT, "mlm")), MissingHeadError,
     "so zero_shot cannot run"),
]
for _entry, _name, _call, _error, _named in TASK_CASES:
    case(_entry, _name, _nothing, lambda s, t, c=_call: c(), _error, _named)


# ---- the table's test ------------------------------------------------------------------------------------

def _hashes(tmp: Path, src: Path) -> tuple[str, str]:
    return tree_hash(tmp), (tree_hash(src) if not src.is_relative_to(tmp) else "")


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_bad_input(bad: Case, tmp_path: Path) -> None:
    src = bad.make(tmp_path)
    before = _hashes(tmp_path, src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(bad.error) as info:
            bad.call(src, tmp_path)
    named = bad.named(src, tmp_path) if callable(bad.named) else bad.named
    assert named in str(info.value), f"{bad.id}: the message does not name {named!r}: {info.value}"
    assert _hashes(tmp_path, src) == before, f"{bad.id}: something under {tmp_path} was written or deleted"


def table_counts() -> dict[str, dict[str, int]]:
    """Cases per class and per entry point (docs/reliability.md quotes them)."""
    by_kind: dict[str, int] = {}
    by_entry: dict[str, int] = {}
    for c in CASES:
        by_kind[f"{c.kind}. {KINDS[c.kind]}"] = by_kind.get(f"{c.kind}. {KINDS[c.kind]}", 0) + 1
        by_entry[c.entry] = by_entry.get(c.entry, 0) + 1
    return {"class": dict(sorted(by_kind.items())), "entry": by_entry}


def test_the_table_is_large_enough() -> None:
    counts = table_counts()
    assert len(CASES) >= 150 and len({c.id for c in CASES}) == len(CASES), counts
    assert set(c.kind for c in CASES) == set(KINDS), counts


# ---- 1. atomicity: a real `flodl-hf export` SIGKILLed at every stage of its write and swap --------------

def _cli() -> str:
    found = shutil.which("flodl-hf", path=str(Path(sys.executable).parent)) or shutil.which("flodl-hf")
    assert found, "the flodl-hf console script is not installed in this environment"
    return found


def test_kill_at_every_stage_leaves_old_or_new(tmp_path: Path) -> None:
    """DIR holds an earlier export; `flodl-hf export --force` of another head is killed at each stage.
    After every kill DIR is, by tree hash, exactly the old export (killed before the swap) or exactly the
    new one (at or after it), never missing or mixed; the next export settles the scratch it left. With
    the exchange syscall disabled (the two-rename fallback), a kill between the renames leaves the old
    DIR aside, and the next write restores it."""
    old_src, new_src = _tiny("seqcls"), _tiny("qa")
    export(old_src, tmp_path / "old")
    export(new_src, tmp_path / "new")
    old, new = tree_hash(tmp_path / "old"), tree_hash(tmp_path / "new")
    assert old != new
    runs = [(stage, False) for stage in STAGES if stage != "old-moved"] + [("old-moved", True), ("swapped", True)]
    procs = []
    for stage, fallback in runs:
        work = tmp_path / f"{stage}-{'fallback' if fallback else 'exchange'}"
        work.mkdir()
        shutil.copytree(tmp_path / "old", work / "out", symlinks=True)
        env = {**os.environ, KILL_ENV: stage, **({"FLODL_HF_NO_EXCHANGE": "1"} if fallback else {})}
        cmd = [_cli(), "export", "--hub", str(new_src), "--out", str(work / "out"), "--force"]
        procs.append((stage, fallback, work, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                              stderr=subprocess.PIPE)))
    swapped_at = STAGES.index("swapped")
    for stage, fallback, work, proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, (stage, fallback, err.decode()[-2000:])
        out = work / "out"
        left = sorted(p.name for p in work.iterdir() if p.name != "out")
        if fallback and stage == "old-moved":
            # the one instant the fallback cannot cover: DIR is aside, and is restored by the next write
            assert not out.exists() and any(".old-" in n for n in left), left
            assert recover_scratch(out) and tree_hash(out) == old
        else:
            assert tree_hash(out) == (new if STAGES.index(stage) >= swapped_at else old), (stage, fallback)
        export(new_src, out, force=True)  # the next write settles the scratch and succeeds
        assert tree_hash(out) == new
        assert [p.name for p in work.iterdir()] == ["out"], (stage, fallback)


def test_orphan_is_restored_never_deleted(tmp_path: Path) -> None:
    """What a writer killed between the fallback's two renames leaves (DIR missing, `.DIR.old-PID-*` beside
    it, PID gone) is renamed back by the next write, never deleted as stale scratch."""
    export(_tiny("seqcls"), tmp_path / "out")
    before = tree_hash(tmp_path / "out")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "out").rename(tmp_path / f".out.old-{dead.pid}-0badc0de")
    (tmp_path / f".out.partial-{dead.pid}-0badc0de").mkdir()  # the unfinished new one
    with pytest.raises(OutputExistsError, match="already exists"):
        export(_tiny("qa"), tmp_path / "out")  # restored first, then judged like any existing DIR
    assert tree_hash(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- 2. hub snapshots (links into blobs are inside) and directory links are not followed ------------------

def test_hub_snapshot_links_into_blobs_load(tmp_path: Path) -> None:
    src = source(tmp_path, shards=2)
    repo = tmp_path / "hub" / "models--someone--tiny"
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = repo / "blobs" / f"sha-{f.name}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    ours = load_model(snap)
    reference = load_model(src)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), reference.state_dict().values()))


def test_convert_does_not_follow_a_linked_directory(tmp_path: Path) -> None:
    src = source(tmp_path, fmt="bin")
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "key.txt").write_text("secret")
    (src / "extra").symlink_to(tmp_path / "private", target_is_directory=True)
    result = convert(src, tmp_path / "out")
    assert not (result.out / "extra").exists() and "extra/key.txt" not in result.copied


# ---- 3. the tied flag against a different decoder in the file: as transformers 5 -------------------------

def test_tied_flag_with_a_different_decoder_keeps_the_files_tensor(tmp_path: Path) -> None:
    transformers = quiet_transformers()
    src = source(tmp_path)
    assert json.loads((src / "config.json").read_text()).get("tie_word_embeddings", True)
    tensors = load_file(src / "model.safetensors")
    tensors["cls.predictions.decoder.weight"] = tensors["bert.embeddings.word_embeddings.weight"] + 1.0
    _save(tensors, src / "model.safetensors", "safetensors")
    with pytest.warns(UserWarning, match="cls.predictions.decoder.weight"):
        ours = load_model(src)
    theirs = transformers.AutoModelForMaskedLM.from_pretrained(str(src)).eval()
    ids = _ids(8)
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)
    assert torch.equal(ours.cls.predictions.decoder.weight, tensors["cls.predictions.decoder.weight"])
    # the same file with an equal copy stays tied
    tensors["cls.predictions.decoder.weight"] = tensors["bert.embeddings.word_embeddings.weight"].clone()
    _save(tensors, src / "model.safetensors", "safetensors")
    tied = load_model(src)
    assert tied.cls.predictions.decoder.weight is tied.bert.embeddings.word_embeddings.weight


# ---- 5. formats real checkpoints use ------------------------------------------------------------------------

def _same_logits_as_transformers(src: Path) -> None:
    transformers = quiet_transformers()
    ours = load_model(src)
    theirs = transformers.AutoModelForMaskedLM.from_pretrained(str(src)).eval()
    ids = _ids(8)
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


def test_legacy_non_zip_bin_loads(tmp_path: Path) -> None:
    src = source(tmp_path, fmt="bin")
    torch.save(torch.load(src / "pytorch_model.bin", weights_only=True), src / "pytorch_model.bin",
               _use_new_zipfile_serialization=False)
    assert not __import__("zipfile").is_zipfile(src / "pytorch_model.bin")
    _same_logits_as_transformers(src)


def test_cuda_storage_bin_loads_on_cpu(tmp_path: Path, monkeypatch) -> None:
    """A .bin saved from a GPU names CUDA storages; here (no GPU needed) the storages are tagged 'cuda:0'."""
    import torch.serialization as serialization
    src = source(tmp_path, fmt="bin")
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    monkeypatch.setattr(serialization, "location_tag", lambda storage: "cuda:0")
    torch.save(state, src / "pytorch_model.bin")
    monkeypatch.undo()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(src / "pytorch_model.bin", weights_only=True)  # what a load without map_location does
    model = load_model(src)
    assert model.device.type == "cpu"
    _same_logits_as_transformers(src)


def test_mixed_dtypes_give_a_working_model_cast_as_transformers_does(tmp_path: Path) -> None:
    src = source(tmp_path)
    edit_config(src, dtype=DELETE, torch_dtype=DELETE)
    tensors = load_file(src / "model.safetensors")
    tensors["bert.encoder.layer.0.attention.self.query.weight"] = \
        tensors["bert.encoder.layer.0.attention.self.query.weight"].half()
    _save(tensors, src / "model.safetensors", "safetensors")
    with pytest.warns(UserWarning, match="several dtypes"):
        model = load_model(src)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    _same_logits_as_transformers(src)


# ---- 6. empty inputs give empty results; the registry fails loudly every time -------------------------------

def test_empty_task_inputs_give_empty_results() -> None:
    mlm, seqcls, tokcls = _task(BERT, "mlm"), _task(BERT, "seqcls"), _task(BERT, "tokcls")
    assert classify([], seqcls) == []
    assert tag([], tokcls) == []
    assert fill_mask([], mlm) == []
    vectors = embed([], mlm)
    assert vectors.shape == (0, json.loads((mlm / "config.json").read_text())["hidden_size"])


def test_registry_fails_loudly_every_time(monkeypatch) -> None:
    from flodl_hf.core import registry
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setitem(sys.modules, "flodl_hf.families", None)  # importing it now raises ImportError
    for _ in range(2):
        with pytest.raises(RegistryError, match="flodl_hf.families"):
            registry.get_family("bert")
        with pytest.raises(RegistryError):
            registry.supported_model_types()
    monkeypatch.undo()
    assert "bert" in registry.supported_model_types()


def test_relative_only_deberta_takes_inputs_past_max_position_embeddings() -> None:
    """DeBERTa-v3 (position_biased_input=false) has no absolute position table: no length limit applies."""
    transformers = quiet_transformers()
    fields = tiny_config("deberta-v2", {"relative_attention": True, "position_biased_input": False,
                                        "position_buckets": 16, "pos_att_type": ["p2c", "c2p"]}, "base")
    src = make_checkpoint(fields, "base")
    ours = load_model(src)
    theirs = transformers.AutoModel.from_pretrained(str(src)).eval()
    ids = (torch.arange(fields.get("max_position_embeddings", 512) + 8) % 50 + 5)[None]
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).last_hidden_state, theirs(input_ids=ids).last_hidden_state)


def test_arguments_of_the_python_api_and_the_commands_get_typed_errors(tmp_path):
    """Arguments, not files: each gets an InputError (exit 2 from the command) naming it, before any write."""
    src = _tiny("seqcls")
    for kwargs, named in ((dict(task="foo"), "task 'foo'"), (dict(attn_implementation="foo"), "attn_implementation"),
                          (dict(dtype="float99"), "dtype"), (dict(dtype=torch.int8), "dtype"),
                          (dict(num_labels="x"), "num_labels"), (dict(num_labels=0), "num_labels")):
        with pytest.raises(InputError, match=named):
            load_model(src, **kwargs)
    # dtype by name, as transformers' from_pretrained takes it
    assert next(load_model(src, dtype="bfloat16").parameters()).dtype == torch.bfloat16
    assert next(load_model(src, dtype="torch.float32").parameters()).dtype == torch.float32
    for size in ("abc", "1XB", [1], -1, "0MB"):
        with pytest.raises(InputError, match="max_shard_size"):
            export(src, tmp_path / "out", max_shard_size=size)
    with pytest.raises(InputError, match="out must be a directory path"):
        export(src, None)
    (tmp_path / "afile").write_text("")
    from flodl_hf.cli import main
    for argv in (["export", "--hub", str(src), "--out", str(tmp_path / "out"), "--max-shard-size", "abc"],
                 ["convert", str(src), "--out", str(tmp_path / "out"), "--max-shard-size", "1XB"],
                 ["export", "--hub", str(src), "--out", str(tmp_path / "afile" / "sub")],
                 ["generate", "hi", "-m", str(src), "--eos-token-id", "abc"]):
        assert main(argv) == 2, argv
    assert not (tmp_path / "out").exists() and (tmp_path / "afile").read_text() == ""


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin", "config.json"])
def test_a_weights_or_config_file_linking_out_of_the_checkpoint_is_not_read(tmp_path, name):
    """As for the shards of an index and the tokenizer's files: a directory's file that is a link out of
    it is refused, naming it; a link inside the directory, and a hub cache's links into its blobs, are read."""
    src = source(tmp_path, fmt="bin" if name == "pytorch_model.bin" else "safetensors")
    moved = tmp_path / f"elsewhere-{name}"
    (src / name).rename(moved)
    (src / name).symlink_to(moved)
    with pytest.raises(CheckpointFormatError, match=f"{name} is a link to .*outside the checkpoint"):
        load_model(src)
    from flodl_hf.cli import main
    assert main(["export", "--hub", str(src), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    (src / name).unlink()
    (src / f"real-{name}").write_bytes(moved.read_bytes())
    (src / name).symlink_to(src / f"real-{name}")  # a link inside the checkpoint is the checkpoint's own
    load_model(src)
    cache = tmp_path / "hub" / "models--org--tiny"
    (cache / "blobs").mkdir(parents=True)
    snapshot = cache / "snapshots" / "abc123"
    shutil.copytree(src, snapshot, symlinks=False)
    (snapshot / name).unlink()
    shutil.copy(moved, cache / "blobs" / "0123abcd")
    (snapshot / name).symlink_to(cache / "blobs" / "0123abcd")  # as huggingface_hub lays a snapshot out
    load_model(snapshot)


@pytest.mark.parametrize("edit, error, named", [
    (lambda c: c.update(model_type="nosuch"), UnsupportedModelError, "config.json: model_type 'nosuch'"),
    (lambda c: c.update(hidden_act=None), ConfigError, "config.json: config field hidden_act=None"),
    (lambda c: c.update(hidden_act="swoosh"), ConfigError, "config.json: config field hidden_act='swoosh'"),
])
def test_an_unknown_family_or_activation_names_config_json(tmp_path, edit, error, named):
    src = source(tmp_path)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=named):
        load_model(src)


def test_a_classifier_trained_for_the_other_classification_task_is_refused():
    """Sequence and token classification heads share their keys and shapes (`classifier`), so loading one
    for the other initialises nothing; the checkpoint's architectures tells them apart."""
    with pytest.raises(MissingHeadError, match="architectures names a seqcls model, so tag cannot run"):
        tag("hello world", _tiny("seqcls"))
    # The other way round the load failed first, on the pooler classify needs and a token classifier lacks
    # (a WeightsMismatchError whose hint, pass num_labels=, did not help)
    with pytest.raises(MissingHeadError, match="architectures names a tokcls model, so classify cannot run"):
        classify("hello world", _tiny("tokcls"))
    # zero_shot loads the sequence classifier too, and names itself, not classify
    with pytest.raises(MissingHeadError, match="architectures names a tokcls model, so zero_shot cannot run"):
        zero_shot("hello world", ["a", "b"], _tiny("tokcls"))
