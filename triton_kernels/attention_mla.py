"""Paged absorbed-MLA attention for every forward mode: one Triton kernel (+ the split-KV merge).

Used by :class:`specattn.backends.triton_backend.TritonBackend` for ``AttentionKind.MLA``.

Absorbed MLA (DeepSeek-V2, arXiv:2405.04434, section 2.1 and its "absorb" remark; the form
FlashMLA and SGLang's MLA backends run): the per-head key up-projection ``W_UK`` is folded into
the query and ``W_UV`` into the output projection, so every head attends over ONE shared latent
per token.  With ``r = kv_lora_rank`` and ``d_r = qk_rope_head_dim``:

- ``q [T, H, r + d_r] = [q_nope_absorbed | q_pe]`` (per head);
- the cache (``MLATokenToKVPool``) ``[num_slots, 1, r + d_r] = [c_kv | k_pe]`` (one "KV head");
- ``score(t, h, key) = (q_nope[t, h] . c_kv[key] + q_pe[t, h] . k_pe[key]) * sm_scale``;
- ``out[t, h] = softmax(scores) @ c_kv`` -> ``[T, H, r]`` (the values are the first ``r``
  entries of the latent; the caller applies ``W_UV`` afterwards).

Visibility is exactly :mod:`specattn.triton_kernels.attention`'s (the
:mod:`specattn.backends.forward_batch` convention): request ``i`` (``r_i = req_pool_indices[i]``)
has ``P = prefix_lens[i]`` committed keys and ``n = qo_indptr[i+1] - qo_indptr[i]`` new tokens whose
latents are already in the cache; its keys are at slots ``req_to_token[r_i, 0 : P + n]``.
Query ``j`` sees every prefix key ``p < P`` and key ``P + k`` when ``k <= j`` (``causal``:
EXTEND, DECODE, DRAFT_EXTEND_V2) or bit ``k % 32`` of word ``k // 32`` of ``tree_mask[i, j]``
is set (``tree``: TARGET_VERIFY).  A query that sees no key outputs zeros.

Kernel layout
-------------
- Grid ``(row_tiles, r // BLOCK_DV, bs * num_splits)``.  MLA has one KV head, so the GQA
  packing of ``attention.py`` applies with ``G = H``: row ``m`` of a request is token
  ``m // H``, head ``m % H``; ``row_tiles = cdiv(max_q * H, BLOCK_M)`` with a static
  ``max_q``; a tile starting past the request's ``n * H`` rows exits at once.  With
  ``H = 128`` and ``BLOCK_M = 64`` a decode token is two tiles of 64 heads (the tile FlashMLA's
  decode kernel uses: 64 query heads per CTA, 8 warps); a 64-token tree verify is 128 tiles
  per request.
- Per key tile of ``BLOCK_N`` positions the program gathers the slots through ``req_to_token``
  (int64 address arithmetic; the slot table is per token, so any page size works) and loads
  the latent tile ONCE: ``c [BLOCK_N, BLOCK_DV]`` (its own value slice of ``c_kv``) and
  ``k_pe [d_r, BLOCK_N]``.  Scores are two ``tl.dot``'s accumulated in float32,
  ``q_nope @ c^T`` (``r`` wide) plus ``q_pe @ k_pe`` (``d_r`` wide): no padding of
  ``r + d_r = 576`` to a power of two.  The same ``c`` tile is the value operand of
  ``p @ c``.  (FlashMLA shares the K and V tile in shared memory the same way.)
- With ``page_size % BLOCK_N == 0`` (``page_size`` argument) every prefix tile (they start
  at multiples of ``BLOCK_N``) lies in one page, whose slots are consecutive in the pool's
  layout (token ``p`` at offset ``p % page_size`` of its page): the program reads one slot
  per tile instead of one per key.  Phase 2 always gathers per key.  This is a precondition
  on ``req_to_token`` that the kernel cannot check: pass ``page_size=1`` for rows that do
  not follow the page layout (``TritonBackend(page_aligned=False)`` does).
- ``BLOCK_DV`` (``block_dv``) is ``r`` or ``r / 2`` (the default at >= 128 rows and
  ``r >= 256``, see :func:`default_mla_config`).  With ``r / 2`` two programs
  own the two halves of the value width (accumulator ``BLOCK_M x r/2`` fp32: half the
  registers); each also loads the other half of ``c_kv`` and recomputes the full scores
  (``1.5x`` the FLOPs of the unsplit kernel at ``r = 512, d_r = 64``).
- Phase 1: the prefix ``[0, P)`` unmasked (bound ``p < P`` on the last tile).  Phase 2:
  this forward's tokens ``P + [0, n)``, causal rows stop at the tile's last token, tree rows
  test their int32 mask words.  Online softmax in the log2 domain (``exp2``), running max,
  sum and accumulator in float32.
- dtypes: bf16/fp16 caches use tensor-core dots with fp32 accumulation; an fp32 cache uses
  ``input_precision="ieee"`` (no TF32; the lossless runtime tests); an fp8 (e4m3) cache with
  a bf16/fp16 ``q`` runs the dots in fp16 (the latent tiles converted after their load, q
  once per program; both exact within fp16's range), its scale folded into the score scale
  and applied to the accumulator once; any other ``q`` whose
  dtype differs from the cache's is upcast with the cache tile to fp32.  Output in
  ``q.dtype``.
- ``r`` and ``d_r`` must be powers of two >= 16 (the real ones are 512 and 64; CPU tests use
  32 + 16).

Split-KV (``num_splits = S > 1``): split ``s`` covers prefix positions
``[s * c, min((s + 1) * c, P))`` with ``c = cdiv(cdiv(P, S), BLOCK_N) * BLOCK_N`` computed in
the kernel; the last split also covers phase 2.  Partial outputs (float32 ``[S, T, H, r]``)
and log2-sum-exps (float32 ``[S, T, H]``) are combined by
:func:`.attention_common.merge_kernel` (grid ``(T, H)``), which then writes every one of the
``T`` rows.

Worked shape example (DeepSeek-V3 decode, bf16): ``bs = 128``, ``H = 128``, ``r = 512``,
``d_r = 64``, ``P = 8192`` per request, page 64.  ``q [128, 128, 576]``, cache
``[>= 128 * 8256, 1, 576]``, output ``[128, 128, 512]``.  Default config there
(:func:`default_mla_config`): ``BLOCK_M = 128``, ``BLOCK_DV = 256``, ``BLOCK_N = 64``, 8 warps,
1 stage: grid ``(1, 2, 128)`` = 256 programs (one per 128-head tile and value half); each
streams its request's 8192 latents (9.4 MB; the two halves share them through L2), so the
kernel reads ~1.2 GB from HBM and does ``2 * 128 * 128 * 8192 * (576 + 512) = 292`` GFLOP of
useful work (1.53x that in tensor-core instructions, the scores being computed per half).
A TARGET_VERIFY with 64 draft tokens runs ``64 * 128 / 128 = 64`` row tiles x 2 halves per
request, each over the same ``P + 64`` latents: compute-bound.  Measured times (against
FlashMLA) and the layouts tried: ``docs/attention.md``.

Code generation on sm_90 (Triton 3.6, ``bench/scripts/kernel_ptx.py``): with 2+ stages the
latent tile goes to shared memory by async copies; the default's single stage loads it
through registers (16-byte loads), its whole-tile loop without spills.  Both score dots and
the value dot are wgmma.  Because the score dot feeds another dot, Triton puts all warps
along its M axis, so with ``BLOCK_M = 64`` on 8 warps both
warpgroups would compute the same ``64 x BLOCK_N`` scores (wgmma work ``(2 * 576 + 512) /
(576 + 512) = 1.53x`` the useful work) and a ``64 x 512`` fp32 accumulator spills; 128-row
tiles with half the value width (the default at 128 heads) recompute the scores in the other
half's program instead (the same 1.53x, no spill), the fastest layout of the H100 sweep.
Deeper pipelines do not fit in shared memory (a 2-stage ``BLOCK_N = 64`` latent pipeline
needs 294 KB).  FlashMLA avoids the recomputation by splitting the value width across two
warpgroups that share one score tile; Triton's code generation cannot express that, Gluon
can: on an sm_90 GPU bf16/fp16 attention (and an fp8 cache) at any head count runs the kernel
of :mod:`.attention_mla_sm90` by default, every mode, with FlashMLA's seesaw schedule; see
``sm90`` and ``seesaw`` below.  (Key-major tiles, which make Triton split the rows rather
than the keys across the warpgroups, compute no score twice but measured slower: the
softmax then reduces through shared memory and ``p`` goes through shared memory every tile;
``docs/attention.md``.)

Sources: DeepSeek-V2 (arXiv:2405.04434) for absorbed MLA; FlashMLA (deepseek-ai/FlashMLA:
64-head tiles, 8 warps, K and V sharing one shared-memory tile, split-KV plus a combine
kernel) for the decode design points; Triton's tutorial ``06-fused-attention`` for the
online-softmax program layout.  No code copied.

No host sync: every launch parameter is a Python int fixed by shapes and static maxima.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._util import (check_attention_dtypes, check_dequant_scales, check_out_apart, check_paged_metadata, check_sm_scale,
                    choose_gluon, is_pow2, kv_conversion, launch_fitting, on_tensor_device)
from .attention_mla_sm90 import sm90_mla_attention, sm90_mla_supported
from .gluon_common import int32_offset_needs
from .attention_common import (MASK_CAUSAL, MASK_TREE, check_kernel_config, draft_key_count,
                               draft_visibility, full_update, masked_update, merge_partials,
                               prefix_range, program_request, split_partials, store_rows,
                               tile_rows, tree_mask_arg)

__all__ = ["mla_paged_attention", "default_mla_config", "MLA_CONFIG_KEYS", "check_mla_config"]

MLA_CONFIG_KEYS = ("block_m", "block_n", "block_dv", "num_warps", "num_stages", "tma", "sm90",
                   "seesaw")


@triton.jit
def _mla_tile(acc, m_i, l_i, q_own, q_oth, q_pe, kv_row, ok, vis, offs_own, offs_oth, offs_r,
              qk_scale, NUM_DV: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
              CAST_KV: tl.constexpr):
    """One key tile.  ``kv_row [BLOCK_N]``: pointers to the latent rows (``KV + slot * stride``),
    ``ok [BLOCK_N]``: which of them exist, ``vis [BLOCK_M, BLOCK_N]``: visibility.  Loads the
    latent tile once (own value slice, the other slice when ``NUM_DV == 2``, ``k_pe``), updates
    the online softmax ``(acc, m_i, l_i)`` and returns it."""
    c = tl.load(kv_row[:, None] + offs_own[None, :], mask=ok[:, None], other=0.0)     # [N, DV]
    kpe = tl.load(kv_row[None, :] + offs_r[:, None], mask=ok[None, :], other=0.0)     # [R, N]
    if UPCAST:
        c = c.to(tl.float32)
        kpe = kpe.to(tl.float32)
    elif CAST_KV:
        c = c.to(q_own.dtype)
        kpe = kpe.to(q_own.dtype)
    if IEEE:
        s = tl.dot(q_own, tl.trans(c), input_precision="ieee")
        s = tl.dot(q_pe, kpe, s, input_precision="ieee")
    else:
        s = tl.dot(q_own, tl.trans(c))
        s = tl.dot(q_pe, kpe, s)
    if NUM_DV == 2:
        c2 = tl.load(kv_row[None, :] + offs_oth[:, None], mask=ok[None, :], other=0.0)  # [DV, N]
        if UPCAST:
            c2 = c2.to(tl.float32)
        elif CAST_KV:
            c2 = c2.to(q_own.dtype)
        if IEEE:
            s = tl.dot(q_oth, c2, s, input_precision="ieee")
        else:
            s = tl.dot(q_oth, c2, s)
    return masked_update(acc, m_i, l_i, s, vis, qk_scale, c, IEEE)


@triton.jit
def _mla_tile_tma(acc, m_i, l_i, q_own, q_oth, q_pe, desc_v, desc_pe, row, own_col, oth_col,
                  qk_scale, KV_LORA: tl.constexpr, NUM_DV: tl.constexpr, IEEE: tl.constexpr,
                  UPCAST: tl.constexpr, CAST_KV: tl.constexpr):
    """:func:`_mla_tile` for a full tile of ``BLOCK_N`` consecutive cache rows from ``row``
    (one page), loaded by the tensor-memory accelerator (``desc_v``: ``[BLOCK_N, BLOCK_DV]``
    value boxes, ``desc_pe``: ``[BLOCK_N, ROPE]``): every key exists and is visible."""
    c = desc_v.load([row, own_col])                                                   # [N, DV]
    kpe = desc_pe.load([row, KV_LORA])                                                # [N, R]
    if UPCAST:
        c = c.to(tl.float32)
        kpe = kpe.to(tl.float32)
    elif CAST_KV:
        c = c.to(q_own.dtype)
        kpe = kpe.to(q_own.dtype)
    if IEEE:
        s = tl.dot(q_own, tl.trans(c), input_precision="ieee")
        s = tl.dot(q_pe, tl.trans(kpe), s, input_precision="ieee")
    else:
        s = tl.dot(q_own, tl.trans(c))
        s = tl.dot(q_pe, tl.trans(kpe), s)
    if NUM_DV == 2:
        c2 = desc_v.load([row, oth_col])                                              # [N, DV]
        if UPCAST:
            c2 = c2.to(tl.float32)
        elif CAST_KV:
            c2 = c2.to(q_own.dtype)
        if IEEE:
            s = tl.dot(q_oth, tl.trans(c2), s, input_precision="ieee")
        else:
            s = tl.dot(q_oth, tl.trans(c2), s)
    return full_update(acc, m_i, l_i, s, qk_scale, c, IEEE)


@triton.jit
def _mla_fwd_kernel(
        Q, KV, O, O_PART, LSE_PART,
        req_to_token, req_pool_indices, prefix_lens, qo_indptr, tree_mask, desc_v, desc_pe,
        stride_qt, stride_qh, stride_kvt, stride_ot, stride_oh,
        stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
        stride_rtt, stride_tmb, stride_tmj,
        qk_scale, v_scale,
        NUM_HEADS: tl.constexpr, KV_LORA: tl.constexpr, ROPE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
        NUM_DV: tl.constexpr, MASK_MODE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        CONTIG: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, CAST_KV: tl.constexpr,
        SCALE_V: tl.constexpr, TMA: tl.constexpr):
    dvi = tl.program_id(1)
    req, split, q_start, n = program_request(qo_indptr, NUM_SPLITS)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 >= n * NUM_HEADS:
        return
    P, rtt_row, j, head, tok = tile_rows(prefix_lens, req_pool_indices, req_to_token, stride_rtt,
                                         req, q_start, m0, BLOCK_M, NUM_HEADS)
    row_ok = j < n
    if NUM_DV == 1:
        offs_own = tl.arange(0, BLOCK_DV)
        offs_oth = offs_own
    else:
        offs_own = dvi * BLOCK_DV + tl.arange(0, BLOCK_DV)
        offs_oth = (1 - dvi) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    offs_r = KV_LORA + tl.arange(0, ROPE)

    q_row = Q + tok[:, None] * stride_qt + head.to(tl.int64)[:, None] * stride_qh   # (int64: a caller's q view)
    q_own = tl.load(q_row + offs_own[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_row + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    if NUM_DV == 2:
        q_oth = tl.load(q_row + offs_oth[None, :], mask=row_ok[:, None], other=0.0)
    else:
        q_oth = q_own
    if UPCAST:
        q_own = q_own.to(tl.float32)
        q_oth = q_oth.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    elif CAST_KV:  # fp8 cache: the dots run in fp16 (tiles convert by one cvt per pair of values)
        q_own = q_own.to(tl.float16)
        q_oth = q_oth.to(tl.float16)
        q_pe = q_pe.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # ---------------- phase 1: the committed prefix, no visibility mask
    lo, hi = prefix_range(P, split, NUM_SPLITS, BLOCK_N)
    if TMA:  # full tiles by TMA (each lies in one page: CONTIG), then at most one partial tile
        hi_full = lo + ((hi - lo) // BLOCK_N) * BLOCK_N
        own_col = dvi * BLOCK_DV
        oth_col = (1 - dvi) * BLOCK_DV
        for start in range(lo, hi_full, BLOCK_N):
            acc, m_i, l_i = _mla_tile_tma(acc, m_i, l_i, q_own, q_oth, q_pe, desc_v, desc_pe,
                                          tl.load(rtt_row + start), own_col, oth_col, qk_scale,
                                          KV_LORA, NUM_DV, IEEE, UPCAST, CAST_KV)
        lo = hi_full
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        if CONTIG:  # the tile lies in one page: its slots are consecutive
            slot = tl.load(rtt_row + start).to(tl.int64) + tl.arange(0, BLOCK_N)
        else:
            slot = tl.load(rtt_row + offs_n, mask=n_ok, other=0).to(tl.int64)
        acc, m_i, l_i = _mla_tile(acc, m_i, l_i, q_own, q_oth, q_pe, KV + slot * stride_kvt, n_ok,
                                  n_ok[None, :], offs_own, offs_oth, offs_r, qk_scale,
                                  NUM_DV, IEEE, UPCAST, CAST_KV)

    # ---------------- phase 2: this forward's tokens P + [0, n), masked (last split only)
    kv_hi = draft_key_count(n, m0, split, NUM_HEADS, BLOCK_M, MASK_MODE, NUM_SPLITS)
    for start in range(0, kv_hi, BLOCK_N):
        offs_k = start + tl.arange(0, BLOCK_N)
        k_ok = offs_k < kv_hi
        slot = tl.load(rtt_row + P + offs_k, mask=k_ok, other=0).to(tl.int64)
        vis = draft_visibility(tree_mask, stride_tmb, stride_tmj, req, j, row_ok, offs_k, k_ok,
                               MASK_MODE)
        acc, m_i, l_i = _mla_tile(acc, m_i, l_i, q_own, q_oth, q_pe, KV + slot * stride_kvt, k_ok,
                                  vis, offs_own, offs_oth, offs_r, qk_scale, NUM_DV, IEEE, UPCAST,
                                  CAST_KV)

    if SCALE_V:
        acc = acc * v_scale
    store_rows(O, O_PART, LSE_PART, acc, m_i, l_i, tok, head, offs_own, row_ok[:, None],
               row_ok & ((head * 0 + dvi) == 0),  # one LSE writer per row
               split, stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
               NUM_SPLITS)


def default_mla_config(max_rows: int, kv_lora_rank: int, ieee: bool) -> dict:
    """Default kernel config for ``max_rows = max_q * H`` packed rows per request, rank
    ``kv_lora_rank`` and fp32 (``ieee``) inputs.  Returns ``block_m``, ``block_n``,
    ``block_dv``, ``num_warps``, ``num_stages``.  With >= 128 rows and rank >= 256 (MLA decode
    at 128 heads, tree verify): 128-row tiles, half the value width per program, 64 keys,
    one stage -- the best of the H100 sweep of ``bench/scripts/attention_sweep.py`` for both
    (Triton 3.6).  Otherwise 64-row tiles with the whole value width on 8 warps (FlashMLA's
    tile), 32 keys per tile (a bf16 latent tile of 32 x 576 is 36 KB of shared memory)."""
    big = kv_lora_rank >= 256
    block_m = min(64, max(16, triton.next_power_of_2(max(max_rows, 1))))
    if ieee:
        return dict(block_m=min(block_m, 32) if big else block_m, block_n=16 if big else 32,
                    block_dv=kv_lora_rank, num_warps=8 if big else 4, num_stages=1)
    if big and max_rows >= 128:  # the H100 sweep's best (bench/scripts/attention_sweep.py)
        return dict(block_m=128, block_n=64, block_dv=kv_lora_rank // 2, num_warps=8, num_stages=1)
    return dict(block_m=block_m, block_n=32 if big else 64, block_dv=kv_lora_rank,
                num_warps=8 if big else 4, num_stages=2)


def check_mla_config(config: dict, kv_lora_rank: Optional[int] = None) -> None:
    """Raise ValueError unless ``config``'s keys are among :data:`MLA_CONFIG_KEYS` with the
    value rules of :func:`~specattn.triton_kernels.attention_common.check_kernel_config`, and
    ``block_dv`` is ``kv_lora_rank`` or half of it (when the rank is given).  None values
    mean "default"."""
    check_kernel_config(config, MLA_CONFIG_KEYS)
    dv = config.get("block_dv")
    if dv is not None and kv_lora_rank is not None and dv not in (kv_lora_rank, kv_lora_rank // 2):
        raise ValueError(f"block_dv must be kv_lora_rank ({kv_lora_rank}) or half of it, got {dv}")


def _tma_descriptors(kv_cache: torch.Tensor, page_size: int, block_n: int, block_dv: int,
                     rank: int, rope: int):
    """Host TMA descriptors over the latent cache viewed ``[num_slots, rank + rope]``: value
    boxes ``[block_n, block_dv]`` and ``k_pe`` boxes ``[block_n, rope]``.  Raises ValueError
    where TMA cannot serve these tiles (see ``mla_paged_attention``'s ``tma``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    kv2d = kv_cache[:, 0, :]
    es = kv_cache.element_size()
    why = [w for bad, w in (
        (page_size % block_n != 0, f"block_n ({block_n}) dividing page_size ({page_size})"),
        (block_dv > 256 or rope > 256, f"block_dv ({block_dv}) and qk_rope_head_dim ({rope}) <= 256"),
        ((kv2d.stride(0) * es) % 16 != 0 or kv2d.data_ptr() % 16 != 0,
         "a 16-byte aligned cache and row stride")) if bad]
    if why:
        raise ValueError(f"tma=True needs {'; '.join(why)}")
    return (TensorDescriptor.from_tensor(kv2d, [block_n, block_dv]),
            TensorDescriptor.from_tensor(kv2d, [block_n, rope]))


@on_tensor_device
def mla_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, req_to_token: torch.Tensor,
                        req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                        qo_indptr: torch.Tensor, tree_mask: Optional[torch.Tensor], max_q: int,
                        sm_scale: float, kv_lora_rank: int, num_splits: int = 1,
                        out: Optional[torch.Tensor] = None, *, page_size: int = 1,
                        block_m: Optional[int] = None,
                        block_n: Optional[int] = None, block_dv: Optional[int] = None,
                        num_warps: Optional[int] = None,
                        num_stages: Optional[int] = None, tma: Optional[bool] = None,
                        sm90: Optional[bool] = None, seesaw: Optional[bool] = None,
                        check_bounds: bool = True, kv_scale: float = 1.0) -> torch.Tensor:
    """Absorbed-MLA attention of ``q`` over the paged latent cache (module docstring).

    Args:
        q: ``[T, H, kv_lora_rank + qk_rope_head_dim]`` fp32/bf16/fp16 (``[q_nope_absorbed |
            q_pe]``), last dim contiguous; ``T = qo_indptr[-1]`` (only rows named by
            ``qo_indptr`` are read).
        kv_cache: ``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]`` (``[c_kv | k_pe]``),
            last dim contiguous (``MLATokenToKVPool.get_key_buffer``): fp32/bf16/fp16, or
            ``float8_e4m3fn`` holding ``latent / kv_scale`` (the portable kernel reads it in
            fp16; the Gluon kernels widen its tiles to q's dtype in shared memory).
        req_to_token: int32 ``[rows, width]``, last dim contiguous.
        req_pool_indices: int64 ``[bs]``; prefix_lens: int32 ``[bs]`` (``P``, committed keys);
        qo_indptr: int32 ``[bs + 1]`` (token offsets of each request's ``n`` new tokens).
        tree_mask: int32 ``[bs, D, ceil(D/32)]`` (TARGET_VERIFY) or None (causal).
        max_q: static upper bound of ``n`` over the batch (sizes the grid; checked with
            ``check_bounds``).
        sm_scale: multiplies ``q . k`` before the softmax (a finite float > 0).
        kv_lora_rank: ``r``, the value width; ``qk_rope_head_dim = q.shape[2] - r``.  Both
            must be powers of two >= 16.
        num_splits: split-KV factor over the prefix (1: single pass).
        out: optional ``[T, H, kv_lora_rank]`` output, last dim contiguous.
        page_size: the pool's page size.  When ``block_n`` divides it, the prefix tiles
            (which start at multiples of ``block_n``) each lie in one page, so the kernel
            reads one slot per tile (``req_to_token[r, start]``) and takes the next
            ``block_n - 1`` slots as consecutive -- the page layout of
            :mod:`~specattn.backends.pools` (token ``p`` at offset ``p % page_size`` of its
            page).  1 (default): one slot per key, any layout.
        block_m, block_n, block_dv, num_warps, num_stages: kernel config overrides (powers of
            two; ``block_m``/``block_n`` >= 16; ``block_dv`` = ``r`` or ``r / 2``); None = the
            defaults of :func:`default_mla_config`.
        tma: load the prefix's full key tiles with the tensor-memory accelerator (one
            descriptor load per value box and one for ``k_pe``, no per-key addresses) instead
            of per-thread loads; needs tiles inside one page (``block_n`` divides
            ``page_size``), ``block_dv`` and ``qk_rope_head_dim`` <= 256 (TMA box limit) and a
            16-byte aligned cache and row stride.  None = False: measured slower on an H100
            (MLA decode b128 L8192: 1262 vs 1165 us; tree verify within 3 %).
        sm90: run on the Gluon kernel of :mod:`.attention_mla_sm90` (64 packed token x head
            rows per CTA, two warpgroups share one score tile, FlashMLA's split; every mode; ``block_n``
            32 or 64, the other config keys do not apply).  True raises ValueError where
            :func:`~.attention_mla_sm90.sm90_mla_supported` says it cannot run or
            another config key is set; None (default) uses it where it can run and no other
            key is set; False never.
        seesaw: with the Gluon kernel, FlashMLA's seesaw schedule (warp-specialized: each
            warpgroup computes the whole score tile of every other key tile; 64-key tiles;
            whole-page tiles copied by TMA when ``page_size`` is a multiple of 64) instead of
            the key-split one; None (default) = True unless ``block_n`` is 32.
            ``seesaw=True`` raises ValueError with ``block_n=32`` or where the Gluon kernel
            cannot run (as ``sm90=True`` does).
        check_bounds: check every index the kernel follows before launching (one host read,
            skipped during CUDA-graph capture; :func:`~specattn.triton_kernels._util.
            check_paged_metadata`).  Backends that validated the batch pass False.
        kv_scale: dequantization scale of an fp8 cache (the latent of a key is
            ``kv_cache[slot].float() * kv_scale``: it scales the scores and the output once);
            1.0 for other caches.
    Returns:
        ``[T, H, kv_lora_rank]`` in ``q.dtype`` (or ``out``).  With ``num_splits == 1`` rows of
        no request are left untouched; with splits every one of the ``T`` rows is written, so
        every row must belong to a request (``qo_indptr[-1] == T``).
    Raises:
        ValueError: inconsistent shapes, dtypes or devices; dims not powers of two >= 16; a
            ``tree_mask`` smaller than ``[bs, max_q, ceil(max_q/32)]``; a bad config value;
            with ``check_bounds``, an index out of range (``check_paged_metadata``); ``tma=True``
            where its needs are not met; an ``sm_scale`` that is not a finite float > 0; a
            ``kv_scale`` that is not a finite float > 0, or not 1.0 for a cache that is not fp8.
    """
    sm_scale = check_sm_scale(sm_scale)
    if q.dim() != 3 or kv_cache.dim() != 3:
        raise ValueError(f"q and kv_cache must be 3-D, got {list(q.shape)} / {list(kv_cache.shape)}")
    T, H, Dqk = q.shape
    rank, rope = kv_lora_rank, Dqk - kv_lora_rank
    bs = req_pool_indices.shape[0]
    if kv_cache.shape[1] != 1 or kv_cache.shape[2] != Dqk:
        raise ValueError(f"kv_cache must be [slots, 1, {Dqk}] for q {list(q.shape)}, got "
                         f"{list(kv_cache.shape)}")
    for name, d in (("kv_lora_rank", rank), ("qk_rope_head_dim", rope)):
        if not is_pow2(d) or d < 16:
            raise ValueError(f"{name} must be a power of two >= 16, got {d}")
    if q.stride(2) != 1 or kv_cache.stride(2) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("q, kv_cache and req_to_token need a contiguous last dim")
    if q.device != kv_cache.device:
        raise ValueError(f"q is on {q.device}, kv_cache on {kv_cache.device}")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    check_attention_dtypes(q, kv_cache, out, (T, H, rank))
    check_out_apart(out, kv_cache=kv_cache)
    check_paged_metadata(q, req_to_token, req_pool_indices, prefix_lens, qo_indptr, tree_mask, max_q,
                         num_splits, kv_cache.shape[0], check_bounds, page_size)
    if out is None:
        out = torch.empty(T, H, rank, dtype=q.dtype, device=q.device)
    (kv_scale,) = check_dequant_scales(kv_cache.dtype, kv_scale=kv_scale)
    upcast, cast_kv = kv_conversion(q.dtype, kv_cache.dtype)
    ieee = upcast or kv_cache.dtype == torch.float32
    cfg = default_mla_config(max_q * H, rank, ieee)
    over = dict(block_m=block_m, block_n=block_n, block_dv=block_dv, num_warps=num_warps,
                num_stages=num_stages, tma=tma, sm90=sm90, seesaw=seesaw)
    check_mla_config(over, rank)
    if seesaw and block_n == 32:
        raise ValueError("seesaw=True runs 64-key tiles; block_n=32 needs seesaw=False")
    conflicts, why = [], "sm90=False"
    if sm90 is not False:  # None (default) or True: the Gluon kernel where it can run
        conflicts = [k for k in ("block_m", "block_dv", "num_warps", "num_stages", "tma") if over[k]]
        if block_n not in (None, 32, 64):
            conflicts.append(f"block_n={block_n}")
        why = sm90_mla_supported(q, kv_cache, rank)
        why = "; ".join(([why] if why else []) + int32_offset_needs(q, out, tree_mask, max_q)) or None
        if why is None and max_q > 65535:  # the token is the Gluon kernel's grid axis 1
            why = f"max_q <= 65535 (got {max_q})"
    use_sm90 = choose_gluon(sm90, why, conflicts, "seesaw", seesaw)
    if use_sm90:
        if bs == 0 or T == 0 or max_q == 0:
            return out
        o_part, lse, _, _ = split_partials(num_splits, T, H, rank, out, prefix_lens)
        sm90_mla_attention(q, kv_cache, req_to_token, req_pool_indices, prefix_lens, qo_indptr,
                           tree_mask, max_q, sm_scale, out, o_part, lse, num_splits, block_n or 64,
                           seesaw=seesaw is not False and block_n != 32,
                           page_size=page_size, kv_scale=kv_scale)
        if num_splits > 1:
            merge_partials(o_part, lse, out, num_splits, rank, rank, 4)
        return out
    cfg.update({k: v for k, v in over.items() if v is not None and k != "seesaw"})
    BLOCK_M, BLOCK_N, BLOCK_DV = cfg["block_m"], cfg["block_n"], cfg["block_dv"]
    desc_v = desc_pe = None
    if cfg.get("tma", False):
        desc_v, desc_pe = _tma_descriptors(kv_cache, page_size, BLOCK_N, BLOCK_DV, rank, rope)
    if bs == 0 or T == 0 or max_q == 0:
        return out
    num_dv = rank // BLOCK_DV
    grid = (triton.cdiv(max_q * H, BLOCK_M), num_dv, bs * num_splits)
    o_part, lse, ps, ls = split_partials(num_splits, T, H, rank, out, prefix_lens)
    tm, tm_strides = tree_mask_arg(tree_mask, prefix_lens)
    launch_fitting(_mla_fwd_kernel, grid, (
        q, kv_cache, out, o_part, lse,
        req_to_token, req_pool_indices, prefix_lens, qo_indptr, tm, desc_v, desc_pe,
        q.stride(0), q.stride(1), kv_cache.stride(0), out.stride(0), out.stride(1),
        ps[0], ps[1], ps[2], ls[0], ls[1],
        req_to_token.stride(0), tm_strides[0], tm_strides[1],
        sm_scale * kv_scale * 1.4426950408889634, kv_scale), dict(
        NUM_HEADS=H, KV_LORA=rank, ROPE=rope, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_DV=BLOCK_DV, NUM_DV=num_dv,
        MASK_MODE=MASK_TREE if tree_mask is not None else MASK_CAUSAL,
        NUM_SPLITS=num_splits, CONTIG=page_size % BLOCK_N == 0, IEEE=ieee, UPCAST=upcast,
        CAST_KV=cast_kv, SCALE_V=kv_scale != 1.0, TMA=desc_v is not None,
        num_warps=cfg["num_warps"]), cfg["num_stages"])
    if num_splits > 1:
        merge_partials(o_part, lse, out, num_splits, rank, rank, 4 if rank >= 256 else 1)
    return out
