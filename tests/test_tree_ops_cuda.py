"""CUDA EAGLE tree ops (csrc/tree_ops.cu: build_tree, verify_tree_greedy,
compact_accepted_path) and their Triton versions against the references, bit for bit, on
fresh random trees with poisoned outputs (ints -7777, floats NaN); the FlashInfer mask output
of build_tree; CUDA-graph capture + replay of each CUDA op.

``test_sanitizer_smoke`` runs each CUDA kernel once on moderate shapes, for
``compute-sanitizer --tool memcheck python -m pytest tests/test_tree_ops_cuda.py -k sanitizer``.

Needs a GPU and the built extension specattn._C (skipped otherwise).  Random-tree helpers come
from test_triton_tree_ops.py.
"""
import random

import pytest
import torch

from specattn import _ext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _ext.EXT_AVAILABLE,
                       reason=f"specattn._C missing: {_ext.EXT_MISSING_REASON}"),
]

from test_triton_tree_ops import (FI_POISON, POISON, assert_all_same, assert_same,  # noqa: E402
                                  check_build_tree, check_build_tree_fi, check_compaction,
                                  check_verify, fi_buffers, random_batch, run_both, t,
                                  tree_outputs)

from specattn.ops.tree_mask import tree_mask_to_flashinfer  # noqa: E402
from specattn.ops import (build_tree, compact_accepted_path, num_tree_candidates,  # noqa: E402
                          registry, verify_tree_greedy)

DEV = "cuda"
ALL = ("reference", "cuda", "triton")
GPU = ("cuda", "triton")


def rand_tokens(rng, bs, D, vocab, dtype=torch.int64):
    return t([[rng.randrange(vocab) for _ in range(D)] for _ in range(bs)], dtype)


def random_config(rng, max_topk=16, max_steps=8, max_D=64):
    topk, num_steps = rng.randint(1, max_topk), rng.randint(1, max_steps)
    D = rng.randint(1, min(num_tree_candidates(topk, num_steps), max_D - 1) + 1)
    return topk, num_steps, D


def tree_and_path(rng, bs, topk, num_steps, D, closed=True, dtype=torch.int64, vocab=2):
    """A random tree (built by CUDA), greedy verify of it (CUDA): the inputs of compaction."""
    pl, sel, vsl = random_batch(rng, bs, topk, num_steps, D, closed=closed, dtype=dtype)
    tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="cuda")
    cand, target = rand_tokens(rng, bs, D, vocab), rand_tokens(rng, bs, D, vocab)
    pred, ai, al = verify_tree_greedy(cand, *tree[2:], target, num_steps, impl="cuda")
    return tree, pred, ai, al


# Closed random trees cost O(D * candidates) per request in Python: keep big batches small.
BIG_BATCH_CONFIGS = {64: [(8, 5, 64), (4, 6, 64), (16, 2, 40)], 256: [(8, 3, 64), (3, 8, 17)]}


# ----------------------------------------------------------------------------- build_tree
def test_build_tree_random(seed):
    rng = random.Random(seed)
    for bs in (1, 2, 7):
        for i in range(8):
            topk, num_steps, D = random_config(rng)
            dtype = rng.choice([torch.int32, torch.int64])
            check_build_tree(*random_batch(rng, bs, topk, num_steps, D, closed=i % 2 == 0,
                                           dtype=dtype), topk, num_steps, D, impls=ALL)
    for bs, configs in BIG_BATCH_CONFIGS.items():
        for i, (topk, num_steps, D) in enumerate(configs):
            check_build_tree(*random_batch(rng, bs, topk, num_steps, D, closed=i != 1),
                             topk, num_steps, D, impls=ALL)


def test_build_tree_edges(seed):
    rng = random.Random(seed)
    # SGLang's vector, chain (topk 1), root only (D = 1), missing parent with a descendant
    pl = t([[-1, 0, 1, 2, 3, 4, 8, 9, 10, 20, 24, 21, 28],
            [-1, 0, 1, 2, 3, 4, 5, 6, 7, 24, 28, 20, 21]])
    check_build_tree(pl, t([[0, 1, 4, 8, 20, 24, 36], [0, 4, 5, 6, 7, 24, 36]]), t([5, 10]),
                     4, 4, 8, impls=ALL)
    check_build_tree(t([[-1, 0, 1]] * 2), t([[0, 1, 2]] * 2), t([4, 0]), 1, 3, 4, impls=ALL)
    check_build_tree(*random_batch(rng, 1, 1, 8, 9), 1, 8, 9, impls=ALL)
    check_build_tree(t([[-1, 0, 1]] * 2), torch.zeros(2, 0, dtype=torch.int64, device=DEV),
                     t([9, 0]), 2, 2, 1, impls=ALL)
    check_build_tree(t([[-1, 0, 1, 4, 2]]), t([[0, 4, 6]]), t([10]), 2, 3, 4, impls=ALL)
    out = build_tree(t([[-1, 0, 1, 4, 2]]), t([[0, 4, 6]]), t([10]), 2, 3, 4, impl="cuda")
    assert out.positions.tolist() == [10, 11, 11, 12]
    assert out.retrive_next_token.tolist() == [[1, -1, 3, -1]]
    # D = 33: bit 31 (the int32 sign bit) and the second word; chain and bushy, all orphans
    check_build_tree(*random_batch(rng, 2, 1, 33, 33), 1, 33, 33, impls=ALL)
    check_build_tree(*random_batch(rng, 3, 3, 5, 33), 3, 5, 33, impls=ALL)
    check_build_tree(*random_batch(rng, 3, 4, 4, 33, closed=False), 4, 4, 33, impls=ALL)
    # int32 and int64 inputs mixed (each tensor its own dtype)
    pl, sel, vsl = random_batch(rng, 5, 4, 4, 20)
    check_build_tree(pl.int(), sel, vsl.int(), 4, 4, 20, impls=ALL)
    check_build_tree(pl, sel.int(), vsl, 4, 4, 20, impls=ALL)
    # non-contiguous inputs
    check_build_tree(pl.t().contiguous().t(), sel[:, :].t().contiguous().t(), vsl, 4, 4, 20,
                     impls=ALL)
    # large D (CUDA kernel limit 512): CUDA vs reference only (Triton's [D, D] tiles spill)
    check_build_tree(*random_batch(rng, 2, 16, 2, 256, closed=False), 16, 2, 256,
                     impls=("reference", "cuda"))
    check_build_tree(*random_batch(rng, 1, 16, 3, 512, closed=False), 16, 3, 512,
                     impls=("reference", "cuda"))
    # wide parent_list rows (1024 and 1025 entries: beams far from the root)
    for topk, num_steps in ((31, 34), (32, 33)):
        check_build_tree(*random_batch(rng, 2, topk, num_steps, 48, closed=False), topk, num_steps, 48,
                         impls=("reference", "cuda"))


def test_build_tree_strided_outputs(seed):
    """The raw op writes through arbitrary output strides (every element)."""
    rng = random.Random(seed)
    bs, topk, num_steps, D = 3, 3, 4, 31  # 31 = 1 + all 30 candidates
    pl, sel, vsl = random_batch(rng, bs, topk, num_steps, D)
    want = build_tree(pl, sel, vsl, topk, num_steps, D, impl="reference")
    outs = [torch.full((x.shape[-1], *x.shape[:-1]), POISON, dtype=x.dtype, device=DEV)
            .movedim(0, -1) if x.dim() > 1 else
            torch.full((2 * x.shape[0],), POISON, dtype=x.dtype, device=DEV)[::2]
            for x in want]
    torch.ops.specattn.build_tree(pl, sel, vsl, *outs, topk, num_steps, D)
    assert_same(list(want), outs)


def test_build_tree_flashinfer(seed):
    rng = random.Random(seed)
    for bs in (1, 2, 7, 64):
        for i in range(4 if bs < 64 else 1):
            topk, num_steps, D = random_config(rng, max_topk=6, max_steps=6, max_D=48)
            dtype = rng.choice([torch.int32, torch.int64])
            pl, sel, _ = random_batch(rng, bs, topk, num_steps, D, closed=i % 2 == 0,
                                      dtype=dtype)
            # P = 0, odd P (segments not a multiple of 8 bits), long prefixes (16-byte body)
            vsl = t([rng.choice([0, 1, 3, 7, 31, 33, rng.randrange(4000)]) for _ in range(bs)],
                    dtype)
            check_build_tree_fi(pl, sel, vsl, topk, num_steps, D, impls=ALL,
                                offset=rng.randrange(16))
    z = torch.zeros(3, 0, dtype=torch.int64, device=DEV)
    check_build_tree_fi(t([[-1, 0, 1]] * 3), z, t([0, 1, 8]), 2, 2, 1, impls=ALL)  # D = 1
    check_build_tree_fi(*random_batch(rng, 3, 3, 5, 33, closed=False)[:2], t([0, 5, 1000]), 3,
                        5, 33, impls=ALL, offset=1)  # D = 33
    check_build_tree_fi(*random_batch(rng, 2, 16, 2, 256, closed=False)[:2], t([0, 333]), 16,
                        2, 256, impls=("reference", "cuda"), offset=5)  # W = 8


def test_empty_batch_through_wrappers():
    e = torch.zeros(0, 3, dtype=torch.int64, device=DEV)
    buf = torch.full((4,), FI_POISON, dtype=torch.uint8, device=DEV)
    for impl in GPU:
        tree = build_tree(e, e[:, :2], e[:, 0], 2, 2, 3, impl=impl,
                          flashinfer_packed_mask=buf,
                          flashinfer_mask_indptr=torch.zeros(1, dtype=torch.int32, device=DEV))
        assert tree.tree_mask.shape == (0, 3, 1) and tree.positions.shape == (0,)
        assert bool((buf == FI_POISON).all())
        v = verify_tree_greedy(e, e, e, e, e, 2, impl=impl)
        assert v.predicts.shape == (0,) and v.accept_index.shape == (0, 3)
        c = compact_accepted_path(e, e[:, 0], e[:, 0], 3, predicts=e[:, 0],
                                  hidden_states=torch.zeros(0, 8, device=DEV), impl=impl)
        assert c.src_index.shape == (0,) and c.hidden_states.shape == (0, 8)
    # raw ops with an empty batch launch nothing and do not fail
    torch.ops.specattn.build_tree(e, e[:, :2], e[:, 0], *tree_outputs(0, 3), 2, 2, 3)


# ----------------------------------------------------------------------------- verify
def test_verify_random(seed):
    rng = random.Random(seed)
    cases = [(bs, None) for bs in (1, 2, 7) for _ in range(8)]
    cases += [(bs, c) for bs, configs in BIG_BATCH_CONFIGS.items() for c in configs]
    for i, (bs, config) in enumerate(cases):
        topk, num_steps, D = config or random_config(rng)
        pl, sel, vsl = random_batch(rng, bs, topk, num_steps, D, closed=i % 3 != 0)
        tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="cuda")
        vocab = rng.randint(1, 3)  # tiny vocab: many matches, duplicate sibling tokens
        dtype = rng.choice([torch.int32, torch.int64])
        cand, target = rand_tokens(rng, bs, D, vocab, dtype), rand_tokens(rng, bs, D, vocab)
        check_verify(cand, tree, target, rng.randint(0, num_steps + 1), impls=ALL)


def test_verify_edges():
    D = 5
    tree = build_tree(t([[-1, 0, 1, 2]] * 2), t([[0, 1, 2, 3]] * 2), t([3, 8]), 1, 4, D)
    cand = t([[9, 1, 2, 3, 4], [9, 1, 2, 3, 4]])
    target = t([[1, 2, 3, 4, 5], [7, 7, 7, 7, 7]])  # request 0 all accepted, request 1 none
    pred, acc, n = check_verify(cand, tree, target, 4, impls=ALL)
    assert n.tolist() == [4, 0]
    assert acc.tolist() == [[0, 1, 2, 3, 4], [5, -1, -1, -1, -1]]
    assert pred.tolist() == [1, 2, 3, 4, 5, 7, 0, 0, 0, 0]
    pred, acc, n = check_verify(cand, tree, target, 2, impls=ALL)  # num_steps cap
    assert n.tolist() == [2, 0] and pred.tolist()[:5] == [1, 2, 3, 0, 0]
    check_verify(cand, tree, target, 0, impls=ALL)  # S = 1
    check_verify(cand.int(), tree, target.int(), 9, impls=ALL)  # S > D, int32
    # orphan (missing parent) never accepted although its token matches
    tree = build_tree(t([[-1, 0, 1]]), t([[0, 2, 5]]), t([0]), 2, 2, 4)
    pred, acc, n = check_verify(t([[0, 4, 4, 4]]), tree, t([[4, 9, 4, 4]]), 3, impls=ALL)
    assert n.tolist() == [1] and acc.tolist() == [[0, 1, -1, -1]]
    # duplicate sibling tokens: the first in sibling order wins
    tree = build_tree(t([[-1, 0, 1]]), t([[0, 1, 2, 3]]), t([0]), 2, 2, 5)
    pred, acc, n = check_verify(t([[0, 5, 5, 6, 6]]), tree, t([[5, 6, 6, 6, 6]]), 2, impls=ALL)
    assert acc.tolist() == [[0, 1, 3]]
    # D = 1
    tree = build_tree(t([[-1, 0, 1]]), torch.zeros(1, 0, dtype=torch.int64, device=DEV), t([3]),
                      2, 2, 1)
    pred, acc, n = check_verify(t([[4]]), tree, t([[8]]), 2, impls=ALL)
    assert pred.tolist() == [8] and acc.tolist() == [[0, -1, -1]] and n.tolist() == [0]


def random_links(rng, bs, D):
    """retrive_* of random trees given by parent arrays (parent[j] < j), any D."""
    nxt, sib = [[-1] * D for _ in range(bs)], [[-1] * D for _ in range(bs)]
    for b in range(bs):
        last = [None] * D
        for j in range(1, D):
            p = rng.randrange(j) if rng.random() < 0.5 else j - 1  # long chains and wide nodes
            if last[p] is None:
                nxt[b][p] = j
            else:
                sib[b][last[p]] = j
            last[p] = j
    ridx = torch.arange(bs * D, device=DEV).view(bs, D)
    return ridx, t(nxt), t(sib)


def test_verify_large_D_global_path(seed):
    """D > 1024: the kernel reads the rows from global memory instead of shared memory."""
    rng = random.Random(seed)
    for D in (1024, 1100):
        bs = 3
        ridx, nxt, sib = random_links(rng, bs, D)
        cand = rand_tokens(rng, bs, D, 2)
        target = rand_tokens(rng, bs, D, 2)
        res = run_both("verify_tree_greedy", lambda o: (*o, cand, ridx, nxt, sib, target),
                       [torch.empty(bs * D, dtype=torch.int32, device=DEV),
                        torch.empty(bs, D, dtype=torch.int32, device=DEV),
                        torch.empty(bs, dtype=torch.int32, device=DEV)],
                       impls=("reference", "cuda"))
        assert_all_same(res)


def test_verify_bad_links_terminate():
    """A cyclic sibling chain (rejected by the reference) must not hang the kernel."""
    D = 4
    ridx = torch.arange(D, device=DEV).view(1, D)
    nxt, sib = t([[1, -1, -1, -1]]), t([[-1, 2, 1, -1]])  # 1 -> 2 -> 1 -> ...
    out = verify_tree_greedy(t([[0, 1, 1, 1]]), ridx, nxt, sib, t([[5, 5, 5, 5]]), 3,
                             impl="cuda")
    torch.cuda.synchronize()
    assert out.accept_length.tolist() == [0]


# ----------------------------------------------------------------------------- compaction
def random_hidden(rng, rows):
    kind = rng.randrange(6)
    if kind == 0:
        return None
    if kind == 1:
        return torch.randn(rows, rng.randint(1, 70), device=DEV)
    if kind == 2:
        return torch.randn(rows, 2, rng.randint(1, 40), device=DEV).to(torch.bfloat16)
    if kind == 3:
        return torch.rand(rows, device=DEV) < 0.5  # 1-D, bool
    if kind == 4:
        return torch.randn(rows, rng.randint(1, 300), device=DEV).to(torch.float8_e4m3fn)
    return torch.rand(rows, rng.randint(1, 9), device=DEV) < 0.5


def test_compaction_random(seed):
    rng = random.Random(seed)
    cases = [(bs, None) for bs in (1, 2, 7) for _ in range(10)]
    cases += [(bs, c) for bs, configs in BIG_BATCH_CONFIGS.items() for c in configs]
    for bs, config in cases:
        topk, num_steps, D = config or random_config(rng)
        _, pred, ai, al = tree_and_path(rng, bs, topk, num_steps, D)
        if rng.random() < 0.5:
            ai, al = ai.long(), al.long()
        dtype = rng.choice([torch.int32, torch.int64])
        ocl = torch.randperm(bs * D + 5, device=DEV)[:bs * D].to(dtype)
        pred = pred if rng.random() < 0.7 else None
        if pred is not None and rng.random() < 0.5:
            pred = pred.long()
        check_compaction(ai, al, ocl, D, pred, random_hidden(rng, bs * D), impls=ALL)


def test_compaction_all_and_none_accepted():
    ai, al = t([[0, 1, 2, 3], [4, -1, -1, -1]]), t([3, 0])
    ocl = t([10, 11, 12, 13, 20, 21, 22, 23], torch.int32)
    hidden = torch.arange(8 * 3, dtype=torch.float32, device=DEV).view(8, 3)
    check_compaction(ai, al, ocl, 4, t(list(range(8))), hidden, impls=ALL)
    check_compaction(t([[2, 0], [6, 5]]), t([1, 1]), ocl, 4, None, hidden, impls=ALL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.bool,
                                   torch.float8_e4m3fn, torch.int8, torch.float64])
@pytest.mark.parametrize("shape", [(), (3,), (2, 5), (256,)])
def test_compaction_hidden_dtypes(dtype, shape, seed):
    rng = random.Random(seed)
    bs, D = 7, 9
    _, pred, ai, al = tree_and_path(rng, bs, 2, 4, D)
    ocl = torch.randperm(bs * D, device=DEV)
    raw = torch.randint(0, 256, (bs * D, *shape, torch.empty((), dtype=dtype).element_size()),
                        dtype=torch.uint8, device=DEV)
    if dtype == torch.bool:
        raw = raw % 2
    elif dtype.is_floating_point:  # keep NaNs out (poison detection compares bits)
        raw = torch.randn(bs * D, *shape, device=DEV).to(dtype).view(torch.uint8) \
            .view(bs * D, *shape, -1)
    hidden = raw.view(dtype).view(bs * D, *shape)
    check_compaction(ai, al, ocl, D, pred, hidden, impls=ALL)


def _noncontig_hidden(kind, rows, gen):
    if kind == "row_strided":  # rows dense, row stride > row length: native path
        return torch.randn(rows, 72, generator=gen, device=DEV).to(torch.bfloat16)[:, :64]
    if kind == "rows_step2":
        return torch.randn(2 * rows, 40, generator=gen, device=DEV)[::2]
    if kind == "transposed":  # inner dims not dense: input copy, output through a temporary
        return torch.randn(48, rows, generator=gen, device=DEV).t()
    if kind == "permuted_3d":
        return torch.randn(rows, 6, 4, generator=gen, device=DEV).permute(0, 2, 1)
    if kind == "unaligned":  # base 2-byte aligned: narrower vectors
        flat = torch.randn(rows * 64 + 1, generator=gen, device=DEV).to(torch.bfloat16)
        return flat[1:].view(rows, 64)
    raise ValueError(kind)


@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("kind", ["row_strided", "rows_step2", "transposed", "permuted_3d",
                                  "unaligned"])
def test_compaction_noncontiguous_hidden(kind, impl, seed):
    rng = random.Random(seed)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    bs, D = 5, 12
    _, pred, ai, al = tree_and_path(rng, bs, 3, 4, D)
    hidden = _noncontig_hidden(kind, bs * D, gen)
    ocl = torch.randperm(bs * D, device=DEV)
    check_compaction(ai, al, ocl, D, pred, hidden, impls=("reference", impl))


# ----------------------------------------------------------------------------- CUDA graphs
def capture(fn):
    """Warm ``fn`` up on a side stream, capture it in a CUDA graph; returns (graph, outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def test_cuda_graph_build_tree(seed):
    rng = random.Random(seed)
    bs, topk, num_steps, D, max_p = 16, 4, 5, 33, 500
    pl, sel, vsl = random_batch(rng, bs, topk, num_steps, D)
    buf = torch.full((bs * ((D * (max_p + D) + 7) // 8) + 7,), FI_POISON, dtype=torch.uint8,
                     device=DEV)
    _, indptr = fi_buffers(vsl, D)
    g, out = capture(lambda: build_tree(pl, sel, vsl, topk, num_steps, D, impl="cuda",
                                        flashinfer_packed_mask=buf,
                                        flashinfer_mask_indptr=indptr))
    for _ in range(3):
        new_pl, new_sel, _ = random_batch(rng, bs, topk, num_steps, D, closed=rng.random() < 0.5)
        new_vsl = t([rng.randrange(max_p) for _ in range(bs)])
        pl.copy_(new_pl)
        sel.copy_(new_sel)
        vsl.copy_(new_vsl)
        indptr.copy_(fi_buffers(new_vsl, D)[1])
        buf.fill_(FI_POISON)
        g.replay()
        torch.cuda.synchronize()
        want = build_tree(new_pl, new_sel, new_vsl, topk, num_steps, D, impl="reference")
        assert_same(list(want), list(out))
        packed, _ = tree_mask_to_flashinfer(want.tree_mask, new_vsl.cpu())
        total = packed.numel()
        assert torch.equal(buf[:total], packed) and bool((buf[total:] == FI_POISON).all())


def test_cuda_graph_verify(seed):
    rng = random.Random(seed)
    bs, topk, num_steps, D = 16, 4, 5, 24
    pl, sel, vsl = random_batch(rng, bs, topk, num_steps, D)
    tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="cuda")
    links = [x.clone() for x in tree[2:]]
    cand, target = rand_tokens(rng, bs, D, 2), rand_tokens(rng, bs, D, 2)
    g, out = capture(lambda: verify_tree_greedy(cand, *links, target, num_steps, impl="cuda"))
    for _ in range(3):
        tree = build_tree(*random_batch(rng, bs, topk, num_steps, D, closed=rng.random() < 0.5),
                          topk, num_steps, D, impl="reference")
        for dst, src in zip(links, tree[2:]):
            dst.copy_(src)
        cand.copy_(rand_tokens(rng, bs, D, 2))
        target.copy_(rand_tokens(rng, bs, D, 2))
        for o in out:
            o.fill_(POISON)
        g.replay()
        torch.cuda.synchronize()
        assert_same(list(verify_tree_greedy(cand, *links, target, num_steps, impl="reference")),
                    list(out))


def test_cuda_graph_compaction(seed):
    rng = random.Random(seed)
    bs, topk, num_steps, D, H = 16, 4, 5, 24, 96
    _, pred, ai, al = tree_and_path(rng, bs, topk, num_steps, D)
    ocl = torch.randperm(bs * D * 2, device=DEV)[:bs * D]
    hidden = torch.randn(bs * D, H, device=DEV).to(torch.bfloat16)
    g, out = capture(lambda: compact_accepted_path(ai, al, ocl, D, predicts=pred,
                                                   hidden_states=hidden, impl="cuda"))
    for _ in range(3):
        _, new_pred, new_ai, new_al = tree_and_path(rng, bs, topk, num_steps, D)
        pred.copy_(new_pred)
        ai.copy_(new_ai)
        al.copy_(new_al)
        ocl.copy_(torch.randperm(bs * D * 2, device=DEV)[:bs * D])
        hidden.copy_(torch.randn(bs * D, H, device=DEV))
        for o in out:
            o.fill_(POISON)
        g.replay()
        torch.cuda.synchronize()
        want = compact_accepted_path(ai, al, ocl, D, predicts=pred, hidden_states=hidden,
                                     impl="reference")
        assert_same(list(want), list(out))


# ----------------------------------------------------------------------------- misc
def test_sanitizer_smoke(seed):
    """Each CUDA kernel once on moderate shapes (bs 64, D 64, hidden 256), with and without
    the FlashInfer mask, checked against the reference: quick under compute-sanitizer."""
    rng = random.Random(seed)
    bs, topk, num_steps, D = 64, 8, 5, 64
    pl, sel, vsl = random_batch(rng, bs, topk, num_steps, D, closed=True)
    check_build_tree(pl, sel, vsl.abs() + 1000, topk, num_steps, D, impls=("reference", "cuda"))
    pl2, sel2, vsl2 = random_batch(rng, bs, topk, num_steps, D, closed=False)
    check_build_tree_fi(pl2, sel2, vsl2, topk, num_steps, D, impls=("reference", "cuda"),
                        offset=3)
    tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="cuda")
    cand, target = rand_tokens(rng, bs, D, 2), rand_tokens(rng, bs, D, 2)
    pred, ai, al = check_verify(cand, tree, target, num_steps, impls=("reference", "cuda"))
    ocl = torch.randperm(bs * D, device=DEV)
    hidden = torch.randn(bs * D, 256, device=DEV).to(torch.bfloat16)
    check_compaction(ai, al, ocl, D, pred, hidden, impls=("reference", "cuda"))
    check_compaction(ai, al, ocl, D, None, hidden[:, :255], impls=("reference", "cuda"))


def test_auto_picks_cuda():
    for op in ("build_tree", "verify_tree_greedy", "compact_accepted_path"):
        assert registry.availability(op)["cuda"] is None
        assert registry.dispatch(op, "auto", torch.device(DEV)) is getattr(torch.ops.specattn, op)


def test_raw_op_host_checks():
    pl, sel, vsl = t([[-1, 0, 1]]), t([[0, 1, 2, 4]]), t([7])
    outs = tree_outputs(1, 5)
    op = torch.ops.specattn.build_tree
    with pytest.raises(RuntimeError, match="int32 or int64"):
        op(pl.float(), sel, vsl, *outs, 2, 2, 5)
    with pytest.raises(RuntimeError, match="tree_mask must be Int"):
        op(pl, sel, vsl, outs[0].long(), *outs[1:], 2, 2, 5)
    with pytest.raises(RuntimeError, match="parent_list must have shape"):
        op(pl, sel, vsl, *outs, 3, 2, 5)
    with pytest.raises(RuntimeError, match="limit of 512"):
        op(pl, sel, vsl, *outs, 2, 2, 513)
    with pytest.raises(RuntimeError, match="or neither"):
        op(pl, sel, vsl, *outs, 2, 2, 5, torch.zeros(8, dtype=torch.uint8, device=DEV), None)
    with pytest.raises(RuntimeError, match="is on cpu"):
        op(pl, sel.cpu(), vsl, *outs, 2, 2, 5)
    e = torch.zeros(1, 5, dtype=torch.int64, device=DEV)
    vop = torch.ops.specattn.verify_tree_greedy
    vouts = [torch.empty(5, dtype=torch.int32, device=DEV),
             torch.empty(1, 3, dtype=torch.int32, device=DEV),
             torch.empty(1, dtype=torch.int32, device=DEV)]
    with pytest.raises(RuntimeError, match="predicts must be Int"):
        vop(vouts[0].long(), *vouts[1:], e, e, e, e, e)
    with pytest.raises(RuntimeError, match="target_predict must have shape"):
        vop(*vouts, e, e, e, e, e[:, :4])
    cop = torch.ops.specattn.compact_accepted_path
    ai, al, ocl = t([[0, 1]]), t([1]), t([5, 6, 7])
    couts = [torch.empty(3, dtype=torch.int64, device=DEV)] + [None, None] + \
        [torch.empty_like(ocl) for _ in range(3)]
    with pytest.raises(RuntimeError, match="both be given"):
        cop(ai, al, ocl, ocl, None, *couts)
    with pytest.raises(RuntimeError, match="hidden_states_out must match"):
        h = torch.zeros(3, 4, device=DEV)
        cop(ai, al, ocl, None, h, couts[0], None, h.half(), *couts[3:])
