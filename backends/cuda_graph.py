"""Static input buffers for CUDA-graph capture and replay of the fixed-shape modes.

The graph runner owns one :class:`GraphInputBuffers`; ``fill(batch, padded_bs)`` copies a
live batch (``bs <= padded_bs``) into the buffers and returns a :class:`ForwardBatch` of
``padded_bs`` requests viewing them.  Padded requests are harmless: ``req_pool_indices = 0``,
``seq_lens = 0``, ``positions = 0``, ``out_cache_loc = 0`` (the reserved page, see
:mod:`~specattn.backends.pools`) and a tree mask where each padded token sees only itself.
Device copies only: no host sync.
"""
from __future__ import annotations

import torch

from .forward_batch import ForwardBatch
from .forward_mode import ForwardMode
from .tree_mask import num_mask_words, pack_tree_mask


def capturing() -> bool:
    """True inside a CUDA-graph capture on the current stream (False on CPU-only torch)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:  # CPU-only builds define a dummy that raises
        return False


class GraphInputBuffers:
    """Static buffers for up to ``max_bs`` requests of up to ``max_tokens_per_req`` tokens."""

    def __init__(self, max_bs: int, max_tokens_per_req: int, device):
        self.max_bs, self.max_tokens_per_req = max_bs, max_tokens_per_req
        T, D = max_bs * max_tokens_per_req, max_tokens_per_req
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.extend_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.out_cache_loc = torch.zeros(T, dtype=torch.int64, device=device)
        self.positions = torch.zeros(T, dtype=torch.int64, device=device)
        self.tree_mask = torch.zeros(max_bs, D, num_mask_words(D), dtype=torch.int32, device=device)

    def fill(self, batch: ForwardBatch, padded_bs: int) -> ForwardBatch:
        """Copy ``batch`` into the buffers, pad to ``padded_bs`` requests, return the view.

        Raises:
            ValueError: mode not capturable, or the batch does not fit.
        """
        mode, bs = batch.forward_mode, batch.batch_size
        if not mode.is_cuda_graph() or mode == ForwardMode.IDLE:
            raise ValueError(f"{mode.name} has no static input buffers")
        D = batch.num_tokens_per_req if mode.has_fixed_tokens_per_req() else 1
        if not bs <= padded_bs <= self.max_bs or D > self.max_tokens_per_req:
            raise ValueError(f"batch of {bs} x {D} does not fit padded {padded_bs} / "
                             f"buffers {self.max_bs} x {self.max_tokens_per_req}")
        T, PT = bs * D, padded_bs * D
        for buf, src in ((self.req_pool_indices, batch.req_pool_indices),
                         (self.seq_lens, batch.seq_lens)):
            buf[:bs].copy_(src)
            buf[bs:padded_bs].zero_()
        self.extend_lens[:padded_bs].fill_(D)
        self.out_cache_loc[:T].copy_(batch.out_cache_loc)
        self.out_cache_loc[T:PT].zero_()
        self.positions[:T].copy_(batch.positions)
        self.positions[T:PT].zero_()
        tree_mask = None
        if mode == ForwardMode.TARGET_VERIFY:
            tm = self.tree_mask[:padded_bs, :D, :num_mask_words(D)]
            tm[:bs].copy_(batch.tree_mask)
            tm[bs:].copy_(pack_tree_mask(torch.eye(D, dtype=torch.bool, device=tm.device))
                          .expand(padded_bs - bs, D, num_mask_words(D)))
            tree_mask = tm
        return ForwardBatch(mode, self.req_pool_indices[:padded_bs], self.seq_lens[:padded_bs],
                            self.extend_lens[:padded_bs], self.out_cache_loc[:PT],
                            self.positions[:PT],
                            num_tokens_per_req=batch.num_tokens_per_req, tree_mask=tree_mask)
