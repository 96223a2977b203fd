"""Triton implementation of :func:`specattn.ops.ngram_candidates` (registered as
``impl="triton"``; the launcher has the reference's signature).

One program per request row scans the history positions ``j < P`` in tiles of ``BLOCK``:
the length of the common suffix of ``history[.. j]`` and ``history[.. P]`` (up to
``NGRAM`` tokens, unrolled), the score ``L * W + j`` (longer first, then more recent;
distinct per position), and a running top-``K`` of the scores (``K`` rounds of a tile-wide
max per tile, each replacing the current minimum when larger).  The ``K`` kept positions
are then ordered (largest first) and each proposes the ``S`` tokens after it, or the root
where there is no match or the copy runs past ``P``.  The whole search is one launch, no
host sync and no allocation but the outputs: CUDA-graph capturable; it also runs in the CPU
interpreter (``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import os
from typing import Tuple

import torch
import triton
import triton.language as tl

from ._util import gdc_enter, on_tensor_device, pdl_kwargs

__all__ = ["ngram_candidates"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BLOCK = 1024


@triton.jit
def _ngram_kernel(hist_ptr, hist_s0, p_ptr, drafts_ptr, len_ptr, W,
                  NGRAM: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, S: tl.constexpr,
                  SP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    gdc_enter(PDL)
    b = tl.program_id(0)
    row = hist_ptr + b.to(tl.int64) * hist_s0
    P = tl.load(p_ptr + b).to(tl.int64)
    kslot = tl.arange(0, KP)
    live = kslot < K
    big = tl.full([KP], 1 << 62, tl.int64)
    best = tl.where(live, tl.full([KP], -1, tl.int64), big)   # padding slots never the minimum
    n_pos = P.to(tl.int32)                       # positions j < P are candidates
    for j0 in range(0, n_pos, BLOCK):
        j = (j0 + tl.arange(0, BLOCK)).to(tl.int64)
        run = j < P
        L = tl.zeros([BLOCK], dtype=tl.int64)
        for i in tl.static_range(NGRAM):
            ok_i = (j * 0 + P - i) >= 0          # (vector masks only: the interpreter's rule)
            s_i = tl.load(row + tl.maximum(P - i, 0)).to(tl.int64)
            t = tl.load(row + tl.maximum(j - i, 0), mask=run & (j - i >= 0), other=-1).to(tl.int64)
            run = run & (t == s_i) & (j - i >= 0) & ok_i
            L += run.to(tl.int64)
        score = tl.where((j < P) & (L > 0), L * W + j, -1)
        for r in tl.static_range(K):
            m = tl.max(score, 0)
            worst = tl.min(best, 0)
            slot = tl.argmin(best, 0)
            best = tl.where((kslot == slot) & (m > worst), m, best)
            score = tl.where(score == m, -1, score)
    root = tl.load(row + P).to(tl.int64)
    so = tl.arange(0, SP)
    ranked = tl.where(live, best, -2)
    for r in tl.static_range(K):
        m = tl.max(ranked, 0)
        slot = tl.argmax(ranked, 0)
        ranked = tl.where(kslot == slot, -3, ranked)
        mv = so.to(tl.int64) * 0 + m             # the key as a vector (vector masks only)
        at = tl.where(mv >= 0, mv % W, 0)
        pos = at + 1 + so
        ok = (mv >= 0) & (pos <= P) & (so < S)
        tok = tl.load(row + tl.minimum(pos, W - 1), mask=ok, other=0).to(tl.int64)
        out = tl.where(ok, tok, root)
        base = (b.to(tl.int64) * K + r)
        tl.store(drafts_ptr + base * S + so, out, mask=so < S)
        tl.store(len_ptr + base, tl.where(m >= 0, m // W, 0))


@on_tensor_device
def ngram_candidates(history: torch.Tensor, prefix_lens: torch.Tensor, ngram_size: int, topk: int,
                     num_steps: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`specattn.ops.ngram_candidates` (one launch)."""
    if history.device.type != "cuda" and not _INTERPRET:
        raise RuntimeError(f"triton implementation of ngram_candidates unavailable for tensors on "
                           f"{history.device} (set TRITON_INTERPRET=1 to run it on the CPU)")
    bs, W = history.shape
    drafts = torch.empty(bs, topk, num_steps, dtype=torch.int64, device=history.device)
    match_len = torch.empty(bs, topk, dtype=torch.int64, device=history.device)
    if bs == 0:
        return drafts, match_len
    _ngram_kernel[(bs,)](history, history.stride(0), prefix_lens, drafts, match_len, W,
                         NGRAM=ngram_size, K=topk, KP=triton.next_power_of_2(topk), S=num_steps,
                         SP=triton.next_power_of_2(num_steps), BLOCK=min(BLOCK, triton.next_power_of_2(W)),
                         num_warps=4, **pdl_kwargs(history))
    return drafts, match_len
