"""What a CUDA machine must show, in one table, in a few minutes.

    python scripts/gpu_check.py                 # on a machine with a GPU
    python scripts/gpu_check.py --dry-run       # the same code paths on the CPU (gloo for NCCL)

Rows:
1. parity of every family (every variant x head of tests/cases, sdpa and eager where the family
   has both) on CUDA against transformers on CUDA, same batch: exact (torch.equal) where both
   pick the same kernels, else the max abs diff, reported (not a failure by itself: cuBLAS and
   the fused attention kernels may differ between the two call orders);
2. the forward ratio ours / transformers, BERT-base size, batch 8 x 128, alternating pairs;
3. one training step (AdamW) on a sequence classifier: loss and gradients against transformers';
   then one forward + backward per family in train mode (dropout on, the same seed on both sides);
   and each decoder family's generate, greedy and sampled, against transformers' generate;
4. El Che over NCCL: two workers, one GPU each (needs 2 GPUs; NCCL refuses two ranks on one);
5. a mixed cohort, worker 0 on the GPU and worker 1 on the CPU, averaging over gloo.

Rows 4 and 5 train a small MLP with ``verify_sync=True``: every sync checks that both workers hold
bit-identical parameters. ``--dry-run`` runs rows 1-3 on the CPU and rows 4-5 as two CPU workers
over gloo, to check the script itself where there is no GPU; its figures say nothing about CUDA.
The exit code is 0 when no row failed.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

# transformers (with the `kernels` package, one of its dependencies) swaps in kernels from the Hub for
# some layers on CUDA (rotary, RMSNorm); they need the network and are not the reference: its torch path is.
os.environ.setdefault("USE_HUB_KERNELS", "0")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# flodl_hf comes from the installed package (families/ and heads/ install as flodl_hf.families and
# flodl_hf.heads, so the checkout's flodl_hf/ alone is not the package); tests/ holds the cases.
sys.path.insert(0, str(ROOT / "tests"))

ROWS: list[tuple[str, str, str]] = []  # (check, result, detail)


def row(check: str, result: str, detail: str = "") -> None:
    ROWS.append((check, result, detail))
    print(f"  {check:<44} {result:<8} {detail}", flush=True)


# ---- 1. parity ---------------------------------------------------------------------------------

def parity(device: torch.device, quick: bool, match: str) -> None:
    from cases import CASES
    from helpers import make_checkpoint
    from flodl_hf.auto import load_model
    from flodl_hf.roundtrip.parity import compare_outputs, make_batch, reference_model
    from flodl_hf.core.registry import get_family

    seen: set[str] = set()
    for case_id, task, fields in CASES:
        family = get_family(fields["model_type"])
        if match and match not in case_id:
            continue
        if quick and fields["model_type"] in seen:
            continue
        seen.add(fields["model_type"])
        source = make_checkpoint(fields, task)
        for impl in family.attn_implementations:
            try:
                ours = load_model(source, task, dtype=torch.float32, attn_implementation=impl).to(device).eval()
                ref_impl = impl if len(family.attn_implementations) > 1 else None
                theirs = reference_model(source, task, ref_impl).to(device)
                batch = {k: v.to(device) for k, v in make_batch(ours.config, task).items()}
                with torch.inference_mode():
                    a, b = ours(**batch), theirs(**batch)
                diffs, equal = compare_outputs(a, b, list(a.keys()))
                worst = max(diffs.values()) if diffs else float("nan")
                result = "exact" if equal and all(equal.values()) else ("close" if worst < 1e-4 else "FAIL")
                row(f"parity {case_id} {impl}", result, f"max diff {worst:.2e}")
            except Exception as exc:  # one broken case must not hide the others
                row(f"parity {case_id} {impl}", "FAIL", f"{type(exc).__name__}: {str(exc)[:120]}")


# ---- 2. forward ratio --------------------------------------------------------------------------

def forward_ratio(device: torch.device, layers: int, repeats: int) -> None:
    from flodl_hf import AutoModel
    from flodl_hf.roundtrip.parity import quiet_transformers
    transformers = quiet_transformers()
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=layers)
    with tempfile.TemporaryDirectory() as tmp:
        transformers.BertModel(config).save_pretrained(tmp)
        theirs = transformers.AutoModel.from_pretrained(tmp, dtype=torch.float32, attn_implementation="sdpa")
        theirs = theirs.to(device).eval()
        ours = AutoModel.from_pretrained(tmp, attn_implementation="sdpa").to(device).eval()
    ids = torch.randint(1000, config.vocab_size, (8, 128))
    mask = torch.ones_like(ids)
    for r in range(4):
        mask[r, 64 + r * 8:] = 0
    batch = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    batch = {k: v.to(device) for k, v in batch.items()}

    def timed(model) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model(**batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    with torch.inference_mode():
        a, b = ours(**batch), theirs(**batch)
        diff = (a.last_hidden_state - b.last_hidden_state).abs().max().item()
        for _ in range(2):  # warm-up: kernel selection, allocator
            timed(ours), timed(theirs)
        ratios = [timed(ours) / timed(theirs) for _ in range(repeats)]
    row(f"forward ratio, BERT {layers} layers, 8x128", f"{statistics.median(ratios):.3f}",
        f"ours / transformers, median of {repeats} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
        f"max diff {diff:.2e}")


# ---- 3. one training step ----------------------------------------------------------------------

def training_step(device: torch.device) -> None:
    from helpers import make_checkpoint
    from flodl_hf.auto import load_model
    from flodl_hf.roundtrip.parity import make_batch, reference_model
    fields = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 64, "num_labels": 2}
    source = make_checkpoint(fields, "seqcls")
    ours = load_model(source, "seqcls", dtype=torch.float32, attn_implementation="eager").to(device).train()
    theirs = reference_model(source, "seqcls", "eager").to(device).train()
    batch = {k: v.to(device) for k, v in make_batch(ours.config, "seqcls").items()}
    labels = torch.tensor([0, 1], device=device)
    losses, grads, steps = [], [], []
    for model in (ours, theirs):
        for m in model.modules():  # dropout off on both, so the step is deterministic
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        losses.append(loss.item())
        steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    common = sorted(set(grads[0]) & set(grads[1]))
    if not common:
        row("training step (seqcls, AdamW)", "FAIL", "no parameter names in common to compare")
        return
    gdiff = max((grads[0][n] - grads[1][n]).abs().max().item() for n in common)
    pdiff = max((steps[0][n] - steps[1][n]).abs().max().item() for n in common)
    exact = losses[0] == losses[1] and gdiff == 0 and pdiff == 0
    result = "exact" if exact else ("close" if max(gdiff, pdiff, abs(losses[0] - losses[1])) < 1e-4 else "FAIL")
    row("training step (seqcls, AdamW)", result,
        f"loss {losses[0]:.6f} vs {losses[1]:.6f}; grad max diff {gdiff:.2e}; params after {pdiff:.2e}; "
        f"{len(common)} tensors")


def training_steps(device: torch.device, match: str) -> None:
    """One train-mode forward and backward per family (its first sequence-classification case, else its
    first causal LM or masked LM case), on both sides from the same seed: the loss and every gradient."""
    from cases import CASES
    from helpers import make_checkpoint, seeded_backward
    from flodl_hf.auto import load_model
    from flodl_hf.roundtrip.parity import make_batch, reference_model
    from flodl_hf.core.registry import get_family

    chosen: dict[str, tuple[str, str, dict]] = {}
    for preferred in ("seqcls", "causal_lm", "mlm"):
        for case_id, task, fields in CASES:
            if task == preferred and fields["model_type"] not in chosen and (not match or match in case_id):
                chosen[fields["model_type"]] = (case_id, task, fields)
    for model_type, (case_id, task, fields) in sorted(chosen.items()):
        try:
            family = get_family(model_type)
            impl = family.attn_implementations[0]
            source = make_checkpoint(fields, task)
            ours = load_model(source, task, dtype=torch.float32, attn_implementation=impl).to(device).train()
            theirs = reference_model(source, task, impl if len(family.attn_implementations) > 1 else None)
            theirs = theirs.to(device).train()
            batch = {k: v.to(device) for k, v in make_batch(ours.config, task).items()}
            ids, mask = batch["input_ids"], batch["attention_mask"]
            if task == "seqcls":
                batch["labels"] = torch.arange(ids.shape[0], device=device) % ours.config.num_labels
            else:
                batch["labels"] = ids.masked_fill(mask == 0, -100)
            losses = seeded_backward((ours, theirs), batch)
            pairs = list(zip(ours.parameters(), theirs.parameters(), strict=True))
            grads = [(p.grad, q.grad) for p, q in pairs if p.grad is not None or q.grad is not None]
            one_sided = sum((g is None) != (h is None) for g, h in grads)
            gdiff = max(((g - h).abs().max().item() for g, h in grads if g is not None and h is not None),
                        default=0.0)
            exact = (torch.equal(*losses) and not one_sided
                     and all(torch.equal(g, h) for g, h in grads if g is not None and h is not None))
            result = "exact" if exact else ("close" if not one_sided and gdiff < 1e-4 else "FAIL")
            detail = (f"loss diff {(losses[0] - losses[1]).abs().item():.2e}; grad max diff {gdiff:.2e}; "
                      f"{len(grads)} gradients" + (f", {one_sided} on one side only" if one_sided else ""))
            if not exact:  # is transformers' own backward repeatable here (atomics in a scatter-add)?
                first = [q.grad.clone() for q in theirs.parameters() if q.grad is not None]
                seeded_backward((theirs,), batch)
                again = [q.grad for q in theirs.parameters() if q.grad is not None]
                self_diff = max((a - b).abs().max().item() for a, b in zip(first, again))
                detail += f"; transformers against itself {self_diff:.2e}"
            row(f"train step {case_id} {impl}", result, detail)
        except Exception as exc:
            row(f"train step {case_id}", "FAIL", f"{type(exc).__name__}: {str(exc)[:120]}")


def generation(device: torch.device, match: str) -> None:
    """Each decoder family's first causal LM case: our generate_ids against transformers' generate on a
    left-padded batch (rows of 9, 6 and 3 tokens), 16 new tokens, greedy and sampled from the same seed."""
    import warnings
    from cases import CASES
    from helpers import left_padded, make_checkpoint
    from flodl_hf.auto import load_model
    from flodl_hf.generation.generate import generate_ids
    from flodl_hf.roundtrip.parity import reference_model
    from flodl_hf.core.registry import get_family

    seen: set[str] = set()
    for case_id, task, fields in CASES:
        if task != "causal_lm" or fields["model_type"] in seen or (match and match not in case_id):
            continue
        seen.add(fields["model_type"])
        try:
            source = make_checkpoint(fields, task)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                impls = get_family(fields["model_type"]).attn_implementations
                ours = load_model(source, task, dtype=torch.float32, attn_implementation=impls[0]).to(device).eval()
                theirs = reference_model(source, task, impls[0] if len(impls) > 1 else None).to(device)
            ids, mask = (t.to(device) for t in left_padded(ours.config.vocab_size))
            results = []
            for name, settings in (("greedy", {"do_sample": False}), ("sampled", {"do_sample": True, "top_k": 50})):
                settings = {"max_new_tokens": 16, "pad_token_id": 0, "eos_token_id": 2, **settings}
                with torch.inference_mode(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch.manual_seed(7)
                    reference = theirs.generate(input_ids=ids, attention_mask=mask, **settings)
                    torch.manual_seed(7)
                    mine = generate_ids(ours, ids, mask, **settings)
                same = mine.shape == reference.shape and torch.equal(mine, reference)
                results.append((name, same, "" if same or mine.shape != reference.shape
                                else f" ({int((mine != reference).sum())} ids differ)"))
            row(f"generate {case_id} {impls[0]}", "exact" if all(r[1] for r in results) else "FAIL",
                "; ".join(f"{n} {'equal' if ok else 'differs'}{extra}" for n, ok, extra in results))
        except Exception as exc:
            row(f"generate {case_id}", "FAIL", f"{type(exc).__name__}: {str(exc)[:120]}")


# ---- 4 and 5. two workers ----------------------------------------------------------------------

def _worker(rank: int, port: int, devices: list[str], backend: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), FLODL_HF_BACKEND=backend)
    torch.set_num_threads(1)
    try:
        from torch import nn
        from flodl_hf import ElChe, Trainer
        torch.manual_seed(0)
        x = torch.randn(2048, 32)
        data = [(x[i], x[i].tanh().sum(0, keepdim=True)) for i in range(len(x))]
        model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 1))

        def step(model, batch):
            if rank == 1:
                time.sleep(0.002)  # the slower worker, so the counts must differ
            return nn.functional.mse_loss(model(batch[0]), batch[1])

        t = Trainer(model, step, lambda p: torch.optim.SGD(p, lr=0.01), data, batch_size=16, epochs=2,
                    sync=ElChe(windows="planned", combine="average"), device=devices[rank], verify_sync=True,
                    progress=False, report=False,
                    timeout=60)
        summary = t.fit()
        windows = [r for r in t.history if r.get("event") == "train"]
        plane = "nccl" if t.comm.plane_device.type == "cuda" else "gloo"
        batches = [sum(w["batches"][r] for w in windows) for r in range(2)]
        torch.save({"ok": True, "batches": batches, "windows": len(windows), "plane": plane,
                    "loss": summary["loss"], "device": str(t.device)}, Path(out) / f"r{rank}.pt")
    except BaseException:
        Path(out, f"r{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def two_workers(name: str, devices: list[str], backend: str) -> None:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, port, devices, backend, out)) for r in range(2)]
        for p in procs:
            p.start()
        end = time.monotonic() + 180
        for p in procs:
            p.join(max(0.1, end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = [Path(out, f"r{r}.err").read_text() for r in range(2) if Path(out, f"r{r}.err").exists()]
        if errors or not Path(out, "r0.pt").exists():
            row(name, "FAIL", (errors[0].strip().splitlines()[-1] if errors else "no result within 180 s")[:160])
            return
        res = torch.load(Path(out, "r0.pt"))
    fast, slow = res["batches"]
    row(name, "ok", f"{res['windows']} windows, synced bit-identical each time, averaging over {res['plane']}; "
                    f"batches {fast} / {slow}; final loss {res['loss']:.4f}")


# ---- main --------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU (no CUDA needed): checks the script")
    parser.add_argument("--quick", action="store_true", help="parity: one case per family instead of all")
    parser.add_argument("--match", default="", help="parity: only the cases whose id contains this text")
    parser.add_argument("--layers", type=int, default=12, help="forward ratio: BERT layers (default 12)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", default="parity,forward,train,train-all,generate,elche,mixed",
                        help="comma-separated rows to run (default: all)")
    args = parser.parse_args()
    only = set(args.only.split(","))
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --dry-run runs the same code paths on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    gpus = 0 if args.dry_run else torch.cuda.device_count()
    name = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    print(f"gpu_check on {name}: torch {torch.__version__}, {gpus} GPU(s)", flush=True)
    start = time.monotonic()
    steps = [
        ("parity", lambda: parity(device, args.quick, args.match)),
        ("forward", lambda: forward_ratio(device, args.layers, args.repeats)),
        ("train", lambda: training_step(device)),
        ("train-all", lambda: training_steps(device, args.match)),
        ("generate", lambda: generation(device, args.match)),
        ("elche", lambda: two_workers("El Che over NCCL, 2 GPUs", ["cuda:0", "cuda:1"], "cpu:gloo,cuda:nccl")
         if gpus >= 2 else (two_workers("El Che, 2 CPU workers over gloo (dry run)", ["cpu", "cpu"], "gloo")
                            if args.dry_run else row("El Che over NCCL, 2 GPUs", "skipped",
                                                     f"{gpus} GPU here; NCCL needs one GPU per rank"))),
        ("mixed", lambda: two_workers("mixed cohort GPU + CPU over gloo", ["cuda:0", "cpu"], "cpu:gloo,cuda:nccl")
         if not args.dry_run else two_workers("mixed cohort (dry run: CPU + CPU) over gloo", ["cpu", "cpu"],
                                              "gloo")),
    ]
    for key, fn in steps:
        if key in only:
            try:
                fn()
            except Exception as exc:
                row(key, "FAIL", f"{type(exc).__name__}: {str(exc)[:160]}")
    width = max(len(c) for c, _, _ in ROWS) if ROWS else 10
    print(f"\n| {'check':<{width}} | result | detail |\n|{'-' * (width + 2)}|--------|--------|")
    for check, result, detail in ROWS:
        print(f"| {check:<{width}} | {result:<6} | {detail} |")
    failed = sum(r == "FAIL" for _, r, _ in ROWS)
    print(f"\n{len(ROWS)} rows, {failed} failed, {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
