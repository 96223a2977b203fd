"""Forward modes, the worked examples of the prefix_lens convention, tree-mask converters, pools."""
import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specattn.backends import (ForwardBatch, ForwardMode, GraphInputBuffers, KVAllocator,
                               MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool, TorchReferenceBackend,
                               num_mask_words, pack_tree_mask, tree_mask_to_flashinfer, unpack_tree_mask)
from specattn.backends.torch_reference import build_reference_metadata


def test_forward_mode_predicates():
    M = ForwardMode
    assert [m for m in M if m.is_decode()] == [M.DECODE]
    assert [m for m in M if m.is_target_verify()] == [M.TARGET_VERIFY]
    assert [m for m in M if m.is_idle()] == [M.IDLE]
    assert [m for m in M if m.is_cuda_graph()] == [M.DECODE, M.TARGET_VERIFY, M.DRAFT_EXTEND_V2, M.IDLE]
    assert [m for m in M if m.has_fixed_tokens_per_req()] == [M.TARGET_VERIFY, M.DRAFT_EXTEND_V2]


def _example_pool():
    pool = ReqToTokenPool(4, 16)
    pool.req_to_token[3, :11] = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23, 24, 25, 26])
    pool.req_to_token[0, :8] = torch.tensor([7, 8, 30, 31, 32, 33, 34, 35])
    return pool


def _visible_slots(pool, batch):
    """Per token, the visible slots according to the reference metadata."""
    P = batch.prefix_lens.long(); n = batch.extend_lens.long()
    md = build_reference_metadata(pool.req_to_token, batch, int(n.max()), int((P + n).max()))
    out = []
    for i in range(batch.batch_size):
        for j in range(int(n[i])):
            out.append(md.kv_slots[i][md.mask[i, j]].tolist())
    return out


def test_worked_example_extend():
    pool = _example_pool()
    b = ForwardBatch.extend([3, 0], [4, 2], [3, 2], [20, 21, 22, 30, 31])
    b.validate(pool.req_to_token)
    assert b.positions.tolist() == [4, 5, 6, 2, 3]
    assert b.qo_indptr().tolist() == [0, 3, 5]
    assert _visible_slots(pool, b)[1] == [10, 11, 12, 13, 20, 21]


def test_worked_example_decode():
    pool = _example_pool()
    b = ForwardBatch.decode([3, 0], [7, 4], [23, 32])
    b.validate(pool.req_to_token)
    assert b.positions.tolist() == [7, 4]
    assert _visible_slots(pool, b) == [[10, 11, 12, 13, 20, 21, 22, 23], [7, 8, 30, 31, 32]]


def test_worked_example_target_verify():
    pool = _example_pool()
    tm = torch.tensor([[[0b001], [0b011], [0b111]], [[0b001], [0b011], [0b101]]], dtype=torch.int32)
    b = ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, [3, 0], [8, 5], 3, [24, 25, 26, 33, 34, 35],
                           positions=[8, 9, 10, 5, 6, 6], tree_mask=tm)
    b.validate(pool.req_to_token)
    vis = _visible_slots(pool, b)
    assert vis[5] == [7, 8, 30, 31, 32, 33, 35]
    assert vis[2] == [10, 11, 12, 13, 20, 21, 22, 23, 24, 25, 26]


def test_worked_example_draft_extend_v2():
    pool = _example_pool()
    b = ForwardBatch.fixed(ForwardMode.DRAFT_EXTEND_V2, [3, 0], [8, 5], 3, [24, 25, 26, 33, 34, 35])
    b.validate(pool.req_to_token)
    assert b.positions.tolist() == [8, 9, 10, 5, 6, 7]
    assert _visible_slots(pool, b)[4] == [7, 8, 30, 31, 32, 33, 34]


def test_validate_catches_convention_breaks():
    pool = _example_pool()
    with pytest.raises(ValueError):
        ForwardBatch.decode([3, 0], [7, 4], [23, 99]).validate(pool.req_to_token)
    with pytest.raises(ValueError):  # sum(extend_lens) != T
        ForwardBatch(ForwardMode.EXTEND, torch.tensor([3, 0]), torch.tensor([4, 2], dtype=torch.int32),
                     torch.tensor([3, 3], dtype=torch.int32), torch.tensor([20, 21, 22, 30, 31]),
                     torch.tensor([4, 5, 6, 2, 3])).validate()
    with pytest.raises(ValueError):
        ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, [3], [8], 3, [24, 25, 26])


def test_validate_checks_rows_slots_and_extend_lengths():
    pool = _example_pool()
    good = ForwardBatch.decode([3, 0], [7, 4], [23, 32])
    good.validate(pool.req_to_token)
    for field, bad, match in (("req_pool_indices", torch.tensor([-1, 0]), "req_pool_indices must be >= 0"),
                              ("req_pool_indices", torch.tensor([3, 4]), "req_pool_indices must be < 4"),
                              ("out_cache_loc", torch.tensor([23, -5]), "out_cache_loc must be >= 0")):
        with pytest.raises(ValueError, match=match):          # built by hand: the constructors refuse less
            dataclasses.replace(good, **{field: bad}).validate(pool.req_to_token)
    empty = ForwardBatch(ForwardMode.EXTEND, torch.tensor([3]), torch.tensor([4], dtype=torch.int32),
                         torch.tensor([0], dtype=torch.int32), torch.zeros(0, dtype=torch.int64),
                         torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="extend_lens must be >= 1"):
        empty.validate()


@pytest.mark.parametrize("call,error,match", [
    (lambda: ForwardBatch.extend([0], torch.tensor([2 ** 32 + 3]), [1], [5]), ValueError, "prefix_lens must fit int32"),
    (lambda: ForwardBatch.extend([0.9], [2], [1], [5]), TypeError, "req_pool_indices must hold integers"),
    (lambda: ForwardBatch.extend([0], [2.7], [1], [5]), TypeError, "prefix_lens must hold integers"),
    (lambda: ForwardBatch.extend([0, 1], [0, 0], [3, -1], [5, 6]), ValueError, "extend_lens must be >= 0"),
    (lambda: ForwardBatch.decode([0], [-2], [5]), ValueError, "prefix_lens must be >= 0"),
    (lambda: ForwardBatch.decode([0], [2], [True]), TypeError, "out_cache_loc must hold integers"),
    (lambda: ForwardBatch.fixed(ForwardMode.DRAFT_EXTEND_V2, [0], [2], -1, []), ValueError, "num_tokens_per_req"),
    (lambda: ForwardBatch.fixed(ForwardMode.DRAFT_EXTEND_V2, [0], [2], 0, []), ValueError, "num_tokens_per_req"),
    (lambda: ForwardBatch.fixed(ForwardMode.DRAFT_EXTEND_V2, [0], [2], 2.5, [4, 5]), ValueError, "num_tokens_per_req"),
    (lambda: ForwardBatch.from_sglang(ForwardMode.DECODE, [0], [1.5], [3]), TypeError, "seq_lens must hold integers"),
], ids=range(10))
def test_batch_constructors_never_truncate_or_wrap(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_batch_constructors_take_empty_and_integer_inputs():
    b = ForwardBatch.extend([], [], [], [])
    assert b.batch_size == 0 and b.positions.dtype == torch.int64
    b = ForwardBatch.extend(torch.tensor([1], dtype=torch.int32), torch.tensor([2], dtype=torch.int64), [1], [9])
    assert b.prefix_lens.dtype == torch.int32 and b.req_pool_indices.dtype == torch.int64
    b.validate()


# ------------------------------------------------------------------ tree mask
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.integers(0, 3), st.integers(0, 2**31 - 1), st.floats(0.0, 1.0))
def test_pack_unpack_roundtrip(D, bs, seed, density):
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(bs, D, D, generator=g) < density
    packed = pack_tree_mask(dense)
    assert packed.shape == (bs, D, num_mask_words(D)) and packed.dtype == torch.int32
    assert torch.equal(unpack_tree_mask(packed, D), dense)
    words = packed.long() & 0xFFFFFFFF  # bit k of row j lives in word k // 32
    k = torch.arange(D)
    bits = (words[..., k // 32] >> (k % 32)) & 1
    assert torch.equal(bits.bool(), dense)


def test_flashinfer_mask_layout():
    rng = random.Random()
    D, P = 5, [3, 0, 6]
    dense = torch.rand(3, D, D) < 0.5
    packed, indptr = tree_mask_to_flashinfer(pack_tree_mask(dense), torch.tensor(P))
    for i, p in enumerate(P):
        full = torch.cat([torch.ones(D, p, dtype=torch.bool), dense[i]], 1).flatten()
        seg = packed[int(indptr[i]):int(indptr[i + 1])]
        assert seg.numel() == (full.numel() + 7) // 8
        bits = [(int(seg[e // 8]) >> (e % 8)) & 1 for e in range(full.numel())]
        assert bits == full.int().tolist()


def test_tree_mask_errors():
    with pytest.raises(ValueError):
        pack_tree_mask(torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError):
        unpack_tree_mask(torch.zeros(3, 3, 2, dtype=torch.int32), 3)
    with pytest.raises(TypeError, match="num_draft_tokens must be an int"):
        unpack_tree_mask(torch.zeros(2, 1, dtype=torch.int32), 2.0)
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 1"):
        unpack_tree_mask(torch.zeros(0, 1, dtype=torch.int32), 0)


def test_flashinfer_mask_helpers_never_truncate():
    from specattn.ops import flashinfer_mask_bytes
    tm = pack_tree_mask(torch.ones(1, 2, 2, dtype=torch.bool).tril())
    assert tree_mask_to_flashinfer(tm, torch.tensor([2]))[1].tolist() == [0, 1]
    for P, error, match in ((torch.tensor([2.9]), TypeError, "integers"), ([2], TypeError, "integers"),
                            (torch.tensor([-1]), ValueError, "must be in \\[0, "),
                            (torch.tensor([2 ** 33]), ValueError, "must be in \\[0, ")):
        with pytest.raises(error, match=match):
            tree_mask_to_flashinfer(tm, P)
    assert flashinfer_mask_bytes(torch.tensor([3, 0]), 2).tolist() == [2, 1]
    with pytest.raises(TypeError, match="num_draft_tokens"):
        flashinfer_mask_bytes(torch.tensor([3]), 2.9)
    with pytest.raises(TypeError, match="verified_seq_len"):
        flashinfer_mask_bytes(torch.tensor([3.9]), 2)


# ------------------------------------------------------------------ pools
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_allocator_pages(page_size):
    alloc = KVAllocator(page_size * 8, page_size)
    a = alloc.alloc_extend([0], [page_size + 1], [-1])
    assert a.numel() == page_size + 1 and int(a.min()) >= page_size  # page 0 reserved
    assert (a[:page_size] // page_size).unique().numel() == 1
    b = alloc.alloc_extend([page_size + 1], [page_size - 1 if page_size > 1 else 1], [int(a[-1])])
    if page_size > 1:  # continues the last page
        assert int(b[0]) == int(a[-1]) + 1 and int(b[-1] // page_size) == int(a[-1] // page_size)
    free_before = alloc.available_size()
    assert alloc.alloc(alloc.available_size() + 1) is None and alloc.available_size() == free_before
    alloc.free(torch.cat([a, b]))
    assert alloc.available_size() == page_size * 8
    with pytest.raises(ValueError):
        alloc.free(a)  # double free
    with pytest.raises(ValueError):
        alloc.free(torch.tensor([0]))  # reserved page


def test_allocator_refuses_a_last_loc_outside_the_pages_in_use():
    """A ``last_loc`` past the pool or in a free page would hand its page's slots out twice."""
    alloc = KVAllocator(16, page_size=4)
    with pytest.raises(ValueError, match="not a page in use"):
        alloc.alloc_extend([2], [2], [1001])
    with pytest.raises(ValueError, match="not a page in use"):
        alloc.alloc_extend([1], [3], [8])                  # page 2 is free
    held = alloc.alloc(4)
    assert alloc.alloc_extend([1], [3], [int(held[0])]).tolist() == [5, 6, 7]
    with pytest.raises(TypeError, match="last_loc must be an int"):
        alloc.alloc_extend([1], [3], [4.0])
    assert alloc.available_size() == 12                    # nothing taken by the refused calls


def test_req_to_token_pool_free_and_write_checks():
    pool = ReqToTokenPool(4, 8)
    assert pool.alloc(4) == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="row must be an int"):
        pool.free([1.5])
    with pytest.raises(ValueError, match="repeated"):
        pool.free([2, 2])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([1, 4])
    assert pool.available_size() == 0                      # all or nothing
    pool.free([2, 1])
    assert pool.available_size() == 2
    with pytest.raises(ValueError, match="already free"):
        pool.free([1])
    before = pool.req_to_token.clone()
    for slots, error in ((torch.tensor([2 ** 32 + 5]), IndexError), (torch.tensor([-7]), IndexError),
                         (torch.tensor([3.7]), ValueError), (torch.zeros(2, 3, dtype=torch.int32), ValueError),
                         ([1, 2], TypeError)):
        with pytest.raises(error):
            pool.write(0, 0, slots)
    with pytest.raises(TypeError):
        pool.write(0, 1.0, torch.tensor([1]))
    assert torch.equal(pool.req_to_token, before)
    pool.write(0, 6, torch.tensor([2 ** 31 - 1, 0]))
    assert pool.req_to_token[0, 6:].tolist() == [2 ** 31 - 1, 0]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_kv_pool_layers_sizes_and_input_dtypes(kind):
    pool = (MHATokenToKVPool(8, 1, torch.float32, 1, 4, layer_num=2) if kind == "mha"
            else MLATokenToKVPool(8, 1, torch.float32, 2, kv_lora_rank=4, qk_rope_head_dim=2))
    for get in (pool.get_key_buffer, pool.get_value_buffer, pool.kv_scales):
        with pytest.raises(IndexError, match="layer_id -1"):       # no wrap-around to the last layer
            get(-1)
        with pytest.raises(IndexError):
            get(2)
        with pytest.raises(TypeError, match="layer_id must be an int"):
            get(1.0)
    assert pool.get_key_buffer(1) is pool.buffers[1]
    width = 4 if kind == "mha" else 6
    rows = torch.ones(1, 1, width, dtype=torch.complex64)
    with pytest.raises(ValueError, match="must have dtype"):
        pool.set_kv_buffer(0, torch.tensor([1]), rows, rows)
    with pytest.raises(TypeError, match="layer_id must be an int"):
        pool.set_kv_buffer(1.5, torch.tensor([1]), rows.real, rows.real)


@pytest.mark.parametrize("kw,match", [
    (dict(head_num=0), "head_num must be >= 1"), (dict(head_dim=-1), "head_dim must be >= 1"),
    (dict(v_head_dim=0), "v_head_dim must be >= 1"), (dict(head_num=1.5), "head_num must be an int"),
])
def test_mha_pool_sizes(kw, match):
    args = dict(size=8, page_size=1, dtype=torch.float32, head_num=1, head_dim=4, layer_num=1)
    with pytest.raises((ValueError, TypeError), match=match):
        MHATokenToKVPool(**{**args, **kw})
    with pytest.raises(ValueError, match="kv_lora_rank must be >= 1"):
        MLATokenToKVPool(8, 1, torch.float32, 1, kv_lora_rank=-2, qk_rope_head_dim=2)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_move_kv_cache_overlap_and_range(kind):
    pool = (MHATokenToKVPool(64, 1, torch.float32, 2, 8, 3) if kind == "mha"
            else MLATokenToKVPool(64, 1, torch.float32, 3, kv_lora_rank=16, qk_rope_head_dim=8))
    for b in pool.buffers:
        b.normal_()
    before = [b.clone() for b in pool.buffers]
    tgt = torch.tensor([10, 11, 12, 13]); src = torch.tensor([11, 13, 15, 10])  # overlapping
    pool.move_kv_cache(tgt, src)
    for b0, b1 in zip(before, pool.buffers):
        assert torch.equal(b1[tgt], b0[src])
        untouched = torch.ones(b0.shape[0], dtype=torch.bool); untouched[tgt] = False
        assert torch.equal(b1[untouched], b0[untouched])
    snap = [b.clone() for b in pool.buffers]
    with pytest.raises(IndexError):
        pool.move_kv_cache(torch.tensor([1, pool.num_slots]), torch.tensor([2, 3]))
    with pytest.raises(IndexError):
        pool.move_kv_cache(torch.tensor([1, 2]), torch.tensor([-1, 3]))
    with pytest.raises(ValueError):
        pool.move_kv_cache(torch.tensor([1, 1]), torch.tensor([2, 3]))
    with pytest.raises(ValueError):  # slot 5 kept and overwritten at once
        pool.move_kv_cache(torch.tensor([5, 5]), torch.tensor([5, 6]))
    assert all(torch.equal(a, b) for a, b in zip(snap, pool.buffers))
    pool.move_kv_cache(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    pool.move_kv_cache(torch.tensor([0, 0, 5]), torch.tensor([0, 0, 6]))  # padded self-moves are fine
    assert all(torch.equal(b[5], s[6]) for b, s in zip(pool.buffers, snap))


def test_set_kv_buffer_checks():
    pool = MHATokenToKVPool(16, 1, torch.bfloat16, 2, 8, 1)
    k = torch.randn(2, 2, 8); v = torch.randn(2, 2, 8)
    pool.set_kv_buffer(0, torch.tensor([1, 5]), k, v)
    assert torch.equal(pool.k_buffer[0][5], k[1].bfloat16())
    with pytest.raises(IndexError):
        pool.set_kv_buffer(0, torch.tensor([1, 17]), k, v)
    with pytest.raises(ValueError):
        pool.set_kv_buffer(0, torch.tensor([1, 2]), k[:, :1], v)
    with pytest.raises(IndexError):
        pool.set_kv_buffer(1, torch.tensor([1, 2]), k, v)


def test_graph_buffers_pad_harmlessly():
    bufs = GraphInputBuffers(4, 3, "cpu")
    tm = pack_tree_mask(torch.tril(torch.ones(2, 3, 3, dtype=torch.bool)))
    b = ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, [2, 1], [5, 6], 3, list(range(20, 26)),
                           positions=[5, 6, 7, 6, 7, 8], tree_mask=tm)
    p = bufs.fill(b, 4)
    assert p.batch_size == 4 and p.num_tokens == 12
    assert p.prefix_lens.tolist() == [5, 6, 0, 0] and p.req_pool_indices.tolist() == [2, 1, 0, 0]
    assert p.out_cache_loc[6:].eq(0).all() and p.extend_lens.eq(3).all()
    assert torch.equal(unpack_tree_mask(p.tree_mask[2:], 3), torch.eye(3, dtype=torch.bool).expand(2, 3, 3))
    with pytest.raises(ValueError):
        bufs.fill(b, 5)


def test_graph_buffers_pad_extend():
    """EXTEND: a static token count (default padded_bs * max_tokens_per_req), padded requests
    with extend_lens 0, the token tail zeroed (slot 0, position 0), stale values overwritten."""
    bufs = GraphInputBuffers(4, 3, "cpu")
    bufs.out_cache_loc.fill_(77)
    bufs.extend_lens.fill_(9)
    b = ForwardBatch.extend([2, 1], [4, 0], [3, 2], list(range(30, 35)))
    p = bufs.fill(b, 4)
    assert p.forward_mode == ForwardMode.EXTEND and p.batch_size == 4 and p.num_tokens == 12
    assert p.extend_lens.tolist() == [3, 2, 0, 0] and p.prefix_lens.tolist() == [4, 0, 0, 0]
    assert p.req_pool_indices.tolist() == [2, 1, 0, 0]
    assert p.out_cache_loc.tolist() == list(range(30, 35)) + [0] * 7
    assert p.positions.tolist() == [4, 5, 6, 0, 1] + [0] * 7
    assert bufs.fill(b, 2, padded_tokens=5).num_tokens == 5
    for bad in (dict(padded_bs=1), dict(padded_bs=5), dict(padded_bs=2, padded_tokens=4),
                dict(padded_bs=4, padded_tokens=13)):
        with pytest.raises(ValueError, match="does not fit"):
            bufs.fill(b, bad.pop("padded_bs"), **bad)
    d = ForwardBatch.decode([0], [3], [9])
    with pytest.raises(ValueError, match="EXTEND batches only"):
        bufs.fill(d, 1, padded_tokens=3)


def test_move_kv_cache_check_values_false(seed):
    """``check_values=False``: same result on valid overlapping moves, and the value checks
    (here: two different moves into one slot) are skipped."""
    from specattn.ops import move_kv_cache
    slots = 16
    buf = torch.randn(slots, 3)
    tgt = torch.tensor([1, 2, 3])
    src = torch.tensor([2, 3, 5])  # overlapping: slot 2 and 3 are read and written
    want = buf.clone()
    want[tgt] = buf[src]
    for group_size in (None, 3):
        got = buf.clone()
        move_kv_cache([got], tgt, src, group_size=group_size, check_values=False,
                      impl="reference")
        assert torch.equal(got, want)
    dup = torch.tensor([1, 1])
    with pytest.raises(ValueError, match="two different moves"):
        move_kv_cache([buf.clone()], dup, torch.tensor([2, 3]), impl="reference")
    move_kv_cache([buf.clone()], dup, torch.tensor([2, 3]), check_values=False,
                  impl="reference")  # not checked: the caller vouches for its slots


def test_sglang_length_mapping():
    """``to_sglang_lens`` / ``from_sglang``: SGLang's seq_lens counts this forward's tokens in
    EXTEND and DECODE, not in TARGET_VERIFY / DRAFT_EXTEND_V2; a round trip is the identity."""
    from specattn.backends import ForwardBatch, ForwardMode, pack_tree_mask
    ext = ForwardBatch.extend([3, 0], [4, 2], [3, 2], [20, 21, 22, 30, 31])
    s = ext.to_sglang_lens()
    assert s["seq_lens"].tolist() == [7, 4] and s["extend_prefix_lens"].tolist() == [4, 2]
    back = ForwardBatch.from_sglang(ForwardMode.EXTEND, [3, 0], s["seq_lens"], ext.out_cache_loc,
                                    extend_seq_lens=s["extend_seq_lens"])
    assert back.prefix_lens.tolist() == [4, 2] and back.positions.tolist() == ext.positions.tolist()
    dec = ForwardBatch.decode([3, 0], [7, 4], [23, 32])
    assert dec.to_sglang_lens()["seq_lens"].tolist() == [8, 5]
    assert ForwardBatch.from_sglang(ForwardMode.DECODE, [3, 0], [8, 5], [23, 32]).prefix_lens.tolist() == [7, 4]
    mask = pack_tree_mask(torch.eye(3, dtype=torch.bool).expand(2, 3, 3).contiguous())
    ver = ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, [3, 0], [8, 5], 3, list(range(6)),
                             positions=[8, 9, 9, 5, 6, 6], tree_mask=mask)
    assert ver.to_sglang_lens()["seq_lens"].tolist() == [8, 5]
    back = ForwardBatch.from_sglang(ForwardMode.TARGET_VERIFY, [3, 0], [8, 5], list(range(6)),
                                    [8, 9, 9, 5, 6, 6], num_tokens_per_req=3, tree_mask=mask)
    assert back.prefix_lens.tolist() == [8, 5] and back.num_tokens_per_req == 3
    with pytest.raises(ValueError, match="extend_seq_lens"):
        ForwardBatch.from_sglang(ForwardMode.EXTEND, [0], [3], [1, 2, 3])
    with pytest.raises(ValueError, match="below 0"):
        ForwardBatch.from_sglang(ForwardMode.DECODE, [0], [0], [1])


@pytest.mark.parametrize("name", ["torch_reference", "triton"])
def test_graph_capacity_is_the_base_class_bound(name):
    """Every backend's CUDA-graph state is sized through the base class: ``graph_capacity``
    records the bounds, ``check_graph_batch`` is the one check (RuntimeError before
    ``init_cuda_graph_state``, ValueError past a bound, ValueError for bounds below 1)."""
    from specattn.backends import GraphCapacity, MHATokenToKVPool, ReqToTokenPool, create_backend
    req_pool = ReqToTokenPool(4, 64, "cpu")
    backend = create_backend(name, req_pool, MHATokenToKVPool(128, 1, torch.float32, 2, 16, 1, "cpu"))
    with pytest.raises(RuntimeError, match="init_cuda_graph_state was not called"):
        backend.check_graph_batch(1, 1)
    with pytest.raises(ValueError, match=">= 1"):
        backend.init_cuda_graph_state(0, 4)
    backend.init_cuda_graph_state(2, 8)
    assert backend.graph_capacity == GraphCapacity(2, 8)
    assert backend.check_graph_batch(2, 8) == GraphCapacity(2, 8)
    for bs, tokens in [(3, 3), (2, 9)]:
        with pytest.raises(ValueError, match=r"exceeds init_cuda_graph_state\(2, 8\)"):
            backend.check_graph_batch(bs, tokens)
    batch = ForwardBatch.fixed(ForwardMode.DRAFT_EXTEND_V2, [0, 1, 2], [1, 1, 1], 3, torch.arange(9))
    with pytest.raises(ValueError, match="exceeds"):   # the metadata builders use that check
        backend.init_forward_metadata_capture_cuda_graph(batch)
