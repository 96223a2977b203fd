"""N-gram draft proposal from each request's own token history: :func:`ngram_candidates`.

For each request ``i`` with history ``h = history[i]`` and root position ``P = prefix_lens[i]``
(``h[P]`` is the last emitted token), every earlier position ``j < P`` is scored by ``L``,
the length (up to ``ngram_size``) of the common suffix of ``h[.. j]`` and ``h[.. P]``; the
``topk`` best positions (longest match first, then the most recent) each propose the
``num_steps`` tokens that followed them, ``h[j + 1 ..]``, as one chain of drafts (the root
where there is no match or a copy would run past ``P``).  This is prompt-lookup / n-gram
drafting (SGLang's ngram speculative decoding, vLLM's prompt lookup) on the device, so the
lookup never serializes a round.

Implementations (registry op ``"ngram_candidates"``, each taking the reference's
arguments):

- ``reference``: a few ``[bs, W]`` elementwise passes and a ``topk`` in PyTorch
  (:func:`ngram_candidates_reference`);
- ``triton``: one launch, one program per request (:mod:`specattn.triton_kernels.ngram`).

``impl="auto"`` takes Triton for CUDA tensors when Triton imports, else the reference.
"""
from __future__ import annotations

from typing import Tuple

import numbers
import torch

from . import registry
from .checks import INDEX_DTYPES, check_index_range, check_tensor

__all__ = ["ngram_candidates", "ngram_candidates_reference", "MAX_NGRAM_SIZE", "MAX_TOPK", "MAX_STEPS"]

# Limits of the arguments: the Triton kernel unrolls ``ngram_size`` and ``topk`` (one
# compiled kernel per value) and holds a chain's ``num_steps`` drafts in one register vector.
MAX_NGRAM_SIZE = 32
MAX_TOPK = 32
MAX_STEPS = 256


def ngram_candidates_reference(history: torch.Tensor, prefix_lens: torch.Tensor, ngram_size: int, topk: int,
                               num_steps: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """PyTorch :func:`ngram_candidates` (no validation)."""
    bs, W = history.shape
    dev = history.device
    idx = torch.arange(W, device=dev)
    P = prefix_lens.long()
    L = torch.zeros(bs, W, dtype=torch.int64, device=dev)
    run = torch.ones(bs, W, dtype=torch.bool, device=dev)
    for i in range(ngram_size):
        tok_j = history[:, (idx - i).clamp(min=0)]                       # token at j - i
        suffix = history.gather(1, (P - i).clamp(min=0)[:, None])       # token at P - i
        run = run & (tok_j == suffix) & (idx >= i)[None, :] & (P - i >= 0)[:, None]
        L += run
    usable = (idx[None, :] < P[:, None]) & (L > 0)
    score = torch.where(usable, L * W + idx[None, :], torch.full_like(L, -1))
    top, at = score.topk(min(topk, W), dim=-1)
    if at.shape[1] < topk:  # a row shorter than topk: pad with "no match"
        pad = topk - at.shape[1]
        top = torch.cat([top, top.new_full((bs, pad), -1)], 1)
        at = torch.cat([at, at.new_zeros(bs, pad)], 1)
    cont = at[:, :, None] + 1 + torch.arange(num_steps, device=dev)      # [bs, K, S]
    ok = (top >= 0)[:, :, None] & (cont <= P[:, None, None])
    toks = history.gather(1, cont.clamp(max=W - 1).flatten(1)).view(bs, topk, num_steps)
    root = history.gather(1, P[:, None])[:, :, None]
    return torch.where(ok, toks, root), torch.where(top >= 0, top // W, torch.zeros_like(top))


registry.register("ngram_candidates", "reference", lambda: ngram_candidates_reference)
registry.register("ngram_candidates", "triton",
                  registry.from_module("specattn.triton_kernels.ngram", "ngram_candidates", "Triton"))


def ngram_candidates(history: torch.Tensor, prefix_lens: torch.Tensor, ngram_size: int, topk: int,
                     num_steps: int, *, check_values: bool = True, impl: str = "auto"
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Drafts copied from each request's history (module docstring).

    Args:
        history: int64 ``[bs, W]``: the token at every position, ``history[i, P_i]`` the
            root (positions past it are ignored).
        prefix_lens: int32 / int64 ``[bs]``: ``P_i``, in ``[0, W)`` (checked with one host sync
            unless ``check_values=False`` or a CUDA graph is being captured).
        ngram_size: longest suffix matched, in ``[1, MAX_NGRAM_SIZE]`` (32).
        topk, num_steps: chains and drafts per chain, in ``[1, MAX_TOPK]`` (32) and
            ``[1, MAX_STEPS]`` (256).
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        ``(drafts int64 [bs, topk, num_steps], match_len int64 [bs, topk])``: the proposed
        tokens (the root where a chain has no match or runs past ``P``) and the matched
        suffix length of each chain (0: no match), chains ordered longest match first, then
        most recent.  Device work only.

    Raises:
        TypeError / ValueError: wrong types, ranks, dtypes, devices or sizes.  IndexError:
        a prefix length outside ``[0, W)``.
    """
    check_tensor("history", history, dim=2, dtypes=(torch.int64,))
    check_tensor("prefix_lens", prefix_lens, dim=1, dtypes=INDEX_DTYPES, device=history.device,
                 shape=[history.shape[0]])
    for name, v, most in (("ngram_size", ngram_size, MAX_NGRAM_SIZE), ("topk", topk, MAX_TOPK),
                          ("num_steps", num_steps, MAX_STEPS)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):   # numpy ints are Integral
            raise TypeError(f"{name} must be an int in [1, {most}], got {type(v).__name__}")
        if not 1 <= v <= most:
            raise ValueError(f"{name} must be an int in [1, {most}], got {v!r}")
    ngram_size, topk, num_steps = int(ngram_size), int(topk), int(num_steps)
    if history.shape[1] < 1:
        raise ValueError(f"history must have at least one position, got {list(history.shape)}")
    if check_values:
        check_index_range("prefix_lens", prefix_lens, history.shape[1])
    fn = registry.dispatch("ngram_candidates", impl, history.device)
    if history.stride(1) != 1:
        history = history.contiguous()
    return fn(history, prefix_lens.contiguous(), ngram_size, topk, num_steps)
