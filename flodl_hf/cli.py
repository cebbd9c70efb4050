"""The ``flodl-hf`` command. Thin: it parses arguments and calls library functions.

Each module of ``flodl_hf.commands`` defines ``register_cli(subparsers)``; the subcommand's
``func(args) -> int`` is the exit code. Modules are listed here once.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from flodl_hf.core.errors import FlodlHFError

COMMAND_MODULES = (
    "flodl_hf.commands.parity",
    "flodl_hf.commands.export",   # registers verify-export, verify-matrix and convert too
    "flodl_hf.commands.tasks",
    "flodl_hf.commands.image",    # classify-image, zero-shot-image
    "flodl_hf.commands.generate",
    "flodl_hf.commands.samples",
    "flodl_hf.commands.train",
    "flodl_hf.commands.doctor",
    "flodl_hf.commands.portal",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flodl-hf", description="HuggingFace checkpoints in native, exact PyTorch modules.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # the module is not written yet; its commands are absent
                continue
            raise
        register = getattr(module, "register_cli", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except FlodlHFError as exc:
        print(f"flodl-hf {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
