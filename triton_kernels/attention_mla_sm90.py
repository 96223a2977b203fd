"""Hopper (sm_90) absorbed-MLA attention in Gluon: two warpgroups share one score tile.

Why a second kernel: the Triton kernel of :mod:`.attention_mla` lets the compiler place the
warps, and for a score dot that feeds another dot Triton puts all of them along the rows, so
with 64 heads per program both warpgroups compute the same scores, or (the default) two
programs each own half of the value width and both compute every score: 1.53x the useful
tensor-core work, and MLA at 128 heads is compute-bound (decode: 2.3x FlashMLA's time on an
H100).  Gluon (Triton's explicit-layout dialect, ``triton.experimental.gluon``) lets the
kernel choose the split FlashMLA uses (deepseek-ai/FlashMLA: 64 heads per CTA, 8 warps, the
value width split across the two warpgroups; no code copied):

- CTA = 64 heads (``BLOCK_H``) of ONE query token x one KV split; grid
  ``(H / 64, max_q, bs * num_splits)`` (``(H / 64, bs * num_splits)`` when ``max_q == 1``):
  axis 1 is the token ``j`` among its request's ``n``
  new tokens (CTAs with ``j >= n`` exit), so every mode runs here -- DECODE (``n = 1``),
  EXTEND / DRAFT_EXTEND_V2 (causal: token ``j`` sees keys ``< P + j + 1``) and TARGET_VERIFY
  (the ``n`` draft keys through the token's bit-packed tree-mask row, bit ``k % 32`` of word
  ``k // 32``; one row per CTA, so the visibility is a vector over the tile's keys).
  8 warps = two warpgroups.
- Scores ``S [64, BLOCK_N] = q_nope @ c^T + q_pe @ k_pe^T`` by ``wgmma`` with the accumulator
  layout ``warps_per_cta = [4, 2]``: warpgroup ``g`` computes the scores of keys
  ``g * BLOCK_N/2 + [0, BLOCK_N/2)``, so no score is computed twice.  ``q`` (``[64, 512]`` and
  ``[64, 64]``) sits in shared memory for the whole kernel.
- Online softmax in float32, log2 domain.  The row max is reduced across the two warpgroups
  (one shared-memory exchange per tile); the row sum is kept per thread as a ``[64, BLOCK_N]``
  partial and reduced once at the end.
- ``P`` (bf16/fp16) goes to shared memory, and ``O [64, 512] += P @ c`` by ``wgmma`` with
  ``warps_per_cta = [4, 2]`` again: warpgroup ``g`` owns value columns ``g * 256 + [0, 256)``
  (a ``64 x 256`` float32 accumulator, 128 registers per thread).  The latent tile is loaded
  once into shared memory and is both the key and the value operand.
- Key tiles (``[BLOCK_N, 512]`` + ``[BLOCK_N, 64]``) are gathered by ``cp.async`` through
  ``req_to_token`` (one slot per key, so any page size works), double-buffered: tile ``i + 1``
  streams in while tile ``i`` is computed; the slot indices are loaded one tile earlier still.
- Split-KV as :mod:`.attention_mla`: split ``s`` covers prefix keys ``[s * c, min((s + 1) *
  c, P))`` with ``c = cdiv(cdiv(P, S), BLOCK_N) * BLOCK_N``, the last split also this
  forward's keys; partial outputs and base-2 log-sum-exps go to the same workspace as the
  Triton kernel's and :func:`.attention._merge_kernel` combines them.

Scope (:func:`sm90_mla_supported`): bf16/fp16 ``q`` and cache of the same dtype,
``kv_lora_rank = 512``, ``qk_rope_head_dim = 64``, heads a multiple of 64, an sm_90 GPU.
Everything else (and any CPU run: Gluon has no interpreter) uses :mod:`.attention_mla`.

Shared memory at ``BLOCK_N = 64``: ``q`` 72 KB + 2 x 72 KB latent stages + 8 KB ``P`` = 224 KB
(one CTA per SM).  No host sync.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

try:  # Gluon ships with Triton >= 3.4; its Hopper ops are only compiled on an sm_90 device
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                                   warpgroup_mma,
                                                                   warpgroup_mma_wait)
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["sm90_mla_attention", "sm90_mla_supported", "HAVE_GLUON", "BLOCK_H"]

BLOCK_H = 64       # heads per CTA (one wgmma M tile)
KV_LORA, ROPE = 512, 64


def sm90_device_needs(t: torch.Tensor) -> list:
    """What the Gluon sm_90 kernels need and ``t``'s device or Triton lacks: a Triton with
    Gluon and an sm_90 GPU (list of strings, empty when both are there)."""
    why = []
    if not HAVE_GLUON:
        why.append("this Triton has no Gluon")
    if t.device.type != "cuda" or torch.cuda.get_device_capability(t.device) != (9, 0):
        why.append(f"an sm_90 GPU (got {t.device})")
    return why


def sm90_mla_supported(q: torch.Tensor, kv_cache: torch.Tensor,
                       kv_lora_rank: int) -> Optional[str]:
    """None when :func:`sm90_mla_attention` can run this call, else the reason it cannot (a
    string).  Shapes as in :func:`.attention_mla.mla_paged_attention`."""
    why = sm90_device_needs(q)
    if q.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype != q.dtype:
        why.append(f"bf16/fp16 q and cache of one dtype (got {q.dtype} / {kv_cache.dtype})")
    if kv_lora_rank != KV_LORA or q.shape[-1] != KV_LORA + ROPE:
        why.append(f"kv_lora_rank {KV_LORA} and qk_rope_head_dim {ROPE}")
    if q.shape[1] % BLOCK_H != 0:
        why.append(f"a head count divisible by {BLOCK_H} (got {q.shape[1]})")
    return "; ".join(why) if why else None


if HAVE_GLUON:

    @gluon.jit
    def _slots(rtt_row, start, hi, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
        """int32 slots of keys ``start + [0, BLOCK_N)`` (0 past ``hi``), in ``LAYOUT``'s rows."""
        rows = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
        return gl.load(rtt_row + rows, mask=rows < hi, other=0)

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
    def _store_out(O, O_PART, LSE_PART, acc, m_i, l_i, tok, head, cols, ok, split,
                   stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                   NUM_SPLITS: gl.constexpr):
        """Epilogue of both sm_90 kernels (``.attention._store_rows``'s contract): normalise
        the ``[rows, width]`` float32 accumulator by the row sums ``l_i`` and store it to
        ``O[tok, head, cols]`` in ``O``'s dtype, or with split-KV the float32 partial to
        ``O_PART[split, tok, head, cols]`` and the base-2 log-sum-exp to
        ``LSE_PART[split, tok, head]``.  ``m_i``/``l_i``/``tok`` (int64)/``head``/``ok`` are
        in the accumulator's row layout; a row with ``l_i == 0`` gets zeros (LSE ``-inf``);
        rows where ``ok`` is False are not written."""
        l_safe = gl.where(l_i > 0.0, l_i, 1.0)
        out = gl.where((l_i > 0.0)[:, None], acc / l_safe[:, None], 0.0)
        if NUM_SPLITS == 1:
            gl.store(O + (tok * stride_ot + head * stride_oh)[:, None] + cols[None, :],
                     out.to(O.dtype.element_ty), mask=ok[:, None])
        else:
            sp = split.to(gl.int64)
            gl.store(O_PART + sp * stride_ps + (tok * stride_pt + head * stride_ph)[:, None]
                     + cols[None, :], out, mask=ok[:, None])
            lse = gl.where(l_i > 0.0, m_i + gl.log2(l_safe), float("-inf"))
            gl.store(LSE_PART + sp * stride_ls + tok * stride_lt + head, lse, mask=ok)

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
    def _mla_sm90_kernel(
            Q, KV, O, O_PART, LSE_PART, req_to_token, req_pool_indices, seq_lens, qo_indptr,
            tree_mask,
            stride_qt, stride_qh, stride_kvt, stride_ot, stride_oh,
            stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_rtt,
            stride_tmb, stride_tmj,
            qk_scale,
            BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr, TREE: gl.constexpr,
            DECODE: gl.constexpr):
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

        pid_h = gl.program_id(0)
        if DECODE:  # max_q == 1: a 2-D grid, the one token
            j = 0
            pid2 = gl.program_id(1)
        else:
            j = gl.program_id(1)  # this CTA's token among its request's n new tokens
            pid2 = gl.program_id(2)
        req = pid2 // NUM_SPLITS
        split = pid2 % NUM_SPLITS
        q_start = gl.load(qo_indptr + req)
        n = gl.load(qo_indptr + req + 1) - q_start
        if j < n:
            tok = (q_start + j).to(gl.int64)
            P = gl.load(seq_lens + req)
            rtt_row = req_to_token + gl.load(req_pool_indices + req).to(gl.int64) * stride_rtt
            if TREE:
                kv_end = P + n
            else:  # causal: token j sees this forward's keys up to itself
                kv_end = P + j + 1
            if NUM_SPLITS == 1:
                lo = 0
                hi = kv_end
            else:  # splits share the prefix; the last one also takes this forward's keys
                chunk = gl.cdiv(gl.cdiv(P, NUM_SPLITS), BLOCK_N) * BLOCK_N
                lo = gl.minimum(split * chunk, P)
                hi = gl.where(split == NUM_SPLITS - 1, kv_end, gl.minimum(lo + chunk, P))
            tree_row = tree_mask + req.to(gl.int64) * stride_tmb + j * stride_tmj

            # q: [64, 512] and [64, 64] into shared memory for the whole kernel
            heads_c = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD_C))
            cols_c = gl.arange(0, KV_LORA, layout=gl.SliceLayout(0, LD_C))
            q_c = gl.load(Q + tok * stride_qt + heads_c.to(gl.int64)[:, None] * stride_qh
                          + cols_c[None, :])
            heads_r = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD_R))
            cols_r = KV_LORA + gl.arange(0, ROPE, layout=gl.SliceLayout(0, LD_R))
            q_r = gl.load(Q + tok * stride_qt + heads_r.to(gl.int64)[:, None] * stride_qh
                          + cols_r[None, :])
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
                       _slots(rtt_row, lo, hi, BLOCK_N, LD_C), _slots(rtt_row, lo, hi, BLOCK_N, LD_R),
                       lo, hi, stride_kvt, BLOCK_N, LD_C, LD_R)
            sc = _slots(rtt_row, lo + BLOCK_N, hi, BLOCK_N, LD_C)
            sr = _slots(rtt_row, lo + BLOCK_N, hi, BLOCK_N, LD_R)
            n_tiles = gl.cdiv(hi - lo, BLOCK_N)
            for i in range(n_tiles):
                start = lo + i * BLOCK_N
                # every warp is done with tile i - 1 (its stage and P): refill that stage
                gl.thread_barrier()
                nxt = (i + 1) % 2
                _copy_tile(kc_smem.index(nxt), kr_smem.index(nxt), KV, sc, sr, start + BLOCK_N, hi,
                           stride_kvt, BLOCK_N, LD_C, LD_R)
                sc = _slots(rtt_row, start + 2 * BLOCK_N, hi, BLOCK_N, LD_C)
                sr = _slots(rtt_row, start + 2 * BLOCK_N, hi, BLOCK_N, LD_R)
                async_copy.wait_group(1)  # tile i has landed (this thread's copies)
                fence_async_shared()
                gl.thread_barrier()       # ... and every thread's

                cur = i % 2
                kc = kc_smem.index(cur)
                s = warpgroup_mma(qc_smem, kc.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s = warpgroup_mma(qr_smem, kr_smem.index(cur).permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(0, deps=[s])

                s = gl.where(_visible(start + keys, P, hi, tree_row, TREE)[None, :], s * qk_scale,
                             float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, axis=1))
                if TREE:  # a tree row may see nothing yet; causal tiles always hold a key
                    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                else:
                    m_use = m_new
                alpha = gl.exp2(m_i - m_use)
                p = gl.exp2(s - m_use[:, None])
                l_part = l_part * alpha[:, None] + p
                m_i = m_new

                p_smem.store(p.to(dtype))
                fence_async_shared()
                gl.thread_barrier()
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
                acc = warpgroup_mma(p_smem, kc, acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
            async_copy.wait_group(0)

            # epilogue: normalise; store the output or this split's partial + log2-sum-exp
            heads_o = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
            _store_out(O, O_PART, LSE_PART, acc, gl.convert_layout(m_i, gl.SliceLayout(1, O_L)),
                       gl.convert_layout(gl.sum(l_part, axis=1), gl.SliceLayout(1, O_L)),
                       tok + heads_o * 0, heads_o, gl.arange(0, KV_LORA, layout=gl.SliceLayout(0, O_L)),
                       heads_o >= 0, split, stride_ot, stride_oh, stride_ps, stride_pt,
                       stride_ph, stride_ls, stride_lt, NUM_SPLITS)


def sm90_mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor,
                       req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       qo_indptr: torch.Tensor, tree_mask: Optional[torch.Tensor], max_q: int,
                       sm_scale: float, out: torch.Tensor, o_part: torch.Tensor,
                       lse: torch.Tensor, num_splits: int, block_n: int = 64) -> None:
    """Launch the Gluon MLA kernel (module docstring).  Called by
    :func:`.attention_mla.mla_paged_attention`, which validates every argument and index,
    allocates ``out`` ``[T, H, 512]`` and, with ``num_splits > 1``, the float32 partials
    ``o_part [S, T, H, 512]`` / ``lse [S, T, H]`` it then merges; :func:`sm90_mla_supported`
    must have returned None.  ``q [T, H, 576]`` bf16/fp16 (``[q_nope_absorbed | q_pe]``, H a
    multiple of 64); ``kv_cache [num_slots, 1, 576]`` of ``q``'s dtype; ``req_to_token`` int32
    ``[rows, width]``; ``req_pool_indices`` int64 / ``seq_lens`` int32 ``[bs]``; ``qo_indptr``
    int32 ``[bs + 1]``; ``tree_mask``: int32 ``[bs, D, ceil(D/32)]`` (TARGET_VERIFY) or None
    (causal); ``max_q``: static bound of new tokens per request (grid axis 1, <= 65535);
    ``sm_scale`` multiplies ``q . k``; ``block_n``: keys per tile, 32 or 64 (ValueError
    otherwise).  No host sync."""
    if block_n not in (32, 64):
        raise ValueError(f"block_n must be 32 or 64, got {block_n}")
    bs, H = req_pool_indices.shape[0], q.shape[1]
    ps = o_part.stride() if num_splits > 1 else (0, 0, 0, 0)
    ls = lse.stride() if num_splits > 1 else (0, 0, 0)
    tm = tree_mask if tree_mask is not None else seq_lens
    tms = (tree_mask.stride(0), tree_mask.stride(1)) if tree_mask is not None else (0, 0)
    grid = (H // BLOCK_H, bs * num_splits) if max_q == 1 else (H // BLOCK_H, max_q, bs * num_splits)
    _mla_sm90_kernel[grid](
        q, kv_cache, out, o_part, lse, req_to_token, req_pool_indices, seq_lens, qo_indptr, tm,
        q.stride(0), q.stride(1), kv_cache.stride(0), out.stride(0), out.stride(1),
        ps[0], ps[1], ps[2], ls[0], ls[1], req_to_token.stride(0), tms[0], tms[1],
        sm_scale * 1.4426950408889634,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, TREE=tree_mask is not None, DECODE=max_q == 1,
        num_warps=8)
