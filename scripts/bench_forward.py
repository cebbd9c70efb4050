"""Forward speed, ours vs transformers (sdpa), BERT-base size, batch 8 x 128 with padding.

The two models run alternately (A B A B ...) in one process on the same batch, so
machine drift cancels; the figure is the median of per-pair ratios ours / transformers.
Outputs are checked to be torch.equal before timing.

    python scripts/bench_forward.py [--layers 12] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    args = parser.parse_args()

    from helpers import quiet_transformers
    transformers = quiet_transformers()
    from flodl_hf import AutoModel

    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=args.layers)  # hidden 768, 12 heads, vocab 30522
    with tempfile.TemporaryDirectory() as tmp:
        transformers.BertModel(config).save_pretrained(tmp)
        theirs = transformers.AutoModel.from_pretrained(tmp, dtype=torch.float32,
                                                        attn_implementation=args.attn).eval()
        ours = AutoModel.from_pretrained(tmp, attn_implementation=args.attn)

    ids = torch.randint(1000, config.vocab_size, (args.batch, args.length))
    mask = torch.ones_like(ids)
    for row in range(args.batch // 2):  # half the rows padded, to various lengths
        mask[row, args.length // 2 + row * 8:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}

    with torch.inference_mode():
        a, b = ours(**batch), theirs(**batch)
        exact = torch.equal(a.last_hidden_state, b.last_hidden_state) and torch.equal(a.pooler_output, b.pooler_output)
        times = {"ours": [], "transformers": []}
        for _ in range(args.repeats):
            for name, model in (("ours", ours), ("transformers", theirs)):
                start = time.perf_counter()
                model(**batch)
                times[name].append(time.perf_counter() - start)
    ratios = [o / t for o, t in zip(times["ours"], times["transformers"])]
    print(f"BERT-base forward, {args.layers} layers, batch {args.batch} x {args.length} (half padded), "
          f"{args.attn}, {torch.get_num_threads()} threads, {args.repeats} alternating pairs")
    print(f"  outputs torch.equal: {exact}")
    print(f"  median ours:         {statistics.median(times['ours']) * 1000:8.1f} ms")
    print(f"  median transformers: {statistics.median(times['transformers']) * 1000:8.1f} ms")
    print(f"  median ratio ours/transformers: {statistics.median(ratios):.3f}  "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
