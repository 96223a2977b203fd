"""DDTree draft-tree candidates from a block drafter's per-position top-k: :func:`ddtree_candidates`.

A DFlash block forward predicts every block position independently of the others, so a path's
probability is the product of its positions' probabilities.  DDTree (Ringel and Romano,
"Accelerating Speculative Decoding with Block Diffusion Draft Trees", 2025) verifies the tree of
the most probable paths, built from each position's top-k, instead of the single argmax chain.
Here the candidates grow level by level as EAGLE grows its tree: level 0 holds the ``K`` best
tokens of position 1; level ``s`` extends each of the ``K`` best paths of level ``s - 1``
(the beams) by the ``K`` best tokens of position ``s + 1`` (score: the summed
log-probability), and its ``K`` best become the next beams.  :func:`specattn.ops.build_tree`
then keeps the ``num_draft_tokens - 1`` best candidates (a node's score never exceeds its
parent's, so but for exact ties the kept set holds every kept node's parent).  Keeping ``K``
beams per level is EAGLE's rule; the exact best-``N`` tree would keep up to ``N`` per level.

The candidates use EAGLE's numbering (:mod:`specattn.ops.eagle_draft`): the root's ``K``
children first, then one block of ``K * K`` per level (lane ``j * K + i``: beam ``j``, token
``i``), and ``parent_list`` holds ``-1`` (the root), ``0 .. K-1`` (level 0's candidates), then
per level ``s`` in ``1 .. S-2`` the candidate columns of its ``K`` beams.  Beams rank by score
and, among equal scores, by the lower candidate column (the order of
:func:`specattn.ops.topk.order_keys`), so the implementations agree exactly.

Implementations (registry op ``"ddtree_candidates"``, each taking the reference's arguments):

- ``reference``: per level an add and a ``topk`` in PyTorch (:func:`ddtree_candidates_reference`);
- ``triton``: one launch, one program per request, every level in register vectors
  (:mod:`specattn.triton_kernels.ddtree`).

``impl="auto"`` takes Triton for CUDA tensors when Triton imports, else the reference.  No
value is used as an index and nothing syncs with the host: CUDA-graph capturable.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import registry
from .checks import INDEX_DTYPES, check_tensor
from .topk import order_keys

__all__ = ["ddtree_candidates", "ddtree_candidates_reference", "MAX_TOPK"]

MAX_TOPK = 8   # K * K <= 64 lanes per level: one program's register vectors


def ddtree_candidates_reference(vals: torch.Tensor, toks: torch.Tensor,
                                depth_weights: Optional[torch.Tensor] = None
                                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch :func:`ddtree_candidates` (no validation)."""
    bs, S, K = vals.shape
    dev = vals.device
    if depth_weights is not None:
        vals = vals * depth_weights[None, :, None]
    toks = toks.long()
    beam = vals[:, 0]
    scores, tokens = [beam], [toks[:, 0]]
    parents = [torch.full((bs, 1), -1, dtype=torch.int64, device=dev)]
    if S > 1:
        parents.append(torch.arange(K, device=dev).expand(bs, K))
    for s in range(1, S):
        child = (beam[:, :, None] + vals[:, s][:, None, :]).flatten(1)          # [bs, K * K]
        scores.append(child)
        tokens.append(toks[:, s][:, None, :].expand(bs, K, K).flatten(1))
        if s < S - 1:
            best = order_keys(child).topk(K, dim=-1).indices
            beam = child.gather(1, best)
            parents.append(K + (s - 1) * K * K + best)
    return torch.cat(parents, 1), torch.cat(scores, 1), torch.cat(tokens, 1)


registry.register("ddtree_candidates", "reference", lambda: ddtree_candidates_reference)
registry.register("ddtree_candidates", "triton",
                  registry.from_module("specattn.triton_kernels.ddtree", "ddtree_candidates", "Triton"))


def ddtree_candidates(vals: torch.Tensor, toks: torch.Tensor, *,
                      depth_weights: Optional[torch.Tensor] = None, impl: str = "auto"
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DDTree's candidate nodes, in the layout :func:`specattn.ops.build_tree` reads
    (module docstring; source: Ringel and Romano's DDTree construction, with EAGLE's beam rule).

    Args:
        vals: float32 ``[bs, S, K]``: the ``K`` largest log-probabilities of block positions
            ``1 .. S`` (``S >= 1``, ``1 <= K <= 8``), largest first
            (:func:`specattn.ops.topk_log_probs` of the block's logits).
        toks: int64 / int32 ``[bs, S, K]``: their tokens.
        depth_weights: optional float32 ``[S]`` on ``vals``' device: position ``s + 1``'s
            log-probabilities are multiplied by ``depth_weights[s]`` before they are summed
            (one float32 product per value, the same in both implementations).  Weights below
            1 at deeper positions favour depth; non-increasing positive weights keep every
            node's score at or below its parent's.  ``None``: all 1.
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        ``(parent_list int64 [bs, K * (S - 1) + 1], scores float32 [bs, n_cand], tokens int64
        [bs, n_cand])`` with ``n_cand = K + (S - 1) * K * K``: ``build_tree``'s
        ``parent_list`` for ``topk = K``, ``num_steps = S``, and every candidate's summed
        log-probability and token (the ``num_draft_tokens - 1`` best are the tree).  Device
        work only.

    Raises:
        TypeError: a non-tensor argument.  ValueError: wrong ranks, shapes, dtypes or devices,
        ``S == 0``, ``K`` outside ``[1, 8]``, ``depth_weights`` not float32 ``[S]`` on
        ``vals``' device.  RuntimeError: a forced ``impl`` unavailable here.
    """
    check_tensor("vals", vals, dim=3, dtypes=(torch.float32,))
    check_tensor("toks", toks, dtypes=INDEX_DTYPES, device=vals.device, shape=tuple(vals.shape))
    bs, S, K = vals.shape
    if depth_weights is not None:
        check_tensor("depth_weights", depth_weights, dtypes=(torch.float32,), device=vals.device, shape=(S,))
    if S < 1:
        raise ValueError(f"vals must hold at least one block position, got {list(vals.shape)}")
    if not 1 <= K <= MAX_TOPK:
        raise ValueError(f"K (the last dim) must be in [1, {MAX_TOPK}], got {K}")
    fn = registry.dispatch("ddtree_candidates", impl, vals.device)
    return fn(vals, toks, depth_weights)
