"""The Triton kernels offset in int64 wherever an input's stride is the caller's: an input view
whose inner stride puts element 2 (or 4, 16) past 2**31 elements equals the reference (or the
same call on contiguous tensors).  With int32 offsets ``index * stride`` wrapped negative and
the kernels read or wrote out of bounds (a segfault under the interpreter).

The views come from a sparse file mapped shared into host memory: only the pages written or
read take memory or disk, so each case costs well under a GB whatever the strides.  Those
cases run on the CPU (the Triton kernels in the interpreter).  The Gluon sm_90 kernels offset
heads and tree-mask rows in int32: views past that run the portable kernels (a GPU test), and
``sm90=True`` names the need."""
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn's Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specattn import ops  # noqa: E402

pytest.importorskip("triton")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="views mapped sparse in host memory (CPU run)")

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


@cpu_only
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


@cpu_only
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


@cpu_only
@pytest.mark.parametrize("which", ["selected", "parent_list"])
def test_build_tree(wide, which):
    parent_list, selected, vsl = _chain()
    if which == "selected":
        selected = wide(selected, (1, BIG))
    else:
        parent_list = wide(parent_list, (1, BIG))
    assert _equal(tuple(ops.build_tree(parent_list, selected, vsl, 1, 4, 4, impl="reference")),
                  tuple(ops.build_tree(parent_list, selected, vsl, 1, 4, 4, impl="triton")))


@cpu_only
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


@cpu_only
def test_compact_accepted_path(wide):
    ai = wide(torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), (1, BIG))
    args = (ai, torch.tensor([3], dtype=torch.int32), torch.tensor([40, 41, 42, 43]), 4)
    pr = torch.tensor([11, 12, 13, 14], dtype=torch.int32)
    assert _equal(tuple(ops.compact_accepted_path(*args, predicts=pr, impl="reference")),
                  tuple(ops.compact_accepted_path(*args, predicts=pr, impl="triton")))


@cpu_only
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


@cpu_only
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


@cpu_only
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


def test_gluon_int32_offset_needs():
    """The host check that sends views past the Gluon kernels' int32 offsets to the portable
    kernels: empty for ordinary layouts (a head-major q of 4096 tokens too), one need per view
    past 2**31 elements, at the edge exactly."""
    from specattn.triton_kernels.gluon_common import int32_offset_needs
    meta = lambda shape, strides: torch.empty(0, device="meta").as_strided(shape, strides)   # noqa: E731
    T, H, D = 64, 32, 128
    q, out, tm = meta((T, H, D), (H * D, D, 1)), meta((T, H, D), (H * D, D, 1)), meta((1, T, 2), (2 * T, 2, 1))
    assert int32_offset_needs(q, out, tm, T) == []
    assert int32_offset_needs(meta((4096, H, D), (D, 4096 * D, 1)), out, None, T) == []   # head-major
    edge = (2 ** 31 - D) // (H - 1)                          # (H - 1) * stride + D == 2**31 - (a little)
    assert int32_offset_needs(meta((T, H, D), (1, edge, 1)), out, tm, T) == []
    why = int32_offset_needs(meta((T, H, D), (1, edge + 1, 1)), meta((T, H, D), (1, BIG, 1)),
                             meta((1, T, 2), (T * BIG, BIG, 1)), T)
    assert len(why) == 3 and why[0].startswith("q's head") and why[1].startswith("out's head")
    assert why[2].startswith("tree_mask's row")


@cpu_only
def test_gluon_sm90_true_names_the_int32_need(wide):
    """``sm90=True`` with an ``out`` view past the Gluon kernels' int32 head offsets is a
    ValueError that names it (before any launch)."""
    from specattn.triton_kernels.attention import paged_attention
    H, Dh, T = 4, 64, 2
    q, kc = torch.randn(T, H, Dh, dtype=torch.bfloat16), torch.randn(8, 1, Dh, dtype=torch.bfloat16)
    out = wide(torch.zeros(T, H, Dh, dtype=torch.bfloat16), (H * BIG, BIG, 1))
    tm = torch.tensor([[[1], [3]]], dtype=torch.int32)
    with pytest.raises(ValueError, match="out's head offsets below 2\\*\\*31"):
        paged_attention(q, kc, kc, torch.arange(8, dtype=torch.int32)[None], torch.tensor([0]),
                        torch.tensor([3], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32), tm, T, 0.125,
                        out=out, sm90=True)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the Gluon kernels run on sm_90")
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_gluon_views_past_int32_run_the_portable_kernels(seed, kind):
    """On sm_90 a tree verify whose ``q`` and ``out`` are views with head strides past the
    Gluon kernels' int32 offsets (a head-major buffer of 2**31 / H elements a head) runs the
    portable kernels and equals the same call on contiguous tensors (which runs Gluon)."""
    from specattn.triton_kernels.attention import paged_attention
    from specattn.triton_kernels.attention_mla import mla_paged_attention
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, P, dev, dt = 64, 300, "cuda", torch.bfloat16
    H, Dq, Dv = (8, 128, 128) if kind == "mha" else (16, 576, 512)
    rtt = torch.randperm(1024, device=dev, generator=g)[None].int()
    tm = torch.zeros(1, n, 2, dtype=torch.int32, device=dev)
    for j in range(n):                                       # a chain: token j sees 0..j
        tm[0, j, 0] = (1 << min(j + 1, 31)) - 1 if j < 31 else -1
        tm[0, j, 1] = 0 if j < 32 else ((1 << (j - 31)) - 1 if j < 63 else -1)
    meta = (rtt, torch.tensor([0], device=dev), torch.tensor([P], dtype=torch.int32, device=dev),
            torch.tensor([0, n], dtype=torch.int32, device=dev), tm, n, Dq ** -0.5)
    q = torch.randn(n, H, Dq, dtype=dt, device=dev, generator=g)
    head = -(-2 ** 31 // (H - 1))                             # (H - 1) * head stride >= 2**31
    q_wide = torch.empty(H * head, dtype=dt, device=dev).as_strided((n, H, Dq), (Dq, head, 1)).copy_(q)
    out_wide = torch.empty(H * head, dtype=dt, device=dev).as_strided((n, H, Dv), (Dv, head, 1))
    if kind == "mha":
        kc, vc = (torch.randn(1024, 2, Dq, dtype=dt, device=dev, generator=g) for _ in range(2))
        ref = paged_attention(q, kc, vc, *meta)
        got = paged_attention(q_wide, kc, vc, *meta, out=out_wide)
    else:
        kv = torch.randn(1024, 1, Dq, dtype=dt, device=dev, generator=g)
        ref = mla_paged_attention(q, kv, *meta, 512)
        got = mla_paged_attention(q_wide, kv, *meta, 512, out=out_wide)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
