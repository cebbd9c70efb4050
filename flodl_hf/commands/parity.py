"""The ``parity`` command: our model against transformers' on a padded batch, as a table."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from flodl_hf.auto import task_of
from flodl_hf.roundtrip.parity import check_parity
from flodl_hf.core.registry import get_family
from flodl_hf.core.registry import task_names


def _tasks_for(family, head: str) -> list[str]:
    if head == "all":
        return list(family.tasks)
    return [head]


def run_cli(args: argparse.Namespace) -> int:
    from flodl_hf.auto import AutoConfig
    config = AutoConfig.from_pretrained(args.source, revision=args.revision)
    family = get_family(config.model_type)
    impls = list(family.attn_implementations) if args.attn == "all" else [args.attn]
    heads = [task_of(config)] if args.head == "auto" else _tasks_for(family, args.head)
    results = []
    for task in heads:
        for impl in impls:
            results.append(check_parity(args.source, task, impl, args.revision))
    if args.json:
        print(json.dumps([{**asdict(r), "exact": r.exact} for r in results], indent=2))
    else:
        print(f"parity of {args.source} ({config.model_type}) against transformers, CPU float32")
        print(f"{'head':11} {'attention':9} {'field':18} {'max abs diff':>13}  exact")
        for r in results:
            if r.skipped:
                print(f"{r.task:11} {r.attn_implementation:9} {'-':18} {'skipped':>13}  ({r.skipped})")
            for name, diff in r.diffs.items():
                print(f"{r.task:11} {r.attn_implementation:9} {name:18} {diff:13.3g}  {'yes' if r.equal[name] else 'NO'}")
    compared = [r for r in results if not r.skipped]
    ok = bool(compared) and all(r.exact for r in compared)
    if not args.json:
        print("PASS: every field is bit-exact" if ok else "FAIL: some field differs, or nothing was compared")
    return 0 if ok else 1


def register_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="compare our model with transformers' on a padded batch; exit 1 unless exact")
    p.add_argument("source", help="local directory, weights file, or hub id")
    p.add_argument("--head", default="auto", choices=["auto", "all", *task_names()],
                   help="head to build (auto: from config architectures; all: every head)")
    p.add_argument("--attn", default="all", choices=["sdpa", "eager", "all"], help="attention path(s)")
    p.add_argument("--revision", default=None)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_cli)
