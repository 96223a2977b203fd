"""Triton implementations of the fused Llama-layer ops of :mod:`specattn.ops.fused_llama`
(registered as ``impl="triton"`` there; each launcher has exactly the signature of the
op's ``*_reference`` function).

Two kernels, one GEMM shape: ``out[M, N] = epilogue(prologue(x[M, K]) @ W[N, K]^T)`` with a
grid of ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))`` programs, each looping over ``K`` in
``BLOCK_K`` chunks with a float32 accumulator.

- ``_gemm_kernel``: the RMSNorm prologue (optional), then one of four epilogues: store
  (``rms_norm_matmul``; any output dtype), add the residual tile in float32 and store it back
  in place (``matmul_residual``; optionally also each row's share of the stored tile's sum
  of squares, ``SS_OUT``), SwiGLU over two accumulators fed by the gate and up weights
  (``rms_norm_swiglu``: ``silu(g) * u`` in float32), or top-k (``rms_norm_matmul_topk``:
  no store; each row's ``k`` best order keys of the tile and its ``(max, sum exp)``, the
  parts that the top-k op's merge kernel reduces, so an LM head hands a drafting step or a
  greedy verify its top-k log-probabilities without writing the logits).
- ``_qkv_rope_kernel``: the RMSNorm prologue, one head (``head_dim`` columns of the fused
  QKV weight) per N-program, kept as two accumulators (the first and the second half of
  the head's columns) so the rotate-half pairs ``(i, i + D/2)`` of neox RoPE meet in
  registers; Q and K heads are rotated, V heads are not; Q goes to the returned tensor, K
  and V to ``k_cache[out_cache_loc[m]]`` / ``v_cache[out_cache_loc[m]]``.  A float8_e4m3fn
  cache (``CACHE_FP8``) stores ``clamp(x / scale, +-448)`` rounded to nearest even on the
  float32 bits (``_util.fp8e4m3_bits``, the code the KV-materialize kernel uses; the
  interpreter's ``.to(float8e4nv)`` mis-rounds) through a uint8 view of the cache, the
  division IEEE (``div_rn``); the other cache dtypes compile as before.

RMSNorm prologue, three forms.  The row scale ``1 / sqrt(sum(x^2) / K + eps)`` always
multiplies the float32 accumulator after the K loop (except float16 with a norm weight,
below); the normalized activations never exist in memory.

- Norm weight folded into ``W`` (``norm_weight`` None, :func:`specattn.ops.fold_rms_norm_weight`)
  and the sums of squares handed over (``row_sumsq``: the ``[P, M]`` partial sums that the
  ``matmul_residual`` which wrote ``x`` returned): one ``[BLOCK_M, P]`` load before the
  loop, and the K loop is a pure GEMM over ``x`` as loaded, the fastest form (the model's
  path).
- Folded, no sums handed over: a pre-pass over the (cache-resident) rows sums ``x^2``, then
  the same pure loop.
- With a norm weight: while each ``x`` tile is loaded its ``sum(x^2)`` accumulates and the
  tile is multiplied by ``norm_weight`` in float32 and rounded to the activation dtype for
  the dot (gate/up and QKV 1.7-4.6 us slower per launch at ``M`` = 64-256); float16
  computes the row scale first (``PRESCALE``) and applies it before the rounding, since
  ``x * norm_weight`` un-normalized can overflow float16's range.

A folded loop must not read its ``x`` tile for anything but the dot: summing ``x^2`` from
the same tile inside the loop ran faster still but gave wrong results with 64-row,
4-warp tiles (wgmma) for some shapes under Triton 3.6 (the LM head at every ``M``,
gate/up at ``M = 192 / 256`` with 32-column tiles), so the sums come from the producer or
a pre-pass.

Tiles (:func:`tile_config`, :func:`qkv_tile_config`; chosen from ``M``, ``N``, ``K`` and the
dtype, so each op compiles a handful of variants): 16-bit ``BLOCK_M`` 16 / 64 for ``M`` <= 32
/ more (the QKV kernel 16 / 32 / 64 up to 128 / 256 / more, gate/up 32-row tiles up to 64;
float32 ``next_pow2(M)`` up to 16, since its dots run on FMA units, then 32 / 64);
``BLOCK_N`` 64 by default, 128 for the LM head (16-bit, ``N >= 16384``), 16 where the grid
would have fewer than ``SMALL_GRID`` programs (o_proj, down_proj, the MLP at decode and
verify sizes: latency-bound weight streams, so as many programs and as few dependent K
steps as possible: ``BLOCK_K`` 256 / 128, 4 stages); 4 warps (2 for 16 x 16 tiles and for
float32 with ``M <= 16``); 3 pipeline stages by default (fewer only where a GPU lacks the
shared memory: ``_util.launch_fitting``).  Loads only the epilogue needs (the residual
tile; positions, cos/sin and cache slots) are issued before the K loop.  float32 dots use
``input_precision="ieee"`` (no TF32); 16-bit dots run on tensor cores with float32
accumulation.

No host sync and no allocation but the outputs, so every launcher can be captured in a
CUDA graph (after one eager call per tile variant, which compiles it).  The kernels trust
the wrapper's validation; out-of-range ``out_cache_loc`` or ``positions`` values (possible
when the wrapper's value checks are skipped) make the QKV kernel skip those rows' cache
stores and never dereference them.

Programmatic dependent launch (sm_90+, ``_util.pdl_kwargs``; ``SPECATTN_PDL=0``: off): both
kernels then start with ``_pdl_enter``: an L2 prefetch of the program's weight rows (by the
first row tile), the wait for the previous grid, and the trigger that lets the next grid
launch; every load of activations and every store comes after the wait.

CPU interpreter (``TRITON_INTERPRET=1``): its bf16 ``tl.dot`` is wrong and its
``.to(bfloat16)`` truncates, so the launchers pass ``INTERP=True`` there and the kernels
multiply 16-bit values in float32 (exact products, float32 accumulation: what the tensor
cores do) and round to bfloat16 on the float32 bits (round to nearest even, as the GPU's
conversion).  The GPU code never takes these branches.

Semantics, argument docs and the precision contract: :mod:`specattn.ops.fused_llama`.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._util import (fp8e4m3_bits, gdc_enter, is_pow2, launch_fitting, on_tensor_device, pdl_kwargs,
                    require_device)
from .topk import KEY_MIN, MAX_MERGE_KEYS, lse_shift, merge_topk_parts, order_keys, topk_log_probs

__all__ = ["rms_norm_matmul", "rms_norm_matmul_topk", "topk_fusable", "qkv_rope_store", "matmul_residual",
           "rms_norm_swiglu", "tile_config", "qkv_tile_config", "qkv_head_dim_supported", "NUM_WARPS", "NUM_STAGES"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

SMALL_GRID = 64  # programs; see tile_config
SMALL_GRID_TWO_WEIGHTS = 96  # gate/up programs at 16 columns past which 32-column tiles win
NUM_WARPS = 4
NUM_STAGES = 3
QKV_MIN_HEAD_DIM = 32  # D/2 >= 16: the smallest N of a tl.dot

# epilogues of _gemm_kernel
_STORE, _RESIDUAL, _SWIGLU, _TOPK = 0, 1, 2, 3


def _block_m(M: int, dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        if M <= 16:
            return triton.next_power_of_2(max(M, 1))  # FMA dot: its work scales with BLOCK_M
        return 32 if M <= 32 else 64
    return 16 if M <= 32 else 64  # 16-bit: two 16-row tiles beat one of 32 (more programs)


def tile_config(M: int, N: int, K: int, dtype: torch.dtype,
                num_weights: int = 1, folded: bool = False) -> Tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` of the GEMM kernel for
    ``x [M, K]`` of ``dtype``, ``N`` output columns and ``num_weights`` weight matrices (2 for
    SwiGLU's gate and up); ``folded``: an RMSNorm prologue whose weight is folded into the
    GEMM weight (``x`` feeds the dot as loaded).

    - ``BLOCK_M``: 16-bit 16 / 64 for ``M`` <= 32 / more (at ``M`` 24-32 two 16-row tiles
      beat one of 32: twice the programs on the same weight); float32 ``next_pow2(M)`` up to
      16 (its dots run on FMA units, whose work scales with ``BLOCK_M``; 16-bit dots run on
      tensor cores, which pad small tiles to 16 rows anyway), then 32 / 64;
    - default: ``BLOCK_N`` 64, ``BLOCK_K`` 64 (32 for float32, whose tiles weigh double), 3
      pipeline stages;
    - small grids (fewer than ``SMALL_GRID`` programs at ``BLOCK_N`` 64: o_proj, down_proj
      and the MLP at decode and verify sizes) are latency-bound: the weight must stream
      through as many SMs as possible in as few dependent K steps as possible.  16-bit, one
      weight: ``BLOCK_N`` 16 (32 when that grid exceeds ``SMALL_GRID`` programs, twice
      that for 16-row tiles), ``BLOCK_K`` 256 (128 for ``BLOCK_M`` 64 and ``K < 1024``), 4
      stages, 2 warps for 16 x 16 tiles; two weights: ``BLOCK_N`` 16, ``BLOCK_K`` 128, 2
      warps at ``BLOCK_M`` 16 (past ``SMALL_GRID_TWO_WEIGHTS`` programs of 16-row tiles:
      ``BLOCK_N`` 32, 4 stages).  float32: ``BLOCK_N`` 16.
    - two weights, 16-bit, ``M > 32``: 32-row tiles up to ``M = 64``, then 64, and the
      narrowest ``BLOCK_N`` of 16 / 32 / 64 that keeps the grid within
      ``SMALL_GRID_TWO_WEIGHTS`` programs, ``BLOCK_K`` 64, 3 stages (gate/up at ``M = 64`` 9.9
      -> 8.7 us, ``M = 128`` 14.6 -> 10.5; ``M = 256`` unchanged at 12.0); folded: up to
      ``M = 64`` 16 x 32 tiles, ``BLOCK_K`` 128, 2 warps, 3 stages, then 64-row tiles and
      the narrowest ``BLOCK_N`` of 32 / 64 within those programs (with the sums handed
      over, ``M`` = 1 / 16 / 64 / 128 / 256: 6.5 / 5.3 / 5.6 / 7.4 / 7.5 us against 6.1 /
      6.2 / 8.7 / 10.4 / 12.1 with the norm weight in registers);
    - wide outputs (``N >= 16384``: the LM head), 16-bit: ``BLOCK_N`` 128;
    - float32 with ``BLOCK_M <= 8``: ``BLOCK_K`` 64 (small tiles); ``num_warps`` 2 for
      float32 with ``M <= 16``, else 4.

    The small-grid tiles come from a sweep at SmolLM2-135M's shapes (H200, bf16, 120
    distinct weights per op so every launch streams its weight from HBM, in a CUDA graph):
    per launch at ``M = 1`` o_proj 4.3 -> 3.5 us, down_proj 7.0 -> 4.5 us, gate/up 7.3 ->
    6.2 us against 32-column tiles; at ``M = 32`` (a 32-token verify) the 16-row tiles take
    gate/up 8.1 -> 6.0 us, o_proj 3.8 -> 3.3, down_proj 4.6 -> 4.3, the QKV kernel 8.8 ->
    7.4 (``docs/fused_llama.md``).
    """
    block_m = _block_m(M, dtype)
    small = triton.cdiv(M, block_m) * triton.cdiv(N, 64) < SMALL_GRID
    if dtype == torch.float32:
        warps = 2 if M <= 16 else NUM_WARPS
        block_k = 64 if block_m <= 8 else 32
        return block_m, 16 if small else 64, block_k, warps, NUM_STAGES
    if num_weights == 2 and folded and M <= 64:
        return 16, 32, 128, 2, NUM_STAGES
    if num_weights == 2 and M > 32:  # gate/up: about SMALL_GRID_TWO_WEIGHTS programs of 32 / 64 rows
        block_m = 32 if M <= 64 and not folded else 64
        rt = triton.cdiv(M, block_m)
        widths = (32,) if folded else (16, 32)
        block_n = next((b for b in widths if rt * triton.cdiv(N, b) <= SMALL_GRID_TWO_WEIGHTS), 64)
        return block_m, block_n, 64, NUM_WARPS, NUM_STAGES
    row_tiles = triton.cdiv(M, block_m)
    if small and num_weights == 1:
        block_n = 16 if row_tiles * triton.cdiv(N, 16) <= (2 * SMALL_GRID if block_m <= 16 else SMALL_GRID) else 32
        block_k = 256 if block_m <= 16 or K >= 1024 else 128
        return block_m, block_n, block_k, 2 if block_m <= 16 and block_n == 16 else NUM_WARPS, 4
    if small:
        if block_m <= 16 and row_tiles * triton.cdiv(N, 16) > SMALL_GRID_TWO_WEIGHTS:
            return block_m, 32, 128, 2, 4
        return block_m, 16, 128, 2 if block_m <= 16 else NUM_WARPS, NUM_STAGES
    if N >= 16384:
        return block_m, 128, 64, NUM_WARPS, NUM_STAGES
    return block_m, 64, 64, NUM_WARPS, NUM_STAGES


def qkv_tile_config(M: int, dtype: torch.dtype, folded: bool = False) -> Tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_K, num_warps, HB, num_stages)`` of the QKV kernel (each program
    computes ``HB`` columns of both halves of one head; ``HB`` larger than ``head_dim / 2``
    means the whole head): float32 ``BLOCK_M`` as :func:`tile_config`, ``BLOCK_K`` 64 (float32 with
    ``BLOCK_M > 8``: 32), ``num_warps`` 2 for float32 with ``M <= 16``, else 4; whole heads
    (half heads were no faster in the sweep); 16-bit: 4 stages, ``BLOCK_M`` 16 up to ``M =
    128`` and 32 up to 256 (the 15 head programs stream the weight; more row tiles put it
    on more SMs: at ``M = 64`` / 128 / 256, 64-row tiles 10.7 us, 16-row 7.5 / 7.6, 32-row
    at 256 9.0; the EAGLE-3 drafter's 1,152-wide input at ``M = 64`` 20.4 -> 11.3 us), then
    64.  ``folded`` (the norm weight folded into ``w_qkv``: ``x`` feeds the dot as loaded):
    16-bit ``BLOCK_M`` 64 at every ``M`` (with the sums of squares handed over, ``M`` = 1 /
    16 / 64 / 256: 5.2 / 5.7 / 5.8 / 6.2 us against 7.4 / 7.5 / 7.5 / 9.0 with the norm
    weight in registers)."""
    if dtype == torch.float32:
        block_m = _block_m(M, dtype)
        return block_m, 64 if block_m <= 8 else 32, 2 if M <= 16 else NUM_WARPS, 1 << 30, NUM_STAGES
    if folded:
        return 64, 64, NUM_WARPS, 1 << 30, 4
    return 16 if M <= 128 else 32 if M <= 256 else 64, 64, NUM_WARPS, 1 << 30, 4


def qkv_head_dim_supported(head_dim: int) -> bool:
    """Whether the QKV kernel takes ``head_dim``: a power of two >= 32."""
    return is_pow2(head_dim) and head_dim >= QKV_MIN_HEAD_DIM


@triton.jit
def _prefetch_l2(w_ptr, ldw, cols, N, K, LINES: tl.constexpr, EPL: tl.constexpr):
    """``prefetch.global.L2`` of every 128-byte line of weight rows ``cols`` (``[N, K]``,
    row stride ``ldw``; rows past ``N`` and lines past ``K`` clamp to the last valid one, so
    no address leaves the weight).  ``EPL``: elements per 128-byte line."""
    line = tl.arange(0, LINES)
    off = tl.minimum(line * EPL, K - 1)
    c = tl.minimum(cols, N - 1).to(tl.int64)
    addr = (w_ptr + c[None, :] * ldw + off[:, None]).to(tl.int64)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pdl_enter(w_ptr, ldw, w2_ptr, ldw2, cols, N, K, TWO: tl.constexpr, LINES: tl.constexpr,
               EPL: tl.constexpr):
    """Under programmatic dependent launch: prefetch the (read-only) weight rows of this
    program (the first row tile's programs only: every row tile reads the same weight rows,
    and at hundreds of rows the repeated prefetches cost more L2 traffic than the GEMM),
    wait for the previous grid (every load of activations and every store comes after
    this), then let the next grid launch."""
    if tl.program_id(0) == 0:
        _prefetch_l2(w_ptr, ldw, cols, N, K, LINES, EPL)
        if TWO:
            _prefetch_l2(w2_ptr, ldw2, cols, N, K, LINES, EPL)
    gdc_enter(True)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, INTERP: tl.constexpr):
    if INTERP:  # the CPU interpreter's bf16 tl.dot is wrong: multiply the 16-bit values in fp32
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _cast(x, ty: tl.constexpr, INTERP: tl.constexpr):
    """float32 ``x`` rounded to nearest even in ``ty``.  The CPU interpreter's
    ``.to(bfloat16)`` truncates, so there the rounding is done on the float32 bits first
    (the conversion of the rounded value is then exact); the GPU converts directly."""
    if INTERP:
        if ty == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            x = b.to(tl.float32, bitcast=True)
    return x.to(ty)


@triton.jit
def _kv_value(x, scale, ty: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr):
    """float32 ``x`` as a KV cache stores it.  ``FP8`` (``ty`` uint8: the bytes of a
    float8_e4m3fn cache): the e4m3 bits of ``x / scale``, the division correctly rounded
    (``div_rn``, as torch's on the CPU; Triton's ``/`` need not be on the GPU), then
    saturating round to nearest even (:func:`._util.fp8e4m3_bits`); else :func:`_cast` to
    ``ty``."""
    if FP8:
        return fp8e4m3_bits(tl.div_rn(x, scale))
    else:
        return _cast(x, ty, INTERP)


@triton.jit
def _inv_rms(x_rows, rmask, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``1 / sqrt(mean(x^2) + eps)`` of ``BLOCK_M`` rows (``x_rows``: [BLOCK_M, 1] row
    pointers), float32, summed over K in the same chunks as the GEMM loop."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + kk[None, :], mask=rmask[:, None] & (kk < K)[None, :],
                    other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    return tl.div_rn(1.0, tl.sqrt_rn(ss / K + eps))


@triton.jit
def _inv_rms_from_parts(ss_ptr, ld_ss, n_parts, rows, rmask, K, eps, NP: tl.constexpr):
    """``1 / sqrt(sum / K + eps)`` of the rows from the ``[n_parts, M]`` float32 partial sums
    of squares that a ``matmul_residual`` producing ``x`` wrote (one load, issued before
    the K loop)."""
    pp = tl.arange(0, NP)
    parts = tl.load(ss_ptr + pp.to(tl.int64)[None, :] * ld_ss + rows[:, None],
                    mask=rmask[:, None] & (pp < n_parts)[None, :], other=0.0)
    return tl.div_rn(1.0, tl.sqrt_rn(tl.sum(parts, axis=1) / K + eps))


@triton.jit
def _row_scale(x_rows, ss_ptr, ld_ss, n_parts, rows, rmask, K, eps, HAS_SS: tl.constexpr,
               PREPASS: tl.constexpr, NP: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """The row scale known before the K loop: from the handed-over partial sums
    (``HAS_SS``), else from a pre-pass over the rows (``PREPASS``), else 1 (summed in the
    loop)."""
    inv = tl.full([BLOCK_M], 1.0, tl.float32)
    if HAS_SS:  # the producer's partial sums of squares: one load
        inv = _inv_rms_from_parts(ss_ptr, ld_ss, n_parts, rows, rmask, K, eps, NP)
    elif PREPASS:
        inv = _inv_rms(x_rows, rmask, K, eps, BLOCK_M, BLOCK_K)
    return inv


@triton.jit
def _norm_operand(x, g_ptr, kk, km, inv, ss, HAS_G: tl.constexpr, SCALE_FIRST: tl.constexpr,
                  HAS_SS: tl.constexpr, INTERP: tl.constexpr):
    """The dot's A operand from the ``x`` tile and the running row sums of squares: ``x``
    as loaded (norm weight folded into W), or ``x * norm_weight`` rounded to ``x``'s dtype
    (scaled by ``inv`` first with ``SCALE_FIRST``; else ``x^2`` summed here unless the sums
    were handed over)."""
    a = x
    if HAS_G:
        xf = x.to(tl.float32)
        if SCALE_FIRST:
            xf = xf * inv[:, None]
        elif not HAS_SS:
            ss += tl.sum(xf * xf, axis=1)
        g = tl.load(g_ptr + kk, mask=km, other=0.0).to(tl.float32)
        a = _cast(xf * g[None, :], x.dtype, INTERP)
    return a, ss


@triton.jit
def _topk_parts(acc, rows, cols, rmask, cmask, key_ptr, m_ptr, s_ptr, TOPK: tl.constexpr):
    """The ``_TOPK`` epilogue: for each row of the float32 tile, its ``TOPK`` largest order keys
    (:func:`specattn.triton_kernels.topk.order_keys`, best first; ``KEY_MIN`` past the
    tile's valid columns) to ``key_ptr [M, C, TOPK]`` and its max and ``sum(exp(x -
    shift))`` to ``m_ptr / s_ptr [M, C]``, ``C`` = the column tiles: the parts that
    :func:`specattn.triton_kernels.topk.merge_topk_parts` reduces."""
    C = tl.num_programs(1)
    x = tl.where(cmask[None, :], acc, float("-inf"))
    m = tl.max(x, axis=1)
    s = tl.sum(tl.exp(x - lse_shift(m)[:, None]), axis=1)
    part = rows.to(tl.int64) * C + tl.program_id(1)
    tl.store(m_ptr + part, m, mask=rmask)
    tl.store(s_ptr + part, s, mask=rmask)
    key = order_keys(x, cols[None, :], cmask[None, :])
    for r in tl.static_range(TOPK):
        top = tl.max(key, axis=1)
        tl.store(key_ptr + part * TOPK + r, top, mask=rmask)
        key = tl.where(key == top[:, None], KEY_MIN, key)


@triton.jit
def _gemm_kernel(x_ptr, ldx, g_ptr, w_ptr, ldw, w2_ptr, ldw2, out_ptr, ldo, M, N, K, eps,
                 ss_ptr, ld_ss, n_parts, tk_m_ptr, tk_s_ptr, cp_ptr, ldc,
                 HAS_NORM: tl.constexpr, HAS_G: tl.constexpr, PRESCALE: tl.constexpr, COPY: tl.constexpr,
                 HAS_SS: tl.constexpr, SS_OUT: tl.constexpr, NP: tl.constexpr,
                 EPILOGUE: tl.constexpr, TOPK: tl.constexpr,
                 IEEE: tl.constexpr, INTERP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr = False, LINES: tl.constexpr = 1,
                 EPL: tl.constexpr = 64):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    if PDL:
        _pdl_enter(w_ptr, ldw, w2_ptr, ldw2, cols, N, K, EPILOGUE == 2, LINES, EPL)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * ldx
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * ldw
    w2_cols = w2_ptr + cols.to(tl.int64)[None, :] * ldw2

    omask = rmask[:, None] & cmask[None, :]
    optrs = out_ptr + rows.to(tl.int64)[:, None] * ldo + cols[None, :]
    if EPILOGUE == 1:  # the residual tile, loaded before the K loop so its latency hides there
        res = tl.load(optrs, mask=omask, other=0.0).to(tl.float32)
    NORM_SS: tl.constexpr = HAS_NORM and HAS_SS
    NORM_PREPASS: tl.constexpr = HAS_NORM and (PRESCALE or not HAS_G)
    NORM_G: tl.constexpr = HAS_NORM and HAS_G
    inv = _row_scale(x_rows, ss_ptr, ld_ss, n_parts, rows, rmask, K, eps, NORM_SS, NORM_PREPASS, NP,
                     BLOCK_M, BLOCK_K)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        x = tl.load(x_rows + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        a, ss = _norm_operand(x, g_ptr, kk, km, inv, ss, NORM_G, PRESCALE, HAS_SS, INTERP)
        wm = km[:, None] & cmask[None, :]
        w = tl.load(w_cols + kk[:, None], mask=wm, other=0.0)
        acc = _dot(a, w, acc, IEEE, INTERP)
        if EPILOGUE == 2:
            w2 = tl.load(w2_cols + kk[:, None], mask=wm, other=0.0)
            acc2 = _dot(a, w2, acc2, IEEE, INTERP)

    if HAS_NORM and not PRESCALE:
        if HAS_G and not HAS_SS:
            inv = tl.div_rn(1.0, tl.sqrt_rn(ss / K + eps))
        acc = acc * inv[:, None]
        acc2 = acc2 * inv[:, None]
    if EPILOGUE == 1:
        acc += res
    if EPILOGUE == 2:
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    if EPILOGUE == 3:  # no store: this column tile's top-TOPK keys and (max, sum exp) per row
        _topk_parts(acc, rows, cols, rmask, cmask, out_ptr, tk_m_ptr, tk_s_ptr, TOPK)
    else:
        out = _cast(acc, out_ptr.dtype.element_ty, INTERP)
        tl.store(optrs, out, mask=omask)
        if COPY:  # the stored values once more, into a second [M, N] view
            tl.store(cp_ptr + rows.to(tl.int64)[:, None] * ldc + cols[None, :], out, mask=omask)
    if SS_OUT:  # this tile's share of each row's sum of squares, of the values as stored
        of = out.to(tl.float32)
        of = tl.where(omask, of, 0.0)
        tl.store(ss_ptr + tl.program_id(1).to(tl.int64) * ld_ss + rows, tl.sum(of * of, axis=1), mask=rmask)


@triton.jit
def _qkv_second_input(x2_ptr, ldx2, g2_ptr, K2, w_lo, w_hi, K, rows64, rmask, acc_lo, acc_hi, eps,
                      HAS_G: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HB: tl.constexpr):
    """Add ``RMSNorm(x2) @ W[:, K:K+K2]^T`` to both half-head accumulators (the two inputs
    are normalized each on its own; the row scale from a pre-pass over the cache-resident
    rows).  With ``HAS_G`` the scale and the weight are applied to ``x2`` before the dot;
    without (the norm weight folded into ``W``) ``x2`` feeds the dot as loaded into
    accumulators of its own, scaled after the loop."""
    x2_rows = x2_ptr + rows64[:, None] * ldx2
    if HAS_G:
        inv2 = _inv_rms(x2_rows, rmask, K2, eps, BLOCK_M, BLOCK_K)
        for k0 in range(0, K2, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < K2
            x = tl.load(x2_rows + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            g = tl.load(g2_ptr + kk, mask=km, other=0.0).to(tl.float32)
            a = _cast(x.to(tl.float32) * inv2[:, None] * g[None, :], x.dtype, INTERP)
            wl = tl.load(w_lo + (K + kk)[:, None], mask=km[:, None], other=0.0)
            wh = tl.load(w_hi + (K + kk)[:, None], mask=km[:, None], other=0.0)
            acc_lo = _dot(a, wl, acc_lo, IEEE, INTERP)
            acc_hi = _dot(a, wh, acc_hi, IEEE, INTERP)
    else:
        inv2 = _inv_rms(x2_rows, rmask, K2, eps, BLOCK_M, BLOCK_K)
        lo2 = tl.zeros([BLOCK_M, HB], dtype=tl.float32)
        hi2 = tl.zeros([BLOCK_M, HB], dtype=tl.float32)
        for k0 in range(0, K2, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < K2
            x = tl.load(x2_rows + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            wl = tl.load(w_lo + (K + kk)[:, None], mask=km[:, None], other=0.0)
            wh = tl.load(w_hi + (K + kk)[:, None], mask=km[:, None], other=0.0)
            lo2 = _dot(x, wl, lo2, IEEE, INTERP)
            hi2 = _dot(x, wh, hi2, IEEE, INTERP)
        acc_lo += lo2 * inv2[:, None]
        acc_hi += hi2 * inv2[:, None]
    return acc_lo, acc_hi


@triton.jit
def _head_norm(lo, hi, g_ptr, j, eps, HALF: tl.constexpr):
    """RMSNorm of each row's head ``[lo | hi]`` (``2 * HALF`` values, float32) times the
    weight ``g``: Qwen3's ``q_norm`` / ``k_norm``."""
    ms = (tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / (2 * HALF)
    r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
    g_lo = tl.load(g_ptr + j).to(tl.float32)
    g_hi = tl.load(g_ptr + HALF + j).to(tl.float32)
    return lo * r[:, None] * g_lo[None, :], hi * r[:, None] * g_hi[None, :]


@triton.jit
def _qkv_rope_kernel(x_ptr, ldx, g_ptr, w_ptr, ldw, pos_ptr, pos_s, cs_ptr, cs_s0, cs_s1,
                     loc_ptr, loc_s, q_ptr, ldq, k_ptr, v_ptr, M, K, num_heads, num_kv_heads,
                     num_slots, max_pos, eps, x2_ptr, ldx2, g2_ptr, K2, ss_ptr, ld_ss, n_parts,
                     k_scale, v_scale, qn_ptr, kn_ptr,
                     Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
                     HAS_SS: tl.constexpr, NP: tl.constexpr, HAS_G: tl.constexpr, PRESCALE: tl.constexpr, TWO_INPUTS: tl.constexpr,
                     IEEE: tl.constexpr, CACHE_FP8: tl.constexpr,
                     INTERP: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                     LINES: tl.constexpr = 1, EPL: tl.constexpr = 64):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)  # head of the fused QKV output: Q heads, then K, then V
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    j = tl.program_id(2) * HB + tl.arange(0, HB)  # this program's columns of each half
    if PDL:
        wrow = h * (2 * HALF) + j
        _pdl_enter(w_ptr, ldw, w_ptr + HALF * ldw, ldw, wrow, (num_heads + 2 * num_kv_heads) * 2 * HALF,
                   K, True, LINES, EPL)
    x_rows = x_ptr + rows64[:, None] * ldx
    w_lo = w_ptr + (h.to(tl.int64) * (2 * HALF) + j)[None, :] * ldw  # first half's columns
    w_hi = w_lo + HALF * ldw

    # what the epilogue reads (positions, cos/sin, cache slots), loaded before the K loop so
    # these dependent loads overlap the weight stream instead of following it
    pos = tl.load(pos_ptr + rows64 * pos_s, mask=rmask, other=0).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < max_pos)
    is_rope = h < num_heads + num_kv_heads
    h_rows = tl.zeros([BLOCK_M], dtype=tl.int32) + h  # (per-row copies: vector masks)
    cm = (rmask & pos_ok & (h_rows < num_heads + num_kv_heads))[:, None]
    cs_row = cs_ptr + tl.where(pos_ok, pos, 0)[:, None] * cs_s0
    j64 = j.to(tl.int64)  # (a cos/sin view's column stride can pass 2**31 / head_dim)
    cos = tl.load(cs_row + j64[None, :] * cs_s1, mask=cm, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + (HALF + j64)[None, :] * cs_s1, mask=cm, other=0.0).to(tl.float32)
    slot = tl.load(loc_ptr + rows64 * loc_s, mask=rmask & (h_rows >= num_heads), other=-1).to(tl.int64)

    # the row scale before the dot (from a pre-pass over the rows) where a norm weight
    # multiplies x in registers, for float16 and for two inputs (each scaled by its own
    # norm); else on the accumulator: summed in the loop with a norm weight, from the
    # pre-pass with the weight folded into W (then x feeds the dot as loaded and is read by
    # nothing else in the loop: a pure dot loop, both the fastest and the one the compiler
    # pipelines safely)
    SCALE_FIRST: tl.constexpr = PRESCALE or (TWO_INPUTS and HAS_G)
    PREPASS: tl.constexpr = SCALE_FIRST or not HAS_G
    inv = _row_scale(x_rows, ss_ptr, ld_ss, n_parts, rows, rmask, K, eps, HAS_SS, PREPASS, NP,
                     BLOCK_M, BLOCK_K)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HB], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HB], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        x = tl.load(x_rows + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
        a, ss = _norm_operand(x, g_ptr, kk, km, inv, ss, HAS_G, SCALE_FIRST, HAS_SS, INTERP)
        wl = tl.load(w_lo + kk[:, None], mask=km[:, None], other=0.0)
        wh = tl.load(w_hi + kk[:, None], mask=km[:, None], other=0.0)
        acc_lo = _dot(a, wl, acc_lo, IEEE, INTERP)
        acc_hi = _dot(a, wh, acc_hi, IEEE, INTERP)
    if not SCALE_FIRST:
        if HAS_G and not HAS_SS:
            inv = tl.div_rn(1.0, tl.sqrt_rn(ss / K + eps))
        acc_lo = acc_lo * inv[:, None]
        acc_hi = acc_hi * inv[:, None]
    if TWO_INPUTS:
        acc_lo, acc_hi = _qkv_second_input(x2_ptr, ldx2, g2_ptr, K2, w_lo, w_hi, K, rows64, rmask, acc_lo,
                                           acc_hi, eps, HAS_G, IEEE, INTERP, BLOCK_M,
                                           BLOCK_K, HB)

    # per-head Q / K RMSNorm before RoPE (the launch gives each program a whole head: HB = HALF)
    if Q_NORM:
        if h < num_heads:
            acc_lo, acc_hi = _head_norm(acc_lo, acc_hi, qn_ptr, j, eps, HALF)
    if K_NORM:
        if (h >= num_heads) & (h < num_heads + num_kv_heads):
            acc_lo, acc_hi = _head_norm(acc_lo, acc_hi, kn_ptr, j, eps, HALF)

    if is_rope:  # Q and K heads: neox RoPE, rotate-half pairs in registers
        lo = acc_lo * cos - acc_hi * sin
        hi = acc_hi * cos + acc_lo * sin
    else:
        lo = acc_lo
        hi = acc_hi

    # (each branch names its own pointer: q and the caches may differ in dtype)
    if h < num_heads:
        q_dst = q_ptr + rows64[:, None] * ldq + h * (2 * HALF) + j[None, :]
        qm = rmask[:, None]
        tl.store(q_dst, _cast(lo, q_ptr.dtype.element_ty, INTERP), mask=qm)
        tl.store(q_dst + HALF, _cast(hi, q_ptr.dtype.element_ty, INTERP), mask=qm)
    else:
        # the wrapper validates indices; out-of-range ones are skipped, never dereferenced
        ok = rmask & pos_ok & (slot >= 0) & (slot < num_slots)
        sm = ok[:, None]
        kv_h = h - num_heads  # K heads 0..Hkv-1, V heads Hkv..2*Hkv-1
        if kv_h < num_kv_heads:
            k_dst = k_ptr + (slot * num_kv_heads + kv_h)[:, None] * (2 * HALF) + j[None, :]
            tl.store(k_dst, _kv_value(lo, k_scale, k_ptr.dtype.element_ty, CACHE_FP8, INTERP), mask=sm)
            tl.store(k_dst + HALF, _kv_value(hi, k_scale, k_ptr.dtype.element_ty, CACHE_FP8, INTERP),
                     mask=sm)
        else:
            v_row = slot * num_kv_heads + (kv_h - num_kv_heads)
            v_dst = v_ptr + v_row[:, None] * (2 * HALF) + j[None, :]
            tl.store(v_dst, _kv_value(lo, v_scale, v_ptr.dtype.element_ty, CACHE_FP8, INTERP), mask=sm)
            tl.store(v_dst + HALF, _kv_value(hi, v_scale, v_ptr.dtype.element_ty, CACHE_FP8, INTERP),
                     mask=sm)


# ----------------------------------------------------------------------------- host side
def _interp(x: torch.Tensor) -> bool:
    """Whether this launch runs in the CPU interpreter (fp32 dots, bit-exact bf16 rounding)."""
    return _INTERPRET and x.device.type != "cuda"


def _pdl_kwargs(x: torch.Tensor, weight: torch.Tensor, K: int) -> dict:
    """:func:`pdl_kwargs` plus the weight prefetch's line geometry (``K`` columns of
    ``weight``'s dtype in 128-byte lines)."""
    kw = pdl_kwargs(x)
    if kw:
        epl = 128 // weight.element_size()
        kw.update(LINES=triton.next_power_of_2(triton.cdiv(K, epl)), EPL=epl)
    return kw


def _launch_gemm(x: torch.Tensor, norm_weight: Optional[torch.Tensor], weight: torch.Tensor,
                 weight2: Optional[torch.Tensor], out: torch.Tensor, eps: float,
                 epilogue: int, config: Optional[Tuple[int, ...]] = None,
                 has_norm: Optional[bool] = None, row_sumsq: Optional[torch.Tensor] = None,
                 want_sumsq: bool = False, topk_parts: Optional[Tuple[torch.Tensor, ...]] = None,
                 copy_to: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``has_norm`` (default: ``norm_weight`` given): the RMSNorm prologue; with it and no
    ``norm_weight`` the norm's weight is folded into ``weight`` (and ``weight2``).
    ``row_sumsq``: the ``[P, M]`` partial sums of squares of ``x`` (the norm reads them
    instead of summing ``x``).  ``want_sumsq`` (residual epilogue): also return the
    ``[P, M]`` float32 partial sums of squares of the updated output, ``P`` its column
    tiles.  ``topk_parts`` (top-k epilogue; ``out`` only gives the key buffer's view):
    ``(key [M, C, k], m, s [M, C])``, ``C`` the column tiles of ``config``.  ``copy_to``
    (store epilogues): an ``[M, N]`` view that also receives the stored values."""
    M, K = x.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return torch.zeros(1, M, device=x.device, dtype=torch.float32) if want_sumsq else None
    has_norm = norm_weight is not None if has_norm is None else has_norm
    has_g = has_norm and norm_weight is not None
    cfg = config or tile_config(M, N, K, x.dtype, 1 if weight2 is None else 2,
                                folded=has_norm and not has_g)
    block_m, block_n, block_k, warps = cfg[:4]
    stages = cfg[4] if len(cfg) > 4 else NUM_STAGES
    w2 = weight if weight2 is None else weight2
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    ss = row_sumsq if has_norm else None
    if want_sumsq:
        ss = torch.empty(grid[1], M, device=x.device, dtype=torch.float32)
    n_parts = 1 if ss is None else ss.shape[0]
    tk = topk_parts if topk_parts is not None else (out, out, out)
    args = (x, x.stride(0), weight if norm_weight is None else norm_weight, weight,
            weight.stride(0), w2, w2.stride(0), tk[0], out.stride(0), M, N, K, float(eps),
            out if ss is None else ss, 0 if ss is None else ss.stride(0), n_parts, tk[1], tk[2],
            out if copy_to is None else copy_to, 0 if copy_to is None else copy_to.stride(0))
    kwargs = dict(HAS_NORM=has_norm, HAS_G=has_g, PRESCALE=has_g and x.dtype == torch.float16,
                  COPY=copy_to is not None,
                  HAS_SS=has_norm and ss is not None, SS_OUT=want_sumsq,
                  NP=max(triton.next_power_of_2(n_parts), 2),
                  EPILOGUE=epilogue, TOPK=1 if topk_parts is None else topk_parts[0].shape[2],
                  IEEE=x.dtype == torch.float32, INTERP=_interp(x),
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                  **_pdl_kwargs(x, weight, K))
    launch_fitting(_gemm_kernel, grid, args, kwargs, stages)
    return ss if want_sumsq else None


@on_tensor_device
def rms_norm_matmul(x: torch.Tensor, norm_weight: Optional[torch.Tensor], weight: torch.Tensor,
                    eps: float, *, out_dtype: Optional[torch.dtype] = None,
                    row_sumsq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton :func:`specattn.ops.rms_norm_matmul` (one launch; ``norm_weight`` None: folded
    into ``weight``)."""
    require_device(x, "rms_norm_matmul", _INTERPRET)
    out = torch.empty(x.shape[0], weight.shape[0], device=x.device,
                      dtype=x.dtype if out_dtype is None else out_dtype)
    _launch_gemm(x, norm_weight, weight, None, out, eps, _STORE, has_norm=True, row_sumsq=row_sumsq)
    return out


def topk_fusable(M: int, N: int, K: int, dtype: torch.dtype, k: int) -> bool:
    """Whether :func:`rms_norm_matmul_topk` takes these sizes: its merge loads
    ``next_pow2(C) * next_pow2(k)`` keys per row (``C``: the GEMM's column tiles) in one
    program, at most ``MAX_MERGE_KEYS``."""
    block_n = tile_config(max(M, 1), N, K, dtype)[1]
    return triton.next_power_of_2(triton.cdiv(N, block_n)) * triton.next_power_of_2(k) <= MAX_MERGE_KEYS


@on_tensor_device
def rms_norm_matmul_topk(x: torch.Tensor, norm_weight: Optional[torch.Tensor], weight: torch.Tensor,
                         eps: float, k: int, *, row_sumsq: Optional[torch.Tensor] = None,
                         column_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`specattn.ops.rms_norm_matmul_topk`: the GEMM of :func:`rms_norm_matmul`
    (same tiles, so the same float32 logits) whose epilogue keeps each column tile's top-``k``
    keys and log-sum-exp parts instead of storing the tile, then one merge launch
    (:func:`specattn.triton_kernels.topk.merge_topk_parts`, which also maps the columns
    through ``column_ids``).  Returns ``(values float32 [M, k], indices int64 [M, k])``.
    Sizes past :func:`topk_fusable` take the two-step path (float32 logits, then
    :func:`specattn.triton_kernels.topk.topk_log_probs`)."""
    require_device(x, "rms_norm_matmul_topk", _INTERPRET)
    M, K = x.shape
    N = weight.shape[0]
    dev = x.device
    if not topk_fusable(M, N, K, x.dtype, k):
        values, indices = topk_log_probs(rms_norm_matmul(x, norm_weight, weight, eps, out_dtype=torch.float32,
                                                         row_sumsq=row_sumsq), k)
        return values, (indices if column_ids is None else column_ids[indices].long())
    values = torch.empty(M, k, device=dev, dtype=torch.float32)
    indices = torch.empty(M, k, device=dev, dtype=torch.int64)
    if M == 0:
        return values, indices
    block_n = tile_config(M, N, K, x.dtype, 1, folded=norm_weight is None)[1]
    C = triton.cdiv(N, block_n)
    parts = (torch.empty(M, C, k, device=dev, dtype=torch.int64),
             torch.empty(M, C, device=dev, dtype=torch.float32),
             torch.empty(M, C, device=dev, dtype=torch.float32))
    _launch_gemm(x, norm_weight, weight, None, parts[0].view(M, C * k), eps, _TOPK, has_norm=True,
                 row_sumsq=row_sumsq, topk_parts=parts)
    merge_topk_parts(*parts, values, indices, column_ids)
    return values, indices


@on_tensor_device
def matmul_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
                    return_row_sumsq: bool = False, copy_to: Optional[torch.Tensor] = None):
    """Triton :func:`specattn.ops.matmul_residual` (one launch, in place; with
    ``return_row_sumsq`` also the ``[P, M]`` partial sums of squares of the updated rows, one
    row per column tile of the launch; ``copy_to`` also gets the updated rows)."""
    require_device(x, "matmul_residual", _INTERPRET)
    ss = _launch_gemm(x, None, weight, None, residual, 0.0, _RESIDUAL, want_sumsq=return_row_sumsq,
                      copy_to=copy_to)
    return (residual, ss) if return_row_sumsq else residual


@on_tensor_device
def rms_norm_swiglu(x: torch.Tensor, norm_weight: Optional[torch.Tensor], w_gate: torch.Tensor,
                    w_up: torch.Tensor, eps: float, *,
                    row_sumsq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton :func:`specattn.ops.rms_norm_swiglu` (one launch; ``norm_weight`` None: folded
    into ``w_gate`` and ``w_up``)."""
    require_device(x, "rms_norm_swiglu", _INTERPRET)
    out = torch.empty(x.shape[0], w_gate.shape[0], device=x.device, dtype=x.dtype)
    _launch_gemm(x, norm_weight, w_gate, w_up, out, eps, _SWIGLU, has_norm=True, row_sumsq=row_sumsq)
    return out


@on_tensor_device
def qkv_rope_store(x: torch.Tensor, norm_weight: Optional[torch.Tensor], w_qkv: torch.Tensor, eps: float,
                   positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   out_cache_loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int,
                   x2: Optional[torch.Tensor] = None, norm_weight2: Optional[torch.Tensor] = None,
                   row_sumsq: Optional[torch.Tensor] = None, *, k_scale: float = 1.0,
                   v_scale: float = 1.0, q_norm_weight: Optional[torch.Tensor] = None,
                   k_norm_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton :func:`specattn.ops.qkv_rope_store` (one launch; ``x2``: the second input of an
    EAGLE-3 draft layer, normalized on its own; ``norm_weight`` (and ``norm_weight2``) None:
    folded into ``w_qkv``; ``q_norm_weight`` / ``k_norm_weight``: per-head norms, each
    program then holds a whole head).  float8_e4m3fn caches (``k_scale`` / ``v_scale`` as
    validated by the wrapper) are quantized in the kernel: ``x / scale`` in float32 (IEEE
    division), then saturating round to nearest even on the bits, stored through a uint8 view
    of the cache.

    Raises:
        ValueError: ``head_dim`` not a power of two >= 32 (the two half-head accumulators
            are ``tl.dot`` outputs of ``head_dim / 2 >= 16`` columns).
    """
    require_device(x, "qkv_rope_store", _INTERPRET)
    if not qkv_head_dim_supported(head_dim):
        raise ValueError(f"triton qkv_rope_store needs head_dim a power of two >= "
                         f"{QKV_MIN_HEAD_DIM}, got {head_dim}; use impl='reference'")
    q = torch.empty(x.shape[0], num_heads, head_dim, device=x.device, dtype=x.dtype)
    _launch_qkv(x, norm_weight, w_qkv, eps, positions, cos_sin_cache, out_cache_loc, k_cache,
                v_cache, q, x2=x2, norm_weight2=norm_weight2, row_sumsq=row_sumsq, k_scale=k_scale,
                v_scale=v_scale, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight)
    return q


def _launch_qkv(x, norm_weight, w_qkv, eps, positions, cos_sin_cache, out_cache_loc, k_cache,
                v_cache, q, config: Optional[Tuple[int, ...]] = None, x2=None, norm_weight2=None,
                row_sumsq: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                v_scale: float = 1.0, q_norm_weight: Optional[torch.Tensor] = None,
                k_norm_weight: Optional[torch.Tensor] = None) -> None:
    """One launch of ``_qkv_rope_kernel``; ``config``: a :func:`qkv_tile_config` tuple
    (default: chosen from ``M``; with a per-head norm its head split is ignored).
    float8_e4m3fn caches go to the kernel as uint8 views (``CACHE_FP8``: quantized with
    ``k_scale`` / ``v_scale`` in the kernel); other caches as they are (the scales unread)."""
    M, K = x.shape
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if M == 0:
        return
    has_g = norm_weight is not None
    cfg = config or qkv_tile_config(M, x.dtype, folded=not has_g)
    block_m, block_k, warps = cfg[:3]
    head_norm = q_norm_weight is not None or k_norm_weight is not None
    hb = min(cfg[3], head_dim // 2) if len(cfg) > 3 and not head_norm else head_dim // 2
    if (head_dim // 2) % hb or not is_pow2(hb) or hb < 16:
        raise ValueError(f"HB={hb} must be a power of two >= 16 dividing head_dim / 2 = {head_dim // 2}")
    stages = cfg[4] if len(cfg) > 4 else NUM_STAGES
    grid = (triton.cdiv(M, block_m), num_heads + 2 * num_kv_heads, head_dim // 2 // hb)
    g = norm_weight if has_g else x  # (an unread pointer when folded)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:  # the kernel stores the e4m3 bits it rounds (fp8e4m3_bits), as bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    args = (x, x.stride(0), g, w_qkv, w_qkv.stride(0), positions, positions.stride(0),
            cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.stride(1), out_cache_loc,
            out_cache_loc.stride(0), q, num_heads * head_dim, k_cache, v_cache, M, K, num_heads,
            num_kv_heads, k_cache.shape[0], cos_sin_cache.shape[0], float(eps),
            x if x2 is None else x2, x.stride(0) if x2 is None else x2.stride(0),
            g if norm_weight2 is None else norm_weight2, 0 if x2 is None else x2.shape[1],
            q if row_sumsq is None else row_sumsq, 0 if row_sumsq is None else row_sumsq.stride(0),
            1 if row_sumsq is None else row_sumsq.shape[0], float(k_scale), float(v_scale),
            g if q_norm_weight is None else q_norm_weight, g if k_norm_weight is None else k_norm_weight)
    kwargs = dict(Q_NORM=q_norm_weight is not None, K_NORM=k_norm_weight is not None,
                  HAS_SS=row_sumsq is not None,
                  NP=max(triton.next_power_of_2(1 if row_sumsq is None else row_sumsq.shape[0]), 2),
                  HAS_G=has_g, PRESCALE=has_g and x.dtype == torch.float16, TWO_INPUTS=x2 is not None, IEEE=x.dtype == torch.float32,
                  CACHE_FP8=fp8, INTERP=_interp(x), HALF=head_dim // 2, HB=hb, BLOCK_M=block_m,
                  BLOCK_K=block_k, num_warps=warps, **_pdl_kwargs(x, w_qkv, K))
    launch_fitting(_qkv_rope_kernel, grid, args, kwargs, stages)
