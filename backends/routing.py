"""``RoutedBackend``: one backend per forward mode over the same pools.

A runtime whose backend lacks a mode (FlashInfer has no MLA tree verify; a backend without
graphs for a mode) routes that mode to another backend built over the SAME pools, e.g.
Triton, as SGLang routes its FlashMLA backend's draft extend to a prefill path.  The router
is itself an :class:`~specattn.backends.base.AttentionBackend`: the runtime calls it exactly
as any backend and never branches on which kernel runs.

Both backends see one ``req_to_token`` and one KV pool, so what one mode writes the other
reads: routing changes the kernel, never the data.  ``supports`` answers per mode for the
backend that runs it; the metadata builders and ``forward`` go to that backend too.

Example (what :class:`~specattn.spec_runtime.engine.Engine` builds for FlashInfer on MLA
with a tree drafter)::

    fi = create_backend("flashinfer", req_pool, mla_pool, topk=4)  # no MLA tree verify
    tri = create_backend("triton", req_pool, mla_pool)
    backend = RoutedBackend(fi, {ForwardMode.TARGET_VERIFY: tri})
    backend.name == "flashinfer+triton"; backend.backend_for(ForwardMode.DECODE) is fi
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .base import AttentionBackend, GraphCapacity
from .forward_batch import ForwardBatch
from .forward_mode import ForwardMode
from .layer import AttentionKind, AttentionLayer

__all__ = ["RoutedBackend"]


class RoutedBackend(AttentionBackend):
    """``primary`` for every mode except those in ``routes``, each run by its own backend.

    Args:
        primary: the backend of every mode not in ``routes``.
        routes: ``{mode: backend}``; every backend must share ``primary``'s
            ``req_to_token_pool`` and ``kv_pool`` (the same objects).
    Raises:
        TypeError: ``primary`` or a route that is not a backend, a key that is not a
            ForwardMode.  ValueError: a routed backend over other pools, or routing IDLE.
    """

    def __init__(self, primary: AttentionBackend, routes: Dict[ForwardMode, AttentionBackend]):
        if not isinstance(primary, AttentionBackend):
            raise TypeError(f"primary must be an AttentionBackend, got {type(primary).__name__}")
        if not isinstance(routes, dict):
            raise TypeError(f"routes must be a dict {{ForwardMode: AttentionBackend}}, got {type(routes).__name__}")
        for mode, b in routes.items():
            if not isinstance(mode, ForwardMode) or not isinstance(b, AttentionBackend):
                raise TypeError(f"routes must map a ForwardMode to an AttentionBackend, got {mode!r}: "
                                f"{type(b).__name__}")
        super().__init__(primary.req_to_token_pool, primary.kv_pool, topk=primary.topk)
        for mode, b in routes.items():
            if b.req_to_token_pool is not primary.req_to_token_pool or b.kv_pool is not primary.kv_pool:
                raise ValueError(f"the backend for {mode.name} ({b.name}) must share the primary's pools")
            if mode.is_idle():
                raise ValueError("IDLE is not routed (it runs no kernel)")
        self.primary, self.routes = primary, dict(routes)
        others = sorted({b.name for b in self.routes.values()} - {primary.name})
        self.name = "+".join([primary.name] + others)
        self._current: AttentionBackend = primary

    def backend_for(self, mode: ForwardMode) -> AttentionBackend:
        """The backend that runs ``mode``."""
        return self.routes.get(mode, self.primary)

    @property
    def device_metadata(self) -> bool:  # noqa: D102
        """True when every backend it routes to builds its graph metadata on the device."""
        return all(b.device_metadata for b in self._distinct())

    def _distinct(self):
        seen = {id(self.primary): self.primary}
        for b in self.routes.values():
            seen.setdefault(id(b), b)
        return list(seen.values())

    def supports(self, mode: ForwardMode, *, graph: bool, kind: AttentionKind) -> bool:  # noqa: D102
        """What :meth:`backend_for` ``(mode)`` supports (instance method: it depends on the routes)."""
        return self.backend_for(mode).supports(mode, graph=graph, kind=kind)

    def _select(self, batch: ForwardBatch) -> AttentionBackend:
        self._current = self.backend_for(batch.forward_mode)
        return self._current

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        b = self._select(batch)
        b.init_forward_metadata(batch)
        self.forward_metadata = b.forward_metadata

    def init_graph_buffers(self, capacity: GraphCapacity) -> None:
        """Every distinct backend's static state, each sized the same."""
        for b in self._distinct():
            b.init_cuda_graph_state(capacity.max_bs, capacity.max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        b = self._select(batch)
        b.init_forward_metadata_capture_cuda_graph(batch)
        self.forward_metadata = b.forward_metadata

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        b = self._select(batch)
        b.init_forward_metadata_replay_cuda_graph(batch)
        self.forward_metadata = b.forward_metadata

    def init_forward_metadata_in_capture(self, batch: ForwardBatch) -> None:
        b = self._select(batch)
        b.init_forward_metadata_in_capture(batch)
        self.forward_metadata = b.forward_metadata

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        """The routed backend's ``forward`` (its checks, its KV write, its kernel).  The mode's
        backend is looked up again, so a forward whose metadata came from another mode's
        builder fails there rather than running on stale metadata."""
        b = self.backend_for(batch.forward_mode)
        if b is not self._current:
            raise RuntimeError(f"{batch.forward_mode.name} runs on {b.name}, but the last metadata "
                               f"was built by {self._current.name}: call init_forward_metadata first")
        return b.forward(q, k, v, layer, batch, save_kv_cache)

    def _forward(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        return self.backend_for(batch.forward_mode)._forward(q, layer, batch)
