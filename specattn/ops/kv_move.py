"""Moving KV between slots of a pool for all layers at once (after verify, the accepted path
moves to the front of its request's block)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import registry
from .checks import INDEX_DTYPES, capturing, check_tensor


def move_kv_cache_reference(buffers: Sequence[torch.Tensor], tgt_loc: torch.Tensor,
                            src_loc: torch.Tensor, group_size: Optional[int] = None) -> None:
    """Plain-PyTorch reference: gather every source row first, then scatter, per buffer.
    ``group_size`` is accepted for the common signature and ignored (exact for any overlap)."""
    for buf in buffers:
        buf[tgt_loc.long()] = buf[src_loc.long()]  # the gather copies before any write


registry.register("move_kv_cache", "reference", lambda: move_kv_cache_reference)


def _load_cuda():
    """The compiled implementation ``torch.ops.specattn.move_kv_cache`` (csrc/kv_move.cu)."""
    from specattn import _ext
    if not _ext.EXT_AVAILABLE:
        raise ImportError(_ext.EXT_MISSING_REASON)
    op = torch.ops.specattn.move_kv_cache

    def move_kv_cache_cuda(buffers, tgt_loc, src_loc, group_size=None):
        op(list(buffers), tgt_loc, src_loc, 0 if group_size is None else int(group_size))

    return move_kv_cache_cuda


registry.register("move_kv_cache", "cuda", _load_cuda)
registry.register("move_kv_cache", "triton",
                  registry.from_module("specattn.triton_kernels.kv_move", "move_kv_cache", "triton"))


def _check_moves(tgt_loc: torch.Tensor, src_loc: torch.Tensor, num_slots: int,
                 group_size: Optional[int]) -> Optional[int]:
    """Eager value checks of :func:`move_kv_cache` with ONE host sync (vectorised, no boolean
    indexing): slot range, unique targets, the ``group_size`` promise.  Returns the group
    size to run with: ``group_size`` itself, or 1 when ``group_size`` is None and no slot is
    both read and written by different pairs (then the direct path is exact), else None."""
    n = tgt_loc.numel()
    t, s = tgt_loc.long(), src_loc.long()
    ar = torch.arange(n, device=t.device)
    live = t != s  # identity pairs are skipped by every implementation
    # live targets, identity pairs replaced by distinct negative sentinels
    key = torch.where(live, t, -1 - ar)
    sorted_key, order = torch.sort(key)
    dup = (sorted_key[1:] == sorted_key[:-1]).any() if n > 1 else torch.zeros((), dtype=torch.bool,
                                                                               device=t.device)
    # a live target that an identity pair keeps
    kept = torch.isin(torch.where(live, t, -1), torch.where(live, -2, t)) & live
    # a live source that a live pair writes (s >= 0 never meets a sentinel)
    pos = torch.searchsorted(sorted_key, s).clamp_(max=n - 1)
    hit = live & (sorted_key[pos] == s)
    writer = order[pos]
    if group_size is not None:
        cross = hit & (writer // group_size != ar // group_size)
    else:
        cross = torch.zeros_like(hit)
    tmin, tmax = torch.aminmax(t)
    smin, smax = torch.aminmax(s)
    stats = torch.stack([tmin, tmax, smin, smax, dup.long(), kept.any().long(), hit.any().long(),
                         cross.any().long()]).tolist()  # the one host sync
    for name, lo, hi in (("tgt_loc", stats[0], stats[1]), ("src_loc", stats[2], stats[3])):
        if lo < 0 or hi >= num_slots:
            raise IndexError(f"{name} has values in [{lo}, {hi}], outside the valid range "
                             f"[0, {num_slots})")
    if stats[4] or stats[5]:
        raise ValueError("tgt_loc gets two different moves into one slot; the move would be ambiguous")
    if stats[7]:
        i = int(torch.nonzero(cross)[0])
        j = int(writer[i])
        raise ValueError(
            f"group_size={group_size} promise violated: pair {i} (group {i // group_size}) reads "
            f"slot {int(s[i])}, which pair {j} (group {j // group_size}) writes; a slot read by "
            f"one pair may be written by another pair only within the same group")
    if group_size is None and not stats[6]:
        return 1
    return group_size


def _check_disjoint(buffers: Sequence[torch.Tensor]) -> None:
    """ValueError if two (contiguous) buffers share memory: each would be moved once per
    listing, so a buffer passed twice (e.g. one tensor as both K and V) would be moved twice by
    the reference and once or twice by the kernels.  Host-side byte ranges, no sync."""
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size(), i)
                   for i, b in enumerate(buffers) if b.numel())
    reach, owner = -1, -1          # the furthest end so far, and whose
    for start, end, j in spans:
        if start < reach:
            raise ValueError(f"buffers[{min(owner, j)}] and buffers[{max(owner, j)}] share memory; "
                             "pass each layer's cache once")
        if end > reach:
            reach, owner = end, j


def move_kv_cache(buffers: Sequence[torch.Tensor], tgt_loc: torch.Tensor, src_loc: torch.Tensor,
                  *, impl: str = "auto", group_size: Optional[int] = None,
                  check_values: bool = True) -> None:
    """Copy KV rows ``src_loc -> tgt_loc`` in every buffer, in place.

    After the call, for every ``i`` and every buffer, ``buf[tgt_loc[i]]`` equals what
    ``buf[src_loc[i]]`` held *before* the call, even when the two sets of slots overlap.
    Pairs with ``tgt_loc[i] == src_loc[i]`` move nothing.

    Args:
        buffers: the per-layer cache tensors, all ``[num_slots, ...]`` (any dtype, rows moved
            as raw bytes), contiguous, on one device, with the same ``num_slots``, no two
            sharing memory (MHA pools pass K and V of every layer, MLA pools the latent of
            every layer: see ``MHATokenToKVPool.buffers``).
        tgt_loc, src_loc: int32/int64 ``[n]`` slot indices on the buffers' device; ``n`` may
            be 0.  ``tgt_loc`` may repeat a slot only in self-moves (``tgt == src``, e.g. the
            padded rows of a CUDA-graph batch, which all point at slot 0).
        impl: ``"auto"`` | ``"cuda"`` | ``"triton"`` | ``"reference"``.
        group_size: ``None`` (default): overlap-safe for any pairs; the CUDA / Triton
            implementations stage the rows through a temporary (gather launch, then scatter
            launch: twice the memory traffic).  In eager mode (not during CUDA-graph
            capture) the checks below also detect when no slot is both read and written by
            different pairs, and then take the direct path.
            ``G >= 1``: the caller's **promise** that the pairs come in consecutive groups of
            ``G`` (pairs ``[g*G, (g+1)*G)``, the last group may be shorter) and that a slot
            read by one pair is written by another pair only within the same group
            (``G = 1``: no slot is both read and written by different pairs; identity pairs
            do not count).  The CUDA / Triton implementations then move every row once, in
            ONE launch for all buffers (the CUDA kernel holds groups of up to 1024 pairs, the
            Triton one up to 1024; larger groups are staged).  The pairs of
            :func:`specattn.ops.compact_accepted_path` keep it with ``G = num_draft_tokens``
            (request ``b``'s pairs are block ``b`` and only touch its own slots).  Checked
            eagerly; during CUDA-graph capture the promise is trusted (a false one there
            gives undefined row contents, never out-of-bounds accesses).
        check_values: ``True`` (default): the value checks below, one host sync in eager
            mode.  ``False``: none of them, so the call never syncs with the host (for a hot
            path whose slots come from the allocator); ``group_size=None`` then always stages.
            The CUDA / Triton kernels skip out-of-range pairs instead of touching them; the
            reference indexes with torch, which raises for a slot past the end but counts a
            negative slot from the end (Python indexing), so out-of-range input is undefined
            there.
    Raises:
        TypeError: ``group_size`` not an int.
        ValueError: empty ``buffers``, 0-d, non-contiguous or memory-sharing buffers,
            mismatched devices / slot counts / lengths, bad dtypes, a target slot written by
            two different moves (or written and kept by a self-move), ``group_size < 1``, a
            violated ``group_size`` promise.
        IndexError: a slot outside ``[0, num_slots)``.
        Value checks (slot range, unique targets, the promise) cost one host sync before any
        write and are skipped during CUDA-graph capture (the kernels then skip out-of-range
        pairs instead of touching them).
    """
    buffers = list(buffers)
    if not buffers:
        raise ValueError("buffers must hold at least one tensor")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"group_size must be an int or None, got {type(group_size).__name__}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
    for i, b in enumerate(buffers):
        check_tensor(f"buffers[{i}]", b)
        if b.dim() < 1:
            raise ValueError(f"buffers[{i}] must have a slot dimension, got a 0-d tensor")
    dev, slots = buffers[0].device, buffers[0].shape[0]
    for i, b in enumerate(buffers):
        check_tensor(f"buffers[{i}]", b, device=dev)
        if not b.is_contiguous():
            raise ValueError(f"buffers[{i}] must be contiguous")
        if b.shape[0] != slots:
            raise ValueError(f"buffers[{i}] has {b.shape[0]} slots, buffers[0] has {slots}")
    _check_disjoint(buffers)
    check_tensor("tgt_loc", tgt_loc, dim=1, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("src_loc", src_loc, dim=1, dtypes=INDEX_DTYPES, device=dev)
    if tgt_loc.shape != src_loc.shape:
        raise ValueError(f"tgt_loc {list(tgt_loc.shape)} and src_loc {list(src_loc.shape)} differ")
    if tgt_loc.numel() == 0:
        return
    if check_values and not capturing():
        group_size = _check_moves(tgt_loc, src_loc, slots, group_size)
    registry.dispatch("move_kv_cache", impl, dev)(buffers, tgt_loc, src_loc, group_size=group_size)
