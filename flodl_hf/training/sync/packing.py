"""Parameter tensors in and out of the flat buffers the collectives move, and blockwise passes over them.

The packing computes a worker's weighted change on the way into a buffer and adds the start back on
the way out (:func:`_pack`, :func:`_unpack`); :func:`_pack_carried` rounds a change to bfloat16 with
the remainder carried (error feedback); :func:`blocks` cuts elementwise passes into cache-sized blocks.
"""

from __future__ import annotations

from typing import Sequence

import torch


def _by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _pack(view: torch.Tensor, t: torch.Tensor, weight: float, start: torch.Tensor | None) -> None:
    """Write ``weight * t`` (or ``weight * (t - start)``) into the flat buffer's ``view``.

    The same float ops as the unfused ``(t - start).to(dtype) * weight``: a change is taken in
    ``t``'s own dtype, a weight of 1 multiplies nothing (``x * 1.0`` is ``x``)."""
    src = t.detach().reshape(-1)
    if start is not None and (src.dtype != view.dtype or src.device != view.device):
        t.sub_(start)  # a low-precision change, in its own dtype; the start is added back in _unpack
        start = None
        src = t.detach().reshape(-1)
    if start is not None:
        torch.sub(src, start.reshape(-1), out=view)
    elif src.dtype == view.dtype and src.device == view.device and weight != 1.0:
        torch.mul(src, weight, out=view)
        return
    else:
        view.copy_(src)
    if weight != 1.0:
        view.mul_(weight)


BLOCK = 1 << 16  # elements per block of elementwise passes over parameters: 256 KiB of float32


def blocks(*tensors: torch.Tensor):
    """Flat views of ``tensors`` (as many elements each), block by block of :data:`BLOCK` where all
    are contiguous and on the CPU, else whole: a few elementwise passes over a block stay in cache,
    where whole tensors go to memory once a pass. On MiniLM-sized tensors the look-ahead took 38 ms
    in blocks and 82 whole, and the bfloat16 change the lead sends, taken and landed, 106 and 167;
    elementwise, the same bits."""
    if all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
        return zip(*(t.view(-1).split(BLOCK) for t in tensors))
    return [tensors]


def _pack_carried(view: torch.Tensor, t: torch.Tensor, weight: float, start: torch.Tensor | None,
                  residual: torch.Tensor) -> None:
    """Write ``weight * (t - start)`` plus what earlier windows left in ``residual`` into the
    low-precision ``view``, and keep in ``residual`` (float32) what the rounding leaves out.

    The change is taken in ``t``'s dtype (``start=None``: ``t`` is the change), widened, weighted
    and added to the carried remainder in float32; ``residual - view`` is then exact (a float32
    minus its own rounding to bfloat16 fits float32), so the sends add up to the changes over the
    run, less the last remainder."""
    src = t.detach().reshape(-1)
    tensors = (src, residual.view(-1), view) + (() if start is None else (start.reshape(-1),))
    for src, carried, out, *base in blocks(*tensors):
        change = (src if not base else torch.sub(src, base[0])).to(torch.float32)
        if weight != 1.0:  # (a change given as ``t`` itself is the caller's: weighed in a copy)
            change = change * weight if change is src else change.mul_(weight)
        carried.add_(change)
        out.copy_(carried)
        carried.sub_(out)


def _take_change(view: torch.Tensor, t: torch.Tensor, start: torch.Tensor) -> None:
    """``t = start + view`` (a low-precision change, widened: one rounding into ``t``'s dtype, as
    :func:`_unpack` does), then ``start = t``: the next shared point."""
    if t.is_contiguous() and start.is_contiguous() and view.device == t.device:
        for v, x, s in blocks(view.view(-1), t.view(-1), start.view(-1)):
            x.copy_(v)
            x.add_(s)
            s.copy_(x)
        return
    _unpack(view, t, start)
    start.copy_(t)


def _unpack(view: torch.Tensor, t: torch.Tensor, start: torch.Tensor | None) -> None:
    """Load the reduced ``view`` into ``t``, adding ``start`` back for a sum of changes."""
    view = view.view(t.shape)
    if start is None:
        t.copy_(view)
    elif view.dtype == t.dtype and view.device == t.device:
        torch.add(view, start, out=t)
    else:
        t.copy_(view)
        t.add_(start)


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view(t.shape))
            offset += n
