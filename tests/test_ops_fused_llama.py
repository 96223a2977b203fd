"""Fused Llama-layer ops (rms_norm_matmul, qkv_rope_store, matmul_residual, rms_norm_swiglu,
and the LM head's rms_norm_matmul_topk):
Triton and reference against a float64 computation written here (no shared code), on fresh
random inputs (the ``seed`` fixture), with poisoned caches and NaN-filled fresh outputs.

Error metric (the precision contract of :mod:`specattn.ops.fused_llama`): the largest
``(|out - exact| - step * |exact|) / rms(exact row)`` over all elements, where ``exact`` is
float64 on the same (rounded) inputs and ``step`` bounds the relative error of one
round-to-nearest to the output dtype (0 for float32, ``2^-8`` for bfloat16, ``2^-11`` for
float16); SwiGLU outputs use a per-element scale instead of the row rms
(:func:`swiglu_scale`).  Bounds: Triton 1e-4 (float32) and 2e-2 (16-bit), the reference
1e-4 and 5e-2.  ``pytest -s`` prints each check and, last, the worst plain errors
``|out - exact| / scale`` of the run (the numbers the module docstring quotes).

float8_e4m3fn caches (``k_scale`` / ``v_scale``): the bound above plus one e4m3 step
(``2^-3 |exact| + 2^-9 scale``) of the saturated truth; and bit for bit ``quantize_kv`` of
the float32 values the same call stores in a float32 cache (:func:`fp8_rounding_mismatch`).

On a CPU-only machine the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set below before triton is imported) on small shapes; its bf16 ``tl.dot`` is wrong and its
``.to(bfloat16)`` truncates, so there the kernels multiply the 16-bit values in float32 and
round to bfloat16 on the float32 bits (see ``triton_kernels/fused_llama.py``).  The
``gpu``-marked tests run SmolLM2-135M's shapes and CUDA-graph capture + replay.
"""
import math
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn's Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from specattn.ops import (fold_rms_norm_weight, make_cos_sin_cache, matmul_residual,  # noqa: E402
                          qkv_rope_store, registry, rms_norm_matmul, rms_norm_swiglu)
from specattn.ops import fused_llama as fl  # noqa: E402
from specattn.ops.fp8 import FP8_E4M3_MAX, quantize_kv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OPS = ("rms_norm_matmul", "rms_norm_matmul_topk", "qkv_rope_store", "matmul_residual", "rms_norm_swiglu")
IMPLS = ("triton", "reference")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
REF_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}
STEP = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
FP8 = torch.float8_e4m3fn
FP8_STEP, FP8_SUB_STEP = 2.0 ** -3, 2.0 ** -9  # one e4m3 step: relative (normal), absolute * scale
EPS = 1e-5

# (M, K, N): M across the BLOCK_M variants (16 / 32 / 64), K with and without a K tail
SHAPES = [(1, 64, 64), (5, 100, 130), (17, 40, 96), (33, 64, 130)]
# (M, K, H, Hkv, D)
QKV_SHAPES = [(1, 64, 3, 1, 32), (5, 100, 4, 2, 64), (17, 40, 3, 1, 32), (33, 64, 4, 2, 64)]


# ------------------------------------------------------------------ inputs and float64 truth
def act(M, K, dt, scale=3.0):
    """Activations with a spread of row scales (an un-normalized residual stream)."""
    rows = scale * torch.rand(M, 1, dtype=torch.float64, device=DEV) + 0.1
    return (torch.randn(M, K, dtype=torch.float64, device=DEV) * rows).to(dt)


def lin(N, K, dt):
    return (torch.randn(N, K, device=DEV) / math.sqrt(K)).to(dt)


def gain(K, dt):
    return (1.0 + 0.3 * torch.randn(K, device=DEV)).to(dt)


def exact_norm(x, g, eps=EPS):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g.double()


def exact_rope(y, positions, cs):
    """``y [T, H, D]`` float64, rotate-half RoPE with the cache's (float32) cos / sin."""
    half = y.shape[-1] // 2
    c = cs.double()[positions.long()]
    cos, sin = c[:, None, :half], c[:, None, half:]
    lo, hi = y[..., :half], y[..., half:]
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1)


def _rows(t, exact):
    return t.double().reshape(exact.shape[0], -1)


def row_scale(exact):
    """rms of each row of ``exact`` (float64), as a ``[rows, 1]`` column."""
    return _rows(exact, exact).pow(2).mean(-1, keepdim=True).sqrt()


def row_err(out, exact, dt, scale=None):
    """``max(|out - exact| - step*|exact|) / scale`` over all elements (float64); ``scale``
    (broadcast against ``exact``'s rows) defaults to the rms of the exact row."""
    out, ex = _rows(out, exact), _rows(exact, exact)
    assert torch.isfinite(out).all(), "non-finite output (an unwritten or poisoned element?)"
    dev = ((out - ex).abs() - STEP[dt] * ex.abs()).clamp_min(0)
    scale = row_scale(exact) if scale is None else _rows(scale, exact)
    return float((dev / scale.clamp_min(1e-30)).max())


def plain_err(out, exact, scale=None):
    """``max |out - exact| / scale`` (default scale: the rms of the exact row)."""
    out, ex = _rows(out, exact), _rows(exact, exact)
    scale = row_scale(exact) if scale is None else _rows(scale, exact)
    return float(((out - ex).abs() / scale.clamp_min(1e-30)).max())


ERRORS = {}  # (name, dtype) -> worst plain error seen (printed by test_zz_error_summary)


def _record(name, dt, err):
    key = (name, str(dt))
    ERRORS[key] = max(ERRORS.get(key, 0.0), err)


def check(name, out, exact, dt, ref_out=None, scale=None):
    """Assert the contract for ``out`` (bound TOL) and, given ``ref_out``, the looser bound
    REF_TOL for the reference (the model's unfused sequence rounds more often)."""
    err = row_err(out, exact, dt, scale)
    _record(name, dt, plain_err(out, exact, scale))
    msg = f"{name} {dt}: error {err:.3g}"
    if ref_out is not None:
        ref_err = row_err(ref_out, exact, dt, scale)
        _record(name.replace("triton", "reference"), dt, plain_err(ref_out, exact, scale))
        msg += f", reference {ref_err:.3g}"
        print(msg)
        assert ref_err <= REF_TOL[dt], msg
    else:
        print(msg)
    assert err <= (REF_TOL if "reference" in name else TOL)[dt], msg


def swiglu_scale(gate, up):
    """Per-element scale of ``silu(g) * u``: errors ``e_g``, ``e_u`` of the two GEMMs (each
    of the order of its row's rms) propagate as ``silu'(g) u e_g + silu(g) e_u``, so the
    natural scale is ``|u| rms(g) + |silu(g)| rms(u)``."""
    return up.abs() * row_scale(gate) + (gate * torch.sigmoid(gate)).abs() * row_scale(up)


def positions_for(M, max_pos):
    pos = torch.randint(0, max_pos, (M,), device=DEV)
    if M > 0:
        pos[0] = max_pos - 1
    if M > 1:
        pos[1] = 0
    return pos


def poisoned_cache(num_slots, Hkv, D, dt):
    c = torch.full((num_slots, Hkv, D), float("nan"), dtype=dt, device=DEV)
    c[::3] = 1e30 if dt == torch.float32 else FP8_E4M3_MAX if dt == FP8 else 6e4
    return c


def same_bits(a, b):
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


# ------------------------------------------------------------------ the four ops vs float64
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_rms_norm_matmul(M, K, N, dt, impl, seed, nan_empty):
    x, g, w = act(M, K, dt), gain(K, dt), lin(N, K, dt)
    exact = exact_norm(x, g) @ w.double().T
    ref = rms_norm_matmul(x, g, w, EPS, impl="reference")
    out = rms_norm_matmul(x, g, w, EPS, impl=impl)
    assert out.shape == (M, N) and out.dtype == dt
    check(f"rms_norm_matmul[{impl}]", out, exact, dt, ref)
    # float32 logits (the LM head): rounded once, from the float32 accumulator
    out32 = rms_norm_matmul(x, g, w, EPS, out_dtype=torch.float32, impl=impl)
    assert out32.dtype == torch.float32
    err = plain_err(out32, exact)
    assert err <= (REF_TOL if impl == "reference" else TOL)[dt], f"float32 out: {err}"   # as check()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matmul_residual(M, K, N, dt, impl, seed):
    x, w = act(M, K, dt, scale=1.0), lin(N, K, dt)
    residual = act(M, N, dt)
    exact = residual.double() + x.double() @ w.double().T
    ref = matmul_residual(x, w, residual.clone(), impl="reference")
    ptr = residual.data_ptr()
    out = matmul_residual(x, w, residual, impl=impl)
    assert out is residual and out.data_ptr() == ptr
    check(f"matmul_residual[{impl}]", out, exact, dt, ref)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matmul_residual_copy_to(M, K, N, dt, impl, seed):
    """``copy_to``: a column block of a wider, NaN-poisoned tensor receives exactly the
    updated residual (bit for bit), with the sums of squares still returned; the columns
    around it stay poisoned."""
    x, w = act(M, K, dt, scale=1.0), lin(N, K, dt)
    residual = act(M, N, dt)
    plain = matmul_residual(x, w, residual.clone(), impl=impl)
    wide = torch.full((M, 3 * N), float("nan"), dtype=dt, device=DEV)
    out, ss = matmul_residual(x, w, residual, return_row_sumsq=True, copy_to=wide[:, N:2 * N], impl=impl)
    assert out is residual and torch.equal(out, plain)
    assert torch.equal(wide[:, N:2 * N], out)
    assert wide[:, :N].isnan().all() and wide[:, 2 * N:].isnan().all()
    assert torch.allclose(ss.double().sum(0), out.double().pow(2).sum(-1), rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_rms_norm_swiglu(M, K, N, dt, impl, seed, nan_empty):
    x, g = act(M, K, dt), gain(K, dt)
    wg, wu = lin(N, K, dt), lin(N, K, dt)
    n = exact_norm(x, g)
    gate, up = n @ wg.double().T, n @ wu.double().T
    exact = gate * torch.sigmoid(gate) * up
    ref = rms_norm_swiglu(x, g, wg, wu, EPS, impl="reference")
    out = rms_norm_swiglu(x, g, wg, wu, EPS, impl=impl)
    assert out.shape == (M, N) and out.dtype == dt
    check(f"rms_norm_swiglu[{impl}]", out, exact, dt, ref, swiglu_scale(gate, up))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N", [(5, 100, 130), (70, 64, 96)])
def test_folded_norm_weight(M, K, N, dt, impl, seed, nan_empty):
    """``norm_weight=None`` with the norm weight folded into the GEMM weights computes the
    same function as the unfolded op, within the same contract (the fold rounds each weight
    once, as the unfolded kernel rounds ``x * g``)."""
    x, g = act(M, K, dt), gain(K, dt)
    w, wu = lin(N, K, dt), lin(N, K, dt)
    n = exact_norm(x, g)
    out = rms_norm_matmul(x, None, fold_rms_norm_weight(w, g), EPS, out_dtype=torch.float32, impl=impl)
    err = plain_err(out, n @ w.double().T)
    # the reference runs the unfused sequence (more roundings): its looser bound, as in check()
    assert err <= (REF_TOL if impl == "reference" else TOL)[dt], f"rms_norm_matmul folded[{impl}]: {err}"
    gate, up = n @ w.double().T, n @ wu.double().T
    out = rms_norm_swiglu(x, None, fold_rms_norm_weight(w, g), fold_rms_norm_weight(wu, g), EPS, impl=impl)
    check(f"rms_norm_swiglu folded[{impl}]", out, gate * torch.sigmoid(gate) * up, dt,
          scale=swiglu_scale(gate, up))
    inp = qkv_inputs(M, K, 3, 1, 32, dt, dt)
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    q_exact, k_exact, v_exact = qkv_exact(inp)
    q = run_qkv(dict(inp, norm_weight=None, w_qkv=fold_rms_norm_weight(inp["w_qkv"], inp["norm_weight"])), impl)
    check(f"qkv_rope_store folded[{impl}] q", q, q_exact, dt)
    check_caches(inp, before, k_exact, v_exact, dt, f"qkv_rope_store folded[{impl}]")


def row_sumsq_of(x, impl):
    """``x``'s partial sums of squares as a residual GEMM hands them on: ``x + 0 @ 0^T``
    (exact) through :func:`matmul_residual` with ``return_row_sumsq``."""
    M, K = x.shape
    zeros = torch.zeros(M, 16, dtype=x.dtype, device=DEV)
    res, ss = matmul_residual(zeros, torch.zeros(K, 16, dtype=x.dtype, device=DEV), x.clone(),
                              return_row_sumsq=True, impl=impl)
    assert torch.equal(res, x)
    return ss


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N", SHAPES + [(70, 64, 96)])
def test_row_sumsq_handoff(M, K, N, dt, impl, seed):
    """``matmul_residual(return_row_sumsq=True)`` returns ``[P, M]`` float32 partial sums whose
    column sums are the updated rows' sums of squares (of the stored values); every norm
    consumer given them (folded or not) computes what it computes from ``x`` itself."""
    x, w = act(M, K, dt, scale=1.0), lin(N, K, dt)
    residual = act(M, N, dt)
    out, ss = matmul_residual(x, w, residual, return_row_sumsq=True, impl=impl)
    assert out is residual and ss.dtype == torch.float32 and ss.dim() == 2 and ss.shape[1] == M
    assert ss.shape[0] >= 1
    exact = residual.double().pow(2).sum(-1)
    assert torch.allclose(ss.double().sum(0), exact, rtol=1e-5, atol=1e-30)
    h, g = residual, gain(N, dt)
    n = exact_norm(h, g)
    wg, wu, wl = lin(40, N, dt), lin(40, N, dt), lin(48, N, dt)
    gate, up = n @ wg.double().T, n @ wu.double().T
    for nw, fold in ((g, lambda t: t), (None, lambda t: fold_rms_norm_weight(t, g))):
        out = rms_norm_swiglu(h, nw, fold(wg), fold(wu), EPS, row_sumsq=ss, impl=impl)
        check(f"swiglu row_sumsq[{impl}]", out, gate * torch.sigmoid(gate) * up, dt,
              scale=swiglu_scale(gate, up))
        out = rms_norm_matmul(h, nw, fold(wl), EPS, out_dtype=torch.float32, row_sumsq=ss, impl=impl)
        # the reference rounds the normalized rows (and a folded weight) to dt: its looser bound
        assert plain_err(out, n @ wl.double().T) <= (REF_TOL if impl == "reference" else TOL)[dt]
    inp = qkv_inputs(M, N, 3, 1, 32, dt, dt)
    inp["x"] = h
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    q_exact, k_exact, v_exact = qkv_exact(inp)
    q = run_qkv(dict(inp, norm_weight=None, w_qkv=fold_rms_norm_weight(inp["w_qkv"], inp["norm_weight"])),
                impl, row_sumsq=ss)
    check(f"qkv row_sumsq[{impl}] q", q, q_exact, dt)
    check_caches(inp, before, k_exact, v_exact, dt, f"qkv row_sumsq[{impl}]")
    # refused before any kernel: wrong rows, dtype, rank
    for bad in (ss[:, :M - 1] if M > 1 else ss[:, :0], ss.double(), ss[0]):
        with pytest.raises(ValueError, match="row_sumsq"):
            rms_norm_swiglu(h, g, wg, wu, EPS, row_sumsq=bad, impl=impl)


def test_fold_rms_norm_weight(seed):
    """Column-wise product rounded once; ``columns`` folds one K-range and copies the rest;
    shape / dtype errors."""
    w, g = lin(7, 10, torch.bfloat16), gain(10, torch.bfloat16)
    f = fold_rms_norm_weight(w, g)
    assert f.dtype == w.dtype and f.is_contiguous() and f.data_ptr() != w.data_ptr()
    assert torch.equal(f, (w.float() * g.float()).bfloat16())
    part = fold_rms_norm_weight(w, g[:4], slice(6, 10))
    assert torch.equal(part[:, :6], w[:, :6]) and torch.equal(part[:, 6:], (w[:, 6:].float() * g[:4].float()).bfloat16())
    with pytest.raises(ValueError, match="norm_weight"):
        fold_rms_norm_weight(w, g[:9])
    with pytest.raises(ValueError, match="weight"):
        fold_rms_norm_weight(w[0], g)
    with pytest.raises(TypeError):
        fold_rms_norm_weight(w, [1.0] * 10)
    with pytest.raises(TypeError, match="columns"):
        fold_rms_norm_weight(w, g[:4], (6, 10))


def qkv_inputs(M, K, H, Hkv, D, dt, cache_dt, idx_dt=torch.int64, num_slots=None, max_pos=50):
    num_slots = num_slots or 2 * M + 3
    return dict(
        x=act(M, K, dt), norm_weight=gain(K, dt), w_qkv=lin((H + 2 * Hkv) * D, K, dt), eps=EPS,
        positions=positions_for(M, max_pos).to(idx_dt),
        cos_sin_cache=make_cos_sin_cache(max_pos, D, 10000.0, device=DEV),
        out_cache_loc=torch.randperm(num_slots, device=DEV)[:M].to(idx_dt),
        k_cache=poisoned_cache(num_slots, Hkv, D, cache_dt),
        v_cache=poisoned_cache(num_slots, Hkv, D, cache_dt),
        num_heads=H, num_kv_heads=Hkv, head_dim=D)


def qkv_exact(inp):
    H, Hkv, D = inp["num_heads"], inp["num_kv_heads"], inp["head_dim"]
    T = inp["x"].shape[0]
    y = (exact_norm(inp["x"], inp["norm_weight"]) @ inp["w_qkv"].double().T).view(T, -1, D)
    q = exact_rope(y[:, :H], inp["positions"], inp["cos_sin_cache"])
    k = exact_rope(y[:, H:H + Hkv], inp["positions"], inp["cos_sin_cache"])
    return q, k, y[:, H + Hkv:]


def run_qkv(inp, impl, **kw):
    return qkv_rope_store(**inp, impl=impl, **kw)


def check_caches(inp, before, k, v, dt, name):
    """Slots outside out_cache_loc keep their poison bit for bit; written ones are right."""
    loc = inp["out_cache_loc"].long()
    untouched = torch.ones(before[0].shape[0], dtype=torch.bool, device=DEV)
    untouched[loc] = False
    for cache, old, exact, what in ((inp["k_cache"], before[0], k, "k"),
                                    (inp["v_cache"], before[1], v, "v")):
        assert same_bits(cache[untouched], old[untouched]), f"{what}_cache: a foreign slot changed"
        check(f"{name} {what}_cache", cache[loc], exact, dt)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,H,Hkv,D", QKV_SHAPES)
def test_qkv_rope_store(M, K, H, Hkv, D, dt, impl, seed, nan_empty):
    idx_dt = torch.int32 if M % 2 else torch.int64
    inp = qkv_inputs(M, K, H, Hkv, D, dt, dt, idx_dt)
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    q_exact, k_exact, v_exact = qkv_exact(inp)
    q = run_qkv(inp, impl)
    assert q.shape == (M, H, D) and q.dtype == dt and q.is_contiguous()
    check(f"qkv_rope_store[{impl}] q", q, q_exact, dt)
    check_caches(inp, before, k_exact, v_exact, dt, f"qkv_rope_store[{impl}]")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("norms", ["qk", "q", "k"])
@pytest.mark.parametrize("M,K,H,Hkv,D", [(1, 64, 3, 1, 32), (6, 100, 4, 2, 64), (33, 40, 3, 1, 64)])
def test_qkv_rope_store_head_norms(M, K, H, Hkv, D, norms, dt, impl, seed):
    """Per-head Q / K RMSNorm before RoPE (a Qwen3-style / DFlash draft layer), with the input
    norm given or folded into ``w_qkv``; heads of very different scales; V untouched."""
    inp = qkv_inputs(M, K, H, Hkv, D, dt, dt)
    head_scale = (0.05 + 10 * torch.rand((H + 2 * Hkv) * D // D, device=DEV)).repeat_interleave(D)
    inp["w_qkv"] = (inp["w_qkv"].float() * head_scale[:, None]).to(dt)
    gq, gk = gain(D, dt), gain(D, dt)
    kw = dict(q_norm_weight=gq if "q" in norms else None, k_norm_weight=gk if "k" in norms else None)
    y = (exact_norm(inp["x"], inp["norm_weight"]) @ inp["w_qkv"].double().T).view(M, -1, D)
    q_pre, k_pre = y[:, :H], y[:, H:H + Hkv]
    if "q" in norms:
        q_pre = exact_norm(q_pre, gq)
    if "k" in norms:
        k_pre = exact_norm(k_pre, gk)
    q_exact = exact_rope(q_pre, inp["positions"], inp["cos_sin_cache"])
    k_exact = exact_rope(k_pre, inp["positions"], inp["cos_sin_cache"])
    for folded in (False, True):
        for c in (inp["k_cache"], inp["v_cache"]):
            c.copy_(poisoned_cache(c.shape[0], Hkv, D, dt))
        before = (inp["k_cache"].clone(), inp["v_cache"].clone())
        args = dict(inp, norm_weight=None, w_qkv=fold_rms_norm_weight(inp["w_qkv"], inp["norm_weight"])) \
            if folded else inp
        q = run_qkv(args, impl, **kw)
        name = f"qkv_rope_store head norms {norms}{' folded' if folded else ''}[{impl}]"
        check(f"{name} q", q, q_exact, dt)
        check_caches(inp, before, k_exact, y[:, H + Hkv:], dt, name)
    with pytest.raises(ValueError, match="q_norm_weight"):
        run_qkv(inp, impl, q_norm_weight=gain(D + 2, dt))
    with pytest.raises(ValueError, match="k_norm_weight"):
        run_qkv(inp, impl, k_norm_weight=gain(D, torch.float64))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,K2,H,Hkv,D", [(1, 64, 64, 3, 1, 32), (6, 40, 100, 4, 2, 64), (17, 64, 32, 3, 1, 32)])
def test_qkv_rope_store_two_inputs(M, K, K2, H, Hkv, D, dt, impl, seed):
    """The EAGLE-3 draft layer's input: ``cat(RMSNorm(x), RMSNorm(x2))`` (each normalized on
    its own) projected by ``w_qkv [.., K + K2]``, RoPE, store."""
    inp = qkv_inputs(M, K + K2, H, Hkv, D, dt, dt)
    x2, g2 = act(M, K2, dt, scale=20.0), gain(K2, dt)   # a very different scale than x's
    inp.update(x=act(M, K, dt), norm_weight=gain(K, dt))
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    n = torch.cat([exact_norm(inp["x"], inp["norm_weight"]), exact_norm(x2, g2)], -1)
    y = (n @ inp["w_qkv"].double().T).view(M, -1, D)
    q_exact = exact_rope(y[:, :H], inp["positions"], inp["cos_sin_cache"])
    k_exact = exact_rope(y[:, H:H + Hkv], inp["positions"], inp["cos_sin_cache"])
    q = run_qkv(inp, impl, x2=x2, norm_weight2=g2)
    check(f"qkv_rope_store two inputs[{impl}] q", q, q_exact, dt)
    check_caches(inp, before, k_exact, y[:, H + Hkv:], dt, f"qkv_rope_store two inputs[{impl}]")
    with pytest.raises(ValueError, match="go together"):
        run_qkv(inp, impl, x2=x2)
    with pytest.raises(ValueError, match="needs x2"):
        run_qkv(inp, impl, norm_weight2=g2)
    # both norms folded into w_qkv (the EAGLE-3 drafter's fused path)
    for c in (inp["k_cache"], inp["v_cache"]):
        c.copy_(poisoned_cache(c.shape[0], Hkv, D, dt))
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    folded = fold_rms_norm_weight(fold_rms_norm_weight(inp["w_qkv"], inp["norm_weight"], slice(0, K)),
                                  g2, slice(K, K + K2))
    q = run_qkv(dict(inp, norm_weight=None, w_qkv=folded), impl, x2=x2)
    check(f"qkv_rope_store two inputs folded[{impl}] q", q, q_exact, dt)
    check_caches(inp, before, k_exact, y[:, H + Hkv:], dt, f"qkv_rope_store two inputs folded[{impl}]")
    with pytest.raises(ValueError, match="go together"):
        run_qkv(dict(inp, norm_weight=None, w_qkv=folded), impl, x2=x2, norm_weight2=g2)
    with pytest.raises(ValueError, match="w_qkv"):
        run_qkv(dict(inp, w_qkv=inp["w_qkv"][:, :K]), impl, x2=x2, norm_weight2=g2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt,cache_dt", [(torch.bfloat16, torch.float32),
                                         (torch.float32, torch.bfloat16),
                                         (torch.float16, torch.bfloat16)], ids=str)
def test_qkv_rope_store_cache_dtype(dt, cache_dt, impl, seed):
    """Caches in another dtype than the activations: cast on store."""
    inp = qkv_inputs(6, 64, 4, 2, 32, dt, cache_dt, torch.int32, num_slots=40)
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    q_exact, k_exact, v_exact = qkv_exact(inp)
    q = run_qkv(inp, impl)
    check(f"qkv_rope_store[{impl}] q", q, q_exact, dt)
    coarse = dt if STEP[dt] >= STEP[cache_dt] else cache_dt
    check_caches(inp, before, k_exact, v_exact, coarse, f"qkv_rope_store[{impl}]")


def test_qkv_triton_close_to_reference_fp32(seed):
    """float32: the kernel and the reference evaluate the same function; they differ by
    float32 rounding only (a few ulp of the row)."""
    inp = qkv_inputs(9, 64, 4, 2, 64, torch.float32, torch.float32)
    inp2 = dict(inp, k_cache=inp["k_cache"].clone(), v_cache=inp["v_cache"].clone())
    q = run_qkv(inp, "triton")
    q2 = run_qkv(inp2, "reference")
    assert plain_err(q, q2.double()) < 1e-5
    loc = inp["out_cache_loc"]
    assert plain_err(inp["k_cache"][loc], inp2["k_cache"][loc].double()) < 1e-5
    assert torch.equal(inp["v_cache"].isnan(), inp2["v_cache"].isnan())


# ------------------------------------------------------------------ fp8 (e4m3) KV caches
FP8_SCALES = [(0.05, 3.0), (3.0, 0.05)]  # (k_scale, v_scale): values / scale far above and below 1


def e4m3_index(c):
    """The e4m3 codes of ``c`` as integers in value order (adjacent values differ by 1; +0
    and -0 both 0)."""
    b = c.view(torch.uint8).long()
    return torch.where(b >= 0x80, -(b & 0x7F), b)


def fp8_rounding_mismatch(got, want, lo, hi):
    """Mask of the elements where the fp8 tensors ``got`` and ``want`` differ other than by
    one e4m3 step across a rounding boundary (the midpoint of the two values) that lies
    between the float32 pre-rounding values ``lo`` and ``hi`` (``x / scale``; the interval
    widened by one float32 ulp each way, since torch on CUDA divides by a scalar as ``x *
    (1 / scale)`` while the kernel divides)."""
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    adjacent = (e4m3_index(got) - e4m3_index(want)).abs() <= 1
    mid = (got.double() + want.double()) / 2
    a, b = torch.minimum(lo, hi), torch.maximum(lo, hi)
    a = a.nextafter(torch.full_like(a, -float("inf"))).double()
    b = b.nextafter(torch.full_like(b, float("inf"))).double()
    return differ & ~(adjacent & (a <= mid) & (mid <= b))


def check_fp8_cache(name, cache, exact, scale, dt):
    """A float8_e4m3fn cache's written rows against the float64 truth: dequantized
    (``cache * scale``), within the activation dtype's contract (``check``'s bound) plus one
    e4m3 step (``2^-3 |exact| + 2^-9 scale``) of the saturated truth ``clamp(exact, +-448 *
    scale)``; finite (never NaN: e4m3fn has no inf).  Records the worst error in e4m3 steps
    (beyond the activation dtype's ``TOL * rms``) for the summary."""
    got = _rows(cache.float(), exact) * scale
    assert torch.isfinite(got).all(), f"{name}: NaN stored (overflow must saturate)"
    lim = FP8_E4M3_MAX * scale
    t = _rows(exact, exact).clamp(-lim, lim)
    tol = (REF_TOL if "reference" in name else TOL)[dt]
    step = FP8_STEP * t.abs() + FP8_SUB_STEP * scale
    dev = (got - t).abs() - STEP[dt] * t.abs()
    err = float(((dev - step).clamp_min(0) / row_scale(exact)).max())
    steps = float(((dev - tol * row_scale(exact)).clamp_min(0) / step).max())
    _record(f"{name} (e4m3 steps)", dt, steps)
    print(f"{name} {dt}: error beyond one e4m3 step {err:.3g}, worst {steps:.3g} steps")
    assert err <= tol, f"{name} {dt}: error beyond one e4m3 step {err:.3g}"


def fp8_inputs(M, dt, k_scale, v_scale, num_slots=None):
    inp = qkv_inputs(M, 64, 4, 2, 32, dt, FP8, torch.int32 if M % 2 else torch.int64,
                     num_slots=num_slots)
    return inp, dict(k_scale=k_scale, v_scale=v_scale)


def float32_twin(inp):
    """``inp`` with fresh float32 caches: what the same call computes before the fp8 rounding."""
    shape = inp["k_cache"].shape
    return dict(inp, k_cache=torch.zeros(shape, device=DEV), v_cache=torch.zeros(shape, device=DEV))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("k_scale,v_scale", FP8_SCALES)
def test_qkv_rope_store_fp8_cache(k_scale, v_scale, dt, impl, seed):
    """float8_e4m3fn caches with scales != 1: the caches hold ``quantize_kv(k, fp8,
    k_scale)`` / ``quantize_kv(v, fp8, v_scale)`` of the values the call computes, bit for
    bit (each impl against its own float32-cache result, rounded by ``quantize_kv``:
    measured exact in the interpreter, where the kernel divides and rounds like torch on the
    CPU), within one e4m3 step of the float64 truth beyond the activation dtype's contract;
    Q is unchanged; other slots keep their poison."""
    inp, kw = fp8_inputs(7, dt, k_scale, v_scale)
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    q_exact, k_exact, v_exact = qkv_exact(inp)
    q = run_qkv(inp, impl, **kw)
    check(f"qkv_rope_store fp8[{impl}] q", q, q_exact, dt)
    loc = inp["out_cache_loc"].long()
    untouched = torch.ones(before[0].shape[0], dtype=torch.bool, device=DEV)
    untouched[loc] = False
    twin = float32_twin(inp)
    run_qkv(twin, impl)
    for what, exact, scale in (("k", k_exact, k_scale), ("v", v_exact, v_scale)):
        cache, old = inp[f"{what}_cache"], before[0 if what == "k" else 1]
        assert same_bits(cache[untouched], old[untouched]), f"{what}_cache: a foreign slot changed"
        check_fp8_cache(f"qkv_rope_store fp8[{impl}] {what}_cache", cache[loc], exact, scale, dt)
        f32 = twin[f"{what}_cache"][loc]
        want = quantize_kv(f32, FP8, scale)
        if DEV == "cpu":
            assert same_bits(cache[loc], want), f"{what}_cache: not quantize_kv of the float32 values"
        pre = f32 / scale
        assert not fp8_rounding_mismatch(cache[loc], want, pre, pre).any()


@pytest.mark.parametrize("impl", IMPLS)
def test_qkv_rope_store_fp8_saturates(impl, seed):
    """Values past ``448 * scale`` (here most of them: scales 2e-3 and 1e-3) store +-448
    with their sign, never inf / NaN; the rest round as usual."""
    dt = torch.float32
    inp, kw = fp8_inputs(6, dt, 2e-3, 1e-3)
    _, k_exact, v_exact = qkv_exact(inp)
    run_qkv(inp, impl, **kw)
    loc = inp["out_cache_loc"].long()
    for what, exact, scale in (("k", k_exact, 2e-3), ("v", v_exact, 1e-3)):
        got = inp[f"{what}_cache"][loc].float()
        check_fp8_cache(f"qkv_rope_store fp8 saturating[{impl}] {what}_cache", inp[f"{what}_cache"][loc],
                        exact, scale, dt)
        over = exact.abs() > 1.01 * FP8_E4M3_MAX * scale
        assert over.float().mean() > 0.2, "the test needs many overflowing values"
        assert torch.equal(got[over], FP8_E4M3_MAX * exact[over].sign().float())


def test_qkv_fp8_triton_vs_reference(seed):
    """Triton against the reference on fp8 caches.  float32 activations, where the two
    compute K / V up to float32 rounding: equal bit for bit, or (measured in the
    interpreter: 1 element in 46,080 over 40 seeds) one e4m3 step apart where a rounding
    boundary lies between their float32 values divided by the scale.  (With 16-bit
    activations the reference rounds K and V to the activation dtype first, the kernel does
    not: measured up to 88 codes apart near zero, so those are checked against float64 and
    each against its own float32 values only, above.)"""
    dt = torch.float32
    inp, kw = fp8_inputs(9, dt, 0.05, 3.0)
    ref = dict(inp, k_cache=inp["k_cache"].clone(), v_cache=inp["v_cache"].clone())
    tri32, ref32 = float32_twin(inp), float32_twin(inp)
    q = run_qkv(inp, "triton", **kw)
    q_ref = run_qkv(ref, "reference", **kw)
    run_qkv(tri32, "triton")
    run_qkv(ref32, "reference")
    assert plain_err(q, q_ref.double()) < 1e-5
    loc = inp["out_cache_loc"].long()
    for what, scale in (("k", 0.05), ("v", 3.0)):
        got, want = inp[f"{what}_cache"][loc], ref[f"{what}_cache"][loc]
        bad = fp8_rounding_mismatch(got, want, tri32[f"{what}_cache"][loc] / scale,
                                    ref32[f"{what}_cache"][loc] / scale)
        assert not bad.any(), (f"{what}_cache: {int(bad.sum())} codes differ beyond rounding, e.g. "
                               f"{got[bad][:4].float().tolist()} vs {want[bad][:4].float().tolist()}")


def test_qkv_fp8_scale_errors(seed):
    """Bad scales raise before anything is written: not a real number (TypeError), not finite
    and > 0, or != 1.0 with caches that are not fp8 (ValueError)."""
    dt = torch.bfloat16
    inp = qkv_inputs(4, 64, 3, 1, 32, dt, dt, num_slots=10)
    _qkv_err(inp, ValueError, "k_scale", k_scale=0.5)
    _qkv_err(inp, ValueError, "v_scale", v_scale=2.0)
    inp = qkv_inputs(4, 64, 3, 1, 32, dt, FP8, num_slots=10)
    for bad, exc in ((0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                     (float("inf"), ValueError), (True, TypeError), ("0.5", TypeError),
                     (None, TypeError), (torch.tensor(0.5), TypeError)):
        _qkv_err(inp, exc, "k_scale", k_scale=bad)
        _qkv_err(inp, exc, "v_scale", v_scale=bad)
    for kw in (dict(k_scale=1), dict(v_scale=1.0)):  # 1 (an int) is the default scale
        run_qkv(qkv_inputs(4, 64, 3, 1, 32, dt, dt, num_slots=10), "reference", **kw)


# ------------------------------------------------------------------ references = the model
def test_references_are_the_models_sequence(seed):
    """The references reproduce spec_runtime.model's operations bit for bit (CPU)."""
    from specattn.spec_runtime import model as mdl
    dt, T, K, H, Hkv, D = torch.bfloat16, 7, 64, 4, 2, 32
    x, g = act(T, K, dt).cpu(), gain(K, dt).cpu()
    assert torch.equal(fl.llama_rms_norm_reference(x, g, EPS), mdl.rms_norm(x, g, EPS))
    wq, wk, wv = lin(H * D, K, dt).cpu(), lin(Hkv * D, K, dt).cpu(), lin(Hkv * D, K, dt).cpu()
    pos = torch.randint(0, 100, (T,))
    n = mdl.rms_norm(x, g, EPS)
    cos, sin = mdl.rope_cos_sin(pos, D, 10000.0, dt)
    q_m = mdl.apply_rope((n @ wq.T).view(T, H, D), cos, sin)
    k_m = mdl.apply_rope((n @ wk.T).view(T, Hkv, D), cos, sin)
    v_m = (n @ wv.T).view(T, Hkv, D)
    kc, vc = torch.zeros(20, Hkv, D, dtype=dt), torch.zeros(20, Hkv, D, dtype=dt)
    loc = torch.randperm(20)[:T]
    q = fl.qkv_rope_store_reference(x, g, torch.cat([wq, wk, wv]), EPS, pos,
                                    make_cos_sin_cache(100, D, 10000.0), loc, kc, vc, H, Hkv, D)
    assert torch.equal(q, q_m) and torch.equal(kc[loc], k_m) and torch.equal(vc[loc], v_m)
    w = {"mlp.gate_proj.weight": lin(96, K, dt).cpu(), "mlp.up_proj.weight": lin(96, K, dt).cpu(),
         "mlp.down_proj.weight": torch.eye(96, dtype=dt)}
    sw = fl.rms_norm_swiglu_reference(x, g, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], EPS)
    assert torch.equal(sw, mdl.swiglu_mlp(n, w, ""))
    h, wd = act(T, K, dt).cpu(), lin(K, 96, dt).cpu()
    assert torch.equal(fl.matmul_residual_reference(sw, wd, h.clone()), h + sw @ wd.T)


# ------------------------------------------------------------------ edge cases
@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch(impl, seed):
    """M = 0: empty outputs, nothing written, no launch."""
    dt, K = torch.bfloat16, 64
    x, g = act(0, K, dt), gain(K, dt)
    assert rms_norm_matmul(x, g, lin(96, K, dt), EPS, impl=impl).shape == (0, 96)
    out = rms_norm_matmul(x, g, lin(96, K, dt), EPS, out_dtype=torch.float32, impl=impl)
    assert out.shape == (0, 96) and out.dtype == torch.float32
    assert rms_norm_swiglu(x, g, lin(96, K, dt), lin(96, K, dt), EPS, impl=impl).shape == (0, 96)
    r = torch.empty(0, 96, dtype=dt, device=DEV)
    assert matmul_residual(x, lin(96, K, dt), r, impl=impl) is r
    inp = qkv_inputs(0, K, 3, 1, 32, dt, dt, num_slots=8)
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    q = run_qkv(inp, impl)
    assert q.shape == (0, 3, 32) and q.dtype == dt
    assert same_bits(inp["k_cache"], before[0]) and same_bits(inp["v_cache"], before[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_inputs(impl, seed):
    """x / norm_weight with a non-unit last-dim stride are copied; row strides > K (x, the
    weights, the residual) are read in place."""
    dt, M, K, N = torch.float32, 5, 64, 64
    big = act(M, 2 * K, dt)
    g2, w2 = gain(2 * K, dt), lin(N, 2 * K, dt)
    for x, g, w in ((big[:, ::2], g2[::2], w2[:, :K]), (big[:, K:], g2[:K], w2[:, K:])):
        exact = exact_norm(x, g) @ w.double().T
        check("strided", rms_norm_matmul(x, g, w, EPS, impl=impl), exact, dt)
    r2 = act(M, 2 * N, dt)
    res = r2[:, :N]
    exact = res.double() + big[:, K:].double() @ w2[:, K:].double().T
    check("strided residual", matmul_residual(big[:, K:], w2[:, K:], res, impl=impl), exact, dt)


def test_fp16_unnormalized_range(seed):
    """float16 activations whose ``x * norm_weight`` overflows float16 before the norm:
    the kernel normalizes first (PRESCALE), so the result stays finite and right."""
    dt, M, K, N = torch.float16, 3, 64, 64
    x = (torch.randn(M, K, device=DEV) * 2e4).clamp(-6e4, 6e4).to(dt)
    g = torch.full((K,), 8.0, dtype=dt, device=DEV)
    w = lin(N, K, dt)
    exact = exact_norm(x, g) @ w.double().T
    check("fp16 range", rms_norm_matmul(x, g, w, EPS, impl="triton"), exact, dt)
    inp = qkv_inputs(M, K, 3, 1, 32, dt, dt)
    inp.update(x=x, norm_weight=g)
    q_exact, _, _ = qkv_exact(inp)
    check("fp16 range qkv", run_qkv(inp, "triton"), q_exact, dt)


def test_qkv_head_dim_fallback(seed):
    """head_dim not a power of two >= 32: the reference takes it (any even D), triton
    raises, auto on CUDA resolves to the reference."""
    inp = qkv_inputs(4, 64, 2, 1, 48, torch.float32, torch.float32)
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    q_exact, k_exact, v_exact = qkv_exact(inp)
    with pytest.raises(ValueError, match="power of two"):
        run_qkv(inp, "triton")
    assert same_bits(inp["k_cache"], before[0])
    check("qkv D=48", run_qkv(inp, "auto"), q_exact, torch.float32)
    check_caches(inp, before, k_exact, v_exact, torch.float32, "qkv D=48")
    cuda = torch.device("cuda")
    assert fl._qkv_impl("auto", cuda, 48) == "reference"
    assert fl._qkv_impl("auto", cuda, 16) == "reference"
    assert fl._qkv_impl("auto", cuda, 64) == "auto"
    assert fl._qkv_impl("auto", torch.device("cpu"), 48) == "auto"
    assert fl._qkv_impl("triton", cuda, 48) == "triton"


def test_check_values_false_skips_bad_rows_triton(seed):
    """With the value checks off, the kernel skips rows whose slot or position is out of
    range (no out-of-bounds access) and writes the others."""
    inp = qkv_inputs(5, 64, 3, 1, 32, torch.float32, torch.float32, num_slots=12, max_pos=30)
    inp["out_cache_loc"][1] = 12
    inp["positions"][3] = 30
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    _, k_exact, v_exact = qkv_exact(dict(inp, positions=inp["positions"].clamp(max=29)))
    run_qkv(inp, "triton", check_values=False)
    good = torch.tensor([0, 2, 4], device=DEV)
    sub = dict(inp, out_cache_loc=inp["out_cache_loc"][good])
    check_caches(sub, before, k_exact[good], v_exact[good], torch.float32, "check_values=False")


def test_registry_and_auto(seed):
    cpu = torch.device("cpu")
    for name in OPS:
        assert name in registry.names()
        avail = registry.availability(name)
        assert avail["reference"] is None and avail["triton"] is None
        assert avail["cuda"] is not None  # no CUDA C++ implementation: auto never picks one
        assert registry.dispatch(name, "auto", cpu) is fl._REFERENCES[name]
        assert registry.dispatch(name, "auto", torch.device("cuda")) is not fl._REFERENCES[name]
        with pytest.raises(RuntimeError, match="unavailable"):
            registry.dispatch(name, "cuda", cpu)
    x, g, w = act(2, 64, torch.float32), gain(64, torch.float32), lin(64, 64, torch.float32)
    with pytest.raises(RuntimeError, match="cuda implementation"):
        rms_norm_matmul(x, g, w, EPS, impl="cuda")
    with pytest.raises(ValueError, match="impl"):
        rms_norm_matmul(x, g, w, EPS, impl="fast")


# ------------------------------------------------------------------ errors (before any write)
def _qkv_err(inp, exc, match, **kw):
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    for impl in IMPLS:
        with pytest.raises(exc, match=match):
            qkv_rope_store(**inp, impl=impl, **kw)
        assert same_bits(inp["k_cache"], before[0]) and same_bits(inp["v_cache"], before[1])


def test_qkv_errors(seed):
    dt = torch.bfloat16
    mk = lambda: qkv_inputs(4, 64, 3, 1, 32, dt, dt, num_slots=10, max_pos=20)  # noqa: E731
    inp = mk()
    inp["out_cache_loc"][2] = 10
    _qkv_err(inp, IndexError, "out_cache_loc")
    inp = mk()
    inp["out_cache_loc"][2] = -1
    _qkv_err(inp, IndexError, "out_cache_loc")
    inp = mk()
    inp["positions"][1] = 20
    _qkv_err(inp, IndexError, "positions")
    inp = mk()
    inp["out_cache_loc"][3] = inp["out_cache_loc"][0]
    _qkv_err(inp, ValueError, "repeats")
    cases = [
        (dict(w_qkv=lin(5 * 32 + 1, 64, dt)), ValueError, "w_qkv"),
        (dict(w_qkv=lin(5 * 32, 64, torch.float32)), ValueError, "w_qkv"),
        (dict(w_qkv=lin(64, 5 * 32, dt).T), ValueError, "contiguous last dim"),
        (dict(norm_weight=gain(63, dt)), ValueError, "norm_weight"),
        (dict(norm_weight=gain(64, torch.float32)), ValueError, "norm_weight"),
        (dict(positions=torch.zeros(3, dtype=torch.int64, device=DEV)), ValueError, "positions"),
        (dict(positions=torch.zeros(4, device=DEV)), ValueError, "positions"),
        (dict(out_cache_loc=torch.zeros(4, dtype=torch.int16, device=DEV)), ValueError,
         "out_cache_loc"),
        (dict(cos_sin_cache=make_cos_sin_cache(20, 16, device=DEV)), ValueError, "cos_sin_cache"),
        (dict(k_cache=poisoned_cache(10, 2, 32, dt)), ValueError, "k_cache"),
        (dict(v_cache=poisoned_cache(10, 1, 32, torch.float32)), ValueError, "v_cache"),
        (dict(v_cache=poisoned_cache(11, 1, 32, dt)), ValueError, "v_cache"),
        (dict(k_cache=poisoned_cache(10, 1, 64, dt)[:, :, ::2]), ValueError, "contiguous"),
        (dict(k_cache=torch.zeros(10, 1, 32, dtype=torch.float64, device=DEV)), ValueError,
         "k_cache"),
        (dict(k_cache=torch.zeros(10, 1, 32, dtype=FP8, device=DEV)), ValueError, "v_cache"),
        (dict(num_heads=0), ValueError, "num_heads"),
        (dict(num_kv_heads=True), ValueError, "num_kv_heads"),
        (dict(head_dim=31), ValueError, "head_dim"),
        (dict(eps=0.0), ValueError, "eps"),
        (dict(eps=float("nan")), ValueError, "eps"),
        (dict(x=act(4, 64, dt)[None]), ValueError, "x"),
        (dict(x=[[1.0]]), TypeError, "x"),
        (dict(x=torch.zeros(4, 64, dtype=torch.int32, device=DEV)), ValueError, "x"),
        (dict(w_qkv=lin(160, 64, dt).to("meta")), ValueError, "w_qkv"),
    ]
    for change, exc, match in cases:
        inp = mk()
        inp.update(change)
        _qkv_err(inp, exc, match)
    inp = mk()
    inp["v_cache"] = inp["k_cache"]
    _qkv_err(inp, ValueError, "overlap")
    if DEV == "cpu":  # (on a GPU, torch's own index check is a device-side assert)
        inp = mk()
        inp["out_cache_loc"][0] = 10
        with pytest.raises(IndexError):  # the reference without value checks: torch's error
            qkv_rope_store(**inp, impl="reference", check_values=False)


def test_gemm_op_errors(seed):
    dt, M, K, N = torch.float32, 3, 64, 32
    x, g, w = act(M, K, dt), gain(K, dt), lin(N, K, dt)
    res = act(M, N, dt)
    bad = [
        (lambda i: rms_norm_matmul(x, g, lin(N, K + 1, dt), EPS, impl=i), ValueError, "weight"),
        (lambda i: rms_norm_matmul(x, g[:-1], w, EPS, impl=i), ValueError, "norm_weight"),
        (lambda i: rms_norm_matmul(x, g, w.bfloat16(), EPS, impl=i), ValueError, "weight"),
        (lambda i: rms_norm_matmul(x, g, w, -1.0, impl=i), ValueError, "eps"),
        (lambda i: rms_norm_matmul(x, g, w, EPS, out_dtype=torch.int32, impl=i), ValueError,
         "out_dtype"),
        (lambda i: rms_norm_matmul(x[:, :0], g[:0], w[:, :0], EPS, impl=i), ValueError, "K >= 1"),
        (lambda i: rms_norm_matmul(x, g, lin(K, N, dt).T, EPS, impl=i), ValueError,
         "contiguous last dim"),
        (lambda i: rms_norm_matmul(x, g, w.to("meta"), EPS, impl=i), ValueError, "weight"),
        (lambda i: rms_norm_matmul(x, g, "w", EPS, impl=i), TypeError, "weight"),
        (lambda i: rms_norm_swiglu(x, g, w, lin(N + 1, K, dt), EPS, impl=i), ValueError, "w_up"),
        (lambda i: rms_norm_swiglu(x, g, w, w, True, impl=i), ValueError, "eps"),
        (lambda i: matmul_residual(x, w, act(M, N + 1, dt), impl=i), ValueError, "residual"),
        (lambda i: matmul_residual(x, w, res.bfloat16(), impl=i), ValueError, "residual"),
        (lambda i: matmul_residual(x, w, act(N, M, dt).T, impl=i), ValueError, "residual"),
        (lambda i: matmul_residual(x, w, act(1, N, dt).expand(M, N), impl=i), ValueError,
         "residual"),
        (lambda i: matmul_residual(x, w, res.clone(), copy_to=act(M, N + 1, dt), impl=i), ValueError, "copy_to"),
        (lambda i: matmul_residual(x, w, res.clone(), copy_to=act(N, M, dt).T, impl=i), ValueError, "copy_to"),
        (lambda i: matmul_residual(x, w, res, copy_to=res, impl=i), ValueError, "overlap"),
    ]
    for impl in IMPLS:
        for fn, exc, match in bad:
            with pytest.raises(exc, match=match):
                fn(impl)
        # in place over its own input: refused before the kernel reads what it writes
        h = act(M, K, dt)
        before = h.clone()
        with pytest.raises(ValueError, match="overlap"):
            matmul_residual(h, lin(K, K, dt), h, impl=impl)
        with pytest.raises(ValueError, match="overlap"):
            matmul_residual(h[:, :32], lin(K - 32, 32, dt), h[:, 32:], impl=impl)
        assert torch.equal(h, before)


@pytest.mark.slow
@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_every_tile_config(dt, seed):
    """Every tile shape tile_config can pick (and the QKV kernel's BLOCK_M / BLOCK_K),
    forced on small inputs with K and N tails, each epilogue."""
    from specattn.triton_kernels import fused_llama as tk
    K, N = 100, 130
    for cfg in [(16, 64, 64, 4), (32, 64, 32, 4), (64, 64, 64, 4), (16, 32, 128, 4),
                (32, 32, 64, 4), (16, 16, 32, 2), (64, 16, 32, 4), (16, 128, 64, 4),
                (64, 128, 64, 4), (1, 16, 64, 2), (2, 64, 64, 2), (8, 16, 32, 2),
                (16, 16, 256, 2, 4), (16, 16, 128, 2, 3), (64, 16, 128, 4, 4), (64, 32, 256, 4, 4),
                (16, 32, 128, 2, 4)]:
        M = min(2 * cfg[0] + 1, 19)  # a row tail, and several row blocks where cheap
        x, g = act(M, K, dt), gain(K, dt)
        w, w2, r = lin(N, K, dt), lin(N, K, dt), act(M, N, dt)
        n = exact_norm(x, g)
        gate, up = n @ w.double().T, n @ w2.double().T
        out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.float32)
        tk._launch_gemm(x, g, w, None, out, EPS, tk._STORE, config=cfg)
        check(f"config {cfg} store", out, gate, dt)
        out = torch.full((M, N), float("nan"), device=DEV, dtype=dt)
        tk._launch_gemm(x, g, w, w2, out, EPS, tk._SWIGLU, config=cfg)
        check(f"config {cfg} swiglu", out, gate * torch.sigmoid(gate) * up, dt,
              scale=swiglu_scale(gate, up))
        res = r.clone()
        tk._launch_gemm(x, None, w, None, res, 0.0, tk._RESIDUAL, config=cfg)
        check(f"config {cfg} residual", res, r.double() + x.double() @ w.double().T, dt)
    for cfg in [(16, 64, 4), (32, 32, 2), (64, 128, 4), (1, 64, 2), (4, 32, 2), (16, 64, 4, 16, 4),
                (1, 64, 2, 16, 2), (32, 64, 4, 32, 4)]:
        M = min(2 * cfg[0] + 1, 19)
        inp = qkv_inputs(M, K, 3, 1, 32, dt, dt)
        q_exact, _, _ = qkv_exact(inp)
        q = torch.full((M, 3, 32), float("nan"), device=DEV, dtype=dt)
        tk._launch_qkv(inp["x"], inp["norm_weight"], inp["w_qkv"], EPS, inp["positions"],
                       inp["cos_sin_cache"], inp["out_cache_loc"], inp["k_cache"],
                       inp["v_cache"], q, config=cfg)
        check(f"qkv config {cfg}", q, q_exact, dt)


def test_tile_choice():
    """The tiles picked at SmolLM2-135M's decode and prefill shapes."""
    from specattn.triton_kernels.fused_llama import qkv_tile_config, tile_config
    bf16, fp32 = torch.bfloat16, torch.float32
    assert tile_config(1, 49152, 576, bf16) == (16, 128, 64, 4, 3)     # LM head: 384 programs
    assert tile_config(1, 49152, 576, fp32) == (1, 64, 64, 2, 3)
    assert tile_config(16, 49152, 576, fp32) == (16, 64, 32, 2, 3)
    assert tile_config(1, 1536, 576, bf16, 2) == (16, 16, 128, 2, 3)   # MLP, small grid: 96 programs
    assert tile_config(1, 576, 1536, bf16) == (16, 16, 256, 2, 4)      # down_proj, small grid: 36
    assert tile_config(1, 576, 576, bf16) == (16, 16, 256, 2, 4)       # o_proj
    assert tile_config(64, 576, 576, bf16) == (64, 16, 128, 4, 4)
    assert tile_config(256, 576, 576, bf16) == (64, 32, 128, 4, 4)     # 144 programs at BLOCK_N 16
    assert tile_config(5, 576, 1536, fp32) == (8, 16, 64, 2, 3)
    assert tile_config(192, 1536, 576, bf16, 2) == (64, 64, 64, 4, 3)  # 72 programs
    assert tile_config(192, 576, 1536, bf16) == (64, 32, 256, 4, 4)    # 27 programs at BLOCK_N 64
    assert tile_config(192, 576, 1536, fp32) == (64, 16, 32, 4, 3)
    assert tile_config(33, 4096, 576, bf16) == (64, 64, 64, 4, 3)
    # a 24 / 32-token verify: two 16-row tiles; gate/up past 96 programs of 16 columns: 32
    assert tile_config(32, 576, 576, bf16) == (16, 16, 256, 2, 4)      # o_proj: 72 programs
    assert tile_config(24, 576, 1536, bf16) == (16, 16, 256, 2, 4)
    assert tile_config(32, 1536, 576, bf16, 2) == (16, 32, 128, 2, 4)  # 96 programs
    assert tile_config(16, 1536, 576, bf16, 2) == (16, 16, 128, 2, 3)
    assert tile_config(32, 576, 576, fp32)[0] == 32
    assert qkv_tile_config(32, bf16)[:3] == (16, 64, 4)
    assert [qkv_tile_config(m, bf16)[0] for m in (128, 129, 256, 257)] == [16, 32, 32, 64]
    assert tile_config(64, 1536, 576, bf16, 2) == (32, 32, 64, 4, 3)   # gate/up: 96 programs
    assert tile_config(128, 1536, 576, bf16, 2) == (64, 32, 64, 4, 3)
    assert tile_config(256, 1536, 576, bf16, 2) == (64, 64, 64, 4, 3)
    assert qkv_tile_config(1, bf16)[:3] == (16, 64, 4)
    assert qkv_tile_config(3, fp32)[:3] == (4, 64, 2)
    assert qkv_tile_config(17, fp32)[:3] == (32, 32, 4)
    # norm weights folded into W: 64-row tiles at verify sizes
    assert [qkv_tile_config(m, bf16, folded=True)[0] for m in (1, 32, 256)] == [64, 64, 64]
    assert tile_config(128, 1536, 576, bf16, 2, folded=True) == (64, 32, 64, 4, 3)   # 96
    assert tile_config(256, 1536, 576, bf16, 2, folded=True) == (64, 64, 64, 4, 3)
    assert tile_config(16, 1536, 576, bf16, 2, folded=True) == (16, 32, 128, 2, 3)
    assert tile_config(64, 1536, 576, bf16, 2, folded=True) == (16, 32, 128, 2, 3)


def test_triton_impl_needs_interpreter_or_gpu(seed, monkeypatch):
    """Without TRITON_INTERPRET the Triton launchers refuse CPU tensors with a clear error."""
    from specattn.triton_kernels import fused_llama as tk
    monkeypatch.setattr(tk, "_INTERPRET", False)
    x = act(2, 64, torch.float32).cpu()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        tk.rms_norm_matmul(x, gain(64, torch.float32).cpu(), lin(64, 64, torch.float32).cpu(), EPS)


# ------------------------------------------------------------------ GPU: the real model
gpu = pytest.mark.gpu
SMOL = dict(K=576, H=9, Hkv=3, D=64, I=1536, V=49152)


@gpu
@pytest.mark.parametrize("folded", [False, True], ids=["g", "folded"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("M", [1, 16, 64, 192, 256])
def test_gpu_smollm_shapes(M, dt, folded, seed):
    """Every tile variant the model's shapes pick, decode to verify sizes, with the norm
    weights given and folded into the GEMM weights (the model's path)."""
    K, H, Hkv, D, I, V = (SMOL[k] for k in ("K", "H", "Hkv", "D", "I", "V"))
    x, g = act(M, K, dt), gain(K, dt)
    fold = (lambda w: fold_rms_norm_weight(w, g)) if folded else (lambda w: w)  # noqa: E731
    gk = None if folded else g
    ss = row_sumsq_of(x, "triton") if folded else None   # the model's path: handed on
    # LM head: float32 logits
    w = lin(V, K, dt)
    exact = exact_norm(x, g) @ w.double().T
    ref = rms_norm_matmul(x, g, w, EPS, out_dtype=torch.float32, impl="reference")
    for rs in ((ss, None) if folded else (None,)):   # handed-on sums, or the kernel's pre-pass
        out = rms_norm_matmul(x, gk, fold(w), EPS, out_dtype=torch.float32, row_sumsq=rs, impl="triton")
        check("smollm lm_head[triton]", out, exact, dt, ref)
        assert plain_err(out, exact) <= plain_err(ref, exact) * 1.5 + 0.1 * TOL[dt]
    # QKV + RoPE + store
    inp = qkv_inputs(M, K, H, Hkv, D, dt, dt, num_slots=4 * M + 8, max_pos=4096)
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    q_exact, k_exact, v_exact = qkv_exact(inp)
    q = run_qkv(dict(inp, norm_weight=None, w_qkv=fold_rms_norm_weight(inp["w_qkv"], inp["norm_weight"]))
                if folded else inp, "triton", row_sumsq=row_sumsq_of(inp["x"], "triton") if folded else None)
    check("smollm qkv[triton] q", q, q_exact, dt)
    check_caches(inp, before, k_exact, v_exact, dt, "smollm qkv[triton]")
    # with per-head Q / K norms (the DFlash draft layer's path)
    gq, gkn = gain(D, dt), gain(D, dt)
    y = (exact_norm(inp["x"], inp["norm_weight"]) @ inp["w_qkv"].double().T).view(M, -1, D)
    q_exact = exact_rope(exact_norm(y[:, :H], gq), inp["positions"], inp["cos_sin_cache"])
    k_exact = exact_rope(exact_norm(y[:, H:H + Hkv], gkn), inp["positions"], inp["cos_sin_cache"])
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    q = run_qkv(dict(inp, norm_weight=None, w_qkv=fold_rms_norm_weight(inp["w_qkv"], inp["norm_weight"]))
                if folded else inp, "triton", row_sumsq=row_sumsq_of(inp["x"], "triton") if folded else None,
                q_norm_weight=gq, k_norm_weight=gkn)
    check("smollm qkv head norms[triton] q", q, q_exact, dt)
    check_caches(inp, before, k_exact, v_exact, dt, "smollm qkv head norms[triton]")
    # MLP: norm + gate/up + SwiGLU, then down + residual; o_proj + residual
    wg, wu, wd, wo = lin(I, K, dt), lin(I, K, dt), lin(K, I, dt), lin(K, H * D, dt)
    n = exact_norm(x, g)
    gate, up = n @ wg.double().T, n @ wu.double().T
    check("smollm swiglu[triton]", rms_norm_swiglu(x, gk, fold(wg), fold(wu), EPS, row_sumsq=ss, impl="triton"),
          gate * torch.sigmoid(gate) * up, dt, rms_norm_swiglu(x, g, wg, wu, EPS, impl="reference"),
          swiglu_scale(gate, up))
    for a, wt in ((act(M, I, dt, 1.0), wd), (act(M, H * D, dt, 1.0), wo)):
        r = act(M, K, dt)
        exact = r.double() + a.double() @ wt.double().T
        ref = matmul_residual(a, wt, r.clone(), impl="reference")
        check("smollm residual[triton]", matmul_residual(a, wt, r, impl="triton"), exact, dt,
              ref)


@gpu
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("M", [1, 64, 256])
def test_gpu_fp8_cache_smollm_shapes(M, dt, seed):
    """fp8 caches at the model's shapes and path (norm folded, sums handed over), compiled:
    the caches hold ``quantize_kv`` of the float32 values of the same launch with float32
    caches (bit for bit up to a rounding boundary within a float32 ulp: torch on CUDA
    divides by a scalar as ``x * (1 / scale)``), within one e4m3 step of the truth."""
    K, H, Hkv, D = (SMOL[k] for k in ("K", "H", "Hkv", "D"))
    inp = qkv_inputs(M, K, H, Hkv, D, dt, FP8, num_slots=4 * M + 8, max_pos=4096)
    _, k_exact, v_exact = qkv_exact(inp)
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    run = dict(inp, norm_weight=None, w_qkv=fold_rms_norm_weight(inp["w_qkv"], inp["norm_weight"]))
    ss = row_sumsq_of(inp["x"], "triton")
    twin = float32_twin(run)
    run_qkv(run, "triton", row_sumsq=ss, k_scale=0.05, v_scale=3.0)
    run_qkv(twin, "triton", row_sumsq=ss)
    loc = inp["out_cache_loc"].long()
    untouched = torch.ones(before[0].shape[0], dtype=torch.bool, device=DEV)
    untouched[loc] = False
    for what, exact, scale in (("k", k_exact, 0.05), ("v", v_exact, 3.0)):
        cache = run[f"{what}_cache"]
        assert same_bits(cache[untouched], before[0 if what == "k" else 1][untouched])
        check_fp8_cache(f"smollm qkv fp8[triton] {what}_cache", cache[loc], exact, scale, dt)
        f32 = twin[f"{what}_cache"][loc]
        bad = fp8_rounding_mismatch(cache[loc], quantize_kv(f32, FP8, scale), f32 / scale, f32 / scale)
        assert not bad.any(), f"{what}_cache: {int(bad.sum())} codes differ from quantize_kv"


@gpu
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("M", [1, 4, 64])
def test_gpu_eagle3_two_input_qkv(M, dt, seed):
    """The EAGLE-3 draft layer's QKV (embedding and hidden, 576 + 576 wide) on the GPU."""
    K, H, Hkv, D = (SMOL[k] for k in ("K", "H", "Hkv", "D"))
    inp = qkv_inputs(M, 2 * K, H, Hkv, D, dt, dt, num_slots=4 * M + 8, max_pos=4096)
    x2, g2 = act(M, K, dt, scale=20.0), gain(K, dt)
    inp.update(x=act(M, K, dt), norm_weight=gain(K, dt))
    before = (inp["k_cache"].clone(), inp["v_cache"].clone())
    n = torch.cat([exact_norm(inp["x"], inp["norm_weight"]), exact_norm(x2, g2)], -1)
    y = (n @ inp["w_qkv"].double().T).view(M, -1, D)
    q = run_qkv(inp, "triton", x2=x2, norm_weight2=g2)
    check("eagle3 qkv[triton] q", q, exact_rope(y[:, :H], inp["positions"], inp["cos_sin_cache"]), dt)
    check_caches(inp, before, exact_rope(y[:, H:H + Hkv], inp["positions"], inp["cos_sin_cache"]),
                 y[:, H + Hkv:], dt, "eagle3 qkv[triton]")


@gpu
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("M", [1, 16])
def test_gpu_cuda_graph(M, dt, seed):
    """Each op captured in a CUDA graph (default value checks: skipped while capturing) and
    replayed on new inputs: identical to the eager call, bit for bit."""
    K, H, Hkv, D, I = (SMOL[k] for k in ("K", "H", "Hkv", "D", "I"))
    x, g, x2 = act(M, K, dt), gain(K, dt), act(M, K, dt)
    w_lm, wg, wu, wd = lin(4096, K, dt), lin(I, K, dt), lin(I, K, dt), lin(K, I, dt)
    a, a2 = act(M, I, dt, 1.0), act(M, I, dt, 1.0)
    res0, res2 = act(M, K, dt), act(M, K, dt)
    inp = qkv_inputs(M, K, H, Hkv, D, dt, dt, num_slots=64, max_pos=1024)
    inp2 = qkv_inputs(M, K, H, Hkv, D, dt, dt, num_slots=64, max_pos=1024)
    res = res0.clone()

    def step():
        return (rms_norm_matmul(x, g, w_lm, EPS, out_dtype=torch.float32),
                rms_norm_swiglu(x, g, wg, wu, EPS),
                matmul_residual(a, wd, res),
                qkv_rope_store(**inp))

    step()  # compile outside the capture
    res.copy_(res0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    # new inputs into the static buffers, then replay
    x.copy_(x2)
    a.copy_(a2)
    res.copy_(res2)
    for key in ("x", "positions", "out_cache_loc"):
        inp[key].copy_(inp2[key])
    k0, v0 = inp["k_cache"].clone(), inp["v_cache"].clone()
    graph.replay()
    torch.cuda.synchronize()
    kc, vc = inp["k_cache"].clone(), inp["v_cache"].clone()
    inp["k_cache"].copy_(k0)
    inp["v_cache"].copy_(v0)
    res_eager = res2.clone()
    eager = (rms_norm_matmul(x, g, w_lm, EPS, out_dtype=torch.float32),
             rms_norm_swiglu(x, g, wg, wu, EPS), matmul_residual(a, wd, res_eager),
             qkv_rope_store(**inp))
    for o, e in zip(outs, eager):
        assert same_bits(o, e)
    assert same_bits(kc, inp["k_cache"]) and same_bits(vc, inp["v_cache"])


@gpu
def test_gpu_no_host_sync_without_value_checks(seed):
    """``check_values=False``: no op syncs with the host (CUDA sync-debug mode 'error')."""
    dt, M, K = torch.bfloat16, 4, SMOL["K"]
    x, g = act(M, K, dt), gain(K, dt)
    inp = qkv_inputs(M, K, 9, 3, 64, dt, dt, num_slots=32)
    w, w_o, r = lin(256, K, dt), lin(K, 256, dt), act(M, K, dt)
    a = act(M, 256, dt)

    def step():
        qkv_rope_store(**inp, check_values=False)
        rms_norm_matmul(x, g, w, EPS, out_dtype=torch.float32)
        matmul_residual(a, w_o, r)
        rms_norm_swiglu(x, g, w, w, EPS)

    step()  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_zz_error_summary():
    """Prints the worst errors of this run (``pytest -s``): the numbers of the contract."""
    for (name, dt), err in sorted(ERRORS.items()):
        print(f"{name:45s} {dt:15s} {err:.3g}")


# ------------------------------------------------------------------ LM head top-k
def topk_by_definition(logits, k):
    """The k best log-probabilities of float32 logits, written here: a stable sort puts equal
    values in column order (the lower column first)."""
    x = logits.double()
    idx = torch.argsort(-x, dim=-1, stable=True)[:, :k]
    return (x.gather(1, idx) - torch.logsumexp(x, -1, keepdim=True)).float(), idx


def check_topk(got, logits, k):
    values, indices = got
    want_v, want_i = topk_by_definition(logits, k)
    assert values.dtype == torch.float32 and indices.dtype == torch.int64
    assert values.shape == indices.shape == (logits.shape[0], k)
    assert torch.equal(indices, want_i)
    torch.testing.assert_close(values, want_v, rtol=0, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N,k", [(1, 64, 300, 1), (5, 100, 1000, 4), (17, 40, 513, 3), (3, 32, 20, 16),
                                     (33, 64, 130, 16)])
@pytest.mark.parametrize("form", ["g", "folded", "folded+sums"])
def test_rms_norm_matmul_topk(M, K, N, k, dt, impl, form, seed, nan_empty):
    """The top-k of the op's own float32 logits (same tiles, so the same values), by the
    definition; the last column tile narrower than k where N allows."""
    from specattn.ops import rms_norm_matmul_topk
    x, g, w = act(M, K, dt), gain(K, dt), lin(N, K, dt)
    wk, gk = (w, g) if form == "g" else (fold_rms_norm_weight(w, g), None)
    ss = row_sumsq_of(x, impl) if form == "folded+sums" else None
    logits = rms_norm_matmul(x, gk, wk, EPS, out_dtype=torch.float32, row_sumsq=ss, impl=impl)
    check_topk(rms_norm_matmul_topk(x, gk, wk, EPS, k, row_sumsq=ss, impl=impl), logits, k)


@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_matmul_topk_ties(impl, seed):
    """Equal logits (identical weight rows, across column tiles): the lower column first."""
    from specattn.ops import rms_norm_matmul_topk
    x, w = act(2, 64, torch.float32), lin(700, 64, torch.float32)
    for j in (650, 3, 90, 7):
        w[j] = 4.0 * w[0].abs().max() * torch.sign(x[0])  # the best row of x[0], four times
    values, indices = rms_norm_matmul_topk(x, None, w, EPS, 3, impl=impl)
    assert indices[0].tolist() == [3, 7, 90]
    assert torch.equal(values[0], values[0, :1].expand(3))


def test_rms_norm_matmul_topk_two_step_path(seed):
    """Past the merge's key budget the Triton launcher takes logits + the top-k op."""
    from specattn.ops import rms_norm_matmul_topk
    from specattn.triton_kernels import fused_llama as tk
    M, K, N, k = 2, 32, 64 * 520, 16
    assert not tk.topk_fusable(M, N, K, torch.float32, k) and tk.topk_fusable(M, N, K, torch.float32, 8)
    x, w = act(M, K, torch.float32), lin(N, K, torch.float32)
    logits = rms_norm_matmul(x, None, w, EPS, out_dtype=torch.float32, impl="triton")
    for kk in (k, 8):
        check_topk(rms_norm_matmul_topk(x, None, w, EPS, kk, impl="triton"), logits, kk)


@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_matmul_topk_empty_and_errors(impl, seed):
    from specattn.ops import rms_norm_matmul_topk
    x, w = act(0, 64, torch.float32), lin(40, 64, torch.float32)
    values, indices = rms_norm_matmul_topk(x, None, w, EPS, 4, impl=impl)
    assert values.shape == indices.shape == (0, 4)
    x = act(3, 64, torch.float32)
    for bad in (0, 17, True, 2.0):
        with pytest.raises(ValueError, match="k must be"):
            rms_norm_matmul_topk(x, None, w, EPS, bad, impl=impl)
    with pytest.raises(ValueError, match="k must be"):
        rms_norm_matmul_topk(x, None, w[:5], EPS, 6, impl=impl)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_matmul_topk(x, None, lin(40, 32, torch.float32), EPS, 4, impl=impl)


@gpu
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("M", [1, 4, 16, 64, 256])
def test_gpu_smollm_topk(M, dt, seed):
    """The LM heads of the runtime (49,152 and a 16,384-token draft vocabulary, folded, the
    sums handed over or not) for k = 1 and 4, eager and replayed in a CUDA graph."""
    from specattn.ops import rms_norm_matmul_topk, topk_log_probs
    K = SMOL["K"]
    for V, k in ((SMOL["V"], 1), (SMOL["V"], 4), (16384, 4)):
        x, w = act(M, K, dt), fold_rms_norm_weight(lin(V, K, dt), gain(K, dt))
        for ss in (row_sumsq_of(x, "triton"), None):
            logits = rms_norm_matmul(x, None, w, EPS, out_dtype=torch.float32, row_sumsq=ss, impl="triton")
            got = rms_norm_matmul_topk(x, None, w, EPS, k, row_sumsq=ss, impl="triton")
            check_topk(got, logits, k)
            two = topk_log_probs(logits, k)
            assert torch.equal(got[1], two[1])
            if V < SMOL["V"]:   # a draft vocabulary: its columns mapped to token ids in the merge
                ids = torch.randperm(SMOL["V"], device=DEV)[:V]
                mapped = rms_norm_matmul_topk(x, None, w, EPS, k, row_sumsq=ss, column_ids=ids, impl="triton")
                assert torch.equal(mapped[1], ids[two[1]]) and torch.equal(mapped[0], got[0])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = rms_norm_matmul_topk(x, None, w, EPS, k)
        x.copy_(act(M, K, dt))
        graph.replay()
        check_topk(static, rms_norm_matmul(x, None, w, EPS, out_dtype=torch.float32), k)


@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_matmul_topk_column_ids(impl, seed):
    """``column_ids`` maps the chosen columns (a draft vocabulary's token ids); the order is by
    column, ties included."""
    from specattn.ops import rms_norm_matmul_topk
    M, K, N, k = 6, 64, 300, 4
    x, w = act(M, K, torch.float32), lin(N, K, torch.float32)
    ids = torch.randperm(5000, device=DEV)[:N]
    plain = rms_norm_matmul_topk(x, None, w, EPS, k, impl=impl)
    for dt in (torch.int64, torch.int32):
        values, indices = rms_norm_matmul_topk(x, None, w, EPS, k, column_ids=ids.to(dt), impl=impl)
        assert indices.dtype == torch.int64 and torch.equal(indices, ids[plain[1]])
        assert torch.equal(values, plain[0])
    for bad in (ids[:-1], ids.float(), ids[None]):
        with pytest.raises(ValueError, match="column_ids"):
            rms_norm_matmul_topk(x, None, w, EPS, k, column_ids=bad, impl=impl)


def test_lm_head_topk_bench_case(seed):
    """The bench case's three implementations agree (tiny sizes, on this machine's device)."""
    from bench.cases import get_case
    c = get_case("lm_head_topk")
    outs = []
    for impl in ("fused", "two_step", "reference"):
        torch.manual_seed(seed)
        wl = c.build(DEV, rows=3, vocab=300, hidden=64, k=4, impl=impl, dtype="float32", input_sets=2)
        outs.append(wl.fn(*wl.input_sets[1]))
    for values, indices in outs[1:]:
        assert torch.equal(indices, outs[0][1])
        torch.testing.assert_close(values, outs[0][0], rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="impl"):
        c.build(DEV, impl="fast")


def test_make_cos_sin_cache_sizes_and_errors():
    c = make_cos_sin_cache(3, 4, 10000.0)
    assert c.shape == (3, 4) and c.dtype == torch.float32
    assert torch.allclose(c[2], torch.tensor([math.cos(2.0), math.cos(0.02), math.sin(2.0), math.sin(0.02)]))
    for args, error, match in (((3, 4.5), TypeError, "rotary_dim must be an int"),
                               ((2.9, 4), TypeError, "max_pos must be an int"),
                               ((True, 4), TypeError, "max_pos must be an int"),
                               ((0, 4), ValueError, "max_pos must be >= 1"),
                               ((2, 3), ValueError, "rotary_dim must be a positive even"),
                               ((2, 4, float("inf")), ValueError, "base must be finite"),
                               ((2, 4, float("nan")), ValueError, "base must be finite"),
                               ((2, 4, -1.0), ValueError, "base must be finite and > 0")):
        with pytest.raises(error, match=match):
            make_cos_sin_cache(*args)
