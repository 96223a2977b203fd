"""Greedy correctness of a low-precision (bf16 / fp16) run: near-ties may flip, nothing else.

A bf16 run is not token-identical to a float32 run (nor to another bf16 kernel: different
summation orders flip near-ties, and after one flip the continuations differ), so the
runtime's lossless checks for backends without float32 kernels (FlashInfer, FlashMLA:
``tests/test_runtime_lowp.py``) and the bf16 rows of ``bench/scripts/runtime_matrix.py``
are per token instead:

1. teacher-force each request's ``prompt + output`` through the float32 model (the SAME
   weights, already rounded to the run's dtype, reference backend, one EXTEND) and take
   each emitted token's *gap* ``max(logits) - logits[token]`` at its position;
2. the precision's own logit noise at each position, ``delta_i``: the largest
   ``|logits_lowp - logits_fp32|`` over the vocabulary at that position, the reference backend
   on those same sequences (the bf16 model vs the float32 model);
3. every gap must be ``<= tol_i = 4 * delta_i``: a correct kernel with noise ``delta'`` only
   picks tokens whose float32 gap is at most ``2 * delta'``; 4x leaves room for a kernel
   twice as noisy as the reference.  Per position, not one maximum over the run: a single
   noisy position would loosen every other one (measured on 60 tiny bf16 models: correct
   runs reach 0.35 of the per-position tolerance, a verify ignoring the tree mask misses it
   by 7.9x or more; with one run-wide maximum those were 0.26 and only 1.7x, and correct
   runs had up to 12 % of the vocabulary within tolerance);
4. the check must have teeth: on average at most ``max_share`` (10 %) of the vocabulary lies
   within ``tol`` of the maximum, so a wrong token passes with low probability per
   position (the mean share is reported; a model whose logits are too flat fails here
   rather than passing vacuously).

Each position is checked on the run's own context, so a flip does not cascade.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from specattn.backends import ForwardBatch, KVAllocator, ReqToTokenPool, TorchReferenceBackend
from specattn.ops.fp8 import FP8_E4M3_MAX

__all__ = ["teacher_forced", "teacher_forced_logits", "calibrate_kv_scales", "NearGreedy", "near_greedy",
           "check_near_greedy"]


def teacher_forced(model, seqs: Sequence[Sequence[int]], kv_cache_dtype=None, kv_scales=(1.0, 1.0)):
    """One EXTEND batch of ``seqs`` (lists of token ids) on the reference backend over fresh
    pools (of ``kv_cache_dtype``, default the model's, with ``kv_scales`` for an fp8 cache).
    Returns ``(hidden [sum(len), hidden_size], pool, slots int64 [sum(len)])``: the final
    hidden states and the KV pool the sequences' keys and values were written to (at
    ``slots``, sequence after sequence)."""
    dev = model.device
    lens = [len(s) for s in seqs]
    width = max(lens)
    req = ReqToTokenPool(len(seqs), width, dev)
    size = sum(lens)
    pool = model.make_kv_pool(size, kv_cache_dtype=kv_cache_dtype, k_scale=kv_scales[0], v_scale=kv_scales[1])
    alloc = KVAllocator(size, 1, dev)
    slots = alloc.alloc(size)
    for i, part in enumerate(slots.split(lens)):
        req.write(i, 0, part)
    backend = TorchReferenceBackend(req, pool)
    batch = ForwardBatch.extend(list(range(len(seqs))), [0] * len(seqs), lens, slots, device=dev)
    backend.init_forward_metadata(batch)
    ids = torch.tensor([t for s in seqs for t in s], device=dev)
    hidden, _ = model.forward(ids, batch, backend)
    return hidden, pool, slots


def teacher_forced_logits(model, seqs: Sequence[Sequence[int]], kv_cache_dtype=None,
                          kv_scales=(1.0, 1.0)) -> List[torch.Tensor]:
    """Float32 logits ``[len(s), V]`` of every position of every sequence (row ``i`` predicts
    token ``i + 1``): :func:`teacher_forced`'s hidden states through the LM head (an fp8
    cache's rounding enters the logits as it does in a run)."""
    hidden, _, _ = teacher_forced(model, seqs, kv_cache_dtype, kv_scales)
    return list(model.logits(hidden).float().split([len(s) for s in seqs]))


def calibrate_kv_scales(model, prompts: Sequence[Sequence[int]], headroom: float = 2.0):
    """Per-layer fp8 (e4m3) dequantization scales for ``model``'s KV cache from the keys and
    values it writes over ``prompts`` (one EXTEND in the model's dtype on the reference
    backend): ``scale = headroom * amax / 448`` per layer, K and V apart (an MLA latent: one
    scale for both, the larger), so the observed values use e4m3's normal range (relative
    step 2^-3) with ``headroom`` to spare before saturating.  vLLM's ``calculate_kv_scales``
    derives its scales from the first batch's amax the same way; SGLang and vLLM otherwise
    default to 1.0, which sends small-valued layers into e4m3's subnormals (absolute step
    2^-9).  Returns ``(k_scales, v_scales)``, lists of floats (a layer whose values are all
    zero gets 1.0).  Raises ValueError for no prompt tokens or ``headroom < 1``."""
    if headroom < 1:
        raise ValueError(f"headroom must be >= 1, got {headroom}")
    seqs = [list(p) for p in prompts if len(p)]
    if not seqs:
        raise ValueError("calibrate_kv_scales needs at least one prompt token")
    _, pool, slots = teacher_forced(model, seqs)
    mla = hasattr(pool, "kv_lora_rank")
    ks, vs = [], []
    for layer in range(pool.layer_num):
        k = float(pool.get_key_buffer(layer)[slots].float().abs().max())
        v = float(pool.get_value_buffer(layer)[slots].float().abs().max())
        if mla:
            k = v = max(k, v)
        ks.append(headroom * k / FP8_E4M3_MAX if k > 0 else 1.0)
        vs.append(headroom * v / FP8_E4M3_MAX if v > 0 else 1.0)
    return ks, vs


@dataclass
class NearGreedy:
    """What :func:`check_near_greedy` measured: ``delta`` (the largest per-position logit
    noise), ``tol`` (the largest per-position tolerance), the largest gap of an emitted token
    and the largest gap / tolerance ratio (must be <= 1), how many tokens were not the
    float32 argmax (of ``num_tokens``), and the mean share of the vocabulary within
    tolerance."""
    delta: float
    tol: float
    max_gap: float
    max_ratio: float
    num_flips: int
    num_tokens: int
    vocab_share: float


def near_greedy(model32, model_lowp, prompts, outputs, factor: float = 4.0, kv_cache_dtype=None,
                kv_scales=(1.0, 1.0)) -> NearGreedy:
    """Measure how far every token of ``outputs`` (per request, after ``prompts``; lists of
    token ids) is from the float32 greedy choice on its own context, against ``factor`` times
    the precision's logit noise at that position (module docstring).  ``model32`` /
    ``model_lowp``: the same weights in float32 / the run's dtype, on one device (e.g.
    :class:`~specattn.spec_runtime.model.LlamaModel` over weights rounded to the run's dtype).
    Verdict: ``max_ratio <= 1`` (every token a near-tie at most) and ``vocab_share`` small
    (the check has teeth); :func:`check_near_greedy` asserts both.  ``kv_cache_dtype`` /
    ``kv_scales``: the run's KV cache (e.g. fp8 e4m3); the low-precision side's noise
    ``delta_i`` is then measured over such a cache, so the tolerance is the one of e4m3 KV
    plus the model's dtype, derived the same way.

    Raises:
        ValueError: ``prompts`` and ``outputs`` of different lengths, an empty prompt, or no
            output token at all.
    """
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs")
    if any(len(p) == 0 for p in prompts) or not any(len(o) for o in outputs):
        raise ValueError("every prompt needs a token and some output must be non-empty")
    seqs = [list(p) + list(o) for p, o in zip(prompts, outputs)]
    ref = teacher_forced_logits(model32, seqs, kv_cache_dtype, kv_scales)
    low = teacher_forced_logits(model_lowp, seqs, kv_cache_dtype, kv_scales)
    gaps, tols, shares = [], [], []
    for p, o, lg, lw in zip(prompts, outputs, ref, low):
        if not o:
            continue
        span = slice(len(p) - 1, len(p) - 1 + len(o))                   # rows predicting o
        rows = lg[span]
        top = rows.max(-1).values
        tol = factor * (rows - lw[span]).abs().max(-1).values            # per position
        gaps.append(top - rows.gather(1, torch.tensor(o, device=rows.device)[:, None])[:, 0])
        tols.append(tol)
        shares.append((rows >= (top - tol)[:, None]).float().mean(-1))
    gap, tol, share = torch.cat(gaps), torch.cat(tols), torch.cat(shares)
    ratio = gap / tol.clamp_min(torch.finfo(torch.float32).tiny)
    return NearGreedy(float(tol.max()) / factor, float(tol.max()), float(gap.max()), float(ratio.max()),
                      int((gap > 0).sum()), gap.numel(), float(share.mean()))


def check_near_greedy(model32, model_lowp, prompts, outputs, factor: float = 4.0,
                      max_share: float = 0.1, kv_cache_dtype=None, kv_scales=(1.0, 1.0)) -> NearGreedy:
    """:func:`near_greedy`, asserting its verdict: AssertionError unless every token is
    within ``factor * delta`` of the float32 greedy choice and at most ``max_share`` of the
    vocabulary lies within tolerance on average."""
    res = near_greedy(model32, model_lowp, prompts, outputs, factor, kv_cache_dtype, kv_scales)
    assert res.vocab_share <= max_share, f"the check has no teeth here (logits too flat): {res}"
    assert res.max_ratio <= 1.0, f"a token beyond the precision's near-ties: {res}"
    return res
