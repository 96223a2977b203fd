"""The PyTorch bench anchors (specattn.bench.torch_anchors) against the op references, and the
EAGLE tree bench cases (specattn.bench.cases_tree) built and run on the CPU.

Fresh random inputs each run (``seed`` fixture); int outputs compared exactly; the stochastic
verify's bonus token checked by a property (in the residual's support, consistent with its
cumulative sum within float rounding), since two float32 cumulative sums may round apart."""
import random
from types import SimpleNamespace

import pytest
import torch

from specattn.bench import cases_tree
from specattn.bench.cases import get_case
from specattn.bench.torch_anchors import (build_tree_torch, compact_accepted_path_torch,
                                          tree_parents, tree_speculative_sampling_torch,
                                          verify_tree_greedy_torch)
from specattn.ops.tree_mask import num_mask_words
from specattn.ops import (build_tree, compact_accepted_path, num_tree_candidates,
                          tree_speculative_sampling, verify_tree_greedy)
from test_triton_tree_ops import random_batch as _random_batch  # tests' random EAGLE trees


def random_batch(*args, **kw):
    """tests' ``random_batch``, on the CPU (the anchors are device-agnostic; the bench cases
    run them on the GPU)."""
    return tuple(x.cpu() for x in _random_batch(*args, **kw))


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype, x.shape, y.shape)
        assert x.device == y.device
        assert torch.equal(x, y), (x, y)


def random_sizes(rng, max_d=15):
    topk, num_steps = rng.randint(1, 4), rng.randint(1, 5)
    D = rng.randint(1, min(num_tree_candidates(topk, num_steps), max_d) + 1)
    return rng.randint(1, 5), topk, num_steps, D


def random_trees(rng, n, max_d=15, closed_every=2):
    for i in range(n):
        bs, topk, num_steps, D = random_sizes(rng, max_d)
        dtype = rng.choice([torch.int32, torch.int64])
        pl, sel, vsl = random_batch(rng, bs, topk, num_steps, D,
                                    closed=i % closed_every == 0, dtype=dtype)
        yield (pl, sel, vsl, topk, num_steps, D)


# ----------------------------------------------------------------------------- build_tree
def test_build_tree_torch_matches_reference(seed):
    rng = random.Random(seed)
    for args in random_trees(rng, 80, max_d=40):  # D > 32: two mask words
        assert_same(build_tree(*args, impl="reference"), build_tree_torch(*args))


def test_build_tree_torch_edge_cases(seed):
    rng = random.Random(seed)
    for topk, num_steps, D in [(1, 33, 33), (1, 1, 2), (3, 1, 4), (2, 3, 1), (8, 5, 64)]:
        for closed in (True, False):
            pl, sel, vsl = random_batch(rng, 2, topk, num_steps, D, closed=closed)
            assert_same(build_tree(pl, sel, vsl, topk, num_steps, D, impl="reference"),
                        build_tree_torch(pl, sel, vsl, topk, num_steps, D))
    # column 0 of parent_list is never read; an orphan (draft 3) with depth 1 from it
    pl = torch.tensor([[123456, 0, 1, 4, 2]])
    out = build_tree_torch(pl, torch.tensor([[0, 4, 6]]), torch.tensor([10]), 2, 3, 4)
    assert out.positions.tolist() == [10, 11, 11, 12]
    assert out.retrive_next_token.tolist() == [[1, -1, 3, -1]]
    assert out.tree_mask.shape == (1, 4, num_mask_words(4))


# ----------------------------------------------------------------------------- verify
def test_tree_parents_from_links(seed):
    rng = random.Random(seed)
    for pl, sel, vsl, topk, num_steps, D in random_trees(rng, 30, max_d=30):
        tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="reference")
        parent, to_tail = tree_parents(tree.retrive_next_token, tree.retrive_next_sibling)
        nxt, sib = tree.retrive_next_token.tolist(), tree.retrive_next_sibling.tolist()
        for b in range(len(nxt)):
            want_parent, want_tail = [-1] * D, [0] * D
            for p in range(D):
                chain, c = [], nxt[b][p]
                while c != -1:
                    chain.append(c)
                    c = sib[b][c]
                for k, c in enumerate(chain):
                    want_parent[c], want_tail[c] = p, len(chain) - 1 - k
            assert parent[b].tolist() == want_parent
            assert to_tail[b].tolist() == want_tail


def test_verify_greedy_torch_matches_reference(seed):
    rng = random.Random(seed)
    for i, (pl, sel, vsl, topk, num_steps, D) in enumerate(random_trees(rng, 80, 20, 3)):
        bs = pl.shape[0]
        tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="reference")
        vocab = rng.randint(1, 3)  # tiny vocab: many matches, duplicate sibling tokens
        dtype = rng.choice([torch.int32, torch.int64])
        cand = torch.randint(vocab, (bs, D), dtype=dtype)
        target = torch.randint(vocab, (bs, D), dtype=dtype)
        links = tuple(x.to(rng.choice([torch.int32, torch.int64])) for x in tree[2:])
        cap = rng.randint(0, num_steps + 1)
        ref = verify_tree_greedy(cand, *links, target, cap, impl="reference")
        assert_same(ref, verify_tree_greedy_torch(cand, *links, target, cap))


def test_verify_greedy_torch_first_matching_sibling_wins():
    # root's children 1, 2, 3 all carry token 5; the first (1) must be taken, then 4 (child
    # of 2) is unreachable although it matches
    tree = build_tree(torch.tensor([[-1, 0, 1, 2]]), torch.tensor([[0, 1, 2, 5]]),
                      torch.tensor([0]), 3, 2, 5, impl="reference")
    cand, target = torch.tensor([[0, 5, 5, 5, 7]]), torch.tensor([[5, 9, 7, 9, 9]])
    out = verify_tree_greedy_torch(cand, *tree[2:], target, 2)
    assert out.accept_length.tolist() == [1] and out.accept_index.tolist() == [[0, 1, -1]]
    assert out.predicts.tolist() == [5, 9, 0, 0, 0]
    assert_same(out, verify_tree_greedy(cand, *tree[2:], target, 2, impl="reference"))


def final_node_rejections(out, tree, cand, b, D, num_steps):
    """Final node of request b's walk and the tokens rejected there (all its children when
    the walk stopped before num_steps, else none)."""
    L = int(out.accept_length[b])
    node = int(out.accept_index[b, L]) - b * D
    rejected = []
    if L < num_steps:
        c = int(tree.retrive_next_token[b, node])
        while c != -1:
            rejected.append(int(cand[b, c]))
            c = int(tree.retrive_next_sibling[b, c])
    return node, rejected


def check_bonus(token, row, rejected, coin):
    """``token`` is a valid inverse-cdf draw at ``coin`` from ``relu(row)`` with the
    ``rejected`` tokens removed, within float32 rounding of the cumulative sum."""
    V = row.numel()
    res = row.double().clone()
    res[rejected] = 0.0
    res.clamp_(min=0.0)
    total = float(res.sum())
    u = float(coin) * total
    cdf = res.cumsum(0)
    tol = 1e-5 * total + 1e-30
    if token == V - 1 and (total == 0.0 or u >= float(cdf[-1]) - tol):
        return  # nothing exceeds the target value: FlashInfer's fallback d - 1
    assert 0 <= token < V
    assert res[token] > 0, (token, res, rejected)
    assert float(cdf[token]) >= u - tol, (token, cdf, u)
    assert token == 0 or float(cdf[token - 1]) <= u + tol, (token, cdf, u)


def random_probs(rng, bs, D, V):
    probs = torch.rand(bs, D, V)
    if rng.random() < 0.5:
        probs[torch.rand(bs, D, V) < 0.4] = 0.0  # zeros: support checks bite
    return probs / probs.sum(-1, keepdim=True).clamp(min=1e-30)


def test_sampling_torch_matches_reference(seed):
    rng = random.Random(seed)
    for i, (pl, sel, vsl, topk, num_steps, D) in enumerate(random_trees(rng, 80, 20, 3)):
        bs = pl.shape[0]
        tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="reference")
        V = rng.randint(1, 6)  # tiny vocab: duplicate sibling tokens
        cand = torch.randint(V, (bs, D), dtype=rng.choice([torch.int32, torch.int64]))
        probs = random_probs(rng, bs, D, V)
        coins, final = torch.rand(bs, D), torch.rand(bs)
        if rng.random() < 0.3:  # exact edge coins
            coins[torch.rand(bs, D) < 0.3] = rng.choice([0.0, 1.0])
            final[torch.rand(bs) < 0.5] = rng.choice([0.0, 1.0])
        ts = rng.choice([1.0, 1.0, rng.random(), 0.0])
        ta = rng.choice([1.0, 1.0, rng.random(), 0.0])
        cap = rng.randint(0, num_steps + 1)
        ref = tree_speculative_sampling(cand, *tree[2:], probs, cap, uniform_samples=coins,
                                        uniform_samples_for_final_sampling=final,
                                        threshold_single=ts, threshold_acc=ta,
                                        impl="reference")
        got = tree_speculative_sampling_torch(cand, *tree[2:], probs, cap, coins, final, ts, ta)
        assert_same(ref[1:], got[1:])  # accept_index, accept_length: exact
        assert got.predicts.dtype == torch.int32 and got.predicts.shape == (bs * D,)
        bonus_rows = ref.accept_index[torch.arange(bs), ref.accept_length.long()].long()
        mask = torch.ones(bs * D, dtype=torch.bool)
        mask[bonus_rows] = False
        assert torch.equal(ref.predicts[mask], got.predicts[mask])  # path tokens and zeros
        for b in range(bs):
            node, rejected = final_node_rejections(got, tree, cand, b, D, cap)
            check_bonus(int(got.predicts[bonus_rows[b]]), probs[b, node], rejected, final[b])


def test_sampling_torch_max_children_bound_exact_on_eagle_trees(seed):
    # EAGLE trees have at most topk children per node: max_children=topk is then exact
    rng = random.Random(seed)
    for _ in range(20):
        topk, num_steps = rng.randint(1, 4), rng.randint(1, 4)
        D = rng.randint(1, min(num_tree_candidates(topk, num_steps), 15) + 1)
        bs = rng.randint(1, 4)
        pl, sel, vsl, _ = cases_tree.random_eagle_batch(rng, bs, topk, num_steps, D)
        tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="reference")
        V = rng.randint(1, 5)
        cand = torch.randint(V, (bs, D))
        probs = random_probs(rng, bs, D, V)
        coins, final = torch.rand(bs, D), torch.rand(bs)
        full = tree_speculative_sampling_torch(cand, *tree[2:], probs, num_steps, coins, final)
        short = tree_speculative_sampling_torch(cand, *tree[2:], probs, num_steps, coins, final,
                                                max_children=topk)
        assert_same(full, short)


def test_sampling_torch_hand_case():
    # root (token 0) with children 1 (token 0) and 2 (token 1); q_root = [.25, .25, .5]
    tree = build_tree(torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1]]), torch.tensor([0]),
                      2, 2, 3, impl="reference")
    cand = torch.tensor([[0, 0, 1]])
    probs = torch.tensor([[[0.25, 0.25, 0.5], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])
    # coin 0.45: child 1 (cum .25) rejected, child 2 (cum .5) accepted; leaf: bonus from q_2
    out = tree_speculative_sampling_torch(cand, *tree[2:], probs, 2, torch.tensor([[0.45, 0, 0]]),
                                          torch.tensor([0.3]))
    assert out.accept_length.tolist() == [1] and out.accept_index.tolist() == [[0, 2, -1]]
    assert out.predicts.tolist() == [1, 0, 2]
    # coin 0.9: both rejected; residual [0, 0, .5] -> token 2 whatever the final coin
    out = tree_speculative_sampling_torch(cand, *tree[2:], probs, 2, torch.tensor([[0.9, 0, 0]]),
                                          torch.tensor([0.01]))
    assert out.accept_length.tolist() == [0] and out.predicts.tolist() == [2, 0, 0]


# ----------------------------------------------------------------------------- compaction
def test_compaction_torch_matches_reference(seed):
    rng = random.Random(seed)
    for pl, sel, vsl, topk, num_steps, D in random_trees(rng, 60, 15, 1):
        bs = pl.shape[0]
        tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="reference")
        cand, target = torch.randint(2, (bs, D)), torch.randint(2, (bs, D))
        pred, ai, al = verify_tree_greedy(cand, *tree[2:], target, rng.randint(0, num_steps),
                                          impl="reference")
        if rng.random() < 0.5:
            ai, al = ai.long(), al.long()
        ocl = torch.randperm(bs * D + 7)[:bs * D].to(rng.choice([torch.int32, torch.int64]))
        predicts = pred if rng.random() < 0.7 else None
        hidden = rng.choice([None, torch.randn(bs * D, rng.randint(1, 9)),
                             torch.randn(bs * D, 2, 3).to(torch.bfloat16)])
        ref = compact_accepted_path(ai, al, ocl, D, predicts=predicts, hidden_states=hidden,
                                    impl="reference")
        assert_same(ref, compact_accepted_path_torch(ai, al, ocl, D, predicts, hidden))


# ----------------------------------------------------------------------------- bench cases
SMALL = {
    "tree_build": dict(bs=3, topk=3, num_steps=4, num_draft_tokens=12, input_sets=3),
    "verify_greedy": dict(bs=6, num_draft_tokens=12, topk=3, num_steps=4, vocab=50,
                          input_sets=3),
    "verify_sampling": dict(bs=5, num_draft_tokens=10, topk=3, num_steps=3, vocab=40,
                            input_sets=2),
    "compaction": dict(bs=4, num_draft_tokens=8, num_steps=3, hidden=16, vocab=100,
                       input_sets=3),
}


def run_case(name, impl, **kw):
    wl = get_case(name).build("cpu", impl=impl, **{**SMALL[name], **kw})
    return wl, [call() for call in wl.calls()]


@pytest.mark.parametrize("name", sorted(SMALL))
def test_tree_cases_torch_equals_reference_on_cpu(name, seed):
    wl_ref, ref = run_case(name, "reference", seed=seed)
    wl_t, got = run_case(name, "torch", seed=seed)
    wl_auto, auto = run_case(name, "auto", seed=seed)  # auto on the CPU: the reference
    assert len(ref) == len(got) == len(auto) == SMALL[name]["input_sets"]
    for r, g, a, inputs in zip(ref, got, auto, wl_t.input_sets):
        assert_same(r, a)
        if name == "verify_sampling":
            assert_same(r[1:], g[1:])
            cand, ridx, nxt, sib, probs, coins, final = inputs
            bs, D = cand.shape
            links = SimpleNamespace(retrive_next_token=nxt, retrive_next_sibling=sib)
            for b in range(bs):
                row = int(g.accept_index[b, g.accept_length[b]])
                node, rejected = final_node_rejections(g, links, cand, b, D,
                                                       SMALL[name]["num_steps"])
                check_bonus(int(g.predicts[row]), probs[b, node], rejected, final[b])
        else:
            assert_same(r, g)
    # the same seed gives the same inputs; input sets differ from each other
    for a, b in zip(wl_ref.input_sets, wl_t.input_sets):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(wl_t.input_sets[0][0], wl_t.input_sets[1][0])


def test_tree_case_bytes():
    wl, _ = run_case("tree_build", "torch")
    bs, D, topk, ns = 3, 12, 3, 4
    width = topk * (ns - 1) + 1
    assert wl.bytes == 8 * bs * (width + D - 1 + 1) + bs * D * (4 * 1 + 8 + 3 * 8)
    wl, _ = run_case("verify_greedy", "torch")
    bs, D, S = 6, 12, 5
    assert wl.bytes == 5 * bs * D * 8 + 4 * (bs * D + bs * S + bs)
    wl, _ = run_case("verify_sampling", "torch")
    bs, D, S, V = 5, 10, 4, 40
    assert wl.bytes == 4 * bs * D * 8 + 4 * bs * D + 4 * bs + 4 * bs * V + 4 * (bs * D + bs * S + bs)
    wl, _ = run_case("compaction", "torch")
    bs, D, S, H = 4, 8, 4, 16
    reads = 8 * bs * S + 8 * bs + 8 * bs * D + 4 * bs * D + 2 * bs * D * H
    writes = 8 * bs * D + 4 * bs * D + 2 * bs * D * H + 3 * 8 * bs * D
    assert wl.bytes == reads + writes
    assert wl.input_sets[0][4].dtype == torch.bfloat16


def test_tree_cases_inputs_are_valid_and_mixed():
    wl, outs = run_case("verify_greedy", "reference", bs=32, input_sets=2)
    lengths = torch.cat([o.accept_length for o in outs])
    assert len(set(lengths.tolist())) >= 3  # mixed accepted lengths
    wl, _ = run_case("compaction", "reference", bs=64)
    for ai, al, ocl, predicts, hs in wl.input_sets:
        assert len(set(al.tolist())) >= 3
        assert torch.unique(ocl).numel() == ocl.numel()
    # the generator's closed trees: every selected candidate's parent is selected
    rng = random.Random(0)
    for _ in range(20):
        pl, sel, parents = cases_tree.random_eagle_tree(rng, 4, 4, 20)
        assert None not in parents[1:] and all(p < j for j, p in enumerate(parents) if j)
        assert sel == sorted(sel) and len(set(sel)) == 19


def test_tree_cases_impl_validation_and_eager_only(monkeypatch):
    with pytest.raises(ValueError, match="impl"):
        get_case("tree_build").build("cpu", impl="nope", **SMALL["tree_build"])
    # the reference (and auto, which is the reference on the CPU) refuses graph capture
    # before doing any work; the torch anchor does not
    monkeypatch.setattr(cases_tree, "capturing", lambda: True)
    for name in SMALL:
        for impl in ("reference", "auto"):
            wl = get_case(name).build("cpu", impl=impl, **SMALL[name])
            with pytest.raises(cases_tree.NotCapturable, match="host syncs"):
                wl.calls()[0]()
        wl = get_case(name).build("cpu", impl="torch", **SMALL[name])
        wl.calls()[0]()
