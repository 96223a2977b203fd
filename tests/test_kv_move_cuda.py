"""torch.ops.specattn.move_kv_cache (csrc/kv_move.cu) against move_kv_cache_reference,
bit for bit.  Needs a GPU and the built extension specattn._C."""
import pytest
import torch

from specattn import _ext
from specattn.ops import move_kv_cache, move_kv_cache_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _ext.EXT_AVAILABLE, reason=f"specattn._C missing: {_ext.EXT_MISSING_REASON}"),
]

DEV = "cuda"


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _buffers(num_buffers, num_slots, row_shape, dtype, gen):
    bufs = []
    for _ in range(num_buffers):
        raw = torch.randint(0, 256, (num_slots, *row_shape, torch.empty((), dtype=dtype).element_size()),
                            generator=gen, dtype=torch.uint8, device="cpu")
        b = raw.view(dtype).view(num_slots, *row_shape).to(DEV)  # random bits, NaNs included
        bufs.append(b)
    return bufs


def _accepted_path_moves(num_slots, num_reqs, block, gen):
    """Per request a block of slots; the accepted path (random kept positions, in order)
    moves to the front of its own block: targets and sources overlap, tgt[i] <= src[i]."""
    tgt, src = [], []
    starts = torch.randperm(num_slots // block, generator=gen)[:num_reqs] * block
    for s in starts.tolist():
        k = int(torch.randint(0, block + 1, (1,), generator=gen))
        kept = torch.sort(torch.randperm(block, generator=gen)[:k]).values + s
        tgt += list(range(s, s + k))
        src += kept.tolist()
    return tgt, src


def _check(bufs, tgt, src, idx_dtype, impl="cuda", src_dtype=None):
    expected = [b.clone() for b in bufs]
    t = torch.tensor(tgt, dtype=idx_dtype, device=DEV)
    s = torch.tensor(src, dtype=src_dtype or idx_dtype, device=DEV)
    move_kv_cache_reference(expected, t, s)
    move_kv_cache(bufs, t, s, impl=impl)
    torch.cuda.synchronize()
    for i, (got, exp) in enumerate(zip(bufs, expected)):
        assert torch.equal(_bits(got), _bits(exp)), f"buffer {i} differs"


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("row_shape", [(576,), (8, 128)], ids=["mla576", "mha8x128"])
def test_accepted_path_overlap(idx_dtype, dtype, row_shape, seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = _buffers(6, 512, row_shape, dtype, gen)
    tgt, src = _accepted_path_moves(512, 20, 16, gen)
    _check(bufs, tgt, src, idx_dtype)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_random_overlapping_permutation(idx_dtype, seed):
    """Targets and sources drawn from the same small set: chains and cycles of moves."""
    gen = torch.Generator().manual_seed(seed)
    bufs = _buffers(4, 300, (8, 128), torch.bfloat16, gen)
    pool = torch.randperm(300, generator=gen)[:150]
    tgt = pool[:100].tolist()
    src = pool[torch.randint(0, 150, (100,), generator=gen)].tolist()  # src may repeat
    _check(bufs, tgt, src, idx_dtype)


def test_cycle_swap():
    bufs = [torch.arange(40, dtype=torch.float32, device=DEV).view(10, 4)]
    _check(bufs, [0, 1, 2, 3], [1, 2, 3, 0], torch.int64)
    _check(bufs, [5, 6], [6, 5], torch.int32)


def test_poisoned_untouched_slots_stay():
    gen = torch.Generator().manual_seed(1)
    bufs = [torch.full((64, 8, 128), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(3)]
    for b in bufs:
        b[:32] = torch.randn(32, 8, 128, generator=gen).to(DEV, torch.bfloat16)
    before = [b.clone() for b in bufs]
    tgt, src = [40, 41, 42, 10], [0, 1, 2, 11]
    _check(bufs, tgt, src, torch.int64)
    untouched = [i for i in range(64) if i not in tgt]
    for b, old in zip(bufs, before):
        assert torch.equal(_bits(b[untouched]), _bits(old[untouched]))
        assert not b[tgt].isnan().any()


def test_empty_moves_nothing():
    bufs = [torch.randn(16, 576, device=DEV)]
    before = bufs[0].clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEV)
    torch.ops.specattn.move_kv_cache(bufs, empty, empty)
    move_kv_cache(bufs, empty, empty, impl="cuda")
    torch.cuda.synchronize()
    assert torch.equal(bufs[0], before)


def test_mixed_index_dtypes_and_tgt_equals_src(seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = _buffers(2, 128, (576,), torch.bfloat16, gen)
    _check(bufs, [0, 1, 2, 3, 50], [0, 5, 2, 9, 1], torch.int32, src_dtype=torch.int64)


@pytest.mark.parametrize("row_shape,dtype", [((3,), torch.float16), ((5,), torch.uint8),
                                             ((2, 3), torch.float32), ((1,), torch.float64),
                                             ((576,), torch.float8_e4m3fn)])
def test_narrow_rows_use_fallback_widths(row_shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = _buffers(3, 200, row_shape, dtype, gen)
    tgt, src = _accepted_path_moves(200, 10, 10, gen)
    _check(bufs, tgt, src, torch.int64)


def test_mixed_row_widths_in_one_call(seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = (_buffers(2, 100, (8, 128), torch.bfloat16, gen) + _buffers(2, 100, (576,), torch.bfloat16, gen)
            + _buffers(1, 100, (7,), torch.uint8, gen))
    tgt, src = _accepted_path_moves(100, 6, 10, gen)
    _check(bufs, tgt, src, torch.int32)


def test_many_buffers_chunked(seed):
    """More than 128 buffers (one launch's pointer table) -> several chunks."""
    gen = torch.Generator().manual_seed(seed)
    bufs = _buffers(300, 64, (4, 16), torch.bfloat16, gen)
    tgt, src = _accepted_path_moves(64, 4, 16, gen)
    _check(bufs, tgt, src, torch.int64)


def test_large_staging_chunked(seed):
    """More than 64 MiB of staging -> chunks reuse the staging area."""
    gen = torch.Generator().manual_seed(seed)
    bufs = [torch.randn(4096, 8192, device=DEV) for _ in range(3)]  # 32 KiB rows
    tgt, src = _accepted_path_moves(4096, 200, 16, gen)
    while len(tgt) < 2100:  # >= 2100 rows * 32 KiB = 66 MiB per buffer
        more_t, more_s = _accepted_path_moves(4096, 200, 16, gen)
        used = set(tgt)
        pairs = [(a, b) for a, b in zip(more_t, more_s) if a not in used]
        tgt += [a for a, _ in pairs]
        src += [b for _, b in pairs]
    _check(bufs, tgt, src, torch.int64)


def test_unaligned_views_fall_back():
    """A buffer whose base is not 16-byte aligned (a contiguous slice of a bigger one)."""
    big = torch.randn(1 + 64 * 6, device=DEV)
    buf = big[1:].view(64, 6)  # 4-byte aligned base, 24-byte rows
    _check([buf], [0, 1, 2], [3, 0, 1], torch.int64)


def test_current_stream_is_used():
    s = torch.cuda.Stream()
    bufs = [torch.randn(1000, 8, 128, device=DEV)]
    expected = [bufs[0].clone()]
    t = torch.arange(0, 500, device=DEV)
    src = torch.arange(500, 1000, device=DEV)
    move_kv_cache_reference(expected, t, src)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.specattn.move_kv_cache(bufs, t, src)
        got = bufs[0].clone()  # ordered after the op on the same stream
    torch.cuda.synchronize()
    assert torch.equal(got, expected[0])


def test_cuda_graph_capture_and_replay(seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = _buffers(4, 256, (8, 128), torch.bfloat16, gen)
    n = 32
    t = torch.zeros(n, dtype=torch.int64, device=DEV)
    s = torch.zeros(n, dtype=torch.int64, device=DEV)
    t.copy_(torch.arange(n))
    s.copy_(torch.arange(n))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ops.specattn.move_kv_cache(bufs, t, s)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        move_kv_cache(bufs, t, s, impl="cuda")
    for _ in range(3):
        tgt, src = _accepted_path_moves(192, 4, 16, gen)  # slots < 192; pad: tgt == src
        tgt, src = (tgt + list(range(200, 256)))[:n], (src + list(range(200, 256)))[:n]
        t.copy_(torch.tensor(tgt))
        s.copy_(torch.tensor(src))
        expected = [b.clone() for b in bufs]
        move_kv_cache_reference(expected, t, s)
        g.replay()
        torch.cuda.synchronize()
        for got, exp in zip(bufs, expected):
            assert torch.equal(_bits(got), _bits(exp))


def test_raw_op_host_checks():
    op = torch.ops.specattn.move_kv_cache
    idx = torch.arange(2, device=DEV)
    with pytest.raises(RuntimeError, match="contiguous"):
        op([torch.randn(8, 4, device=DEV).t()], idx, idx)
    with pytest.raises(RuntimeError, match="slots"):
        op([torch.randn(8, 4, device=DEV), torch.randn(9, 4, device=DEV)], idx, idx)
    with pytest.raises(RuntimeError, match="int32 or int64"):
        op([torch.randn(8, 4, device=DEV)], idx.float(), idx)
    with pytest.raises(RuntimeError, match="entries"):
        op([torch.randn(8, 4, device=DEV)], idx, idx[:1])
    with pytest.raises(RuntimeError, match="tgt_loc is on cpu"):
        op([torch.randn(8, 4, device=DEV)], idx.cpu(), idx)


def test_auto_picks_cuda():
    from specattn.ops import registry
    assert registry.availability("move_kv_cache")["cuda"] is None
    fn = registry.dispatch("move_kv_cache", "auto", torch.device(DEV))
    assert fn.__name__ == "move_kv_cache_cuda"
