"""``TritonBackend``: MHA/GQA attention in Triton for every mode, eager and CUDA graph.

Kernels: :mod:`specattn.triton_kernels.attention` (one kernel for every mode; its module
docstring has the layout).  MLA (absorbed, 512 + 64: decode, extend, tree verify) is the next
step of issue 6; ``supports(..., kind=MLA)`` is False until then.

Metadata (:class:`TritonMetadata`), derived on the device from the batch alone with ONE
builder (:func:`fill_triton_metadata`) used by eager, capture and replay -- only where it
writes differs (fresh tensors in eager, the static buffers of ``init_cuda_graph_state`` in
graph mode):

- ``qo_indptr`` int32 ``[bs + 1]`` = ``[0, cumsum(extend_lens)]`` (token offsets);
- ``seq_lens`` int32 ``[bs]`` = ``P`` (committed keys before this forward; the kernel reads
  keys ``req_to_token[r, 0 : P + n]``, this forward's included);
- ``req_pool_indices`` int64 ``[bs]``;
- ``tree_mask`` int32 ``[bs, D, ceil(D/32)]`` (TARGET_VERIFY only, else None);
- host ints fixed per batch shape: ``max_q`` (grid bound: ``num_tokens_per_req`` for
  TARGET_VERIFY / DRAFT_EXTEND_V2, 1 for DECODE, the host maximum of ``extend_lens`` for
  EXTEND) and ``max_prefix`` (eager only: host maximum of ``seq_lens``, for the split-KV
  choice; None in graph mode, where no device value may reach the host).

Worked example (the TARGET_VERIFY batch of :mod:`~specattn.backends.forward_batch`, bs = 2,
``D = 3``, ``req_pool_indices = [3, 0]``, ``seq_lens = [8, 5]``)::

    qo_indptr = [0, 3, 6]      seq_lens = [8, 5]      req_pool_indices = [3, 0]
    tree_mask = [[[1], [3], [7]], [[1], [3], [5]]]    max_q = 3
    token 2 of request 1: keys req_to_token[0, 0:5] (prefix) + req_to_token[0, 5 + {0, 2}]

EXTEND of that module's example: ``qo_indptr = [0, 3, 5]``, ``seq_lens = [4, 2]``,
``max_q = 3``; DECODE: ``qo_indptr = [0, 1, 2]``, ``max_q = 1``; DRAFT_EXTEND_V2:
``qo_indptr = [0, 3, 6]``, ``max_q = 3``, causal.

CUDA graphs: ``init_cuda_graph_state(max_bs, max_num_tokens)`` allocates the static buffers
(``qo_indptr [max_bs + 1]``, ``seq_lens [max_bs]``, ``req_pool_indices [max_bs]``, a tree-mask
area of ``max_num_tokens * ceil(max_num_tokens / 32)`` int32 words).  Capture and replay run
the same builder into views of them (device copies and a cumsum only; no host sync, no
allocation).  Padded requests (``seq_lens = 0``, ``req_pool_indices = 0``, ``n = D``) read
some valid slots and write only their own (discarded) output rows.  The kernel grid depends
only on ``(bs, max_q, num_kv_heads, group, num_splits)``, all static per captured graph.
The static buffers are shared by every graph of this backend (the replay of a graph rewrites
them just before it runs).

Split-KV: DECODE, TARGET_VERIFY and DRAFT_EXTEND_V2 split the prefix when the batch alone
would launch fewer programs than ~2 waves of the GPU's SMs (eager also bounds the splits by
``max_prefix / 256``); ``num_kv_splits=`` forces a count (tests).  EXTEND never splits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton  # noqa: F401  (a missing triton makes create_backend("triton") say so)

from .base import AttentionBackend
from .forward_batch import ForwardBatch
from .forward_mode import ForwardMode
from .layer import AttentionKind, AttentionLayer
from .tree_mask import num_mask_words

__all__ = ["TritonBackend", "TritonMetadata", "fill_triton_metadata"]

MAX_KV_SPLITS = 16
MIN_SPLIT_KEYS = 256


@dataclass
class TritonMetadata:
    """See the module docstring.  Tensors on the batch's device."""

    mode: ForwardMode
    qo_indptr: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    tree_mask: Optional[torch.Tensor]
    max_q: int
    max_prefix: Optional[int]

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]


def fill_triton_metadata(batch: ForwardBatch, md: TritonMetadata) -> TritonMetadata:
    """Write ``batch``'s metadata into ``md``'s tensors (sized for ``batch.batch_size``
    requests) and return ``md``.  Device work only: copies and one cumsum."""
    md.qo_indptr[:1].zero_()
    torch.cumsum(batch.extend_lens, 0, dtype=torch.int32, out=md.qo_indptr[1:])
    md.seq_lens.copy_(batch.seq_lens)
    md.req_pool_indices.copy_(batch.req_pool_indices)
    if md.tree_mask is not None:
        md.tree_mask.copy_(batch.tree_mask)
    return md


def _max_q_static(batch: ForwardBatch) -> int:
    """Tokens per request fixed by the mode (graph mode), else raise."""
    mode = batch.forward_mode
    if mode.has_fixed_tokens_per_req():
        return int(batch.num_tokens_per_req)
    if mode == ForwardMode.DECODE:
        return 1
    raise ValueError(f"{mode.name} has no static tokens per request")


class TritonBackend(AttentionBackend):
    """MHA/GQA Triton backend (see the module docstring).

    Args:
        req_to_token_pool, kv_pool: the pools (``MHATokenToKVPool``; an MLA pool builds but
            ``supports`` answers False and ``forward`` raises ``UnsupportedError``).
        num_kv_splits: force the split-KV factor (1 = never split) for the modes that split;
            None picks it from the batch shape and the GPU's SM count (1 on CPU).
    """

    name = "triton"

    def __init__(self, req_to_token_pool, kv_pool, num_kv_splits: Optional[int] = None):
        super().__init__(req_to_token_pool, kv_pool)
        if num_kv_splits is not None and not 1 <= num_kv_splits <= 64:
            raise ValueError(f"num_kv_splits must be in [1, 64], got {num_kv_splits}")
        self.num_kv_splits = num_kv_splits
        self._g = None
        dev = req_to_token_pool.device
        self._num_sms = (torch.cuda.get_device_properties(dev).multi_processor_count
                         if dev.type == "cuda" else 0)

    # --------------------------------------------------------------- capability
    @classmethod
    def supports(cls, mode: ForwardMode, *, graph: bool, kind: AttentionKind) -> bool:
        """MHA/GQA: every mode eager; DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2 and IDLE in
        CUDA graphs (EXTEND is variable-length).  MLA: not yet (issue 6, next step)."""
        if kind != AttentionKind.MHA:
            return False
        return (not graph) or mode.is_cuda_graph()

    # --------------------------------------------------------------- eager
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Eager metadata (one host read of ``extend_lens``/``seq_lens`` maxima unless the
        batch carries CPU copies).  Raises ValueError when a request's ``P + n`` exceeds the
        ``req_to_token`` width."""
        mode = batch.forward_mode
        if mode == ForwardMode.IDLE:
            self.forward_metadata = None
            return
        bs, dev = batch.batch_size, batch.device
        P = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
        n = batch.extend_lens_cpu if batch.extend_lens_cpu is not None else batch.extend_lens.cpu()
        max_q = int(n.max()) if bs else 0
        max_prefix = int(P.max()) if bs else 0
        max_kv = int((P.long() + n.long()).max()) if bs else 0
        if max_kv > self.req_to_token_pool.max_context_len:
            raise ValueError(f"a request needs {max_kv} KV positions, req_to_token has "
                             f"{self.req_to_token_pool.max_context_len}")
        tm = None
        if mode == ForwardMode.TARGET_VERIFY:
            D = batch.num_tokens_per_req
            tm = torch.empty(bs, D, num_mask_words(D), dtype=torch.int32, device=dev)
        md = TritonMetadata(mode, torch.empty(bs + 1, dtype=torch.int32, device=dev),
                            torch.empty(bs, dtype=torch.int32, device=dev),
                            torch.empty(bs, dtype=torch.int64, device=dev), tm, max_q, max_prefix)
        self.forward_metadata = fill_triton_metadata(batch, md)

    # --------------------------------------------------------------- graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static metadata buffers for graphs of up to ``max_bs`` requests and
        ``max_num_tokens`` tokens (module docstring)."""
        dev = self.req_to_token_pool.device
        self._g = dict(
            max_bs=max_bs, max_num_tokens=max_num_tokens,
            qo_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            req_pool_indices=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            tree_mask=torch.zeros(max_num_tokens * num_mask_words(max_num_tokens),
                                  dtype=torch.int32, device=dev))

    def _graph_metadata(self, batch: ForwardBatch) -> Optional[TritonMetadata]:
        mode = batch.forward_mode
        if mode == ForwardMode.IDLE:
            return None
        if self._g is None:
            raise RuntimeError("init_cuda_graph_state was not called")
        g, bs = self._g, batch.batch_size
        max_q = _max_q_static(batch)
        if bs > g["max_bs"] or bs * max_q > g["max_num_tokens"]:
            raise ValueError(f"graph batch ({bs} requests x {max_q}) exceeds "
                             f"init_cuda_graph_state({g['max_bs']}, {g['max_num_tokens']})")
        tm = None
        if mode == ForwardMode.TARGET_VERIFY:
            W = num_mask_words(max_q)
            tm = g["tree_mask"][:bs * max_q * W].view(bs, max_q, W)
        md = TritonMetadata(mode, g["qo_indptr"][:bs + 1], g["seq_lens"][:bs],
                            g["req_pool_indices"][:bs], tm, max_q, None)
        return fill_triton_metadata(batch, md)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        if not self.supports(batch.forward_mode, graph=True, kind=self.kind):
            raise ValueError(f"{batch.forward_mode.name} cannot be captured by {self.name} "
                             f"for {self.kind.name}")
        self.forward_metadata = self._graph_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self.forward_metadata = self._graph_metadata(batch)

    # --------------------------------------------------------------- forward
    def _num_splits(self, md: TritonMetadata, num_kv_heads: int, group: int) -> int:
        if md.mode == ForwardMode.EXTEND:
            return 1
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        if self._num_sms == 0:
            return 1
        from specattn.triton_kernels.attention import choose_block_m
        rows = md.max_q * group
        programs = -(-rows // choose_block_m(rows)) * num_kv_heads * md.batch_size
        splits = min(MAX_KV_SPLITS, max(1, (2 * self._num_sms) // max(programs, 1)))
        if md.max_prefix is not None:
            splits = min(splits, max(1, md.max_prefix // MIN_SPLIT_KEYS))
        return splits

    def _forward(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        from specattn.triton_kernels.attention import paged_attention
        md: Optional[TritonMetadata] = self.forward_metadata
        if md is None or md.mode != batch.forward_mode or md.batch_size != batch.batch_size:
            raise RuntimeError("init_forward_metadata was not called for this batch")
        k_cache = self.kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.kv_pool.get_value_buffer(layer.layer_id)
        splits = self._num_splits(md, layer.num_kv_heads, layer.group_size)
        if q.stride(2) != 1:
            q = q.contiguous()
        return paged_attention(q, k_cache, v_cache, self.req_to_token_pool.req_to_token,
                               md.req_pool_indices, md.seq_lens, md.qo_indptr, md.tree_mask,
                               md.max_q, layer.scaling, num_splits=splits)
