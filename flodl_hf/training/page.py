"""The run page's HTML, style and script (rendered by :mod:`flodl_hf.training.report`).

Every chart holds one quantity in one unit (each series carries it as ``data-unit``); a chart appears
only where its series says something (El Che's window charts only where the records carry window
timing, the alive count only where it changed); counts and rates start at zero, a constant series is
drawn mid-chart with its value written, and the loss can be drawn on a log scale. An evaluation's
metrics each get a chart of their own; its bookkeeping fields (step, samples, eval_s...) are the
points' context, shown on hover. The run's last evaluation sits beside the loss in the summary at
the top, at every level.
"""

from __future__ import annotations

# Our page, and only ours, starts with these bytes: ``portal --save --force`` replaces a file only where
# it does (the generator meta comes before the title, the first text a run can influence).
PAGE_HEAD = ('<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
             '<meta name="generator" content="flodl-hf run page">')

PAGE = PAGE_HEAD + """<title>__TITLE__</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>__STYLE__</style></head>
<body>
<nav id="crumbs"></nav>
<header><h1 id="name"></h1><span id="level" class="level"></span><span id="status" class="badge"></span>
<span id="eta"></span><span id="stepinfo"></span>
<span class="axis">x: <button id="x-step" class="on">step</button><button id="x-time">time</button></span></header>
<section id="summary"></section>
<section id="choices"></section>
<section id="children"></section>
<section id="charts"></section>
<p class="note" id="mode"></p>
<div id="tip"></div>
<script>__SCRIPT__</script>
</body></html>
"""

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px auto; max-width: 1100px; color: #222; padding: 0 12px; }
h1 { font-size: 20px; display: inline; margin-right: 10px; }
nav { margin-bottom: 6px; } nav a { color: #1f5fa8; cursor: pointer; text-decoration: none; }
nav a:hover { text-decoration: underline; }
header { display: flex; gap: 12px; align-items: baseline; flex-wrap: wrap; border-bottom: 1px solid #ddd;
         padding-bottom: 8px; }
.level { color: #666; } .axis { margin-left: auto; } .axis button, h2 button { border: 1px solid #bbb;
  background: #fff; cursor: pointer; font-size: 11px; }
.axis button.on, h2 button.on { background: #1f5fa8; color: #fff; }
.badge { padding: 1px 8px; border-radius: 9px; font-size: 12px; background: #ddd; }
.b-training { background: #d6f0d6; } .b-idle { background: #fff1c4; } .b-slowest { background: #ffd8b0; }
.b-finished { background: #dde6f5; } .b-lost { background: #f7c6c6; }
#summary { display: flex; gap: 10px; flex-wrap: wrap; margin: 12px 0 4px; }
.stat { border: 1px solid #ddd; border-radius: 6px; padding: 4px 12px; min-width: 110px; }
.stat .k { color: #666; font-size: 12px; } .stat .v { font-size: 22px; font-weight: 600; }
.stat .sub { color: #888; font-size: 11px; } .stat.eval { border-color: #9bc29b; background: #f6fbf6; }
#children { display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr)); gap: 8px; margin: 12px 0; }
.child { border: 1px solid #ddd; border-radius: 6px; padding: 6px 8px; cursor: pointer; }
.child:hover { border-color: #1f5fa8; } .child b { font-size: 13px; }
.child table { font-size: 12px; width: 100%; } .child td { padding: 0 2px; } .child td.v { text-align: right; }
#charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 6px 16px; }
h2 { font-size: 14px; margin: 10px 0 2px; } h2 .unit { color: #777; font-weight: normal; font-size: 12px; }
svg text { font-size: 10px; fill: #333; } svg text.const { font-size: 11px; fill: #1f5fa8; }
.grid { stroke: #eee; } .frame { fill: none; stroke: #999; }
.note { color: #666; font-size: 12px; }
#choices table { font-size: 12px; border-collapse: collapse; margin: 4px 0; }
#choices td { padding: 1px 8px 1px 0; vertical-align: top; } #choices td.why { color: #666; }
#tip { position: absolute; display: none; pointer-events: none; white-space: nowrap; background: #fff;
       border: 1px solid #aaa;
       border-radius: 4px; padding: 3px 6px; font-size: 12px; box-shadow: 0 1px 4px rgba(0,0,0,.15); }
"""

# The page's script. It keeps one node in view: its records (history, then its one stream), its
# children's latest summaries, which arrive inside those records, and the run's evaluations (the
# root's records; read once more every few seconds while a lower level is followed live).
SCRIPT = r"""
"use strict";
const SAVED = __DATA__;
const TOKEN = new URLSearchParams(location.search).get("token");
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
// One quantity and one unit a chart. axis: "zero" a count or a rate, drawn from zero; "share" a fraction
// of a whole, from zero inside [0, 1]; "free" the data's own range. sum: a rollup sums its ranks (else
// averages them). window: El Che's window numbers, drawn where the records carry window timing.
// changing: drawn only where the series changed.
const CHARTS = [
  {key: "loss", title: "loss", unit: "loss", axis: "free", log: true},
  {key: "samples_per_s", title: "throughput", unit: "samples/s", axis: "zero", sum: true},
  {key: "ms_per_batch", title: "compute per batch", unit: "ms", axis: "zero"},
  {key: "lr", title: "learning rate", unit: "lr", axis: "zero"},
  {key: "batches", title: "batches per window", unit: "batches", axis: "zero", sum: true, window: true},
  {key: "idle_share", title: "idle share of the window", unit: "share", axis: "share", window: true},
  {key: "sync_ms", title: "sync", unit: "ms", axis: "zero", window: true},
  {key: "alive", title: "ranks alive", unit: "ranks", axis: "zero", changing: true},
  {key: "cpu_pct", title: "CPU", unit: "%", axis: "zero"},
  {key: "rss_mb", title: "resident memory", unit: "MiB", axis: "zero", sum: true},
  {key: "gpu_util", title: "GPU", unit: "%", axis: "zero"},
  {key: "gpu_mem_mb", title: "GPU memory", unit: "MiB", axis: "zero", sum: true},
  {key: "mem_peak_mb", title: "peak memory in the window", unit: "MiB", axis: "zero", sum: true},
  {key: "sync_mem_mb", title: "memory a sync allocates", unit: "MiB", axis: "zero", window: true}];
const EXTREMES = new Set(["samples_per_s", "ms_per_batch", "idle_share", "loss", "cpu_pct", "rss_mb", "mem_peak_mb",
                          "sync_mem_mb"]);
// An evaluation record's own fields: the context of its points (hover, x axis), never a metric.
const EVAL_CONTEXT = new Set(["event", "step", "epoch", "time", "samples", "eval_s", "t", "level", "name", "status"]);
const EVAL_REFRESH_MS = 5000;
let view = {path: null, train: [], evals: [], last: null, children: {}, spark: {}, source: null, gen: 0,
            charts: {}, evalAt: 0};
let xAxis = "step", logLoss = false;

function api(u) { return TOKEN ? u + (u.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(TOKEN) : u; }
const ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
function esc(s) { return String(s).replace(/[&<>"']/g, c => ENTITIES[c]); }
function num(v) { return typeof v === "number" && isFinite(v); }
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
function isEval(r) { return r.event === "eval"; }
function evalKeys() {
  return [...new Set(view.evals.flatMap(r => Object.keys(r).filter(k => num(r[k]) && !EVAL_CONTEXT.has(k))))];
}

function add(rec) {
  if (isEval(rec)) { view.evals.push(rec); return; }
  // El Che's choices: what the start chose and why, then each later choice (the windows, the tiers).
  if (rec.event === "start" && rec.el_che && rec.el_che.chose)
    for (const [k, v] of Object.entries(rec.el_che.chose))
      view.choices[k] = {value: v, why: (rec.el_che.why || {})[k] || "", step: 0};
  if (rec.event === "choice" && rec.field)
    view.choices[rec.field] = {value: rec.value, why: rec.why || "", step: rec.step};
  if (rec.event === "train") view.train.push(rec);
  if (rec.event === "train" || rec.event === "end" || rec.status) view.last = Object.assign({}, view.last || {}, rec);
  for (const [k, c] of Object.entries(rec.children || {})) {
    view.children[k] = c;
    if (rec.event === "train") (view.spark[k] = view.spark[k] || []).push(c.samples_per_s);
  }
}

async function rootEvals(gen) {
  // The run's evaluations are the root's records: a lower level reads them there.
  const last = view.evals[view.evals.length - 1];
  view.evalAt = Date.now();
  const res = await fetch(api("/history/?event=eval" + (last ? "&since=" + last.t : "")));
  if (!res.ok || gen !== view.gen) return [];
  return (await res.json()).records;
}

async function show(path) {
  const gen = ++view.gen;
  if (view.source) { view.source.close(); view.source = null; }
  view = {path, train: [], evals: [], last: null, children: {}, spark: {}, source: null, gen, charts: {}, evalAt: 0,
          choices: {}};
  let records, evals = [];
  if (SAVED) {
    records = SAVED.nodes[path] || [];
    if (path !== "") evals = (SAVED.nodes[""] || []).filter(isEval);
  } else {
    const res = await fetch(api("/history/" + path));
    if (gen !== view.gen) return;
    if (!res.ok) { document.getElementById("name").textContent = "unknown node " + path; return; }
    records = (await res.json()).records;
    if (path !== "") evals = await rootEvals(gen);
    if (gen !== view.gen) return;
  }
  records.forEach(add);
  evals.forEach(add);
  render();
  if (!SAVED) {
    // One stream: this node's. Its children's numbers come inside its records.
    const t = records.length ? records[records.length - 1].t : null;
    const es = new EventSource(api("/stream/" + path + (typeof t === "number" ? "?since=" + t : "")));
    es.addEventListener("record", async e => {
      if (gen !== view.gen) return;
      add(JSON.parse(e.data));
      if (path !== "" && Date.now() - view.evalAt > EVAL_REFRESH_MS) (await rootEvals(gen)).forEach(add);
      if (gen === view.gen) render();
    });
    view.source = es;
  }
}

function choicesTable() {
  // El Che's choices at the root, each with the measurement behind it (the start record's, then later ones).
  const rows = Object.entries(view.choices || {});
  if (!rows.length) return "";
  const show = v => v === null || v === undefined ? "auto" : Array.isArray(v) ? JSON.stringify(v) : String(v);
  return "<table><tr><td><b>El Che chose</b></td><td></td><td></td></tr>" + rows.map(([k, c]) =>
    `<tr data-choice="${esc(k)}"><td>${esc(k)}</td><td class="v">${esc(show(c.value))}` +
    `${c.step ? ` <span class="note">(step ${esc(c.step)})</span>` : ""}</td><td class="why">${esc(c.why)}</td></tr>`)
    .join("") + "</table>";
}

function summaryCards(last) {
  // The node's loss, the run's last evaluation beside it, then the node's throughput.
  const cards = [];
  if (num(last.loss)) cards.push(["loss", "loss", last.loss, `step ${last.step}`, ""]);
  const ev = view.evals[view.evals.length - 1];
  for (const k of ev ? evalKeys() : [])
    if (num(ev[k])) cards.push(["eval:" + k, k, ev[k], `evaluation at step ${ev.step}`, " eval"]);
  const scope = levelOf(view.path) === "rank" ? "this rank" : "all ranks";
  if (num(last.samples_per_s)) cards.push(["samples_per_s", "samples/s", last.samples_per_s, scope, ""]);
  return cards.map(([key, label, v, sub, cls]) => `<div class="stat${cls}" data-stat="${esc(key)}">` +
    `<div class="k">${esc(label)}</div><div class="v">${fmt(v)}</div><div class="sub">${esc(sub)}</div></div>`)
    .join("");
}

function render() {
  const p = view.path, last = view.last || {};
  const parts = p === "" ? [] : p.split("/");
  let crumbs = `<a href="#/" data-path="">run</a>`, acc = "";
  for (const part of parts) {
    acc = join(acc, part);
    crumbs += ` › <a href="#/${esc(acc)}" data-path="${esc(acc)}">${esc(part)}</a>`;
  }
  document.getElementById("crumbs").innerHTML = crumbs;
  document.getElementById("name").textContent = nameOf(p);
  // The alive count only where a rank was lost: "1 of 1 alive" says nothing.
  const lost = (last.dead || 0) > 0 || view.train.some(r => (r.dead || 0) > 0);
  document.getElementById("level").textContent = levelOf(p) + (!last.ranks ? "" :
    lost ? ` · ${last.alive} of ${last.ranks} ranks alive` : ` · ${last.ranks} rank${last.ranks === 1 ? "" : "s"}`);
  const ts = view.train.map(r => r.t), dts = ts.slice(1).map((t, i) => t - ts[i]);
  const st = stale(last, dts) || "waiting";
  const badge = document.getElementById("status");
  badge.textContent = st; badge.className = "badge b-" + st;
  document.getElementById("eta").textContent = last.eta_s ? "ETA " + fmtS(last.eta_s) : "";
  document.getElementById("stepinfo").textContent = last.step !== undefined ? `step ${last.step}` : "";
  document.getElementById("mode").textContent = SAVED ? "saved page: every level inlined, no server" :
    "live: following this node's stream";
  document.getElementById("summary").innerHTML = summaryCards(last);
  document.getElementById("choices").innerHTML = choicesTable();
  // Children grid: a row only where the child has the number (idle: El Che; alive: a rank was lost).
  const grid = Object.entries(view.children).map(([k, c]) => {
    const cst = stale(c, dts);
    const rows = [["loss", c.loss], ["samples/s", c.samples_per_s], ["ms/batch", c.ms_per_batch]]
      .concat(num(c.idle_share) ? [["idle", (100 * c.idle_share).toFixed(1) + "%"]] : [])
      .concat(num(c.gpu_mem_mb) ? [["memory MiB", c.gpu_mem_mb]] : num(c.rss_mb) ? [["memory MiB", c.rss_mb]] : [])
      .concat(num(c.mem_peak_mb) ? [["peak MiB", c.mem_peak_mb]] : [])
      .concat(num(c.sync_mem_mb) ? [["sync MiB", c.sync_mem_mb]] : [])
      .concat((c.dead || 0) > 0 ? [["alive", `${c.alive}/${c.alive + c.dead}`]] : []);
    return `<div class="child" data-child="${esc(k)}" data-path="${esc(join(p, k))}"><b>${esc(k)}</b>
      <span class="badge b-${esc(cst)}">${esc(cst)}</span>${spark(view.spark[k] || [])}
      <table>${rows.map(([a, b]) => `<tr><td>${a}</td><td class="v">${typeof b === "string" ? esc(b) : fmt(b)}` +
        "</td></tr>").join("")}</table></div>`;
  });
  document.getElementById("children").innerHTML = grid.join("");
  document.getElementById("charts").innerHTML = charts(p, last).join("") || '<p class="note">no records yet</p>';
}

function charts(p, last) {
  const t0 = (view.train[0] || view.evals[0] || {t: 0}).t;
  const xs = r => xAxis === "step" ? r.step : r.t - t0;
  const rollup = levelOf(p) !== "rank", many = rollup && (last.ranks || 0) > 1;
  const windowed = view.train.some(r => num(r.sync_ms) || num(r.idle_share));
  view.charts = {};
  const out = [];
  const trainChart = spec => {
    if (spec.window && !windowed) return;
    const pts = view.train.filter(r => num(r[spec.key])).map(r => [xs(r), r[spec.key], r]);
    if (!pts.length || (spec.changing && new Set(pts.map(q => q[1])).size < 2)) return;
    const series = [{label: rollup ? (spec.sum ? "sum" : "mean") : nameOf(p), pts}];
    if (!EXTREMES.has(spec.key) || !many) { out.push(chart(spec, series)); return; }
    const sides = ["min", "max"].map(side => ({label: side + " rank", dash: true,
      pts: view.train.filter(r => r[side] && r[side][spec.key] && num(r[side][spec.key].v))
        .map(r => [xs(r), r[side][spec.key].v, r, r[side][spec.key].who])}));
    if (!spec.sum) { out.push(chart(spec, series.concat(sides))); return; }
    // A sum over ranks and one rank's number are not one quantity: the sum alone, then a chart per rank.
    out.push(chart(spec, series));
    const mean = view.train.filter(r => num(r[spec.key]) && r.alive > 0).map(r => [xs(r), r[spec.key] / r.alive, r]);
    out.push(chart({...spec, key: spec.key + ":rank", title: spec.title + " per rank"},
                   [{label: "mean", pts: mean}].concat(sides)));
  };
  trainChart(CHARTS[0]);
  for (const k of evalKeys()) {  // each evaluation metric its own chart, beside the loss
    const pts = view.evals.filter(r => num(r[k])).map(r => [xs(r), r[k], r]);
    const fraction = pts.every(q => q[1] >= 0 && q[1] <= 1);
    out.push(chart({key: "eval:" + k, title: k, unit: k, axis: fraction ? "fraction" : "free", note: "evaluation"},
                   [{label: k, markers: true, pts}]));
  }
  CHARTS.slice(1).forEach(trainChart);
  return out;
}

function ticks(lo, hi, n) {
  if (!(hi > lo)) hi = lo + (Math.abs(lo) || 1);
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw);
  const first = Math.floor(lo / step) * step, out = [];
  for (let v = first; v < hi + step * 0.999; v += step) out.push(+v.toPrecision(12));
  return out;
}

function yDomain(v, axis, log) {
  // {lo, hi, ticks, constant}: counts and rates from zero, fractions inside [0, 1], a constant series mid-chart.
  const lo = Math.min(...v), hi = Math.max(...v);
  if (hi - lo <= 1e-9 * Math.max(Math.abs(lo), Math.abs(hi))) {
    const w = axis === "zero" && lo > 0 ? lo : (axis === "share" || axis === "fraction") && lo > 0 && lo < 1 ?
      Math.min(lo, 1 - lo) : Math.abs(lo) / 2 || 1;
    return {lo: lo - w, hi: lo + w, ticks: [lo], constant: true};
  }
  if (log) {  // the 1-2-5 values of each decade around the data; decades alone where they are many
    const c = [];
    for (let e = Math.floor(Math.log10(lo)) - 1; e <= Math.ceil(Math.log10(hi)); e++)
      for (const m of [1, 2, 5]) c.push(+(m * Math.pow(10, e)).toPrecision(12));
    const a = Math.max(...c.filter(x => x <= lo)), b = Math.min(...c.filter(x => x >= hi));
    let t = c.filter(x => x >= a && x <= b);
    const decade = x => Math.abs(Math.log10(x) - Math.round(Math.log10(x))) < 1e-9;
    if (t.length > 7) t = t.filter(x => x === a || x === b || decade(x));
    return {lo: a, hi: b, ticks: t, constant: false};
  }
  const t = ticks(axis === "zero" || axis === "share" ? Math.min(lo, 0) : lo, hi, 4);
  return {lo: t[0], hi: t[t.length - 1], ticks: t, constant: false};
}

function chart(spec, series) {
  const W = 520, H = 200, L = 64, R = 96, T = 10, B = 30, pw = W - L - R, ph = H - T - B;
  const all = series.flatMap(s => s.pts);
  if (!all.length) return "";
  let xlo = Math.min(...all.map(q => q[0])), xhi = Math.max(...all.map(q => q[0]));
  if (!(xhi > xlo)) { xlo -= 1; xhi += 1; }  // one point: mid-chart
  const xt = ticks(xlo, xhi, 5), x0 = xt[0], x1 = xt[xt.length - 1];
  const log = !!spec.log && logLoss && all.every(q => q[1] > 0);
  const yd = yDomain(all.map(q => q[1]), spec.axis, log), f = log ? Math.log10 : (y => y);
  const px = x => L + (x - x0) / (x1 - x0) * pw, py = y => T + ph - (f(y) - f(yd.lo)) / (f(yd.hi) - f(yd.lo)) * ph;
  view.charts[spec.key] = {series, px};
  const unit = esc(spec.unit);
  const sub = [spec.note, spec.unit === spec.title ? "" : spec.unit].filter(x => x).map(esc).join(", ");
  let s = `<div class="chart"><h2>${esc(spec.title)} <span class="unit">${sub}</span>` +
    (spec.log ? ` <button class="${log ? "on" : ""}" data-log-toggle title="log scale">log</button>` : "") +
    `</h2><svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" data-metric="${esc(spec.key)}" ` +
    `data-unit="${unit}" data-points="${series[0].pts.length}" data-ymin="${yd.lo}" data-ymax="${yd.hi}" ` +
    `data-scale="${log ? "log" : "linear"}"` +
    (yd.constant ? ` data-constant="${yd.ticks[0]}"` : "") + ">";
  for (const v of yd.ticks) {
    const y = py(v).toFixed(1);
    s += `<line x1="${L}" x2="${L + pw}" y1="${y}" y2="${y}" class="grid"/>` +
      `<text x="${L - 5}" y="${(py(v) + 3).toFixed(1)}" text-anchor="end">${fmt(v)}</text>`;
  }
  for (const v of xt) s += `<text x="${px(v).toFixed(1)}" y="${T + ph + 13}" text-anchor="middle">${fmt(v)}</text>`;
  s += `<rect x="${L}" y="${T}" width="${pw}" height="${ph}" class="frame"/>` +
    `<text x="${L + pw / 2}" y="${H - 3}" text-anchor="middle">${xAxis === "step" ? "step" : "seconds"}</text>`;
  if (yd.constant)  // its value written on it
    s += `<text class="const" x="${L + pw - 4}" y="${(py(yd.ticks[0]) - 5).toFixed(1)}" text-anchor="end">` +
      `${fmt(yd.ticks[0])} throughout</text>`;
  series.forEach((se, i) => {
    const c = se.dash ? "#999" : COLORS[i % COLORS.length], d = se.dash ? ' stroke-dasharray="4 3"' : "";
    const pts = se.pts.map(q => px(q[0]).toFixed(1) + "," + py(q[1]).toFixed(1)).join(" ");
    s += `<g class="series" data-unit="${unit}" data-label="${esc(se.label)}">`;
    if (se.pts.length > 1) s += `<polyline points="${pts}" fill="none" stroke="${c}" stroke-width="1.5"${d}/>`;
    if (se.markers || se.pts.length === 1)
      s += se.pts.map(q => `<circle cx="${px(q[0]).toFixed(1)}" cy="${py(q[1]).toFixed(1)}" r="2.5" fill="${c}"/>`)
        .join("");
    const ly = T + 10 + 14 * i;
    s += `<line x1="${L + pw + 8}" x2="${L + pw + 22}" y1="${ly - 3}" y2="${ly - 3}" stroke="${c}" stroke-width="2"` +
      `${d}/>` +
      `<text x="${L + pw + 26}" y="${ly}">${esc(se.label)}</text></g>`;
  });
  return s + "</svg></div>";
}

function context(r) {
  // A point's bookkeeping: where it sits in the run, and what an evaluation cost.
  const out = [`step ${r.step}`];
  if (num(r.epoch)) out.push(`epoch ${r.epoch}`);
  if (num(r.time)) out.push(`${fmtS(r.time)} of training`);
  if (isEval(r)) {
    if (num(r.samples)) out.push(`${r.samples} samples seen`);
    if (num(r.eval_s)) out.push(`evaluated in ${fmt(r.eval_s)} s`);
  } else if (num(r.samples)) out.push(`${fmt(r.samples)} samples in this record`);
  return out.join(" · ");
}

function hover(e) {
  const tip = document.getElementById("tip");
  const svg = e.target.closest ? e.target.closest("svg[data-metric]") : null;
  const c = svg && view.charts[svg.dataset.metric];
  if (!c || !c.series[0].pts.length) { tip.style.display = "none"; return; }
  const mx = e.clientX - svg.getBoundingClientRect().left;
  const near = c.series[0].pts.reduce((a, q) => Math.abs(c.px(q[0]) - mx) < Math.abs(c.px(a[0]) - mx) ? q : a);
  const lines = [context(near[2])].concat(c.series.map(se => {
    const q = se.pts.find(z => z[0] === near[0]);
    return q ? `${se.label}: ${fmt(q[1])}${q[3] ? " (" + q[3] + ")" : ""}` : null;
  }).filter(x => x));
  tip.innerHTML = lines.map(esc).join("<br>");
  tip.style.display = "block"; tip.style.top = (e.pageY + 12) + "px";
  const right = e.pageX + 12 + tip.offsetWidth > document.documentElement.clientWidth;  // near the edge: to the left
  tip.style.left = (right ? e.pageX - 12 - tip.offsetWidth : e.pageX + 12) + "px";
}

function spark(vals) {
  const v = vals.filter(num);
  if (v.length < 2) return '<svg width="120" height="24" class="spark"></svg>';
  const lo = Math.min(...v), hi = Math.max(...v), span = hi - lo || 1;
  const pts = v.map((y, i) => (i / (v.length - 1) * 118 + 1).toFixed(1) + "," + (22 - (y - lo) / span * 20).toFixed(1))
    .join(" ");
  return `<svg width="120" height="24" class="spark" data-points="${v.length}">` +
    `<polyline points="${pts}" fill="none" stroke="#1f77b4" stroke-width="1.2"/></svg>`;
}

function route() {  // a node path of the tree's names only: anything else shows the root
  let p = "";
  try { p = decodeURIComponent(location.hash.replace(/^#\/?/, "")); } catch (e) { p = ""; }
  show(/^[A-Za-z0-9._-]+(\/[A-Za-z0-9._-]+)*$/.test(p) && !p.split("/").includes("..") ? p : "");
}
document.addEventListener("click", e => {
  if (e.target.closest("[data-log-toggle]")) { logLoss = !logLoss; render(); return; }
  const el = e.target.closest("[data-path]");
  if (el) { e.preventDefault(); location.hash = "#/" + el.dataset.path; }
});
document.addEventListener("mousemove", hover);
for (const [id, mode] of [["x-step", "step"], ["x-time", "time"]])
  document.getElementById(id).addEventListener("click", () => {
    xAxis = mode; document.getElementById("x-step").className = mode === "step" ? "on" : "";
    document.getElementById("x-time").className = mode === "time" ? "on" : ""; render();
  });
window.addEventListener("hashchange", route);
route();
"""
