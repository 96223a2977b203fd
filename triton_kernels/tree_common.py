"""Pieces shared by the tree-verify kernels (:mod:`.tree_ops`: greedy, :mod:`.tree_sampling`:
speculative sampling): a request's tree rows as register vectors (:func:`tree_rows`) and a
scalar lookup into such a vector (:func:`gather_lane`).  Inlined into each kernel by Triton.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["gather_lane", "tree_rows"]


@triton.jit
def gather_lane(vec, idx, jj):
    """``vec[idx]`` for a register vector ``vec`` and a scalar ``idx`` (0 if out of range)."""
    return tl.sum(tl.where(jj == idx, vec, 0), axis=0)


@triton.jit
def tree_rows(cand_ptr, c_s0, c_s1, ri_ptr, ri_s0, ri_s1, nx_ptr, nx_s0, nx_s1, sb_ptr, sb_s0,
              sb_s1, b, D, BLOCK_D: tl.constexpr):
    """Request ``b``'s tree as register vectors over ``jj = [0, BLOCK_D)`` (valid ``< D``):
    ``(jj, cand int64, retrive_index int64, next_token int32, next_sibling int32)``.  Links
    outside ``[0, D)`` become -1 (end of chain): the wrapper's range checks are skipped while a
    CUDA graph is captured, so a bad link must never become an address."""
    jj = tl.arange(0, BLOCK_D)
    vm = jj < D
    j64 = jj.to(tl.int64)                          # offsets: a view's strides can pass 2**31 / D
    cand = tl.load(cand_ptr + b * c_s0 + j64 * c_s1, mask=vm, other=0).to(tl.int64)
    ridx = tl.load(ri_ptr + b * ri_s0 + j64 * ri_s1, mask=vm, other=0).to(tl.int64)
    nxt = tl.load(nx_ptr + b * nx_s0 + j64 * nx_s1, mask=vm, other=-1).to(tl.int32)
    sib = tl.load(sb_ptr + b * sb_s0 + j64 * sb_s1, mask=vm, other=-1).to(tl.int32)
    nxt = tl.where((nxt >= 0) & (nxt < D), nxt, -1)
    sib = tl.where((sib >= 0) & (sib < D), sib, -1)
    return jj, cand, ridx, nxt, sib
