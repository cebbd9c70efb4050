"""The verify matrix: export then verify-export for every registered family x task, on tiny checkpoints
generated with transformers (no network), as a table, ``matrix.json`` and ``matrix.html``.

A cell is n/a only where transformers itself has no class for it (``cell_gate``); a task a family
added is asked only of the families that declare it (``matrix_pairs``).
"""

from __future__ import annotations

import copy
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

from flodl_hf.auto import build_model, config_from_dict
from flodl_hf.core.errors import InputError, UnsupportedModelError
from flodl_hf.roundtrip.export import export
from flodl_hf.roundtrip.parity import quiet_transformers
from flodl_hf.core.registry import get_family, supported_model_types
from flodl_hf.core.registry import get_task, task_names
from flodl_hf.roundtrip.verify import FAIL, PASS, verify_export


# Size fields of the lineage's configs (HF names, DistilBERT's included) and their tiny values.
# Applied to the fields a config sets and to those transformers' defaults have; others stay.
TINY = {
    "hidden_size": 32, "dim": 32, "pooler_hidden_size": 32, "embedding_size": 16,
    "num_attention_heads": 4, "n_heads": 4, "intermediate_size": 64, "hidden_dim": 64,
    "num_hidden_layers": 2, "n_layers": 2, "vocab_size": 128, "max_position_embeddings": 64,
    "num_key_value_heads": 2,  # decoders' grouped KV heads (Mistral's default 8, Qwen2's 32)
    "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,  # GPT-2's names
    "ffn_dim": 64,  # OPT's MLP width
    "num_local_experts": 4, "num_experts": 4,  # Mixtral's, Qwen2-MoE's experts (8, 60 by default)
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,  # Qwen2-MoE's expert widths
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
    for sub in ("text_config", "vision_config"):  # a dual model's towers (CLIP, SigLIP), each shrunk as its own
        if isinstance(defaults.get(sub), dict):
            out[sub] = tiny_config(defaults[sub]["model_type"], (fields or {}).get(sub))
    if task in TASK_LABELS:
        out["num_labels"] = TASK_LABELS[task]
    for key in ("rope_parameters", "rope_scaling"):
        # longrope's factor lists hold one entry per pair of rotated dimensions: cut (or cycle) to the tiny head's
        params = out.get(key)
        lists = [n for n in ("short_factor", "long_factor") if isinstance(params, dict) and params.get(n)
                 and isinstance(params[n], list)]
        if lists:
            head = out.get("head_dim") or out["hidden_size"] // out["num_attention_heads"]
            partial = params.get("partial_rotary_factor", out.get("partial_rotary_factor")) or 1.0
            pairs = int(head * partial) // 2
            out[key] = {**params, **{n: [params[n][i % len(params[n])] for i in range(pairs)] for n in lists}}
    rotary = {**defaults, **out}.get("rotary_dim")  # GPT-J: the turned dimensions fit in the tiny head
    if isinstance(rotary, int) and out.get("n_embd") and out.get("n_head"):
        out["rotary_dim"] = min(rotary, out["n_embd"] // out["n_head"])
    if task == "seqcls" and {**defaults, **out}.get("pad_token_id") is None:
        out["pad_token_id"] = 0  # a decoder's classifier finds each row's last token by it (batches of 2 rows)
    return out


def generate_checkpoint(fields: dict[str, Any], task: str, out: Path, seed: int = 0, perturb: float = 0.05) -> Path:
    """transformers' model for ``task`` from ``fields``, every parameter perturbed (so LayerNorms and
    biases are not trivial), written with ``save_pretrained``."""
    transformers = quiet_transformers()
    fields = copy.deepcopy(dict(fields))  # transformers' configs fill nested RoPE dicts in place: keep the caller's
    from transformers.models.auto import modeling_auto
    several = getattr(modeling_auto, get_task(task).hf_mapping, {}).get(fields["model_type"])
    if isinstance(several, (tuple, list)):  # an Auto class with several classes for the type (DeiT's) picks by it
        fields.setdefault("architectures", [several[0]])
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    reference = getattr(transformers, get_task(task).auto_class)
    # a task without an Auto class names transformers' own class (GPT2DoubleHeadsModel): built as an Auto class would
    model = (reference.from_config if hasattr(reference, "from_config") else reference._from_config)(config)
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
        first = max([14, *(len(mt) + 2 for mt in self.model_types)])  # roberta-prelayernorm: 20 characters
        lines = ["verify-matrix: export then verify-export per cell (status, max abs diff of outputs)",
                 f"{'model_type':{first}}" + "".join(f"{h:{width}}" for h in self.heads)]
        for mt in self.model_types:
            row = f"{mt:{first}}"
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
    from flodl_hf.core.registry import hf_mapping
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
    from flodl_hf.core.version import __version__
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
