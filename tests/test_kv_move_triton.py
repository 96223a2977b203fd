"""Triton move_kv_cache (triton_kernels/kv_move.py) against move_kv_cache_reference, bit for
bit, on fresh random data: staged (group_size=None) and direct (grouped) paths, overlapping
accepted-path moves, poisoned destinations, page sizes 1 and 64, empty moves, identity
pairs, index dtypes; plus the wrapper's eager checks of the group_size promise.

On a CPU-only machine the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported) on small shapes; the raw-address pointer table works there
because the buffers are CPU tensors.  The GPU-marked tests run the real shapes."""
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn's Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from kv_cases import bits, random_buffers, replay_matches_reference  # noqa: E402
from specattn.backends.pools import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from specattn.ops import kv_move as kv_move_ops  # noqa: E402
from specattn.ops import move_kv_cache, move_kv_cache_reference, registry  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def compact_style_moves(num_slots, bs, D, gen, lo=0):
    """Pairs as :func:`specattn.ops.compact_accepted_path` makes them: request ``b`` owns
    ``D`` random distinct slots (tree order) and pairs ``[b*D, (b+1)*D)``; its accepted path
    (root + sorted random drafts) moves to the block's front, the rest are identity pairs.
    Targets and sources overlap within a block, never across blocks: ``group_size=D``."""
    slots = (torch.randperm(num_slots - lo, generator=gen)[:bs * D] + lo).view(bs, D)
    tgt, src = [], []
    for b in range(bs):
        k = int(torch.randint(0, D, (1,), generator=gen))  # accepted drafts
        path = [0] + sorted((torch.randperm(D - 1, generator=gen)[:k] + 1).tolist())
        index = path + list(range(len(path), D))
        tgt += slots[b].tolist()
        src += slots[b, index].tolist()
    return tgt, src


def group_cycles(num_slots, bs, D, gen):
    """Each group of ``D`` pairs permutes ``D`` random slots of its own (cycles, chains)."""
    slots = torch.randperm(num_slots, generator=gen)[:bs * D].view(bs, D)
    tgt, src = [], []
    for b in range(bs):
        tgt += slots[b].tolist()
        src += slots[b, torch.randperm(D, generator=gen)].tolist()
    return tgt, src


def disjoint_moves(num_slots, n, gen, lo=0):
    perm = torch.randperm(num_slots - lo, generator=gen)[:2 * n] + lo
    return perm[:n].tolist(), perm[n:].tolist()


def check(bufs, tgt, src, idx_dtype=torch.int64, impl="triton", group_size=None, src_dtype=None,
          poison=True):
    """Run ``impl`` and the reference on copies; with ``poison`` the target slots that no
    pair reads are first filled with NaN bits (in both copies: the move must overwrite
    them)."""
    t = torch.tensor(tgt, dtype=idx_dtype, device=bufs[0].device)
    s = torch.tensor(src, dtype=src_dtype or idx_dtype, device=bufs[0].device)
    if poison and t.numel():
        dest = t[(t != s) & ~torch.isin(t, s)].long()
        for b in bufs:
            b.view(torch.uint8).view(b.shape[0], -1)[dest] = 0xFF  # NaN bits for floats
    expected = [b.clone() for b in bufs]
    move_kv_cache_reference(expected, t, s)
    move_kv_cache(bufs, t, s, impl=impl, group_size=group_size)
    for i, (got, exp) in enumerate(zip(bufs, expected)):
        assert torch.equal(bits(got), bits(exp)), f"buffer {i} differs"


# --------------------------------------------------------------------------- CPU + GPU
def test_registered():
    assert registry.availability("move_kv_cache")["triton"] is None


@pytest.mark.parametrize("group_size", [None, 8], ids=["staged", "grouped"])
@pytest.mark.parametrize("row_shape,dtype", [((1, 576), torch.bfloat16), ((2, 16), torch.float32),
                                             ((3,), torch.float16), ((5,), torch.uint8)],
                         ids=["mla576", "mha2x16", "odd6B", "odd5B"])
def test_accepted_path_overlap(row_shape, dtype, group_size, seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(3, 96, row_shape, dtype, gen, device=DEV)
    tgt, src = compact_style_moves(96, 5, 8, gen)
    check(bufs, tgt, src, group_size=group_size)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("group_size", [None, 1, 3])
def test_disjoint_moves(idx_dtype, group_size, seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(2, 80, (2, 16), torch.bfloat16, gen, device=DEV)
    tgt, src = disjoint_moves(80, 21, gen)
    check(bufs, tgt, src, idx_dtype=idx_dtype, group_size=group_size)


@pytest.mark.parametrize("row_shape,dtype,bs", [((1024,), torch.float32, 6),
                                                ((1, 576), torch.bfloat16, 23)],
                         ids=["4KiB-rows", "mla576"])
@pytest.mark.parametrize("group_size", [None, 6])
@pytest.mark.parametrize("pattern", ["compact", "cycles"])
def test_groups_span_many_programs(row_shape, dtype, bs, group_size, pattern, seed):
    """More pairs than one program holds (non-power-of-two groups: the last rows of a
    program's row tile are masked), several column tiles for the MLA rows.  ``cycles``:
    each group permutes its own slots (chains and cycles, not front-to-back safe)."""
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(2, 160, row_shape, dtype, gen, device=DEV)
    tgt, src = (compact_style_moves if pattern == "compact" else group_cycles)(160, bs, 6, gen)
    check(bufs, tgt, src, group_size=group_size)


def test_cycles_staged_and_one_group(seed):
    """Chains and cycles: staged, or everything in one group (direct, one program holds it)."""
    gen = torch.Generator().manual_seed(seed)
    for gs in (None, 40):
        bufs = random_buffers(2, 64, (4, 4), torch.float32, gen, device=DEV)
        pool = torch.randperm(64, generator=gen)[:40]
        tgt = pool.tolist()
        src = pool[torch.randperm(40, generator=gen)].tolist()
        check(bufs, tgt, src, group_size=gs)


def test_mixed_dtypes_identity_pairs_and_padding(seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(2, 64, (1, 576), torch.bfloat16, gen, device=DEV)
    # two requests of D=4 plus two padded requests whose pairs all sit on slot 0
    tgt = [8, 9, 10, 11, 20, 21, 22, 23] + [0] * 8
    src = [9, 11, 10, 11, 20, 22, 22, 23] + [0] * 8
    check(bufs, tgt, src, idx_dtype=torch.int32, src_dtype=torch.int64, group_size=4)
    check(bufs, tgt, src, idx_dtype=torch.int64, group_size=None)


def test_empty_moves(seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(2, 16, (8,), torch.float32, gen, device=DEV)
    before = [b.clone() for b in bufs]
    for gs in (None, 1):
        move_kv_cache(bufs, torch.empty(0, dtype=torch.int64, device=DEV),
                      torch.empty(0, dtype=torch.int64, device=DEV), impl="triton", group_size=gs)
        kv_move_ops.registry.dispatch("move_kv_cache", "triton")(
            bufs, torch.empty(0, dtype=torch.int32, device=DEV),
            torch.empty(0, dtype=torch.int32, device=DEV), group_size=gs)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(bufs, before))


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_pools_page_sizes(kind, page_size, seed):
    """Page-64 pools: whole pages moved onto other pages (aligned) and single slots
    anywhere (unaligned), through the pool's move_kv_cache."""
    gen = torch.Generator().manual_seed(seed)
    size = 4 * max(page_size, 16)
    pool = (MHATokenToKVPool(size, page_size, torch.bfloat16, 2, 16, 2, device=DEV) if kind == "mha"
            else MLATokenToKVPool(size, page_size, torch.bfloat16, 2, device=DEV,
                                  kv_lora_rank=32, qk_rope_head_dim=16))
    for b in pool.buffers:
        b.copy_(random_buffers(1, b.shape[0], b.shape[1:], b.dtype, gen, device=DEV)[0])
    ps = page_size
    if ps > 1:  # page 1 -> page 3 (aligned, one group per page), and 1 page unaligned
        tgt = list(range(3 * ps, 4 * ps)) + [ps * 2 + 5, ps * 4 + 7]
        src = list(range(1 * ps, 2 * ps)) + [ps * 4 + 7, ps * 2 + 5]  # a swap: one group
        groups = ps  # pairs [0, ps) read page 1 and write page 3; the swap pairs sit in [ps, 2ps)
    else:
        tgt, src = compact_style_moves(pool.num_slots, 4, 8, gen, lo=1)
        groups = 8
    for gs in (None, groups):
        expected = [b.clone() for b in pool.buffers]
        t, s = torch.tensor(tgt, device=DEV), torch.tensor(src, device=DEV)
        move_kv_cache_reference(expected, t, s)
        pool.move_kv_cache(t, s, impl="triton", group_size=gs)
        for got, exp in zip(pool.buffers, expected):
            assert torch.equal(bits(got), bits(exp))


def test_violated_promise_raises_before_any_write(seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(2, 32, (4,), torch.float32, gen, device=DEV)
    before = [b.clone() for b in bufs]
    # pair 1 (group 0 with G=2) reads slot 6, which pair 2 (group 1) writes
    tgt, src = [1, 2, 6, 7], [2, 6, 9, 10]
    t, s = torch.tensor(tgt, device=DEV), torch.tensor(src, device=DEV)
    for impl in ("triton", "reference"):
        with pytest.raises(ValueError, match="promise"):
            move_kv_cache(bufs, t, s, impl=impl, group_size=2)
        with pytest.raises(ValueError, match="promise"):
            move_kv_cache(bufs, t, s, impl=impl, group_size=1)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(bufs, before))
    check(bufs, tgt, src, group_size=4)  # one group: the promise holds


def test_group_size_argument_checks():
    b = [torch.zeros(8, 4, device=DEV)]
    idx = torch.tensor([1, 2], device=DEV)
    with pytest.raises(ValueError, match=">= 1"):
        move_kv_cache(b, idx, idx + 1, group_size=0)
    with pytest.raises(TypeError):
        move_kv_cache(b, idx, idx + 1, group_size=2.0)
    with pytest.raises(TypeError):
        move_kv_cache(b, idx, idx + 1, group_size=True)
    with pytest.raises(IndexError):
        move_kv_cache(b, idx, idx + 6, group_size=1)
    with pytest.raises(ValueError, match="two different moves"):
        move_kv_cache(b, torch.tensor([1, 1], device=DEV), idx + 3, group_size=1)


def test_eager_check_picks_direct_when_disjoint():
    f = kv_move_ops._check_moves
    t = torch.tensor([4, 5, 6], device=DEV)
    assert f(t, t + 3, 16, None) == 1           # no slot both read and written
    assert f(t, t + 1, 16, None) is None        # 5 and 6 read and written: stay staged
    assert f(t, t + 1, 16, 3) == 3              # ... fine within one group of 3
    assert f(t, t, 16, None) == 1               # identity pairs only
    with pytest.raises(ValueError, match="promise"):
        f(t, t + 1, 16, 2)


def test_pointer_table_cached_and_chunked_staging(monkeypatch, seed):
    from specattn.triton_kernels import kv_move as tk
    gen = torch.Generator().manual_seed(seed)
    bufs = (random_buffers(5, 48, (2, 8), torch.bfloat16, gen, device=DEV)
            + random_buffers(2, 48, (3,), torch.bfloat16, gen, device=DEV))
    tgt, src = compact_style_moves(48, 4, 6, gen)
    check(bufs, tgt, src, group_size=None)
    key = [k for k in tk._TABLES if k[1] == tuple(b.data_ptr() for b in bufs)]
    assert len(key) == 1
    tab = tk._TABLES[key[0]]
    monkeypatch.setattr(tk, "MAX_STAGING_BYTES", 2 * 24 * 32)  # ~2 buffers a chunk
    check(bufs, tgt, src, group_size=None)
    check(bufs, tgt, src, group_size=6)
    assert tk._TABLES[key[0]] is tab  # no new table, no host-to-device copy


def test_many_buffers_one_launch(seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(150, 24, (4,), torch.float16, gen, device=DEV)
    tgt, src = compact_style_moves(24, 3, 4, gen)
    check(bufs, tgt, src, group_size=4)


# --------------------------------------------------------------------------- GPU only
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [None, 1, 8, 64])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layers,row_shape", [(61, (1, 576)), (64, (8, 128))], ids=["mla", "mha"])
def test_gpu_real_shapes(layers, row_shape, idx_dtype, group_size, seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(layers, 4096, row_shape, torch.bfloat16, gen, device=DEV)
    if group_size == 1:
        tgt, src = disjoint_moves(4096, 1000, gen)
    else:
        tgt, src = compact_style_moves(4096, 48, group_size or 16, gen)
    check(bufs, tgt, src, idx_dtype=idx_dtype, group_size=group_size)
    torch.cuda.synchronize()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [None, 8])
def test_gpu_graph_capture_and_replay(group_size, seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = random_buffers(6, 512, (1, 576), torch.bfloat16, gen, device=DEV)
    bs, D = 8, 8
    t = torch.zeros(bs * D, dtype=torch.int64, device=DEV)
    s = torch.zeros(bs * D, dtype=torch.int64, device=DEV)
    move_kv_cache(bufs, t, s, impl="triton", group_size=group_size)  # warm-up: builds the table
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        move_kv_cache(bufs, t, s, impl="triton", group_size=group_size)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        move_kv_cache(bufs, t, s, impl="triton", group_size=group_size)
    for _ in range(3):
        tgt, src = compact_style_moves(512, bs, D, gen)
        replay_matches_reference(g, bufs, t, s, tgt, src)


@gpu
@pytest.mark.gpu
def test_gpu_capture_without_table_raises():
    bufs = [torch.zeros(64, 32, device=DEV) for _ in range(3)]
    t = torch.arange(4, device=DEV)
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="pointer table"):
        with torch.cuda.graph(g):
            move_kv_cache(bufs, t, t + 8, impl="triton", group_size=1)
