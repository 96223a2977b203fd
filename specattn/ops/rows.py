"""Per-request state read and written by request row, several tensors per launch:
:func:`gather_rows` and :func:`scatter_rows`; a round's slots (:func:`extend_cache_locs`)
and its commit (:func:`commit_accepted`), one launch each.

A speculative round keeps per-request state in tensors indexed by request row (prefix
lengths, roots, the drafter's kept top-k and hidden state, scratch rows).  Reading it for
the round's ``rows`` is ``t[rows]`` per tensor, and writing it back ``t[rows] = v``: one
small kernel each (PyTorch's advanced indexing, 1.5-3.7 us per launch on an H200 at these
sizes).  These ops do all of a round's reads, or all of its writes, in one launch.  A
speculative round also looks up the KV slots of its ``n`` tokens per request
(``req_to_token[row, P + j]``: a gather, an add, an index and a cast) and commits its
accepted path (the emitted block, the new root, the new prefix length: five small kernels);
:func:`extend_cache_locs` and :func:`commit_accepted` do each in one launch.

Implementations (registry ops ``"gather_rows"``, ``"scatter_rows"``,
``"extend_cache_locs"`` and ``"commit_accepted"``, each taking the reference's arguments):

- ``reference``: ``t[rows]`` / ``t[rows] = v`` per tensor (:func:`gather_rows_reference`,
  :func:`scatter_rows_reference`);
- ``triton``: one launch, one program per row (:mod:`specattn.triton_kernels.rows`).

``impl="auto"`` takes Triton for CUDA tensors when Triton imports, else the reference.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import registry
from .checks import (INDEX_DTYPES, capturing, check_disjoint, check_fits_int32, check_index_range,
                     check_no_internal_overlap, check_tensor)

__all__ = ["gather_rows", "gather_rows_reference", "scatter_rows", "scatter_rows_reference", "MAX_ROW_TENSORS",
           "ExtendCacheLocs", "extend_cache_locs", "extend_cache_locs_reference", "commit_accepted",
           "commit_accepted_reference"]

MAX_ROW_TENSORS = 8   # tensors per call: the Triton kernel's unrolled copies


def gather_rows_reference(rows: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """PyTorch :func:`gather_rows` (no validation): ``[t[rows] for t in tensors]``."""
    return [t[rows] for t in tensors]


def scatter_rows_reference(rows: torch.Tensor, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """PyTorch :func:`scatter_rows` (no validation): ``dst[rows] = src`` per pair."""
    for dst, src in pairs:
        dst[rows] = src


class ExtendCacheLocs(NamedTuple):
    """Outputs of :func:`extend_cache_locs` (see its docstring)."""

    seq_lens: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    input_ids: Optional[torch.Tensor]


def extend_cache_locs_reference(rows, prefix_lens, req_to_token, n, roots, fill_id):
    """PyTorch :func:`extend_cache_locs` (no validation): ``(seq_lens, positions,
    out_cache_loc, input_ids or None)``."""
    P = prefix_lens[rows].long()
    pos = P[:, None] + torch.arange(n, device=rows.device)
    loc = req_to_token[rows.long()[:, None], pos].long()
    ids = None
    if roots is not None:
        ids = torch.full((rows.shape[0], n), int(fill_id), dtype=torch.int64, device=rows.device)
        ids[:, 0] = roots[rows].long()
    return P.to(torch.int32), pos.flatten(), loc.flatten(), ids


def commit_accepted_reference(rows, prefix_lens, roots, seq_lens, path, accept_length, emitted) -> None:
    """PyTorch :func:`commit_accepted` (no validation), in place."""
    bs, n = path.shape
    a = accept_length.long()
    emitted[:, 1:1 + n] = path.long()
    emitted[:, 0] = a + 1
    roots[rows] = path.gather(1, a[:, None]).squeeze(1).to(roots.dtype)
    prefix_lens[rows] = (seq_lens.long() + a + 1).to(prefix_lens.dtype)


registry.register("extend_cache_locs", "reference", lambda: extend_cache_locs_reference)
registry.register("extend_cache_locs", "triton", registry.from_module(
    "specattn.triton_kernels.rows", "extend_cache_locs", "Triton"))
registry.register("commit_accepted", "reference", lambda: commit_accepted_reference)
registry.register("commit_accepted", "triton", registry.from_module(
    "specattn.triton_kernels.rows", "commit_accepted", "Triton"))
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
    if t.is_complex():
        raise ValueError(f"{name} must have a real dtype (bool, integer, floating or float8), got {t.dtype}")
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
        tensors: 1 to 8 contiguous tensors ``[N_t, ...]`` on ``rows``' device, any real dtypes
            (bool, integer, floating, float8; not complex).
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
    return registry.dispatch("gather_rows", impl, rows.device)(rows.contiguous(), tensors)


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
        ``src`` whose shape is not ``[bs] + dst.shape[1:]`` or whose dtype differs, a ``dst``
        that shares memory with any ``src``, another ``dst`` or ``rows``.
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
    for k, (dst, _) in enumerate(pairs):   # a dst is written while every src and rows are read
        check_disjoint(f"pairs[{k}] dst", dst, "rows", rows)
        for k2, (dst2, src2) in enumerate(pairs):
            check_disjoint(f"pairs[{k}] dst", dst, f"pairs[{k2}] src", src2)
            if k2 > k:
                check_disjoint(f"pairs[{k}] dst", dst, f"pairs[{k2}] dst", dst2)
    if check_values:
        check_index_range("rows", rows, min(dst.shape[0] for dst, _ in pairs))
    registry.dispatch("scatter_rows", impl, rows.device)(rows.contiguous(), pairs)


def extend_cache_locs(rows: torch.Tensor, prefix_lens: torch.Tensor, req_to_token: torch.Tensor, n: int, *,
                      roots: Optional[torch.Tensor] = None, fill_id: int = 0, check_values: bool = True,
                      impl: str = "auto") -> ExtendCacheLocs:
    """The positions and KV slots of ``n`` new tokens per request after its committed
    prefix, in one launch (SGLang spec v2's ``assign_extend_cache_locs`` reads the same
    ``req_to_token`` ranges; here also the prefix lengths and, optionally, a DFlash block's
    input ids).

    Args:
        rows: int32 / int64 ``[bs]`` request rows (repeats allowed).
        prefix_lens: int32 / int64 ``[R]`` per-row state: each row's committed tokens ``P``.
        req_to_token: int32 / int64 ``[R2, W]``, contiguous rows: the KV slot of each row's
            position.
        n: tokens per request (>= 1).
        roots: optional int32 / int64 ``[R]`` per-row state (the last committed token).
        fill_id: the token id after each root in ``input_ids`` (DFlash's mask token).
        check_values: check every row against ``R`` / ``R2`` and ``P + n <= W`` (one host
            sync; skipped during CUDA-graph capture).
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``.
    Returns:
        :class:`ExtendCacheLocs` on ``rows``' device: ``seq_lens`` int32 ``[bs]``
        (``prefix_lens[rows]``), ``positions`` int64 ``[bs * n]`` (``P + j``, request-major),
        ``out_cache_loc`` int64 ``[bs * n]`` (``req_to_token[row, P + j]``), ``input_ids``
        int64 ``[bs, n]`` (``[roots[row], fill_id, ..]``; None without ``roots``).
    Raises:
        TypeError / ValueError: wrong types, ranks, dtypes, devices, a non-contiguous
        ``req_to_token`` row, ``n < 1`` or a ``fill_id`` that is not an int int64 holds.
        IndexError: a row or position out of range
        (``check_values``).  RuntimeError: a forced ``impl`` unavailable here.
    """
    _check_rows(rows)
    check_tensor("prefix_lens", prefix_lens, dim=1, dtypes=INDEX_DTYPES, device=rows.device)
    check_tensor("req_to_token", req_to_token, dim=2, dtypes=INDEX_DTYPES, device=rows.device)
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must have contiguous rows")
    if roots is not None:
        check_tensor("roots", roots, dim=1, dtypes=INDEX_DTYPES, device=rows.device)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if isinstance(fill_id, bool) or not isinstance(fill_id, int) or not -2 ** 63 <= fill_id < 2 ** 63:
        raise ValueError(f"fill_id must be an int that int64 holds, got {fill_id!r}")
    if check_values and rows.numel() and not capturing():
        check_index_range("rows", rows, min(prefix_lens.shape[0], req_to_token.shape[0],
                                            roots.shape[0] if roots is not None else prefix_lens.shape[0]))
        check_index_range("prefix_lens[rows] + n", prefix_lens[rows] + n, req_to_token.shape[1] + 1, lower=n)
    return ExtendCacheLocs(*registry.dispatch("extend_cache_locs", impl, rows.device)(
        rows.contiguous(), prefix_lens.contiguous(), req_to_token, n,
        roots.contiguous() if roots is not None else None, fill_id))


def commit_accepted(rows: torch.Tensor, prefix_lens: torch.Tensor, roots: torch.Tensor, seq_lens: torch.Tensor,
                    path: torch.Tensor, accept_length: torch.Tensor, emitted: torch.Tensor, *,
                    check_values: bool = True, impl: str = "auto") -> None:
    """Commit a round's accepted paths in one launch, in place: for request ``i`` with
    ``a = accept_length[i]`` accepted drafts, ``emitted[i, 0] = a + 1``, ``emitted[i, 1 :
    1 + n] = path[i]``, ``roots[rows[i]] = path[i, a]`` (the bonus: the next root) and
    ``prefix_lens[rows[i]] = seq_lens[i] + a + 1``.

    Args:
        rows: int32 / int64 ``[bs]`` request rows; a repeated row gets one of its requests'
            values (which one is unspecified), as for :func:`scatter_rows`.
        prefix_lens, roots: int32 / int64 ``[R]``, contiguous: per-row state, written at ``rows``.
        seq_lens: int32 / int64 ``[bs]``: the round's prefix lengths ``P``.
        path: int32 / int64 ``[bs, n]``, contiguous: the compacted path (accepted drafts,
            then the bonus; :func:`compact_accepted_path`'s ``predicts``).
        accept_length: int32 / int64 ``[bs]`` in ``[0, n - 1]`` (drafts, excluding the bonus).
        emitted: int64 ``[bs, 1 + W]`` with ``W >= n`` and contiguous rows: the count, then the
            tokens (the first ``a + 1`` are the emitted ones).
        check_values: check ``rows`` against ``R`` and ``accept_length`` against ``n`` (one
            host sync; skipped during CUDA-graph capture).
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``.
    Raises:
        TypeError / ValueError: wrong types, ranks, dtypes, shapes or devices, a
        non-contiguous ``prefix_lens`` / ``roots``, an ``emitted`` whose rows share memory,
        an output (``prefix_lens``, ``roots``, ``emitted``) that shares memory with another
        or with an input.  IndexError: a row or an
        ``accept_length`` out of range, a negative ``seq_lens``, or a new prefix length or root that an int32
        ``prefix_lens`` / ``roots`` cannot hold (``check_values``).  RuntimeError: a forced
        ``impl`` unavailable here.
    """
    _check_rows(rows)
    bs = rows.shape[0]
    for name, t in (("prefix_lens", prefix_lens), ("roots", roots)):
        check_tensor(name, t, dim=1, dtypes=INDEX_DTYPES, device=rows.device)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (it is written in place at rows)")
    check_tensor("seq_lens", seq_lens, shape=(bs,), dtypes=INDEX_DTYPES, device=rows.device)
    check_tensor("accept_length", accept_length, shape=(bs,), dtypes=INDEX_DTYPES, device=rows.device)
    check_tensor("path", path, dim=2, dtypes=INDEX_DTYPES, device=rows.device)
    check_tensor("emitted", emitted, dim=2, dtypes=(torch.int64,), device=rows.device)
    n = path.shape[1]
    if path.shape[0] != bs or not path.is_contiguous() or n < 1:
        raise ValueError(f"path must be contiguous [{bs}, n >= 1], got {list(path.shape)}")
    if emitted.shape[0] != bs or emitted.shape[1] < 1 + n or emitted.stride(1) != 1:
        raise ValueError(f"emitted must be [{bs}, >= {1 + n}] with contiguous rows, got {list(emitted.shape)}")
    check_no_internal_overlap("emitted", emitted)
    outs = (("prefix_lens", prefix_lens), ("roots", roots), ("emitted", emitted))
    for i, (name, out) in enumerate(outs):   # written while the inputs are read
        for name_in, t in (("rows", rows), ("seq_lens", seq_lens), ("path", path),
                           ("accept_length", accept_length)) + outs[i + 1:]:
            check_disjoint(name, out, name_in, t)
    if check_values and bs and not capturing():
        check_index_range("rows", rows, min(prefix_lens.shape[0], roots.shape[0]))
        check_index_range("accept_length", accept_length, n)
        check_index_range("seq_lens", seq_lens, 2 ** 63 - 1)     # a committed length is >= 0
        for name, state, values in (("seq_lens + accept_length + 1", prefix_lens, seq_lens.long() + accept_length + 1),
                                    ("path", roots, path)):
            if state.dtype == torch.int32:   # what the int32 state would hold must fit it
                check_fits_int32(name, values)
    registry.dispatch("commit_accepted", impl, rows.device)(rows.contiguous(), prefix_lens, roots,
                                                             seq_lens.contiguous(), path,
                                                             accept_length.contiguous(), emitted)
