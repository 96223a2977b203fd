"""One registry for the spec-decoding ops: each op has one Python signature and up to three
implementations, ``cuda`` (``torch.ops.specattn.*`` from ``specattn._C``), ``triton`` and
``reference`` (plain PyTorch, always present).

The public wrappers in :mod:`specattn.ops` validate their inputs and then call
``dispatch(name, impl, device)``; ``impl="auto"`` picks CUDA when the extension is built and
the tensors are on a CUDA device, else Triton on CUDA, else the reference. Tests force an
implementation with ``impl="reference" | "triton" | "cuda"`` and compare them.

Implementations register lazily (a loader returning the callable, or raising ImportError
with the reason), so importing specattn never imports Triton or the extension.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

IMPLS = ("cuda", "triton", "reference")


@dataclass
class _Op:
    name: str
    loaders: Dict[str, Callable[[], Callable]] = field(default_factory=dict)
    cache: Dict[str, Tuple[Optional[Callable], Optional[str]]] = field(default_factory=dict)


_OPS: Dict[str, _Op] = {}


def register(name: str, impl: str, loader: Callable[[], Callable]) -> None:
    """Register ``loader`` (no arguments, returns the implementation or raises ImportError /
    RuntimeError saying why it is unavailable) as implementation ``impl`` of op ``name``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    op = _OPS.setdefault(name, _Op(name))
    op.loaders[impl] = loader
    op.cache.pop(impl, None)


def from_module(module: str, attr: str, what: str) -> Callable[[], Callable]:
    """A loader for :func:`register`: imports ``module`` and returns ``module.attr``; an
    ImportError becomes ``ImportError("<what> unavailable: ...")``."""
    def load():
        import importlib
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"{what} unavailable: {e}") from e
        return getattr(mod, attr)
    return load


def from_ext(op_name: str) -> Callable[[], Callable]:
    """A loader for :func:`register`: the compiled op ``torch.ops.specattn.<op_name>`` from
    ``specattn._C`` (its schema takes the reference function's arguments, outputs first where
    the reference has them).  ImportError says why when the extension is missing or was built
    without that op."""
    def load():
        from specattn import _ext
        if not _ext.EXT_AVAILABLE:
            raise ImportError(_ext.EXT_MISSING_REASON)
        if not hasattr(torch.ops.specattn, op_name):
            raise ImportError(f"specattn._C has no op {op_name!r} (rebuild the extension)")
        return getattr(torch.ops.specattn, op_name)
    return load


def _resolve(op: _Op, impl: str) -> Tuple[Optional[Callable], Optional[str]]:
    if impl not in op.cache:
        loader = op.loaders.get(impl)
        if loader is None:
            op.cache[impl] = (None, f"no {impl} implementation of {op.name} yet")
        else:
            try:
                op.cache[impl] = (loader(), None)
            except (ImportError, RuntimeError, AttributeError) as e:
                op.cache[impl] = (None, str(e) or type(e).__name__)
    return op.cache[impl]


def availability(name: str) -> Dict[str, Optional[str]]:
    """``{impl: None if available else the reason it is not}`` for op ``name``."""
    op = _OPS[name]
    return {impl: _resolve(op, impl)[1] for impl in IMPLS}


def names():
    return sorted(_OPS)


def dispatch(name: str, impl: str = "auto", device: Optional[torch.device] = None) -> Callable:
    """Return the implementation of ``name`` to run.

    Args:
        impl: ``"auto"`` or one of ``IMPLS``.
        device: where the inputs live; GPU implementations are only auto-picked on CUDA.
    Raises:
        KeyError: unknown op.  RuntimeError: a forced implementation is unavailable.
    """
    if name not in _OPS:
        raise KeyError(f"unknown spec op {name!r}; known: {names()}")
    op = _OPS[name]
    if impl != "auto":
        if impl not in IMPLS:
            raise ValueError(f"impl must be 'auto' or one of {IMPLS}, got {impl!r}")
        fn, why = _resolve(op, impl)
        if fn is None:
            raise RuntimeError(f"{impl} implementation of {name} unavailable: {why}")
        return fn
    on_cuda = device is not None and torch.device(device).type == "cuda"
    for cand in (("cuda", "triton") if on_cuda else ()) + ("reference",):
        fn, _ = _resolve(op, cand)
        if fn is not None:
            return fn
    raise RuntimeError(f"no implementation of {name} available")
