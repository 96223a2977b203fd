"""Per-request state read and written by request row, several tensors per launch:
:func:`gather_rows` and :func:`scatter_rows`.

A speculative round keeps per-request state in tensors indexed by request row (prefix
lengths, roots, the drafter's kept top-k and hidden state, scratch rows).  Reading it for
the round's ``rows`` is ``t[rows]`` per tensor, and writing it back ``t[rows] = v``: one
small kernel each (PyTorch's advanced indexing, 1.5-3.7 us per launch on an H200 at these
sizes).  These ops do all of a round's reads, or all of its writes, in one launch.

Implementations (registry ops ``"gather_rows"`` and ``"scatter_rows"``, each taking the
reference's arguments):

- ``reference``: ``t[rows]`` / ``t[rows] = v`` per tensor (:func:`gather_rows_reference`,
  :func:`scatter_rows_reference`);
- ``triton``: one launch, one program per row (:mod:`specattn.triton_kernels.rows`).

``impl="auto"`` takes Triton for CUDA tensors when Triton imports, else the reference.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from . import registry
from .checks import INDEX_DTYPES, check_index_range, check_tensor

__all__ = ["gather_rows", "gather_rows_reference", "scatter_rows", "scatter_rows_reference", "MAX_ROW_TENSORS"]

MAX_ROW_TENSORS = 8   # tensors per call: the Triton kernel's unrolled copies


def gather_rows_reference(rows: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """PyTorch :func:`gather_rows` (no validation): ``[t[rows] for t in tensors]``."""
    return [t[rows] for t in tensors]


def scatter_rows_reference(rows: torch.Tensor, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """PyTorch :func:`scatter_rows` (no validation): ``dst[rows] = src`` per pair."""
    for dst, src in pairs:
        dst[rows] = src


registry.register("gather_rows", "reference", lambda: gather_rows_reference)
registry.register("gather_rows", "triton", registry.from_module("specattn.triton_kernels.rows", "gather_rows",
                                                                  "Triton"))
registry.register("scatter_rows", "reference", lambda: scatter_rows_reference)
registry.register("scatter_rows", "triton", registry.from_module("specattn.triton_kernels.rows", "scatter_rows",
                                                                   "Triton"))


def _check_rows(rows) -> None:
    check_tensor("rows", rows, dim=1, dtypes=INDEX_DTYPES)


def _check_state(name: str, t, rows: torch.Tensor) -> None:
    check_tensor(name, t, device=rows.device)
    if t.dim() < 1:
        raise ValueError(f"{name} must have a row dimension, got a 0-d tensor")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (rows are copied as flat runs)")


def _check_count(n: int, what: str) -> None:
    if not 1 <= n <= MAX_ROW_TENSORS:
        raise ValueError(f"{what} must hold 1 to {MAX_ROW_TENSORS} tensors, got {n}")


def gather_rows(rows: torch.Tensor, tensors: Sequence[torch.Tensor], *, check_values: bool = True,
                impl: str = "auto") -> List[torch.Tensor]:
    """``[t[rows] for t in tensors]`` in one launch.

    Args:
        rows: int32 / int64 ``[bs]`` row indices (repeats allowed), in ``[0, N_t)`` for every
            tensor (checked with one host sync unless ``check_values=False`` or a CUDA graph
            is being captured).
        tensors: 1 to 8 contiguous tensors ``[N_t, ...]`` on ``rows``' device, any dtypes.
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``.
    Returns:
        New contiguous tensors ``[bs, ...]``, one per input, in its dtype.
    Raises:
        TypeError / ValueError: a non-tensor, wrong rank or dtype of ``rows``, a tensor on
        another device, not contiguous or 0-d, or a count outside 1-8.  IndexError: a row
        out of range (``check_values``).  RuntimeError: a forced ``impl`` unavailable here.
    """
    _check_rows(rows)
    tensors = list(tensors)
    _check_count(len(tensors), "tensors")
    for k, t in enumerate(tensors):
        _check_state(f"tensors[{k}]", t, rows)
    if check_values:
        check_index_range("rows", rows, min(t.shape[0] for t in tensors))
    return registry.dispatch("gather_rows", impl, rows.device)(rows, tensors)


def scatter_rows(rows: torch.Tensor, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], *,
                 check_values: bool = True, impl: str = "auto") -> None:
    """``dst[rows] = src`` for every ``(dst, src)`` pair, in one launch, in place.

    Args:
        rows: int32 / int64 ``[bs]`` row indices in ``[0, N)`` of every ``dst`` (checked as
            in :func:`gather_rows`).  A repeated row gets one of its sources' values, which
            one is unspecified (as ``index_put_`` without ``accumulate``).
        pairs: 1 to 8 pairs of contiguous tensors on ``rows``' device: ``dst [N, ...]`` and
            ``src [bs, ...]`` with the same trailing shape and dtype.
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``.
    Raises:
        TypeError / ValueError: as :func:`gather_rows`, a pair that is not two tensors, a
        ``src`` whose shape is not ``[bs] + dst.shape[1:]`` or whose dtype differs.
        IndexError: a row out of range (``check_values``).  RuntimeError: a forced ``impl``
        unavailable here.
    """
    _check_rows(rows)
    pairs = list(pairs)
    _check_count(len(pairs), "pairs")
    for k, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"pairs[{k}] must be a (dst, src) pair")
        dst, src = pair
        _check_state(f"pairs[{k}] dst", dst, rows)
        _check_state(f"pairs[{k}] src", src, rows)
        if tuple(src.shape) != (rows.shape[0],) + tuple(dst.shape[1:]) or src.dtype != dst.dtype:
            raise ValueError(f"pairs[{k}]: src must be {dst.dtype} {[rows.shape[0]] + list(dst.shape[1:])}, "
                             f"got {src.dtype} {list(src.shape)}")
    if check_values:
        check_index_range("rows", rows, min(dst.shape[0] for dst, _ in pairs))
    registry.dispatch("scatter_rows", impl, rows.device)(rows, pairs)
