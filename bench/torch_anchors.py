"""PyTorch anchors for the EAGLE tree ops' benchmarks (``specattn.bench.torch_anchors``).

What an engine without our kernels would write for the same steps: batched, vectorised
PyTorch (no Python loop over requests; loops only over the tree depth / ``num_steps``, over
``ceil(log2 D)`` pointer-jumping rounds, or over a node's children), no host synchronisation
(every function can be captured in a CUDA graph; nothing calls ``.item()``, ``.tolist()``,
``nonzero`` or boolean-mask indexing).  They take the same inputs and return the same
outputs as the public ops and are exact against the references (``tests/
test_torch_anchors.py``, ``tests/test_tree_ops_hypothesis.py``), but they do NOT validate their
inputs: they exist only as ``impl="torch"`` in the bench cases (:mod:`.cases_tree`), next to
``reference`` / ``triton`` / ``cuda``.

- :func:`build_tree_torch` = :func:`specattn.ops.build_tree`;
- :func:`verify_tree_greedy_torch` = :func:`specattn.ops.verify_tree_greedy`;
- :func:`tree_speculative_sampling_torch` = :func:`specattn.ops.tree_speculative_sampling`
  with explicit coins (the bonus draw may differ from the reference's within float rounding
  of the cumulative sum, as any two implementations of it);
- :func:`compact_accepted_path_torch` = :func:`specattn.ops.compact_accepted_path`.

The verify anchors take links as :func:`specattn.ops.build_tree` makes them: every node is in
at most one sibling chain, each chain is the child list of the node whose
``retrive_next_token`` is the chain's head, chains are acyclic.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from specattn.ops.tree_mask import pack_tree_mask
from specattn.ops.compaction import CompactedPath
from specattn.ops.tree import TreeInfo
from specattn.ops.verify import VerifyResult

__all__ = ["build_tree_torch", "verify_tree_greedy_torch", "tree_speculative_sampling_torch",
           "compact_accepted_path_torch", "tree_parents"]


# ----------------------------------------------------------------------------- build_tree
def build_tree_torch(parent_list: torch.Tensor, selected_index: torch.Tensor,
                     verified_seq_len: torch.Tensor, topk: int, num_steps: int,
                     D: int) -> TreeInfo:
    """Vectorised :func:`specattn.ops.build_tree` (same semantics, orphans included).

    Args:
        parent_list: int32/int64 ``[bs, topk*(num_steps-1) + 1]``.
        selected_index: int32/int64 ``[bs, D - 1]``, distinct per request.
        verified_seq_len: int32/int64 ``[bs]``, tokens.
        topk, num_steps, D: ints as :func:`specattn.ops.build_tree` (``D`` =
            ``num_draft_tokens``).
    Returns:
        :class:`specattn.ops.TreeInfo` ``(tree_mask int32 [bs, D, ceil(D/32)], positions
        int64 [bs*D], retrive_index / retrive_next_token / retrive_next_sibling int64
        [bs, D])`` on the inputs' device.

    Method: the parent of draft ``j`` by comparing ``selected_index`` with the parent
    candidates (``[bs, D-1, D-1]``); ancestors (mask rows) and depths by ``num_steps`` rounds
    of gathering parents; the dense ``[bs, D, D]`` mask packed to int32 words; first child /
    next sibling as a min over ``[bs, D, D]`` comparisons.
    """
    dev = verified_seq_len.device
    bs = verified_seq_len.shape[0]
    ar = torch.arange(D, device=dev)
    retrive_index = torch.arange(bs * D, dtype=torch.int64, device=dev).view(bs, D)
    if D == 1:  # the root only
        return TreeInfo(torch.ones(bs, 1, 1, dtype=torch.int32, device=dev),
                        verified_seq_len.to(torch.int64).clone(), retrive_index,
                        torch.full((bs, 1), -1, dtype=torch.int64, device=dev),
                        torch.full((bs, 1), -1, dtype=torch.int64, device=dev))
    sel = selected_index.long()  # [bs, D-1]: candidate of draft 1..D-1
    beam = sel // topk
    pcand = parent_list.long().gather(1, beam)  # the candidate each beam continues
    match = sel[:, None, :] == pcand[:, :, None]  # [bs, D-1 (child), D-1 (parent draft - 1)]
    found = (match.long() * ar[None, None, 1:]).amax(-1)  # parent draft, 0 if not selected
    rparent = torch.where(beam == 0, 0, torch.where(found > 0, found, -1))  # -1: missing
    root_col = torch.full((bs, 1), -1, dtype=torch.int64, device=dev)
    parent = torch.cat([root_col, rparent], 1)  # [bs, D]; root -1, orphans -1
    walk_parent = parent.clamp(min=0)  # the mask / depth walk stops at the root or an orphan

    # itself, then its ancestors: a token's depth is at most num_steps
    dense = torch.zeros(bs, D, D, dtype=torch.bool, device=dev)
    depth = torch.zeros(bs, D, dtype=torch.int64, device=dev)
    cur = ar.expand(bs, D)
    for _ in range(num_steps):
        dense.scatter_(2, cur[..., None], True)  # cur == 0 marks the root bit: always set
        depth += cur > 0
        cur = walk_parent.gather(1, cur)
    dense[:, :, 0] = True

    # first child / next sibling: smallest (larger) draft index with that (same) real parent
    big = torch.full((), D, dtype=torch.int64, device=dev)
    is_child = parent[:, None, :] == ar[None, :, None]  # [bs, node, child]
    first = torch.where(is_child, ar, big).amin(-1)
    same = (parent[:, :, None] == parent[:, None, :]) & (parent[:, :, None] >= 0)
    later = ar[None, :] > ar[:, None]
    nxt_sib = torch.where(same & later, ar, big).amin(-1)
    return TreeInfo(pack_tree_mask(dense),
                    (verified_seq_len.long()[:, None] + depth).flatten(),
                    retrive_index,
                    torch.where(first == D, -1, first),
                    torch.where(nxt_sib == D, -1, nxt_sib))


# ----------------------------------------------------------------------------- verify
def tree_parents(retrive_next_token: torch.Tensor,
                 retrive_next_sibling: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Parent and sibling order of every node, from the links, without walking them.

    Args:
        retrive_next_token, retrive_next_sibling: int32/int64 ``[bs, D]`` (-1 = none).
    Returns:
        ``(parent, to_tail)``, int64 ``[bs, D]``: ``parent[b, j]`` the node whose child list
        holds ``j`` (-1 when none: the root, orphans); ``to_tail[b, j]`` the number of
        siblings after ``j`` in its chain, so the first child in sibling order has the
        largest ``to_tail`` among its siblings.

    Method: list ranking by pointer jumping over the sibling chains (``ceil(log2 D)``
    rounds), then each chain's tail is labelled with the parent whose first child heads it.
    """
    bs, D = retrive_next_sibling.shape
    dev = retrive_next_sibling.device
    sib = retrive_next_sibling.long()
    self_idx = torch.arange(D, device=dev).expand(bs, D)
    ptr = torch.where(sib >= 0, sib, self_idx)  # tails point at themselves
    to_tail = (sib >= 0).long()
    for _ in range(math.ceil(math.log2(D)) if D > 1 else 0):
        to_tail = to_tail + to_tail.gather(1, ptr)  # a tail's own count is 0
        ptr = ptr.gather(1, ptr)
    nxt = retrive_next_token.long()
    has_child = nxt >= 0
    tail_of_head = ptr.gather(1, nxt.clamp(min=0))
    by_tail = torch.full((bs, D + 1), -1, dtype=torch.int64, device=dev)  # column D: dump
    by_tail.scatter_(1, torch.where(has_child, tail_of_head, D), self_idx)
    return by_tail[:, :D].gather(1, ptr), to_tail


def _walk_outputs(bs: int, D: int, num_steps: int, retrive_index: torch.Tensor):
    dev = retrive_index.device
    acc = torch.full((bs, num_steps + 1), -1, dtype=torch.int64, device=dev)
    acc[:, 0] = retrive_index[:, 0]
    return acc, torch.zeros(bs, dtype=torch.int64, device=dev)


def verify_tree_greedy_torch(candidates: torch.Tensor, retrive_index: torch.Tensor,
                             retrive_next_token: torch.Tensor,
                             retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor,
                             num_steps: int) -> VerifyResult:
    """Vectorised :func:`specattn.ops.verify_tree_greedy` (same semantics: among the
    children of the last accepted token whose draft token equals the target's token there,
    the FIRST in sibling order is accepted; at most ``num_steps`` drafts).

    Args:
        candidates: int32/int64 ``[bs, D]`` draft tokens (column 0: the root).
        retrive_index, retrive_next_token, retrive_next_sibling: int32/int64 ``[bs, D]`` as
            :func:`specattn.ops.build_tree` returns them.
        target_predict: int32/int64 ``[bs, D]``, read at the flat row ``retrive_index``.
        num_steps: most drafts accepted (>= 0).
    Returns:
        :class:`specattn.ops.VerifyResult` ``(predicts int32 [bs*D], accept_index int32
        [bs, num_steps+1], accept_length int32 [bs])``.

    Method: parents / sibling order from :func:`tree_parents`, then ``num_steps`` levels,
    each one ``[bs, D]`` comparison ``parent == node & candidates == target`` and an argmax
    of the sibling order.  ``predicts`` is the target's token at every path row (the next
    accepted draft along the path, the bonus at its end), 0 elsewhere.
    """
    bs, D = candidates.shape
    dev = candidates.device
    parent, to_tail = tree_parents(retrive_next_token, retrive_next_sibling)
    ridx = retrive_index.long()
    cand = candidates.long()
    target = target_predict.long().flatten()
    bidx = torch.arange(bs, device=dev)
    acc, n_acc = _walk_outputs(bs, D, num_steps, ridx)
    node = torch.zeros(bs, dtype=torch.int64, device=dev)
    last = ridx[:, 0]
    active = torch.ones(bs, dtype=torch.bool, device=dev)
    for s in range(num_steps):
        want = target[last]
        hit = (parent == node[:, None]) & (cand == want[:, None])
        score, child = torch.where(hit, to_tail, -1).max(1)
        found = active & (score >= 0)
        node = torch.where(found, child, node)
        last = torch.where(found, ridx[bidx, child], last)
        acc[:, s + 1] = torch.where(found, last, -1)
        n_acc += found
        active = found
    on_path = acc >= 0
    predicts = torch.zeros(bs * D + 1, dtype=torch.int32, device=dev)  # last entry: dump
    rows = torch.where(on_path, acc, bs * D)
    predicts.scatter_(0, rows.flatten(), target[acc.clamp(min=0)].to(torch.int32).flatten())
    return VerifyResult(predicts[:bs * D], acc.to(torch.int32), n_acc.to(torch.int32))


def tree_speculative_sampling_torch(candidates: torch.Tensor, retrive_index: torch.Tensor,
                                    retrive_next_token: torch.Tensor,
                                    retrive_next_sibling: torch.Tensor,
                                    target_probs: torch.Tensor, num_steps: int,
                                    uniform_samples: torch.Tensor,
                                    uniform_samples_for_final_sampling: torch.Tensor,
                                    threshold_single: float = 1.0, threshold_acc: float = 1.0,
                                    max_children: Optional[int] = None) -> VerifyResult:
    """Vectorised :func:`specattn.ops.tree_speculative_sampling` with explicit coins.

    Args:
        candidates, retrive_index, retrive_next_token, retrive_next_sibling, num_steps: as
            :func:`verify_tree_greedy_torch`; ``candidates`` in ``[0, V)``.
        target_probs: float32 ``[bs, D, V]``, the target's law after each draft token (local
            draft index).
        uniform_samples: float32 ``[bs, D]`` in ``[0, 1]``, the coin at each draft token.
        uniform_samples_for_final_sampling: float32 ``[bs]`` in ``[0, 1]``.
        threshold_single, threshold_acc: floats in ``[0, 1]`` (``threshold_acc`` floored at
            1e-9 as the op).
        max_children: most children a node has (default ``D - 1``: any tree).  EAGLE trees
            have at most ``topk``; passing it shortens the per-level loop.
    Returns:
        :class:`specattn.ops.VerifyResult` as :func:`verify_tree_greedy_torch`.

    Method: per level, the children of each request's current node are tried in sibling
    order, ``max_children`` vectorised steps along the chains, with a float32 running sum of
    ``q[token]`` (bit-exact with the op's acceptance test).  The bonus token: the current
    node's row with the rejected children's tokens zeroed, clamped at 0, inverted with
    ``torch.cumsum`` + ``torch.searchsorted`` at ``coin * sum`` (``V - 1`` if none exceeds).
    """
    bs, D = candidates.shape
    V = target_probs.shape[2]
    dev = candidates.device
    f32 = torch.float32
    K = D - 1 if max_children is None else max_children
    ridx = retrive_index.long()
    cand = candidates.long()
    nxt = retrive_next_token.long()
    sib = retrive_next_sibling.long()
    probs = target_probs.reshape(bs * D, V)
    flat_probs = target_probs.reshape(-1)
    coins = uniform_samples.to(f32)
    th_single = torch.full((), float(threshold_single), dtype=f32, device=dev)
    # a device tensor: true division (a Python scalar divisor becomes a reciprocal multiply
    # on CUDA, which rounds differently from the op's division)
    th_acc = torch.full((), max(float(threshold_acc), 1e-9), dtype=f32, device=dev)
    bidx = torch.arange(bs, device=dev)
    acc, n_acc = _walk_outputs(bs, D, num_steps, ridx)
    node = torch.zeros(bs, dtype=torch.int64, device=dev)
    last = ridx[:, 0]
    active = torch.ones(bs, dtype=torch.bool, device=dev)
    rejected = torch.zeros(bs, D, dtype=torch.bool, device=dev)  # children of the final node
    predicts = torch.zeros(bs * D + 1, dtype=torch.int32, device=dev)  # last entry: dump
    for s in range(num_steps):
        coin = coins[bidx, node]
        row = (bidx * D + node) * V
        cur = torch.where(active, nxt[bidx, node], -1)
        prob_acc = torch.zeros(bs, dtype=f32, device=dev)
        hit = torch.full((bs,), -1, dtype=torch.int64, device=dev)
        rej = torch.zeros(bs, D + 1, dtype=torch.bool, device=dev)  # column D: dump
        for _ in range(K):
            valid = cur >= 0
            c = cur.clamp(min=0)
            q = flat_probs[row + cand[bidx, c]]
            prob_acc = prob_acc + q
            ok = valid & ((coin <= prob_acc / th_acc) | (q >= th_single))
            hit = torch.where(ok, c, hit)
            rej.scatter_(1, torch.where(valid & ~ok, c, D)[:, None], True)
            cur = torch.where(valid & ~ok, sib[bidx, c], -1)
        found = hit >= 0  # only active requests have children to try
        stops = active & ~found
        rejected = torch.where(stops[:, None], rej[:, :D], rejected)
        predicts.scatter_(0, torch.where(found, last, bs * D),
                          cand[bidx, hit.clamp(min=0)].to(torch.int32))
        node = torch.where(found, hit, node)
        last = torch.where(found, ridx[bidx, hit.clamp(min=0)], last)
        acc[:, s + 1] = torch.where(found, last, -1)
        n_acc += found
        active = found
    # bonus: relu(q - p) with p = q on the rejected children's tokens, inverted
    residual = probs[bidx * D + node]  # [bs, V] copy
    keep = torch.where(rejected, 0.0, 1.0).to(f32)  # x * 1 == x, x * 0 == 0: exact
    residual.scatter_reduce_(1, cand, keep, reduce="prod")
    residual.clamp_(min=0.0)
    cdf = torch.cumsum(residual, 1)
    u = uniform_samples_for_final_sampling.to(f32) * residual.sum(1)
    token = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp(max=V - 1)
    predicts.scatter_(0, last, token.to(torch.int32))
    return VerifyResult(predicts[:bs * D], acc.to(torch.int32), n_acc.to(torch.int32))


# ----------------------------------------------------------------------------- compaction
def compact_accepted_path_torch(accept_index: torch.Tensor, accept_length: torch.Tensor,
                                out_cache_loc: torch.Tensor, D: int,
                                predicts: Optional[torch.Tensor] = None,
                                hidden_states: Optional[torch.Tensor] = None) -> CompactedPath:
    """Vectorised :func:`specattn.ops.compact_accepted_path`: one gather index, then gathers.

    Args:
        accept_index: int32/int64 ``[bs, S]`` (path rows, then -1).
        accept_length: int32/int64 ``[bs]``, accepted drafts (excluding the bonus), at most
            ``min(S, D) - 1``.
        out_cache_loc: int32/int64 ``[bs * D]``, the verify forward's KV slots.
        D: ``num_draft_tokens``.
        predicts: optional int32/int64 ``[bs * D]``.  hidden_states: optional
            ``[bs * D, ...]``, any dtype.
    Returns:
        :class:`specattn.ops.CompactedPath` ``(src_index int64 [bs*D], predicts[src_index] or
        None, hidden_states[src_index] or None, out_cache_loc[src_index], tgt_loc (a copy of
        out_cache_loc), src_loc = out_cache_loc[src_index])``.
    """
    bs, S = accept_index.shape
    dev = accept_index.device
    n = min(S, D)
    src = torch.arange(bs * D, dtype=torch.int64, device=dev).view(bs, D)
    on_path = torch.arange(n, device=dev)[None, :] <= accept_length.long()[:, None]
    src[:, :n] = torch.where(on_path, accept_index[:, :n].long(), src[:, :n])
    src = src.flatten()
    loc = out_cache_loc[src]
    return CompactedPath(src_index=src,
                         predicts=None if predicts is None else predicts[src],
                         hidden_states=None if hidden_states is None else hidden_states[src],
                         out_cache_loc=loc, tgt_loc=out_cache_loc.clone(), src_loc=loc.clone())
