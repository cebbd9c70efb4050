"""The portal's HTTP API, its security rules, and the cost of following the root of a large tree."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the portal needs starlette and uvicorn")
pytest.importorskip("uvicorn", reason="the portal needs starlette and uvicorn")
httpx = pytest.importorskip("httpx", reason="the API tests use httpx")
from starlette.testclient import TestClient  # noqa: E402

from flodl_hf.cli import main  # noqa: E402
from flodl_hf.core.errors import InputError  # noqa: E402
from flodl_hf.training.portal import create_app, start_portal, stream_message  # noqa: E402
from flodl_hf.training.records import TreeWriter, host_names, load_tree, read_records, tree_paths  # noqa: E402


def synthetic_run(run: Path, hosts: int, per_host: int, windows: int, seed: int = 0) -> TreeWriter:
    """A tree as the trainer writes it, from made-up per-rank numbers (host 0 is the slowest)."""
    names = [f"h{h:02d}" for h in range(hosts) for _ in range(per_host)]
    writer = TreeWriter(run, names)
    writer.event({"event": "start", "world_size": len(names), "total_steps": 10_000})
    for i in range(windows):
        write_window(writer, names, random.Random(seed * 1000 + i))
    return writer


def write_window(writer: TreeWriter, names: list[str], rng: random.Random) -> dict:
    step = (writer._last.get("", {}).get("step") or 0) + 4
    ranks = []
    for r, host in enumerate(names):
        slow = 0.6 if host == "h00" else 1.0
        ranks.append({"samples": 64, "batches": 4, "loss": 2.0 / (1 + step / 100) + rng.random() * 0.01,
                      "samples_per_s": 400 * slow + rng.random(), "ms_per_batch": 40 / slow + rng.random(),
                      "lr": 2e-5, "sync_ms": 3 + rng.random(), "idle_share": 0.05 + 0.01 * rng.random(),
                      "cpu_pct": 95 + rng.random(), "rss_mb": 900 + rng.random()})
    return writer.window({"step": step, "epoch": 0, "time": step * 0.2}, ranks)


@pytest.fixture()
def run(tmp_path) -> Path:
    synthetic_run(tmp_path / "run", hosts=2, per_host=2, windows=5).close()
    return tmp_path / "run"


@pytest.fixture()
def client(run) -> TestClient:
    return TestClient(create_app(run), base_url="http://127.0.0.1:8765")


# ---- the tree -------------------------------------------------------------------------------------

def test_host_names_add_the_node_rank_only_when_hostnames_collide():
    assert host_names([("a", 0), ("a", 0), ("b", 1)]) == ["a", "a", "b"]
    assert host_names([("box", 0), ("box", 1), ("my host!", 2)]) == ["box-n0", "box-n1", "my-host"]
    assert host_names([("a b", 0), ("a-b", 1)]) == ["a-b-n0", "a-b-n1"]  # distinct hosts, one cleaned name


def test_rollups_sum_average_and_keep_who(run):
    tree = load_tree(run)
    assert tree_paths(run) == ["", "host-h00", "host-h00/rank-0", "host-h00/rank-1",
                               "host-h01", "host-h01/rank-2", "host-h01/rank-3"]
    root = [r for r in tree[""] if r["event"] == "train"][-1]
    ranks = [[r for r in tree[p] if r["event"] == "train"][-1] for p in tree if p.count("/") == 1]
    assert root["samples_per_s"] == pytest.approx(sum(r["samples_per_s"] for r in ranks))
    assert root["ms_per_batch"] == pytest.approx(sum(r["ms_per_batch"] for r in ranks) / 4)
    slowest = min(ranks, key=lambda r: r["samples_per_s"])
    assert root["min"]["samples_per_s"] == {"v": slowest["samples_per_s"], "who": f"host-{slowest['host']}/rank-{slowest['rank']}"}
    assert root["alive"] == 4 and root["dead"] == 0
    assert root["children"]["host-h00"]["status"] == "slowest" and root["children"]["host-h01"]["status"] == "training"
    host = [r for r in tree["host-h01"] if r["event"] == "train"][-1]
    assert set(host["children"]) == {"rank-2", "rank-3"}
    assert host["children"]["rank-3"]["loss"] == ranks[3]["loss"]


# ---- the API ----------------------------------------------------------------------------------------

def test_paths_node_history(client, run):
    assert client.get("/paths").json()["paths"] == tree_paths(run)
    root = client.get("/node/").json()
    assert root["level"] == "root" and set(root["children"]) == {"host-h00", "host-h01"}
    assert client.get("/node").json() == root
    rank = client.get("/node/host-h01/rank-3").json()
    assert rank["level"] == "rank" and rank["record"] == read_records(run / "host-h01/rank-3/records.jsonl")[-1]
    records = client.get("/history/host-h00").json()["records"]
    assert len(records) == 5
    later = client.get(f"/history/host-h00?since={records[2]['t']}").json()["records"]
    assert later == [r for r in records if r["t"] > records[2]["t"]]
    assert client.get("/history/?event=start").json()["records"] == [r for r in read_records(run / "records.jsonl")
                                                                    if r["event"] == "start"] != []
    # the synthetic windows may all land in one millisecond: filter from just before the root's first train record
    trains = [r for r in read_records(run / "records.jsonl") if r["event"] == "train"]
    since = round(trains[0]["t"] - 0.001, 3)
    assert client.get(f"/history/?event=train&since={since}").json()["records"] == \
        [r for r in trains if r["t"] > since] != []
    for bad in ("soon", "nan", "inf", "-inf"):  # nan would match no record: an empty answer, not an error
        answer = client.get(f"/history/?since={bad}")
        assert answer.status_code == 400 and "since" in answer.json()["error"], bad
        assert client.get(f"/stream/?since={bad}").status_code == 400, bad
    page = client.get("/")
    assert page.status_code == 200 and "EventSource" in page.text


@pytest.mark.parametrize("url", ["/node/nope", "/node/host-h09", "/history/host-h00/rank-7", "/stream/host-zz",
                                 "/node/host-h00/%2e%2e/%2e%2e", "/node/..%2F..%2Fetc", "/history/host-h00/%2E%2E/%2E%2E",
                                 "/node/host-h00/rank-0/records.jsonl", "/stream/%2e%2e"])
def test_unknown_node_and_traversal_are_json_404s(client, url):
    res = client.get(url)
    assert res.status_code == 404 and res.headers["content-type"].startswith("application/json")
    assert "error" in res.json()


def test_raw_dot_dot_path_is_refused(run):
    """A client that does not normalise the URL (curl --path-as-is): the server still refuses it."""
    portal = start_portal(run, port=0)
    try:
        with socket.create_connection(("127.0.0.1", portal.port), timeout=5) as s:
            s.sendall(b"GET /node/host-h00/../../../../etc/passwd HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 404") and "error" in json.loads(body)
        assert b"root:" not in body
    finally:
        portal.stop()


def test_token_is_checked_on_every_request(run):
    client = TestClient(create_app(run, token="s3cret"))
    for url in ("/", "/paths", "/node/", "/history/host-h00", "/stream/"):
        for res in (client.get(url), client.get(url + ("&" if "?" in url else "?") + "token=wrong"),
                    client.get(url, headers={"Authorization": "Bearer nope"})):
            assert res.status_code == 401 and "token" in res.json()["error"]
    assert client.get("/paths?token=s3cret").status_code == 200
    assert client.get("/node/host-h00", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_other_addresses_need_a_token(run, capsys):
    with pytest.raises(InputError, match="--token"):
        start_portal(run, host="0.0.0.0", port=0)
    assert main(["portal", str(run), "--host", "0.0.0.0"]) == 2
    assert "--token" in capsys.readouterr().err


def test_half_written_last_line_is_skipped(client, run):
    file = run / "host-h00/rank-1/records.jsonl"
    before = client.get("/history/host-h00/rank-1").json()["records"]
    with file.open("a") as f:
        f.write('{"event": "train", "step": 99, "lo')
    assert client.get("/history/host-h00/rank-1").json()["records"] == before
    assert client.get("/node/host-h00/rank-1").json()["record"] == before[-1]
    assert len(load_tree(run)["host-h00/rank-1"]) == len(before)


def test_stream_sends_new_records_once_their_line_is_complete(run):
    writer = TreeWriter(run, ["h00", "h00", "h01", "h01"], truncate_after=10**9)
    portal = start_portal(run, port=0, poll_s=0.05)
    got: list[dict] = []
    following = threading.Event()

    def follow():
        with httpx.stream("GET", f"http://127.0.0.1:{portal.port}/stream/host-h01/rank-2", timeout=10) as res:
            assert res.headers["content-type"].startswith("text/event-stream")
            for line in res.iter_lines():
                if line.startswith(": following"):
                    following.set()
                if line.startswith("data: "):
                    got.append(json.loads(line[6:]))
                    if len(got) == 2:
                        return

    thread = threading.Thread(target=follow, daemon=True)
    try:
        thread.start()
        # The stream's first line comes once it has fixed its start, after what is already written (the
        # response's headers come before that: a fixed sleep lost the race on a loaded machine).
        assert following.wait(10)
        file = run / "host-h01/rank-2/records.jsonl"
        with file.open("a") as f:
            f.write('{"event": "train", "step": 1000, "t": 1')
            f.flush()
            time.sleep(0.3)
            f.write('0, "loss": 1.0}\n')
        write_window(writer, ["h00", "h00", "h01", "h01"], random.Random(1))
        thread.join(10)
        assert [r["step"] for r in got] == [1000, 4]
        assert got[1] == read_records(file)[-1]
    finally:
        portal.stop()
        writer.close()


def test_stream_message_rotates_one_child_and_pushes_status_changes():
    record = {"step": 1, "children": {f"host-{i}": {"status": "training"} for i in range(3)}}
    sent = {k: "training" for k in record["children"]}
    picks = [list(stream_message(record, turn, sent)["children"]) for turn in range(4)]
    assert picks == [["host-0"], ["host-1"], ["host-2"], ["host-0"]]
    record["children"]["host-2"] = {"status": "lost"}
    assert list(stream_message(record, 0, sent)["children"]) == ["host-0", "host-2"]
    assert stream_message(record, 0, sent)["children_n"] == 3


# ---- cost ---------------------------------------------------------------------------------------------

def _root_stream_cost(run: Path, hosts: int, per_host: int, windows: int) -> tuple[int, int, int]:
    names = [f"h{h:02d}" for h in range(hosts) for _ in range(per_host)]
    writer = synthetic_run(run, hosts, per_host, windows=2)
    portal = start_portal(run, port=0, poll_s=0.05)
    messages, size = [], [0]
    ready = threading.Event()

    def follow():
        with httpx.stream("GET", f"http://127.0.0.1:{portal.port}/stream/", timeout=30) as res:
            for line in res.iter_lines():
                if line.startswith(": following"):  # its start is fixed
                    ready.set()
                size[0] += len(line.encode()) + 1
                if line.startswith("data: "):
                    messages.append(line)
                    if len(messages) == windows:
                        return

    thread = threading.Thread(target=follow, daemon=True)
    try:
        thread.start()
        assert ready.wait(10)
        start = (run / "records.jsonl").stat().st_size
        for w in range(windows):
            write_window(writer, names, random.Random(100 + w))
            time.sleep(0.02)
        thread.join(20)
        record_bytes = (run / "records.jsonl").stat().st_size - start
    finally:
        portal.stop()
        writer.close()
    return len(messages), size[0], record_bytes


def test_root_stream_costs_the_same_for_300_ranks_as_for_3(tmp_path):
    windows = 20
    small = _root_stream_cost(tmp_path / "small", hosts=1, per_host=3, windows=windows)
    large = _root_stream_cost(tmp_path / "large", hosts=10, per_host=30, windows=windows)
    for name, (n, size, record) in (("3 ranks / 1 host", small), ("300 ranks / 10 hosts", large)):
        print(f"{name}: {n / windows:.0f} message(s) per window, {size / windows:.0f} stream bytes per window "
              f"(root record on disk: {record / windows:.0f} bytes per window)")
    assert small[0] == large[0] == windows  # one message per window
    assert abs(large[1] - small[1]) / small[1] <= 0.10, f"stream bytes {large[1]} vs {small[1]}"
    # Not vacuous: the root's full record, with every host's summary, does grow with the hosts.
    assert large[2] > small[2] * 1.5


# ---- beside training ----------------------------------------------------------------------------------

def test_trainer_portal_serves_the_run_while_it_trains(tmp_path, capsys):
    import torch

    from flodl_hf.training.trainer import Trainer, TrainerConfigError

    seen: list[list[str]] = []

    def step(model, batch):
        if len(seen) < 1 and (tmp_path / "records.jsonl").exists():
            seen.append(httpx.get(trainer._portal.url + "paths", timeout=5).json()["paths"])
        return model(batch).pow(2).mean()

    data = [torch.randn(3) for _ in range(16)]
    trainer = Trainer(torch.nn.Linear(3, 1), step, lambda p: torch.optim.SGD(p, lr=0.1), data, batch_size=4,
                      max_steps=4, log_every=1, log_dir=tmp_path, progress=False, portal=0)
    summary = trainer.fit()
    url = capsys.readouterr().out.split("flodl-hf portal: ")[1].split()[0]
    assert url.startswith("http://127.0.0.1:") and url == trainer._portal.url
    assert seen and seen[0][0] == "" and seen[0][-1].endswith("/rank-0")
    assert not trainer._portal.thread.is_alive()  # stopped with the run
    assert Path(summary["report"]).name == "run.html"
    with pytest.raises(TrainerConfigError, match="log_dir"):
        Trainer(torch.nn.Linear(3, 1), step, lambda p: torch.optim.SGD(p, lr=0.1), data, batch_size=4,
                max_steps=1, portal=True)


def test_old_layout_run_is_served_as_a_tree(tmp_path):
    (tmp_path / "run.jsonl").write_text(json.dumps({"event": "train", "step": 1, "loss": 1.0, "t": 5.0}) + "\n")
    (tmp_path / "worker-0.jsonl").write_text(json.dumps({"step": 1, "rank": 0, "loss": 1.0}) + "\n")
    client = TestClient(create_app(tmp_path), base_url="http://127.0.0.1:8765")
    assert client.get("/paths").json()["paths"] == ["", "host-local", "host-local/rank-0"]
    assert client.get("/node/host-local/rank-0").json()["record"]["loss"] == 1.0
    assert client.get("/history/?since=4").json()["records"][0]["step"] == 1


def test_save_replaces_only_an_earlier_page(tmp_path, monkeypatch):
    run = tmp_path / "run"
    synthetic_run(run, hosts=1, per_host=2, windows=3).close()
    monkeypatch.chdir(tmp_path)
    records = run / "records.jsonl"
    before = records.read_bytes()
    assert main(["portal", str(run), "--save", "page.html"]) == 0
    assert (tmp_path / "page.html").read_text().startswith("<!doctype html>")
    assert main(["portal", str(run), "--save", "page.html"]) == 2  # exists: --force replaces it
    assert main(["portal", str(run), "--save", "page.html", "--force"]) == 0
    (tmp_path / "keep.txt").write_text("precious")
    (tmp_path / "adir").mkdir()
    for target, force in (("keep.txt", True), (str(records), True), ("adir", True), ("nodir/x.html", False)):
        assert main(["portal", str(run), "--save", target] + (["--force"] if force else [])) == 2, target
    assert (tmp_path / "keep.txt").read_text() == "precious" and records.read_bytes() == before
    assert not (tmp_path / "nodir").exists() and not list(tmp_path.rglob(".*tmp-*"))


def _our_page(run: Path, target: Path) -> Path:
    from flodl_hf.training.report import write_report
    write_report(run, target)
    return target


def _hand_page(run: Path, target: Path) -> Path:
    target.write_text("<!doctype html>\n<html><head><title>my notes</title></head><body>mine</body></html>\n")
    return target


def _old_page_link(run: Path, target: Path) -> Path:  # a link to one of our pages
    _our_page(run, target.with_name("real.html"))
    target.symlink_to(target.with_name("real.html"))
    return target


def _a_directory(run: Path, target: Path) -> Path:
    target.mkdir()
    return target


def _a_record_file(run: Path, target: Path) -> Path:
    return run / "records.jsonl"


@pytest.mark.parametrize("make, replaced", [(_our_page, True), (_hand_page, False), (_old_page_link, False),
                                            (_a_directory, False), (_a_record_file, False)],
                         ids=["our page", "hand-written page", "symlink", "directory", "record file"])
def test_save_force_replaces_our_page_only(tmp_path, make, replaced):
    """``--save FILE --force`` replaces a page this command wrote (its generator mark), nothing else: a page
    written by hand starts with the same doctype and is refused, named, and left as it was."""
    from flodl_hf.core.errors import OutputExistsError
    from flodl_hf.training.report import write_report
    run = tmp_path / "run"
    synthetic_run(run, hosts=1, per_host=1, windows=2).close()
    target = make(run, tmp_path / "page.html")
    with (run / "records.jsonl").open("a") as f:  # the run goes on: a replaced page shows it
        f.write(json.dumps({"event": "eval", "t": 2e9, "step": 8, "accuracy": 0.5}) + "\n")
    before = target.read_bytes() if target.is_file() else None
    if replaced:
        assert write_report(run, target, force=True) == target
        assert target.read_bytes() != before and b'"accuracy":0.5' in target.read_bytes()
    else:
        with pytest.raises(OutputExistsError, match=target.name):
            write_report(run, target, force=True)
        assert main(["portal", str(run), "--save", str(target), "--force"]) == 2
        assert (target.read_bytes() if target.is_file() else None) == before
    assert not list(tmp_path.rglob(".*tmp-*"))


def test_only_loopback_host_names_are_answered_without_a_token(run):
    """DNS rebinding: a page elsewhere could point a name of its own at 127.0.0.1 and read the run."""
    app = create_app(run)
    for base in ("http://127.0.0.1:8765", "http://localhost", "http://[::1]:8765"):
        assert TestClient(app, base_url=base).get("/paths").status_code == 200, base
    for base in ("http://attacker.example", "http://attacker.example:8765", "http://10.0.0.1"):
        res = TestClient(app, base_url=base).get("/paths")
        assert res.status_code == 421 and "Host header" in res.json()["error"], base
    # with a token, the token is the check, whatever the name
    assert TestClient(create_app(run, token="t"), base_url="http://box.lan").get("/paths?token=t").status_code == 200


def test_records_linking_out_of_the_run_and_malformed_lines_are_never_served(run, tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"event": "train", "step": 1, "SECRET": "outside"}) + "\n")
    (run / "host-x").mkdir()
    (run / "host-x" / "records.jsonl").symlink_to(secret)
    client = TestClient(create_app(run), base_url="http://127.0.0.1")
    assert "host-x" not in client.get("/paths").json()["paths"]
    for url in ("/node/host-x", "/history/host-x", "/stream/host-x"):
        assert client.get(url).status_code == 404, url
    with (run / "host-h00" / "records.jsonl").open("a") as f:  # a foreign writer's lines
        f.write('{"event": "train", "step": 9999, "loss": NaN, "t": 2e9}\n')
        f.write('{"event": "train", "step": 10000, "t": 2e9, "children": {"rank-0": 1}}\n')
        f.write("[" * 100000 + "\n")
    for url in ("/node/host-h00", "/history/host-h00"):
        res = client.get(url)
        assert res.status_code == 200, url
    records = client.get("/history/host-h00").json()["records"]
    assert [r["loss"] for r in records if r["step"] == 9999] == [None]
    assert stream_message(records[-1], 0, {}) == records[-1]  # children that are not objects: none

