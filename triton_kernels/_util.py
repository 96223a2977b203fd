"""Host-side helpers shared by the Triton launchers: the device guard and block sizes.

Triton launches on the *current* CUDA device, so a call whose tensors live on another GPU
would launch there and fault.  :func:`on_tensor_device` makes the launchers run with the
device of their first tensor argument current (as ``torch.ops.specattn`` kernels do through
their C++ guard).  No-op for CPU tensors (the interpreter) and when the device is already
current (a cheap index exchange, safe inside CUDA-graph capture).
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, Sequence) and not isinstance(x, str) and len(x) and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def on_tensor_device(fn):
    """Decorator: run ``fn`` with the CUDA device of its first tensor argument (or the first
    tensor of a first list argument) current."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = _first_tensor(args[0]) if args else None
        if t is None or not t.is_cuda:
            return fn(*args, **kwargs)
        with torch.cuda.device(t.device):
            return fn(*args, **kwargs)
    return wrapper


def next_pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= ``max(n, 1)``, at least ``lo`` (a ``tl.arange`` block size)."""
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def is_pow2(x) -> bool:
    """True for a positive int (not a bool) that is a power of two."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and not x & (x - 1)
