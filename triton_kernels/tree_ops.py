"""Triton implementations of the EAGLE tree ops (registered as ``impl="triton"`` by
:mod:`specattn.ops.tree`, :mod:`specattn.ops.verify` and :mod:`specattn.ops.compaction`).

Each launcher has exactly the signature of the op's reference function (outputs passed in,
written in place), runs ONE kernel launch for the whole batch and never syncs with the host
(CUDA-graph capturable).  Semantics: see the reference functions' modules.

- :func:`build_tree`: one program per request.  The parent of every draft token is found with
  a ``[D, D]`` comparison of ``selected_index`` against the parent candidates; ancestors by
  ``num_steps`` rounds of pointer chasing on register vectors; child / sibling links by a
  min-reduction over ``[D, D]``.  ``D`` up to a few hundred fits comfortably.  When asked, the
  same program then writes the request's FlashInfer packed-mask segment in ``[BLOCK_B, 8]``
  bit tiles (prefix bits are ones, tree bits read back from the mask rows it just stored,
  after a CTA barrier).
- :func:`verify_tree_greedy`: one program per request; the request's tree rows live in
  registers, the walk is a data-dependent loop (path length x siblings tried).  Assumes, as
  SGLang and :func:`specattn.ops.build_tree`, that ``retrive_index[b, :]`` lie in request
  ``b``'s own block ``[b*D, b*D + D)`` (``predicts`` rows are written per block).
- :func:`compact_accepted_path`: grid ``(bs, ceil(H / BLOCK_H))``: every program rebuilds the
  request's ``src_index`` and gathers one column tile of ``hidden_states``; the programs of
  tile 0 also write the index outputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import gdc_enter, next_pow2, on_tensor_device, pdl_kwargs
from .tree_common import gather_lane, tree_rows

__all__ = ["build_tree", "verify_tree_greedy", "compact_accepted_path"]


# ----------------------------------------------------------------------------- build_tree
@triton.jit
def _build_tree_kernel(pl_ptr, pl_s0, pl_s1, sel_ptr, sel_s0, sel_s1, vsl_ptr, vsl_s0,
                       mask_ptr, m_s0, m_s1, m_s2, pos_ptr, pos_s0, ri_ptr, ri_s0, ri_s1,
                       nx_ptr, nx_s0, nx_s1, sb_ptr, sb_s0, sb_s1,
                       fi_ptr, fi_numel, ip_ptr, ip_s0,
                       topk, num_steps, D, W, BLOCK_D: tl.constexpr,
                       HAS_FI: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_D)
    valid = j < D
    is_draft = (j >= 1) & valid
    # flat candidate of each draft token (-1 for the root / padding)
    sel = tl.load(sel_ptr + b * sel_s0 + (j - 1).to(tl.int64) * sel_s1, mask=is_draft, other=-1).to(tl.int32)
    beam = tl.where(is_draft, sel // topk, 0)
    has_beam = is_draft & (beam > 0)
    pcand = tl.load(pl_ptr + b * pl_s0 + beam.to(tl.int64) * pl_s1, mask=has_beam, other=-2).to(tl.int32)
    # draft index whose candidate is pcand (selected candidates are distinct: <= 1 match)
    match = (sel[None, :] == pcand[:, None]) & is_draft[None, :] & has_beam[:, None]
    found = tl.max(tl.where(match, j[None, :], -1), axis=1)
    # real parent: 0 for root children, the found draft, -1 for root / padding / missing parent
    rparent = tl.where(has_beam, found, tl.where(is_draft, 0, -1))
    # parent for the mask / depth walk: an orphan hangs off the root there
    mparent = tl.maximum(rparent, 0)

    # ancestors: itself and the root, then num_steps rounds of pointer chasing
    anc = ((j[None, :] == 0) | (j[None, :] == j[:, None])).to(tl.int32)
    depth = tl.where(is_draft, 1, 0)
    cur = mparent
    for _ in range(num_steps):
        hitk = j[None, :] == cur[:, None]
        anc = anc | hitk.to(tl.int32)
        depth += tl.where(cur > 0, 1, 0)
        cur = tl.sum(tl.where(hitk, mparent[None, :], 0), axis=1)

    # pack rows into int32 words: bit k % 32 of word k // 32
    for w in range(W):
        base = w * 32
        inw = (j >= base) & (j < base + 32)
        bitv = tl.full([BLOCK_D], 1, tl.int32) << ((j - base) & 31)
        word = tl.sum(tl.where((anc != 0) & inw[None, :], bitv[None, :], 0), axis=1)
        tl.store(mask_ptr + b * m_s0 + j * m_s1 + w * m_s2, word, mask=valid)

    prefix = tl.load(vsl_ptr + b * vsl_s0).to(tl.int64)
    row = b * D + j
    tl.store(pos_ptr + row * pos_s0, prefix + depth.to(tl.int64), mask=valid)
    tl.store(ri_ptr + b * ri_s0 + j * ri_s1, row.to(tl.int64), mask=valid)

    BIG: tl.constexpr = 1 << 30
    # next sibling: the smallest larger draft index with the same real parent
    same = ((rparent[:, None] == rparent[None, :]) & (rparent[:, None] >= 0)
            & (j[None, :] > j[:, None]))
    sib = tl.min(tl.where(same, j[None, :], BIG), axis=1)
    sib = tl.where(sib == BIG, -1, sib)
    # first child: the smallest draft index whose real parent is this token
    child = (rparent[None, :] == j[:, None]) & is_draft[None, :]
    nxt = tl.min(tl.where(child, j[None, :], BIG), axis=1)
    nxt = tl.where(nxt == BIG, -1, nxt)
    tl.store(nx_ptr + b * nx_s0 + j * nx_s1, nxt.to(tl.int64), mask=valid)
    tl.store(sb_ptr + b * sb_s0 + j * sb_s1, sib.to(tl.int64), mask=valid)

    if HAS_FI:
        # FlashInfer segment: row-major [D, P + D] bits (P prefix ones, then the tree row),
        # little-endian within bytes, padding 0; bytes [start, start + ceil(D*(P+D)/8)).
        tl.debug_barrier()  # the mask words stored above by other threads are read back
        P = tl.maximum(prefix, 0)
        L = P + D
        nbits = L * D
        start = tl.load(ip_ptr + b * ip_s0).to(tl.int64)
        ok = (start >= 0) & (start < fi_numel)  # never outside the buffer (bad indptr)
        avail = tl.where(ok, tl.minimum((nbits + 7) // 8, fi_numel - start), 0)
        ib = tl.arange(0, BLOCK_B).to(tl.int64)
        tt = tl.arange(0, 8)
        for base in range(0, avail, BLOCK_B):
            i = base + ib
            e = i[:, None] * 8 + tt[None, :]  # [BLOCK_B, 8] element indices
            jr = e // L
            k = e - jr * L - P  # tree column (< 0: prefix)
            inb = e < nbits
            tree = inb & (k >= 0)
            word = tl.load(mask_ptr + b * m_s0 + jr * m_s1 + (k // 32) * m_s2, mask=tree, other=0)
            bit = tl.where(tree, (word >> (k & 31).to(tl.int32)) & 1, tl.where(inb, 1, 0))
            byte = tl.sum(bit << tt[None, :], axis=1)
            tl.store(fi_ptr + start + i, byte.to(tl.uint8), mask=i < avail)


@on_tensor_device
def build_tree(parent_list, selected_index, verified_seq_len, tree_mask, positions,
               retrive_index, retrive_next_token, retrive_next_sibling,
               topk: int, num_steps: int, num_draft_tokens: int,
               flashinfer_packed_mask=None, flashinfer_mask_indptr=None) -> None:
    """Triton :func:`specattn.ops.build_tree` (signature of ``build_tree_reference``).

    ``flashinfer_packed_mask`` (contiguous uint8, written in place) and
    ``flashinfer_mask_indptr`` (int32/int64 ``[bs + 1]``) are given together or not at all."""
    bs, D = verified_seq_len.shape[0], num_draft_tokens
    if bs == 0:
        return
    has_fi = flashinfer_packed_mask is not None
    if has_fi != (flashinfer_mask_indptr is not None):
        raise ValueError("flashinfer_packed_mask and flashinfer_mask_indptr go together")
    if has_fi and not flashinfer_packed_mask.is_contiguous():
        raise ValueError("flashinfer_packed_mask must be contiguous")
    W = tree_mask.shape[2]
    _build_tree_kernel[(bs,)](
        parent_list, parent_list.stride(0), parent_list.stride(1),
        selected_index, selected_index.stride(0), selected_index.stride(1),
        verified_seq_len, verified_seq_len.stride(0),
        tree_mask, tree_mask.stride(0), tree_mask.stride(1), tree_mask.stride(2),
        positions, positions.stride(0),
        retrive_index, retrive_index.stride(0), retrive_index.stride(1),
        retrive_next_token, retrive_next_token.stride(0), retrive_next_token.stride(1),
        retrive_next_sibling, retrive_next_sibling.stride(0), retrive_next_sibling.stride(1),
        flashinfer_packed_mask if has_fi else tree_mask,
        flashinfer_packed_mask.numel() if has_fi else 0,
        flashinfer_mask_indptr if has_fi else tree_mask,
        flashinfer_mask_indptr.stride(0) if has_fi else 0,
        topk, num_steps, D, W, BLOCK_D=next_pow2(D), HAS_FI=has_fi, BLOCK_B=128,
        num_warps=4 if D <= 64 else 8, **pdl_kwargs(parent_list))


# ----------------------------------------------------------------------------- verify
@triton.jit
def _verify_greedy_kernel(pred_ptr, pred_s0, acc_ptr, acc_s0, acc_s1, al_ptr, al_s0,
                          cand_ptr, c_s0, c_s1, ri_ptr, ri_s0, ri_s1, nx_ptr, nx_s0, nx_s1,
                          sb_ptr, sb_s0, sb_s1, tg_ptr, tg_s0, tg_s1, D, S,
                          BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    jj, cand, ridx, nxt, sib = tree_rows(cand_ptr, c_s0, c_s1, ri_ptr, ri_s0, ri_s1, nx_ptr, nx_s0,
                                         nx_s1, sb_ptr, sb_s0, sb_s1, b, D, BLOCK_D)
    vm = jj < D
    # never an address outside the request: rows outside the block fall back to the token's own
    ridx = tl.where((ridx >= b * D) & (ridx < b * D + D), ridx, b * D + jj)
    ks = tl.arange(0, BLOCK_S)

    last = gather_lane(ridx, 0, jj)  # flat row of the last accepted token
    accv = tl.where(ks == 0, last, -1)
    node = gather_lane(nxt, 0, jj) * 0  # draft index of the last accepted token (int32 0)
    n = node
    go = (node + S > 1).to(tl.int32)
    while go != 0:
        t_last = tl.load(tg_ptr + (last // D) * tg_s0 + (last % D) * tg_s1).to(tl.int64)
        c = gather_lane(nxt, node, jj)
        hit = node * 0 - 1
        guard = node * 0
        while (c != -1) & (hit == -1) & (guard <= D):  # siblings in chain order
            tok = gather_lane(cand, c, jj)
            hit = tl.where(tok == t_last, c, hit)
            c = gather_lane(sib, c, jj)
            guard += 1
        ok = hit != -1
        n = tl.where(ok, n + 1, n)
        node = tl.where(ok, hit, node)
        last = tl.where(ok, gather_lane(ridx, hit, jj), last)
        accv = tl.where((ks == n) & ok, last, accv)
        go = (ok & (n < S - 1)).to(tl.int32)

    tl.store(acc_ptr + b * acc_s0 + ks.to(tl.int64) * acc_s1, accv.to(tl.int32), mask=ks < S)
    tl.store(al_ptr + b * al_s0, n.to(tl.int32))
    # predicts of this block: the target's token at path rows (next draft or bonus), else 0
    row = b * D + jj
    on_path = tl.max(((accv[None, :] == row[:, None]) & (ks[None, :] < S)).to(tl.int32), axis=1)
    tg = tl.load(tg_ptr + b * tg_s0 + jj.to(tl.int64) * tg_s1, mask=vm & (on_path != 0), other=0)
    tl.store(pred_ptr + row * pred_s0, tg.to(tl.int32), mask=vm)


@on_tensor_device
def verify_tree_greedy(predicts, accept_index, accept_length, candidates, retrive_index,
                       retrive_next_token, retrive_next_sibling, target_predict) -> None:
    """Triton :func:`specattn.ops.verify_tree_greedy` (signature of
    ``verify_tree_greedy_reference``)."""
    bs, D = candidates.shape
    S = accept_index.shape[1]
    if bs == 0:
        return
    _verify_greedy_kernel[(bs,)](
        predicts, predicts.stride(0), accept_index, accept_index.stride(0), accept_index.stride(1),
        accept_length, accept_length.stride(0),
        candidates, candidates.stride(0), candidates.stride(1),
        retrive_index, retrive_index.stride(0), retrive_index.stride(1),
        retrive_next_token, retrive_next_token.stride(0), retrive_next_token.stride(1),
        retrive_next_sibling, retrive_next_sibling.stride(0), retrive_next_sibling.stride(1),
        target_predict, target_predict.stride(0), target_predict.stride(1), D, S,
        BLOCK_D=next_pow2(D), BLOCK_S=next_pow2(S), num_warps=1 if D <= 64 else 2, **pdl_kwargs(predicts))


# ----------------------------------------------------------------------------- compaction
@triton.jit
def _compact_kernel(ai_ptr, ai_s0, ai_s1, al_ptr, al_s0, ocl_ptr, ocl_s0, pr_ptr, pr_s0, hs_ptr,
                    src_ptr, src_s0, pro_ptr, pro_s0, hso_ptr, oclo_ptr, oclo_s0,
                    tgt_ptr, tgt_s0, sl_ptr, sl_s0, D, S, H,
                    HAS_PRED: tl.constexpr, HAS_HS: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    ph = tl.program_id(1)
    k = tl.arange(0, BLOCK_D)
    vm = k < D
    n = tl.load(al_ptr + b * al_s0).to(tl.int64) + 1  # root + accepted drafts
    on = vm & (k < n) & (k < S)
    ai = tl.load(ai_ptr + b * ai_s0 + k.to(tl.int64) * ai_s1, mask=on, other=0).to(tl.int64)
    row = b * D + k
    src = tl.where(on, ai, row)
    if ph == 0:
        tl.store(src_ptr + row * src_s0, src, mask=vm)
        loc_src = tl.load(ocl_ptr + src * ocl_s0, mask=vm, other=0)
        loc_row = tl.load(ocl_ptr + row * ocl_s0, mask=vm, other=0)
        tl.store(oclo_ptr + row * oclo_s0, loc_src, mask=vm)
        tl.store(sl_ptr + row * sl_s0, loc_src, mask=vm)
        tl.store(tgt_ptr + row * tgt_s0, loc_row, mask=vm)
        if HAS_PRED:
            p = tl.load(pr_ptr + src * pr_s0, mask=vm, other=0)
            tl.store(pro_ptr + row * pro_s0, p, mask=vm)
    if HAS_HS:
        h = ph.to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = vm[:, None] & (h < H)[None, :]
        v = tl.load(hs_ptr + src[:, None] * H + h[None, :], mask=m)
        tl.store(hso_ptr + row[:, None] * H + h[None, :], v, mask=m)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@on_tensor_device
def compact_accepted_path(accept_index, accept_length, out_cache_loc, predicts, hidden_states,
                          src_index, predicts_out, hidden_states_out, out_cache_loc_out,
                          tgt_loc, src_loc) -> None:
    """Triton :func:`specattn.ops.compact_accepted_path` (signature of
    ``compact_accepted_path_reference``)."""
    bs, S = accept_index.shape
    if bs == 0:
        return
    D = out_cache_loc.shape[0] // bs
    has_pred, has_hs = predicts is not None, hidden_states is not None
    hs = hso = hso_final = None
    H, BLOCK_H, n_tiles = 0, 16, 1
    if has_hs:
        H = hidden_states.numel() // max(bs * D, 1)
        isz = hidden_states.element_size()
        # copy raw bits: any dtype (bool, fp8, ...) as a same-size integer
        hs = hidden_states.reshape(bs * D, H).contiguous()  # the kernel reads packed rows
        if hs.dtype.is_complex or isz not in _SAME_SIZE_INT:
            raise RuntimeError(f"triton compact_accepted_path: unsupported hidden dtype {hs.dtype}")
        hs = hs.view(_SAME_SIZE_INT[isz])
        hso_final = hidden_states_out
        if hidden_states_out.is_contiguous():
            hso = hidden_states_out.view(bs * D, H).view(_SAME_SIZE_INT[isz])
        else:
            hso = torch.empty((bs * D, H), dtype=_SAME_SIZE_INT[isz], device=hs.device)
        BLOCK_D = next_pow2(D)
        BLOCK_H = max(16, min(triton.next_power_of_2(max(H, 1)), max(16, 8192 // BLOCK_D)))
        n_tiles = max(1, triton.cdiv(H, BLOCK_H))
    dummy = out_cache_loc
    _compact_kernel[(bs, n_tiles)](
        accept_index, accept_index.stride(0), accept_index.stride(1),
        accept_length, accept_length.stride(0), out_cache_loc, out_cache_loc.stride(0),
        predicts if has_pred else dummy, predicts.stride(0) if has_pred else 0,
        hs if has_hs else dummy,
        src_index, src_index.stride(0),
        predicts_out if has_pred else dummy, predicts_out.stride(0) if has_pred else 0,
        hso if has_hs else dummy,
        out_cache_loc_out, out_cache_loc_out.stride(0), tgt_loc, tgt_loc.stride(0),
        src_loc, src_loc.stride(0), D, S, H,
        HAS_PRED=has_pred, HAS_HS=has_hs, BLOCK_D=next_pow2(D), BLOCK_H=BLOCK_H, num_warps=4,
        **pdl_kwargs(accept_index))
    if has_hs and not hidden_states_out.is_contiguous():
        hso_final.copy_(hso.view(hidden_states_out.dtype).view(hidden_states_out.shape))
