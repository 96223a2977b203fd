"""``ops.ngram_candidates``: the reference and the Triton kernel against the definition (n-gram
drafts copied from each request's own history), its errors, and CUDA-graph capture on a GPU.

On a CPU-only machine the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``,
set here before anything imports Triton)."""
import os
import random

import torch

if not torch.cuda.is_available():  # before triton / specattn's Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specattn import ops  # noqa: E402

pytest.importorskip("triton")


def _naive_ngram(hist, P, n, K, S):
    """``(drafts [K][S], match lengths [K])`` by the definition, in plain Python."""
    root = hist[P]
    best = []
    for j in range(P):
        L = 0
        while L < n and j - L >= 0 and P - L >= 0 and hist[j - L] == hist[P - L]:
            L += 1
        if L:
            best.append((L, j))
    best.sort(reverse=True)
    out, lens = [], []
    for L, j in best[:K]:
        out.append([hist[j + 1 + s] if j + 1 + s <= P else root for s in range(S)])
        lens.append(L)
    while len(out) < K:
        out.append([root] * S)
        lens.append(0)
    return out, lens


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_ngram_candidates_match_naive(seed, impl):
    """Both implementations against the definition on fresh random histories with a small
    alphabet (many matches and ties of length), int32 and int64 prefix lengths, rows with P = 0, fewer matches than chains,
    and a history longer than one Triton tile; outputs poisoned first where possible."""
    rng = random.Random(seed)
    for W, bs in ((40, 5), (7, 3), (1500, 2)):
        hist = torch.tensor([[rng.randrange(4) for _ in range(W)] for _ in range(bs)])
        P = torch.tensor([0] + [rng.randrange(0, W) for _ in range(bs - 1)])
        for n, K, S in ((1, 1, 3), (3, 2, 4), (4, 6, 2), (2, 9, 1)):
            P = P.int() if K % 2 else P.long()   # both index dtypes
            got, L = ops.ngram_candidates(hist, P, n, K, S, impl=impl)
            assert got.shape == (bs, K, S) and L.shape == (bs, K)
            for i in range(bs):
                want, want_len = _naive_ngram(hist[i].tolist(), int(P[i]), n, K, S)
                assert got[i].tolist() == want and L[i].tolist() == want_len, (seed, W, n, K, S, i)


def test_ngram_candidates_errors():
    hist, P = torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="dtype"):
        ops.ngram_candidates(hist.int(), P, 2, 2, 2)
    with pytest.raises(ValueError, match="shape"):
        ops.ngram_candidates(hist, P[:1], 2, 2, 2)
    with pytest.raises(ValueError, match=r"topk must be an int in \[1, 32\]"):
        ops.ngram_candidates(hist, P, 2, 0, 2)
    # the limits (the kernel unrolls ngram_size and topk): one past each raises, each itself runs
    for args, name in (((ops.NGRAM_MAX_SIZE + 1, 2, 2), "ngram_size"), ((2, ops.NGRAM_MAX_TOPK + 1, 2), "topk"),
                       ((2, 2, ops.NGRAM_MAX_STEPS + 1), "num_steps")):
        with pytest.raises(ValueError, match=f"{name} must be an int in"):
            ops.ngram_candidates(hist, P, *args)
    with pytest.raises(TypeError, match="num_steps must be an int"):
        ops.ngram_candidates(hist, P, 2, 2, 2.0)
    import numpy as np      # numpy ints are ints
    ops.ngram_candidates(hist, P, np.int64(2), 2, 2, impl="reference")
    drafts, lens = ops.ngram_candidates(hist, P, ops.NGRAM_MAX_SIZE, ops.NGRAM_MAX_TOPK, ops.NGRAM_MAX_STEPS,
                                        impl="reference")
    assert drafts.shape == (2, ops.NGRAM_MAX_TOPK, ops.NGRAM_MAX_STEPS) and lens.shape == (2, ops.NGRAM_MAX_TOPK)
    with pytest.raises(IndexError, match="prefix_lens"):
        ops.ngram_candidates(hist, torch.tensor([0, 8]), 2, 2, 2)


@pytest.mark.gpu
def test_ngram_candidates_cuda_graph(seed):
    """The Triton kernel on a GPU equals the reference, and replays in a CUDA graph with new
    histories copied into the captured inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(seed)
    bs, W = 8, 3000
    hist = torch.randint(0, 6, (bs, W), generator=g).cuda()
    P = torch.randint(0, W, (bs,), generator=g).cuda()
    for n, K, S in ((4, 4, 4), (2, 8, 3)):
        want = ops.ngram_candidates(hist, P, n, K, S, impl="reference")
        got = ops.ngram_candidates(hist, P, n, K, S, impl="triton")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ops.ngram_candidates(hist, P, 4, 4, 4, check_values=False, impl="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.ngram_candidates(hist, P, 4, 4, 4, check_values=False, impl="triton")
    hist.copy_(torch.randint(0, 6, (bs, W), generator=g).cuda())
    P.copy_(torch.randint(0, W, (bs,), generator=g).cuda())
    graph.replay()
    want = ops.ngram_candidates(hist, P, 4, 4, 4, impl="reference")
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
