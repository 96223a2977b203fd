"""Pieces shared by the Gluon sm_90 kernels (:mod:`.attention_sm90`: GQA tree verify,
:mod:`.attention_mla_sm90`: absorbed MLA): whether this Triton has the Gluon API the kernels
are written against (:data:`HAVE_GLUON`), what a call's device lacks
(:func:`sm90_device_needs`), and, with Gluon,
the 128-byte swizzled shared layout of every ``[rows, 64k]`` bf16/fp16 tile (:data:`SW128`),
the per-key slot gather (:func:`load_slots`) and the epilogue (:func:`store_out`).  The
``@gluon.jit`` helpers are inlined into each kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

# Gluon (``triton.experimental.gluon``, Triton >= 3.4) is experimental and its API changes
# between releases (Triton 3.9 removed ``async_copy.async_copy_global_to_shared``, which the
# kernels call), so the kernels run only on the Triton minor release they are written and
# tested against; with another the callers run the portable Triton kernels instead.
GLUON_TRITON = (3, 6)


def gluon_api_matches(version: str) -> bool:
    """Whether Triton ``version`` (e.g. ``"3.6.0"``, ``"3.6.0+git1a2b"``) is the minor
    release :data:`GLUON_TRITON` whose Gluon API the kernels use."""
    parts = version.split("+")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) == GLUON_TRITON
    except (IndexError, ValueError):
        return False


try:  # its Hopper ops are only compiled on an sm_90 device
    if not gluon_api_matches(triton.__version__):
        raise ImportError(f"Triton {triton.__version__}")
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: F401
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = ["GLUON_TRITON", "HAVE_GLUON", "gluon_api_matches", "sm90_device_needs", "int32_offset_needs"] + (
    ["SW128", "load_slots", "store_out"] if HAVE_GLUON else [])


def sm90_device_needs(t: torch.Tensor) -> list:
    """What the Gluon sm_90 kernels need and ``t``'s device or Triton lacks: Triton
    :data:`GLUON_TRITON` with Gluon and an sm_90 GPU (list of strings, empty when both are
    there)."""
    why = []
    if not HAVE_GLUON:
        why.append(f"Triton {'.'.join(map(str, GLUON_TRITON))} with Gluon "
                   f"(this is Triton {triton.__version__})")
    if t.device.type != "cuda" or torch.cuda.get_device_capability(t.device) != (9, 0):
        why.append(f"an sm_90 GPU (got {t.device})")
    return why


def int32_offset_needs(q: torch.Tensor, out: torch.Tensor, tree_mask: Optional[torch.Tensor],
                       max_q: int) -> list:
    """What the Gluon kernels' int32 offsets need and this call's views lack (empty when they
    fit): a head of ``q [T, H, D]`` / ``out [T, H, Dv]`` (``head * stride(1)`` plus the
    head's columns) and a token's tree-mask row (``j * tree_mask.stride(1)`` plus its words,
    ``j < max_q``) below 2**31 elements.  Views past that (a head-major buffer of many
    tokens seen as ``[T, H, D]``) run the portable kernels, which offset in int64."""
    why = []
    for name, t in (("q", q), ("out", out)):
        if (t.shape[1] - 1) * t.stride(1) + t.shape[2] >= 2 ** 31:
            why.append(f"{name}'s head offsets below 2**31 elements (its head stride is {t.stride(1)})")
    if tree_mask is not None and (max_q - 1) * tree_mask.stride(1) + tree_mask.shape[2] >= 2 ** 31:
        why.append(f"tree_mask's row offsets below 2**31 elements (its row stride is {tree_mask.stride(1)})")
    return why


if HAVE_GLUON:
    # the 128-byte swizzle of every [rows, 64k] bf16/fp16 tile; the host TMA descriptors'
    # boxes must land in the same layout
    SW128 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                              rank=2))

    @gluon.jit
    def load_slots(rtt_row, start, hi, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
        """int32 slots of keys ``start + [0, BLOCK_N)`` (0 past ``hi``), in ``LAYOUT``'s rows."""
        rows = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
        return gl.load(rtt_row + rows, mask=rows < hi, other=0)

    @gluon.jit
    def store_out(O, O_PART, LSE_PART, acc, m_i, l_i, tok, head, cols, ok, split,
                  stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                  NUM_SPLITS: gl.constexpr):
        """Epilogue of both sm_90 kernels (:func:`.attention_common.store_rows`'s contract):
        normalise the ``[rows, width]`` float32 accumulator by the row sums ``l_i`` and store
        it to ``O[tok, head, cols]`` in ``O``'s dtype, or with split-KV the float32 partial to
        ``O_PART[split, tok, head, cols]`` and the base-2 log-sum-exp to
        ``LSE_PART[split, tok, head]``.  ``m_i``/``l_i``/``tok`` (int64)/``head``/``ok`` are
        in the accumulator's row layout; a row with ``l_i == 0`` gets zeros (LSE ``-inf``), a
        NaN row stays NaN; rows where ``ok`` is False are not written."""
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        out = gl.where(empty[:, None], 0.0, acc / l_safe[:, None])
        if NUM_SPLITS == 1:
            gl.store(O + (tok * stride_ot + head * stride_oh)[:, None] + cols[None, :],
                     out.to(O.dtype.element_ty), mask=ok[:, None])
        else:
            sp = split.to(gl.int64)
            gl.store(O_PART + sp * stride_ps + (tok * stride_pt + head * stride_ph)[:, None]
                     + cols[None, :], out, mask=ok[:, None])
            lse = gl.where(empty, float("-inf"), m_i + gl.log2(l_safe))
            gl.store(LSE_PART + sp * stride_ls + tok * stride_lt + head, lse, mask=ok)
