"""Ops that write into the caller's tensors refuse outputs that share memory with an input,
another output or themselves (an ``expand``-ed view) with a ValueError before anything is
written (the Triton kernels' per-row programs would otherwise give a result that depends on
program order, and the reference another one); NaN probabilities count as 0 in both
implementations of the stochastic verify; the shared span checks against brute force.

On a CPU-only machine the Triton kernels run in Triton's interpreter."""
import os
import random

import torch

if not torch.cuda.is_available():  # before triton / specattn's Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specattn import ops  # noqa: E402
from specattn.ops.checks import check_no_internal_overlap, check_writes_disjoint  # noqa: E402

pytest.importorskip("triton")

IMPLS = ["reference", "triton"]


@pytest.mark.parametrize("impl", IMPLS)
def test_scatter_rows_refuses_overlap(impl):
    t = torch.arange(8.).view(4, 2)
    with pytest.raises(ValueError, match=r"pairs\[0\] dst and pairs\[0\] src overlap"):
        ops.scatter_rows(torch.tensor([1, 0]), [(t, t[:2])], impl=impl)
    A, B, C = torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"pairs\[0\] dst and pairs\[1\] src overlap"):
        ops.scatter_rows(torch.tensor([1, 0]), [(A, B), (C, A)], impl=impl)      # a chained pair
    with pytest.raises(ValueError, match=r"pairs\[0\] dst and pairs\[1\] dst overlap"):
        ops.scatter_rows(torch.tensor([1, 0]), [(A, B), (A.view(2, 2), C)], impl=impl)
    rows = torch.tensor([1, 2, 3, 0])
    with pytest.raises(ValueError, match="dst and rows overlap"):
        ops.scatter_rows(rows, [(rows.view(4, 1), torch.zeros(4, 1, dtype=torch.int64))], impl=impl)
    ops.scatter_rows(torch.tensor([1, 0]), [(A, B), (C, B)], impl=impl)           # two dsts, one src: fine
    assert A.eq(1).all() and C.eq(1).all()


def _commit_args():
    return dict(rows=torch.arange(2), prefix_lens=torch.zeros(2, dtype=torch.long),
                roots=torch.zeros(2, dtype=torch.long), seq_lens=torch.tensor([5, 6]),
                path=torch.tensor([[1, 2], [3, 4]]), accept_length=torch.tensor([0, 1]),
                emitted=torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("impl", IMPLS)
def test_commit_accepted_refuses_overlap(impl):
    a = _commit_args()
    with pytest.raises(ValueError, match="emitted has elements that share memory"):
        ops.commit_accepted(**{**a, "emitted": torch.zeros(1, 3, dtype=torch.long).expand(2, 3)}, impl=impl)
    p = torch.tensor([10, 20])
    with pytest.raises(ValueError, match="prefix_lens and seq_lens overlap"):
        ops.commit_accepted(**{**a, "prefix_lens": p, "seq_lens": p}, impl=impl)
    with pytest.raises(ValueError, match="roots and seq_lens overlap"):
        ops.commit_accepted(**{**a, "roots": p, "seq_lens": p}, impl=impl)
    em = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="emitted and path overlap"):
        ops.commit_accepted(**{**a, "emitted": em, "path": em.view(-1)[:4].view(2, 2)}, impl=impl)
    ops.commit_accepted(**a, impl=impl)                                           # separate tensors: fine
    assert a["prefix_lens"].tolist() == [6, 8] and a["roots"].tolist() == [1, 4]


@pytest.mark.parametrize("impl", IMPLS)
def test_eagle_beam_step_refuses_expanded_outputs(impl):
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 2, generator=g), torch.randn(4, 2, generator=g), torch.arange(8).view(4, 2))
    with pytest.raises(ValueError, match="cand_scores has elements that share memory"):
        ops.eagle_beam_step(*args, torch.zeros(1, 6).expand(2, 6), torch.zeros(2, 6, dtype=torch.long), 2,
                            impl=impl)
    with pytest.raises(ValueError, match="parent_list has elements that share memory"):
        ops.eagle_beam_step(*args, torch.zeros(2, 6), torch.zeros(2, 6, dtype=torch.long), 2, select=True,
                            parent_list=torch.zeros(1, 4, dtype=torch.long).expand(2, 4), parent_offset=0,
                            impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_fork_req_to_token_rows_refuses_shared_rows(impl):
    rtt = torch.arange(6).view(1, 6).expand(3, 6)
    with pytest.raises(ValueError, match="req_to_token has elements that share memory"):
        ops.fork_req_to_token_rows(rtt, torch.tensor([[0]]), torch.tensor([[2]]), torch.tensor([0]), 2,
                                   new_col=torch.tensor([3]), new_slots=torch.tensor([[99]]), impl=impl)


def test_tree_speculative_sampling_nan_counts_zero():
    """A NaN in the target or draft probabilities counts as 0 in the bonus draw, in both
    implementations (the kernels' ``fmaxf`` rule): the same token, and the token the draw
    gives with the NaN replaced by 0."""
    t = ops.build_tree(torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]), torch.tensor([5]), 1, 2, 3, impl="reference")
    tree = (torch.tensor([[0, 1, 2]]), t.retrive_index, t.retrive_next_token, t.retrive_next_sibling)
    coins = dict(uniform_samples=torch.tensor([[0.9, .5, .5]]),
                 uniform_samples_for_final_sampling=torch.tensor([0.5]))
    q = torch.tensor([[[0.2, 0.0, 0.4, float("nan"), 0.4]] + [[0.2] * 5] * 2])
    d = torch.full((1, 3, 5), 0.1)
    d[0, 0, 4] = float("nan")
    for draft in (None, d):
        got = [ops.tree_speculative_sampling(*tree, q, 2, draft_probs=draft, **coins, impl=impl).predicts
               for impl in IMPLS]
        want = ops.tree_speculative_sampling(*tree, q.nan_to_num(0.0), 2, draft_probs=None if draft is None else
                                             draft.nan_to_num(float("inf")), **coins, impl="reference").predicts
        assert torch.equal(got[0], got[1]) and torch.equal(got[0], want)


@pytest.mark.parametrize("impl", IMPLS)
def test_qkv_rope_store_refuses_caches_over_inputs(impl):
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(6, 1, 32, generator=g), torch.zeros(6, 1, 32)
    w = torch.randn(96, 32, generator=g) * 0.1
    with pytest.raises(ValueError, match="k_cache and x overlap"):
        ops.qkv_rope_store(kc.view(6, 32)[:4], None, w, 1e-6, torch.arange(4), ops.make_cos_sin_cache(8, 32, 1e4),
                           torch.tensor([1, 0, 3, 2]), kc, vc, 1, 1, 32, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_materialize_kv_refuses_shared_buffers(impl):
    T, hid, d = 2, 16, 8
    hidden, w_kv = torch.randn(T, hid), torch.randn(2 * 2 * d, hid)
    k_norm, cs = torch.rand(2, d) + 0.5, ops.make_cos_sin_cache(16, d)
    pos, loc = torch.tensor([3, 7]), torch.tensor([1, 4])
    b = [torch.zeros(6, 1, d) for _ in range(3)]
    for kb, vb, msg in (([b[0], b[1]], [b[0], b[2]], r"k_buffers\[0\] and v_buffers\[0\] overlap"),
                        ([b[0], b[0]], [b[1], b[2]], r"k_buffers\[0\] and k_buffers\[1\] overlap")):
        with pytest.raises(ValueError, match=msg):
            ops.materialize_kv(hidden, w_kv, k_norm, pos, cs, loc, kb, vb, impl=impl)
    big = torch.zeros(6 * d + T * hid)                      # hidden lies inside a buffer's memory
    with pytest.raises(ValueError, match="hidden overlap|and hidden overlap"):
        ops.materialize_kv(big[:T * hid].view(T, hid), w_kv, k_norm, pos, cs, loc,
                           [big[T * hid:].view(6, 1, d), b[1]], [b[0], big[:6 * d].view(6, 1, d)], impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_extend_cache_locs_fill_id(impl):
    args = (torch.tensor([0]), torch.tensor([0]), torch.arange(8).view(1, 8), 2)
    for bad in (2 ** 63, -2 ** 63 - 1, 2.7, True, None):
        with pytest.raises(ValueError, match="fill_id must be an int"):
            ops.extend_cache_locs(*args, roots=torch.tensor([5]), fill_id=bad, impl=impl)
    out = ops.extend_cache_locs(*args, roots=torch.tensor([5]), fill_id=2 ** 63 - 1, impl=impl)
    assert out.input_ids.tolist() == [[5, 2 ** 63 - 1]]


@pytest.mark.parametrize("impl", IMPLS)
def test_complex_state_refused(impl):
    with pytest.raises(ValueError, match="real dtype"):
        ops.gather_rows(torch.tensor([0]), [torch.ones(2, 2, dtype=torch.complex64)], impl=impl)
    with pytest.raises(ValueError, match="real dtype"):
        ops.compact_accepted_path(torch.tensor([[0]]), torch.tensor([0]), torch.tensor([3]), 1,
                                  hidden_states=torch.ones(1, 2, dtype=torch.complex64), impl=impl)


def test_span_checks_against_brute_force(seed):
    """``check_writes_disjoint`` raises exactly when a written span meets another span, and
    ``check_no_internal_overlap`` exactly when two elements of a small view share an address."""
    rng = random.Random(seed)
    base = torch.zeros(64)
    for _ in range(300):
        groups = [[], []]
        for _ in range(rng.randint(1, 6)):
            a = rng.randrange(64)
            b = rng.randint(a + 1, min(64, a + rng.randint(1, 20)))
            groups[rng.random() < 0.5].append((f"t{a}_{b}", base[a:b]))
        read, written = groups
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * 4, w) for w, g in ((True, written), (False, read))
                 for _, t in g]
        clash = any(s1[2] or s2[2] for i, s1 in enumerate(spans) for s2 in spans[i + 1:]
                    if s1[0] < s2[1] and s2[0] < s1[1])
        if clash:
            with pytest.raises(ValueError, match="overlap in memory"):
                check_writes_disjoint(written, read)
        else:
            check_writes_disjoint(written, read)
    for _ in range(300):
        shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        strides = [rng.randint(0, 6) for _ in shape]
        view = torch.zeros(200).as_strided(shape, strides)
        offs = [sum(i * st for i, st in zip(idx, strides)) for idx in torch.cartesian_prod(
            *[torch.arange(n) for n in shape]).view(-1, len(shape)).tolist()]
        if len(set(offs)) < len(offs):
            with pytest.raises(ValueError, match="share memory"):
                check_no_internal_overlap("t", view)
        elif all(st >= 1 or n == 1 for n, st in zip(shape, strides)):
            try:   # distinct addresses: refused only for interleaved layouts (conservative)
                check_no_internal_overlap("t", view)
            except ValueError:
                assert len(shape) > 1
