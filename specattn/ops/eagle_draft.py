"""EAGLE drafting's bookkeeping, fused: :func:`eagle_beam_step`, :func:`select_draft_tokens`
and :func:`fork_req_to_token_rows`.

An EAGLE draft (SGLang's ``draft_forward`` / ``select_top_k_tokens``) keeps ``topk = K``
beams per request.  At every step the drafter scores the ``K`` best children of each beam;
the ``K * K`` children, with cumulative log-probabilities ``beam + child``, are the step's
*candidates*, and the ``K`` best of them become the next beams.  After the last step the
``num_draft_tokens - 1`` best of all ``n_cand = K + (num_steps - 1) * K * K`` candidates
(the root's ``K`` children first, then each step's block of ``K * K``) are the draft tree's
tokens.  In plain PyTorch this is several small kernels per step (add, ``topk``, gathers,
``// K``, ``+ offset``) and a ``topk`` + ``sort`` + ``cat`` at the end; here:

- :func:`eagle_beam_step`: one step: candidates written into the caller's candidate buffers
  (so no final ``cat``), the next beams (``scores``, ``tokens``, ``best`` candidate columns,
  ``parents = best // K``, optionally the gathered source rows ``cur_rows[parents]``) and
  the step's ``parent_list`` block ``best + offset``.  One launch.
- :func:`select_draft_tokens`: the ``D - 1`` best candidates of each row in ascending index
  order and ``draft_tokens = [root, tokens[selected]]``.  One launch.
- :func:`fork_req_to_token_rows`: the ``req_to_token`` bookkeeping of beams drafted on
  scratch rows (``topk > 1``): each beam's row takes its source beam's ancestor columns and
  its own new slot, and the step's DECODE ``prefix_lens`` / ``out_cache_loc`` come back
  flat (SGLang assigns the draft's ``out_cache_loc`` and builds per-beam ``kv_indices`` for
  the same purpose).  In PyTorch, gathers, two ``index_put`` and the copies their strided
  indices need, about ten kernels a step; one launch here.

Order rule (both ops, both implementations): candidates rank by score descending and, among
equal scores, by LOWER candidate column first (``-0.0`` ties with ``+0.0``; a NaN ranks by
its bits: ``+NaN`` above ``+inf``, ``-NaN`` below ``-inf``).  This is the order of
``torch.topk`` over :func:`~specattn.ops.topk.order_keys`, which the references use, so
reference and Triton results compare exactly (one exception: the sign of a NaN that a sum
of two NaNs of opposite signs yields is the platform's, and torch on the CPU and Triton's
interpreter differ there); ``torch.topk`` on the raw scores agrees
wherever the scores it ranks are distinct.  Any selection gives a valid tree, so the
choice among ties never affects losslessness.

Implementations (registry ops ``"eagle_beam_step"`` and ``"select_draft_tokens"``, each
taking the reference's positional arguments):

- ``reference``: PyTorch (:func:`eagle_beam_step_reference`,
  :func:`select_draft_tokens_reference`);
- ``triton``: one launch each, one program per request (:mod:`specattn.triton_kernels.eagle_draft`).

``impl="auto"`` takes Triton for CUDA tensors when Triton imports, else the reference.
Neither op follows an index from its inputs' values (``parents`` are computed in ``[0,
K)``), so there are no value checks and no host sync: both are CUDA-graph capturable.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple, Optional, Tuple

import torch

from . import registry
from .checks import (INDEX_DTYPES, capturing, check_fits_int32, check_index_range, check_no_internal_overlap,
                     check_tensor)
from .topk import order_keys

__all__ = ["BeamStep", "eagle_beam_step", "eagle_beam_step_reference", "select_draft_tokens",
           "select_draft_tokens_reference", "fork_req_to_token_rows",
           "fork_req_to_token_rows_reference", "MAX_TOPK", "MAX_CANDIDATES"]

MAX_TOPK = 8            # K * K <= 64 candidates per step: one program's register vectors
MAX_CANDIDATES = 4096   # n_cand of select_draft_tokens: one program's register vectors

_TRITON_MODULE = "specattn.triton_kernels.eagle_draft"


class BeamStep(NamedTuple):
    """The next beams of :func:`eagle_beam_step`, each ``[bs, K]``, best first.

    Attributes:
        scores: float32, the beams' cumulative log-probabilities (descending).
        tokens: int64, their tokens (the next step's input ids).
        best: int64, their columns in ``[0, K * K)`` within this step's candidate block
            (SGLang's ``topk_cs_index``).
        parents: int64, ``best // K``: the beam of this step each one continues.
        src_rows: int64 ``cur_rows.gather(1, parents)``, or None without ``cur_rows``.
    """
    scores: torch.Tensor
    tokens: torch.Tensor
    best: torch.Tensor
    parents: torch.Tensor
    src_rows: Optional[torch.Tensor]


def _top_columns(x: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the ``k`` best entries of each row of float32 ``x``, best first, under the
    module's order rule."""
    return order_keys(x).topk(k, dim=-1).indices


def eagle_beam_step_reference(beam_scores, child_scores, child_tokens, cand_scores, cand_tokens,
                              offset, beam_tokens, beam_offset, select, cur_rows, parent_list,
                              parent_offset) -> Optional[BeamStep]:
    """PyTorch :func:`eagle_beam_step` (no validation; every argument positional).  Returns
    a :class:`BeamStep` with ``select``, else None."""
    bs, K = beam_scores.shape
    scores = (beam_scores[:, :, None] + child_scores.reshape(bs, K, K)).reshape(bs, K * K)
    tokens = child_tokens.reshape(bs, K * K)
    cand_scores[:, offset:offset + K * K] = scores
    cand_tokens[:, offset:offset + K * K] = tokens
    if beam_offset is not None:
        cand_scores[:, beam_offset:beam_offset + K] = beam_scores
        cand_tokens[:, beam_offset:beam_offset + K] = beam_tokens
    if not select:
        return None
    best = _top_columns(scores, K)
    parents = best // K
    src_rows = None if cur_rows is None else cur_rows.gather(1, parents).long()
    if parent_list is not None:
        parent_list[:, parent_offset:parent_offset + K] = best + offset
    return BeamStep(scores.gather(1, best), tokens.gather(1, best), best, parents, src_rows)


def select_draft_tokens_reference(scores, tokens, roots, num_draft_tokens
                                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """PyTorch :func:`select_draft_tokens` (no validation)."""
    selected = _top_columns(scores, num_draft_tokens - 1).sort(dim=-1).values
    draft_tokens = torch.cat([roots.long()[:, None], tokens.gather(1, selected)], 1)
    return selected, draft_tokens


def fork_req_to_token_rows_reference(req_to_token, src_rows, dst_rows, first_col, num_cols, new_col,
                                     new_slots) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """PyTorch :func:`fork_req_to_token_rows` (no validation; every argument positional).
    Boolean masks pick the columns inside the table, so it syncs with the host: eager use."""
    bs, R = dst_rows.shape
    W = req_to_token.shape[1]
    dst = dst_rows.long()[:, :, None]
    if num_cols > 0:
        cols = first_col.long()[:, None] + torch.arange(num_cols, device=req_to_token.device)
        ok = (cols >= 0) & (cols < W)
        if new_col is not None:
            ok &= cols != new_col.long()[:, None]
        cols = cols.clamp(0, W - 1)[:, None, :].expand(bs, R, num_cols)
        vals = req_to_token[src_rows.long()[:, :, None], cols]      # every read before a write
        ok = ok[:, None, :].expand(bs, R, num_cols)
        req_to_token[dst.expand_as(cols)[ok], cols[ok]] = vals[ok]
    if new_col is None:
        return None
    col = new_col.long()[:, None].expand(bs, R)
    slots = new_slots.long()
    ok = (col >= 0) & (col < W)
    req_to_token[dst[..., 0][ok], col[ok]] = slots[ok].to(req_to_token.dtype)
    return col.reshape(-1).clone(), slots.reshape(-1).clone()


registry.register("eagle_beam_step", "reference", lambda: eagle_beam_step_reference)
registry.register("eagle_beam_step", "triton",
                  registry.from_module(_TRITON_MODULE, "eagle_beam_step", "Triton"))
registry.register("select_draft_tokens", "reference", lambda: select_draft_tokens_reference)
registry.register("select_draft_tokens", "triton",
                  registry.from_module(_TRITON_MODULE, "select_draft_tokens", "Triton"))
registry.register("fork_req_to_token_rows", "reference", lambda: fork_req_to_token_rows_reference)
registry.register("fork_req_to_token_rows", "triton",
                  registry.from_module(_TRITON_MODULE, "fork_req_to_token_rows", "Triton"))


def _int_arg(name: str, v, lo: int, hi: int) -> int:
    """``v`` as an int in ``[lo, hi]``, else TypeError / ValueError naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return int(v)


def eagle_beam_step(beam_scores: torch.Tensor, child_scores: torch.Tensor, child_tokens: torch.Tensor,
                    cand_scores: torch.Tensor, cand_tokens: torch.Tensor, offset: int, *,
                    beam_tokens: Optional[torch.Tensor] = None, beam_offset: Optional[int] = None,
                    select: bool = True, cur_rows: Optional[torch.Tensor] = None,
                    parent_list: Optional[torch.Tensor] = None, parent_offset: Optional[int] = None,
                    impl: str = "auto") -> Optional[BeamStep]:
    """One EAGLE draft step's candidates and next beams (module docstring), ``K = topk``.

    Writes, for every request ``b`` and candidate ``c = j * K + i`` (beam ``j``, child ``i``)::

        cand_scores[b, offset + c] = beam_scores[b, j] + child_scores[b * K + j, i]   (float32)
        cand_tokens[b, offset + c] = child_tokens[b * K + j, i]

    and with ``select``, the ``K`` best candidates ``best`` (order rule of the module) as
    the next beams; ``parent_list[b, parent_offset + r] = best[b, r] + offset`` (the
    beams' flat candidate indices, SGLang's ``parents_list`` block).  Nothing else of the
    buffers is written.

    Args:
        beam_scores: float32 ``[bs, K]``, ``1 <= K <= 8``: the current beams' cumulative
            log-probabilities.
        child_scores: float32 ``[bs * K, K]``: log-probabilities of each beam's ``K`` best
            children (row ``b * K + j``: beam ``j`` of request ``b``).
        child_tokens: int64 ``[bs * K, K]``: their tokens.
        cand_scores, cand_tokens: float32 / int64 ``[bs, n_cand]`` candidate buffers
            (written in place, any strides).
        offset: column of this step's ``K * K`` candidates, ``offset + K * K <= n_cand``.
        beam_tokens: int64 ``[bs, K]``, with ``beam_offset`` only.
        beam_offset: if given, also write the incoming beams (``beam_scores``,
            ``beam_tokens``) to columns ``[beam_offset, beam_offset + K)`` (the first step
            stores the root's top-k, candidates ``0 .. K-1``, this way); the range must not
            overlap this step's block.
        select: compute the next beams (False on the last step: returns None, and
            ``cur_rows`` / ``parent_list`` must be None).
        cur_rows: int32 / int64 ``[bs, K]`` (any strides), e.g. the beams' ``req_to_token``
            rows: ``src_rows = cur_rows.gather(1, parents)`` is returned (int64).
        parent_list: int64 ``[bs, W]`` (written in place, any strides), with
            ``parent_offset``, ``parent_offset + K <= W``.
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        :class:`BeamStep` (new ``[bs, K]`` tensors) with ``select``, else None.  Device
        work only, one launch on the Triton path.

    Raises:
        TypeError: a non-tensor or a non-int offset.  ValueError: ranks, dtypes, devices or
        shapes that do not match, ``K > 8`` (:data:`MAX_TOPK`), column ranges outside the
        buffers or overlapping, an output buffer (``cand_scores``, ``cand_tokens``,
        ``parent_list``) with elements that share memory (an ``expand``-ed view),
        ``beam_tokens`` / ``parent_offset`` missing or given without
        their partner, ``cur_rows`` / ``parent_list`` without ``select``.  RuntimeError: a
        forced ``impl`` unavailable here.
    """
    check_tensor("beam_scores", beam_scores, dim=2, dtypes=(torch.float32,))
    bs, K = beam_scores.shape
    dev = beam_scores.device
    if not 1 <= K <= MAX_TOPK:
        raise ValueError(f"topk (beam_scores.shape[1]) must be in [1, {MAX_TOPK}], got {K}")
    check_tensor("child_scores", child_scores, dtypes=(torch.float32,), device=dev, shape=[bs * K, K])
    check_tensor("child_tokens", child_tokens, dtypes=(torch.int64,), device=dev, shape=[bs * K, K])
    check_tensor("cand_scores", cand_scores, dim=2, dtypes=(torch.float32,), device=dev, shape=[bs, None])
    n_cand = cand_scores.shape[1]
    check_tensor("cand_tokens", cand_tokens, dtypes=(torch.int64,), device=dev, shape=[bs, n_cand])
    offset = _int_arg("offset", offset, 0, n_cand - K * K)
    if (beam_offset is None) != (beam_tokens is None):
        raise ValueError("beam_tokens and beam_offset go together (both or neither)")
    if beam_offset is not None:
        check_tensor("beam_tokens", beam_tokens, dtypes=(torch.int64,), device=dev, shape=[bs, K])
        beam_offset = _int_arg("beam_offset", beam_offset, 0, n_cand - K)
        if beam_offset < offset + K * K and offset < beam_offset + K:
            raise ValueError(f"beam_offset columns [{beam_offset}, {beam_offset + K}) overlap this "
                             f"step's candidates [{offset}, {offset + K * K})")
    if not isinstance(select, bool):
        raise TypeError(f"select must be a bool, got {type(select).__name__}")
    if not select and (cur_rows is not None or parent_list is not None):
        raise ValueError("cur_rows and parent_list need select=True (they come from the next beams)")
    if cur_rows is not None:
        check_tensor("cur_rows", cur_rows, dtypes=INDEX_DTYPES, device=dev, shape=[bs, K])
    if (parent_list is None) != (parent_offset is None):
        raise ValueError("parent_list and parent_offset go together (both or neither)")
    if parent_list is not None:
        check_tensor("parent_list", parent_list, dim=2, dtypes=(torch.int64,), device=dev,
                     shape=[bs, None])
        parent_offset = _int_arg("parent_offset", parent_offset, 0, parent_list.shape[1] - K)
    for name, t in (("cand_scores", cand_scores), ("cand_tokens", cand_tokens), ("parent_list", parent_list)):
        if t is not None:   # written: one memory place per element (no expand-ed views)
            check_no_internal_overlap(name, t)
    fn = registry.dispatch("eagle_beam_step", impl, dev)
    out = fn(beam_scores, child_scores, child_tokens, cand_scores, cand_tokens, offset, beam_tokens,
             beam_offset, select, cur_rows, parent_list, parent_offset)
    return None if out is None else BeamStep(*out)


def select_draft_tokens(scores: torch.Tensor, tokens: torch.Tensor, roots: torch.Tensor,
                        num_draft_tokens: int, *, impl: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """The draft tree's tokens: the ``D - 1`` best candidates of each request (``D =
    num_draft_tokens``, order rule of the module), in ascending candidate order, after the
    root.  What ``scores.topk(D - 1).indices.sort().values`` and ``cat([roots[:, None],
    tokens.gather(1, selected)], 1)`` give, in one launch.

    Args:
        scores: float32 ``[bs, n_cand]``, ``1 <= n_cand <= 4096`` (:data:`MAX_CANDIDATES`),
            any strides: the candidates' cumulative log-probabilities.
        tokens: int64 ``[bs, n_cand]``, any strides: their tokens.
        roots: int64 ``[bs]``: each request's root (last emitted) token.
        num_draft_tokens: ``D``, tokens verified per request including the root,
            ``2 <= D <= n_cand + 1``.
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        ``(selected, draft_tokens)``: int64 ``[bs, D - 1]`` (candidate indices, strictly
        ascending: ``ops.build_tree``'s ``selected_index``) and int64 ``[bs, D]`` (``root``,
        then ``tokens[selected]``), new tensors.  Device work only.

    Raises:
        TypeError: a non-tensor or a non-int ``num_draft_tokens``.  ValueError: ranks,
        dtypes, devices or shapes that do not match, ``n_cand`` or ``D`` out of range.
        RuntimeError: a forced ``impl`` unavailable here.
    """
    check_tensor("scores", scores, dim=2, dtypes=(torch.float32,))
    bs, n_cand = scores.shape
    dev = scores.device
    if not 1 <= n_cand <= MAX_CANDIDATES:
        raise ValueError(f"scores must be [bs, n_cand] with 1 <= n_cand <= {MAX_CANDIDATES}, "
                         f"got {list(scores.shape)}")
    check_tensor("tokens", tokens, dtypes=(torch.int64,), device=dev, shape=[bs, n_cand])
    check_tensor("roots", roots, dtypes=(torch.int64,), device=dev, shape=[bs])
    D = _int_arg("num_draft_tokens", num_draft_tokens, 2, n_cand + 1)
    fn = registry.dispatch("select_draft_tokens", impl, dev)
    if bs == 0:
        return (torch.empty(0, D - 1, dtype=torch.int64, device=dev),
                torch.empty(0, D, dtype=torch.int64, device=dev))
    return fn(scores, tokens, roots, D)


def fork_req_to_token_rows(req_to_token: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
                           first_col: torch.Tensor, num_cols: int, *,
                           new_col: Optional[torch.Tensor] = None, new_slots: Optional[torch.Tensor] = None,
                           check_values: bool = True, impl: str = "auto"
                           ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Fork ``req_to_token`` rows: for every request ``b`` and beam ``j``, row
    ``dst_rows[b, j]`` takes the slots of row ``src_rows[b, j]`` at columns ``first_col[b] +
    [0, num_cols)`` and then, with ``new_col``, slot ``new_slots[b, j]`` at column
    ``new_col[b]``::

        req_to_token[dst_rows[b, j], c] = req_to_token[src_rows[b, j], c]   c in first_col[b] + [0, num_cols)
        req_to_token[dst_rows[b, j], new_col[b]] = new_slots[b, j]

    Columns outside ``[0, width)`` are skipped (neither read nor written), as is the copy of
    column ``new_col[b]`` (the new slot wins).  An EAGLE draft step with ``topk > 1`` runs
    each beam on a scratch row holding the request's prefix: step ``s`` forks the beams'
    rows from their parents' rows (the ``s - 1`` ancestor columns) and gives each beam the
    slot of its new entry; after the last step the same op with ``src_rows`` = the request
    rows restores the scratch rows' drafted columns.

    Args:
        req_to_token: int32 / int64 ``[rows, width]``, contiguous last dim (written in place).
        src_rows, dst_rows: int32 / int64 ``[bs, R]``, any strides: rows of ``req_to_token``.
            Every read happens before any write only where no ``dst`` row is also a ``src``
            row and the ``dst`` rows are distinct (checked with ``check_values``).
        first_col: int32 / int64 ``[bs]``: each request's first copied column.
        num_cols: columns copied per row, ``>= 0``.
        new_col: int32 / int64 ``[bs]`` or None: each request's new column (the beams'
            DECODE prefix length: the entry's position in the row).
        new_slots: int32 / int64 ``[bs, R]``, any strides, with ``new_col`` only: each
            beam's new slot, written as given (the KV pools it indexes are not the op's:
            the attention backends check slots against them).
        check_values: check row indices (and that no ``dst`` row repeats or is a ``src``
            row) with one host sync, skipped while a CUDA graph is being captured.
        impl: ``"auto"`` | ``"triton"`` | ``"reference"`` (the reference syncs: eager only).

    Returns:
        With ``new_col``: ``(prefix_lens, out_cache_loc)``, new int64 ``[bs * R]`` tensors,
        ``new_col[b]`` and ``new_slots[b, j]`` at ``b * R + j`` (the beams' DECODE batch).
        Else None.  One launch on the Triton path.

    Raises:
        TypeError: a non-tensor or a non-int ``num_cols``.  ValueError: ranks, dtypes,
        devices or shapes that do not match, a ``req_to_token`` whose rows share memory,
        ``new_slots`` without ``new_col`` or the other
        way round, repeated ``dst`` rows or one that is also a ``src`` row (with
        ``check_values``).  IndexError: a row outside ``req_to_token``, or an int64
        ``new_slots`` value that an int32 ``req_to_token`` cannot hold (with
        ``check_values``).  RuntimeError: a forced ``impl`` unavailable here.
    """
    check_tensor("req_to_token", req_to_token, dim=2, dtypes=INDEX_DTYPES)
    dev = req_to_token.device
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token needs a contiguous last dim")
    check_no_internal_overlap("req_to_token", req_to_token)   # written: rows must not share memory
    check_tensor("dst_rows", dst_rows, dim=2, dtypes=INDEX_DTYPES, device=dev)
    bs, R = dst_rows.shape
    check_tensor("src_rows", src_rows, dtypes=INDEX_DTYPES, device=dev, shape=[bs, R])
    check_tensor("first_col", first_col, dtypes=INDEX_DTYPES, device=dev, shape=[bs])
    num_cols = _int_arg("num_cols", num_cols, 0, 1 << 30)
    if (new_col is None) != (new_slots is None):
        raise ValueError("new_col and new_slots go together (both or neither)")
    if new_col is not None:
        check_tensor("new_col", new_col, dtypes=INDEX_DTYPES, device=dev, shape=[bs])
        check_tensor("new_slots", new_slots, dtypes=INDEX_DTYPES, device=dev, shape=[bs, R])
    if check_values and bs * R and not capturing():
        rows = req_to_token.shape[0]
        check_index_range("src_rows", src_rows, rows)
        check_index_range("dst_rows", dst_rows, rows)
        d = dst_rows.flatten().long()
        if d.unique().numel() != d.numel():
            raise ValueError("dst_rows repeats a row: the forked rows would race")
        if torch.isin(d, src_rows.flatten().long()).any():
            raise ValueError("a dst row is also a src row: it could be written before it is read")
        if new_slots is not None and req_to_token.dtype == torch.int32 and new_slots.dtype == torch.int64:
            check_fits_int32("new_slots", new_slots)   # as the int32 table holds them
    fn = registry.dispatch("fork_req_to_token_rows", impl, dev)
    if bs * R == 0:
        if new_col is None:
            return None
        return tuple(torch.empty(0, dtype=torch.int64, device=dev) for _ in range(2))
    return fn(req_to_token, src_rows, dst_rows, first_col, num_cols, new_col, new_slots)
