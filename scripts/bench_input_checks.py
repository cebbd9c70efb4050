"""Cost of the forward input checks (flodl_hf.core.modeling.check_forward_inputs) on a backbone forward.

The same model runs with its input-check hook and with the hook removed, alternating, and the ratio of
median times is printed (checked / unchecked). Timings are noisy on shared machines: read the ratio.

    .venv/bin/python scripts/bench_input_checks.py [--hidden 256] [--layers 4] [--batch 8] [--seq 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flodl_hf.auto import AutoConfig, AutoModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)  # steadier on a shared machine
    config = AutoConfig.for_model("bert", hidden_size=args.hidden, num_hidden_layers=args.layers,
                                  num_attention_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden)
    model = AutoModel.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    mask = torch.ones_like(ids)
    hooks = dict(model._forward_pre_hooks)
    timings: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for _ in range(3):
            model(input_ids=ids, attention_mask=mask)
        for i in range(2 * args.repeats):
            checked = i % 2 == 0
            model._forward_pre_hooks.clear()
            if checked:
                model._forward_pre_hooks.update(hooks)
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=mask)
            timings[checked].append(time.perf_counter() - start)
    model._forward_pre_hooks.update(hooks)
    on, off = statistics.median(timings[True]), statistics.median(timings[False])
    print(f"forward median: checked {on * 1e3:.2f} ms, unchecked {off * 1e3:.2f} ms, ratio {on / off:.3f} "
          f"(hidden {args.hidden}, layers {args.layers}, batch {args.batch}, seq {args.seq})")


if __name__ == "__main__":
    main()
