"""``FlashInferBackend``: FlashInfer (flashinfer-python 0.7.2, extra ``flashinfer``) behind the
backend contract, eager and CUDA graph.

Kernels (FlashInfer's wrappers, NHD paged layout, ``backend="fa2"`` for MHA/GQA):

==================  ==========================================  ================================
mode                MHA / GQA                                   absorbed MLA
==================  ==========================================  ================================
EXTEND              ``BatchPrefillWithPagedKVCacheWrapper``     ``BatchMLAPagedAttentionWrapper``
                    causal                                      causal
DECODE              ``BatchDecodeWithPagedKVCacheWrapper``      ``BatchMLAPagedAttentionWrapper``
                    (tensor cores: the prefill JIT module)
TARGET_VERIFY       prefill wrapper, packed custom mask         chain only (``topk=1``): MLA
                    ``[D x (P + D)]`` built on the GPU          wrapper, causal; trees are not in
                                                                FlashInfer (``supports`` says no)
DRAFT_EXTEND_V2     prefill wrapper, causal                     MLA wrapper, causal
==================  ==========================================  ================================

``uniform_q_len = num_tokens_per_req`` is passed to the prefill plan for TARGET_VERIFY and
DRAFT_EXTEND_V2 (FlashInfer uses it for its CUDA-graph tile choice).

KV dtypes.  bf16 and fp16 pools: queries run in the pool's dtype.  ``float8_e4m3fn`` pools
(:mod:`specattn.ops.fp8`): queries stay 16-bit -- MHA/GQA in the query's dtype when it is
bf16/fp16 (else bf16), MLA in bf16 -- planned with ``kv_data_type=float8_e4m3fn``, and each
layer's scales from ``pool.kv_scales(layer_id)`` go to ``run`` as Python floats (constant per
layer, so CUDA graphs capture them): MHA ``k_scale`` / ``v_scale`` (FlashInfer folds
``k_scale`` into the softmax scale and multiplies the output by ``v_scale``), MLA ``ckv_scale``
= ``kpe_scale`` = the latent's scale (dequantized in the kernel, plan ``scale_mode=
"kv-per-tensor"``).  Where FlashInfer 0.7.2 runs that: MHA/GQA with the ``fa2`` kernels, every
mode (fa3 needs fp8 queries); MLA with its fa3/fa2 kernels on SM90 only, bf16 queries,
``kv_lora_rank = 512``, ``qk_rope_head_dim`` 64.  Elsewhere the constructor raises
:class:`~specattn.backends.base.UnsupportedConfigError` (the triton backend reads fp8 caches in
every mode).  The output is always in the query's dtype.  No float32 pools: FlashInfer has no
float32 attention.

Metadata, derived from the batch alone with the pure-torch builders below (they run on any
device; the backend runs them on the GPU, tests on the CPU), kv length = ``P + n``:

- :func:`paged_kv_layout`: ``qo_indptr``, ``kv_indptr`` (pages), ``kv_last_page_len``,
  ``kv_lens`` (int32);
- :func:`paged_kv_indices`: ``kv_indices[kv_indptr[i] + j] = req_to_token[r_i, j * page_size]
  // page_size`` (one gather, no loop over requests);
- :func:`flashinfer_packed_mask`: FlashInfer's packed custom mask (prefix bits all ones, then
  the tree bits) from our bit-packed rows, and its byte ``mask_indptr``.

Worked example (the TARGET_VERIFY batch of :mod:`~specattn.backends.forward_batch`: bs = 2,
page_size = 1, ``req_pool_indices = [3, 0]``, ``prefix_lens = [8, 5]``, D = 3)::

    qo_indptr = [0, 3, 6]    kv_lens = [11, 8]    kv_indptr = [0, 11, 19]
    kv_last_page_len = [1, 1]
    kv_indices = [10 11 12 13 20 21 22 23 24 25 26 | 7 8 30 31 32 33 34 35]
    mask_indptr = [0, 5, 8]  (ceil(3 * 11 / 8), ceil(3 * 8 / 8) bytes)
    packed mask = [255, 249, 223, 255, 1 | 63, 127, 191]
    (request 1, row 2 = 11111 101 -> bits little-endian = 0b10111111 = 191)

Plans.  FlashInfer plans on the host (``plan()`` reads host copies of the indptrs) and needs
the layer's head count (and, for MLA, its softmax scale), which ``init_forward_metadata`` does
not see: the backend plans as soon as it knows them -- at ``init_forward_metadata`` once any
forward has run, else at the first forward of the batch (the same plan serves every layer
with the same head count / scale; a layer that differs re-plans, eager only).  The host
arrays come from ``batch.prefix_lens_cpu`` / ``extend_lens_cpu`` when the batch carries them,
else from one device-to-host read of ``prefix_lens`` (the one host sync of a step).

CUDA graphs (DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2; IDLE trivially): ``init_cuda_graph_state``
allocates the static buffers (``qo_indptr``, ``kv_indptr``, ``kv_last_page_len``,
``kv_lens``, ``kv_indices`` for ``max_bs * ceil(max_context_len / page_size)`` pages,
``mask_indptr`` and the packed-mask words for ``max_num_tokens * max_context_len`` bits).
Capture of ``(mode, bs)`` builds FlashInfer wrappers with ``use_cuda_graph=True`` bound to
views of those buffers; the builders write into them; the plan happens at capture when the
head count is known, else in the warm-up forward before the capture (a first forward
*inside* a capture raises).  Replay recomputes the metadata into the same buffers (device
ops), then plans on the host -- outside the captured region, as FlashInfer's own design
does -- with the one host read of ``prefix_lens`` above.

FlashInfer 0.7.2's ``plan(packed_custom_mask=...)`` stores a ``mask_indptr`` in *bits*
(``cumsum(qo_len * kv_len)``) while its kernel reads it as a *byte* offset
(flashinfer-ai/flashinfer PR #2201); after each plan the backend writes the byte offsets into
the wrapper's mask-indptr buffer (:func:`install_mask_indptr`; a no-op if FlashInfer already
wrote the same).
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from specattn.ops.checks import capturing
from specattn.ops.tree_mask import chain_tree_mask, flashinfer_mask_bytes, unpack_tree_mask

from .base import AttentionBackend, GraphCapacity, UnsupportedConfigError, UnsupportedError
from .forward_batch import ForwardBatch
from .forward_mode import ForwardMode
from .layer import AttentionKind, AttentionLayer

__all__ = ["FlashInferBackend", "PagedKVLayout", "paged_kv_layout", "paged_kv_indices",
           "flashinfer_packed_mask", "install_mask_indptr"]

INSTALL_HINT = 'pip install "specattn[flashinfer]"'
WORKSPACE_BYTES = 128 * 2**20
FP8 = torch.float8_e4m3fn
DTYPES = (torch.bfloat16, torch.float16, FP8)   # KV pool dtypes (fp8: see the module docstring)
QUERY_DTYPES = (torch.bfloat16, torch.float16)  # what the kernels compute in
MHA_HEAD_DIMS = (64, 128, 256)
FP8_MLA_BACKENDS = ("auto", "fa3", "fa2")       # the MLA kernels that read an fp8 latent
FP8_MLA_DIMS = (512, 64)                        # kv_lora_rank, qk_rope_head_dim they take


# ------------------------------------------------------------------ pure-torch builders
@dataclass
class PagedKVLayout:
    """FlashInfer's paged-KV description of a batch; int32 tensors on one device.

    ``qo_indptr [bs + 1]`` (tokens), ``kv_indptr [bs + 1]`` (pages), ``kv_last_page_len
    [bs]`` (1 .. page_size), ``kv_lens [bs] = P + n`` (tokens)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: torch.Tensor

    @property
    def num_pages(self) -> int:
        """Total pages ``kv_indptr[-1]`` (a host read when the layout is on the GPU)."""
        return int(self.kv_indptr[-1])


def paged_kv_layout(prefix_lens: torch.Tensor, extend_lens: torch.Tensor, page_size: int
                    ) -> PagedKVLayout:
    """Indptrs of a batch from the one convention (kv length = ``P + n``).

    Args:
        prefix_lens: int ``[bs]``, ``P`` = committed KV before the forward (tokens).
        extend_lens: int ``[bs]``, ``n`` = this forward's tokens, >= 1.
        page_size: tokens per KV page (>= 1).
    Returns:
        :class:`PagedKVLayout` on the inputs' device (device ops only, no host sync).
    Raises:
        ValueError: shapes differ or ``page_size < 1``.
    """
    if page_size < 1 or prefix_lens.shape != extend_lens.shape or prefix_lens.dim() != 1:
        raise ValueError(f"need prefix_lens/extend_lens of one shape [bs] and page_size >= 1, got "
                         f"{list(prefix_lens.shape)}, {list(extend_lens.shape)}, {page_size}")
    dev = prefix_lens.device
    P, n = prefix_lens.long(), extend_lens.to(dev).long()
    kv = P + n
    pages = (kv + page_size - 1) // page_size
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    qo_indptr = torch.cat([zero, torch.cumsum(n, 0)]).int()
    kv_indptr = torch.cat([zero, torch.cumsum(pages, 0)]).int()
    last = (kv - (pages - 1).clamp_min(0) * page_size).int()
    return PagedKVLayout(qo_indptr, kv_indptr, last, kv.int())


def paged_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     kv_indptr: torch.Tensor, page_size: int, num_pages: int,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Page ids of every request's KV, concatenated: ``kv_indices[kv_indptr[i] + j] =
    req_to_token[req_pool_indices[i], j * page_size] // page_size`` (the pools put token
    ``p`` of a request at offset ``p % page_size`` of its page, so the first slot of each
    page names it).  One gather, no loop over requests, no host sync.

    Args:
        req_to_token: int32 ``[rows, max_context_len]``.
        req_pool_indices: int ``[bs]``.
        kv_indptr: int32 ``[bs + 1]`` from :func:`paged_kv_layout`, same device.
        num_pages: ``kv_indptr[-1]`` as a host int (the caller knows it from host lengths).
        out: optional int32 buffer with at least ``num_pages`` entries (CUDA-graph static).
    Returns:
        int32 ``[num_pages]`` (a view of ``out`` when given).
    Raises:
        ValueError: ``out`` too small or not int32.
    """
    dev = req_to_token.device
    if out is not None and (out.dtype != torch.int32 or out.numel() < num_pages):
        raise ValueError(f"out must be int32 with >= {num_pages} entries, got {out.dtype} "
                         f"{out.numel()}")
    bs = req_pool_indices.shape[0]
    if num_pages == 0 or bs == 0:
        return out[:0] if out is not None else torch.zeros(0, dtype=torch.int32, device=dev)
    starts = kv_indptr[:-1].long()
    pages_per_req = kv_indptr[1:].long() - starts
    req = torch.repeat_interleave(torch.arange(bs, device=dev), pages_per_req, output_size=num_pages)
    j = torch.arange(num_pages, device=dev) - starts[req]
    slots = req_to_token[req_pool_indices.long()[req], j * page_size]
    pages = torch.div(slots, page_size, rounding_mode="floor").to(torch.int32)
    if out is None:
        return pages
    out[:num_pages].copy_(pages)
    return out[:num_pages]


def flashinfer_packed_mask(tree_mask: torch.Tensor, prefix_lens: torch.Tensor, num_bytes: int,
                           out_words: Optional[torch.Tensor] = None
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's packed custom mask for TARGET_VERIFY, built from our bit-packed rows.

    Request ``i`` attends with ``D`` queries to ``P_i + D`` keys: the row-major ``[D, P_i + D]``
    bool mask (``P_i`` ones -- the prefix is always visible -- then row ``j`` of the tree mask)
    is packed little-endian into bytes (bit ``t`` of byte ``b`` = element ``8b + t``), each
    request padded to a whole byte with zero bits, segments back to back.  This is what
    :func:`specattn.ops.tree_mask.tree_mask_to_flashinfer` computes with a loop; here it
    is a handful of device ops: start from all ones, clear the tree's zero bits and the
    padding bits with one ``index_add_`` into 32-bit words, no host sync.

    Args:
        tree_mask: int32 ``[bs, D, ceil(D/32)]``.
        prefix_lens: int ``[bs]`` (``P``), on ``tree_mask``'s device.
        num_bytes: ``sum(ceil(D * (P_i + D) / 8))`` as a host int (the caller has ``P`` on the
            host for the plan anyway; see :func:`specattn.ops.tree_mask.flashinfer_mask_bytes`).
        out_words: optional int32 buffer of at least ``ceil(num_bytes / 4)`` words to write
            into (the CUDA-graph static buffer); its uint8 view is the mask.
    Returns:
        ``(packed uint8 [num_bytes], mask_indptr int32 [bs + 1])`` (byte offsets).
    Raises:
        ValueError: wrong dtypes/shapes or ``out_words`` too small.
    """
    if tree_mask.dtype != torch.int32 or tree_mask.dim() != 3:
        raise ValueError(f"tree_mask must be int32 [bs, D, W], got {tree_mask.dtype} "
                         f"{list(tree_mask.shape)}")
    bs, D = tree_mask.shape[0], tree_mask.shape[1]
    dev = tree_mask.device
    if prefix_lens.shape != (bs,):
        raise ValueError(f"prefix_lens must be [{bs}], got {list(prefix_lens.shape)}")
    nwords = (num_bytes + 3) // 4
    if out_words is not None and (out_words.dtype != torch.int32 or out_words.dim() != 1
                                  or out_words.numel() < nwords or not out_words.is_contiguous()):
        raise ValueError(f"out_words must be a contiguous int32 [>= {nwords}] buffer")
    P = prefix_lens.to(dev).long()
    indptr = torch.zeros(bs + 1, dtype=torch.int64, device=dev)
    torch.cumsum(flashinfer_mask_bytes(P, D), 0, out=indptr[1:])
    clear = torch.zeros(max(nwords, 1), dtype=torch.int64, device=dev)  # bits to clear, per word
    if bs and D:
        dense = unpack_tree_mask(tree_mask, D)                              # [bs, D, D] bool
        ar = torch.arange(D, device=dev)
        row = P + D                                                         # bits per mask row
        bit = ((indptr[:-1] * 8 + P)[:, None, None] + ar[None, :, None] * row[:, None, None]
               + ar[None, None, :])                                         # [bs, D, D]
        clear.index_add_(0, (bit >> 5).flatten(),
                         ((~dense).long() << (bit & 31)).flatten())
        tail = (indptr[:-1] * 8 + D * row)[:, None] + torch.arange(8, device=dev)[None, :]
        pad = tail < indptr[1:, None] * 8                                   # [bs, 8]
        clear.index_add_(0, (tail >> 5).clamp_max(clear.numel() - 1).flatten(),
                         (pad.long() << (tail & 31)).flatten())
    words = (~clear) & 0xFFFFFFFF
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)[:nwords]
    if out_words is None:
        out_words = words
    else:
        out_words[:nwords].copy_(words)
    return out_words[:nwords].view(torch.uint8)[:num_bytes], indptr.to(torch.int32)


def install_mask_indptr(wrapper, mask_indptr: torch.Tensor) -> None:
    """After ``wrapper.plan(..., packed_custom_mask=...)``: write the BYTE offsets of each
    request's mask segment (``mask_indptr`` int32 ``[bs + 1]``, from
    :func:`flashinfer_packed_mask`) into the wrapper's mask indptr buffer.

    FlashInfer 0.7.2's plan stores that indptr in *bits* (``cumsum(qo_len * kv_len)``) while
    its kernel adds it to a byte pointer (flashinfer-ai/flashinfer PR #2201: requests after
    the first read the wrong bits); a no-op where FlashInfer already wrote the same.  Device
    copy only, no host sync.

    Raises:
        RuntimeError: the wrapper has no ``_mask_indptr_buf`` of ``mask_indptr``'s shape (a
            FlashInfer whose internals moved: check that PR).
    """
    buf = getattr(wrapper, "_mask_indptr_buf", None)
    if not isinstance(buf, torch.Tensor) or buf.shape != mask_indptr.shape:
        raise RuntimeError(f"this FlashInfer wrapper has no _mask_indptr_buf of shape "
                           f"{tuple(mask_indptr.shape)}; the packed-mask offset fix (flashinfer "
                           f"PR #2201) is written for flashinfer-python 0.7.2")
    buf.copy_(mask_indptr)


# ------------------------------------------------------------------ the backend
def _import_flashinfer():
    try:
        return importlib.import_module("flashinfer")
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.split(".")[0] != "flashinfer":
            raise ImportError(f"flashinfer-python is installed but needs {e.name} ({e}); "
                              f"reinstall with {INSTALL_HINT}") from e
        raise ImportError(f"the flashinfer backend needs flashinfer-python: {INSTALL_HINT}") from None


@dataclass
class _Host:
    """Host copies the plan reads (CPU int32)."""

    layout: PagedKVLayout
    num_pages: int
    mask_bytes: int
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor


@dataclass
class _GraphState:
    """One captured ``(mode, bs)``: its wrapper and the plan key it was captured with."""

    wrapper: object
    key: Optional[tuple] = None


@dataclass
class FlashInferMetadata:
    """One forward's metadata (see the module docstring).  Device tensors are fresh in eager
    mode and views of the static buffers in graph mode."""

    mode: ForwardMode
    batch_size: int
    num_tokens_per_req: Optional[int]
    num_tokens: int = 0   # the batch's token count (a forward on another count is refused)
    host: Optional[_Host] = None
    layout: Optional[PagedKVLayout] = None
    kv_indices: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None
    wrapper: object = None
    graph_state: Optional[_GraphState] = None
    planned_key: Optional[tuple] = None

    @property
    def empty(self) -> bool:
        return self.batch_size == 0


@dataclass
class _GraphBuffers:
    max_bs: int
    max_num_tokens: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    kv_indices: torch.Tensor
    mask_indptr: torch.Tensor
    mask_words: Optional[torch.Tensor] = None
    states: Dict[tuple, _GraphState] = field(default_factory=dict)


class FlashInferBackend(AttentionBackend):
    """FlashInfer behind the contract (see the module docstring).

    Args:
        req_to_token_pool, kv_pool: the pools, on a CUDA device; bf16/fp16 KV, or
            ``float8_e4m3fn`` KV where FlashInfer reads it (MHA: ``prefill_backend="fa2"``; MLA:
            an SM90 GPU, 512 + 64 latents, ``mla_backend`` auto/fa3/fa2).  MHA: ``head_dim`` in
            (64, 128, 256) and ``v_head_dim == head_dim``.  MLA: ``kv_lora_rank % 128 == 0``
            and ``qk_rope_head_dim % 64 == 0`` (FlashInfer's MLA).
        topk: the drafter's top-k when known.  ``topk=1`` promises chain drafts, which lets
            MLA run TARGET_VERIFY (causal) and makes this instance's ``supports`` say so.
        workspace_bytes: FlashInfer's float workspace (shared by this backend's wrappers).
        prefill_backend: FlashInfer kernel family for MHA/GQA (``"fa2"``: custom masks and
            ``uniform_q_len``; the decode wrapper uses the same JIT module).
        mla_backend: ``BatchMLAPagedAttentionWrapper`` backend (``"auto"``: fa3 on SM90).
    Raises:
        UnsupportedConfigError: (a ValueError) a pool FlashInfer cannot run: float32, dims, an
            fp8 pool where its kernels take none (see the module docstring).
        ValueError: pools not on one CUDA device, or a bad ``topk``.
        ImportError: flashinfer-python missing (names the extra to install).
    """

    name = "flashinfer"

    def __init__(self, req_to_token_pool, kv_pool, *, topk: Optional[int] = None,
                 workspace_bytes: int = WORKSPACE_BYTES, prefill_backend: str = "fa2",
                 mla_backend: str = "auto"):
        super().__init__(req_to_token_pool, kv_pool, topk=topk)
        _check_pools(req_to_token_pool, kv_pool, self.kind, prefill_backend=prefill_backend,
                     mla_backend=mla_backend)
        self._fi = _import_flashinfer()
        if topk == 1:  # this instance can promise chains: its supports() answers for them
            self.supports = functools.partial(type(self).supports, topk=1)
        self.page_size = kv_pool.page_size
        self.dtype = kv_pool.dtype            # the cache's (kv_data_type of every plan)
        self.fp8 = kv_pool.dtype == FP8
        self.device = req_to_token_pool.device
        self._workspace_bytes = workspace_bytes
        self._prefill_backend, self._mla_backend = prefill_backend, mla_backend
        self._workspace: Optional[torch.Tensor] = None
        self._eager: Dict[str, object] = {}
        self._g: Optional[_GraphBuffers] = None
        self._key: Optional[tuple] = None   # the last layer key seen (plans ahead with it)

    # --------------------------------------------------------------- capability
    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """None when this backend can be built here, else why not (package, then CUDA)."""
        try:
            _import_flashinfer()
        except ImportError as e:
            return str(e)
        except Exception as e:  # a broken install must be reported, not raised
            return f"flashinfer-python does not import ({type(e).__name__}: {e})"
        if not torch.cuda.is_available():
            return "needs a CUDA GPU (torch.cuda.is_available() is False)"
        return None

    @classmethod
    def supports(cls, mode: ForwardMode, *, graph: bool, kind: AttentionKind,
                 topk: Optional[int] = None) -> bool:
        """MHA/GQA: every mode eager; DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2, IDLE in graphs.
        MLA: the same except TARGET_VERIFY, which FlashInfer runs only for chains
        (``topk == 1``; an instance built with ``topk=1`` answers with it): tree verify on MLA
        belongs to the Triton backend."""
        if graph and not mode.is_cuda_graph():
            return False
        if kind == AttentionKind.MLA and mode.is_target_verify():
            return topk == 1
        return True

    def _require(self, mode: ForwardMode, graph: bool) -> None:
        if not self.supports(mode, graph=graph, kind=self.kind):
            what = "tree TARGET_VERIFY (build with topk=1 for chains; trees: the triton backend)" \
                if mode.is_target_verify() else mode.name
            raise UnsupportedError(f"{self.name} does not run {what} for {self.kind.name}"
                                   f"{' in a CUDA graph' if graph else ''}")

    # --------------------------------------------------------------- wrappers
    def _ws(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(self._workspace_bytes, dtype=torch.uint8, device=self.device)
        return self._workspace

    def _family(self, mode: ForwardMode) -> str:
        if self.kind == AttentionKind.MLA:
            return "mla"
        return "decode" if mode.is_decode() else "prefill"

    def _new_wrapper(self, mode: ForwardMode, g: Optional[_GraphBuffers] = None, bs: int = 0):
        fi, fam = self._fi, self._family(mode)
        graph = g is not None
        if fam == "mla":
            from flashinfer.mla import BatchMLAPagedAttentionWrapper
            kw = {}
            if graph:
                kw = dict(qo_indptr=g.qo_indptr[:bs + 1], kv_indptr=g.kv_indptr[:bs + 1],
                          kv_indices=g.kv_indices, kv_len_arr=g.kv_lens[:bs])
            return BatchMLAPagedAttentionWrapper(self._ws(), use_cuda_graph=graph,
                                                 backend=self._mla_backend, **kw)
        if fam == "decode":
            kw = {}
            if graph:
                kw = dict(paged_kv_indptr_buffer=g.kv_indptr[:bs + 1],
                          paged_kv_indices_buffer=g.kv_indices,
                          paged_kv_last_page_len_buffer=g.kv_last_page_len[:bs])
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                self._ws(), "NHD", use_cuda_graph=graph, use_tensor_cores=True,
                backend=self._prefill_backend, **kw)
        kw = {}
        if graph:
            kw = dict(qo_indptr_buf=g.qo_indptr[:bs + 1], paged_kv_indptr_buf=g.kv_indptr[:bs + 1],
                      paged_kv_indices_buf=g.kv_indices,
                      paged_kv_last_page_len_buf=g.kv_last_page_len[:bs])
            if mode.is_target_verify():
                kw.update(custom_mask_buf=g.mask_words.view(torch.uint8),
                          mask_indptr_buf=g.mask_indptr[:bs + 1])
        return fi.BatchPrefillWithPagedKVCacheWrapper(self._ws(), "NHD", use_cuda_graph=graph,
                                                      backend=self._prefill_backend, **kw)

    def _eager_wrapper(self, mode: ForwardMode):
        fam = self._family(mode)
        if fam not in self._eager:
            self._eager[fam] = self._new_wrapper(mode)
        return self._eager[fam]

    # --------------------------------------------------------------- metadata
    def _host(self, batch: ForwardBatch) -> _Host:
        """Host lengths for the plan: the batch's CPU copies, else one read of prefix_lens."""
        bs, mode = batch.batch_size, batch.forward_mode
        P = batch.prefix_lens_cpu
        if P is None or P.shape != (bs,):
            P = batch.prefix_lens.cpu()
        if mode.has_fixed_tokens_per_req() or mode.is_decode():
            n = torch.full((bs,), 1 if mode.is_decode() else batch.num_tokens_per_req,
                           dtype=torch.int32)
        else:
            n = batch.extend_lens_cpu
            if n is None or n.shape != (bs,):
                n = batch.extend_lens.cpu()
            if bool((n < 1).any()):
                raise ValueError("every request of an EXTEND batch needs extend_lens >= 1")
        layout = paged_kv_layout(P.int(), n.int(), self.page_size)
        W = self.req_to_token_pool.max_context_len
        if int(layout.kv_lens.max()) > W:
            raise ValueError(f"a request needs {int(layout.kv_lens.max())} KV positions, "
                             f"req_to_token has {W}")
        mask_bytes = 0
        if mode.is_target_verify() and self.kind == AttentionKind.MHA:
            mask_bytes = int(flashinfer_mask_bytes(P, batch.num_tokens_per_req).sum())
        return _Host(layout, layout.num_pages, mask_bytes, P, n)

    def _build(self, batch: ForwardBatch, host: _Host, md: FlashInferMetadata,
               g: Optional[_GraphBuffers]) -> FlashInferMetadata:
        """Device metadata of ``batch`` into fresh tensors (``g`` None) or the static buffers."""
        bs = batch.batch_size
        layout = paged_kv_layout(batch.prefix_lens, batch.extend_lens, self.page_size)
        rtt = self.req_to_token_pool.req_to_token
        if g is not None:
            views = PagedKVLayout(g.qo_indptr[:bs + 1], g.kv_indptr[:bs + 1],
                                  g.kv_last_page_len[:bs], g.kv_lens[:bs])
            for dst, src in ((views.qo_indptr, layout.qo_indptr), (views.kv_indptr, layout.kv_indptr),
                             (views.kv_last_page_len, layout.kv_last_page_len),
                             (views.kv_lens, layout.kv_lens)):
                dst.copy_(src)
            layout = views
        md.layout = layout
        md.kv_indices = paged_kv_indices(rtt, batch.req_pool_indices, layout.kv_indptr,
                                         self.page_size, host.num_pages,
                                         out=None if g is None else g.kv_indices)
        if md.mode.is_target_verify() and self.kind == AttentionKind.MHA:
            md.mask, indptr = flashinfer_packed_mask(
                batch.tree_mask, batch.prefix_lens, host.mask_bytes,
                out_words=None if g is None else g.mask_words)
            md.mask_indptr = indptr
        md.host = host
        return md

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Eager metadata (device builders) and, when the layer key is known, the plan.

        Raises:
            UnsupportedError: MLA tree TARGET_VERIFY.  ValueError: a request longer than
            ``req_to_token``, an EXTEND request with no token, (MLA, ``topk=1``) a
            TARGET_VERIFY mask that is not a chain, a ``req_pool_indices`` row or a slot out
            of range, or stale host copies of the lengths (one more host read).
        """
        self._metadata_or_none(self._init_eager_metadata, batch)

    def _init_eager_metadata(self, batch: ForwardBatch) -> None:
        mode = batch.forward_mode
        self._require(mode, graph=False)
        md = FlashInferMetadata(mode, batch.batch_size, batch.num_tokens_per_req, batch.num_tokens)
        self.forward_metadata = md
        if mode.is_idle() or batch.batch_size == 0:
            md.batch_size = 0
            return
        if mode.is_target_verify() and self.kind == AttentionKind.MLA:
            chain = chain_tree_mask(batch.num_tokens_per_req, batch.device)
            if not torch.equal(batch.tree_mask, chain.expand_as(batch.tree_mask)):
                raise ValueError("topk=1 promised chains, but the TARGET_VERIFY tree mask is not one")
        md.wrapper = self._eager_wrapper(mode)
        host = self._host(batch)
        self._check_batch_reads(batch, host.prefix_lens, host.extend_lens)
        self._build(batch, host, md, None)
        if self._key is not None:
            self._plan(md, self._key)

    # --------------------------------------------------------------- graphs
    def init_graph_buffers(self, capacity: GraphCapacity) -> None:
        """Static buffers for graphs of up to ``max_bs`` requests / ``max_num_tokens`` tokens
        (module docstring); the packed-mask words are allocated at the first TARGET_VERIFY
        capture."""
        max_bs, max_num_tokens = capacity.max_bs, capacity.max_num_tokens
        dev, ps = self.device, self.page_size
        W = self.req_to_token_pool.max_context_len
        max_pages = max_bs * (-(-W // ps))

        def i32(n):
            return torch.zeros(n, dtype=torch.int32, device=dev)

        self._g = _GraphBuffers(max_bs, max_num_tokens, i32(max_bs + 1), i32(max_bs + 1), i32(max_bs),
                                i32(max_bs), i32(max_pages), i32(max_bs + 1))

    def _graph_metadata(self, batch: ForwardBatch, capture: bool) -> FlashInferMetadata:
        mode, bs = batch.forward_mode, batch.batch_size
        md = FlashInferMetadata(mode, bs, batch.num_tokens_per_req, batch.num_tokens)
        if mode.is_idle() or bs == 0:
            md.batch_size = 0
            return md
        D = batch.num_tokens_per_req if mode.has_fixed_tokens_per_req() else 1
        self.check_graph_batch(bs, bs * D)
        g = self._g
        state = g.states.get((mode, bs))
        if state is None:
            if not capture:
                raise RuntimeError(f"{mode.name} with {bs} requests was never captured")
            if mode.is_target_verify() and self.kind == AttentionKind.MHA \
                    and g.mask_words is None:
                W = self.req_to_token_pool.max_context_len
                nbytes = (g.max_num_tokens * W + 7) // 8 + g.max_bs
                g.mask_words = torch.zeros((nbytes + 3) // 4, dtype=torch.int32, device=self.device)
            state = g.states[(mode, bs)] = _GraphState(self._new_wrapper(mode, g, bs))
        md.wrapper, md.graph_state = state.wrapper, state
        self._build(batch, self._host(batch), md, g)
        key = state.key or self._key
        if key is not None:
            self._plan(md, key)
        return md

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Bind a ``use_cuda_graph=True`` wrapper for ``(mode, bs)`` to the static buffers, fill
        them, plan if the layer key is known (else the warm-up forward plans).

        Raises:
            ValueError: mode not capturable here, or the batch exceeds the static buffers.
        """
        if not self.supports(batch.forward_mode, graph=True, kind=self.kind):
            raise ValueError(f"{batch.forward_mode.name} cannot be captured by {self.name} "
                             f"for {self.kind.name}")
        self.forward_metadata = self._graph_metadata(batch, capture=True)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        """Recompute into the static buffers, then the host plan (one host read of
        ``prefix_lens`` unless the batch carries ``prefix_lens_cpu``).

        Raises:
            RuntimeError: ``(mode, bs)`` never captured, or never planned before capture.
        """
        md = self._graph_metadata(batch, capture=False)
        if not md.empty and md.planned_key is None:
            raise RuntimeError("this graph was captured without a plan: run one forward "
                               "between init_forward_metadata_capture_cuda_graph and the capture")
        self.forward_metadata = md

    # --------------------------------------------------------------- plan + forward
    def query_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the kernels compute queries of ``dtype`` in (queries are cast to it, the
        output back): the pool's for a bf16/fp16 pool; for an fp8 pool the query's own when
        bf16/fp16 (MHA) else bf16 -- never fp8 (FlashInfer's MLA takes bf16 queries only)."""
        if not self.fp8:
            return self.dtype
        if self.kind == AttentionKind.MHA and dtype in QUERY_DTYPES:
            return dtype
        return torch.bfloat16

    def _layer_key(self, layer: AttentionLayer, q_dtype: torch.dtype) -> tuple:
        """What a plan depends on beyond the batch: head count (MLA: and softmax scale), and
        the query dtype (last)."""
        if self.kind == AttentionKind.MLA:
            return (layer.num_heads, float(layer.scaling), q_dtype)
        return (layer.num_heads, q_dtype)

    def _plan(self, md: FlashInferMetadata, key: tuple) -> None:
        """FlashInfer's host plan of ``md`` for layers with ``key`` (module docstring)."""
        h, pool, ps, kvt, qt = md.host.layout, self.kv_pool, self.page_size, self.dtype, key[-1]
        mode, D = md.mode, md.num_tokens_per_req
        if self.kind == AttentionKind.MLA:
            from flashinfer.mla import MLAPlanMetadata
            kw = dict(scale_mode="kv-per-tensor") if self.fp8 else {}
            md.wrapper.plan(
                metadata=MLAPlanMetadata.csr(h.qo_indptr, h.kv_indptr,
                                             md.kv_indices, h.kv_lens),
                num_heads=key[0], head_dim_ckv=pool.kv_lora_rank,
                head_dim_kpe=pool.qk_rope_head_dim, page_size=ps,
                causal=not mode.is_decode(), sm_scale=key[1], q_data_type=qt,
                kv_data_type=kvt, **kw)
        elif mode.is_decode():
            md.wrapper.plan(h.kv_indptr, md.kv_indices, h.kv_last_page_len, key[0], pool.head_num,
                            pool.head_dim, ps, q_data_type=qt, kv_data_type=kvt, sm_scale=1.0)
        else:
            tv = mode.is_target_verify()
            md.wrapper.plan(h.qo_indptr, h.kv_indptr, md.kv_indices, h.kv_last_page_len, key[0],
                            pool.head_num, pool.head_dim, ps, head_dim_vo=pool.v_head_dim,
                            packed_custom_mask=md.mask if tv else None, causal=not tv,
                            q_data_type=qt, kv_data_type=kvt, sm_scale=1.0,
                            uniform_q_len=D if mode.has_fixed_tokens_per_req() else None)
            if tv:  # byte offsets (flashinfer PR #2201: 0.7.2 stores bit offsets here)
                install_mask_indptr(md.wrapper, md.mask_indptr)
        md.planned_key = key
        if md.graph_state is not None:
            md.graph_state.key = key

    def _metadata_fits(self, batch: ForwardBatch) -> bool:
        md: Optional[FlashInferMetadata] = self.forward_metadata
        return md is not None and md.mode == batch.forward_mode and (
            md.empty or (md.batch_size == batch.batch_size and md.num_tokens == batch.num_tokens))

    def _forward(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        md: Optional[FlashInferMetadata] = self.forward_metadata
        if not self._metadata_fits(batch):
            raise RuntimeError("init_forward_metadata was not called for this batch")
        if md.empty:
            return q.new_empty(0, layer.num_heads, layer.v_head_dim)
        pool = self.kv_pool
        if self.kind == AttentionKind.MHA and (layer.num_kv_heads != pool.head_num
                                               or layer.head_dim != pool.head_dim
                                               or layer.v_head_dim != pool.v_head_dim):
            raise ValueError(f"layer has {layer.num_kv_heads} KV heads of {layer.head_dim} / "
                             f"{layer.v_head_dim}, the pool {pool.head_num} of {pool.head_dim} / "
                             f"{pool.v_head_dim}")
        if self.kind == AttentionKind.MLA and (layer.kv_lora_rank != pool.kv_lora_rank
                                               or layer.qk_rope_head_dim != pool.qk_rope_head_dim):
            raise ValueError("layer and pool disagree on kv_lora_rank / qk_rope_head_dim")
        qt = self.query_dtype(q.dtype)
        key = self._layer_key(layer, qt)
        if md.planned_key != key:
            if capturing():
                raise RuntimeError("FlashInfer must plan before a CUDA graph capture: run one "
                                   "forward (warm-up) after init_forward_metadata_capture_cuda_graph")
            self._plan(md, key)
        self._key = key
        qq = q if q.dtype == qt else q.to(qt)
        if qq.stride(-1) != 1:
            qq = qq.contiguous()
        ps, lid = self.page_size, layer.layer_id
        # fp8: the layer's dequantization scales, Python floats (a CUDA graph keeps them)
        ks, vs = (float(s) for s in pool.kv_scales(lid)) if self.fp8 else (None, None)
        if self.kind == AttentionKind.MLA:
            kv = pool.get_key_buffer(lid).view(-1, ps, pool.kv_cache_dim)
            scales = dict(ckv_scale=ks, kpe_scale=ks) if self.fp8 else {}
            out = md.wrapper.run(query=qq, kv_cache=kv, **scales)
        else:
            k = pool.get_key_buffer(lid).view(-1, ps, pool.head_num, pool.head_dim)
            v = pool.get_value_buffer(lid).view(-1, ps, pool.head_num, pool.v_head_dim)
            scales = dict(k_scale=ks, v_scale=vs) if self.fp8 else {}
            out = md.wrapper.run(qq, (k, v), q_scale=float(layer.scaling), **scales)
        return out if out.dtype == q.dtype else out.to(q.dtype)


def _check_pools(req_to_token_pool, kv_pool, kind: AttentionKind, *, prefill_backend: str = "fa2",
                 mla_backend: str = "auto") -> None:
    """Raise UnsupportedConfigError (a ValueError) for what FlashInfer cannot run (before importing
    it; the fp8 MLA check reads the GPU's compute capability)."""
    if kv_pool.dtype not in DTYPES:
        raise UnsupportedConfigError(
            f"FlashInfer has no {kv_pool.dtype} attention: use a bfloat16, float16 or "
            f"float8_e4m3fn KV pool (float32: the triton or torch_reference backend)")
    fp8 = kv_pool.dtype == FP8
    if kind == AttentionKind.MHA:
        if kv_pool.head_dim not in MHA_HEAD_DIMS or kv_pool.v_head_dim != kv_pool.head_dim:
            raise UnsupportedConfigError(f"FlashInfer MHA here needs head_dim in {MHA_HEAD_DIMS} and "
                             f"v_head_dim == head_dim, got {kv_pool.head_dim}/{kv_pool.v_head_dim}")
        if fp8 and prefill_backend != "fa2":
            raise UnsupportedConfigError(
                f"FlashInfer reads a float8_e4m3fn KV cache with 16-bit queries only in its fa2 "
                f"kernels (its fa3 ones need fp8 queries): build with prefill_backend='fa2', "
                f"not {prefill_backend!r}")
    else:
        if kv_pool.kv_lora_rank % 128 or kv_pool.qk_rope_head_dim % 64:
            raise UnsupportedConfigError(
                f"FlashInfer MLA needs kv_lora_rank % 128 == 0 and qk_rope_head_dim % 64 == 0, "
                f"got {kv_pool.kv_lora_rank} + {kv_pool.qk_rope_head_dim}")
        if fp8 and (kv_pool.kv_lora_rank, kv_pool.qk_rope_head_dim) != FP8_MLA_DIMS:
            raise UnsupportedConfigError(
                f"FlashInfer's MLA reads a float8_e4m3fn latent only for kv_lora_rank "
                f"{FP8_MLA_DIMS[0]} + qk_rope_head_dim {FP8_MLA_DIMS[1]}, the pool has "
                f"{kv_pool.kv_lora_rank} + {kv_pool.qk_rope_head_dim}: the triton backend reads "
                f"fp8 caches in every mode")
        if fp8 and mla_backend not in FP8_MLA_BACKENDS:
            raise UnsupportedConfigError(
                f"FlashInfer's MLA reads a float8_e4m3fn latent (with bf16 queries) only in its "
                f"fa3/fa2 kernels: build with mla_backend in {FP8_MLA_BACKENDS}, not {mla_backend!r}")
    if req_to_token_pool.device.type != "cuda" or kv_pool.device != req_to_token_pool.device:
        raise ValueError(f"FlashInfer needs both pools on one CUDA device, got "
                         f"{req_to_token_pool.device} and {kv_pool.device}")
    if fp8 and kind == AttentionKind.MLA:
        major, minor = torch.cuda.get_device_capability(kv_pool.device)
        if major != 9:
            raise UnsupportedConfigError(
                f"FlashInfer's MLA reads a float8_e4m3fn latent on SM90 (Hopper) only, this GPU "
                f"is SM{major}{minor}: the triton backend reads fp8 caches in every mode")
