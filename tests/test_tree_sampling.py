"""Stochastic tree verification (tree_speculative_sampling): the Triton and CUDA kernels
against the reference, on fresh random EAGLE trees, with poisoned outputs.

accept_index / accept_length and the accepted drafts in predicts must match exactly (the
acceptance test is float32 in sibling order everywhere).  The bonus token is checked with a
property robust to float rounding: it has a positive residual and u * total lies between
the float64 cdf before and at it (within 1e-5 relative); away from a boundary it must equal
the reference's.  On a CPU-only machine the Triton kernel runs in Triton's interpreter
(small shapes); the CUDA tests need a GPU and the built extension.
"""
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from test_triton_tree_ops import random_batch  # noqa: E402

from specattn.ops import (build_tree, num_tree_candidates, registry,  # noqa: E402
                          tree_speculative_sampling)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OP = "tree_speculative_sampling"
POISON = -7777
REL_TOL = 1e-5


def _available(impl):
    return registry.availability(OP)[impl] is None


needs_cuda_op = pytest.mark.skipif(
    not torch.cuda.is_available() or not _available("cuda"),
    reason=f"CUDA op unavailable: {registry.availability(OP)['cuda']}")
# the small-shape tests run every kernel there is: Triton (interpreted on CPU), CUDA on a GPU
IMPLS = ["triton", "cuda"]


def _skip_unavailable(impl):
    if not _available(impl) or (impl == "cuda" and DEV != "cuda"):
        pytest.skip(f"{impl} unavailable: {registry.availability(OP)[impl] or 'no GPU'}")


def _tile_kw(impl, rng, choices=(None, 16, 32)):
    """Small vocabulary tiles for Triton (several tiles, V not a multiple of the tile)."""
    return {"block_v": rng.choice(choices)} if impl == "triton" else {}


# ----------------------------------------------------------------------------- helpers
def links(tree):
    return tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling


def run_impl(impl, cand, tree, coins, final, probs, num_steps, th_s, th_a, draft, **kw):
    """The raw implementation (positional arguments of the reference) on poisoned outputs."""
    bs, D = cand.shape
    outs = [torch.full((bs * D,), POISON, dtype=torch.int32, device=cand.device),
            torch.full((bs, num_steps + 1), POISON, dtype=torch.int32, device=cand.device),
            torch.full((bs,), POISON, dtype=torch.int32, device=cand.device)]
    registry.dispatch(OP, impl, cand.device)(*outs, cand, *links(tree), coins, final, probs,
                                             th_s, th_a, draft, **kw)
    return outs


def children(tree, b, node):
    nxt, sib = tree.retrive_next_token[b].tolist(), tree.retrive_next_sibling[b].tolist()
    out, c = [], nxt[node]
    while c != -1:
        out.append(c)
        c = sib[c]
    return out


def residual_f32(probs, draft, cand, tree, b, node, n, num_steps):
    """relu(q - p) in float32 at the final node (independently of the reference): p is the
    draft row unless num_steps drafts were accepted; a final node with children that was not
    stopped by the cap rejected all of them (their tokens get 0)."""
    r = probs[b, node].clone()
    if draft is not None and n != num_steps:
        r = r - draft[b, node]
    if n != num_steps:
        kids = children(tree, b, node)
        if kids:
            r[cand[b, kids].long()] = 0.0
    return r.clamp(min=0.0)


def check_bonus(t, t_ref, r32, coin):
    """The bonus token ``t`` of a kernel against the float64 inversion of ``r32``."""
    r = r32.double().cpu()
    V = r.numel()
    total = float(r.sum())
    if total == 0.0:
        assert t == V - 1 and t_ref == V - 1
        return
    assert 0 <= t < V and r[t] > 0, (t, float(r[t]) if 0 <= t < V else None)
    cdf = r.cumsum(0)
    u, tol = coin * total, REL_TOL * total
    lo = float(cdf[t - 1]) if t > 0 else 0.0
    assert lo <= u + tol and float(cdf[t]) >= u - tol, (t, lo, float(cdf[t]), u)
    lo_ref = float(cdf[t_ref - 1]) if t_ref > 0 else 0.0
    if abs(lo_ref - u) > tol and abs(float(cdf[t_ref]) - u) > tol:
        assert t == t_ref, (t, t_ref)


def compare(impl, cand, tree, coins, final, probs, num_steps, th_s=1.0, th_a=1.0, draft=None,
            **kw):
    """Run the reference and ``impl``; exact on the path, property on the bonus."""
    bs, D = cand.shape
    draft_before = None if draft is None else draft.clone()
    ref = run_impl("reference", cand, tree, coins, final, probs, num_steps, th_s, th_a, draft)
    got = run_impl(impl, cand, tree, coins, final, probs, num_steps, th_s, th_a, draft, **kw)
    if draft is not None:
        assert torch.equal(draft, draft_before), "draft_probs was written"
    pred_r, acc_r, n_r = (x.cpu() for x in ref)
    pred_g, acc_g, n_g = (x.cpu() for x in got)
    assert torch.equal(n_g, n_r), (n_g, n_r)
    assert torch.equal(acc_g, acc_r), (acc_g, acc_r)
    bonus_rows = acc_r[torch.arange(bs), n_r.long()].long()
    keep = torch.ones(bs * D, dtype=torch.bool)
    keep[bonus_rows] = False
    assert torch.equal(pred_g[keep], pred_r[keep])
    probs_c, draft_c, cand_c, tree_c = (probs.cpu(), None if draft is None else draft.cpu(),
                                        cand.cpu(), _cpu_tree(tree))
    for b in range(bs):
        n = int(n_r[b])
        node = int(acc_r[b, n]) - b * D  # retrive_index = b * D + local index
        r32 = residual_f32(probs_c, draft_c, cand_c, tree_c, b, node, n, num_steps)
        check_bonus(int(pred_g[bonus_rows[b]]), int(pred_r[bonus_rows[b]]), r32,
                    float(final[b]))
    return ref, got


def _cpu_tree(tree):
    return type(tree)(*(x.cpu() if isinstance(x, torch.Tensor) else x for x in tree))


def random_probs(gen, bs, D, V, hot, sparse):
    """Peaked random laws (mass on the `hot` tokens so drafts get accepted) on ``gen``'s
    device; `sparse` zeroes a random half of the vocabulary per row (top-k / top-p like)."""
    dev = gen.device
    logits = torch.randn(bs, D, V, generator=gen, device=dev) * 2
    logits[:, :, hot] += 5.0
    p = torch.softmax(logits, -1)
    if sparse:
        p = p * (torch.rand(bs, D, V, generator=gen, device=dev) < 0.5)
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
    return p


def random_case(rng, gen, bs, topk, num_steps, D, V, *, closed=True, idx_dtype=torch.int64,
                dev=DEV):
    """A random batch on ``dev``: tree, candidate tokens (mostly a few hot tokens: frequent
    accepts and duplicate siblings), target / draft laws (large ones drawn on ``dev``),
    coins (sometimes exactly 0 or 1) and a num_steps cap in ``[0, num_steps + 1]``."""
    pl, sel, vsl = random_batch(rng, bs, topk, num_steps, D, closed=closed, dtype=idx_dtype)
    tree = build_tree(pl.to(dev), sel.to(dev), vsl.to(dev), topk, num_steps, D, impl="reference")
    mixed = rng.random() < 0.3  # int32 / int64 index tensors mixed
    tree = tree._replace(**{k: getattr(tree, k).to(rng.choice([torch.int32, torch.int64])
                                                   if mixed else idx_dtype)
                            for k in ("retrive_index", "retrive_next_token",
                                      "retrive_next_sibling")})
    hot = rng.sample(range(V), min(V, rng.choice([2, 3, 5])))
    cand = torch.tensor([[rng.choice(hot) if rng.random() < 0.85 else rng.randrange(V)
                          for _ in range(D)] for _ in range(bs)],
                        dtype=rng.choice([torch.int32, torch.int64]) if mixed else idx_dtype,
                        device=dev)
    dgen = torch.Generator(device=dev).manual_seed(rng.randrange(2 ** 62))
    probs = random_probs(dgen, bs, D, V, hot, sparse=rng.random() < 0.3)
    if rng.random() < 0.25:  # rows padded to V + 1..3: not 16-byte aligned (CUDA scalar path)
        probs = torch.zeros(bs, D, V + rng.randint(1, 3), device=dev).narrow(2, 0, V).copy_(probs)
    coins = torch.rand(bs, D, generator=gen)
    final = torch.rand(bs, generator=gen)
    if rng.random() < 0.3:  # exact 0 / 1 coins
        coins[torch.rand(bs, D, generator=gen) < 0.3] = 0.0
        coins[torch.rand(bs, D, generator=gen) < 0.3] = 1.0
        final[torch.rand(bs, generator=gen) < 0.5] = rng.choice([0.0, 1.0])
    draft = None
    kind = rng.randrange(3)
    if kind == 1:  # p > q in places
        draft = probs * torch.rand(bs, D, V, generator=dgen, device=dev) * 1.5
    elif kind == 2:
        draft = torch.rand(bs, D, V, generator=dgen, device=dev) / V
    cap = rng.randint(0, num_steps + 1)
    return cand, tree, coins.to(dev), final.to(dev), probs, cap, draft


def random_thresholds(rng):
    k = rng.randrange(4)
    if k < 2:
        return 1.0, 1.0
    if k == 2:
        return rng.random(), rng.random()
    return rng.choice([0.0, 1.0]), rng.choice([0.0, 1e-12, 0.5])


# ----------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference_random(impl, seed):
    _skip_unavailable(impl)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for i in range(50):
        bs, topk, num_steps = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4)
        D = rng.randint(1, min(num_tree_candidates(topk, num_steps), 11) + 1)
        V = rng.choice([5, 7, 33, 300])
        cand, tree, coins, final, probs, cap, draft = random_case(
            rng, gen, bs, topk, num_steps, D, V, closed=i % 3 != 0,
            idx_dtype=rng.choice([torch.int32, torch.int64]))
        th_s, th_a = random_thresholds(rng)
        compare(impl, cand, tree, coins, final, probs, cap, th_s, th_a, draft,
                **_tile_kw(impl, rng))


def dyadic_case(rng, gen, bs, topk, num_steps, D, V, dev=DEV):
    """Probabilities k/16 and coins k/8: every sum in any order is exact in float32 (V up to
    a few 10^5), so the kernels must equal the reference bit for bit, bonus included, with u
    often exactly on a cdf boundary (``cdf > u``, not ``>=``) and coins exactly equal to
    cumulative sums."""
    pl, sel, vsl = random_batch(rng, bs, topk, num_steps, D)
    tree = build_tree(pl, sel, vsl, topk, num_steps, D, impl="reference")
    dgen = torch.Generator(device=dev).manual_seed(rng.randrange(2 ** 62))
    w = torch.randint(0, 3, (bs, D, V), generator=dgen, device=dev).float()
    if V > 64:  # long zero runs (top-k like) in half of the rows
        rows = torch.rand(bs, D, generator=dgen, device=dev) < 0.5
        w[rows] *= torch.rand(V, generator=dgen, device=dev) < 0.01
    w[..., 0] += (w.sum(-1) == 0).float()  # at least one positive entry per row
    probs = w / 16
    hot = torch.randint(0, V, (4,), generator=gen)
    cand = hot[torch.randint(0, 4, (bs, D), generator=gen)].to(dev)
    coins = (torch.randint(0, 9, (bs, D), generator=gen) / 8).to(dev)
    final = (torch.randint(0, 9, (bs,), generator=gen) / 8).to(dev)
    draft = None
    if rng.random() < 0.5:
        draft = torch.randint(0, 3, (bs, D, V), generator=dgen, device=dev) / 32
    return cand, tree, coins, final, probs, rng.randint(0, num_steps), draft


def check_dyadic(impl, rng, gen, bs, topk, num_steps, D, V, **kw):
    cand, tree, coins, final, probs, cap, draft = dyadic_case(rng, gen, bs, topk, num_steps, D,
                                                              V)
    ref = run_impl("reference", cand, tree, coins, final, probs, cap, 1.0, 1.0, draft)
    got = run_impl(impl, cand, tree, coins, final, probs, cap, 1.0, 1.0, draft, **kw)
    for x, y in zip(ref, got):
        assert torch.equal(x.cpu(), y.cpu()), (x, y)


@pytest.mark.parametrize("impl", IMPLS)
def test_dyadic_exact(impl, seed):
    _skip_unavailable(impl)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(25):
        bs, topk, num_steps = rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 3)
        D = rng.randint(2, min(num_tree_candidates(topk, num_steps), 8) + 1)
        check_dyadic(impl, rng, gen, bs, topk, num_steps, D, rng.choice([4, 6, 19, 40]),
                     **_tile_kw(impl, rng, (None, 16)))


def chain(bs, D, dev=DEV):
    return build_tree(torch.tensor([[-1] + list(range(D - 2))] * bs, device=dev),
                      torch.tensor([list(range(D - 1))] * bs, device=dev),
                      torch.zeros(bs, dtype=torch.int64, device=dev), 1, D - 1, D)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_none_accepted_and_cap(impl, seed):
    _skip_unavailable(impl)
    kw = {"block_v": 16} if impl == "triton" else {}
    gen = torch.Generator().manual_seed(seed)
    D, V = 6, 40
    tree = chain(2, D)
    cand = torch.randint(0, V, (2, D), generator=gen).to(DEV)
    probs = torch.softmax(torch.randn(2, D, V, generator=gen), -1).to(DEV)
    final = torch.rand(2, generator=gen).to(DEV)
    # threshold_single 0: every child accepted -> full depth, or the num_steps cap
    for cap in (D - 1, 2, 0, D + 3):
        _, (pred, acc, n) = compare(impl, cand, tree, torch.rand(2, D, device=DEV), final,
                                    probs, cap, 0.0, 1.0, **kw)
        assert n.tolist() == [min(cap, D - 1)] * 2
    # coins 1 and children far below 1: nothing accepted, the root's child is rejected
    _, (pred, acc, n) = compare(impl, cand, tree, torch.ones(2, D, device=DEV), final,
                                probs, D - 1, **kw)
    assert n.tolist() == [0, 0] and acc[:, 1:].eq(-1).all()
    # coins 0: the first child is always accepted (SGLang's `coin <= cum`), even at q = 0
    probs0 = probs.clone()
    rows, cols = torch.arange(2, device=DEV)[:, None], torch.arange(D, device=DEV)
    probs0[rows, cols, cand.roll(-1, 1)] = 0.0
    _, (pred, acc, n) = compare(impl, cand, tree, torch.zeros(2, D, device=DEV), final,
                                probs0, D - 1, **kw)
    assert n.tolist() == [D - 1] * 2


@pytest.mark.parametrize("impl", IMPLS)
def test_edge_residuals(impl, seed):
    _skip_unavailable(impl)
    gen = torch.Generator().manual_seed(seed)
    D, V = 4, 20
    # root with 3 children (topk 3, one step): tokens 2, 5, 7
    tree = build_tree(torch.tensor([[-1]], device=DEV), torch.tensor([[0, 1, 2]], device=DEV),
                      torch.tensor([0], device=DEV), 3, 1, D)
    cand = torch.tensor([[0, 2, 5, 7]], device=DEV)
    # the root's law lives on the children's tokens only: all rejected -> residual all zero
    # -> V - 1; coins 1 reject every child with cumulative sum < 1
    probs = torch.zeros(1, D, V)
    probs[0, 0, [2, 5, 7]] = torch.tensor([0.2, 0.3, 0.4])  # sums to 0.9 < 1
    probs[0, 1:] = torch.softmax(torch.randn(D - 1, V, generator=gen), -1)
    probs = probs.to(DEV)
    for final in (0.0, 0.5, 1.0):
        ref, (pred, acc, n) = compare(impl, cand, tree, torch.ones(1, D, device=DEV),
                                      torch.tensor([final], device=DEV), probs, 1)
        assert n.tolist() == [0] and pred[0].item() == V - 1
    # final coin 1 (u = total): no cdf value exceeds u -> the last positive token, not V - 1
    probs[0, 0, [11, 13]] = 0.05
    for fc, want in ((1.0, 13), (0.0, 11)):
        ref, (pred, acc, n) = compare(impl, cand, tree, torch.ones(1, D, device=DEV),
                                      torch.tensor([fc], device=DEV), probs, 1)
        assert pred[0].item() == want and ref[0][0].item() == want
    # duplicate sibling tokens: the second copy is rejected too and its token removed once
    cand = torch.tensor([[0, 11, 11, 13]], device=DEV)
    ref, (pred, acc, n) = compare(impl, cand, tree, torch.ones(1, D, device=DEV),
                                  torch.tensor([0.5], device=DEV), probs, 1)
    assert pred[0].item() in (2, 5, 7)  # 11 and 13 rejected: only the other mass is left


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_and_batch_independent(impl, seed):
    _skip_unavailable(impl)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cand, tree, coins, final, probs, cap, draft = random_case(rng, gen, 3, 3, 3, 8, 50)
    a = run_impl(impl, cand, tree, coins, final, probs, cap, 1.0, 1.0, draft)
    b = run_impl(impl, cand, tree, coins, final, probs, cap, 1.0, 1.0, draft)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    check_batch_independent(impl, a, cand, tree, coins, final, probs, cap, draft)


def check_batch_independent(impl, full, cand, tree, coins, final, probs, cap, draft):
    """Request 1 alone gives the same outputs as inside the batch."""
    bs, D = cand.shape
    one = type(tree)(*(x[1:2] if isinstance(x, torch.Tensor) and x.dim() >= 2
                       and x.shape[0] == bs else x for x in tree))
    one = one._replace(retrive_index=one.retrive_index - D)
    p1, a1, n1 = run_impl(impl, cand[1:2], one, coins[1:2], final[1:2], probs[1:2], cap, 1.0,
                          1.0, None if draft is None else draft[1:2])
    pred, acc, n = full
    assert n1[0] == n[1]
    assert torch.equal(torch.where(a1 >= 0, a1 + D, a1)[0], acc[1])
    assert torch.equal(p1, pred[D:2 * D])


def test_draft_probs_semantics_by_hand():
    """relu(q - p) with p = q on the rejected tokens; p ignored after num_steps accepts; p
    used at a leaf (SGLang).  Same tree as tests/test_ops_verify.py::stochastic_case."""
    tree = build_tree(torch.tensor([[-1, 0, 1]], device=DEV),
                      torch.tensor([[0, 1, 2, 3]], device=DEV),
                      torch.tensor([3], device=DEV), 2, 2, 5)
    cand = torch.tensor([[3, 0, 1, 2, 3]], device=DEV)
    probs = torch.tensor([[[0.5, 0.3, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4],
                           [0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0],
                           [0.7, 0.1, 0.1, 0.1]]], device=DEV)
    draft = torch.zeros_like(probs)
    draft[0, 0] = torch.tensor([0.1, 0.1, 0.05, 0.0])
    draft[0, 1] = torch.tensor([0.0, 0.0, 0.0, 0.4])
    draft[0, 2] = torch.tensor([0.25, 0.0, 0.0, 0.0])
    saved = draft.clone()

    def run(coins, final, steps, dp, impl):
        return tree_speculative_sampling(
            cand, *links(tree), probs, steps, uniform_samples=torch.tensor([coins], device=DEV),
            uniform_samples_for_final_sampling=torch.tensor([final], device=DEV),
            draft_probs=dp, impl=impl)

    impls = ["reference"] + (["triton"] if _available("triton") else [])
    impls += ["cuda"] if DEV == "cuda" and _available("cuda") else []
    for impl in impls:
        # root coin .95 rejects tokens 0, 1: r = [0, 0, .1, .1] (no draft) or
        # [0, 0, .05, .1] (draft; p = q on 0, 1); final .4: u = .08 -> 2, u = .06 -> 3
        assert run([0.95, 0, 0, 0, 0], 0.4, 2, None, impl).predicts[0].item() == 2
        assert run([0.95, 0, 0, 0, 0], 0.4, 2, draft, impl).predicts[0].item() == 3
        # num_steps 1, root coin .3 accepts draft 1 (cap): p ignored, r = q_1, u = .95 -> 3
        # (with p it would be [.1, .2, .3, 0] -> 2)
        pred, acc, n = run([0.3, 0, 0, 0, 0], 0.95, 1, draft, impl)
        assert n.tolist() == [1] and pred[1].item() == 3
        # root coin .6 accepts draft 2 (token 1), a leaf before the cap: p used there,
        # r = [0, .25, .25, .25], u = 0 -> the first positive token 1 (0 without draft)
        pred, acc, n = run([0.6, 0, 0, 0, 0], 0.0, 2, draft, impl)
        assert acc.tolist() == [[0, 2, -1]] and pred[2].item() == 1
        assert run([0.6, 0, 0, 0, 0], 0.0, 2, None, impl).predicts[2].item() == 0
        # same with num_steps 1 (cap at draft 2): token 0, rejected at the root, is not
        # removed from draft 2's law; p ignored -> first positive of q_2 = token 0
        pred, acc, n = run([0.6, 0, 0, 0, 0], 0.0, 1, draft, impl)
        assert acc.tolist() == [[0, 2]] and pred[2].item() == 0
        assert torch.equal(draft, saved)


def test_bad_draft_probs_and_strides():
    tree = chain(1, 3)
    cand = torch.tensor([[0, 1, 2]], device=DEV)
    probs = torch.full((1, 3, 8), 1 / 8, device=DEV)
    args = (cand, *links(tree), probs, 2)
    with pytest.raises(ValueError, match="draft_probs"):
        tree_speculative_sampling(*args, draft_probs=torch.zeros(1, 3, 7, device=DEV))
    with pytest.raises(ValueError, match="draft_probs"):
        tree_speculative_sampling(*args, draft_probs=torch.zeros(1, 3, 8, dtype=torch.float64,
                                                                 device=DEV))
    with pytest.raises(ValueError, match="draft_probs"):
        tree_speculative_sampling(*args, draft_probs=torch.zeros(1, 3, 8, device="meta"))
    with pytest.raises(ValueError, match="draft_probs must have stride 1"):
        tree_speculative_sampling(*args, draft_probs=torch.zeros(1, 8, 3, device=DEV).mT)
    with pytest.raises(ValueError, match="target_probs must have stride 1"):
        tree_speculative_sampling(cand, *links(tree), torch.full((1, 8, 3), 0.1,
                                                                 device=DEV).mT, 2)
    with pytest.raises(TypeError, match="draft_probs"):
        tree_speculative_sampling(*args, draft_probs=[0.0] * 24)


# ----------------------------------------------------------------------------- GPU
GPU_IMPLS = ["cuda", "triton"]
GPU_DEV = "cuda"
DIST_N = 40000  # requests in the distribution test
# (bs, topk, num_steps, D, V)
GPU_SHAPES = [(1, 8, 8, 64, 128256), (16, 4, 6, 32, 128256), (64, 8, 4, 24, 128256),
              (64, 8, 3, 16, 32000), (64, 8, 8, 64, 7), (16, 1, 63, 64, 32000), (1, 2, 3, 8, 7),
              (16, 8, 4, 48, 32001)]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("with_draft", [False, True], ids=["no_draft", "draft"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "bs%d_topk%d_steps%d_D%d_V%d" % s)
def test_gpu_matches_reference(impl, with_draft, shape, seed):
    _skip_unavailable(impl)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bs, topk, num_steps, D, V = shape
    cand, tree, coins, final, probs, cap, draft = random_case(
        rng, gen, bs, topk, num_steps, D, V, closed=rng.random() < 0.7,
        idx_dtype=rng.choice([torch.int32, torch.int64]), dev=GPU_DEV)
    if with_draft and draft is None:
        draft = (probs * torch.rand(probs.shape, device=GPU_DEV) * 1.5)
    if not with_draft:
        draft = None
    th_s, th_a = random_thresholds(rng)
    compare(impl, cand, tree, coins, final, probs, cap, th_s, th_a, draft)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "bs%d_topk%d_steps%d_D%d_V%d" % s)
def test_gpu_dyadic_exact(impl, shape, seed):
    """Exactly representable sums: the GPU kernels equal the reference bit for bit."""
    _skip_unavailable(impl)
    bs, topk, num_steps, D, V = shape
    check_dyadic(impl, random.Random(seed), torch.Generator().manual_seed(seed), bs, topk,
                 num_steps, D, V)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_gpu_deterministic_and_batch_independent(impl, seed):
    _skip_unavailable(impl)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cand, tree, coins, final, probs, cap, draft = random_case(rng, gen, 16, 8, 4, 32, 128256,
                                                              dev=GPU_DEV)
    a = run_impl(impl, cand, tree, coins, final, probs, 4, 1.0, 1.0, draft)
    for _ in range(3):
        b = run_impl(impl, cand, tree, coins, final, probs, 4, 1.0, 1.0, draft)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    check_batch_independent(impl, a, cand, tree, coins, final, probs, 4, draft)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_gpu_cuda_graph_capture_replay(impl, seed):
    _skip_unavailable(impl)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cand, tree, coins, final, probs, cap, draft = random_case(rng, gen, 8, 4, 4, 24, 32000,
                                                              dev=GPU_DEV)
    coins, final = coins.clone(), final.clone()

    def call():
        return tree_speculative_sampling(cand, *links(tree), probs, 4, uniform_samples=coins,
                                         uniform_samples_for_final_sampling=final,
                                         draft_probs=draft, impl=impl)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()  # warm-up (Triton compile) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = call()
    for _ in range(3):
        coins.copy_(torch.rand(coins.shape, generator=gen).to(GPU_DEV))
        final.copy_(torch.rand(final.shape, generator=gen).to(GPU_DEV))
        g.replay()
        eager = call()
        torch.cuda.synchronize()
        for x, y in zip(static, eager):
            assert torch.equal(x, y)


@pytest.mark.gpu
@needs_cuda_op
def test_sanitizer_smoke(seed):
    """One quick run of the CUDA kernel on moderate shapes (float4 and scalar paths, with and
    without draft_probs; V 20000+ is several 8192-token tiles, split over blocks with the
    ticket), for `compute-sanitizer --tool memcheck|racecheck|synccheck`."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for V in (4096, 4099, 20000, 20001):
        cand, tree, coins, final, probs, cap, draft = random_case(rng, gen, 4, 4, 3, 16, V,
                                                                  dev=GPU_DEV)
        for dp in (None, torch.rand(probs.shape, device=GPU_DEV) * probs):
            compare("cuda", cand, tree, coins, final, probs, 3, 1.0, 1.0, dp)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_gpu_rejected_tokens_at_tile_edges(impl, seed):
    """All children of the root rejected, their tokens at 8192-token tile edges (the CUDA
    kernel's split-V tiles; also 4096 multiples, Triton's tile), the law peaked there, coins
    near 0 and 1, with and without draft: exact path, bonus by property."""
    _skip_unavailable(impl)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tile = 8192
    for V in (3 * tile, 5 * tile + 3, 2 * tile + 1):
        topk = rng.randint(2, 8)
        D = topk + 1
        tree = build_tree(torch.tensor([[-1]], device=GPU_DEV),
                          torch.tensor([list(range(topk))], device=GPU_DEV),
                          torch.tensor([0], device=GPU_DEV), topk, 1, D)
        edges = [t * tile // 2 + d for t in range(1, 2 * V // tile + 1) for d in (-1, 0, 1)
                 if 0 <= t * tile // 2 + d < V]
        toks = rng.sample(edges, min(topk, len(edges)))
        cand = torch.tensor([[0] + toks], device=GPU_DEV)
        logits = torch.randn(1, D, V, generator=gen)
        logits[0, :, edges] += torch.tensor([rng.choice([0.0, 6.0, 12.0]) for _ in edges])
        probs = torch.softmax(logits, -1).to(GPU_DEV)
        for fc in (0.0, 1e-7, rng.random(), 1 - 6e-8, 1.0):
            draft = None if rng.random() < 0.5 else probs * torch.rand(probs.shape,
                                                                      device=GPU_DEV)
            compare(impl, cand, tree, torch.ones(1, D, device=GPU_DEV),
                    torch.tensor([fc], device=GPU_DEV), probs, 1, 1.0, 1.0, draft)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_gpu_lossless_distribution(impl, seed):
    """Thresholds 1: the first emitted token follows q_root, and given that it is draft 1's
    token, the second follows q_1.  N identical requests with fresh coins; the chi-square
    bound is the 1 - 1e-6 quantile (df = 4: 33.38), so a correct kernel fails with
    probability ~2e-6 per check."""
    _skip_unavailable(impl)
    gen = torch.Generator().manual_seed(seed)
    N, V, D = DIST_N, 5, 6
    # tree 0 -> {1, 2}, 1 -> {3, 4}, 2 -> {5}; tokens 1:0, 2:3, 3:1, 4:4, 5:2 (distinct siblings)
    tree1 = build_tree(torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2, 3, 4]]),
                       torch.tensor([0]), 2, 2, D)
    ri = torch.arange(N * D, device=GPU_DEV).view(N, D)
    nx = tree1.retrive_next_token.expand(N, -1).contiguous().to(GPU_DEV)
    sb = tree1.retrive_next_sibling.expand(N, -1).contiguous().to(GPU_DEV)
    tree = tree1._replace(retrive_index=ri, retrive_next_token=nx, retrive_next_sibling=sb)
    cand = torch.tensor([[2, 0, 3, 1, 4, 2]]).expand(N, -1).contiguous().to(GPU_DEV)
    probs1 = torch.distributions.Dirichlet(torch.ones(V)).sample((D,))
    probs1[0] = torch.tensor([0.35, 0.1, 0.2, 0.25, 0.1])
    probs = probs1[None].expand(N, -1, -1).contiguous().to(GPU_DEV)
    coins = torch.rand(N, D, generator=gen).to(GPU_DEV)
    final = torch.rand(N, generator=gen).to(GPU_DEV)
    pred, acc, n = run_impl(impl, cand, tree, coins, final, probs, 2, 1.0, 1.0, None)
    pred, acc = pred.cpu(), acc.cpu()
    first = pred[acc[:, 0].long()].long()
    counts = torch.bincount(first, minlength=V).double()
    assert chi2_stat(counts, probs1[0].double()) < 33.38
    took1 = first == 0
    second = pred[acc[took1, 1].long()].long()
    counts = torch.bincount(second, minlength=V).double()
    assert chi2_stat(counts, probs1[1].double()) < 33.38


def chi2_stat(counts, probs):
    exp = probs * counts.sum()
    keep = exp > 0
    assert counts[~keep].sum() == 0  # a zero-probability token was emitted
    return float((((counts - exp) ** 2)[keep] / exp[keep]).sum())
