"""The ``AttentionBackend`` contract.

A backend is metadata builders plus kernels.  Per forward:

- eager: ``init_forward_metadata(batch)`` then ``forward(...)`` for each layer;
- CUDA graph: once ``init_cuda_graph_state(max_bs, max_num_tokens)``; per captured padded
  batch size, ``init_forward_metadata_capture_cuda_graph(batch)`` (outside the capture; binds
  the static metadata buffers) then the captured forwards; per replay,
  ``init_forward_metadata_replay_cuda_graph(batch)`` (writes the live batch's metadata into
  the same static buffers: device work only, no host sync) then ``graph.replay()``.

A runtime that captures whole rounds (``device_metadata`` backends) builds each forward's
metadata inside the capture with ``init_forward_metadata_in_capture(batch)``, which may read
the batch's tensors in place (they are the capture's own).

In graph mode ``batch`` is the graph runner's padded batch over its static input buffers
(see :class:`specattn.backends.cuda_graph.GraphInputBuffers`): ``batch_size`` is the padded
size; padded requests have ``prefix_lens = 0``, write their KV to the reserved slot 0 and their
outputs are discarded.

Callers ask ``supports(mode, graph=..., kind=...)`` before calling.  Eager metadata checks,
with one host read, that every row and slot its kernels will read lies in ``req_to_token``
and the KV pool and that the batch's host copies of the lengths are current; a ``forward``
on a batch of another mode, size or token count than the metadata's raises.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from specattn.ops.fp8 import FLOAT_DTYPES

from .forward_batch import ForwardBatch
from .forward_mode import ForwardMode
from .layer import AttentionKind, AttentionLayer


class UnsupportedError(NotImplementedError):
    """The backend does not support this mode / kind / graph combination."""


class UnsupportedConfigError(UnsupportedError, ValueError):
    """The backend's library cannot run these pools (dtype, head size, page size): both an
    :class:`UnsupportedError` (callers that route or skip catch it) and a ValueError."""


@dataclass(frozen=True)
class GraphCapacity:
    """The most requests (``max_bs``) and tokens (``max_num_tokens``) one CUDA-graph forward of
    a backend may carry: what :meth:`AttentionBackend.init_cuda_graph_state` sized its static
    buffers for."""

    max_bs: int
    max_num_tokens: int


class AttentionBackend(ABC):
    """Base class.  Subclasses implement the builders and ``_forward`` (per mode or not).

    Args:
        req_to_token_pool: :class:`~specattn.backends.pools.ReqToTokenPool`.
        kv_pool: :class:`~specattn.backends.pools.MHATokenToKVPool` or ``MLATokenToKVPool``.
        topk: the drafter's top-k when known, a promise about every TARGET_VERIFY this
            instance will run: ``1`` means chain drafts (backends with a faster or only a
            causal verify use it, e.g. FlashInfer / FlashMLA on MLA); ``None`` (default):
            any tree.  Every backend accepts it, so a runtime can pass it to any of them.
    Raises:
        ValueError: ``topk`` not a positive int or None.
    """

    name = "base"
    #: True when the graph metadata builders (``init_forward_metadata_capture_cuda_graph`` /
    #: ``..._replay_cuda_graph``) are device work only that may itself be recorded inside a
    #: CUDA graph capture, with no host-side plan and no warm-up forward needed first.  A
    #: runtime can then capture a whole speculative round (several forwards of this backend
    #: with metadata rebuilt between them) as one graph.  False for backends whose library
    #: plans on the host at replay (FlashInfer) or needs a forward before capture (FlashMLA).
    device_metadata = False

    def __init__(self, req_to_token_pool, kv_pool, *, topk: Optional[int] = None):
        if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
            raise ValueError(f"topk must be a positive int or None, got {topk!r}")
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.topk = topk
        self.kind = AttentionKind.MLA if hasattr(kv_pool, "kv_lora_rank") else AttentionKind.MHA
        self.forward_metadata = None

    # --------------------------------------------------------------- capability
    @classmethod
    @abstractmethod
    def supports(cls, mode: ForwardMode, *, graph: bool, kind: AttentionKind) -> bool:
        """Whether ``forward`` works for this mode and attention kind, eager (``graph=False``)
        or inside a CUDA graph (``graph=True``)."""

    # --------------------------------------------------------------- metadata
    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Eager: compute this forward's metadata (host syncs allowed).  A call that raises
        must leave no metadata (:meth:`_metadata_or_none`), so the next :meth:`forward`
        raises instead of running the refused batch on an older batch's metadata."""

    def _metadata_or_none(self, build, batch: ForwardBatch) -> None:
        """Run ``build(batch)`` (which sets :attr:`forward_metadata`); on any exception clear
        the metadata and re-raise."""
        try:
            build(batch)
        except BaseException:
            self.forward_metadata = None
            raise

    #: set by :meth:`init_cuda_graph_state`
    graph_capacity: Optional[GraphCapacity] = None

    #: An upper bound of every request's ``prefix_lens`` in the forwards whose graph metadata
    #: is built while it is set (a runtime sets it around a capture and replays that graph
    #: only while the bound holds; None: unknown).  A backend may size its work by it (the
    #: Triton backend's split-KV count); results never depend on it.
    graph_prefix_bound: Optional[int] = None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the static metadata buffers for graphs of up to ``max_bs`` requests and
        ``max_num_tokens`` tokens: records :attr:`graph_capacity`, then the backend's
        :meth:`init_graph_buffers`.

        Raises:
            ValueError: a bound below 1.
        """
        if int(max_bs) < 1 or int(max_num_tokens) < 1:
            raise ValueError(f"init_cuda_graph_state needs max_bs and max_num_tokens >= 1, got "
                             f"{max_bs}, {max_num_tokens}")
        self.graph_capacity = GraphCapacity(int(max_bs), int(max_num_tokens))
        self.init_graph_buffers(self.graph_capacity)

    @abstractmethod
    def init_graph_buffers(self, capacity: GraphCapacity) -> None:
        """Allocate this backend's static metadata buffers for ``capacity`` (called by
        :meth:`init_cuda_graph_state`)."""

    def check_graph_batch(self, batch_size: int, num_tokens: int) -> GraphCapacity:
        """The one bound check of every graph-mode metadata builder: returns
        :attr:`graph_capacity`.

        Raises:
            RuntimeError: :meth:`init_cuda_graph_state` was not called.
            ValueError: ``batch_size`` or ``num_tokens`` exceeds it.
        """
        cap = self.graph_capacity
        if cap is None:
            raise RuntimeError("init_cuda_graph_state was not called")
        if batch_size > cap.max_bs or num_tokens > cap.max_num_tokens:
            raise ValueError(f"graph batch ({batch_size} requests, {num_tokens} tokens) exceeds "
                             f"init_cuda_graph_state({cap.max_bs}, {cap.max_num_tokens})")
        return cap

    @abstractmethod
    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Before capturing ``batch`` (a padded static batch): point the metadata at the
        static buffers and fill them."""

    @abstractmethod
    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        """Before a replay: recompute ``batch``'s metadata into the static buffers (device
        work only, no host sync, no allocation that the graph reads)."""

    def init_forward_metadata_in_capture(self, batch: ForwardBatch) -> None:
        """A forward's metadata built inside a whole-round capture (:attr:`device_metadata`
        backends; also the eager warm-up of that round): ``batch``'s tensors were made by
        the captured work itself, so at every replay they hold that replay's values at the
        same addresses, and a backend may read them in place instead of copying them into
        its static buffers (a launch saved per tensor and forward).  The default builds as
        :meth:`init_forward_metadata_capture_cuda_graph`."""
        self.init_forward_metadata_capture_cuda_graph(batch)

    # --------------------------------------------------------------- forward
    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        """Attention for ``batch``'s tokens at ``layer``.

        Args:
            q: ``[T, num_heads, head_dim]`` (MLA: ``[T, H, kv_lora_rank + qk_rope_head_dim]``).
            k, v: this forward's new K ``[T, num_kv_heads, head_dim]`` and V
                ``[T, num_kv_heads, v_head_dim]`` (MLA: the latent ``[T, 1, 576]`` as k, v
                ignored).  Written at ``batch.out_cache_loc`` when ``save_kv_cache``.
            save_kv_cache: False when the caller already wrote this forward's KV.
        Returns:
            ``[T, num_heads, v_head_dim]`` in ``q.dtype``.
        Raises:
            UnsupportedError: mode/kind not supported.  ValueError: shapes/devices off, ``q``
                not float32 / bfloat16 / float16, a layer that does not fit the pool.
            RuntimeError: metadata built for another batch (mode, size or token count) or
                none (also after an :meth:`init_forward_metadata` that raised).  Every check
                runs before this forward's KV is written.
        """
        mode = batch.forward_mode
        if layer.kind != self.kind:
            raise ValueError(f"layer is {layer.kind.name} but the pool is {self.kind.name}")
        self._check_layer_fits_pool(layer)
        if not self.supports(mode, graph=False, kind=layer.kind):
            raise UnsupportedError(f"{self.name} does not support {mode.name} for {layer.kind.name}")
        T = batch.num_tokens
        if not isinstance(q, torch.Tensor) or q.dtype not in FLOAT_DTYPES:
            raise ValueError(f"q must be a float32, bfloat16 or float16 tensor, got "
                             f"{getattr(q, 'dtype', type(q).__name__)}")
        if q.dim() != 3 or q.shape != (T, layer.num_heads, layer.head_dim):
            raise ValueError(f"q must be [{T}, {layer.num_heads}, {layer.head_dim}], got {list(q.shape)}")
        if q.device != batch.device:
            raise ValueError(f"q is on {q.device}, batch on {batch.device}")
        if mode.is_idle():
            return q.new_empty(0, layer.num_heads, layer.v_head_dim)
        if not self._metadata_fits(batch):
            raise RuntimeError("init_forward_metadata was not called for this batch")
        if save_kv_cache:
            if k is None or k.shape != (T, layer.num_kv_heads, layer.head_dim):
                raise ValueError(f"k must be [{T}, {layer.num_kv_heads}, {layer.head_dim}]")
            if layer.kind == AttentionKind.MHA:
                if v is None or v.shape != (T, layer.num_kv_heads, layer.v_head_dim):
                    raise ValueError(f"v must be [{T}, {layer.num_kv_heads}, {layer.v_head_dim}]")
                self.kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
            else:
                self.kv_pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k)
        return self._forward(q, layer, batch)

    @staticmethod
    def _host_lens(batch: ForwardBatch) -> tuple:
        """``(prefix_lens, extend_lens)`` on the host: the batch's CPU copies where it carries
        them, else one read of its device tensors; each must be ``[bs]``.

        Raises:
            ValueError: a host copy of another shape; in a fixed-count mode (TARGET_VERIFY,
                DRAFT_EXTEND_V2) an ``extend_lens`` entry other than ``num_tokens_per_req``
                (the graph path assumes it).
        """
        P = batch.prefix_lens_cpu if batch.prefix_lens_cpu is not None else batch.prefix_lens.cpu()
        n = batch.extend_lens_cpu if batch.extend_lens_cpu is not None else batch.extend_lens.cpu()
        bs = batch.batch_size
        if P.shape != (bs,) or n.shape != (bs,):
            raise ValueError(f"the batch's host copies of prefix_lens / extend_lens must be [{bs}], got "
                             f"{list(P.shape)} / {list(n.shape)}")
        D = batch.num_tokens_per_req
        if bs and batch.forward_mode.has_fixed_tokens_per_req() and bool((n != D).any()):
            raise ValueError(f"{batch.forward_mode.name} needs extend_lens == num_tokens_per_req = {D} for "
                             f"every request, got {n.tolist()}")
        return P, n

    def _check_batch_reads(self, batch: ForwardBatch, prefix_lens: torch.Tensor,
                           extend_lens: torch.Tensor) -> None:
        """Eager metadata's check of what the kernels will read, with one host read:
        ``prefix_lens`` / ``extend_lens`` are the host (CPU) lengths the metadata is built from
        (``[bs]`` integer tensors) and must equal the batch's device tensors; every request's
        ``P + n`` positions must fit ``req_to_token``'s width, its ``req_pool_indices`` row must
        be a row of it, and every slot those positions map to must lie in the KV pool.

        Raises:
            ValueError: the first violation, named.
        """
        bs = batch.batch_size
        if not bs:
            return
        dev = batch.device
        rtt = self.req_to_token_pool.req_to_token
        ends_host = prefix_lens.long() + extend_lens.long()
        max_kv = int(ends_host.max())
        if max_kv > rtt.shape[1]:
            raise ValueError(f"a request needs {max_kv} KV positions, req_to_token has {rtt.shape[1]}")
        rows = batch.req_pool_indices
        ends = ends_host.to(dev)
        width = max(max_kv, 1)
        used = torch.arange(width, device=dev)[None, :] < ends[:, None]
        slots = rtt[rows.clamp(0, rtt.shape[0] - 1), :width].long()
        big = torch.iinfo(torch.int64).max
        stale = ((batch.prefix_lens.long() != prefix_lens.to(dev).long()).any()
                 | (batch.extend_lens.long() != extend_lens.to(dev).long()).any())
        lo, hi, s_lo, s_hi, stale = torch.stack((rows.min(), rows.max(), torch.where(used, slots, big).min(),
                                                 torch.where(used, slots, -1).max(), stale.long())).tolist()
        if stale:
            raise ValueError("the batch's host copies of prefix_lens / extend_lens differ from its tensors")
        if lo < 0 or hi >= rtt.shape[0]:
            raise ValueError(f"req_pool_indices must be in [0, {rtt.shape[0]}), got [{lo}, {hi}]")
        num_slots = self.kv_pool.get_key_buffer(0).shape[0]
        if s_hi >= 0 and (s_lo < 0 or s_hi >= num_slots):
            raise ValueError(f"req_to_token holds slots [{s_lo}, {s_hi}] for this batch, outside the "
                             f"KV pool's [0, {num_slots})")

    def _check_layer_fits_pool(self, layer: AttentionLayer) -> None:
        """ValueError unless ``layer`` has a layer of the pool and its dims: ``layer_id`` in
        ``[0, layer_num)``, ``num_kv_heads`` dividing ``num_heads``; MHA the pool's KV heads,
        ``head_dim`` and ``v_head_dim``; MLA its ``kv_lora_rank`` and ``qk_rope_head_dim``,
        one KV head, ``head_dim = kv_lora_rank + qk_rope_head_dim`` and ``v_head_dim =
        kv_lora_rank``."""
        pool = self.kv_pool
        num_layers = getattr(pool, "layer_num", None)
        lid = layer.layer_id
        if num_layers is not None and (isinstance(lid, bool) or not isinstance(lid, int)
                                       or not 0 <= lid < num_layers):
            raise ValueError(f"layer_id must be an int in [0, {num_layers}), got {lid!r}")
        if layer.num_heads < 1 or layer.num_kv_heads < 1 or layer.num_heads % layer.num_kv_heads:
            raise ValueError(f"layer.num_kv_heads ({layer.num_kv_heads}) must divide layer.num_heads "
                             f"({layer.num_heads})")
        if layer.kind == AttentionKind.MLA:
            rank, rope = getattr(pool, "kv_lora_rank", None), getattr(pool, "qk_rope_head_dim", None)
            want = {"kv_lora_rank": rank, "qk_rope_head_dim": rope, "num_kv_heads": 1,
                    "head_dim": None if rank is None or rope is None else rank + rope, "v_head_dim": rank}
        else:
            want = {"num_kv_heads": getattr(pool, "head_num", None), "head_dim": getattr(pool, "head_dim", None),
                    "v_head_dim": getattr(pool, "v_head_dim", None)}
        for name, value in want.items():
            if value is not None and getattr(layer, name) != value:
                raise ValueError(f"layer.{name} = {getattr(layer, name)} but the KV pool has {value}")

    def _metadata_fits(self, batch: ForwardBatch) -> bool:
        """Whether ``self.forward_metadata`` was built for ``batch``: its forward mode here;
        backends whose metadata records more (batch size, token count) compare that too."""
        md = self.forward_metadata
        return md is not None and getattr(md, "mode", None) == batch.forward_mode

    @abstractmethod
    def _forward(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """Attention reading every key (this forward's included) from the cache."""
