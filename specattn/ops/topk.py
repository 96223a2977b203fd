"""Row top-k log-probabilities of a logits matrix, fused: :func:`topk_log_probs`.

``topk_log_probs(logits, k)`` returns what a drafting step computes as::

    top = logits.float().topk(k, dim=-1)
    values = top.values - torch.logsumexp(logits.float(), -1, keepdim=True)
    indices = top.indices

with one tie rule: among equal logits the LOWER vocabulary index comes first (torch.topk
leaves the order of ties unspecified).  ``k = 1`` is ``argmax`` with torch.argmax's
first-occurrence rule, plus the log-probability of the chosen token.

Implementations (registry op ``"topk_log_probs"``; each takes ``(logits, k)``):

- ``reference``: plain PyTorch (:func:`topk_log_probs_reference`): ``torch.topk`` on an
  int64 key that orders by value, then by lower index, and ``torch.logsumexp``.
- ``triton``: two launches (:mod:`specattn.triton_kernels.topk`): per-chunk online
  logsumexp and top-k candidates over a ``(rows, chunks)`` grid, then one merge program per
  row.  No host sync and no allocation but the outputs and a small workspace (from the
  shapes), so it is CUDA-graph capturable; also runs in the CPU interpreter
  (``TRITON_INTERPRET=1``).

``impl="auto"`` takes Triton for CUDA tensors when Triton is importable, else the reference;
CPU tensors get the reference.  There is no CUDA C++ implementation.

Special values: a row holding a NaN gives unspecified values and indices (but valid index
values in ``[0, V)``, and no error).  ``+inf`` / ``-inf`` follow ``torch.logsumexp``: a
row with a ``+inf`` has ``lse = +inf`` (its ``+inf`` entries give NaN values, every other
value is ``-inf``); a row of only ``-inf`` has ``lse = -inf`` and NaN values; ``-inf``
entries of a row with a finite maximum give ``-inf`` values and are ranked (by index)
after every finite entry.  ``-0.0`` and ``+0.0`` are equal (a tie).
"""
from __future__ import annotations

import numbers
from typing import Tuple

import torch

from . import registry
from .checks import check_tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_K = 16
MAX_V = 2 ** 30  # column indices travel in the low 31 bits of the Triton kernels' keys

__all__ = ["topk_log_probs", "topk_log_probs_reference", "order_keys", "MAX_K"]

_TRITON_MODULE = "specattn.triton_kernels.topk"


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys of float32 ``x [N, V]`` (``V <= 2^31``), distinct within a row, ordered as
    the values and, among equal values, with the lower column on top: ``(o << 32) | (2^31 -
    1 - col)``, ``o`` the float's bits made monotone (``b`` if ``b >= 0`` else ``b ^
    0x7FFFFFFF``; ``-0.0`` read as ``+0.0``).  ``x.topk(k)`` of the keys is a deterministic
    top-k (the Triton kernels' order; NaNs rank by their bits).

    Raises:
        TypeError / ValueError: ``x`` not a 2-D float32 tensor (another width's bits would
        be read as float32's)."""
    check_tensor("x", x, dim=2, dtypes=(torch.float32,))
    b = torch.where(x == 0, torch.zeros_like(x), x).view(torch.int32)
    o = torch.where(b >= 0, b, b ^ 0x7FFFFFFF).to(torch.int64)
    low = 0x7FFFFFFF - torch.arange(x.shape[1], device=x.device, dtype=torch.int64)
    return (o << 32) | low


def topk_log_probs_reference(logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`topk_log_probs` (no validation): ``torch.topk`` over
    :func:`order_keys` of ``logits.float()`` (value descending, ties by lower index), the
    values gathered back and ``torch.logsumexp(logits.float(), -1)`` subtracted, in
    float32.  Returns ``(values float32 [N, k], indices int64 [N, k])``."""
    x = logits.float()
    if x.shape[0] == 0:
        return (torch.empty(0, k, device=x.device, dtype=torch.float32),
                torch.empty(0, k, device=x.device, dtype=torch.int64))
    indices = order_keys(x).topk(k, dim=-1).indices
    values = x.gather(1, indices) - torch.logsumexp(x, -1, keepdim=True)
    return values, indices


registry.register("topk_log_probs", "reference", lambda: topk_log_probs_reference)
registry.register("topk_log_probs", "triton",
                  registry.from_module(_TRITON_MODULE, "topk_log_probs", "Triton"))


def _check_k(k, V: int) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k must be an int, got {type(k).__name__} {k!r}")
    hi = min(V, MAX_K)
    if not 1 <= k <= hi:
        raise ValueError(f"k must be in [1, min(V, {MAX_K})] = [1, {hi}] for V = {V}, got {k}")
    return int(k)


def topk_log_probs(logits: torch.Tensor, k: int, *, impl: str = "auto"
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-probabilities of each row of ``logits`` and their indices:
    ``values[i, j] = logits[i, indices[i, j]] - logsumexp(logits[i])`` in float32, sorted
    descending, ties broken by the LOWER vocabulary index first.

    Args:
        logits: ``[N, V]`` float32 / bfloat16 / float16, ``N >= 0``, ``1 <= V <= 2^30``,
            on CPU or CUDA, any strides (a last dim with ``stride(1) != 1`` is copied
            contiguous first).  Read in float32 (16-bit inputs convert exactly).
        k: ``1 <= k <= min(V, 16)``.  ``k = 1`` is argmax with the lowest index among ties
            (torch.argmax's rule) and its log-probability.
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``; ``auto`` takes Triton for CUDA
            tensors, the reference on the CPU.
    Returns:
        ``(values, indices)``: float32 ``[N, k]`` and int64 ``[N, k]``, new tensors on
        ``logits.device`` (``N == 0``: empty).  Rows with a NaN: unspecified values and
        indices (indices still in ``[0, V)``); ``+inf`` / ``-inf``: as ``torch.logsumexp``
        (a row of only ``-inf`` gives NaN values; see the module docstring).
    Raises:
        TypeError: ``logits`` not a tensor, ``k`` not an int.  ValueError: ``logits`` not
        2-D, not a float dtype, ``V == 0`` or ``V > 2^30``; ``k`` out of range.
        RuntimeError: a forced ``impl`` unavailable here.
        No host sync on the Triton path: capturable in a CUDA graph.
    """
    check_tensor("logits", logits, dim=2, dtypes=FLOAT_DTYPES)
    N, V = logits.shape
    if not 1 <= V <= MAX_V:
        raise ValueError(f"logits must be [N, V] with 1 <= V <= 2^30, got {list(logits.shape)}")
    k = _check_k(k, V)
    fn = registry.dispatch("topk_log_probs", impl, logits.device)
    if N == 0:
        return (torch.empty(0, k, device=logits.device, dtype=torch.float32),
                torch.empty(0, k, device=logits.device, dtype=torch.int64))
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return fn(logits, k)
