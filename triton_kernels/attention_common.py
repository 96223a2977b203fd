"""Pieces shared by the Triton attention kernels (:mod:`.attention`: MHA/GQA,
:mod:`.attention_mla`: absorbed MLA): the online-softmax updates, the program -> request /
rows / key-range mapping, the draft-key visibility (causal or bit-packed tree rows), the
epilogue, the split-KV merge (:func:`merge_kernel`) and its host side, and the kernel-config
check.  The ``@triton.jit`` helpers are inlined into each kernel by Triton.

Conventions (both kernels): a program owns ``BLOCK_M`` packed rows (token ``j`` x head ``h``
of ``ROWS_PER_TOKEN``) of one request and one KV split (grid axis 2 = request x split);
scores are in the log2 domain (``qk_scale`` includes ``log2(e)``); running max ``m``, sum
``l`` and accumulator in float32; ``MASK_MODE`` is :data:`MASK_CAUSAL` or :data:`MASK_TREE`.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._util import gdc_enter, is_pow2, pdl_kwargs

__all__ = ["MASK_CAUSAL", "MASK_TREE", "masked_update", "full_update", "program_request",
           "tile_rows", "prefix_range", "draft_key_count", "draft_visibility", "store_rows",
           "merge_kernel", "split_partials", "tree_mask_arg", "merge_partials",
           "check_kernel_config"]

MASK_CAUSAL, MASK_TREE = 0, 1


@triton.jit
def masked_update(acc, m_i, l_i, s, vis, qk_scale, v, IEEE: tl.constexpr):
    """The online-softmax update of ``(acc, m_i, l_i)`` by raw scores ``s`` (scaled here,
    ``-inf`` where not ``vis``; a row that has seen no key keeps ``m = -inf``) and values ``v``
    (``[BLOCK_N, DV]``); shared with the MLA kernel."""
    s = tl.where(vis, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def full_update(acc, m_i, l_i, s, qk_scale, v, IEEE: tl.constexpr):
    """:func:`masked_update` for scores every row sees (no mask, all finite): the running
    max never stays ``-inf``, so no guard; shared with the MLA kernel's TMA tiles."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def program_request(qo_indptr, NUM_SPLITS: tl.constexpr):
    """This program's request (axis 2 = request x split), split, first token row and new-token
    count ``n``."""
    pid2 = tl.program_id(2)
    req = pid2 // NUM_SPLITS
    split = pid2 % NUM_SPLITS
    q_start = tl.load(qo_indptr + req)
    n = tl.load(qo_indptr + req + 1) - q_start
    return req, split, q_start, n


@triton.jit
def tile_rows(prefix_lens, req_pool_indices, req_to_token, stride_rtt, req, q_start, m0,
              BLOCK_M: tl.constexpr, ROWS_PER_TOKEN: tl.constexpr):
    """The tile's packed rows ``m0 + [0, BLOCK_M)`` (row = token ``j`` x head ``h`` of
    ``ROWS_PER_TOKEN``): ``P``, the request's ``req_to_token`` row, ``j``, ``h``, row
    validity (``j < n`` is the caller's: passed back as ``j``) and the int64 token rows."""
    P = tl.load(prefix_lens + req)
    r = tl.load(req_pool_indices + req).to(tl.int64)
    rtt_row = req_to_token + r * stride_rtt
    offs_m = m0 + tl.arange(0, BLOCK_M)
    j = offs_m // ROWS_PER_TOKEN
    h = offs_m % ROWS_PER_TOKEN
    tok = (q_start + j).to(tl.int64)
    return P, rtt_row, j, h, tok


@triton.jit
def prefix_range(P, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[lo, hi)``: this split's share of the prefix, in whole ``BLOCK_N`` tiles."""
    if NUM_SPLITS == 1:
        lo = 0
        hi = P
    else:
        chunk = tl.cdiv(tl.cdiv(P, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = tl.minimum(split * chunk, P)
        hi = tl.minimum(lo + chunk, P)
    return lo, hi


@triton.jit
def draft_key_count(n, m0, split, ROWS_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr,
                    MASK_MODE: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """How many of this forward's keys the tile reads: all ``n`` (tree), up to the tile's
    last token (causal); none but in the last split."""
    if MASK_MODE == 1:
        kv_hi = n
    else:  # causal: no row of this tile sees past its last token
        kv_hi = tl.minimum(n, (m0 + BLOCK_M - 1) // ROWS_PER_TOKEN + 1)
    if NUM_SPLITS > 1:
        kv_hi = tl.where(split == NUM_SPLITS - 1, kv_hi, 0)
    return kv_hi


@triton.jit
def draft_visibility(tree_mask, stride_tmb, stride_tmj, req, j, row_ok, offs_k, k_ok,
                     MASK_MODE: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]``: row (token ``j``) sees draft key ``offs_k``: its tree bit
    (``MASK_MODE == 1``) or ``offs_k <= j`` (causal)."""
    if MASK_MODE == 1:
        wmask = row_ok[:, None] & k_ok[None, :]
        words = tl.load(tree_mask + req.to(tl.int64) * stride_tmb + j.to(tl.int64)[:, None] * stride_tmj
                        + (offs_k // 32)[None, :], mask=wmask, other=0)
        vis = (((words >> (offs_k % 32)[None, :]) & 1) != 0) & wmask
    else:
        vis = (offs_k[None, :] <= j[:, None]) & k_ok[None, :]
    return vis


@triton.jit
def store_rows(O, O_PART, LSE_PART, acc, m_i, l_i, tok, head, offs_v, st_mask, lse_mask, split,
               stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
               NUM_SPLITS: tl.constexpr):
    """Normalise and store: the output (one split), or the split's partial output and its
    base-2 log-sum-exp for the merge.  Rows that saw no key get zeros (LSE -inf); a NaN
    score or value stays NaN (``l_i == 0`` tells an empty row, not ``l_i > 0``)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
    if NUM_SPLITS == 1:
        # (int64: a caller's out view can put head * stride_oh past 2**31 elements)
        tl.store(O + tok[:, None] * stride_ot + head.to(tl.int64)[:, None] * stride_oh + offs_v[None, :],
                 out.to(O.dtype.element_ty), mask=st_mask)
    else:
        sp = split.to(tl.int64)
        tl.store(O_PART + sp * stride_ps + tok[:, None] * stride_pt + head[:, None] * stride_ph
                 + offs_v[None, :], out, mask=st_mask)
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
        tl.store(LSE_PART + sp * stride_ls + tok * stride_lt + head, lse, mask=lse_mask)


@triton.jit
def merge_kernel(O_PART, LSE_PART, O, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                 stride_ot, stride_oh, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, PDL: tl.constexpr = False):
    """Grid ``(T, H)``: combine the ``NUM_SPLITS`` partial outputs of one (token, head).
    The split offsets advance the (64-bit) pointers by one stride per split: no 32-bit
    ``split * stride`` product that could overflow on a large ``T``."""
    gdc_enter(PDL)  # before any load or store (programmatic dependent launch)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_DV)
    ok = offs < V_DIM
    lse_max = float("-inf")
    lse_ptr = LSE_PART + t * stride_lt + h
    for s in tl.static_range(NUM_SPLITS):
        lse_max = tl.maximum(lse_max, tl.load(lse_ptr))
        lse_ptr += stride_ls
    base = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    wsum = 0.0
    lse_ptr = LSE_PART + t * stride_lt + h
    o_ptr = O_PART + t * stride_pt + h * stride_ph + offs
    for s in tl.static_range(NUM_SPLITS):
        w = tl.math.exp2(tl.load(lse_ptr) - base)
        o = tl.load(o_ptr, mask=ok, other=0.0)
        acc += w * o
        wsum += w
        lse_ptr += stride_ls
        o_ptr += stride_ps
    out = tl.where(wsum == 0.0, 0.0, acc / tl.where(wsum == 0.0, 1.0, wsum))   # (a NaN split stays NaN)
    tl.store(O + t * stride_ot + h * stride_oh + offs, out.to(O.dtype.element_ty), mask=ok)


def split_partials(num_splits: int, T: int, H: int, v_dim: int, out: torch.Tensor,
                   placeholder: torch.Tensor):
    """Host side of split-KV, shared with the MLA launcher: ``(o_part, lse, o_part strides,
    lse strides)``, float32 ``[splits, T, H, v_dim]`` / ``[splits, T, H]`` partials; with one
    split, unused placeholders and zero strides."""
    if num_splits == 1:
        return out, placeholder, (0, 0, 0, 0), (0, 0, 0)
    o_part = torch.empty(num_splits, T, H, v_dim, dtype=torch.float32, device=out.device)
    lse = torch.empty(num_splits, T, H, dtype=torch.float32, device=out.device)
    return o_part, lse, o_part.stride(), lse.stride()


def tree_mask_arg(tree_mask: Optional[torch.Tensor], placeholder: torch.Tensor):
    """``(tensor, (stride_b, stride_j))`` for the kernels' tree-mask argument (a placeholder
    and zero strides when there is no tree)."""
    if tree_mask is None:
        return placeholder, (0, 0)
    return tree_mask, (tree_mask.stride(0), tree_mask.stride(1))


def merge_partials(o_part, lse, out, num_splits: int, v_dim: int, block_dv: int,
                   num_warps: int) -> None:
    """Merge the split partials of :func:`split_partials` into ``out`` (one launch)."""
    ps, ls = o_part.stride(), lse.stride()
    T, H = out.shape[0], out.shape[1]
    merge_kernel[(T, H)](o_part, lse, out, ps[0], ps[1], ps[2], ls[0], ls[1],
                          out.stride(0), out.stride(1), V_DIM=v_dim, BLOCK_DV=block_dv,
                          NUM_SPLITS=num_splits, num_warps=num_warps, **pdl_kwargs(out))


def check_kernel_config(config: dict, allowed) -> None:
    """Raise ValueError unless every key of ``config`` is in ``allowed`` and every non-None
    value is an int: ``block_*`` powers of two >= 16, ``num_warps`` a power of two,
    ``num_stages`` >= 1; ``tma``/``seesaw`` (MLA), ``pingpong`` (MHA) and ``sm90`` bools.
    (Shared by the MHA and MLA kernels and ``TritonBackend``.)"""
    bad = sorted(set(config) - set(allowed))
    if bad:
        raise ValueError(f"unknown kernel config keys {bad}; allowed: {list(allowed)}")
    for key, val in config.items():
        if val is None:
            continue
        if key == "num_stages":
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"num_stages must be an int >= 1, got {val!r}")
        elif key in ("tma", "sm90", "seesaw", "pingpong"):
            if not isinstance(val, bool):
                raise ValueError(f"{key} must be a bool, got {val!r}")
        elif not is_pow2(val) or (key.startswith("block") and val < 16):
            raise ValueError(f"{key} must be a power of two (>= 16 for blocks), got {val!r}")
