"""``ops.gather_rows`` / ``ops.scatter_rows``: both implementations against a per-row loop
written here, on fresh random state of mixed dtypes and widths (1 element to more than one
1,024-wide block), repeated and int32 rows, every other row of the state left as it was,
an empty batch, and validation.  On a CPU-only machine the Triton kernel
runs in Triton's interpreter; the ``gpu`` test replays it from a CUDA graph.
"""
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn's Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from specattn import ops  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ("reference", "triton")


def state(n):
    """A round's kind of per-row state, ``n`` rows each: prefix lengths, roots, kept scores
    and tokens, a hidden state wider than one block, scratch rows (int32)."""
    return [torch.randint(0, 1000, (n,), device=DEV),
            torch.randint(0, 50000, (n,), device=DEV),
            torch.randn(n, 4, device=DEV),
            torch.randint(0, 50000, (n, 4), device=DEV),
            torch.randn(n, 1100, device=DEV).to(torch.bfloat16),
            torch.randint(0, 99, (n, 3, 2), device=DEV, dtype=torch.int32)]


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32], ids=str)
def test_gather_rows(impl, idx_dtype, seed):
    n = 9
    ts = state(n)
    rows = torch.tensor([3, 0, 8, 3, 5], device=DEV, dtype=idx_dtype)   # a repeat
    got = ops.gather_rows(rows, ts, impl=impl)
    for t, g in zip(ts, got):
        want = torch.stack([t[int(r)] for r in rows])
        assert same(g, want) and g.is_contiguous()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32], ids=str)
def test_scatter_rows(impl, idx_dtype, seed):
    n = 9
    dsts = state(n)
    before = [d.clone() for d in dsts]
    rows = torch.tensor([7, 1, 4], device=DEV, dtype=idx_dtype)
    srcs = [t[:3].clone() for t in state(3)]
    ops.scatter_rows(rows, list(zip(dsts, srcs)), impl=impl)
    for d, b, s in zip(dsts, before, srcs):
        want = b.clone()
        for i, r in enumerate(rows.tolist()):
            want[r] = s[i]
        assert same(d, want)       # the other rows untouched


@pytest.mark.parametrize("impl", IMPLS)
def test_scatter_repeated_row_takes_one_source(impl, seed):
    dst = torch.full((4, 5), -1.0, device=DEV)
    src = torch.randn(3, 5, device=DEV)
    ops.scatter_rows(torch.tensor([2, 2, 0], device=DEV), [(dst, src)], impl=impl)
    assert torch.equal(dst[0], src[2]) and (torch.equal(dst[2], src[0]) or torch.equal(dst[2], src[1]))
    assert (dst[[1, 3]] == -1).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch_and_eight_tensors(impl, seed):
    ts = [torch.randn(5, k + 1, device=DEV) for k in range(8)]
    rows = torch.empty(0, dtype=torch.int64, device=DEV)
    assert [tuple(g.shape) for g in ops.gather_rows(rows, ts, impl=impl)] == [(0, k + 1) for k in range(8)]
    ops.scatter_rows(rows, [(t, t[:0]) for t in ts], impl=impl)
    rows = torch.tensor([4, 0], device=DEV)
    for t, g in zip(ts, ops.gather_rows(rows, ts, impl=impl)):
        assert torch.equal(g, t[rows])


def test_validation(seed):
    ts = state(4)
    rows = torch.tensor([0, 3], device=DEV)
    with pytest.raises(IndexError, match="rows"):
        ops.gather_rows(torch.tensor([0, 4], device=DEV), ts)
    with pytest.raises(IndexError, match="rows"):
        ops.scatter_rows(torch.tensor([-1, 0], device=DEV), [(ts[0], ts[0][:2].clone())])
    with pytest.raises(ValueError, match="1 to 8"):
        ops.gather_rows(rows, [])
    with pytest.raises(ValueError, match="1 to 8"):
        ops.gather_rows(rows, ts + ts)
    with pytest.raises(ValueError, match="contiguous"):
        ops.gather_rows(rows, [ts[2].t()])
    with pytest.raises(ValueError, match="rows"):
        ops.gather_rows(rows.float(), ts)
    with pytest.raises(ValueError, match="pairs\\[0\\]"):
        ops.scatter_rows(rows, [(ts[2], torch.randn(3, 4, device=DEV))])
    with pytest.raises(ValueError, match="pairs\\[0\\]"):
        ops.scatter_rows(rows, [(ts[2], torch.randn(2, 4, device=DEV, dtype=torch.float64))])
    with pytest.raises(ValueError, match="pair"):
        ops.scatter_rows(rows, [(ts[2],)])
    with pytest.raises(TypeError):
        ops.gather_rows(rows, [3])


@pytest.mark.gpu
def test_gpu_graph_replay(seed):
    ts = state(33)
    rows = torch.randint(0, 33, (16,), device=DEV)
    ops.gather_rows(rows, ts)   # compiles outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = ops.gather_rows(rows, ts)
    rows.copy_(torch.randint(0, 33, (16,), device=DEV))
    g.replay()
    for t, o in zip(ts, outs):
        assert torch.equal(o, t[rows])
