"""Proof that an export changed nothing: ``verify_export`` and, over the whole registry, ``verify_matrix``.

``verify_export(DIR)`` runs, and reports as a PASS/FAIL table:

1. loadable: DIR loads into the ``AutoModelFor*`` of ``architectures[0]`` with zero missing,
   unexpected or mismatched keys (so transformers initialises nothing new);
2. weights: every exported tensor is byte-identical to its source tensor after the declared
   key renames (or equal to the source tensor cast, when the export asked for a dtype);
3. transformers on DIR against transformers on the source: every output field ``torch.equal``;
4. our native model on DIR against transformers on DIR (``flodl_hf.parity``): every field
   ``torch.equal``, on each attention path transformers has for the family;
5. tokenizer: DIR's tokenizer gives the source tokenizer's ids on the prompts;
6. sentence-transformers, only when DIR or its source has a modules.json: it loads DIR and the
   source into the same module list, and their ``encode`` outputs on the prompts are ``torch.equal``
   (``flodl_hf.carry``); a source with modules.json and a DIR without fails.

The source is the one stamped in ``config.json`` by ``flodl_hf.export`` unless ``source`` is
given; ``no_source`` (a fine-tuned model with no upstream) runs checks 1 and 4 only.
Inputs are a padded batch of prompts through DIR's tokenizer, or of random ids when DIR
has no tokenizer. Float32, CPU: the domain where the project promises exactness.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import carry, io
from .auto import build_model, config_from_dict
from .config import BaseConfig
from .errors import ConfigError, FlodlHFError, InputError, SourceNotFoundError, UnsupportedModelError
from .export import (STAMP_KEY, architecture_task, export, has_tokenizer,
                     read_trainer_checkpoint, same_bytes, sha256_file)
from .keys import expected, has_pooler, normalise
from .parity import REFERENCE_CLASSES, check_parity, compare_outputs, make_batch, quiet_transformers
from .registry import get_family, supported_model_types
from .task_registry import get_task, task_names

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
DEFAULT_PROMPTS = ("The quick brown fox jumps over the lazy dog near the river bank.", "Hello world!")
CHECK_NAMES = {
    1: "loadable by transformers",
    2: "weights identical to source",
    3: "transformers: export vs source",
    4: "native vs transformers (export)",
    5: "tokenizer ids equal to source's",
    6: "sentence-transformers: vs source",
}


@dataclass
class Check:
    number: int
    name: str
    status: str                        # PASS, FAIL or SKIP
    detail: str
    max_abs_diff: float | None = None  # over every compared output field (checks 3 and 4)


@dataclass
class VerifyReport:
    directory: str
    architecture: str
    task: str
    source: str | None
    inputs: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No check failed, and at least loadability and native parity ran."""
        ran = {c.number for c in self.checks if c.status == PASS}
        return not any(c.status == FAIL for c in self.checks) and {1, 4} <= ran

    @property
    def max_abs_diff(self) -> float | None:
        diffs = [c.max_abs_diff for c in self.checks if c.max_abs_diff is not None]
        return max(diffs) if diffs else None

    def check(self, number: int) -> Check:
        return next(c for c in self.checks if c.number == number)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "max_abs_diff": self.max_abs_diff}

    def format_table(self) -> str:
        lines = [f"verify-export {self.directory}",
                 f"  {self.architecture} ({self.task}); source: {self.source or 'none (--no-source)'}",
                 f"  inputs: {self.inputs}",
                 f"  {'#':>2}  {'check':34} {'result':6}  detail"]
        for c in self.checks:
            lines.append(f"  {c.number:>2}  {c.name:34} {c.status:6}  {c.detail}")
        failed = [c for c in self.checks if c.status == FAIL]
        passed = sum(c.status == PASS for c in self.checks)
        if self.ok:
            lines.append(f"PASS: {passed} checks passed, {len(self.checks) - passed} skipped")
        else:
            lines.append(f"FAIL: {', '.join(str(c.number) for c in failed) or 'checks 1 and 4 did not run'}")
        return "\n".join(lines)


@dataclass
class _Source:
    label: str
    kind: str                          # "hf" or "trainer"
    stamped: bool                      # taken from the stamp (so its sha256 can be checked)
    ckpt: io.Checkpoint | None = None  # kind hf
    path: Path | None = None           # kind trainer

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.kind == "trainer":
            return read_trainer_checkpoint(self.path)[1]
        return io.load_tensors(self.ckpt)

    def weight_files(self) -> list[Path]:
        return [self.path] if self.kind == "trainer" else list(self.ckpt.weight_files)


def _find_source(directory: Path, stamp: dict, source: str | None, no_source: bool) -> _Source | None:
    if no_source:
        return None
    if source is None:
        source = stamp.get("source")
        if not source:
            raise ConfigError(f"{directory / io.CONFIG_NAME}: carries no '{STAMP_KEY}' source stamp (it was not "
                              "written by flodl-hf export); pass --source SOURCE, or --no-source to run checks 1 and 4")
        if stamp.get("format") == "flodl-checkpoint":
            return _Source(source, "trainer", True, path=Path(source))
        return _Source(source, "hf", True, ckpt=io.resolve(source, stamp.get("commit") or stamp.get("revision")))
    path = Path(source).expanduser()
    if path.is_file() and path.suffix in (".pt", ".pth", ".ckpt"):
        try:
            read_trainer_checkpoint(path)
            return _Source(str(path), "trainer", False, path=path)
        except FlodlHFError:
            pass
    return _Source(str(source), "hf", False, ckpt=io.resolve(source))


def _inputs(directory: Path, config: BaseConfig, task: str, prompts: list[str] | None):
    """(batch, description, tokenizer or None): prompts through DIR's tokenizer, else random ids."""
    if not has_tokenizer(directory):
        if prompts:
            raise InputError(f"--prompt needs a tokenizer, and {directory} has no tokenizer files")
        return make_batch(config, task), "random token ids, 2 sequences padded 13/8 (no tokenizer in DIR)", None
    transformers = quiet_transformers()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    texts = list(prompts or DEFAULT_PROMPTS)
    limit = min(128, getattr(config, "max_position_embeddings", 256) // 2)
    enc = tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt")
    batch = {k: enc[k] for k in ("input_ids", "attention_mask") if k in enc}
    if "token_type_ids" in enc and getattr(config, "type_vocab_size", 0):
        batch["token_type_ids"] = enc["token_type_ids"]
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and int(batch["input_ids"].max()) >= vocab:
        raise InputError(f"{directory}: the tokenizer gives ids up to {int(batch['input_ids'].max())}, beyond "
                         f"the model's vocab_size={vocab}; the tokenizer does not belong to this model")
    if task == "mc":  # (B, S) -> (B, 2 choices, S), as parity.make_batch builds it
        batch = {k: torch.stack([v.roll(c, dims=0) for c in range(2)], dim=1) for k, v in batch.items()}
    lengths = "/".join(str(int(n)) for n in enc["attention_mask"].sum(-1))
    return batch, f"{len(texts)} prompt(s) through DIR's tokenizer, padded ({lengths} tokens)", tokenizer


def _check_loadable(directory: Path, task: str, architecture: str):
    transformers = quiet_transformers()
    cls = getattr(transformers, get_task(task).auto_class)
    model, info = cls.from_pretrained(str(directory), dtype=torch.float32, output_loading_info=True)
    problems = {name: sorted(map(str, info.get(name) or [])) for name in
                ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    bad = {k: v for k, v in problems.items() if v}
    name = f"{CHECK_NAMES[1]}"
    if type(model).__name__ != architecture:
        return Check(1, name, FAIL, f"{REFERENCE_CLASSES[task]} built {type(model).__name__}, "
                                    f"config.json names {architecture}"), model.eval()
    if bad:
        detail = "; ".join(f"{k.replace('_', ' ')}: {', '.join(v[:6])}{' ...' if len(v) > 6 else ''}"
                           for k, v in bad.items())
        return Check(1, name, FAIL, detail), model.eval()
    return Check(1, name, PASS, f"{type(model).__name__}: 0 missing, 0 unexpected, 0 mismatched keys"), model.eval()


def _check_weights(directory: Path, config: BaseConfig, task: str, stamp: dict, src: _Source,
                   cast: torch.dtype | None) -> Check:
    name = CHECK_NAMES[2]
    if src.stamped and stamp.get("weights_sha256"):
        now = {f.name: sha256_file(f) for f in src.weight_files()}
        if now != stamp["weights_sha256"]:
            return Check(2, name, FAIL, f"the source's weight files changed since the export (sha256 differs "
                                        f"from the stamp): {src.label}")
    exported = io.load_tensors(io.resolve(directory))
    with torch.device("meta"):
        skeleton = build_model(config, task, add_pooling_layer=has_pooler(exported))
    shapes, aliases = expected(skeleton)
    ours = normalise(skeleton, exported, shapes, aliases)
    theirs = normalise(skeleton, src.tensors(), shapes, aliases)
    key_map = skeleton.family.key_map()
    fresh = {key_map.to_native(k) for k in stamp.get("fresh", [])}
    differ, absent, compared, nbytes = [], [], 0, 0
    for key, tensor in ours.items():
        if key not in shapes:
            continue  # not a weight of this class: check 1 reports it
        if key not in theirs:
            if key not in fresh:
                absent.append(key)
            continue
        want = theirs[key]
        if cast is not None and want.is_floating_point():
            want = want.to(cast)
        compared += 1
        nbytes += tensor.numel() * tensor.element_size()
        if not same_bytes(tensor, want):
            differ.append(f"{key} ({want.dtype}->{tensor.dtype})" if want.dtype != tensor.dtype else key)
    if differ or absent:
        parts = []
        if differ:
            parts.append(f"{len(differ)} differ: {', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''}")
        if absent:
            parts.append(f"{len(absent)} not in the source: {', '.join(absent[:6])}")
        return Check(2, name, FAIL, "; ".join(parts))
    how = f"equal to the source cast to {str(cast).removeprefix('torch.')}" if cast is not None else "byte-identical"
    extra = f"; {len(fresh)} fresh (not in source)" if fresh else ""
    return Check(2, name, PASS, f"{compared} tensors ({nbytes / 1e6:.2f} MB) {how}{extra}")


def _source_reference(src: _Source, task: str, cast: torch.dtype | None):
    transformers = quiet_transformers()
    cls = getattr(transformers, get_task(task).auto_class)
    model = cls.from_pretrained(str(src.ckpt.root), dtype=cast or torch.float32)
    return model.to(torch.float32).eval()


@torch.inference_mode()
def _check_against_source(directory: Path, task: str, src: _Source, cast: torch.dtype | None, fresh: bool,
                          ref_export, batch: dict[str, torch.Tensor]) -> Check:
    name = CHECK_NAMES[3]
    if src.kind == "trainer":
        return Check(3, name, SKIP, "the source is a flodl-hf trainer checkpoint, which transformers cannot load")
    fields = None
    if fresh:  # both heads would be random: compare the backbones
        transformers = quiet_transformers()
        ref_export = transformers.AutoModel.from_pretrained(str(directory), dtype=torch.float32).eval()
        task, fields = "base", ["last_hidden_state"]
        batch = {k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()}
    theirs = _source_reference(src, task, cast)
    out_export, out_source = ref_export(**batch), theirs(**batch)
    fields = fields or [k for k, v in out_export.items() if isinstance(v, torch.Tensor)]
    diffs, equal = compare_outputs(out_export, out_source, fields)
    status = PASS if all(equal.values()) else FAIL
    note = " (head fresh in the export: backbones compared)" if fresh else ""
    detail = ", ".join(f"{k} {'equal' if equal[k] else f'max abs diff {diffs[k]:.3g}'}" for k in fields) + note
    return Check(3, name, status, detail, max(diffs.values()))


def _check_native(directory: Path, task: str, batch: dict[str, torch.Tensor], impls: tuple[str, ...]) -> Check:
    parts, worst, exact = [], 0.0, True
    for impl in impls:
        result = check_parity(str(directory), task, impl, batch=batch)
        if result.skipped or not result.diffs:
            return Check(4, CHECK_NAMES[4], FAIL, f"{impl}: nothing compared ({result.skipped})")
        exact &= result.exact
        worst = max(worst, *result.diffs.values())
        parts.append(f"{impl}: " + ", ".join(f"{k} {'equal' if result.equal[k] else f'{v:.3g}'}"
                                             for k, v in result.diffs.items()))
    return Check(4, CHECK_NAMES[4], PASS if exact else FAIL, "; ".join(parts), worst)


def _check_tokenizer(src: _Source | None, tokenizer, prompts: list[str]) -> Check:
    name = CHECK_NAMES[5]
    if tokenizer is None:
        return Check(5, name, SKIP, "DIR has no tokenizer")
    if src is None or src.kind != "hf" or not has_tokenizer(src.ckpt.root):
        return Check(5, name, SKIP, "no source tokenizer to compare with")
    theirs = quiet_transformers().AutoTokenizer.from_pretrained(str(src.ckpt.root))
    a, b = tokenizer(prompts), theirs(prompts)
    differ = [k for k in set(a) | set(b) if a.get(k) != b.get(k)]
    if differ:
        return Check(5, name, FAIL, f"{', '.join(sorted(differ))} differ on the prompts")
    return Check(5, name, PASS, f"{', '.join(sorted(a))} equal on {len(prompts)} prompt(s)")


def _check_sentence(directory: Path, src: _Source | None, stamp: dict, cast: torch.dtype | None,
                    prompts: list[str]) -> Check | None:
    """Check 6; None (no row) when neither DIR nor its source is a sentence-transformers model."""
    carried_from = stamp.get("carried_from")
    layout = Path(carried_from) if carried_from and Path(carried_from).is_dir() else None
    if src is None:
        reference, why, compare = None, "--no-source", True
    elif src.kind == "hf" and (not src.stamped or layout is None or layout.resolve() == src.ckpt.root.resolve()):
        reference, why, compare = src.ckpt.root, "", True
    elif src.kind == "hf":  # the layout came from --like, the weights from the source
        reference, why, compare = layout, f"the layout came from {layout}, the weights from the source", False
    else:  # a trainer checkpoint: its carried files came from carried_from, its weights were trained
        reference, compare = layout, False
        why = "the weights were trained" if layout else "no carried_from directory to compare with"
    if not carry.is_sentence_model(directory) and not (reference and carry.is_sentence_model(reference)):
        return None
    result = carry.check_sentence_transformers(directory, reference, prompts, cast, compare, why)
    status = SKIP if result.ok is None else PASS if result.ok else FAIL
    return Check(6, CHECK_NAMES[6], status, result.detail, result.max_abs_diff)


def _guard(number: int, fn, *args) -> tuple[Check, Any]:
    """Run one check; an exception becomes its FAIL row (the table still prints)."""
    try:
        out = fn(*args)
        return out if isinstance(out, tuple) else (out, None)
    except Exception as exc:  # a crash inside a check is a failed check, named in the table
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Check(number, CHECK_NAMES[number], FAIL, f"{type(exc).__name__}: {first}"), None


def verify_export(directory: str | os.PathLike, source: str | None = None, no_source: bool = False,
                  prompts: list[str] | None = None) -> VerifyReport:
    """Run the checks on an exported directory; see the module docstring. Never raises on a failed check."""
    directory = Path(directory).expanduser().absolute()
    if not directory.is_dir():
        raise SourceNotFoundError(f"{directory}: no such directory")
    config_path = directory / io.CONFIG_NAME
    if not config_path.is_file():
        raise ConfigError(f"{directory}: no config.json, so this is not a model directory "
                          "(point verify-export at a directory written by flodl-hf export or save_pretrained)")
    raw = io.read_json(config_path, "config.json")
    io.resolve(directory)  # no weights: SourceNotFoundError names the files looked for
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ConfigError(f"{config_path}: has no architectures, so the head to verify is unknown")
    config = config_from_dict(raw, str(config_path))
    try:
        task = architecture_task(architectures[0], config.model_type)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{config_path}: architectures[0] is {architectures[0]!r}: {exc}") from None
    stamp = raw.get(STAMP_KEY) or {}
    src = _find_source(directory, stamp, source, no_source)
    # What the export declared (a cast, fresh keys) holds whichever source it is compared with.
    cast_name = stamp.get("dtype") or "keep"
    cast = None if cast_name == "keep" else getattr(torch, cast_name)
    fresh = bool(stamp.get("fresh"))
    batch, described, tokenizer = _inputs(directory, config, task, prompts)
    report = VerifyReport(str(directory), architectures[0], task, src.label if src else None, described)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check1, ref_export = _guard(1, _check_loadable, directory, task, architectures[0])
        report.checks.append(check1)
        if src is None:
            report.checks.append(Check(2, CHECK_NAMES[2], SKIP, "--no-source"))
            report.checks.append(Check(3, CHECK_NAMES[3], SKIP, "--no-source"))
        else:
            report.checks.append(_guard(2, _check_weights, directory, config, task, stamp, src, cast)[0])
            if ref_export is None:
                report.checks.append(Check(3, CHECK_NAMES[3], SKIP, "transformers cannot load DIR (check 1)"))
            else:
                report.checks.append(_guard(3, _check_against_source, directory, task, src, cast, fresh,
                                            ref_export, batch)[0])
        impls = tuple(get_family(config.model_type).attn_implementations)
        report.checks.append(_guard(4, _check_native, directory, task, batch, impls)[0])
        report.checks.append(_guard(5, _check_tokenizer, src, tokenizer, list(prompts or DEFAULT_PROMPTS))[0])
        check6 = _guard(6, _check_sentence, directory, src, stamp, cast, list(prompts or DEFAULT_PROMPTS))[0]
        report.checks += [check6] if check6 is not None else []
    return report


# ---- the matrix: every registered family x head, generated locally ----------------------------------

# Size fields of the lineage's configs (HF names, DistilBERT's included) and their tiny values.
# Applied to the fields a config sets and to those transformers' defaults have; others stay.
TINY = {
    "hidden_size": 32, "dim": 32, "pooler_hidden_size": 32, "embedding_size": 16,
    "num_attention_heads": 4, "n_heads": 4, "intermediate_size": 64, "hidden_dim": 64,
    "num_hidden_layers": 2, "n_layers": 2, "vocab_size": 128, "max_position_embeddings": 64,
}
TASK_LABELS = {"seqcls": 3, "tokcls": 3, "qa": 2}  # transformers' QA head splits exactly 2 outputs


def tiny_config(model_type: str, fields: dict[str, Any] | None = None, task: str | None = None) -> dict[str, Any]:
    """transformers config fields for a tiny model of ``model_type`` (hidden 32, 2 layers), keeping
    ``fields``' variant switches (activation, attention types, groups...) and shrinking their sizes."""
    transformers = quiet_transformers()
    defaults = transformers.AutoConfig.for_model(model_type).to_dict()
    base = {"model_type": model_type, **(fields or {})}
    out = dict(base)
    for name, value in TINY.items():
        if name in base or defaults.get(name) is not None:
            out[name] = value
    if base.get("embedding_size") is not None and base.get("embedding_size") == base.get("hidden_size"):
        out["embedding_size"] = out["hidden_size"]
    if "num_hidden_groups" in base:
        out["num_hidden_groups"] = min(base["num_hidden_groups"], out.get("num_hidden_layers", 2))
    specials = [v for k, v in {**defaults, **out}.items() if k.endswith("_token_id") and isinstance(v, int)]
    if "vocab_size" in out and specials:
        out["vocab_size"] = max(out["vocab_size"], max(specials) + 1)
    if task in TASK_LABELS:
        out["num_labels"] = TASK_LABELS[task]
    return out


def generate_checkpoint(fields: dict[str, Any], task: str, out: Path, seed: int = 0, perturb: float = 0.05) -> Path:
    """transformers' model for ``task`` from ``fields``, every parameter perturbed (so LayerNorms and
    biases are not trivial), written with ``save_pretrained``."""
    transformers = quiet_transformers()
    fields = dict(fields)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, get_task(task).auto_class).from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * perturb)
    model.save_pretrained(str(out))
    return out


@dataclass
class Cell:
    model_type: str
    head: str
    status: str                 # PASS, FAIL, ERROR or n/a
    max_abs_diff: float | None
    seconds: float
    detail: str = ""
    checks: list[dict] = field(default_factory=list)


@dataclass
class MatrixResult:
    model_types: list[str]
    heads: list[str]
    cells: list[Cell]
    seconds: float
    json_path: Path | None = None
    html_path: Path | None = None
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        ran = [c for c in self.cells if c.status != "n/a"]
        return bool(ran) and all(c.status == PASS for c in ran)

    def cell(self, model_type: str, head: str) -> Cell | None:
        """The cell, or None where the head is another family's own task (not part of this family)."""
        return next((c for c in self.cells if c.model_type == model_type and c.head == head), None)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.cells:
            out[c.status] = out.get(c.status, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"model_types": self.model_types, "heads": self.heads, "seconds": round(self.seconds, 2),
                "ok": self.ok, "counts": self.counts(), "versions": self.versions,
                "cells": [asdict(c) for c in self.cells]}

    def format_table(self) -> str:
        width = 13
        lines = ["verify-matrix: export then verify-export per cell (status, max abs diff of outputs)",
                 f"{'model_type':14}" + "".join(f"{h:{width}}" for h in self.heads)]
        for mt in self.model_types:
            row = f"{mt:14}"
            for head in self.heads:
                c = self.cell(mt, head)
                if c is None:
                    row += f"{'-':{width}}"
                    continue
                diff = "" if c.max_abs_diff is None else f" {c.max_abs_diff:.2g}"
                row += f"{c.status + diff:{width}}"
            lines.append(row)
        counts = ", ".join(f"{n} {s}" for s, n in sorted(self.counts().items()))
        lines.append(f"{len(self.cells)} cells: {counts}; {self.seconds:.1f} s")
        for c in self.cells:
            if c.status in ("FAIL", "ERROR"):
                lines.append(f"  {c.model_type} x {c.head}: {c.detail}")
        return "\n".join(lines)


def cell_gate(model_type: str, head: str, fields: dict) -> tuple[str | None, str]:
    """(None, "") when the cell runs. ("n/a", why) only where transformers itself has no class for it;
    ("FAIL", why) where transformers has one and the family does not declare the task or cannot build it
    (a family that forgets a head fails the matrix instead of passing it)."""
    from .task_registry import hf_mapping
    theirs = hf_mapping(head).get(model_type)
    if not theirs:
        return "n/a", f"transformers has no {head} class for {model_type}"
    family = get_family(model_type)
    if not family.supports(head):
        return FAIL, f"transformers has {theirs}; the {family.model_type} family declares no {head} task"
    config = config_from_dict(quiet_transformers().AutoConfig.for_model(
        model_type, **{k: v for k, v in fields.items() if k != "model_type"}).to_dict())
    try:
        with torch.device("meta"):
            build_model(config, head)
    except UnsupportedModelError as exc:
        return FAIL, f"transformers has {theirs}; ours cannot be built: {exc}"
    return None, ""


def matrix_pairs(model_types: list[str], heads: list[str]) -> list[tuple[str, str]]:
    """The (model_type, head) cells: every core task for every family; a task a family added
    (``core=False``) only for the families that declare it."""
    return [(mt, h) for mt in model_types for h in heads
            if get_task(h).core or get_family(mt).supports(h)]


def _run_cell(model_type: str, head: str, fields: dict, work: Path) -> Cell:
    start = time.perf_counter()
    fields = tiny_config(model_type, fields, head)
    status, why = cell_gate(model_type, head, fields)
    if status:
        return Cell(model_type, head, status, None, 0.0, why)
    src = generate_checkpoint(fields, head, work / "sources" / f"{model_type}-{head}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export(src, work / "exports" / f"{model_type}-{head}", force=True)
    report = verify_export(work / "exports" / f"{model_type}-{head}")
    failed = [f"{c.number} {c.name}: {c.detail}" for c in report.checks if c.status == FAIL]
    return Cell(model_type, head, PASS if report.ok else FAIL, report.max_abs_diff,
                time.perf_counter() - start, "; ".join(failed), [asdict(c) for c in report.checks])


def verify_matrix(families: list[str] | None = None, heads: list[str] | None = None,
                  out_dir: str | os.PathLike | None = "verify-matrix", configs: dict[str, dict] | None = None,
                  keep: bool = False, progress: bool = True) -> MatrixResult:
    """export then verify_export for every registered model_type x head, on tiny checkpoints generated
    with transformers (no network). Writes ``matrix.json`` and ``matrix.html`` into ``out_dir``.

    ``configs``: model_type -> transformers config fields (sizes are shrunk by ``tiny_config``).
    ``keep``: keep the generated sources and exports under ``out_dir/work``.
    """
    model_types = list(families or supported_model_types())
    for mt in model_types:
        get_family(mt)  # unknown names fail here, listing the supported ones
    heads = list(heads or [t for t in task_names()
                           if get_task(t).core or any(get_family(mt).supports(t) for mt in model_types)])
    for head in heads:
        if head not in task_names():
            raise InputError(f"head {head!r}: expected one of {', '.join(task_names())}")
    out = Path(out_dir).expanduser().absolute() if out_dir is not None else None
    work = out / "work" if keep and out is not None else Path(tempfile.mkdtemp(prefix="flodl-hf-matrix-"))
    cells: list[Cell] = []
    start = time.perf_counter()
    pairs = matrix_pairs(model_types, heads)
    from tqdm.auto import tqdm
    try:
        for mt, head in tqdm(pairs, desc="verify-matrix", unit="cell", disable=not progress):
            try:
                cells.append(_run_cell(mt, head, (configs or {}).get(mt, {}), work))
            except Exception as exc:  # one broken cell must not hide the others
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                cells.append(Cell(mt, head, "ERROR", None, 0.0, f"{type(exc).__name__}: {first}"))
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    import transformers
    from . import __version__
    result = MatrixResult(model_types, heads, cells, time.perf_counter() - start, versions={
        "flodl_hf": __version__, "torch": torch.__version__, "transformers": transformers.__version__})
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        result.json_path, result.html_path = out / "matrix.json", out / "matrix.html"
        result.json_path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        result.html_path.write_text(render_html(result))
    return result


def render_html(result: MatrixResult) -> str:
    """A self-contained page (inline CSS, no scripts): one coloured cell per family x head."""
    colour = {PASS: "#d8f5d0", FAIL: "#ffd6d6", "ERROR": "#ffd6d6", "n/a": "#eeeeee"}
    head_row = "".join(f"<th>{html.escape(h)}</th>" for h in result.heads)
    rows = []
    for mt in result.model_types:
        tds = []
        for head in result.heads:
            c = result.cell(mt, head)
            if c is None:
                tds.append("<td>-</td>")
                continue
            diff = "" if c.max_abs_diff is None else f"<br><small>max |diff| {c.max_abs_diff:.2g}</small>"
            checks = "\n".join(f"{k['number']} {k['name']}: {k['status']} ({k['detail']})" for k in c.checks)
            title = html.escape(checks or c.detail, quote=True)
            tds.append(f'<td style="background:{colour.get(c.status, "#fff")}" title="{title}">'
                       f"<b>{html.escape(c.status)}</b>{diff}<br><small>{c.seconds:.1f} s</small></td>")
        rows.append(f"<tr><th>{html.escape(mt)}</th>{''.join(tds)}</tr>")
    failures = "".join(f"<li><b>{html.escape(c.model_type)} x {html.escape(c.head)}</b>: {html.escape(c.detail)}</li>"
                       for c in result.cells if c.status in (FAIL, "ERROR"))
    counts = ", ".join(f"{n} {s}" for s, n in sorted(result.counts().items()))
    versions = ", ".join(f"{k} {v}" for k, v in result.versions.items())
    verdict = "all PASS" if result.ok else "NOT all PASS"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>flodl-hf verify-matrix</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #bbb; padding: .45em .8em; text-align: center; }}
th {{ background: #f4f4f4; }}
</style></head><body>
<h1>flodl-hf verify-matrix: {verdict}</h1>
<p>Each cell: a checkpoint generated locally with transformers, exported with <code>flodl-hf export</code>,
then <code>flodl-hf verify-export</code> (loadable with zero missing/unexpected keys, weights byte-identical,
transformers export vs source, native vs transformers; every output field <code>torch.equal</code>, CPU float32).
Hover a cell for its checks.</p>
<table><tr><th>model_type</th>{head_row}</tr>
{''.join(rows)}
</table>
<p>{len(result.cells)} cells: {counts}; {result.seconds:.1f} s. {html.escape(versions)}.</p>
{f'<h2>Failures</h2><ul>{failures}</ul>' if failures else ''}
</body></html>
"""


# ---- CLI ------------------------------------------------------------------------------------------------

def run_verify_export(args: argparse.Namespace) -> int:
    report = verify_export(args.dir, source=args.source, no_source=args.no_source, prompts=args.prompt)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_table())
    return 0 if report.ok else 1


def run_verify_matrix(args: argparse.Namespace) -> int:
    result = verify_matrix(args.families, args.heads, args.out, keep=args.keep, progress=not args.json)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.format_table())
        print(f"wrote {result.json_path} and {result.html_path}")
    return 0 if result.ok else 1


def register_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify-export", help="prove an exported directory matches its source; exit 1 on any FAIL")
    p.add_argument("dir", metavar="DIR")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--source", default=None, help="compare with this source instead of the stamped one")
    group.add_argument("--no-source", action="store_true", help="no upstream (fine-tuned): checks 1 and 4 only")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="an input text (repeatable); default: two prompts, or random ids without a tokenizer")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_verify_export)

    p = sub.add_parser("verify-matrix", help="export + verify-export over every family x head, generated locally")
    p.add_argument("--families", nargs="+", default=None, metavar="MODEL_TYPE", help="default: every registered one")
    p.add_argument("--heads", nargs="+", default=None, choices=list(task_names()),
                   help="default: the six core tasks and the tasks the chosen families add")
    p.add_argument("--out", default="verify-matrix", help="where matrix.json and matrix.html go")
    p.add_argument("--keep", action="store_true", help="keep the generated sources and exports in OUT/work")
    p.add_argument("--json", action="store_true", help="print the matrix as JSON")
    p.set_defaults(func=run_verify_matrix)
