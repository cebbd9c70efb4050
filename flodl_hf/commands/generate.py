"""``flodl-hf generate "prompt" ... --model M``: continue prompts with a decoder, as the text-generation pipeline."""

from __future__ import annotations

import argparse
import json

from flodl_hf.core.errors import InputError
from flodl_hf.tasks.generate import generate
from flodl_hf.commands.tasks import _texts


def _ids(text: str) -> list[int]:
    """``--eos-token-id``: comma-separated non-negative ints ('' for none)."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not all(t.isdigit() for t in parts):
        raise InputError(f"--eos-token-id {text!r}: expected comma-separated token ids such as 2 or 2,32000")
    return [int(t) for t in parts]


def _cmd_generate(args: argparse.Namespace) -> int:
    prompts = _texts(args)
    eos = None if args.eos_token_id is None else _ids(args.eos_token_id)
    # always a list of prompts: one list of records per prompt, as the pipeline returns for a list
    results = generate(prompts, args.model, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       eos_token_id=eos, return_full_text=args.full_text, return_tensors=args.return_tensors or None,
                       num_return_sequences=args.num_return_sequences,
                       **{name: value for name, value in (("num_beams", args.num_beams),
                                                          ("repetition_penalty", args.repetition_penalty),
                                                          ("no_repeat_ngram_size", args.no_repeat_ngram_size),
                                                          ("min_p", args.min_p), ("stop_sequence", args.stop),
                                                          ("assistant_model", args.assistant))
                          if value is not None})
    if args.json:
        print(json.dumps(results, indent=2, ensure_ascii=False))
        return 0
    for records in results:
        for record in records:
            if "generated_token_ids" in record:
                print(" ".join(str(t) for t in record["generated_token_ids"]))
            else:
                print(record["generated_text"])
            print()
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="continue prompts with a causal LM (LLaMA, Mistral, Qwen2, ...), as "
                                               "transformers' text-generation pipeline")
    p.add_argument("texts", nargs="*", metavar="PROMPT", help="prompts (default: one per line on stdin)")
    p.add_argument("--model", "-m", required=True, help="a checkpoint directory, samples/<name>, or a hub id")
    # Unset options take generation_config.json's values, else the pipeline's defaults (as generate() does)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens per prompt, at most (default: generation_config.json's, else the pipeline's 256)")
    p.add_argument("--sample", action=argparse.BooleanOptionalAction, default=None,
                   help="sample (--no-sample: greedy) (default: generation_config.json's do_sample, else the "
                        "pipeline's: sampling)")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: generation_config.json's, else the pipeline's 0.7 when sampling")
    p.add_argument("--top-k", type=int, default=None, help="default: generation_config.json's, else 50; 0 for none")
    p.add_argument("--top-p", type=float, default=None, help="default: generation_config.json's, else 1.0")
    p.add_argument("--seed", type=int, default=None, help="the sampling seed (as torch.manual_seed before the "
                                                          "pipeline)")
    p.add_argument("--num-return-sequences", type=int, default=None,
                   help="sequences per prompt, when sampling (default: generation_config.json's, else 1)")
    p.add_argument("--num-beams", type=int, default=None,
                   help="beam search with this many beams (default: generation_config.json's, else 1)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="transformers' repetition penalty (default: generation_config.json's, else 1.0: none)")
    p.add_argument("--no-repeat-ngram-size", type=int, default=None,
                   help="ban repeating any n-gram of this size (default: generation_config.json's, else 0: none)")
    p.add_argument("--min-p", type=float, default=None, help="min-p sampling (default: generation_config.json's)")
    p.add_argument("--stop", default=None, metavar="TEXT",
                   help="stop a row once its text ends with TEXT (the pipeline's stop_sequence)")
    p.add_argument("--assistant", default=None, metavar="DIR",
                   help="assisted generation: a smaller causal LM over the same vocabulary drafts tokens that the "
                        "model checks (the pipeline's assistant_model; one prompt at a time)")
    p.add_argument("--eos-token-id", default=None,
                   help="comma-separated ids that end a row (default: the config's; '' for none)")
    p.add_argument("--full-text", action=argparse.BooleanOptionalAction, default=None,
                   help="the prompt and its continuation (default), or --no-full-text: the new text alone")
    p.add_argument("--return-tensors", action="store_true",
                   help="print the token ids (prompt and new) instead of the text")
    p.add_argument("--json", action="store_true",
                   help="print the pipeline's records as JSON: one list per prompt of {generated_text} "
                        "(or {generated_token_ids})")
    p.set_defaults(func=_cmd_generate)
