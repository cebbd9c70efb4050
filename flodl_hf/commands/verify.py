"""The ``verify-export`` and ``verify-matrix`` commands."""

from __future__ import annotations

import argparse
import json

from flodl_hf.roundtrip.matrix import verify_matrix
from flodl_hf.core.registry import task_names
from flodl_hf.roundtrip.verify import verify_export


def run_verify_export(args: argparse.Namespace) -> int:
    if args.dir.endswith(".gguf"):  # a GGUF export, verified against its source
        from flodl_hf.roundtrip.gguf_verify import verify_gguf
        report = verify_gguf(args.dir, source=args.source, prompts=args.prompt)
        print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_table())
        return 0 if report.ok else 1
    report = verify_export(args.dir, source=args.source, no_source=args.no_source, prompts=args.prompt)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format_table())
    return 0 if report.ok else 1


def run_verify_matrix(args: argparse.Namespace) -> int:
    result = verify_matrix(args.families, args.heads, args.out, keep=args.keep, progress=not args.json)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.format_table())
        print(f"wrote {result.json_path} and {result.html_path}")
    return 0 if result.ok else 1


def register_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify-export", help="prove an exported directory matches its source; exit 1 on any FAIL")
    p.add_argument("dir", metavar="DIR", help="an exported directory, or a .gguf file (with --source)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--source", default=None, help="compare with this source instead of the stamped one")
    group.add_argument("--no-source", action="store_true", help="no upstream (fine-tuned): checks 1, 4 and 7 only")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="an input text (repeatable); default: two prompts, or random ids without a tokenizer")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_verify_export)

    p = sub.add_parser("verify-matrix", help="export + verify-export over every family x head, generated locally")
    p.add_argument("--families", nargs="+", default=None, metavar="MODEL_TYPE", help="default: every registered one")
    p.add_argument("--heads", nargs="+", default=None, choices=list(task_names()),
                   help="default: the six core tasks and the tasks the chosen families add")
    p.add_argument("--out", default="verify-matrix", help="where matrix.json and matrix.html go")
    p.add_argument("--keep", action="store_true", help="keep the generated sources and exports in OUT/work")
    p.add_argument("--json", action="store_true", help="print the matrix as JSON")
    p.set_defaults(func=run_verify_matrix)
