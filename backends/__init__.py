"""The backend contract and the backends.

- :class:`ForwardMode`, :class:`ForwardBatch` (one meaning of ``prefix_lens`` in every mode),
  :class:`AttentionLayer` / :class:`AttentionKind`, the tree-mask encoding (defined in
  :mod:`specattn.ops.tree_mask`, re-exported here);
- :class:`AttentionBackend`, the ABC every backend implements;
- pools (:class:`ReqToTokenPool`, :class:`MHATokenToKVPool`, :class:`MLATokenToKVPool`,
  :class:`KVAllocator`) and :class:`GraphInputBuffers` for CUDA graphs;
- :class:`TorchReferenceBackend`, the oracle; ``TritonBackend`` (MHA/GQA and absorbed MLA,
  every mode, eager and graph; imported on first access, it needs triton); ``flashinfer`` and ``flashmla``
  (``backends/flashinfer_backend.py``, ``backends/flashmla_backend.py``: their packages are
  imported only when such a backend is built or probed, never by importing this package).
  ``create_backend(name, ...)`` builds any backend by name; ``available_backends()`` says which
  can be built here and why not; :class:`RoutedBackend` runs some modes on another backend
  over the same pools (what a runtime does for a mode its backend lacks).
"""
import importlib
from typing import Dict, Optional

from specattn.ops.tree_mask import num_mask_words, pack_tree_mask, tree_mask_to_flashinfer, unpack_tree_mask

from .base import AttentionBackend, GraphCapacity, UnsupportedConfigError, UnsupportedError
from .cuda_graph import GraphInputBuffers
from .forward_batch import ForwardBatch
from .forward_mode import ForwardMode
from .layer import AttentionKind, AttentionLayer
from .pools import KVAllocator, MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from .routing import RoutedBackend
from .torch_reference import TorchReferenceBackend

# name -> (module, class, what is missing when the module is absent)
_BACKENDS = {
    "torch_reference": ("specattn.backends.torch_reference", "TorchReferenceBackend", None),
    "triton": ("specattn.backends.triton_backend", "TritonBackend", "needs triton (pip install triton)"),
    "flashinfer": ("specattn.backends.flashinfer_backend", "FlashInferBackend",
                   "needs flashinfer-python: pip install \"specattn[flashinfer]\""),
    "flashmla": ("specattn.backends.flashmla_backend", "FlashMLABackend",
                 "needs sgl-flash-mla: pip install \"specattn[flashmla]\""),
}


def _load(name: str):
    if name not in _BACKENDS:
        raise KeyError(f"unknown backend {name!r}; known: {sorted(_BACKENDS)}")
    module, cls, missing = _BACKENDS[name]
    try:
        backend_cls = getattr(importlib.import_module(module), cls)
    except ModuleNotFoundError as e:
        if e.name == module:
            raise ImportError(missing) from None
        raise ImportError(f"{name} needs {e.name}: {missing or e}") from e
    probe = getattr(backend_cls, "unavailable_reason", None)  # optional packages, devices
    why = probe() if probe is not None else None
    if why:
        raise ImportError(why)
    return backend_cls


def available_backends() -> Dict[str, Optional[str]]:
    """``{name: None if it can be built here, else why not}``."""
    out = {}
    for name in _BACKENDS:
        try:
            _load(name)
            out[name] = None
        except ImportError as e:
            out[name] = str(e)
    return out


def create_backend(name: str, req_to_token_pool, kv_pool, **kwargs) -> AttentionBackend:
    """Build backend ``name`` over the pools.  Raises KeyError (unknown) or ImportError (why
    it is unavailable here)."""
    return _load(name)(req_to_token_pool, kv_pool, **kwargs)


def __getattr__(name: str):
    """``TritonBackend`` is loaded on first access (importing it imports triton)."""
    if name == "TritonBackend":
        return _load("triton")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AttentionBackend", "GraphCapacity", "UnsupportedError", "UnsupportedConfigError", "GraphInputBuffers",
           "ForwardBatch",
           "ForwardMode", "AttentionKind", "AttentionLayer", "KVAllocator", "MHATokenToKVPool",
           "MLATokenToKVPool", "ReqToTokenPool", "TorchReferenceBackend", "TritonBackend", "num_mask_words",
           "pack_tree_mask", "tree_mask_to_flashinfer", "unpack_tree_mask", "available_backends",
           "create_backend", "RoutedBackend"]
