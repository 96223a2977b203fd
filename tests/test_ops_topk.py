"""topk_log_probs: the reference against torch (``topk`` + ``logsumexp``) and a stable-sort
oracle written here, and the Triton kernels against the reference, on fresh random inputs
(the ``seed`` fixture): ties (integer-valued logits), +-inf entries, vocabularies that are
not a multiple of the chunk, several tiles per chunk, k = 1 and k = 16, N = 0, 16-bit
inputs, strided inputs, NaN-filled fresh outputs; the wrapper's validation errors.

On a CPU-only machine the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set below before triton is imported) on small shapes.  The ``gpu``-marked tests run the real
vocabulary (49,152) and CUDA-graph capture + replay.
"""
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn's Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from specattn.ops import order_keys, registry, topk_log_probs, topk_log_probs_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 1e-5
INF = float("inf")

# the interpreter's numpy warns on the arithmetic of infinite logits (inf - inf, log(0))
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


# ------------------------------------------------------------------ inputs and the oracle
def make_logits(N, V, kind="randn", dtype=torch.float32):
    """``[N, V]`` logits of ``kind``: ``randn`` (scaled normal), ``ties`` (integers in a small
    range: many equal values; odd rows at most 0, so that the top-k are zeros of both signs),
    ``inf`` (random entries at -inf; row 0 all -inf, row 1 with two +inf, row 2 with fewer
    finite entries than 16, row 3 near -100 with its first half -inf)."""
    if kind == "ties":
        x = torch.randint(-3, 3, (N, V), device=DEV).float()
        x[1::2] = -x[1::2].abs()  # odd rows <= 0: their top-k are zeros
        zero = torch.where(torch.rand(N, V, device=DEV) < 0.5, -0.0, 0.0)
        x = torch.where(x == 0, zero, x)  # zeros of both signs
    else:
        x = torch.randn(N, V, device=DEV) * 4.0
    if kind == "inf":
        x[torch.rand(N, V, device=DEV) < 0.3] = -INF
        if N > 0:
            x[0] = -INF
        if N > 1 and V > 1:
            x[1, torch.randperm(V, device=DEV)[:2]] = INF
        if N > 2:
            x[2, torch.randperm(V, device=DEV)[:max(V - 3, 0)]] = -INF
        if N > 3:  # all -inf chunks beside a max whose exp(-max) overflows float32
            x[3] -= 100.0
            x[3, :V // 2] = -INF
    return x.to(dtype)


def oracle(logits, k):
    """Indices by a stable descending sort (ties: lower index first; -0.0 == +0.0), values
    in float64 minus a float64 logsumexp, rounded to float32."""
    x = logits.float()
    xs = torch.where(x == 0, torch.zeros_like(x), x)
    idx = torch.sort(xs, dim=-1, descending=True, stable=True).indices[:, :k]
    xd = x.double()
    return (xd.gather(1, idx) - torch.logsumexp(xd, -1, keepdim=True)).float(), idx


def assert_same(got, want, atol=ATOL, exact_values=False):
    (v, i), (wv, wi) = got, want
    assert v.dtype == torch.float32 and i.dtype == torch.int64
    assert v.shape == wv.shape and i.shape == wi.shape
    assert torch.equal(i, wi), f"indices differ:\n{i}\n{wi}"
    if exact_values:
        assert torch.equal(v.isnan(), wv.isnan()) and torch.equal(v.nan_to_num(), wv.nan_to_num())
    else:
        torch.testing.assert_close(v, wv, atol=atol, rtol=0, equal_nan=True)


# ------------------------------------------------------------------ the reference
@pytest.mark.parametrize("N,V,k", [(1, 1, 1), (3, 7, 7), (5, 100, 16), (4, 3000, 8)])
def test_reference_matches_torch(N, V, k, seed):
    x = make_logits(N, V)
    v, i = topk_log_probs(x, k, impl="reference")
    top = x.topk(k, dim=-1)
    torch.testing.assert_close(v, top.values - torch.logsumexp(x, -1, keepdim=True),
                               atol=1e-6, rtol=0)
    assert torch.equal(x.gather(1, i), top.values)
    assert_same((v, i), oracle(x, k))


@pytest.mark.parametrize("kind", ["ties", "inf"])
@pytest.mark.parametrize("N,V,k", [(4, 5, 5), (6, 40, 16), (3, 1000, 4)])
def test_reference_tie_rule_and_infinities(N, V, k, kind, seed):
    x = make_logits(N, V, kind)
    assert_same(topk_log_probs(x, k, impl="reference"), oracle(x, k))


def test_reference_special_rows():
    """The documented values: a row of only -inf gives NaN values and indices 0..k-1; a row
    with +inf has lse = +inf (NaN at the +inf entries, -inf elsewhere); -inf entries of a
    finite row rank after every finite one, by index."""
    x = torch.tensor([[-INF] * 5, [1.0, INF, 2.0, INF, -INF], [-INF, 0.0, -INF, 0.0, -INF]],
                     device=DEV)
    for impl in ("reference", "triton"):
        v, i = topk_log_probs(x, 5, impl=impl)
        assert i.tolist() == [[0, 1, 2, 3, 4], [1, 3, 2, 0, 4], [1, 3, 0, 2, 4]]
        assert v[0].isnan().all() and v[1, :2].isnan().all() and (v[1, 2:] == -INF).all()
        ln2 = torch.log(torch.tensor(2.0)).item()
        assert v[2, :2].tolist() == pytest.approx([-ln2, -ln2]) and (v[2, 2:] == -INF).all()


def test_k1_is_argmax(seed):
    for kind in ("randn", "ties"):
        x = make_logits(9, 300, kind)
        for impl in ("reference", "triton"):
            v, i = topk_log_probs(x, 1, impl=impl)
            assert torch.equal(i[:, 0], x.argmax(-1))
            torch.testing.assert_close(v[:, 0], x.max(-1).values - torch.logsumexp(x, -1),
                                       atol=ATOL, rtol=0)


# ------------------------------------------------------------------ Triton vs the reference
CASES = [  # (N, V, k): V = 1, tiny, one exact block, one past it, several chunks, a tail
    (3, 1, 1), (2, 7, 7), (5, 100, 16), (3, 2048, 8), (2, 2049, 16), (4, 5000, 3),
    (1, 50000, 16),
]


@pytest.mark.parametrize("kind", ["randn", "ties", "inf"])
@pytest.mark.parametrize("N,V,k", CASES)
def test_triton_matches_reference(N, V, k, kind, seed, nan_empty):
    x = make_logits(N, V, kind)
    ref = topk_log_probs(x, k, impl="reference")
    assert_same(topk_log_probs(x, k, impl="triton"), ref)
    assert_same(ref, oracle(x, k))
    # a second call on other inputs: nothing stale from the first
    y = make_logits(N, V, kind)
    assert_same(topk_log_probs(y, k, impl="triton"), topk_log_probs(y, k, impl="reference"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["randn", "ties", "inf"])
def test_triton_16bit(dtype, kind, seed, nan_empty):
    x = make_logits(5, 3000, kind, dtype)
    for k in (1, 16):
        assert_same(topk_log_probs(x, k, impl="triton"), topk_log_probs(x, k, impl="reference"))
        assert_same(topk_log_probs(x, k, impl="reference"), oracle(x, k))


@pytest.mark.parametrize("kind", ["randn", "ties", "inf"])
@pytest.mark.parametrize("max_block,max_chunks,V", [(64, 2, 1000), (16, 4, 333), (2048, 2, 5000)])
def test_triton_several_tiles_per_chunk(max_block, max_chunks, V, kind, seed, nan_empty,
                                        monkeypatch):
    """Small tiles and few chunks: every program merges many tiles into its candidates."""
    from specattn.triton_kernels import topk as tk
    monkeypatch.setattr(tk, "MAX_BLOCK", max_block)
    monkeypatch.setattr(tk, "MAX_CHUNKS", max_chunks)
    block, tiles, C = tk.chunk_config(V)
    assert tiles > 1 and C <= max_chunks
    x = make_logits(4, V, kind)
    for k in (1, 5, 16):
        assert_same(topk_log_probs(x, k, impl="triton"), topk_log_probs(x, k, impl="reference"))


def test_triton_large_vocab(seed):
    """262,144 columns: two tiles per chunk, 64 chunks."""
    from specattn.triton_kernels import topk as tk
    assert tk.chunk_config(262144) == (2048, 2, 64)
    x = make_logits(1, 262144)
    x[0, 100_000] = x[0, 200_000] = x.max() + 1  # a tie at the top, across chunks
    v, i = topk_log_probs(x, 16, impl="triton")
    assert i[0, :2].tolist() == [100_000, 200_000]
    assert_same((v, i), topk_log_probs(x, 16, impl="reference"))


def test_strided_inputs(seed):
    base = make_logits(6, 1001, "ties")
    for x in (base[::2], base[:, ::3], base.t().contiguous().t(), base[1:4, 7:900]):
        want = oracle(x, 8)
        for impl in ("reference", "triton"):
            assert_same(topk_log_probs(x, 8, impl=impl), want)


@pytest.mark.parametrize("impl", ["auto", "reference", "triton"])
def test_empty_batch(impl):
    for V, k in ((7, 3), (1, 1)):
        v, i = topk_log_probs(torch.empty(0, V, device=DEV), k, impl=impl)
        assert v.shape == (0, k) and v.dtype == torch.float32 and v.device.type == DEV
        assert i.shape == (0, k) and i.dtype == torch.int64 and i.device.type == DEV


def test_chunk_config():
    from specattn.triton_kernels.topk import MAX_CHUNKS, chunk_config
    assert chunk_config(49152) == (2048, 1, 24)
    assert chunk_config(1) == (16, 1, 1)
    assert chunk_config(7) == (16, 1, 1)
    for V in (1, 15, 16, 17, 2048, 2049, 49152, 50000, 131072, 131073, 262144, 10 ** 7, 2 ** 30):
        block, tiles, C = chunk_config(V)
        assert 1 <= C <= MAX_CHUNKS and (C - 1) * tiles * block < V <= C * tiles * block


# ------------------------------------------------------------------ registry and validation
def test_registry():
    assert "topk_log_probs" in registry.names()
    assert registry.availability("topk_log_probs")["reference"] is None
    assert registry.dispatch("topk_log_probs", "auto", "cpu") is topk_log_probs_reference
    if torch.cuda.is_available():
        from specattn.triton_kernels.topk import topk_log_probs as tri
        assert registry.dispatch("topk_log_probs", "auto", "cuda") is tri


def test_validation_errors():
    x = torch.randn(3, 10, device=DEV)
    for k, exc, msg in ((0, ValueError, r"k must be in \[1, min\(V, 16\)\] = \[1, 10\]"),
                        (11, ValueError, r"\[1, 10\]"), (-1, ValueError, "k must be"),
                        (1.0, TypeError, "k must be an int"), (True, TypeError, "k must be an int"),
                        (None, TypeError, "k must be an int")):
        with pytest.raises(exc, match=msg):
            topk_log_probs(x, k)
    with pytest.raises(ValueError, match=r"\[1, 16\]"):
        topk_log_probs(torch.randn(2, 100, device=DEV), 17)
    with pytest.raises(ValueError, match="logits must be 2-D"):
        topk_log_probs(torch.randn(10, device=DEV), 1)
    with pytest.raises(ValueError, match="logits must be 2-D"):
        topk_log_probs(torch.randn(2, 3, 10, device=DEV), 1)
    with pytest.raises(ValueError, match="logits must have dtype"):
        topk_log_probs(torch.randint(0, 5, (3, 10), device=DEV), 1)
    with pytest.raises(ValueError, match="1 <= V"):
        topk_log_probs(torch.empty(3, 0, device=DEV), 1)
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        topk_log_probs([[1.0, 2.0]], 1)
    with pytest.raises(ValueError, match="impl must be"):
        topk_log_probs(x, 1, impl="fast")
    for bad in (torch.bfloat16, torch.float16, torch.float64, torch.int32):   # bits of another width
        with pytest.raises(ValueError, match="x must have dtype"):
            order_keys(torch.zeros(2, 3, dtype=bad))
    with pytest.raises(ValueError, match="x must be 2-D"):
        order_keys(torch.zeros(3))


def test_triton_impl_needs_interpreter_or_gpu(monkeypatch):
    """Without TRITON_INTERPRET the Triton launcher refuses CPU tensors with a clear error."""
    from specattn.triton_kernels import topk as tk
    monkeypatch.setattr(tk, "_INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        tk.topk_log_probs(torch.randn(2, 10), 3)


# ------------------------------------------------------------------ GPU: the real vocabulary
gpu = pytest.mark.gpu
VOCAB = 49152


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("N", [1, 7, 64])
def test_gpu_real_vocab(N, k, dtype, seed, nan_empty):
    for kind in ("randn", "ties", "inf"):
        x = make_logits(N, VOCAB, kind, dtype)
        ref = topk_log_probs(x, k, impl="reference")
        assert_same(topk_log_probs(x, k, impl="triton"), ref)
        assert_same(topk_log_probs(x, k), ref)  # auto: Triton on CUDA
        assert_same(ref, oracle(x, k))


@gpu
@pytest.mark.parametrize("k", [1, 8, 16])
@pytest.mark.parametrize("N", [1, 64])
def test_gpu_cuda_graph(N, k, seed):
    """Captured in a CUDA graph (no host sync, no value-dependent shape) and replayed on new
    inputs copied into the static input: identical to an eager call."""
    x = make_logits(N, VOCAB)
    topk_log_probs(x, k)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        v, i = topk_log_probs(x, k)
    for kind in ("randn", "ties", "inf"):
        x.copy_(make_logits(N, VOCAB, kind))
        graph.replay()
        torch.cuda.synchronize()
        ev, ei = topk_log_probs(x, k, impl="triton")
        assert_same((v, i), (ev, ei), exact_values=True)
        assert_same((v, i), topk_log_probs(x, k, impl="reference"))


@gpu
def test_gpu_no_host_sync(seed):
    """The Triton path never syncs with the host (CUDA sync-debug mode 'error')."""
    x = make_logits(4, VOCAB)
    topk_log_probs(x, 8)
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        topk_log_probs(x, 8)
        topk_log_probs(x[:, ::2], 8)
    finally:
        torch.cuda.set_sync_debug_mode(old)
