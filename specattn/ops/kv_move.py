"""Moving KV between slots of a pool for all layers at once (after verify, the accepted path
moves to the front of its request's block)."""
from __future__ import annotations

from typing import Sequence

import torch

from . import registry
from ._checks import INDEX_DTYPES, capturing, check_index_range, check_tensor


def move_kv_cache_reference(buffers: Sequence[torch.Tensor], tgt_loc: torch.Tensor,
                            src_loc: torch.Tensor) -> None:
    """Plain-PyTorch reference: gather every source row first, then scatter, per buffer."""
    for buf in buffers:
        buf[tgt_loc.long()] = buf[src_loc.long()]  # the gather copies before any write


registry.register("move_kv_cache", "reference", lambda: move_kv_cache_reference)


def _load_cuda():
    """The compiled implementation ``torch.ops.specattn.move_kv_cache`` (csrc/kv_move.cu)."""
    from specattn import _ext
    if not _ext.EXT_AVAILABLE:
        raise ImportError(_ext.EXT_MISSING_REASON)
    op = torch.ops.specattn.move_kv_cache

    def move_kv_cache_cuda(buffers, tgt_loc, src_loc):
        op(list(buffers), tgt_loc, src_loc)

    return move_kv_cache_cuda


registry.register("move_kv_cache", "cuda", _load_cuda)


def move_kv_cache(buffers: Sequence[torch.Tensor], tgt_loc: torch.Tensor, src_loc: torch.Tensor,
                  *, impl: str = "auto") -> None:
    """Copy KV rows ``src_loc -> tgt_loc`` in every buffer, in place.

    After the call, for every ``i`` and every buffer, ``buf[tgt_loc[i]]`` equals what
    ``buf[src_loc[i]]`` held *before* the call, even when the two sets of slots overlap.

    Args:
        buffers: the per-layer cache tensors, all ``[num_slots, ...]`` on one device with the
            same ``num_slots`` (MHA pools pass K and V of every layer, MLA pools the latent of
            every layer: see ``MHATokenToKVPool.buffers``).
        tgt_loc, src_loc: int32/int64 ``[n]`` slot indices on the buffers' device; ``n`` may
            be 0.  ``tgt_loc`` may repeat a slot only in self-moves (``tgt == src``, e.g. the
            padded rows of a CUDA-graph batch, which all point at slot 0).
        impl: ``"auto"`` | ``"cuda"`` | ``"triton"`` | ``"reference"``.
    Raises:
        ValueError: empty ``buffers``, non-contiguous buffers, mismatched devices / slot counts
            / lengths, bad dtypes, a target slot written by two different moves.
        IndexError: a slot outside ``[0, num_slots)`` (checked with one host sync before any
            write; skipped during CUDA-graph capture).
    """
    buffers = list(buffers)
    if not buffers:
        raise ValueError("buffers must hold at least one tensor")
    dev, slots = buffers[0].device, buffers[0].shape[0]
    for i, b in enumerate(buffers):
        check_tensor(f"buffers[{i}]", b, device=dev)
        if not b.is_contiguous():
            raise ValueError(f"buffers[{i}] must be contiguous")
        if b.shape[0] != slots:
            raise ValueError(f"buffers[{i}] has {b.shape[0]} slots, buffers[0] has {slots}")
    check_tensor("tgt_loc", tgt_loc, dim=1, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("src_loc", src_loc, dim=1, dtypes=INDEX_DTYPES, device=dev)
    if tgt_loc.shape != src_loc.shape:
        raise ValueError(f"tgt_loc {list(tgt_loc.shape)} and src_loc {list(src_loc.shape)} differ")
    if tgt_loc.numel() == 0:
        return
    check_index_range("tgt_loc", tgt_loc, slots)
    check_index_range("src_loc", src_loc, slots)
    if not capturing():
        moving = tgt_loc[tgt_loc != src_loc]
        if torch.unique(moving).numel() != moving.numel() or bool(
                torch.isin(moving, tgt_loc[tgt_loc == src_loc]).any()):
            raise ValueError("tgt_loc gets two different moves into one slot; the move would be ambiguous")
    registry.dispatch("move_kv_cache", impl, dev)(buffers, tgt_loc, src_loc)
