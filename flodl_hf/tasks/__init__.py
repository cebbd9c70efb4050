"""Tasks in one line: ``fill_mask``, ``classify``, ``zero_shot``, ``tag``, ``answer``, ``embed`` (and ``rank``).

Each gives what transformers' pipeline gives for the same checkpoint and inputs (for ``answer``:
transformers 4's question-answering pipeline, which transformers 5 dropped; for ``embed``:
sentence-transformers' pooling), with our native models underneath. Post-processing copies the
pipelines' own numpy/torch operations, in their order, so scores are equal, not merely close.

Beyond the pipelines: models and tokenizers are loaded once per process (keyed by source), many
texts are batched automatically without padding (sorted by length, equal lengths together:
``flodl_hf.tasks.batching``), and texts longer than the model's maximum are truncated with a warning
instead of failing inside the model. ``precision="exact"`` (the default) is float32, bit-identical
to transformers on every batch; ``"bf16"`` and ``"int8"`` are faster and change scores (opt-in,
measured in docs/benchmarks.md).

One module per task (``fill_mask``, ``classify``, ``zero_shot``, ``tag``, ``answer``, ``embed`` with
``rank``, ELECTRA's ``detect_replaced``, and the text-generation pipeline ``generate``) over a shared runtime
(``runtime``: loading, batching, precisions, the forward loop). The commands are in ``flodl_hf.commands.tasks``.
"""

from __future__ import annotations

from flodl_hf.tasks.answer import answer
from flodl_hf.tasks.classify import classify
from flodl_hf.tasks.detect_replaced import detect_replaced
from flodl_hf.tasks.embed import embed, rank
from flodl_hf.tasks.fill_mask import DEFAULT_FILL_MASK_MODEL, MASK_SPELLINGS, fill_mask
from flodl_hf.tasks.generate import generate
from flodl_hf.tasks.runtime import (BATCH_SIZE, PRECISIONS, BatchSize, Loaded, Source, clear_cache, load,
                                    max_input_length, quantize_int8)
from flodl_hf.tasks.tag import AGGREGATIONS, tag
from flodl_hf.tasks.zero_shot import zero_shot

__all__ = [
    "AGGREGATIONS", "BATCH_SIZE", "DEFAULT_FILL_MASK_MODEL", "MASK_SPELLINGS", "PRECISIONS", "BatchSize", "Loaded",
    "Source", "answer", "classify", "clear_cache", "detect_replaced", "embed", "fill_mask", "generate", "load",
    "max_input_length", "quantize_int8", "rank", "tag", "zero_shot",
]

