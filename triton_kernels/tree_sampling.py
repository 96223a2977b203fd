"""Triton stochastic tree verification (registered as ``impl="triton"`` of
:func:`specattn.ops.tree_speculative_sampling`).

Semantics: :func:`specattn.ops.verify.tree_speculative_sampling_reference` (SGLang
``tree_speculative_sampling_target_only``, ``sgl-kernel/csrc/speculative/
speculative_sampling.cuh``; final draw as FlashInfer's sampling-from-probabilities, with the
positive-residual guard and the last-positive fallback of the reference).  Written from those
semantics, not from their code.

One launch, one program per request, no host sync (CUDA-graph capturable):

1. Walk.  The request's tree rows (tokens, retrive rows, first-child / next-sibling links)
   live in register vectors of ``BLOCK_D`` lanes, as in the greedy kernel of
   :mod:`.tree_ops`.  At the last accepted node the children are tried in sibling order
   with a float32 running sum ``prob_acc += q[tok]`` and accepted when
   ``coin <= div_rn(prob_acc, threshold_acc)`` or ``q[tok] >= threshold_single``:
   ``div_rn`` (IEEE round-to-nearest) rather than ``/``, which Triton lowers to the
   approximate ``div.full.f32`` on NVIDIA GPUs.  The tokens of children rejected at the
   final node are kept in a register mask.
2. Final draw over ``V`` in tiles of ``BLOCK_V`` (any ``V``): residual
   ``r = relu(q - p)`` with ``p`` the draft row (``HAS_DRAFT``, not after ``num_steps``
   accepts) and ``r = 0`` at the rejected tokens (zeroed by a short loop per tile that holds
   one).  Pass 1 sums ``r`` tile by tile (running float32 total); pass 2 walks the tiles
   again with ``cdf = running + cumsum(r)`` and stops at the first tile holding an index with
   ``r > 0`` and ``cdf > u`` (``u = coin * total``); if there is none, the last index with
   ``r > 0``; ``V - 1`` if ``r`` is all zero.

Deterministic: fixed reduction order per ``(V, D)`` configuration, no atomics; the tile
size depends on ``V`` only, so results do not depend on the batch.  Acceptance decisions are
bit-identical to the reference; the bonus token is equal up to rounding at cdf boundaries
(tree-ordered float32 tile sums vs the reference's double-accumulated CPU cumsum).

Assumes, as SGLang and :func:`specattn.ops.build_tree`, that ``retrive_index[b, :]`` lie in
request ``b``'s own rows ``[b*D, b*D + D)``: each program writes its block of ``predicts``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._util import gdc_enter, next_pow2, on_tensor_device, pdl_kwargs
from .tree_common import gather_lane, tree_rows

__all__ = ["tree_speculative_sampling"]

_MAX_BLOCK_V = 4096


@triton.jit
def _residual_tile(q_row, p_row, v0, V, p_len, rejtok,
                   HAS_DRAFT: tl.constexpr, BLOCK_V: tl.constexpr):
    """``relu(q - p)`` on tokens ``[v0, v0 + BLOCK_V)`` (0 past ``V`` and at the rejected
    tokens ``rejtok >= 0``), and the token ids of the tile; ``p`` is read below ``p_len``
    (``V`` or 0), else taken as 0."""
    vv = v0 + tl.arange(0, BLOCK_V)
    m = vv < V
    q = tl.load(q_row + vv, mask=m, other=0.0)
    if HAS_DRAFT:
        p = tl.load(p_row + vv, mask=vv < p_len, other=0.0)
        r = tl.maximum(q - p, 0.0)
    else:
        r = tl.maximum(q, 0.0)
    # SGLang sets p = q at the rejected children's tokens: relu(q - q) = 0
    rem = (rejtok >= v0) & (rejtok < v0 + BLOCK_V)
    while tl.max(rem.to(tl.int32), axis=0) > 0:
        tk = tl.min(tl.where(rem, rejtok, V), axis=0)
        r = tl.where(vv == tk, 0.0, r)
        rem = rem & (rejtok != tk)
    return r, vv


@triton.jit
def _tree_sampling_kernel(pred_ptr, pred_s0, acc_ptr, acc_s0, acc_s1, al_ptr, al_s0,
                          cand_ptr, c_s0, c_s1, ri_ptr, ri_s0, ri_s1, nx_ptr, nx_s0, nx_s1,
                          sb_ptr, sb_s0, sb_s1, us_ptr, us_s0, us_s1, uf_ptr, uf_s0,
                          tp_ptr, tp_s0, tp_s1, dp_ptr, dp_s0, dp_s1,
                          th_single, th_acc, D, S, V,
                          HAS_DRAFT: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    jj, cand, ridx, nxt, sib = tree_rows(cand_ptr, c_s0, c_s1, ri_ptr, ri_s0, ri_s1, nx_ptr, nx_s0,
                                         nx_s1, sb_ptr, sb_s0, sb_s1, b, D, BLOCK_D)
    vm = jj < D
    ks = tl.arange(0, BLOCK_S)

    # ---- walk: children in sibling order, float32 running sum (bit-exact with the reference)
    last = gather_lane(ridx, 0, jj)                  # flat row of the last accepted token
    accv = tl.where(ks == 0, last, -1)           # accept_index row
    predv = tl.zeros([BLOCK_S], dtype=tl.int64)  # token emitted after path token k
    node = gather_lane(nxt, 0, jj) * 0               # draft index of the last accepted token
    n = node
    rej = jj < 0                                 # children of `node` rejected (draft mask)
    go = (node + S > 1).to(tl.int32)
    while go != 0:
        q_row = tp_ptr + b * tp_s0 + node.to(tl.int64) * tp_s1
        coin = tl.load(us_ptr + b * us_s0 + node.to(tl.int64) * us_s1)
        prob_acc = coin * 0.0
        c = gather_lane(nxt, node, jj)
        hit = node * 0 - 1
        guard = node * 0
        rej = jj < 0
        while (c != -1) & (hit == -1) & (guard <= D):
            tok = gather_lane(cand, c, jj)
            q = tl.load(q_row + tok, mask=(tok >= 0) & (tok < V), other=0.0)
            prob_acc = prob_acc + q
            ok = (coin <= tl.math.div_rn(prob_acc, th_acc)) | (q >= th_single)
            hit = tl.where(ok, c, hit)
            rej = rej | ((jj == c) & (ok == 0))
            c = gather_lane(sib, c, jj)
            guard += 1
        ok = hit != -1
        predv = tl.where((ks == n) & ok, gather_lane(cand, hit, jj), predv)
        n = tl.where(ok, n + 1, n)
        node = tl.where(ok, hit, node)
        last = tl.where(ok, gather_lane(ridx, hit, jj), last)
        accv = tl.where((ks == n) & ok, last, accv)
        rej = rej & (ok == 0)                    # nothing rejected yet at the new node
        go = (ok & (n < S - 1)).to(tl.int32)

    # ---- final draw from relu(q - p) at `node`
    q_row = tp_ptr + b * tp_s0 + node.to(tl.int64) * tp_s1
    p_row = dp_ptr + b * dp_s0 + node.to(tl.int64) * dp_s1
    p_len = tl.where(n != S - 1, V, 0)           # no draft probs for the bonus token
    rejtok = tl.where(rej, cand, -1)
    total = tl.zeros([], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        r, vv = _residual_tile(q_row, p_row, v0, V, p_len, rejtok, HAS_DRAFT, BLOCK_V)
        total += tl.sum(r, axis=0)
    u = tl.load(uf_ptr + b * uf_s0) * total
    agg = tl.zeros([], dtype=tl.float32)
    found = n * 0 - 1
    last_pos = n * 0 - 1
    v0 = n * 0
    while (v0 < V) & (found < 0):
        r, vv = _residual_tile(q_row, p_row, v0, V, p_len, rejtok, HAS_DRAFT, BLOCK_V)
        pos = r > 0.0
        cdf = agg + tl.cumsum(r, axis=0)
        idx = tl.min(tl.where(pos & (cdf > u), vv, V), axis=0)
        found = tl.where(idx < V, idx, -1)
        last_pos = tl.maximum(last_pos, tl.max(tl.where(pos, vv, -1), axis=0))
        agg += tl.sum(r, axis=0)
        v0 += BLOCK_V
    bonus = tl.where(found >= 0, found, tl.where(last_pos >= 0, last_pos, V - 1))
    predv = tl.where(ks == n, bonus.to(tl.int64), predv)

    # ---- outputs
    tl.store(acc_ptr + b * acc_s0 + ks.to(tl.int64) * acc_s1, accv.to(tl.int32), mask=ks < S)
    tl.store(al_ptr + b * al_s0, n.to(tl.int32))
    row = b * D + jj  # this request's rows of predicts: path rows get their token, others 0
    on = (accv[None, :] == row[:, None]) & (ks[None, :] <= n)
    val = tl.sum(tl.where(on, predv[None, :], 0), axis=1)
    tl.store(pred_ptr + row * pred_s0, val.to(tl.int32), mask=vm)


@on_tensor_device
def tree_speculative_sampling(predicts, accept_index, accept_length, candidates, retrive_index,
                              retrive_next_token, retrive_next_sibling, uniform_samples,
                              uniform_samples_for_final_sampling, target_probs,
                              threshold_single: float, threshold_acc: float,
                              draft_probs: Optional[torch.Tensor] = None, *,
                              block_v: Optional[int] = None) -> None:
    """Triton :func:`specattn.ops.tree_speculative_sampling` (signature of
    ``tree_speculative_sampling_reference``; inputs validated by the wrapper, ``target_probs``
    / ``draft_probs`` with stride 1 in the last dim).  ``block_v`` (a power of 2 >= 16)
    overrides the vocabulary tile, for tests; by default it depends on ``V`` only."""
    bs, D = candidates.shape
    S, V = accept_index.shape[1], target_probs.shape[2]
    if bs == 0:
        return
    if V > 1 and target_probs.stride(2) != 1:
        raise ValueError("target_probs must have stride 1 in its last dim")
    has_draft = draft_probs is not None
    if has_draft and V > 1 and draft_probs.stride(2) != 1:
        raise ValueError("draft_probs must have stride 1 in its last dim")
    BLOCK_V = block_v or min(next_pow2(V), _MAX_BLOCK_V)
    dp = draft_probs if has_draft else target_probs  # never read without HAS_DRAFT
    _tree_sampling_kernel[(bs,)](
        predicts, predicts.stride(0), accept_index, accept_index.stride(0), accept_index.stride(1),
        accept_length, accept_length.stride(0),
        candidates, candidates.stride(0), candidates.stride(1),
        retrive_index, retrive_index.stride(0), retrive_index.stride(1),
        retrive_next_token, retrive_next_token.stride(0), retrive_next_token.stride(1),
        retrive_next_sibling, retrive_next_sibling.stride(0), retrive_next_sibling.stride(1),
        uniform_samples, uniform_samples.stride(0), uniform_samples.stride(1),
        uniform_samples_for_final_sampling, uniform_samples_for_final_sampling.stride(0),
        target_probs, target_probs.stride(0), target_probs.stride(1),
        dp, dp.stride(0), dp.stride(1),
        float(threshold_single), float(max(threshold_acc, 1e-9)), D, S, V,
        HAS_DRAFT=has_draft, BLOCK_D=next_pow2(D), BLOCK_S=next_pow2(S), BLOCK_V=BLOCK_V,
        num_warps=8 if BLOCK_V >= 2048 else 4, **pdl_kwargs(predicts))
