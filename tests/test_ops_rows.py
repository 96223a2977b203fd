"""``ops.gather_rows`` / ``ops.scatter_rows`` / ``ops.extend_cache_locs`` /
``ops.commit_accepted``: both implementations against a per-row loop
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

from scenarios import strided_view as strided  # noqa: E402
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


def _rtt(R, W):
    """A ``req_to_token`` of distinct random slots per row (int32)."""
    return torch.randperm(R * W, device=DEV).view(R, W).to(torch.int32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("n", [1, 5, 16, 1100])
def test_extend_cache_locs(impl, idx_dtype, n, seed):
    R, W = 7, 1200
    rtt = _rtt(R, W)
    prefix = torch.randint(0, W - n + 1, (R,), device=DEV, dtype=idx_dtype)
    roots = torch.randint(0, 50000, (R,), device=DEV, dtype=idx_dtype)
    rows = torch.tensor([4, 0, 6, 4], device=DEV, dtype=idx_dtype)   # a repeat
    fill = 1 if n % 2 else 16   # (an int argument of 1 reaches a Triton kernel as a constexpr)
    got = ops.extend_cache_locs(rows, prefix, rtt, n, roots=roots, fill_id=fill, impl=impl)
    for i, r in enumerate(rows.tolist()):
        P = int(prefix[r])
        assert int(got.seq_lens[i]) == P
        assert got.positions[i * n:(i + 1) * n].tolist() == list(range(P, P + n))
        assert got.out_cache_loc[i * n:(i + 1) * n].tolist() == rtt[r, P:P + n].tolist()
        assert got.input_ids[i].tolist() == [int(roots[r])] + [fill] * (n - 1)
    assert got.seq_lens.dtype == torch.int32 and got.positions.dtype == torch.int64
    assert got.out_cache_loc.dtype == torch.int64 and got.input_ids.dtype == torch.int64
    assert ops.extend_cache_locs(rows, prefix, rtt, n, impl=impl).input_ids is None


def test_extend_cache_locs_validation():
    rtt = _rtt(3, 8)
    prefix = torch.tensor([0, 4, 7], device=DEV)
    rows = torch.tensor([0, 1], device=DEV)
    with pytest.raises(IndexError, match="prefix_lens"):
        ops.extend_cache_locs(rows, prefix, rtt, 5)         # row 1: 4 + 5 > 8
    with pytest.raises(IndexError, match="rows"):
        ops.extend_cache_locs(torch.tensor([3], device=DEV), prefix, rtt, 1)
    with pytest.raises(ValueError, match="n must be"):
        ops.extend_cache_locs(rows, prefix, rtt, 0)
    with pytest.raises(ValueError, match="contiguous rows"):
        ops.extend_cache_locs(rows, prefix, rtt.t(), 1)
    with pytest.raises(ValueError):
        ops.extend_cache_locs(rows, prefix.float(), rtt, 1)
    assert ops.extend_cache_locs(rows[:0], prefix, rtt, 3).positions.numel() == 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("n", [1, 4, 16])
def test_commit_accepted(impl, idx_dtype, n, seed):
    R, bs, W = 9, 3, n + 3
    prefix = torch.randint(0, 500, (R,), device=DEV)
    roots = torch.randint(0, 50000, (R,), device=DEV)
    before_p, before_r = prefix.clone(), roots.clone()
    rows = torch.tensor([5, 0, 8], device=DEV, dtype=idx_dtype)
    seq = torch.randint(0, 500, (bs,), device=DEV, dtype=idx_dtype)
    path = torch.randint(0, 50000, (bs, n), device=DEV, dtype=idx_dtype)
    acc = torch.randint(0, n, (bs,), device=DEV, dtype=idx_dtype)
    acc[0] = n - 1   # the edges: every draft accepted, and none
    acc[-1] = 0
    emitted = torch.full((bs, 1 + W), -7, dtype=torch.int64, device=DEV)   # poisoned
    ops.commit_accepted(rows, prefix, roots, seq, path, acc, emitted, impl=impl)
    for i, r in enumerate(rows.tolist()):
        a = int(acc[i])
        assert emitted[i, 0] == a + 1 and emitted[i, 1:1 + n].tolist() == path[i].tolist()
        assert emitted[i, 1 + n:].tolist() == [-7] * (W - n)      # past the path: untouched
        assert int(roots[r]) == int(path[i, a]) and int(prefix[r]) == int(seq[i]) + a + 1
    others = [r for r in range(R) if r not in rows.tolist()]
    assert torch.equal(prefix[others], before_p[others]) and torch.equal(roots[others], before_r[others])


def test_commit_accepted_validation():
    prefix, roots = torch.zeros(4, dtype=torch.int64, device=DEV), torch.zeros(4, dtype=torch.int64, device=DEV)
    rows, seq = torch.tensor([0, 1], device=DEV), torch.zeros(2, dtype=torch.int64, device=DEV)
    path, emitted = torch.zeros(2, 3, dtype=torch.int64, device=DEV), torch.zeros(2, 4, dtype=torch.int64, device=DEV)
    with pytest.raises(IndexError, match="accept_length"):
        ops.commit_accepted(rows, prefix, roots, seq, path, torch.tensor([0, 3], device=DEV), emitted)
    with pytest.raises(IndexError, match="rows"):
        ops.commit_accepted(torch.tensor([0, 4], device=DEV), prefix, roots, seq, path,
                            torch.zeros(2, dtype=torch.int64, device=DEV), emitted)
    with pytest.raises(ValueError, match="emitted"):
        ops.commit_accepted(rows, prefix, roots, seq, path, torch.zeros(2, dtype=torch.int64, device=DEV),
                            emitted[:, :3])
    with pytest.raises(ValueError, match="path"):
        ops.commit_accepted(rows, prefix, roots, seq, path.t().contiguous().t(), torch.zeros(2, dtype=torch.int64,
                                                                                             device=DEV), emitted)
    before = prefix.clone()
    with pytest.raises(IndexError, match="seq_lens"):      # a negative committed length
        ops.commit_accepted(rows, prefix, roots, torch.tensor([0, -5], device=DEV), path,
                            torch.zeros(2, dtype=torch.int64, device=DEV), emitted)
    assert torch.equal(prefix, before)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_index_inputs(impl, seed):
    """1-D index and per-request inputs of any stride give what their contiguous copies give
    (rows, prefix lengths and roots read by ``extend_cache_locs``, rows / seq_lens /
    accept_length of ``commit_accepted``); the state ``commit_accepted`` writes must be
    contiguous."""
    R, W, n = 6, 40, 3
    ts = state(R)
    rows = torch.randperm(R, device=DEV)[:4]
    want = ops.gather_rows(rows, ts, impl="reference")
    for g, w in zip(ops.gather_rows(strided(rows), ts, impl=impl), want):
        assert same(g, w)
    dst, src = torch.zeros(R, 5, device=DEV), torch.randn(4, 5, device=DEV)
    ops.scatter_rows(strided(rows), [(dst, src)], impl=impl)
    assert torch.equal(dst[rows], src) and dst[[r for r in range(R) if r not in rows.tolist()]].abs().sum() == 0
    rtt = _rtt(R, W)
    prefix = torch.randint(0, W - n, (R,), device=DEV)
    roots = torch.randint(0, 50000, (R,), device=DEV)
    got = ops.extend_cache_locs(strided(rows), strided(prefix), rtt, n, roots=strided(roots), impl=impl)
    ref = ops.extend_cache_locs(rows, prefix, rtt, n, roots=roots, impl="reference")
    for g, w in zip(got, ref):
        assert same(g, w)
    bs = rows.shape[0]
    seq = torch.randint(0, 500, (bs,), device=DEV)
    path = torch.randint(0, 50000, (bs, n), device=DEV)
    acc = torch.randint(0, n, (bs,), device=DEV)
    outs = []
    for r, sq, ac in ((rows, seq, acc), (strided(rows), strided(seq), strided(acc))):
        p, rt = prefix.clone(), roots.clone()
        emitted = torch.full((bs, 1 + n), -7, dtype=torch.int64, device=DEV)
        ops.commit_accepted(r, p, rt, sq, path, ac, emitted, impl=impl)
        outs.append((p, rt, emitted))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    for name in ("prefix_lens", "roots"):
        p, rt = strided(prefix), strided(roots)
        with pytest.raises(ValueError, match=f"{name} must be contiguous"):
            ops.commit_accepted(rows, p if name == "prefix_lens" else prefix, rt if name == "roots" else roots,
                                seq, path, acc, torch.zeros(bs, 1 + n, dtype=torch.int64, device=DEV), impl=impl)


def test_commit_accepted_int32_state_overflow():
    """An int32 ``prefix_lens`` / ``roots`` state raises instead of wrapping a new prefix
    length or root it cannot hold; at the int32 edge it takes it."""
    rows, acc = torch.tensor([0], device=DEV), torch.tensor([1], device=DEV)
    emitted = torch.zeros(1, 3, dtype=torch.int64, device=DEV)
    for seq, path, what in (([2**31 - 2], [[5, 6]], "seq_lens"), ([3], [[5, 2**31]], "path")):
        p, rt = torch.zeros(2, dtype=torch.int32, device=DEV), torch.zeros(2, dtype=torch.int32, device=DEV)
        with pytest.raises(IndexError, match=what):
            ops.commit_accepted(rows, p, rt, torch.tensor(seq, device=DEV), torch.tensor(path, device=DEV), acc,
                                emitted)
        assert p.tolist() == [0, 0] and rt.tolist() == [0, 0]          # nothing written
    p, rt = torch.zeros(2, dtype=torch.int32, device=DEV), torch.zeros(2, dtype=torch.int32, device=DEV)
    ops.commit_accepted(rows, p, rt, torch.tensor([2**31 - 3], device=DEV), torch.tensor([[5, 2**31 - 1]], device=DEV),
                        acc, emitted)
    assert p.tolist() == [2**31 - 1, 0] and rt.tolist() == [2**31 - 1, 0]


@pytest.mark.gpu
def test_gpu_round_ops_graph_replay(seed):
    """``extend_cache_locs`` and ``commit_accepted`` captured once, replayed on new rows,
    prefix lengths and paths: the replay matches the references."""
    R, W, n = 9, 64, 6
    rtt, prefix = _rtt(R, W), torch.randint(0, W - n, (R,), device=DEV)
    roots = torch.randint(0, 50000, (R,), device=DEV)
    rows = torch.randperm(R, device=DEV)[:4]
    path = torch.randint(0, 50000, (4, n), device=DEV, dtype=torch.int32)
    acc = torch.randint(0, n, (4,), device=DEV, dtype=torch.int32)
    emitted = torch.zeros(4, 1 + n, dtype=torch.int64, device=DEV)
    ops.extend_cache_locs(rows, prefix, rtt, n, roots=roots, fill_id=3)   # compiles outside the capture
    ops.commit_accepted(rows, prefix.clone(), roots.clone(), prefix[rows], path, acc, emitted.clone())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = ops.extend_cache_locs(rows, prefix, rtt, n, roots=roots, fill_id=3)
        ops.commit_accepted(rows, prefix, roots, got.seq_lens, path, acc, emitted)
    rows.copy_(torch.randperm(R, device=DEV)[:4])
    prefix.copy_(torch.randint(0, W - n, (R,), device=DEV))
    path.copy_(torch.randint(0, 50000, (4, n), device=DEV, dtype=torch.int32))
    acc.copy_(torch.randint(0, n, (4,), device=DEV, dtype=torch.int32))
    p0, r0 = prefix.clone(), roots.clone()
    want = ops.extend_cache_locs(rows, p0, rtt, n, roots=r0, fill_id=3, impl="reference")
    want_e = torch.zeros_like(emitted)
    ops.commit_accepted(rows, p0, r0, want.seq_lens, path, acc, want_e, impl="reference")
    g.replay()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(emitted, want_e) and torch.equal(prefix, p0) and torch.equal(roots, r0)
