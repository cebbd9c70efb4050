"""The image task commands: ``classify-image`` and ``zero-shot-image``."""

from __future__ import annotations

import argparse

from flodl_hf.commands.tasks import _print_json, _table
from flodl_hf.tasks.image import DEFAULT_IMAGE_TEMPLATE, classify_image, zero_shot_image


def _rows(images: list[str], results: list) -> list[dict]:
    return [{"image": image, **r} for image, result in zip(images, results) for r in result]


def _cmd_classify_image(args: argparse.Namespace) -> int:
    results = classify_image(list(args.images), model=args.model, top_k=args.top_k, function_to_apply=args.function)
    if args.json:
        _print_json(results)
    else:
        _table(_rows(args.images, results), ("label", "score", "image"))
    return 0


def _cmd_zero_shot_image(args: argparse.Namespace) -> int:
    labels = [label.strip() for label in args.labels.split(",") if label.strip()]
    results = zero_shot_image(list(args.images), labels, model=args.model, hypothesis_template=args.template)
    if args.json:
        _print_json(results)
    else:
        _table(_rows(args.images, results), ("label", "score", "image"))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("images", nargs="+", metavar="IMG", help="image files (JPEG, PNG, ... as Pillow reads)")
        parser.add_argument("--model", "-m", required=True, help="a model directory, hub id or samples/<name>")
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = subparsers.add_parser("classify-image", help="classify images (image classification head)")
    common(p)
    p.add_argument("--top-k", type=int, default=5, help="the best k labels per image (default 5)")
    p.add_argument("--function", choices=("softmax", "sigmoid", "none"), help="score function (default: as configured)")
    p.set_defaults(func=_cmd_classify_image)

    p = subparsers.add_parser("zero-shot-image", help="score images against labels given now (CLIP or SigLIP)")
    common(p)
    p.add_argument("--labels", "-l", required=True, help="comma-separated candidate labels")
    p.add_argument("--template", default=DEFAULT_IMAGE_TEMPLATE,
                   help=f"hypothesis template ({DEFAULT_IMAGE_TEMPLATE!r})")
    p.set_defaults(func=_cmd_zero_shot_image)
