"""Building the EAGLE draft tree: SGLang's ``build_tree_kernel_efficient`` in plain PyTorch.

Source of the semantics: ``sgl-kernel/csrc/speculative/eagle_utils.cu`` (kernels
``build_tree_efficient`` / ``build_tree_efficient_partial_packed``) and its callers in
``python/sglang/srt/speculative/eagle_utils.py`` / ``build_eagle_tree.py``
(``build_tree_kernel_efficient``, ``build_tree_kernel_efficient_preprocess`` /
``organize_draft_results``).  Written from those semantics, not from their code.

How EAGLE's top-k drafting numbers its candidates (SGLang)
---------------------------------------------------------
Drafting runs ``num_steps`` steps (SGLang: ``spec_steps`` / ``depth``) with ``topk`` beams:

- step 0 scores ``topk`` children of the root: *flat indices* ``0 .. topk-1``;
- step ``s >= 1`` expands each of the ``topk`` beams kept after step ``s-1`` into ``topk``
  children: flat indices ``topk + (s-1)*topk^2 + r*topk + c`` for beam ``r``, child ``c``.

So there are ``topk + (num_steps-1)*topk^2`` candidates per request, and a candidate with
flat index ``f`` hangs off *beam* ``f // topk`` (beam 0 = the root).

- ``parent_list[b, beam]`` (``beam >= 1``) is the flat index of the candidate that beam
  ``beam`` continues: SGLang builds it as ``cat(parents_list[:-1], dim=1)``, whose first block
  is ``[-1, 0, 1, .., topk-1]`` and whose block ``s`` (``s >= 1``) holds the ``topk`` flat
  indices chosen at step ``s``.  Width ``topk*(num_steps-1) + 1``; column 0 is never read.
- ``selected_index[b]`` (SGLang's ``top_scores_index``) lists the flat indices of the
  ``num_draft_tokens - 1`` candidates kept for verification (SGLang: ``topk`` of the scores
  over all candidates, then sorted ascending, hence parents before children).
- Draft token ``j >= 1`` of request ``b`` is candidate ``selected_index[b, j-1]``; draft token
  0 is the root (the last verified token, SGLang's ``verified_id``).  SGLang's
  ``draft_tokens`` are ``cat(verified_id[:, None], gather(token_list, selected_index))``.
- The parent of draft token ``j`` is the root when ``selected_index[b, j-1] // topk == 0``,
  else the draft token whose candidate is ``parent_list[b, selected_index[b, j-1] // topk]``.

A *missing parent*: that parent candidate was not selected (SGLang prints "invalid eagle
tree ... check if the logprob has nan" and goes on).  SGLang then leaves the token out of its
parent's child list, so verification never reaches it nor anything below it; we do the same.
SGLang's mask/position walk for such a token runs past the request's row (out of bounds), so
its values there are undefined; ours stop the walk at the orphan: its mask row is
``{root, itself}`` and its position ``verified_seq_len + 1`` (its descendants count from it).
Those tokens are never accepted, so their values only have to be safe.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import registry
from .checks import INDEX_DTYPES, capturing, check_index_range, check_tensor
from .tree_mask import flashinfer_mask_bytes, num_mask_words, pack_tree_mask, tree_mask_to_flashinfer

__all__ = ["TreeInfo", "build_tree", "build_tree_reference", "num_tree_candidates",
           "flashinfer_mask_bytes", "CUDA_MAX_DRAFT_TOKENS"]

# Largest num_draft_tokens the CUDA build_tree kernel supports (csrc/tree_ops.cu kBuildMaxD:
# one block per request, mask rows in shared memory).  Beyond it impl="auto" uses Triton
# (or the reference) and impl="cuda" raises ValueError.
CUDA_MAX_DRAFT_TOKENS = 512


class TreeInfo(NamedTuple):
    """Outputs of :func:`build_tree` (see its docstring)."""

    tree_mask: torch.Tensor
    positions: torch.Tensor
    retrive_index: torch.Tensor
    retrive_next_token: torch.Tensor
    retrive_next_sibling: torch.Tensor


def num_tree_candidates(topk: int, num_steps: int) -> int:
    """Candidates EAGLE drafting scores per request: ``topk + (num_steps - 1) * topk**2``."""
    return topk + (num_steps - 1) * topk * topk


def _parents(parent_list: list, selected: list, topk: int, num_draft_tokens: int) -> list:
    """Parent draft index of every draft token of one request: ``None`` for the root and for
    a token whose parent candidate was not selected."""
    draft_of_candidate = {f: j + 1 for j, f in enumerate(selected)}
    parent = [None] * num_draft_tokens
    for j in range(1, num_draft_tokens):
        beam = selected[j - 1] // topk
        parent[j] = 0 if beam == 0 else draft_of_candidate.get(parent_list[beam])
    return parent


def build_tree_reference(parent_list: torch.Tensor, selected_index: torch.Tensor,
                         verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                         positions: torch.Tensor, retrive_index: torch.Tensor,
                         retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                         topk: int, num_steps: int, num_draft_tokens: int,
                         flashinfer_packed_mask: Optional[torch.Tensor] = None,
                         flashinfer_mask_indptr: Optional[torch.Tensor] = None) -> None:
    """Plain-PyTorch reference of :func:`build_tree`: inputs already validated; writes every
    element of the five outputs in place (argument order as SGLang's
    ``build_tree_kernel_efficient`` op, without ``tree_mask_mode``), and, when given, request
    ``b``'s segment ``[indptr[b], indptr[b] + ceil(D*(P_b+D)/8))`` of
    ``flashinfer_packed_mask`` (:func:`specattn.ops.tree_mask.tree_mask_to_flashinfer`
    of the tree mask with ``P_b = verified_seq_len[b]``); no other byte of it."""
    bs, D = selected_index.shape[0], num_draft_tokens
    dense = torch.zeros(bs, D, D, dtype=torch.bool)
    pos = torch.empty(bs, D, dtype=torch.int64)
    nxt = torch.full((bs, D), -1, dtype=torch.int64)
    sib = torch.full((bs, D), -1, dtype=torch.int64)
    for b in range(bs):
        parent = _parents(parent_list[b].tolist(), selected_index[b].tolist(), topk, D)
        prefix = int(verified_seq_len[b])
        for j in range(D):
            dense[b, j, 0] = True  # every draft token sees the root
            k, depth = j, 0
            while k is not None and k != 0:  # itself, then its ancestors, up to the root
                dense[b, j, k] = True
                depth += 1
                k = parent[k]
            pos[b, j] = prefix + depth
        last_child = [None] * D
        for j in range(1, D):  # ascending j: child lists come out in ascending order
            p = parent[j]
            if p is None:
                continue  # missing parent: unreachable from the root (as SGLang)
            if last_child[p] is None:
                nxt[b, p] = j
            else:
                sib[b, last_child[p]] = j
            last_child[p] = j
    dev = tree_mask.device
    tree_mask.copy_(pack_tree_mask(dense.to(dev)))
    positions.copy_(pos.flatten().to(dev))
    retrive_index.copy_(torch.arange(bs * D, dtype=torch.int64, device=dev).view(bs, D))
    retrive_next_token.copy_(nxt.to(dev))
    retrive_next_sibling.copy_(sib.to(dev))
    if flashinfer_packed_mask is not None:
        packed, seg = tree_mask_to_flashinfer(tree_mask.contiguous(), verified_seq_len.cpu())
        seg, starts = seg.tolist(), flashinfer_mask_indptr.tolist()
        for b in range(bs):
            n = seg[b + 1] - seg[b]
            flashinfer_packed_mask[starts[b]:starts[b] + n].copy_(packed[seg[b]:seg[b + 1]])


registry.register("build_tree", "reference", lambda: build_tree_reference)


registry.register("build_tree", "triton",
                  registry.from_module("specattn.triton_kernels.tree_ops", "build_tree", "triton"))
registry.register("build_tree", "cuda", registry.from_ext("build_tree"))


def _check_int(name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")


def build_tree(parent_list: torch.Tensor, selected_index: torch.Tensor,
               verified_seq_len: torch.Tensor, topk: int, num_steps: int, num_draft_tokens: int,
               *, flashinfer_packed_mask: Optional[torch.Tensor] = None,
               flashinfer_mask_indptr: Optional[torch.Tensor] = None,
               impl: str = "auto") -> TreeInfo:
    """Tree mask, positions and traversal links of each request's EAGLE draft tree.

    Semantics of SGLang's ``build_tree_kernel_efficient`` (``sgl-kernel/csrc/speculative/
    eagle_utils.cu``; see the module docstring for how ``parent_list`` / ``selected_index``
    encode the tree and what happens to a draft whose parent is missing).

    Args:
        parent_list: int32/int64 ``[bs, topk*(num_steps-1) + 1]``: flat candidate index that
            each beam continues (column 0 unused; SGLang puts -1 there).
        selected_index: int32/int64 ``[bs, num_draft_tokens - 1]``: flat candidate index of
            draft tokens ``1 .. D-1`` (SGLang's ``top_scores_index``), distinct per request.
        verified_seq_len: int32/int64 ``[bs]``, tokens: KV committed before the verify
            forward, *excluding* the root.  It is SGLang's ``batch.seq_lens`` at verify time
            (SGLang writes the D verify tokens at ``req_to_token[prefix_lens : prefix_lens + D]``)
            and our ``ForwardBatch.prefix_lens`` for TARGET_VERIFY: the root sits at position
            ``verified_seq_len``.
        topk: beams per step (>= 1).  num_steps: drafting steps, SGLang's ``spec_steps`` /
            ``depth`` (>= 1).  num_draft_tokens: ``D``, tokens verified per request including
            the root (>= 1, at most ``1 + topk + (num_steps-1)*topk**2``; the CUDA kernel
            supports at most :data:`CUDA_MAX_DRAFT_TOKENS` = 512, beyond which ``"auto"``
            uses Triton).
        flashinfer_packed_mask: optional contiguous uint8 1-D buffer on the inputs' device,
            written in place: FlashInfer's packed custom mask for
            ``BatchPrefillWithPagedKVCacheWrapper.plan`` (the result of
            :func:`specattn.ops.tree_mask.tree_mask_to_flashinfer` of ``tree_mask`` with
            ``prefix_lens = verified_seq_len``), built in the same launch.  Request ``b``'s
            segment is bytes ``[indptr[b], indptr[b+1])``: ``ceil(D*(P_b+D)/8)`` bytes with
            ``P_b = verified_seq_len[b]``, the row-major ``[D, P_b + D]`` bit matrix (``P_b``
            prefix columns all ones, then row ``j`` of the tree mask), little-endian bit
            order (element ``8i + t`` is bit ``t`` of byte ``i``), padding bits 0.  Bytes
            outside the segments are not touched.
        flashinfer_mask_indptr: int32 ``[bs + 1]`` on the inputs' device, given exactly when
            ``flashinfer_packed_mask`` is: ``indptr[0] = 0``, ``indptr[b+1] - indptr[b] =
            ceil(D*(P_b+D)/8)`` (:func:`flashinfer_mask_bytes`), ``indptr[bs] <=
            flashinfer_packed_mask.numel()``.  The same tensor can be passed to FlashInfer.
        impl: ``"auto"`` | ``"cuda"`` | ``"triton"`` | ``"reference"``.
    Returns:
        :class:`TreeInfo` on the inputs' device, every element written:

        - ``tree_mask``: int32 ``[bs, D, ceil(D/32)]``, our encoding
          (:mod:`specattn.ops.tree_mask`): bit ``k`` of row ``j`` set when draft token
          ``j`` may see draft token ``k``: the root, its ancestors and itself.  The prefix is
          always visible and not in the mask.  These bits equal the draft part of SGLang's
          masks: columns ``seq_len .. seq_len+D-1`` of a FULL_MASK row, the row of QLEN_ONLY,
          and (for ``D <= 32``) the little-endian bytes of QLEN_ONLY_BITPACKING.
        - ``positions``: int64 ``[bs * D]`` (request-major, as ``ForwardBatch.positions``):
          ``verified_seq_len[b] + depth(j)``, depth 0 for the root, 1 for its children...
        - ``retrive_index``: int64 ``[bs, D]``, ``b * D + j``: draft token ``j``'s row in the
          flat ``[bs * D]`` verify outputs (logits, ``predicts``, ``out_cache_loc``).
        - ``retrive_next_token``: int64 ``[bs, D]``: the first child (smallest draft index)
          of draft token ``j``, ``-1`` for a leaf.
        - ``retrive_next_sibling``: int64 ``[bs, D]``: the next child (next larger draft
          index) of ``j``'s parent, ``-1`` for the last one.  Draft tokens with a missing
          parent appear in no child list.

        The FlashInfer mask, when requested, is written into ``flashinfer_packed_mask``
        (it is not part of the returned tuple).
    Raises:
        TypeError / ValueError: non-int sizes, sizes out of range, wrong rank / dtype / shape,
            mismatched devices or batch sizes, a repeated ``selected_index`` in a request, a
            negative ``verified_seq_len``, a ``parent_list`` entry (columns >= 1) that is not
            a flat index of the step before its beam's (entries of block ``s`` must lie in
            step ``s``'s range; this also rules out cycles).
        IndexError: a ``selected_index`` outside ``[0, topk + (num_steps-1)*topk**2)``.
        ValueError (FlashInfer mask): only one of ``flashinfer_packed_mask`` /
            ``flashinfer_mask_indptr`` given; wrong dtype / rank / shape / device, a
            non-contiguous buffer; ``indptr[0] != 0``, a segment length other than
            ``ceil(D*(P_b+D)/8)``, or a buffer shorter than ``indptr[bs]``.
        ValueError: ``impl="cuda"`` with ``num_draft_tokens > CUDA_MAX_DRAFT_TOKENS``.
        Value checks cost host syncs and are skipped during CUDA-graph capture (the kernels
        then never write outside the buffer, but a wrong ``indptr`` gives a wrong mask).
    """
    _check_int("topk", topk, 1)
    _check_int("num_steps", num_steps, 1)
    _check_int("num_draft_tokens", num_draft_tokens, 1)
    n_cand = num_tree_candidates(topk, num_steps)
    if num_draft_tokens - 1 > n_cand:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} needs {num_draft_tokens - 1} "
                         f"candidates but topk={topk}, num_steps={num_steps} draft only {n_cand}")
    check_tensor("verified_seq_len", verified_seq_len, dim=1, dtypes=INDEX_DTYPES)
    bs, dev, D = verified_seq_len.shape[0], verified_seq_len.device, num_draft_tokens
    width = topk * (num_steps - 1) + 1
    check_tensor("parent_list", parent_list, dtypes=INDEX_DTYPES, device=dev, shape=(bs, width))
    check_tensor("selected_index", selected_index, dtypes=INDEX_DTYPES, device=dev,
                 shape=(bs, D - 1))
    if not capturing() and bs > 0:
        if int(verified_seq_len.min()) < 0:
            raise ValueError("verified_seq_len has a negative length")
        check_index_range("selected_index", selected_index, n_cand)
        if D > 2:
            s = selected_index.sort(dim=1).values
            if bool((s[:, 1:] == s[:, :-1]).any()):
                raise ValueError("selected_index repeats a candidate within a request")
        if width > 1:
            step = torch.arange(width - 1, device=dev) // topk  # beam 1.. continues a step-s pick
            lo = torch.where(step == 0, 0, topk + (step - 1) * topk * topk)
            hi = topk + step * topk * topk
            cols = parent_list[:, 1:]
            bad = (cols < lo) | (cols >= hi)
            if bool(bad.any()):
                b, c = (int(x) for x in bad.nonzero()[0])
                raise ValueError(
                    f"parent_list[{b}, {c + 1}] = {int(cols[b, c])} is not a step-{int(step[c])} "
                    f"candidate (flat index in [{int(lo[c])}, {int(hi[c])}))")
    fi_mask, fi_indptr = flashinfer_packed_mask, flashinfer_mask_indptr
    if (fi_mask is None) != (fi_indptr is None):
        raise ValueError("pass both flashinfer_packed_mask and flashinfer_mask_indptr, or neither")
    if fi_mask is not None:
        check_tensor("flashinfer_packed_mask", fi_mask, dim=1, dtypes=(torch.uint8,), device=dev)
        if not fi_mask.is_contiguous():
            raise ValueError("flashinfer_packed_mask must be contiguous")
        check_tensor("flashinfer_mask_indptr", fi_indptr, dtypes=(torch.int32,), device=dev,
                     shape=(bs + 1,))
        if not capturing():
            ip = fi_indptr.long()
            if int(ip[0]) != 0:
                raise ValueError(f"flashinfer_mask_indptr[0] must be 0, got {int(ip[0])}")
            if bs > 0:
                want = flashinfer_mask_bytes(verified_seq_len, D)
                bad = (ip[1:] - ip[:-1]) != want
                if bool(bad.any()):
                    b = int(bad.nonzero()[0])
                    raise ValueError(
                        f"flashinfer_mask_indptr: request {b} has a segment of "
                        f"{int(ip[b + 1] - ip[b])} bytes, expected ceil(D*(P+D)/8) = "
                        f"{int(want[b])} (D = {D}, P = verified_seq_len[{b}] = "
                        f"{int(verified_seq_len[b])})")
                if int(ip[-1]) > fi_mask.numel():
                    raise ValueError(f"flashinfer_packed_mask has {fi_mask.numel()} bytes, "
                                     f"flashinfer_mask_indptr needs {int(ip[-1])}")
    if D > CUDA_MAX_DRAFT_TOKENS:
        if impl == "cuda":
            raise ValueError(f"the CUDA build_tree supports num_draft_tokens <= "
                             f"{CUDA_MAX_DRAFT_TOKENS}, got {D} (use impl='triton' or 'reference')")
        if impl == "auto" and dev.type == "cuda":
            has_triton = registry.availability("build_tree")["triton"] is None
            impl = "triton" if has_triton else "reference"
    W = num_mask_words(D)
    out = TreeInfo(
        tree_mask=torch.empty(bs, D, W, dtype=torch.int32, device=dev),
        positions=torch.empty(bs * D, dtype=torch.int64, device=dev),
        retrive_index=torch.empty(bs, D, dtype=torch.int64, device=dev),
        retrive_next_token=torch.empty(bs, D, dtype=torch.int64, device=dev),
        retrive_next_sibling=torch.empty(bs, D, dtype=torch.int64, device=dev))
    if bs == 0:
        return out
    registry.dispatch("build_tree", impl, dev)(
        parent_list, selected_index, verified_seq_len, *out, topk, num_steps, D, fi_mask,
        fi_indptr)
    return out
