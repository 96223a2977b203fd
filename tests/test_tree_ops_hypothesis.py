"""Hypothesis-driven random EAGLE trees: build_tree / verify_tree_greedy /
compact_accepted_path with impl="triton" against impl="reference" (exact), the PyTorch bench
anchors against the reference, and properties that do not lean on the reference.

On a CPU-only machine the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is imported), so shapes stay small (bs <= 3, D <= 12)."""
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specattn.ops.tree_mask import unpack_tree_mask  # noqa: E402
from specattn.bench.torch_anchors import (build_tree_torch,  # noqa: E402
                                          compact_accepted_path_torch,
                                          tree_speculative_sampling_torch,
                                          verify_tree_greedy_torch)
from specattn.ops import (TreeInfo, build_tree, compact_accepted_path,  # noqa: E402
                          num_tree_candidates, tree_speculative_sampling, verify_tree_greedy)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(x.cpu(), y.cpu()), (x, y)


# ----------------------------------------------------------------------------- strategies
@st.composite
def eagle_trees(draw, max_bs=3, max_d=12):
    """A batch of EAGLE trees as build_tree takes them, plus the drawn sizes.

    parent_list: column 0 arbitrary (never read), block ``s`` ``topk`` distinct step-``s``
    candidates; selected: closed (every parent selected) or not (missing parents), in any
    order; verified_seq_len in [0, 1e6]; index dtype int32 or int64."""
    topk = draw(st.integers(1, 4))
    num_steps = draw(st.integers(1, 4))
    n_cand = num_tree_candidates(topk, num_steps)
    D = draw(st.integers(1, min(n_cand + 1, max_d)))
    bs = draw(st.integers(1, max_bs))
    closed = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    pls, sels = [], []
    for _ in range(bs):
        pl = [draw(st.sampled_from([-1, -1, 0, n_cand - 1]))]
        for s in range(num_steps - 1):
            lo = 0 if s == 0 else topk + (s - 1) * topk * topk
            pl += draw(st.permutations(range(lo, topk + s * topk * topk)))[:topk]
        if closed:
            sel, eligible = [], set(range(topk))
            for _ in range(D - 1):
                f = draw(st.sampled_from(sorted(eligible)))
                eligible.discard(f)
                sel.append(f)
                eligible |= {g for g in range(topk, n_cand)
                             if g not in sel and pl[g // topk] == f}
        else:
            sel = draw(st.lists(st.integers(0, n_cand - 1), min_size=D - 1, max_size=D - 1,
                                unique=True))
        if draw(st.booleans()):
            sel.sort()  # SGLang sorts; any order is valid input
        pls.append(pl)
        sels.append(sel)
    vsl = draw(st.lists(st.integers(0, 10 ** 6), min_size=bs, max_size=bs))
    t = lambda x: torch.tensor(x, dtype=dtype, device=DEV)  # noqa: E731
    return dict(pl=t(pls), sel=t(sels).view(bs, D - 1), vsl=t(vsl), topk=topk,
                num_steps=num_steps, D=D, bs=bs, dtype=dtype)


def tokens(draw, bs, D, vocab, dtype):
    return torch.tensor(draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=D,
                                               max_size=D), min_size=bs, max_size=bs)),
                        dtype=dtype, device=DEV).view(bs, D)


@st.composite
def verify_inputs(draw):
    """A tree (its reference build_tree links, as int32 or int64), draft and target tokens
    from a tiny vocab (duplicate sibling tokens, many matches), a step cap in
    [0, num_steps + 1]."""
    tr = draw(eagle_trees())
    bs, D = tr["bs"], tr["D"]
    tree = build_tree(tr["pl"], tr["sel"], tr["vsl"], tr["topk"], tr["num_steps"], D,
                      impl="reference")
    link_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    tree = TreeInfo(*tree[:2], *(x.to(link_dtype) for x in tree[2:]))
    vocab = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    cand = tokens(draw, bs, D, vocab, dtype)
    target = tokens(draw, bs, D, vocab, dtype)
    cap = draw(st.integers(0, tr["num_steps"] + 1))
    return tr, tree, cand, target, cap


# ----------------------------------------------------------------------------- helpers
def input_parents(tr):
    """Per request, the parent draft of every draft token from the EAGLE encoding (None for
    the root and for a missing parent)."""
    out = []
    for pl, sel in zip(tr["pl"].tolist(), tr["sel"].tolist()):
        draft_of = {f: j + 1 for j, f in enumerate(sel)}
        out.append([None] + [0 if f // tr["topk"] == 0 else draft_of.get(pl[f // tr["topk"]])
                             for f in sel])
    return out


def children(tree, b, node):
    """Children of ``node`` in request ``b`` in sibling order (asserting no cycle)."""
    D = tree.retrive_next_token.shape[1]
    out, c = [], int(tree.retrive_next_token[b, node])
    while c != -1:
        out.append(c)
        assert len(out) <= D, "cyclic sibling chain"
        c = int(tree.retrive_next_sibling[b, c])
    return out


# ----------------------------------------------------------------------------- build_tree
@SETTINGS
@given(eagle_trees())
def test_build_tree_triton_and_anchor_match_reference(tr):
    args = (tr["pl"], tr["sel"], tr["vsl"], tr["topk"], tr["num_steps"], tr["D"])
    ref = build_tree(*args, impl="reference")
    assert_same(ref, build_tree(*args, impl="triton"))
    assert_same(ref, build_tree_torch(*args))

    # properties, without the reference's help
    bs, D = tr["bs"], tr["D"]
    dense = unpack_tree_mask(ref.tree_mask.cpu(), D)
    pos = ref.positions.cpu().view(bs, D)
    vsl = tr["vsl"].cpu().long()
    ar = torch.arange(D)
    assert dense[:, :, 0].all() and dense[:, ar, ar].all()  # root bit, own bit
    assert torch.equal(pos, vsl[:, None] + dense.sum(-1) - 1)
    assert torch.equal(ref.retrive_index.cpu(), torch.arange(bs * D).view(bs, D))
    for b, parents in enumerate(input_parents(tr)):
        for p in range(D):  # child lists = the encoding's parents, ascending; orphans in none
            assert children(ref, b, p) == [j for j in range(D) if parents[j] == p]
        reachable = {0}
        for j in range(1, D):  # reachable: its parent chain ends at the root
            k, seen = j, 0
            while k not in (0, None) and seen <= D:
                k, seen = parents[k], seen + 1
            if k == 0:
                reachable.add(j)
        visited, stack = [0], [0]  # the links form a tree over exactly the reachable nodes
        while stack:
            p = stack.pop()
            for c in children(ref, b, p):
                assert torch.equal(dense[b, c], dense[b, p] | (ar == c))
                assert pos[b, c] == pos[b, p] + 1
                visited.append(c)
                stack.append(c)
        assert len(visited) == len(set(visited)) and set(visited) == reachable


# ----------------------------------------------------------------------------- verify
@SETTINGS
@given(verify_inputs())
def test_verify_greedy_triton_and_anchor_match_reference(inputs):
    tr, tree, cand, target, cap = inputs
    links = tuple(tree[2:])
    ref = verify_tree_greedy(cand, *links, target, cap, impl="reference")
    assert_same(ref, verify_tree_greedy(cand, *links, target, cap, impl="triton"))
    assert_same(ref, verify_tree_greedy_torch(cand, *links, target, cap))

    # properties: a path of links whose tokens match the target at their parent, the first
    # match in sibling order, stopped by the cap or by no match; predicts only on the path
    bs, D = cand.shape
    pred, acc, n = (x.cpu() for x in ref)
    tgt = target.cpu().flatten()
    expected_pred = torch.zeros(bs * D, dtype=torch.int32)
    for b in range(bs):
        L = int(n[b])
        assert 0 <= L <= cap
        assert (acc[b, L + 1:] == -1).all()
        rows = acc[b, :L + 1].tolist()
        assert rows[0] == b * D
        node = 0
        for k in range(1, L + 1):
            c = rows[k] - b * D
            kids = children(tree, b, node)
            assert c in kids
            assert int(cand[b, c]) == int(tgt[rows[k - 1]])
            assert all(int(cand[b, x]) != int(tgt[rows[k - 1]]) for x in kids[:kids.index(c)])
            node = c
        if L < cap:
            assert all(int(cand[b, x]) != int(tgt[rows[L]]) for x in children(tree, b, node))
        for r in rows:
            expected_pred[r] = tgt[r]
    assert torch.equal(pred, expected_pred)


@SETTINGS
@given(verify_inputs(), st.data())
def test_sampling_anchor_matches_reference(inputs, data):
    tr, tree, cand, _, cap = inputs
    bs, D = cand.shape
    V = int(cand.max()) + 1 + data.draw(st.integers(0, 2))
    probs = torch.rand(bs, D, V, device=DEV)
    probs[torch.rand(bs, D, V, device=DEV) < 0.3] = 0.0
    probs /= probs.sum(-1, keepdim=True).clamp(min=1e-30)
    coins = torch.rand(bs, D, device=DEV)
    final = torch.rand(bs, device=DEV)
    ts = data.draw(st.sampled_from([1.0, 0.0, 0.3, 0.9]))
    ta = data.draw(st.sampled_from([1.0, 0.0, 0.5]))
    links = tuple(tree[2:])
    ref = tree_speculative_sampling(cand, *links, probs, cap, uniform_samples=coins,
                                    uniform_samples_for_final_sampling=final,
                                    threshold_single=ts, threshold_acc=ta, impl="reference")
    got = tree_speculative_sampling_torch(cand, *links, probs, cap, coins, final, ts, ta)
    assert_same(ref[1:], got[1:])
    bonus = ref.accept_index.long()[torch.arange(bs), ref.accept_length.long()]
    keep = torch.ones(bs * D, dtype=torch.bool, device=DEV)
    keep[bonus] = False
    assert torch.equal(ref.predicts[keep], got.predicts[keep])
    for b in range(bs):  # the bonus: in the residual's support (or the V-1 fallback)
        L = int(got.accept_length[b])
        node = int(got.accept_index[b, L]) - b * D
        res = probs[b, node].double().cpu().clone()
        if L < cap:
            res[[int(cand[b, c]) for c in children(tree, b, node)]] = 0.0
        tok = int(got.predicts[bonus[b]])
        assert 0 <= tok < V
        assert res[tok] > 0 or tok == V - 1


# ----------------------------------------------------------------------------- compaction
@SETTINGS
@given(verify_inputs(), st.data())
def test_compaction_triton_and_anchor_match_reference(inputs, data):
    tr, tree, cand, target, cap = inputs
    bs, D = cand.shape
    cap = min(cap, D - 1)
    pred, ai, al = verify_tree_greedy(cand, *tree[2:], target, cap, impl="reference")
    if data.draw(st.booleans()):
        ai, al = ai.long(), al.long()
    odt = data.draw(st.sampled_from([torch.int32, torch.int64]))
    ocl = torch.randperm(bs * D + 5, device=DEV)[:bs * D].to(odt)
    predicts = pred if data.draw(st.booleans()) else None
    kind = data.draw(st.sampled_from(["none", "f32", "bf16"]))
    hidden = {"none": None,
              "f32": torch.randn(bs * D, data.draw(st.integers(1, 9)), device=DEV),
              "bf16": torch.randn(bs * D, 2, 3, device=DEV).to(torch.bfloat16)}[kind]
    ref = compact_accepted_path(ai, al, ocl, D, predicts=predicts, hidden_states=hidden,
                                impl="reference")
    assert_same(ref, compact_accepted_path(ai, al, ocl, D, predicts=predicts,
                                           hidden_states=hidden, impl="triton"))
    assert_same(ref, compact_accepted_path_torch(ai, al, ocl, D, predicts, hidden))

    # properties: the path at each block's front, the rest of the block in place
    src = ref.src_index.cpu().view(bs, D)
    for b in range(bs):
        n = int(al[b]) + 1
        assert src[b, :n].tolist() == ai[b, :n].long().tolist()
        assert src[b, n:].tolist() == list(range(b * D + n, b * D + D))
    assert torch.equal(ref.tgt_loc, ocl)
    assert torch.equal(ref.src_loc, ocl[ref.src_index])
    assert torch.equal(ref.out_cache_loc, ref.src_loc)
