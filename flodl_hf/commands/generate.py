"""``flodl-hf generate "prompt" ... --model M``: continue prompts with a decoder (greedy by default)."""

from __future__ import annotations

import argparse
import json

from ..errors import InputError
from ..generate import generate
from .tasks import _texts


def _ids(text: str) -> list[int]:
    """``--eos-token-id``: comma-separated non-negative ints ('' for none)."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not all(t.isdigit() for t in parts):
        raise InputError(f"--eos-token-id {text!r}: expected comma-separated token ids such as 2 or 2,32000")
    return [int(t) for t in parts]


def _cmd_generate(args: argparse.Namespace) -> int:
    prompts = _texts(args)
    eos = None if args.eos_token_id is None else _ids(args.eos_token_id)
    results = generate(prompts, args.model, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       eos_token_id=eos)
    if args.json:
        print(json.dumps(results, indent=2, ensure_ascii=False))
        return 0
    for result in results:
        print(result["generated_text"])
        print()
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="continue prompts with a causal LM (LLaMA, Mistral, Qwen2)")
    p.add_argument("texts", nargs="*", metavar="PROMPT", help="prompts (default: one per line on stdin)")
    p.add_argument("--model", "-m", required=True, help="a checkpoint directory, samples/<name>, or a hub id")
    # Unset options take generation_config.json's values, else transformers' defaults (as generate() does)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens per prompt, at most (default: generation_config.json's, else 20)")
    p.add_argument("--sample", action=argparse.BooleanOptionalAction, default=None,
                   help="sample (--no-sample: greedy) (default: generation_config.json's do_sample, else greedy)")
    p.add_argument("--temperature", type=float, default=None, help="default: generation_config.json's, else 1.0")
    p.add_argument("--top-k", type=int, default=None, help="default: generation_config.json's, else 50; 0 for none")
    p.add_argument("--top-p", type=float, default=None, help="default: generation_config.json's, else 1.0")
    p.add_argument("--seed", type=int, default=None, help="the sampling seed (same seed, same tokens)")
    p.add_argument("--eos-token-id", default=None,
                   help="comma-separated ids that end a row (default: the config's; '' for none)")
    p.add_argument("--json", action="store_true", help="print JSON (text and new token ids)")
    p.set_defaults(func=_cmd_generate)
