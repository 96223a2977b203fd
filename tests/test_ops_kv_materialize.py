"""materialize_kv (DFlash context KV for all draft layers) against a naive per-layer,
per-token, per-head loop in float64 that shares no code with the reference."""
import math

import pytest
import torch

from specattn.ops import (apply_rope_neox_reference, llama_rms_norm_reference, make_cos_sin_cache, materialize_kv,
                          materialize_kv_reference, registry, rms_norm_reference,
                          stack_kv_proj_weights)

FP8 = torch.float8_e4m3fn


def _inputs(T=7, L=3, Hkv=2, D=16, H=40, max_pos=64, num_slots=32, rot=None, dtype=torch.float32,
            cache_dtype=torch.float32, bias=False, seed=0, idx_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    rot = D if rot is None else rot
    w_k = [torch.randn(Hkv * D, H, generator=g) / math.sqrt(H) for _ in range(L)]
    w_v = [torch.randn(Hkv * D, H, generator=g) / math.sqrt(H) for _ in range(L)]
    return dict(
        hidden=torch.randn(T, H, generator=g).to(dtype),
        w_kv=stack_kv_proj_weights(w_k, w_v).to(dtype),
        k_norm_weight=1.0 + 0.5 * torch.randn(L, D, generator=g),
        positions=torch.randint(0, max_pos, (T,), generator=g, dtype=torch.int64).to(idx_dtype),
        cos_sin_cache=make_cos_sin_cache(max_pos, rot, 10000.0),
        out_cache_loc=torch.randperm(num_slots, generator=g)[:T].to(idx_dtype),
        k_buffers=[_poisoned(num_slots, Hkv, D, cache_dtype) for _ in range(L)],
        v_buffers=[_poisoned(num_slots, Hkv, D, cache_dtype) for _ in range(L)],
        kv_bias=(0.1 * torch.randn(L * 2 * Hkv * D, generator=g)) if bias else None,
    )


def _poisoned(num_slots, Hkv, D, dtype):
    buf = torch.empty(num_slots, Hkv, D, dtype=dtype)
    if dtype == FP8:
        buf.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
    else:
        buf.fill_(float("nan"))
        buf[::3] = 1e30 if dtype == torch.float32 else 6e4  # some "large" poison too
    return buf


def _naive(inp, eps):
    """Per layer / token / head, float64, explicit rotate-halves loop over the frequencies."""
    hidden, w_kv = inp["hidden"].double(), inp["w_kv"].double()
    L = len(inp["k_buffers"])
    _, Hkv, D = inp["k_buffers"][0].shape
    cs = inp["cos_sin_cache"].double()
    half = cs.shape[1] // 2
    bias = inp["kv_bias"].double() if inp["kv_bias"] is not None else None
    T = hidden.shape[0]
    K = torch.zeros(L, T, Hkv, D, dtype=torch.float64)
    V = torch.zeros(L, T, Hkv, D, dtype=torch.float64)
    for l in range(L):
        for t in range(T):
            p = int(inp["positions"][t])
            for h in range(Hkv):
                k_row = l * 2 * Hkv * D + h * D
                v_row = l * 2 * Hkv * D + Hkv * D + h * D
                k = w_kv[k_row:k_row + D] @ hidden[t]
                v = w_kv[v_row:v_row + D] @ hidden[t]
                if bias is not None:
                    k = k + bias[k_row:k_row + D]
                    v = v + bias[v_row:v_row + D]
                k = k / torch.sqrt((k * k).sum() / D + eps) * inp["k_norm_weight"][l].double()
                out = k.clone()
                for i in range(half):
                    c, s = cs[p, i], cs[p, half + i]
                    out[i] = k[i] * c - k[half + i] * s
                    out[half + i] = k[half + i] * c + k[i] * s
                K[l, t, h], V[l, t, h] = out, v
    return K, V


def _snapshot(inp):
    return [b.clone() for b in inp["k_buffers"] + inp["v_buffers"]]


def _bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t.view(torch.int16 if t.element_size() == 2
                                                            else torch.int32)


def _check_untouched(inp, before):
    loc = set(inp["out_cache_loc"].tolist())
    keep = torch.tensor([s not in loc for s in range(before[0].shape[0])])
    for b, old in zip(inp["k_buffers"] + inp["v_buffers"], before):
        assert torch.equal(_bits(b)[keep], _bits(old)[keep]), "a slot outside out_cache_loc changed"


def _run(inp, eps=1e-6, **kw):
    materialize_kv(inp["hidden"], inp["w_kv"], inp["k_norm_weight"], inp["positions"],
                   inp["cos_sin_cache"], inp["out_cache_loc"], inp["k_buffers"], inp["v_buffers"],
                   eps=eps, kv_bias=inp["kv_bias"], **kw)


@pytest.mark.parametrize("cache_dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2),
                                             (torch.float16, 2e-3)])
@pytest.mark.parametrize("variant", [0, 1])
def test_matches_naive_loop(cache_dtype, tol, variant, seed):
    inp = _inputs(cache_dtype=cache_dtype, seed=seed + variant, bias=variant == 1,
                  idx_dtype=torch.int32 if variant else torch.int64)
    before = _snapshot(inp)
    _run(inp, eps=1e-5)
    K, V = _naive(inp, 1e-5)
    loc = inp["out_cache_loc"].long()
    for l in range(len(inp["k_buffers"])):
        kw, vw = inp["k_buffers"][l][loc].double(), inp["v_buffers"][l][loc].double()
        assert torch.isfinite(kw).all() and torch.isfinite(vw).all(), "a written slot kept poison"
        torch.testing.assert_close(kw, K[l], rtol=tol, atol=tol)
        torch.testing.assert_close(vw, V[l], rtol=tol, atol=tol)
    _check_untouched(inp, before)


def test_bf16_activations_and_bigger_shapes(seed):
    inp = _inputs(T=33, L=2, Hkv=4, D=64, H=96, num_slots=100, max_pos=4096,
                  dtype=torch.bfloat16, cache_dtype=torch.bfloat16, seed=seed)
    before = _snapshot(inp)
    _run(inp)
    K, V = _naive(inp, 1e-6)  # naive reads the same bf16 inputs, in float64
    loc = inp["out_cache_loc"].long()
    for l in range(2):
        torch.testing.assert_close(inp["k_buffers"][l][loc].double(), K[l], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(inp["v_buffers"][l][loc].double(), V[l], rtol=1e-2, atol=1e-2)
    _check_untouched(inp, before)


def test_partial_rotary_dim_passes_tail_through(seed):
    inp = _inputs(D=16, rot=8, seed=seed)
    _run(inp)
    K, _ = _naive(inp, 1e-6)
    loc = inp["out_cache_loc"].long()
    for l in range(3):
        torch.testing.assert_close(inp["k_buffers"][l][loc].double(), K[l], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.5, 2.0)])
def test_fp8_cache_with_scale(k_scale, v_scale, seed):
    inp = _inputs(cache_dtype=FP8, seed=seed)
    before = _snapshot(inp)
    _run(inp, k_scale=k_scale, v_scale=v_scale)
    K, V = _naive(inp, 1e-6)
    loc = inp["out_cache_loc"].long()
    for l in range(3):
        for buf, ref, scale in ((inp["k_buffers"][l], K[l], k_scale), (inp["v_buffers"][l], V[l], v_scale)):
            got = buf[loc].double() * scale
            assert torch.isfinite(got).all()
            # e4m3: 3 mantissa bits -> half-ulp relative error 2^-4; subnormal step 2^-9.
            torch.testing.assert_close(got, ref, rtol=2 ** -4 + 1e-6, atol=scale * 2 ** -9)
            # And bit-exact against quantizing the float32 reference value ourselves, except
            # where float32-vs-float64 rounding lands on a tie (allow a tiny fraction).
            exact = (ref / scale).clamp(-448, 448).float().to(FP8)
            mismatch = (_bits(buf[loc]) != _bits(exact)).float().mean().item()
            assert mismatch < 0.01
    _check_untouched(inp, before)


def test_fp8_saturates_instead_of_nan(seed):
    inp = _inputs(cache_dtype=FP8, seed=seed)
    _run(inp, k_scale=1e-3, v_scale=1e-3)  # |k| / 1e-3 is far beyond 448
    loc = inp["out_cache_loc"].long()
    k = inp["k_buffers"][0][loc].float()
    assert torch.isfinite(k).all()
    assert k.abs().max().item() == 448.0


def test_empty_batch_writes_nothing():
    inp = _inputs(T=0)
    before = _snapshot(inp)
    _run(inp)
    for b, old in zip(inp["k_buffers"] + inp["v_buffers"], before):
        assert torch.equal(_bits(b), _bits(old))


def test_reference_and_auto_agree_and_registry(seed):
    assert registry.availability("materialize_kv")["reference"] is None
    a, b = _inputs(seed=seed), _inputs(seed=seed)
    _run(a, impl="auto")
    _run(b, impl="reference")
    for x, y in zip(a["k_buffers"] + a["v_buffers"], b["k_buffers"] + b["v_buffers"]):
        assert torch.equal(_bits(x), _bits(y))
    with pytest.raises(RuntimeError, match="unavailable"):
        _run(_inputs(seed=seed), impl="cuda")


def test_one_gemm_layout_equals_per_layer_projection(seed):
    """The stacked w_kv == SGLang's per-layer qkv_proj.weight[q_size : q_size + 2*kv_size]."""
    g = torch.Generator().manual_seed(seed)
    L, Hq, Hkv, D, H = 2, 4, 2, 8, 24
    qkv = [torch.randn((Hq + 2 * Hkv) * D, H, generator=g) for _ in range(L)]
    w_kv = torch.cat([w[Hq * D:(Hq + 2 * Hkv) * D] for w in qkv])
    assert torch.equal(w_kv, stack_kv_proj_weights([w[Hq * D:(Hq + Hkv) * D] for w in qkv],
                                                   [w[(Hq + Hkv) * D:] for w in qkv]))
    x = torch.randn(5, H, generator=g)
    kv = (x @ w_kv.t()).view(5, L, 2, Hkv, D)
    for l in range(L):
        ref = x @ qkv[l].t()
        torch.testing.assert_close(kv[:, l, 0].reshape(5, -1), ref[:, Hq * D:(Hq + Hkv) * D])
        torch.testing.assert_close(kv[:, l, 1].reshape(5, -1), ref[:, (Hq + Hkv) * D:])


def test_building_blocks():
    cache = make_cos_sin_cache(50, 8, 500.0)
    assert cache.shape == (50, 8) and cache.dtype == torch.float32
    for p in (0, 1, 49):
        for i in range(4):
            ang = p * 500.0 ** (-2 * i / 8)
            assert abs(cache[p, i].item() - math.cos(ang)) < 1e-5
            assert abs(cache[p, 4 + i].item() - math.sin(ang)) < 1e-5
    x = torch.randn(3, 2, 8)
    pos = torch.tensor([0, 7, 49])
    y = apply_rope_neox_reference(x, pos, cache)
    torch.testing.assert_close(y[0], x[0])  # position 0 is the identity
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # rotations keep the norm
    # rotate-halves pairs (i, i + 4), not interleaved (2i, 2i + 1)
    e = torch.zeros(1, 1, 8)
    e[..., 0] = 1
    z = apply_rope_neox_reference(e, torch.tensor([7]), cache)
    torch.testing.assert_close(z[0, 0, 4], cache[7, 4])
    assert z[0, 0, 1].item() == 0
    n = rms_norm_reference(x, torch.full((8,), 2.0), 0.0)
    torch.testing.assert_close(n.pow(2).mean(-1), torch.full((3, 2), 4.0))
    with pytest.raises(ValueError):
        make_cos_sin_cache(10, 7)


def _bad(**override):
    inp = _inputs(seed=9)
    inp.update(override)
    return inp


@pytest.mark.parametrize("override,exc,match", [
    (dict(hidden=torch.zeros(7, 40, dtype=torch.int64)), ValueError, "hidden must have dtype"),
    (dict(hidden=[[0.0]]), TypeError, "hidden must be a torch.Tensor"),
    (dict(w_kv=torch.zeros(3 * 2 * 2 * 16 - 1, 40)), ValueError, "w_kv must have shape"),
    (dict(w_kv=torch.zeros(3 * 2 * 2 * 16, 40, dtype=torch.bfloat16)), ValueError, "w_kv must have dtype"),
    (dict(k_norm_weight=torch.ones(2, 16)), ValueError, "k_norm_weight must have shape"),
    (dict(positions=torch.zeros(6, dtype=torch.int64)), ValueError, "positions must have shape"),
    (dict(positions=torch.zeros(7)), ValueError, "positions must have dtype"),
    (dict(positions=torch.full((7,), 64)), IndexError, "positions has values"),
    (dict(out_cache_loc=torch.tensor([0, 1, 2, 3, 4, 5, 32])), IndexError, "out_cache_loc has values"),
    (dict(out_cache_loc=torch.tensor([0, 1, 2, 3, 4, 5, -1])), IndexError, "out_cache_loc has values"),
    (dict(out_cache_loc=torch.tensor([0, 1, 2, 3, 4, 5, 5])), ValueError, "repeats a slot"),
    (dict(cos_sin_cache=torch.zeros(64, 7)), ValueError, "rotary_dim"),
    (dict(cos_sin_cache=torch.zeros(64, 18)), ValueError, "rotary_dim"),
    (dict(kv_bias=torch.zeros(5)), ValueError, "kv_bias must have shape"),
    (dict(v_buffers=[torch.zeros(32, 2, 16)] * 2), ValueError, "v_buffers has 2 layers"),
    (dict(v_buffers=[torch.zeros(32, 2, 16)] * 2 + [torch.zeros(31, 2, 16)]), ValueError, "v_buffers\\[2\\] has shape"),
    (dict(v_buffers=[torch.zeros(32, 2, 16, dtype=torch.bfloat16)] * 3), ValueError, "dtype"),
    (dict(v_buffers=[torch.zeros(32, 16, 2).transpose(1, 2)] * 3), ValueError, "contiguous"),
    (dict(v_buffers=[torch.zeros(32, 2, 16, dtype=torch.int8)] * 3), ValueError, "must have dtype"),
    (dict(k_buffers=torch.zeros(3, 32, 2, 16)), TypeError, "list of per-layer tensors"),
    (dict(k_buffers=[]), ValueError, "at least one"),
    (dict(cos_sin_cache=torch.zeros(64, 16, device="meta")), ValueError, "must be on cpu"),
])
def test_bad_inputs_raise_before_any_write(override, exc, match):
    inp = _bad(**override)
    bufs = [b for b in (inp["k_buffers"], inp["v_buffers"]) if isinstance(b, list)]
    before = [x.clone() for bl in bufs for x in bl]
    with pytest.raises(exc, match=match):
        _run(inp)
    after = [x for bl in bufs for x in bl]
    for b, old in zip(after, before):
        assert torch.equal(_bits(b), _bits(old))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(eps=0.0), ValueError, "eps"),
    (dict(eps=float("nan")), ValueError, "eps"),
    (dict(k_scale=0.5), ValueError, "only applies to a float8"),
    (dict(v_scale=torch.tensor(1.0)), TypeError, "v_scale must be a Python float"),
    (dict(impl="nope"), ValueError, "impl must be"),
    (dict(hidden_norm_weight=torch.ones(39)), ValueError, "hidden_norm_weight must have shape"),
    (dict(hidden_norm_weight=torch.ones(40, dtype=torch.bfloat16)), ValueError, "hidden_norm_weight must have dtype"),
])
def test_bad_options(kw, exc, match):
    inp = _inputs(seed=10)
    with pytest.raises(exc, match=match):
        _run(inp, **kw)


def test_fp8_scale_must_be_positive():
    inp = _inputs(seed=11, cache_dtype=FP8)
    with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
        _run(inp, k_scale=-1.0)


def test_reference_directly_is_callable(seed):
    inp = _inputs(seed=seed)
    materialize_kv_reference(inp["hidden"], inp["w_kv"], inp["k_norm_weight"], inp["positions"],
                             inp["cos_sin_cache"], inp["out_cache_loc"], inp["k_buffers"],
                             inp["v_buffers"], eps=1e-6)
    K, V = _naive(inp, 1e-6)
    torch.testing.assert_close(inp["v_buffers"][2][inp["out_cache_loc"]].double(), V[2],
                               rtol=1e-5, atol=1e-5)


def test_hidden_norm_weight_norms_the_rows_first(seed):
    """``hidden_norm_weight``: the same caches as the normed rows (Llama RMSNorm, the same
    ``eps``) given without it; rows far from unit rms, so a skipped norm would show."""
    g = torch.Generator().manual_seed(seed)
    inp = _inputs(seed=seed)
    inp["hidden"] = 3 * inp["hidden"] + 0.5
    gamma = 1 + 0.3 * torch.randn(inp["hidden"].shape[1], generator=g)
    normed = dict(inp, hidden=llama_rms_norm_reference(inp["hidden"], gamma, 1e-4),
                  k_buffers=[b.clone() for b in inp["k_buffers"]], v_buffers=[b.clone() for b in inp["v_buffers"]])
    raw = dict(inp, k_buffers=[b.clone() for b in inp["k_buffers"]], v_buffers=[b.clone() for b in inp["v_buffers"]])
    _run(inp, eps=1e-4, hidden_norm_weight=gamma)
    _run(normed, eps=1e-4)
    _run(raw, eps=1e-4)
    loc = inp["out_cache_loc"]
    for got, exp, unnormed in zip(inp["k_buffers"] + inp["v_buffers"], normed["k_buffers"] + normed["v_buffers"],
                                  raw["k_buffers"] + raw["v_buffers"]):
        assert torch.equal(got[loc], exp[loc])
    assert not torch.allclose(inp["v_buffers"][0][loc], raw["v_buffers"][0][loc], rtol=1e-2, atol=1e-2)


def test_check_values_false_same_result_and_skips_checks(seed):
    """``check_values=False`` computes the same cache contents on valid input, and skips the
    value checks (an out-of-range position is no longer rejected by the wrapper)."""
    from specattn.ops import make_cos_sin_cache, materialize_kv
    L, hkv, d, hid, T, slots = 2, 2, 8, 16, 5, 12
    hidden = torch.randn(T, hid)
    w_kv = torch.randn(L * 2 * hkv * d, hid)
    k_norm = torch.rand(L, d) + 0.5
    pos = torch.randint(0, 32, (T,))
    cs = make_cos_sin_cache(32, d)
    loc = torch.randperm(slots)[:T]
    outs = []
    for check in (True, False):
        kb = [torch.full((slots, hkv, d), float("nan")) for _ in range(L)]
        vb = [torch.full((slots, hkv, d), float("nan")) for _ in range(L)]
        materialize_kv(hidden, w_kv, k_norm, pos, cs, loc, kb, vb, check_values=check,
                       impl="reference")
        outs.append(kb + vb)
    for a, b in zip(*outs):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    bad = pos.clone()
    bad[0] = 32  # outside the cos/sin cache
    kb, vb = ([torch.zeros(slots, hkv, d) for _ in range(L)] for _ in range(2))
    with pytest.raises(IndexError, match="positions"):
        materialize_kv(hidden, w_kv, k_norm, bad, cs, loc, kb, vb, impl="reference")
    with pytest.raises(IndexError) as e:  # torch's own error from the reference's gather
        materialize_kv(hidden, w_kv, k_norm, bad, cs, loc, kb, vb, check_values=False,
                       impl="reference")
    assert "positions has values" not in str(e.value)
