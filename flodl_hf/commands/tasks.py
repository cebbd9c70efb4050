"""The task commands: ``fill-mask``, ``classify``, ``zero-shot``, ``tag``, ``answer``, ``embed``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from flodl_hf.core.errors import InputError
from flodl_hf.tasks.answer import answer
from flodl_hf.tasks.classify import classify
from flodl_hf.tasks.detect_replaced import detect_replaced
from flodl_hf.tasks.embed import embed, rank
from flodl_hf.tasks.fill_mask import DEFAULT_FILL_MASK_MODEL, fill_mask
from flodl_hf.tasks.runtime import PRECISIONS
from flodl_hf.tasks.tag import AGGREGATIONS, tag
from flodl_hf.tasks.zero_shot import DEFAULT_HYPOTHESIS_TEMPLATE, zero_shot


def _texts(args: argparse.Namespace) -> list[str]:
    texts = list(args.texts or [])
    if not texts:
        if sys.stdin.isatty():
            raise InputError("give texts as arguments, or one per line on stdin")
        texts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise InputError("no texts given (as arguments or on stdin)")
    return texts


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False))


def _table(rows: list[dict], columns: Sequence[str]) -> None:
    def cell(value: Any) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)
    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


def _cmd_fill_mask(args: argparse.Namespace) -> int:
    texts = _texts(args)
    targets = args.targets.split(",") if args.targets else None
    results = fill_mask(texts, model=args.model, top_k=args.top_k, targets=targets, precision=args.precision)
    if args.json:
        _print_json(results)
        return 0
    for text, result in zip(texts, results):
        print(text)
        masks = result if result and isinstance(result[0], list) else [result]
        for n, rows in enumerate(masks, 1):
            if len(masks) > 1:
                print(f"mask {n}:")
            _table(rows, ("score", "token_str", "sequence"))
        print()
    return 0


def _cmd_classify(args: argparse.Namespace) -> int:
    texts = _texts(args)
    given = {} if args.top_k is None else {"top_k": args.top_k}  # no --top-k: the pipeline's one best per text
    results = classify(texts, args.model, function_to_apply=args.function, precision=args.precision, **given)
    if args.json:
        _print_json(results)
        return 0
    rows = []
    for text, result in zip(texts, results):
        for r in (result if isinstance(result, list) else [result]):
            rows.append({"text": text if len(text) <= 60 else text[:57] + "...", **r})
    _table(rows, ("label", "score", "text"))
    return 0


def _cmd_zero_shot(args: argparse.Namespace) -> int:
    texts = _texts(args)
    results = zero_shot(texts, args.labels, args.model, hypothesis_template=args.template,
                        multi_label=args.multi_label, precision=args.precision)
    if args.json:
        _print_json(results)
        return 0
    for result in results:
        print(result["sequence"])
        _table([{"label": label, "score": score} for label, score in zip(result["labels"], result["scores"])],
               ("label", "score"))
        print()
    return 0


def _cmd_tag(args: argparse.Namespace) -> int:
    texts = _texts(args)
    results = tag(texts, args.model, aggregation_strategy=args.aggregation, precision=args.precision)
    if args.json:
        _print_json(results)
        return 0
    key = "entity" if args.aggregation == "none" else "entity_group"
    for text, entities in zip(texts, results):
        print(text)
        _table([{"label": e[key], **e} for e in entities], ("label", "score", "word", "start", "end"))
        print()
    return 0


def _cmd_detect_replaced(args: argparse.Namespace) -> int:
    texts = _texts(args)
    results = detect_replaced(texts, args.model, threshold=args.threshold, precision=args.precision)
    if args.json:
        _print_json(results)
        return 0
    for text, tokens in zip(texts, results):
        print(text)
        _table(tokens, ("token", "score", "replaced", "start", "end"))
        print()
    return 0


def _cmd_answer(args: argparse.Namespace) -> int:
    context = args.context
    if context is None:
        if sys.stdin.isatty():
            raise InputError("give the context with --context, or on stdin")
        context = sys.stdin.read().strip()
    questions = args.question[0] if len(args.question) == 1 else args.question
    results = answer(questions, context, args.model, top_k=args.top_k, max_answer_len=args.max_answer_len,
                     handle_impossible_answer=args.allow_no_answer, precision=args.precision)
    if args.json:
        _print_json(results)
        return 0
    results = [results] if len(args.question) == 1 else results
    for q, result in zip(args.question, results):
        print(q)
        _table(result if isinstance(result, list) else [result], ("score", "answer", "start", "end"))
        print()
    return 0


def _cmd_embed(args: argparse.Namespace) -> int:
    texts = _texts(args)
    if args.query is not None:
        ranked = rank(args.query, texts, args.model, pooling=args.pooling, normalize=not args.no_normalize,
                      precision=args.precision)
        if args.json:
            _print_json(ranked)
        else:
            print(f"query: {args.query}")
            _table(ranked, ("score", "text"))
        return 0
    vectors = embed(texts, args.model, pooling=args.pooling, normalize=not args.no_normalize, precision=args.precision)
    if args.json:
        _print_json([{"text": t, "embedding": v} for t, v in zip(texts, vectors.tolist())])
        return 0
    for text, v in zip(texts, vectors.tolist()):
        head = ", ".join(f"{x:+.4f}" for x in v[:4])
        print(f"[{head}, ...] dim={len(v)}  {text}")
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    def common(parser: argparse.ArgumentParser, texts: bool = True, model_default: str | None = None) -> None:
        if texts:
            parser.add_argument("texts", nargs="*", metavar="TEXT", help="texts (default: one per line on stdin)")
        parser.add_argument("--model", "-m", default=model_default, required=model_default is None,
                            help="a checkpoint directory, samples/<name>, or a hub id")
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
        parser.add_argument("--precision", choices=PRECISIONS, default="exact",
                            help="exact (float32, the default) or an opt-in faster one that changes scores")

    p = subparsers.add_parser("fill-mask", help="predict the masked word ([MASK] or <mask>)")
    common(p, model_default=DEFAULT_FILL_MASK_MODEL)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--targets", help="comma-separated candidate words")
    p.set_defaults(func=_cmd_fill_mask)

    p = subparsers.add_parser("classify", help="classify texts (sequence classification head)")
    common(p)
    p.add_argument("--top-k", type=int, help="the best k labels per text, as a list (default: the best one)")
    p.add_argument("--function", choices=("softmax", "sigmoid", "none"), help="score function (default: as configured)")
    p.set_defaults(func=_cmd_classify)

    p = subparsers.add_parser("zero-shot", help="classify texts into labels given now (an NLI model)")
    common(p)
    p.add_argument("--labels", "-l", required=True, help="comma-separated candidate labels")
    p.add_argument("--template", default=DEFAULT_HYPOTHESIS_TEMPLATE,
                   help="the hypothesis, with {} where the label goes (default: %(default)r)")
    p.add_argument("--multi-label", action="store_true",
                   help="score each label on its own (entailment vs contradiction) instead of across labels")
    p.set_defaults(func=_cmd_zero_shot)

    p = subparsers.add_parser("tag", help="tag tokens / named entities (token classification head)")
    common(p)
    p.add_argument("--aggregation", choices=AGGREGATIONS, default="simple")
    p.set_defaults(func=_cmd_tag)

    p = subparsers.add_parser("answer", help="extract the answer to a question from a context")
    common(p, texts=False)
    p.add_argument("--question", "-q", action="append", required=True, help="may be repeated")
    p.add_argument("--context", "-c", help="the context (default: stdin)")
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--max-answer-len", type=int, default=15)
    p.add_argument("--allow-no-answer", action="store_true", help="handle_impossible_answer")
    p.set_defaults(func=_cmd_answer)

    p = subparsers.add_parser("detect-replaced", help="per token, was it replaced? (ELECTRA's discriminator)")
    common(p)
    p.add_argument("--threshold", type=float, default=0.5, help="score above which a token counts as replaced")
    p.set_defaults(func=_cmd_detect_replaced)

    p = subparsers.add_parser("embed", help="sentence embeddings, or rank texts by similarity to --query")
    common(p)
    p.add_argument("--pooling", choices=("mean", "cls", "max"))
    p.add_argument("--no-normalize", action="store_true")
    p.add_argument("--query", help="rank the texts by cosine similarity to this one")
    p.set_defaults(func=_cmd_embed)
