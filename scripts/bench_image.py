"""The image case of the benchmark: the ImageNet photos of samples/images through ``classify_image`` against
``pipeline("image-classification")``, on a ViT-base size classifier (12 layers, hidden 768, patch 16, 224 px,
1000 labels; random weights generated once with transformers, google/vit-base-patch16-224's processor settings).

    python scripts/bench_image.py [--repeats 3] [--json out/bench_image.json]
    python scripts/bench.py --images        # the same case, beside the others

Reported: the throughput ratio (ours ÷ the pipeline's, images per second over the 20 photos, the median of
alternated pairs), whether the outputs agree (the same labels in the same order, the largest score difference),
and the processor's share of each side's time (the photos decoded and prepared alone, as each side does it:
ours ``flodl_hf.vision``; theirs ``load_image`` and the PIL-backend processor, per image, as the pipeline calls
them). The pipeline runs as a user calls it (one image per pass) and with ``batch_size=8``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

CACHE = Path(os.environ.get("FLODL_HF_BENCH_CACHE", Path.home() / ".cache" / "flodl-hf" / "bench"))
VIT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                image_size=224, patch_size=16, num_labels=1000)
PROCESSOR = {"image_processor_type": "ViTImageProcessor", "do_normalize": True, "do_resize": True, "resample": 2,
             "size": {"height": 224, "width": 224}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def vit_checkpoint() -> Path:
    """A ViT-base size image classifier with its processor file, generated once."""
    import torch
    import transformers
    out = CACHE / "vit-base-imgcls"
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    labels = {i: f"class {i:03d}" for i in range(VIT_BASE["num_labels"])}
    config = transformers.ViTConfig(**VIT_BASE, id2label=labels, label2id={v: k for k, v in labels.items()})
    model = transformers.ViTForImageClassification(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    (tmp / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2) + "\n")
    tmp.rename(out)
    return out


def photos() -> list[str]:
    from flodl_hf.core.samples import fetch, local_path
    folder = local_path("images") or fetch(["images"], quiet=True)["images"]
    return [str(p) for p in sorted(Path(folder).glob("imagenet_*.jpg"))]


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def case_images(repeats: int = 3) -> dict[str, Any]:
    """The measured figures of the image case (see the module docstring)."""
    import transformers
    from transformers.image_utils import load_image

    from flodl_hf.tasks.image import classify_image
    from flodl_hf.tasks.image_runtime import load_images, pixel_rows
    transformers.logging.set_verbosity_error()
    source, images = vit_checkpoint(), photos()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = transformers.pipeline("image-classification", model=str(source), device="cpu")
    ours_out = classify_image(images, model=source)  # loads and warms ours
    theirs_out = pipe(images)
    same = all([r["label"] for r in a] == [r["label"] for r in b] for a, b in zip(ours_out, theirs_out))
    diff = max(abs(x["score"] - y["score"]) for a, b in zip(ours_out, theirs_out) for x, y in zip(a, b))
    sides = {"ours": lambda: classify_image(images, model=source), "pipeline": lambda: pipe(images),
             "pipeline_b8": lambda: pipe(images, batch_size=8)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(repeats):  # alternated, each side first in turn
        for name in (list(sides) if r % 2 == 0 else list(reversed(list(sides)))):
            times[name].append(timed(sides[name]))
    loaded = load_images(source, "image_classification")
    processor = pipe.image_processor
    prep = {"ours": statistics.median(timed(lambda: pixel_rows(loaded, images)) for _ in range(repeats)),
            "pipeline": statistics.median(timed(lambda: [processor(images=load_image(p), return_tensors="pt")
                                                         for p in images]) for _ in range(repeats))}
    median = {name: statistics.median(values) for name, values in times.items()}
    n = len(images)
    return {"images": n, "model": "ViT-base size (12 layers, hidden 768, patch 16, 224 px, 1000 labels)",
            "same_labels": same, "max_score_diff": diff,
            "images_per_s": {name: n / t for name, t in median.items()},
            "ratio": median["pipeline"] / median["ours"], "ratio_b8": median["pipeline_b8"] / median["ours"],
            "processor_s": prep, "processor_share": {"ours": prep["ours"] / median["ours"],
                                                     "pipeline": prep["pipeline"] / median["pipeline"]},
            "seconds": median}


def table(result: dict[str, Any]) -> str:
    rate, share = result["images_per_s"], result["processor_share"]
    return "\n".join([
        f"image case: {result['images']} ImageNet photos (samples/images), {result['model']}",
        f"  classify_image       {rate['ours']:6.2f} images/s   processor {share['ours']:.0%} of the time",
        f"  pipeline             {rate['pipeline']:6.2f} images/s   processor {share['pipeline']:.0%} of the time",
        f"  pipeline batch 8     {rate['pipeline_b8']:6.2f} images/s",
        f"  ratio (ours ÷ pipeline): {result['ratio']:.2f}x; against batch_size=8: {result['ratio_b8']:.2f}x",
        f"  outputs: same labels in the same order {'yes' if result['same_labels'] else 'NO'}, "
        f"largest score difference {result['max_score_diff']:.2g}"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="alternated runs of each side (default 3)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    result = case_images(args.repeats)
    say(table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
