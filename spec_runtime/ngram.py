"""N-gram (prompt-lookup) drafting: drafts copied from the request's own history, no drafter.

Each round looks, on the device, for the earlier places where the request's latest tokens
occurred before (its prompt and everything it emitted) and proposes what followed them
there, as prompt-lookup decoding and SGLang's n-gram speculative decoding do; vLLM's suffix
decoding grows the same idea into a suffix tree.  Summaries, edits of a given text and code
that repeats identifiers are its workloads: their outputs copy spans of their inputs.

One round, per request (``P`` = target KV committed, ``root`` = last emitted token at
position ``P``, ``history[row, 0 .. P]`` = every token so far, root last):

1. match: for every earlier position ``j < P`` the length ``L[j] <= ngram_size`` of the
   common suffix of ``history[.. j]`` and ``history[.. P]`` (:func:`specattn.ops.ngram_candidates`:
   one Triton launch on a GPU, a few ``[bs, max_context]`` passes in the reference);
2. the ``topk`` best positions by ``(L, j)`` (longest match first, then the most recent)
   each propose the ``num_steps`` tokens that followed them (``history[j+1 ..]``; a position
   with no match, or a continuation running past ``P``, proposes the root as filler);
3. the tree: the root and ``topk`` chains of ``num_steps`` drafts hanging off it (a fixed
   shape: mask, depths and sibling links are built once); TARGET_VERIFY over its
   ``D = 1 + topk * num_steps`` tokens, verify, compaction + KV move, commit; the emitted
   tokens are appended to ``history``.  With ``SpecConfig.num_draft_tokens_by_batch`` a
   round over a large batch keeps fewer chains (its best matches), or none: then the round
   verifies the root alone, a decode step (the verify's tokens are nearly free at batch 1
   and what a large batch pays for).

Nothing serializes the round: the lookup is device work inside the round's CUDA graph.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Tuple

import torch

from specattn import ops
from specattn.backends import ForwardMode, pack_tree_mask

from .strategies import PrefillBatch, SpecConfig, Strategy

if TYPE_CHECKING:  # the engine imports this module
    from .engine import Engine, RoundBatch

__all__ = ["NgramStrategy", "chains_tree_shape"]


def chains_tree_shape(branches: int, depth: int, device=None) -> Tuple[torch.Tensor, ...]:
    """The fixed tree of a root with ``branches`` chains of ``depth`` drafts: node 0 is the
    root, node ``1 + k * depth + s`` is draft ``s`` (depth ``s + 1``) of chain ``k``
    (``branches = 0``: the root alone).

    Returns ``(tree_mask int32 [D, W], depth int64 [D], next_token int64 [D],
    next_sibling int64 [D])`` with ``D = 1 + branches * depth``, ``W = ceil(D / 32)``, in the
    layout :func:`specattn.ops.build_tree` produces per request (draft-local indices).

    Raises:
        ValueError: ``branches < 0`` or ``depth < 1``.
    """
    if branches < 0 or depth < 1:
        raise ValueError(f"need branches >= 0 and depth >= 1, got {branches}, {depth}")
    D = 1 + branches * depth
    node = torch.arange(D)
    k, s = (node - 1) // depth, (node - 1) % depth        # chain and depth - 1 of node >= 1
    dep = torch.where(node == 0, 0, s + 1)
    dense = torch.zeros(D, D, dtype=torch.bool)
    dense[:, 0] = True
    same = (k[:, None] == k[None, :]) & (s[None, :] <= s[:, None]) & (node[None, :] > 0) & (node[:, None] > 0)
    dense |= same
    nxt = torch.where((node > 0) & (s + 1 < depth), node + 1, -1)
    nxt[0] = 1 if D > 1 else -1
    sib = torch.where((node > 0) & (s == 0) & (k + 1 < branches), node + depth, -1)
    out = (pack_tree_mask(dense), dep, nxt, sib)
    return tuple(t.to(device) for t in out) if device is not None else out


class NgramStrategy(Strategy):
    """``algo="ngram"``: ``topk`` chains of ``num_steps`` drafts copied from the request's own
    history, matched on suffixes of up to ``ngram_size`` tokens (module docstring)."""

    name = "ngram"
    drafter = None

    def __init__(self, spec: SpecConfig):
        self.spec, self.S, self.n = spec, spec.num_steps, spec.ngram_size
        self.D = spec.max_num_draft_tokens()          # the largest; a round's own: chains_for
        self.K = (self.D - 1) // self.S
        self.verify_topk = self.K
        self.tokens_per_round = self.emit_width = self.D

    def chains_for(self, eng: "Engine", bs: int) -> int:
        """The chains of a round over ``bs`` request rows: ``topk``, or what
        ``spec.num_draft_tokens_for`` the padded batch (as the engine pads it for its graphs)
        leaves room for."""
        if not self.spec.num_draft_tokens_by_batch:
            return self.K
        return (self.spec.num_draft_tokens_for(self.padded_rows(eng, bs)) - 1) // self.S

    def round_modes(self):
        return [("target", ForwardMode.TARGET_VERIFY)]

    def graph_state_sizes(self, max_batch: int) -> Dict[str, Tuple[int, int]]:
        return {"target": (max_batch, max_batch * self.D)}

    def per_mode_graph_plan(self, eng: "Engine") -> list:
        if self.spec.num_draft_tokens_by_batch:   # a per-mode graph has one shape: the verify runs eagerly
            return []
        return [("target", eng.target, eng.target_backend, ForwardMode.TARGET_VERIFY, self.D, eng.max_batch)]

    def build(self, eng: "Engine") -> None:
        self.history = torch.zeros(eng.max_batch + 1, eng.max_context, dtype=torch.int64, device=eng.device)
        chains = {self.spec.topk} | {(d - 1) // self.S for _, d in self.spec.num_draft_tokens_by_batch}
        self.shapes = {k: chains_tree_shape(k, self.S, eng.device) for k in chains}   # per chain count

    def row_state(self) -> List[torch.Tensor]:
        return [self.history]

    def prefill(self, eng: "Engine", pb: "PrefillBatch") -> None:
        """The prompts and roots into ``history`` (device work: padding tokens write the
        dummy row)."""
        h = self.history
        h.index_fill_(0, pb.rows, 0)      # (a kernel: no host scalar copy inside a capture)
        h[pb.token_rows, pb.batch.positions] = pb.ids.to(h.dtype)
        h[pb.rows, pb.batch.extend_lens.long()] = eng.roots[pb.rows].to(h.dtype)

    def round(self, eng: "Engine", rb: "RoundBatch") -> None:
        S, dev = self.S, eng.device
        rows = rb.rows
        bs = rows.shape[0]
        K = self.chains_for(eng, bs)
        D = 1 + K * S
        # P, the verify's slots req_to_token[row, P + j] and the roots, in one launch
        loc = ops.extend_cache_locs(rows, eng.prefix_lens, eng.req_pool.req_to_token, D, roots=eng.roots,
                                    check_values=False)
        P, out_cache_loc, roots = loc.seq_lens, loc.out_cache_loc, loc.input_ids[:, :1]
        if K:
            drafts, _ = ops.ngram_candidates(self.history[rows], P, self.n, K, S, check_values=False)
            draft_tokens = torch.cat([roots, drafts.flatten(1)], 1)     # [bs, D]
        else:   # no chain: the root alone, a decode step through the verify path
            draft_tokens = roots
        j = eng.arange(D)
        # the tree's value-independent fields are the same every round: kept engine constants
        one = self.shapes[K]
        shape = eng.constant(("ngram_tree", bs, K, S), lambda: (
            one[0].expand(bs, D, one[0].shape[-1]).contiguous(),
            (torch.arange(bs, device=dev)[:, None] * D + torch.arange(D, device=dev)),
            one[2].expand(bs, D).contiguous(), one[3].expand(bs, D).contiguous()))
        tree = ops.TreeInfo(shape[0], (P[:, None] + one[1][None, :]).flatten(), shape[1], shape[2], shape[3])
        batch = eng.batch(ForwardMode.TARGET_VERIFY, rows, P, D, out_cache_loc, positions=tree.positions,
                          tree_mask=tree.tree_mask, host_prefix_lens=rb.host())
        t = eng.forward("target", draft_tokens.flatten(), batch, top_k=eng.greedy_top_k)
        cp, n_acc = eng.verify_and_compact(draft_tokens, tree, t, S, out_cache_loc, chain=K <= 1)
        path = cp.predicts.view(bs, D).long()
        # every emitted token joins the history (positions past the new root are rewritten later)
        self.history[rows[:, None], P[:, None] + 1 + j] = path
        eng.commit(rb, rows, P, path, n_acc)
