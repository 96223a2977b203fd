"""Paged MHA/GQA attention for every forward mode: one Triton kernel (+ a split-KV merge).

Used by :class:`specattn.backends.triton_backend.TritonBackend`.  Semantics are the
:mod:`specattn.backends.forward_batch` convention: request ``i`` (``r = req_pool_indices[i]``)
has ``P = prefix_lens[i]`` committed keys and ``n = qo_indptr[i+1] - qo_indptr[i]`` new tokens,
whose K/V are already in the cache; all ``P + n`` keys are at slots
``req_to_token[r, 0 : P + n]``.  Query ``j`` (0-based among the ``n``) sees key position
``p < P`` always (the prefix) and ``p = P + k`` (``0 <= k < n``) when

- ``causal``: ``k <= j`` (EXTEND, DECODE, DRAFT_EXTEND_V2);
- ``tree``: bit ``k % 32`` of word ``k // 32`` of ``tree_mask[i, j]`` (TARGET_VERIFY).

A query that sees no key outputs zeros (only a malformed tree row can cause it).

Kernel layout (after Triton's tutorial ``06-fused-attention``: one program owns a tile of
query rows and streams key tiles through an online softmax in float32)
------------------------------------------------------------------------------------------
- Grid ``(row_tiles, num_kv_heads, bs * num_splits)``.  The rows of a request and KV head are
  its query tokens x the GQA group, packed: row ``m`` is token ``m // G``, query head
  ``kv_head * G + m % G``.  The ``G`` query heads of a KV head therefore share every K/V tile
  load (a decode of G = 8 runs 8 rows, a 64-token tree verify 512 rows = 8 tiles of 64).
  ``row_tiles = cdiv(max_q * G, BLOCK_M)`` uses a *static* ``max_q`` (the batch's
  ``num_tokens_per_req``, 1 for DECODE, the host maximum for EXTEND), so the grid never
  depends on device values; a program whose tile starts past its request's ``n * G`` rows
  exits at once (padded graph requests, short EXTEND requests).
- Keys are gathered per position through ``req_to_token`` (``slot = req_to_token[r, p]``,
  int64 address arithmetic), so a page size > 1 changes nothing: pages only decide which
  slots the allocator hands out, the slot table is per token.
- Phase 1, the prefix ``[0, P)`` in ``BLOCK_N`` tiles: no visibility mask (only the bound
  ``p < P`` on the last tile).  Phase 2, this forward's tokens ``P + [0, n)``: causal rows
  stop at the tile's last token (``k <= j_max``); tree rows load their int32 mask words
  (``[BLOCK_M, BLOCK_N]`` gathers of ``tree_mask[i, j, k // 32]``) and test bit ``k % 32``.
- Scores ``q . k * sm_scale`` in the log2 domain (``exp2``), running max ``m``, running sum
  ``l`` and accumulator in float32; a fully masked tile is harmless (``m = -inf`` handled).
  ``q @ k^T`` and ``p @ v`` use ``tl.dot`` in the cache dtype (bf16/fp16: tensor cores,
  fp32 accumulation; fp32: ``input_precision="ieee"``, no TF32).  An fp8 (e4m3) cache with a
  bf16/fp16 ``q``: the dots run in fp16 -- each K/V tile is converted after its load by
  the hardware's pairwise e4m3 -> f16 conversion (exact: every e4m3 value is an fp16 normal),
  ``q`` once per program (exact for ``|q| < 65504``; bf16 -> fp16 only gains mantissa bits)
  -- and the dequantization scales cost nothing per element (``k_scale`` folds into the
  score scale, ``v_scale`` multiplies the accumulator once before the store).  Any other pair of
  different dtypes upcasts both to fp32.  Output in the output tensor's dtype (``q.dtype``).
- head_dim and v_head_dim are constexprs padded to a power of two >= 16 (64 and 128 exact).

Split-KV (``num_splits > 1``, for DECODE / TARGET_VERIFY / DRAFT_EXTEND_V2 with few
programs): split ``s`` of a request covers prefix positions ``[s * c, min((s + 1) * c, P))``
with ``c = cdiv(cdiv(P, S), BLOCK_N) * BLOCK_N`` computed in-kernel from ``P`` (no host
value), the last split also covers phase 2.  Each split writes its normalised partial output
(float32 ``[S, T, H, Dv]``) and its log2-sum-exp (float32 ``[S, T, H]``, ``-inf`` when it saw
no key); :func:`.attention_common.merge_kernel` (grid ``(T, H)``) combines them:
``o = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max)``.  The workspace comes from
PyTorch's caching allocator per call (inside a CUDA graph capture: the graph's private pool,
so it is static for the graph's life).

No host sync: every launch parameter is a Python int fixed by shapes and static maxima.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._util import (check_attention_dtypes, check_dequant_scales, check_out_apart, check_paged_metadata, check_sm_scale,
                    choose_gluon, gdc_enter, kv_conversion, launch_fitting, next_pow2, on_tensor_device,
                    pdl_kwargs)
from .attention_common import (MASK_CAUSAL, MASK_TREE, check_kernel_config, draft_key_count,
                               draft_visibility, full_update, masked_update, merge_partials,
                               prefix_range, program_request, split_partials, store_rows,
                               tile_rows, tree_mask_arg)
from .attention_sm90 import SM90_BLOCK_M, sm90_tree_verify, sm90_tree_verify_supported
from .gluon_common import int32_offset_needs

__all__ = ["paged_attention", "choose_block_m", "default_config", "check_kernel_config",
           "MHA_CONFIG_KEYS", "SHORT_LOOP_KEYS"]


@triton.jit
def _online_step(acc, m_i, l_i, q, kT, v, vis, qk_scale, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                 CAST_KV: tl.constexpr):
    """One key tile: scores ``q @ kT`` (``[BLOCK_M, BLOCK_N]``) where ``vis``, online
    softmax update of ``(acc, m_i, l_i)``; returns the new triple."""
    if UPCAST:
        kT = kT.to(tl.float32)
        v = v.to(tl.float32)
    elif CAST_KV:
        kT = kT.to(q.dtype)
        v = v.to(q.dtype)
    if IEEE:
        s = tl.dot(q, kT, input_precision="ieee")
    else:
        s = tl.dot(q, kT)
    return masked_update(acc, m_i, l_i, s, vis, qk_scale, v, IEEE)


@triton.jit
def _online_step_full(acc, m_i, l_i, q, kT, v, qk_scale, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                      CAST_KV: tl.constexpr):
    """:func:`_online_step` for a tile every row sees entirely (no mask, scores finite)."""
    if UPCAST:
        kT = kT.to(tl.float32)
        v = v.to(tl.float32)
    elif CAST_KV:
        kT = kT.to(q.dtype)
        v = v.to(q.dtype)
    if IEEE:
        s = tl.dot(q, kT, input_precision="ieee")
    else:
        s = tl.dot(q, kT)
    return full_update(acc, m_i, l_i, s, qk_scale, v, IEEE)


@triton.jit
def _attn_fwd_kernel(
        Q, K, V, O, O_PART, LSE_PART,
        req_to_token, req_pool_indices, prefix_lens, qo_indptr, tree_mask,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
        stride_rtt, stride_tmb, stride_tmj,
        qk_scale, v_scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        IEEE: tl.constexpr, UPCAST: tl.constexpr, CAST_KV: tl.constexpr, SCALE_V: tl.constexpr,
        SLOT_T: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)  # before any load or store (programmatic dependent launch)
    hk = tl.program_id(1)
    req, split, q_start, n = program_request(qo_indptr, NUM_SPLITS)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 >= n * GROUP:
        return
    P, rtt_row, j, g, tok = tile_rows(prefix_lens, req_pool_indices, req_to_token, stride_rtt, req,
                                      q_start, m0, BLOCK_M, GROUP)
    head = hk * GROUP + g
    row_ok = j < n
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < V_DIM

    q = tl.load(Q + tok[:, None] * stride_qt + head.to(tl.int64)[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    elif CAST_KV:  # fp8 cache: the dots run in fp16 (tiles convert by one cvt per pair of values)
        q = q.to(tl.float16)
    k_base = K + hk.to(tl.int64) * stride_kh
    v_base = V + hk.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # ---------------- phase 1: the committed prefix, no visibility mask
    lo, hi = prefix_range(P, split, NUM_SPLITS, BLOCK_N)
    # full tiles without bound checks, then at most one partial tile
    hi_full = lo + ((hi - lo) // BLOCK_N) * BLOCK_N
    for start in range(lo, hi_full, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        slot = tl.load(rtt_row + offs_n).to(SLOT_T)
        kT = tl.load(k_base + slot[None, :] * stride_kt + offs_d[:, None],
                     mask=d_ok[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vt + offs_dv[None, :],
                    mask=dv_ok[None, :], other=0.0)
        acc, m_i, l_i = _online_step_full(acc, m_i, l_i, q, kT, v, qk_scale, IEEE, UPCAST, CAST_KV)
    if hi_full < hi:
        offs_n = hi_full + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        slot = tl.load(rtt_row + offs_n, mask=n_ok, other=0).to(SLOT_T)
        kT = tl.load(k_base + slot[None, :] * stride_kt + offs_d[:, None],
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vt + offs_dv[None, :],
                    mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        acc, m_i, l_i = _online_step(acc, m_i, l_i, q, kT, v, n_ok[None, :], qk_scale, IEEE, UPCAST,
                                     CAST_KV)

    # ---------------- phase 2: this forward's tokens P + [0, n), masked (last split only)
    kv_hi = draft_key_count(n, m0, split, GROUP, BLOCK_M, MASK_MODE, NUM_SPLITS)
    for start in range(0, kv_hi, BLOCK_N):
        offs_k = start + tl.arange(0, BLOCK_N)
        k_ok = offs_k < kv_hi
        slot = tl.load(rtt_row + P + offs_k, mask=k_ok, other=0).to(SLOT_T)
        kT = tl.load(k_base + slot[None, :] * stride_kt + offs_d[:, None],
                     mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vt + offs_dv[None, :],
                    mask=k_ok[:, None] & dv_ok[None, :], other=0.0)
        vis = draft_visibility(tree_mask, stride_tmb, stride_tmj, req, j, row_ok, offs_k, k_ok,
                               MASK_MODE)
        acc, m_i, l_i = _online_step(acc, m_i, l_i, q, kT, v, vis, qk_scale, IEEE, UPCAST, CAST_KV)

    if SCALE_V:
        acc = acc * v_scale
    store_rows(O, O_PART, LSE_PART, acc, m_i, l_i, tok, head, offs_dv,
               row_ok[:, None] & dv_ok[None, :], row_ok, split, stride_ot, stride_oh,
               stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, NUM_SPLITS)


def choose_block_m(max_rows: int) -> int:
    """Row-tile height for ``max_rows = max_q * G`` packed rows: 16, 32 or 64."""
    return min(64, next_pow2(max_rows))


MHA_CONFIG_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "sm90", "pingpong")


SHORT_LOOP_KEYS = 256   # prefix keys per program up to which one unpipelined stage wins


def default_config(max_rows: int, block_d: int, ieee: bool, num_splits: int = 1,
                   max_prefix: Optional[int] = None) -> dict:
    """Kernel config for ``max_rows = max_q * G`` packed rows per (request, KV head), the
    padded head width ``block_d``, fp32 (``ieee``) inputs, the split-KV factor and, when
    known, a host bound ``max_prefix`` of the prefix lengths: ``block_m``, ``block_n``,
    ``num_warps``, ``num_stages``.

    With a bound and fewer than 128 rows (decode, verify and draft-extend sizes), each
    program reads about ``keys = cdiv(max_prefix, num_splits)`` prefix keys, and the loop is
    latency-bound: 16-row tiles (more programs share each K/V tile through L2), and for
    ``keys <= SHORT_LOOP_KEYS`` one pipeline stage with the smallest ``block_n`` (32 to 128)
    that covers the keys in two iterations; past that 128-key tiles in three stages.  An
    H200 sweep in CUDA graphs (SmolLM2's 9 / 3 heads of 64, bf16, merge included): a bs-1
    16-token tree verify over 200 keys in 8 splits 7.8 -> 4.5 us, over 900 keys 8.8 -> 6.1
    us; a 6-token draft extend 5.7 -> 4.4 us; a bs-1 decode 5.4 -> 4.3 us; a bs-16
    16-token verify in one pass 10.0 -> 8.4 us.  Heads of 128 at decode sizes (at
    most 16 rows) take one-stage 128-key tiles instead, so that a split covers at least 128
    keys (the kernels cut the prefix into whole tiles; the splits past the prefix exit at
    once): H200, Llama-3-8B GQA (32 / 8 heads of 128), bs 1 in 16 splits, bf16 / fp8 cache:
    1,024 keys 13.7 / 14.1 us with 32-key tiles, 13.5 / 12.8 with 64, 12.0 / 11.9 with 128;
    2,048 keys 16.2 / 16.1 (64-key tiles) -> 15.2 / 14.6.  Without a bound, and for 128 rows and
    more, the configs of the H100 sweep of ``bench/scripts/attention_sweep.py`` (Triton
    3.6).  The launch lowers ``num_stages`` where a Triton version's pipelining of a config
    outgrows shared memory (:func:`~specattn.triton_kernels._util.launch_fitting`; offline,
    Triton 3.9 sizes the 128 x 128 four-stage tile at 288 KB, over the H100's 227 KB)."""
    if ieee or block_d > 128:
        return dict(block_m=min(64, choose_block_m(max_rows)), block_n=32, num_warps=4, num_stages=2)
    if max_rows >= 128:  # compute-bound rows (tree verify, extend)
        if num_splits > 1:  # short loops per program: a shallower pipeline
            return dict(block_m=128, block_n=64, num_warps=8, num_stages=2)
        return dict(block_m=128, block_n=128, num_warps=8, num_stages=4)
    if max_prefix is not None:
        keys = -(-max(int(max_prefix), 1) // max(num_splits, 1))
        if keys <= SHORT_LOOP_KEYS:
            block_n = 128 if block_d >= 128 and max_rows <= 16 else min(128, max(32, next_pow2(-(-keys // 2))))
            return dict(block_m=16, block_n=block_n, num_warps=4, num_stages=1)
        return dict(block_m=16, block_n=128, num_warps=4, num_stages=3)
    return dict(block_m=choose_block_m(max_rows), block_n=128 if max_rows <= 16 else 64,
                num_warps=4, num_stages=4)


@on_tensor_device
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                    prefix_lens: torch.Tensor, qo_indptr: torch.Tensor,
                    tree_mask: Optional[torch.Tensor], max_q: int, sm_scale: float,
                    num_splits: int = 1, out: Optional[torch.Tensor] = None, *,
                    block_m: Optional[int] = None, block_n: Optional[int] = None,
                    num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                    off32: Optional[bool] = None, sm90: Optional[bool] = None,
                    pingpong: Optional[bool] = None, page_size: int = 1,
                    check_bounds: bool = True, max_prefix: Optional[int] = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Attention of ``q`` over the paged cache (module docstring: semantics, layout).

    Args:
        q: ``[T, H, Dqk]`` fp32/bf16/fp16, last dim contiguous; ``T = qo_indptr[-1]`` (the
            kernel reads only rows named by ``qo_indptr``).
        k_cache, v_cache: ``[num_slots, Hkv, Dqk]`` / ``[num_slots, Hkv, Dv]``, one dtype
            (fp32/bf16/fp16, or ``float8_e4m3fn`` holding ``x / scale``), last dim
            contiguous; ``Hkv`` divides ``H``.
        req_to_token: int32 ``[rows, width]``, last dim contiguous.
        req_pool_indices: int64 ``[bs]``; prefix_lens: int32 ``[bs]`` (``P``, committed keys);
        qo_indptr: int32 ``[bs + 1]`` (token offsets of each request's ``n`` new tokens).
        tree_mask: int32 ``[bs, D, ceil(D/32)]`` (TARGET_VERIFY: tree visibility among the
            new tokens) or None (causal).
        max_q: static upper bound of ``n`` over the batch (sizes the grid): the backend
            passes ``num_tokens_per_req`` (fixed per mode and graph) or the eager batch's true
            maximum.  Checked with ``check_bounds``.
        sm_scale: multiplies ``q . k`` before the softmax (a finite float > 0).
        num_splits: split-KV factor over the prefix (1: single pass).
        out: optional ``[T, H, Dv]`` output (dtype of ``q`` unless given).
        block_m, block_n, num_warps, num_stages: kernel config overrides (powers of two,
            ``block_m``/``block_n`` >= 16; tuning sweeps); None = the defaults of
            :func:`default_config`.
        off32: int32 slot address offsets (None: whenever every cache element offset fits
            in 31 bits; False forces int64, True is ignored when they do not fit).
        sm90: run TARGET_VERIFY on the Gluon kernel of :mod:`.attention_sm90` (each tile's
            softmax runs under the previous tile's PV GEMM; ``block_n`` 64 or 128, only 64
            over an fp8 cache, which only the ping-pong schedule reads; the other config keys
            do not apply).  True raises ValueError where
            :func:`~.attention_sm90.sm90_tree_verify_supported` says it cannot run or another
            config key is set; None (default) uses it where it can run, no other key is set
            and a request fills its 128-row tile (``max_q * G >= 128``; below that the Triton
            kernel's smaller row tiles waste less); False never.
        pingpong: with the Gluon kernel, its warp-specialized ping-pong schedule (default,
            None or True: a loader partition and two warpgroups taking turns on the tensor
            cores, FlashAttention-3's) or, False, the synchronous one.  ``pingpong=True``
            raises ValueError where the Gluon kernel does not run (also when ``sm90`` is None
            and the call has no tree mask or fewer than 128 packed rows per request).
        page_size: the pools' page size, a promise on ``req_to_token`` that the kernel
            cannot check: token ``p`` of a request at offset ``p % page_size`` of its page
            (the layout of :mod:`~specattn.backends.pools`).  A multiple of 16 lets the
            ping-pong Gluon kernel copy each whole 64-key tile that starts at a page boundary
            by TMA, one box per run of consecutive slots from the slot of its first key;
            1 (default): one slot per key, any layout.
        check_bounds: check every index the kernel follows before launching (one host read,
            skipped during CUDA-graph capture; see
            :func:`~specattn.triton_kernels._util.check_paged_metadata`).  Backends that
            validated the batch pass False.
        max_prefix: a host bound of ``prefix_lens`` (None: unknown), used only to pick the
            default tiles (:func:`default_config`); results never depend on it, and a
            prefix past it is still read whole.
        k_scale, v_scale: dequantization scales of an fp8 cache (key ``p``'s K is
            ``k_cache[slot].float() * k_scale``); 1.0 for other caches.
    Returns:
        ``[T, H, Dv]`` in ``q.dtype`` (or ``out``).  With ``num_splits == 1`` rows of no
        request are left untouched; with splits the merge writes all ``T`` rows, so every row
        must belong to a request (``qo_indptr[-1] == T``, as every ForwardBatch has).
    Raises:
        ValueError: inconsistent shapes, dtypes or devices; a ``tree_mask`` smaller than
            ``[bs, max_q, ceil(max_q/32)]``; with ``check_bounds``, an index out of range
            (a request with more than ``max_q`` new tokens, rows or slots outside the tables);
            ``sm90=True`` where its needs are not met; ``page_size`` not an int >= 1;
            ``max_prefix`` neither None nor an int >= 0; an ``sm_scale`` that is not a finite
            float > 0; a dequantization scale that is not a finite float > 0, or not 1.0 for a
            cache that is not fp8.
    """
    sm_scale = check_sm_scale(sm_scale)
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if max_prefix is not None and (not isinstance(max_prefix, int) or isinstance(max_prefix, bool)
                                   or max_prefix < 0):
        raise ValueError(f"max_prefix must be None or an int >= 0, got {max_prefix!r}")
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(f"q, k_cache and v_cache must be 3-D, got {list(q.shape)} / {list(k_cache.shape)} / "
                         f"{list(v_cache.shape)}")
    T, H, Dqk = q.shape
    Hkv, Dv = k_cache.shape[1], v_cache.shape[2]
    bs = req_pool_indices.shape[0]
    if k_cache.shape[2] != Dqk or H % Hkv or v_cache.shape[1] != Hkv:
        raise ValueError(f"q {list(q.shape)} does not fit caches {list(k_cache.shape)} / {list(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must share a dtype")
    if v_cache.shape[0] != k_cache.shape[0]:
        raise ValueError(f"k_cache has {k_cache.shape[0]} slots, v_cache {v_cache.shape[0]}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("q, caches and req_to_token need a contiguous last dim")
    check_attention_dtypes(q, k_cache, out, (T, H, Dv))
    check_out_apart(out, k_cache=k_cache, v_cache=v_cache)
    check_paged_metadata(q, req_to_token, req_pool_indices, prefix_lens, qo_indptr, tree_mask, max_q,
                         num_splits, k_cache.shape[0], check_bounds, page_size)
    G = H // Hkv
    if out is None:
        out = torch.empty(T, H, Dv, dtype=q.dtype, device=q.device)
    if bs == 0 or T == 0 or max_q == 0:
        return out
    k_scale, v_scale = check_dequant_scales(k_cache.dtype, k_scale=k_scale, v_scale=v_scale)
    upcast, cast_kv = kv_conversion(q.dtype, k_cache.dtype)
    ieee = upcast or k_cache.dtype == torch.float32
    BLOCK_D, BLOCK_DV = next_pow2(Dqk), next_pow2(Dv)
    cfg = default_config(max_q * G, max(BLOCK_D, BLOCK_DV), ieee, num_splits, max_prefix)
    overrides = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    check_kernel_config({**overrides, "sm90": sm90, "pingpong": pingpong}, MHA_CONFIG_KEYS)
    if sm90 or (sm90 is None and tree_mask is not None and max_q * G >= SM90_BLOCK_M):
        conflicts = [k for k in ("block_m", "num_warps", "num_stages") if overrides[k] is not None]
        if block_n not in (None, 64, 128):
            conflicts.append(f"block_n={block_n}")
        why = sm90_tree_verify_supported(q, k_cache, v_cache, tree_mask, pingpong is not False)
        why = "; ".join(([why] if why else []) + int32_offset_needs(q, out, tree_mask, max_q)) or None
    else:
        conflicts = []
        why = ("sm90=False" if sm90 is False
               else f"a tree mask and >= {SM90_BLOCK_M} packed rows per request")
    use_sm90 = choose_gluon(sm90, why, conflicts, "pingpong", pingpong)
    if use_sm90:
        o_part, lse, _, _ = split_partials(num_splits, T, H, Dv, out, prefix_lens)
        sm90_tree_verify(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens,
                         qo_indptr, tree_mask, max_q, sm_scale, out, o_part, lse, num_splits,
                         block_n, pingpong=pingpong is not False, page_size=page_size,
                         k_scale=k_scale, v_scale=v_scale)
        if num_splits > 1:
            merge_partials(o_part, lse, out, num_splits, Dv, BLOCK_DV, 1 if BLOCK_DV <= 64 else 2)
        return out
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    BLOCK_M, BLOCK_N = cfg["block_m"], cfg["block_n"]
    # int32 slot offsets when the largest element offset of both caches fits in 31 bits
    fits = all(c.shape[0] * c.stride(0) + c.shape[1] * c.stride(1) < 2**31 for c in (k_cache, v_cache))
    off32 = fits if off32 is None else (bool(off32) and fits)
    grid = (triton.cdiv(max_q * G, BLOCK_M), Hkv, bs * num_splits)
    o_part, lse, ps, ls = split_partials(num_splits, T, H, Dv, out, prefix_lens)
    tm, tm_strides = tree_mask_arg(tree_mask, prefix_lens)
    launch_fitting(_attn_fwd_kernel, grid, (
        q, k_cache, v_cache, out, o_part, lse,
        req_to_token, req_pool_indices, prefix_lens, qo_indptr, tm,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        ps[0], ps[1], ps[2], ls[0], ls[1],
        req_to_token.stride(0), tm_strides[0], tm_strides[1],
        sm_scale * k_scale * 1.4426950408889634, v_scale), dict(
        GROUP=G, HEAD_DIM=Dqk, V_DIM=Dv, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        MASK_MODE=MASK_TREE if tree_mask is not None else MASK_CAUSAL,
        NUM_SPLITS=num_splits, IEEE=ieee, UPCAST=upcast, CAST_KV=cast_kv, SCALE_V=v_scale != 1.0,
        SLOT_T=tl.int32 if off32 else tl.int64,
        num_warps=cfg["num_warps"], **pdl_kwargs(q)), cfg["num_stages"])
    if num_splits > 1:
        merge_partials(o_part, lse, out, num_splits, Dv, BLOCK_DV, 1 if BLOCK_DV <= 64 else 2)
    return out
