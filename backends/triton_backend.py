"""``TritonBackend``: MHA/GQA and absorbed-MLA attention in Triton for every mode, eager and
CUDA graph.

Kernels: :mod:`specattn.triton_kernels.attention` (MHA/GQA) and
:mod:`specattn.triton_kernels.attention_mla` (absorbed MLA, ``kv_lora_rank + qk_rope_head_dim``
latent, e.g. 512 + 64); one kernel per kind for every mode; their module docstrings have the
layouts.  The metadata below is the same for both kinds.

Metadata (:class:`TritonMetadata`), derived on the device from the batch alone with ONE
builder (:func:`fill_triton_metadata`) used by eager, capture and replay -- only where it
writes differs (fresh tensors in eager, the static buffers of ``init_cuda_graph_state`` in
graph mode):

- ``qo_indptr`` int32 ``[bs + 1]`` = ``[0, cumsum(extend_lens)]`` (token offsets);
- ``prefix_lens`` int32 ``[bs]`` = ``P`` (committed keys before this forward; the kernel reads
  keys ``req_to_token[r, 0 : P + n]``, this forward's included);
- ``req_pool_indices`` int64 ``[bs]``;
- ``tree_mask`` int32 ``[bs, D, ceil(D/32)]`` (TARGET_VERIFY only, else None);
- host ints fixed per batch shape: ``max_q`` (grid bound: ``num_tokens_per_req`` for
  TARGET_VERIFY / DRAFT_EXTEND_V2, 1 for DECODE; EXTEND: the host maximum of ``extend_lens``
  eager, ``min(num_tokens, req_to_token width)`` in graph mode) and ``max_prefix`` (for the
  split-KV choice: eager, the host maximum of ``prefix_lens``; in graph mode, where no device
  value may reach the host, the runtime's ``graph_prefix_bound`` or None).

Worked example (the TARGET_VERIFY batch of :mod:`~specattn.backends.forward_batch`, bs = 2,
``D = 3``, ``req_pool_indices = [3, 0]``, ``prefix_lens = [8, 5]``)::

    qo_indptr = [0, 3, 6]      prefix_lens = [8, 5]      req_pool_indices = [3, 0]
    tree_mask = [[[1], [3], [7]], [[1], [3], [5]]]    max_q = 3
    token 2 of request 1: keys req_to_token[0, 0:5] (prefix) + req_to_token[0, 5 + {0, 2}]

EXTEND of that module's example: ``qo_indptr = [0, 3, 5]``, ``prefix_lens = [4, 2]``,
``max_q = 3``; DECODE: ``qo_indptr = [0, 1, 2]``, ``max_q = 1``; DRAFT_EXTEND_V2:
``qo_indptr = [0, 3, 6]``, ``max_q = 3``, causal.

MLA, the same TARGET_VERIFY batch with 16 heads, ``kv_lora_rank = 512``,
``qk_rope_head_dim = 64``, bf16: ``q [6, 16, 576]`` (``[q_nope_absorbed | q_pe]``), the layer's
latent cache ``[slots, 1, 576]``, output ``[6, 16, 512]``; the 3 tokens x 16 heads of a
request are 48 packed rows, one ``block_m = 64`` tile: grid ``(1, 1, 2 * num_splits)``.

CUDA graphs: ``init_cuda_graph_state(max_bs, max_num_tokens)`` allocates the static buffers
(``qo_indptr [max_bs + 1]``, ``prefix_lens [max_bs]``, ``req_pool_indices [max_bs]``, a tree-mask
area of ``max_num_tokens * ceil(max_num_tokens / 32)`` int32 words).  Capture and replay run
the same builder into views of them (device copies and a cumsum only; no host sync, no
allocation).  Padded requests (``prefix_lens = 0``, ``req_pool_indices = 0``, ``n = D``) read
some valid slots and write only their own (discarded) output rows.  The kernel grid depends
only on ``(bs, max_q, heads, num_splits, kernel config)``, all static per captured graph.
The static buffers are shared by every graph of this backend (the replay of a graph rewrites
them just before it runs).

EXTEND in a CUDA graph: the padded batch has a static ``bs`` and a static token count ``T``
(``<= max_num_tokens``) while ``extend_lens`` are device values, so ``max_q = min(T,
req_to_token width)`` bounds every request's ``n`` and the grid is static; the programs past a
request's ``n`` exit at once (cost: ``bs * cdiv(max_q * G, block_m)`` programs, most of them
empty).  Padded requests should have ``n = 0`` (every request, padded ones included, needs
``P + n <= req_to_token width``); token rows past ``qo_indptr[-1]`` belong to no request and
are left unwritten (EXTEND never splits, so no merge touches them).  Example: padded
``bs = 4``, ``T = 16``, live ``extend_lens = [3, 2]`` padded to ``[3, 2, 0, 0]``:
``qo_indptr = [0, 3, 5, 5, 5]``, ``max_q = 16``, rows 5..15 untouched.
(:class:`~specattn.backends.GraphInputBuffers` builds such batches.)

Split-KV: DECODE, TARGET_VERIFY and DRAFT_EXTEND_V2 split the prefix when the batch alone
would launch fewer programs than ~2 waves of the GPU's SMs for MHA (1 wave with 128-row
tiles), ~1 wave for MLA (its 128-row x 256-value tiles hold about one 8-warp program per SM);
``max_prefix`` (eager: the batch's; graph mode: ``graph_prefix_bound`` when the runtime
sets one) bounds them to one split per :func:`split_keys_mha` keys for MHA (32 keys while the
batch's query rows in flight stay within a bs-1 16-token verify's 144, proportionally more
above), 128 for MLA in whole 64-key tiles, as evenly as they allow (:func:`mla_splits`; on
an H100, MLA decode at bs 1 over 1,024 / 4,096 keys, 16 heads, takes 25.4 / 27.1 us in the 3
/ 15 splits that 256 keys a split allowed and 17.1 / 19.6 us in 8 / 32; at bs 16 over 1,024
keys 30.8 us in 3 and 27.0 in 8).  On an H200 in CUDA graphs (SmolLM2's 9 / 3 heads of 64, bf16, merge
included, the pipelined tiles the rule was fitted with): a bs-1 16-token verify over 256
keys takes 9.1 us in one pass and 7.7 in eight; at bs 16 the same verify takes 9.2 us in
one pass and 12.3 in the four that SM occupancy alone picks (over 1,024 keys: 18.8 in one,
15.5 in two, 15.0 in four); a bs-1 decode over 512 keys takes 8.4 us in one pass and 5.3 in
eight.  The split count is chosen with those tiles' program count; the kernel then runs
the short-loop tiles that ``max_prefix`` allows (MHA's ``default_config``: the bs-1 verify
over 200 keys in eight splits 4.5 us).
An fp8 cache read by 16-bit queries, at decode-sized rows (at most 16 per KV head) and
long prefixes, runs 2-warp programs split to about four per SM instead
(:func:`fp8_narrow_splits`: heads of up to 64, or of 128 on GPUs with H200-class bandwidth per
SM); on GPUs with H200-class bandwidth per SM, a DECODE with enough programs runs 1-warp
programs of 32-key tiles, about eight per SM, ahead of them (:func:`fp8_single_warp_splits`).
A DECODE that even 16 splits leave under two programs per SM (bs 1 with 8 KV heads), over
2,048+ keys, splits wider into 2-warp programs of 64 keys, about three per SM
(:func:`wide_decode_splits`: heads of 128 on GPUs with H200-class bandwidth per SM).
``num_kv_splits=`` forces a count (tests, sweeps).  EXTEND never splits.

Kernel config: ``kernel_config={"block_m": .., "block_n": .., "num_warps": .., "num_stages":
..}`` (MLA also ``"block_dv"``: ``kv_lora_rank`` or half of it, ``"tma"``: prefix tiles
by TMA, pages holding whole tiles, ``"sm90"``: the Gluon sm_90 kernel of
:mod:`~specattn.triton_kernels.attention_mla_sm90`, every mode, and ``"seesaw"``: its
schedule, FlashMLA's seesaw (default) or the key split (False); MHA's ``"sm90"`` runs
TARGET_VERIFY on the one of :mod:`~specattn.triton_kernels.attention_sm90`, other modes
ignore it; on an sm_90 GPU both are the default where they can run) overrides the kernels'
defaults for every forward (sweeps); keys and values are checked at construction.
``page_aligned`` (default True): see :class:`TritonBackend`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton  # noqa: F401  (a missing triton makes create_backend("triton") say so)

from specattn.ops.checks import capturing
from specattn.ops.tree_mask import check_tree_mask, num_mask_words

from .base import AttentionBackend, GraphCapacity
from .forward_batch import ForwardBatch
from .forward_mode import ForwardMode
from .layer import AttentionKind, AttentionLayer

__all__ = ["TritonBackend", "TritonMetadata", "fill_triton_metadata"]

MAX_KV_SPLITS = 16
MLA_MAX_KV_SPLITS = 32
MIN_SPLIT_KEYS = 128
MIN_SPLIT_KEYS_MHA = 32
SPLIT_WORK_UNIT = 144   # query rows in flight of a bs-1 16-token verify with 3 KV heads of 16 queries
MLA_SPLIT_TILE = 64      # keys of a Gluon MLA tile: the split chunks are whole tiles
FP8_NARROW_KEYS = 2048   # fp8 MHA decode: prefix keys a program from which 2-warp programs win
FP8_NARROW_WAVES = 4     # ... and the programs per SM they are split to
FP8_NARROW_SM_BANDWIDTH = 30e9   # HBM bytes/s per SM from which they win at head_dim 128 too
FP8_NARROW_CONFIG = {"block_m": 16, "block_n": 128, "num_warps": 2, "num_stages": 2}
FP8_SINGLE_WARP_CONFIG = {"block_m": 16, "block_n": 32, "num_warps": 1, "num_stages": 4}
FP8_SINGLE_WARP_WAVES = 8       # fp8 MHA decode on H200-class GPUs: 1-warp programs per SM
FP8_SINGLE_WARP_MIN_WAVES = 6   # ... taken only where MAX_KV_SPLITS splits reach this many
FP8_SINGLE_WARP_KEYS = 512      # ... and each program reads at least this many prefix keys
WIDE_SPLIT_KEYS = 2048   # MHA decode under one wave of programs: prefix keys from which it splits wider
WIDE_SPLIT_WAVES = 3     # ... into about this many 2-warp programs per SM
MAX_WIDE_SPLITS = 48
WIDE_SPLIT_CONFIG = {"block_m": 16, "block_n": 64, "num_warps": 2, "num_stages": 3}


def wide_decode_splits(programs: int, num_sms: int, max_prefix: int, head_dim: int,
                       hbm_bytes_per_s: float) -> int:
    """The split count at which an MHA DECODE too small to fill the GPU runs
    ``WIDE_SPLIT_CONFIG`` (2-warp, 3-stage programs of 16 rows x 64 keys), or 0 where the
    default split rule stays.

    ``programs`` is the batch's program count before splitting (row tiles x KV heads x
    requests), ``num_sms`` the GPU's SM count, ``max_prefix`` the host bound of the prefix
    keys, ``head_dim`` the padded head width, ``hbm_bytes_per_s`` the GPU's DRAM bandwidth
    (:func:`hbm_bytes_per_s`).  It applies where even ``MAX_KV_SPLITS`` splits leave fewer
    than two programs per SM, the prefix holds at least ``WIDE_SPLIT_KEYS`` keys, the heads
    are 128 wide and the GPU has at least ``FP8_NARROW_SM_BANDWIDTH`` bytes/s per SM; the
    count gives about ``WIDE_SPLIT_WAVES`` programs per SM, at most ``MAX_WIDE_SPLITS``.
    Such a decode is bound by the latency of its loads, not by DRAM bandwidth (bs 1 x 8,192
    keys reads its cache at 30 % of the copy bandwidth): more, smaller programs keep more
    loads in flight.  Measured in CUDA graphs, page 16, Llama-3-8B GQA (32 / 8 heads of 128),
    bs 1, default -> these programs in 48 splits, interleaved on an H200 (37 GB/s per SM):
    8,192 keys 26.0 -> 23.0 us (bf16 cache) and 22.8 -> 19.7 (fp8), 4,096 keys 19.6 -> 17.0,
    2,048 keys 14.6 -> 13.7.  At bs 2 (16 programs; 32 splits 29.6 against 31.0 us) and bs 4
    the gain was within the noise or negative; 2-warp programs of 128 keys were slower at
    every point.  Unmeasured, hence left out: heads of 64 and GPUs with less bandwidth per SM
    (H100).  Returns an int."""
    if programs <= 0 or num_sms <= 0 or head_dim != 128 or max_prefix < WIDE_SPLIT_KEYS:
        return 0
    if hbm_bytes_per_s < FP8_NARROW_SM_BANDWIDTH * num_sms or (2 * num_sms) // programs <= MAX_KV_SPLITS:
        return 0
    return min(MAX_WIDE_SPLITS, (WIDE_SPLIT_WAVES * num_sms) // programs)


def hbm_bytes_per_s(props) -> float:
    """The peak DRAM bandwidth (bytes/s) of a ``torch.cuda.get_device_properties`` result:
    two transfers per ``memory_clock_rate`` (kHz) cycle over ``memory_bus_width`` bits (H100
    SXM: 3.35e12, H200: 4.81e12); 0.0 for None or a torch whose properties lack the fields."""
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    return 2.0 * clock_khz * 1e3 * bus_bits / 8


def mla_splits(limit: int, max_prefix: int) -> int:
    """The MLA split-KV count for a prefix of at most ``max_prefix`` keys: at most ``limit``
    (what SM occupancy allows), at least ``MIN_SPLIT_KEYS`` keys (two 64-key tiles) a split,
    and no empty split.  The kernels give split ``s`` the keys ``[s * c, (s + 1) * c)`` with
    ``c = cdiv(cdiv(P, S), 64) * 64``, so ``S`` is taken as ``cdiv(tiles, tiles a split)``:
    over 1,023 keys 7 splits would be six chunks of up to 192 keys and one without a prefix
    key, 8 are eight of up to 128 (H100, MLA decode bs 1, 16 heads: 17.1 us in 8 splits, 20.9
    in the 7 of ``P // MIN_SPLIT_KEYS``; over 4,095 keys 19.6 in 32 against 27.1 in 15).
    ``limit`` and ``max_prefix`` are counts (ints); returns an int in ``[1, max(limit, 1)]``."""
    tiles = max(1, -(-max_prefix // MLA_SPLIT_TILE))
    per = max(MIN_SPLIT_KEYS // MLA_SPLIT_TILE, -(-tiles // max(limit, 1)))
    return max(1, min(limit, -(-tiles // per)))


def fp8_narrow_splits(programs: int, num_sms: int, max_prefix: int, head_dim: int,
                      hbm_bytes_per_s: float) -> int:
    """The split count at which an fp8-cache MHA decode runs ``FP8_NARROW_CONFIG`` (2-warp,
    2-stage programs of 16 rows x 128 keys), or 0 where the default 4-warp programs stay.

    ``programs`` is the batch's program count before splitting (row tiles x KV heads x
    requests), ``num_sms`` the GPU's SM count, ``max_prefix`` the host bound of the prefix
    keys, ``head_dim`` the padded head width, ``hbm_bytes_per_s`` the GPU's DRAM bandwidth
    (:func:`hbm_bytes_per_s`).  The split count gives about ``FP8_NARROW_WAVES`` programs per
    SM (at most ``MAX_KV_SPLITS``); the narrow programs are taken only if each still reads at
    least ``FP8_NARROW_KEYS`` keys, for heads of up to 64, or of 128 on a GPU with at least
    ``FP8_NARROW_SM_BANDWIDTH`` bytes/s per SM.  Their value tile is read back from shared
    memory a byte at a time (``docs/attention.md``); twice the programs per SM keep more of
    those loads in flight, which pays where the loads, not DRAM, set the pace.  Measured in
    CUDA graphs, page 16, 4-warp -> narrow programs: Llama-3-8B GQA (32 / 8 heads of 128) on
    an H200 (37 GB/s per SM) bs 32 x 8,192 keys 190.1 -> 169.3 us, bs 128 x 8,192 712.6 ->
    653.2, bs 64 x 4,096 193.3 -> 180.8, bs 16 x 16,384 186.4 -> 167.1, on an H100 (25 GB/s
    per SM) 213.0 -> 222.9, 814.8 -> 843.0, 215.2 -> 231.4 (so not there); 9 / 3 heads of 64
    at bs 64 x 8,192 keys 131.0 -> 102.2 (H200) and 132.3 -> 111.9 (H100).  With fewer keys
    a program or fewer programs (bs 1 / 8 x 8,192 keys, H200: 22.7 -> 31.4, 57.9 -> 59.2 us)
    4 warps stay ahead, and a bf16 cache runs slower with 2 warps everywhere.  Returns an
    int."""
    if programs <= 0 or num_sms <= 0 or head_dim > 128:
        return 0
    if head_dim > 64 and hbm_bytes_per_s < FP8_NARROW_SM_BANDWIDTH * num_sms:
        return 0
    splits = max(1, min(MAX_KV_SPLITS, (FP8_NARROW_WAVES * num_sms) // programs))
    return splits if max_prefix // splits >= FP8_NARROW_KEYS else 0


def fp8_single_warp_splits(programs: int, num_sms: int, max_prefix: int, head_dim: int,
                           hbm_bytes_per_s: float) -> int:
    """The split count at which an fp8-cache MHA DECODE runs ``FP8_SINGLE_WARP_CONFIG``
    (1-warp, 4-stage programs of 16 rows x 32 keys), or 0 where it does not apply.

    Arguments as :func:`fp8_narrow_splits`. The count is the one nearest to
    ``FP8_SINGLE_WARP_WAVES`` programs per SM (at most ``MAX_KV_SPLITS``); the rule applies on a
    GPU with at least ``FP8_NARROW_SM_BANDWIDTH`` bytes/s of DRAM per SM, for heads of up to
    128, where ``MAX_KV_SPLITS`` splits reach ``FP8_SINGLE_WARP_MIN_WAVES`` programs per SM and
    a split still holds ``FP8_SINGLE_WARP_KEYS`` keys (``cdiv(max_prefix, splits)``). Such a
    decode is paced by the byte-wide shared-memory reads of its value tiles
    (``docs/attention.md``), not by DRAM: one warp a program with a deep pipeline of small tiles
    keeps the most of them in flight per SM. Measured in CUDA graphs, page 16, on an H200
    (37 GB/s per SM), interleaved, the default before this rule -> these programs: Llama-3-8B GQA
    (32 / 8 heads of 128) bs 32 x 8,192 keys 166.9 -> 155.3 us (the bf16 cache 248.3), bs 128 x
    8,192 653.6 -> 574.5 (964.1), bs 64 x 4,096 179.5 -> 159.5, bs 16 x 16,384 164.6 -> 154.0,
    bs 8 x 8,192 (16 splits of 512 keys) 58.1 -> 51.1, bs 64 x 2,048 104.8 -> 89.5; heads of 64:
    9 / 3 heads at bs 64 x 8,192 keys 102.5 -> 80.2, 32 / 8 at bs 32 x 4,096 73.3 -> 60.5. About
    four programs per SM were slower than the default (1-warp programs of 64 keys at bs 32 x
    8,192 keys: 184.1 us), and 1-warp programs of 128-key tiles far slower (273.6). A bf16 cache
    ran slower in 1-warp programs at heads of 128 (275.3 against 248.3 us). GPUs with less
    bandwidth per SM (H100) are unmeasured, hence left out.  Returns an int."""
    if programs <= 0 or num_sms <= 0 or head_dim > 128 or hbm_bytes_per_s < FP8_NARROW_SM_BANDWIDTH * num_sms:
        return 0
    if programs * MAX_KV_SPLITS < FP8_SINGLE_WARP_MIN_WAVES * num_sms:
        return 0
    target = 2 * FP8_SINGLE_WARP_WAVES * num_sms
    splits = max(1, min(MAX_KV_SPLITS, (target + programs) // (2 * programs)))   # rounded to nearest
    return splits if -(-max_prefix // splits) >= FP8_SINGLE_WARP_KEYS else 0


def split_keys_mha(programs: int, rows: int, block_m: int) -> int:
    """The fewest prefix keys one MHA split-KV program should get: ``MIN_SPLIT_KEYS_MHA``
    times the batch's query rows in flight (``programs`` x rows per program, at least 16) per
    ``SPLIT_WORK_UNIT``: the fuller the GPU already is, the longer a split must be to pay for
    its partial write and the merge (module docstring: the measurements)."""
    work = programs * max(16, min(rows, block_m))
    return MIN_SPLIT_KEYS_MHA * max(1, work // SPLIT_WORK_UNIT)


@dataclass
class TritonMetadata:
    """See the module docstring.  Tensors on the batch's device."""

    mode: ForwardMode
    qo_indptr: torch.Tensor
    prefix_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    tree_mask: Optional[torch.Tensor]
    max_q: int
    max_prefix: Optional[int]
    num_tokens: Optional[int] = None   # the batch's token count (a forward on another count is refused)

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]


def fill_triton_metadata(batch: ForwardBatch, md: TritonMetadata, qo_indptr_ready: bool = False
                         ) -> TritonMetadata:
    """Write ``batch``'s metadata into ``md``'s tensors (sized for ``batch.batch_size``
    requests) and return ``md``.  Device work only: copies and one cumsum (none when
    ``qo_indptr_ready``: ``md.qo_indptr`` already holds the batch's offsets)."""
    if not qo_indptr_ready:
        md.qo_indptr[:1].zero_()
        torch.cumsum(batch.extend_lens, 0, dtype=torch.int32, out=md.qo_indptr[1:])
    for dst, src in ((md.prefix_lens, batch.prefix_lens), (md.req_pool_indices, batch.req_pool_indices),
                     (md.tree_mask, batch.tree_mask)):
        if dst is not None and dst is not src:   # (a metadata tensor may be the batch's own)
            dst.copy_(src)
    return md


def _aliasable(t: Optional[torch.Tensor], dtype: torch.dtype, shape: tuple) -> bool:
    """Whether a batch tensor can serve as the metadata tensor of ``dtype`` and ``shape``."""
    return t is not None and t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous()


def _check_batch_layout(batch: ForwardBatch, max_q: int) -> None:
    """Host-only checks of a batch's per-request tensors (no device value is read, so graph
    builders can run them): ``prefix_lens`` / ``extend_lens`` / ``req_pool_indices`` of shape
    ``[bs]`` and index dtypes, a fixed-count mode's token count ``bs * max_q``, and a
    TARGET_VERIFY ``tree_mask`` int32 ``[bs, max_q, ceil(max_q / 32)]``.

    Raises:
        ValueError: the first violation, named.
    """
    bs = batch.batch_size
    for name, t in (("prefix_lens", batch.prefix_lens), ("extend_lens", batch.extend_lens),
                    ("req_pool_indices", batch.req_pool_indices)):
        if tuple(t.shape) != (bs,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"batch.{name} must be int32 / int64 [{bs}], got {t.dtype} {list(t.shape)}")
    if batch.forward_mode != ForwardMode.EXTEND and batch.num_tokens != bs * max_q:
        raise ValueError(f"a {batch.forward_mode.name} batch of {bs} requests x {max_q} tokens has "
                         f"{batch.num_tokens} tokens")
    if batch.forward_mode.is_target_verify():
        if batch.tree_mask is None:
            raise ValueError("TARGET_VERIFY needs batch.tree_mask")
        check_tree_mask(batch.tree_mask, bs, max_q)


def _max_q_static(batch: ForwardBatch, width: int) -> int:
    """Static grid bound of the tokens per request in graph mode: ``num_tokens_per_req``
    (TARGET_VERIFY, DRAFT_EXTEND_V2), 1 (DECODE), ``min(num_tokens, width)`` (EXTEND, whose
    per-request counts are device values; ``width`` is the ``req_to_token`` width)."""
    mode = batch.forward_mode
    if mode.has_fixed_tokens_per_req():
        return int(batch.num_tokens_per_req)
    if mode.is_decode():
        return 1
    if mode == ForwardMode.EXTEND:
        return min(batch.num_tokens, width)
    raise ValueError(f"{mode.name} has no static tokens per request")


def _check_kernel_config(config: Optional[dict], kind: AttentionKind, kv_pool) -> dict:
    """Validated copy of ``config`` (ValueError on an unknown key for ``kind`` or a value that
    is not a power of two; ``block_*`` >= 16; MLA ``block_dv`` = rank or rank / 2)."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"kernel_config must be a dict, got {type(config).__name__}")
    if kind == AttentionKind.MLA:
        from specattn.triton_kernels.attention_mla import check_mla_config
        check_mla_config(config, kv_pool.kv_lora_rank)
    else:
        from specattn.triton_kernels.attention import MHA_CONFIG_KEYS, check_kernel_config
        check_kernel_config(config, MHA_CONFIG_KEYS)
    return {k: v for k, v in config.items() if v is not None}


class TritonBackend(AttentionBackend):
    """MHA/GQA and absorbed-MLA Triton backend (see the module docstring).

    Args:
        req_to_token_pool, kv_pool: the pools (``MHATokenToKVPool`` or ``MLATokenToKVPool``;
            MLA needs ``kv_lora_rank`` and ``qk_rope_head_dim`` powers of two >= 16).
        num_kv_splits: force the split-KV factor (1 = never split) for the modes that split;
            None picks it from the batch shape and the GPU's SM count (1 on CPU).
        kernel_config: kernel config overrides passed to every kernel call: ``block_m``,
            ``block_n``, ``num_warps``, ``num_stages`` (MLA also ``block_dv``, and ``tma`` /
            ``seesaw``, bools: :func:`~specattn.triton_kernels.attention_mla.mla_paged_attention`);
            ``sm90`` (bool) for both kinds, MHA also ``pingpong`` (bool:
            :func:`~specattn.triton_kernels.attention.paged_attention`); powers of two
            (``num_stages``: any int >= 1).
        page_aligned: promise that ``req_to_token`` rows follow the pools' page layout (token
            ``p`` of a request at offset ``p % page_size`` of its page, as ``KVAllocator``
            hands slots out), so the MLA kernel reads one slot per key tile when ``block_n``
            divides ``page_size``, and the MHA ping-pong tree-verify kernel copies whole
            64-key tiles by TMA when ``page_size`` is a multiple of 16 (measured figures use
            this).  Pass False for rows built otherwise (e.g. scratch rows copied from other
            requests with ``page_size > 1``): the kernels then gather every key's slot.
        topk: accepted for the contract (:class:`~specattn.backends.base.AttentionBackend`);
            the Triton kernels run any tree, so it changes nothing here.
    Raises:
        ValueError: a bad ``num_kv_splits``, ``kernel_config`` key or value, MLA dims, or
            ``topk``.
    """

    name = "triton"
    device_metadata = True

    def __init__(self, req_to_token_pool, kv_pool, num_kv_splits: Optional[int] = None,
                 kernel_config: Optional[dict] = None, page_aligned: bool = True,
                 topk: Optional[int] = None):
        super().__init__(req_to_token_pool, kv_pool, topk=topk)
        self.page_aligned = bool(page_aligned)
        if num_kv_splits is not None and (isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int)
                                          or not 1 <= num_kv_splits <= 64):
            raise ValueError(f"num_kv_splits must be an int in [1, 64], got {num_kv_splits!r}")
        if self.kind == AttentionKind.MLA:
            for name in ("kv_lora_rank", "qk_rope_head_dim"):
                d = getattr(kv_pool, name)
                if d < 16 or d & (d - 1):
                    raise ValueError(f"TritonBackend MLA needs {name} a power of two >= 16, got {d}")
        self.kernel_config = _check_kernel_config(kernel_config, self.kind, kv_pool)
        self.num_kv_splits = num_kv_splits
        self._g = None
        dev = req_to_token_pool.device
        props = torch.cuda.get_device_properties(dev) if dev.type == "cuda" else None
        self._num_sms = props.multi_processor_count if props is not None else 0
        self._hbm_bytes_per_s = hbm_bytes_per_s(props)

    # --------------------------------------------------------------- capability
    @classmethod
    def supports(cls, mode: ForwardMode, *, graph: bool, kind: AttentionKind) -> bool:
        """MHA/GQA and MLA: every mode eager; every mode in CUDA graphs too (DECODE,
        TARGET_VERIFY, DRAFT_EXTEND_V2, IDLE, and EXTEND with a static token count: module
        docstring)."""
        if kind not in (AttentionKind.MHA, AttentionKind.MLA):
            return False
        return (not graph) or mode.is_cuda_graph() or mode == ForwardMode.EXTEND

    # --------------------------------------------------------------- eager
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Eager metadata (one host read of ``extend_lens``/``prefix_lens`` unless the batch
        carries CPU copies, and one of the ``req_pool_indices`` range, the slots the batch
        reads and whether the CPU copies match the tensors).  Raises ValueError when a
        request's ``P + n`` exceeds the ``req_to_token`` width, a ``req_pool_indices`` row is out
        of range, a slot lies outside the KV pool, ``extend_lens`` do not sum to the token count
        or a length is negative, the CPU copies are stale, a per-request tensor is not
        ``[bs]``, or a TARGET_VERIFY ``tree_mask`` is missing or not int32 ``[bs, D,
        ceil(D/32)]``."""
        self.forward_metadata = None      # a call that raises leaves none: the next forward raises
        mode = batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        bs, dev = batch.batch_size, batch.device
        _check_batch_layout(batch, batch.num_tokens_per_req or 1)
        P, n = self._host_lens(batch)
        if bs and (int(P.min()) < 0 or int(n.min()) < 0):
            raise ValueError("prefix_lens and extend_lens must be >= 0")
        if int(n.sum()) != batch.num_tokens:
            raise ValueError(f"sum(extend_lens) = {int(n.sum())}, but the batch has {batch.num_tokens} tokens")
        if mode.is_decode() and bs and int(n.max()) != 1:
            raise ValueError("DECODE needs extend_lens == 1")
        max_q = int(n.max()) if bs else 0
        max_prefix = int(P.max()) if bs else 0
        self._check_batch_reads(batch, P, n)
        tm = None
        if mode.is_target_verify():
            D = batch.num_tokens_per_req
            if batch.tree_mask is None:
                raise ValueError("TARGET_VERIFY needs batch.tree_mask")
            check_tree_mask(batch.tree_mask, bs, D)
            tm = torch.empty(bs, D, num_mask_words(D), dtype=torch.int32, device=dev)
        md = TritonMetadata(mode, torch.empty(bs + 1, dtype=torch.int32, device=dev),
                            torch.empty(bs, dtype=torch.int32, device=dev),
                            torch.empty(bs, dtype=torch.int64, device=dev), tm, max_q, max_prefix,
                            batch.num_tokens)
        self.forward_metadata = fill_triton_metadata(batch, md)

    # --------------------------------------------------------------- graphs
    def init_graph_buffers(self, capacity: GraphCapacity) -> None:
        """Static metadata buffers for graphs of up to ``capacity.max_bs`` requests and
        ``capacity.max_num_tokens`` tokens (module docstring)."""
        dev = self.req_to_token_pool.device
        max_bs, max_num_tokens = capacity.max_bs, capacity.max_num_tokens
        self._g = dict(
            max_bs=max_bs, max_num_tokens=max_num_tokens,
            qo_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            prefix_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            req_pool_indices=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            tree_mask=torch.zeros(max_num_tokens * num_mask_words(max_num_tokens),
                                  dtype=torch.int32, device=dev),
            fixed_qo_indptr={})

    def _graph_metadata(self, batch: ForwardBatch, in_capture: bool = False) -> Optional[TritonMetadata]:
        mode = batch.forward_mode
        if mode.is_idle():
            return None
        bs = batch.batch_size
        max_q = _max_q_static(batch, self.req_to_token_pool.max_context_len)
        self.check_graph_batch(bs, batch.num_tokens if mode == ForwardMode.EXTEND else bs * max_q)
        _check_batch_layout(batch, max_q)
        g = self._g
        tm = None
        if mode.is_target_verify():
            W = num_mask_words(max_q)
            tm = g["tree_mask"][:bs * max_q * W].view(bs, max_q, W)
        # a fixed count per request (DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2): qo_indptr is the
        # constant max_q * [0, 1, .., bs], kept per max_q (made outside any capture: a tensor
        # made inside one holds its values only while that graph replays)
        fixed = g["fixed_qo_indptr"].get(max_q) if mode != ForwardMode.EXTEND else None
        if fixed is None and mode != ForwardMode.EXTEND and not capturing():
            fixed = g["fixed_qo_indptr"][max_q] = torch.arange(
                0, (g["max_bs"] + 1) * max_q, max_q, dtype=torch.int32, device=g["qo_indptr"].device)
        qo = g["qo_indptr"][:bs + 1] if fixed is None else fixed[:bs + 1]
        prefix_lens, rows = g["prefix_lens"][:bs], g["req_pool_indices"][:bs]
        if in_capture:  # the batch's own tensors where their layout fits (no copies)
            if _aliasable(batch.prefix_lens, torch.int32, (bs,)):
                prefix_lens = batch.prefix_lens
            if _aliasable(batch.req_pool_indices, torch.int64, (bs,)):
                rows = batch.req_pool_indices
            if tm is not None and _aliasable(batch.tree_mask, torch.int32, tuple(tm.shape)):
                tm = batch.tree_mask
        md = TritonMetadata(mode, qo, prefix_lens, rows, tm, max_q, self.graph_prefix_bound, batch.num_tokens)
        return fill_triton_metadata(batch, md, qo_indptr_ready=fixed is not None)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        if not self.supports(batch.forward_mode, graph=True, kind=self.kind):
            raise ValueError(f"{batch.forward_mode.name} cannot be captured by {self.name} "
                             f"for {self.kind.name}")
        self.forward_metadata = self._graph_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self.forward_metadata = self._graph_metadata(batch)

    def init_forward_metadata_in_capture(self, batch: ForwardBatch) -> None:
        """As :meth:`init_forward_metadata_capture_cuda_graph`, reading the batch's
        ``prefix_lens`` (int32), ``req_pool_indices`` (int64) and ``tree_mask`` in place
        where they are contiguous and of the metadata's shape (base class docstring)."""
        if not self.supports(batch.forward_mode, graph=True, kind=self.kind):
            raise ValueError(f"{batch.forward_mode.name} cannot be captured by {self.name} "
                             f"for {self.kind.name}")
        self.forward_metadata = self._graph_metadata(batch, in_capture=True)

    # --------------------------------------------------------------- forward
    def _num_splits(self, md: TritonMetadata, layer: AttentionLayer, q_dtype: torch.dtype
                    ) -> tuple[int, dict]:
        """The split-KV count of this forward and the kernel config it runs with (the
        backend's ``kernel_config``, :data:`FP8_SINGLE_WARP_CONFIG` where
        :func:`fp8_single_warp_splits` picks it, :data:`FP8_NARROW_CONFIG` where
        :func:`fp8_narrow_splits` does, or :data:`WIDE_SPLIT_CONFIG` where
        :func:`wide_decode_splits` does)."""
        if md.mode == ForwardMode.EXTEND:
            return 1, self._config(md.mode)
        if self.num_kv_splits is not None:
            return self.num_kv_splits, self._config(md.mode)
        if self._num_sms == 0:
            return 1, self._config(md.mode)
        cfg = self.kernel_config
        if self.kind == AttentionKind.MLA:
            from specattn.triton_kernels.attention_mla import default_mla_config
            rows, heads, max_splits, waves = md.max_q * layer.num_heads, 1, MLA_MAX_KV_SPLITS, 1
            fp8_cast = False
            dtype = self.kv_pool.dtype
            d = default_mla_config(rows, layer.kv_lora_rank, dtype == torch.float32)
            block_m = cfg.get("block_m", d["block_m"])
            heads *= layer.kv_lora_rank // cfg.get("block_dv", d["block_dv"])
        else:
            from specattn.triton_kernels.attention import default_config
            rows, heads, max_splits, waves = md.max_q * layer.group_size, layer.num_kv_heads, MAX_KV_SPLITS, 2
            width = max(16, 1 << (max(layer.head_dim, layer.v_head_dim) - 1).bit_length())
            kv_dtype = self.kv_pool.dtype
            fp8_cast = self.kv_pool.is_fp8 and q_dtype in (torch.bfloat16, torch.float16)
            ieee = kv_dtype == torch.float32 or (q_dtype != kv_dtype and not fp8_cast)
            block_m = cfg.get("block_m", default_config(rows, width, ieee)["block_m"])
            if block_m >= 128:  # 8-warp tiles: one wave (H100 sweep: 8 splits beat 16 at bs=1)
                waves = 1
        programs = -(-rows // block_m) * heads * md.batch_size
        splits = min(max_splits, max(1, (waves * self._num_sms) // max(programs, 1)))
        if md.max_prefix is None:
            return splits, self._config(md.mode)
        if self.kind == AttentionKind.MLA:
            return mla_splits(splits, md.max_prefix), self._config(md.mode)
        if fp8_cast and md.mode == ForwardMode.DECODE and rows <= FP8_SINGLE_WARP_CONFIG["block_m"] and not cfg:
            single = fp8_single_warp_splits(programs, self._num_sms, md.max_prefix, width, self._hbm_bytes_per_s)
            if single:
                return single, FP8_SINGLE_WARP_CONFIG
        if fp8_cast and rows <= FP8_NARROW_CONFIG["block_m"] and not cfg:
            narrow = fp8_narrow_splits(programs, self._num_sms, md.max_prefix, width, self._hbm_bytes_per_s)
            if narrow:
                return narrow, FP8_NARROW_CONFIG
        if md.mode == ForwardMode.DECODE and not cfg:
            wide = wide_decode_splits(programs, self._num_sms, md.max_prefix, width, self._hbm_bytes_per_s)
            if wide:
                return wide, WIDE_SPLIT_CONFIG
        splits = min(splits, max(1, md.max_prefix // split_keys_mha(programs, rows, block_m)))
        return splits, self._config(md.mode)

    def _metadata_fits(self, batch: ForwardBatch) -> bool:
        md: Optional[TritonMetadata] = self.forward_metadata
        return (md is not None and md.mode == batch.forward_mode and md.batch_size == batch.batch_size
                and md.num_tokens == batch.num_tokens)

    def _forward(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        md: Optional[TritonMetadata] = self.forward_metadata
        if not self._metadata_fits(batch):
            raise RuntimeError("init_forward_metadata was not called for this batch")
        splits, config = self._num_splits(md, layer, q.dtype)
        if q.stride(2) != 1:
            q = q.contiguous()
        rtt = self.req_to_token_pool.req_to_token
        page_size = self.kv_pool.page_size if self.page_aligned else 1
        k_scale, v_scale = self.kv_pool.kv_scales(layer.layer_id)
        if self.kind == AttentionKind.MLA:
            from specattn.triton_kernels.attention_mla import mla_paged_attention
            return mla_paged_attention(q, self.kv_pool.get_key_buffer(layer.layer_id), rtt,
                                       md.req_pool_indices, md.prefix_lens, md.qo_indptr, md.tree_mask,
                                       md.max_q, layer.scaling, layer.kv_lora_rank,
                                       num_splits=splits, page_size=page_size,
                                       check_bounds=False, kv_scale=k_scale, **config)
        from specattn.triton_kernels.attention import paged_attention
        return paged_attention(q, self.kv_pool.get_key_buffer(layer.layer_id),
                               self.kv_pool.get_value_buffer(layer.layer_id), rtt,
                               md.req_pool_indices, md.prefix_lens, md.qo_indptr, md.tree_mask,
                               md.max_q, layer.scaling, num_splits=splits, page_size=page_size,
                               check_bounds=False, max_prefix=md.max_prefix, k_scale=k_scale,
                               v_scale=v_scale, **config)

    def _config(self, mode: ForwardMode) -> dict:
        """The kernel config for ``mode``: MHA's ``"sm90"`` and ``"pingpong"`` name the Gluon
        TARGET_VERIFY kernel and are dropped for the other modes (MLA's Gluon kernel serves
        every mode)."""
        if self.kind == AttentionKind.MLA or mode.is_target_verify():
            return self.kernel_config
        return {k: v for k, v in self.kernel_config.items() if k not in ("sm90", "pingpong")}
