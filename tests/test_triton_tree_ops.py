"""Triton tree ops (build_tree, verify_tree_greedy, compact_accepted_path) against the
references, on fresh random EAGLE trees (with and without missing parents), with poisoned
outputs.  On a CPU-only machine the kernels run in Triton's interpreter (small shapes)."""
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from specattn.ops.tree_mask import num_mask_words, tree_mask_to_flashinfer  # noqa: E402
from specattn.ops import (build_tree, compact_accepted_path, num_tree_candidates,  # noqa: E402
                          registry, verify_tree_greedy)
from specattn.ops.tree import flashinfer_mask_bytes  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
POISON = -7777


def t(x, dtype=torch.int64):
    return torch.tensor(x, dtype=dtype, device=DEV)


def random_tree(rng, topk, num_steps, D, closed=True):
    """``(parent_list, selected)`` of one request: a valid EAGLE ``parent_list`` (block ``s``
    picks ``topk`` distinct step-``s`` candidates) and ``D - 1`` distinct candidates; when
    ``closed`` every selected candidate's parent is selected, else any (missing parents)."""
    n_cand = num_tree_candidates(topk, num_steps)
    pl = [-1]
    for s in range(num_steps - 1):
        lo = 0 if s == 0 else topk + (s - 1) * topk * topk
        pl += rng.sample(range(lo, topk + s * topk * topk), topk)
    if closed:
        sel = set()
        while len(sel) < D - 1:
            sel.add(rng.choice([f for f in range(n_cand) if f not in sel
                                and (f < topk or pl[f // topk] in sel)]))
        sel = sorted(sel)
    else:
        sel = rng.sample(range(n_cand), D - 1)
        if rng.random() < 0.7:
            sel.sort()  # SGLang sorts; any order is valid input
    return pl, sel


def random_batch(rng, bs, topk, num_steps, D, closed=True, dtype=torch.int64):
    pls, sels = zip(*[random_tree(rng, topk, num_steps, D, closed) for _ in range(bs)])
    vsl = t([rng.randrange(100) for _ in range(bs)], dtype)
    return t(list(pls), dtype), t(list(sels), dtype).view(bs, D - 1), vsl


def poisoned(o):
    """A tensor like ``o`` full of a value no kernel writes by accident: NaN for floats,
    True for bool, -7777 for int32/int64, the 0xA5 byte pattern for narrower integers."""
    if o.is_floating_point():
        return torch.full_like(o, float("nan"))
    if o.dtype == torch.bool:
        return torch.ones_like(o)
    if o.element_size() >= 4:
        return torch.full_like(o, POISON)
    out = torch.empty_like(o)
    out.view(torch.uint8).fill_(0xA5)
    return out


def run_both(op, inputs, outputs_like, *tail, impls=("reference", "triton")):
    """Run each of ``impls`` (default: the reference and the Triton launcher) on the same
    inputs with poisoned outputs (:func:`poisoned`; same argument order as the wrappers) and
    return their output lists."""
    res = []
    for impl in impls:
        outs = [None if o is None else poisoned(o) for o in outputs_like]
        registry.dispatch(op, impl, torch.device(DEV))(*inputs(outs), *tail)
        res.append(outs)
    return res


def assert_same(a, b):
    """Same dtypes, shapes and bits (any dtype: floats / fp8 / bool compared as bytes)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None:
            assert y is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            x, y = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
        assert torch.equal(x.cpu(), y.cpu()), (x, y)


def assert_all_same(results):
    for r in results[1:]:
        assert_same(results[0], r)


# ----------------------------------------------------------------------------- build_tree
def tree_outputs(bs, D):
    return [torch.empty(bs, D, num_mask_words(D), dtype=torch.int32, device=DEV),
            torch.empty(bs * D, dtype=torch.int64, device=DEV)] + [
        torch.empty(bs, D, dtype=torch.int64, device=DEV) for _ in range(3)]


def check_build_tree(pl, sel, vsl, topk, num_steps, D, impls=("reference", "triton")):
    bs = vsl.shape[0]
    assert_all_same(run_both("build_tree", lambda o: (pl, sel, vsl, *o), tree_outputs(bs, D),
                             topk, num_steps, D, impls=impls))
    # and through the public wrapper
    assert_all_same([build_tree(pl, sel, vsl, topk, num_steps, D, impl=impl) for impl in impls])


def test_build_tree_random(seed):
    rng = random.Random(seed)
    for i in range(60):
        bs, topk, num_steps = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 4)
        D = rng.randint(1, min(num_tree_candidates(topk, num_steps), 15) + 1)
        dtype = rng.choice([torch.int32, torch.int64])
        check_build_tree(*random_batch(rng, bs, topk, num_steps, D, closed=i % 2 == 0,
                                       dtype=dtype), topk, num_steps, D)


def test_build_tree_edge_cases():
    # SGLang's test vector (topk 4, depth 4, 8 drafts)
    pl = t([[-1, 0, 1, 2, 3, 4, 8, 9, 10, 20, 24, 21, 28],
            [-1, 0, 1, 2, 3, 4, 5, 6, 7, 24, 28, 20, 21]])
    check_build_tree(pl, t([[0, 1, 4, 8, 20, 24, 36], [0, 4, 5, 6, 7, 24, 36]]), t([5, 10]),
                     4, 4, 8)
    # chain (topk 1), root only, missing parent with a descendant
    check_build_tree(t([[-1, 0, 1]] * 2), t([[0, 1, 2]] * 2), t([4, 0]), 1, 3, 4)
    check_build_tree(t([[-1, 0, 1]]), torch.zeros(1, 0, dtype=torch.int64, device=DEV),
                     t([9]), 2, 2, 1)
    check_build_tree(t([[-1, 0, 1, 4, 2]]), t([[0, 4, 6]]), t([10]), 2, 3, 4)
    out = build_tree(t([[-1, 0, 1, 4, 2]]), t([[0, 4, 6]]), t([10]), 2, 3, 4, impl="triton")
    assert out.positions.tolist() == [10, 11, 11, 12]
    assert out.retrive_next_token.tolist() == [[1, -1, 3, -1]]


def test_build_tree_mask_word_boundary(seed):
    # D = 33: two mask words, bit 31 (the int32 sign bit) in use
    rng = random.Random(seed)
    check_build_tree(*random_batch(rng, 2, 3, 5, 33, closed=True), 3, 5, 33)
    check_build_tree(*random_batch(rng, 1, 1, 33, 33, closed=True), 1, 33, 33)  # deep chain


# ----------------------------------------------------------------------------- FlashInfer mask
FI_POISON = 0xAB


def fi_buffers(vsl, D, offset=0, slack=5):
    """A FlashInfer packed-mask buffer for :func:`build_tree`, poisoned (``FI_POISON``), that
    starts ``offset`` bytes into a bigger allocation (unaligned segments) and has ``slack``
    spare bytes after the last segment, and its int32 ``indptr``."""
    bs = vsl.shape[0]
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device=vsl.device)
    if bs:
        indptr[1:] = flashinfer_mask_bytes(vsl, D).cumsum(0)
    total = int(indptr[-1])
    big = torch.full((offset + total + slack,), FI_POISON, dtype=torch.uint8, device=vsl.device)
    return big[offset:], indptr


def check_build_tree_fi(pl, sel, vsl, topk, num_steps, D, impls=("reference", "triton"),
                        offset=0):
    """Every impl's FlashInfer bytes equal ``tree_mask_to_flashinfer`` of its own tree mask
    (and all impls agree on every output); the bytes after the segments stay poisoned."""
    got = []
    for impl in impls:
        buf, indptr = fi_buffers(vsl, D, offset)
        tree = build_tree(pl, sel, vsl, topk, num_steps, D, flashinfer_packed_mask=buf,
                          flashinfer_mask_indptr=indptr, impl=impl)
        want, want_indptr = tree_mask_to_flashinfer(tree.tree_mask, vsl.cpu())
        assert torch.equal(want_indptr.cpu(), indptr.cpu())
        total = int(indptr[-1])
        assert torch.equal(buf[:total].cpu(), want.cpu()), (impl, D, vsl.tolist())
        assert bool((buf[total:] == FI_POISON).all()), impl
        got.append((tree, buf))
    for tree, buf in got[1:]:
        assert_same(got[0][0], tree)
        assert torch.equal(got[0][1].cpu(), buf.cpu())
    return got


def test_build_tree_flashinfer_random(seed):
    rng = random.Random(seed)
    for i in range(24):
        bs, topk, num_steps = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4)
        D = rng.randint(1, min(num_tree_candidates(topk, num_steps), 40) + 1)  # crosses 32
        dtype = rng.choice([torch.int32, torch.int64])
        pl, sel, _ = random_batch(rng, bs, topk, num_steps, D, closed=i % 3 != 0, dtype=dtype)
        # P = 0, and values making D*(P+D) not a multiple of 8
        vsl = t([rng.choice([0, 0, 1, 3, 5, 8, 13, 31, 33, 77]) for _ in range(bs)], dtype)
        check_build_tree_fi(pl, sel, vsl, topk, num_steps, D, offset=rng.randrange(16))


def test_build_tree_flashinfer_edges(seed):
    rng = random.Random(seed)
    # D = 1 (root only): one bit per row... and one row
    z = torch.zeros(3, 0, dtype=torch.int64, device=DEV)
    check_build_tree_fi(t([[-1, 0, 1]] * 3), z, t([0, 1, 8]), 2, 2, 1)
    # D = 33 (bit 31, second word) as a chain and as a bushy tree, P = 0 / odd
    check_build_tree_fi(*random_batch(rng, 2, 1, 33, 33)[:2], t([0, 7]), 1, 33, 33, offset=3)
    check_build_tree_fi(*random_batch(rng, 3, 3, 5, 33, closed=False)[:2], t([0, 5, 64]), 3, 5,
                        33, offset=1)
    # missing parent with a descendant (rows {0, 2} and {0, 2, 3})
    got = check_build_tree_fi(t([[-1, 0, 1, 4, 2]]), t([[0, 4, 6]]), t([3]), 2, 3, 4)
    _, buf = got[0]
    bits = [(int(buf[i // 8]) >> (i % 8)) & 1 for i in range(4 * 7)]
    assert bits == [1, 1, 1, 1, 0, 0, 0,   1, 1, 1, 1, 1, 0, 0,
                    1, 1, 1, 1, 0, 1, 0,   1, 1, 1, 1, 0, 1, 1]


def test_build_tree_flashinfer_empty_batch():
    buf = torch.full((4,), FI_POISON, dtype=torch.uint8, device=DEV)
    indptr = torch.zeros(1, dtype=torch.int32, device=DEV)
    e = torch.zeros(0, 3, dtype=torch.int64, device=DEV)
    for impl in ("reference", "triton"):
        out = build_tree(e, e[:, :2], e[:, 0], 2, 2, 3, flashinfer_packed_mask=buf,
                         flashinfer_mask_indptr=indptr, impl=impl)
        assert out.tree_mask.shape == (0, 3, 1)
        assert bool((buf == FI_POISON).all())


@pytest.mark.parametrize("case, msg", [
    ("only_mask", "both"), ("only_indptr", "both"), ("mask_dtype", "dtype"),
    ("mask_2d", "1-D"), ("noncontig", "contiguous"), ("indptr_dtype", "dtype"),
    ("indptr_shape", "shape"), ("indptr0", "indptr\\[0\\]"), ("segment", "segment"),
    ("small", "bytes"),
])
def test_build_tree_flashinfer_bad_input(case, msg):
    pl, sel, vsl = t([[-1, 0, 1], [-1, 0, 1]]), t([[0, 1, 2, 4], [0, 2, 3, 5]]), t([3, 9])
    buf, indptr = fi_buffers(vsl, 5, slack=0)
    kw = dict(flashinfer_packed_mask=buf, flashinfer_mask_indptr=indptr)
    if case == "only_mask":
        kw["flashinfer_mask_indptr"] = None
    elif case == "only_indptr":
        kw["flashinfer_packed_mask"] = None
    elif case == "mask_dtype":
        kw["flashinfer_packed_mask"] = buf.to(torch.int32)
    elif case == "mask_2d":
        kw["flashinfer_packed_mask"] = buf.view(1, -1)
    elif case == "noncontig":
        kw["flashinfer_packed_mask"] = torch.zeros(2 * buf.numel(), dtype=torch.uint8,
                                                   device=DEV)[::2]
    elif case == "indptr_dtype":
        kw["flashinfer_mask_indptr"] = indptr.long()
    elif case == "indptr_shape":
        kw["flashinfer_mask_indptr"] = indptr[:2]
    elif case == "indptr0":
        kw["flashinfer_mask_indptr"] = indptr + 1
    elif case == "segment":
        bad = indptr.clone()
        bad[1] -= 1
        kw["flashinfer_mask_indptr"] = bad
    elif case == "small":
        kw["flashinfer_packed_mask"] = buf[:-1]
    before = buf.clone()
    with pytest.raises(ValueError, match=msg):
        build_tree(pl, sel, vsl, 2, 2, 5, impl="reference", **kw)
    assert torch.equal(buf, before)


def test_build_tree_cuda_draft_token_limit():
    from specattn.ops.tree import CUDA_MAX_DRAFT_TOKENS
    D = CUDA_MAX_DRAFT_TOKENS + 1
    pl, sel = t([[-1]]), t([list(range(D - 1))])
    with pytest.raises(ValueError, match="num_draft_tokens <= 512"):
        build_tree(pl, sel, t([0]), D - 1, 1, D, impl="cuda")


# ----------------------------------------------------------------------------- verify
def verify_outputs(bs, D, S):
    return [torch.empty(bs * D, dtype=torch.int32, device=DEV),
            torch.empty(bs, S, dtype=torch.int32, device=DEV),
            torch.empty(bs, dtype=torch.int32, device=DEV)]


def check_verify(cand, tree, target, cap, impls=("reference", "triton")):
    bs, D = cand.shape
    links = (tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling)
    res = run_both("verify_tree_greedy", lambda o: (*o, cand, *links, target),
                   verify_outputs(bs, D, cap + 1), impls=impls)
    assert_all_same(res)
    assert_all_same([verify_tree_greedy(cand, *links, target, cap, impl=impl) for impl in impls])
    return res[-1]


def test_verify_random(seed):
    rng = random.Random(seed)
    for i in range(60):
        bs, topk, num_steps = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 4)
        D = rng.randint(1, min(num_tree_candidates(topk, num_steps), 15) + 1)
        pl, sel, vsl = random_batch(rng, bs, topk, num_steps, D, closed=i % 3 != 0)
        tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="reference")
        vocab = rng.randint(1, 3)  # tiny vocab: many matches, duplicate sibling tokens
        dtype = rng.choice([torch.int32, torch.int64])
        cand = t([[rng.randrange(vocab) for _ in range(D)] for _ in range(bs)], dtype)
        target = t([[rng.randrange(vocab) for _ in range(D)] for _ in range(bs)], dtype)
        check_verify(cand, tree, target, rng.randint(0, num_steps + 1))


def test_verify_chain_all_and_none_accepted():
    D = 5
    tree = build_tree(t([[-1, 0, 1, 2]] * 2), t([[0, 1, 2, 3]] * 2), t([3, 8]), 1, 4, D)
    cand = t([[9, 1, 2, 3, 4], [9, 1, 2, 3, 4]])
    target = t([[1, 2, 3, 4, 5], [7, 7, 7, 7, 7]])  # request 0 all accepted, request 1 none
    pred, acc, n = check_verify(cand, tree, target, 4)
    assert n.tolist() == [4, 0]
    assert acc.tolist() == [[0, 1, 2, 3, 4], [5, -1, -1, -1, -1]]
    assert pred.tolist() == [1, 2, 3, 4, 5, 7, 0, 0, 0, 0]
    pred, acc, n = check_verify(cand, tree, target, 2)  # step cap
    assert n.tolist() == [2, 0] and pred.tolist()[:5] == [1, 2, 3, 0, 0]


def test_verify_orphan_never_accepted():
    # draft 3 (flat 5) has a missing parent; its token matches everything, never reached
    tree = build_tree(t([[-1, 0, 1]]), t([[0, 2, 5]]), t([0]), 2, 2, 4)
    pred, acc, n = check_verify(t([[0, 4, 4, 4]]), tree, t([[4, 9, 4, 4]]), 3)
    assert n.tolist() == [1] and acc.tolist() == [[0, 1, -1, -1]]


# ----------------------------------------------------------------------------- compaction
def check_compaction(ai, al, ocl, D, predicts, hidden, impls=("reference", "triton")):
    bs = ai.shape[0]
    outs = [torch.empty(bs * D, dtype=torch.int64, device=DEV),
            None if predicts is None else torch.empty_like(predicts),
            None if hidden is None else torch.empty_like(hidden),
            torch.empty_like(ocl), torch.empty_like(ocl), torch.empty_like(ocl)]
    assert_all_same(run_both("compact_accepted_path",
                             lambda o: (ai, al, ocl, predicts, hidden, *o), outs, impls=impls))
    assert_all_same([compact_accepted_path(ai, al, ocl, D, predicts=predicts,
                                           hidden_states=hidden, impl=impl) for impl in impls])


def random_hidden(rng, rows):
    kind = rng.randrange(4)
    if kind == 0:
        return None
    if kind == 1:
        return torch.randn(rows, rng.randint(1, 40), device=DEV)
    if kind == 2:
        return torch.randn(rows, 2, rng.randint(1, 5), device=DEV).to(torch.bfloat16)
    return torch.rand(rows, device=DEV) < 0.5  # 1-D, bool


def test_compaction_random(seed):
    rng = random.Random(seed)
    for i in range(60):
        bs, topk, num_steps = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 4)
        D = rng.randint(1, min(num_tree_candidates(topk, num_steps), 15) + 1)
        pl, sel, vsl = random_batch(rng, bs, topk, num_steps, D, closed=True)
        tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="reference")
        cand = t([[rng.randrange(2) for _ in range(D)] for _ in range(bs)])
        target = t([[rng.randrange(2) for _ in range(D)] for _ in range(bs)])
        cap = rng.randint(0, num_steps)
        pred, ai, al = verify_tree_greedy(cand, *tree[2:], target, cap, impl="reference")
        if rng.random() < 0.5:
            ai, al = ai.long(), al.long()
        dtype = rng.choice([torch.int32, torch.int64])
        ocl = torch.randperm(bs * D + 5, device=DEV)[:bs * D].to(dtype)
        check_compaction(ai, al, ocl, D, pred if rng.random() < 0.7 else None,
                         random_hidden(rng, bs * D))


def test_compaction_all_and_none_accepted():
    # request 0: whole chain accepted (identity); request 1: only the root
    ai, al = t([[0, 1, 2, 3], [4, -1, -1, -1]]), t([3, 0])
    ocl = t([10, 11, 12, 13, 20, 21, 22, 23], torch.int32)
    hidden = torch.arange(8 * 3, dtype=torch.float32, device=DEV).view(8, 3)
    check_compaction(ai, al, ocl, 4, t(list(range(8))), hidden)
    # shuffled path, fewer accept_index columns than D
    check_compaction(t([[2, 0], [6, 5]]), t([1, 1]), ocl, 4, None, hidden)


# ----------------------------------------------------------------------------- GPU sizes
@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 17, 64])
def test_large_shapes_gpu(bs, seed):
    rng = random.Random(seed)
    for topk, num_steps, D in [(8, 8, 64), (4, 6, 64), (1, 64, 64), (10, 4, 48)]:
        pl, sel, vsl = random_batch(rng, bs, topk, num_steps, D, closed=rng.random() < 0.5)
        check_build_tree(pl, sel, vsl, topk, num_steps, D)
        tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="triton")
        cand = t([[rng.randrange(2) for _ in range(D)] for _ in range(bs)])
        target = t([[rng.randrange(2) for _ in range(D)] for _ in range(bs)])
        pred, ai, al = check_verify(cand, tree, target, num_steps)
        ocl = torch.randperm(bs * D * 2, device=DEV)[:bs * D]
        hidden = torch.randn(bs * D, 4096, device=DEV, dtype=torch.bfloat16)
        check_compaction(ai, al, ocl, D, pred, hidden)
