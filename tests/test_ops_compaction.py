"""compact_accepted_path (reference): hand-derived cases, the slot pairs applied with
move_kv_cache, verify -> compact end to end, input checks, hypothesis properties."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specattn.ops import (build_tree, compact_accepted_path, move_kv_cache, registry,
                          verify_tree_greedy)


def t(x, dtype=torch.int64):
    return torch.tensor(x, dtype=dtype)


def kv_pool(num_slots, seed=0):
    """Two per-layer buffers whose rows are distinguishable."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_slots, 2, 3, generator=g), torch.randn(num_slots, 4, generator=g)]


def test_hand_case_and_kv_move():
    # D = 4.  Request 0 accepted drafts 2 then 3 (rows 2, 3; accept_length 2), request 1
    # nothing (accept_length 0: only its root, row 4).
    accept_index = t([[0, 2, 3], [4, -1, -1]], torch.int32)
    accept_length = t([2, 0], torch.int32)
    out_cache_loc = t([10, 11, 12, 13, 20, 21, 22, 23])
    predicts = t([100, 101, 102, 103, 104, 105, 106, 107], torch.int32)
    hidden = torch.arange(16.0).view(8, 2)
    r = compact_accepted_path(accept_index, accept_length, out_cache_loc, 4, predicts=predicts,
                              hidden_states=hidden)
    # block 0: rows 0, 2, 3 to the front, row 3 keeps its own entry; block 1 unchanged
    assert r.src_index.tolist() == [0, 2, 3, 3, 4, 5, 6, 7]
    assert r.predicts.tolist() == [100, 102, 103, 103, 104, 105, 106, 107]
    assert r.predicts.dtype == torch.int32
    assert torch.equal(r.hidden_states, hidden[[0, 2, 3, 3, 4, 5, 6, 7]])
    assert r.out_cache_loc.tolist() == [10, 12, 13, 13, 20, 21, 22, 23]
    assert r.tgt_loc.tolist() == [10, 11, 12, 13, 20, 21, 22, 23]
    assert r.src_loc.tolist() == [10, 12, 13, 13, 20, 21, 22, 23]
    bufs = kv_pool(32)
    old = [b.clone() for b in bufs]
    move_kv_cache(bufs, r.tgt_loc, r.src_loc)
    for b, o in zip(bufs, old):
        assert torch.equal(b[[10, 11, 12]], o[[10, 12, 13]])  # the path, in order
        keep = [s for s in range(32) if s not in (11, 12)]
        assert torch.equal(b[keep], o[keep])  # everything else untouched


def test_all_accepted_chain_is_identity():
    # chain D = 4 (topk = 1), everything accepted: accept_index is already the block
    ai, n = t([[0, 1, 2, 3], [4, 5, 6, 7]]), t([3, 3])
    loc = t([5, 6, 7, 8, 1, 2, 3, 4], torch.int32)
    r = compact_accepted_path(ai, n, loc, 4)
    assert r.src_index.tolist() == list(range(8))
    assert r.predicts is None and r.hidden_states is None
    assert torch.equal(r.tgt_loc, loc) and torch.equal(r.src_loc, loc)
    assert r.tgt_loc.dtype == torch.int32


def test_none_accepted_bs1():
    r = compact_accepted_path(t([[0, -1, -1]]), t([0]), t([9, 8, 7, 6, 5]), 5,
                              predicts=t([1, 2, 3, 4, 5]))
    assert r.src_index.tolist() == [0, 1, 2, 3, 4]
    assert r.predicts.tolist() == [1, 2, 3, 4, 5]
    assert torch.equal(r.tgt_loc, r.src_loc)


def test_verify_then_compact_end_to_end():
    # tests/test_ops_verify.py::test_greedy_two_requests: request 0 accepts drafts 2, 4
    # (emits 12, 14, bonus 9), request 1 accepts draft 1 (emits 21, bonus 25)
    tree = build_tree(t([[-1, 0, 1], [-1, 0, 1]]), t([[0, 1, 2, 4], [0, 1, 2, 3]]),
                      t([7, 3]), 2, 2, 5)
    pred, acc, n = verify_tree_greedy(
        t([[100, 11, 12, 13, 14], [200, 21, 22, 23, 24]]), tree.retrive_index,
        tree.retrive_next_token, tree.retrive_next_sibling,
        t([[12, 7, 14, 8, 9], [21, 25, 26, 27, 28]]), 2)
    loc = t(list(range(40, 45)) + list(range(60, 65)))
    hidden = torch.randn(10, 8)
    r = compact_accepted_path(acc, n, loc, 5, predicts=pred, hidden_states=hidden)
    assert r.predicts[0:3].tolist() == [12, 14, 9]     # emitted tokens, bonus last
    assert r.predicts[5:7].tolist() == [21, 25]
    assert torch.equal(r.hidden_states[0:3], hidden[[0, 2, 4]])
    assert torch.equal(r.hidden_states[5:7], hidden[[5, 6]])
    bufs = kv_pool(70)
    old = [b.clone() for b in bufs]
    move_kv_cache(bufs, r.tgt_loc, r.src_loc)
    for b, o in zip(bufs, old):
        assert torch.equal(b[[40, 41, 42]], o[[40, 42, 44]])
        assert torch.equal(b[[60, 61]], o[[60, 61]])


def test_poisoned_outputs_fully_written():
    args = (t([[0, 2, 3], [4, -1, -1]]), t([2, 0]), t([10, 11, 12, 13, 20, 21, 22, 23]),
            t([100, 101, 102, 103, 104, 105, 106, 107]), torch.randn(8, 3))
    want = compact_accepted_path(*args[:3], 4, predicts=args[3], hidden_states=args[4])
    outs = [torch.full_like(x, -5) for x in want]
    registry.dispatch("compact_accepted_path", "reference")(*args, *outs)
    for x, y in zip(outs, want):
        assert torch.equal(x, y)


@pytest.mark.parametrize("ai, n, msg, exc", [
    ([[0, 2, 4], [4, -1, -1]], [2, 0], r"accept_index\[0, 2\] = 4, expected in \[0, 4\)",
     ValueError),
    ([[0, 2, 3], [4, 5, -1]], [2, 0], r"accept_index\[1, 1\] = 5, expected -1", ValueError),
    ([[0, 2, 3], [4, -1, -1]], [3, 0], "accept_length", ValueError),
    ([[0, 2, 3], [4, -1, -1]], [2, -1], "accept_length", ValueError),
    ([[0, 2, 3], [4, -1, -1]], [2, 0, 0], "accept_length", ValueError),
])
def test_bad_accept(ai, n, msg, exc):
    with pytest.raises(exc, match=msg):
        compact_accepted_path(t(ai), t(n), t(list(range(8))), 4)


def test_bad_input():
    ai, n, loc = t([[0, 2, 3], [4, -1, -1]]), t([2, 0]), t(list(range(8)))
    with pytest.raises(ValueError, match="out_cache_loc"):
        compact_accepted_path(ai, n, loc[:7], 4)
    with pytest.raises(ValueError, match="accept_index"):
        compact_accepted_path(ai.float(), n, loc, 4)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        compact_accepted_path(ai, n, loc, 0)
    with pytest.raises(TypeError, match="num_draft_tokens"):
        compact_accepted_path(ai, n, loc, 4.0)
    with pytest.raises(ValueError, match="predicts"):
        compact_accepted_path(ai, n, loc, 4, predicts=t([1, 2]))
    with pytest.raises(ValueError, match="hidden_states"):
        compact_accepted_path(ai, n, loc, 4, hidden_states=torch.zeros(7, 2))
    with pytest.raises(ValueError, match="on cpu"):
        compact_accepted_path(ai, n, loc.to("meta"), 4)
    # accept_index may be wider than D when the tree is shallower than num_steps
    r = compact_accepted_path(t([[0, 1, -1, -1, -1]]), t([1]), t([3, 4]), 2)
    assert r.src_index.tolist() == [0, 1]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bs=st.integers(1, 4), D=st.integers(1, 8),
       extra_cols=st.integers(0, 2))
def test_random_paths_move_kv(seed, bs, D, extra_cols):
    rng = random.Random(seed)
    S = max(1, D - rng.randrange(0, D)) + extra_cols  # accept_index width, may exceed D
    ai = torch.full((bs, S), -1, dtype=torch.int64)
    n = torch.zeros(bs, dtype=torch.int64)
    for b in range(bs):
        L = rng.randrange(0, min(S, D))
        path = [0] + rng.sample(range(1, D), L)  # root, then distinct drafts
        ai[b, :L + 1] = t(path) + b * D
        n[b] = L
    num_slots = bs * D + 5
    loc = t(rng.sample(range(num_slots), bs * D))  # distinct slots anywhere in the pool
    pred = torch.randint(0, 1000, (bs * D,))
    hid = torch.randn(bs * D, 3)
    r = compact_accepted_path(ai, n, loc, D, predicts=pred, hidden_states=hid)
    bufs = kv_pool(num_slots, seed)
    old = [x.clone() for x in bufs]
    move_kv_cache(bufs, r.tgt_loc, r.src_loc)
    for b in range(bs):
        for k in range(D):
            row = b * D + k
            src = int(ai[b, k]) if k <= n[b] else row  # path rows first, then unchanged
            assert r.src_index[row] == src
            assert r.predicts[row] == pred[src] and torch.equal(r.hidden_states[row], hid[src])
            assert r.out_cache_loc[row] == loc[src] == r.src_loc[row]
            assert r.tgt_loc[row] == loc[row]
            for x, o in zip(bufs, old):
                assert torch.equal(x[loc[row]], o[loc[src]])
    untouched = sorted(set(range(num_slots)) - set(loc.tolist()))
    for x, o in zip(bufs, old):
        assert torch.equal(x[untouched], o[untouched])
