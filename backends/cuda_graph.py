"""Static input buffers for CUDA-graph capture and replay.

The graph runner owns one :class:`GraphInputBuffers`; ``fill(batch, padded_bs)`` copies a
live batch (``bs <= padded_bs``) into the buffers and returns a :class:`ForwardBatch` of
``padded_bs`` requests viewing them.  Padded requests are harmless: ``req_pool_indices = 0``,
``prefix_lens = 0``, ``positions = 0``, ``out_cache_loc = 0`` (the reserved page, see
:mod:`~specattn.backends.pools`) and a tree mask where each padded token sees only itself.
Device copies only: no host sync.  A live batch that carries host copies of its lengths
(``prefix_lens_cpu`` / ``extend_lens_cpu``: the runtime's batches do) gets them padded too, so
backends that plan on the host (FlashInfer) need no device read at replay.

Fixed-shape modes (DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2): ``D`` tokens per request (1 for
DECODE), padded requests too.  EXTEND (for backends that capture it, e.g. Triton): the
per-request counts are device values, so the padded batch has a static token count
``padded_tokens`` (default ``padded_bs * max_tokens_per_req``); padded requests get
``extend_lens = 0`` and the token tail past the live tokens belongs to no request
(``out_cache_loc = 0``, ``positions = 0``).  Example: live ``extend_lens = [3, 2]``,
``padded_bs = 4``, ``padded_tokens = 8`` -> ``extend_lens = [3, 2, 0, 0]``, 8 token rows of
which 5 are live.
"""
from __future__ import annotations

from typing import Optional

import torch

from specattn.ops.tree_mask import check_tree_mask, num_mask_words, pack_tree_mask

from .forward_batch import ForwardBatch
from .forward_mode import ForwardMode


def _host_lens(batch: ForwardBatch, padded_bs: int, pad_n: int) -> dict:
    """The live batch's host copies of ``prefix_lens`` / ``extend_lens`` padded like the device
    buffers (padded requests: ``P = 0``, ``n = pad_n``), so host planners (FlashInfer's
    ``plan()``) read no device value at replay; empty when the batch has none."""
    if batch.prefix_lens_cpu is None or batch.extend_lens_cpu is None:
        return {}
    pad = padded_bs - batch.batch_size
    return dict(prefix_lens_cpu=torch.cat([batch.prefix_lens_cpu, torch.zeros(pad, dtype=torch.int32)]),
                extend_lens_cpu=torch.cat([batch.extend_lens_cpu,
                                           torch.full((pad,), pad_n, dtype=torch.int32)]))


def _check_batch_fields(batch: ForwardBatch) -> None:
    """ValueError unless ``batch``'s per-request fields are integer ``[bs]``, its per-token
    ones integer ``[T]`` with ``T`` the sum its mode implies, its host copies ``[bs]`` and a
    TARGET_VERIFY mask int32 ``[bs, D, ceil(D/32)]`` (shapes and dtypes only: no device read)."""
    bs, T, mode = batch.batch_size, batch.num_tokens, batch.forward_mode
    per_token = bs * (batch.num_tokens_per_req or 0) if mode.has_fixed_tokens_per_req() else \
        (bs if mode.is_decode() else T)
    for name, t, n in (("req_pool_indices", batch.req_pool_indices, bs), ("prefix_lens", batch.prefix_lens, bs),
                       ("extend_lens", batch.extend_lens, bs), ("out_cache_loc", batch.out_cache_loc, per_token),
                       ("positions", batch.positions, per_token), ("prefix_lens_cpu", batch.prefix_lens_cpu, bs),
                       ("extend_lens_cpu", batch.extend_lens_cpu, bs)):
        if t is None:
            continue
        if t.shape != (n,) or t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
            raise ValueError(f"{name} must be an integer [{n}] tensor, got {t.dtype} {list(t.shape)}")
    if mode.is_target_verify():
        if batch.tree_mask is None:
            raise ValueError("TARGET_VERIFY needs tree_mask")
        check_tree_mask(batch.tree_mask, bs, batch.num_tokens_per_req)


class GraphInputBuffers:
    """Static buffers for up to ``max_bs`` requests of up to ``max_tokens_per_req`` tokens
    (EXTEND: up to ``max_bs * max_tokens_per_req`` tokens in all)."""

    def __init__(self, max_bs: int, max_tokens_per_req: int, device):
        for name, v in (("max_bs", max_bs), ("max_tokens_per_req", max_tokens_per_req)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.max_bs, self.max_tokens_per_req = max_bs, max_tokens_per_req
        T, D = max_bs * max_tokens_per_req, max_tokens_per_req
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.prefix_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.extend_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.out_cache_loc = torch.zeros(T, dtype=torch.int64, device=device)
        self.positions = torch.zeros(T, dtype=torch.int64, device=device)
        self.tree_mask = torch.zeros(max_bs, D, num_mask_words(D), dtype=torch.int32, device=device)

    def fill(self, batch: ForwardBatch, padded_bs: int, padded_tokens: Optional[int] = None) -> ForwardBatch:
        """Copy ``batch`` into the buffers, pad to ``padded_bs`` requests (EXTEND: and to
        ``padded_tokens`` tokens), return the view.

        Raises:
            ValueError: IDLE, ``padded_tokens`` outside EXTEND, the batch does not fit, or a
                field of the wrong shape or dtype (checked before any copy: a wrong shape
                would broadcast or leave part of the buffers stale).
        """
        mode, bs = batch.forward_mode, batch.batch_size
        if isinstance(padded_bs, bool) or not isinstance(padded_bs, int):
            raise ValueError(f"padded_bs must be an int, got {padded_bs!r}")
        _check_batch_fields(batch)
        if mode == ForwardMode.EXTEND:
            return self._fill_extend(batch, padded_bs, padded_tokens)
        if padded_tokens is not None:
            raise ValueError("padded_tokens is for EXTEND batches only")
        if not mode.is_cuda_graph() or mode.is_idle():
            raise ValueError(f"{mode.name} has no static input buffers")
        D = batch.num_tokens_per_req if mode.has_fixed_tokens_per_req() else 1
        if not bs <= padded_bs <= self.max_bs or D > self.max_tokens_per_req:
            raise ValueError(f"batch of {bs} x {D} does not fit padded {padded_bs} / "
                             f"buffers {self.max_bs} x {self.max_tokens_per_req}")
        T, PT = bs * D, padded_bs * D
        for buf, src in ((self.req_pool_indices, batch.req_pool_indices),
                         (self.prefix_lens, batch.prefix_lens)):
            buf[:bs].copy_(src)
            buf[bs:padded_bs].zero_()
        self.extend_lens[:padded_bs].fill_(D)
        self.out_cache_loc[:T].copy_(batch.out_cache_loc)
        self.out_cache_loc[T:PT].zero_()
        self.positions[:T].copy_(batch.positions)
        self.positions[T:PT].zero_()
        tree_mask = None
        if mode.is_target_verify():
            tm = self.tree_mask[:padded_bs, :D, :num_mask_words(D)]
            tm[:bs].copy_(batch.tree_mask)
            tm[bs:].copy_(pack_tree_mask(torch.eye(D, dtype=torch.bool, device=tm.device))
                          .expand(padded_bs - bs, D, num_mask_words(D)))
            tree_mask = tm
        return ForwardBatch(mode, self.req_pool_indices[:padded_bs], self.prefix_lens[:padded_bs],
                            self.extend_lens[:padded_bs], self.out_cache_loc[:PT],
                            self.positions[:PT],
                            num_tokens_per_req=batch.num_tokens_per_req, tree_mask=tree_mask,
                            **_host_lens(batch, padded_bs, D))

    def _fill_extend(self, batch: ForwardBatch, padded_bs: int, padded_tokens) -> ForwardBatch:
        bs, T = batch.batch_size, batch.num_tokens
        PT = padded_bs * self.max_tokens_per_req if padded_tokens is None else padded_tokens
        if not bs <= padded_bs <= self.max_bs or not T <= PT <= self.out_cache_loc.shape[0]:
            raise ValueError(f"EXTEND batch of {bs} requests / {T} tokens does not fit padded "
                             f"{padded_bs} / {PT} (buffers: {self.max_bs} requests, "
                             f"{self.out_cache_loc.shape[0]} tokens)")
        for buf, src in ((self.req_pool_indices, batch.req_pool_indices),
                         (self.prefix_lens, batch.prefix_lens), (self.extend_lens, batch.extend_lens)):
            buf[:bs].copy_(src)
            buf[bs:padded_bs].zero_()
        for buf, src in ((self.out_cache_loc, batch.out_cache_loc), (self.positions, batch.positions)):
            buf[:T].copy_(src)
            buf[T:PT].zero_()
        return ForwardBatch(ForwardMode.EXTEND, self.req_pool_indices[:padded_bs],
                            self.prefix_lens[:padded_bs], self.extend_lens[:padded_bs],
                            self.out_cache_loc[:PT], self.positions[:PT],
                            **_host_lens(batch, padded_bs, 0))
