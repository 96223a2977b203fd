"""Input checks shared by the op wrappers and the backends: clear Python errors before any
kernel runs, and :func:`capturing` (the one test for "a CUDA graph is being captured" that
every layer above the kernels uses)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


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
