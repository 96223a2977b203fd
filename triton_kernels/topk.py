"""Triton implementation of :func:`specattn.ops.topk_log_probs` (registered as
``impl="triton"`` there; :func:`topk_log_probs` has exactly the reference's signature):
the ``k`` largest log-probabilities of each row of a logits matrix, and their vocabulary
indices, in two launches.

Order key.  Every logit ``x`` at column ``j`` becomes one int64 key::

    b   = bits of float32(x), with -0.0 read as +0.0            (int32)
    o   = b if b >= 0 else b ^ 0x7FFFFFFF                       (int32, ordered as x)
    key = (o << 32) | (0x7FFFFFFF - j)                          (int64)

so ``key_a > key_b`` exactly when ``x_a > x_b``, or ``x_a == x_b`` and ``j_a < j_b``: a
single integer max picks the largest logit with the LOWEST index among equal ones, keys are
distinct within a row, and the key decodes back to ``x`` (bit for bit) and ``j``.  -inf
keys rank below every finite one and above every padding key; NaNs rank by their bits
(unspecified, but every loop stays bounded since all comparisons are on integers).

- ``_chunk_kernel``, grid ``(N, C)``: program ``(i, c)`` scans columns
  ``[c * CHUNK, (c + 1) * CHUNK)`` of row ``i`` in ``BLOCK``-wide tiles (``CHUNK = TILES *
  BLOCK``).  Per tile it updates the running max ``m`` and ``s = sum(exp(x - m))`` (online
  logsumexp in float32, with torch's rule for infinite maxima: the shift is 0 when ``m`` is
  +-inf), then merges the tile's keys into the chunk's ``k`` candidates: while the tile's
  largest remaining key beats the smallest candidate, that candidate is replaced and the
  key removed from the tile (at most ``k`` rounds of one tile-wide max each, fewer on later
  tiles).  Writes the ``k`` candidate keys (unsorted) to ``ws_key [N, C, k]`` int64 and
  ``(m, s)`` to ``ws_m / ws_s [N, C]`` float32.  Unused candidate slots (a chunk narrower
  than ``k``) hold distinct sentinel keys below every real key.
- ``_merge_kernel``, grid ``(N,)``: loads the row's ``C * k`` keys and ``C`` pairs
  ``(m, s)``; ``lse = log(sum_c s_c * exp(m_c - M')) + M'`` with ``M = max_c m_c`` and
  ``M' = M`` if finite else 0 (torch.logsumexp's rule: a +inf logit gives ``lse = +inf``,
  a row of -inf ``lse = -inf``); then ``k`` rounds of max over the keys give the output in
  descending order, decoded to ``values = x - lse`` (float32) and ``indices`` (int64).

Shapes (:func:`chunk_config`, from ``V`` only): ``BLOCK = min(2048, next_pow2(V))`` (at
least 16), ``TILES = cdiv(cdiv(V, BLOCK), MAX_CHUNKS)`` so that ``C = cdiv(V, TILES * BLOCK)
<= MAX_CHUNKS = 64``; at ``V = 49152``: ``BLOCK = CHUNK = 2048``, ``C = 24``; at ``V =
262144``: ``TILES = 2``, ``C = 64``.  The constexprs are ``BLOCK`` and ``KP = next_pow2(k)``
(kernel 1), ``CP = next_pow2(C)`` and ``KP`` (kernel 2); ``k``, ``C`` and ``TILES`` are
runtime arguments, so a vocabulary compiles a handful of variants (per input dtype).

Outputs and the workspace are allocated with ``torch.empty`` from the shapes; there is no
host sync, so a call can be captured in a CUDA graph (after one eager call per variant,
which compiles it).  The launchers trust the wrapper's validation (2-D float logits with a
unit last-dim stride, ``1 <= k <= min(V, 16)``, ``V <= 2^30``, so a column's low key bits
``2^31 - 1 - j`` exceed every sentinel's).

CPU interpreter (``TRITON_INTERPRET=1``): the same code runs on CPU tensors (the tests);
without it, CPU tensors raise RuntimeError.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._util import gdc_enter, on_tensor_device, pdl_kwargs, require_device

__all__ = ["topk_log_probs", "merge_topk_parts", "chunk_config", "order_keys", "lse_shift", "MAX_K",
           "MAX_CHUNKS", "MAX_BLOCK", "MAX_MERGE_KEYS", "KEY_MIN", "KEY_MAX"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

MAX_K = 16
MAX_CHUNKS = 64   # C <= 64 programs per row in kernel 1 (and C * k <= 1024 keys in kernel 2)
MAX_BLOCK = 2048  # columns per tile
MAX_MERGE_KEYS = 8192  # next_pow2(C) * next_pow2(k) keys that one merge program loads

KEY_MIN = tl.constexpr(-(2 ** 63))     # padding: below every real key
KEY_MAX = tl.constexpr(2 ** 63 - 1)    # padding for a min: above every real key


def chunk_config(V: int) -> Tuple[int, int, int]:
    """``(BLOCK, TILES, C)`` for rows of ``V`` logits: tiles of ``BLOCK`` columns, chunks of
    ``TILES`` tiles (``CHUNK = TILES * BLOCK`` columns per program of kernel 1), ``C =
    cdiv(V, CHUNK) <= MAX_CHUNKS`` chunks per row."""
    block = max(16, min(MAX_BLOCK, triton.next_power_of_2(max(int(V), 1))))
    tiles = max(1, triton.cdiv(triton.cdiv(V, block), MAX_CHUNKS))
    return block, tiles, triton.cdiv(V, block * tiles)


@triton.jit
def order_keys(x, cols, mask):
    """int64 order keys of float32 ``x`` at columns ``cols`` (padding: ``KEY_MIN``); the order
    :func:`specattn.ops.topk.order_keys` defines: by value, then the lower column."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0
    b = x.to(tl.int32, bitcast=True)
    o = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    key = (o.to(tl.int64) << 32) | (cols ^ 0x7FFFFFFF).to(tl.int64)  # 0x7FFFFFFF - cols
    return tl.where(mask, key, KEY_MIN)


@triton.jit
def lse_shift(m):
    """torch.logsumexp's shift: ``m`` where finite, else 0."""
    return tl.where(tl.abs(m) == float("inf"), 0.0, m)


@triton.jit
def _rescale(s, m, shift):
    """``s * exp(m - shift)``: 0 for an all -inf part (``m = -inf``, ``s = 0``; ``shift`` is
    always finite), +inf for a part holding +inf (``m = +inf``, ``s = +inf``)."""
    return s * tl.exp(m - shift)


@triton.jit
def _chunk_kernel(x_ptr, stride_row, V, K, C, TILES, ws_key_ptr, ws_m_ptr, ws_s_ptr,
                  BLOCK: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * stride_row
    lane = tl.arange(0, BLOCK)
    kk = tl.arange(0, KP)
    # k distinct sentinels below every real key; slots >= k never take part
    cand = tl.where(kk < K, kk.to(tl.int64) + KEY_MIN, KEY_MAX)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for t in range(TILES):
        cols = (c * TILES + t) * BLOCK + lane
        mask = cols < V
        x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        # online logsumexp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = lse_shift(m_new)
        s = _rescale(s, m, shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
        # merge the tile into the candidates: replace the smallest while the tile beats it
        key = order_keys(x, cols, mask)
        top = tl.max(key, axis=0)
        worst = tl.min(cand, axis=0)
        while top > worst:
            cand = tl.where(cand == worst, top, cand)
            key = tl.where(key == top, KEY_MIN, key)
            top = tl.max(key, axis=0)
            worst = tl.min(cand, axis=0)
    part = row.to(tl.int64) * C + c
    tl.store(ws_key_ptr + part * K + kk, cand, mask=kk < K)
    tl.store(ws_m_ptr + part, m)
    tl.store(ws_s_ptr + part, s)


@triton.jit
def _merge_kernel(ws_key_ptr, ws_m_ptr, ws_s_ptr, val_ptr, idx_ptr, ids_ptr, K, C,
                  HAS_IDS: tl.constexpr, CP: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cc = tl.arange(0, CP)
    m = tl.load(ws_m_ptr + row * C + cc, mask=cc < C, other=float("-inf"))
    s = tl.load(ws_s_ptr + row * C + cc, mask=cc < C, other=0.0)
    shift = lse_shift(tl.max(m, axis=0))
    lse = tl.log(tl.sum(_rescale(s, m, shift), axis=0)) + shift

    j = tl.arange(0, CP * KP)
    key = tl.load(ws_key_ptr + row * C * K + j, mask=j < C * K, other=KEY_MIN)
    kk = tl.arange(0, KP)
    out = tl.full([KP], KEY_MIN, tl.int64)
    for r in range(K):
        top = tl.max(key, axis=0)
        out = tl.where(kk == r, top, out)
        key = tl.where(key == top, KEY_MIN, key)
    o = (out >> 32).to(tl.int32)
    x = tl.where(o >= 0, o, o ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    idx = (out & 0x7FFFFFFF) ^ 0x7FFFFFFF
    om = kk < K
    if HAS_IDS:  # columns -> the caller's ids (a draft vocabulary's token ids)
        idx = tl.load(ids_ptr + idx, mask=om, other=0).to(tl.int64)
    tl.store(val_ptr + row * K + kk, x - lse, mask=om)
    tl.store(idx_ptr + row * K + kk, idx, mask=om)


# ----------------------------------------------------------------------------- host side
@on_tensor_device
def topk_log_probs(logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`specattn.ops.topk_log_probs` (two launches: per-chunk partials, then
    one merge per row).  ``logits``: ``[N, V]`` float32 / bfloat16 / float16 with
    ``stride(1) == 1``; ``1 <= k <= min(V, 16)``.  Returns ``(values float32 [N, k],
    indices int64 [N, k])``, new tensors."""
    require_device(logits, "topk_log_probs", _INTERPRET)
    N, V = logits.shape
    k = int(k)
    dev = logits.device
    values = torch.empty(N, k, device=dev, dtype=torch.float32)
    indices = torch.empty(N, k, device=dev, dtype=torch.int64)
    if N == 0:
        return values, indices
    block, tiles, C = chunk_config(V)
    kp = triton.next_power_of_2(k)
    ws_key = torch.empty(N, C, k, device=dev, dtype=torch.int64)
    ws_m = torch.empty(N, C, device=dev, dtype=torch.float32)
    ws_s = torch.empty(N, C, device=dev, dtype=torch.float32)
    _chunk_kernel[(N, C)](logits, logits.stride(0), V, k, C, tiles, ws_key, ws_m, ws_s,
                          BLOCK=block, KP=kp,
                          num_warps=max(1, min(8, block // 256)), **pdl_kwargs(logits))
    merge_topk_parts(ws_key, ws_m, ws_s, values, indices)
    return values, indices


def merge_topk_parts(ws_key: torch.Tensor, ws_m: torch.Tensor, ws_s: torch.Tensor,
                     values: torch.Tensor, indices: torch.Tensor,
                     column_ids: Optional[torch.Tensor] = None) -> None:
    """The merge launch (one program per row) over per-part candidates of ``N`` rows, ``C``
    parts each: ``ws_key`` int64 ``[N, C, k]`` (order keys, see the module docstring; a
    part narrower than ``k`` pads with keys below every real one), ``ws_m`` / ``ws_s``
    float32 ``[N, C]`` (each part's max and ``sum(exp(x - lse_shift(max)))``), all
    contiguous.  Writes the row's ``k`` best ``values`` (float32 log-probabilities, ``[N,
    k]``) and ``indices`` (int64 ``[N, k]``: the columns, or ``column_ids[column]`` when
    ``column_ids``, an int32 / int64 ``[V]`` tensor, is given), best first.  The caller keeps
    ``next_pow2(C) * next_pow2(k) <= MAX_MERGE_KEYS``."""
    N, C, k = ws_key.shape
    cp, kp = triton.next_power_of_2(C), triton.next_power_of_2(k)
    _merge_kernel[(N,)](ws_key, ws_m, ws_s, values, indices, indices if column_ids is None else column_ids,
                        k, C, HAS_IDS=column_ids is not None, CP=cp, KP=kp,
                        num_warps=max(1, min(4, cp * kp // 256)), **pdl_kwargs(ws_key))
