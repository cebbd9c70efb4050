"""Test fixtures: checkpoints generated locally with transformers (random weights, every
parameter perturbed so LayerNorms and biases are not trivial), saved with save_pretrained."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

REFERENCE = {
    "base": "AutoModel",
    "seqcls": "AutoModelForSequenceClassification",
    "tokcls": "AutoModelForTokenClassification",
    "qa": "AutoModelForQuestionAnswering",
    "mlm": "AutoModelForMaskedLM",
    "mc": "AutoModelForMultipleChoice",
}
CACHE = Path(os.environ.get("FLODL_HF_TEST_CACHE", Path(__file__).resolve().parent.parent / ".test-cache"))


def quiet_transformers():
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def hf_config(model_type: str, **fields):
    transformers = quiet_transformers()
    return transformers.AutoConfig.for_model(model_type, **fields)


def make_checkpoint(config_fields: dict, task: str, seed: int = 0, root: Path | None = None,
                    perturb: float = 0.05) -> Path:
    """save_pretrained of transformers' model for ``task``, perturbed; cached by (config, task, seed)."""
    transformers = quiet_transformers()
    key = hashlib.sha1(json.dumps([config_fields, task, seed, perturb, transformers.__version__],
                                  sort_keys=True).encode()).hexdigest()[:16]
    out = Path(root or CACHE) / f"{config_fields['model_type']}-{task}-{key}"
    if (out / "config.json").is_file():
        return out
    fields = dict(config_fields)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, REFERENCE[task]).from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * perturb)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out
