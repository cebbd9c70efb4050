"""The live portal: a run's record tree over HTTP (starlette + uvicorn, server-sent events).

API (JSON out; a node's path is its directory under RUN, ``""`` for the root)::

    GET /                      the page (the same one at every level; #/<path> picks the node)
    GET /paths                 {"paths": [every node's path]}
    GET /node/<path>           {"path", "level", "record": latest record, "children": {name: summary}}
    GET /history/<path>?since=T {"path", "records": the node's records with t > T}
                   &event=E    (only those whose event is E: the page reads the run's evaluations so)
    GET /stream/<path>?since=T text/event-stream: one ``record`` event per new record of that node
                               (with since: every record after T first)

A stream carries one node's records only, so a page costs the same whatever the tree below it
holds. Each event is the node's own record with, in ``children``, one child's summary in turn
(round robin) plus any child whose status changed; every child's full summary is in
``/node`` and ``/history``. Only nodes under RUN are served: a path with ``..`` or an unknown
node is a 404 with a JSON error. The server binds 127.0.0.1 unless told otherwise; any other
address needs a token, checked on every request (``?token=`` or ``Authorization: Bearer``).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import math
import os
import threading
import time
from pathlib import Path
from urllib.parse import quote

from flodl_hf.core.errors import InputError, SourceNotFoundError
from flodl_hf.training.records import NODE_RE, RECORDS, level_of, load_tree, parse_lines, read_records, tree_paths

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8765
POLL_S = 0.2          # how often a stream looks for new lines
KEEPALIVE_S = 15.0    # an SSE comment line this often keeps proxies from closing a quiet stream


class NodeNotFound(Exception):
    pass


class RunSource:
    """The record tree of one run directory, read on demand (a run in progress keeps growing)."""

    def __init__(self, run: str | Path) -> None:
        self.run = Path(run).resolve()
        if not self.run.is_dir():
            raise SourceNotFoundError(f"{run}: no such run directory")

    def paths(self) -> list[str]:
        return tree_paths(self.run)

    def node(self, path: str) -> str:
        """``path`` checked: a node of this run, inside RUN; else NodeNotFound."""
        path = path.strip("/")
        parts = path.split("/") if path else []
        if any(p in ("", ".", "..") for p in parts) or "\\" in path or "\x00" in path or not NODE_RE.match(path):
            raise NodeNotFound(f"not a node path: {path!r}")
        if path not in self.paths():
            raise NodeNotFound(f"no node {path!r} in this run")
        if not (self.run / path).resolve().is_relative_to(self.run):
            raise NodeNotFound(f"{path!r} is outside the run")
        return path

    def file(self, path: str) -> Path | None:
        """The node's JSONL file; None for a run in the old layout (read whole, see records). A file
        that is a link out of the run is not one (``lookup`` has refused the node already)."""
        file = self.run / path / RECORDS
        return file if file.is_file() and file.resolve().is_relative_to(self.run) else None

    def records(self, path: str) -> list[dict]:
        file = self.file(path)
        return read_records(file) if file is not None else load_tree(self.run).get(path, [])


def stream_message(record: dict, turn: int, sent: dict[str, str]) -> dict:
    """What a stream sends for one record: the node's own numbers, one child's summary in turn,
    and every child whose status changed since this stream last sent it."""
    children = _children(record)
    if not children:
        return record
    names = sorted(children)
    pick = {names[turn % len(names)]}
    pick |= {k for k, c in children.items() if sent.get(k) != c.get("status")}
    for k in pick:
        sent[k] = children[k].get("status")
    return {**record, "children": {k: children[k] for k in sorted(pick)}, "children_n": len(names)}


def _children(record: dict) -> dict[str, dict]:
    """A record's children as the trainer writes them (an object of objects); anything else, none."""
    children = record.get("children")
    if not isinstance(children, dict):
        return {}
    return {str(k): c for k, c in children.items() if isinstance(c, dict)}


def create_app(run: str | Path, token: str | None = None, poll_s: float = POLL_S):
    """The ASGI app serving ``run``; with ``token``, every request must carry it."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.routing import Route

    from flodl_hf.training.report import render_page

    source = RunSource(run)
    stopping = threading.Event()

    def lookup(request: Request) -> str:
        try:
            return source.node(request.path_params.get("path", ""))
        except NodeNotFound as exc:
            raise HTTPException(404, str(exc)) from None

    def page(request: Request):  # (sync endpoints run in the threadpool: file work never blocks the loop)
        return HTMLResponse(render_page(title=f"flodl-hf run: {source.run.name}"))

    def paths(request: Request):
        return JSONResponse({"paths": source.paths()})

    def node(request: Request):
        path = lookup(request)
        records = source.records(path)
        last = next((r for r in reversed(records) if r.get("event") in ("train", "end")), records[-1] if records else None)
        return JSONResponse({"path": path, "level": level_of(path), "record": last,
                             "children": _children(last or {})})

    def since_of(request: Request) -> float | None:
        raw = request.query_params.get("since")
        try:
            since = float(raw) if raw is not None else None
        except ValueError:
            since = math.nan
        if since is not None and not math.isfinite(since):  # nan compares false with every t: no records
            raise HTTPException(400, f"since must be a finite number (a record's t), got {raw!r}")
        return since

    def history(request: Request):
        path = lookup(request)
        since = since_of(request)
        records = source.records(path)
        if since is not None:
            records = [r for r in records if isinstance(r.get("t"), (int, float)) and r["t"] > since]
        event = request.query_params.get("event")
        if event is not None:  # a lower level's page reads the run's evaluations from the root's records
            records = [r for r in records if r.get("event") == event]
        return JSONResponse({"path": path, "records": records})

    async def stream(request: Request):
        path = lookup(request)
        file = source.file(path)
        since = since_of(request)

        def read_new(offset: int, held: int) -> tuple[int, bytes, bool]:
            """(offset, bytes, rewritten): what was written past ``offset`` and the ``held`` bytes of an
            unfinished line already read (a long line in progress is read once, not at every poll)."""
            if file is None:
                return offset, b"", False
            try:
                size = file.stat().st_size
                if size < offset + held:  # rewritten (a resumed run drops its tail): follow from its end
                    return _complete_size(file), b"", True
                if size > offset + held:
                    with open(file, "rb") as f:
                        f.seek(offset + held)
                        return offset, f.read(size - offset - held), False
            except FileNotFoundError:
                pass
            return offset, b"", False

        def setup() -> tuple[int, dict]:
            # From the end of what is written; with ?since=T from the first record after T, so a
            # page that read /history up to T misses nothing written before it connected.
            offset = 0 if since is not None else _complete_size(file)
            # The page drew the children from /history; the stream sends their changes from here.
            last = next((r for r in reversed(source.records(path)) if r.get("children")), {})
            return offset, {k: c.get("status") for k, c in _children(last).items()}

        async def events():
            offset, sent = await asyncio.to_thread(setup)  # file work off the event loop
            pending = b""
            turn, quiet = 0, time.monotonic()
            yield ": following " + (path or "the root") + "\n\n"
            while not stopping.is_set() and not await request.is_disconnected():
                offset, new, rewritten = await asyncio.to_thread(read_new, offset, len(pending))
                records, used = [], 0
                if rewritten:
                    pending = b""
                if new:
                    data = pending + new
                    records, used = parse_lines(data) if b"\n" in new else ([], 0)
                    offset, pending = offset + used, data[used:]
                chunk = []  # what this poll found goes out as one write, then the disconnect check
                for record in records:
                    if since is not None and not (isinstance(record.get("t"), (int, float)) and record["t"] > since):
                        continue
                    message = stream_message(record, turn, sent)
                    turn += 1
                    chunk.append(f"event: record\ndata: {json.dumps(message, separators=(',', ':'))}\n\n")
                if chunk:
                    yield "".join(chunk)
                    quiet = time.monotonic()
                if time.monotonic() - quiet > KEEPALIVE_S:
                    yield ": keepalive\n\n"
                    quiet = time.monotonic()
                await asyncio.sleep(poll_s)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def not_found(request: Request, exc: HTTPException):
        return JSONResponse({"error": exc.detail, "status": exc.status_code}, status_code=exc.status_code)

    routes = [Route("/", page), Route("/paths", paths),
              Route("/node", node), Route("/node/{path:path}", node),
              Route("/history", history), Route("/history/{path:path}", history),
              Route("/stream", stream), Route("/stream/{path:path}", stream)]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found})
    app.state.stopping = stopping

    async def guarded(scope, receive, send):
        # Without a token the portal listens on loopback only, and answers only requests that name a
        # loopback host: a page elsewhere cannot reach it by a name of its own resolving to 127.0.0.1
        # (DNS rebinding). With a token, the token is the check.
        if scope["type"] == "http" and token is None and not _host_ok(scope):
            await JSONResponse({"error": "the Host header must name this machine's loopback (127.0.0.1, localhost, "
                                         "[::1]); serve with --token to be reached by another name",
                                "status": 421}, status_code=421)(scope, receive, send)
            return
        if scope["type"] == "http" and token is not None and not _token_ok(scope, token):
            await JSONResponse({"error": "missing or wrong token (?token= or Authorization: Bearer)",
                                "status": 401}, status_code=401)(scope, receive, send)
            return
        await app(scope, receive, send)

    guarded.state = app.state  # type: ignore[attr-defined]
    return guarded


def _host_ok(scope: dict) -> bool:
    """The request's Host header names a loopback address (its port aside)."""
    host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), "")
    if host.startswith("[") and "]" in host:  # [::1]:8765
        name = host[1:host.index("]")]
    elif host.count(":") == 1:                # 127.0.0.1:8765, localhost:8765
        name = host.split(":")[0]
    else:
        name = host
    return _is_loopback(name.lower())


def _token_ok(scope: dict, token: str) -> bool:
    from urllib.parse import parse_qs
    given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [None])[-1]
    for key, value in scope.get("headers", []):
        if key == b"authorization" and value.lower().startswith(b"bearer "):
            given = value[7:].decode("latin-1").strip()
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def _complete_size(file: Path | None) -> int:
    """Bytes of ``file`` up to its last newline: a stream starts after what is already written."""
    if file is None:
        return 0
    try:
        with open(file, "rb") as f:  # from the end, a block at a time: the last newline, not the whole file
            end = f.seek(0, os.SEEK_END)
            while end > 0:
                start = max(0, end - (1 << 16))
                f.seek(start)
                found = f.read(end - start).rfind(b"\n")
                if found >= 0:
                    return start + found + 1
                end = start
    except FileNotFoundError:
        pass
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Any address but loopback needs a token: the portal shows the run to whoever can reach it."""
    if not _is_loopback(host) and not token:
        raise InputError(f"--host {host} is reachable from other machines: give --token T (checked on every "
                         "request), or serve on 127.0.0.1")


class Portal:
    """A portal running in a background thread (beside training)."""

    def __init__(self, server, thread: threading.Thread, url: str, app) -> None:
        self.server, self.thread, self.url, self.app = server, thread, url, app

    @property
    def port(self) -> int:
        return int(self.url.split(":")[2].split("/")[0])

    def stop(self, timeout: float = 5.0) -> None:
        self.app.state.stopping.set()
        self.server.should_exit = True
        self.thread.join(timeout)


def start_portal(run: str | Path, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, token: str | None = None,
                 poll_s: float = POLL_S, wait_s: float = 15.0) -> Portal:
    """Serve ``run`` from a daemon thread; return once it listens (``port=0``: any free port)."""
    import uvicorn
    check_bind(host, token)
    app = create_app(run, token=token, poll_s=poll_s)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="flodl-hf-portal", daemon=True)
    thread.start()
    deadline = time.monotonic() + wait_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise InputError(f"the portal could not listen on {host}:{port} (in use?); pass another port")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound}/" + (f"?token={quote(token, safe='')}" if token else "")
    return Portal(server, thread, url, app)


def serve(run: str | Path, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, token: str | None = None) -> None:
    """Serve ``run`` in the foreground until Ctrl-C."""
    import uvicorn
    check_bind(host, token)
    app = create_app(run, token=token)
    shown = f"[{host}]" if ":" in host else host
    print(f"flodl-hf portal: http://{shown}:{port}/" + (f"?token={quote(token, safe='')}" if token else ""), flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
