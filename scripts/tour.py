"""The README's main job: a short offline tour of flodl-hf on real and generated checkpoints.

    bash scripts/setup.sh && .venv/bin/python scripts/tour.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def parity_tour(tmp: Path) -> None:
    from helpers import make_checkpoint
    from flodl_hf.cli import main as cli

    step("Parity: a BERT-base-width masked LM generated with transformers, ours vs AutoModelForMaskedLM")
    src = make_checkpoint(dict(model_type="bert", hidden_size=768, num_attention_heads=12, num_hidden_layers=2,
                               intermediate_size=3072, vocab_size=1024, max_position_embeddings=64), "mlm", root=tmp)
    print(f"$ flodl-hf parity {src.name} --attn all")
    if cli(["parity", str(src), "--attn", "all"]) != 0:
        raise SystemExit("parity failed")


def main() -> int:
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        parity_tour(Path(tmp))
    print(f"\nTour finished in {time.time() - start:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
