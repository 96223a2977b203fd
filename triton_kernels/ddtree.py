"""Triton implementation of :func:`specattn.ops.ddtree_candidates` (registered as
``impl="triton"`` there; the launcher has the reference's positional signature).

``_ddtree_kernel``, grid ``(bs,)``, one program per request, everything in register vectors:
level 0 stores position 1's ``K`` tokens and log-probabilities as the root's children and
keeps them as the beams; each level ``s >= 1`` builds its ``K * K`` candidates (lane ``c = j *
K + i``: beam ``j``, token ``i`` of position ``s + 1``; one float32 add, as the reference's),
stores them at column ``K + (s - 1) * K * K``, and, below the last level, takes ``K`` rounds of
a max over the order keys of :mod:`.topk` (value, then the lower column: the reference's
order; :func:`.eagle_draft.select_top_lanes`, shared with the EAGLE beam step) for the next
beams and their ``parent_list`` columns.  A beam's score reaches its lane
through a one-hot sum over its int32 bits (exact: one non-zero term, so ``-0.0`` stays
``-0.0``).  ``S`` is a runtime loop bound: one compile per ``K`` (and per
``HAS_W``: the optional ``depth_weights`` multiply each position's values as they are loaded, the
reference's one float32 product; ``enable_fp_fusion=False`` keeps the compiler from fusing that
product and the sum that follows into one FMA, whose single rounding would differ from the
reference's two).

No host sync and no allocation but the outputs (``torch.empty``): CUDA-graph capturable.  The
launcher trusts the wrapper's validation (shapes, dtypes, ``1 <= K <= 8``).  CPU interpreter
(``TRITON_INTERPRET=1``): the same code runs on CPU tensors (the tests); without it, CPU
tensors raise RuntimeError.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._util import gdc_enter, on_tensor_device, pdl_kwargs, require_device
from .eagle_draft import select_top_lanes

__all__ = ["ddtree_candidates"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _ddtree_kernel(v_ptr, v_s0, v_s1, v_s2, t_ptr, t_s0, t_s1, t_s2, plist_ptr, cs_ptr, ct_ptr, w_ptr, w_s0,
                   S, NPL, NC, K: tl.constexpr, KP: tl.constexpr, KKP: tl.constexpr, HAS_W: tl.constexpr,
                   PDL: tl.constexpr = False):
    gdc_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, KP)
    km = kk < K
    kk64 = kk.to(tl.int64)
    plist = plist_ptr + b * NPL
    cs = cs_ptr + b * NC
    ct = ct_ptr + b * NC
    # level 0: the root's children, and the first beams
    beam = tl.load(v_ptr + b * v_s0 + kk64 * v_s2, mask=km, other=0.0)
    if HAS_W:
        beam = beam * tl.load(w_ptr)                                # position 1's weight
    tok0 = tl.load(t_ptr + b * t_s0 + kk64 * t_s2, mask=km, other=0).to(tl.int64)
    tl.store(cs + kk64, beam, mask=km)
    tl.store(ct + kk64, tok0, mask=km)
    tl.store(plist + kk64, kk64 - 1, mask=kk == 0)                 # the root: -1
    tl.store(plist + 1 + kk64, kk64, mask=km & (kk * 0 + S > 1))    # level 0's candidates
    cc = tl.arange(0, KKP)
    live = cc < K * K
    j = cc // K
    i = (cc % K).to(tl.int64)
    for s in range(1, S):
        # each lane's beam score, exactly (one-hot sum of int32 bits)
        bits = beam.to(tl.int32, bitcast=True)
        pick = j[None, :] == kk[:, None]                             # [KP, KKP]
        bj = tl.sum(tl.where(pick, bits[:, None], 0), axis=0).to(tl.int32).to(tl.float32, bitcast=True)
        s64 = tl.cast(s, tl.int64)                                  # offsets past 2**31 elements
        row = b * v_s0 + s64 * v_s1
        child = tl.load(v_ptr + row + i * v_s2, mask=live, other=0.0)
        if HAS_W:
            child = child * tl.load(w_ptr + s64 * w_s0)
        tok = tl.load(t_ptr + b * t_s0 + s64 * t_s1 + i * t_s2, mask=live, other=0).to(tl.int64)
        score = bj + child
        off = K + (s64 - 1) * K * K
        tl.store(cs + off + cc, score, mask=live)
        tl.store(ct + off + cc, tok, mask=live)
        if s < S - 1:
            best, beam, _ = select_top_lanes(score, cc, live, kk, km, K, KP)   # best in [0, K*K)
            tl.store(plist + 1 + K + (s64 - 1) * K + kk64, off + best, mask=km)


@on_tensor_device
def ddtree_candidates(vals: torch.Tensor, toks: torch.Tensor, depth_weights: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton :func:`specattn.ops.ddtree_candidates` (one launch; arguments validated by the
    wrapper).  Returns ``(parent_list int64 [bs, K*(S-1)+1], scores float32 [bs, n_cand],
    tokens int64 [bs, n_cand])``, new tensors."""
    require_device(vals, "ddtree_candidates", _INTERPRET)
    bs, S, K = vals.shape
    dev = vals.device
    npl, nc = K * (S - 1) + 1, K + (S - 1) * K * K
    parent_list = torch.empty(bs, npl, dtype=torch.int64, device=dev)
    scores = torch.empty(bs, nc, dtype=torch.float32, device=dev)
    tokens = torch.empty(bs, nc, dtype=torch.int64, device=dev)
    if bs == 0:
        return parent_list, scores, tokens
    _ddtree_kernel[(bs,)](vals, vals.stride(0), vals.stride(1), vals.stride(2),
                          toks, toks.stride(0), toks.stride(1), toks.stride(2),
                          parent_list, scores, tokens, vals if depth_weights is None else depth_weights,
                          0 if depth_weights is None else depth_weights.stride(0), S, npl, nc,
                          K=K, KP=triton.next_power_of_2(K), KKP=triton.next_power_of_2(K * K),
                          HAS_W=depth_weights is not None,
                          num_warps=1, enable_fp_fusion=False, **pdl_kwargs(vals))
    return parent_list, scores, tokens
