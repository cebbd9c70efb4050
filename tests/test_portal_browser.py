"""The portal in a real headless Chromium (Debian's ``chromium``, driven by playwright).

A 2-worker training run is watched live: the root page shows each new record within 2 s of
its being written, the page goes down to a rank and back up; then the run's saved page
renders offline with no network request. A screenshot of each level is written to tmp_path
(and, with FLODL_HF_PORTAL_SHOTS=docs/portal, copied there: the docs' screenshots). Every page
checks that each chart holds one unit, that the evaluation's metrics are charts of their own and
that a run without El Che has no window chart.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the portal needs starlette and uvicorn")
pytest.importorskip("uvicorn", reason="the portal needs starlette and uvicorn")
playwright = pytest.importorskip("playwright.sync_api", reason="the browser tests need playwright (pip install playwright)")

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = next((p for p in (os.environ.get("FLODL_HF_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), "/usr/bin/chromium") if p and Path(p).is_file()), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (apt-get install chromium; .ci/run does)")

SCRIPT = textwrap.dedent('''
    import sys, time
    import torch
    from flodl_hf.training.trainer import Trainer

    out, port, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    w = torch.tensor([1.0, -2.0, 0.5, 1.5])
    xs = torch.randn(96, 4)
    data = [(x, (x @ w > 0).float().view(1)) for x in xs[:64]]

    def step(model, batch):
        time.sleep(0.12)  # a slow step, so the run lasts while the page is watched
        x, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)

    def accuracy(model):
        return {"accuracy": ((model(xs[64:]) > 0).float().view(-1) == (xs[64:] @ w > 0).float()).float().mean()}

    Trainer(torch.nn.Linear(4, 1), step, lambda p: torch.optim.SGD(p, lr=0.5), data, batch_size=4,
            max_steps=steps, log_every=1, log_dir=out, progress=False, portal=port, timeout=60,
            eval_fn=accuracy, eval_every=5).fit()
    import os
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # torch 2.13 + gloo can abort at interpreter exit after a finished run (docs/trainer.md)
''')


SHOTS = os.environ.get("FLODL_HF_PORTAL_SHOTS")  # a folder the saved pages' screenshots are copied to
WINDOW_CHARTS = {"batches", "idle_share", "sync_ms"}  # El Che's window numbers
EVAL_CONTEXT = ("samples", "eval_s", "epoch", "time", "step", "t")  # an evaluation record's own fields


def _publish(shot: Path, name: str) -> None:
    if SHOTS:
        shutil.copyfile(shot, Path(SHOTS) / name)


def _charts(page) -> dict[str, dict]:
    """Every chart on the page by metric: its unit, y range, scale, constant, its series' units and where its
    lines sit inside the frame. Each chart holds one unit: every series is marked with the chart's."""
    charts = page.eval_on_selector_all("svg[data-metric]", """els => els.map(e => ({
        metric: e.dataset.metric, unit: e.dataset.unit, ymin: +e.dataset.ymin, ymax: +e.dataset.ymax,
        scale: e.dataset.scale, constant: e.dataset.constant === undefined ? null : +e.dataset.constant,
        units: [...e.querySelectorAll("g.series")].map(g => g.dataset.unit),
        frame: ["y", "height"].map(k => +e.querySelector("rect.frame").getAttribute(k)),
        ys: [...e.querySelectorAll("g.series polyline")].flatMap(l => l.getAttribute("points").split(" ")
              .map(q => +q.split(",")[1]))}))""")
    for c in charts:
        assert c["unit"] and c["units"] and set(c["units"]) == {c["unit"]}, c
    return {c["metric"]: c for c in charts}


def _mid_chart(chart: dict) -> bool:
    """The chart's lines lie in the middle half of its frame, away from either border."""
    top, height = chart["frame"]
    return bool(chart["ys"]) and all(top + height / 4 < y < top + 3 * height / 4 for y in chart["ys"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        except Exception as exc:  # a Chromium that cannot start here (no display libraries, ...)
            pytest.skip(f"Chromium at {CHROMIUM} does not start: {exc}")
        yield b
        b.close()


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """Two workers training under torchrun, the portal on rank 0 (portal=PORT)."""
    tmp = tmp_path_factory.mktemp("live")
    script, run, port = tmp / "train.py", tmp / "run", _free_port()
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    log = open(tmp / "train.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(script), str(run), str(port), "90"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    yield {"proc": proc, "run": run, "port": port, "tmp": tmp, "log": tmp / "train.log"}
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
    proc.wait()
    log.close()


def _wait(cond, timeout: float, what: str, proc=None, log=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}" + (f"; training log:\n{log.read_text()[-3000:]}" if log else ""))


def _train_lines(file: Path) -> list[dict]:
    if not file.exists():
        return []
    out = []
    for line in file.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("event") == "train":
            out.append(r)
    return out


def _points(page, metric: str = "samples_per_s") -> int:
    return page.evaluate(f"(document.querySelector('svg[data-metric={metric}]') || {{dataset: {{points: 0}}}}).dataset.points | 0")


def test_live_two_worker_run_at_every_level(browser, live_run):
    run, port, proc, log = live_run["run"], live_run["port"], live_run["proc"], live_run["log"]
    _wait(lambda: "flodl-hf portal: http" in log.read_text(), 120, "the portal's URL", proc, log)
    base = f"http://127.0.0.1:{port}/"
    root_file = run / "records.jsonl"
    _wait(lambda: len(_train_lines(root_file)) >= 2, 60, "the first windows", proc, log)
    host = next(p.name for p in run.glob("host-*"))
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    streams: list[str] = []
    page.on("request", lambda r: streams.append(r.url[len(base):]) if "/stream/" in r.url else None)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(base)
    page.wait_for_selector("svg[data-metric=samples_per_s]", timeout=10_000)

    # Each new root record shows up as a new point within 2 s of being written.
    lags = []
    for _ in range(3):
        seen = len(_train_lines(root_file))
        new = _wait(lambda: (lines := _train_lines(root_file)) and len(lines) > seen and lines[seen], 10,
                    "a new root record", proc, log)
        page.wait_for_function(f"(document.querySelector('svg[data-metric=samples_per_s]').dataset.points | 0) > {seen}",
                               timeout=2_000)
        lags.append(time.time() - new["t"])
    print(f"root page: new point {', '.join(f'{x:.2f}' for x in lags)} s after the record was written")
    assert max(lags) < 2.0
    assert page.locator(f"[data-child='{host}']").count() == 1
    page.wait_for_selector("svg[data-metric='eval:accuracy']", timeout=10_000)  # worker 0 evaluates every 5 steps
    charts = _charts(page)
    assert not WINDOW_CHARTS & set(charts) and charts["eval:accuracy"]["unit"] == "accuracy"
    page.screenshot(path=str(live_run["tmp"] / "live-root.png"), full_page=True)

    # Down to the host, then to rank 1; each level follows its own stream only.
    page.click(f"[data-child='{host}']")
    page.wait_for_function(f"document.getElementById('name').textContent === '{host}'")
    page.wait_for_selector("[data-child='rank-1']")
    page.screenshot(path=str(live_run["tmp"] / "live-host.png"), full_page=True)
    page.click("[data-child='rank-1']")
    page.wait_for_function("document.getElementById('name').textContent === 'rank-1'")
    page.wait_for_selector("svg[data-metric=loss]")
    seen = _points(page, "loss")
    page.wait_for_function(f"(document.querySelector('svg[data-metric=loss]').dataset.points | 0) > {seen}",
                           timeout=5_000)
    assert page.locator("#children .child").count() == 0  # a rank has no children
    # The run's evaluation beside the rank's loss: read from the root's records, refreshed while followed.
    page.wait_for_selector("[data-stat='eval:accuracy']", timeout=10_000)
    assert "eval:accuracy" in _charts(page) and page.locator("[data-stat=loss]").count() == 1
    assert page.locator("#level").text_content().startswith("rank")
    page.screenshot(path=str(live_run["tmp"] / "live-rank.png"), full_page=True)
    page.click("nav a[data-path='']")  # the breadcrumb, back to the root
    page.wait_for_function("document.getElementById('name').textContent === 'run'")
    page.wait_for_selector(f"[data-child='{host}']")
    followed = [s.split("?")[0] for s in streams]
    assert followed == ["stream/", f"stream/{host}", f"stream/{host}/rank-1", "stream/"], followed
    live_run["charts"] = sorted(page.eval_on_selector_all("svg[data-metric]", "els => els.map(e => e.dataset.metric)"))
    assert not errors
    page.close()


def test_saved_page_renders_offline(browser, live_run):
    proc, run, log = live_run["proc"], live_run["run"], live_run["log"]
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    saved = run / "run.html"  # written by the trainer at the end of the run
    assert saved.is_file()
    context = browser.new_context(offline=True, viewport={"width": 1100, "height": 900})
    page = context.new_page()
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(saved.as_uri())
    page.wait_for_selector("svg[data-metric=samples_per_s]")
    trained = _train_lines(run / "records.jsonl")
    assert _points(page) == len(trained)
    charts = sorted(page.eval_on_selector_all("svg[data-metric]", "els => els.map(e => e.dataset.metric)"))
    if "charts" in live_run:
        assert charts == live_run["charts"]  # the same charts as the live root page
    assert page.locator("#status").text_content() == "finished"
    shots = live_run["tmp"]
    host = next(p.name for p in run.glob("host-*"))
    for level, name in (("root", "run"), ("host", host), ("rank", "rank-0")):
        if level != "root":
            page.click(f"[data-child='{name}']")
        page.wait_for_function(f"document.getElementById('name').textContent === '{name}'")
        page.mouse.move(1, 1)  # off the cards: no hover outline in the screenshot
        charts = _charts(page)
        assert "eval:accuracy" in charts and not WINDOW_CHARTS & set(charts), (level, sorted(charts))
        assert page.locator("[data-stat='eval:accuracy']").count() == 1, level
        page.screenshot(path=str(shots / f"saved-{level}.png"), full_page=True)
        _publish(shots / f"saved-{level}.png", f"{level}.png")
    assert _points(page, "loss") == len(_train_lines(run / host / "rank-0" / "records.jsonl"))
    page.click(f"nav a[data-path='{host}']")
    page.wait_for_function(f"document.getElementById('name').textContent === '{host}'")
    assert requests == [saved.as_uri()], requests  # the file itself, nothing else
    for name in ("live-root", "live-host", "live-rank", "saved-root", "saved-host", "saved-rank"):
        assert (shots / f"{name}.png").stat().st_size > 10_000 or name.startswith("live")
    context.close()


def test_statuses_token_and_time_axis_on_a_synthetic_tree(browser, tmp_path):
    """A served tree with a lost rank, an idle one and a slow host, behind a token."""
    from flodl_hf.training.portal import start_portal
    from flodl_hf.training.records import TreeWriter

    names = ["a", "a", "a", "b", "b"]
    writer = TreeWriter(tmp_path / "run", names)
    writer.event({"event": "start", "total_steps": 100})
    for w in range(4):
        ranks = [{"samples": 32, "samples_per_s": 100.0 + w - (50 if h == "a" else 0), "loss": 1.0 / (w + 1),
                  "ms_per_batch": 20.0, "idle_share": 0.8 if r == 4 else 0.1} for r, h in enumerate(names)]
        ranks[2]["status"] = "lost"
        writer.window({"step": 4 * (w + 1), "epoch": 0, "time": 0.5 * (w + 1)}, ranks)
    writer.close()
    portal = start_portal(tmp_path / "run", port=0, token="t0ken")
    try:
        page = browser.new_page(viewport={"width": 1100, "height": 800})
        denied = page.goto(portal.url.split("?")[0])
        assert denied.status == 401
        page.goto(portal.url)
        page.wait_for_selector("[data-child='host-a']")
        assert page.locator("[data-child='host-a'] .badge").text_content() == "slowest"
        assert "2/3" in page.locator("[data-child='host-a']").text_content()
        assert page.locator("#level").text_content() == "root · 4 of 5 ranks alive"
        assert page.locator("#eta").text_content().startswith("ETA")
        charts = _charts(page)  # window timing (idle share) in the records: its chart, a share from zero
        assert charts["idle_share"]["unit"] == "share" and charts["idle_share"]["ymin"] == 0
        assert charts["idle_share"]["ymax"] <= 1 and "alive" not in charts  # 4 of 5 alive throughout
        page.click("[data-child='host-b']")
        page.wait_for_selector("[data-child='rank-4']")
        assert page.locator("[data-child='rank-4'] .badge").text_content() == "idle"
        page.click("nav a[data-path='']")
        page.click("[data-child='host-a']")
        page.wait_for_selector("[data-child='rank-2']")
        assert page.locator("[data-child='rank-2'] .badge").text_content() == "lost"
        page.click("#x-time")
        page.wait_for_function("[...document.querySelectorAll('svg text')].some(t => t.textContent === 'seconds')")
        page.screenshot(path=str(tmp_path / "synthetic-host-a.png"), full_page=True)
        page.close()
    finally:
        portal.stop()


def test_a_crafted_fragment_injects_nothing(browser, tmp_path):
    """The node path comes from the URL's fragment, which any page can link to: it is escaped where it is
    shown, and a path that is not the tree's shows the root."""
    from flodl_hf.training.portal import start_portal
    from flodl_hf.training.records import TreeWriter

    writer = TreeWriter(tmp_path / "run", ["a"])
    writer.window({"step": 4, "epoch": 0, "time": 0.5}, [{"samples": 32, "loss": 1.0}])
    writer.close()
    portal = start_portal(tmp_path / "run", port=0)
    try:
        page = browser.new_page()
        for fragment in ("%23%22%3E%3Cimg%20src=x%20onerror=%22document.title='XSS'%22%3E",
                         "host-a%22%3E%3Cimg%20src=x%20onerror=%22document.title='XSS'%22%3E"):
            page.goto(portal.url + "#/" + fragment)
            page.wait_for_selector("[data-child='host-a']")
            time.sleep(0.3)
            assert page.title() != "XSS" and page.locator("img").count() == 0, fragment
    finally:
        portal.stop()


def test_a_one_worker_run_reads_at_a_glance(browser, tmp_path):
    """A one-worker run whose eval_fn returns accuracy and F1, at every level, saved and served: each metric is
    a chart of its own inside [0, 1] (the record's samples and eval_s are none), no chart mixes units, no
    window chart, the constant learning rate drawn mid-chart, counts from zero, the last evaluation beside
    the loss in the summary, the loss on a log scale at a click."""
    import torch

    from flodl_hf.training.portal import start_portal
    from flodl_hf.training.trainer import Trainer

    calls: list[int] = []

    def evaluate(model):
        calls.append(1)
        return {"accuracy": 0.5 + 0.1 * len(calls), "f1": 0.4 + 0.12 * len(calls)}

    torch.manual_seed(0)
    run = tmp_path / "run"
    Trainer(torch.nn.Linear(3, 1), lambda m, b: m(b).pow(2).mean(), lambda p: torch.optim.SGD(p, lr=1e-4),
            [torch.randn(3) for _ in range(48)], batch_size=4, max_steps=12, log_every=2, eval_fn=evaluate,
            eval_every=3, log_dir=run, progress=False).fit()
    last = {"accuracy": 0.5 + 0.1 * len(calls), "f1": 0.4 + 0.12 * len(calls)}
    host = next(p.name for p in run.glob("host-*"))
    portal = start_portal(run, port=0)
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        for base in ((run / "run.html").as_uri(), portal.url):
            for node, name in (("", "run"), (host, host), (f"{host}/rank-0", "rank-0")):
                page.goto(base + "#/" + node)
                page.wait_for_function(f"document.getElementById('name').textContent === '{name}'")
                page.wait_for_selector("svg[data-metric='eval:f1']")
                charts, where = _charts(page), f"{base} #/{node}"
                for metric in ("accuracy", "f1"):
                    c = charts["eval:" + metric]
                    assert c["unit"] == metric and 0 <= c["ymin"] < c["ymax"] <= 1, (where, c)
                    shown = page.locator(f"[data-stat='eval:{metric}'] .v").text_content()
                    assert float(shown) == pytest.approx(last[metric], abs=1e-3), where
                assert page.locator("#summary .stat").first.get_attribute("data-stat") == "loss", where
                assert not {f"eval:{k}" for k in EVAL_CONTEXT} & set(charts), (where, sorted(charts))
                assert not WINDOW_CHARTS & set(charts) and "alive" not in charts, (where, sorted(charts))
                assert charts["lr"]["constant"] == pytest.approx(1e-4) and _mid_chart(charts["lr"]), where
                assert charts["samples_per_s"]["ymin"] == 0 and charts["ms_per_batch"]["ymin"] == 0, where
                assert "1 of 1" not in page.locator("#level").text_content(), where
        page.screenshot(path=str(tmp_path / "rank.png"), full_page=True)
        assert charts["loss"]["scale"] == "linear"
        page.click("[data-log-toggle]")
        page.wait_for_selector("svg[data-metric=loss][data-scale=log]")
        assert _charts(page)["loss"]["ymin"] > 0
        assert not errors, errors
    finally:
        page.close()
        portal.stop()


def test_six_hosts_root(browser, tmp_path):
    """The saved root of 48 ranks on 6 hosts (host-h00's ranks slower), with evaluations: each host a card,
    the slowest marked, the min and max rank beside the sum in the same unit, El Che's window charts."""
    from test_portal import synthetic_run

    from flodl_hf.training.records import read_records
    from flodl_hf.training.report import write_report

    writer = synthetic_run(tmp_path / "run", hosts=6, per_host=8, windows=12)
    # El Che's choices (the trainer's start record and a later choice), shown with their reasons at the root.
    from flodl_hf.training.sync import ElChe, Link, choose
    from flodl_hf.training.sync.choice import describe
    link = Link(hosts=6, mb_per_s=112.0)
    cadence, why = choose(ElChe(), 48, link)
    writer.event({"event": "start", "el_che": describe(ElChe(), cadence, why, link)})
    writer.event({"event": "choice", "step": 4, "field": "windows", "value": "planned", "why": "an <even> cohort"})
    for i, step in enumerate((16, 32, 48)):
        writer.event({"event": "eval", "step": step, "epoch": 0, "time": step * 0.2, "samples": step * 768,
                      "eval_s": 1.5, "accuracy": 0.71 + 0.06 * i + 0.01 * i * i})
    writer.close()
    saved = write_report(tmp_path / "run")
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    page.goto(saved.as_uri())
    page.wait_for_selector("svg[data-metric='eval:accuracy']")
    assert page.locator("#children .child").count() == 6
    assert page.locator("[data-child='host-h00'] .badge").text_content() == "slowest"
    assert "bf16" in page.locator("[data-choice=compress]").text_content()
    assert "112 MB/s" in page.locator("[data-choice=compress] .why").text_content()
    assert page.locator("[data-choice=windows] .why").text_content() == "an <even> cohort"  # text, not markup
    charts = _charts(page)
    labels = "gs => gs.map(g => g.dataset.label)"  # the sum alone; one rank's numbers on a chart of their own
    assert page.eval_on_selector_all("svg[data-metric=samples_per_s] g.series", labels) == ["sum"]
    assert page.eval_on_selector_all("svg[data-metric='samples_per_s:rank'] g.series", labels) == \
        ["mean", "min rank", "max rank"]
    fastest = max(r["samples_per_s"] for r in read_records(tmp_path / "run/host-h01/rank-8/records.jsonl"))
    assert fastest < charts["samples_per_s:rank"]["ymax"] < 2 * fastest < charts["samples_per_s"]["ymax"]
    assert {"batches", "idle_share", "sync_ms"} <= set(charts) and charts["batches"]["constant"] == 192
    assert _mid_chart(charts["batches"]) and 0 <= charts["eval:accuracy"]["ymin"] < charts["eval:accuracy"]["ymax"] <= 1
    page.screenshot(path=str(tmp_path / "root-6-hosts.png"), full_page=True)
    _publish(tmp_path / "root-6-hosts.png", "root-6-hosts.png")
    page.close()
