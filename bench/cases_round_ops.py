"""Bench cases of the small ops a speculative round runs besides attention and the tree ops:
the drafter's top-k log-probabilities (and the greedy argmax) over the vocabulary, from
logits or fused into the LM head, the n-gram lookup over each request's history, and EAGLE
drafting's beam bookkeeping and draft token selection.  Run e.g.
``specattn bench topk_log_probs -p impl=triton -p rows=16``,
``specattn bench lm_head_topk -p impl=fused|two_step -p rows=256``,
``specattn bench ngram_candidates -p impl=reference``,
``specattn bench ddtree_candidates -p impl=triton`` or
``specattn bench eagle_beam_steps -p impl=torch -p bs=16``.

``impl``: ``triton`` | ``reference`` (the public wrapper forced to that implementation) or
``torch``: the PyTorch ops a runtime without the op runs (``topk_log_probs``: ``torch.topk``
+ ``torch.logsumexp``, with ``k = 1`` ``torch.argmax``; ``eagle_beam_steps``: per step the
add, ``topk``, gathers and index arithmetic, then the ``cat`` of candidates and parents;
``select_draft_tokens``: ``topk`` + ``sort`` + gather + ``cat``).  Inputs are rotated over
``input_sets`` copies so the L2 cache is not what is timed.
"""
from __future__ import annotations

import torch

from specattn.ops import (ddtree_candidates, eagle_beam_step, ngram_candidates, num_tree_candidates,
                          rms_norm_matmul, rms_norm_matmul_topk, select_draft_tokens, topk_log_probs)
from specattn.ops.fp8 import FLOAT_DTYPES
from specattn.ops.ngram import MAX_NGRAM_SIZE, MAX_STEPS, MAX_TOPK

from .cases import Workload, case, check_choice, positive_ints, torch_dtype
from . import cases_tree  # a module reference: cases_tree may be mid-import (it imports .cases)

__all__ = []


def _check_topk_log_probs(*, rows, vocab, k, impl, input_sets):
    check_choice("impl", impl, ("triton", "reference", "torch"))
    positive_ints(rows=rows, vocab=vocab, k=k, input_sets=input_sets)


@case("topk_log_probs", "drafting's top-k log-probabilities of float32 logits [rows, vocab] "
      "(k = 1: the greedy argmax)", check=_check_topk_log_probs,
      rows=1, vocab=49152, k=4, impl="triton", input_sets=8)
def _topk_log_probs(device, *, rows, vocab, k, impl, input_sets):
    sets = [(torch.randn(rows, vocab, device=device),) for _ in range(input_sets)]

    def run(x):
        if impl != "torch":
            return topk_log_probs(x, k, impl=impl)
        if k == 1:
            return x.argmax(-1)
        top = x.topk(k, dim=-1)
        return top.values - torch.logsumexp(x, -1, keepdim=True), top.indices

    return Workload(fn=run, bytes=4 * rows * vocab + 12 * rows * k, flops=0, input_sets=sets)


def _check_lm_head_topk(*, rows, vocab, hidden, k, impl, dtype, input_sets):
    check_choice("impl", impl, ("fused", "two_step", "reference"))
    positive_ints(rows=rows, vocab=vocab, hidden=hidden, k=k, input_sets=input_sets)
    torch_dtype("dtype", dtype, FLOAT_DTYPES)


@case("lm_head_topk", "an LM head's top-k log-probabilities from hidden rows [rows, hidden] "
      "(folded final norm; k = 1: the greedy argmax)", check=_check_lm_head_topk,
      rows=16, vocab=49152, hidden=576, k=1, impl="fused", dtype="bfloat16", input_sets=8)
def _lm_head_topk(device, *, rows, vocab, hidden, k, impl, dtype, input_sets):
    """``fused``: ``rms_norm_matmul_topk`` (the GEMM's epilogue keeps the top-k); ``two_step``:
    float32 logits from ``rms_norm_matmul``, then ``topk_log_probs``; ``reference``: the op's
    PyTorch reference.  Each input set has its own weight, so the head streams from memory."""
    dt = getattr(torch, dtype)
    sets = [(torch.randn(rows, hidden, device=device).to(dt),
             (torch.randn(vocab, hidden, device=device) / hidden ** 0.5).to(dt)) for _ in range(input_sets)]

    def run(x, w):
        if impl == "two_step":
            return topk_log_probs(rms_norm_matmul(x, None, w, 1e-5, out_dtype=torch.float32), k)
        return rms_norm_matmul_topk(x, None, w, 1e-5, k, impl="triton" if impl == "fused" else "reference")

    size = torch.finfo(dt).bits // 8
    return Workload(fn=run, bytes=size * (vocab + rows) * hidden + 12 * rows * k,
                    flops=2 * rows * vocab * hidden, input_sets=sets)


def _check_ngram_candidates(*, bs, context, ngram_size, topk, num_steps, impl, input_sets):
    check_choice("impl", impl, ("triton", "reference"))
    positive_ints(bs=bs, context=context, ngram_size=ngram_size, topk=topk, num_steps=num_steps,
                  input_sets=input_sets)
    for name, v, most in (("ngram_size", ngram_size, MAX_NGRAM_SIZE), ("topk", topk, MAX_TOPK),
                          ("num_steps", num_steps, MAX_STEPS)):   # ngram_candidates' bounds
        if v > most:
            raise ValueError(f"{name} must be an int in [1, {most}], got {v!r}")


@case("ngram_candidates", "n-gram drafts from each request's history [bs, context]",
      check=_check_ngram_candidates,
      bs=16, context=2048, ngram_size=4, topk=4, num_steps=4, impl="triton", input_sets=8)
def _ngram_candidates(device, *, bs, context, ngram_size, topk, num_steps, impl, input_sets):
    g = torch.Generator().manual_seed(0)
    sets = [(torch.randint(0, 64, (bs, context), generator=g).to(device),
             torch.randint(context // 2, context, (bs,), generator=g).to(device)) for _ in range(input_sets)]

    def run(history, prefix_lens):
        return ngram_candidates(history, prefix_lens, ngram_size, topk, num_steps, check_values=False,
                                impl=impl)

    return Workload(fn=run, bytes=8 * bs * (context + 1 + topk * (num_steps + 1)), flops=0, input_sets=sets)


def _check_ddtree_candidates(*, bs, positions, topk, impl, input_sets):
    check_choice("impl", impl, ("triton", "reference"))
    positive_ints(bs=bs, positions=positions, topk=topk, input_sets=input_sets)


@case("ddtree_candidates", "a DDTree's candidates from a block's per-position top-k [bs, positions, topk]",
      check=_check_ddtree_candidates,
      bs=1, positions=15, topk=4, impl="triton", input_sets=8)
def _ddtree_candidates(device, *, bs, positions, topk, impl, input_sets):
    g = torch.Generator().manual_seed(0)
    sets = [((-torch.rand(bs, positions, topk, generator=g) * 5).sort(-1, descending=True).values.to(device),
             torch.randint(0, 49152, (bs, positions, topk), generator=g).to(device)) for _ in range(input_sets)]
    n_cand = num_tree_candidates(topk, positions)
    return Workload(fn=lambda v, t: ddtree_candidates(v, t, impl=impl),
                    bytes=12 * bs * (positions * topk + n_cand) + 8 * bs * (topk * (positions - 1) + 1),
                    flops=0, input_sets=sets)


def _draft_inputs(device, bs, topk, num_steps, input_sets, seed=0):
    """``input_sets`` tuples ``(beam_scores [bs, K], beam_tokens [bs, K], child_scores
    [S-1, bs*K, K], child_tokens [S-1, bs*K, K], cur_rows [bs, K])``: log-prob-like floats
    (distinct with probability ~1), random token ids and rows."""
    g = torch.Generator().manual_seed(seed)
    K, S = topk, num_steps
    return [tuple(t.to(device) for t in (
        -torch.rand(bs, K, generator=g) * 5, torch.randint(0, 49152, (bs, K), generator=g),
        -torch.rand(S - 1, bs * K, K, generator=g) * 5, torch.randint(0, 49152, (S - 1, bs * K, K), generator=g),
        torch.randint(0, 4096, (bs, K), generator=g))) for _ in range(input_sets)]


def _check_eagle_beam_steps(*, bs, topk, num_steps, impl, input_sets):
    check_choice("impl", impl, ("triton", "reference", "torch"))
    positive_ints(bs=bs, topk=topk, num_steps=num_steps, input_sets=input_sets)
    if num_steps < 2:
        raise ValueError(f"num_steps must be >= 2 (a step to time), got {num_steps}")


@case("eagle_beam_steps", "an EAGLE draft's beam bookkeeping: num_steps - 1 steps of candidates, "
      "next beams and parent blocks (eagle_beam_step per step, or torch's ops and final cats)",
      check=_check_eagle_beam_steps,
      bs=1, topk=4, num_steps=5, impl="triton", input_sets=8)
def _eagle_beam_steps(device, *, bs, topk, num_steps, impl, input_sets):
    K, S = topk, num_steps
    n_cand = num_tree_candidates(K, S)
    root_block = torch.cat([torch.full((1,), -1, dtype=torch.int64), torch.arange(K)]).to(device)

    def run(beam, beam_tok, child_scores, child_tokens, cur):
        if impl == "torch":  # EagleStrategy._draft's PyTorch path, less the forwards
            cand_s, cand_t, blocks = [beam], [beam_tok], [root_block[None].expand(bs, K + 1)]
            for s in range(1, S):
                cs = beam[..., None] + child_scores[s - 1].view(bs, K, K)
                ct = child_tokens[s - 1].view(bs, K, K)
                cand_s.append(cs.flatten(1))
                cand_t.append(ct.flatten(1))
                if s < S - 1:
                    beam, best = cs.flatten(1).topk(K, dim=-1)
                    beam_tok = ct.flatten(1).gather(1, best)
                    cur.gather(1, best // K)
                    blocks.append(best + (K + (s - 1) * K * K))
            return torch.cat(blocks, 1), torch.cat(cand_s, 1), torch.cat(cand_t, 1)
        all_s = torch.empty(bs, n_cand, dtype=torch.float32, device=device)
        all_t = torch.empty(bs, n_cand, dtype=torch.int64, device=device)
        plist = torch.empty(bs, K * (S - 1) + 1, dtype=torch.int64, device=device)
        plist[:, :K + 1] = root_block
        for s in range(1, S):
            nxt = s < S - 1
            st = eagle_beam_step(beam, child_scores[s - 1], child_tokens[s - 1], all_s, all_t,
                                 K + (s - 1) * K * K, beam_tokens=beam_tok if s == 1 else None,
                                 beam_offset=0 if s == 1 else None, select=nxt, cur_rows=cur if nxt else None,
                                 parent_list=plist if nxt else None,
                                 parent_offset=K + 1 + (s - 1) * K if nxt else None, impl=impl)
            if nxt:
                beam = st.scores
        return plist, all_s, all_t

    # inputs read once (beams, children, rows), candidates and parent list written once
    nbytes = bs * (12 * K + 12 * (S - 1) * K * K + 8 * K + 12 * n_cand + 8 * (K * (S - 1) + 1))
    return Workload(fn=run, bytes=nbytes, flops=0,
                    input_sets=_draft_inputs(device, bs, K, S, input_sets))


def _check_select_draft_tokens(*, bs, topk, num_steps, num_draft_tokens, impl, input_sets):
    check_choice("impl", impl, ("triton", "reference", "torch"))
    positive_ints(bs=bs, input_sets=input_sets)
    cases_tree.check_tree_shape(topk, num_steps, num_draft_tokens)


@case("select_draft_tokens", "EAGLE's draft tokens: the num_draft_tokens - 1 best of [bs, n_cand] "
      "candidates in index order, after the root (n_cand = topk + (num_steps - 1) * topk^2)",
      check=_check_select_draft_tokens,
      bs=1, topk=4, num_steps=5, num_draft_tokens=16, impl="triton", input_sets=8)
def _select_draft_tokens(device, *, bs, topk, num_steps, num_draft_tokens, impl, input_sets):
    n_cand = num_tree_candidates(topk, num_steps)
    g = torch.Generator().manual_seed(0)
    sets = [(-torch.rand(bs, n_cand, generator=g).to(device) * 20,
             torch.randint(0, 49152, (bs, n_cand), generator=g).to(device),
             torch.randint(0, 49152, (bs,), generator=g).to(device)) for _ in range(input_sets)]
    D = num_draft_tokens

    def run(scores, tokens, roots):
        if impl != "torch":
            return select_draft_tokens(scores, tokens, roots, D, impl=impl)
        selected = scores.topk(D - 1, dim=-1).indices.sort(dim=-1).values
        return selected, torch.cat([roots[:, None], tokens.gather(1, selected)], 1)

    return Workload(fn=run, bytes=bs * (12 * n_cand + 8 + 8 * (2 * D - 1)), flops=0, input_sets=sets)
