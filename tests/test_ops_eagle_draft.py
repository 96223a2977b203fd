"""``ops.eagle_beam_step``, ``ops.select_draft_tokens`` and ``ops.fork_req_to_token_rows``:
the references against the
PyTorch ops they replace (EAGLE's ``topk`` / gathers / ``cat`` bookkeeping) on fresh random
scores (the ``seed`` fixture: ties have probability ~0), the documented tie rule (lower
candidate column first, ``-0.0 == +0.0``) against a stable-sort oracle, the Triton kernels
against the references exactly (bits of every output, and of every buffer element the op
must not write, after poisoning), edges (``K = 1``, ``bs = 1`` and ``0``, ``D - 1 ==
n_cand``, strided inputs), validation errors, and the runtime's EAGLE round with the fused
ops forced (same tokens and accept lengths as its PyTorch path).  The row fork against a
per-element loop (columns off the table's edges, the new column inside the copied range,
strided and int32 indices, an empty batch) and its validation.

On a CPU-only machine the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set below before triton is imported) on small shapes.  The ``gpu``-marked tests compare the
CUDA kernels with the reference, check that they never sync with the host and replay them
from a CUDA graph.
"""
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn's Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from specattn import ops  # noqa: E402
from specattn.ops import BeamStep, eagle_beam_step, registry, select_draft_tokens  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ("reference", "triton")
POISON_S, POISON_T = float("nan"), -12345


# ------------------------------------------------------------------ helpers and oracles
def bits(x: torch.Tensor) -> torch.Tensor:
    """float32 as int32 bits (NaN == NaN, -0.0 != +0.0), other dtypes unchanged."""
    return x.contiguous().view(torch.int32) if x.dtype == torch.float32 else x


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = ""):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b)), f"{what} differs:\n{a}\n{b}"


def stable_top(x: torch.Tensor, k: int) -> torch.Tensor:
    """The documented order: score descending, ties by lower column (-0.0 == +0.0)."""
    xs = torch.where(x == 0, torch.zeros_like(x), x)
    return torch.sort(xs, dim=-1, descending=True, stable=True).indices[:, :k]


def make_step(bs, K, kind="randn", gen=None):
    """``(beam_scores [bs, K], child_scores [bs*K, K], child_tokens [bs*K, K], beam_tokens
    [bs, K])``: ``randn`` log-prob-like floats, or ``ties`` (a few integer values: many equal
    candidates, zeros of both signs)."""
    if kind == "ties":
        beam = torch.randint(-2, 1, (bs, K), generator=gen).float()
        child = torch.randint(-2, 1, (bs * K, K), generator=gen).float()
        child = torch.where((child == 0) & (torch.rand(bs * K, K, generator=gen) < 0.5), -0.0, child)
        beam = torch.where((beam == 0) & (torch.rand(bs, K, generator=gen) < 0.5), -0.0, beam)
    else:
        beam = -torch.rand(bs, K, generator=gen) * 5
        child = -torch.rand(bs * K, K, generator=gen) * 5
    ctok = torch.randint(0, 50000, (bs * K, K), generator=gen)
    btok = torch.randint(0, 50000, (bs, K), generator=gen)
    return beam.to(DEV), child.to(DEV), ctok.to(DEV), btok.to(DEV)


def torch_step(beam, child, ctok, K):
    """What ``EagleStrategy._draft``'s PyTorch path computes for one step."""
    bs = beam.shape[0]
    cs = (beam[..., None] + child.view(bs, K, K)).flatten(1)
    ct = ctok.view(bs, K, K).flatten(1)
    top, best = cs.topk(K, dim=-1)
    return cs, ct, top, ct.gather(1, best), best


def poisoned(bs, n, extra=0):
    """Candidate buffers ``[bs, n]`` (as views into wider poisoned storage when ``extra``)."""
    s = torch.full((bs, n + extra), POISON_S, device=DEV)
    t = torch.full((bs, n + extra), POISON_T, dtype=torch.int64, device=DEV)
    return s[:, extra // 2:extra // 2 + n], t[:, extra // 2:extra // 2 + n], s, t


def run_step(impl, beam, child, ctok, btok, n_cand, offset, *, beam_offset=None, select=True,
             cur=None, plist_width=None, parent_offset=None, extra=0):
    bs, K = beam.shape
    cs, ct, cs_base, ct_base = poisoned(bs, n_cand, extra)
    pl = None if plist_width is None else torch.full((bs, plist_width), POISON_T, dtype=torch.int64,
                                                     device=DEV)
    out = eagle_beam_step(beam, child, ctok, cs, ct, offset,
                          beam_tokens=btok if beam_offset is not None else None, beam_offset=beam_offset,
                          select=select, cur_rows=cur, parent_list=pl, parent_offset=parent_offset,
                          impl=impl)
    return out, cs_base, ct_base, pl


# ------------------------------------------------------------------ eagle_beam_step
def test_reference_matches_torch_ops(seed):
    """Random scores: the reference gives the PyTorch path's candidates (bit for bit), next
    beams and parents."""
    g = torch.Generator().manual_seed(seed)
    for bs, K in ((1, 1), (3, 2), (2, 4), (5, 8)):
        beam, child, ctok, _ = make_step(bs, K, gen=g)
        n = K * K + 3
        out, cs, ct, pl = run_step("reference", beam, child, ctok, None, n, 1,
                                   plist_width=2 * K + 1, parent_offset=K + 1)
        want_s, want_t, top, top_t, best = torch_step(beam, child, ctok, K)
        assert_bits_equal(cs[:, 1:1 + K * K], want_s, "candidate scores")
        assert torch.equal(ct[:, 1:1 + K * K], want_t)
        assert_bits_equal(out.scores, top, "beam scores")
        assert torch.equal(out.tokens, top_t) and torch.equal(out.best, best)
        assert torch.equal(out.parents, best // K) and out.src_rows is None
        assert torch.equal(pl[:, K + 1:2 * K + 1], best + 1)


@pytest.mark.parametrize("kind", ["randn", "ties"])
@pytest.mark.parametrize("bs,K", [(1, 1), (3, 1), (1, 2), (4, 3), (2, 4), (3, 8)])
def test_triton_matches_reference(bs, K, kind, seed, nan_empty):
    """Every output and every buffer element (written or not) equal, bit for bit, for the
    step variants ``_draft`` uses (first step with the incoming beams, middle steps with
    rows and parent block, the last step without selection), on strided buffers."""
    g = torch.Generator().manual_seed(seed)
    S = 4
    n_cand = ops.num_tree_candidates(K, S)
    for s in range(1, S):
        beam, child, ctok, btok = make_step(bs, K, kind, gen=g)
        nxt = s < S - 1
        scratch = torch.randint(0, 1000, (bs, 2 * K), generator=g).to(DEV)
        cur = scratch[:, (s % 2) * K:(s % 2) * K + K] if nxt else None
        if nxt and s == 2:
            cur = cur.int()
        kw = dict(beam_offset=0 if s == 1 else None, select=nxt, cur=cur,
                  plist_width=K * (S - 1) + 1 if nxt else None,
                  parent_offset=K + 1 + (s - 1) * K if nxt else None, extra=6)
        offset = K + (s - 1) * K * K
        got = run_step("triton", beam, child, ctok, btok, n_cand, offset, **kw)
        want = run_step("reference", beam, child, ctok, btok, n_cand, offset, **kw)
        for name, a, b in zip(("cand_scores", "cand_tokens", "parent_list"), got[1:], want[1:]):
            if a is not None:
                assert_bits_equal(a, b, name)
        if not nxt:
            assert got[0] is None and want[0] is None
            continue
        assert isinstance(got[0], BeamStep)
        for name, a, b in zip(BeamStep._fields, got[0], want[0]):
            assert_bits_equal(a, b, name)
        assert got[0].src_rows.dtype == torch.int64
        assert torch.equal(got[0].src_rows, cur.long().gather(1, got[0].parents))


def test_writes_only_its_columns(seed):
    """Poisoned buffers: the step's block (and the beams' block) are written, every other
    element keeps its poison, in both implementations."""
    g = torch.Generator().manual_seed(seed)
    bs, K = 3, 3
    beam, child, ctok, btok = make_step(bs, K, gen=g)
    n, off, boff = 30, 13, 2
    for impl in IMPLS:
        out, cs, ct, pl = run_step(impl, beam, child, ctok, btok, n, off, beam_offset=boff,
                                   plist_width=12, parent_offset=5, extra=4)
        written = torch.zeros(n + 4, dtype=torch.bool)
        written[2 + off:2 + off + K * K] = True
        written[2 + boff:2 + boff + K] = True
        assert not cs[:, written].isnan().any() and (ct[:, written] != POISON_T).all()
        assert cs[:, ~written].isnan().all() and (ct[:, ~written] == POISON_T).all()
        assert_bits_equal(cs[:, 2 + boff:2 + boff + K], beam, "beams")
        assert torch.equal(ct[:, 2 + boff:2 + boff + K], btok)
        pw = torch.zeros(12, dtype=torch.bool)
        pw[5:5 + K] = True
        assert (pl[:, ~pw] == POISON_T).all() and torch.equal(pl[:, pw], out.best + off)


@pytest.mark.parametrize("impl", IMPLS)
def test_tie_rule(impl, seed):
    """Integer-valued scores (many ties, zeros of both signs): the next beams are the
    stable-sort oracle's (lower candidate column first), and chosen ``-0.0`` scores keep
    their sign bit."""
    g = torch.Generator().manual_seed(seed)
    for bs, K in ((4, 2), (3, 4), (2, 8)):
        beam, child, ctok, _ = make_step(bs, K, "ties", gen=g)
        out, cs, *_ = run_step(impl, beam, child, ctok, None, K * K, 0)
        cand = (beam[..., None] + child.view(bs, K, K)).flatten(1)
        best = stable_top(cand, K)
        assert torch.equal(out.best, best)
        assert_bits_equal(out.scores, cand.gather(1, best), "scores")
    # all equal: beams are candidates 0 .. K-1 (beam 0's children)
    K = 4
    beam = torch.zeros(2, K, device=DEV)
    child = torch.full((2 * K, K), -1.0, device=DEV)
    out, *_ = run_step(impl, beam, child, torch.arange(2 * K * K, device=DEV).view(2 * K, K), None, K * K, 0)
    assert out.best.tolist() == [[0, 1, 2, 3]] * 2 and (out.parents == 0).all()
    assert out.tokens.tolist() == [[0, 1, 2, 3], [16, 17, 18, 19]]
    # -0.0 and +0.0 tie: the lower column wins whatever the sign
    beam = torch.tensor([[0.0, -0.0]], device=DEV)
    child = torch.tensor([[-0.0, -1.0], [0.0, -1.0]], device=DEV)
    out, *_ = run_step(impl, beam, child, torch.zeros(2, 2, dtype=torch.int64, device=DEV), None, 4, 0)
    assert out.best.tolist() == [[0, 2]]
    assert_bits_equal(out.scores, torch.tensor([[0.0 + -0.0, -0.0 + 0.0]], device=DEV))


@pytest.mark.parametrize("impl", IMPLS)
def test_k1_and_empty_batch(impl, seed):
    g = torch.Generator().manual_seed(seed)
    beam, child, ctok, btok = make_step(3, 1, gen=g)
    out, cs, ct, pl = run_step(impl, beam, child, ctok, btok, 4, 1, beam_offset=0,
                               cur=torch.arange(3, device=DEV)[:, None] * 7, plist_width=2, parent_offset=1)
    assert_bits_equal(out.scores, beam + child, "scores")
    assert torch.equal(out.tokens, ctok) and (out.best == 0).all() and (out.parents == 0).all()
    assert out.src_rows[:, 0].tolist() == [0, 7, 14] and torch.equal(pl[:, 1:], torch.ones_like(pl[:, 1:]))
    assert_bits_equal(cs[:, :2], torch.cat([beam, beam + child], 1))
    assert cs[:, 2:].isnan().all()
    e = torch.empty(0, 2, device=DEV)
    out = eagle_beam_step(e, torch.empty(0, 2, device=DEV), torch.empty(0, 2, dtype=torch.int64, device=DEV),
                          torch.empty(0, 6, device=DEV), torch.empty(0, 6, dtype=torch.int64, device=DEV), 2,
                          cur_rows=torch.empty(0, 2, dtype=torch.int64, device=DEV), impl=impl)
    assert all(t.shape == (0, 2) for t in out)


def test_a_whole_draft_matches_the_torch_path(seed, nan_empty):
    """``S - 1`` chained steps as ``_draft`` runs them, Triton vs the PyTorch ops: the same
    candidate buffers (no ``cat``), ``parent_list`` and beams at every step, and the same
    ``select_draft_tokens`` result as ``topk(D - 1).indices.sort()``."""
    g = torch.Generator().manual_seed(seed)
    for bs, K, S, D in ((2, 4, 5, 16), (1, 2, 3, 7), (3, 1, 4, 4), (2, 3, 2, 13)):
        n_cand = ops.num_tree_candidates(K, S)
        beam, _, _, btok = make_step(bs, K, gen=g)
        roots = torch.randint(0, 100, (bs,), generator=g).to(DEV)
        # the PyTorch path
        t_scores, t_tokens, blocks = [beam], [btok], [torch.cat([torch.tensor([-1]), torch.arange(K)]).to(DEV)
                                                      [None].expand(bs, K + 1)]
        # the fused path
        all_s = torch.full((bs, n_cand), POISON_S, device=DEV)
        all_t = torch.full((bs, n_cand), POISON_T, dtype=torch.int64, device=DEV)
        plist = torch.empty(bs, K * (S - 1) + 1, dtype=torch.int64, device=DEV)
        plist[:, :K + 1] = blocks[0]
        fb, tb = beam, beam  # the beams of each path
        for s in range(1, S):
            _, child, ctok, _ = make_step(bs, K, gen=g)
            nxt = s < S - 1
            step = eagle_beam_step(fb, child, ctok, all_s, all_t, K + (s - 1) * K * K,
                                   beam_tokens=btok if s == 1 else None, beam_offset=0 if s == 1 else None,
                                   select=nxt, parent_list=plist if nxt else None,
                                   parent_offset=K + 1 + (s - 1) * K if nxt else None, impl="triton")
            cs, ct, top, top_t, best = torch_step(tb, child, ctok, K)
            t_scores.append(cs)
            t_tokens.append(ct)
            if nxt:
                blocks.append(best + (K + (s - 1) * K * K))
                assert_bits_equal(step.scores, top, "beam scores")
                assert torch.equal(step.tokens, top_t) and torch.equal(step.best, best)
                fb, tb = step.scores, top
        scores, tokens = torch.cat(t_scores, 1), torch.cat(t_tokens, 1)
        assert_bits_equal(all_s, scores, "candidate scores")
        assert torch.equal(all_t, tokens) and torch.equal(plist, torch.cat(blocks, 1))
        want_sel = scores.topk(D - 1, dim=-1).indices.sort(dim=-1).values
        want_draft = torch.cat([roots[:, None], tokens.gather(1, want_sel)], 1)
        for impl in IMPLS:
            sel, draft = select_draft_tokens(all_s, all_t, roots, D, impl=impl)
            assert torch.equal(sel, want_sel) and torch.equal(draft, want_draft)


# ------------------------------------------------------------------ select_draft_tokens
SELECT_CASES = [  # (bs, n_cand, D): one candidate, top rounds, bottom rounds, D - 1 == n_cand, tiles
    (1, 1, 2), (3, 4, 2), (3, 4, 5), (2, 68, 16), (2, 68, 40), (1, 68, 69), (4, 21, 11),
    (2, 300, 64), (1, 300, 290), (2, 1000, 1001),
]


@pytest.mark.parametrize("kind", ["randn", "ties"])
@pytest.mark.parametrize("bs,n,D", SELECT_CASES)
def test_select_matches_reference_and_oracle(bs, n, D, kind, seed, nan_empty):
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        x = torch.randint(-3, 1, (bs, n), generator=g).float()
        x = torch.where((x == 0) & (torch.rand(bs, n, generator=g) < 0.5), -0.0, x)
    else:
        x = -torch.rand(bs, n, generator=g) * 20
    x = x.to(DEV)
    tok = torch.randint(0, 10 ** 6, (bs, n), generator=g).to(DEV)
    roots = torch.randint(0, 10 ** 6, (bs,), generator=g).to(DEV)
    want_sel = stable_top(x, D - 1).sort(dim=-1).values
    want_draft = torch.cat([roots[:, None], tok.gather(1, want_sel)], 1)
    if kind == "randn":  # distinct scores: what torch.topk + sort give
        assert torch.equal(want_sel, x.topk(D - 1, dim=-1).indices.sort(dim=-1).values)
    for impl in IMPLS:
        sel, draft = select_draft_tokens(x, tok, roots, D, impl=impl)
        assert sel.dtype == draft.dtype == torch.int64
        assert torch.equal(sel, want_sel), (impl, sel, want_sel)
        assert torch.equal(draft, want_draft), impl


def test_select_strided_and_empty(seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 90, generator=g).to(DEV)
    tok = torch.randint(0, 99, (90, 6), generator=g).to(DEV).t()        # column-major
    roots = torch.arange(12, device=DEV)[::2]
    x = base[:, ::2][:, :40]
    want = select_draft_tokens(x.contiguous(), tok[:, :40].contiguous(), roots.contiguous(), 9, impl="reference")
    for impl in IMPLS:
        got = select_draft_tokens(x, tok[:, :40], roots, 9, impl=impl)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        sel, draft = select_draft_tokens(torch.empty(0, 5, device=DEV),
                                         torch.empty(0, 5, dtype=torch.int64, device=DEV),
                                         torch.empty(0, dtype=torch.int64, device=DEV), 3, impl=impl)
        assert sel.shape == (0, 2) and draft.shape == (0, 3)


# ------------------------------------------------------------------ registry and validation
def test_registry():
    for name in ("eagle_beam_step", "select_draft_tokens"):
        assert name in registry.names()
        assert registry.availability(name)["reference"] is None
    assert registry.dispatch("select_draft_tokens", "auto", "cpu") is ops.select_draft_tokens_reference
    assert registry.dispatch("eagle_beam_step", "auto", "cpu") is ops.eagle_beam_step_reference
    if torch.cuda.is_available():
        from specattn.triton_kernels import eagle_draft as tk
        assert registry.dispatch("eagle_beam_step", "auto", "cuda") is tk.eagle_beam_step
        assert registry.dispatch("select_draft_tokens", "auto", "cuda") is tk.select_draft_tokens


def test_beam_step_validation_errors():
    f32, i64 = torch.float32, torch.int64

    def z(*shape, dtype=f32):
        return torch.zeros(*shape, dtype=dtype, device=DEV)

    bs, K = 2, 3
    good = dict(beam_scores=z(bs, K), child_scores=z(bs * K, K), child_tokens=z(bs * K, K, dtype=i64),
                cand_scores=z(bs, 20), cand_tokens=z(bs, 20, dtype=i64), offset=3)

    def call(**kw):
        args = {**good, **kw}
        pos = [args.pop(k) for k in ("beam_scores", "child_scores", "child_tokens", "cand_scores",
                                     "cand_tokens", "offset")]
        return eagle_beam_step(*pos, **args)

    call()  # fine
    bad = [
        (dict(beam_scores=z(bs, 9), child_scores=z(bs * 9, 9), child_tokens=z(bs * 9, 9, dtype=i64)),
         ValueError, r"topk .* must be in \[1, 8\], got 9"),
        (dict(beam_scores=z(bs, 0)), ValueError, r"\[1, 8\]"),
        (dict(beam_scores=z(bs, K, dtype=torch.float16)), ValueError, "beam_scores must have dtype"),
        (dict(beam_scores=z(bs)), ValueError, "beam_scores must be 2-D"),
        (dict(child_scores=z(bs * K, K + 1)), ValueError, "child_scores must have shape"),
        (dict(child_tokens=z(bs * K, K, dtype=torch.int32)), ValueError, "child_tokens must have dtype"),
        (dict(cand_scores=z(bs + 1, 20)), ValueError, "cand_scores must have shape"),
        (dict(cand_tokens=z(bs, 21, dtype=i64)), ValueError, "cand_tokens must have shape"),
        (dict(offset=12), ValueError, r"offset must be in \[0, 11\]"),
        (dict(offset=-1), ValueError, "offset must be in"),
        (dict(offset=3.0), TypeError, "offset must be an int"),
        (dict(beam_offset=0), ValueError, "beam_tokens and beam_offset go together"),
        (dict(beam_tokens=z(bs, K, dtype=i64)), ValueError, "beam_tokens and beam_offset go together"),
        (dict(beam_tokens=z(bs, K, dtype=i64), beam_offset=1), ValueError, "overlap"),
        (dict(beam_tokens=z(bs, K, dtype=i64), beam_offset=18), ValueError, r"beam_offset must be in \[0, 17\]"),
        (dict(beam_tokens=z(bs, K + 1, dtype=i64), beam_offset=0), ValueError, "beam_tokens must have shape"),
        (dict(select=False, cur_rows=z(bs, K, dtype=i64)), ValueError, "need select=True"),
        (dict(select=False, parent_list=z(bs, 9, dtype=i64), parent_offset=0), ValueError, "need select=True"),
        (dict(select=1), TypeError, "select must be a bool"),
        (dict(cur_rows=z(bs, K)), ValueError, "cur_rows must have dtype"),
        (dict(cur_rows=z(bs, K + 1, dtype=i64)), ValueError, "cur_rows must have shape"),
        (dict(parent_list=z(bs, 9, dtype=i64)), ValueError, "parent_list and parent_offset go together"),
        (dict(parent_list=z(bs, 9, dtype=i64), parent_offset=7), ValueError, r"parent_offset must be in \[0, 6\]"),
        (dict(parent_list=z(bs, 9, dtype=torch.int32), parent_offset=0), ValueError, "parent_list must have dtype"),
        (dict(beam_scores=[[0.0]]), TypeError, "beam_scores must be a torch.Tensor"),
        (dict(impl="fast"), ValueError, "impl must be"),
    ]
    for kw, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            call(**kw)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="cand_scores must be on"):
            call(cand_scores=torch.zeros(bs, 20))


def test_select_validation_errors():
    x, t, r = torch.zeros(2, 10, device=DEV), torch.zeros(2, 10, dtype=torch.int64, device=DEV), \
        torch.zeros(2, dtype=torch.int64, device=DEV)
    select_draft_tokens(x, t, r, 11)  # fine: D - 1 == n_cand
    bad = [
        ((x, t, r, 1), ValueError, r"num_draft_tokens must be in \[2, 11\], got 1"),
        ((x, t, r, 12), ValueError, r"num_draft_tokens must be in \[2, 11\], got 12"),
        ((x, t, r, 4.0), TypeError, "num_draft_tokens must be an int"),
        ((x, t, r, True), TypeError, "num_draft_tokens must be an int"),
        ((x.double(), t, r, 4), ValueError, "scores must have dtype"),
        ((x[0], t, r, 4), ValueError, "scores must be 2-D"),
        ((torch.zeros(2, 0, device=DEV), t[:, :0], r, 2), ValueError, "1 <= n_cand <= 4096"),
        ((torch.zeros(1, 4097, device=DEV), t, r, 2), ValueError, "1 <= n_cand <= 4096"),
        ((x, t.int(), r, 4), ValueError, "tokens must have dtype"),
        ((x, t[:, :9], r, 4), ValueError, "tokens must have shape"),
        ((x, t, r[:1], 4), ValueError, "roots must have shape"),
        ((x, t, r.int(), 4), ValueError, "roots must have dtype"),
    ]
    for args, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            select_draft_tokens(*args)
    with pytest.raises(ValueError, match="impl must be"):
        select_draft_tokens(x, t, r, 4, impl="fast")


def test_triton_impl_needs_interpreter_or_gpu(monkeypatch):
    from specattn.triton_kernels import eagle_draft as tk
    monkeypatch.setattr(tk, "_INTERPRET", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        tk.select_draft_tokens(torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.int64),
                               torch.zeros(1, dtype=torch.int64), 3)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ops.eagle_beam_step(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.int64),
                            torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.int64), 0, impl="triton")


# ------------------------------------------------------------------ fork_req_to_token_rows
def fork_oracle(rtt, src, dst, first, num_cols, new_col, new_slots):
    """Element by element, from a snapshot (every read before any write)."""
    out, W = rtt.clone(), rtt.shape[1]
    for b in range(dst.shape[0]):
        for j in range(dst.shape[1]):
            for c in range(num_cols):
                col = int(first[b]) + c
                if 0 <= col < W and (new_col is None or col != int(new_col[b])):
                    out[dst[b, j], col] = rtt[src[b, j], col]
            if new_col is not None and 0 <= int(new_col[b]) < W:
                out[dst[b, j], int(new_col[b])] = int(new_slots[b, j])
    return out


def fork_case(gen, bs, R, W, num_cols, new=True, rows_extra=3):
    """Random disjoint src / dst rows (int32 src, strided dst), first columns and new columns
    reaching past both edges of the table, strided new slots."""
    rows = 2 * bs * R + rows_extra
    perm = torch.randperm(rows, generator=gen)
    src = perm[:bs * R].view(bs, R).int()
    dst = perm[bs * R:2 * bs * R].view(R, bs).t()                  # strided
    rtt = torch.randint(0, 10**6, (rows, W), generator=gen, dtype=torch.int32)
    first = torch.randint(-3, W + 2, (bs,), generator=gen)
    new_col = (first + torch.randint(-1, num_cols + 2, (bs,), generator=gen)) if new else None
    new_slots = torch.randint(0, 10**6, (bs, 2 * R), generator=gen)[:, ::2] if new else None
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return to(rtt), to(src), to(dst), to(first), num_cols, to(new_col), to(new_slots)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bs,R,W,num_cols", [(1, 1, 8, 0), (1, 4, 16, 3), (3, 2, 9, 7), (2, 8, 40, 20),
                                             (4, 3, 5, 9)])
def test_fork_rows_matches_oracle(impl, bs, R, W, num_cols, seed):
    gen = torch.Generator().manual_seed(seed)
    for new in (True, False):
        rtt, src, dst, first, n, new_col, new_slots = fork_case(gen, bs, R, W, num_cols, new)
        want = fork_oracle(rtt.cpu(), src.cpu(), dst.cpu(), first.cpu(), n,
                           None if new_col is None else new_col.cpu(),
                           None if new_slots is None else new_slots.cpu())
        out = ops.fork_req_to_token_rows(rtt, src, dst, first, n, new_col=new_col, new_slots=new_slots,
                                         impl=impl)
        assert torch.equal(rtt.cpu(), want), (impl, new)
        if new:
            prefix, loc = out
            assert prefix.dtype == loc.dtype == torch.int64
            assert torch.equal(prefix.cpu(), new_col.cpu().long()[:, None].expand(bs, R).reshape(-1))
            assert torch.equal(loc.cpu(), new_slots.cpu().reshape(-1))
        else:
            assert out is None


@pytest.mark.parametrize("impl", IMPLS)
def test_fork_rows_empty_batch(impl):
    rtt = torch.arange(12, dtype=torch.int32, device=DEV).view(3, 4)
    e = torch.zeros(0, 2, dtype=torch.int64, device=DEV)
    e1 = torch.zeros(0, dtype=torch.int64, device=DEV)
    prefix, loc = ops.fork_req_to_token_rows(rtt, e, e, e1, 3, new_col=e1, new_slots=e, impl=impl)
    assert prefix.shape == loc.shape == (0,)
    assert torch.equal(rtt.cpu(), torch.arange(12, dtype=torch.int32).view(3, 4))


def test_fork_rows_validation_errors():
    rtt = torch.zeros(8, 6, dtype=torch.int32, device=DEV)
    src = torch.tensor([[0, 1]], device=DEV)
    dst = torch.tensor([[2, 3]], device=DEV)
    first = torch.tensor([1], device=DEV)
    fork = ops.fork_req_to_token_rows
    with pytest.raises(ValueError, match="dtype"):
        fork(rtt.float(), src, dst, first, 2)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fork(rtt.t(), src, dst, first, 2)
    with pytest.raises(ValueError, match="src_rows must have shape"):
        fork(rtt, src[:, :1], dst, first, 2)
    with pytest.raises(ValueError, match="first_col must have shape"):
        fork(rtt, src, dst, first.repeat(2), 2)
    with pytest.raises(TypeError, match="num_cols must be an int"):
        fork(rtt, src, dst, first, 2.0)
    with pytest.raises(ValueError, match="num_cols must be in"):
        fork(rtt, src, dst, first, -1)
    with pytest.raises(ValueError, match="go together"):
        fork(rtt, src, dst, first, 2, new_col=first)
    with pytest.raises(ValueError, match="new_slots must have shape"):
        fork(rtt, src, dst, first, 2, new_col=first, new_slots=src[:, :1])
    with pytest.raises(IndexError, match="dst_rows"):
        fork(rtt, src, dst + 6, first, 2)
    with pytest.raises(IndexError, match="src_rows"):
        fork(rtt, src - 1, dst, first, 2)
    with pytest.raises(ValueError, match="repeats a row"):
        fork(rtt, src, torch.tensor([[2, 2]], device=DEV), first, 2)
    with pytest.raises(ValueError, match="also a src row"):
        fork(rtt, src, torch.tensor([[2, 0]], device=DEV), first, 2)
    assert torch.equal(rtt, torch.zeros_like(rtt)), "a rejected call wrote the table"


# ------------------------------------------------------------------ the runtime's round
@pytest.mark.parametrize("algo", ["self", "eagle3"])
@pytest.mark.parametrize("spec,page_size", [((3, 3, 8), 1), ((2, 4, 6), 4), ((1, 3, 4), 1)],
                         ids=["tree", "tree-paged", "chain"])
def test_eagle_round_with_the_fused_ops(tmp_path, seed, spec, page_size, algo, monkeypatch):
    """``EagleStrategy`` with the fused draft ops forced (``draft_ops_impl``: the Triton
    kernels, in the interpreter on a CPU, and their references) emits the same tokens and
    accept lengths as its PyTorch path, and stays lossless against target-only greedy."""
    calls = []
    for name in ("eagle_beam_step", "select_draft_tokens", "fork_req_to_token_rows"):
        def spy(*args, _fn=getattr(ops, name), _name=name, **kw):
            calls.append((_name, kw.get("impl")))
            return _fn(*args, **kw)
        monkeypatch.setattr(ops, name, spy)
    from specattn.spec_runtime.eagle3 import Eagle3Drafter
    from specattn.spec_runtime.engine import Engine, SpecConfig
    from specattn.spec_runtime.model import LlamaModel
    from specattn.spec_runtime.sampling import SamplingParams
    from tiny_models import random_prompts, tiny_llama

    cfg, w = tiny_llama(tmp_path, seed, layers=4)
    target = LlamaModel(cfg, dict(w), DEV)
    drafter = None
    if algo == "eagle3":  # drafting from a draft vocabulary: child tokens map back to ids
        drafter = Eagle3Drafter.from_target(target, seed=seed)
        drafter.set_draft_vocab(torch.randperm(96, generator=torch.Generator().manual_seed(seed))[:40])
    prompts = random_prompts(seed, 96)
    p = SamplingParams(max_new_tokens=12)
    base = Engine(target, max_context=64).generate(prompts, p)
    runs = {}
    for impl in ("torch", "reference", "triton"):
        eng = Engine(target, spec=SpecConfig("eagle", *spec, draft_layers=2), max_context=64,
                     draft_model=drafter, page_size=page_size)
        eng.strategy.draft_ops_impl = impl
        calls.clear()
        runs[impl] = eng.generate(prompts, p)
        assert runs[impl].tokens == base.tokens, (impl, f"seed={seed}")
        rounds = calls.count(("select_draft_tokens", impl))   # one per round, S - 1 steps each
        K, S = spec[0], spec[1]
        forks = 0 if K == 1 else (S if page_size == 1 else 1)  # per step + the restore; paged: restore
        assert len(calls) == rounds * (S + forks) and (rounds > 0) == (impl != "torch"), calls
    assert runs["triton"].accept_lengths == runs["torch"].accept_lengths == runs["reference"].accept_lengths


# ------------------------------------------------------------------ GPU
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("algo", ["self", "eagle3"])
def test_gpu_eagle_round_in_a_cuda_graph(tmp_path, seed, algo):
    """On CUDA the round takes the fused ops by default (Triton) and is captured whole in a
    CUDA graph: lossless, and the same accept lengths as the PyTorch path in a graph."""
    from specattn.spec_runtime.eagle3 import Eagle3Drafter
    from specattn.spec_runtime.engine import Engine, SpecConfig
    from specattn.spec_runtime.model import LlamaModel
    from specattn.spec_runtime.sampling import SamplingParams
    from tiny_models import random_prompts, tiny_llama

    cfg, w = tiny_llama(tmp_path, seed, layers=4)
    target = LlamaModel(cfg, dict(w), "cuda")
    drafter = Eagle3Drafter.from_target(target, seed=seed) if algo == "eagle3" else None
    prompts = random_prompts(seed, 96)
    p = SamplingParams(max_new_tokens=24)
    kw = dict(max_context=128, max_batch=3)
    base = Engine(target, **kw).generate(prompts, p)
    runs = {}
    for impl in (None, "torch"):
        eng = Engine(target, spec=SpecConfig("eagle", 4, 5, 16, draft_layers=2), draft_model=drafter,
                     cuda_graph=True, **kw)
        if impl is not None:
            eng.strategy.draft_ops_impl = impl
        runs[impl] = eng.generate(prompts, p)
        assert eng.round_graphs and runs[impl].tokens == base.tokens, (impl, f"seed={seed}")
    assert runs[None].accept_lengths == runs["torch"].accept_lengths


@gpu
@pytest.mark.parametrize("bs,K,S,D", [(1, 4, 5, 16), (16, 4, 5, 16), (64, 8, 5, 64), (7, 1, 6, 6),
                                      (3, 8, 8, 300)])
def test_gpu_matches_reference(bs, K, S, D, seed):
    """The CUDA kernels equal the reference bit for bit on a whole draft (random and tied
    scores), with ``auto`` dispatching to Triton."""
    n_cand = ops.num_tree_candidates(K, S)
    for kind in ("randn", "ties"):
        res = {}
        for impl in ("reference", "triton", "auto"):
            gs = torch.Generator().manual_seed(seed + 1)
            beam, _, _, btok = make_step(bs, K, kind, gen=gs)
            all_s = torch.full((bs, n_cand), POISON_S, device=DEV)
            all_t = torch.full((bs, n_cand), POISON_T, dtype=torch.int64, device=DEV)
            plist = torch.full((bs, K * (S - 1) + 1), POISON_T, dtype=torch.int64, device=DEV)
            cur = torch.randint(0, 999, (bs, 2 * K), generator=gs).to(DEV)
            steps = []
            for s in range(1, S):
                _, child, ctok, _ = make_step(bs, K, kind, gen=gs)
                nxt = s < S - 1
                st = eagle_beam_step(beam, child, ctok, all_s, all_t, K + (s - 1) * K * K,
                                     beam_tokens=btok if s == 1 else None, beam_offset=0 if s == 1 else None,
                                     select=nxt, cur_rows=cur[:, :K] if nxt else None,
                                     parent_list=plist if nxt else None,
                                     parent_offset=K + 1 + (s - 1) * K if nxt else None, impl=impl)
                if nxt:
                    steps.append(st)
                    beam = st.scores
            roots = torch.arange(bs, device=DEV)
            res[impl] = (all_s, all_t, plist, *select_draft_tokens(all_s, all_t, roots, D, impl=impl), steps)
        for impl in ("triton", "auto"):
            for a, b in zip(res[impl][:5], res["reference"][:5]):
                assert_bits_equal(a, b, impl)
            for sa, sb in zip(res[impl][5], res["reference"][5]):
                for a, b in zip(sa, sb):
                    assert_bits_equal(a, b, impl)


@gpu
def test_gpu_no_host_sync_and_cuda_graph(seed):
    """The Triton paths never sync with the host (CUDA sync-debug mode 'error'), and a draft
    step + selection captured in a CUDA graph and replayed on new inputs equals an eager
    call."""
    bs, K, S, D = 4, 4, 5, 16
    n_cand = ops.num_tree_candidates(K, S)
    beam, child, ctok, btok = make_step(bs, K)
    cur = torch.arange(bs * K, device=DEV).view(bs, K)
    all_s = torch.zeros(bs, n_cand, device=DEV)
    all_t = torch.zeros(bs, n_cand, dtype=torch.int64, device=DEV)
    plist = torch.zeros(bs, K * (S - 1) + 1, dtype=torch.int64, device=DEV)
    roots = torch.arange(bs, device=DEV)

    def work():
        st = eagle_beam_step(beam, child, ctok, all_s, all_t, K, beam_tokens=btok, beam_offset=0,
                             cur_rows=cur, parent_list=plist, parent_offset=K + 1)
        return st, select_draft_tokens(all_s, all_t, roots, D)

    work()  # compile
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        work()
    finally:
        torch.cuda.set_sync_debug_mode(old)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_step, (g_sel, g_draft) = work()
    for kind in ("randn", "ties"):
        nb, nc, nt, nbt = make_step(bs, K, kind)
        for dst, src in ((beam, nb), (child, nc), (ctok, nt), (btok, nbt)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        snap = (all_s.clone(), all_t.clone(), plist.clone())
        e_step, (e_sel, e_draft) = work()
        for a, b in zip(snap, (all_s, all_t, plist)):
            assert_bits_equal(a, b)
        for a, b in zip(g_step, e_step):
            assert_bits_equal(a, b)
        assert torch.equal(g_sel, e_sel) and torch.equal(g_draft, e_draft)
        ref = ops.select_draft_tokens(all_s, all_t, roots, D, impl="reference")
        assert torch.equal(g_sel, ref[0]) and torch.equal(g_draft, ref[1])


@gpu
def test_gpu_fork_rows_graph_replay(seed):
    """The Triton fork equals the reference on a large case, never syncs with the host
    (``check_values=False``) and replays from a CUDA graph on new inputs."""
    gen = torch.Generator().manual_seed(seed)
    rtt, src, dst, first, n, new_col, new_slots = fork_case(gen, 64, 8, 2048, 300)
    ref = rtt.clone()
    want = ops.fork_req_to_token_rows(ref, src, dst, first, n, new_col=new_col, new_slots=new_slots,
                                      impl="reference")
    got = ops.fork_req_to_token_rows(rtt, src, dst, first, n, new_col=new_col, new_slots=new_slots)
    assert torch.equal(rtt, ref) and all(torch.equal(a, b) for a, b in zip(got, want))
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.fork_req_to_token_rows(rtt, src, dst, first, n, new_col=new_col, new_slots=new_slots,
                                   check_values=False)
    finally:
        torch.cuda.set_sync_debug_mode(old)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_prefix, g_loc = ops.fork_req_to_token_rows(rtt, src, dst, first, n, new_col=new_col,
                                                     new_slots=new_slots, check_values=False)
    first.copy_(torch.randint(-3, 2050, first.shape, generator=gen).to(DEV))
    new_col.copy_(first + 5)
    new_slots.copy_(torch.randint(0, 10**6, new_slots.shape, generator=gen).to(DEV))
    ref = rtt.clone()
    want = ops.fork_req_to_token_rows(ref, src, dst, first, n, new_col=new_col, new_slots=new_slots,
                                      impl="reference")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(rtt, ref) and torch.equal(g_prefix, want[0]) and torch.equal(g_loc, want[1])
