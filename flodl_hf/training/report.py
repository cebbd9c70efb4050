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

from flodl_hf.training.page import PAGE, PAGE_HEAD, SCRIPT, STYLE
from flodl_hf.training.records import load_tree, tree_paths

REPORT_NAME = "run.html"


def render_page(*, title: str = "flodl-hf run", data: dict | None = None) -> str:
    """The page. ``data`` (``{"paths": [...], "nodes": {path: records}}``) makes it the saved,
    self-contained page; without it the page reads the portal's HTTP API."""
    inline = "null" if data is None else json.dumps(data, separators=(",", ":"))
    # JSON inside <script>: "</" would end the element, so it is escaped (JSON allows "<\/").
    inline = inline.replace("</", "<\\/").replace("<!--", "<\\!--")
    return (PAGE.replace("__TITLE__", html.escape(title)).replace("__STYLE__", STYLE)
            .replace("__SCRIPT__", SCRIPT.replace("__DATA__", inline)))


def saved_page(run: str | os.PathLike) -> str:
    """The self-contained page of ``run`` (every level inlined)."""
    run = Path(run)
    nodes = load_tree(run)
    return render_page(title=f"flodl-hf run: {run.name}", data={"paths": list(nodes), "nodes": nodes})


def write_report(log_dir: str | os.PathLike, path: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Write ``log_dir``'s whole record tree as one page (default ``log_dir/run.html``, replaced at
    each write); return its path. A ``path`` that exists is replaced only with ``force``, and only
    where it is a page written here (it starts with :data:`PAGE_HEAD`, the generator mark): never a page
    written by hand, a link, a directory, a record file or anything else."""
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
            if out.is_symlink() or not out.is_file() or not _is_page(out):
                raise OutputExistsError(f"{out} is not a page that flodl-hf wrote (its generator mark is missing, "
                                        "or it is a link): --force replaces only such a page, never another file; "
                                        "choose another path (nothing was written)")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(saved_page(log_dir))
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def _is_page(path: Path) -> bool:
    """``path`` is a page this module wrote: it starts with :data:`PAGE_HEAD` (the generator meta), which
    a page written by hand, or by another tool, does not; a doctype alone is not enough."""
    head = PAGE_HEAD.encode()
    with open(path, "rb") as f:
        return f.read(len(head)) == head
