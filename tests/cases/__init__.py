"""The parity table: (family config variant x head) cases, collected from one module per family.

Each family module defines ``CONFIGS: dict[str, dict]`` (variant name -> transformers config
fields, ``model_type`` included) and ``HEADS`` (every task the family declares, its own included:
tests/test_contract.py fails while one is missing); ``VARIANT_HEADS`` may narrow a costly variant
to some heads. A variant at real
width (hidden 768, head_dim 64) and one at an odd head size (head_dim 24) at least.
"""

from __future__ import annotations

import importlib
import pkgutil

CASES: list[tuple[str, str, dict]] = []   # (case id, task, config fields)
for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    module = importlib.import_module(f"{__name__}.{info.name}")
    for variant, fields in module.CONFIGS.items():
        # VARIANT_HEADS narrows a costly variant (a real-width decoder) to some heads; HEADS covers the rest
        for task in getattr(module, "VARIANT_HEADS", {}).get(variant, module.HEADS):
            # transformers' QA head has num_labels outputs and splits them into start/end: 2 only.
            CASES.append((f"{variant}-{task}", task, {**fields, "num_labels": 2} if task == "qa" else fields))
