"""Padding-free batching: which sequences share a forward pass, and how they are padded.

Texts are sorted by length (longest first, ties in input order) and cut into contiguous runs; each run
is one forward pass padded to its longest member. Where the cuts go is chosen to minimise an estimate
of the time the passes take:

    cost(batch) = rows * width * (1 + width / attention_width) + batch_cost

``rows * width`` is the tokens computed, padding included; ``width / attention_width`` adds the
attention matrices, which grow with the width (``attention_width = 2 * hidden + intermediate``: the
width at which attention costs as much as the projections and the feed-forward, 4608 for BERT-base);
``batch_cost`` is the fixed price of one more forward pass, in tokens: every weight is read again and
small matrix products run below the machine's peak. With it, sequences of equal length share a batch
(no padding at all) and a short run of rare lengths joins a neighbour when padding it costs less than
a pass of its own. ``max_tokens`` bounds one pass (memory: a masked-LM pass holds ``max_tokens x
vocab`` logits). The defaults were measured on the SMS workload (``scripts/bench.py --tune``,
docs/benchmarks.md; BERT-base, 2 cores): equal lengths only (``batch_cost=0``) took 1.46x the time of
the best setting, while ``batch_cost`` from 32 to 256 and ``max_tokens`` 1024 or 4096 were all within
a few percent of it; the smaller ``max_tokens`` keeps masked-LM logits at 125 MB a pass.

Optimal cuts are contiguous in the sorted order (swapping two sequences between batches never lowers
both widths), so a dynamic programme over that order finds them exactly.

Exactness: a batch formed here is an ordinary padded batch. Our models are bit-identical to
transformers' on the same batch (tests/test_batching.py runs transformers on exactly these batches);
what differs from evaluating each text alone, or in the pipeline's batches of 32, is the batch shape,
which moves float results by a few ulps (PARITY_NOTES.md, "Batch shape matters").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from flodl_hf.core.errors import InputError

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True)
class BatchPolicy:
    """How texts are grouped into forward passes (see the module docstring for the cost model)."""

    max_tokens: int = 1024           # padded tokens in one pass, at most (a longer text still runs, alone)
    batch_cost: float = 96.0         # fixed cost of one pass, in tokens (measured: scripts/bench.py --tune)
    attention_width: float = 4608.0  # 2 * hidden + intermediate of the model (BERT-base here)
    max_rows: int | None = None      # rows in one pass, at most (tasks' batch_size); None: no limit

    def __post_init__(self) -> None:
        if self.max_rows is not None and self.max_rows < 1:
            raise InputError(f"batch_size={self.max_rows}: must be at least 1 (or None for automatic batches)")
        if self.max_tokens < 1:
            raise InputError(f"max_tokens={self.max_tokens}: must be at least 1")

    @classmethod
    def for_model(cls, model: torch.nn.Module | None, max_rows: int | None = None, **overrides) -> "BatchPolicy":
        """The default policy with the attention width of ``model``'s config (hidden and intermediate size)."""
        config = getattr(model, "config", None)
        hidden = getattr(config, "hidden_size", None) or getattr(config, "dim", None)
        inner = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None)
        if hidden and inner:
            overrides.setdefault("attention_width", float(2 * hidden + inner))
        return cls(max_rows=max_rows, **overrides)


def plan(lengths: Sequence[int], policy: BatchPolicy = BatchPolicy()) -> list[list[int]]:
    """Batches of indices into ``lengths``, longest first, that minimise the policy's estimated cost."""
    n = len(lengths)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    width = np.array([lengths[i] for i in order], dtype=np.float64)  # non-increasing
    per_row = width * (1.0 + width / policy.attention_width)          # cost of one row padded to width[i]
    max_rows = policy.max_rows or n
    best = np.zeros(n + 1)             # best[j]: least cost of the first j sorted sequences
    start = np.zeros(n + 1, dtype=np.int64)
    lo = 0                             # first feasible start of a batch ending at j (non-decreasing in j)
    for j in range(1, n + 1):
        while lo < j - 1 and ((j - lo) * width[lo] > policy.max_tokens or j - lo > max_rows):
            lo += 1
        starts = np.arange(lo, j)
        costs = best[lo:j] + (j - starts) * per_row[lo:j] + policy.batch_cost
        k = int(np.argmin(costs))      # the first minimum: the largest batch among equals
        best[j], start[j] = costs[k], lo + k
    cuts, j = [], n
    while j > 0:
        cuts.append((int(start[j]), j))
        j = int(start[j])
    return [order[a:b] for a, b in reversed(cuts)]


def padded_tokens(lengths: Sequence[int], batches: list[list[int]]) -> int:
    """Tokens the batches compute, padding included."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)


def collate(rows: Sequence[dict[str, list]], pad_values: dict[str, int], side: str = "right",
            keys: Sequence[str] = MODEL_INPUTS) -> dict[str, torch.Tensor]:
    """One padded batch from tokenised rows, as the tokenizer pads (its side and pad values)."""
    width = max(len(r["input_ids"]) for r in rows)
    out = {}
    for key in keys:
        if key not in rows[0]:
            continue
        fill = pad_values[key]
        tensor = torch.full((len(rows), width), fill, dtype=torch.long)
        for j, r in enumerate(rows):
            values = r[key]
            if values:
                target = tensor[j, width - len(values):] if side == "left" else tensor[j, :len(values)]
                target.copy_(torch.as_tensor(values, dtype=torch.long))
        out[key] = tensor
    return out


def pad_values(tokenizer) -> dict[str, int]:
    """The fill of each model input when ``tokenizer`` pads."""
    return {"input_ids": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            "attention_mask": 0, "token_type_ids": tokenizer.settings.pad_token_type_id}


def batches(rows: Sequence[dict[str, list]], tokenizer, policy: BatchPolicy = BatchPolicy(),
            keys: Sequence[str] = MODEL_INPUTS) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """``(indices, padded tensors)`` for each batch the tasks forward, in the order they run."""
    lengths = [len(r["input_ids"]) for r in rows]
    fill, side = pad_values(tokenizer), tokenizer.padding_side
    for indices in plan(lengths, policy):
        yield indices, collate([rows[i] for i in indices], fill, side, keys)
