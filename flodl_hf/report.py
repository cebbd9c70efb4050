"""The training report: one self-contained HTML page with inline SVG plots.

It is built from the JSONL files a :class:`~flodl_hf.trainer.Trainer` writes (``run.jsonl``
and ``worker-R.jsonl``), so it can be rebuilt from a finished run's folder at any time. It
needs no server and no plotting library: open ``report.html`` from disk.
"""

from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path
from typing import Sequence

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
TOTAL_COLOR = "#444444"  # series that sum over workers; worker r is PALETTE[r] in every chart


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_report(log_dir: str | os.PathLike, path: str | os.PathLike | None = None) -> Path:
    """Render ``log_dir``'s records into ``path`` (default ``log_dir/report.html``); return the path."""
    log_dir = Path(log_dir)
    run = read_jsonl(log_dir / "run.jsonl")
    workers = {int(p.stem.split("-")[1]): read_jsonl(p) for p in sorted(log_dir.glob("worker-*.jsonl"))}
    out = Path(path) if path is not None else log_dir / "report.html"
    out.write_text(render_report(run, workers))
    return out


def render_report(run: Sequence[dict], workers: dict[int, Sequence[dict]]) -> str:
    """The HTML page for a run's rolled-up records and each worker's records."""
    start = next((r for r in run if r.get("event") == "start"), {})
    end = next((r for r in reversed(run) if r.get("event") == "end"), {})
    train = [r for r in run if r.get("event") == "train"]
    evals = [r for r in run if r.get("event") == "eval"]
    world = start.get("world_size") or max(len(workers), 1)

    sections = [_summary_table(start, end, train)]
    loss = [{**_series("train loss", train, "loss"), "color": TOTAL_COLOR}]
    metric_keys = sorted({k for r in evals for k in r if k not in ("event", "step", "epoch", "time", "eval_s")})
    loss += [_series(k, evals, k, markers=True) for k in metric_keys if "loss" in k]
    sections.append(svg_chart("Loss", loss, y_label="loss"))
    other = [_series(k, evals, k, markers=True) for k in metric_keys if "loss" not in k]
    if other:
        sections.append(svg_chart("Evaluation", other, y_label="metric"))

    throughput = [_series(f"worker {r} (compute)", train, "worker_samples_per_s", index=r) for r in range(world)]
    throughput.append({**_series("all workers (wall)", train, "samples_per_s"), "color": TOTAL_COLOR})
    sections.append(svg_chart("Throughput", throughput, y_label="samples / s"))
    if world > 1:
        share = [_series(f"worker {r}", train, "batch_share", index=r) for r in range(world)]
        sections.append(svg_chart("Batch share", share, y_label="share of batches", percent=True))
        if any("anchor" in r for r in train):
            per_window = [_series(f"worker {r}", train, "batches", index=r) for r in range(world)]
            sections.append(svg_chart("Batches per window", per_window, y_label="batches"))

    timed = [r for r in train if r.get("window_ms")]
    if timed:
        overhead = [{"label": "sync (averaging)", "xs": [r["step"] for r in timed],
                     "ys": [r["sync_ms"] / r["window_ms"][0] for r in timed], "color": TOTAL_COLOR}]
        overhead += [{"label": f"worker {w} idle", "xs": [r["step"] for r in timed],
                      "ys": [r["idle_ms"][w] / r["window_ms"][w] for r in timed], "dash": True,
                      "color": PALETTE[w % len(PALETTE)]} for w in range(world)]
        sections.append(svg_chart("Sync overhead (share of each window)", overhead, y_label="share of window",
                                  percent=True))
    elif world > 1:
        sections.append("<p class=note>Sync overhead: DDP overlaps its all-reduce with the backward pass, "
                        "so it is not measured apart from compute.</p>")
    sections.append(_worker_table(workers, timed))
    title = f"flodl-hf training: {start.get('sync', '?')}, {world} worker{'s' if world != 1 else ''}"
    return _PAGE.format(title=html.escape(title), body="\n".join(sections))


# ---- tables ----------------------------------------------------------------------------------

def _summary_table(start: dict, end: dict, train: Sequence[dict]) -> str:
    rows = [("sync", start.get("sync")), ("workers", start.get("world_size")), ("batch size per worker",
            start.get("batch_size")), ("device (worker 0)", start.get("device")),
            ("steps", f"{end.get('step', train[-1]['step'] if train else '?')} of {start.get('total_steps', '?')}"),
            ("samples", end.get("samples")), ("training time", _fmt_s(end.get("train_time"))),
            ("final train loss", _fmt(end.get("loss"))),
            ("last evaluation", ", ".join(f"{k} {_fmt(v)}" for k, v in (end.get("eval") or {}).items()) or None),
            ("El Che", start.get("el_che")), ("outer optimizer", start.get("outer")),
            ("resumed from", start.get("resumed_from"))]
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows
                   if v is not None)
    return f"<table class=summary>{body}</table>"


def _worker_table(workers: dict[int, Sequence[dict]], timed: Sequence[dict]) -> str:
    if not workers:
        return ""
    head = "<tr><th>worker</th><th>batches</th><th>samples</th><th>ms / batch</th><th>idle</th><th>sync</th></tr>"
    lines = []
    for rank, records in sorted(workers.items()):
        batches = sum(r.get("batches") or 0 for r in records)
        samples = sum(r.get("samples") or 0 for r in records)
        compute = sum(r.get("compute_ms") or 0 for r in records)
        window = sum(r["window_ms"][rank] for r in timed if rank < len(r["window_ms"]))
        idle = sum(r["idle_ms"][rank] for r in timed if rank < len(r["idle_ms"]))
        sync = sum(r["sync_ms"] for r in timed)
        cells = [rank, batches, samples, _fmt(compute / batches if batches else None),
                 f"{idle / window:.1%}" if window else "-", f"{sync / window:.1%}" if window else "-"]
        lines.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return f"<h2>Workers</h2><table class=workers>{head}{''.join(lines)}</table>"


def _fmt(v) -> str | None:
    if v is None:
        return None
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _fmt_s(v) -> str | None:
    return None if v is None else f"{v:.1f} s"


# ---- charts ----------------------------------------------------------------------------------

def _series(label: str, records: Sequence[dict], key: str, index: int | None = None, markers: bool = False) -> dict:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if index is not None:
            v = v[index] if isinstance(v, list) and index < len(v) else None
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return {"label": label, "xs": xs, "ys": ys, "markers": markers}


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values (1, 2, 5 times a power of ten) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    return [first + i * step for i in range(int(math.ceil((hi - first) / step)) + 1)]


def svg_chart(title: str, series: Sequence[dict], *, y_label: str = "", x_label: str = "step",
              percent: bool = False, width: int = 720, height: int = 260) -> str:
    """A line chart as inline SVG. Each series: ``label``, ``xs``, ``ys``; optional ``markers``, ``dash``, ``color``."""
    series = [s for s in series if s["xs"]]
    if not series:
        return f"<h2>{html.escape(title)}</h2><p class=note>no data</p>"
    left, right, top, bottom = 64, 170, 12, 40
    pw, ph = width - left - right, height - top - bottom
    xs = [x for s in series for x in s["xs"]]
    ys = [y for s in series for y in s["ys"]]
    xt, yt = _ticks(min(xs), max(xs)), _ticks(min(0.0, min(ys)) if percent else min(ys), max(ys))
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return top + ph - (y - y0) / (y1 - y0) * ph

    def label(v: float) -> str:
        return f"{v:.0%}" if percent else f"{v:.4g}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title)}">']
    for v in yt:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(v):.1f}" y2="{py(v):.1f}" class="grid" />'
                   f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{label(v)}</text>')
    for v in xt:
        out.append(f'<text x="{px(v):.1f}" y="{top + ph + 16}" text-anchor="middle">{v:g}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame" />')
    out.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle">{html.escape(x_label)}</text>')
    out.append(f'<text transform="translate(14 {top + ph / 2}) rotate(-90)" text-anchor="middle">'
               f'{html.escape(y_label)}</text>')
    for i, s in enumerate(series):
        color = s.get("color") or PALETTE[i % len(PALETTE)]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(s["xs"], s["ys"]))
        dash = ' stroke-dasharray="5 3"' if s.get("dash") else ""
        if len(s["xs"]) > 1:
            out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.6"{dash} />')
        if s.get("markers") or len(s["xs"]) == 1:
            out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.8" fill="{color}" />'
                    for x, y in zip(s["xs"], s["ys"])]
        ly = top + 10 + 16 * i
        out.append(f'<line x1="{left + pw + 12}" x2="{left + pw + 30}" y1="{ly - 4}" y2="{ly - 4}" '
                   f'stroke="{color}" stroke-width="2.5"{dash} />'
                   f'<text x="{left + pw + 36}" y="{ly}">{html.escape(s["label"])}</text>')
    out.append("</svg>")
    return f"<h2>{html.escape(title)}</h2>\n" + "".join(out)


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px auto; max-width: 760px; color: #222; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 16px; margin: 22px 0 6px; }}
table {{ border-collapse: collapse; }} th, td {{ padding: 2px 10px; text-align: left; border-bottom: 1px solid #eee; }}
svg text {{ font-size: 11px; fill: #333; }} .grid {{ stroke: #eee; }} .frame {{ fill: none; stroke: #999; }}
.note {{ color: #666; }}
</style></head>
<body><h1>{title}</h1>
{body}
</body></html>
"""
