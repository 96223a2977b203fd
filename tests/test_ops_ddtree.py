"""``ops.ddtree_candidates``: both implementations against the definition (every candidate is a
path of per-position top-k tokens scored by its summed log-probability, every beam one of the
``K`` best of its level), the Triton kernel equal to the reference bit for bit (ties
included), the tree it feeds, its errors, and CUDA-graph capture on a GPU.

On a CPU-only machine the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``,
set here before anything imports Triton)."""
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn's Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specattn import ops  # noqa: E402

pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _block_top(g, bs, S, K, V, ties=False):
    """Per-position top-k of random block log-probabilities (``ties``: coarse values, so
    equal sums are common)."""
    x = torch.randn(bs, S, V, generator=g)
    if ties:
        x = (x * 2).round() / 2
    lp = torch.log_softmax(x, -1)
    if ties:
        lp = (lp * 4).round() / 4
    vals, toks = lp.topk(K, -1)
    return lp, vals.contiguous(), toks.contiguous()


def _check_definition(lp, vals, toks, parent_list, scores, tokens):
    """Walk every candidate to the root; each level's beams are its K best candidates."""
    bs, S, K = vals.shape
    assert parent_list.shape == (bs, K * (S - 1) + 1) and parent_list.dtype == torch.int64
    assert scores.shape == tokens.shape == (bs, ops.num_tree_candidates(K, S))
    assert scores.dtype == torch.float32 and tokens.dtype == torch.int64
    for b in range(bs):
        assert parent_list[b, 0] == -1
        if S > 1:
            assert parent_list[b, 1:K + 1].tolist() == list(range(K))
        for f in range(scores.shape[1]):
            d = 0 if f < K else 1 + (f - K) // (K * K)
            total, node, depth = 0.0, f, d
            while True:
                tok = int(tokens[b, node])
                assert tok in toks[b, depth].tolist()
                total += float(lp[b, depth, tok])
                beam = node // K
                if beam == 0:
                    break
                node, depth = int(parent_list[b, beam]), depth - 1
            assert abs(total - float(scores[b, f])) < 1e-4
        for s in range(1, S - 1):                       # beams of level s: its K best candidates
            block = scores[b, K + (s - 1) * K * K: K + s * K * K]
            beams = parent_list[b, 1 + K + (s - 1) * K: 1 + K + s * K] - (K + (s - 1) * K * K)
            assert sorted(block[beams].tolist(), reverse=True) == block.sort(descending=True).values[:K].tolist()


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("bs,S,K", [(3, 4, 3), (2, 1, 4), (1, 2, 1), (4, 15, 4), (2, 6, 8), (1, 3, 5)])
def test_ddtree_candidates_definition(seed, impl, bs, S, K):
    g = torch.Generator().manual_seed(seed)
    for ties in (False, True):
        lp, vals, toks = _block_top(g, bs, S, K, 17, ties)
        got = ops.ddtree_candidates(vals.to(DEV), toks.to(DEV), impl=impl)
        _check_definition(lp, vals, toks, *(t.cpu() for t in got))


@pytest.mark.parametrize("bs,S,K", [(3, 4, 3), (2, 1, 4), (1, 2, 1), (5, 15, 4), (2, 7, 8), (3, 9, 6)])
def test_ddtree_candidates_triton_equals_reference(seed, bs, S, K):
    """Bit for bit, with many ties (equal sums rank by the lower column in both), int32
    tokens and a non-contiguous ``vals`` view."""
    g = torch.Generator().manual_seed(seed)
    for ties in (False, True):
        _, vals, toks = _block_top(g, bs, S, K, 13, ties)
        wide = torch.zeros(bs, S, 2 * K)
        wide[:, :, ::2] = vals
        args = (wide[:, :, ::2].to(DEV), toks.int().to(DEV))
        want = ops.ddtree_candidates(*args, impl="reference")
        got = ops.ddtree_candidates(*args, impl="triton")
        for w, o in zip(want, got):
            assert w.dtype == o.dtype and w.shape == o.shape
            assert torch.equal(w.view(torch.int32) if w.is_floating_point() else w,
                               o.view(torch.int32) if o.is_floating_point() else o), (seed, ties)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("bs,S,K", [(3, 5, 3), (2, 1, 4), (2, 7, 8)])
def test_ddtree_candidates_depth_weights(seed, impl, bs, S, K):
    """``depth_weights``: the candidates of the block's values with position ``s + 1`` scaled
    by ``depth_weights[s]`` (the definition on the scaled log-probabilities), bit for bit the
    call on pre-scaled values, and different from the unweighted call (a kernel that ignores
    the weights fails)."""
    g = torch.Generator().manual_seed(seed)
    lp, vals, toks = _block_top(g, bs, S, K, 19)
    w = torch.rand(S, generator=g) * 1.5 + 0.25
    got = ops.ddtree_candidates(vals.to(DEV), toks.to(DEV), depth_weights=w.to(DEV), impl=impl)
    _check_definition(lp * w[None, :, None], vals * w[None, :, None], toks, *(t.cpu() for t in got))
    pre = ops.ddtree_candidates((vals * w[None, :, None]).to(DEV), toks.to(DEV), impl=impl)
    for a, b in zip(got, pre):
        assert torch.equal(a, b)
    plain = ops.ddtree_candidates(vals.to(DEV), toks.to(DEV), impl=impl)
    assert not torch.equal(plain[1], got[1])
    strided = torch.zeros(2 * S)
    strided[::2] = w                                    # a non-contiguous view of the same weights
    for a, b in zip(got, ops.ddtree_candidates(vals.to(DEV), toks.to(DEV), depth_weights=strided.to(DEV)[::2],
                                               impl=impl)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_ddtree_candidates_feed_build_tree(seed, impl):
    """The best ``D - 1`` candidates form a tree: every kept node's parent is kept (the scores
    of a path only fall) and its depth is its level + 1."""
    g = torch.Generator().manual_seed(seed)
    bs, S, K, D = 3, 6, 4, 16
    _, vals, toks = _block_top(g, bs, S, K, 29)
    parent_list, scores, tokens = ops.ddtree_candidates(vals.to(DEV), toks.to(DEV), impl=impl)
    selected = scores.topk(D - 1, -1).indices.sort(-1).values
    tree = ops.build_tree(parent_list, selected, torch.tensor([3, 0, 7], device=DEV), K, S, D)
    P = torch.tensor([3, 0, 7])
    pos = tree.positions.view(bs, D).cpu()
    for b in range(bs):
        levels = [0] + [0 if c < K else 1 + (c - K) // (K * K) for c in selected[b].tolist()]
        assert pos[b].tolist() == [int(P[b]) + (lv + 1 if j else 0) for j, lv in enumerate(levels)]


def _sparse_view(path, shape, strides, dtype):
    """A view with ``strides`` into a storage of ``max offset + 1`` elements mapped (shared,
    so not counted against the memory commit) from a sparse file: only the pages of the
    elements written or read take memory."""
    n = sum((d - 1) * st for d, st in zip(shape, strides)) + 1
    with open(path, "wb") as f:
        f.truncate(n * torch.empty(0, dtype=dtype).element_size())
    return torch.from_file(str(path), shared=True, size=n, dtype=dtype).as_strided(shape, strides)


@pytest.mark.skipif(DEV != "cpu", reason="a view past 2**31 elements, mapped sparse in host memory")
@pytest.mark.parametrize("which", ["vals", "toks", "depth_weights"])
def test_ddtree_candidates_offsets_past_int32(tmp_path, seed, which):
    """Position ``s`` of an input whose position stride puts ``s * stride`` past 2**31 elements
    (a view of a large storage): the Triton kernel offsets in int64 and equals the reference
    (int32 offsets wrapped negative and read out of bounds)."""
    g = torch.Generator().manual_seed(seed)
    bs, S, K, big = 1, 3, 2, 2 ** 30 + 3
    _, vals, toks = _block_top(g, bs, S, K, 11)
    w = torch.rand(S, generator=g) + 0.5
    if which == "vals":
        vals = _sparse_view(tmp_path / "v.bin", (bs, S, K), (S * big, big, 1), torch.float32).copy_(vals)
    elif which == "toks":
        toks = _sparse_view(tmp_path / "t.bin", (bs, S, K), (S * big, big, 1), torch.int32).copy_(toks)
    else:
        w = _sparse_view(tmp_path / "w.bin", (S,), (big,), torch.float32).copy_(w)
    ref = ops.ddtree_candidates(vals, toks, depth_weights=w, impl="reference")
    got = ops.ddtree_candidates(vals, toks, depth_weights=w, impl="triton")
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_ddtree_candidates_errors():
    vals, toks = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="vals must have dtype"):
        ops.ddtree_candidates(vals.double(), toks)
    with pytest.raises(ValueError, match="toks must have shape"):
        ops.ddtree_candidates(vals, toks[:, :2])
    with pytest.raises(ValueError, match="toks must have dtype"):
        ops.ddtree_candidates(vals, toks.float())
    with pytest.raises(ValueError, match="3-D"):
        ops.ddtree_candidates(vals[0], toks[0])
    with pytest.raises(ValueError, match="at least one block position"):
        ops.ddtree_candidates(vals[:, :0], toks[:, :0])
    with pytest.raises(ValueError, match=r"K \(the last dim\)"):
        ops.ddtree_candidates(torch.zeros(2, 3, 9), torch.zeros(2, 3, 9, dtype=torch.int64))
    with pytest.raises(TypeError):
        ops.ddtree_candidates(vals.tolist(), toks)
    with pytest.raises(ValueError, match="depth_weights must have shape"):
        ops.ddtree_candidates(vals, toks, depth_weights=torch.ones(4))
    with pytest.raises(ValueError, match="depth_weights must have dtype"):
        ops.ddtree_candidates(vals, toks, depth_weights=torch.ones(3, dtype=torch.float64))


@pytest.mark.gpu
def test_ddtree_candidates_cuda_graph(seed):
    """The Triton kernel on a GPU equals the reference, and replays in a CUDA graph with new
    inputs copied into the captured ones."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(seed)
    _, vals, toks = _block_top(g, 64, 15, 4, 1000)
    vals, toks = vals.cuda(), toks.cuda()
    want = ops.ddtree_candidates(vals, toks, impl="reference")
    got = ops.ddtree_candidates(vals, toks, impl="triton")
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    weights = 0.8 ** torch.arange(15, dtype=torch.float32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.ddtree_candidates(vals, toks, impl="triton")
        out_w = ops.ddtree_candidates(vals, toks, depth_weights=weights, impl="triton")
    _, v2, t2 = _block_top(g, 64, 15, 4, 1000, ties=True)
    vals.copy_(v2.cuda())
    toks.copy_(t2.cuda())
    graph.replay()
    want = ops.ddtree_candidates(vals, toks, impl="reference")
    assert all(torch.equal(a, b) for a, b in zip(want, out))
    want = ops.ddtree_candidates(vals, toks, depth_weights=weights, impl="reference")
    assert all(torch.equal(a, b) for a, b in zip(want, out_w))
