"""Triton implementations of :func:`specattn.ops.gather_rows`,
:func:`specattn.ops.scatter_rows`, :func:`specattn.ops.extend_cache_locs` and
:func:`specattn.ops.commit_accepted` (registered as ``impl="triton"`` there; the launchers
have the references' positional signatures): up to ``MAX_TENSORS`` row copies indexed by
one ``rows`` vector, in one launch; a round's slots, and its commit, in one launch each.

``_rows_kernel``, grid ``(bs,)``: program ``i`` reads ``r = rows[i]`` once, then for each
tensor pair ``t`` (unrolled: the count and every row width ``W_t``, in elements, are
constexprs) copies ``W_t`` elements from source row ``r`` to destination row ``i``
(gather) or from source row ``i`` to destination row ``r`` (scatter), ``BLOCK``-wide
vectors at a time, each tensor in its own dtype.  Rows are contiguous ``W_t``-element runs
(the wrapper's contract: every tensor contiguous), so a copy is ``ptr + row * W_t +
column``.  A row index repeated in a scatter has its writes race (the wrapper documents
it); a gather may repeat rows freely.

``_extend_locs_kernel``, grid ``(bs,)``: program ``i`` reads ``r = rows[i]`` and ``P =
prefix_lens[r]``, then writes ``P`` (int32), the ``n`` positions ``P + j``, their slots
``req_to_token[r, P + j]`` (int64) and, with roots, the row's input ids ``[roots[r],
fill_id, ..]``.  ``_commit_kernel``, grid ``(bs,)``: program ``i`` copies its ``n`` path
tokens into the emitted block (int64) after the count ``a + 1``, and writes the row's new
root ``path[i, a]`` and prefix length ``P + a + 1`` (``a = accept_length[i]``).

No host sync and no allocation but the gathers' outputs, so a call is CUDA-graph
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

from ._util import gdc_enter, on_tensor_device, pdl_kwargs, require_device

__all__ = ["gather_rows", "scatter_rows", "extend_cache_locs", "commit_accepted", "MAX_TENSORS"]

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
                 NT: tl.constexpr, SCATTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
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
                        num_warps=4 if block >= 512 else 1, **pdl_kwargs(rows))


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


@triton.jit
def _extend_locs_kernel(rows_ptr, prefix_ptr, rtt_ptr, ld_rtt, roots_ptr, fill_id,
                        seq_out, pos_out, loc_out, ids_out, n,
                        HAS_ROOTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + i).to(tl.int64)
    p = tl.load(prefix_ptr + r).to(tl.int64)
    tl.store(seq_out + i, p.to(tl.int32))
    if HAS_ROOTS:
        root = tl.load(roots_ptr + r).to(tl.int64)
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < n
        pos = p + j
        tl.store(pos_out + i * n + j, pos, mask=m)
        loc = tl.load(rtt_ptr + r * ld_rtt + pos, mask=m, other=0)
        tl.store(loc_out + i * n + j, loc.to(tl.int64), mask=m)
        if HAS_ROOTS:
            ids = tl.where(j == 0, root, fill_id)   # (an int argument: 1 may arrive as a constexpr)
            tl.store(ids_out + i * n + j, ids, mask=m)


@on_tensor_device
def extend_cache_locs(rows: torch.Tensor, prefix_lens: torch.Tensor, req_to_token: torch.Tensor, n: int,
                      roots, fill_id: int):
    """Triton :func:`specattn.ops.extend_cache_locs` (one launch); returns ``(seq_lens,
    positions, out_cache_loc, input_ids or None)``."""
    require_device(rows, "extend_cache_locs", _INTERPRET)
    bs, dev = rows.shape[0], rows.device
    seq = torch.empty(bs, dtype=torch.int32, device=dev)
    pos = torch.empty(bs * n, dtype=torch.int64, device=dev)
    loc = torch.empty(bs * n, dtype=torch.int64, device=dev)
    ids = torch.empty((bs, n), dtype=torch.int64, device=dev) if roots is not None else None
    if bs:
        block = min(MAX_BLOCK, triton.next_power_of_2(n))
        _extend_locs_kernel[(bs,)](rows, prefix_lens, req_to_token, req_to_token.stride(0),
                                   roots if roots is not None else rows, int(fill_id),
                                   seq, pos, loc, ids if ids is not None else loc, n,
                                   HAS_ROOTS=roots is not None, BLOCK=block, num_warps=1, **pdl_kwargs(rows))
    return seq, pos, loc, ids


@triton.jit
def _commit_kernel(rows_ptr, prefix_ptr, roots_ptr, seq_ptr, path_ptr, acc_ptr, emit_ptr, ld_emit, n,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + i).to(tl.int64)
    a = tl.load(acc_ptr + i).to(tl.int64)
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < n
        t = tl.load(path_ptr + i * n + j, mask=m, other=0)
        tl.store(emit_ptr + i * ld_emit + 1 + j, t.to(tl.int64), mask=m)
    tl.store(emit_ptr + i * ld_emit, a + 1)
    tl.store(roots_ptr + r, tl.load(path_ptr + i * n + a).to(roots_ptr.dtype.element_ty))
    p = tl.load(seq_ptr + i).to(tl.int64)
    tl.store(prefix_ptr + r, (p + a + 1).to(prefix_ptr.dtype.element_ty))


@on_tensor_device
def commit_accepted(rows: torch.Tensor, prefix_lens: torch.Tensor, roots: torch.Tensor, seq_lens: torch.Tensor,
                    path: torch.Tensor, accept_length: torch.Tensor, emitted: torch.Tensor) -> None:
    """Triton :func:`specattn.ops.commit_accepted` (one launch, in place)."""
    require_device(rows, "commit_accepted", _INTERPRET)
    bs, n = path.shape
    if bs:
        block = min(MAX_BLOCK, triton.next_power_of_2(n))
        _commit_kernel[(bs,)](rows, prefix_lens, roots, seq_lens, path, accept_length, emitted,
                              emitted.stride(0), n, BLOCK=block, num_warps=1, **pdl_kwargs(rows))
