"""The Triton kernels offset in int64 wherever an input's stride is the caller's: an input view
whose inner stride puts element 2 (or 4, 16) past 2**31 elements equals the reference (or the
same call on contiguous tensors).  With int32 offsets ``index * stride`` wrapped negative and
the kernels read or wrote out of bounds (a segfault under the interpreter).

The views come from a sparse file mapped shared into host memory: only the pages written or
read take memory or disk, so each case costs well under a GB whatever the strides.  CPU only (the Triton
kernels run in the interpreter)."""
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn's Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specattn import ops  # noqa: E402

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="views mapped sparse in host memory (CPU run)")

BIG = 2 ** 30 + 3          # index 2 times this stride passes 2**31


@pytest.fixture
def wide(tmp_path):
    """``wide(t, strides)``: ``t``'s values in a view with ``strides`` (sparse storage)."""
    count = [0]

    def make(t, strides):
        n = sum((d - 1) * st for d, st in zip(t.shape, strides)) + 1
        count[0] += 1
        path = tmp_path / f"s{count[0]}.bin"
        with open(path, "wb") as f:
            f.truncate(n * t.element_size())
        # shared: a file-backed mapping, not counted against the machine's memory commit
        return torch.from_file(str(path), shared=True, size=n, dtype=t.dtype).as_strided(t.shape, strides).copy_(t)
    return make


def _equal(a, b):
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return all(_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("which", ["scores", "tokens"])
def test_select_draft_tokens(wide, seed, which):
    g = torch.Generator().manual_seed(seed)
    scores, tokens = torch.randn(1, 4, generator=g), torch.randint(0, 1000, (1, 4), generator=g)
    if which == "scores":
        scores = wide(scores, (1, BIG))
    else:
        tokens = wide(tokens, (1, BIG))
    roots = torch.tensor([7])
    assert _equal(ops.select_draft_tokens(scores, tokens, roots, 5, impl="reference"),
                  ops.select_draft_tokens(scores, tokens, roots, 5, impl="triton"))


@pytest.mark.parametrize("which", ["scores", "tokens"])
def test_eagle_beam_step_beams(wide, seed, which):
    g = torch.Generator().manual_seed(seed)
    K = 3
    beam_scores, beam_tokens = torch.randn(1, K, generator=g), torch.randint(0, 1000, (1, K), generator=g)
    child_scores, child_tokens = torch.randn(K, K, generator=g), torch.randint(0, 1000, (K, K), generator=g)
    if which == "scores":
        beam_scores = wide(beam_scores, (1, BIG))
    else:
        beam_tokens = wide(beam_tokens, (1, BIG))
    outs = []
    for impl in ("reference", "triton"):
        cs, ct = torch.full((1, K + K * K), -7.0), torch.full((1, K + K * K), -7, dtype=torch.int64)
        r = ops.eagle_beam_step(beam_scores, child_scores, child_tokens, cs, ct, K, beam_tokens=beam_tokens,
                                beam_offset=0, impl=impl)
        outs.append((cs, ct, *r))
    assert _equal(*outs)


def _chain():
    """A chain root -> 0 -> 1 -> 2 (topk 1, 4 steps, 4 tokens) and its tree."""
    parent_list, selected = torch.tensor([[-1, 0, 1, 2]]), torch.tensor([[0, 1, 2]])
    return parent_list, selected, torch.tensor([5], dtype=torch.int32)


@pytest.mark.parametrize("which", ["selected", "parent_list"])
def test_build_tree(wide, which):
    parent_list, selected, vsl = _chain()
    if which == "selected":
        selected = wide(selected, (1, BIG))
    else:
        parent_list = wide(parent_list, (1, BIG))
    assert _equal(tuple(ops.build_tree(parent_list, selected, vsl, 1, 4, 4, impl="reference")),
                  tuple(ops.build_tree(parent_list, selected, vsl, 1, 4, 4, impl="triton")))


@pytest.mark.parametrize("which", ["candidates", "retrive_index", "target_predict", "sampling"])
def test_verify_tree(wide, which):
    tree = ops.build_tree(*_chain(), 1, 4, 4, impl="reference")
    cand, tp = torch.tensor([[9, 11, 12, 13]]), torch.tensor([[11, 12, 13, 14]])   # every draft accepted
    ri, nx, sb = tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling
    if which in ("candidates", "sampling"):
        cand = wide(cand, (1, BIG))
    elif which == "retrive_index":
        ri = wide(ri, (1, BIG))
    else:
        tp = wide(tp, (1, BIG))
    if which != "sampling":
        run = lambda impl: ops.verify_tree_greedy(cand, ri, nx, sb, tp, 3, impl=impl)   # noqa: E731
    else:
        probs = torch.zeros(1, 4, 16)
        probs[0, torch.arange(4), tp[0]] = 1.0
        run = lambda impl: ops.tree_speculative_sampling(   # noqa: E731
            cand, ri, nx, sb, probs, 3, uniform_samples=torch.full((1, 4), 0.5),
            uniform_samples_for_final_sampling=torch.full((1,), 0.5), impl=impl)
    assert _equal(tuple(run("reference")), tuple(run("triton")))


def test_compact_accepted_path(wide):
    ai = wide(torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), (1, BIG))
    args = (ai, torch.tensor([3], dtype=torch.int32), torch.tensor([40, 41, 42, 43]), 4)
    pr = torch.tensor([11, 12, 13, 14], dtype=torch.int32)
    assert _equal(tuple(ops.compact_accepted_path(*args, predicts=pr, impl="reference")),
                  tuple(ops.compact_accepted_path(*args, predicts=pr, impl="triton")))


@pytest.mark.parametrize("which", ["cos_sin_cache", "k_norm_weight"])
def test_materialize_kv(wide, seed, which):
    g = torch.Generator().manual_seed(seed)
    T, Hd, D = 2, 16, 8
    hidden, w_kv = torch.randn(T, Hd, generator=g), torch.randn(2 * D, Hd, generator=g) * 0.3
    knw, csc = torch.rand(1, D, generator=g) + 0.5, ops.make_cos_sin_cache(16, D)
    if which == "cos_sin_cache":
        csc = wide(csc, (1, 2 ** 29 + 1))          # column 4 passes 2**31
    else:
        knw = wide(knw, (1, 2 ** 29 + 1))
    outs = []
    for impl in ("reference", "triton"):
        kb, vb = [torch.full((6, 1, D), -7.0)], [torch.full((6, 1, D), -7.0)]
        ops.materialize_kv(hidden, w_kv, knw, torch.tensor([3, 7]), csc, torch.tensor([1, 4]), kb, vb, impl=impl)
        outs.append((kb[0], vb[0]))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_qkv_rope_store(wide, seed):
    g = torch.Generator().manual_seed(seed)
    M, K, D = 2, 32, 32
    x, w = torch.randn(M, K, generator=g), torch.randn(3 * D, K, generator=g) * 0.2
    csc = wide(ops.make_cos_sin_cache(16, D), (1, 2 ** 27 + 1))   # column 16 passes 2**31
    outs = []
    for impl in ("reference", "triton"):
        kc, vc = torch.full((6, 1, D), -7.0), torch.full((6, 1, D), -7.0)
        q = ops.qkv_rope_store(x, None, w, 1e-6, torch.tensor([3, 7]), csc, torch.tensor([1, 4]), kc, vc, 1, 1, D,
                               impl=impl)
        outs.append((q, kc, vc))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which", ["mha_q", "mha_out", "mha_merge_out", "mha_tree_mask", "mla_q", "mla_out"])
def test_attention(wide, seed, which):
    """``q`` / ``out`` whose head stride puts head 2 past 2**31 elements (one split and the
    split-KV merge), and a tree mask whose row stride puts token 2's word there: equal to the
    same call on contiguous tensors."""
    from specattn.triton_kernels.attention import paged_attention
    from specattn.triton_kernels.attention_mla import mla_paged_attention
    g = torch.Generator().manual_seed(seed)
    H, rtt, rpi = 4, torch.arange(16, dtype=torch.int32)[None, :].contiguous(), torch.tensor([0])
    T = 3 if which == "mha_tree_mask" else 1
    pl, qo = torch.tensor([12 if which == "mha_merge_out" else 3], dtype=torch.int32), torch.tensor([0, T],
                                                                                                    dtype=torch.int32)
    tm = torch.tensor([[[1], [3], [5]]], dtype=torch.int32) if which == "mha_tree_mask" else None
    if which.startswith("mha"):
        Dq = Dv = 16
        kc, vc = torch.randn(16, 1, Dq, generator=g), torch.randn(16, 1, Dq, generator=g)
        splits = 2 if which == "mha_merge_out" else 1
        run = lambda q_, out_, tm_: paged_attention(q_, kc, vc, rtt, rpi, pl, qo, tm_, T, 0.25,   # noqa: E731
                                                    num_splits=splits, block_n=16, out=out_)
    else:
        rank = rope = Dv = 16
        Dq = rank + rope
        kv = torch.randn(16, 1, Dq, generator=g)
        run = lambda q_, out_, tm_: mla_paged_attention(q_, kv, rtt, rpi, pl, qo, tm_, T, 0.25, rank,   # noqa: E731
                                                        out=out_)
    q = torch.randn(T, H, Dq, generator=g)
    ref = run(q, None, tm).clone()
    if which.endswith("_q"):
        got = run(wide(q, (H * BIG, BIG, 1)), None, tm)
    elif which.endswith("out"):
        got = run(q, wide(torch.full((T, H, Dv), -7.0), (H * BIG, BIG, 1)), tm)
    else:
        got = run(q, None, wide(tm, (3 * BIG, BIG, 1)))
    assert torch.equal(ref, got)
