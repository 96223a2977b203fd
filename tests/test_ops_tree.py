"""build_tree (reference): hand-derived trees, SGLang's own test vector, missing parents,
input checks, and hypothesis properties on random EAGLE drafts."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specattn.ops.tree_mask import num_mask_words, unpack_tree_mask
from specattn.ops import build_tree, num_tree_candidates, registry


def bits(tree_mask, D):
    """Row j of each request as the int whose bit k says j sees k (for readable asserts)."""
    dense = unpack_tree_mask(tree_mask, D).long()
    return (dense * (1 << torch.arange(D))).sum(-1).tolist()


def t(x, dtype=torch.int64):
    return torch.tensor(x, dtype=dtype)


# ----------------------------------------------------------------------------- hand-checked
def test_two_requests_topk2_steps2():
    # topk=2, num_steps=2: step-0 candidates are flat 0, 1 (children of the root); step 1
    # expands beam r (continuing parent_list[1 + r]) into flat 2 + 2r + c.  With 2 steps
    # parent_list is SGLang's first block only: [-1, 0, 1] (beam 1 continues flat 0, beam 2
    # continues flat 1).
    #
    # request 0, selected [0, 1, 2, 4]: draft 1 = flat 0 (root), 2 = flat 1 (root),
    #   3 = flat 2 (beam 1 -> flat 0 = draft 1), 4 = flat 4 (beam 2 -> flat 1 = draft 2)
    #   tree 0 -> {1, 2}, 1 -> {3}, 2 -> {4}
    # request 1, selected [0, 1, 2, 3]: 1, 2 root children, 3 = flat 2 and 4 = flat 3 both
    #   under beam 1 -> draft 1: tree 0 -> {1, 2}, 1 -> {3, 4}
    parent_list = t([[-1, 0, 1], [-1, 0, 1]])
    selected = t([[0, 1, 2, 4], [0, 1, 2, 3]])
    out = build_tree(parent_list, selected, t([7, 3], torch.int32), 2, 2, 5)
    assert out.tree_mask.dtype == torch.int32 and out.tree_mask.shape == (2, 5, 1)
    # rows as bit sets: {0}=1, {0,1}=3, {0,2}=5, {0,1,3}=11, {0,2,4}=21 / {0,1,4}=19
    assert bits(out.tree_mask, 5) == [[1, 3, 5, 11, 21], [1, 3, 5, 11, 19]]
    # seq_len + depth, request-major flat
    assert out.positions.dtype == torch.int64
    assert out.positions.tolist() == [7, 8, 8, 9, 9, 3, 4, 4, 5, 5]
    assert out.retrive_index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert out.retrive_next_token.tolist() == [[1, 3, 4, -1, -1], [1, 3, -1, -1, -1]]
    assert out.retrive_next_sibling.tolist() == [[-1, 2, -1, -1, -1], [-1, 2, -1, 4, -1]]
    for x in out[2:]:
        assert x.dtype == torch.int64


def test_sglang_build_tree_kernel_efficient_vector():
    # SGLang python/sglang/srt/speculative/build_eagle_tree.py,
    # test_build_tree_kernel_efficient: topk=4, depth=4, 8 draft tokens, prefix_lens [5, 10].
    # parent_list = cat(parents_list[:-1]) of that test; selected = sorted top-7 of its
    # score_list (computed once from the test's scores); the expected outputs are the ones
    # that test asserts.
    parent_list = t([[-1, 0, 1, 2, 3, 4, 8, 9, 10, 20, 24, 21, 28],
                     [-1, 0, 1, 2, 3, 4, 5, 6, 7, 24, 28, 20, 21]])
    selected = t([[0, 1, 4, 8, 20, 24, 36], [0, 4, 5, 6, 7, 24, 36]])
    out = build_tree(parent_list, selected, t([5, 10]), 4, 4, 8)
    assert out.positions.tolist() == [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]
    assert out.retrive_index.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7],
                                          [8, 9, 10, 11, 12, 13, 14, 15]]
    assert out.retrive_next_token.tolist() == [[1, 3, 4, 5, 6, 7, -1, -1],
                                               [1, 2, -1, 6, -1, -1, 7, -1]]
    assert out.retrive_next_sibling.tolist() == [[-1, 2, -1, -1, -1, -1, -1, -1],
                                                 [-1, -1, 3, 4, 5, -1, -1, -1]]
    # request 0 is two chains 0-1-3-5-7 and 0-2-4-6; request 1: 0-1-{2,3,4,5}, 3-6-7
    assert bits(out.tree_mask, 8) == [
        [0b1, 0b11, 0b101, 0b1011, 0b10101, 0b101011, 0b1010101, 0b10101011],
        [0b1, 0b11, 0b111, 0b1011, 0b10011, 0b100011, 0b1001011, 0b11001011]]


def test_missing_parent_is_unreachable():
    # topk=2, num_steps=2, selected [0, 2, 5]: draft 1 = flat 0 (root child), 2 = flat 2
    # (beam 1 -> flat 0 = draft 1), 3 = flat 5 (beam 2 -> flat 1: NOT selected -> missing).
    out = build_tree(t([[-1, 0, 1]]), t([[0, 2, 5]]), t([0]), 2, 2, 4)
    assert bits(out.tree_mask, 4) == [[1, 3, 7, 9]]  # orphan 3 sees {root, itself}
    assert out.positions.tolist() == [0, 1, 2, 1]
    assert out.retrive_next_token.tolist() == [[1, 2, -1, -1]]
    assert out.retrive_next_sibling.tolist() == [[-1, -1, -1, -1]]


def test_missing_parent_with_descendant():
    # topk=2, num_steps=3: step 1 flats 2..5 (beam 1: 2,3; beam 2: 4,5), step 2 flats 6..9
    # (beam 3: 6,7; beam 4: 8,9).  parent_list [-1, 0, 1, 4, 2]: beam 3 continues flat 4.
    # selected [0, 4, 6]: 1 = flat 0 (root child); 2 = flat 4 (beam 2 -> flat 1, not
    # selected: orphan); 3 = flat 6 (beam 3 -> flat 4 = draft 2: child of the orphan).
    out = build_tree(t([[-1, 0, 1, 4, 2]]), t([[0, 4, 6]]), t([10]), 2, 3, 4)
    assert bits(out.tree_mask, 4) == [[0b1, 0b11, 0b101, 0b1101]]
    assert out.positions.tolist() == [10, 11, 11, 12]
    # 3 hangs under 2, but 2 hangs under nothing: neither is reachable from the root
    assert out.retrive_next_token.tolist() == [[1, -1, 3, -1]]
    assert out.retrive_next_sibling.tolist() == [[-1, -1, -1, -1]]


def test_chain_topk1():
    # topk=1, num_steps=3: one candidate per step (flat 0, 1, 2), parent_list [-1, 0, 1]
    out = build_tree(t([[-1, 0, 1], [-1, 0, 1]]), t([[0, 1, 2], [0, 1, 2]]), t([4, 0]), 1, 3, 4)
    assert bits(out.tree_mask, 4) == [[1, 3, 7, 15]] * 2
    assert out.positions.tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    assert out.retrive_next_token.tolist() == [[1, 2, 3, -1]] * 2
    assert out.retrive_next_sibling.tolist() == [[-1] * 4] * 2


def test_root_only_bs1():
    out = build_tree(t([[-1, 0, 1]]), torch.zeros(1, 0, dtype=torch.int64), t([9]), 2, 2, 1)
    assert bits(out.tree_mask, 1) == [[1]]
    assert out.positions.tolist() == [9]
    assert out.retrive_index.tolist() == [[0]]
    assert out.retrive_next_token.tolist() == [[-1]]
    assert out.retrive_next_sibling.tolist() == [[-1]]


def test_int32_inputs_and_empty_batch():
    a = build_tree(t([[-1, 0, 1]]), t([[0, 1, 2, 4]]), t([7]), 2, 2, 5)
    b = build_tree(t([[-1, 0, 1]], torch.int32), t([[0, 1, 2, 4]], torch.int32),
                   t([7], torch.int32), 2, 2, 5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    e = build_tree(torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 4, dtype=torch.int64),
                   torch.zeros(0, dtype=torch.int64), 2, 2, 5)
    assert e.tree_mask.shape == (0, 5, 1) and e.positions.shape == (0,)


def test_wide_tree_uses_several_mask_words():
    # topk=8, num_steps=2: 8 + 64 candidates; D = 41 needs 2 words.  Root children flats
    # 0..7, then the 32 children of beams 1..4 (flats 8..39), parent_list [-1, 0..7].
    D = 41
    out = build_tree(t([[-1] + list(range(8))]), t([list(range(40))]), t([0]), 8, 2, D)
    assert out.tree_mask.shape == (1, D, num_mask_words(D)) == (1, 41, 2)
    dense = unpack_tree_mask(out.tree_mask, D)[0]
    # draft 40 = flat 39 = beam 4 (flats 32..39 -> 8 + 3*8 + 7): parent flat 3 = draft 4
    assert dense[40].nonzero().flatten().tolist() == [0, 4, 40]
    assert out.positions[40].item() == 2


def test_poisoned_outputs_fully_written():
    parent_list, selected = t([[-1, 0, 1], [-1, 0, 1]]), t([[0, 1, 2, 4], [0, 2, 3, 5]])
    seq = t([7, 3])
    want = build_tree(parent_list, selected, seq, 2, 2, 5)
    outs = [torch.full_like(x, -12345) for x in want]
    registry.dispatch("build_tree", "reference")(parent_list, selected, seq, *outs, 2, 2, 5)
    for x, y in zip(outs, want):
        assert torch.equal(x, y)
    assert registry.availability("build_tree")["reference"] is None


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(topk=0), ValueError, "topk"),
    (dict(topk=2.0), TypeError, "topk"),
    (dict(num_steps=0), ValueError, "num_steps"),
    (dict(num_draft_tokens=8), ValueError, "candidates"),  # 7 > 6 candidates
    (dict(num_draft_tokens=4), ValueError, "selected_index"),  # shape mismatch
    (dict(selected=[[0, 1, 2, 6]]), IndexError, "selected_index"),
    (dict(selected=[[0, 1, 2, 2]]), ValueError, "repeats"),
    (dict(parent_list=[[-1, 0, 2]]), ValueError, "parent_list"),  # 2 is not a step-0 flat
    (dict(parent_list=[[-1, 0]]), ValueError, "parent_list"),
    (dict(seq=[-1]), ValueError, "negative"),
    (dict(seq=[1, 2]), ValueError, "parent_list"),  # batch mismatch
    (dict(selected_dtype=torch.float32), ValueError, "dtype"),
])
def test_bad_input(kwargs, exc, msg):
    args = dict(parent_list=[[-1, 0, 1]], selected=[[0, 1, 2, 4]], seq=[7], topk=2, num_steps=2,
                num_draft_tokens=5, selected_dtype=torch.int64)
    args.update(kwargs)
    with pytest.raises(exc, match=msg):
        build_tree(t(args["parent_list"]), t(args["selected"], args["selected_dtype"]),
                   t(args["seq"]), args["topk"], args["num_steps"], args["num_draft_tokens"])


def test_bad_device_and_impl():
    with pytest.raises(ValueError, match="device|on "):
        build_tree(t([[-1, 0, 1]]).to("meta"), t([[0, 1, 2, 4]]), t([7]), 2, 2, 5)
    with pytest.raises(RuntimeError, match="unavailable"):
        build_tree(t([[-1, 0, 1]]), t([[0, 1, 2, 4]]), t([7]), 2, 2, 5, impl="cuda")


# ----------------------------------------------------------------------------- properties
def random_draft(rng: random.Random, bs, topk, num_steps, D, closed=False, sort=True):
    """Random EAGLE-shaped draft: per request a layered parent_list (each step keeps topk
    distinct candidates of the previous step) and D-1 distinct selected candidates.  With
    ``closed`` every selected candidate's parent is selected too (what real top-k scores give)."""
    n_cand = num_tree_candidates(topk, num_steps)
    pls, sels = [], []
    for _ in range(bs):
        pl = [-1] + (list(range(topk)) if num_steps > 1 else [])  # step-0 beams: all of step 0
        for s in range(1, num_steps - 1):
            base = topk + (s - 1) * topk * topk
            pl += rng.sample(range(base, base + topk * topk), topk)
        if closed:
            sel = set()
            while len(sel) < D - 1:
                ok = [f for f in range(n_cand) if f not in sel
                      and (f < topk or pl[f // topk] in sel)]
                sel.add(rng.choice(ok))
            sel = list(sel)
        else:
            sel = rng.sample(range(n_cand), D - 1)
        pls.append(pl)
        sels.append(sorted(sel) if sort else sel)
    return t(pls), t(sels).view(bs, D - 1)


def ancestors_by_flat_index(pl, sel, topk):
    """Independent oracle: walk flat candidate indices (f -> parent_list[f // topk]) and map
    them to draft indices; stop at the root or at an unselected candidate."""
    draft = {f: j + 1 for j, f in enumerate(sel)}
    rows, reachable = [], [True]
    for j in range(1, len(sel) + 1):
        chain, f, ok = [j], sel[j - 1], True
        while f >= topk:
            pf = pl[f // topk]
            if pf not in draft:
                ok = False
                break
            chain.append(draft[pf])
            f = pf
        rows.append(chain)
        reachable.append(ok)
    return [[0]] + rows, reachable


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bs=st.integers(1, 3), topk=st.integers(1, 3),
       num_steps=st.integers(1, 4), frac=st.floats(0, 1), closed=st.booleans(),
       sort=st.booleans())
def test_random_trees(seed, bs, topk, num_steps, frac, closed, sort):
    rng = random.Random(seed)
    n_cand = num_tree_candidates(topk, num_steps)
    D = 1 + round(frac * min(n_cand, 14))
    parent_list, selected = random_draft(rng, bs, topk, num_steps, D, closed, sort)
    seq = t([rng.randrange(0, 100) for _ in range(bs)], torch.int32)
    out = build_tree(parent_list, selected, seq, topk, num_steps, D)
    dense = unpack_tree_mask(out.tree_mask, D)
    assert out.retrive_index.tolist() == [list(range(b * D, b * D + D)) for b in range(bs)]
    for b in range(bs):
        rows, reachable = ancestors_by_flat_index(parent_list[b].tolist(),
                                                  selected[b].tolist(), topk)
        for j in range(D):
            # mask row = root + ancestors + itself; position = prefix + depth
            assert set(dense[b, j].nonzero().flatten().tolist()) == set(rows[j]) | {0}
            assert out.positions[b * D + j] == seq[b] + len(rows[j]) - int(j == 0)
            assert out.positions[b * D + j] == seq[b] + int(dense[b, j].sum()) - 1
        if sort:  # SGLang sorts selected_index: parents come first, the mask is lower-triangular
            assert not torch.triu(dense[b], diagonal=1).any()
        if closed:
            assert all(reachable)
        # the links reproduce the tree: every reachable node once, under its parent,
        # children in ascending order; unreachable nodes (missing parent) never
        nxt, sib = out.retrive_next_token[b].tolist(), out.retrive_next_sibling[b].tolist()
        seen, stack = [0], [0]
        while stack:
            p = stack.pop()
            kids, c = [], nxt[p]
            while c != -1:
                kids.append(c)
                c = sib[c]
            assert kids == sorted(kids)
            for c in kids:
                assert rows[c][1:2] == [p] or (p == 0 and len(rows[c]) == 1)
            seen += kids
            stack += kids
        assert sorted(seen) == [j for j in range(D) if reachable[j]]
