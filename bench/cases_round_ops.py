"""Bench cases of the small ops a speculative round runs besides attention and the tree ops:
the drafter's top-k log-probabilities (and the greedy argmax) over the vocabulary, and the
n-gram lookup over each request's history.  Run e.g.
``specattn bench topk_log_probs -p impl=triton -p rows=16`` or
``specattn bench ngram_candidates -p impl=reference``.

``impl``: ``triton`` | ``reference`` (the public wrapper forced to that implementation) or,
for ``topk_log_probs``, ``torch`` (``torch.topk`` + ``torch.logsumexp``; with ``k = 1``,
``torch.argmax``: what a runtime without the op runs).  Inputs are rotated over
``input_sets`` copies so the L2 cache is not what is timed.
"""
from __future__ import annotations

import torch

from specattn.ops import ngram_candidates, topk_log_probs

from .cases import Workload, case

__all__ = []


@case("topk_log_probs", "drafting's top-k log-probabilities of float32 logits [rows, vocab] "
      "(k = 1: the greedy argmax)", rows=1, vocab=49152, k=4, impl="triton", input_sets=8)
def _topk_log_probs(device, *, rows, vocab, k, impl, input_sets):
    if impl not in ("triton", "reference", "torch"):
        raise ValueError(f"impl must be triton | reference | torch, got {impl!r}")
    sets = [(torch.randn(rows, vocab, device=device),) for _ in range(input_sets)]

    def run(x):
        if impl != "torch":
            return topk_log_probs(x, k, impl=impl)
        if k == 1:
            return x.argmax(-1)
        top = x.topk(k, dim=-1)
        return top.values - torch.logsumexp(x, -1, keepdim=True), top.indices

    return Workload(fn=run, bytes=4 * rows * vocab + 12 * rows * k, flops=0, input_sets=sets)


@case("ngram_candidates", "n-gram drafts from each request's history [bs, context]",
      bs=16, context=2048, ngram_size=4, topk=4, num_steps=4, impl="triton", input_sets=8)
def _ngram_candidates(device, *, bs, context, ngram_size, topk, num_steps, impl, input_sets):
    if impl not in ("triton", "reference"):
        raise ValueError(f"impl must be triton | reference, got {impl!r}")
    g = torch.Generator().manual_seed(0)
    sets = [(torch.randint(0, 64, (bs, context), generator=g).to(device),
             torch.randint(context // 2, context, (bs,), generator=g).to(device)) for _ in range(input_sets)]

    def run(history, prefix_lens):
        return ngram_candidates(history, prefix_lens, ngram_size, topk, num_steps, check_values=False,
                                impl=impl)

    return Workload(fn=run, bytes=8 * bs * (context + 1 + topk * (num_steps + 1)), flops=0, input_sets=sets)
