"""The ``portal`` command: serve a training run's live records and page (``flodl_hf.training.portal``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from flodl_hf.core.errors import SourceNotFoundError
from flodl_hf.training.portal import DEFAULT_HOST, DEFAULT_PORT, serve


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("portal", help="watch a run (live or finished) in the browser, or save it as one file",
                              description="Serve RUN's record tree: the same page at the root, each host and "
                                          "each rank, live over server-sent events. --save writes the "
                                          "self-contained page instead of serving.")
    p.add_argument("run", help="the run directory (the trainer's log_dir)")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default 127.0.0.1; any other needs --token)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--token", default=None, help="a secret every request must carry (?token= or Bearer)")
    p.add_argument("--save", metavar="FILE", default=None, help="write the self-contained page to FILE and exit")
    p.add_argument("--force", action="store_true", help="with --save: replace FILE if it is a page flodl-hf wrote "
                   "(never a hand-written page or any other file)")
    p.set_defaults(func=_cmd_portal)


def _cmd_portal(args: argparse.Namespace) -> int:
    if args.save:
        from flodl_hf.training.report import write_report
        if not Path(args.run).is_dir():
            raise SourceNotFoundError(f"{args.run}: no such run directory")
        print(write_report(args.run, args.save, force=args.force))
        return 0
    serve(args.run, host=args.host, port=args.port, token=args.token)
    return 0
