"""The ``convert`` command: .bin checkpoints to safetensors."""

from __future__ import annotations

import argparse
import json

from flodl_hf.roundtrip.convert import convert


def run_convert(args: argparse.Namespace) -> int:
    result = convert(args.source, args.out, revision=args.revision, max_shard_size=args.max_shard_size,
                     force=args.force)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print(f"converted {args.source} to {result.out}: {result.tensors} tensors, every one byte-identical after writing")
    for name in result.weight_files:
        print(f"  {name}")
    if result.shared:
        print(f"  {len(result.shared)} group(s) of tensors shared storage (tied weights), written as copies: "
              + "; ".join(", ".join(g) for g in result.shared))
    if result.copied:
        print(f"  copied: {', '.join(result.copied)}")
    return 0


def register_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="pytorch_model.bin (single or sharded) to safetensors, checked bitwise")
    p.add_argument("source", metavar="SOURCE", help="directory, .bin file, index file or hub id")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to create (atomically)")
    p.add_argument("--revision", default=None)
    p.add_argument("--max-shard-size", default="5GB", help="shard above this size (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_convert)
