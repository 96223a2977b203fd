"""Input checks shared by the op wrappers and the backends: clear Python errors before any
kernel runs, and :func:`capturing` (the one test for "a CUDA graph is being captured" that
every layer above the kernels uses)."""
from __future__ import annotations

import operator
from typing import Optional, Sequence, Tuple

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def check_int(name: str, value, minimum: Optional[int] = None) -> int:
    """``value`` as a Python int (ints, numpy ints, 0-d integer tensors: anything with
    ``__index__``).  Raises TypeError for bools, floats and other non-integers (never
    truncated), ValueError below ``minimum`` when given."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream (no host syncs then);
    False on a CPU-only torch, whose ``is_current_stream_capturing`` raises RuntimeError."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:
        return False


def same_device(a, b) -> bool:
    """Device equality where ``cuda`` means the current CUDA device (``cuda == cuda:0`` when
    device 0 is current)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda" or (a.index is not None and b.index is not None):
        return a.index == b.index
    cur = torch.cuda.current_device()
    return (cur if a.index is None else a.index) == (cur if b.index is None else b.index)


def check_tensor(name: str, t, *, dim: Optional[int] = None, dtypes: Optional[Sequence] = None,
                 device: Optional[torch.device] = None, shape: Optional[Sequence] = None) -> None:
    """Raise TypeError/ValueError unless ``t`` is a tensor with the given rank, dtype, device
    and shape (``None`` entries in ``shape`` match anything)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def check_index_range(name: str, idx: torch.Tensor, upper: int, lower: int = 0) -> None:
    """Raise IndexError unless every value of ``idx`` lies in ``[lower, upper)``.

    Costs one host sync; skipped (silently) while a CUDA graph is being captured, where the
    caller's static buffers were checked when they were filled.
    """
    if idx.numel() == 0 or capturing():
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < lower or hi >= upper:
        raise IndexError(f"{name} has values in [{lo}, {hi}], outside the valid range "
                         f"[{lower}, {upper})")


def check_fits_int32(name: str, values: torch.Tensor) -> None:
    """Raise IndexError unless every value of ``values`` (an integer tensor) fits int32, for
    an int32 output that would otherwise wrap it; :func:`check_index_range`'s host sync."""
    check_index_range(name, values, 2**31, lower=-2**31)


def memory_span(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``[first, last + 1)`` byte addresses ``t``'s elements lie in (None when empty)."""
    if t.numel() == 0:
        return None
    last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def check_disjoint(name_a: str, a: Optional[torch.Tensor], name_b: str, b: Optional[torch.Tensor]) -> None:
    """Raise ValueError when ``a`` and ``b`` (either may be None) may share memory: their
    byte spans overlap (conservative for interleaved views).  For an op that writes one of
    them while it reads the other, whose result would then depend on program order."""
    sa = memory_span(a) if a is not None else None
    sb = memory_span(b) if b is not None else None
    if sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]:
        raise ValueError(f"{name_a} and {name_b} overlap in memory; the kernel would read what it "
                         f"writes (or write one place twice)")


def check_no_internal_overlap(name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless no two elements of ``t`` (a tensor an op writes) share memory
    (e.g. an ``expand``-ed view): taken by stride, each dimension of size > 1 must step past
    the span of the smaller ones."""
    span = 1
    for st, n in sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st < span:
            raise ValueError(f"{name} has elements that share memory (shape {list(t.shape)}, strides "
                             f"{list(t.stride())}); it is written, so each element needs its own")
        span += st * (n - 1)


def check_writes_disjoint(written: Sequence[Tuple[str, torch.Tensor]],
                          read: Sequence[Tuple[str, Optional[torch.Tensor]]] = ()) -> None:
    """Raise ValueError when a ``written`` tensor may share memory with another written one
    or with a ``read`` one (read ones may share memory with each other): one sort of the byte
    spans (:func:`check_disjoint` pairwise, for many buffers at once)."""
    spans = []
    for is_written, group in ((True, written), (False, read)):
        for name, t in group:
            sp = memory_span(t) if t is not None else None
            if sp is not None:
                spans.append((sp[0], sp[1], is_written, name))
    spans.sort(key=lambda x: x[0])
    last_any = last_written = None      # (end, name) of the furthest-reaching span so far
    for start, end, is_written, name in spans:
        other = last_any if is_written else last_written
        if other is not None and start < other[0]:
            raise ValueError(f"{other[1]} and {name} overlap in memory; the kernel would read what it "
                             f"writes (or write one place twice)")
        if last_any is None or end > last_any[0]:
            last_any = (end, name)
        if is_written and (last_written is None or end > last_written[0]):
            last_written = (end, name)
