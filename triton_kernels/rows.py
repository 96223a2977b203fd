"""Triton implementations of :func:`specattn.ops.gather_rows` and
:func:`specattn.ops.scatter_rows` (registered as ``impl="triton"`` there; the launchers
have the references' positional signatures): up to ``MAX_TENSORS`` row copies indexed by
one ``rows`` vector, in one launch.

``_rows_kernel``, grid ``(bs,)``: program ``i`` reads ``r = rows[i]`` once, then for each
tensor pair ``t`` (unrolled: the count and every row width ``W_t``, in elements, are
constexprs) copies ``W_t`` elements from source row ``r`` to destination row ``i``
(gather) or from source row ``i`` to destination row ``r`` (scatter), ``BLOCK``-wide
vectors at a time, each tensor in its own dtype.  Rows are contiguous ``W_t``-element runs
(the wrapper's contract: every tensor contiguous), so a copy is ``ptr + row * W_t +
column``.  A row index repeated in a scatter has its writes race (the wrapper documents
it); a gather may repeat rows freely.

No host sync and no allocation but the gather's outputs, so a call is CUDA-graph
capturable.  CPU interpreter (``TRITON_INTERPRET=1``): the same code on CPU tensors (the
tests); without it, CPU tensors raise RuntimeError.
"""
from __future__ import annotations

import math
import os
from typing import List, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ._util import on_tensor_device, require_device

__all__ = ["gather_rows", "scatter_rows", "MAX_TENSORS"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

MAX_TENSORS = 8
MAX_BLOCK = 1024


@triton.jit
def _copy_row(src, dst, src_row, dst_row, W: tl.constexpr, BLOCK: tl.constexpr):
    for c0 in tl.static_range(0, W, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        m = cols < W
        v = tl.load(src + src_row * W + cols, mask=m)
        tl.store(dst + dst_row * W + cols, v, mask=m)


@triton.jit
def _rows_kernel(rows_ptr, s0, d0, s1, d1, s2, d2, s3, d3, s4, d4, s5, d5, s6, d6, s7, d7,
                 W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
                 W4: tl.constexpr, W5: tl.constexpr, W6: tl.constexpr, W7: tl.constexpr,
                 NT: tl.constexpr, SCATTER: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + i).to(tl.int64)
    if SCATTER:
        src_row, dst_row = i, r
    else:
        src_row, dst_row = r, i
    _copy_row(s0, d0, src_row, dst_row, W0, BLOCK)
    if NT > 1:
        _copy_row(s1, d1, src_row, dst_row, W1, BLOCK)
    if NT > 2:
        _copy_row(s2, d2, src_row, dst_row, W2, BLOCK)
    if NT > 3:
        _copy_row(s3, d3, src_row, dst_row, W3, BLOCK)
    if NT > 4:
        _copy_row(s4, d4, src_row, dst_row, W4, BLOCK)
    if NT > 5:
        _copy_row(s5, d5, src_row, dst_row, W5, BLOCK)
    if NT > 6:
        _copy_row(s6, d6, src_row, dst_row, W6, BLOCK)
    if NT > 7:
        _copy_row(s7, d7, src_row, dst_row, W7, BLOCK)


def _launch(rows: torch.Tensor, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], scatter: bool) -> None:
    """``pairs``: ``(source, destination)`` per tensor, both contiguous."""
    bs = rows.shape[0]
    if bs == 0 or not pairs:
        return
    widths = [math.prod(src.shape[1:]) for src, _ in pairs]
    ptrs: List[torch.Tensor] = []
    for src, dst in pairs:
        ptrs += [src, dst]
    pad = MAX_TENSORS - len(pairs)
    ptrs += [rows, rows] * pad
    widths += [1] * pad
    block = min(MAX_BLOCK, triton.next_power_of_2(max(max(widths), 1)))
    _rows_kernel[(bs,)](rows, *ptrs, *widths, NT=len(pairs), SCATTER=scatter, BLOCK=block,
                        num_warps=4 if block >= 512 else 1)


@on_tensor_device
def gather_rows(rows: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Triton :func:`specattn.ops.gather_rows` (one launch)."""
    require_device(rows, "gather_rows", _INTERPRET)
    outs = [torch.empty((rows.shape[0],) + tuple(t.shape[1:]), device=t.device, dtype=t.dtype) for t in tensors]
    _launch(rows, list(zip(tensors, outs)), scatter=False)
    return outs


@on_tensor_device
def scatter_rows(rows: torch.Tensor, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Triton :func:`specattn.ops.scatter_rows` (one launch; ``pairs`` are ``(dst, src)``)."""
    require_device(rows, "scatter_rows", _INTERPRET)
    _launch(rows, [(src, dst) for dst, src in pairs], scatter=True)
