"""``TorchReferenceBackend``: the oracle.  Plain PyTorch, float32 accumulation, every mode,
eager and CUDA graph, MHA/GQA and MLA, any page size, any device.  Obviously correct, not fast.

Metadata (one builder for eager, capture and replay): for ``bs`` requests padded to
``max_q`` queries and ``max_kv`` keys each,

- ``q_index [bs, max_q]`` int64: the token row of query ``j`` of request ``i``, or ``T`` for
  padding (a dummy row that is dropped);
- ``kv_slots [bs, max_kv]`` int64: ``req_to_token[req_pool_indices[i], :max_kv]``;
- ``mask [bs, max_q, max_kv]`` bool: query ``j`` may see key position ``k`` (the
  :mod:`~specattn.backends.forward_batch` table).

Eager uses the batch's true maxima; graphs use ``max_q = num_tokens_per_req`` (1 for
DECODE) and ``max_kv = req_to_token`` width, so shapes are static per padded batch size.
A query that sees no key (only padding can) outputs zeros.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from specattn.ops.tree_mask import unpack_tree_mask

from .base import AttentionBackend, GraphCapacity
from .forward_batch import ForwardBatch
from .forward_mode import ForwardMode
from .layer import AttentionKind, AttentionLayer


@dataclass
class RefMetadata:
    q_index: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor
    mode: Optional[ForwardMode] = None   # the batch's mode and token count: a forward on
    num_tokens: Optional[int] = None     # another batch is refused


def build_reference_metadata(req_to_token: torch.Tensor, batch: ForwardBatch, max_q: int,
                             max_kv: int) -> RefMetadata:
    """Dense metadata for ``batch`` (see the module docstring).  Device ops only, no host sync."""
    dev, bs, T = batch.device, batch.batch_size, batch.num_tokens
    P = batch.prefix_lens.long()
    n = batch.extend_lens.long()
    j = torch.arange(max_q, device=dev)
    p = torch.arange(max_kv, device=dev)
    q_valid = j[None, :] < n[:, None]                                   # [bs, max_q]
    q_index = torch.where(q_valid, (torch.cumsum(n, 0) - n)[:, None] + j, T)
    kv_slots = req_to_token[batch.req_pool_indices][:, :max_kv].long()  # [bs, max_kv]
    rel = p[None, None, :] - P[:, None, None]                           # [bs, 1, max_kv]
    visible = rel < 0                                                   # the prefix
    if batch.forward_mode.is_target_verify():
        D = batch.num_tokens_per_req
        tree = unpack_tree_mask(batch.tree_mask, D)                     # [bs, D, D]
        tree = torch.nn.functional.pad(tree, (0, 0, 0, max_q - D))      # rows up to max_q
        idx = rel.clamp(0, D - 1).expand(bs, max_q, max_kv)
        visible = visible | ((rel >= 0) & (rel < D) & torch.gather(tree, 2, idx))
    else:  # EXTEND, DECODE, DRAFT_EXTEND_V2: causal among the new tokens
        visible = visible | ((rel >= 0) & (rel <= j[None, :, None]))
    mask = visible & q_valid[:, :, None] & (rel < n[:, None, None])
    return RefMetadata(q_index, kv_slots, mask, batch.forward_mode, T)


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        md: RefMetadata, scaling: float, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> torch.Tensor:
    """``q [T, H, Dqk]``, caches ``[slots, Hkv, Dqk]`` / ``[slots, Hkv, Dv]`` -> ``[T, H, Dv]``
    in ``q.dtype``; float32 math on the dequantized keys and values (``cache.float() *
    scale``: the scales of an fp8 cache, 1.0 otherwise); query head ``h`` uses KV head
    ``h // (H // Hkv)``."""
    T, H, Dqk = q.shape
    Hkv, Dv = k_cache.shape[1], v_cache.shape[2]
    G = H // Hkv
    bs, max_q = md.q_index.shape
    qp = torch.cat([q.float(), q.new_zeros(1, H, Dqk, dtype=torch.float32)])
    qg = qp[md.q_index].view(bs, max_q, Hkv, G, Dqk)
    kg = k_cache[md.kv_slots].float() * k_scale                         # [bs, max_kv, Hkv, Dqk]
    vg = v_cache[md.kv_slots].float() * v_scale
    # slots of the gathered width no row of the request sees (past its keys: padding, other
    # requests' stale slots) read as 0, so a NaN there cannot reach it through a 0 weight
    vg = torch.where(md.mask.any(1)[:, :, None, None], vg, 0.0)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, kg) * scaling
    m = md.mask[:, None, None]
    s = s.masked_fill(~m, float("-inf"))
    w = torch.softmax(s, dim=-1)
    w = torch.where(m.any(-1, keepdim=True), w, torch.zeros_like(w))    # no visible key -> 0
    o = torch.einsum("bhgqk,bkhd->bqhgd", w, vg).reshape(bs * max_q, H, Dv)
    out = q.new_zeros(T + 1, H, Dv, dtype=torch.float32)
    out[md.q_index.flatten()] = o
    return out[:T].to(q.dtype)


class TorchReferenceBackend(AttentionBackend):
    """The oracle backend (see the module docstring)."""

    name = "torch_reference"
    device_metadata = True

    @classmethod
    def supports(cls, mode: ForwardMode, *, graph: bool, kind: AttentionKind) -> bool:
        return (not graph) or mode.is_cuda_graph()

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Eager metadata, after the batch's own checks (:meth:`ForwardBatch.validate`: the
        oracle refuses what the Triton backend refuses, and a token whose ``out_cache_loc``
        is not its ``req_to_token`` slot, which no backend would read back) and the reads'
        range checks.  A call that raises leaves no metadata, so the next :meth:`forward`
        raises too."""
        self.forward_metadata = None
        if batch.forward_mode.is_idle():
            return
        batch.validate()
        P, n = self._host_lens(batch)
        self._check_batch_reads(batch, P, n)   # also: P + n within req_to_token's width
        batch.check_slots(self.req_to_token_pool.req_to_token)   # out_cache_loc == req_to_token[r, P:P+n]
        max_q = int(n.max()) if len(n) else 0
        max_kv = int((P + n).max()) if len(n) else 0
        self.forward_metadata = build_reference_metadata(
            self.req_to_token_pool.req_to_token, batch, max_q, max_kv)

    # --------------------------------------------------------------- graphs
    def init_graph_buffers(self, capacity: GraphCapacity) -> None:
        dev, W = self.req_to_token_pool.device, self.req_to_token_pool.max_context_len
        self._g_q_index = torch.zeros(capacity.max_num_tokens, dtype=torch.int64, device=dev)
        self._g_kv_slots = torch.zeros(capacity.max_bs * W, dtype=torch.int64, device=dev)
        self._g_mask = torch.zeros(capacity.max_num_tokens * W, dtype=torch.bool, device=dev)

    def _graph_metadata(self, batch: ForwardBatch) -> RefMetadata:
        if batch.forward_mode.is_idle():
            return None
        bs, W = batch.batch_size, self.req_to_token_pool.max_context_len
        max_q = batch.num_tokens_per_req if batch.forward_mode.has_fixed_tokens_per_req() else 1
        self.check_graph_batch(bs, bs * max_q)
        md = build_reference_metadata(self.req_to_token_pool.req_to_token, batch, max_q, W)
        static = RefMetadata(self._g_q_index[:bs * max_q].view(bs, max_q),
                             self._g_kv_slots[:bs * W].view(bs, W),
                             self._g_mask[:bs * max_q * W].view(bs, max_q, W), md.mode, md.num_tokens)
        static.q_index.copy_(md.q_index)
        static.kv_slots.copy_(md.kv_slots)
        static.mask.copy_(md.mask)
        return static

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        if not self.supports(batch.forward_mode, graph=True, kind=self.kind):
            raise ValueError(f"{batch.forward_mode.name} cannot be captured")
        self.forward_metadata = self._graph_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self.forward_metadata = self._graph_metadata(batch)

    # --------------------------------------------------------------- forward
    def _metadata_fits(self, batch: ForwardBatch) -> bool:
        md: Optional[RefMetadata] = self.forward_metadata
        return (md is not None and md.mode == batch.forward_mode and md.q_index.shape[0] == batch.batch_size
                and md.num_tokens == batch.num_tokens)

    def _forward(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        md: Optional[RefMetadata] = self.forward_metadata
        if not self._metadata_fits(batch):
            raise RuntimeError("init_forward_metadata was not called for this batch")
        k_cache = self.kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.kv_pool.get_value_buffer(layer.layer_id)
        return reference_attention(q, k_cache, v_cache, md, layer.scaling,
                                   *self.kv_pool.kv_scales(layer.layer_id))
