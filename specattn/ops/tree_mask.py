"""The tree-mask encoding shared by every backend and spec op (re-exported by
:mod:`specattn.backends`).

For TARGET_VERIFY each request has ``D = num_draft_tokens`` query tokens (token 0 is the
root: the last verified token).  The mask says only which *draft* tokens a draft token may
see: the request's committed prefix is always visible.  Row ``j`` of a request is
``W = ceil(D / 32)`` int32 words; bit ``k % 32`` of word ``k // 32`` is set when draft token
``j`` may attend to draft token ``k`` (its ancestors and itself).  Shape ``[bs, D, W]``,
dtype ``torch.int32`` (bit 31 is the sign bit; it is used like any other bit).

A 64-token tree costs 64 x 2 x 4 = 512 bytes per request instead of ``D x (P + D)`` bytes.

Example (D = 3, token 0 root, tokens 1 and 2 both children of 0)::

    dense           packed (W = 1)
    [[1, 0, 0],     [[0b001],      = [[1],
     [1, 1, 0],      [0b011],         [3],
     [1, 0, 1]]      [0b101]]         [5]]
"""
from __future__ import annotations

from typing import Tuple

import torch

from .checks import check_int

__all__ = ["num_mask_words", "pack_tree_mask", "unpack_tree_mask", "tree_mask_to_flashinfer",
           "check_tree_mask", "chain_tree_mask", "flashinfer_mask_bytes"]


def num_mask_words(num_draft_tokens: int) -> int:
    """Number of int32 words per mask row: ``ceil(num_draft_tokens / 32)``."""
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    return (num_draft_tokens + 31) // 32


def pack_tree_mask(dense: torch.Tensor) -> torch.Tensor:
    """Pack a dense bool mask ``[..., D, D]`` (``dense[..., j, k]``: token j sees token k)
    into int32 words ``[..., D, ceil(D/32)]``.  Runs on the input's device, no host sync.

    Raises:
        ValueError: not at least 2-D, last two dims unequal, or dtype not bool.
    """
    if dense.dim() < 2 or dense.shape[-1] != dense.shape[-2]:
        raise ValueError(f"dense tree mask must be [..., D, D], got {tuple(dense.shape)}")
    if dense.dtype != torch.bool:
        raise ValueError(f"dense tree mask must be bool, got {dense.dtype}")
    D = dense.shape[-1]
    W = num_mask_words(D)
    padded = torch.zeros(*dense.shape[:-1], W * 32, dtype=torch.int64, device=dense.device)
    padded[..., :D] = dense.to(torch.int64)
    weights = torch.bitwise_left_shift(
        torch.ones(32, dtype=torch.int64, device=dense.device),
        torch.arange(32, dtype=torch.int64, device=dense.device))
    words = (padded.view(*dense.shape[:-1], W, 32) * weights).sum(-1)  # in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_tree_mask(packed: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """Inverse of :func:`pack_tree_mask`: int32 ``[..., D, W]`` -> bool ``[..., D, D]``.

    Raises:
        TypeError: ``num_draft_tokens`` not an int.  ValueError: ``num_draft_tokens < 1``,
        wrong dtype, or last dim is not ``ceil(D/32)`` or rows are not D.
    """
    D = check_int("num_draft_tokens", num_draft_tokens, minimum=1)
    if packed.dtype != torch.int32:
        raise ValueError(f"packed tree mask must be int32, got {packed.dtype}")
    if packed.dim() < 2 or packed.shape[-2] != D or packed.shape[-1] != num_mask_words(D):
        raise ValueError(f"packed tree mask must be [..., {D}, {num_mask_words(D)}], "
                         f"got {tuple(packed.shape)}")
    bits = torch.arange(32, dtype=torch.int32, device=packed.device)
    dense = (torch.bitwise_right_shift(packed.unsqueeze(-1), bits) & 1).bool()
    return dense.flatten(-2)[..., :D]


def check_tree_mask(tree_mask: torch.Tensor, bs: int, num_draft_tokens: int) -> None:
    """Raise ValueError unless ``tree_mask`` is int32 ``[bs, D, ceil(D/32)]``."""
    want = (bs, num_draft_tokens, num_mask_words(num_draft_tokens))
    if tree_mask.dtype != torch.int32 or tuple(tree_mask.shape) != want:
        raise ValueError(f"tree_mask must be int32 {list(want)}, got {tree_mask.dtype} "
                         f"{list(tree_mask.shape)}")


def chain_tree_mask(num_draft_tokens: int, device=None) -> torch.Tensor:
    """The packed tree mask int32 ``[D, ceil(D/32)]`` of a chain 0 -> 1 -> ... -> D-1 (each
    token sees itself and every earlier one: lower-triangular), on ``device``.  Chains
    (``topk=1``) are what the causal MLA kernels (FlashInfer's, FlashMLA's) can verify."""
    D = num_draft_tokens
    return pack_tree_mask(torch.ones(D, D, dtype=torch.bool, device=device).tril())


def flashinfer_mask_bytes(verified_seq_len: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """Bytes of each request's FlashInfer packed-mask segment: int64 ``[bs]``,
    ``ceil(D * (P_b + D) / 8)`` with ``P_b = verified_seq_len[b]`` and ``D =
    num_draft_tokens`` (on ``verified_seq_len``'s device, no host sync).  The
    ``mask_indptr`` of :func:`tree_mask_to_flashinfer` (and the ``flashinfer_mask_indptr``
    that :func:`specattn.ops.build_tree` expects) is ``[0, cumsum(this)]`` as int32.

    Raises TypeError for a non-int ``num_draft_tokens`` or a non-integer ``verified_seq_len``
    (never truncated), ValueError for ``num_draft_tokens < 1``; a negative length is the
    caller's to avoid (checking it would read the device)."""
    D = check_int("num_draft_tokens", num_draft_tokens, minimum=1)
    if not isinstance(verified_seq_len, torch.Tensor) or verified_seq_len.is_floating_point() \
            or verified_seq_len.dtype == torch.bool or verified_seq_len.is_complex():
        raise TypeError(f"verified_seq_len must be an integer tensor, got "
                        f"{getattr(verified_seq_len, 'dtype', type(verified_seq_len).__name__)}")
    return (D * (verified_seq_len.long() + D) + 7) // 8


def tree_mask_to_flashinfer(tree_mask: torch.Tensor, prefix_lens_cpu: torch.Tensor
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's packed custom mask for ``BatchPrefillWithPagedKVCacheWrapper.plan``.

    Request i attends with ``D`` queries to ``P_i + D`` keys (``P_i = prefix_lens_cpu[i]``, the
    prefix, always visible, then the draft tokens under ``tree_mask``).  FlashInfer wants the
    row-major ``[D, P_i + D]`` bool mask of each request flattened, packed little-endian into
    bytes (element ``8b + t`` is bit ``t`` of byte ``b``), each request padded to a whole byte;
    ``mask_indptr`` gives each request's first byte (as ``flashinfer.segment_packbits``).

    Args:
        tree_mask: int32 ``[bs, D, ceil(D/32)]``, on any device.
        prefix_lens_cpu: integer ``[bs]`` on the CPU, each in ``[0, 2**31 - 1 - D]``
            (sizes decide the output's length).
    Returns:
        ``(packed_custom_mask uint8 [total_bytes], mask_indptr int32 [bs + 1])`` on
        ``tree_mask``'s device.
    Raises:
        TypeError: ``prefix_lens_cpu`` not a tensor of integers.  ValueError: a bad
        ``tree_mask``, ``prefix_lens_cpu`` off the CPU, of another shape or out of range,
        or a total over the int32 ``mask_indptr``.
    """
    if tree_mask.dim() != 3:
        raise ValueError(f"tree_mask must be int32 [bs, D, ceil(D/32)], got {list(tree_mask.shape)}")
    bs, D = tree_mask.shape[0], tree_mask.shape[1]
    check_tree_mask(tree_mask, bs, D)
    if not isinstance(prefix_lens_cpu, torch.Tensor) or prefix_lens_cpu.is_floating_point() \
            or prefix_lens_cpu.dtype == torch.bool or prefix_lens_cpu.is_complex():
        raise TypeError(f"prefix_lens_cpu must be a CPU tensor of integers, got "
                        f"{getattr(prefix_lens_cpu, 'dtype', type(prefix_lens_cpu).__name__)}")
    if prefix_lens_cpu.device.type != "cpu" or prefix_lens_cpu.shape != (bs,):
        raise ValueError("prefix_lens_cpu must be a CPU tensor of shape [bs]")
    if bs:
        lo, hi = int(prefix_lens_cpu.min()), int(prefix_lens_cpu.max())
        if lo < 0 or hi > 2 ** 31 - 1 - D:
            raise ValueError(f"prefix_lens_cpu must be in [0, {2 ** 31 - 1 - D}], got values in [{lo}, {hi}]")
        total = int(flashinfer_mask_bytes(prefix_lens_cpu, D).sum())
        if total > 2 ** 31 - 1:
            raise ValueError(f"the packed mask would take {total} bytes, past the int32 mask_indptr")
    dense = unpack_tree_mask(tree_mask, D)
    chunks, indptr = [], [0]
    weights = torch.tensor([1 << t for t in range(8)], dtype=torch.int32, device=tree_mask.device)
    for i in range(bs):
        P = int(prefix_lens_cpu[i])
        full = torch.cat([torch.ones(D, P, dtype=torch.bool, device=tree_mask.device),
                          dense[i]], dim=1).flatten()
        nbytes = (full.numel() + 7) // 8
        pad = torch.zeros(nbytes * 8, dtype=torch.int32, device=tree_mask.device)
        pad[:full.numel()] = full.to(torch.int32)
        chunks.append((pad.view(nbytes, 8) * weights).sum(-1).to(torch.uint8))
        indptr.append(indptr[-1] + nbytes)
    packed = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=tree_mask.device)
    return packed, torch.tensor(indptr, dtype=torch.int32, device=tree_mask.device)
