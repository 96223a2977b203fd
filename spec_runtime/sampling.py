"""Turning logits into a next-token law: temperature, top-k, top-p (as HF / SGLang)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from specattn import ops


@dataclass
class SamplingParams:
    """``temperature == 0`` is greedy.  ``top_k <= 0`` and ``top_p >= 1`` disable those filters.
    ``max_new_tokens`` counts generated tokens; generation also stops at an EOS id.

    Raises:
        TypeError: a field of the wrong type (bools are not numbers here).
        ValueError: a ``temperature`` that is not finite and >= 0, a ``top_p`` that is not
            finite and > 0 (``top_p <= 0`` would drop every token), a ``seed`` outside
            ``[0, 2**64)``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: Optional[int] = None

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"{name} must be a real number, got {v!r}")
        for name in ("top_k", "max_new_tokens") + (("seed",) if self.seed is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 64:   # torch's generator would wrap a negative one
            raise ValueError(f"seed must be in [0, 2**64) or None, got {self.seed}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0 (0: greedy), got {self.temperature}")
        if not (math.isfinite(self.top_p) and self.top_p > 0):
            raise ValueError(f"top_p must be finite and > 0 (>= 1: off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def logits_to_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float32 ``[N, V]`` probabilities after temperature, top-k (keep the k largest) and
    top-p (keep the smallest prefix of the sorted law whose mass reaches ``top_p``)."""
    x = logits.float() / max(p.temperature, 1e-6)
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = x.topk(p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        drop = sp.cumsum(-1) - sp >= p.top_p        # mass before this token already enough
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


#: rows up to which :func:`greedy_tokens` takes the fused top-1 (beyond, torch's argmax,
#: whose one-pass multi-row reduction wins: H200, 49,152 columns, 11.0 / 12.3 us at 64 rows,
#: 34.3 / 20.6 us at 256)
FUSED_ARGMAX_MAX_ROWS = 64


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]`` argmax of ``logits [N, V]`` (the lowest token id among ties, as
    ``torch.argmax``): :func:`specattn.ops.topk_log_probs` with ``k = 1`` (two short launches
    on a GPU instead of a single-block reduction per row) for up to
    ``FUSED_ARGMAX_MAX_ROWS`` rows, ``torch.argmax`` beyond."""
    if logits.shape[0] > FUSED_ARGMAX_MAX_ROWS:
        return logits.argmax(-1)
    return ops.topk_log_probs(logits, 1)[1][:, 0]


def top_log_probs(logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-probabilities of ``logits [N, V]`` and their tokens (float32
    ``[N, k]``, int64 ``[N, k]``; ties: lower token id first), by
    :func:`specattn.ops.topk_log_probs` (one pass over the logits on a GPU, no ``[N, V]``
    log-softmax; beyond its ``k <= 16``, ``torch.topk`` and ``logsumexp``)."""
    if k <= min(logits.shape[-1], ops.TOPK_MAX_K):
        return ops.topk_log_probs(logits, k)
    x = logits.float()
    top = x.topk(k, dim=-1)
    return top.values - torch.logsumexp(x, -1, keepdim=True), top.indices


def sample(logits: torch.Tensor, p: SamplingParams, generator: Optional[torch.Generator] = None
           ) -> torch.Tensor:
    """int64 ``[N]`` next tokens: argmax when greedy, else a draw from :func:`logits_to_probs`.

    The draw is the exponential race ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per
    entry (the token with the smallest ``E_v / p_v`` wins, which happens with probability
    ``p_v``), as SGLang's and vLLM's samplers do: unlike ``torch.multinomial`` it needs no
    host sync and can be captured in a CUDA graph (with ``generator`` registered there).
    """
    if p.greedy:
        return greedy_tokens(logits)
    probs = logits_to_probs(logits, p)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    race.clamp_(min=torch.finfo(race.dtype).tiny)  # a zero-probability token can never win
    return (probs / race).argmax(-1)
