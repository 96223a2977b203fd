"""Hopper (sm_90) GQA tree verify in Gluon: two schedules of one CTA layout.

Why a second kernel: the Triton kernel of :mod:`.attention` issues each tile's GEMMs and then
waits for them before its softmax, and the exponentials of a score tile take about half the
time of its two GEMMs on the SFU, so the tensor cores idle during every softmax.  Gluon
(Triton's explicit-layout dialect) lets the kernel overlap them.  Measurements, what limits
the kernel and the variants that did not help: ``docs/attention.md``.

Common layout (same semantics as :mod:`.attention`, ``forward_batch`` convention):

- CTA = 128 packed rows (token ``j = m // G`` x query head ``kv_head * G + m % G``) of one
  request and KV head; warpgroup ``g`` owns rows ``64 g + [0, 64)`` (wgmma ``m64nNk16``), so
  the row softmax stays inside a warp.  Grid ``(cdiv(max_q * G, 128), Hkv, bs *
  num_splits)``; CTAs past ``n * G`` exit.
- ``q`` in shared memory (the ping-pong warpgroups then load theirs into registers, the score
  GEMM's A operand, so the GEMM reads only K from shared memory); keys ``[lo, hi)`` in
  ``BLOCK_N`` tiles, K and V gathered per token through ``req_to_token`` by ``cp.async``
  (rows past ``hi`` zero-filled).  The ping-pong kernel with ``page_size`` a multiple of 16
  copies a whole 64-key tile that starts at a page boundary by TMA instead: for each run of
  ``R`` consecutive slots (``R`` = 64, 32 or 16, the largest dividing the page size),
  ``[R, 64]`` boxes from the slot of its first key (``req_to_token``) over the cache viewed
  ``[num_slots, Hkv * D]``; a partial tile and the tiles of a last split starting off a page
  boundary stay on ``cp.async``.  Whole prefix tiles take no mask; the tile holding ``P``
  and after test the bound and the bit-packed tree rows (``tree_mask[i, j]``, bit ``k % 32``
  of word ``k // 32``).
- Online softmax in float32, log2 domain, the scale folded into the exponent's argument
  (one FFMA per score, :func:`_softmax_step`).
- Split-KV as :mod:`.attention` (split ``s`` covers prefix ``[s c, min((s + 1) c, P))``, the
  last split also the ``n`` draft keys); partials merged by
  :func:`.attention_common.merge_kernel`.

**Ping-pong** (:func:`_tree_verify_ws_kernel`, the default), FlashAttention-3's schedule
(Shah et al., arXiv:2407.08608, sections 3.1-3.2; no code copied), warp-specialized into two
4-warp compute partitions and a loader on mbarriers: the loader gathers ``q`` once and every
K/V tile into a 6-stage ring of 64-key tiles (each loader thread's ``cp.async`` arrives on
the stage's full barrier when it lands, so the loader never waits for its own copies; a
stage is refilled once both warpgroups released it); the two compute warpgroups take turns
on the tensor cores (a turn barrier each): on its turn a warpgroup issues the score GEMM of
tile ``j`` and the PV GEMM of tile ``j - 1``, hands the turn over, and runs the softmax of
tile ``j`` under the other warpgroup's pair.  ptxas places the wait for the warpgroup's own
PV GEMM at the start of the softmax (later places measured slower), so the softmax does not
run under its own PV GEMM.

- Tile order: with TMA tiles (pages of a multiple of 16) both partitions take a CTA's tiles
  holding ``P`` or draft keys first, then its whole prefix tiles, so that the compute's main
  loop has no mask code (:func:`_tile_order`, ``masked_first``); the per-key gather keeps
  tile order (there the reordering measured slower).
- Loader: 8 warps for the per-key gather (32 registers a thread, the compute 224, launched
  with ``maxnreg=128``), loading each tile's slots just before its copies (none carried
  between tiles, no spill); 4 warps with TMA tiles (40 registers, the compute 232,
  ``maxnreg=168``).  64-key tiles: 128-key tiles (opt-in, three stages) spill.

**Synchronous** (:func:`_tree_verify_sm90_kernel`, ``pingpong=False``), 8 warps, each
iteration ordered as FlashAttention-3's intra-warpgroup overlap::

    S_j = Q K_j^T   (async)      O += P_{j-1} V_{j-1}   (async, P from registers)
    wait for S_j;  softmax(S_j) -> P_j, alpha_j   (while the PV GEMM runs)
    wait for the PV GEMM;  O *= alpha_j

with a 3-stage ring (tile ``j + 1`` streams while ``j`` computes) refilled behind CTA-wide
barriers, so both warpgroups run in lockstep: their score GEMMs run together and nothing
hides them.  That is the PTX's order; in the SASS (64-key tiles) ptxas moves the wait for the
PV GEMM up to the start of the softmax, as in the ping-pong kernel, so the softmax does not
in fact run under it.

**fp8 (e4m3) caches** (ping-pong only, :func:`_tv_loader_fp8`): wgmma takes no bf16 x fp8
pair, so the loader widens each tile before the warpgroups see it.  Its 8 warps ``cp.async``
the raw rows into a 3-stage fp8 ring two tiles ahead (each tile's slots loaded an iteration
earlier), read back the bytes each thread copied once they land, convert them to fp16 in
registers (exact, one conversion per pair) and store them into a 4-stage fp16 ring of the
layout above; ``q`` goes to fp16 once and the compute partitions run in fp16 (``P`` rounded
to fp16 for the PV GEMM; ``k_scale`` folds into the score scale, ``v_scale`` multiplies the
accumulator once).  The pool is read as fp8 once and never widened in global memory.
Widening to bf16 instead (a second conversion per element: sm_90 has no e4m3 -> bf16 one)
left the loader the bottleneck, 0.72-0.79x the bf16 cache's speed against 0.90-1.02x with
fp16 tiles (H200, the attention suite's four points).

Scope (:func:`sm90_tree_verify_supported`): TARGET_VERIFY, bf16/fp16 ``q`` with caches of
its dtype or (ping-pong) fp8 e4m3, ``head_dim == v_head_dim`` in (64, 128), an sm_90 GPU; the
rest uses :mod:`.attention`.  :func:`.attention.paged_attention` takes this module by default
where it can run and a request has >= 128 packed rows (``max_q * G``).  No host sync.
"""
from __future__ import annotations

from typing import Optional

import torch

from .gluon_common import HAVE_GLUON, sm90_device_needs

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                                   mbarrier, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from .gluon_common import SW128, load_slots, store_out

__all__ = ["sm90_tree_verify", "sm90_tree_verify_supported", "SM90_BLOCK_M"]

SM90_BLOCK_M = 128


def sm90_tree_verify_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               tree_mask: Optional[torch.Tensor],
                               pingpong: bool = True) -> Optional[str]:
    """None when :func:`sm90_tree_verify` can run this call, else why not: one string naming
    every unmet need (a Triton with Gluon, an sm_90 GPU, a tree mask, bf16/fp16 ``q`` with
    caches of its dtype or, with the ping-pong schedule (``pingpong``), fp8 e4m3 caches,
    ``head_dim == v_head_dim`` in (64, 128)).  Shapes as in :func:`.attention.paged_attention`:
    ``q [T, H, D]``, caches ``[num_slots, Hkv, D]``, ``tree_mask`` int32 or None.  Host-only
    (reads the device's compute capability, no sync)."""
    why = sm90_device_needs(q)
    if tree_mask is None:
        why.append("TARGET_VERIFY (a tree mask)")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if q.dtype not in (torch.bfloat16, torch.float16) or (k_cache.dtype != q.dtype and not fp8):
        why.append(f"bf16/fp16 q and caches of its dtype or fp8 e4m3 (got {q.dtype} / "
                   f"{k_cache.dtype})")
    elif fp8 and not pingpong:
        why.append("the ping-pong schedule for an fp8 cache (pingpong=False asked for the "
                   "synchronous one)")
    if q.shape[-1] not in (64, 128) or v_cache.shape[-1] != q.shape[-1]:
        why.append(f"head_dim == v_head_dim in (64, 128) (got {q.shape[-1]} / {v_cache.shape[-1]})")
    return "; ".join(why) if why else None


if HAVE_GLUON:

    @gluon.jit
    def _rows_copy(buf, base, slot, start, hi, stride_t,
                   BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, LD: gl.constexpr):
        """``cp.async`` the rows (``slot``, in ``LD``'s rows) of keys ``start + [0, BLOCK_N)``
        into ``buf``; rows past ``hi`` are zero-filled, never read."""
        ok = (start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD)) < hi)[:, None]
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))[None, :]
        async_copy.async_copy_global_to_shared(buf, base + slot.to(gl.int64)[:, None] * stride_t + d,
                                               mask=ok)

    @gluon.jit
    def _kv_copy(k_buf, v_buf, k_base, v_base, slot, start, hi, stride_kt, stride_vt,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, LD: gl.constexpr):
        """The K and V rows of keys ``start + [0, BLOCK_N)`` into one stage, one commit group."""
        _rows_copy(k_buf, k_base, slot, start, hi, stride_kt, BLOCK_N, HEAD_DIM, LD)
        _rows_copy(v_buf, v_base, slot, start, hi, stride_vt, BLOCK_N, HEAD_DIM, LD)
        async_copy.commit_group()

    @gluon.jit
    def _tv_keys(prefix_lens, req_to_token, req_pool_indices, req, split, n, stride_rtt,
                 BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr):
        """A CTA's keys: ``(P, rtt_row, lo, hi)`` -- the request's prefix length, its
        ``req_to_token`` row, and its split's key range ``[lo, hi)``."""
        P = gl.load(prefix_lens + req)
        rtt_row = req_to_token + gl.load(req_pool_indices + req).to(gl.int64) * stride_rtt
        if NUM_SPLITS == 1:
            lo = 0
            hi = P + n
        else:
            chunk = gl.cdiv(gl.cdiv(P, NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = gl.minimum(split * chunk, P)
            hi = gl.where(split == NUM_SPLITS - 1, P + n, gl.minimum(lo + chunk, P))
        return P, rtt_row, lo, hi

    @gluon.jit
    def _tile_order(P, lo, hi, BLOCK_N: gl.constexpr):
        """``(n_whole, n_masked)``: the CTA's whole prefix tiles and the tiles after them
        (holding ``P`` or draft keys).  With ``MASKED_FIRST`` (the default with TMA tiles)
        both partitions visit the masked tiles first, then the whole ones: iteration ``i``
        takes tile ``n_whole + i`` for ``i < n_masked``, else ``i - n_masked`` (written out in
        the loader and the compute rather than shared: a helper changed the TMA loader's
        compiled code)."""
        n_whole = (gl.minimum(P, hi) - lo) // BLOCK_N
        return n_whole, gl.cdiv(hi - lo, BLOCK_N) - n_whole

    @gluon.jit
    def _tile_scores(s, start, P, hi, tree_row, row_ok,
                     BLOCK_N: gl.constexpr, S_L: gl.constexpr):
        """Scores (unscaled) of keys ``start + [0, BLOCK_N)``, ``-inf`` where not visible: past
        ``hi``, and for draft keys (``>= P``) where the row's tree bit is clear."""
        if start + BLOCK_N <= gl.minimum(P, hi):  # a whole prefix tile: every key visible
            out = s
        else:
            keys = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
            draft = keys - P
            in_draft = (draft >= 0) & (keys < hi)
            dk = gl.where(in_draft, draft, 0)
            word = gl.load(tree_row[:, None] + (dk // 32)[None, :],
                           mask=row_ok[:, None] & in_draft[None, :], other=0)
            vis = ((keys < gl.minimum(P, hi))[None, :]
                   | (((word >> (dk % 32)[None, :]) & 1) != 0))
            out = gl.where(vis, s, float("-inf"))
        return out

    @gluon.jit
    def _softmax_step(x, m_i, l_i, qk_scale):
        """Online-softmax update for one tile of unscaled scores ``x`` (``qk_scale`` > 0 takes
        them to log2 units): ``(p, m, l, alpha)``.  The scale is folded into the exponent's
        argument, one FFMA per score (``x * qk_scale - m``)."""
        m_new = gl.maximum(m_i, gl.max(x, axis=1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(x * qk_scale - m_use[:, None])
        return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha

    @gluon.jit
    def _tree_verify_sm90_kernel(
            Q, K, V, O, O_PART, LSE_PART,
            req_to_token, req_pool_indices, prefix_lens, qo_indptr, tree_mask,
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
        SW: gl.constexpr = SW128  # the TMA descriptors' layout too

        hk = gl.program_id(1)
        pid2 = gl.program_id(2)
        req = pid2 // NUM_SPLITS
        split = pid2 % NUM_SPLITS
        q_start = gl.load(qo_indptr + req)
        n = gl.load(qo_indptr + req + 1) - q_start
        m0 = gl.program_id(0) * BLOCK_M
        if m0 < n * GROUP:
            P, rtt_row, lo, hi = _tv_keys(prefix_lens, req_to_token, req_pool_indices, req, split, n,
                                          stride_rtt, BLOCK_N, NUM_SPLITS)

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
                     load_slots(rtt_row, lo, hi, BLOCK_N, LD), lo, hi, stride_kt, stride_vt,
                     BLOCK_N, HEAD_DIM, LD)
            _kv_copy(k_smem.index(1), v_smem.index(1), k_base, v_base,
                     load_slots(rtt_row, lo + BLOCK_N, hi, BLOCK_N, LD), lo + BLOCK_N, hi,
                     stride_kt, stride_vt, BLOCK_N, HEAD_DIM, LD)
            sl = load_slots(rtt_row, lo + 2 * BLOCK_N, hi, BLOCK_N, LD)
            if n_tiles > 0:
                async_copy.wait_group(1)
                fence_async_shared()
                gl.thread_barrier()
                s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
                s = _tile_scores(s, lo, P, hi, tree_row, row_ok, BLOCK_N, S_L)
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)

            for j in range(1, n_tiles):
                start = lo + j * BLOCK_N
                gl.thread_barrier()  # every warp has waited for the PV GEMM of tile j - 2
                _kv_copy(k_smem.index((j + 1) % STAGES), v_smem.index((j + 1) % STAGES),
                         k_base, v_base, sl, start + BLOCK_N, hi, stride_kt, stride_vt,
                         BLOCK_N, HEAD_DIM, LD)
                sl = load_slots(rtt_row, start + 2 * BLOCK_N, hi, BLOCK_N, LD)
                async_copy.wait_group(1)  # tile j has landed
                fence_async_shared()
                gl.thread_barrier()

                s_tok = warpgroup_mma(q_smem, k_smem.index(j % STAGES).permute((1, 0)), s_zero,
                                      use_acc=False, is_async=True)
                p_op = gl.convert_layout(p.to(dtype), P_OP)
                o_tok = warpgroup_mma(p_op, v_smem.index((j - 1) % STAGES), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=[s_tok])
                s = _tile_scores(s, start, P, hi, tree_row, row_ok, BLOCK_N, S_L)
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)
                acc, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]

            if n_tiles > 0:  # the last tile's PV GEMM
                p_op = gl.convert_layout(p.to(dtype), P_OP)
                acc = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), acc)
            async_copy.wait_group(0)

            # epilogue: normalise, store the output rows or this split's partial + LSE
            rows_o = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
            store_out(O, O_PART, LSE_PART, acc, gl.convert_layout(m_i, gl.SliceLayout(1, O_L)),
                      gl.convert_layout(l_i, gl.SliceLayout(1, O_L)),
                      (q_start + rows_o // GROUP).to(gl.int64), hk * GROUP + rows_o % GROUP,
                      gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_L)), rows_o < n * GROUP,
                      split, stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls,
                      stride_lt, NUM_SPLITS)


    # ---- warp-specialized ping-pong schedule ----
    # mbarriers, [2 * STAGES + 2]: stage (its K/V landed: one cp.async arrival per loader
    # thread), STAGES + stage (both warpgroups are done with it), 2 * STAGES + wg (wg's turn
    # to issue its GEMMs).  LW: the loader's warps (8 for the per-key gather, 4 with TMA).

    @gluon.jit
    def _cp_tile(k_buf, v_buf, bar, K, V, sl, start, hi, stride_kt, stride_vt,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, LD: gl.constexpr):
        """``cp.async`` a tile's K and V rows; each thread's copies arrive on ``bar``."""
        _rows_copy(k_buf, K, sl, start, hi, stride_kt, BLOCK_N, HEAD_DIM, LD)
        _rows_copy(v_buf, V, sl, start, hi, stride_vt, BLOCK_N, HEAD_DIM, LD)
        async_copy.mbarrier_arrive(bar, increment_count=False)

    @gluon.jit
    def _tma_tile(k_desc, v_desc, k_buf, v_buf, bar, slots, hk,
                  HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, ROWS: gl.constexpr,
                  LW: gl.constexpr):
        """TMA a whole tile made of runs of ``ROWS`` consecutive slots (pages of ``ROWS`` or a
        multiple): per run, ``[ROWS, 64]`` boxes from the slot of its first key
        (``slots``: the tile's ``req_to_token`` entries).  The arrivals match ``_cp_tile``'s
        (one per loader thread) plus the bytes.  Each thread's earlier ``cp.async`` copies
        (``q`` before the first tile) still hold the phase until they land (a counted
        ``cp.async`` arrival: +1 now, -1 when they complete)."""
        async_copy.mbarrier_arrive(bar, increment_count=True)
        mbarrier.arrive(bar, count=LW * 32 - 1)
        mbarrier.expect(bar, 2 * BLOCK_N * HEAD_DIM * 2)
        for r in gl.static_range(BLOCK_N // ROWS):
            slot0 = gl.load(slots + r * ROWS)
            for b in gl.static_range(HEAD_DIM // 64):
                col = hk * HEAD_DIM + b * 64
                tma.async_copy_global_to_shared(
                    k_desc, [slot0, col], bar, k_buf.slice(r * ROWS, ROWS).slice(b * 64, 64, dim=1))
                tma.async_copy_global_to_shared(
                    v_desc, [slot0, col], bar, v_buf.slice(r * ROWS, ROWS).slice(b * 64, 64, dim=1))

    @gluon.jit
    def _q_copy(q_smem, Q, q_start, n, m0, hk, stride_qt, stride_qh, GROUP: gl.constexpr,
                HEAD_DIM: gl.constexpr, LD: gl.constexpr):
        """``cp.async`` each warpgroup's 64 packed rows of ``q`` into ``q_smem[wg]`` (rows past
        ``n * GROUP`` zero-filled)."""
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
        for h in gl.static_range(2):
            rows = m0 + h * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, LD))
            q_rows = ((q_start + rows // GROUP).to(gl.int64) * stride_qt
                      + (hk * GROUP + rows % GROUP) * stride_qh)
            async_copy.async_copy_global_to_shared(q_smem.index(h), Q + q_rows[:, None] + d[None, :],
                                                   mask=(rows < n * GROUP)[:, None])

    @gluon.jit
    def _tv_loader(q_smem, k_smem, v_smem, bars, Q, K, V, O, O_PART, LSE_PART, rtt_row,
                   tree_base, q_start, n, m0, hk, split, P, lo, hi, n_tiles,
                   stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh, stride_ps,
                   stride_pt, stride_ph, stride_ls, stride_lt, stride_tmj, qk_scale,
                   k_desc, v_desc,
                   GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                   NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr, TMA_ROWS: gl.constexpr,
                   LW: gl.constexpr, MASKED_FIRST: gl.constexpr):
        """Loader partition: ``q`` once, then each key tile's K and V rows by ``cp.async``
        into stage ``t % STAGES`` once both warpgroups freed it; each thread's copies arrive
        on the stage's full barrier when they land.  The gather loads a tile's slots just
        before its copies; with ``TMA_ROWS`` (pages of a multiple of 16 slots) a whole tile at
        a page boundary comes by TMA instead (``_tma_tile``), and the slots for the other
        tiles are loaded a tile ahead."""
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [LW, 1],
                                            [1, 0])
        _q_copy(q_smem, Q, q_start, n, m0, hk, stride_qt, stride_qh, GROUP, HEAD_DIM, LD)
        if MASKED_FIRST:  # the compute's order (``_tile_order``): masked tiles first
            n_whole, n_masked = _tile_order(P, lo, hi, BLOCK_N)
        if TMA_ROWS > 0:
            if MASKED_FIRST:
                sl = load_slots(rtt_row, lo + gl.where(n_masked > 0, n_whole, 0) * BLOCK_N, hi,
                                BLOCK_N, LD)
            else:
                sl = load_slots(rtt_row, lo, hi, BLOCK_N, LD)
        for t in range(n_tiles):
            st = t % STAGES
            mbarrier.wait(bars.index(STAGES + st), ((t // STAGES) & 1) ^ 1)
            if MASKED_FIRST:
                start = lo + gl.where(t < n_masked, n_whole + t, t - n_masked) * BLOCK_N
            else:
                start = lo + t * BLOCK_N
            if TMA_ROWS > 0:  # a whole tile at a page boundary: runs of consecutive slots
                if (start % TMA_ROWS == 0) & (start + BLOCK_N <= hi):
                    _tma_tile(k_desc, v_desc, k_smem.index(st), v_smem.index(st), bars.index(st),
                              rtt_row + start, hk, HEAD_DIM, BLOCK_N, TMA_ROWS, LW)
                else:
                    _cp_tile(k_smem.index(st), v_smem.index(st), bars.index(st), K, V, sl, start,
                             hi, stride_kt, stride_vt, BLOCK_N, HEAD_DIM, LD)
                if MASKED_FIRST:
                    nxt = gl.where(t + 1 < n_masked, n_whole + t + 1, t + 1 - n_masked)
                else:
                    nxt = t + 1
                sl = load_slots(rtt_row, lo + nxt * BLOCK_N, hi, BLOCK_N, LD)  # the next tile's
            else:  # the gather: the tile's slots loaded just before its copies, none carried
                _cp_tile(k_smem.index(st), v_smem.index(st), bars.index(st), K, V,
                         load_slots(rtt_row, start, hi, BLOCK_N, LD), start, hi, stride_kt,
                         stride_vt, BLOCK_N, HEAD_DIM, LD)
        async_copy.commit_group()  # nothing in flight at exit (q when there is no tile)
        async_copy.wait_group(0)

    @gluon.jit
    def _tv_loader_fp8(q_smem, k_smem, v_smem, k8_smem, v8_smem, bars, Q, K, V, rtt_row,
                       q_start, n, m0, hk, lo, hi, n_tiles, stride_qt, stride_qh, stride_kt,
                       stride_vt, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, F8_STAGES: gl.constexpr,
                       LW: gl.constexpr):
        """Loader partition for an fp8 (e4m3) cache: the raw K/V rows of a tile stream by
        ``cp.async`` into an ``F8_STAGES`` ring of fp8 tiles, ``F8_STAGES - 1`` tiles ahead;
        once tile ``t`` has landed, each thread reads back the very bytes it copied (no
        barrier between the loader's threads), widens them in registers to the tiles' dtype
        (``k_smem``'s: fp16, one ``cvt.rn.f16x2.e4m3x2`` per pair, exact since every e4m3
        value is an fp16 normal) and stores them into stage ``t % STAGES`` of the 16-bit ring
        that the warpgroups read, once both released it; then a barrier of the loader's
        warps and one arrival on the stage's full barrier (count 1).  ``q`` in another dtype
        than the tiles (bf16) is converted once on its way to shared memory (exact for
        ``|q| < 65504``, as in the portable kernel).  Neither the pool nor a tile is ever
        widened in global memory."""
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [LW, 1],
                                            [1, 0])
        # 16 fp8 bytes per thread and row segment: one 16-byte cp.async, one 16-byte read back
        L8: gl.constexpr = gl.BlockedLayout([1, 16], [512 // HEAD_DIM, HEAD_DIM // 16], [LW, 1],
                                            [1, 0])
        dtype: gl.constexpr = k_smem.dtype
        HALF: gl.constexpr = BLOCK_N // 2
        if dtype == Q.dtype.element_ty:
            _q_copy(q_smem, Q, q_start, n, m0, hk, stride_qt, stride_qh, GROUP, HEAD_DIM, LD)
        else:  # fp16 tiles under bf16 queries: q converted once (exact for |q| < 65504)
            d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
            for h in gl.static_range(2):
                rows = m0 + h * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, LD))
                q_rows = ((q_start + rows // GROUP).to(gl.int64) * stride_qt
                          + (hk * GROUP + rows % GROUP) * stride_qh)
                x = gl.load(Q + q_rows[:, None] + d[None, :], mask=(rows < n * GROUP)[:, None],
                            other=0.0)
                q_smem.index(h).store(x.to(dtype))
        async_copy.commit_group()
        for f in gl.static_range(F8_STAGES - 1):  # prologue: tiles 0 .. F8_STAGES - 2 in flight
            if f < n_tiles:
                sl = load_slots(rtt_row, lo + f * BLOCK_N, hi, BLOCK_N, L8)
                _rows_copy(k8_smem.index(f), K, sl, lo + f * BLOCK_N, hi, stride_kt, BLOCK_N,
                           HEAD_DIM, L8)
                _rows_copy(v8_smem.index(f), V, sl, lo + f * BLOCK_N, hi, stride_vt, BLOCK_N,
                           HEAD_DIM, L8)
            async_copy.commit_group()
        # the slots of the tile copied next iteration, loaded one iteration ahead (their
        # latency then hides behind a conversion instead of stalling the copies)
        sl = load_slots(rtt_row, lo + (F8_STAGES - 1) * BLOCK_N, hi, BLOCK_N, L8)
        for t in range(n_tiles):
            nt = t + F8_STAGES - 1
            start = lo + nt * BLOCK_N
            if nt < n_tiles:  # into the fp8 stage that this thread read back at t - 1
                f8 = nt % F8_STAGES
                _rows_copy(k8_smem.index(f8), K, sl, start, hi, stride_kt, BLOCK_N, HEAD_DIM, L8)
                _rows_copy(v8_smem.index(f8), V, sl, start, hi, stride_vt, BLOCK_N, HEAD_DIM, L8)
            async_copy.commit_group()  # (empty past the last tile: the group count stays fixed)
            sl = load_slots(rtt_row, start + BLOCK_N, hi, BLOCK_N, L8)
            async_copy.wait_group(F8_STAGES - 1)  # this thread's copies of tile t (and q) landed
            st = t % STAGES
            mbarrier.wait(bars.index(STAGES + st), ((t // STAGES) & 1) ^ 1)
            f8 = t % F8_STAGES
            for h in gl.static_range(2):  # half a tile at a time (registers)
                kx = k8_smem.index(f8).slice(h * HALF, HALF).load(L8)
                k_smem.index(st).slice(h * HALF, HALF).store(kx.to(dtype))
                vx = v8_smem.index(f8).slice(h * HALF, HALF).load(L8)
                v_smem.index(st).slice(h * HALF, HALF).store(vx.to(dtype))
            # no proxy fence here: the warpgroups fence after their wait on this barrier, as
            # they do for cp.async data (a fence here measured ~5 % slower at bs 16-64)
            gl.thread_barrier()
            mbarrier.arrive(bars.index(st), count=1)
        async_copy.wait_group(0)

    @gluon.jit
    def _tv_load(q_smem, k_smem, v_smem, k8_smem, v8_smem, bars, Q, K, V, O, O_PART, LSE_PART,
                 rtt_row, tree_base, q_start, n, m0, hk, split, P, lo, hi, n_tiles,
                 stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh, stride_ps,
                 stride_pt, stride_ph, stride_ls, stride_lt, stride_tmj, qk_scale, k_desc, v_desc,
                 GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                 NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr, TMA_ROWS: gl.constexpr,
                 LW: gl.constexpr, MASKED_FIRST: gl.constexpr, F8_STAGES: gl.constexpr):
        """The loader partition: :func:`_tv_loader_fp8` over an fp8 cache (``F8_STAGES`` > 0,
        its ring ``k8_smem`` / ``v8_smem``), else :func:`_tv_loader`."""
        if F8_STAGES > 0:
            _tv_loader_fp8(q_smem, k_smem, v_smem, k8_smem, v8_smem, bars, Q, K, V, rtt_row,
                           q_start, n, m0, hk, lo, hi, n_tiles, stride_qt, stride_qh, stride_kt,
                           stride_vt, GROUP, HEAD_DIM, BLOCK_N, STAGES, F8_STAGES, LW)
        else:
            _tv_loader(q_smem, k_smem, v_smem, bars, Q, K, V, O, O_PART, LSE_PART, rtt_row,
                       tree_base, q_start, n, m0, hk, split, P, lo, hi, n_tiles, stride_qt,
                       stride_qh, stride_kt, stride_vt, stride_ot, stride_oh, stride_ps,
                       stride_pt, stride_ph, stride_ls, stride_lt, stride_tmj, qk_scale, k_desc,
                       v_desc, GROUP, HEAD_DIM, BLOCK_N, NUM_SPLITS, STAGES, TMA_ROWS, LW,
                       MASKED_FIRST)

    @gluon.jit
    def _tv_step(q_op, k_smem, v_smem, bars, i, start, P, hi, tree_row, row_ok, s_zero, p, m_i,
                 l_i, acc, qk_scale, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 WG: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr, P_OP: gl.constexpr,
                 WHOLE: gl.constexpr, dtype: gl.constexpr, FROM_ONE: gl.constexpr = False):
        """Iteration ``i`` of warpgroup ``WG`` on the tile at ``start``: on its turn the score
        GEMM of this tile and the PV GEMM of the previous iteration's (at ``i == 0`` ``P`` is
        zero and this stage's V is read), then the softmax.  ``WHOLE``: a whole prefix tile
        (no mask code); else the tile's keys are tested (``_tile_scores``).  ``q_op``: the
        warpgroup's ``q`` rows in registers (the score GEMM's A operand).  ``FROM_ONE``:
        the caller's ``i`` starts at 1 (no code for ``i == 0``)."""
        st = i % STAGES
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        fence_async_shared()
        mbarrier.wait(bars.index(2 * STAGES + WG), (i & 1) ^ (1 - WG))
        s_tok = warpgroup_mma(q_op, k_smem.index(st).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        p_op = gl.convert_layout(p.to(dtype), P_OP)
        if FROM_ONE:
            o_tok = warpgroup_mma(p_op, v_smem.index((i - 1) % STAGES), acc, is_async=True)
        else:
            o_tok = warpgroup_mma(p_op, v_smem.index(gl.where(i > 0, (i + STAGES - 1) % STAGES,
                                                              st)), acc, is_async=True)
        mbarrier.arrive(bars.index(2 * STAGES + 1 - WG), count=1)
        s = warpgroup_mma_wait(1, deps=[s_tok])
        if not WHOLE:
            s = _tile_scores(s, start, P, hi, tree_row, row_ok, BLOCK_N, S_L)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)
        acc, p_op = warpgroup_mma_wait(0, deps=[o_tok, p_op])
        if FROM_ONE:
            mbarrier.arrive(bars.index(STAGES + (i - 1) % STAGES), count=1)
        else:
            mbarrier.arrive(bars.index(STAGES + (i + STAGES - 1) % STAGES), count=1, pred=i > 0)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        return p, m_i, l_i, acc

    @gluon.jit
    def _tv_compute(q_smem, k_smem, v_smem, bars, Q, K, V, O, O_PART, LSE_PART, rtt_row,
                    tree_base, q_start, n, m0, hk, split, P, lo, hi, n_tiles,
                    stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh, stride_ps,
                    stride_pt, stride_ph, stride_ls, stride_lt, stride_tmj, qk_scale, v_scale,
                    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                    NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr,
                    MASKED_FIRST: gl.constexpr, SCALE_V: gl.constexpr):
        """Warpgroup ``WG``: rows ``m0 + 64 WG + [0, 64)``.  Each iteration (``_tv_step``)
        issues the score GEMM of its tile and the PV GEMM of the previous one on its turn,
        hands the turn to the other warpgroup, and runs the softmax under the other
        warpgroup's GEMMs: FlashAttention-3's ping-pong (Shah et al., arXiv:2407.08608,
        section 3.1).  The PTX waits for the PV GEMM after the softmax, as FlashAttention-3's
        intra-warpgroup overlap (section 3.2) does, but ptxas moves that wait up to the start
        of the row max; keeping it later measured slower (``docs/attention.md``).
        ``MASKED_FIRST`` (the default with TMA tiles): tiles in ``_tile_order``'s order, the
        ones holding ``P`` or draft keys first, then the whole prefix tiles in a loop without
        mask code (the online softmax does not depend on the order); else tile 0 peeled,
        then one loop that tests each tile (``_tile_scores``).  ``v_scale`` (``SCALE_V``, an
        fp8 cache's V dequantization scale) multiplies the accumulator once before the store."""
        dtype: gl.constexpr = k_smem.dtype  # the tiles' (an fp8 cache's are widened to it)
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HEAD_DIM, 16])
        P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        q_wg = q_smem.index(WG)
        rows_s = m0 + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, S_L))
        row_ok = rows_s < n * GROUP
        tree_row = tree_base + (rows_s // GROUP).to(gl.int64) * stride_tmj
        m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, S_L))
        acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=O_L)
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=S_L)
        p = s_zero
        if n_tiles > 0:
            # q, which lands with the first tile, as the score GEMM's register operand: the
            # GEMM then reads only K from shared memory
            mbarrier.wait(bars.index(0), 0)
            q_op = q_wg.load(gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2))
            if MASKED_FIRST:
                # the tiles holding P or draft keys first (at least one iteration: tile 0 when
                # there are none), then the whole prefix tiles, whose loop has no mask code
                n_whole, n_masked = _tile_order(P, lo, hi, BLOCK_N)
                n_a = gl.maximum(n_masked, 1)
                for i in range(0, n_a):
                    start = lo + gl.where(n_masked > 0, n_whole + i, 0) * BLOCK_N
                    p, m_i, l_i, acc = _tv_step(q_op, k_smem, v_smem, bars, i, start, P, hi,
                                                tree_row, row_ok, s_zero, p, m_i, l_i, acc,
                                                qk_scale, BLOCK_N, STAGES, WG, S_L, O_L, P_OP,
                                                False, dtype)
                for i in range(n_a, n_tiles):
                    p, m_i, l_i, acc = _tv_step(q_op, k_smem, v_smem, bars, i,
                                                lo + (i - n_masked) * BLOCK_N, P, hi, tree_row,
                                                row_ok, s_zero, p, m_i, l_i, acc, qk_scale,
                                                BLOCK_N, STAGES, WG, S_L, O_L, P_OP, True, dtype)
            else:  # the per-key gather: tile 0 peeled, then one loop testing each tile
                fence_async_shared()
                mbarrier.wait(bars.index(2 * STAGES + WG), 1 - WG)
                s_tok = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), s_zero,
                                      use_acc=False, is_async=True)
                mbarrier.arrive(bars.index(2 * STAGES + 1 - WG), count=1)
                s = warpgroup_mma_wait(0, deps=[s_tok])
                s = _tile_scores(s, lo, P, hi, tree_row, row_ok, BLOCK_N, S_L)
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale)
                for j in range(1, n_tiles):
                    p, m_i, l_i, acc = _tv_step(q_op, k_smem, v_smem, bars, j, lo + j * BLOCK_N,
                                                P, hi, tree_row, row_ok, s_zero, p, m_i, l_i,
                                                acc, qk_scale, BLOCK_N, STAGES, WG, S_L, O_L,
                                                P_OP, False, dtype, True)
            # the last tile's PV GEMM
            mbarrier.wait(bars.index(2 * STAGES + WG), (n_tiles & 1) ^ (1 - WG))
            p_op = gl.convert_layout(p.to(dtype), P_OP)
            o_tok = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), acc, is_async=True)
            mbarrier.arrive(bars.index(2 * STAGES + 1 - WG), count=1)
            acc = warpgroup_mma_wait(0, deps=[o_tok])
        if SCALE_V:
            acc = acc * v_scale
        rows_o = m0 + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, O_L))
        store_out(O, O_PART, LSE_PART, acc, gl.convert_layout(m_i, gl.SliceLayout(1, O_L)),
                  gl.convert_layout(l_i, gl.SliceLayout(1, O_L)),
                  (q_start + rows_o // GROUP).to(gl.int64), hk * GROUP + rows_o % GROUP,
                  gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_L)), rows_o < n * GROUP,
                  split, stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls,
                  stride_lt, NUM_SPLITS)

    @gluon.jit
    def _tv_wg0(q_smem, k_smem, v_smem, bars, Q, K, V, O, O_PART, LSE_PART, rtt_row,
                tree_base, q_start, n, m0, hk, split, P, lo, hi, n_tiles,
                stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh, stride_ps,
                stride_pt, stride_ph, stride_ls, stride_lt, stride_tmj, qk_scale, v_scale,
                GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr, MASKED_FIRST: gl.constexpr,
                SCALE_V: gl.constexpr):
        _tv_compute(q_smem, k_smem, v_smem, bars, Q, K, V, O, O_PART, LSE_PART, rtt_row,
                    tree_base, q_start, n, m0, hk, split, P, lo, hi, n_tiles,
                    stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh, stride_ps,
                    stride_pt, stride_ph, stride_ls, stride_lt, stride_tmj, qk_scale, v_scale,
                    GROUP, HEAD_DIM, BLOCK_N, NUM_SPLITS, STAGES, 0, MASKED_FIRST, SCALE_V)

    @gluon.jit
    def _tv_wg1(q_smem, k_smem, v_smem, bars, Q, K, V, O, O_PART, LSE_PART, rtt_row,
                tree_base, q_start, n, m0, hk, split, P, lo, hi, n_tiles,
                stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh, stride_ps,
                stride_pt, stride_ph, stride_ls, stride_lt, stride_tmj, qk_scale, v_scale,
                GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr, MASKED_FIRST: gl.constexpr,
                SCALE_V: gl.constexpr):
        _tv_compute(q_smem, k_smem, v_smem, bars, Q, K, V, O, O_PART, LSE_PART, rtt_row,
                    tree_base, q_start, n, m0, hk, split, P, lo, hi, n_tiles,
                    stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh, stride_ps,
                    stride_pt, stride_ph, stride_ls, stride_lt, stride_tmj, qk_scale, v_scale,
                    GROUP, HEAD_DIM, BLOCK_N, NUM_SPLITS, STAGES, 1, MASKED_FIRST, SCALE_V)

    @gluon.jit
    def _tree_verify_ws_kernel(
            Q, K, V, O, O_PART, LSE_PART,
            req_to_token, req_pool_indices, prefix_lens, qo_indptr, tree_mask,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
            stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
            stride_rtt, stride_tmb, stride_tmj,
            qk_scale, v_scale, k_desc, v_desc,
            GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
            NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr, TMA_ROWS: gl.constexpr = 0,
            LW: gl.constexpr = 8, MASKED_FIRST: gl.constexpr = False,
            F8_STAGES: gl.constexpr = 0, SCALE_V: gl.constexpr = False):
        """Warp-specialized ping-pong tree verify: 4 warps here (warpgroup 0), warpgroup 1
        and the loader (``LW`` warps) as workers, on mbarriers.  ``F8_STAGES`` > 0: an fp8
        cache, widened by the loader (:func:`_tv_loader_fp8`) through a ring of that many
        fp8 tiles, into fp16 tiles (``q`` too) whatever ``q``'s dtype."""
        SW: gl.constexpr = SW128  # the TMA descriptors' layout too
        hk = gl.program_id(1)
        pid2 = gl.program_id(2)
        req = pid2 // NUM_SPLITS
        split = pid2 % NUM_SPLITS
        q_start = gl.load(qo_indptr + req)
        n = gl.load(qo_indptr + req + 1) - q_start
        m0 = gl.program_id(0) * 128
        if m0 < n * GROUP:
            P, rtt_row, lo, hi = _tv_keys(prefix_lens, req_to_token, req_pool_indices, req, split, n,
                                          stride_rtt, BLOCK_N, NUM_SPLITS)
            n_tiles = gl.cdiv(hi - lo, BLOCK_N)
            if F8_STAGES > 0:  # fp16 tiles: e4m3 -> fp16 is one cvt per pair, bf16 needs two
                q_smem = gl.allocate_shared_memory(gl.float16, [2, 64, HEAD_DIM], SW)
                k_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, HEAD_DIM], SW)
                v_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, HEAD_DIM], SW)
            else:
                q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, 64, HEAD_DIM], SW)
                k_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM],
                                                   SW)
                v_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, BLOCK_N, HEAD_DIM],
                                                   SW)
            bars = gl.allocate_shared_memory(gl.int64, [2 * STAGES + 2, 1],
                                             mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                # a stage's K/V landed: one cp.async arrival per loader thread, or with an fp8
                # cache one arrival after the loader's warps stored the widened tile
                mbarrier.init(bars.index(i), count=1 if F8_STAGES > 0 else LW * 32)
                mbarrier.init(bars.index(STAGES + i), count=2)
            mbarrier.init(bars.index(2 * STAGES), count=1)
            mbarrier.init(bars.index(2 * STAGES + 1), count=1)
            tree_base = tree_mask + req.to(gl.int64) * stride_tmb
            k_base = K + hk.to(gl.int64) * stride_kh
            v_base = V + hk.to(gl.int64) * stride_vh
            if F8_STAGES > 0:
                L8S: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                             order=[1, 0])
                k8_smem = gl.allocate_shared_memory(K.dtype.element_ty,
                                                    [F8_STAGES, BLOCK_N, HEAD_DIM], L8S)
                v8_smem = gl.allocate_shared_memory(K.dtype.element_ty,
                                                    [F8_STAGES, BLOCK_N, HEAD_DIM], L8S)
            else:  # no fp8 ring: the 16-bit loader never touches these
                k8_smem = k_smem
                v8_smem = v_smem
            gl.warp_specialize([
                (_tv_wg0, (q_smem, k_smem, v_smem, bars, Q, k_base, v_base, O, O_PART, LSE_PART,
                           rtt_row, tree_base, q_start, n, m0, hk, split, P, lo, hi, n_tiles,
                           stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh,
                           stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_tmj,
                           qk_scale, v_scale, GROUP, HEAD_DIM, BLOCK_N, NUM_SPLITS, STAGES,
                           MASKED_FIRST, SCALE_V)),
                (_tv_wg1, (q_smem, k_smem, v_smem, bars, Q, k_base, v_base, O, O_PART, LSE_PART,
                           rtt_row, tree_base, q_start, n, m0, hk, split, P, lo, hi, n_tiles,
                           stride_qt, stride_qh, stride_kt, stride_vt, stride_ot, stride_oh,
                           stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_tmj,
                           qk_scale, v_scale, GROUP, HEAD_DIM, BLOCK_N, NUM_SPLITS, STAGES,
                           MASKED_FIRST, SCALE_V)),
                (_tv_load, (q_smem, k_smem, v_smem, k8_smem, v8_smem, bars, Q, k_base, v_base, O,
                            O_PART, LSE_PART, rtt_row, tree_base, q_start, n, m0, hk, split, P,
                            lo, hi, n_tiles, stride_qt, stride_qh, stride_kt, stride_vt,
                            stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls,
                            stride_lt, stride_tmj, qk_scale, k_desc, v_desc, GROUP, HEAD_DIM,
                            BLOCK_N, NUM_SPLITS, STAGES, TMA_ROWS, LW, MASKED_FIRST, F8_STAGES))],
                               [4, LW], [216 if F8_STAGES > 0 else (232 if LW == 4 else 224),
                                         32 if LW == 8 and F8_STAGES == 0 else 40])


def sm90_tree_verify(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, qo_indptr,
                     tree_mask, max_q: int, sm_scale: float, out, o_part, lse,
                     num_splits: int, block_n: Optional[int] = None,
                     pingpong: bool = True, page_size: int = 1,
                     masked_first: Optional[bool] = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> None:
    """Launch a Gluon tree-verify kernel (module docstring).  Called by
    :func:`.attention.paged_attention`, which validates every argument and index; after
    :func:`sm90_tree_verify_supported` returned None.

    Args: ``q [T, H, D]`` bf16/fp16; ``k_cache``/``v_cache [num_slots, Hkv, D]`` of ``q``'s
    dtype (``Hkv`` divides ``H``); ``req_to_token`` int32 ``[rows, width]``;
    ``req_pool_indices`` int64 / ``prefix_lens`` int32 ``[bs]``; ``qo_indptr`` int32 ``[bs + 1]``;
    ``tree_mask`` int32 ``[bs, >= max_q, ceil(max_q / 32)]``; ``max_q`` the static bound of new
    tokens per request; ``sm_scale`` multiplies ``q . k``; ``out [T, H, D]`` (written);
    with ``num_splits > 1`` float32 ``o_part [S, T, H, D]`` / ``lse [S, T, H]`` (written,
    merged by the caller), else unused; ``block_n`` 64 or 128 keys per tile; ``pingpong``:
    the warp-specialized ping-pong kernel (:func:`_tree_verify_ws_kernel`; ``block_n`` None
    = 64, six stages; 128 runs three and spills registers) rather than the synchronous one
    (:func:`_tree_verify_sm90_kernel`; None = 64 with split-KV, else 128).
    ``page_size``: the pools' page size, a promise that ``req_to_token`` rows follow the page
    layout (token ``p`` at offset ``p % page_size`` of its page); a multiple of 16 lets the
    ping-pong kernel copy whole 64-key tiles at a page boundary by TMA, one box per run of
    64 / 32 / 16 consecutive slots and 64 columns (16-byte aligned caches with
    ``stride(1) == head_dim``; else ``cp.async`` as at 1).
    ``masked_first``: the ping-pong kernel's tile order (``_tile_order``: a CTA's tiles
    holding ``P`` or draft keys first, then its whole prefix tiles); None = with TMA tiles
    only, where it measured faster.  The output depends on the order by rounding only (tests
    set it to compare the TMA and ``cp.async`` paths bit for bit).
    An fp8 e4m3 cache (ping-pong only, 64-key tiles): the loader widens each tile to fp16 in
    shared memory and ``q`` once (:func:`_tv_loader_fp8`; four fp16 stages behind three fp8
    ones, per-key ``cp.async`` at any page size), the GEMMs run in fp16; ``k_scale`` folds
    into the score scale, ``v_scale`` multiplies the accumulator once (both 1.0 for other
    caches).
    Raises ValueError for another ``block_n`` (only 64 with an fp8 cache).  No host sync."""
    D = q.shape[2]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if block_n not in (None, 64, 128) or (fp8 and block_n not in (None, 64)):
        raise ValueError(f"sm90 tree verify: block_n must be 64{'' if fp8 else ' or 128'}"
                         f"{' with an fp8 cache' if fp8 else ''}, got {block_n}")
    bs, H, Hkv = req_pool_indices.shape[0], q.shape[1], k_cache.shape[1]
    G = H // Hkv
    ps = o_part.stride() if num_splits > 1 else (0, 0, 0, 0)
    ls = lse.stride() if num_splits > 1 else (0, 0, 0)
    grid = (-(-(max_q * G) // SM90_BLOCK_M), Hkv, bs * num_splits)
    args = (q, k_cache, v_cache, out, o_part, lse,
            req_to_token, req_pool_indices, prefix_lens, qo_indptr, tree_mask,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
            ps[0], ps[1], ps[2], ls[0], ls[1],
            req_to_token.stride(0), tree_mask.stride(0), tree_mask.stride(1),
            sm_scale * k_scale * 1.4426950408889634)
    if pingpong and fp8:
        # 8 loader warps (H200, bs 1-64: 1.04-1.10x faster than 4): 216 registers a warpgroup,
        # 40 the loader (maxnreg 128 x 16 warps); shared memory at head_dim 128: 4 x 32 KB
        # 16-bit stages + 3 x 16 KB fp8 stages + q (a fourth fp8 stage measured no faster)
        _tree_verify_ws_kernel[grid](*args, v_scale, None, None, GROUP=G, HEAD_DIM=D, BLOCK_N=64,
                                     NUM_SPLITS=num_splits, STAGES=4, LW=8, F8_STAGES=3,
                                     SCALE_V=v_scale != 1.0, num_warps=4,
                                     maxnreg=128)
        return
    if pingpong:
        block_n = block_n or 64
        # TMA boxes of one page's run of slots (the largest of 64 / 32 / 16 dividing the page)
        rows = next((r for r in (64, 32, 16) if page_size % r == 0), 0) if block_n == 64 else 0
        if not all(c.stride(2) == 1 and c.stride(1) == D and c.data_ptr() % 16 == 0
                   and (c.stride(0) * c.element_size()) % 16 == 0 for c in (k_cache, v_cache)):
            rows = 0
        descs = (None, None)
        if rows:
            descs = tuple(TensorDescriptor(c, [c.shape[0], Hkv * D], [c.stride(0), 1], [rows, 64],
                                           SW128.value) for c in (k_cache, v_cache))
        # the per-key gather of 64-key tiles gets an 8-warp loader (faster than 4 at page 1,
        # slower with TMA tiles); the opt-in 128-key tiles keep 4 warps (both gathers load
        # each tile's slots just in time)
        lw = 8 if rows == 0 and block_n == 64 else 4
        # launched with maxnreg=168 (4 loader warps: the warpgroups get 232 registers and the
        # loader 40) or 128 (8 loader warps: 224 and 32)
        _tree_verify_ws_kernel[grid](*args, 1.0, *descs, GROUP=G, HEAD_DIM=D,
                                     BLOCK_N=block_n, NUM_SPLITS=num_splits,
                                     STAGES=6 if block_n == 64 else 3, TMA_ROWS=rows, LW=lw,
                                     MASKED_FIRST=rows > 0 if masked_first is None
                                     else bool(masked_first),
                                     num_warps=4, maxnreg=168 if lw == 4 else 128)
        return
    block_n = block_n or (64 if num_splits > 1 else 128)
    _tree_verify_sm90_kernel[grid](*args, GROUP=G, HEAD_DIM=D, BLOCK_N=block_n,
                                   NUM_SPLITS=num_splits, STAGES=3, num_warps=8)
