"""Test fixtures: checkpoints generated locally with transformers (random weights, every
parameter perturbed so LayerNorms and biases are not trivial), saved with save_pretrained."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from flodl_hf.parity import quiet_transformers
from flodl_hf.matrix import generate_checkpoint

CACHE = Path(os.environ.get("FLODL_HF_TEST_CACHE", Path(__file__).resolve().parent.parent / ".test-cache"))


def make_checkpoint(config_fields: dict, task: str, seed: int = 0, root: Path | None = None,
                    perturb: float = 0.05) -> Path:
    """flodl_hf.matrix.generate_checkpoint, cached by (config, task, seed, transformers version)."""
    transformers = quiet_transformers()
    key = hashlib.sha1(json.dumps([config_fields, task, seed, perturb, transformers.__version__],
                                  sort_keys=True).encode()).hexdigest()[:16]
    out = Path(root or CACHE) / f"{config_fields['model_type']}-{task}-{key}"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    generate_checkpoint(config_fields, task, tmp, seed=seed, perturb=perturb)
    tmp.rename(out)
    return out


@pytest.fixture
def one_thread():
    """Tiny models run faster on one thread, and far faster on a busy machine (no spin-waiting).
    A module takes it for all its tests with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
