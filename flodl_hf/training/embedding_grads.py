"""Embedding gradients into a table kept between steps, bit for bit (``Trainer.fit`` on the CPU).

``nn.Embedding``'s backward (aten's ``embedding_dense_backward``) makes a zeroed (vocab, hidden)
table on every step and adds each token's gradient row into its word's row, in token order. On the
CPU a table over glibc's largest mmap threshold (32 MiB) comes fresh from the kernel each time, so
the zeros cost a page fault per 4 KiB: MiniLM's 30,522 x 384 floats (47 MiB) took 16 ms a step
where zeroing a table already in memory takes 1.1 ms; XLM-R's (250,002 x 768) is 768 MiB a step.

Within :func:`reused`, the embeddings of a model add their gradient into the table of the step
before, zeroed in place, with ``index_add_``, which walks the tokens in the same order: the same
sums, ``torch.equal`` to ``nn.Embedding``'s gradient (``tests/test_embedding_grads.py`` checks
it against transformers). A table is taken only when it is no one else's: it is the one this
backward gave last time as the weight's gradient (taken again once ``zero_grad(set_to_none=True)``
let go of it), or, where the weight has a gradient already (gradient accumulation), the one it gave
to be added to it; and no tensor or Python name holds it or a view of it (a gradient sent in flight,
one a caller kept). Otherwise a new table is made, as ``nn.Embedding`` does. The forward is
``F.embedding``'s, unchanged.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable


class _Table:
    """The tables a weight's backward made: the one that became its gradient (``tensor``, kept while it
    is the gradient and after), and the one added to a gradient already there (``extra``: gradient
    accumulation's later micro-batches, which ``nn.Embedding`` also gives as a table of their own)."""

    __slots__ = ("tensor", "extra", "ptr")

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.extra: torch.Tensor | None = None
        self.ptr = 0  # data_ptr of the table the last backward gave as the weight's new gradient

    def keep(self, weight: torch.Tensor) -> None:
        """After the gradient landed on ``weight`` (post-accumulate hook): keep it if it is that table."""
        grad = weight.grad
        if grad is not None and self.ptr and grad.data_ptr() == self.ptr and grad.shape == weight.shape:
            self.tensor = grad
        self.ptr = 0

    def take(self, weight: torch.Tensor) -> torch.Tensor:
        """A zeroed table for ``weight``'s gradient: a kept one if no one else holds it, else a new one."""
        adding = weight.grad is not None  # then the table is added to the gradient, not stolen as it
        if adding:
            table, self.extra = self.extra, None
        else:
            table, self.tensor = self.tensor, None
        if (table is not None and sys.getrefcount(table) == 2  # this name and the call's argument
                and torch._C._storage_Use_Count(table.untyped_storage()._cdata) == 2):  # no view, no alias
            table.zero_()
        else:
            table = torch.zeros_like(weight, memory_format=torch.contiguous_format)
        if adding:
            self.extra = table  # autograd reads it and lets it go; kept for the next micro-batch
        else:
            self.ptr = table.data_ptr()
        return table

    def __deepcopy__(self, memo: dict) -> "_Table":  # a copied model starts without one
        return _Table()

    def __getstate__(self) -> dict:  # a pickled model carries no table
        return {}

    def __setstate__(self, state: dict) -> None:
        self.tensor, self.extra, self.ptr = None, None, 0


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None,
                table: _Table) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx, ctx.table = weight, padding_idx, table
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        out = ctx.table.take(weight)
        flat = ids.reshape(-1)
        out.index_add_(0, flat, grad.reshape(flat.numel(), weight.shape[1]))
        if ctx.padding_idx is not None:
            out[ctx.padding_idx] = 0  # embedding_dense_backward skips the padding row's tokens
        return None, out, None, None


class _ReusingEmbedding(nn.Embedding):
    """``nn.Embedding`` whose weight gradient goes into the last step's table (set by :func:`reused`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        table = self.__dict__.get("_flodl_table")
        if table is None or not (torch.is_grad_enabled() and self.weight.requires_grad):
            return super().forward(input)
        return _Lookup.apply(input, self.weight, self.padding_idx, table)


def _eligible(module: nn.Module) -> bool:
    """Plain ``nn.Embedding`` (not a subclass with its own forward), dense gradients, nothing that
    changes the weight or scales its gradient, a float32 or float64 weight on the CPU."""
    w = getattr(module, "weight", None)
    return (type(module) is nn.Embedding and isinstance(w, torch.Tensor) and w.requires_grad and w.is_leaf
            and not module.sparse and module.max_norm is None and not module.scale_grad_by_freq
            and w.device.type == "cpu" and w.dtype in (torch.float32, torch.float64) and w.dim() == 2
            and w.is_contiguous())


@contextlib.contextmanager
def reused(model: nn.Module, enabled: bool = True) -> Iterator[list[nn.Module]]:
    """Within it, ``model``'s plain CPU embeddings keep their gradient table between steps (see the
    module's docstring); yields those modules. They are ``nn.Embedding`` again afterwards."""
    modules = [m for m in model.modules() if _eligible(m)] if enabled else []
    hooks = []
    try:
        for m in modules:
            table = _Table()
            m.__class__ = _ReusingEmbedding
            m.__dict__["_flodl_table"] = table
            hooks.append(m.weight.register_post_accumulate_grad_hook(table.keep))
        yield modules
    finally:
        for h in hooks:
            h.remove()
        for m in modules:
            m.__dict__.pop("_flodl_table", None)
            if type(m) is _ReusingEmbedding:
                m.__class__ = nn.Embedding
