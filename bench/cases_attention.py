"""Attention bench cases: the Triton backend next to FlashInfer / FlashMLA.

Cases (``-p impl=...`` picks the implementation; every other parameter is shared, so the
rows of one point are timed on identical inputs)::

    case             impl                                            target points (-p ...)
    tree_verify      triton | triton_generic | triton_sm90_sync |    bs/prefix 1/4096 16/2048
                     flashinfer_mask | flashinfer_split              64/4096 16/16384
    mla_tree_verify  triton | triton_generic | triton_sm90_split |   bs 1 | 16, prefix 4096;
                     triton_tma | flashmla (chains: topk 1)          chains of 2-8 at bs 16 | 64
    mla_decode       triton | triton_generic | triton_sm90_split |   bs 128, seq_len 8192; 16-128
                     triton_tma | flashmla                           heads x bs 1-128 x 1024-8192
    decode           triton | flashinfer                             bs 1|32|128 x seq_len 1024|8192
    extend           triton | flashinfer                             bs 1, 2048 new, prefix 0|4096

- ``triton``: :class:`~specattn.backends.triton_backend.TritonBackend`;
  ``init_forward_metadata`` runs eagerly once per input set at setup, the timed call is
  ``backend._forward(q, layer, batch)`` (the KV of every position, this forward's included,
  is written at setup), captured in a CUDA graph by the harness.
  On an sm_90 GPU the defaults run the Gluon kernels for MLA (every mode; the seesaw
  schedule of :mod:`~specattn.triton_kernels.attention_mla_sm90`) and for tree verify with
  >= 128 packed rows per request (:mod:`~specattn.triton_kernels.attention_sm90`).
- ``triton_sm90_split`` (MLA): the Gluon MLA kernel with the key-split schedule
  (``kernel_config={"sm90": True, "seesaw": False}``), the default before the seesaw one.
- ``triton_tma`` (MLA): the same with ``kernel_config={"tma": True}``: the prefix's full key
  tiles by TMA descriptors (pages hold whole tiles), not yet the default.
- ``triton_generic``: ``kernel_config={"sm90": False}``: the portable Triton kernels
  (``tl.dot``; what other GPUs run).
- ``triton_sm90_sync`` (tree verify): the Gluon kernel's synchronous schedule
  (``kernel_config={"sm90": True, "pingpong": False}``), the default before the
  warp-specialized ping-pong one.
- ``flashinfer_mask``: one ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` over the
  ``P + D`` keys with FlashInfer's packed custom mask, planned with the metadata the
  FlashInfer backend builds (:func:`~specattn.backends.flashinfer_backend.paged_kv_layout`,
  :func:`~specattn.backends.flashinfer_backend.paged_kv_indices`,
  :func:`~specattn.backends.flashinfer_backend.flashinfer_packed_mask`: on the device from
  our bit-packed rows); ``plan()`` at setup, ``run()`` timed.  FlashInfer 0.7.2's
  ``plan(packed_custom_mask=...)`` derives the per-request mask offsets in *bits* (``q_len *
  kv_len``) where its kernel reads *bytes* (flashinfer PR #2201, open), so the byte offsets
  are installed after ``plan()`` (the backend's :func:`install_mask_indptr`); bs = 1 is
  unaffected.
- ``flashinfer_split``: the reference anchor: a non-causal paged prefill over the ``P``
  prefix keys and a custom-mask prefill over the ``D`` draft keys, both with ``return_lse``,
  merged by ``flashinfer.merge_state``.  Timed: both runs + the merge.  Needs
  ``prefix % page_size == 0`` (the draft keys must start a page).
- ``flashinfer`` (decode): ``BatchDecodeWithPagedKVCacheWrapper`` with
  ``use_tensor_cores=True`` by default (it then runs FlashInfer's fa2 prefill kernel, the
  module the other FlashInfer impls use; ``-p fi_use_tensor_cores=False`` times the CUDA-core
  decode kernel, one more JIT module); (extend): ``BatchPrefillWithPagedKVCacheWrapper``
  with ``causal=True``.
- ``flashmla``: ``flash_mla.flash_mla_with_kvcache`` (dense bf16 decode; on SM90 that is the
  legacy kernel, ``use_legacy=True``) on ``[pages, 64, 1, 576]`` with its block table; the
  scheduler metadata (``get_mla_decoding_metadata``) is computed at setup.  In
  ``mla_tree_verify`` it verifies chains only (``topk=1``, ``num_steps = num_draft_tokens -
  1``: draft ``j`` sees the prefix and drafts ``0..j``): ``s_q = num_draft_tokens`` tokens a
  request with ``causal=True``, as SGLang's FlashMLA backend runs MTP drafts (a ValueError for
  ``topk > 1``).

FlashInfer wrappers are built with ``backend=fi_backend``, default ``"fa2"``: what SGLang's
FlashInfer backend passes for its paged prefill and decode wrappers, and ONE JIT module (the
fa2 batch-prefill module for bf16, head_dim 128, int32 indices) serves the mask, both split
parts, tensor-core decode and extend; ``merge_state`` adds the small ``cascade`` module.
``-p fi_backend=auto`` lets FlashInfer pick fa3 on Hopper for the mask-free prefills (split
prefix part, extend): one more JIT module.  At page 1 that split measured 1.25-1.7x slower
than with fa2 on an H100 and an H200, so fa2 stays the anchor; :mod:`.attention_report` times
the split under both (the reference split anchors match ``"auto"``).  FlashInfer and FlashMLA are imported only inside
the impls that need them: a missing one raises ImportError naming the extra
(``pip install specattn[flashinfer]`` / ``specattn[flashmla]``).

Inputs, built once on the device: one KV pool (one layer) holding ``input_sets`` disjoint
batches; each request's pages are drawn at random from the pool (a cache after some churn;
``-p contiguous=True`` for in-order pages) and ``req_to_token`` lists them position by
position; K/V, q ~ N(0, 1).  Trees are random EAGLE trees
(:func:`specattn.bench.cases_tree.random_eagle_tree`, ``topk = 8, num_steps = 5`` for 64
tokens) built by :func:`specattn.ops.build_tree` (reference).  ``input_sets=None`` picks
``clamp(256 MiB // bytes_per_set, 1, 4)`` sets; the harness flushes L2 when they are small.
Every request of a point has the same prefix; ``seq_len`` (decode) counts the keys a query
sees, its own included (``P = seq_len - 1`` committed + 1 new).  ``-p kv_dtype=fp8_e4m3``
(decode, tree verify, MLA decode and tree verify) keeps the KV cache in fp8 e4m3 (scale 1.0)
with bf16 queries: the Triton impls read it directly (GQA tree verify on the ping-pong Gluon
kernel, which widens each tile to fp16 in shared memory; the rest on the portable kernels),
the FlashInfer impls are planned with an fp8 ``kv_data_type``, FlashMLA refuses it.

Accounting (the same for every impl of a point, so GB/s and TFLOP/s compare):

- ``bytes`` = the KV of every key read once (``P + n`` keys per request: prefix + this
  forward's tokens; MHA ``Hkv * (Dqk + Dv)`` elements per key, absorbed MLA the
  ``kv_lora_rank + qk_rope_head_dim`` latent once, its values being a prefix of it) + q read
  once + o written once.  Index tables, masks and split-KV partials are not counted.
- ``flops`` = ``2 * H * (Dqk + Dv) * visible`` with ``visible`` = the (query token, key)
  pairs that are visible (QK^T and PV, 2 flops per multiply-add; masked pairs are free):
  tree verify ``P + popcount(mask row)`` per token (mean over the input sets), decode
  ``seq_len``, extend ``P + j + 1`` for new token ``j``.
- % of roofline = ``max(% copy bandwidth, % bf16 matmul rate)`` of the harness's measured
  ceilings = (roofline time ``max(bytes / BW, flops / peak)``) / measured time; the JSON has
  both fractions (``pct_copy_bw``, ``pct_matmul``), :mod:`.attention_report` adds the max.
"""
from __future__ import annotations

import importlib
import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from specattn.backends import (AttentionLayer, ForwardBatch, ForwardMode, MHATokenToKVPool,
                               MLATokenToKVPool, ReqToTokenPool)
from specattn.backends.flashinfer_backend import (flashinfer_packed_mask, install_mask_indptr,
                                                  paged_kv_indices, paged_kv_layout)
from specattn.ops import build_tree, num_tree_candidates
from specattn.ops.tree_mask import flashinfer_mask_bytes, unpack_tree_mask

from .cases import Workload, case, check_choice, positive_ints
from . import cases_tree  # a module reference: cases_tree may be mid-import (it imports .cases)

__all__ = ["IMPLS", "LIBRARIES", "AttnShape", "PagedSet", "PagedInputs", "check_impl",
           "require_library", "attention_bytes", "attention_flops", "auto_input_sets",
           "make_paged_inputs", "random_tree_masks", "flashinfer_kv_metadata",
           "flashinfer_page_metadata", "flashinfer_verify_metadata", "install_mask_indptr",
           "paged_view",
           "FI_WORKSPACE_BYTES", "MLA_SCALING"]

IMPLS: Dict[str, Tuple[str, ...]] = {
    "tree_verify": ("triton", "triton_generic", "triton_sm90_sync", "flashinfer_mask", "flashinfer_split"),
    "mla_tree_verify": ("triton", "triton_generic", "triton_sm90_split", "triton_tma", "flashmla"),
    "mla_decode": ("triton", "triton_generic", "triton_sm90_split", "triton_tma", "flashmla"),
    "decode": ("triton", "flashinfer"),
    "extend": ("triton", "flashinfer"),
}
# impl -> (import name, pip extra, distribution)
LIBRARIES: Dict[str, Tuple[str, str, str]] = {
    "flashinfer": ("flashinfer", "specattn[flashinfer]", "flashinfer-python"),
    "flashinfer_mask": ("flashinfer", "specattn[flashinfer]", "flashinfer-python"),
    "flashinfer_split": ("flashinfer", "specattn[flashinfer]", "flashinfer-python"),
    "flashmla": ("flash_mla", "specattn[flashmla]", "sgl-flash-mla"),
}
FI_WORKSPACE_BYTES = 256 << 20
AUTO_SETS_BUDGET = 256 << 20
MAX_AUTO_SETS = 4
MLA_SCALING = (128 + 64) ** -0.5  # DeepSeek-V3: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5


# ----------------------------------------------------------------------------- checks
def check_impl(case_name: str, impl: str, device: Optional[torch.device]) -> None:
    """Raise ValueError unless ``impl`` is one of ``IMPLS[case_name]`` and, for a library
    impl (FlashInfer / FlashMLA), ``device`` is a CUDA device (``device=None``: the name
    only, as the cases' parameter checks do)."""
    check_choice("impl", impl, IMPLS[case_name])
    if device is not None and impl in LIBRARIES and torch.device(device).type != "cuda":
        raise ValueError(f"{case_name}: impl={impl!r} runs {LIBRARIES[impl][2]} kernels and "
                         f"needs a CUDA device, got {device}")


def require_library(impl: str):
    """Import and return the library module of ``impl`` (``flashinfer`` / ``flash_mla``).

    Raises:
        ImportError: not installed, naming the extra to install (``pip install
            specattn[flashinfer]`` / ``specattn[flashmla]``).
    """
    module, extra, dist = LIBRARIES[impl]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"impl={impl!r} needs {dist} (import {module!r} failed: {e}); "
                          f"install it with: pip install {extra}") from e


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if dt not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {name!r}")
    return dt


KV_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}
"""``kv_dtype`` parameter values: the KV cache in the point's ``dtype`` or in fp8 e4m3 (scale
1.0; the N(0, 1) inputs lie in e4m3's normal range)."""


def _cache_dtype(kv_dtype: str, dtype: torch.dtype) -> torch.dtype:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {' | '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return KV_DTYPES[kv_dtype] or dtype


# ----------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class AttnShape:
    """One attention layer's shape.  ``kind="mha"``: ``num_heads`` q heads over
    ``num_kv_heads`` KV heads of ``head_dim``; ``kind="mla"``: absorbed MLA, one latent KV
    head of ``kv_lora_rank + qk_rope_head_dim`` whose first ``kv_lora_rank`` are the values."""
    kind: str
    num_heads: int
    num_kv_heads: int
    head_dim: int       # q / k width (MLA: kv_lora_rank + qk_rope_head_dim)
    v_head_dim: int     # v / o width (MLA: kv_lora_rank)
    dtype: torch.dtype  # q, o (and the cache unless cache_dtype says otherwise)
    scaling: float
    cache_dtype: torch.dtype  # the KV cache's (``kv_dtype="fp8_e4m3"``: float8_e4m3fn)

    @classmethod
    def mha(cls, num_heads: int, num_kv_heads: int, head_dim: int, dtype,
            kv_dtype: str = "auto") -> "AttnShape":
        """Raises ValueError unless ``num_kv_heads`` divides ``num_heads``, or for an unknown
        ``kv_dtype``."""
        positive_ints(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        dt = _dtype(dtype)
        return cls("mha", num_heads, num_kv_heads, head_dim, head_dim, dt, head_dim ** -0.5,
                   _cache_dtype(kv_dtype, dt))

    @classmethod
    def mla(cls, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype,
            kv_dtype: str = "auto") -> "AttnShape":
        positive_ints(num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                  qk_rope_head_dim=qk_rope_head_dim)
        dt = _dtype(dtype)
        return cls("mla", num_heads, 1, kv_lora_rank + qk_rope_head_dim, kv_lora_rank,
                   dt, MLA_SCALING, _cache_dtype(kv_dtype, dt))

    @property
    def kv_elems_per_key(self) -> int:
        """Cache elements read per key: MHA ``Hkv * (Dqk + Dv)``, MLA the latent once."""
        if self.kind == "mla":
            return self.head_dim
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)

    def layer(self) -> AttentionLayer:
        if self.kind == "mla":
            return AttentionLayer.mla(0, self.num_heads, self.v_head_dim,
                                      self.head_dim - self.v_head_dim, scaling=self.scaling)
        return AttentionLayer.mha(0, self.num_heads, self.num_kv_heads, self.head_dim,
                                  self.v_head_dim, scaling=self.scaling)

    def make_pool(self, size: int, page_size: int, device):
        if self.kind == "mla":
            return MLATokenToKVPool(size, page_size, self.cache_dtype, 1, device, self.v_head_dim,
                                    self.head_dim - self.v_head_dim)
        return MHATokenToKVPool(size, page_size, self.cache_dtype, self.num_kv_heads, self.head_dim,
                                1, device, self.v_head_dim)


def attention_bytes(shape: AttnShape, num_keys: int, num_tokens: int) -> int:
    """Minimum device traffic of one attention call: ``num_keys`` keys' cache rows read once
    (:attr:`AttnShape.kv_elems_per_key` elements each, in ``shape.cache_dtype`` bytes),
    ``num_tokens`` query rows read (``H * Dqk``) and output rows written (``H * Dv``), in
    ``shape.dtype`` bytes."""
    return (shape.cache_dtype.itemsize * num_keys * shape.kv_elems_per_key
            + shape.dtype.itemsize * num_tokens * shape.num_heads * (shape.head_dim + shape.v_head_dim))


def attention_flops(shape: AttnShape, visible_pairs: int) -> int:
    """``2 * H * (Dqk + Dv) * visible_pairs``: QK^T and PV over the visible (query token,
    key) pairs, every query head, 2 flops per multiply-add."""
    return 2 * shape.num_heads * (shape.head_dim + shape.v_head_dim) * int(visible_pairs)


def auto_input_sets(bytes_per_set: int, budget: int = AUTO_SETS_BUDGET,
                    max_sets: int = MAX_AUTO_SETS) -> int:
    """``clamp(budget // bytes_per_set, 1, max_sets)``: enough rotation for small points,
    one set for the ones that dwarf L2 anyway."""
    return max(1, min(max_sets, budget // max(1, bytes_per_set)))


# ----------------------------------------------------------------------------- inputs
@dataclass
class PagedSet:
    """One batch of ``bs`` requests inside :class:`PagedInputs`.

    Attributes:
        rows: ``req_to_token`` rows of the requests (host ints).
        req_pool_indices: int64 ``[bs]`` on the device.
        prefix_lens, extend_lens: committed keys ``P`` and this forward's tokens ``n`` per
            request (host ints; the keys are ``req_to_token[row, :P + n]``).
        out_cache_loc: int64 ``[sum(n)]`` slots of this forward's tokens.
        page_table: int32 ``[bs, pages_per_req]`` page ids in position order (slot of
            position ``p`` = ``page_table[i, p // page_size] * page_size + p % page_size``).
    """
    rows: List[int]
    req_pool_indices: torch.Tensor
    prefix_lens: List[int]
    extend_lens: List[int]
    out_cache_loc: torch.Tensor
    page_table: torch.Tensor

    @property
    def kv_lens(self) -> List[int]:
        return [p + n for p, n in zip(self.prefix_lens, self.extend_lens)]


@dataclass
class PagedInputs:
    """A one-layer KV pool holding ``len(sets)`` disjoint batches (random K/V everywhere)."""
    req_pool: ReqToTokenPool
    kv_pool: Any
    page_size: int
    shape: AttnShape
    sets: List[PagedSet] = field(default_factory=list)


def _check_paged_sizes(*, num_sets, bs, prefix, new_tokens, page_size) -> None:
    """:func:`make_paged_inputs`' sizes (``num_sets=None``: picked later, >= 1)."""
    positive_ints(bs=bs, new_tokens=new_tokens, page_size=page_size)
    if num_sets is not None:
        positive_ints(num_sets=num_sets)
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        raise ValueError(f"prefix must be an int >= 0, got {prefix!r}")


def make_paged_inputs(device, shape: AttnShape, *, num_sets: int, bs: int, prefix: int,
                      new_tokens: int, page_size: int, seed: int,
                      contiguous: bool = False) -> PagedInputs:
    """``num_sets`` batches of ``bs`` requests, each with ``prefix`` committed keys and
    ``new_tokens`` tokens this forward, in one pool of ``num_sets * bs *
    ceil((prefix + new_tokens) / page_size)`` pages (+ the reserved page 0).

    Pages are a random permutation of the pool's pages (``contiguous=True``: in order);
    ``req_to_token`` lists each request's slots position by position; every K/V element is
    N(0, 1) (seeded), this forward's positions included.

    Raises:
        ValueError: a size < 1 (``prefix`` may be 0), bad page size.
    """
    positive_ints(num_sets=num_sets)
    _check_paged_sizes(num_sets=num_sets, bs=bs, prefix=prefix, new_tokens=new_tokens,
                       page_size=page_size)
    device = torch.device(device)
    ps = page_size
    ppr = -(-(prefix + new_tokens) // ps)            # pages per request
    width = ppr * ps
    num_req = num_sets * bs
    total_pages = num_req * ppr
    req_pool = ReqToTokenPool(num_req, width, device)
    kv_pool = shape.make_pool(total_pages * ps, ps, device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = (torch.arange(total_pages) if contiguous else torch.randperm(total_pages, generator=g))
    pages = (pages + 1).view(num_req, ppr)           # page 0 is reserved by the pool
    slots = (pages[:, :, None] * ps + torch.arange(ps)).view(num_req, width)
    req_pool.req_to_token.copy_(slots.to(device, torch.int32))
    gd = torch.Generator(device=device).manual_seed(seed)
    for buf in kv_pool.buffers:
        if buf.dtype.itemsize == 1:   # fp8: no normal_ kernel; draw in bf16, round once
            buf.copy_(torch.randn(buf.shape, generator=gd, device=device, dtype=torch.bfloat16))
        else:
            buf.normal_(generator=gd)
    rows = list(range(num_req))
    random.Random(seed).shuffle(rows)                # request rows in no particular order
    sets = []
    for s in range(num_sets):
        r = rows[s * bs:(s + 1) * bs]
        rt = torch.tensor(r, dtype=torch.int64, device=device)
        loc = req_pool.req_to_token[rt, prefix:prefix + new_tokens].reshape(-1).long()
        sets.append(PagedSet(r, rt, [prefix] * bs, [new_tokens] * bs, loc,
                             pages[r].to(device, torch.int32)))
    return PagedInputs(req_pool, kv_pool, ps, shape, sets)


def random_tree_masks(rng: random.Random, bs: int, num_draft_tokens: int, topk: int,
                      num_steps: int, prefix_lens: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``bs`` random EAGLE trees of ``num_draft_tokens`` tokens (root included) as
    :func:`specattn.ops.build_tree` (reference, on the CPU) builds them.

    Returns:
        ``(tree_mask int32 [bs, D, ceil(D/32)], positions int64 [bs * D])`` on the CPU,
        positions ``prefix_lens[i] + depth``.
    Raises:
        ValueError: ``D - 1`` exceeds the ``topk + (num_steps-1) * topk**2`` candidates.
    """
    D = num_draft_tokens
    if D - 1 > num_tree_candidates(topk, num_steps):
        raise ValueError(f"num_draft_tokens={D} needs {D - 1} candidates; topk={topk}, "
                         f"num_steps={num_steps} draft {num_tree_candidates(topk, num_steps)}")
    pl, sel, _, _ = cases_tree.random_eagle_batch(rng, bs, topk, num_steps, D)
    vsl = torch.tensor(list(prefix_lens), dtype=torch.int64)
    info = build_tree(pl, sel, vsl, topk, num_steps, D, impl="reference")
    return info.tree_mask, info.positions


def paged_view(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """A pool buffer ``[slots, heads, dim]`` as pages ``[slots / page_size, page_size, heads,
    dim]`` (FlashInfer NHD, FlashMLA).  A view, no copy."""
    return buf.view(buf.shape[0] // page_size, page_size, *buf.shape[1:])


def flashinfer_kv_metadata(req_to_token: torch.Tensor, pset: PagedSet, page_size: int):
    """FlashInfer's paged-KV description of keys ``[0, P + n)`` of each request of ``pset``,
    built by the FlashInfer backend's own builders (:func:`paged_kv_layout`,
    :func:`paged_kv_indices`) over ``req_to_token`` (:attr:`PagedInputs.req_pool`).

    Returns:
        ``(kv_indptr int32 [bs + 1], kv_indices int32 [kv_indptr[-1]], kv_last_page_len
        int32 [bs])`` on ``req_to_token``'s device.
    """
    dev = req_to_token.device
    layout = paged_kv_layout(torch.tensor(pset.prefix_lens, dtype=torch.int32, device=dev),
                             torch.tensor(pset.extend_lens, dtype=torch.int32, device=dev),
                             page_size)
    num_pages = sum(-(-kv // page_size) for kv in pset.kv_lens)
    indices = paged_kv_indices(req_to_token, pset.req_pool_indices, layout.kv_indptr, page_size,
                               num_pages)
    return layout.kv_indptr, indices, layout.kv_last_page_len


def flashinfer_page_metadata(page_table: torch.Tensor, kv_lens: Sequence[int], page_size: int,
                             first_key: int = 0):
    """FlashInfer's paged-KV description of keys ``[first_key, first_key + kv_lens[i])`` of
    each request, from the page table (the split anchor's two parts; keys from 0 of a whole
    batch: :func:`flashinfer_kv_metadata`).  The indptr and last-page lengths are the
    backend's :func:`paged_kv_layout` of ``kv_lens`` keys per request.

    Args:
        page_table: int32 ``[bs, pages]`` (:attr:`PagedSet.page_table`).
        kv_lens: keys per request (host ints, >= 1).
        first_key: first key position; a multiple of ``page_size``.
    Returns:
        ``(kv_indptr int32 [bs + 1], kv_indices int32 [kv_indptr[-1]], kv_last_page_len
        int32 [bs])`` on ``page_table``'s device.
    Raises:
        ValueError: ``first_key`` not page-aligned, a length < 1, or pages past the table.
    """
    ps, dev = page_size, page_table.device
    if first_key % ps:
        raise ValueError(f"first_key ({first_key}) must be a multiple of page_size ({ps})")
    if len(kv_lens) != page_table.shape[0] or min(kv_lens, default=1) < 1:
        raise ValueError("kv_lens needs one length >= 1 per page_table row")
    p0 = first_key // ps
    npages = [-(-n // ps) for n in kv_lens]
    if p0 + max(npages, default=0) > page_table.shape[1]:
        raise ValueError(f"keys up to {first_key + max(kv_lens)} need more than the "
                         f"{page_table.shape[1]} pages of the table")
    lens = torch.tensor(list(kv_lens), dtype=torch.int32, device=dev)
    layout = paged_kv_layout(torch.zeros_like(lens), lens, ps)
    indices = torch.cat([page_table[i, p0:p0 + k] for i, k in enumerate(npages)])
    return layout.kv_indptr, indices.to(torch.int32).contiguous(), layout.kv_last_page_len


def flashinfer_verify_metadata(req_to_token: torch.Tensor, pset: PagedSet,
                               tree_mask: torch.Tensor, page_size: int,
                               split: bool) -> Dict[str, Any]:
    """Everything FlashInfer's plan() gets for a TARGET_VERIFY batch (``D`` tokens per
    request; ``tree_mask`` int32 ``[bs, D, ceil(D/32)]`` on ``req_to_token``'s device).

    ``split=False`` (custom mask, what the FlashInfer backend builds): ``{"qo_indptr", "kv":
    (indptr, indices, last), "packed_mask", "mask_indptr"}`` over the ``P + D`` keys
    (:func:`flashinfer_kv_metadata`); the mask is FlashInfer's packed ``[D, P + D]`` rows
    (prefix columns set) with BYTE offsets ``mask_indptr`` (:func:`flashinfer_packed_mask`).
    ``split=True``: ``{"qo_indptr", "prefix_kv", "draft_kv", "packed_mask", "mask_indptr"}``,
    the prefix part over keys ``[0, P)`` (no mask) and the draft part over ``[P, P + D)`` with
    the ``[D, D]`` tree rows.

    Raises:
        ValueError: (split) a request with ``P = 0`` or ``P`` not a multiple of ``page_size``.
    """
    dev = pset.out_cache_loc.device
    D = pset.extend_lens[0]
    qo = torch.arange(len(pset.rows) + 1, dtype=torch.int32, device=dev) * D
    P_cpu = torch.tensor(pset.prefix_lens, dtype=torch.int64)
    if not split:
        packed, mask_indptr = flashinfer_packed_mask(
            tree_mask, P_cpu.to(tree_mask.device), int(flashinfer_mask_bytes(P_cpu, D).sum()))
        kv = flashinfer_kv_metadata(req_to_token, pset, page_size)
        return dict(qo_indptr=qo, kv=kv, packed_mask=packed, mask_indptr=mask_indptr)
    for p in pset.prefix_lens:
        if p < 1 or p % page_size:
            raise ValueError(f"flashinfer_split needs a prefix >= 1 that is a multiple of "
                             f"page_size ({page_size}), got {p}")
    zero = torch.zeros_like(P_cpu)
    packed, mask_indptr = flashinfer_packed_mask(
        tree_mask, zero.to(tree_mask.device), int(flashinfer_mask_bytes(zero, D).sum()))
    pre = flashinfer_page_metadata(pset.page_table, pset.prefix_lens, page_size)
    # the draft keys start a page (P % page_size == 0): one table per request, shifted
    drafts = [flashinfer_page_metadata(pset.page_table[i:i + 1], [D], page_size, p)
              for i, p in enumerate(pset.prefix_lens)]
    d_indptr = torch.tensor([0] + [int(d[0][1]) for d in drafts], dtype=torch.int64)
    draft = (d_indptr.cumsum(0).to(dev, torch.int32), torch.cat([d[1] for d in drafts]),
             torch.cat([d[2] for d in drafts]))
    return dict(qo_indptr=qo, prefix_kv=pre, draft_kv=draft, packed_mask=packed,
                mask_indptr=mask_indptr)


def _random_q(shape: AttnShape, tokens: int, gen: torch.Generator, device) -> torch.Tensor:
    return torch.randn(tokens, shape.num_heads, shape.head_dim, generator=gen,
                       device=device).to(shape.dtype)


# ----------------------------------------------------------------------------- impls
TRITON_IMPLS = {"triton": None, "triton_generic": {"sm90": False}, "triton_tma": {"tma": True},
                "triton_sm90_sync": {"sm90": True, "pingpong": False},
                "triton_sm90_split": {"sm90": True, "seesaw": False}}  # impl -> TritonBackend kernel_config


def _triton_sets(inputs: PagedInputs, batches, qs, num_kv_splits, kernel_config=None):
    """One eagerly initialised TritonBackend per input set: ``(backend, q, batch)``."""
    from specattn.backends.triton_backend import TritonBackend
    out = []
    for batch, q in zip(batches, qs):
        be = TritonBackend(inputs.req_pool, inputs.kv_pool, num_kv_splits=num_kv_splits,
                           kernel_config=kernel_config)
        be.init_forward_metadata(batch)
        out.append((be, q, batch))
    return out


def _triton_workload(inputs, batches, qs, num_kv_splits, nbytes, flops, state) -> Workload:
    layer = inputs.shape.layer()

    def call(backend, q, batch):
        return backend._forward(q, layer, batch)
    sets = _triton_sets(inputs, batches, qs, num_kv_splits, TRITON_IMPLS[state["impl"]])
    return Workload(fn=call, bytes=nbytes, flops=flops, input_sets=sets, state=state)


def _fi_kv(inputs: PagedInputs):
    pool = inputs.kv_pool
    return (paged_view(pool.get_key_buffer(0), inputs.page_size),
            paged_view(pool.get_value_buffer(0), inputs.page_size))


def _fi_plan_prefill(fi, workspace, fi_backend, shape, qo_indptr, kv, page_size, **kw):
    w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=fi_backend)
    w.plan(qo_indptr, *kv, shape.num_heads, shape.num_kv_heads, shape.head_dim, page_size,
           head_dim_vo=shape.v_head_dim, sm_scale=shape.scaling, q_data_type=shape.dtype,
           kv_data_type=shape.cache_dtype, **kw)
    return w


def _fi_verify_workload(impl, inputs: PagedInputs, masks, qs, fi_backend, nbytes, flops,
                        state) -> Workload:
    fi = require_library(impl)
    shape, ps, dev = inputs.shape, inputs.page_size, qs[0].device
    workspace = torch.empty(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    kv = _fi_kv(inputs)
    H, Dv, f32 = shape.num_heads, shape.v_head_dim, torch.float32
    sets = []
    for pset, tm, q in zip(inputs.sets, masks, qs):
        md = flashinfer_verify_metadata(inputs.req_pool.req_to_token, pset, tm.to(dev), ps,
                                        split=impl == "flashinfer_split")
        T = q.shape[0]
        if impl == "flashinfer_mask":
            w = _fi_plan_prefill(fi, workspace, fi_backend, shape, md["qo_indptr"], md["kv"],
                                 ps, packed_custom_mask=md["packed_mask"])
            install_mask_indptr(w, md["mask_indptr"])
            sets.append((w, q, torch.empty(T, H, Dv, dtype=shape.dtype, device=dev)))
        else:
            wp = _fi_plan_prefill(fi, workspace, fi_backend, shape, md["qo_indptr"],
                                  md["prefix_kv"], ps, causal=False)
            wd = _fi_plan_prefill(fi, workspace, fi_backend, shape, md["qo_indptr"],
                                  md["draft_kv"], ps, packed_custom_mask=md["packed_mask"])
            install_mask_indptr(wd, md["mask_indptr"])
            bufs = tuple(torch.empty(T, H, *d, dtype=t, device=dev)
                         for d, t in (((Dv,), shape.dtype), ((), f32), ((Dv,), shape.dtype),
                                      ((), f32)))
            sets.append((wp, wd, q, bufs))
    state.update(workspace=workspace)
    if impl == "flashinfer_mask":
        def call(w, q, out):
            return w.run(q, kv, out=out)
    else:
        def call(wp, wd, q, bufs):
            op, lp, od, ld = bufs
            wp.run(q, kv, out=op, lse=lp, return_lse=True)
            wd.run(q, kv, out=od, lse=ld, return_lse=True)
            return fi.merge_state(op, lp, od, ld)[0]
    return Workload(fn=call, bytes=nbytes, flops=flops, input_sets=sets, state=state)


def _check_flashmla_cache(impl: str, kv_dtype: str) -> None:
    if impl == "flashmla" and kv_dtype != "auto":
        raise ValueError("impl='flashmla' runs a bf16 latent cache only (its fp8 KV is the "
                         f"sparse decode's own layout), got kv_dtype={kv_dtype!r}")


def _check_verify(case_name, *, bs, prefix, num_draft_tokens, page_size, topk, num_steps,
                  input_sets, impl, kv_dtype, **_) -> None:
    """The parameter checks of the tree-verify cases (the shape's are its constructor's)."""
    if impl == "flashmla" and impl in IMPLS[case_name] and topk != 1:
        raise ValueError("impl='flashmla' verifies chains only (topk=1: draft j sees the prefix "
                         f"and drafts 0..j, FlashMLA's causal s_q = num_draft_tokens), got topk={topk}")
    check_impl(case_name, impl, None)
    _check_paged_sizes(num_sets=input_sets, bs=bs, prefix=prefix, new_tokens=num_draft_tokens,
                       page_size=page_size)
    if impl == "flashinfer_split" and (prefix < 1 or prefix % page_size):
        raise ValueError(f"flashinfer_split needs a prefix >= 1 that is a multiple of "
                         f"page_size ({page_size}), got {prefix}")
    cases_tree.check_tree_shape(topk, num_steps, num_draft_tokens)
    _check_flashmla_cache(impl, kv_dtype)


def _check_decode(case_name, *, bs, seq_len, page_size, input_sets, impl, kv_dtype, **_) -> None:
    """The parameter checks of the decode cases (the shape's are its constructor's)."""
    check_impl(case_name, impl, None)
    positive_ints(seq_len=seq_len)
    _check_paged_sizes(num_sets=input_sets, bs=bs, prefix=seq_len - 1, new_tokens=1,
                       page_size=page_size)
    _check_flashmla_cache(impl, kv_dtype)


def _verify_setup(case_name, device, shape: AttnShape, *, bs, prefix, num_draft_tokens,
                  page_size, topk, num_steps, input_sets, seed, impl, num_kv_splits,
                  fi_backend, contiguous) -> Workload:
    """A tree-verify workload (its parameters checked by :func:`_check_verify`)."""
    check_impl(case_name, impl, device)
    D = num_draft_tokens
    nbytes = attention_bytes(shape, bs * (prefix + D), bs * D)
    n_sets = input_sets if input_sets is not None else auto_input_sets(nbytes)
    inputs = make_paged_inputs(device, shape, num_sets=n_sets, bs=bs, prefix=prefix,
                               new_tokens=D, page_size=page_size, seed=seed,
                               contiguous=contiguous)
    rng = random.Random(seed)
    gq = torch.Generator(device=device).manual_seed(seed + 1)
    masks, qs, batches, visible = [], [], [], 0
    for pset in inputs.sets:
        tm, pos = random_tree_masks(rng, bs, D, topk, num_steps, pset.prefix_lens)
        batch = ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, pset.req_pool_indices,
                                   pset.prefix_lens, D, pset.out_cache_loc, positions=pos,
                                   tree_mask=tm, device=device).with_cpu_copies()
        visible += bs * D * prefix + int(unpack_tree_mask(tm, D).sum())
        masks.append(tm)
        batches.append(batch)
        qs.append(_random_q(shape, bs * D, gq, device))
    flops = attention_flops(shape, round(visible / n_sets))
    state = dict(impl=impl, inputs=inputs, batches=batches, qs=qs, tree_masks=masks,
                 layer=shape.layer())
    if impl in TRITON_IMPLS:
        return _triton_workload(inputs, batches, qs, num_kv_splits, nbytes, flops, state)
    if impl == "flashmla":   # topk 1 trees are chains: FlashMLA's causal mask is theirs
        chain = torch.tril(torch.ones(D, D, dtype=torch.bool)).expand(bs, D, D)
        assert all(torch.equal(unpack_tree_mask(tm, D), chain) for tm in masks)
        return _flashmla_workload(inputs, qs, shape, D, page_size, nbytes, flops, state, device)
    return _fi_verify_workload(impl, inputs, masks, qs, fi_backend, nbytes, flops, state)


def _flashmla_workload(inputs: PagedInputs, qs, shape: AttnShape, s_q: int, page_size: int,
                       nbytes: int, flops: int, state: dict, device) -> Workload:
    """FlashMLA's dense decode (``flash_mla_with_kvcache``, SM90 legacy kernels) over the
    inputs' pages: ``s_q`` new tokens per request, causal (bottom-right) when ``s_q > 1`` --
    a chain verify, as SGLang's FlashMLA backend runs MTP drafts.  Its tile-scheduler metadata
    is computed at setup.  Raises ValueError for an fp8 cache, RuntimeError for a build
    without the legacy kernels."""
    lib = require_library("flashmla")
    if shape.cache_dtype != shape.dtype:   # the cases' check refuses it before any input is built
        raise ValueError("impl='flashmla' runs a bf16 latent cache only (its fp8 KV is the "
                         "sparse decode's own layout)")
    if not lib.has_legacy():
        raise RuntimeError("impl='flashmla': this sgl-flash-mla build has no legacy "
                           "kernels (dense bf16 MLA decode on SM90 lives there)")
    H, Dv, bs = shape.num_heads, shape.v_head_dim, len(inputs.sets[0].kv_lens)
    k_cache = paged_view(inputs.kv_pool.get_key_buffer(0), page_size)   # [pages, ps, 1, 576]
    sets = []
    for pset, q in zip(inputs.sets, qs):
        seqlens = torch.tensor(pset.kv_lens, dtype=torch.int32, device=device)
        meta, _ = lib.get_mla_metadata()
        meta.tile_scheduler_metadata, meta.num_splits = lib.get_mla_decoding_metadata(
            seqlens, s_q * H // shape.num_kv_heads, shape.num_kv_heads, H, is_fp8_kvcache=False,
            topk=None, use_legacy=True)
        sets.append((q.view(bs, s_q, H, shape.head_dim), pset.page_table, seqlens, meta))

    def call(q4, block_table, seqlens, meta):
        out, _ = lib.flash_mla_with_kvcache(q4, k_cache, block_table, seqlens, Dv, meta,
                                            softmax_scale=shape.scaling, causal=s_q > 1,
                                            use_legacy=True)
        return out.view(-1, H, Dv)
    return Workload(fn=call, bytes=nbytes, flops=flops, input_sets=sets, state=state)


def _decode_setup(case_name, device, shape: AttnShape, *, bs, seq_len, page_size, input_sets,
                  seed, impl, num_kv_splits, fi_backend, fi_use_tensor_cores, contiguous
                  ) -> Workload:
    """A decode workload (its parameters checked by :func:`_check_decode`)."""
    check_impl(case_name, impl, device)
    P = seq_len - 1
    nbytes = attention_bytes(shape, bs * seq_len, bs)
    n_sets = input_sets if input_sets is not None else auto_input_sets(nbytes)
    inputs = make_paged_inputs(device, shape, num_sets=n_sets, bs=bs, prefix=P, new_tokens=1,
                               page_size=page_size, seed=seed, contiguous=contiguous)
    gq = torch.Generator(device=device).manual_seed(seed + 1)
    batches = [ForwardBatch.decode(s.req_pool_indices, s.prefix_lens, s.out_cache_loc,
                                   device=device).with_cpu_copies() for s in inputs.sets]
    qs = [_random_q(shape, bs, gq, device) for _ in inputs.sets]
    flops = attention_flops(shape, bs * seq_len)
    state = dict(impl=impl, inputs=inputs, batches=batches, qs=qs, layer=shape.layer())
    if impl in TRITON_IMPLS:
        return _triton_workload(inputs, batches, qs, num_kv_splits, nbytes, flops, state)
    if impl == "flashmla":
        return _flashmla_workload(inputs, qs, shape, 1, page_size, nbytes, flops, state, device)
    lib = require_library(impl)
    ps, H, Dv = page_size, shape.num_heads, shape.v_head_dim
    sets = []
    workspace = torch.empty(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    kv = _fi_kv(inputs)
    for pset, q in zip(inputs.sets, qs):
        w = lib.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                   use_tensor_cores=fi_use_tensor_cores,
                                                   backend=fi_backend)
        w.plan(*flashinfer_kv_metadata(inputs.req_pool.req_to_token, pset, ps), H,
               shape.num_kv_heads, shape.head_dim, ps, sm_scale=shape.scaling,
               q_data_type=shape.dtype, kv_data_type=shape.cache_dtype)
        sets.append((w, q, torch.empty(bs, H, Dv, dtype=shape.dtype, device=device)))
    state.update(workspace=workspace)

    def call(w, q, out):
        return w.run(q, kv, out=out)
    return Workload(fn=call, bytes=nbytes, flops=flops, input_sets=sets, state=state)


# ----------------------------------------------------------------------------- cases
_VERIFY_DOC = ("bytes = KV of P+D keys read once + q + o; flops = 2*H*(Dqk+Dv)*visible "
               "(prefix + tree bits); random EAGLE trees (topk 8, 5 steps)")


def _check_tree_verify(*, num_heads, num_kv_heads, head_dim, dtype, kv_dtype, **params):
    AttnShape.mha(num_heads, num_kv_heads, head_dim, dtype, kv_dtype)
    _check_verify("tree_verify", kv_dtype=kv_dtype, **params)


@case("tree_verify",
      "TARGET_VERIFY, Llama-3-8B GQA 32 q / 8 kv heads x 128, bf16, page 1, random 64-token "
      "EAGLE trees over a P-token prefix (target points bs/prefix 1/4096 16/2048 64/4096 "
      "16/16384); impl=triton|triton_generic|triton_sm90_sync|flashinfer_mask|flashinfer_split; " + _VERIFY_DOC,
      check=_check_tree_verify,
      bs=1, prefix=4096, num_draft_tokens=64, num_heads=32, num_kv_heads=8, head_dim=128,
      dtype="bfloat16", page_size=1, topk=8, num_steps=5, input_sets=None, seed=0,
      impl="triton", num_kv_splits=None, fi_backend="fa2", contiguous=False, kv_dtype="auto")
def _tree_verify(device, *, bs, prefix, num_draft_tokens, num_heads, num_kv_heads, head_dim,
                 dtype, page_size, topk, num_steps, input_sets, seed, impl, num_kv_splits,
                 fi_backend, contiguous, kv_dtype):
    """Tree verify (MHA/GQA); see the module docstring."""
    shape = AttnShape.mha(num_heads, num_kv_heads, head_dim, dtype, kv_dtype)
    return _verify_setup("tree_verify", device, shape, bs=bs, prefix=prefix,
                         num_draft_tokens=num_draft_tokens, page_size=page_size, topk=topk,
                         num_steps=num_steps, input_sets=input_sets, seed=seed, impl=impl,
                         num_kv_splits=num_kv_splits, fi_backend=fi_backend,
                         contiguous=contiguous)


def _check_mla_tree_verify(*, num_heads, kv_lora_rank, qk_rope_head_dim, dtype, kv_dtype,
                           **params):
    AttnShape.mla(num_heads, kv_lora_rank, qk_rope_head_dim, dtype, kv_dtype)
    _check_verify("mla_tree_verify", kv_dtype=kv_dtype, **params)


@case("mla_tree_verify",
      "TARGET_VERIFY, absorbed MLA 128 heads, latent 512 + rope 64, bf16, page 64, random "
      "64-token EAGLE trees over a 4096 prefix (target points bs 1 | 16); impl=triton|triton_generic|triton_sm90_split|triton_tma"
      "|flashmla (chains only, topk=1: no public library has MLA tree verify with a custom mask); " + _VERIFY_DOC,
      check=_check_mla_tree_verify,
      bs=1, prefix=4096, num_draft_tokens=64, num_heads=128, kv_lora_rank=512,
      qk_rope_head_dim=64, dtype="bfloat16", page_size=64, topk=8, num_steps=5,
      input_sets=None, seed=0, impl="triton", num_kv_splits=None, contiguous=False, kv_dtype="auto")
def _mla_tree_verify(device, *, bs, prefix, num_draft_tokens, num_heads, kv_lora_rank,
                     qk_rope_head_dim, dtype, page_size, topk, num_steps, input_sets, seed,
                     impl, num_kv_splits, contiguous, kv_dtype):
    """Tree verify (absorbed MLA); see the module docstring."""
    shape = AttnShape.mla(num_heads, kv_lora_rank, qk_rope_head_dim, dtype, kv_dtype)
    return _verify_setup("mla_tree_verify", device, shape, bs=bs, prefix=prefix,
                         num_draft_tokens=num_draft_tokens, page_size=page_size, topk=topk,
                         num_steps=num_steps, input_sets=input_sets, seed=seed, impl=impl,
                         num_kv_splits=num_kv_splits, fi_backend=None, contiguous=contiguous)


def _check_mla_decode(*, num_heads, kv_lora_rank, qk_rope_head_dim, dtype, kv_dtype, **params):
    AttnShape.mla(num_heads, kv_lora_rank, qk_rope_head_dim, dtype, kv_dtype)
    _check_decode("mla_decode", kv_dtype=kv_dtype, **params)


@case("mla_decode",
      "DECODE, absorbed MLA 128 heads, latent 512 + rope 64, bf16, page 64, s_q=1, bs=128 x "
      "seq_len 8192 keys (target: within 1.5x of FlashMLA's 538 us on an H200); "
      "impl=triton|triton_generic|triton_sm90_split|triton_tma|flashmla; bytes = latent of every key once + q + o",
      check=_check_mla_decode,
      bs=128, seq_len=8192, num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64,
      dtype="bfloat16", page_size=64, input_sets=None, seed=0, impl="triton",
      num_kv_splits=None, contiguous=False, kv_dtype="auto")
def _mla_decode(device, *, bs, seq_len, num_heads, kv_lora_rank, qk_rope_head_dim, dtype,
                page_size, input_sets, seed, impl, num_kv_splits, contiguous, kv_dtype):
    """MLA decode; see the module docstring."""
    shape = AttnShape.mla(num_heads, kv_lora_rank, qk_rope_head_dim, dtype, kv_dtype)
    return _decode_setup("mla_decode", device, shape, bs=bs, seq_len=seq_len,
                         page_size=page_size, input_sets=input_sets, seed=seed, impl=impl,
                         num_kv_splits=num_kv_splits, fi_backend=None,
                         fi_use_tensor_cores=None, contiguous=contiguous)


def _check_gqa_decode(*, num_heads, num_kv_heads, head_dim, dtype, kv_dtype, **params):
    AttnShape.mha(num_heads, num_kv_heads, head_dim, dtype, kv_dtype)
    _check_decode("decode", kv_dtype=kv_dtype, **params)


@case("decode",
      "DECODE, Llama-3-8B GQA 32 q / 8 kv heads x 128, bf16, page 16, seq_len keys per "
      "request (target points bs 1|32|128 x seq_len 1024|8192); impl=triton|flashinfer "
      "(BatchDecodeWithPagedKVCacheWrapper, tensor cores); bytes = KV once + q + o",
      check=_check_gqa_decode,
      bs=32, seq_len=8192, num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
      page_size=16, input_sets=None, seed=0, impl="triton", num_kv_splits=None,
      fi_backend="fa2", fi_use_tensor_cores=True, contiguous=False, kv_dtype="auto")
def _decode(device, *, bs, seq_len, num_heads, num_kv_heads, head_dim, dtype, page_size,
            input_sets, seed, impl, num_kv_splits, fi_backend, fi_use_tensor_cores, contiguous,
            kv_dtype):
    """GQA decode; see the module docstring."""
    shape = AttnShape.mha(num_heads, num_kv_heads, head_dim, dtype, kv_dtype)
    return _decode_setup("decode", device, shape, bs=bs, seq_len=seq_len, page_size=page_size,
                         input_sets=input_sets, seed=seed, impl=impl,
                         num_kv_splits=num_kv_splits, fi_backend=fi_backend,
                         fi_use_tensor_cores=fi_use_tensor_cores, contiguous=contiguous)


def _check_extend(*, bs, prefix, new_tokens, num_heads, num_kv_heads, head_dim, dtype,
                  page_size, input_sets, impl, **_):
    check_impl("extend", impl, None)
    AttnShape.mha(num_heads, num_kv_heads, head_dim, dtype)
    _check_paged_sizes(num_sets=input_sets, bs=bs, prefix=prefix, new_tokens=new_tokens,
                       page_size=page_size)


@case("extend",
      "EXTEND (causal prefill over a paged prefix), Llama-3-8B GQA 32 q / 8 kv heads x 128, "
      "bf16, page 16, bs=1 x 2048 new tokens (target points prefix 0 | 4096); "
      "impl=triton|flashinfer (BatchPrefillWithPagedKVCacheWrapper, causal); bytes = KV of "
      "P+n keys once + q + o; flops over the causal pairs",
      check=_check_extend,
      bs=1, prefix=0, new_tokens=2048, num_heads=32, num_kv_heads=8, head_dim=128,
      dtype="bfloat16", page_size=16, input_sets=None, seed=0, impl="triton",
      fi_backend="fa2", contiguous=False)
def _extend(device, *, bs, prefix, new_tokens, num_heads, num_kv_heads, head_dim, dtype,
            page_size, input_sets, seed, impl, fi_backend, contiguous):
    """GQA extend; see the module docstring."""
    check_impl("extend", impl, device)
    shape = AttnShape.mha(num_heads, num_kv_heads, head_dim, dtype)
    n, P = new_tokens, prefix
    nbytes = attention_bytes(shape, bs * (P + n), bs * n)
    n_sets = input_sets if input_sets is not None else auto_input_sets(nbytes)
    inputs = make_paged_inputs(device, shape, num_sets=n_sets, bs=bs, prefix=P, new_tokens=n,
                               page_size=page_size, seed=seed, contiguous=contiguous)
    gq = torch.Generator(device=device).manual_seed(seed + 1)
    batches = [ForwardBatch.extend(s.req_pool_indices, s.prefix_lens, s.extend_lens,
                                   s.out_cache_loc, device=device) for s in inputs.sets]
    qs = [_random_q(shape, bs * n, gq, device) for _ in inputs.sets]
    flops = attention_flops(shape, bs * (n * P + n * (n + 1) // 2))
    state = dict(impl=impl, inputs=inputs, batches=batches, qs=qs, layer=shape.layer())
    if impl == "triton":
        return _triton_workload(inputs, batches, qs, None, nbytes, flops, state)
    fi = require_library(impl)
    workspace = torch.empty(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    kv = _fi_kv(inputs)
    sets = []
    for pset, q in zip(inputs.sets, qs):
        qo = torch.arange(bs + 1, dtype=torch.int32, device=device) * n
        w = _fi_plan_prefill(fi, workspace, fi_backend, shape, qo,
                             flashinfer_kv_metadata(inputs.req_pool.req_to_token, pset, page_size),
                             page_size, causal=True)
        sets.append((w, q, torch.empty(bs * n, shape.num_heads, shape.v_head_dim,
                                       dtype=shape.dtype, device=device)))
    state.update(workspace=workspace)

    def call(w, q, out):
        return w.run(q, kv, out=out)
    return Workload(fn=call, bytes=nbytes, flops=flops, input_sets=sets, state=state)
