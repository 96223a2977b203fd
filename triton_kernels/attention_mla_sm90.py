"""Hopper (sm_90) absorbed-MLA attention in Gluon: 64 packed (token, head) rows per CTA.

Why a second kernel: the Triton kernel of :mod:`.attention_mla` lets the compiler place the
warps, and for a score dot that feeds another dot Triton puts all of them along the rows, so
with 64 heads per program both warpgroups compute the same scores, or (the default) two
programs each own half of the value width and both compute every score: 1.53x the useful
tensor-core work, and MLA at 128 heads is compute-bound.  Gluon (Triton's explicit-layout
dialect, ``triton.experimental.gluon``) lets the kernel place every warp.  Two schedules share
the grid, the modes and the epilogue:

Common to both:

- CTA = 64 packed rows (``BLOCK_H``, one wgmma M tile) of one request x one KV split; grid
  ``(cdiv(max_q * H, 64), bs * num_splits)``.  Row ``m`` of a request is head ``m % H`` of
  its new token ``m // H`` (the packing of :mod:`.attention_mla`, FlashMLA's ``s_q x h_q``
  rows); tiles starting past the request's ``n * H`` rows exit at once, rows past it inside
  a tile read zeros and are not stored.  With ``H`` a multiple of 64 a tile is 64 heads of
  one token; with fewer heads (16 or 32 under tensor parallelism) a tile holds the heads of
  several tokens -- a decode token's ``H`` rows pad one tile, a chain or tree verify fills
  its tiles.  Every mode runs here: DECODE (``n = 1``), EXTEND / DRAFT_EXTEND_V2 (causal:
  token ``j`` sees keys ``< P + j + 1``) and TARGET_VERIFY (the ``n`` draft keys through the
  token's bit-packed tree-mask row, bit ``k % 32`` of word ``k // 32``).  With one token per
  tile the visibility is one vector over the tile's keys; with several, causal rows stop at
  their own token and tree rows read their own mask words, on the tiles that hold draft
  keys only.
- The latent tile is loaded once into shared memory and is both the key and the value
  operand; online softmax in float32, log2 domain; ``O [64, 512]`` is split by columns over
  the two warpgroups (a ``64 x 256`` float32 accumulator, 128 registers per thread each).
- Split-KV as :mod:`.attention_mla`: split ``s`` covers prefix keys ``[s * c, min((s + 1) *
  c, P))`` with ``c = cdiv(cdiv(P, S), BLOCK_N) * BLOCK_N``, the last split also this
  forward's keys; partial outputs and base-2 log-sum-exps go to the same workspace as the
  Triton kernel's and :func:`.attention_common.merge_kernel` combines them.  No host sync.

**Seesaw** (:func:`_mla_seesaw_kernel`, the default): FlashMLA's schedule
(deepseek-ai/FlashMLA, ``docs/20250422-new-kernel-deep-dive.md``; no code copied), 64-key
tiles, warp-specialized into three 4-warp partitions on mbarriers:

- warpgroup 0 computes the whole ``[64, 64]`` score tile of the even key tiles, warpgroup 1
  of the odd ones (so each reads ``q`` from shared memory once per two tiles, half of what
  the key split needs), concurrently; ``q_pe`` is the register A operand.
- Per pair of tiles: warpgroup 0 takes its tile's max ``m0`` and ``P0`` and hands both to
  warpgroup 1 through shared memory; warpgroup 1 folds ``m0`` into its own tile's max ``m1``
  and hands ``m1`` and ``P1`` back.  Each warpgroup accumulates both ``P0 V0`` and ``P1 V1``
  into its 256 value columns (its own ``P`` from registers, the other's from shared memory),
  rescaling by ``exp2(m - m0)`` and ``exp2(m0 - m1)``; row sums are exchanged once at the
  end.  One GEMM of each warpgroup runs under the other's softmax.
- A loader partition fills two tile stages, each 64-column block of a tile on its own
  barrier so a score GEMM starts on the first block while the rest stream in.  A stage is
  released in two halves: value columns 0-255 and the rope block once warpgroup 0 is done
  with them, columns 256-511 once warpgroup 1 is.  Tiles are copied by the tensor memory
  accelerator (9 boxes of ``[64, 64]`` from the slot of the tile's first key) where a tile is
  one page's consecutive slots (``page_size % 64 == 0``, the pool's page layout, and the tile
  at a multiple of 64 keys), otherwise gathered by ``cp.async`` per key through
  ``req_to_token``: at page 1, for a partial last tile (its rows past the request must read
  as zeros) and for the tiles of a last KV split that starts at an unaligned ``P``.
- Shared memory: ``q_nope`` 64 KB + 2 x 72 KB stages + 2 x 8 KB ``P`` = 225 KB.

**Key split** (:func:`_mla_sm90_kernel`, ``seesaw=False``; 32- or 64-key tiles), 8 warps: both
warpgroups work on every tile; the score accumulator has ``warps_per_cta = [4, 2]``, so
warpgroup ``g`` computes the scores of keys ``g * BLOCK_N/2 + [0, BLOCK_N/2)`` (no score is
computed twice); the row max is reduced across the warpgroups through shared memory once per
tile, ``P`` goes to shared memory and each warpgroup multiplies it into its value columns.
Tiles are gathered by ``cp.async`` and double-buffered.  Shared memory at ``BLOCK_N = 64``:
``q`` 72 KB + 2 x 72 KB stages + 8 KB ``P`` = 224 KB.

What limits the seesaw kernel is the latency of refilling a stage (only two 72 KB stages
fit); measured times against FlashMLA and the variants that did not help:
``docs/attention.md``.

**fp8 (e4m3) caches**: wgmma takes no 16-bit x fp8 pair, so the tiles are widened to ``q``'s
type in shared memory (exact: e4m3 fits bf16 and fp16); ``kv_scale`` folds into the score
scale and multiplies the accumulator once.

- Seesaw (default, :func:`_ss_gather8`): the loader partition widens, off the warpgroups'
  path, and in place, since no shared memory is left for an fp8 ring.  It ``cp.async``-copies
  a tile's 36 KB of fp8 bytes into its stage's half A as soon as warpgroup 0 frees it (the
  latent's eight ``[64, 64]`` byte blocks in the latent's first 32 KB, the rope block in the
  rope tile's second half), then, once half B is free too, widens in three groups: latent
  blocks 7-4 (half B holds no fp8 byte), blocks 3 and 2 with the rope block, blocks 1 and 0.
  The 16-bit block ``b < 4`` covers the fp8 blocks ``2b`` and ``2b + 1``, all widened in an
  earlier group but block 0's own and 1 (and the rope block's own bytes): those are read by
  every loader thread before any writes.  The score GEMMs take the blocks in that order, one
  ready barrier per group.  A group is one shared-memory load and one store (the compiler
  separates any two accesses of one buffer by a barrier of the loader's warps).  ``q`` is
  copied in its own type and widened to fp16 in place once.  The widening, not the copy, is
  what fp8 costs: without it (output wrong) MLA decode at bs 128 x 8192 keys took 498 us on
  an H200, against 727 with it and 567 for bf16.  TMA is not used for fp8 tiles: TMA boxes
  into the fp8 bytes for whole-page tiles measured no faster there (770 us) and slower for
  tree verify at bs 1 (221 against 200 us).
- Key split (``seesaw=False``, :func:`_mla_sm90_fp8_kernel`): every thread ``cp.async``-copies
  its share of a tile's raw bytes into a two-stage fp8 ring and, once they land, widens
  exactly those bytes to fp16 into ONE fp16 tile that both GEMMs read, between the GEMMs of
  consecutive tiles; ``q`` goes to fp16 once and ``P`` is fp16.  Shared memory at
  ``BLOCK_N = 64``: ``q`` 72 KB + the ring 2 x 36 KB + the fp16 tile 72 KB + ``P`` 8 KB = 224 KB.

Scope (:func:`sm90_mla_supported`): bf16/fp16 ``q`` with a cache of its dtype or fp8 e4m3,
``kv_lora_rank = 512``, ``qk_rope_head_dim = 64``, any head count, an sm_90 GPU.
Everything else (and any CPU run: Gluon has no interpreter) uses :mod:`.attention_mla`.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from .gluon_common import HAVE_GLUON, sm90_device_needs

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                   tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from .gluon_common import SW128, load_slots, store_out

__all__ = ["sm90_mla_attention", "sm90_mla_supported", "BLOCK_H"]

BLOCK_H = 64       # packed (token, head) rows per CTA (one wgmma M tile)
KV_LORA, ROPE = 512, 64


def sm90_mla_supported(q: torch.Tensor, kv_cache: torch.Tensor,
                       kv_lora_rank: int) -> Optional[str]:
    """None when :func:`sm90_mla_attention` can run this call, else the reason it cannot (a
    string).  Shapes as in :func:`.attention_mla.mla_paged_attention`."""
    why = sm90_device_needs(q)
    if q.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        why.append(f"bf16/fp16 q with a cache of its dtype or fp8 e4m3 (got {q.dtype} / {kv_cache.dtype})")
    if kv_lora_rank != KV_LORA or q.shape[-1] != KV_LORA + ROPE:
        why.append(f"kv_lora_rank {KV_LORA} and qk_rope_head_dim {ROPE}")
    return "; ".join(why) if why else None


if HAVE_GLUON:

    @gluon.jit
    def _copy_tile(kc_buf, kr_buf, KV, slot_c, slot_r, start, hi, stride_kvt,
                   BLOCK_N: gl.constexpr, LD_C: gl.constexpr, LD_R: gl.constexpr):
        """cp.async the latent rows of keys ``start + [0, BLOCK_N)`` into one stage (rows past
        ``hi`` are zero-filled, no global read) and commit them as one group."""
        rows_c = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD_C))
        cols_c = gl.arange(0, 512, layout=gl.SliceLayout(0, LD_C))
        async_copy.async_copy_global_to_shared(
            kc_buf, KV + slot_c.to(gl.int64)[:, None] * stride_kvt + cols_c[None, :],
            mask=(rows_c < hi)[:, None])
        rows_r = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD_R))
        cols_r = 512 + gl.arange(0, 64, layout=gl.SliceLayout(0, LD_R))
        async_copy.async_copy_global_to_shared(
            kr_buf, KV + slot_r.to(gl.int64)[:, None] * stride_kvt + cols_r[None, :],
            mask=(rows_r < hi)[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _visible(keys, P, hi, tree_row, TREE: gl.constexpr):
        """Which of ``keys`` (one tile, positions) the CTA's token sees: causal, every key
        below ``hi`` (which stops at the token); tree, every prefix key below ``hi`` and
        those of this forward's keys (``>= P``) whose bit is set in the token's tree-mask
        row."""
        if TREE:
            draft = keys - P
            in_draft = (draft >= 0) & (keys < hi)
            dk = gl.where(in_draft, draft, 0)
            word = gl.load(tree_row + dk // 32, mask=in_draft, other=0)
            vis = (keys < gl.minimum(P, hi)) | (in_draft & (((word >> (dk % 32)) & 1) != 0))
        else:
            vis = keys < hi
        return vis

    @gluon.jit
    def _cta_tile(qo_indptr, NUM_SPLITS: gl.constexpr):
        """This CTA's ``(row0, req, split, q_start, n)``: packed rows ``row0 + [0, 64)`` (grid
        axis 0) of request ``req``'s ``n`` new tokens from row ``q_start``, and its KV split
        (grid axis 1)."""
        row0 = gl.program_id(0) * 64
        pid1 = gl.program_id(1)
        req = pid1 // NUM_SPLITS
        q_start = gl.load(qo_indptr + req)
        return row0, req, pid1 % NUM_SPLITS, q_start, gl.load(qo_indptr + req + 1) - q_start

    @gluon.jit
    def _tile_base(q_start, row0, H: gl.constexpr):
        """``(tok, rowb)``: the tile's rows relative to a base token -- with ``H`` a multiple
        of 64 the tile's one token (int64) and its first head, otherwise the request's first
        token and the tile's first packed row."""
        if H % 64 == 0:
            return (q_start + row0 // H).to(gl.int64), row0 % H
        return q_start.to(gl.int64), row0

    @gluon.jit
    def _rows(rowb, n, H: gl.constexpr, SL: gl.constexpr):
        """The tile's rows (base :func:`_tile_base`) in ``SL`` (a row slice layout): ``(j,
        head, ok)`` -- token ``tok + j``, head ``head``, ``ok`` where the row lies inside the
        request (``n`` new tokens).  Packed row ``m`` of a request is head ``m % H`` of its
        token ``m // H``."""
        r = gl.arange(0, 64, layout=SL)
        if H % 64 == 0:   # one token's heads: no per-row division, every row inside the request
            return r * 0, rowb + r, r >= 0
        m = rowb + r
        return m // H, m % H, m < n * H

    @gluon.jit
    def _cta_keys(prefix_lens, req_to_token, req_pool_indices, tree_mask, req, split, row0, n,
                  stride_rtt, stride_tmb, stride_tmj, H: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_SPLITS: gl.constexpr, TREE: gl.constexpr):
        """The keys the tile's rows (``row0 + [0, 64)`` of request ``req``) attend to in this
        split: ``(P, rtt_row, lo, hi, tree_row)`` -- ``P`` committed keys, the request's
        ``req_to_token`` row, positions ``[lo, hi)`` (tree: the prefix and all ``n`` draft
        keys, masked later per token; causal: up to the tile's last token, rows of earlier
        tokens masked later) and the tree-mask row of the tile's first token.  Splits share
        the prefix in ``BLOCK_N``-aligned chunks; the last one also takes this forward's keys."""
        P = gl.load(prefix_lens + req)
        rtt_row = req_to_token + gl.load(req_pool_indices + req).to(gl.int64) * stride_rtt
        if TREE:
            kv_end = P + n
        else:
            kv_end = P + gl.minimum(row0 + 63, n * H - 1) // H + 1
        if NUM_SPLITS == 1:
            lo = split  # 0, as a tensor (warp-specialized partitions take tensors)
            hi = kv_end
        else:
            chunk = gl.cdiv(gl.cdiv(P, NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = gl.minimum(split * chunk, P)
            hi = gl.where(split == NUM_SPLITS - 1, kv_end, gl.minimum(lo + chunk, P))
        tree_row = tree_mask + req.to(gl.int64) * stride_tmb + (row0 // H) * stride_tmj
        return P, rtt_row, lo, hi, tree_row

    @gluon.jit
    def _mask_scores(s, qk_scale, start, offs, P, hi, tree_row, rowb, n, stride_tmj,
                     H: gl.constexpr, TREE: gl.constexpr, S_L: gl.constexpr):
        """``s * qk_scale`` where the tile's rows see key positions ``keys = start + offs``
        (``offs``: ``[0, BLOCK_N)`` in ``SliceLayout(0, S_L)``), ``-inf`` elsewhere.  A whole
        prefix tile (every key below ``min(P, hi)``) is visible to every row: no mask code
        runs for it (2-11 % of MLA's time at 128 heads on an H100).  Other tiles: with
        ``H`` a multiple of 64 every row of the tile is the same token (:func:`_visible`, one
        vector); otherwise rows of several tokens share the tile: causal rows stop at their
        own token, tree rows test their own mask rows, read only for a tile that holds draft
        keys."""
        keys = start + offs
        if start + s.shape[1] <= gl.minimum(P, hi):   # a whole prefix tile: every key visible
            return s * qk_scale
        if H % 64 == 0:
            vis = _visible(keys, P, hi, tree_row, TREE)[None, :]
        else:
            j, _, ok = _rows(rowb, n, H, gl.SliceLayout(1, S_L))
            jt = j - rowb // H   # rows relative to the tile's first token (tree_row)
            if TREE:
                vis = (keys < gl.minimum(P, hi))[None, :] & ok[:, None]
                if start + s.shape[1] > P:   # the tile holds draft keys
                    draft = keys - P
                    in_draft = (draft >= 0) & (keys < hi)
                    dk = gl.where(in_draft, draft, 0)
                    word = gl.load(tree_row + (jt * stride_tmj)[:, None] + (dk // 32)[None, :],
                                   mask=ok[:, None] & in_draft[None, :], other=0)
                    vis = vis | (in_draft[None, :] & (((word >> (dk % 32)[None, :]) & 1) != 0))
            else:
                vis = keys[None, :] < gl.minimum(hi, P + j + 1)[:, None]
        return gl.where(vis, s * qk_scale, float("-inf"))

    @gluon.jit
    def _load_q(Q, rowb, n, stride_qt, stride_qh, H: gl.constexpr, LD_C: gl.constexpr,
                LD_R: gl.constexpr):
        """The tile's packed rows of ``q`` (:func:`_rows`; rows past the request read as
        zeros): the latent part ``[64, 512]`` in ``LD_C`` and the rope part ``[64, 64]`` in
        ``LD_R`` (registers)."""
        j, h, ok = _rows(rowb, n, H, gl.SliceLayout(1, LD_C))
        cols_c = gl.arange(0, 512, layout=gl.SliceLayout(0, LD_C))
        q_c = gl.load(Q + (j.to(gl.int64) * stride_qt + h * stride_qh)[:, None]
                      + cols_c[None, :], mask=ok[:, None], other=0.0)
        j, h, ok = _rows(rowb, n, H, gl.SliceLayout(1, LD_R))
        cols_r = 512 + gl.arange(0, 64, layout=gl.SliceLayout(0, LD_R))
        q_r = gl.load(Q + (j.to(gl.int64) * stride_qt + h * stride_qh)[:, None]
                      + cols_r[None, :], mask=ok[:, None], other=0.0)
        return q_c, q_r

    @gluon.jit
    def _ks_tile(qc_smem, qr_smem, kc, kr, p_smem, s_zero, keys, start, P, hi, tree_row,
                 rowb, n, stride_tmj, qk_scale, m_i, l_part, acc, P_T: gl.constexpr,
                 H: gl.constexpr, TREE: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr):
        """One key tile of the key-split schedule, its keys in shared memory (``kc`` latent,
        ``kr`` rope): the score wgmmas, the online-softmax update, ``P`` (as ``P_T``) through
        shared memory and the value wgmma.  Returns ``(m_i, l_part, acc)``."""
        s = warpgroup_mma(qc_smem, kc.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qr_smem, kr.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])

        s = _mask_scores(s, qk_scale, start, keys, P, hi, tree_row, rowb, n, stride_tmj, H, TREE,
                         S_L)
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        if TREE:  # a tree row may see nothing yet; causal tiles always hold a key
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_part = l_part * alpha[:, None] + p

        p_smem.store(p.to(P_T))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(p_smem, kc, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        return m_new, l_part, acc

    @gluon.jit
    def _ks_store(O, O_PART, LSE_PART, acc, m_i, l_part, tok, rowb, n, split, stride_ot,
                  stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                  H: gl.constexpr, NUM_SPLITS: gl.constexpr, O_L: gl.constexpr):
        """The key split's epilogue: normalise; store the tile's rows of the request (the
        output, or this split's partial and log2-sum-exp)."""
        j, h, ok = _rows(rowb, n, H, gl.SliceLayout(1, O_L))
        store_out(O, O_PART, LSE_PART, acc, gl.convert_layout(m_i, gl.SliceLayout(1, O_L)),
                  gl.convert_layout(gl.sum(l_part, axis=1), gl.SliceLayout(1, O_L)),
                  tok + j, h, gl.arange(0, 512, layout=gl.SliceLayout(0, O_L)),
                  ok, split, stride_ot, stride_oh, stride_ps, stride_pt,
                  stride_ph, stride_ls, stride_lt, NUM_SPLITS)

    @gluon.jit
    def _mla_sm90_kernel(
            Q, KV, O, O_PART, LSE_PART, req_to_token, req_pool_indices, prefix_lens, qo_indptr,
            tree_mask,
            stride_qt, stride_qh, stride_kvt, stride_ot, stride_oh,
            stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_rtt,
            stride_tmb, stride_tmj,
            qk_scale,
            H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr,
            TREE: gl.constexpr):
        BLOCK_H: gl.constexpr = 64
        KV_LORA: gl.constexpr = 512
        ROPE: gl.constexpr = 64
        dtype: gl.constexpr = KV.dtype.element_ty
        # register layouts: wgmma accumulators split over the two warpgroups along N
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BLOCK_N // 2, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, KV_LORA // 2, 16])
        # global loads: 16-byte vectors, one warp per row of 256 (value part) / 4 rows (rope)
        LD_C: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        LD_R: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        SW_C: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SW_P: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128 if BLOCK_N >= 64 else BLOCK_N * 2, element_bitwidth=16, rank=2)

        row0, req, split, q_start, n = _cta_tile(qo_indptr, NUM_SPLITS)
        if row0 < n * H:
            P, rtt_row, lo, hi, tree_row = _cta_keys(
                prefix_lens, req_to_token, req_pool_indices, tree_mask, req, split, row0, n,
                stride_rtt, stride_tmb, stride_tmj, H, BLOCK_N, NUM_SPLITS, TREE)

            # q: [64, 512] and [64, 64] into shared memory for the whole kernel
            tok, rowb = _tile_base(q_start, row0, H)
            q_c, q_r = _load_q(Q + tok * stride_qt, rowb, n, stride_qt, stride_qh, H, LD_C, LD_R)
            qc_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, KV_LORA], SW_C, q_c)
            qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, ROPE], SW_C, q_r)
            kc_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, KV_LORA], SW_C)
            kr_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], SW_C)
            p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], SW_P)

            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
            l_part = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
            acc = gl.zeros([BLOCK_H, KV_LORA], gl.float32, layout=O_L)
            s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
            keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))

            # prologue: tile 0 in flight, tile 1's slots loaded
            _copy_tile(kc_smem.index(0), kr_smem.index(0), KV,
                       load_slots(rtt_row, lo, hi, BLOCK_N, LD_C), load_slots(rtt_row, lo, hi, BLOCK_N, LD_R),
                       lo, hi, stride_kvt, BLOCK_N, LD_C, LD_R)
            sc = load_slots(rtt_row, lo + BLOCK_N, hi, BLOCK_N, LD_C)
            sr = load_slots(rtt_row, lo + BLOCK_N, hi, BLOCK_N, LD_R)
            n_tiles = gl.cdiv(hi - lo, BLOCK_N)
            for i in range(n_tiles):
                start = lo + i * BLOCK_N
                # every warp is done with tile i - 1 (its stage and P): refill that stage
                gl.thread_barrier()
                nxt = (i + 1) % 2
                _copy_tile(kc_smem.index(nxt), kr_smem.index(nxt), KV, sc, sr, start + BLOCK_N, hi,
                           stride_kvt, BLOCK_N, LD_C, LD_R)
                sc = load_slots(rtt_row, start + 2 * BLOCK_N, hi, BLOCK_N, LD_C)
                sr = load_slots(rtt_row, start + 2 * BLOCK_N, hi, BLOCK_N, LD_R)
                async_copy.wait_group(1)  # tile i has landed (this thread's copies)
                fence_async_shared()
                gl.thread_barrier()       # ... and every thread's

                cur = i % 2
                m_i, l_part, acc = _ks_tile(qc_smem, qr_smem, kc_smem.index(cur), kr_smem.index(cur),
                                            p_smem, s_zero, keys, start, P, hi, tree_row, rowb, n,
                                            stride_tmj, qk_scale, m_i, l_part, acc, dtype, H, TREE, S_L, O_L)
            async_copy.wait_group(0)
            _ks_store(O, O_PART, LSE_PART, acc, m_i, l_part, tok, rowb, n, split, stride_ot,
                      stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, H,
                      NUM_SPLITS, O_L)


    # ---- seesaw schedule (module docstring) ----
    # mbarriers ([_NB, 1]); each is arrived on once per phase (count 1), _FIN twice
    # Blocks are loaded and scored in the order 0 1 2 3 8 4 5 6 7: half A (value columns
    # 0-255 and the rope block 8), then half B (value columns 256-511).
    _READY = gl.constexpr(0)     # + stage * 9 + block: 64-column block b of a stage landed
    _EMPTY = gl.constexpr(18)    # + stage * 2 + half: half A (cols 0-255 + rope) / B freed
    _Q_READY = gl.constexpr(22)  # q_nope landed
    _P0_READY = gl.constexpr(23)
    _P0_FREE = gl.constexpr(24)
    _P1_READY = gl.constexpr(25)
    _P1_FREE = gl.constexpr(26)
    _FIN = gl.constexpr(27)      # row sums exchanged (count 2)
    _NB = gl.constexpr(28)
    # one warpgroup's layouts: the [64, 64] score tile, the [64, 256] output half, and P as
    # the register A operand of the PV GEMM
    _SS_S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, 64, 16]))
    _SS_O_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, 256, 16]))
    _SS_PA_L = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_SS_O_L.value, k_width=2))

    @gluon.jit
    def _ss_score_block(s, q_smem, q_pe, kc, kr, bars, stage, phase, b: gl.constexpr,
                        WAIT: gl.constexpr = True):
        """Wait for 64-column block ``b`` of a stage (unless ``WAIT`` is False: an fp8 tile's
        blocks are ready by groups) and issue its score GEMM (block 8: the rope block,
        ``q_pe`` from registers)."""
        if WAIT:
            mbarrier.wait(bars.index(_READY + stage * 9 + b), phase)
        if b < 8:
            s = warpgroup_mma(q_smem.slice(b * 64, 64, dim=1),
                              kc.slice(b * 64, 64, dim=1).permute((1, 0)), s, is_async=True)
        else:
            s = warpgroup_mma(q_pe, kr.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _ss_scores(q_smem, q_pe, kc, kr, bars, stage, phase, S_L: gl.constexpr,
                   FP8: gl.constexpr):
        """``[64, 64]`` float32 scores of one stage's keys: ``q_nope @ c^T`` over the eight
        64-column blocks of the latent and ``q_pe @ k_pe^T``, in the order the blocks land
        (half A, then half B; an fp8 tile is widened in three groups, blocks 7-4, then 3, 2
        and the rope block, then 1 and 0, each group on the ready barrier of its first block:
        :func:`_ss_gather8`), each block's GEMM issued as soon as it is in place."""
        s = gl.zeros([64, 64], gl.float32, layout=S_L)
        if FP8:
            for b in gl.static_range(6):
                s = _ss_score_block(s, q_smem, q_pe, kc, kr, bars, stage, phase, 7 - b,
                                    b == 0 or b == 4)
            s = _ss_score_block(s, q_smem, q_pe, kc, kr, bars, stage, phase, 8, False)
            for b in gl.static_range(2):
                s = _ss_score_block(s, q_smem, q_pe, kc, kr, bars, stage, phase, 1 - b, b == 0)
        else:
            for b in gl.static_range(4):
                s = _ss_score_block(s, q_smem, q_pe, kc, kr, bars, stage, phase, b)
            s = _ss_score_block(s, q_smem, q_pe, kc, kr, bars, stage, phase, 8)
            for b in gl.static_range(4, 8):
                s = _ss_score_block(s, q_smem, q_pe, kc, kr, bars, stage, phase, b)
        return warpgroup_mma_wait(0, deps=[s])

    @gluon.jit
    def _ss_load_qpe(Q, rowb, n, stride_qt, stride_qh, H: gl.constexpr, QA_L: gl.constexpr):
        """``q_pe`` of the tile's 64 packed rows (:func:`_rows`; ``Q`` points at the
        request's first token; rows past the request are zeros), ``[64, 64]``, as the
        register A operand."""
        j, h, ok = _rows(rowb, n, H, gl.SliceLayout(1, QA_L))
        c = 512 + gl.arange(0, 64, layout=gl.SliceLayout(0, QA_L))
        return gl.load(Q + (j.to(gl.int64) * stride_qt + h * stride_qh)[:, None] + c[None, :],
                       mask=ok[:, None], other=0.0)

    @gluon.jit
    def _ss_copy_block(kc, kr, src, ok, b: gl.constexpr):
        """``cp.async`` 64-column block ``b`` of a tile (``src``: ``[64, 64]`` pointers of
        block 0) as one commit group."""
        if b < 8:
            async_copy.async_copy_global_to_shared(kc.slice(b * 64, 64, dim=1), src + b * 64,
                                                   mask=ok[:, None])
        else:
            async_copy.async_copy_global_to_shared(kr, src + 512, mask=ok[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _ss_gather(kc, kr, bars, stage, phase, KV, rtt_row, start, hi, stride_kvt):
        """One key tile into a stage by ``cp.async`` through ``req_to_token`` (rows past
        ``hi`` zero-filled, never read): half A once it is free, then half B; each block's
        ready barrier is arrived on as soon as that block has landed."""
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = start + gl.arange(0, 64, layout=gl.SliceLayout(1, LD))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, LD))
        ok = rows < hi
        src = KV + (gl.load(rtt_row + rows, mask=ok, other=0).to(gl.int64) * stride_kvt)[:, None] \
            + cols[None, :]
        mbarrier.wait(bars.index(_EMPTY + stage * 2), phase ^ 1)
        for b in gl.static_range(4):
            _ss_copy_block(kc, kr, src, ok, b)
        _ss_copy_block(kc, kr, src, ok, 8)
        for b in gl.static_range(4):
            async_copy.wait_group(4 - b)
            fence_async_shared()  # the cp.async writes, before the wgmma (async proxy) reads
            mbarrier.arrive(bars.index(_READY + stage * 9 + b), count=1)
        async_copy.wait_group(0)
        fence_async_shared()
        mbarrier.arrive(bars.index(_READY + stage * 9 + 8), count=1)
        mbarrier.wait(bars.index(_EMPTY + stage * 2 + 1), phase ^ 1)
        for b in gl.static_range(4, 8):
            _ss_copy_block(kc, kr, src, ok, b)
        for b in gl.static_range(4, 8):
            async_copy.wait_group(7 - b)
            fence_async_shared()
            mbarrier.arrive(bars.index(_READY + stage * 9 + b), count=1)

    @gluon.jit
    def _ss_widen_q(q_smem, q_raw, bars):
        """``q_nope``, copied in ``q``'s type into ``q_raw`` (a view of ``q_smem``'s bytes),
        to ``q_smem``'s type in place (each thread rewrites the elements it read; nothing to
        do if the types agree), then arrive on ``_Q_READY``.  The caller has waited for its
        own copies."""
        LDQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        gl.thread_barrier()   # every thread's copies have landed
        if q_raw.dtype != q_smem.dtype:
            for b in gl.static_range(8):
                x = q_raw.slice(b * 64, 64, dim=1).load(LDQ)
                q_smem.slice(b * 64, 64, dim=1).store(x.to(q_smem.dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(bars.index(_Q_READY), count=1)

    @gluon.jit
    def _ss_ready(bars, stage, b: gl.constexpr):
        """Arrive on the ready barrier of block ``b`` of a stage (after a fence and a barrier
        of the loader's warps: every thread's stores)."""
        mbarrier.arrive(bars.index(_READY + stage * 9 + b), count=1)

    @gluon.jit
    def _ss_gather8(kc, kr, bars, stage, phase, KV, rtt_row, start, hi, stride_kvt, q_smem, q_raw,
                    first):
        """One fp8 key tile into a stage, widened in place (module docstring): once half A
        is free, ``cp.async`` the tile's 36 KB of fp8 bytes through ``req_to_token`` into it
        (the latent's 64-column blocks ``j`` at bytes ``4 KB * j`` of the stage's latent, the
        rope block in the second half of its rope tile; rows past ``hi`` zero-filled, never
        read) in three commit groups; once half B is free too, widen in three groups, each
        closed by one fence and one barrier of the loader's warps before the ready barrier of
        its first block: blocks 7-4 into half B (no fp8 byte there); blocks 3 and 2 (over fp8
        blocks 4-7) and the rope block (over its own bytes: read before a barrier, written
        after); blocks 1 and 0 (over fp8 blocks 0-3; 0 and 1 read before a barrier).  A group
        is one shared-memory load of its fp8 blocks and one store of its 16-bit blocks, in
        ``[blocks, 64, 64]`` views of the stage: the compiler puts a barrier of the loader's
        warps between any two accesses of one buffer that it cannot prove disjoint, and a
        load and a store per 64-column block cost two such barriers each.  With ``first``
        (tile 0), between its copy and its widening, ``q_nope`` (``q_raw``, copied in ``q``'s
        type) becomes fp16 in place (:func:`_ss_widen_q`)."""
        LDW: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        raw_c = kc._reinterpret(gl.float8e4nv, [1024, 64], RAW)   # fp8 block j: rows 64j..
        raw_r = kr._reinterpret(gl.float8e4nv, [128, 64], RAW).slice(64, 64, dim=0)
        rows = start + gl.arange(0, 64, layout=gl.SliceLayout(1, LDW))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, LDW))
        ok = (rows < hi)[:, None]
        src = KV + (gl.load(rtt_row + rows, mask=rows < hi, other=0).to(gl.int64)
                    * stride_kvt)[:, None] + cols[None, :]
        mbarrier.wait(bars.index(_EMPTY + stage * 2), phase ^ 1)
        for b in gl.static_range(4):
            async_copy.async_copy_global_to_shared(raw_c.slice((7 - b) * 64, 64, dim=0),
                                                   src + (7 - b) * 64, mask=ok)
        async_copy.commit_group()
        async_copy.async_copy_global_to_shared(raw_r, src + 512, mask=ok)
        for b in gl.static_range(2):
            async_copy.async_copy_global_to_shared(raw_c.slice((3 - b) * 64, 64, dim=0),
                                                   src + (3 - b) * 64, mask=ok)
        async_copy.commit_group()
        for b in gl.static_range(2):
            async_copy.async_copy_global_to_shared(raw_c.slice((1 - b) * 64, 64, dim=0),
                                                   src + (1 - b) * 64, mask=ok)
        async_copy.commit_group()
        if first:
            async_copy.wait_group(3)
            _ss_widen_q(q_smem, q_raw, bars)
        mbarrier.wait(bars.index(_EMPTY + stage * 2 + 1), phase ^ 1)
        # the stage as [block, key, column]: fp8 block j at bytes 4 KB * j, 16-bit block b
        # at 8 KB * b (the 128-byte swizzle of a [64, 512] tile is per 64 columns)
        LW3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [1, 4, 1], [2, 1, 0])
        raw3 = kc._reinterpret(gl.float8e4nv, [16, 64, 64],
                               gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
        kc3 = kc._reinterpret(kc.dtype, [8, 64, 64], gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=3))
        async_copy.wait_group(2)
        gl.thread_barrier()   # every thread's bytes of blocks 7-4 have landed
        x = raw3.slice(4, 4, dim=0).load(LW3)
        kc3.slice(4, 4, dim=0).store(x.to(kc.dtype))
        fence_async_shared()   # the generic-proxy stores, before the wgmma (async proxy) reads
        gl.thread_barrier()
        _ss_ready(bars, stage, 7)
        async_copy.wait_group(1)
        gl.thread_barrier()
        xr = raw_r.load(LDW)
        x = raw3.slice(2, 2, dim=0).load(LW3)
        kc3.slice(2, 2, dim=0).store(x.to(kc.dtype))
        gl.thread_barrier()   # every thread has read the rope block's fp8 bytes
        kr.store(xr.to(kr.dtype))
        fence_async_shared()
        gl.thread_barrier()
        _ss_ready(bars, stage, 3)
        async_copy.wait_group(0)
        gl.thread_barrier()
        x = raw3.slice(0, 2, dim=0).load(LW3)
        gl.thread_barrier()   # every thread has read fp8 blocks 0 and 1
        kc3.slice(0, 2, dim=0).store(x.to(kc.dtype))
        fence_async_shared()
        gl.thread_barrier()
        _ss_ready(bars, stage, 1)

    @gluon.jit
    def _ss_tma_block(kv_desc, kc, kr, bars, stage, slot0, b: gl.constexpr):
        """TMA 64-column block ``b`` of a whole-page tile (first slot ``slot0``) into a
        stage, completing its ready barrier."""
        bar = bars.index(_READY + stage * 9 + b)
        mbarrier.expect(bar, 64 * 64 * 2)
        if b < 8:
            tma.async_copy_global_to_shared(kv_desc, [slot0, b * 64], bar, kc.slice(b * 64, 64, dim=1))
        else:
            tma.async_copy_global_to_shared(kv_desc, [slot0, 512], bar, kr)

    @gluon.jit
    def _ss_loader(q_smem, kc_smem, kr_smem, p_smem, x_smem, bars, Q, KV, O, O_PART, LSE_PART,
                   rtt_row, tree_row, tok, rowb, n, split, P, lo, hi, n_tiles,
                   stride_qt, stride_qh, stride_tmj, stride_kvt, stride_ot, stride_oh, stride_ps,
                   stride_pt, stride_ph, stride_ls, stride_lt, qk_scale, v_scale, kv_desc,
                   H: gl.constexpr, NUM_SPLITS: gl.constexpr, TREE: gl.constexpr,
                   TMA: gl.constexpr, FP8: gl.constexpr):
        """Loader partition (4 warps): ``q_nope`` once, then every key tile into stage
        ``t % 2``, half A as soon as warpgroup 0 frees it, half B once warpgroup 1 does.
        With ``TMA`` (pages of a multiple of 64 keys) a whole tile at a multiple of 64 keys is
        one page's consecutive slots: 9 tensor-memory-accelerator copies of ``[64, 64]`` from
        the slot of its first key.  Other tiles (every tile without ``TMA``, a partial last
        tile, whose rows past ``hi`` must read as zeros, and the tiles of a last split that
        starts at an unaligned ``P``) are gathered by ``cp.async`` per key."""
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        j, h, ok = _rows(rowb, n, H, gl.SliceLayout(1, LD))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, LD))
        q_rows = Q + (j.to(gl.int64) * stride_qt + h * stride_qh)[:, None] + cols[None, :]
        q_raw = q_smem._reinterpret(Q.dtype.element_ty, [64, 512], SW128)
        for b in gl.static_range(8):   # rows past the request: zeros
            async_copy.async_copy_global_to_shared(q_raw.slice(b * 64, 64, dim=1), q_rows + b * 64,
                                                   mask=ok[:, None])
        async_copy.commit_group()
        if not FP8:
            async_copy.wait_group(0)
            fence_async_shared()
            mbarrier.arrive(bars.index(_Q_READY), count=1)
        for t in range(n_tiles):
            st = t % 2
            ph = (t // 2) & 1
            start = lo + t * 64
            kc = kc_smem.index(st)
            kr = kr_smem.index(st)
            if FP8:
                _ss_gather8(kc, kr, bars, st, ph, KV, rtt_row, start, hi, stride_kvt, q_smem, q_raw,
                            t == 0)
            elif TMA:
                # one page's consecutive slots: a whole tile at a multiple of 64 (the last
                # split starts at P, which need not be one)
                if (start % 64 == 0) & (start + 64 <= hi):
                    slot0 = gl.load(rtt_row + start)
                    mbarrier.wait(bars.index(_EMPTY + st * 2), ph ^ 1)
                    for b in gl.static_range(4):
                        _ss_tma_block(kv_desc, kc, kr, bars, st, slot0, b)
                    _ss_tma_block(kv_desc, kc, kr, bars, st, slot0, 8)
                    mbarrier.wait(bars.index(_EMPTY + st * 2 + 1), ph ^ 1)
                    for b in gl.static_range(4, 8):
                        _ss_tma_block(kv_desc, kc, kr, bars, st, slot0, b)
                else:
                    _ss_gather(kc, kr, bars, st, ph, KV, rtt_row, start, hi, stride_kvt)
            else:
                _ss_gather(kc, kr, bars, st, ph, KV, rtt_row, start, hi, stride_kvt)
        if FP8:
            if n_tiles == 0:   # a split without keys: q was not widened in the loop
                async_copy.wait_group(0)
                _ss_widen_q(q_smem, q_raw, bars)

    @gluon.jit
    def _ss_init(Q, rowb, n, stride_qt, stride_qh, H: gl.constexpr, bars, q3):
        """A warpgroup's start: ``q_pe`` in registers (in the type of ``q3``, ``q_nope``'s
        ``[1, 64, 512]`` shared memory), the tile's key offsets, ``m = -inf``, ``l = 0``,
        ``O = 0``; then wait until the loader has put ``q_nope`` in place."""
        S_L: gl.constexpr = _SS_S_L
        q_pe = _ss_load_qpe(Q, rowb, n, stride_qt, stride_qh, H,
                            gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2))
        q_pe = q_pe.to(q3.dtype)   # an fp8 cache's tiles are fp16
        keys = gl.arange(0, 64, layout=gl.SliceLayout(0, S_L))
        m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, S_L))
        acc = gl.zeros([64, 256], gl.float32, layout=_SS_O_L)
        mbarrier.wait(bars.index(_Q_READY), 0)
        return q_pe, keys, m_i, l_i, acc

    @gluon.jit
    def _ss_epilogue(acc, m_i, l_i, x_smem, bars, WG: gl.constexpr, O, O_PART, LSE_PART, tok,
                     rowb, n, split, stride_ot, stride_oh, stride_ps, stride_pt, stride_ph,
                     stride_ls, stride_lt, v_scale, H: gl.constexpr, NUM_SPLITS: gl.constexpr,
                     O_L: gl.constexpr, FP8: gl.constexpr):
        """Exchange the two warpgroups' row sums, then store this warpgroup's 256 columns
        (times ``v_scale``, an fp8 cache's scale, with ``FP8``)."""
        if FP8:
            acc = acc * v_scale
        x_smem.index(2 + WG).store(l_i)
        mbarrier.arrive(bars.index(_FIN), count=1)
        mbarrier.wait(bars.index(_FIN), 0)
        l_tot = l_i + x_smem.index(3 - WG).load(l_i.type.layout)
        j, h, ok = _rows(rowb, n, H, gl.SliceLayout(1, O_L))
        store_out(O, O_PART, LSE_PART, acc, gl.convert_layout(m_i, gl.SliceLayout(1, O_L)),
                  gl.convert_layout(l_tot, gl.SliceLayout(1, O_L)), tok + j, h,
                  WG * 256 + gl.arange(0, 256, layout=gl.SliceLayout(0, O_L)), ok, split,
                  stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                  NUM_SPLITS)

    @gluon.jit
    def _ss_wg0(q3, kc_smem, kr_smem, p_smem, x_smem, bars, Q, KV, O, O_PART, LSE_PART,
                rtt_row, tree_row, tok, rowb, n, split, P, lo, hi, n_tiles,
                stride_qt, stride_qh, stride_tmj, stride_kvt, stride_ot, stride_oh, stride_ps,
                stride_pt, stride_ph, stride_ls, stride_lt, qk_scale, v_scale, kv_desc,
                H: gl.constexpr, NUM_SPLITS: gl.constexpr, TREE: gl.constexpr,
                TMA: gl.constexpr, FP8: gl.constexpr, zero):
        """Warpgroup 0: the scores of the even tiles, value columns ``[0, 256)``."""
        q_pe, keys, m_i, l_i, acc = _ss_init(Q, rowb, n, stride_qt, stride_qh, H, bars, q3)
        for k in range(gl.cdiv(n_tiles, 2)):
            ph = k & 1
            z = k & zero   # 0, opaque: descriptors built in the loop (_mla_seesaw_kernel)
            s = _ss_scores(q3.index(z), q_pe, kc_smem.index(z), kr_smem.index(z), bars, 0, ph, _SS_S_L, FP8)
            s = _mask_scores(s, qk_scale, lo + 2 * k * 64, keys, P, hi, tree_row, rowb, n, stride_tmj,
                             H, TREE, _SS_S_L)
            m0 = gl.maximum(m_i, gl.max(s, axis=1))
            m0_use = gl.where(m0 == float("-inf"), 0.0, m0)
            scale0 = gl.exp2(m_i - m0_use)
            p = gl.exp2(s - m0_use[:, None])
            l_i = l_i * scale0 + gl.sum(p, axis=1)
            pb = p.to(p_smem.dtype)
            mbarrier.wait(bars.index(_P0_FREE), ph ^ 1)
            p_smem.index(0).store(pb)
            x_smem.index(0).store(m0)
            fence_async_shared()
            mbarrier.arrive(bars.index(_P0_READY), count=1)
            acc = acc * gl.convert_layout(scale0, gl.SliceLayout(1, _SS_O_L))[:, None]
            acc = warpgroup_mma(gl.convert_layout(pb, _SS_PA_L), kc_smem.index(z).slice(0, 256, dim=1),
                                acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(bars.index(_EMPTY + 0), count=1)  # stage 0, half A
            # warpgroup 1's max over both tiles and its P
            mbarrier.wait(bars.index(_P1_READY), ph)
            m1 = x_smem.index(1).load(gl.SliceLayout(1, _SS_S_L))
            scale1 = gl.where(m0 == float("-inf"), 1.0, gl.exp2(m0 - m1))
            acc = acc * gl.convert_layout(scale1, gl.SliceLayout(1, _SS_O_L))[:, None]
            l_i = l_i * scale1
            m_i = m1
            if 2 * k + 1 < n_tiles:
                acc = warpgroup_mma(p_smem.index(1), kc_smem.index(1 + z).slice(0, 256, dim=1), acc,
                                    is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(bars.index(_EMPTY + 2), count=1)  # stage 1, half A
            mbarrier.arrive(bars.index(_P1_FREE), count=1)
        _ss_epilogue(acc, m_i, l_i, x_smem, bars, 0, O, O_PART, LSE_PART, tok, rowb, n, split,
                     stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                     v_scale, H, NUM_SPLITS, _SS_O_L, FP8)

    @gluon.jit
    def _ss_wg1(q3, kc_smem, kr_smem, p_smem, x_smem, bars, Q, KV, O, O_PART, LSE_PART,
                rtt_row, tree_row, tok, rowb, n, split, P, lo, hi, n_tiles,
                stride_qt, stride_qh, stride_tmj, stride_kvt, stride_ot, stride_oh, stride_ps,
                stride_pt, stride_ph, stride_ls, stride_lt, qk_scale, v_scale, kv_desc,
                H: gl.constexpr, NUM_SPLITS: gl.constexpr, TREE: gl.constexpr,
                TMA: gl.constexpr, FP8: gl.constexpr, zero):
        """Warpgroup 1: the scores of the odd tiles, value columns ``[256, 512)``."""
        q_pe, keys, m_i, l_i, acc = _ss_init(Q, rowb, n, stride_qt, stride_qh, H, bars, q3)
        for k in range(gl.cdiv(n_tiles, 2)):
            ph = k & 1
            has1 = 2 * k + 1 < n_tiles
            z = k & zero   # 0, opaque (see warpgroup 0)
            if has1:
                s = _ss_scores(q3.index(z), q_pe, kc_smem.index(1 + z), kr_smem.index(1 + z), bars, 1, ph, _SS_S_L, FP8)
                s = _mask_scores(s, qk_scale, lo + (2 * k + 1) * 64, keys, P, hi, tree_row, rowb, n,
                                 stride_tmj, H, TREE, _SS_S_L)
            else:
                s = gl.full([64, 64], float("-inf"), gl.float32, layout=_SS_S_L)
            mp = gl.max(s, axis=1)
            # warpgroup 0's max and P of the even tile
            mbarrier.wait(bars.index(_P0_READY), ph)
            m0 = x_smem.index(0).load(gl.SliceLayout(1, _SS_S_L))
            scale0 = gl.exp2(m_i - gl.where(m0 == float("-inf"), 0.0, m0))
            acc = acc * gl.convert_layout(scale0, gl.SliceLayout(1, _SS_O_L))[:, None]
            acc = warpgroup_mma(p_smem.index(0), kc_smem.index(z).slice(256, 256, dim=1), acc,
                                is_async=True)
            m1 = gl.maximum(m0, mp)
            m1_use = gl.where(m1 == float("-inf"), 0.0, m1)
            scale1 = gl.where(m0 == float("-inf"), 1.0, gl.exp2(m0 - m1))
            p = gl.exp2(s - m1_use[:, None])
            l_i = l_i * scale0 * scale1 + gl.sum(p, axis=1)
            pb = p.to(p_smem.dtype)
            mbarrier.wait(bars.index(_P1_FREE), ph ^ 1)
            if has1:
                p_smem.index(1).store(pb)
            x_smem.index(1).store(m1)
            fence_async_shared()
            mbarrier.arrive(bars.index(_P1_READY), count=1)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(bars.index(_P0_FREE), count=1)
            mbarrier.arrive(bars.index(_EMPTY + 1), count=1)  # stage 0, half B
            acc = acc * gl.convert_layout(scale1, gl.SliceLayout(1, _SS_O_L))[:, None]
            if has1:
                acc = warpgroup_mma(gl.convert_layout(pb, _SS_PA_L),
                                    kc_smem.index(1 + z).slice(256, 256, dim=1), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(bars.index(_EMPTY + 3), count=1)  # stage 1, half B
            m_i = m1
        _ss_epilogue(acc, m_i, l_i, x_smem, bars, 1, O, O_PART, LSE_PART, tok, rowb, n, split,
                     stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                     v_scale, H, NUM_SPLITS, _SS_O_L, FP8)

    @gluon.jit
    def _mla_seesaw_kernel(
            Q, KV, O, O_PART, LSE_PART, req_to_token, req_pool_indices, prefix_lens, qo_indptr,
            tree_mask,
            stride_qt, stride_qh, stride_kvt, stride_ot, stride_oh,
            stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_rtt,
            stride_tmb, stride_tmj,
            qk_scale, v_scale, kv_desc, zero,
            H: gl.constexpr, NUM_SPLITS: gl.constexpr, TREE: gl.constexpr, TMA: gl.constexpr,
            FP8: gl.constexpr):
        """The seesaw schedule (module docstring): the arguments of :func:`_mla_sm90_kernel`
        (``qk_scale`` with an fp8 cache's scale folded in) plus ``v_scale`` (that scale, applied
        to the accumulator once with ``FP8``), and ``kv_desc``, a TMA descriptor over the
        cache viewed ``[num_slots, 576]`` with ``[64, 64]`` boxes (None unless ``TMA``; never
        with ``FP8``); ``FP8``: an fp8 e4m3 cache, widened to fp16 tiles by the loader.  4 warps
        here (warpgroup 0) and two 4-warp workers (warpgroup 1, the loader), launched with
        ``maxnreg=168`` (504 registers a thread slot over the three partitions): with ``TMA``
        the warpgroups get 240 registers and the loader 24 (a TMA loader holds a few scalars;
        the warpgroups' loops then spill less: 6-13 % faster decode on an H100, output bit for
        bit the same), otherwise 232 and 40 (with ``FP8`` 224 and 56: the loader holds a
        widening group's fp8 bytes, 32 registers, besides the gather's addresses).  ``zero``: a
        runtime 0 (the launcher's).  The warpgroups index ``q``'s and the stages' shared
        memory with ``k & zero`` in their loops, so the compiler cannot prove those operands
        loop-invariant: their wgmma descriptors are then computed next to each GEMM from one
        base instead of hoisted out of the loop, where ptxas kept 16 and more of them spilled
        to local memory (112-224 bytes of spill stores in every configuration; with it none in
        the warpgroups' loops)."""
        BLOCK_N: gl.constexpr = 64
        # the tiles' type: q's, or fp16 for an fp8 cache (one conversion per pair of values)
        dtype: gl.constexpr = gl.float16 if FP8 else Q.dtype.element_ty
        row0, req, split, q_start, n = _cta_tile(qo_indptr, NUM_SPLITS)
        if row0 < n * H:
            P, rtt_row, lo, hi, tree_row = _cta_keys(
                prefix_lens, req_to_token, req_pool_indices, tree_mask, req, split, row0, n,
                stride_rtt, stride_tmb, stride_tmj, H, BLOCK_N, NUM_SPLITS, TREE)
            n_tiles = gl.cdiv(hi - lo, BLOCK_N)
            SW: gl.constexpr = SW128
            XL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
            q3 = gl.allocate_shared_memory(dtype, [1, 64, 512], SW)
            q_smem = q3.index(0)
            kc_smem = gl.allocate_shared_memory(dtype, [2, 64, 512], SW)
            kr_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], SW)
            p_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], SW)
            x_smem = gl.allocate_shared_memory(gl.float32, [4, 64], XL)
            bars = gl.allocate_shared_memory(gl.int64, [_NB, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(_FIN):
                mbarrier.init(bars.index(i), count=1)
            mbarrier.init(bars.index(_FIN), count=2)
            tok, rowb = _tile_base(q_start, row0, H)
            qt = Q + tok * stride_qt
            gl.warp_specialize([
                (_ss_wg0, (q3, kc_smem, kr_smem, p_smem, x_smem, bars, qt, KV, O, O_PART, LSE_PART,
                           rtt_row, tree_row, tok, rowb, n, split, P, lo, hi, n_tiles,
                           stride_qt, stride_qh, stride_tmj, stride_kvt, stride_ot, stride_oh,
                           stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, qk_scale,
                           v_scale, kv_desc, H, NUM_SPLITS, TREE, TMA, FP8, zero)),
                (_ss_wg1, (q3, kc_smem, kr_smem, p_smem, x_smem, bars, qt, KV, O, O_PART, LSE_PART,
                           rtt_row, tree_row, tok, rowb, n, split, P, lo, hi, n_tiles,
                           stride_qt, stride_qh, stride_tmj, stride_kvt, stride_ot, stride_oh,
                           stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, qk_scale,
                           v_scale, kv_desc, H, NUM_SPLITS, TREE, TMA, FP8, zero)),
                (_ss_loader, (q_smem, kc_smem, kr_smem, p_smem, x_smem, bars, qt, KV, O, O_PART, LSE_PART,
                           rtt_row, tree_row, tok, rowb, n, split, P, lo, hi, n_tiles,
                           stride_qt, stride_qh, stride_tmj, stride_kvt, stride_ot, stride_oh,
                           stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, qk_scale,
                           v_scale, kv_desc, H, NUM_SPLITS, TREE, TMA, FP8))],
                               [4, 4], [240, 24] if TMA else ([224, 56] if FP8 else [232, 40]))   # see the docstring


    @gluon.jit
    def _copy_tile8(k8, KV, slots, start, hi, stride_kvt, BLOCK_N: gl.constexpr, LDW: gl.constexpr):
        """cp.async the fp8 rows (512 latent + 64 rope values) of keys ``start + [0, BLOCK_N)``
        into one ring stage ``[9, BLOCK_N, 64]``, block by 64-column block in ``LDW`` (rows past
        ``hi`` zero-filled), one commit group."""
        rows = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LDW))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, LDW))
        src = KV + slots.to(gl.int64)[:, None] * stride_kvt + cols[None, :]
        ok = (rows < hi)[:, None]
        for b in gl.static_range(9):
            async_copy.async_copy_global_to_shared(k8.index(b), src + b * 64, mask=ok)
        async_copy.commit_group()

    @gluon.jit
    def _widen(k8, kc, kr, LDW: gl.constexpr):
        """fp8 stage ``[9, BLOCK_N, 64]`` -> the fp16 tiles (latent ``[BLOCK_N, 512]``, rope
        ``[BLOCK_N, 64]``), 64 columns at a time in the copy's layout: each thread reads back
        only the bytes it copied itself."""
        for b in gl.static_range(8):
            kc.slice(b * 64, 64, dim=1).store(k8.index(b).load(LDW).to(gl.float16))
        kr.store(k8.index(8).load(LDW).to(gl.float16))

    @gluon.jit
    def _mla_sm90_fp8_kernel(
            Q, KV, O, O_PART, LSE_PART, req_to_token, req_pool_indices, prefix_lens, qo_indptr,
            tree_mask,
            stride_qt, stride_qh, stride_kvt, stride_ot, stride_oh,
            stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_rtt,
            stride_tmb, stride_tmj,
            qk_scale, v_scale,
            H: gl.constexpr, BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr,
            TREE: gl.constexpr):
        """The key-split schedule over an fp8 e4m3 cache (module docstring): the arguments of
        :func:`_mla_sm90_kernel`, ``qk_scale`` with the cache's scale folded in, and
        ``v_scale`` (the cache's scale) applied to the accumulator once; 8 warps."""
        BLOCK_H: gl.constexpr = 64
        KV_LORA: gl.constexpr = 512
        ROPE: gl.constexpr = 64
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BLOCK_N // 2, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, KV_LORA // 2, 16])
        # q loads (bf16, 8 per thread) and fp8 tile copies / widening (16 per thread)
        LDQ_C: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        LDQ_R: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        VEC: gl.constexpr = 16 if BLOCK_N == 64 else 8     # bytes per cp.async: a [BLOCK_N, 64] block per pass
        LDW: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // 64, 64 // VEC], [8, 1], [1, 0])
        SW: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        SW_P: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128 if BLOCK_N >= 64 else BLOCK_N * 2, element_bitwidth=16, rank=2)
        RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])

        row0, req, split, q_start, n = _cta_tile(qo_indptr, NUM_SPLITS)
        if row0 < n * H:
            P, rtt_row, lo, hi, tree_row = _cta_keys(
                prefix_lens, req_to_token, req_pool_indices, tree_mask, req, split, row0, n,
                stride_rtt, stride_tmb, stride_tmj, H, BLOCK_N, NUM_SPLITS, TREE)
            tok, rowb = _tile_base(q_start, row0, H)
            q_c, q_r = _load_q(Q + tok * stride_qt, rowb, n, stride_qt, stride_qh, H, LDQ_C, LDQ_R)
            qc_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_H, KV_LORA], SW, q_c.to(gl.float16))
            qr_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_H, ROPE], SW, q_r.to(gl.float16))
            k8a = gl.allocate_shared_memory(gl.float8e4nv, [9, BLOCK_N, 64], RAW)   # ring stage 0
            k8b = gl.allocate_shared_memory(gl.float8e4nv, [9, BLOCK_N, 64], RAW)   # ring stage 1
            kc = gl.allocate_shared_memory(gl.float16, [BLOCK_N, KV_LORA], SW)
            kr = gl.allocate_shared_memory(gl.float16, [BLOCK_N, ROPE], SW)
            p_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_H, BLOCK_N], SW_P)

            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
            l_part = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
            acc = gl.zeros([BLOCK_H, KV_LORA], gl.float32, layout=O_L)
            s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
            keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))

            _copy_tile8(k8a, KV, load_slots(rtt_row, lo, hi, BLOCK_N, LDW), lo, hi, stride_kvt, BLOCK_N, LDW)
            sl = load_slots(rtt_row, lo + BLOCK_N, hi, BLOCK_N, LDW)
            n_tiles = gl.cdiv(hi - lo, BLOCK_N)
            for i in range(n_tiles):
                start = lo + i * BLOCK_N
                gl.thread_barrier()   # every warp is done with tile i - 1: its ring stage and the fp16 tile
                if i % 2 == 0:
                    _copy_tile8(k8b, KV, sl, start + BLOCK_N, hi, stride_kvt, BLOCK_N, LDW)
                else:
                    _copy_tile8(k8a, KV, sl, start + BLOCK_N, hi, stride_kvt, BLOCK_N, LDW)
                sl = load_slots(rtt_row, start + 2 * BLOCK_N, hi, BLOCK_N, LDW)
                async_copy.wait_group(1)   # tile i's bytes that this thread copied have landed
                if i % 2 == 0:
                    _widen(k8a, kc, kr, LDW)
                else:
                    _widen(k8b, kc, kr, LDW)
                fence_async_shared()
                gl.thread_barrier()
                m_i, l_part, acc = _ks_tile(qc_smem, qr_smem, kc, kr, p_smem, s_zero, keys, start, P,
                                            hi, tree_row, rowb, n, stride_tmj, qk_scale, m_i, l_part,
                                            acc, gl.float16, H, TREE, S_L, O_L)
            async_copy.wait_group(0)
            _ks_store(O, O_PART, LSE_PART, acc * v_scale, m_i, l_part, tok, rowb, n, split,
                      stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                      H, NUM_SPLITS, O_L)


def sm90_mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor,
                       req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                       qo_indptr: torch.Tensor, tree_mask: Optional[torch.Tensor], max_q: int,
                       sm_scale: float, out: torch.Tensor, o_part: torch.Tensor,
                       lse: torch.Tensor, num_splits: int, block_n: int = 64,
                       seesaw: bool = True, page_size: int = 1, kv_scale: float = 1.0) -> None:
    """Launch the Gluon MLA kernel (module docstring).  Called by
    :func:`.attention_mla.mla_paged_attention`, which validates every argument and index,
    allocates ``out`` ``[T, H, 512]`` and, with ``num_splits > 1``, the float32 partials
    ``o_part [S, T, H, 512]`` / ``lse [S, T, H]`` it then merges; :func:`sm90_mla_supported`
    must have returned None.  ``q [T, H, 576]`` bf16/fp16 (``[q_nope_absorbed | q_pe]``, any
    ``H``); ``kv_cache [num_slots, 1, 576]`` of ``q``'s dtype or fp8 e4m3;
    ``req_to_token`` int32 ``[rows, width]``; ``req_pool_indices`` int64 /
    ``prefix_lens`` int32 ``[bs]``; ``qo_indptr`` int32 ``[bs + 1]``; ``tree_mask``: int32 ``[bs, D, ceil(D/32)]`` (TARGET_VERIFY) or None
    (causal); ``max_q``: static bound of new tokens per request (grid axis 0 is
    ``cdiv(max_q * H, 64)`` row tiles);
    ``sm_scale`` multiplies ``q . k``; ``block_n``: keys per tile, 32 or 64 (ValueError
    otherwise); ``seesaw``: FlashMLA's seesaw schedule (:func:`_mla_seesaw_kernel`, 64-key
    tiles only, ValueError with 32) instead of the key split; ``page_size``: the pool's page
    size -- with a multiple of 64 (and a 16-byte aligned cache and row stride) the seesaw
    kernel copies whole-page tiles by TMA, which assumes the pool's page layout (key ``p`` of
    a request at slot ``page * page_size + p % page_size``; see
    :func:`.attention_mla.mla_paged_attention`'s ``page_size``); ``kv_scale``: an fp8
    cache's dequantization scale (1.0 for other caches).
    No host sync."""
    if block_n not in (32, 64) or (seesaw and block_n != 64):
        raise ValueError(f"block_n must be 64 (seesaw) or 32/64 (key split), got {block_n}")
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    bs, H = req_pool_indices.shape[0], q.shape[1]
    ps = o_part.stride() if num_splits > 1 else (0, 0, 0, 0)
    ls = lse.stride() if num_splits > 1 else (0, 0, 0)
    tm = tree_mask if tree_mask is not None else prefix_lens
    tms = (tree_mask.stride(0), tree_mask.stride(1)) if tree_mask is not None else (0, 0)
    grid = (triton.cdiv(max_q * H, BLOCK_H), bs * num_splits)
    args = (q, kv_cache, out, o_part, lse, req_to_token, req_pool_indices, prefix_lens, qo_indptr, tm,
            q.stride(0), q.stride(1), kv_cache.stride(0), out.stride(0), out.stride(1),
            ps[0], ps[1], ps[2], ls[0], ls[1], req_to_token.stride(0), tms[0], tms[1],
            sm_scale * kv_scale * 1.4426950408889634)   # kv_scale: 1.0 but for fp8
    modes = dict(H=H, NUM_SPLITS=num_splits, TREE=tree_mask is not None)
    if fp8 and not seesaw:
        _mla_sm90_fp8_kernel[grid](*args, kv_scale, BLOCK_N=block_n, **modes, num_warps=8)
        return
    if not seesaw:
        _mla_sm90_kernel[grid](*args, BLOCK_N=block_n, **modes, num_warps=8)
        return
    kv2d = kv_cache[:, 0, :]
    desc = None
    if (not fp8 and page_size % 64 == 0 and kv2d.data_ptr() % 16 == 0
            and (kv2d.stride(0) * kv2d.element_size()) % 16 == 0):
        desc = TensorDescriptor.from_tensor(kv2d, [64, 64], SW128.value)
    _mla_seesaw_kernel[grid](*args, kv_scale, desc, 0, **modes, TMA=desc is not None, FP8=fp8, num_warps=4,
                             maxnreg=168)
