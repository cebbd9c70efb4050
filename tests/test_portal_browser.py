"""The portal in a real headless Chromium (Debian's ``chromium``, driven by playwright).

A 2-worker training run is watched live: the root page shows each new record within 2 s of
its being written, the page goes down to a rank and back up; then the run's saved page
renders offline with no network request. A screenshot of each level is written to tmp_path.
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
    data = [(torch.randn(4), torch.randn(1)) for _ in range(64)]

    def step(model, batch):
        time.sleep(0.12)  # a slow step, so the run lasts while the page is watched
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    Trainer(torch.nn.Linear(4, 1), step, lambda p: torch.optim.SGD(p, lr=0.05), data, batch_size=4,
            max_steps=steps, log_every=1, log_dir=out, progress=False, portal=port, timeout=60).fit()
    import os
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # torch 2.13 + gloo can abort at interpreter exit after a finished run (docs/trainer.md)
''')


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
    page.screenshot(path=str(shots / "saved-root.png"), full_page=True)
    host = next(p.name for p in run.glob("host-*"))
    page.click(f"[data-child='{host}']")
    page.wait_for_function(f"document.getElementById('name').textContent === '{host}'")
    page.screenshot(path=str(shots / "saved-host.png"), full_page=True)
    page.click("[data-child='rank-0']")
    page.wait_for_function("document.getElementById('name').textContent === 'rank-0'")
    assert _points(page, "loss") == len(_train_lines(run / host / "rank-0" / "records.jsonl"))
    page.screenshot(path=str(shots / "saved-rank.png"), full_page=True)
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
