"""Gradient checkpointing on the real SmolLM2-135M: the memory of a training step with and without it, and its time.

    OMP_NUM_THREADS=1 python scripts/bench_checkpointing.py    # batch 8 x 256, 3 pairs of runs
    python scripts/bench_checkpointing.py --batch 4 --length 128 --pairs 1 --reentrant

The model is SmolLM2-135M-Instruct (sample "smollm2", a GGUF file), dequantised to float32 by
flodl-hf's GGUF reader (``from_pretrained(dir, gguf_file=...)``) and written once as an HF directory under
~/.cache/flodl-hf/smollm2-135m-instruct-f32 (as notebooks/06 writes it), which flodl-hf loads. A step is a forward
and backward of the causal LM on random token ids (labels = the ids) and an AdamW step; gradients are set to None
after it.

Each run is a fresh process: it loads the model, takes one step (AdamW's state and the allocator settle), reads its
resident set (the steady state), resets the peak (``/proc/self/clear_refs``, 5), takes ``--steps`` more and reads the
peak again (VmHWM). The figure is that peak above the steady state: what the step itself needs (activations,
gradients, temporaries), as the kernel counts resident pages; torch keeps no allocator statistics on the CPU.
On a GPU (``--device cuda``) it is ``torch.cuda.max_memory_allocated`` above the memory allocated before the step.
Runs without and with checkpointing alternate (off on, on off, ...) so machine drift cancels; the time ratios are the
medians of the per-pair ratios of the median step times, by the wall clock and by the process's CPU time (which a busy
machine moves less; with one thread, ``OMP_NUM_THREADS=1``, it is the step's compute).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# the same directory notebooks/06_smollm2_lora_sms.ipynb writes
SMOLLM2 = Path.home() / ".cache" / "flodl-hf" / "smollm2-135m-instruct-f32"
MIB = 2 ** 20


def smollm2_directory() -> Path:
    """SmolLM2-135M-Instruct as an HF directory (float32 safetensors, tokenizer, chat template), made once."""
    out = SMOLLM2
    if (out / "config.json").is_file():
        return out
    from flodl_hf import AutoModelForCausalLM, AutoTokenizer
    from flodl_hf.core.fs import atomic_directory
    from flodl_hf.core.samples import sample_path
    source = sample_path("smollm2")
    gguf = next(source.glob("*.gguf")).name
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf)
    with atomic_directory(out, force=True) as tmp:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source, gguf_file=gguf).save_pretrained(tmp)
    return out


def _status(field: str) -> int:
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field + ":"))


def child(args: argparse.Namespace) -> None:
    """One run: prints {"peak": bytes above the steady state, "steady": bytes, "step_s": [...]} as JSON."""
    import torch

    from flodl_hf import AutoModelForCausalLM
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.source).to(device).train()
    if args.mode == "on":
        model.gradient_checkpointing_enable({"use_reentrant": args.reentrant})
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.length), generator=torch.Generator()
                        .manual_seed(1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, time.process_time() - cpu

    step()
    if device.type == "cuda":
        steady = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        steady = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
    times = [step() for _ in range(args.steps)]
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _status("VmHWM")
    print(json.dumps({"mode": args.mode, "steady": steady, "peak": peak - steady, "step_s": [t for t, _ in times],
                      "step_cpu_s": [c for _, c in times]}))


def run(args: argparse.Namespace, mode: str) -> dict:
    command = [sys.executable, __file__, "--child", mode, "--source", str(args.source), "--device", args.device,
               "--batch", str(args.batch), "--length", str(args.length), "--steps", str(args.steps)]
    done = subprocess.run(command + (["--reentrant"] if args.reentrant else []), capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=None, help="an HF directory (default: SmolLM2-135M)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run, after one untimed")
    parser.add_argument("--pairs", type=int, default=3, help="runs without and with checkpointing, alternating")
    parser.add_argument("--reentrant", action="store_true", help="use_reentrant=True (default: False)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child", choices=("off", "on"), dest="mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        return child(args)
    args.source = args.source or smollm2_directory()
    import torch
    print(f"{args.source}: batch {args.batch} x {args.length}, {args.steps} timed steps a run, {args.pairs} pairs, "
          f"use_reentrant={args.reentrant}, {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}", flush=True)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for pair in range(args.pairs):
        for mode in (("off", "on") if pair % 2 == 0 else ("on", "off")):
            result = run(args, mode)
            runs[mode].append(result)
            print(f"  {mode:3}: step peak {(result['peak'] + result['steady']) / MIB:6.0f} MiB, "
                  f"{result['peak'] / MIB:6.0f} MiB above a steady {result['steady'] / MIB:.0f} MiB; steps "
                  f"{', '.join(f'{t:.2f}' for t in result['step_s'])} s "
                  f"({', '.join(f'{t:.2f}' for t in result['step_cpu_s'])} s of CPU)", flush=True)
    memory = {mode: statistics.median(r["peak"] for r in rows) for mode, rows in runs.items()}
    peak = {mode: statistics.median(r["peak"] + r["steady"] for r in rows) for mode, rows in runs.items()}
    ratios = {}
    for clock in ("step_s", "step_cpu_s"):  # wall time, and this process's CPU time (a busy machine moves the first)
        times = {mode: [statistics.median(r[clock]) for r in rows] for mode, rows in runs.items()}
        ratios[clock] = statistics.median(on / off for off, on in zip(times["off"], times["on"]))
    summary = {"source": str(args.source), "batch": args.batch, "length": args.length, "device": args.device,
               "use_reentrant": args.reentrant, "step_memory_bytes": memory, "step_peak_bytes": peak,
               "memory_ratio": memory["on"] / memory["off"], "time_ratio": ratios["step_s"],
               "cpu_time_ratio": ratios["step_cpu_s"], "runs": runs}
    print(f"step memory above the steady state: {memory['off'] / MIB:.0f} MiB without checkpointing, "
          f"{memory['on'] / MIB:.0f} MiB with ({summary['memory_ratio']:.2f}x); the step's peak: "
          f"{peak['off'] / MIB:.0f} MiB and {peak['on'] / MIB:.0f} MiB; step time with / without: "
          f"{ratios['step_s']:.2f}x wall, {ratios['step_cpu_s']:.2f}x CPU")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
