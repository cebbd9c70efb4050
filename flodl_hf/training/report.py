"""The run's page: one view, the same at every level of the record tree (root, host, rank).

The page is served live by :mod:`flodl_hf.training.portal` (it reads ``/history`` and follows one
``/stream``), or saved as one self-contained file with every level's records inlined
(:func:`write_report`, ``flodl-hf portal RUN --save run.html``), which opens from disk,
makes no network request and navigates across levels by its ``#/path`` fragment. Charts
are inline SVG drawn by the page's own script; nothing is loaded from anywhere.
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path

from flodl_hf.training.records import load_tree, tree_paths

REPORT_NAME = "run.html"


def render_page(*, title: str = "flodl-hf run", data: dict | None = None) -> str:
    """The page. ``data`` (``{"paths": [...], "nodes": {path: records}}``) makes it the saved,
    self-contained page; without it the page reads the portal's HTTP API."""
    inline = "null" if data is None else json.dumps(data, separators=(",", ":"))
    # JSON inside <script>: "</" would end the element, so it is escaped (JSON allows "<\/").
    inline = inline.replace("</", "<\\/").replace("<!--", "<\\!--")
    return (_PAGE.replace("__TITLE__", html.escape(title)).replace("__STYLE__", _STYLE)
            .replace("__SCRIPT__", _SCRIPT.replace("__DATA__", inline)))


def saved_page(run: str | os.PathLike) -> str:
    """The self-contained page of ``run`` (every level inlined)."""
    run = Path(run)
    nodes = load_tree(run)
    return render_page(title=f"flodl-hf run: {run.name}", data={"paths": list(nodes), "nodes": nodes})


def write_report(log_dir: str | os.PathLike, path: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Write ``log_dir``'s whole record tree as one page (default ``log_dir/run.html``, replaced at
    each write); return its path. A ``path`` that exists is replaced only with ``force``, and only
    where it is a page (``<!doctype html>``): never a directory, a record file or anything else."""
    from flodl_hf.core.errors import InputError, OutputExistsError, SourceNotFoundError
    log_dir = Path(log_dir)
    if not tree_paths(log_dir):
        raise SourceNotFoundError(f"{log_dir}: no run records here (records.jsonl, or the older run.jsonl)")
    out = Path(path).expanduser() if path is not None else log_dir / REPORT_NAME
    if path is not None:
        if out.is_dir():
            raise OutputExistsError(f"{out} is a directory: give the page's file name (nothing was written)")
        if not out.parent.is_dir():
            raise InputError(f"{out}: its directory {out.parent} does not exist (nothing was written)")
        if out.exists() or out.is_symlink():
            if not force:
                raise OutputExistsError(f"{out} already exists: pass --force (force=True) to replace it, or "
                                        "choose another path (nothing was written)")
            if out.is_symlink() or not _is_page(out):
                raise OutputExistsError(f"{out} is not a page (no <!doctype html> at its start): --force replaces "
                                        "only an earlier page; choose another path (nothing was written)")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(saved_page(log_dir))
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def _is_page(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(15).lower() == b"<!doctype html>"


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>__STYLE__</style></head>
<body>
<nav id="crumbs"></nav>
<header><h1 id="name"></h1><span id="level" class="level"></span><span id="status" class="badge"></span>
<span id="eta"></span><span id="stepinfo"></span>
<span class="axis">x: <button id="x-step" class="on">step</button><button id="x-time">time</button></span></header>
<section id="children"></section>
<section id="charts"></section>
<p class="note" id="mode"></p>
<script>__SCRIPT__</script>
</body></html>
"""

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px auto; max-width: 1100px; color: #222; padding: 0 12px; }
h1 { font-size: 20px; display: inline; margin-right: 10px; }
nav { margin-bottom: 6px; } nav a { color: #1f5fa8; cursor: pointer; text-decoration: none; } nav a:hover { text-decoration: underline; }
header { display: flex; gap: 12px; align-items: baseline; flex-wrap: wrap; border-bottom: 1px solid #ddd; padding-bottom: 8px; }
.level { color: #666; } .axis { margin-left: auto; } .axis button { border: 1px solid #bbb; background: #fff; cursor: pointer; }
.axis button.on { background: #1f5fa8; color: #fff; }
.badge { padding: 1px 8px; border-radius: 9px; font-size: 12px; background: #ddd; }
.b-training { background: #d6f0d6; } .b-idle { background: #fff1c4; } .b-slowest { background: #ffd8b0; }
.b-finished { background: #dde6f5; } .b-lost { background: #f7c6c6; }
#children { display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr)); gap: 8px; margin: 12px 0; }
.child { border: 1px solid #ddd; border-radius: 6px; padding: 6px 8px; cursor: pointer; }
.child:hover { border-color: #1f5fa8; } .child b { font-size: 13px; }
.child table { font-size: 12px; width: 100%; } .child td { padding: 0 2px; } .child td.v { text-align: right; }
#charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 6px 16px; }
h2 { font-size: 14px; margin: 10px 0 2px; }
svg text { font-size: 10px; fill: #333; } .grid { stroke: #eee; } .frame { fill: none; stroke: #999; }
.note { color: #666; font-size: 12px; }
"""

# The page's script. It keeps one node in view: its records (history, then its one stream) and
# its children's latest summaries, which arrive inside those records.
_SCRIPT = r"""
"use strict";
const SAVED = __DATA__;
const TOKEN = new URLSearchParams(location.search).get("token");
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const CHARTS = [
  ["loss", "loss"], ["samples_per_s", "samples / s"], ["ms_per_batch", "ms per batch"],
  ["batches", "batches per window"], ["idle_share", "idle share of window"], ["sync_ms", "sync ms"],
  ["lr", "learning rate"], ["cpu_pct", "CPU %"], ["rss_mb", "RSS MiB"], ["gpu_util", "GPU %"],
  ["gpu_mem_mb", "GPU MiB"]];
const EXTREMES = new Set(["samples_per_s", "ms_per_batch", "idle_share", "loss", "cpu_pct", "rss_mb"]);
let view = {path: null, train: [], evals: [], last: null, children: {}, spark: {}, source: null, gen: 0};
let xAxis = "step";

function api(u) { return TOKEN ? u + (u.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(TOKEN) : u; }
function esc(s) { return String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c])); }
function fmt(v) {
  if (v === undefined || v === null) return "-";
  if (typeof v !== "number") return esc(v);
  const a = Math.abs(v);
  return a !== 0 && (a >= 1e5 || a < 1e-3) ? v.toExponential(2) : String(+v.toPrecision(4));
}
function fmtS(s) {
  if (s === undefined || s === null) return "";
  s = Math.round(s); const h = Math.floor(s / 3600), m = Math.floor(s % 3600 / 60);
  return h ? `${h}h ${m}m` : m ? `${m}m ${s % 60}s` : `${s}s`;
}
function levelOf(p) { return p === "" ? "root" : p.includes("/") ? "rank" : "host"; }
function nameOf(p) { return p === "" ? "run" : p.split("/").pop(); }
function join(p, c) { return p === "" ? c : p + "/" + c; }
function stale(r, dts) {
  // A running node that has not written for ten of its windows (30 s at least) is lost.
  if (SAVED || !r || !["training", "idle", "slowest"].includes(r.status)) return r ? r.status : "";
  const dt = dts.length ? dts.slice().sort((a, b) => a - b)[dts.length >> 1] : 3;
  return Date.now() / 1000 - r.t > Math.max(30, 10 * dt) ? "lost" : r.status;
}

function add(rec) {
  if (rec.event === "eval") { view.evals.push(rec); return; }
  if (rec.event === "train") view.train.push(rec);
  if (rec.event === "train" || rec.event === "end" || rec.status) view.last = Object.assign({}, view.last || {}, rec);
  for (const [k, c] of Object.entries(rec.children || {})) {
    view.children[k] = c;
    if (rec.event === "train") (view.spark[k] = view.spark[k] || []).push(c.samples_per_s);
  }
}

async function show(path) {
  const gen = ++view.gen;
  if (view.source) { view.source.close(); view.source = null; }
  view = {path, train: [], evals: [], last: null, children: {}, spark: {}, source: null, gen};
  let records;
  if (SAVED) records = SAVED.nodes[path] || [];
  else {
    const res = await fetch(api("/history/" + path));
    if (gen !== view.gen) return;
    if (!res.ok) { document.getElementById("name").textContent = "unknown node " + path; return; }
    records = (await res.json()).records;
  }
  records.forEach(add);
  render();
  if (!SAVED) {
    // One stream: this node's. Its children's numbers come inside its records.
    const t = records.length ? records[records.length - 1].t : null;
    const es = new EventSource(api("/stream/" + path + (typeof t === "number" ? "?since=" + t : "")));
    es.addEventListener("record", e => { if (gen === view.gen) { add(JSON.parse(e.data)); render(); } });
    view.source = es;
  }
}

function render() {
  const p = view.path, last = view.last || {};
  const parts = p === "" ? [] : p.split("/");
  let crumbs = `<a href="#/" data-path="">run</a>`, acc = "";
  for (const part of parts) { acc = join(acc, part); crumbs += ` › <a href="#/${esc(acc)}" data-path="${esc(acc)}">${esc(part)}</a>`; }
  document.getElementById("crumbs").innerHTML = crumbs;
  document.getElementById("name").textContent = nameOf(p);
  document.getElementById("level").textContent = levelOf(p) + (last.ranks ? ` · ${last.alive} of ${last.ranks} ranks alive` : "");
  const ts = view.train.map(r => r.t), dts = ts.slice(1).map((t, i) => t - ts[i]);
  const st = stale(last, dts) || "waiting";
  const badge = document.getElementById("status");
  badge.textContent = st; badge.className = "badge b-" + st;
  document.getElementById("eta").textContent = last.eta_s ? "ETA " + fmtS(last.eta_s) : "";
  document.getElementById("stepinfo").textContent = last.step !== undefined ? `step ${last.step}` : "";
  document.getElementById("mode").textContent = SAVED ? "saved page: every level inlined, no server" :
    "live: following this node's stream";
  // Children grid.
  const grid = Object.entries(view.children).map(([k, c]) => {
    const cst = stale(c, dts);
    const rows = [["loss", c.loss], ["samples/s", c.samples_per_s], ["ms/batch", c.ms_per_batch],
                  ["idle", c.idle_share === undefined ? undefined : (100 * c.idle_share).toFixed(1) + "%"]]
      .concat(c.alive !== undefined ? [["alive", `${c.alive}/${c.alive + (c.dead || 0)}`]] : []);
    return `<div class="child" data-child="${esc(k)}" data-path="${esc(join(p, k))}"><b>${esc(k)}</b>
      <span class="badge b-${esc(cst)}">${esc(cst)}</span>${spark(view.spark[k] || [])}
      <table>${rows.map(([a, b]) => `<tr><td>${a}</td><td class="v">${typeof b === "string" ? esc(b) : fmt(b)}</td></tr>`).join("")}</table></div>`;
  });
  document.getElementById("children").innerHTML = grid.join("");
  // Charts.
  const xs = r => xAxis === "step" ? r.step : r.t - (view.train[0] || r).t;
  const out = [];
  for (const [key, label] of CHARTS) {
    const series = [{label: levelOf(p) === "rank" ? nameOf(p) : ["samples_per_s", "batches", "rss_mb", "gpu_mem_mb"].includes(key) ? "sum" : "mean",
                     pts: view.train.filter(r => typeof r[key] === "number").map(r => [xs(r), r[key]])}];
    if (!series[0].pts.length) continue;
    if (EXTREMES.has(key) && levelOf(p) !== "rank" && (last.ranks || 0) > 1) {
      for (const side of ["min", "max"])
        series.push({label: side + " rank", dash: true,
                     pts: view.train.filter(r => r[side] && r[side][key]).map(r => [xs(r), r[side][key].v])});
    }
    out.push(chart(key, label, series));
  }
  const evalKeys = [...new Set(view.evals.flatMap(r => Object.keys(r).filter(k =>
    typeof r[k] === "number" && !["step", "epoch", "time", "t", "eval_s"].includes(k))))];
  if (evalKeys.length)
    out.push(chart("eval", "evaluation", evalKeys.map(k => ({label: k, markers: true,
      pts: view.evals.filter(r => typeof r[k] === "number").map(r => [xAxis === "step" ? r.step : r.t - (view.train[0] || r).t, r[k]])}))));
  document.getElementById("charts").innerHTML = out.join("") || '<p class="note">no records yet</p>';
}

function ticks(lo, hi, n) {
  if (!(hi > lo)) hi = lo + (Math.abs(lo) || 1);
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw);
  const first = Math.floor(lo / step) * step, out = [];
  for (let v = first; v < hi + step * 0.999; v += step) out.push(+v.toPrecision(12));
  return out;
}

function chart(key, label, series) {
  const W = 520, H = 200, L = 56, R = 96, T = 10, B = 30, pw = W - L - R, ph = H - T - B;
  const all = series.flatMap(s => s.pts);
  const xt = ticks(Math.min(...all.map(q => q[0])), Math.max(...all.map(q => q[0])), 5);
  const yt = ticks(Math.min(...all.map(q => q[1])), Math.max(...all.map(q => q[1])), 4);
  const x0 = xt[0], x1 = xt[xt.length - 1], y0 = yt[0], y1 = yt[yt.length - 1];
  const px = x => L + (x - x0) / (x1 - x0) * pw, py = y => T + ph - (y - y0) / (y1 - y0) * ph;
  let s = `<h2>${esc(label)}</h2><svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" data-metric="${esc(key)}" data-points="${series[0].pts.length}">`;
  for (const v of yt) s += `<line x1="${L}" x2="${L + pw}" y1="${py(v).toFixed(1)}" y2="${py(v).toFixed(1)}" class="grid"/><text x="${L - 5}" y="${(py(v) + 3).toFixed(1)}" text-anchor="end">${fmt(v)}</text>`;
  for (const v of xt) s += `<text x="${px(v).toFixed(1)}" y="${T + ph + 13}" text-anchor="middle">${fmt(v)}</text>`;
  s += `<rect x="${L}" y="${T}" width="${pw}" height="${ph}" class="frame"/><text x="${L + pw / 2}" y="${H - 3}" text-anchor="middle">${xAxis === "step" ? "step" : "seconds"}</text>`;
  series.forEach((se, i) => {
    const c = se.dash ? "#999" : COLORS[i % COLORS.length], d = se.dash ? ' stroke-dasharray="4 3"' : "";
    const pts = se.pts.map(q => px(q[0]).toFixed(1) + "," + py(q[1]).toFixed(1)).join(" ");
    if (se.pts.length > 1) s += `<polyline points="${pts}" fill="none" stroke="${c}" stroke-width="1.5"${d}/>`;
    if (se.markers || se.pts.length === 1) s += se.pts.map(q => `<circle cx="${px(q[0]).toFixed(1)}" cy="${py(q[1]).toFixed(1)}" r="2.5" fill="${c}"/>`).join("");
    const ly = T + 10 + 14 * i;
    s += `<line x1="${L + pw + 8}" x2="${L + pw + 22}" y1="${ly - 3}" y2="${ly - 3}" stroke="${c}" stroke-width="2"${d}/><text x="${L + pw + 26}" y="${ly}">${esc(se.label)}</text>`;
  });
  return "<div>" + s + "</svg></div>";
}

function spark(vals) {
  const v = vals.filter(x => typeof x === "number");
  if (v.length < 2) return '<svg width="120" height="24" class="spark"></svg>';
  const lo = Math.min(...v), hi = Math.max(...v), span = hi - lo || 1;
  const pts = v.map((y, i) => (i / (v.length - 1) * 118 + 1).toFixed(1) + "," + (22 - (y - lo) / span * 20).toFixed(1)).join(" ");
  return `<svg width="120" height="24" class="spark" data-points="${v.length}"><polyline points="${pts}" fill="none" stroke="#1f77b4" stroke-width="1.2"/></svg>`;
}

function route() {  // a node path of the tree's names only: anything else shows the root
  let p = "";
  try { p = decodeURIComponent(location.hash.replace(/^#\/?/, "")); } catch (e) { p = ""; }
  show(/^[A-Za-z0-9._-]+(\/[A-Za-z0-9._-]+)*$/.test(p) && !p.split("/").includes("..") ? p : "");
}
document.addEventListener("click", e => {
  const el = e.target.closest("[data-path]");
  if (el) { e.preventDefault(); location.hash = "#/" + el.dataset.path; }
});
for (const [id, mode] of [["x-step", "step"], ["x-time", "time"]])
  document.getElementById(id).addEventListener("click", () => {
    xAxis = mode; document.getElementById("x-step").className = mode === "step" ? "on" : "";
    document.getElementById("x-time").className = mode === "time" ? "on" : ""; render();
  });
window.addEventListener("hashchange", route);
route();
"""
