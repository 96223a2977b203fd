"""Triton implementation of :func:`specattn.ops.materialize_kv` (registered as
``impl="triton"`` by :mod:`specattn.ops.kv_materialize`).

:func:`materialize_kv` has exactly the signature of ``materialize_kv_reference``.  It runs
ONE torch GEMM ``kv = hidden @ w_kv.T`` (cuBLAS on CUDA, in the input dtype: bf16 in, fp32
accumulate, bf16 out) and then ONE Triton launch for the epilogue of every token, draft
layer, K/V and head: K RMSNorm (float32, over ``D``) times ``k_norm_weight[l]``, neox RoPE at
``positions[t]`` from ``cos_sin_cache`` (dims past the rotary dim pass through), the optional
``kv_bias`` added in float32 before the norm, the cast to the cache dtype and the store at
``k_buffers[l][out_cache_loc[t], h]`` / ``v_buffers[l][...]``.  No host sync; the only
allocation is the GEMM output (PyTorch's caching allocator, current stream).

Kernel (``_kv_epilogue_kernel``): grid ``(T, L, ceil(Hkv / BLOCK_H))``; a program owns the
K and V rows of ``BLOCK_H`` heads of one token and one layer.  The K tile is loaded as its
three column ranges ``[0, R/2)``, ``[R/2, R)`` and ``[R, D)`` (``R`` the rotary dim), so the
rotate-halves pairs ``(i, i + R/2)`` meet in registers without any gather or re-load and all
loads/stores are contiguous along ``D``.

Per-layer caches: the kernel gets ONE base pointer (``k_buffers[0]``) and a device table of
int64 element offsets of every K then V buffer from that base (all buffers share one dtype,
so the offsets are exact).  The table is built once per distinct buffer list (keyed by the
buffers' device, dtype and data pointers), with one host-to-device copy, and kept for the
life of the process (a few hundred bytes per list), so later calls copy nothing.  CUDA-graph
capture therefore needs one eager call with the same buffer list before capture (the usual
warm-up, which also compiles the kernel); a capture that would have to build a table raises
RuntimeError instead of recording a host-to-device copy.  The offsets also work unchanged in
the Triton CPU interpreter (``TRITON_INTERPRET=1``), where pointers are host addresses.

Rounding: bf16 and fp8 e4m3 stores round with integer bit operations in the kernel
(round-to-nearest-even; fp8 saturating: ``clamp(x / scale, -448, 448)`` then RTNE, NaN stays
NaN: ``_util.bf16_bits`` / ``_util.fp8e4m3_bits``, shared with the fused QKV kernel) into
the cache viewed as uint16 / uint8.  Reason: the Triton 3.9 interpreter's ``.to(bfloat16)``
truncates and its ``.to(float8e4nv)`` mis-rounds values just below a power of two
(measured), so ``.to()`` could not be checked on the CPU; the bit version is exact on both
and is the same code the GPU runs.  float16 / float32 caches use ``.to()`` (RTNE on both).

Semantics and argument docs: :func:`specattn.ops.materialize_kv`.  Precision: see
:mod:`specattn.ops.kv_materialize` (the GEMM output is rounded to the input dtype before the
epilogue; everything after it is float32 with one rounding at the store).
"""
from __future__ import annotations

import os
from typing import Dict, Sequence, Tuple

import torch
import triton
import triton.language as tl

from ._util import bf16_bits, fp8e4m3_bits, gdc_enter, next_pow2, on_tensor_device, pdl_kwargs
from .fused_llama import rms_norm_matmul

__all__ = ["materialize_kv", "materialize_kv_epilogue"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# cache kinds (constexpr CACHE_KIND)
_NATIVE, _BF16_BITS, _FP8_BITS = 0, 1, 2


@triton.jit
def _cast(x, scale, CACHE_KIND: tl.constexpr, out_ty: tl.constexpr):
    if CACHE_KIND == 2:
        return fp8e4m3_bits(x / scale)
    elif CACHE_KIND == 1:
        return bf16_bits(x)
    else:
        return x.to(out_ty)


@triton.jit
def _kv_epilogue_kernel(kv_ptr, kv_ld, bias_ptr, bias_s, w_ptr, w_s0, w_s1, cs_ptr, cs_s0, cs_s1,
                        pos_ptr, pos_s, loc_ptr, loc_s, cache_ptr, off_ptr, num_layers, hkv, D,
                        half, rot, num_slots, max_pos, eps, k_scale, v_scale,
                        HAS_BIAS: tl.constexpr, CACHE_KIND: tl.constexpr, ALIGN: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                        BLOCK_TAIL: tl.constexpr, HAS_TAIL: tl.constexpr,
                        BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    l = tl.program_id(1)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < hkv
    h64 = h.to(tl.int64)

    slot = tl.load(loc_ptr + t * loc_s).to(tl.int64)
    pos = tl.load(pos_ptr + t * pos_s).to(tl.int64)
    # the wrapper validates indices; out-of-range ones are skipped, never dereferenced
    ok = (slot >= 0) & (slot < num_slots) & (pos >= 0) & (pos < max_pos)
    st_m = tl.where(ok, hm, False)  # (not `hm & ok`: the 3.9 interpreter mis-types it)

    koff = tl.load(off_ptr + l)
    voff = tl.load(off_ptr + num_layers + l)
    if ALIGN > 1:
        koff = tl.multiple_of(koff, ALIGN)
        voff = tl.multiple_of(voff, ALIGN)
    dst_row = (slot * hkv + h64) * D  # [BLOCK_H] element offset of (slot, h) in a buffer

    # ---------------- K: RMSNorm over D, then neox RoPE on [0, rot)
    col0 = l.to(tl.int64) * 2 * hkv * D          # first GEMM column of this layer's K
    src_row = kv_ptr + t * kv_ld + col0 + h64 * D  # [BLOCK_H] pointers
    j = tl.arange(0, BLOCK_HALF)
    jm = j < half
    m2 = hm[:, None] & jm[None, :]
    x1 = tl.load(src_row[:, None] + j[None, :], mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(src_row[:, None] + half + j[None, :], mask=m2, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bk = col0 + h64 * D  # [BLOCK_H] bias index of dim 0 of each head
        x1 += tl.load(bias_ptr + (bk[:, None] + j[None, :]) * bias_s, mask=m2,
                      other=0.0).to(tl.float32)
        x2 += tl.load(bias_ptr + (bk[:, None] + half + j[None, :]) * bias_s, mask=m2,
                      other=0.0).to(tl.float32)
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    if HAS_TAIL:
        e = tl.arange(0, BLOCK_TAIL)
        em = e < D - rot
        m3 = hm[:, None] & em[None, :]
        x3 = tl.load(src_row[:, None] + rot + e[None, :], mask=m3, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x3 += tl.load(bias_ptr + (bk[:, None] + rot + e[None, :]) * bias_s, mask=m3,
                          other=0.0).to(tl.float32)
        ss += tl.sum(x3 * x3, axis=1)
    inv = tl.div_rn(1.0, tl.sqrt_rn(ss / D + eps))  # [BLOCK_H]; IEEE, like the reference

    wrow = w_ptr + l.to(tl.int64) * w_s0
    j64 = j.to(tl.int64)                       # column offsets: a view's strides can pass 2**31 / D
    w1 = tl.load(wrow + j64 * w_s1, mask=jm, other=0.0).to(tl.float32)
    w2 = tl.load(wrow + (half + j64) * w_s1, mask=jm, other=0.0).to(tl.float32)
    y1 = x1 * inv[:, None] * w1[None, :]
    y2 = x2 * inv[:, None] * w2[None, :]
    csrow = cs_ptr + tl.where(ok, pos, 0) * cs_s0
    cos = tl.load(csrow + j64 * cs_s1, mask=jm, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(csrow + (half + j64) * cs_s1, mask=jm, other=0.0).to(tl.float32)[None, :]
    o1 = y1 * cos - y2 * sin
    o2 = y2 * cos + y1 * sin

    kdst = cache_ptr + koff + dst_row
    sm2 = st_m[:, None] & jm[None, :]
    tl.store(kdst[:, None] + j[None, :], _cast(o1, k_scale, CACHE_KIND, cache_ptr.dtype.element_ty),
             mask=sm2)
    tl.store(kdst[:, None] + half + j[None, :],
             _cast(o2, k_scale, CACHE_KIND, cache_ptr.dtype.element_ty), mask=sm2)
    if HAS_TAIL:
        w3 = tl.load(wrow + (rot + e.to(tl.int64)) * w_s1, mask=em, other=0.0).to(tl.float32)
        y3 = x3 * inv[:, None] * w3[None, :]
        tl.store(kdst[:, None] + rot + e[None, :],
                 _cast(y3, k_scale, CACHE_KIND, cache_ptr.dtype.element_ty),
                 mask=st_m[:, None] & em[None, :])

    # ---------------- V: cast and store
    colv = col0 + hkv * D
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    mv = hm[:, None] & dm[None, :]
    v = tl.load((kv_ptr + t * kv_ld + colv + h64 * D)[:, None] + d[None, :], mask=mv,
                other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(bias_ptr + ((colv + h64 * D)[:, None] + d[None, :]) * bias_s, mask=mv,
                     other=0.0).to(tl.float32)
    vdst = cache_ptr + voff + dst_row
    tl.store(vdst[:, None] + d[None, :], _cast(v, v_scale, CACHE_KIND, cache_ptr.dtype.element_ty),
             mask=st_m[:, None] & dm[None, :])


# ----------------------------------------------------------------------------- host side
_TABLES: Dict[Tuple, Tuple[torch.Tensor, int]] = {}


def _cache_view(buf: torch.Tensor) -> Tuple[torch.Tensor, int]:
    if buf.dtype == torch.float8_e4m3fn:
        return buf.view(torch.uint8), _FP8_BITS
    if buf.dtype == torch.bfloat16:
        return buf.view(torch.uint16), _BF16_BITS
    return buf, _NATIVE


def offset_table(k_buffers: Sequence[torch.Tensor],
                 v_buffers: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, int]:
    """``(table, align)``: the int64 ``[2L]`` device table of element offsets of
    ``k_buffers + v_buffers`` from ``k_buffers[0]`` (cached per buffer list), and the
    divisibility (in elements) every offset is known to have (16 bytes' worth when every
    buffer is 16-byte aligned, else 1).

    Raises:
        RuntimeError: the table is not cached yet and a CUDA graph is being captured (run one
            eager call with these buffers before capturing).
    """
    bufs = list(k_buffers) + list(v_buffers)
    base = bufs[0]
    ptrs = tuple(b.data_ptr() for b in bufs)
    key = (base.device, base.dtype, ptrs)
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    if base.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("triton materialize_kv: this k_buffers/v_buffers list has no pointer "
                           "table yet and a CUDA graph is being captured; run one eager call "
                           "with the same buffers before capture")
    es = base.element_size()
    offs = []
    for b, p in zip(bufs, ptrs):
        diff = p - ptrs[0]
        if diff % es:
            raise ValueError("cache buffers must be aligned to their element size")
        offs.append(diff // es)
    align = 16 // es if all(p % 16 == 0 for p in ptrs) and es <= 16 else 1
    table = torch.tensor(offs, dtype=torch.int64).to(base.device)
    _TABLES[key] = (table, align)
    return table, align


@on_tensor_device
def materialize_kv_epilogue(kv: torch.Tensor, k_norm_weight: torch.Tensor, positions: torch.Tensor,
                            cos_sin_cache: torch.Tensor, out_cache_loc: torch.Tensor,
                            k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
                            *, eps: float, kv_bias=None, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> None:
    """The epilogue alone: ``kv [T, L*2*Hkv*D]`` (any row stride, unit column stride; the
    other tensors may have any strides) -> norm, RoPE, cast, store into the caches.  One
    launch, no host sync (after the first call per buffer list).  Inputs as validated by
    :func:`specattn.ops.materialize_kv`.

    Raises:
        ValueError: ``kv`` without unit column stride, or cache buffers not aligned to their
            element size.
        RuntimeError: see :func:`offset_table` (first call for a buffer list during capture).
    """
    T = kv.shape[0]
    L = len(k_buffers)
    num_slots, hkv, D = k_buffers[0].shape
    if T == 0:
        return
    if kv.stride(1) != 1:
        raise ValueError(f"kv must have unit column stride, got strides {kv.stride()}")
    max_pos, rot = cos_sin_cache.shape
    half = rot // 2
    table, align = offset_table(k_buffers, v_buffers)
    base, kind = _cache_view(k_buffers[0])
    BLOCK_D = next_pow2(D, 1)
    BLOCK_H = min(next_pow2(hkv, 1), max(1, 1024 // BLOCK_D))
    tail = D - rot
    grid = (T, L, triton.cdiv(hkv, BLOCK_H))
    _kv_epilogue_kernel[grid](
        kv, kv.stride(0), kv if kv_bias is None else kv_bias,
        0 if kv_bias is None else kv_bias.stride(0),
        k_norm_weight, k_norm_weight.stride(0), k_norm_weight.stride(1),
        cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.stride(1),
        positions, positions.stride(0), out_cache_loc, out_cache_loc.stride(0),
        base, table, L, hkv, D, half, rot, num_slots, max_pos,
        float(eps), float(k_scale), float(v_scale),
        HAS_BIAS=kv_bias is not None, CACHE_KIND=kind, ALIGN=align, BLOCK_H=BLOCK_H,
        BLOCK_HALF=next_pow2(half, 1), BLOCK_TAIL=next_pow2(tail, 1), HAS_TAIL=tail > 0, BLOCK_D=BLOCK_D,
        num_warps=4, **pdl_kwargs(kv))


@on_tensor_device
def materialize_kv(hidden: torch.Tensor, w_kv: torch.Tensor, k_norm_weight: torch.Tensor,
                   positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   out_cache_loc: torch.Tensor, k_buffers: Sequence[torch.Tensor],
                   v_buffers: Sequence[torch.Tensor], *, eps: float, kv_bias=None,
                   k_scale: float = 1.0, v_scale: float = 1.0, hidden_norm_weight=None) -> None:
    """Triton :func:`specattn.ops.materialize_kv` (signature of ``materialize_kv_reference``):
    one torch GEMM in the input dtype (with ``hidden_norm_weight``: one
    :func:`~specattn.triton_kernels.fused_llama.rms_norm_matmul`, the norm in its prologue),
    then :func:`materialize_kv_epilogue` (one launch).

    Raises:
        RuntimeError: tensors on the CPU without ``TRITON_INTERPRET=1`` (Triton needs a GPU
            there), or a first call for a buffer list during CUDA-graph capture.
    """
    if hidden.device.type != "cuda" and not _INTERPRET:
        raise RuntimeError(f"triton implementation of materialize_kv unavailable for tensors "
                           f"on {hidden.device} (set TRITON_INTERPRET=1 to run it on the CPU)")
    if hidden.shape[0] == 0:
        return
    kv = torch.mm(hidden, w_kv.t()) if hidden_norm_weight is None else \
        rms_norm_matmul(hidden, hidden_norm_weight, w_kv, eps)
    materialize_kv_epilogue(kv, k_norm_weight, positions, cos_sin_cache, out_cache_loc,
                            k_buffers, v_buffers, eps=eps, kv_bias=kv_bias, k_scale=k_scale,
                            v_scale=v_scale)
