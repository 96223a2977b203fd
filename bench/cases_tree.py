"""Bench cases of the EAGLE tree ops, each timed per implementation side by side.

Every case takes ``impl`` = ``auto`` | ``reference`` | ``triton`` | ``cuda`` | ``torch``:
the first four call the PUBLIC wrapper (``specattn.ops.build_tree(..., impl=impl)`` and so
on: what users call; their host-syncing value checks are skipped during CUDA-graph capture,
so graph replays time the kernels alone), ``torch`` calls the batched PyTorch anchor of
:mod:`.torch_anchors` (what an engine without our kernels would write).  Run e.g.
``specattn bench tree_build verify_greedy verify_sampling compaction -p impl=cuda``.

``reference`` is a Python loop with ``.tolist()`` host syncs: it cannot be captured, so its
calls raise a clear error during capture (before touching the stream) and the harness times
it eagerly (its ``note`` says so).  Eager times include the wrapper's checks.

Inputs are built on the device once per case: ``input_sets`` random valid EAGLE trees
(drawn as EAGLE top-k drafting selects them: every selected candidate's parent selected) rotated by
the harness, so the L2 cache is not what is timed (it flushes L2 when the sets are small).
``bytes`` is the minimum device traffic of one call: every input read once and every output
written once (see each case), so GB/s is comparable across implementations.
"""
from __future__ import annotations

import math
import random
from typing import List, Optional, Tuple

import torch

from specattn.ops.tree_mask import num_mask_words
from specattn.ops import (build_tree, compact_accepted_path, num_tree_candidates, registry,
                          tree_speculative_sampling, verify_tree_greedy)
from specattn.ops.checks import INDEX_DTYPES, capturing
from specattn.ops.fp8 import FLOAT_DTYPES

from .cases import Workload, case, check_choice, positive_ints, torch_dtype
from .torch_anchors import (build_tree_torch, compact_accepted_path_torch,
                            tree_speculative_sampling_torch, verify_tree_greedy_torch)

__all__ = ["IMPLS", "random_eagle_tree", "random_eagle_batch", "greedy_tokens",
           "check_tree_shape", "NotCapturable"]

IMPLS = ("auto", "reference", "triton", "cuda", "torch")


class NotCapturable(RuntimeError):
    """Raised by a reference call during CUDA-graph capture (the harness then times eager)."""


# ----------------------------------------------------------------------------- inputs
def random_eagle_tree(rng: random.Random, topk: int, num_steps: int, D: int,
                      closed: bool = True) -> Tuple[List[int], List[int], List[Optional[int]]]:
    """One request's random EAGLE draft tree, drafted as EAGLE's top-k drafting does.

    Each beam's ``topk`` children get random probabilities (a softmax of Gaussian scores at
    a random sharpness, times a random mass in (0.5, 0.99)); a candidate's score is the
    product along its path; each step continues the ``topk`` best-scoring candidates
    (``parent_list``) and the ``D - 1`` best-scoring candidates overall are selected.  Scores
    fall strictly along a path, so every selected candidate's parent is selected.  With
    ``closed=False`` the selection is instead uniform (missing parents, unsorted).

    Returns:
        ``(parent_list, selected, parents)``: ``parent_list`` ``topk*(num_steps-1) + 1``
        ints (-1, then per step ``topk`` distinct flat indices of that step's candidates),
        ``selected`` ``D - 1`` distinct flat candidate indices (ascending when ``closed``),
        ``parents`` the parent draft index of each of the ``D`` draft tokens (None for the
        root and for a token whose parent candidate is not selected).
    Raises:
        ValueError: ``D - 1`` exceeds the number of candidates.
    """
    n_cand = num_tree_candidates(topk, num_steps)
    if not 1 <= D <= n_cand + 1:
        raise ValueError(f"D={D} needs 1..{n_cand + 1} (topk={topk}, num_steps={num_steps})")
    sharp = rng.uniform(0.3, 3.0)

    def child_probs():
        w = [math.exp(sharp * rng.gauss(0.0, 1.0)) for _ in range(topk)]
        mass = rng.uniform(0.5, 0.99) / sum(w)
        return [x * mass for x in w]

    score = child_probs()  # step 0: the root's children, flat 0 .. topk-1
    pl = [-1]
    for s in range(num_steps - 1):
        lo = 0 if s == 0 else topk + (s - 1) * topk * topk
        beams = sorted(range(lo, len(score)), key=lambda f: -score[f])[:topk]
        if closed:
            pl += beams
        else:
            pl += rng.sample(range(lo, len(score)), topk)
        for f in pl[-topk:]:
            score += [score[f] * p for p in child_probs()]
    if closed:
        sel = sorted(sorted(range(n_cand), key=lambda f: -score[f])[:D - 1])
    else:
        sel = rng.sample(range(n_cand), D - 1)
        if rng.random() < 0.7:
            sel.sort()
    draft_of = {f: j + 1 for j, f in enumerate(sel)}
    parents: List[Optional[int]] = [None] + [
        0 if f < topk else draft_of.get(pl[f // topk]) for f in sel]
    return pl, sel, parents


def random_eagle_batch(rng: random.Random, bs: int, topk: int, num_steps: int, D: int,
                       closed: bool = True, dtype: torch.dtype = torch.int64,
                       max_seq_len: int = 4096):
    """``bs`` trees of :func:`random_eagle_tree` as CPU tensors.

    Returns:
        ``(parent_list [bs, topk*(num_steps-1)+1], selected_index [bs, D-1],
        verified_seq_len [bs] in [0, max_seq_len), parents)`` (tensors of ``dtype``;
        ``parents`` a list of per-request parent lists).
    """
    trees = [random_eagle_tree(rng, topk, num_steps, D, closed) for _ in range(bs)]
    pl = torch.tensor([t[0] for t in trees], dtype=dtype)
    sel = torch.tensor([t[1] for t in trees], dtype=dtype).view(bs, D - 1)
    vsl = torch.tensor([rng.randrange(max_seq_len) for _ in range(bs)], dtype=dtype)
    return pl, sel, vsl, [t[2] for t in trees]


def _children(parents: List[Optional[int]]) -> List[List[int]]:
    kids: List[List[int]] = [[] for _ in parents]
    for j, p in enumerate(parents):
        if p is not None:
            kids[p].append(j)
    return kids


def greedy_tokens(rng: random.Random, parents: List[Optional[int]], num_steps: int,
                  vocab: int) -> Tuple[List[int], List[int]]:
    """Draft tokens and target argmaxes of one request such that greedy verification accepts
    a path of a random length in ``0 .. num_steps`` (shorter at a leaf): the target's token
    at each node of a random root path is a child's token, and none of the last node's
    children matches (unless every token of ``vocab`` is taken).

    Returns:
        ``(candidates, target_predict)``, ``D`` ints each in ``[0, vocab)``.
    """
    D = len(parents)
    cand = [rng.randrange(vocab) for _ in range(D)]
    target = [rng.randrange(vocab) for _ in range(D)]
    kids = _children(parents)
    height = [0] * D  # longest path below each node (parents precede children in a
    for j in reversed(range(D)):  # closed tree; with orphans this is a lower bound)
        for c in kids[j]:
            height[j] = max(height[j], height[c] + 1)
    node, want = 0, rng.randint(0, num_steps)
    for k in range(want):
        if not kids[node]:
            break
        tall = [c for c in kids[node] if height[c] >= want - k - 1]
        c = rng.choice(tall) if tall else max(kids[node], key=lambda c: height[c])
        target[node] = cand[c]
        node = c
    taken = {cand[c] for c in kids[node]}
    while len(taken) < vocab and target[node] in taken:
        target[node] = rng.randrange(vocab)
    return cand, target


def check_tree_shape(topk: int, num_steps: int, num_draft_tokens: int) -> None:
    """Raise ValueError unless ``topk``, ``num_steps`` are ints >= 1 and ``num_draft_tokens``
    (root included) is between 1 and 1 + the ``topk + (num_steps - 1) * topk**2`` candidates
    of an EAGLE draft (what :func:`random_eagle_tree` can select)."""
    positive_ints(topk=topk, num_steps=num_steps, num_draft_tokens=num_draft_tokens)
    n_cand = num_tree_candidates(topk, num_steps)
    if num_draft_tokens > n_cand + 1:
        raise ValueError(f"num_draft_tokens must be between 1 and {n_cand + 1} (topk={topk}, "
                         f"num_steps={num_steps} draft {n_cand} candidates), got {num_draft_tokens}")


def _check_tree_op(*, bs, topk, num_steps, num_draft_tokens, index_dtype, input_sets, impl,
                   impls=IMPLS, **_):
    """The parameters every tree-op case shares (``impls``: its ``impl`` values)."""
    check_choice("impl", impl, impls)
    positive_ints(bs=bs, input_sets=input_sets)
    check_tree_shape(topk, num_steps, num_draft_tokens)
    torch_dtype("index_dtype", index_dtype, INDEX_DTYPES)


def _check_tree_build(**params):
    _check_tree_op(impls=IMPLS + ("floor",), **params)


def _check_verify(*, vocab, **params):
    positive_ints(vocab=vocab)
    _check_tree_op(**params)


def _check_compaction(*, bs, num_draft_tokens, num_steps, hidden, dtype, index_dtype, vocab,
                      input_sets, impl, **_):
    check_choice("impl", impl, IMPLS)
    positive_ints(bs=bs, num_draft_tokens=num_draft_tokens, hidden=hidden, vocab=vocab,
                  input_sets=input_sets)
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) \
            or not 0 <= num_steps <= num_draft_tokens - 1:
        raise ValueError(f"num_steps must be an int in [0, num_draft_tokens - 1 = "
                         f"{num_draft_tokens - 1}], got {num_steps!r}")
    torch_dtype("dtype", dtype, FLOAT_DTYPES)
    torch_dtype("index_dtype", index_dtype, INDEX_DTYPES)


def _eager_only(op: str, impl: str, device: torch.device, fn):
    """``fn`` unchanged, unless ``impl`` resolves to the reference (a host-syncing Python
    loop): then a wrapper that raises :class:`NotCapturable` when called during CUDA-graph
    capture, before any work is queued, so the harness falls back to eager timing."""
    if impl == "torch":
        return fn
    ref = registry.dispatch(op, "reference")
    if impl != "reference" and (impl != "auto" or registry.dispatch(op, "auto", device) is not ref):
        return fn

    def eager(*args):
        if capturing():
            raise NotCapturable(f"impl={impl!r} of {op} is a Python loop with host syncs "
                                "(.tolist()); it cannot be captured in a CUDA graph")
        return fn(*args)
    return eager


def _nbytes(*tensors) -> int:
    return sum(t.nbytes for t in tensors if t is not None)


# ----------------------------------------------------------------------------- cases
@case("tree_build",
      "build_tree (target: <= 6 us): bs=64 EAGLE trees, topk=8, num_steps=5, 64 draft "
      "tokens; bytes = parent_list + selected_index + verified_seq_len read, mask + positions "
      "+ 3 link arrays written; impl=auto|reference|triton|cuda|torch, or floor (one "
      "one-element kernel on verified_seq_len: the launch + one memory round trip)",
      check=_check_tree_build,
      bs=64, topk=8, num_steps=5, num_draft_tokens=64, index_dtype="int64", input_sets=8,
      seed=0, impl="auto")
def _tree_build(device, *, bs, topk, num_steps, num_draft_tokens, index_dtype, input_sets,
                seed, impl):
    """:func:`specattn.ops.build_tree` on ``input_sets`` batches of random closed trees.
    ``impl="floor"``: one kernel that reads and writes one element of ``verified_seq_len``
    (adds 0), timed the same way: what any one-launch tree build pays before its own work."""
    D, it = num_draft_tokens, getattr(torch, index_dtype)
    rng = random.Random(seed)
    sets = [tuple(x.to(device) for x in random_eagle_batch(rng, bs, topk, num_steps, D,
                                                            dtype=it)[:3])
            for _ in range(input_sets)]
    if impl == "floor":
        return Workload(fn=lambda pl, sel, vsl: vsl[:1].add_(0), bytes=2 * it.itemsize, flops=0,
                        input_sets=sets, state={"impl": impl})
    if impl == "torch":
        def call(pl, sel, vsl):
            return build_tree_torch(pl, sel, vsl, topk, num_steps, D)
    else:
        def call(pl, sel, vsl):
            return build_tree(pl, sel, vsl, topk, num_steps, D, impl=impl)
    out_bytes = bs * D * (num_mask_words(D) * 4 + 8 + 3 * 8)  # mask, positions, 3 links
    return Workload(fn=_eager_only("build_tree", impl, device, call),
                    bytes=_nbytes(*sets[0]) + out_bytes, flops=0, input_sets=sets,
                    state={"impl": impl})


def _verify_trees(device, rng, bs, topk, num_steps, D, index_dtype):
    """Random closed trees with their links (from the reference build_tree, on the CPU)."""
    pl, sel, vsl, parents = random_eagle_batch(rng, bs, topk, num_steps, D)
    tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="reference")
    links = tuple(x.to(device, index_dtype) for x in tree[2:])
    return links, parents


@case("verify_greedy",
      "verify_tree_greedy: bs=64 x 64 nodes, topk=8, num_steps=5, tokens drawn so paths of "
      "0..5 drafts are accepted; bytes = 5 [bs, D] int inputs read, predicts + accept_index + "
      "accept_length written; impl=auto|reference|triton|cuda|torch",
      check=_check_verify,
      bs=64, num_draft_tokens=64, topk=8, num_steps=5, vocab=128256, index_dtype="int64",
      input_sets=8, seed=0, impl="auto")
def _verify_greedy(device, *, bs, num_draft_tokens, topk, num_steps, vocab, index_dtype,
                   input_sets, seed, impl):
    """:func:`specattn.ops.verify_tree_greedy` with mixed accepted lengths."""
    D, it = num_draft_tokens, getattr(torch, index_dtype)
    rng = random.Random(seed)
    sets = []
    for _ in range(input_sets):
        links, parents = _verify_trees(device, rng, bs, topk, num_steps, D, it)
        toks = [greedy_tokens(rng, p, num_steps, vocab) for p in parents]
        cand = torch.tensor([c for c, _ in toks], dtype=it).to(device)
        target = torch.tensor([t for _, t in toks], dtype=it).to(device)
        sets.append((cand, *links, target))
    if impl == "torch":
        def call(cand, ridx, nxt, sib, target):
            return verify_tree_greedy_torch(cand, ridx, nxt, sib, target, num_steps)
    else:
        def call(cand, ridx, nxt, sib, target):
            return verify_tree_greedy(cand, ridx, nxt, sib, target, num_steps, impl=impl)
    out_bytes = 4 * (bs * D + bs * (num_steps + 1) + bs)
    return Workload(fn=_eager_only("verify_tree_greedy", impl, device, call),
                    bytes=_nbytes(*sets[0]) + out_bytes, flops=0, input_sets=sets,
                    state={"impl": impl})


@case("verify_sampling",
      "tree_speculative_sampling (target only, thresholds 1, explicit coins): bs=64 x 64 "
      "nodes, topk=8, num_steps=5, vocab=128256 float32 probs [bs, D, V] (2.1 GB per input "
      "set); bytes = int inputs + coins read, one V-row of probs per request (the bonus "
      "draw's residual), outputs written; impl=auto|reference|triton|cuda|torch (reference "
      "copies all probs to the host per call)",
      check=_check_verify,
      bs=64, num_draft_tokens=64, topk=8, num_steps=5, vocab=128256, index_dtype="int64",
      input_sets=2, seed=0, impl="auto")
def _verify_sampling(device, *, bs, num_draft_tokens, topk, num_steps, vocab, index_dtype,
                     input_sets, seed, impl):
    """:func:`specattn.ops.tree_speculative_sampling` with mixed accepted lengths: the target
    law at each node is softmax(N(0, 1) logits) with the children's tokens boosted by a
    per-request amount in [8, 18] nats (children's mass from ~0.1 to ~1 at vocab 128256)."""
    D, it = num_draft_tokens, getattr(torch, index_dtype)
    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(input_sets):
        links, parents = _verify_trees(device, rng, bs, topk, num_steps, D, it)
        cand = torch.randint(vocab, (bs, D), generator=gen, device=device)
        logits = torch.randn(bs, D, vocab, generator=gen, device=device)
        edges = [(b, p, j) for b, ps in enumerate(parents) for j, p in enumerate(ps)
                 if p is not None]
        eb, ep, ej = (torch.tensor(x, device=device) for x in zip(*edges)) if edges else (
            torch.zeros(0, dtype=torch.int64, device=device),) * 3
        boost = 8.0 + 10.0 * torch.rand(bs, generator=gen, device=device)
        logits.index_put_((eb, ep, cand[eb, ej]), boost[eb], accumulate=True)
        probs = torch.softmax(logits, dim=-1)
        del logits
        coins = torch.rand(bs, D, generator=gen, device=device)
        final = torch.rand(bs, generator=gen, device=device)
        sets.append((cand.to(it), *links, probs, coins, final))
    if impl == "torch":
        def call(cand, ridx, nxt, sib, probs, coins, final):
            return tree_speculative_sampling_torch(cand, ridx, nxt, sib, probs, num_steps,
                                                   coins, final, max_children=topk)
    else:
        def call(cand, ridx, nxt, sib, probs, coins, final):
            return tree_speculative_sampling(
                cand, ridx, nxt, sib, probs, num_steps, uniform_samples=coins,
                uniform_samples_for_final_sampling=final, impl=impl)
    cand, ridx, nxt, sib, probs, coins, final = sets[0]
    in_bytes = _nbytes(cand, ridx, nxt, sib, coins, final) + bs * vocab * probs.element_size()
    out_bytes = 4 * (bs * D + bs * (num_steps + 1) + bs)
    return Workload(fn=_eager_only("tree_speculative_sampling", impl, device, call),
                    bytes=in_bytes + out_bytes, flops=0, input_sets=sets,
                    state={"impl": impl})


@case("compaction",
      "compact_accepted_path: bs=256 x 64 rows, accepted paths of 0..5 drafts, hidden 4096 "
      "bf16 + predicts + out_cache_loc; bytes = accept_index/length, out_cache_loc, predicts, "
      "hidden_states read once, src_index + 5 gathered outputs written; "
      "impl=auto|reference|triton|cuda|torch",
      check=_check_compaction,
      bs=256, num_draft_tokens=64, num_steps=5, hidden=4096, dtype="bfloat16",
      index_dtype="int64", vocab=128256, input_sets=4, seed=0, impl="auto")
def _compaction(device, *, bs, num_draft_tokens, num_steps, hidden, dtype, index_dtype, vocab,
                input_sets, seed, impl):
    """:func:`specattn.ops.compact_accepted_path` with predicts and hidden states; each
    request's path is the root plus ``accept_length`` (uniform in 0..num_steps) distinct rows
    of its block in ascending order (as a tree path), ``out_cache_loc`` distinct slots."""
    D, it, dt = num_draft_tokens, getattr(torch, index_dtype), getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=device).manual_seed(seed)
    S = num_steps + 1
    sets = []
    for _ in range(input_sets):
        rows = torch.rand(bs, D - 1, generator=g).argsort(1)[:, :num_steps].sort(1).values + 1
        path = torch.cat([torch.zeros(bs, 1, dtype=torch.int64), rows], 1)
        path += torch.arange(bs)[:, None] * D
        length = torch.randint(0, num_steps + 1, (bs,), generator=g)
        path[torch.arange(S)[None, :] > length[:, None]] = -1
        ocl = torch.randperm(2 * bs * D, generator=g)[:bs * D]
        predicts = torch.randint(vocab, (bs * D,), generator=g, dtype=torch.int32)
        hs = torch.randn(bs * D, hidden, generator=gd, device=device).to(dt)
        sets.append((path.to(device, it), length.to(device, it), ocl.to(device, it),
                     predicts.to(device), hs))
    if impl == "torch":
        def call(ai, al, ocl, predicts, hs):
            return compact_accepted_path_torch(ai, al, ocl, D, predicts, hs)
    else:
        def call(ai, al, ocl, predicts, hs):
            return compact_accepted_path(ai, al, ocl, D, predicts=predicts, hidden_states=hs,
                                         impl=impl)
    ai, al, ocl, predicts, hs = sets[0]
    out_bytes = bs * D * 8 + predicts.nbytes + hs.nbytes + 3 * ocl.nbytes
    return Workload(fn=_eager_only("compact_accepted_path", impl, device, call),
                    bytes=_nbytes(*sets[0]) + out_bytes, flops=0, input_sets=sets,
                    state={"impl": impl})
