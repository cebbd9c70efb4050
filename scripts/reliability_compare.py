"""Bad inputs side by side: what flodl-hf does and what transformers does with the same file.

Each row builds one bad input (with the builders of tests/test_bad_input.py, from checkpoints that
transformers wrote), runs the flodl-hf call and the nearest transformers call on it, and reports
each outcome as measured: ``loads``, ``loads, warns``, the exception type and the start of its
message, or what went wrong silently (``reads outside``, ``rewrites the source``...). The
cases that could hang or exhaust memory run in a subprocess with a time and memory limit.

    .venv/bin/python scripts/reliability_compare.py > /tmp/table.md   # docs/reliability.md quotes it
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("FLODL_HF_TEST_CACHE", str(ROOT / ".test-cache"))

import torch  # noqa: E402

import test_bad_input as t  # noqa: E402
from flodl_hf import classify, fill_mask  # noqa: E402
from flodl_hf.auto import load_model  # noqa: E402
from flodl_hf.roundtrip.export import export  # noqa: E402
from flodl_hf.core.validate import tree_hash  # noqa: E402
from helpers import quiet_transformers  # noqa: E402

transformers = quiet_transformers()


TMP: list[str] = []  # the current case's temporary directory, shown as TMP in messages


def outcome(call: Callable[[], Any], check: Callable[[Any], str] | None = None) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = call()
        except BaseException as exc:  # noqa: BLE001 - every outcome is reported, not handled
            text = " ".join(str(exc).split())
            for prefix in TMP:
                text = text.replace(prefix, "TMP")
            return f"{type(exc).__name__}: {text[:90]}{'...' if len(text) > 90 else ''}"
    said = check(value) if check else ""
    warned = [w for w in caught if issubclass(w.category, UserWarning)]
    return (said or "loads") + (", warns" if warned else "")


def hf_mlm(src: Path):
    return transformers.AutoModelForMaskedLM.from_pretrained(str(src))


def logits(model, ids=None) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids if ids is not None else t._ids(8)).logits


ROWS: list[tuple[int, str, Callable[[Path], Path], Callable[[Path, Path], str], Callable[[Path, Path], str]]] = []


def row(kind: int, name: str, make, ours, theirs) -> None:
    ROWS.append((kind, name, make, ours, theirs))


# ---- 1. data loss --------------------------------------------------------------------------------------

def _listing(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): tree_hash(p) for p in sorted(path.rglob("*")) if p.is_file()}


def _unchanged(path: Path, call: Callable[[], Any]) -> str:
    """The call's outcome, plus what it did to the files under ``path`` (the source, or a user's directory)."""
    before = _listing(path)
    result = outcome(call)
    after = _listing(path)
    deleted = [k for k in before if k not in after]
    changed = [k for k in before if k in after and after[k] != before[k]]
    added = [k for k in after if k not in before]
    effects = ([f"deletes {', '.join(deleted)}"] if deleted else []) + \
              ([f"overwrites {', '.join(changed)}"] if changed else []) + \
              ([f"writes {len(added)} files among them"] if added else [])
    if not effects and result == "loads":
        return "succeeds, files unchanged (same bytes rewritten)"
    return result if not effects else ("; ".join(effects) if result.startswith("loads") else f"{result}; " + "; ".join(effects))


row(1, "--out is the source directory", t.source,
    lambda s, tmp: _unchanged(s, lambda: export(s, s, force=True)),
    lambda s, tmp: _unchanged(s, lambda: hf_mlm(s).save_pretrained(str(s))))
row(1, "--out is the parent of the source (user files beside it)", lambda tmp: (t.source(tmp),
                                                                             (tmp / "thesis.tex").write_text("x"))[0],
    lambda s, tmp: _unchanged(tmp, lambda: export(s, tmp, force=True)),
    lambda s, tmp: _unchanged(tmp, lambda: hf_mlm(s).save_pretrained(str(tmp))))


def _user_dir_with_stale_shard(tmp: Path) -> Path:
    src = t.source(tmp)
    (tmp / "out").mkdir()
    (tmp / "out" / "model-00001-of-00002.safetensors").write_text("the user's file, named like a shard")
    return src


row(1, "--force over a directory flodl-hf did not write", _user_dir_with_stale_shard,
    lambda s, tmp: _unchanged(tmp / "out", lambda: export(s, tmp / "out", force=True)),
    lambda s, tmp: _unchanged(tmp / "out", lambda: hf_mlm(s).save_pretrained(str(tmp / "out"))))

# ---- 2. reads outside the checkpoint ------------------------------------------------------------------------

for _name, _label in [("shard-dotdot", "index names ../outside.safetensors"),
                      ("shard-symlink-out", "a shard is a symlink out of the directory"),
                      ("key-in-two-shards", "a key in two shards (different values)"),
                      ("key-in-unnamed-shard", "a key in a shard the index does not name for it"),
                      ("key-missing-from-its-shard", "a key the index names, missing from its shard"),
                      ("weight_map-list", "weight_map is a list"),
                      ("index-not-utf8", "index file is not UTF-8")]:
    _make = next(m for n, m, _, _ in t._index_cases("safetensors") if n == _name)
    _kind = 2 if _name.startswith(("shard", "key")) else 6
    row(_kind, _label, _make, lambda s, tmp: outcome(lambda: load_model(s)),
        lambda s, tmp, n=_name: outcome(lambda: hf_mlm(s), (lambda m: "loads (reads outside the checkpoint)")
                                         if n.startswith("shard") else None))

# ---- 3. silently wrong model ----------------------------------------------------------------------------------


def _tied(tmp: Path) -> Path:
    src = t.source(tmp)
    tensors = t.load_file(src / "model.safetensors")
    tensors["cls.predictions.decoder.weight"] = tensors["bert.embeddings.word_embeddings.weight"] + 1.0
    t._save(tensors, src / "model.safetensors", "safetensors")
    return src


def _keeps_file(model) -> str:
    decoder = dict(model.named_parameters(remove_duplicate=False))["cls.predictions.decoder.weight"]
    embeddings = dict(model.named_parameters(remove_duplicate=False))["bert.embeddings.word_embeddings.weight"]
    return "loads, keeps the file's decoder (untied)" if not torch.equal(decoder, embeddings) else "loads, ties (file's decoder lost)"


row(3, "tie_word_embeddings=true, file holds a different decoder", _tied,
    lambda s, tmp: outcome(lambda: load_model(s), _keeps_file), lambda s, tmp: outcome(lambda: hf_mlm(s), _keeps_file))
for _changes, _label in [({"num_hidden_layers": 2.0}, "num_hidden_layers: 2.0"),
                         ({"num_hidden_layers": "2"}, "num_hidden_layers: \"2\""),
                         ({"hidden_size": 33}, "hidden_size not a multiple of the heads"),
                         ({"pad_token_id": 10**6}, "pad_token_id past the vocabulary"),
                         ({"layer_norm_eps": -1.0}, "layer_norm_eps: -1"),
                         ({"hidden_dropout_prob": 1.5}, "hidden_dropout_prob: 1.5")]:
    row(3, f"config {_label}", t._config_src(_changes), lambda s, tmp: outcome(lambda: load_model(s)),
        lambda s, tmp: outcome(lambda: hf_mlm(s)))
row(3, "forward: attention_mask shaped unlike input_ids", t.source,
    lambda s, tmp: outcome(lambda: load_model(s)(input_ids=t._ids(), attention_mask=torch.ones(2, 5, dtype=torch.long))),
    lambda s, tmp: outcome(lambda: hf_mlm(s)(input_ids=t._ids(), attention_mask=torch.ones(2, 5, dtype=torch.long))))
row(3, "forward: token id >= vocab_size", t.source,
    lambda s, tmp: outcome(lambda: load_model(s)(input_ids=t._ids() + 10**6)),
    lambda s, tmp: outcome(lambda: hf_mlm(s)(input_ids=t._ids() + 10**6)))
row(3, "forward: longer than the position table", t.source,
    lambda s, tmp: outcome(lambda: load_model(s)(input_ids=t._ids(n=4000, batch=1) % 90)),
    lambda s, tmp: outcome(lambda: hf_mlm(s)(input_ids=t._ids(n=4000, batch=1) % 90)))

# ---- 4. hang or huge allocation (in a subprocess: 60 s, 6 GB) --------------------------------------------------

LIMITED = """
import resource, sys, warnings
resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))
warnings.simplefilter("ignore")
sys.path.insert(0, {tests!r})
from helpers import quiet_transformers
try:
    if {ours!r}:
        from flodl_hf.auto import load_model
        load_model({src!r})
    else:
        quiet_transformers().AutoModelForMaskedLM.from_pretrained({src!r})
    print("loads")
except BaseException as exc:
    print(type(exc).__name__ + ": " + " ".join(str(exc).split()).replace({tmp!r}, "TMP")[:90])
"""


def limited(src: Path, ours: bool) -> str:
    code = LIMITED.format(tests=str(ROOT / "tests"), ours=ours, src=str(src), tmp=str(src.parent))
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "still building after 60 s (killed)"
    return (proc.stdout.replace("\r", "\n").strip().splitlines() or [f"exit {proc.returncode}: {proc.stderr.strip()[-90:]}"])[-1]


for _changes, _label in [({"num_hidden_layers": 10**6}, "num_hidden_layers: 10**6"),
                         ({"hidden_size": 2**40}, "hidden_size: 2**40")]:
    row(4, f"config {_label}", t._config_src(_changes), lambda s, tmp: limited(s, True), lambda s, tmp: limited(s, False))

# ---- 5. formats real checkpoints use ---------------------------------------------------------------------------


def _legacy(tmp: Path) -> Path:
    src = t.source(tmp, fmt="bin")
    torch.save(torch.load(src / "pytorch_model.bin", weights_only=True), src / "pytorch_model.bin",
               _use_new_zipfile_serialization=False)
    return src


def _cuda(tmp: Path) -> Path:
    import torch.serialization as serialization
    src = t.source(tmp, fmt="bin")
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    original = serialization.location_tag
    serialization.location_tag = lambda storage: "cuda:0"
    try:
        torch.save(state, src / "pytorch_model.bin")
    finally:
        serialization.location_tag = original
    return src


def _mixed(tmp: Path) -> Path:
    src = t.source(tmp)
    t.edit_config(src, dtype=t.DELETE, torch_dtype=t.DELETE)
    tensors = t.load_file(src / "model.safetensors")
    key = "bert.encoder.layer.0.attention.self.query.weight"
    tensors[key] = tensors[key].half()
    t._save(tensors, src / "model.safetensors", "safetensors")
    return src


def _forward(model) -> str:
    logits(model)
    return "loads, forward runs"


row(5, "legacy (non-zip) pytorch_model.bin", _legacy, lambda s, tmp: outcome(lambda: load_model(s), _forward),
    lambda s, tmp: outcome(lambda: hf_mlm(s), _forward))
row(5, ".bin saved with CUDA storages, no GPU here", _cuda, lambda s, tmp: outcome(lambda: load_model(s), _forward),
    lambda s, tmp: outcome(lambda: hf_mlm(s), _forward))
row(5, "one float16 tensor among float32", _mixed, lambda s, tmp: outcome(lambda: load_model(s), _forward),
    lambda s, tmp: outcome(lambda: hf_mlm(s), _forward))
row(5, "an int64 tensor for a float LayerNorm weight", t._weights(t._int_tensor(t.LN)),
    lambda s, tmp: outcome(lambda: load_model(s), _forward), lambda s, tmp: outcome(lambda: hf_mlm(s), _forward))

# ---- 6. typed errors elsewhere ------------------------------------------------------------------------------------

row(6, "config.json is a directory", t._config_file(None), lambda s, tmp: outcome(lambda: load_model(s)),
    lambda s, tmp: outcome(lambda: hf_mlm(s)))
for _files, _label in [({"tokenizer.json": b"{\"model\": "}, "tokenizer.json not JSON"),
                       ({"tokenizer.json": None, "vocab.txt": b""}, "vocab.txt empty"),
                       ({"tokenizer.json": None, "vocab.txt": b"\x89PNG\r\n\x1a\n\x00\x00\xff"}, "vocab.txt binary")]:
    row(6, _label, t._tokenizer_src(_files), lambda s, tmp: outcome(lambda: t.AutoTokenizer.from_pretrained(s)),
        lambda s, tmp: outcome(lambda: transformers.AutoTokenizer.from_pretrained(str(s)),
                               lambda tok: f"loads ({len(tok)} tokens)"))


def _n_results(value) -> str:
    return f"returns {len(value)} results"


row(6, "fill_mask top_k=-1", lambda tmp: t._task(t.BERT, "mlm"),
    lambda s, tmp: outcome(lambda: fill_mask("Paris is the [MASK].", s, top_k=-1), _n_results),
    lambda s, tmp: outcome(lambda: transformers.pipeline("fill-mask", model=str(s))("Paris is the [MASK].", top_k=-1),
                           _n_results))
row(6, "classify on a masked-LM checkpoint (no classifier head)", lambda tmp: t._task(t.BERT, "mlm"),
    lambda s, tmp: outcome(lambda: classify("hello", s), lambda r: f"predicts {r}"),
    lambda s, tmp: outcome(lambda: transformers.pipeline("text-classification", model=str(s))("hello"),
                           lambda r: "predicts with a random head"))
row(6, "classify([])", lambda tmp: t._task(t.BERT, "seqcls"), lambda s, tmp: outcome(lambda: classify([], s), repr),
    lambda s, tmp: outcome(lambda: transformers.pipeline("text-classification", model=str(s))([]), repr))


def main() -> None:
    print("| class | bad input | flodl-hf | transformers " + transformers.__version__ + " |")
    print("|---|---|---|---|")
    for kind, name, make, ours, theirs in ROWS:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            (tmp / "a").mkdir()
            (tmp / "b").mkdir()
            TMP[:] = [str(tmp / "a"), str((tmp / "a").resolve()), str(t.CACHE_DIR)]
            ours_out = ours(make(tmp / "a"), tmp / "a")
            TMP[:] = [str(tmp / "b"), str((tmp / "b").resolve()), str(t.CACHE_DIR)]
            theirs_out = theirs(make(tmp / "b"), tmp / "b")
        cell = lambda s: s.replace("|", "\\|")  # noqa: E731
        print(f"| {kind} | {name} | {cell(ours_out)} | {cell(theirs_out)} |", flush=True)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
