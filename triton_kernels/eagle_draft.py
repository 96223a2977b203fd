"""Triton implementations of :func:`specattn.ops.eagle_beam_step`,
:func:`specattn.ops.select_draft_tokens` and :func:`specattn.ops.fork_req_to_token_rows`
(registered as ``impl="triton"`` there; the launchers have the references' positional
signatures).  One launch each, one program per request row (per beam for the fork),
everything in register vectors.

Order key (as :mod:`.topk`'s): a score ``x`` at column ``c`` becomes the int64 key
``(o << 32) | (0x7FFFFFFF - c)``, ``o`` the float32 bits of ``x`` (``-0.0`` read as
``+0.0``) made monotone (``b`` if ``b >= 0`` else ``b ^ 0x7FFFFFFF``).  Keys are distinct
within a row, a larger key is a larger score or an equal score at a lower column, and every
comparison is on integers, so NaNs cannot stall a loop or pick a padding lane (real keys
are above the padding key ``-2^63``).

- ``_beam_step_kernel``, grid ``(bs,)``: loads the ``K * K`` candidates of request ``b``
  (lane ``c = j * K + i``: beam ``j``, child ``i``; ``K * K <= 64`` lanes), adds the beam
  scores (one float32 add, as torch's), stores candidate scores and tokens at ``offset +
  c`` (and, with ``WRITE_BEAMS``, the incoming beams at ``beam_offset``), then with
  ``SELECT`` takes ``K`` rounds of a max over the keys (unrolled, ``K <= 8``).  The chosen
  scores and tokens are picked out of the lanes by a ``[K, K * K]`` one-hot sum over their
  int32 bits / int64 values (exact: one non-zero term), so a ``-0.0`` score comes back as
  ``-0.0``.  ``parents = best // K``; ``GATHER_ROWS`` loads ``cur_rows[b, parents]``;
  ``WRITE_PARENTS`` stores ``best + offset`` into ``parent_list``.
- ``_select_kernel``, grid ``(bs,)``: the ``n_cand`` keys of row ``b`` in one vector of
  ``NP = next_pow2(n_cand)`` lanes.  The ``D - 1`` largest are those ``>= hi``, ``hi`` the
  ``(D - 1)``-th largest key, found by ``D - 1`` rounds of a max; when ``D - 1 > n_cand /
  2`` the kernel instead finds ``lo``, the ``(n_cand - D + 1)``-th smallest key, by rounds
  of a min and keeps the keys ``> lo`` (at most ``n_cand / 2`` rounds either way; none when
  ``D - 1 == n_cand``).  An inclusive ``cumsum`` of the kept lanes gives each one's output
  position, so ``selected`` comes out in ascending order with no sort, and each kept lane
  stores its column and token (``draft_tokens[b, 1 + pos]``); lane 0 of the row stores the
  root.

- ``_fork_rows_kernel``, grid ``(bs * R,)``: program ``b * R + j`` reads its beam's source
  and destination rows, copies the columns ``first_col[b] + [0, NUM_COLS)`` that lie inside
  the table (and are not ``new_col[b]``) in ``BLOCK_C``-wide vectors, then stores the new
  slot and the flat ``prefix_lens`` / ``out_cache_loc`` entries.  Within a program the
  copy and the new slot never touch the same address, so no barrier is needed; across
  programs the wrapper's contract (no ``dst`` row is a ``src`` row) keeps reads ahead of
  writes.

No host sync and no allocation but the outputs (``torch.empty``): CUDA-graph capturable.
The launchers trust the wrapper's validation (shapes, dtypes, ``K <= 8``, ``n_cand <=
4096``, column ranges inside the buffers).  CPU interpreter (``TRITON_INTERPRET=1``): the
same code runs on CPU tensors (the tests); without it, CPU tensors raise RuntimeError.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._util import gdc_enter, on_tensor_device, pdl_kwargs, require_device
from .topk import KEY_MAX, KEY_MIN, order_keys

__all__ = ["eagle_beam_step", "select_draft_tokens", "fork_req_to_token_rows", "select_top_lanes"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def select_top_lanes(score, cc, live, kk, km, K: tl.constexpr, KP: tl.constexpr):
    """The ``K`` best of the float32 lanes ``score`` (columns ``cc``, ``live`` the real ones)
    under the order keys (value, then the lower column), best first, in ``K`` rounds of an
    integer max: ``(best int64 [KP]: their columns, 0 past K; scores float32 [KP]: their exact
    bits, by a one-hot sum; hit bool [KP, len(cc)]: the one-hot rows, to pick other lanes'
    values)``.  ``kk = arange(KP)``, ``km = kk < K``."""
    key = order_keys(score, cc, live)
    top_keys = tl.full([KP], KEY_MIN, tl.int64)
    for r in tl.static_range(K):
        top = tl.max(key, axis=0)
        top_keys = tl.where(kk == r, top, top_keys)
        key = tl.where(key == top, KEY_MIN, key)
    best = tl.where(km, (top_keys & 0x7FFFFFFF) ^ 0x7FFFFFFF, 0)
    hit = best[:, None] == cc[None, :].to(tl.int64)
    bits = score.to(tl.int32, bitcast=True)
    picked = tl.sum(tl.where(hit, bits[None, :], 0), axis=1).to(tl.int32).to(tl.float32, bitcast=True)
    return best, picked, hit


@triton.jit
def _beam_step_kernel(beam_s_ptr, beam_s_s0, beam_s_s1, child_s_ptr, child_s_s0, child_s_s1,
                      child_t_ptr, child_t_s0, child_t_s1, beam_t_ptr, beam_t_s0, beam_t_s1,
                      cand_s_ptr, cand_s_s0, cand_s_s1, cand_t_ptr, cand_t_s0, cand_t_s1,
                      offset, beam_offset,
                      out_s_ptr, out_t_ptr, best_ptr, parent_ptr,
                      cur_ptr, cur_s0, cur_s1, src_ptr,
                      plist_ptr, plist_s0, plist_s1, parent_offset,
                      K: tl.constexpr, KP: tl.constexpr, KKP: tl.constexpr,
                      WRITE_BEAMS: tl.constexpr, SELECT: tl.constexpr,
                      GATHER_ROWS: tl.constexpr, WRITE_PARENTS: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    cc = tl.arange(0, KKP)
    live = cc < K * K
    j = (cc // K).to(tl.int64)
    i = (cc % K).to(tl.int64)
    beam = tl.load(beam_s_ptr + b * beam_s_s0 + j * beam_s_s1, mask=live, other=0.0)
    child_row = b * K + j
    child = tl.load(child_s_ptr + child_row * child_s_s0 + i * child_s_s1, mask=live, other=0.0)
    tok = tl.load(child_t_ptr + child_row * child_t_s0 + i * child_t_s1, mask=live, other=0)
    score = beam + child
    col = offset + cc.to(tl.int64)
    tl.store(cand_s_ptr + b * cand_s_s0 + col * cand_s_s1, score, mask=live)
    tl.store(cand_t_ptr + b * cand_t_s0 + col * cand_t_s1, tok, mask=live)
    kk = tl.arange(0, KP)
    km = kk < K
    if WRITE_BEAMS:
        bsc = tl.load(beam_s_ptr + b * beam_s_s0 + kk.to(tl.int64) * beam_s_s1, mask=km, other=0.0)
        btk = tl.load(beam_t_ptr + b * beam_t_s0 + kk.to(tl.int64) * beam_t_s1, mask=km, other=0)
        bcol = beam_offset + kk.to(tl.int64)
        tl.store(cand_s_ptr + b * cand_s_s0 + bcol * cand_s_s1, bsc, mask=km)
        tl.store(cand_t_ptr + b * cand_t_s0 + bcol * cand_t_s1, btk, mask=km)
    if SELECT:
        best, out_s, hit = select_top_lanes(score, cc, live, kk, km, K, KP)
        out_t = tl.sum(tl.where(hit, tok[None, :], 0), axis=1)
        parents = best // K
        o = b * K + kk
        tl.store(out_s_ptr + o, out_s, mask=km)
        tl.store(out_t_ptr + o, out_t, mask=km)
        tl.store(best_ptr + o, best, mask=km)
        tl.store(parent_ptr + o, parents, mask=km)
        if GATHER_ROWS:
            src = tl.load(cur_ptr + b * cur_s0 + parents.to(tl.int64) * cur_s1, mask=km, other=0)
            tl.store(src_ptr + o, src.to(tl.int64), mask=km)
        if WRITE_PARENTS:
            pcol = parent_offset + kk.to(tl.int64)
            tl.store(plist_ptr + b * plist_s0 + pcol * plist_s1, best + offset, mask=km)


@triton.jit
def _select_kernel(score_ptr, score_s0, score_s1, tok_ptr, tok_s0, tok_s1, root_ptr, root_s0,
                   sel_ptr, draft_ptr, N, NSEL, TOP_ROUNDS, BOTTOM_ROUNDS, NP: tl.constexpr,
                   PDL: tl.constexpr = False):
    gdc_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    cc = tl.arange(0, NP)
    live = cc < N
    x = tl.load(score_ptr + b * score_s0 + cc.to(tl.int64) * score_s1, mask=live, other=0.0)
    key = order_keys(x, cc, live)
    # hi: the NSEL-th largest key (TOP_ROUNDS = NSEL rounds), or the padding key
    hi = tl.full((), KEY_MIN, tl.int64)
    k = key
    for r in range(TOP_ROUNDS):
        hi = tl.max(k, axis=0)
        k = tl.where(k == hi, KEY_MIN, k)
    # lo: the (N - NSEL)-th smallest key (BOTTOM_ROUNDS = N - NSEL rounds), or the padding key
    lo = tl.full((), KEY_MIN, tl.int64)
    k = tl.where(live, key, KEY_MAX)
    for r in range(BOTTOM_ROUNDS):
        lo = tl.min(k, axis=0)
        k = tl.where(k == lo, KEY_MAX, k)
    keep = live & (key >= hi) & (key > lo)
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1                        # ascending columns
    tok = tl.load(tok_ptr + b * tok_s0 + cc.to(tl.int64) * tok_s1, mask=keep, other=0)
    tl.store(sel_ptr + b * NSEL + pos, cc.to(tl.int64), mask=keep)
    tl.store(draft_ptr + b * (NSEL + 1) + 1 + pos, tok, mask=keep)
    root = tl.load(root_ptr + b * root_s0 + cc * 0, mask=cc == 0, other=0)  # (vector masks only)
    tl.store(draft_ptr + b * (NSEL + 1) + cc, root, mask=cc == 0)


@triton.jit
def _fork_rows_kernel(rtt_ptr, rtt_s0, W, src_ptr, src_s0, src_s1, dst_ptr, dst_s0, dst_s1,
                      first_ptr, first_s0, new_col_ptr, new_col_s0, new_slot_ptr, ns_s0, ns_s1,
                      prefix_ptr, loc_ptr, NUM_COLS, R: tl.constexpr, BLOCK_C: tl.constexpr,
                      HAS_NEW: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    b = pid // R
    j = pid % R
    cc = tl.arange(0, BLOCK_C)
    lane0 = cc == 0
    # per-beam scalars, loaded as lane-0 vectors and reduced (vector masks only)
    src = tl.sum(tl.load(src_ptr + b * src_s0 + j * src_s1 + cc * 0, mask=lane0, other=0).to(tl.int64), axis=0)
    dst = tl.sum(tl.load(dst_ptr + b * dst_s0 + j * dst_s1 + cc * 0, mask=lane0, other=0).to(tl.int64), axis=0)
    c0 = tl.sum(tl.load(first_ptr + b * first_s0 + cc * 0, mask=lane0, other=0).to(tl.int64), axis=0)
    if HAS_NEW:
        ncol = tl.sum(tl.load(new_col_ptr + b * new_col_s0 + cc * 0, mask=lane0, other=0).to(tl.int64), axis=0)
    else:
        ncol = -1
    src_row = rtt_ptr + src * rtt_s0
    dst_row = rtt_ptr + dst * rtt_s0
    for start in range(0, NUM_COLS, BLOCK_C):
        col = c0 + start + cc
        ok = (start + cc < NUM_COLS) & (col >= 0) & (col < W) & (col != ncol)
        v = tl.load(src_row + col, mask=ok, other=0)
        tl.store(dst_row + col, v, mask=ok)
    if HAS_NEW:
        slot = tl.load(new_slot_ptr + b * ns_s0 + j * ns_s1 + cc * 0, mask=lane0, other=0)
        nv = ncol + cc * 0
        ok = lane0 & (nv >= 0) & (nv < W)
        tl.store(dst_row + nv, slot.to(rtt_ptr.dtype.element_ty), mask=ok)
        tl.store(prefix_ptr + pid + cc * 0, nv, mask=lane0)
        tl.store(loc_ptr + pid + cc * 0, slot.to(tl.int64), mask=lane0)


# ----------------------------------------------------------------------------- host side
@on_tensor_device
def eagle_beam_step(beam_scores: torch.Tensor, child_scores: torch.Tensor, child_tokens: torch.Tensor,
                    cand_scores: torch.Tensor, cand_tokens: torch.Tensor, offset: int,
                    beam_tokens: Optional[torch.Tensor], beam_offset: Optional[int], select: bool,
                    cur_rows: Optional[torch.Tensor], parent_list: Optional[torch.Tensor],
                    parent_offset: Optional[int]):
    """Triton :func:`specattn.ops.eagle_beam_step` (one launch; arguments validated by the
    wrapper).  Returns the tuple ``(scores, tokens, best, parents, src_rows)`` (the fields
    of ``specattn.ops.BeamStep``, which the wrapper builds) with ``select``, else None."""
    require_device(beam_scores, "eagle_beam_step", _INTERPRET)
    bs, K = beam_scores.shape
    dev = beam_scores.device
    outs = None
    if select:
        outs = (torch.empty(bs, K, dtype=torch.float32, device=dev),
                torch.empty(bs, K, dtype=torch.int64, device=dev),
                torch.empty(bs, K, dtype=torch.int64, device=dev),
                torch.empty(bs, K, dtype=torch.int64, device=dev),
                None if cur_rows is None else torch.empty(bs, K, dtype=torch.int64, device=dev))
    if bs == 0:
        return outs
    write_beams = beam_offset is not None
    # absent operands: pass a tensor that is never read (its branch is compiled out)
    bt = beam_tokens if write_beams else child_tokens
    cur = cur_rows if cur_rows is not None else child_tokens
    pl = parent_list if parent_list is not None else child_tokens
    o_s, o_t, o_b, o_p, o_src = outs if select else (beam_scores, child_tokens, child_tokens,
                                                     child_tokens, None)
    src = o_src if o_src is not None else child_tokens
    _beam_step_kernel[(bs,)](
        beam_scores, beam_scores.stride(0), beam_scores.stride(1),
        child_scores, child_scores.stride(0), child_scores.stride(1),
        child_tokens, child_tokens.stride(0), child_tokens.stride(1),
        bt, bt.stride(0), bt.stride(1),
        cand_scores, cand_scores.stride(0), cand_scores.stride(1),
        cand_tokens, cand_tokens.stride(0), cand_tokens.stride(1),
        offset, beam_offset if write_beams else 0,
        o_s, o_t, o_b, o_p,
        cur, cur.stride(0), cur.stride(1), src,
        pl, pl.stride(0), pl.stride(1), parent_offset if parent_list is not None else 0,
        K=K, KP=triton.next_power_of_2(K), KKP=triton.next_power_of_2(K * K),
        WRITE_BEAMS=write_beams, SELECT=bool(select), GATHER_ROWS=cur_rows is not None,
        WRITE_PARENTS=parent_list is not None, num_warps=1, **pdl_kwargs(beam_scores))
    return outs


@on_tensor_device
def select_draft_tokens(scores: torch.Tensor, tokens: torch.Tensor, roots: torch.Tensor,
                        num_draft_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`specattn.ops.select_draft_tokens` (one launch; arguments validated by
    the wrapper: ``2 <= num_draft_tokens <= n_cand + 1``, ``n_cand <= 4096``).  Returns
    ``(selected int64 [bs, D - 1], draft_tokens int64 [bs, D])``, new tensors."""
    require_device(scores, "select_draft_tokens", _INTERPRET)
    bs, n = scores.shape
    nsel = int(num_draft_tokens) - 1
    dev = scores.device
    selected = torch.empty(bs, nsel, dtype=torch.int64, device=dev)
    draft_tokens = torch.empty(bs, nsel + 1, dtype=torch.int64, device=dev)
    if bs == 0:
        return selected, draft_tokens
    top_rounds, bottom_rounds = (nsel, 0) if 2 * nsel <= n else (0, n - nsel)
    np2 = triton.next_power_of_2(n)
    _select_kernel[(bs,)](scores, scores.stride(0), scores.stride(1), tokens, tokens.stride(0),
                          tokens.stride(1), roots, roots.stride(0), selected, draft_tokens, n, nsel,
                          top_rounds, bottom_rounds, NP=np2,
                          num_warps=1 if np2 <= 128 else (2 if np2 <= 512 else 4), **pdl_kwargs(scores))
    return selected, draft_tokens


@on_tensor_device
def fork_req_to_token_rows(req_to_token: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
                           first_col: torch.Tensor, num_cols: int, new_col: Optional[torch.Tensor],
                           new_slots: Optional[torch.Tensor]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Triton :func:`specattn.ops.fork_req_to_token_rows` (one launch; arguments validated
    by the wrapper).  Returns ``(prefix_lens, out_cache_loc)`` (int64 ``[bs * R]``) with
    ``new_col``, else None."""
    require_device(req_to_token, "fork_req_to_token_rows", _INTERPRET)
    bs, R = dst_rows.shape
    dev = req_to_token.device
    has_new = new_col is not None
    outs = (torch.empty(bs * R, dtype=torch.int64, device=dev),
            torch.empty(bs * R, dtype=torch.int64, device=dev)) if has_new else None
    if bs * R == 0:
        return outs
    # absent operands: pass a tensor that is never read (its branch is compiled out)
    nc = new_col if has_new else first_col
    ns = new_slots if has_new else dst_rows
    pre, loc = outs if has_new else (first_col, first_col)
    block_c = max(16, min(128, triton.next_power_of_2(max(int(num_cols), 1))))
    _fork_rows_kernel[(bs * R,)](
        req_to_token, req_to_token.stride(0), req_to_token.shape[1],
        src_rows, src_rows.stride(0), src_rows.stride(1), dst_rows, dst_rows.stride(0), dst_rows.stride(1),
        first_col, first_col.stride(0), nc, nc.stride(0), ns, ns.stride(0), ns.stride(1),
        pre, loc, int(num_cols), R=R, BLOCK_C=block_c, HAS_NEW=has_new, num_warps=1, **pdl_kwargs(req_to_token))
    return outs
