"""Compacting the accepted path of each request to the front of its verify block.

After TARGET_VERIFY, request ``b`` owns ``D = num_draft_tokens`` consecutive rows
``b*D .. b*D + D-1`` of the flat per-token arrays (``predicts``, the target's hidden states,
``out_cache_loc``), in tree order.  The accepted path (root + ``accept_length[b]`` drafts, rows
``accept_index[b, :accept_length[b] + 1]``) is scattered over that block.  The next steps
want it at the block's front, in path order:

- the drafter's DRAFT_EXTEND_V2 forward runs row ``b*D + k`` at position ``seq_len + k`` with
  the token ``predicts[accept_index[b, k]]`` and the target hidden state
  ``hidden_states[accept_index[b, k]]`` (EAGLE pairs the target's feature at a token with
  the next token);
- the target's KV of path token ``k`` must sit in slot ``out_cache_loc[b*D + k]``, i.e.
  ``req_to_token[r, seq_len + k]``, so that committing ``seq_len += accept_length + 1`` is
  right.  SGLang spec v2 (``eagle_info_v2.py``, ``move_accepted_tokens_to_target_kvcache``)
  moves the KV from ``out_cache_loc[accept_index[b, k]]`` to those slots with the pool's
  ``move_kv_cache``; this op returns the same pairs for :func:`specattn.ops.move_kv_cache`.

One gather index does all of it: ``src_index[b*D + k] = accept_index[b, k]`` for
``k <= accept_length[b]`` and ``b*D + k`` (the row itself) for the rest of the block.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import registry
from .checks import INDEX_DTYPES, capturing, check_tensor

__all__ = ["CompactedPath", "compact_accepted_path", "compact_accepted_path_reference"]


class CompactedPath(NamedTuple):
    """Outputs of :func:`compact_accepted_path` (see its docstring)."""

    src_index: torch.Tensor
    predicts: Optional[torch.Tensor]
    hidden_states: Optional[torch.Tensor]
    out_cache_loc: torch.Tensor
    tgt_loc: torch.Tensor
    src_loc: torch.Tensor


def compact_accepted_path_reference(accept_index, accept_length, out_cache_loc, predicts,
                                    hidden_states, src_index, predicts_out, hidden_states_out,
                                    out_cache_loc_out, tgt_loc, src_loc) -> None:
    """Plain-PyTorch reference of :func:`compact_accepted_path`: inputs already validated
    (``predicts`` / ``hidden_states`` and their outputs may be None); writes every element of
    the outputs in place."""
    bs = accept_index.shape[0]
    D = out_cache_loc.shape[0] // bs
    index = torch.arange(bs * D, dtype=torch.int64).view(bs, D)
    for b in range(bs):
        n = int(accept_length[b]) + 1  # root + accepted drafts
        index[b, :n] = accept_index[b, :n].cpu().long()
    index = index.flatten().to(out_cache_loc.device)
    src_index.copy_(index)
    if predicts is not None:
        predicts_out.copy_(predicts[index])
    if hidden_states is not None:
        hidden_states_out.copy_(hidden_states[index])
    out_cache_loc_out.copy_(out_cache_loc[index])
    tgt_loc.copy_(out_cache_loc)
    src_loc.copy_(out_cache_loc[index])


registry.register("compact_accepted_path", "reference", lambda: compact_accepted_path_reference)


registry.register("compact_accepted_path", "triton",
                  registry.from_module("specattn.triton_kernels.tree_ops", "compact_accepted_path", "triton"))
registry.register("compact_accepted_path", "cuda", registry.from_ext("compact_accepted_path"))


def compact_accepted_path(accept_index: torch.Tensor, accept_length: torch.Tensor,
                          out_cache_loc: torch.Tensor, num_draft_tokens: int, *,
                          predicts: Optional[torch.Tensor] = None,
                          hidden_states: Optional[torch.Tensor] = None,
                          impl: str = "auto") -> CompactedPath:
    """Move each request's accepted path to the front of its ``D``-row block.

    Args:
        accept_index: int32/int64 ``[bs, S]`` from :func:`specattn.ops.verify_tree_greedy` /
            :func:`specattn.ops.tree_speculative_sampling`: for ``k <= accept_length[b]`` a
            row of request ``b``'s own block ``[b*D, b*D + D)``, after that ``-1``.
        accept_length: int32/int64 ``[bs]``: accepted **draft** tokens, excluding the bonus
            (the verify ops' convention, SGLang's kernel ``accept_token_num``; SGLang spec-v2's
            ``sample()`` returns this + 1).  In ``[0, min(S, D) - 1]``.
        out_cache_loc: int32/int64 ``[bs * D]``: the verify forward's KV slots (tree order).
        num_draft_tokens: ``D`` (>= 1), tokens per request in the verify forward.
        predicts: optional ``[bs * D]`` (int32/int64) from the verify op.
        hidden_states: optional ``[bs * D, ...]`` (any real dtype): the target's per-token hidden
            states from the verify forward.
        impl: ``"auto"`` | ``"cuda"`` | ``"triton"`` | ``"reference"``.
    Returns:
        :class:`CompactedPath`, all on ``out_cache_loc``'s device, every element written;
        ``n_b = accept_length[b] + 1``:

        - ``src_index``: int64 ``[bs * D]``: ``accept_index[b, k]`` at ``b*D + k`` for
          ``k < n_b``, else ``b*D + k``.  Every other output is a gather with it.
        - ``predicts``: ``predicts[src_index]`` (None if not given): the block's first
          ``n_b`` rows are the emitted tokens in order, the last one the bonus (the next
          root, SGLang's new ``verified_id``).
        - ``hidden_states``: ``hidden_states[src_index]`` (None if not given).
        - ``out_cache_loc``: ``out_cache_loc[src_index]``: the slot that *now* holds each
          compacted token's KV.  Use it to re-point ``req_to_token[r, seq_len + k]`` instead
          of moving KV (SGLang v1 style); equal in value to ``src_loc``.
        - ``tgt_loc``, ``src_loc``: int-like ``[bs * D]`` (``out_cache_loc``'s dtype) slot
          pairs for :func:`specattn.ops.move_kv_cache` (SGLang v2 style): ``tgt_loc`` is the
          input ``out_cache_loc`` (a copy), ``src_loc = out_cache_loc[src_index]``.  After
          ``move_kv_cache(buffers, tgt_loc, src_loc)``, slot ``out_cache_loc[b*D + k]``
          holds the KV of path token ``k`` for ``k < n_b``; rows ``k >= n_b`` are identity
          pairs (slot unchanged), so the pair count is static (``bs * D``, CUDA-graph
          friendly).  ``tgt_loc`` repeats a slot only where ``out_cache_loc`` does (e.g.
          padded requests all on slot 0: identity pairs, which ``move_kv_cache`` accepts;
          it refuses only a slot that a real move writes and that is repeated or kept).
    Raises:
        TypeError / ValueError: wrong types, ranks, dtypes, shapes or devices; an
            ``accept_index`` entry outside its request's block for ``k < n_b`` or not -1
            after; ``accept_length`` out of range.  Value checks cost a host sync and are
            skipped during CUDA-graph capture.
    """
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
        raise TypeError(f"num_draft_tokens must be an int, got {type(num_draft_tokens).__name__}")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    D = num_draft_tokens
    check_tensor("accept_index", accept_index, dim=2, dtypes=INDEX_DTYPES)
    bs, S = accept_index.shape
    dev = accept_index.device
    if S < 1:
        raise ValueError("accept_index must have at least one column (the root)")
    check_tensor("accept_length", accept_length, dtypes=INDEX_DTYPES, device=dev, shape=(bs,))
    check_tensor("out_cache_loc", out_cache_loc, dtypes=INDEX_DTYPES, device=dev, shape=(bs * D,))
    if predicts is not None:
        check_tensor("predicts", predicts, dtypes=INDEX_DTYPES, device=dev, shape=(bs * D,))
    if hidden_states is not None:
        check_tensor("hidden_states", hidden_states, device=dev)
        if hidden_states.is_complex():
            raise ValueError(f"hidden_states must have a real dtype, got {hidden_states.dtype}")
        if hidden_states.dim() < 1 or hidden_states.shape[0] != bs * D:
            raise ValueError(f"hidden_states must be [{bs * D}, ...], "
                             f"got {list(hidden_states.shape)}")
    if not capturing() and bs > 0:
        lo, hi = int(accept_length.min()), int(accept_length.max())
        if lo < 0 or hi > min(S, D) - 1:
            raise ValueError(f"accept_length has values in [{lo}, {hi}], outside "
                             f"[0, {min(S, D) - 1}] (accept_index has {S} columns, D = {D})")
        k = torch.arange(S, device=dev)
        on_path = k[None, :] <= accept_length[:, None].long()
        start = (torch.arange(bs, device=dev) * D)[:, None]
        ai = accept_index.long()
        ok = torch.where(on_path, (ai >= start) & (ai < start + D), ai == -1)
        if not bool(ok.all()):
            b, c = (int(x) for x in (~ok).nonzero()[0])
            want = f"in [{b * D}, {b * D + D})" if bool(on_path[b, c]) else "-1"
            raise ValueError(f"accept_index[{b}, {c}] = {int(accept_index[b, c])}, expected {want} "
                             f"(accept_length[{b}] = {int(accept_length[b])})")
    out = CompactedPath(
        src_index=torch.empty(bs * D, dtype=torch.int64, device=dev),
        predicts=None if predicts is None else torch.empty_like(predicts),
        hidden_states=None if hidden_states is None else torch.empty_like(hidden_states),
        out_cache_loc=torch.empty_like(out_cache_loc),
        tgt_loc=torch.empty_like(out_cache_loc),
        src_loc=torch.empty_like(out_cache_loc))
    if bs == 0:
        return out
    registry.dispatch("compact_accepted_path", impl, dev)(
        accept_index, accept_length, out_cache_loc, predicts, hidden_states, *out)
    return out
