"""The ``export`` command (and, through their modules here, ``verify-export``, ``verify-matrix``, ``convert``)."""

from __future__ import annotations

import argparse
import json

from flodl_hf.core.errors import InputError
from flodl_hf.roundtrip.export import DTYPES, export, export_checkpoint
from flodl_hf.core.registry import task_names


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def run_export(args: argparse.Namespace) -> int:
    if (args.gguf is None) == (args.out is None):
        raise InputError("export takes --out DIR (an HF directory) or --gguf OUT.gguf (a GGUF file), one of them")
    if args.gguf is not None:
        from flodl_hf.roundtrip.gguf_out import export_gguf
        done = export_gguf(args.checkpoint or args.hub, args.gguf, outtype=args.outtype, force=args.force,
                           checkpoint=bool(args.checkpoint), tokenizer=args.tokenizer)
        print(f"exported {args.checkpoint or args.hub} as GGUF ({done.architecture}, {done.outtype}, "
              f"{done.tensors} tensors) to {done.out}")
        for note in done.notes:
            print(f"note: {note}")
        print(f"check it: flodl-hf verify-export {done.out} --source {args.hub or '<the source directory>'}")
        return 0
    common = dict(head=args.head, dtype=args.dtype, max_shard_size=args.max_shard_size, force=args.force,
                  tokenizer=args.tokenizer, like=args.like)
    if args.adapter or args.merge:
        from flodl_hf.roundtrip.adapters import export_adapter, require_lora_checkpoint
        if not args.checkpoint:
            raise InputError("--adapter and --merge take --checkpoint CKPT (a LoRA trainer checkpoint), not --hub")
        if args.adapter:
            out = export_adapter(args.checkpoint, args.out, force=args.force)
            print(f"exported the LoRA adapter of {args.checkpoint} as a PEFT adapter to {out}")
            print(f"check it: flodl-hf verify-export {out}")
            return 0
        require_lora_checkpoint(args.checkpoint)
    if args.checkpoint:
        result = export_checkpoint(args.checkpoint, args.out, **common)
    else:
        result = export(args.hub, args.out, revision=args.revision, **common)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print(f"exported {args.checkpoint or args.hub} as {result.architecture} to {result.out}")
    for name in result.files:
        print(f"  {name:40} {_human((result.out / name).stat().st_size):>10}")
    for note in result.notes:
        print(f"note: {note}")
    print(f"check it: flodl-hf verify-export {result.out}")
    return 0


def register_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint out again through our native modules, HF-canonical")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hub", metavar="SOURCE", help="hub id or local directory / weights file")
    src.add_argument("--checkpoint", metavar="CKPT", help="a checkpoint written by the flodl-hf trainer")
    p.add_argument("--out", default=None, metavar="DIR", help="directory to create (atomically)")
    p.add_argument("--gguf", default=None, metavar="OUT.gguf", help="write a GGUF file instead (llama.cpp's format)")
    p.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"],
                   help="with --gguf: the weights' type (norms and biases stay f32)")
    p.add_argument("--head", default="auto", choices=["auto", *task_names()], help="head to export (auto: architectures)")
    p.add_argument("--revision", default=None, help="hub revision (with --hub)")
    p.add_argument("--dtype", default="keep", choices=list(DTYPES), help="cast floating tensors")
    p.add_argument("--max-shard-size", default="5GB", help="shard above this size (default 5GB)")
    p.add_argument("--tokenizer", default=None, metavar="SOURCE", help="take tokenizer files from here")
    p.add_argument("--like", default=None, metavar="DIR",
                   help="take the model card, sentence-transformers layout and tokenizer from here")
    lora = p.add_mutually_exclusive_group()
    lora.add_argument("--adapter", action="store_true", help="LoRA checkpoint: write its adapter as a PEFT directory")
    lora.add_argument("--merge", action="store_true",
                      help="LoRA checkpoint: write the base with the adapter merged in, HF-canonical (the default "
                           "for a LoRA checkpoint; --merge refuses one without an adapter)")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_export)

    import importlib  # by module name: the package may re-export functions called export or convert
    for name in ("verify", "convert"):
        importlib.import_module(f"{__package__}.{name}").register_cli(sub)
