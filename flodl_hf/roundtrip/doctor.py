"""``flodl-hf doctor``: is this machine exact?

Exactness here means the same ops on the same shapes as transformers, on the machine at hand
(docs/design.md). The machine matters: which BLAS kernel computes a matrix product is chosen by
shape, and the choice differs between CPUs. So the doctor reports what this machine is, proves the
shape-changing shortcut on it (``flodl_hf.core.layers.gather_rows``), and runs a short parity self-test
against transformers on a checkpoint it generates, at BERT-base width.
"""

from __future__ import annotations

import platform
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

# The shortcut's shape classes the doctor proves: a BERT-base LM decoder (768 -> 30522) on batches of
# 64 and 192 tokens, gathering 1-8 and 9-16 masked tokens.
PROOF_FULL_ROWS = (64, 192)
PROOF_GATHERED = (8, 16)
SELF_TEST_FIELDS = dict(model_type="bert", hidden_size=768, num_hidden_layers=2, num_attention_heads=12,
                        intermediate_size=3072, vocab_size=2048, max_position_embeddings=64)


@dataclass
class Report:
    machine: dict[str, str] = field(default_factory=dict)
    proofs: list[dict] = field(default_factory=list)        # full_rows, gathered_rows, equal
    parity: list[dict] = field(default_factory=list)        # task, attn, exact, max_abs_diff
    seconds: float = 0.0

    @property
    def exact(self) -> bool:
        return bool(self.parity) and all(p["exact"] for p in self.parity)

    def format(self) -> str:
        lines = ["flodl-hf doctor", ""]
        lines += [f"  {k:12} {v}" for k, v in self.machine.items()]
        lines += ["", "shortcut: an LM head on the masked tokens only (768 -> 30522), proven on this machine",
                  "  full rows  gathered rows  verdict"]
        for p in self.proofs:
            verdict = "equal: the shortcut is taken" if p["equal"] else "differs: the full head runs"
            lines.append(f"  {p['full_rows']:9}  {p['gathered_rows']:13}  {verdict}")
        lines += ["", "parity self-test: a generated BERT (hidden 768, 12 x 64 heads, 2 layers) against transformers"]
        for p in self.parity:
            lines.append(f"  {p['task']:7} {p['attn']:6} max abs diff {p['max_abs_diff']:.3g}  "
                         f"{'EXACT' if p['exact'] else 'NOT EXACT'}")
        lines += ["", f"{'exact on this machine' if self.exact else 'NOT exact on this machine'} "
                      f"({self.seconds:.1f} s)"]
        return "\n".join(lines)


def machine() -> dict[str, str]:
    """CPU model, vector ISA torch dispatches to, BLAS and its version, thread count, library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
        found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    mkl = re.search(r"(Intel\(R\) [^\n]*Math Kernel Library[^\n]*)", config)
    try:
        isa = torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # older torch
        isa = "unknown"
    import transformers
    return {"cpu": f"{cpu} ({platform.machine()})", "isa": isa,
            "blas": (blas.group(1) if blas else "unknown") + (f" ({mkl.group(1).strip()})" if mkl else ""),
            "threads": str(torch.get_num_threads()),
            "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                        f"python {platform.python_version()}",
            "tested range": _range_line({"torch": torch.__version__, "transformers": transformers.__version__})}


def _range_line(installed: dict[str, str]) -> str:
    """'torch 2.5.1 to 2.14.1, transformers 5.18.0 to 5.25.0: both inside', or which one lies outside."""
    from flodl_hf.core.version import TESTED_RANGE, tested
    span = ", ".join(f"{name} {low} to {high}" for name, (low, high) in TESTED_RANGE.items())
    outside = [f"{name} {version}" for name, version in installed.items() if not tested(name, version)]
    return f"{span}: " + (f"OUTSIDE ({', '.join(outside)}: untested here)" if outside else "both inside")


def prove_shortcuts(full_rows=PROOF_FULL_ROWS, gathered=PROOF_GATHERED, seed: int = 0) -> list[dict]:
    """The shortcut's verdict for each (full rows, gathered rows) class, proven here as the tasks prove it."""
    from flodl_hf.core.layers import PROVE_AT_SIGHTING, RowProofs, gather_rows
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(30522, 768, generator=gen) * 0.02
    bias = torch.randn(30522, generator=gen) * 0.02
    module = torch.nn.Linear(768, 30522, device="meta")  # only its shapes key the class
    run = lambda x: F.linear(x, weight, bias)  # noqa: E731
    out, proofs = [], RowProofs()
    with torch.inference_mode():
        for rows in full_rows:
            hidden = torch.randn(rows, 768, generator=gen)
            for m in gathered:
                index = torch.arange(m)
                for _ in range(PROVE_AT_SIGHTING):  # seen, then proven
                    gather_rows(run, module, hidden, index, lambda: run(hidden), proofs=proofs)
                verdict = [v for k, v in proofs.verdicts.items() if k[2] == rows and k[3] == m]
                out.append({"full_rows": rows, "gathered_rows": m, "equal": bool(verdict and verdict[0])})
    return out


def parity_self_test(work: Path | None = None) -> list[dict]:
    """Generate a BERT-base-width checkpoint with transformers; compare our models with transformers'
    on sdpa and eager for the base and masked-LM heads (torch.equal on every output field)."""
    from flodl_hf.roundtrip.parity import check_parity
    from flodl_hf.roundtrip.matrix import generate_checkpoint
    results = []
    with tempfile.TemporaryDirectory(prefix="flodl-hf-doctor-", dir=work) as tmp:
        source = generate_checkpoint(dict(SELF_TEST_FIELDS), "mlm", Path(tmp) / "bert-mlm")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for task in ("base", "mlm"):
                for attn in ("sdpa", "eager"):
                    r = check_parity(source, task, attn)
                    results.append({"task": task, "attn": attn, "exact": r.exact,
                                    "max_abs_diff": max(r.diffs.values()) if r.diffs else float("nan")})
    return results


def doctor(parity: bool = True, proofs: bool = True) -> Report:
    start = time.perf_counter()
    report = Report(machine=machine())
    if proofs:
        report.proofs = prove_shortcuts()
    if parity:
        report.parity = parity_self_test()
    report.seconds = time.perf_counter() - start
    return report
