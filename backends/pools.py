"""Memory pools: request -> token slots, token slots -> KV, and a slot allocator.

Slot layout of every KV pool: ``size + page_size`` slots per layer.  Page 0 (slots
``0 .. page_size-1``) is reserved: padded rows of a CUDA-graph batch write their KV there,
so padding never touches a live request.  The allocator hands out slots from page 1 on.
Slot ``s`` lies in page ``s // page_size``; with ``page_size > 1`` the tokens of a request
fill its pages in order (token ``p`` at offset ``p % page_size`` of its page).

KV dtypes: float32, float16, bfloat16, or ``torch.float8_e4m3fn`` with a dequantization scale
per layer (K and V apart for MHA, one for MLA's latent; :mod:`specattn.ops.fp8`: the cache
holds ``clamp(x / scale, +-448)`` in e4m3, readers multiply by the scale).  ``set_kv_buffer``
quantizes; ``kv_scales(layer_id)`` gives every reader and other writer the layer's scales.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from specattn.ops import move_kv_cache
from specattn.ops.checks import INDEX_DTYPES, check_index_range, check_int, check_tensor, check_writes_disjoint
from specattn.ops.fp8 import KV_CACHE_DTYPES, check_kv_scales, quantize_kv

__all__ = ["ReqToTokenPool", "MHATokenToKVPool", "MLATokenToKVPool", "KVAllocator"]



class ReqToTokenPool:
    """``req_to_token`` int32 ``[size, max_context_len]``: row ``r`` lists the KV slot of each
    token position of the request that owns row ``r``."""

    def __init__(self, size: int, max_context_len: int, device="cpu"):
        if size <= 0 or max_context_len <= 0:
            raise ValueError("size and max_context_len must be positive")
        self.size, self.max_context_len, self.device = size, max_context_len, torch.device(device)
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=device)
        self.device = self.req_to_token.device  # "cuda" resolved to "cuda:N"
        self._free: List[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> Optional[List[int]]:
        """``n`` free rows, or None if fewer are free.  Raises ValueError unless ``n`` is an
        int >= 0."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if n > len(self._free):
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, rows: Sequence[int]) -> None:
        """Return rows, all or none.  Raises TypeError on a row that is not an int, ValueError
        on an out-of-range, already-free or repeated row (before any row is returned)."""
        rows = [check_int("row", r) for r in rows]
        free = set(self._free)
        for i, r in enumerate(rows):
            if not 0 <= r < self.size or r in free or r in rows[:i]:
                raise ValueError(f"row {r} is out of range, already free or repeated")
        self._free.extend(rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """``req_to_token[row, start:start+len(slots)] = slots`` (an int32 / int64 ``[n]``
        tensor of KV slots).  Raises TypeError on a non-int ``row`` / ``start`` or a
        non-tensor, ValueError on a tensor of another rank or dtype, IndexError past the
        width or on a slot outside ``[0, 2**31)`` (one host sync; never wrapped)."""
        row, start = check_int("row", row), check_int("start", start)
        check_tensor("slots", slots, dim=1, dtypes=INDEX_DTYPES)
        n = slots.shape[0]
        if not 0 <= row < self.size or start < 0 or start + n > self.max_context_len:
            raise IndexError(f"row {row}, positions [{start}, {start + n}) outside "
                             f"[{self.size}, {self.max_context_len}]")
        check_index_range("slots", slots, 2 ** 31)
        self.req_to_token[row, start:start + n] = slots.to(self.req_to_token)


Scales = Union[float, Sequence[float]]


class _KVPoolBase:
    def __init__(self, size: int, page_size: int, dtype: torch.dtype, layer_num: int, device):
        size, page_size = check_int("size", size), check_int("page_size", page_size)
        layer_num = check_int("layer_num", layer_num)
        if page_size < 1 or size < 1 or size % page_size:
            raise ValueError(f"size ({size}) must be a positive multiple of page_size ({page_size})")
        if dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"KV pool dtype must be one of {[str(d) for d in KV_CACHE_DTYPES]}, "
                             f"got {dtype}")
        if layer_num < 1:
            raise ValueError(f"layer_num must be >= 1, got {layer_num}")
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.layer_num = layer_num
        self.device = torch.empty(0, device=device).device  # "cuda" resolved to "cuda:N"
        self.num_slots = size + page_size

    @property
    def buffers(self) -> List[torch.Tensor]:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def is_fp8(self) -> bool:
        """Whether the pool stores ``float8_e4m3fn`` (scaled; :meth:`kv_scales`)."""
        return self.dtype == torch.float8_e4m3fn

    def kv_scales(self, layer_id: int) -> Tuple[float, float]:  # pragma: no cover - overridden
        """``(k_scale, v_scale)`` of ``layer_id``: a cached element times its scale is the
        value written (1.0 unless the pool is fp8)."""
        raise NotImplementedError

    def _layer(self, layer_id: int) -> int:
        """``layer_id`` checked: TypeError unless an int, IndexError outside ``[0, layer_num)``
        (no wrap-around: -1 is not the last layer)."""
        if type(layer_id) is int and 0 <= layer_id < self.layer_num:   # the common case, fast
            return layer_id
        i = check_int("layer_id", layer_id)
        if not 0 <= i < self.layer_num:
            raise IndexError(f"layer_id {layer_id} outside [0, {self.layer_num})")
        return i

    def _check_loc(self, loc: torch.Tensor, layer_id: int) -> None:
        self._layer(layer_id)
        check_tensor("loc", loc, dim=1, dtypes=INDEX_DTYPES, device=self.device)
        check_index_range("loc", loc, self.num_slots)

    def _check_rows(self, name: str, t: torch.Tensor, n: int, shape) -> None:
        check_tensor(name, t, device=self.device, shape=(n, *shape), dtypes=KV_CACHE_DTYPES)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor, impl: str = "auto",
                      group_size: Optional[int] = None, check_values: bool = True) -> None:
        """For every layer, slot ``tgt_loc[i]`` gets what slot ``src_loc[i]`` held before the
        call (overlap-safe), all layers in one launch.  ``group_size``: the promise that
        selects the one-launch direct path (pairs of ``compact_accepted_path``:
        ``num_draft_tokens``); ``check_values=False`` skips the value checks (no host sync).
        See :func:`specattn.ops.move_kv_cache` for both and for errors."""
        move_kv_cache(self.buffers, tgt_loc, src_loc, impl=impl, group_size=group_size,
                      check_values=check_values)


class MHATokenToKVPool(_KVPoolBase):
    """Per layer K ``[size + page_size, head_num, head_dim]`` and V ``[..., v_head_dim]``.

    ``k_scale`` / ``v_scale``: the fp8 dequantization scales, one float for every layer or a
    sequence of ``layer_num`` floats (default 1.0; other values only with
    ``dtype=torch.float8_e4m3fn``).  Raises ValueError on a dtype outside float32 / float16 /
    bfloat16 / float8_e4m3fn, a bad size or scale, a head count or dimension < 1; TypeError
    on a non-float scale or a non-int size."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device="cpu", v_head_dim: Optional[int] = None,
                 k_scale: Scales = 1.0, v_scale: Scales = 1.0):
        super().__init__(size, page_size, dtype, layer_num, device)
        self.head_num, self.head_dim = check_int("head_num", head_num, minimum=1), check_int("head_dim", head_dim, minimum=1)
        self.v_head_dim = head_dim if v_head_dim is None else check_int("v_head_dim", v_head_dim, minimum=1)
        self.k_scales = check_kv_scales("k_scale", k_scale, layer_num, self.is_fp8)
        self.v_scales = check_kv_scales("v_scale", v_scale, layer_num, self.is_fp8)
        self.k_buffer = [torch.zeros(self.num_slots, head_num, head_dim, dtype=dtype, device=device)
                         for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(self.num_slots, head_num, self.v_head_dim, dtype=dtype,
                                     device=device) for _ in range(layer_num)]

    @property
    def buffers(self) -> List[torch.Tensor]:
        """K then V of every layer, as ``move_kv_cache`` takes them."""
        return self.k_buffer + self.v_buffer

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s K ``[size + page_size, head_num, head_dim]``; IndexError
        outside ``[0, layer_num)``, TypeError on a non-int."""
        return self.k_buffer[self._layer(layer_id)]

    def kv_scales(self, layer_id: int) -> Tuple[float, float]:
        i = self._layer(layer_id)
        return self.k_scales[i], self.v_scales[i]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s V ``[size + page_size, head_num, v_head_dim]``; errors as
        :meth:`get_key_buffer`."""
        return self.v_buffer[self._layer(layer_id)]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: torch.Tensor) -> None:
        """Write ``cache_k [n, head_num, head_dim]`` / ``cache_v [n, head_num, v_head_dim]``
        (cast to the pool dtype; fp8: divided by the layer's scale and saturated,
        :func:`specattn.ops.fp8.quantize_kv`) at slots ``loc`` (int32/int64 ``[n]``).

        Raises:
            IndexError: a slot outside ``[0, size + page_size)`` or a bad layer (before any write).
            ValueError: wrong shapes, dtypes or devices; ``cache_k``, ``cache_v`` or ``loc``
                sharing memory with the layer's buffers (before any write).
        A slot repeated in ``loc`` gets one of its rows, which one is unspecified (as
        ``index_put_``; SGLang's ``set_kv_buffer`` likewise).
        """
        self._check_loc(loc, layer_id)
        self._check_rows("cache_k", cache_k, loc.shape[0], (self.head_num, self.head_dim))
        self._check_rows("cache_v", cache_v, loc.shape[0], (self.head_num, self.v_head_dim))
        check_writes_disjoint([("k_buffer", self.k_buffer[layer_id]), ("v_buffer", self.v_buffer[layer_id])],
                              [("cache_k", cache_k), ("cache_v", cache_v), ("loc", loc)])
        ks, vs = self.kv_scales(layer_id)
        self.k_buffer[layer_id][loc.long()] = quantize_kv(cache_k, self.dtype, ks)
        self.v_buffer[layer_id][loc.long()] = quantize_kv(cache_v, self.dtype, vs)


class MLATokenToKVPool(_KVPoolBase):
    """Per layer the absorbed-MLA latent ``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]``
    (``[c_kv | k_pe]``); the values are its first ``kv_lora_rank`` entries.

    ``kv_scale``: the fp8 dequantization scale of the latent (keys and values alike), one
    float or one per layer (default 1.0; other values only with ``float8_e4m3fn``).
    Errors as :class:`MHATokenToKVPool`."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, layer_num: int, device="cpu",
                 kv_lora_rank: int = 512, qk_rope_head_dim: int = 64, kv_scale: Scales = 1.0):
        super().__init__(size, page_size, dtype, layer_num, device)
        self.latent_scales = check_kv_scales("kv_scale", kv_scale, layer_num, self.is_fp8)
        self.kv_lora_rank = check_int("kv_lora_rank", kv_lora_rank, minimum=1)
        self.qk_rope_head_dim = check_int("qk_rope_head_dim", qk_rope_head_dim, minimum=0)
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.kv_buffer = [torch.zeros(self.num_slots, 1, self.kv_cache_dim, dtype=dtype, device=device)
                          for _ in range(layer_num)]

    @property
    def buffers(self) -> List[torch.Tensor]:
        return list(self.kv_buffer)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s latent ``[size + page_size, 1, kv_lora_rank +
        qk_rope_head_dim]``; IndexError outside ``[0, layer_num)``, TypeError on a non-int."""
        return self.kv_buffer[self._layer(layer_id)]

    def kv_scales(self, layer_id: int) -> Tuple[float, float]:
        i = self._layer(layer_id)
        return self.latent_scales[i], self.latent_scales[i]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """A view ``[slots, 1, kv_lora_rank]`` of the latent; errors as :meth:`get_key_buffer`."""
        return self.kv_buffer[self._layer(layer_id)][..., :self.kv_lora_rank]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: Optional[torch.Tensor] = None) -> None:
        """Write the latent ``cache_k [n, 1, kv_lora_rank + qk_rope_head_dim]`` (quantized
        like MHA's) at ``loc``;
        ``cache_v`` is ignored (the values live inside the latent).  Errors as MHA."""
        self._check_loc(loc, layer_id)
        self._check_rows("cache_k", cache_k, loc.shape[0], (1, self.kv_cache_dim))
        check_writes_disjoint([("kv_buffer", self.kv_buffer[layer_id])], [("cache_k", cache_k), ("loc", loc)])
        self.kv_buffer[layer_id][loc.long()] = quantize_kv(cache_k, self.dtype, self.latent_scales[layer_id])


class KVAllocator:
    """Hands out KV slots page by page (host-side bookkeeping; page 0 is never handed out).

    ``page_size == 1`` is plain slot allocation.  With larger pages a request's tokens fill
    its current page before a new one is taken (``alloc_extend``).
    """

    def __init__(self, size: int, page_size: int = 1, device="cpu"):
        if page_size < 1 or size < page_size or size % page_size:
            raise ValueError(f"size ({size}) must be a positive multiple of page_size ({page_size})")
        self.size, self.page_size, self.device = size, page_size, torch.device(device)
        self.num_pages = size // page_size
        self._free_pages: List[int] = list(range(1, self.num_pages + 1))
        self._free_set = set(self._free_pages)

    def available_size(self) -> int:
        """Free tokens in whole free pages."""
        return len(self._free_pages) * self.page_size

    def _take(self, n: int) -> List[int]:
        out = self._free_pages[:n]
        self._free_pages = self._free_pages[n:]
        self._free_set.difference_update(out)
        return out

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        """``n`` slots filling ``ceil(n / page_size)`` fresh pages in order (int64 ``[n]`` on
        the pool's device), or None when too few pages are free."""
        return self.alloc_extend([0], [n], [-1])

    def alloc_extend(self, prefix_lens: Sequence[int], extend_lens: Sequence[int],
                     last_loc: Sequence[int]) -> Optional[torch.Tensor]:
        """Slots for ``extend_lens[i]`` new tokens after ``prefix_lens[i]`` tokens per request,
        concatenated request after request (int64 ``[sum(extend_lens)]``), or None when out of
        pages (nothing is taken then).

        ``last_loc[i]`` is the slot of the request's token ``prefix_lens[i] - 1`` (-1 when the
        prefix is empty): tokens continue in that page while it has room.
        Raises ValueError on inconsistent lengths, a ``last_loc`` at the wrong page offset or
        in a page not in use (out of range or free: its slots would be handed out twice);
        TypeError on a value that is not an int.
        """
        if not len(prefix_lens) == len(extend_lens) == len(last_loc):
            raise ValueError("prefix_lens, extend_lens and last_loc must have one entry per request")
        ps, plan, need = self.page_size, [], 0
        for p, n, last in zip(prefix_lens, extend_lens, last_loc):
            p, n, last = check_int("prefix_lens", p), check_int("extend_lens", n), check_int("last_loc", last)
            if n < 0 or p < 0:
                raise ValueError("lengths must be >= 0")
            room = 0
            if p % ps:
                if last < ps or last % ps != (p - 1) % ps:
                    raise ValueError(f"last_loc {last} is not the slot of token {p - 1} in its page")
                if last // ps > self.num_pages or last // ps in self._free_set:
                    raise ValueError(f"last_loc {last} lies in page {last // ps}, which is not a page in use "
                                     f"(pages 1 .. {self.num_pages}, handed out and not freed)")
                room = ps - p % ps
            in_page = min(room, n)
            pages = -(-(n - in_page) // ps)
            plan.append((last, in_page, n - in_page, pages))
            need += pages
        if need > len(self._free_pages):
            return None
        out: List[int] = []
        for last, in_page, rest, pages in plan:
            out.extend(range(last + 1, last + 1 + in_page))
            for pg in self._take(pages):
                take = min(ps, rest)
                out.extend(range(pg * ps, pg * ps + take))
                rest -= take
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages holding ``slots`` (the caller passes every slot it still used in
        them: with pages > 1, a page is returned whole).  Raises ValueError on a reserved,
        out-of-range or already-free page."""
        pages = sorted(set((slots.cpu().long() // self.page_size).tolist()))
        for pg in pages:
            if not 1 <= pg <= self.num_pages or pg in self._free_set:
                raise ValueError(f"page {pg} is reserved, out of range or already free")
        self._free_pages.extend(pages)
        self._free_set.update(pages)
