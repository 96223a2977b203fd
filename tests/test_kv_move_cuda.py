"""torch.ops.specattn.move_kv_cache (csrc/kv_move.cu) against move_kv_cache_reference,
bit for bit, staged (group_size=0 / None) and direct one-launch (group_size=G) paths.
Needs a GPU and the built extension specattn._C.

``test_sanitizer_smoke`` is the quick case for compute-sanitizer:
    compute-sanitizer --tool memcheck python -m pytest tests/test_kv_move_cuda.py -q -k sanitizer_smoke
    compute-sanitizer --tool racecheck python -m pytest tests/test_kv_move_cuda.py -q -k sanitizer_smoke"""
import pytest
import torch

from specattn import _ext
from kv_cases import bits, random_buffers, replay_matches_reference
from specattn.ops import move_kv_cache, move_kv_cache_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _ext.EXT_AVAILABLE, reason=f"specattn._C missing: {_ext.EXT_MISSING_REASON}"),
]

DEV = "cuda"


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


def _grouped_moves(num_slots, num_reqs, block, gen):
    """``_accepted_path_moves`` padded to whole blocks with identity pairs, as
    compact_accepted_path makes them: request r's pairs are ``[r*block, (r+1)*block)`` and
    touch only its own block of slots, so ``group_size=block`` is a true promise."""
    tgt, src = [], []
    starts = torch.randperm(num_slots // block, generator=gen)[:num_reqs] * block
    for s in starts.tolist():
        k = int(torch.randint(0, block + 1, (1,), generator=gen))
        kept = torch.sort(torch.randperm(block, generator=gen)[:k]).values + s
        tgt += list(range(s, s + block))
        src += kept.tolist() + list(range(s + k, s + block))
    return tgt, src


def _group_cycles(num_slots, num_groups, group, gen):
    """Each group of ``group`` pairs permutes ``group`` random slots of its own: chains and
    cycles inside a group (not safe front-to-back), nothing across groups."""
    slots = torch.randperm(num_slots, generator=gen)[:num_groups * group].view(num_groups, group)
    tgt, src = [], []
    for g in range(num_groups):
        tgt += slots[g].tolist()
        src += slots[g, torch.randperm(group, generator=gen)].tolist()
    return tgt, src


def _disjoint_moves(num_slots, n, gen):
    perm = torch.randperm(num_slots, generator=gen)[:2 * n]
    return perm[:n].tolist(), perm[n:].tolist()


def _check(bufs, tgt, src, idx_dtype, impl="cuda", src_dtype=None, group_size=None, raw=False,
           poison=False):
    """``raw``: call torch.ops.specattn.move_kv_cache directly (0 = staged when
    ``group_size`` is None), else the checked wrapper.  ``poison``: first fill the target
    slots that no pair reads with NaN bits (in the copy used for ``expected`` too)."""
    t = torch.tensor(tgt, dtype=idx_dtype, device=DEV)
    s = torch.tensor(src, dtype=src_dtype or idx_dtype, device=DEV)
    if poison and t.numel():
        dest = t[(t != s) & ~torch.isin(t, s)].long()
        for b in bufs:
            b.view(torch.uint8).view(b.shape[0], -1)[dest] = 0xFF
    expected = [b.clone() for b in bufs]
    move_kv_cache_reference(expected, t, s)
    if raw:
        torch.ops.specattn.move_kv_cache(bufs, t, s, group_size or 0)
    else:
        move_kv_cache(bufs, t, s, impl=impl, group_size=group_size)
    torch.cuda.synchronize()
    for i, (got, exp) in enumerate(zip(bufs, expected)):
        assert torch.equal(bits(got), bits(exp)), f"buffer {i} differs"


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("row_shape", [(576,), (8, 128)], ids=["mla576", "mha8x128"])
def test_accepted_path_overlap(idx_dtype, dtype, row_shape, seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(6, 512, row_shape, dtype, gen, device=DEV)
    tgt, src = _accepted_path_moves(512, 20, 16, gen)
    _check(bufs, tgt, src, idx_dtype)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_random_overlapping_permutation(idx_dtype, seed):
    """Targets and sources drawn from the same small set: chains and cycles of moves."""
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(4, 300, (8, 128), torch.bfloat16, gen, device=DEV)
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
        assert torch.equal(bits(b[untouched]), bits(old[untouched]))
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
    bufs = random_buffers(2, 128, (576,), torch.bfloat16, gen, device=DEV)
    _check(bufs, [0, 1, 2, 3, 50], [0, 5, 2, 9, 1], torch.int32, src_dtype=torch.int64)


@pytest.mark.parametrize("row_shape,dtype", [((3,), torch.float16), ((5,), torch.uint8),
                                             ((2, 3), torch.float32), ((1,), torch.float64),
                                             ((576,), torch.float8_e4m3fn)])
def test_narrow_rows_use_fallback_widths(row_shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(3, 200, row_shape, dtype, gen, device=DEV)
    tgt, src = _accepted_path_moves(200, 10, 10, gen)
    _check(bufs, tgt, src, torch.int64)


def test_mixed_row_widths_in_one_call(seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = (random_buffers(2, 100, (8, 128), torch.bfloat16, gen, device=DEV)
            + random_buffers(2, 100, (576,), torch.bfloat16, gen, device=DEV)
            + random_buffers(1, 100, (7,), torch.uint8, gen, device=DEV))
    tgt, src = _accepted_path_moves(100, 6, 10, gen)
    _check(bufs, tgt, src, torch.int32)


def test_many_buffers_chunked(seed):
    """More than 128 buffers (one launch's pointer table) -> several chunks."""
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(300, 64, (4, 16), torch.bfloat16, gen, device=DEV)
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
    bufs = random_buffers(4, 256, (8, 128), torch.bfloat16, gen, device=DEV)
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
        replay_matches_reference(g, bufs, t, s, tgt, src)


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


# --------------------------------------------------------------------------- direct path
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("row_shape", [(576,), (8, 128)], ids=["mla576", "mha8x128"])
@pytest.mark.parametrize("block", [4, 8, 16, 64])
def test_grouped_accepted_path_overlap(block, row_shape, dtype, idx_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(6, 1024, row_shape, dtype, gen, device=DEV)
    tgt, src = _grouped_moves(1024, 12, block, gen)
    _check(bufs, tgt, src, idx_dtype, group_size=block, poison=True)
    tgt, src = _grouped_moves(1024, 12, block, gen)
    _check(bufs, tgt, src, idx_dtype, group_size=block, raw=True)  # the op itself, unchecked


@pytest.mark.parametrize("row_shape,dtype", [((576,), torch.bfloat16), ((8, 128), torch.bfloat16),
                                             ((1, 4096), torch.float32), ((5,), torch.uint8)],
                         ids=["mla576", "mha8x128", "16KiB", "odd5B"])
@pytest.mark.parametrize("group", [2, 3, 6, 16, 64, 200, 1024, 1500])
def test_grouped_cycles_all_tilings(group, row_shape, dtype, seed):
    """Permutations inside each group, group sizes that give every tiling (whole rows,
    column tiles, one vector per row at 1024) and the staged fallback above 1024."""
    gen = torch.Generator().manual_seed(seed)
    num_groups = max(1, 3000 // group)
    slots = num_groups * group + 7
    bufs = random_buffers(3, slots, row_shape, dtype, gen, device=DEV)
    tgt, src = _group_cycles(slots, num_groups, group, gen)
    _check(bufs, tgt, src, torch.int64, group_size=group)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("row_shape", [(576,), (8, 128)], ids=["mla576", "mha8x128"])
def test_grouped_disjoint_group1(row_shape, idx_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(5, 4096, row_shape, torch.bfloat16, gen, device=DEV)
    tgt, src = _disjoint_moves(4096, 1500, gen)
    _check(bufs, tgt, src, idx_dtype, group_size=1, poison=True)
    tgt, src = _disjoint_moves(4096, 777, gen)
    _check(bufs, tgt, src, idx_dtype, group_size=None, poison=True)  # eager: detected disjoint


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_grouped_pools_page_sizes(kind, page_size, seed):
    """Pools of page size 1 and 64 (real row widths): whole pages moved onto other pages
    (aligned), and requests whose slots start mid-page (unaligned), through the pool."""
    from specattn.backends.pools import MHATokenToKVPool, MLATokenToKVPool
    gen = torch.Generator().manual_seed(seed)
    size = 64 * 32
    pool = (MHATokenToKVPool(size, page_size, torch.bfloat16, 8, 128, 3, device=DEV)
            if kind == "mha" else MLATokenToKVPool(size, page_size, torch.bfloat16, 4, device=DEV))
    for b in pool.buffers:
        b.copy_(random_buffers(1, b.shape[0], b.shape[1:], b.dtype, gen, device=DEV)[0])
    ps, D = page_size, 16
    if ps == 64:
        pages = (torch.randperm(30, generator=gen)[:8] + 1).tolist()
        tgt, src = [], []
        for a, b in zip(pages[0::2], pages[1::2]):  # page b -> page a, one group per page
            tgt += range(a * ps, (a + 1) * ps)
            src += range(b * ps, (b + 1) * ps)
        aligned = (tgt, src, ps)
        starts = [p * ps + 24 for p in (torch.randperm(30, generator=gen)[:6] + 1).tolist()]
    else:
        aligned = None
        starts = (torch.randperm(size // D - 1, generator=gen)[:6] * D + 1 + 5).tolist()
    tgt, src = [], []
    for s0 in starts:  # blocks of D slots starting mid-page (unaligned)
        k = int(torch.randint(0, D + 1, (1,), generator=gen))
        kept = torch.sort(torch.randperm(D, generator=gen)[:k]).values + s0
        tgt += range(s0, s0 + D)
        src += kept.tolist() + list(range(s0 + k, s0 + D))
    for t_, s_, g in ([aligned] if aligned else []) + [(tgt, src, D)]:
        for gs in (g, None):
            expected = [b.clone() for b in pool.buffers]
            t, s = torch.tensor(t_, device=DEV), torch.tensor(s_, device=DEV)
            move_kv_cache_reference(expected, t, s)
            pool.move_kv_cache(t, s, impl="cuda", group_size=gs)
            torch.cuda.synchronize()
            for got, exp in zip(pool.buffers, expected):
                assert torch.equal(bits(got), bits(exp))


def test_grouped_identity_pairs_padding_and_mixed_dtypes(seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(4, 256, (576,), torch.bfloat16, gen, device=DEV)
    # two requests of D=4, then two padded requests whose pairs all sit on slot 0
    tgt = [8, 9, 10, 11, 20, 21, 22, 23] + [0] * 8
    src = [9, 11, 10, 11, 20, 22, 22, 23] + [0] * 8
    _check(bufs, tgt, src, torch.int32, src_dtype=torch.int64, group_size=4)
    _check(bufs, tgt, src, torch.int64, group_size=4, raw=True)
    _check(bufs, [5, 6, 7], [5, 6, 7], torch.int32, group_size=1)  # identity only: no-op


def test_grouped_empty_moves():
    bufs = [torch.randn(16, 576, device=DEV)]
    before = bufs[0].clone()
    for dt in (torch.int32, torch.int64):
        empty = torch.empty(0, dtype=dt, device=DEV)
        torch.ops.specattn.move_kv_cache(bufs, empty, empty, 1)
        torch.ops.specattn.move_kv_cache(bufs, empty, empty, 16)
        move_kv_cache(bufs, empty, empty, impl="cuda", group_size=8)
    torch.cuda.synchronize()
    assert torch.equal(bufs[0], before)


def test_grouped_violated_promise_raises_before_any_write(seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(2, 64, (576,), torch.bfloat16, gen, device=DEV)
    before = [b.clone() for b in bufs]
    t = torch.tensor([1, 2, 6, 7], device=DEV)
    s = torch.tensor([2, 6, 9, 10], device=DEV)  # pair 1 (group 0) reads 6, pair 2 (group 1) writes it
    with pytest.raises(ValueError, match="promise"):
        move_kv_cache(bufs, t, s, impl="cuda", group_size=2)
    with pytest.raises(ValueError, match="promise"):
        move_kv_cache(bufs, t, s, impl="cuda", group_size=1)
    torch.cuda.synchronize()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(bufs, before))
    with pytest.raises(RuntimeError, match="group_size"):
        torch.ops.specattn.move_kv_cache(bufs, t, s, -1)
    _check(bufs, t.tolist(), s.tolist(), torch.int64, group_size=4)  # one group: fine


def test_grouped_many_buffers_and_mixed_widths(seed):
    """More than 128 buffers (chunks, one launch each) and rows of several widths in one
    launch (blocks past a narrow buffer's tile count exit)."""
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(300, 128, (4, 16), torch.bfloat16, gen, device=DEV)
    tgt, src = _grouped_moves(128, 6, 16, gen)
    _check(bufs, tgt, src, torch.int64, group_size=16)
    bufs = (random_buffers(2, 512, (8, 128), torch.bfloat16, gen, device=DEV)
            + random_buffers(2, 512, (576,), torch.bfloat16, gen, device=DEV)
            + random_buffers(1, 512, (16,), torch.bfloat16, gen, device=DEV)
            + random_buffers(1, 512, (2, 4096), torch.float32, gen, device=DEV))
    tgt, src = _group_cycles(512, 40, 8, gen)
    _check(bufs, tgt, src, torch.int32, group_size=8)


def test_grouped_cuda_graph_capture_and_replay(seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(61, 512, (576,), torch.bfloat16, gen, device=DEV)
    bs, D = 4, 16
    t = torch.zeros(bs * D, dtype=torch.int64, device=DEV)
    s = torch.zeros(bs * D, dtype=torch.int64, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        move_kv_cache(bufs, t, s, impl="cuda", group_size=D)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        move_kv_cache(bufs, t, s, impl="cuda", group_size=D)
    for i in range(4):
        tgt, src = (_grouped_moves(512, bs, D, gen) if i % 2 else _group_cycles(512, bs, D, gen))
        replay_matches_reference(g, bufs, t, s, tgt, src)


def _kernel_launches(fn):
    """Names of the CUDA kernels ``fn`` launches (torch.profiler); None without CUPTI."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "move_rows" in e.name]
    return names or None


def test_one_launch_for_all_layers(seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(64, 1024, (8, 128), torch.bfloat16, gen, device=DEV)
    tgt, src = _grouped_moves(1024, 16, 8, gen)
    t, s = torch.tensor(tgt, device=DEV), torch.tensor(src, device=DEV)
    names = _kernel_launches(lambda: torch.ops.specattn.move_kv_cache(bufs, t, s, 8))
    if names is None:
        pytest.skip("the profiler saw no CUDA kernels (no CUPTI?)")
    assert len(names) == 1 and "direct" in names[0], names
    staged = _kernel_launches(lambda: torch.ops.specattn.move_kv_cache(bufs, t, s))
    assert len(staged) == 2 and not any("direct" in n for n in staged), staged


def test_sanitizer_smoke(seed):
    """Small moves through every path (staged, direct G=1 / G>1 / column tiles, narrow
    vectors, both index dtypes): the quick case to run under compute-sanitizer."""
    gen = torch.Generator().manual_seed(seed)
    for row_shape, dtype in (((576,), torch.bfloat16), ((8, 128), torch.bfloat16), ((5,), torch.uint8)):
        bufs = random_buffers(3, 256, row_shape, dtype, gen, device=DEV)
        for idx_dtype in (torch.int32, torch.int64):
            tgt, src = _grouped_moves(256, 6, 16, gen)
            _check(bufs, tgt, src, idx_dtype, raw=True)                   # staged
            _check(bufs, tgt, src, idx_dtype, raw=True, group_size=16)    # direct, G > 1
            tgt, src = _group_cycles(256, 2, 64, gen)
            _check(bufs, tgt, src, idx_dtype, raw=True, group_size=64)    # column tiles
            tgt, src = _disjoint_moves(256, 60, gen)
            _check(bufs, tgt, src, idx_dtype, raw=True, group_size=1)     # direct, G = 1


@pytest.mark.parametrize("impl", ["cuda", "triton"])
def test_no_host_sync_with_check_values_false(impl, seed):
    """``check_values=False`` with a ``group_size`` promise: the eager call never syncs with
    the host (sync debug mode "error") and equals the reference on overlapping moves."""
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(4, 512, (576,), torch.bfloat16, gen, device=DEV)
    tgt, src = _accepted_path_moves(512, 6, 16, gen)
    expected = [b.clone() for b in bufs]
    t = torch.tensor(tgt, dtype=torch.int64, device=DEV)
    s = torch.tensor(src, dtype=torch.int64, device=DEV)
    move_kv_cache_reference(expected, t, s)
    # warm-up on these very buffers with identity pairs (nothing moves): kernels compiled,
    # Triton's pointer table cached
    move_kv_cache(bufs, t, t, impl=impl, group_size=16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        move_kv_cache(bufs, t, s, impl=impl, group_size=16, check_values=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for got, exp in zip(bufs, expected):
        assert torch.equal(bits(got), bits(exp))
