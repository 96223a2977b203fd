"""``ForwardBatch``: what one forward computes, with ONE meaning per field in every mode.

The convention
--------------
For request ``i`` (``r = req_pool_indices[i]``):

- ``prefix_lens[i] = P_i`` is the KV already **committed** for the request *before* this
  forward.  This forward's own tokens are never included, in any mode, in any backend.
- ``extend_lens[i] = n_i`` is the number of tokens this forward runs for the request
  (EXTEND: any n >= 1; DECODE: 1; TARGET_VERIFY and DRAFT_EXTEND_V2: ``num_tokens_per_req``).
  Tokens are laid out request after request: ``qo_indptr = [0, cumsum(extend_lens)]``.
- ``out_cache_loc[qo_indptr[i] + j]`` is the KV slot of token ``j`` of request ``i``; the
  forward writes the token's K/V there (``save_kv_cache=True``).  Before the forward the
  caller has also written the same slots into ``req_to_token[r, P_i : P_i + n_i]``, so the
  keys of request ``i`` are ``req_to_token[r, 0 : P_i + n_i]`` (prefix, then this forward's
  tokens in order) and every backend derives its indptrs/indices/page tables from these
  two numbers alone: kv length = ``P_i + n_i``.
- ``positions[qo_indptr[i] + j]`` is the RoPE position of that token.

SGLang's ``seq_lens`` means something else per mode: the KV length including this
forward's tokens in EXTEND (``extend_prefix_lens`` is our ``prefix_lens``) and DECODE, the
committed length in TARGET_VERIFY and DRAFT_EXTEND_V2 (its backends add
``speculative_num_draft_tokens``).  :meth:`ForwardBatch.to_sglang_lens` and
:meth:`ForwardBatch.from_sglang` convert, so code ported from SGLang keeps its meaning.

Which keys a query token ``j`` of request ``i`` sees (k indexes ``req_to_token[r, :]``):

==================  =================================  ======================================
mode                positions                          visible keys
==================  =================================  ======================================
EXTEND              P .. P+n-1                          k < P + j + 1 (prefix + causal)
DECODE              P                                   k < P + 1
TARGET_VERIFY       P + depth(j)                        k < P, or k = P + m with bit m of
                                                        ``tree_mask[i, j]`` set
DRAFT_EXTEND_V2     P .. P+D-1                          k < P + j + 1 (prefix + causal)
IDLE                (no tokens)                         -
==================  =================================  ======================================

Worked examples (bs = 2, page_size = 1, ``req_pool_indices = [3, 0]``)
------------------------------------------------------------------------
EXTEND (request 0 has a 4-token cached prefix, request 1 a 2-token one)::

    prefix_lens      = [4, 2]          extend_lens = [3, 2]      qo_indptr = [0, 3, 5]
    out_cache_loc = [20, 21, 22, 30, 31]
    positions     = [4, 5, 6, 2, 3]
    req_to_token[3, :7] = [10, 11, 12, 13, 20, 21, 22]    (kv len 7)
    req_to_token[0, :4] = [7, 8, 30, 31]                  (kv len 4)
    token 1 of request 0 (slot 21, pos 5) sees slots 10 11 12 13 20 21

DECODE (the next step)::

    prefix_lens      = [7, 4]          extend_lens = [1, 1]
    out_cache_loc = [23, 32]        positions = [7, 4]
    req_to_token[3, :8] = [10, 11, 12, 13, 20, 21, 22, 23]; req_to_token[0, :5] = [7, 8, 30, 31, 32]

TARGET_VERIFY (``num_tokens_per_req = D = 3``; request 0 drafts a chain 0->1->2, request 1 a
root with two children 1 and 2)::

    prefix_lens      = [8, 5]          extend_lens = [3, 3]
    tree_mask     = [[[0b001], [0b011], [0b111]],      # int32 [2, 3, 1]
                     [[0b001], [0b011], [0b101]]]
    positions     = [8, 9, 10, 5, 6, 6]               # P + depth
    out_cache_loc = [24, 25, 26, 33, 34, 35]
    req_to_token[3, 8:11] = [24, 25, 26]; req_to_token[0, 5:8] = [33, 34, 35]
    token 2 of request 1 (slot 35) sees slots 7 8 30 31 32 (prefix) 33 35 (root, itself)

DRAFT_EXTEND_V2 (the drafter re-runs D = 3 verified positions per request, accepted ones
first; the runtime commits only the accepted ones afterwards)::

    prefix_lens      = [8, 5]          extend_lens = [3, 3]
    positions     = [8, 9, 10, 5, 6, 7]
    out_cache_loc = [24, 25, 26, 33, 34, 35]   (written into req_to_token as above)

IDLE: ``req_pool_indices``, ``prefix_lens``, ``extend_lens``, ``out_cache_loc``, ``positions``
all empty; the forward returns an empty output.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from specattn.ops.tree_mask import check_tree_mask

from .forward_mode import ForwardMode

__all__ = ["ForwardBatch"]


_INT32_RANGE = (-2 ** 31, 2 ** 31 - 1)


def _ints(name: str, x, dtype: torch.dtype, device) -> torch.Tensor:
    """``x`` (a list, tuple or tensor of integers) as a ``dtype`` tensor on ``device``.
    Raises TypeError for floats, bools or complex values (never truncated) and, for host
    data, ValueError for values outside int32 when ``dtype`` is int32 (never wrapped; a
    device tensor is not read back)."""
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if t.numel() == 0 and not isinstance(x, torch.Tensor):
        t = t.to(torch.int64)                         # [] reads as float32
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    if dtype == torch.int32 and t.dtype == torch.int64 and t.device.type == "cpu" and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < _INT32_RANGE[0] or hi > _INT32_RANGE[1]:
            raise ValueError(f"{name} must fit int32, got values in [{lo}, {hi}]")
    return t.to(device=device, dtype=dtype)


def _i32(name: str, x, device) -> torch.Tensor:
    return _ints(name, x, torch.int32, device)


def _i64(name: str, x, device) -> torch.Tensor:
    return _ints(name, x, torch.int64, device)


def _host_i32(name: str, x) -> Optional[torch.Tensor]:
    """An int32 CPU copy of ``x`` when that needs no device read (a list, tuple or CPU
    tensor), else None."""
    if isinstance(x, torch.Tensor) and x.device.type != "cpu":
        return None
    t = _i32(name, x, "cpu")
    return t.clone() if t is x else t


def _check_nonneg(name: str, host: Optional[torch.Tensor]) -> None:
    if host is not None and host.numel() and int(host.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {host.tolist()}")


@dataclass
class ForwardBatch:
    """One forward's batch (see the module docstring for the meaning of every field).

    The constructors (:meth:`extend`, :meth:`decode`, :meth:`fixed`, :meth:`from_sglang`)
    take lists or tensors of integers; they raise TypeError for floats or bools (never
    truncated) and ValueError for negative lengths, host values outside int32 (never wrapped)
    or ``num_tokens_per_req < 1``.

    Attributes:
        forward_mode: the :class:`ForwardMode`.
        req_pool_indices: int64 ``[bs]``, rows of ``ReqToTokenPool.req_to_token``.
        prefix_lens: int32 ``[bs]``, committed KV before this forward (tokens).
        extend_lens: int32 ``[bs]``, this forward's tokens per request.
        out_cache_loc: int64 ``[T]``, KV slot of each token, ``T = sum(extend_lens)``.
        positions: int64 ``[T]``, RoPE position of each token.
        num_tokens_per_req: ``D`` for TARGET_VERIFY / DRAFT_EXTEND_V2, else None.
        tree_mask: int32 ``[bs, D, ceil(D/32)]`` for TARGET_VERIFY, else None.
        prefix_lens_cpu, extend_lens_cpu: optional CPU copies for host-side planners
            (eager only; graph replay must not rely on them being fresh).
    """

    forward_mode: ForwardMode
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    num_tokens_per_req: Optional[int] = None
    tree_mask: Optional[torch.Tensor] = None
    prefix_lens_cpu: Optional[torch.Tensor] = None
    extend_lens_cpu: Optional[torch.Tensor] = None

    # ---------------------------------------------------------------- derived
    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.shape[0]

    @property
    def device(self) -> torch.device:
        return self.prefix_lens.device

    def qo_indptr(self) -> torch.Tensor:
        """int32 ``[bs + 1]``: ``[0, cumsum(extend_lens)]`` on the batch's device."""
        out = torch.zeros(self.batch_size + 1, dtype=torch.int32, device=self.device)
        torch.cumsum(self.extend_lens, 0, out=out[1:])
        return out

    def to_sglang_lens(self) -> dict:
        """SGLang's length fields for this batch: ``{"seq_lens", "extend_prefix_lens",
        "extend_seq_lens"}`` (int32 tensors on the batch's device; the last two only for
        EXTEND).  EXTEND: ``seq_lens = P + n``; DECODE: ``P + 1``; TARGET_VERIFY and
        DRAFT_EXTEND_V2: ``P`` (SGLang's backends add the fixed token count); IDLE: empty."""
        mode, P, n = self.forward_mode, self.prefix_lens, self.extend_lens
        if mode == ForwardMode.EXTEND:
            return {"seq_lens": P + n, "extend_prefix_lens": P.clone(), "extend_seq_lens": n.clone()}
        if mode.is_decode():
            return {"seq_lens": P + 1}
        return {"seq_lens": P.clone()}

    @classmethod
    def from_sglang(cls, mode: ForwardMode, req_pool_indices, seq_lens, out_cache_loc, positions=None, *,
                    extend_seq_lens=None, num_tokens_per_req: Optional[int] = None, tree_mask=None,
                    device=None) -> "ForwardBatch":
        """A batch from SGLang's fields, ``seq_lens`` in SGLang's meaning for ``mode`` (see
        :meth:`to_sglang_lens`): EXTEND needs ``extend_seq_lens`` (``prefix_lens = seq_lens -
        extend_seq_lens``), DECODE takes ``prefix_lens = seq_lens - 1``, TARGET_VERIFY /
        DRAFT_EXTEND_V2 take ``seq_lens`` as the prefix and need ``num_tokens_per_req``.

        Raises:
            ValueError: a missing field for ``mode``, or a length below zero.
        """
        dev = device if device is not None else torch.as_tensor(out_cache_loc).device
        seq = _i64("seq_lens", seq_lens, dev)
        if mode == ForwardMode.EXTEND:
            if extend_seq_lens is None:
                raise ValueError("EXTEND needs extend_seq_lens")
            ext = _i64("extend_seq_lens", extend_seq_lens, dev)
            P = seq - ext
        elif mode.is_decode():
            P = seq - 1
        elif mode.has_fixed_tokens_per_req():
            if num_tokens_per_req is None:
                raise ValueError(f"{mode.name} needs num_tokens_per_req")
            P = seq
        else:
            return cls.idle(dev)
        if P.numel() and bool((P < 0).any()):
            raise ValueError(f"seq_lens too short for {mode.name}: a prefix length below 0")
        host = P.cpu()
        if mode == ForwardMode.EXTEND:
            return cls.extend(req_pool_indices, host, ext.cpu(), out_cache_loc, positions, device=dev)
        if mode.is_decode():
            return cls.decode(req_pool_indices, host, out_cache_loc, positions, device=dev)
        return cls.fixed(mode, req_pool_indices, host, num_tokens_per_req, out_cache_loc, positions=positions,
                         tree_mask=tree_mask, device=dev)

    def with_cpu_copies(self) -> "ForwardBatch":
        """A copy with ``prefix_lens_cpu``/``extend_lens_cpu`` filled (one host sync)."""
        return replace(self, prefix_lens_cpu=self.prefix_lens.cpu(), extend_lens_cpu=self.extend_lens.cpu())

    # ---------------------------------------------------------------- constructors
    @classmethod
    def extend(cls, req_pool_indices, prefix_lens, extend_lens, out_cache_loc, positions=None,
               device=None) -> "ForwardBatch":
        """EXTEND batch.  ``positions`` default to ``P_i .. P_i + n_i - 1``.  Lists or tensors."""
        dev = device if device is not None else torch.as_tensor(out_cache_loc).device
        prefix_lens_cpu = _i32("prefix_lens", prefix_lens, "cpu").clone()
        ext_cpu = _i32("extend_lens", extend_lens, "cpu").clone()
        _check_nonneg("prefix_lens", prefix_lens_cpu)
        _check_nonneg("extend_lens", ext_cpu)
        if positions is None:
            positions = torch.cat([torch.arange(int(p), int(p) + int(n)) for p, n in
                                   zip(prefix_lens_cpu, ext_cpu)]) if len(ext_cpu) else torch.zeros(0, dtype=torch.int64)
        return cls(ForwardMode.EXTEND, _i64("req_pool_indices", req_pool_indices, dev),
                   _i32("prefix_lens", prefix_lens, dev), _i32("extend_lens", extend_lens, dev),
                   _i64("out_cache_loc", out_cache_loc, dev), _i64("positions", positions, dev),
                   prefix_lens_cpu=prefix_lens_cpu, extend_lens_cpu=ext_cpu)

    @classmethod
    def decode(cls, req_pool_indices, prefix_lens, out_cache_loc, positions=None, device=None
               ) -> "ForwardBatch":
        """DECODE batch; ``positions`` default to ``prefix_lens``.  Host ``prefix_lens`` (a list or
        CPU tensor) are also kept as ``prefix_lens_cpu`` / ``extend_lens_cpu`` (for host planners,
        no device read)."""
        dev = device if device is not None else torch.as_tensor(out_cache_loc).device
        host = _host_i32("prefix_lens", prefix_lens)
        _check_nonneg("prefix_lens", host)
        prefix_lens = _i32("prefix_lens", prefix_lens, dev)
        pos = prefix_lens.long() if positions is None else _i64("positions", positions, dev)
        return cls(ForwardMode.DECODE, _i64("req_pool_indices", req_pool_indices, dev), prefix_lens,
                   torch.ones_like(prefix_lens), _i64("out_cache_loc", out_cache_loc, dev), pos, prefix_lens_cpu=host,
                   extend_lens_cpu=None if host is None else torch.ones_like(host))

    @classmethod
    def fixed(cls, mode: ForwardMode, req_pool_indices, prefix_lens, num_tokens_per_req: int,
              out_cache_loc, positions=None, tree_mask=None, device=None) -> "ForwardBatch":
        """TARGET_VERIFY (``tree_mask`` and ``positions`` required) or DRAFT_EXTEND_V2
        (``positions`` default to ``P .. P + D - 1``) batch with ``D`` tokens per request.
        Host ``prefix_lens`` are also kept as ``prefix_lens_cpu`` / ``extend_lens_cpu``."""
        if not mode.has_fixed_tokens_per_req():
            raise ValueError(f"{mode.name} has no fixed tokens per request")
        if isinstance(num_tokens_per_req, bool) or not isinstance(num_tokens_per_req, int) \
                or num_tokens_per_req < 1:
            raise ValueError(f"num_tokens_per_req must be an int >= 1, got {num_tokens_per_req!r}")
        dev = device if device is not None else torch.as_tensor(out_cache_loc).device
        host = _host_i32("prefix_lens", prefix_lens)
        _check_nonneg("prefix_lens", host)
        prefix_lens = _i32("prefix_lens", prefix_lens, dev)
        bs, D = prefix_lens.shape[0], num_tokens_per_req
        if mode.is_target_verify() and (tree_mask is None or positions is None):
            raise ValueError("TARGET_VERIFY needs tree_mask and positions (P + depth)")
        if positions is None:
            positions = (prefix_lens.long()[:, None] + torch.arange(D, device=dev)).flatten()
        return cls(mode, _i64("req_pool_indices", req_pool_indices, dev), prefix_lens,
                   torch.full((bs,), D, dtype=torch.int32, device=dev), _i64("out_cache_loc", out_cache_loc, dev),
                   _i64("positions", positions, dev), num_tokens_per_req=D,
                   tree_mask=None if tree_mask is None else (
                       tree_mask.to(dev) if isinstance(tree_mask, torch.Tensor)
                       else torch.as_tensor(tree_mask, dtype=torch.int32, device=dev)),
                   prefix_lens_cpu=host, extend_lens_cpu=None if host is None else torch.full_like(host, D))

    @classmethod
    def idle(cls, device="cpu") -> "ForwardBatch":
        """An IDLE batch: no requests, no tokens."""
        e64 = torch.zeros(0, dtype=torch.int64, device=device)
        e32 = torch.zeros(0, dtype=torch.int32, device=device)
        return cls(ForwardMode.IDLE, e64, e32, e32.clone(), e64.clone(), e64.clone())

    # ---------------------------------------------------------------- checks
    def validate(self, req_to_token: Optional[torch.Tensor] = None) -> None:
        """Check shapes, dtypes and the convention (lengths, slots and rows >= 0, EXTEND
        ``n >= 1``); with ``req_to_token`` also the rows against its height and
        ``req_to_token[r, P:P+n] == out_cache_loc`` for every request.  ``positions`` are
        not checked: they only feed RoPE, and drafters place them as their design needs
        (a DFlash block runs TARGET_VERIFY at its own positions).  Host syncs: use in
        tests and debug runs, not on a hot path.

        Raises:
            ValueError: any inconsistency, with what was expected.
        """
        bs, T, mode = self.batch_size, self.num_tokens, self.forward_mode
        for name, t, dt, n in (("req_pool_indices", self.req_pool_indices, torch.int64, bs),
                               ("prefix_lens", self.prefix_lens, torch.int32, bs),
                               ("extend_lens", self.extend_lens, torch.int32, bs),
                               ("out_cache_loc", self.out_cache_loc, torch.int64, T),
                               ("positions", self.positions, torch.int64, T)):
            if t.dtype != dt or t.shape != (n,) or t.device != self.device:
                raise ValueError(f"{name} must be {dt} [{n}] on {self.device}, got {t.dtype} "
                                 f"{list(t.shape)} on {t.device}")
        if mode.is_idle():
            if bs or T:
                raise ValueError("IDLE batch must be empty")
            return
        ext = self.extend_lens.cpu()
        if bool((ext < 0).any()) or (mode == ForwardMode.EXTEND and bool((ext < 1).any())):
            raise ValueError(f"extend_lens must be >= 1 (EXTEND) / >= 0, got {ext.tolist()}")
        if int(ext.sum()) != T:
            raise ValueError(f"sum(extend_lens) = {int(ext.sum())} but out_cache_loc has {T} tokens")
        if bool((self.prefix_lens < 0).any()):
            raise ValueError("prefix_lens must be >= 0")
        if bool((self.req_pool_indices < 0).any()):
            raise ValueError(f"req_pool_indices must be >= 0, got {self.req_pool_indices.tolist()}")
        if T and bool((self.out_cache_loc < 0).any()):
            raise ValueError("out_cache_loc must be >= 0 (KV slots)")
        if mode.is_decode() and bool((ext != 1).any()):
            raise ValueError("DECODE needs extend_lens == 1")
        if mode.has_fixed_tokens_per_req():
            D = self.num_tokens_per_req
            if D is None:
                raise ValueError(f"{mode.name} needs num_tokens_per_req")
            if bool((ext != D).any()):
                raise ValueError(f"{mode.name} needs extend_lens == num_tokens_per_req = {D} for every request, "
                                 f"got {ext.tolist()}")
        if mode.is_target_verify():
            if self.tree_mask is None:
                raise ValueError("TARGET_VERIFY needs tree_mask")
            check_tree_mask(self.tree_mask, bs, self.num_tokens_per_req)
            D = self.num_tokens_per_req
            if D % 32 and bs:   # bits past D in the last word would be silently ignored
                past = self.tree_mask[..., -1].cpu().long() & ~((1 << (D % 32)) - 1) & 0xFFFFFFFF
                if bool(past.any()):
                    raise ValueError(f"tree_mask has bits set past num_tokens_per_req = {D}")
        if req_to_token is not None:
            self.check_slots(req_to_token)

    def check_slots(self, req_to_token: torch.Tensor) -> None:
        """The part of :meth:`validate` that reads ``req_to_token`` (int ``[rows, width]``):
        every ``req_pool_indices`` row within its height, ``P + n`` within its width and
        ``req_to_token[r, P:P+n] == out_cache_loc`` of the request's tokens (for a batch
        whose layout :meth:`validate` already passed; host syncs).

        Raises:
            ValueError: the first request that breaks one of these."""
        bs = self.batch_size
        if bs and int(self.req_pool_indices.max()) >= req_to_token.shape[0]:
            raise ValueError(f"req_pool_indices must be < {req_to_token.shape[0]} (req_to_token rows), "
                             f"got {self.req_pool_indices.tolist()}")
        seq = self.prefix_lens.cpu().tolist()
        rows = self.req_pool_indices.cpu().tolist()
        loc = self.out_cache_loc.cpu()
        start = 0
        for r, p, n in zip(rows, seq, self.extend_lens.cpu().tolist()):
            if p + n > req_to_token.shape[1]:
                raise ValueError(f"request row {r}: {p}+{n} tokens exceed req_to_token width")
            if not torch.equal(req_to_token[r, p:p + n].cpu().long(), loc[start:start + n]):
                raise ValueError(f"req_to_token[{r}, {p}:{p + n}] != out_cache_loc of its tokens")
            start += n
