"""``FlashMLABackend``: DeepSeek's FlashMLA dense decode kernel (module ``flash_mla`` from
sgl-flash-mla, extra ``flashmla``) behind the backend contract, absorbed MLA only.

What runs where:

==================  ===========================================================================
mode                kernel
==================  ===========================================================================
DECODE              ``flash_mla_with_kvcache`` (``s_q = 1``), page_size 64, SM90 legacy kernels
                    (``use_legacy=True``: upstream kept dense decode only on that side)
TARGET_VERIFY       chain drafts (``topk=1``): ``flash_mla_with_kvcache`` with ``s_q = D``,
                    ``causal=True`` (query ``j`` sees ``P + j + 1`` keys: bottom-right causal)
IDLE                nothing
==================  ===========================================================================

KV dtypes: bf16 and fp16 latents (queries are cast to the pool's dtype, the output back to the
query's).  No float8_e4m3fn pool: sgl-flash-mla's one dense fp8 decode (the legacy SM90
``fwd_kvcache_mla_fp8``, ``flash_mla_with_kvcache(..., is_fp8_kvcache=True)``) takes the plain
576-byte e4m3 latent but only with e4m3 queries as well ("query and key must have the same
dtype", per-tensor ``descale_q`` / ``descale_k``), i.e. it would quantize every query to 3
mantissa bits, which this backend does not do; its other fp8 kernels are sparse decoding over
DeepSeek's packed V3.2 / V4 / V4.1 formats (V3.2: 656 bytes a token, scales inline).  The
constructor refuses fp8 pools (:class:`~specattn.backends.base.UnsupportedConfigError`): the
triton backend reads fp8 caches in every mode, and flashinfer reads an fp8 MLA latent on SM90.

``supports(mode, graph, kind)`` says exactly that (eager and CUDA graph alike): tree
TARGET_VERIFY, EXTEND and DRAFT_EXTEND_V2 are not FlashMLA's.  A runtime routes them to
another backend over the same pools with :class:`~specattn.backends.routing.RoutedBackend`
(the engine sends them to ``triton``; SGLang likewise routes its FlashMLA backend's extend /
draft extend to a prefill path).

Metadata for FlashMLA (device ops only, no host sync, the same builder in eager, capture and
replay; see :func:`flashmla_block_table`):

- ``block_table`` int32 ``[bs, ceil(max_context_len / 64)]``: ``req_to_token[r, 64 k] // 64``,
  the page of each 64-token block (entries past a request's length are valid but unread);
- ``cache_seqlens`` int32 ``[bs] = P + n`` (``n`` = 1 or D);
- the tile-scheduler metadata (``get_mla_decoding_metadata``: ``tile_scheduler_metadata
  [num_sm_parts, 8]``, ``num_splits [bs + 1]``), computed on the GPU from ``cache_seqlens``;
  it depends on the layer's head count, so it is computed at the first forward of a batch.

CUDA graphs (DECODE, chain TARGET_VERIFY): static
``block_table [max_bs, ceil(W / 64)]`` and ``cache_seqlens [max_bs]``; the scheduler metadata
of a captured ``(mode, bs)`` lives in fixed buffers allocated by the warm-up forward before
the capture, and each replay recomputes it into them (``get_mla_decoding_metadata`` + copy).
Replay is device work only: no host sync.

Worked example (DECODE, bs = 2, ``req_pool_indices = [3, 0]``, ``prefix_lens = [100, 5]``,
request 0's tokens in pages 4 and 9, request 1's in page 2)::

    cache_seqlens = [101, 6]
    block_table   = [[4, 9, ...], [2, ...]]   (req_to_token[3, 0] // 64 = 4, [3, 64] // 64 = 9)
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from specattn.ops.checks import capturing
from specattn.ops.tree_mask import chain_tree_mask

from .base import AttentionBackend, GraphCapacity, UnsupportedConfigError, UnsupportedError
from .forward_batch import ForwardBatch
from .forward_mode import ForwardMode
from .layer import AttentionKind, AttentionLayer

__all__ = ["FlashMLABackend", "flashmla_block_table"]

INSTALL_HINT = 'pip install "specattn[flashmla]"'
PAGE_SIZE = 64
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 512, 64
DTYPES = (torch.bfloat16, torch.float16)


def flashmla_block_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         page_size: int = PAGE_SIZE, out: Optional[torch.Tensor] = None
                         ) -> torch.Tensor:
    """FlashMLA's page table: ``table[i, k] = req_to_token[req_pool_indices[i], k * page_size]
    // page_size`` (the pools put token ``p`` at offset ``p % page_size`` of its page).

    Args:
        req_to_token: int32 ``[rows, W]``.
        req_pool_indices: int ``[bs]``.
        out: optional int32 ``[>= bs, ceil(W / page_size)]`` buffer (the graph static one).
    Returns:
        int32 ``[bs, ceil(W / page_size)]`` (a view of ``out`` when given).  One gather, no sync.
    Raises:
        ValueError: ``out`` has the wrong dtype or shape.
    """
    bs, nb = req_pool_indices.shape[0], -(-req_to_token.shape[1] // page_size)
    if out is not None and (out.dtype != torch.int32 or out.dim() != 2 or out.shape[0] < bs
                            or out.shape[1] != nb):
        raise ValueError(f"out must be int32 [>= {bs}, {nb}], got {out.dtype} {list(out.shape)}")
    firsts = req_to_token[:, ::page_size].index_select(0, req_pool_indices.long())
    table = torch.div(firsts, page_size, rounding_mode="floor").to(torch.int32)
    if out is None:
        return table
    out[:bs].copy_(table)
    return out[:bs]


def _import_flash_mla():
    try:
        return importlib.import_module("flash_mla")
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.split(".")[0] != "flash_mla":
            raise ImportError(f"sgl-flash-mla is installed but needs {e.name} ({e})") from e
        raise ImportError(f"the flashmla backend needs sgl-flash-mla: {INSTALL_HINT}") from None
    except (OSError, RuntimeError) as e:  # the CUDA extension does not load here
        raise ImportError(f"sgl-flash-mla does not load here ({type(e).__name__}: {e})") from e


@dataclass
class _Sched:
    """Tile-scheduler metadata for one batch shape and head count."""

    heads: int
    tile_scheduler_metadata: torch.Tensor
    num_splits: torch.Tensor


@dataclass
class FlashMLAMetadata:
    """One forward's metadata."""

    mode: ForwardMode
    batch_size: int
    num_tokens: int = 0   # the batch's token count (a forward on another count is refused)
    s_q: int = 1
    block_table: Optional[torch.Tensor] = None
    cache_seqlens: Optional[torch.Tensor] = None
    sched: Optional[_Sched] = None
    graph_key: Optional[tuple] = None


@dataclass
class _GraphBuffers:
    max_bs: int
    max_num_tokens: int
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    sched: Dict[tuple, _Sched] = field(default_factory=dict)


class FlashMLABackend(AttentionBackend):
    """FlashMLA for absorbed MLA (see the module docstring).

    Args:
        req_to_token_pool, kv_pool: an :class:`~specattn.backends.pools.MLATokenToKVPool` with
            ``page_size = 64``, ``kv_lora_rank = 512``, ``qk_rope_head_dim = 64``, bf16/fp16
            (not float8_e4m3fn: see the module docstring), on an SM90 GPU (FlashMLA's dense
            decode exists only in its legacy SM90 kernels).
        topk: the drafter's top-k when known; ``topk=1`` (chains) lets this instance run
            TARGET_VERIFY (its ``supports`` says so), anything else leaves tree verify to
            another backend (:class:`~specattn.backends.routing.RoutedBackend`).
    Raises:
        UnsupportedConfigError: (a ValueError) an MHA pool, another page size / latent width,
            a float32 or float8_e4m3fn pool.
        ValueError: a CPU pool, a bad ``topk``.
        ImportError: sgl-flash-mla missing (names the extra) or without its SM90 kernels.
    """

    name = "flashmla"

    def __init__(self, req_to_token_pool, kv_pool, *, topk: Optional[int] = None):
        super().__init__(req_to_token_pool, kv_pool, topk=topk)
        _check_pools(req_to_token_pool, kv_pool, self.kind)
        self._fm = _import_flash_mla()
        if not self._fm.has_legacy():
            raise ImportError("this sgl-flash-mla build has no legacy (SM90 dense) kernels")
        self.supports = functools.partial(type(self).supports, topk=topk)
        self._g: Optional[_GraphBuffers] = None

    # --------------------------------------------------------------- capability
    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """None when this backend can be built here, else why not (package, GPU, SM90)."""
        try:
            fm = _import_flash_mla()
        except ImportError as e:
            return str(e)
        except Exception as e:
            return f"sgl-flash-mla does not import ({type(e).__name__}: {e})"
        if not torch.cuda.is_available():
            return "needs a CUDA GPU (torch.cuda.is_available() is False)"
        major, minor = torch.cuda.get_device_capability()
        if major != 9:
            return (f"FlashMLA's dense MLA decode runs on SM90 (Hopper) only; this GPU is "
                    f"SM{major}{minor}")
        if not fm.has_legacy():
            return "this sgl-flash-mla build has no legacy (SM90 dense) kernels"
        return None

    @classmethod
    def supports(cls, mode: ForwardMode, *, graph: bool, kind: AttentionKind,
                 topk: Optional[int] = None) -> bool:
        """MLA only: DECODE and IDLE, and TARGET_VERIFY when ``topk == 1`` (chains), eager and
        in CUDA graphs alike (``graph`` changes nothing).  EXTEND, DRAFT_EXTEND_V2 and tree
        TARGET_VERIFY: False (route them to another backend).  An instance answers for its
        own ``topk``."""
        if kind != AttentionKind.MLA:
            return False
        if mode.is_target_verify():
            return topk == 1
        return mode.is_decode() or mode.is_idle()

    def _require(self, mode: ForwardMode, graph: bool) -> None:
        if not self.supports(mode, graph=graph, kind=self.kind):
            what = "tree TARGET_VERIFY (build with topk=1 for chains)" \
                if mode.is_target_verify() else mode.name
            raise UnsupportedError(f"{self.name} does not run {what}; route it to another "
                                   f"backend over the same pools (RoutedBackend, as the engine "
                                   f"does with triton)")

    # --------------------------------------------------------------- metadata
    def _fill(self, batch: ForwardBatch, md: FlashMLAMetadata, g: Optional[_GraphBuffers]) -> None:
        rtt = self.req_to_token_pool.req_to_token
        bs = batch.batch_size
        md.block_table = flashmla_block_table(rtt, batch.req_pool_indices, PAGE_SIZE,
                                              out=None if g is None else g.block_table)
        kv_lens = (batch.prefix_lens + batch.extend_lens).to(torch.int32)
        if g is None:
            md.cache_seqlens = kv_lens
        else:
            md.cache_seqlens = g.cache_seqlens[:bs]
            md.cache_seqlens.copy_(kv_lens)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Eager metadata (one host read checks the batch; the scheduler metadata follows at the
        first forward).

        Raises:
            UnsupportedError: a mode FlashMLA does not run (see :meth:`supports`).
            ValueError: ``topk=1`` but the TARGET_VERIFY mask is not a chain (checked with one
            host read, eager only); a request longer than ``req_to_token``, a
            ``req_pool_indices`` row or a slot out of range, or stale host copies of the
            lengths (one host read).
        """
        self._metadata_or_none(self._init_eager_metadata, batch)

    def _init_eager_metadata(self, batch: ForwardBatch) -> None:
        mode = batch.forward_mode
        self._require(mode, graph=False)
        md = FlashMLAMetadata(mode, batch.batch_size, batch.num_tokens)
        self.forward_metadata = md
        if mode.is_idle() or batch.batch_size == 0:
            md.batch_size = 0
            return
        md.s_q = batch.num_tokens_per_req if mode.is_target_verify() else 1
        if mode.is_target_verify() and not torch.equal(
                batch.tree_mask, chain_tree_mask(md.s_q, batch.device).expand_as(batch.tree_mask)):
            raise ValueError("topk=1 promised chains, but the TARGET_VERIFY tree mask is not one")
        self._check_batch_reads(batch, *self._host_lens(batch))
        self._fill(batch, md, None)

    def init_graph_buffers(self, capacity: GraphCapacity) -> None:
        """Static ``block_table [max_bs, ceil(max_context_len / 64)]`` / ``cache_seqlens
        [max_bs]`` (int32); the scheduler buffers come with each captured batch's warm-up."""
        W = self.req_to_token_pool.max_context_len
        dev = self.req_to_token_pool.device
        max_bs, max_num_tokens = capacity.max_bs, capacity.max_num_tokens
        self._g = _GraphBuffers(max_bs, max_num_tokens,
                                torch.zeros(max_bs, -(-W // PAGE_SIZE), dtype=torch.int32, device=dev),
                                torch.zeros(max_bs, dtype=torch.int32, device=dev))

    def _graph_metadata(self, batch: ForwardBatch, capture: bool) -> FlashMLAMetadata:
        mode, bs = batch.forward_mode, batch.batch_size
        md = FlashMLAMetadata(mode, bs, batch.num_tokens)
        if mode.is_idle() or bs == 0:
            md.batch_size = 0
            return md
        md.s_q = batch.num_tokens_per_req if mode.is_target_verify() else 1
        self.check_graph_batch(bs, bs * md.s_q)
        g = self._g
        self._fill(batch, md, g)
        md.graph_key = (mode, bs)
        sched = g.sched.get(md.graph_key)
        if sched is not None:  # replay (or re-capture): recompute into the fixed buffers
            new = self._compute_sched(md, sched.heads)
            sched.tile_scheduler_metadata.copy_(new.tile_scheduler_metadata)
            sched.num_splits.copy_(new.num_splits)
            md.sched = sched
        elif not capture:
            raise RuntimeError(f"{mode.name} with {bs} requests was never captured with a "
                               f"warm-up forward")
        return md

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Fill the static buffers for ``batch``; the scheduler buffers come from the warm-up
        forward that must run before the capture.

        Raises:
            ValueError: mode not capturable here, or the batch exceeds the static buffers.
        """
        if not self.supports(batch.forward_mode, graph=True, kind=self.kind):
            raise ValueError(f"{batch.forward_mode.name} cannot be captured by {self.name}")
        self.forward_metadata = self._graph_metadata(batch, capture=True)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        """Recompute block table, lengths and scheduler metadata into the static buffers
        (device work only, no host sync)."""
        self.forward_metadata = self._graph_metadata(batch, capture=False)

    # --------------------------------------------------------------- forward
    def _compute_sched(self, md: FlashMLAMetadata, heads: int) -> _Sched:
        tile, splits = self._fm.get_mla_decoding_metadata(
            md.cache_seqlens, md.s_q * heads, 1, heads, False, None, use_legacy=True)
        return _Sched(heads, tile, splits)

    def _metadata_fits(self, batch: ForwardBatch) -> bool:
        md: Optional[FlashMLAMetadata] = self.forward_metadata
        return md is not None and md.mode == batch.forward_mode and (
            not md.batch_size or (md.batch_size == batch.batch_size and md.num_tokens == batch.num_tokens))

    def _forward(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        md: Optional[FlashMLAMetadata] = self.forward_metadata
        if not self._metadata_fits(batch):
            raise RuntimeError("init_forward_metadata was not called for this batch")
        if md.batch_size == 0:
            return q.new_empty(0, layer.num_heads, layer.v_head_dim)
        if layer.kv_lora_rank != KV_LORA_RANK or layer.qk_rope_head_dim != QK_ROPE_HEAD_DIM:
            raise ValueError(f"FlashMLA needs kv_lora_rank {KV_LORA_RANK} + qk_rope_head_dim "
                             f"{QK_ROPE_HEAD_DIM}, the layer has {layer.kv_lora_rank} + "
                             f"{layer.qk_rope_head_dim}")
        H = layer.num_heads
        if md.sched is None or md.sched.heads != H:
            if capturing():
                raise RuntimeError("FlashMLA's scheduler metadata must exist before a CUDA graph "
                                   "capture: run one forward (warm-up) after "
                                   "init_forward_metadata_capture_cuda_graph")
            md.sched = self._compute_sched(md, H)
            if md.graph_key is not None:
                self._g.sched[md.graph_key] = md.sched
        meta, _ = self._fm.get_mla_metadata()  # an empty FlashMLASchedMeta; ours go in
        meta.tile_scheduler_metadata = md.sched.tile_scheduler_metadata
        meta.num_splits = md.sched.num_splits
        bs, s_q = md.batch_size, md.s_q
        qq = q if q.dtype == self.kv_pool.dtype else q.to(self.kv_pool.dtype)
        qq = qq.contiguous().view(bs, s_q, H, layer.head_dim)
        k_cache = self.kv_pool.get_key_buffer(layer.layer_id).view(-1, PAGE_SIZE, 1,
                                                                    self.kv_pool.kv_cache_dim)
        out, _ = self._fm.flash_mla_with_kvcache(
            qq, k_cache, md.block_table, md.cache_seqlens, layer.v_head_dim, meta,
            softmax_scale=float(layer.scaling), causal=s_q > 1, use_legacy=True)
        out = out.reshape(bs * s_q, H, layer.v_head_dim)
        return out if out.dtype == q.dtype else out.to(q.dtype)


def _check_pools(req_to_token_pool, kv_pool, kind: AttentionKind) -> None:
    """Raise UnsupportedConfigError (a ValueError) for what FlashMLA cannot run (before importing it)."""
    if kind != AttentionKind.MLA:
        raise UnsupportedConfigError("FlashMLA runs absorbed MLA only: pass an MLATokenToKVPool")
    if kv_pool.page_size != PAGE_SIZE:
        raise UnsupportedConfigError(f"FlashMLA needs page_size {PAGE_SIZE}, the pool has {kv_pool.page_size}")
    if (kv_pool.kv_lora_rank, kv_pool.qk_rope_head_dim) != (KV_LORA_RANK, QK_ROPE_HEAD_DIM):
        raise UnsupportedConfigError(f"FlashMLA needs kv_lora_rank {KV_LORA_RANK} + qk_rope_head_dim "
                         f"{QK_ROPE_HEAD_DIM}, the pool has {kv_pool.kv_lora_rank} + "
                         f"{kv_pool.qk_rope_head_dim}")
    if kv_pool.dtype == torch.float8_e4m3fn:
        raise UnsupportedConfigError(
            "FlashMLA's dense decode reads a float8_e4m3fn latent only with fp8 queries "
            "(sgl-flash-mla's SM90 fwd_kvcache_mla_fp8: e4m3 query and cache, per-tensor "
            "descale_q / descale_k), and this backend does not quantize queries; its other fp8 "
            "kernels are sparse decoding over packed formats. For a float8_e4m3fn pool use the "
            "triton backend (it reads fp8 caches in every mode) or flashinfer (fp8 MLA on SM90)")
    if kv_pool.dtype not in DTYPES:
        raise UnsupportedConfigError(f"FlashMLA has no {kv_pool.dtype} kernels: use a bfloat16 or float16 "
                         f"pool (float32: the triton or torch_reference backend)")
    if req_to_token_pool.device.type != "cuda" or kv_pool.device != req_to_token_pool.device:
        raise ValueError(f"FlashMLA needs both pools on one CUDA device, got "
                         f"{req_to_token_pool.device} and {kv_pool.device}")
