"""Hopper (sm_90) GQA tree verify in Gluon: the softmax of each key tile runs under the PV
GEMM of the previous one.

The Triton kernel of :mod:`.attention` (one program per 128 packed rows, ``tl.dot`` on wgmma)
runs tree verify at 44-50 % of the H100's measured matmul rate, on par with FlashInfer's fa2
prefill.  The exponentials of a ``128 x 128`` tile take about half the time of its two GEMMs
on the SFU, so a kernel that waits for each GEMM before its softmax idles the tensor cores a
third of the time.  This kernel issues the GEMMs asynchronously and orders each iteration as
FlashAttention-3 does (Shah et al., arXiv:2407.08608, section 3.2, "intra-warpgroup
overlapping"; no code copied):

    S_j = Q K_j^T   (async)      O += P_{j-1} V_{j-1}   (async, P from registers)
    wait for S_j;  softmax(S_j) -> P_j, alpha_j   (while the PV GEMM runs)
    wait for the PV GEMM;  O *= alpha_j

Layout (same semantics as :mod:`.attention`, ``forward_batch`` convention):

- CTA = 128 packed rows (token ``j = m // G`` x query head ``kv_head * G + m % G``) of one
  request and KV head, 8 warps: warpgroup ``g`` owns rows ``64 g + [0, 64)`` (wgmma
  ``m64nNk16``, accumulators ``warps_per_cta = [8, 1]``), so the row softmax stays inside a
  warp.  Grid ``(cdiv(max_q * G, 128), Hkv, bs * num_splits)``; tiles past ``n * G`` exit.
- ``q`` in shared memory; keys ``[lo, hi)`` in ``BLOCK_N`` tiles, K and V gathered per
  token through ``req_to_token`` by ``cp.async`` into a 3-stage ring (tile ``j + 1`` streams
  while ``j`` computes; a stage is refilled only after the PV GEMM that read it was waited
  for).  Whole prefix tiles take no mask; the tile holding ``P`` and after test the bound and
  the bit-packed tree rows (``tree_mask[i, j]``, bit ``k % 32`` of word ``k // 32``).
- Split-KV as :mod:`.attention` (split ``s`` covers prefix ``[s c, min((s + 1) c, P))``, the
  last split also the ``n`` draft keys); partials merged by :func:`.attention._merge_kernel`.

Scope (:func:`sm90_tree_verify_supported`): TARGET_VERIFY, bf16/fp16 ``q`` and caches of
one dtype, ``head_dim == v_head_dim`` in (64, 128), an sm_90 GPU; the rest uses
:mod:`.attention`.  :func:`.attention.paged_attention` takes this kernel by default where it
can run and a request has >= 128 packed rows (``max_q * G``).  No host sync.

Measured on an H100 (2026-11-22, GQA 32/8, head_dim 128, bf16, page 1, 64-token trees,
``bench/results/2026-11-22-h100-session6``): 724 / 652 us at bs 64 / P 4096 and bs 16 /
P 16384 (380 / 421 TFLOP/s) vs 856 / 762 us for the Triton kernel and 882 / 807 us for
FlashInfer's prefix + tree split; 26.8 us at bs 1 with 64-key tiles.
Tried and dropped: a warp-specialized form (FA3's layout: 4 loader warps issuing the
``cp.async`` gathers, two compute warpgroups as separate partitions, mbarrier ring, 232
registers per compute thread): correct, but 0.96-1.10x of the split -- slower than this
kernel at every point (``sm90_call3/``).  Each loader thread gathers 32 rows of 16 bytes per
tile behind a synchronous slot-index load, and the compute warpgroups still wait on its
arrivals; FA3 gets its producer for free from TMA, which a per-token gather cannot use.
Also tried and dropped: a deeper schedule (64-key tiles, 4 stages) that issues the score GEMM
of tile ``j + 1`` before the softmax of tile ``j``, so the softmax runs under both GEMMs:
correct (27 GPU tests), spill-free offline, but 839-881 us at the two large points and
29.2 us at bs 1 vs 653-718 / 26.7 us for this schedule (``pipe2_tried/``).
And two CTAs per SM (64-key tiles, a 2-stage ring, 96 KB of shared memory and
``maxnreg=128``, 164 bytes of spills per thread offline): 980 / 952 us at the two large
points and 33.6 us at bs 1 vs 727-747 / 673-684 / 26.3 us (``2026-11-22-h100-session7/
tree_verify_2cta/``).  What bounds this kernel: at the large points the two 128-row CTAs
of a (request, KV head) each gather the whole prefix through ``cp.async``, 2.2 GB at
3.0-3.3 TB/s -- the rate at which the ``cp.async`` MLA kernels also stalled, which TMA
tiles lifted there (:mod:`.attention_mla_sm90`); page-1 gathers cannot use TMA.
"""
from __future__ import annotations

from typing import Optional

import torch

from .attention_mla_sm90 import HAVE_GLUON, sm90_device_needs

if HAVE_GLUON:
    from triton.experimental import gluon
    from .attention_mla_sm90 import _slots, _store_out
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                                   warpgroup_mma,
                                                                   warpgroup_mma_wait)

__all__ = ["sm90_tree_verify", "sm90_tree_verify_supported", "SM90_BLOCK_M"]

SM90_BLOCK_M = 128


def sm90_tree_verify_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               tree_mask: Optional[torch.Tensor]) -> Optional[str]:
    """None when :func:`sm90_tree_verify` can run this call, else why not: one string naming
    every unmet need (a Triton with Gluon, an sm_90 GPU, a tree mask, bf16/fp16 of one dtype,
    ``head_dim == v_head_dim`` in (64, 128)).  Shapes as in :func:`.attention.paged_attention`:
    ``q [T, H, D]``, caches ``[num_slots, Hkv, D]``, ``tree_mask`` int32 or None.  Host-only
    (reads the device's compute capability, no sync)."""
    why = sm90_device_needs(q)
    if tree_mask is None:
        why.append("TARGET_VERIFY (a tree mask)")
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype:
        why.append(f"bf16/fp16 q and caches of one dtype (got {q.dtype} / {k_cache.dtype})")
    if q.shape[-1] not in (64, 128) or v_cache.shape[-1] != q.shape[-1]:
        why.append(f"head_dim == v_head_dim in (64, 128) (got {q.shape[-1]} / {v_cache.shape[-1]})")
    return "; ".join(why) if why else None


if HAVE_GLUON:

    @gluon.jit
    def _kv_copy(k_buf, v_buf, k_base, v_base, slot, start, hi, stride_kt, stride_vt,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, LD: gl.constexpr):
        """cp.async the K and V rows of keys ``start + [0, BLOCK_N)`` (zero past ``hi``) into
        one stage, committed as one group."""
        ok = (start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD)) < hi)[:, None]
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))[None, :]
        s64 = slot.to(gl.int64)[:, None]
        async_copy.async_copy_global_to_shared(k_buf, k_base + s64 * stride_kt + d, mask=ok)
        async_copy.async_copy_global_to_shared(v_buf, v_base + s64 * stride_vt + d, mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _tile_scores(s, start, P, hi, qk_scale, tree_row, row_ok,
                     BLOCK_N: gl.constexpr, S_L: gl.constexpr):
        """Scaled scores of keys ``start + [0, BLOCK_N)``, ``-inf`` where not visible: past
        ``hi``, and for draft keys (``>= P``) where the row's tree bit is clear."""
        if start + BLOCK_N <= gl.minimum(P, hi):  # a whole prefix tile: every key visible
            out = s * qk_scale
        else:
            keys = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
            draft = keys - P
            in_draft = (draft >= 0) & (keys < hi)
            dk = gl.where(in_draft, draft, 0)
            word = gl.load(tree_row[:, None] + (dk // 32)[None, :],
                           mask=row_ok[:, None] & in_draft[None, :], other=0)
            vis = ((keys < gl.minimum(P, hi))[None, :]
                   | (((word >> (dk % 32)[None, :]) & 1) != 0))
            out = gl.where(vis, s * qk_scale, float("-inf"))
        return out

    @gluon.jit
    def _softmax_step(s, m_i, l_i):
        """Online-softmax update for one tile of scaled log2 scores: ``(p, m, l, alpha)``."""
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha

    @gluon.jit
    def _tree_verify_sm90_kernel(
            Q, K, V, O, O_PART, LSE_PART,
            req_to_token, req_pool_indices, seq_lens, qo_indptr, tree_mask,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
            stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
            stride_rtt, stride_tmb, stride_tmj,
            qk_scale,
            GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
            NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr):
        BLOCK_M: gl.constexpr = 128
        dtype: gl.constexpr = K.dtype.element_ty
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                      instr_shape=[16, HEAD_DIM, 16])
        P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [8, 1], [1, 0])
        SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        hk = gl.program_id(1)
        pid2 = gl.program_id(2)
        req = pid2 // NUM_SPLITS
        split = pid2 % NUM_SPLITS
        q_start = gl.load(qo_indptr + req)
        n = gl.load(qo_indptr + req + 1) - q_start
        m0 = gl.program_id(0) * BLOCK_M
        if m0 < n * GROUP:
            P = gl.load(seq_lens + req)
            rtt_row = req_to_token + gl.load(req_pool_indices + req).to(gl.int64) * stride_rtt
            if NUM_SPLITS == 1:
                lo = 0
                hi = P + n
            else:
                chunk = gl.cdiv(gl.cdiv(P, NUM_SPLITS), BLOCK_N) * BLOCK_N
                lo = gl.minimum(split * chunk, P)
                hi = gl.where(split == NUM_SPLITS - 1, P + n, gl.minimum(lo + chunk, P))

            # q rows -> shared memory
            rows_ld = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD))
            d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
            q_rows = ((q_start + rows_ld // GROUP).to(gl.int64) * stride_qt
                      + (hk * GROUP + rows_ld % GROUP) * stride_qh)
            q = gl.load(Q + q_rows[:, None] + d_ld[None, :],
                        mask=(rows_ld < n * GROUP)[:, None], other=0.0)
            q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], SW, q)
            k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], SW)
            v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], SW)
            k_base = K + hk.to(gl.int64) * stride_kh
            v_base = V + hk.to(gl.int64) * stride_vh

            # the rows' tree-mask rows (score layout)
            rows_s = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
            row_ok = rows_s < n * GROUP
            tree_row = (tree_mask + req.to(gl.int64) * stride_tmb
                        + (rows_s // GROUP).to(gl.int64) * stride_tmj)

            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_L))
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=O_L)
            s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)
            p = s_zero
            n_tiles = gl.cdiv(hi - lo, BLOCK_N)

            # prologue: tiles 0 and 1 in flight, tile 2's slots loaded; scores of tile 0
            _kv_copy(k_smem.index(0), v_smem.index(0), k_base, v_base,
                     _slots(rtt_row, lo, hi, BLOCK_N, LD), lo, hi, stride_kt, stride_vt,
                     BLOCK_N, HEAD_DIM, LD)
            _kv_copy(k_smem.index(1), v_smem.index(1), k_base, v_base,
                     _slots(rtt_row, lo + BLOCK_N, hi, BLOCK_N, LD), lo + BLOCK_N, hi,
                     stride_kt, stride_vt, BLOCK_N, HEAD_DIM, LD)
            sl = _slots(rtt_row, lo + 2 * BLOCK_N, hi, BLOCK_N, LD)
            if n_tiles > 0:
                async_copy.wait_group(1)
                fence_async_shared()
                gl.thread_barrier()
                s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
                s = _tile_scores(s, lo, P, hi, qk_scale, tree_row, row_ok, BLOCK_N, S_L)
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i)

            for j in range(1, n_tiles):
                start = lo + j * BLOCK_N
                gl.thread_barrier()  # every warp has waited for the PV GEMM of tile j - 2
                _kv_copy(k_smem.index((j + 1) % STAGES), v_smem.index((j + 1) % STAGES),
                         k_base, v_base, sl, start + BLOCK_N, hi, stride_kt, stride_vt,
                         BLOCK_N, HEAD_DIM, LD)
                sl = _slots(rtt_row, start + 2 * BLOCK_N, hi, BLOCK_N, LD)
                async_copy.wait_group(1)  # tile j has landed
                fence_async_shared()
                gl.thread_barrier()

                s_tok = warpgroup_mma(q_smem, k_smem.index(j % STAGES).permute((1, 0)), s_zero,
                                      use_acc=False, is_async=True)
                p_op = gl.convert_layout(p.to(dtype), P_OP)
                o_tok = warpgroup_mma(p_op, v_smem.index((j - 1) % STAGES), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=[s_tok])
                s = _tile_scores(s, start, P, hi, qk_scale, tree_row, row_ok, BLOCK_N, S_L)
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i)
                acc, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]

            if n_tiles > 0:  # the last tile's PV GEMM
                p_op = gl.convert_layout(p.to(dtype), P_OP)
                acc = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), acc)
            async_copy.wait_group(0)

            # epilogue: normalise, store the output rows or this split's partial + LSE
            rows_o = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
            _store_out(O, O_PART, LSE_PART, acc, gl.convert_layout(m_i, gl.SliceLayout(1, O_L)),
                       gl.convert_layout(l_i, gl.SliceLayout(1, O_L)),
                       (q_start + rows_o // GROUP).to(gl.int64), hk * GROUP + rows_o % GROUP,
                       gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_L)), rows_o < n * GROUP,
                       split, stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls,
                       stride_lt, NUM_SPLITS)


def sm90_tree_verify(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, qo_indptr,
                     tree_mask, max_q: int, sm_scale: float, out, o_part, lse,
                     num_splits: int, block_n: Optional[int] = None) -> None:
    """Launch the Gluon tree-verify kernel (module docstring).  Called by
    :func:`.attention.paged_attention`, which validates every argument and index; after
    :func:`sm90_tree_verify_supported` returned None.

    Args: ``q [T, H, D]`` bf16/fp16; ``k_cache``/``v_cache [num_slots, Hkv, D]`` of ``q``'s
    dtype (``Hkv`` divides ``H``); ``req_to_token`` int32 ``[rows, width]``;
    ``req_pool_indices`` int64 / ``seq_lens`` int32 ``[bs]``; ``qo_indptr`` int32 ``[bs + 1]``;
    ``tree_mask`` int32 ``[bs, >= max_q, ceil(max_q / 32)]``; ``max_q`` the static bound of new
    tokens per request; ``sm_scale`` multiplies ``q . k``; ``out [T, H, D]`` (written);
    with ``num_splits > 1`` float32 ``o_part [S, T, H, D]`` / ``lse [S, T, H]`` (written,
    merged by the caller), else unused; ``block_n`` 64 or 128 keys per tile (None: 64 with
    split-KV, whose splits are short, else 128: the H100 best at the issue's points).
    Raises ValueError for another ``block_n``.  No host sync."""
    D = q.shape[2]
    block_n = block_n or (64 if num_splits > 1 else 128)
    if block_n not in (64, 128):
        raise ValueError(f"sm90 tree verify: block_n must be 64 or 128, got {block_n}")
    bs, H, Hkv = req_pool_indices.shape[0], q.shape[1], k_cache.shape[1]
    G = H // Hkv
    ps = o_part.stride() if num_splits > 1 else (0, 0, 0, 0)
    ls = lse.stride() if num_splits > 1 else (0, 0, 0)
    grid = (-(-(max_q * G) // SM90_BLOCK_M), Hkv, bs * num_splits)
    args = (q, k_cache, v_cache, out, o_part, lse,
            req_to_token, req_pool_indices, seq_lens, qo_indptr, tree_mask,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
            ps[0], ps[1], ps[2], ls[0], ls[1],
            req_to_token.stride(0), tree_mask.stride(0), tree_mask.stride(1),
            sm_scale * 1.4426950408889634)
    _tree_verify_sm90_kernel[grid](*args, GROUP=G, HEAD_DIM=D, BLOCK_N=block_n,
                                   NUM_SPLITS=num_splits, STAGES=3, num_warps=8)
