"""Triton implementation of :func:`specattn.ops.move_kv_cache` (registered as ``impl="triton"``
by :mod:`specattn.ops.kv_move`).

Semantics: see :func:`specattn.ops.move_kv_cache` -- for every buffer and every ``i``,
afterwards ``buf[tgt_loc[i]]`` holds what ``buf[src_loc[i]]`` held before the call.  Rows are
moved as raw bytes (any dtype), rows with ``tgt == src`` or a slot outside
``[0, num_slots)`` are skipped.  The wrapper has validated the inputs; this module assumes
contiguous buffers with one slot count on one device and 1-D int32/int64 indices of one
dtype.

Two algorithms, like csrc/kv_move.cu:

- **direct** (``group_size`` given, the caller's promise that a slot read by one pair is
  written by another pair only within the same consecutive group of ``group_size`` pairs):
  ONE launch for all buffers.  Grid ``(row-tiles x column-tiles, buffers)``; a program owns
  whole groups (``BLOCK_R // group_size`` of them) for one column tile of one buffer: it
  loads the ``[rows, BLOCK_C]`` byte tile of its sources into registers, waits at a block
  barrier (``tl.debug_barrier``), then stores the tile to the targets.  Every read of a
  group's rows precedes every write of them, and no other program touches them.
- **staged** (``group_size=None``, always safe): two launches, gather every moved row of
  every buffer into a temporary, then scatter it to the targets (stream order separates
  reads from writes).  The temporary is ``n * sum(row bytes)`` bytes, taken from PyTorch's
  caching allocator on the current stream (inside a CUDA graph: the graph's pool); buffers
  are processed in chunks of at most :data:`MAX_STAGING_BYTES` of staging (one chunk alone
  may exceed it when a single buffer needs more).

Buffers are separate allocations (one tensor per layer).  Their base addresses, row sizes
and staging offsets travel in a device int64 table ``[3, num_buffers]`` that the kernel
reads and turns into pointers in-kernel (``int -> tl.pointer_type(tl.uint8)``), so one
launch covers any number of buffers.  The table is built once per distinct buffer list and
cached (keyed by the device, the buffers' ``data_ptr``s and row sizes): repeated calls
make no host-to-device copy.  Tables are never freed (24 bytes per buffer, one per distinct
buffer list), so a table a captured CUDA graph reads stays valid for the graph's life.  A
CUDA graph cannot capture building it, so call the op once eagerly for a buffer list before
capturing it (every warm-up does); a missing table during capture raises RuntimeError.

Nothing depends on ``n`` at compile time: ``n``, ``num_slots`` and the rows per program
are ``do_not_specialize`` runtime arguments; the constexprs (tile shape, vector width, mode)
depend only on the buffers' row sizes and ``group_size``.

Accesses: tiles are bytes (``uint8`` pointers) with alignment hints of the widest vector
width ``VEC`` in {16, 8, 4, 2, 1} that divides every row size and base address, so the
compiler emits 16-byte vector loads / stores for KV rows.

CPU: under ``TRITON_INTERPRET=1`` the same kernels run in Triton's interpreter on CPU
tensors (the interpreter dereferences the raw addresses of the table, which are the CPU
tensors' own memory; with CUDA tensors in interpreter mode they would not be, so the
interpreter path is for CPU tensors only).
"""
from __future__ import annotations

from math import gcd
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ._util import gdc_enter, on_tensor_device, pdl_kwargs

__all__ = ["move_kv_cache", "MAX_STAGING_BYTES"]

MAX_STAGING_BYTES = 64 << 20   # staging per chunk of buffers (staged algorithm)
TILE_BYTES = 16384             # bytes per program (8 warps x 32 threads x 4 x 16 B)
NUM_WARPS = 8
MAX_GROUP = 1024               # larger groups: staged algorithm

_DIRECT, _GATHER, _SCATTER = 0, 1, 2


@triton.jit(do_not_specialize=["n", "num_slots", "rows_per_prog", "nb", "b0"])
def _move_rows_kernel(table_ptr, tgt_ptr, src_ptr, stage_ptr, n, num_slots, rows_per_prog,
                      nb, b0, MODE: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr = False):
    """One program: rows ``[r0, r0 + rows_per_prog)`` (whole groups), byte columns
    ``[ct * BLOCK_C, (ct + 1) * BLOCK_C)`` of buffer ``b0 + program_id(1)``.

    table (int64 ``[3, nb]``): base address, row bytes, staging prefix (sum of the row bytes
    of the buffers before it).  MODE: 0 direct (buffer -> buffer), 1 gather (buffer ->
    staging), 2 scatter (staging -> buffer)."""
    gdc_enter(PDL)
    x = tl.program_id(0)
    b = b0 + tl.program_id(1)
    addr = tl.load(table_ptr + b)
    rb = tl.multiple_of(tl.load(table_ptr + nb + b), VEC)  # row bytes
    buf = tl.multiple_of(addr.to(tl.pointer_type(tl.uint8)), VEC)

    n_ct = tl.cdiv(rb, BLOCK_C)
    ct = x % n_ct
    r0 = (x // n_ct).to(tl.int64) * rows_per_prog

    r = tl.arange(0, BLOCK_R)
    i = r0 + r
    rmask = (r < rows_per_prog) & (i < n)
    t = tl.load(tgt_ptr + i, mask=rmask, other=0).to(tl.int64)
    s = tl.load(src_ptr + i, mask=rmask, other=0).to(tl.int64)
    live = rmask & (t != s) & (t >= 0) & (t < num_slots) & (s >= 0) & (s < num_slots)

    c = ct * BLOCK_C + tl.arange(0, BLOCK_C)
    m = live[:, None] & (c[None, :] < rb)
    if MODE == 0:
        src_rows = buf + s * rb
        dst_rows = buf + t * rb
    else:
        prefix = tl.load(table_ptr + 2 * nb + b) - tl.load(table_ptr + 2 * nb + b0)
        stage = tl.multiple_of(stage_ptr + n * prefix, VEC)
        if MODE == 1:
            src_rows = buf + s * rb
            dst_rows = stage + i * rb
        else:
            src_rows = stage + i * rb
            dst_rows = buf + t * rb
    vals = tl.load(src_rows[:, None] + c[None, :], mask=m)
    if MODE == 0:
        # every read of this program's groups before any write of them (other threads of
        # the block may read what this thread is about to write)
        tl.debug_barrier()
    tl.store(dst_rows[:, None] + c[None, :], vals, mask=m)


# ----------------------------------------------------------------------------- host side
_TABLES: Dict[tuple, torch.Tensor] = {}  # never evicted: captured graphs read them


def _table(buffers: Sequence[torch.Tensor], row_bytes: Sequence[int]) -> torch.Tensor:
    """Cached int64 ``[3, nb]`` device table: address, row bytes, staging prefix."""
    dev = buffers[0].device
    key = (str(dev), tuple(b.data_ptr() for b in buffers), tuple(row_bytes))
    tab = _TABLES.get(key)
    if tab is not None:
        return tab
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "move_kv_cache(impl='triton'): the pointer table of these buffers does not exist "
            "yet and cannot be built during CUDA-graph capture; call move_kv_cache once "
            "eagerly with the same buffers before capturing")
    prefix, acc = [], 0
    for rb in row_bytes:
        prefix.append(acc)
        acc += rb
    host = [[b.data_ptr() for b in buffers], list(row_bytes), prefix]
    tab = torch.tensor(host, dtype=torch.int64).to(dev)
    _TABLES[key] = tab
    return tab


def _vec_width(buffers: Sequence[torch.Tensor], row_bytes: Sequence[int]) -> int:
    vec = 16
    for b, rb in zip(buffers, row_bytes):
        while vec > 1 and (rb % vec or b.data_ptr() % vec):
            vec //= 2
    return vec


def _tile(row_bytes: Sequence[int], rows_per_group: int) -> Tuple[int, int]:
    """``(BLOCK_R, BLOCK_C)``: powers of two, ``BLOCK_R >= rows_per_group``,
    ``BLOCK_R * BLOCK_C <= max(TILE_BYTES, BLOCK_R)``.  Column tiles are the largest power
    of two dividing every row size when that is >= 128 bytes (no partial tiles: MLA
    1152-byte rows = 9 x 128), else rows rounded up to a power of two."""
    rmax = max(row_bytes)
    g = 0
    for rb in row_bytes:
        g = gcd(g, rb)
    p2 = g & -g
    full = triton.next_power_of_2(rmax)
    cap = max(1, TILE_BYTES // triton.next_power_of_2(rows_per_group))
    block_c = min(p2 if p2 >= 128 else full, full, cap)
    block_r = max(triton.next_power_of_2(rows_per_group), TILE_BYTES // block_c)
    return block_r, block_c


def _launch(mode, tab, nb, b0, nbufs, tgt, src, stage, n, num_slots, rows_per_group, row_bytes,
            vec):
    block_r, block_c = _tile(row_bytes, rows_per_group)
    rows_per_prog = (block_r // rows_per_group) * rows_per_group
    n_ct = max(triton.cdiv(rb, block_c) for rb in row_bytes)
    grid = (triton.cdiv(n, rows_per_prog) * n_ct, nbufs)
    _move_rows_kernel[grid](tab, tgt, src, stage, n, num_slots, rows_per_prog, nb, b0,
                            MODE=mode, BLOCK_R=block_r, BLOCK_C=block_c, VEC=vec,
                            num_warps=NUM_WARPS, **pdl_kwargs(tab))


@on_tensor_device
def move_kv_cache(buffers: Sequence[torch.Tensor], tgt_loc: torch.Tensor, src_loc: torch.Tensor,
                  group_size: Optional[int] = None) -> None:
    """Move rows ``src_loc -> tgt_loc`` in every buffer (inputs validated by the wrapper).

    ``group_size=None``: staged (two launches per chunk of buffers, any overlap);
    ``1 <= group_size <= MAX_GROUP``: direct, one launch (the caller's promise, see the
    module docstring); larger groups fall back to staged."""
    n = tgt_loc.numel()
    if n == 0:
        return
    bufs: List[torch.Tensor] = []
    rbs: List[int] = []
    for b in buffers:
        rb = (b.numel() // b.shape[0]) * b.element_size() if b.shape[0] else 0
        if rb:
            bufs.append(b)
            rbs.append(rb)
    if not bufs:
        return
    num_slots = bufs[0].shape[0]
    tgt, src = tgt_loc, src_loc
    if tgt.dtype != src.dtype:
        tgt, src = tgt.long(), src.long()
    tgt, src = tgt.contiguous(), src.contiguous()
    tab = _table(bufs, rbs)
    vec = _vec_width(bufs, rbs)
    nb = len(bufs)

    if group_size is not None and 1 <= group_size <= MAX_GROUP:
        _launch(_DIRECT, tab, nb, 0, nb, tgt, src, tgt, n, num_slots, group_size, rbs, vec)
        return

    # staged: chunks of buffers with at most MAX_STAGING_BYTES of staging (>= 1 buffer)
    chunks, start, acc = [], 0, 0
    for k, rb in enumerate(rbs):
        if k > start and acc + n * rb > MAX_STAGING_BYTES:
            chunks.append((start, k))
            start, acc = k, 0
        acc += n * rb
    chunks.append((start, nb))
    biggest = max(n * sum(rbs[a:e]) for a, e in chunks)
    stage = torch.empty(biggest, dtype=torch.uint8, device=bufs[0].device)
    for a, e in chunks:
        sub = rbs[a:e]
        _launch(_GATHER, tab, nb, a, e - a, tgt, src, stage, n, num_slots, 1, sub, vec)
        _launch(_SCATTER, tab, nb, a, e - a, tgt, src, stage, n, num_slots, 1, sub, vec)
