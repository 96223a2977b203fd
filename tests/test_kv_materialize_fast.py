"""The fast materialize_kv implementations (``triton``; ``cuda`` on a GPU with specattn._C)
against the reference, on fresh random data with poisoned caches.

Two comparisons per case:
- against the reference run on the SAME GEMM output (``epilogue_reference``: the reference
  fed ``hidden = kv.float()`` and an identity ``w_kv``, which reproduces ``kv`` exactly), so
  the epilogue alone is checked tightly: float32 caches to float32 rounding, 16-bit / fp8
  caches bit-exact up to a rare one-step difference at a rounding tie;
- against the reference on the original inputs, with the documented precision contract of
  the fast paths (the GEMM output is rounded to the activation dtype first): see
  :mod:`specattn.ops.kv_materialize`.
Slots outside ``out_cache_loc`` must keep their poison bit for bit.

On a CPU-only machine the Triton kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``,
set below before triton is imported) on small shapes.  The ``gpu``-marked tests use
Qwen3-8B drafter shapes (hidden 4096, 8 KV heads x 128, 5 layers), the pools of
``specattn.backends`` with page sizes 1 and 64, and CUDA-graph capture + replay.
``test_sanitizer_smoke`` is small and quick, meant to run under compute-sanitizer::

    compute-sanitizer --tool memcheck --error-exitcode 9 python -m pytest \\
        tests/test_kv_materialize_fast.py -q -k sanitizer_smoke
    compute-sanitizer --tool racecheck --error-exitcode 9 python -m pytest \\
        tests/test_kv_materialize_fast.py -q -k sanitizer_smoke
"""
import math
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from specattn import _ext  # noqa: E402
from specattn.ops import (make_cos_sin_cache, materialize_kv,  # noqa: E402
                          materialize_kv_reference, registry, stack_kv_proj_weights)
from specattn.triton_kernels.kv_materialize import _bf16_bits, _fp8e4m3_bits  # noqa: E402

FP8 = torch.float8_e4m3fn
ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
FAST_IMPLS = (["cuda"] if ON_GPU and _ext.EXT_AVAILABLE else []) + ["triton"]
needs_ext = pytest.mark.skipif(not _ext.EXT_AVAILABLE,
                               reason=f"specattn._C missing: {_ext.EXT_MISSING_REASON}")


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 GEMMs must be float32 (the identity trick and the contract need it)."""
    if not ON_GPU:
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


# ----------------------------------------------------------------------------- inputs
def _poison(buf, kind):
    """NaN everywhere (``nan``) or every byte 0xFF (``ff``: a NaN in every float format)."""
    if kind == "ff" or buf.dtype == FP8:
        buf.view(torch.uint8).fill_(0xFF)
    else:
        buf.fill_(float("nan"))
    return buf


def make_inputs(T=7, L=3, Hkv=2, D=16, H=40, max_pos=64, num_slots=32, rot=None,
                dtype=torch.float32, cache_dtype=torch.float32, bias=False,
                idx_dtype=torch.int64, poison="nan", seed=0, device=DEV, strided=False,
                loc=None, positions=None, norm_dtype=torch.float32):
    """Random inputs on ``device``; caches poisoned.  ``strided=True`` hands positions,
    out_cache_loc, k_norm_weight, cos_sin_cache and kv_bias over as non-contiguous views."""
    g = torch.Generator().manual_seed(seed)
    rot = D if rot is None else rot
    w_k = [torch.randn(Hkv * D, H, generator=g) / math.sqrt(H) for _ in range(L)]
    w_v = [torch.randn(Hkv * D, H, generator=g) / math.sqrt(H) for _ in range(L)]
    rows = L * 2 * Hkv * D
    if positions is None:
        positions = torch.randint(0, max_pos, (T,), generator=g)
    if loc is None:
        loc = torch.randperm(num_slots, generator=g)[:T]
    inp = dict(
        hidden=torch.randn(T, H, generator=g).to(device, dtype),
        w_kv=stack_kv_proj_weights(w_k, w_v).to(device, dtype),
        k_norm_weight=(1.0 + 0.5 * torch.randn(L, D, generator=g)).to(device, norm_dtype),
        positions=positions.to(device, idx_dtype),
        cos_sin_cache=make_cos_sin_cache(max_pos, rot, 10000.0, device=device),
        out_cache_loc=loc.to(device, idx_dtype),
        k_buffers=[_poison(torch.empty(num_slots, Hkv, D, dtype=cache_dtype, device=device), poison)
                   for _ in range(L)],
        v_buffers=[_poison(torch.empty(num_slots, Hkv, D, dtype=cache_dtype, device=device), poison)
                   for _ in range(L)],
        kv_bias=(0.1 * torch.randn(rows, generator=g)).to(device) if bias else None,
    )
    if strided:
        inp["positions"] = torch.stack([inp["positions"], inp["positions"]], 1)[:, 0]
        inp["out_cache_loc"] = torch.stack([inp["out_cache_loc"]] * 3, 1)[:, 1]
        inp["k_norm_weight"] = inp["k_norm_weight"].t().contiguous().t()
        wide = torch.zeros(max_pos, 2 * rot + 2, device=device)
        wide[:, 1:rot + 1] = inp["cos_sin_cache"]
        inp["cos_sin_cache"] = wide[:, 1:rot + 1]
        if bias:
            inp["kv_bias"] = torch.stack([inp["kv_bias"]] * 2, 1)[:, 1]
        assert not inp["positions"].is_contiguous() and not inp["k_norm_weight"].is_contiguous()
    return inp


ARGS = ("hidden", "w_kv", "k_norm_weight", "positions", "cos_sin_cache", "out_cache_loc",
        "k_buffers", "v_buffers")


def clone_inputs(inp):
    out = dict(inp)
    out["k_buffers"] = [b.clone() for b in inp["k_buffers"]]
    out["v_buffers"] = [b.clone() for b in inp["v_buffers"]]
    return out


def run(inp, impl, eps=1e-6, **kw):
    materialize_kv(*[inp[a] for a in ARGS], eps=eps, kv_bias=inp["kv_bias"], impl=impl, **kw)


def run_reference(inp, eps=1e-6, **kw):
    materialize_kv_reference(*[inp[a] for a in ARGS], eps=eps, kv_bias=inp["kv_bias"], **kw)


def epilogue_reference(inp, eps=1e-6, **kw):
    """The reference on the GEMM output the fast paths see (``torch.mm`` in the input dtype):
    ``kv.float() @ I`` is exactly ``kv`` (one nonzero product per output, no TF32)."""
    kv = torch.mm(inp["hidden"], inp["w_kv"].t()).float()
    eye = torch.eye(kv.shape[1], dtype=torch.float32, device=kv.device)
    materialize_kv_reference(kv, eye, *[inp[a] for a in ARGS[2:]], eps=eps,
                             kv_bias=inp["kv_bias"], **kw)


# ----------------------------------------------------------------------------- checks
def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(
        {2: torch.int16, 4: torch.int32}[t.element_size()])


def _ordered(t):
    """Float bit patterns as integers ordered like the values (sign-magnitude -> signed)."""
    b = _bits(t).long()
    nbits = 8 * t.element_size()
    b = b & ((1 << nbits) - 1)
    sign = b >> (nbits - 1)
    mag = b & ((1 << (nbits - 1)) - 1)
    return torch.where(sign == 1, -mag, mag)


def check_untouched(inp, before):
    loc = inp["out_cache_loc"].long().cpu()
    keep = torch.ones(before[0].shape[0], dtype=torch.bool)
    keep[loc] = False
    for b, old in zip(inp["k_buffers"] + inp["v_buffers"], before):
        assert torch.equal(_bits(b.cpu())[keep], _bits(old.cpu())[keep]), \
            "a slot outside out_cache_loc changed"


def check_vs_epilogue(got_inp, exp_inp, max_mismatch=0.01):
    """Fast path vs the reference on the same GEMM output, written slots only."""
    loc = got_inp["out_cache_loc"].long()
    for i, (g, e) in enumerate(zip(got_inp["k_buffers"] + got_inp["v_buffers"],
                                   exp_inp["k_buffers"] + exp_inp["v_buffers"])):
        g, e = g[loc], e[loc]
        assert not torch.isnan(g.float()).any(), f"buffer {i}: a written slot kept poison"
        if g.dtype == torch.float32:
            torch.testing.assert_close(g, e, rtol=4e-6, atol=4e-6)
            continue
        step = (_ordered(g) - _ordered(e)).abs()
        assert int(step.max()) <= 1, f"buffer {i}: more than one rounding step off"
        frac = (step > 0).double().mean().item()
        assert frac <= max_mismatch, f"buffer {i}: {frac:.2%} of elements one step off"


def _partner(x, rot):
    half = rot // 2
    p = torch.zeros_like(x)
    p[..., :half] = x[..., half:rot]
    p[..., half:rot] = x[..., :half]
    return p


def check_contract(got_inp, ref_inp, rot, k_scale=1.0, v_scale=1.0):
    """The documented bound vs the reference on the original inputs (bf16 activations)."""
    loc = got_inp["out_cache_loc"].long()
    L = len(got_inp["k_buffers"])
    for l in range(L):
        for kind, scale in (("k_buffers", k_scale), ("v_buffers", v_scale)):
            g = got_inp[kind][l][loc].double() * scale
            r = ref_inp[kind][l][loc].double() * scale
            part = _partner(r, rot) if kind == "k_buffers" else torch.zeros_like(r)
            rms = r.pow(2).mean(-1, keepdim=True).sqrt()
            bound = 2 ** -6 * (r.abs() + part.abs()) + 2 ** -10 * rms
            if got_inp[kind][l].dtype == FP8:
                bound = bound + 2 ** -3 * r.abs() + 2 ** -9 * scale
            bad = (g - r).abs() > bound
            assert not bad.any(), (f"{kind}[{l}]: {int(bad.sum())} elements beyond the bound, "
                                   f"worst excess {((g - r).abs() - bound).max().item():.3g}")


def available(impl):
    why = registry.availability("materialize_kv")[impl]
    if why is not None:
        pytest.skip(f"{impl} unavailable: {why}")


# ----------------------------------------------------------------------------- CPU + GPU
@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, FP8],
                         ids=["f32", "bf16", "f16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["act_f32", "act_bf16"])
@pytest.mark.parametrize("extra", [False, True], ids=["plain", "extras"])
def test_matches_reference(impl, cache_dtype, dtype, extra, seed):
    """Each cache dtype x activation dtype, plain (full rotary dim, int64 indices, NaN
    poison) and with extras (rotary dim < D, kv_bias, int32 indices, 0xFF poison)."""
    available(impl)
    kw = dict(k_scale=0.5, v_scale=2.0) if cache_dtype == FP8 else {}
    inp = make_inputs(dtype=dtype, cache_dtype=cache_dtype, seed=seed, rot=8 if extra else None,
                      bias=extra, idx_dtype=torch.int32 if extra else torch.int64,
                      poison="ff" if extra else "nan")
    exp, ref = clone_inputs(inp), clone_inputs(inp)
    before = [b.clone() for b in inp["k_buffers"] + inp["v_buffers"]]
    run(inp, impl, **kw)
    epilogue_reference(exp, **kw)
    run_reference(ref, **kw)
    check_untouched(inp, before)
    check_vs_epilogue(inp, exp)
    if dtype == torch.bfloat16:
        check_contract(inp, ref, rot=inp["cos_sin_cache"].shape[1], **kw)
    elif cache_dtype == torch.float32:
        loc = inp["out_cache_loc"].long()
        for g, r in zip(inp["k_buffers"] + inp["v_buffers"], ref["k_buffers"] + ref["v_buffers"]):
            torch.testing.assert_close(g[loc], r[loc], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", FAST_IMPLS)
@pytest.mark.parametrize("D,rot,Hkv", [(64, 64, 2), (128, 128, 2), (256, 256, 1), (128, 32, 3),
                                       (20, 10, 3), (8, 2, 4), (24, 24, 1)])
def test_head_dims_and_rotary_dims(impl, D, rot, Hkv, seed):
    """Head dims 64/128/256, a partial rotary dim, and odd shapes (D not a multiple of 8,
    R/2 not a multiple of 8): the CUDA kernel's scalar and partner-reload paths."""
    available(impl)
    inp = make_inputs(T=5, L=2, Hkv=Hkv, D=D, H=32, rot=rot, dtype=torch.bfloat16,
                      cache_dtype=torch.bfloat16, seed=seed, bias=D == 20)
    exp = clone_inputs(inp)
    before = [b.clone() for b in inp["k_buffers"] + inp["v_buffers"]]
    run(inp, impl)
    epilogue_reference(exp)
    check_untouched(inp, before)
    check_vs_epilogue(inp, exp)


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_strided_inputs_and_low_precision_params(impl, seed):
    """Non-contiguous positions / out_cache_loc / k_norm_weight / cos_sin_cache / kv_bias,
    bf16 norm weights and a partial rotary dim: read through their strides, no copies."""
    available(impl)
    inp = make_inputs(T=9, dtype=torch.bfloat16, cache_dtype=FP8, seed=seed, bias=True,
                      strided=True, idx_dtype=torch.int32, norm_dtype=torch.bfloat16, rot=8)
    exp = clone_inputs(inp)
    before = [b.clone() for b in inp["k_buffers"] + inp["v_buffers"]]
    run(inp, impl, k_scale=0.25, v_scale=0.125)
    epilogue_reference(exp, k_scale=0.25, v_scale=0.125)
    check_untouched(inp, before)
    check_vs_epilogue(inp, exp)


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_fp8_saturates_instead_of_nan(impl, seed):
    available(impl)
    inp = make_inputs(cache_dtype=FP8, seed=seed)
    exp = clone_inputs(inp)
    run(inp, impl, k_scale=1e-3, v_scale=1e-3)  # |k| / 1e-3 is far beyond 448
    epilogue_reference(exp, k_scale=1e-3, v_scale=1e-3)
    loc = inp["out_cache_loc"].long()
    for b in inp["k_buffers"] + inp["v_buffers"]:
        v = b[loc].float()
        assert torch.isfinite(v).all() and v.abs().max().item() == 448.0
    check_vs_epilogue(inp, exp)


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_empty_batch_writes_nothing(impl):
    available(impl)
    inp = make_inputs(T=0)
    before = [b.clone() for b in inp["k_buffers"] + inp["v_buffers"]]
    run(inp, impl)
    # also the implementation directly (the wrapper returns early for T == 0)
    registry.dispatch("materialize_kv", impl, inp["hidden"].device)(
        *[inp[a] for a in ARGS], eps=1e-6, kv_bias=None)
    for b, old in zip(inp["k_buffers"] + inp["v_buffers"], before):
        assert torch.equal(_bits(b), _bits(old))


def test_registry_and_impl_errors(seed):
    avail = registry.availability("materialize_kv")
    assert avail["reference"] is None and avail["triton"] is None
    inp = make_inputs(seed=seed, device="cpu")
    if avail["cuda"] is None:  # extension built: CPU tensors get a clear error, not a crash
        with pytest.raises(RuntimeError, match="unavailable for tensors on cpu"):
            run(inp, "cuda")
    else:
        with pytest.raises(RuntimeError, match="unavailable"):
            run(inp, "cuda")


# ----------------------------------------------------------------------------- GPU only
QWEN = dict(H=4096, L=5, Hkv=8, D=128)


def _pool_slots(page_size, T, seed):
    """Slots and positions of ``T`` new tokens appended to 4 requests with random prefixes,
    from a ``KVAllocator`` / ``MHATokenToKVPool`` pair of that page size."""
    import random

    from specattn.backends.pools import KVAllocator
    rng = random.Random(seed)
    size = 64 * (2 * T // 64 + 40)
    alloc = KVAllocator(size, page_size, device="cpu")
    prefix = [rng.randrange(0, 3 * page_size + 5) for _ in range(4)]
    first = alloc.alloc_extend([0] * 4, prefix, [-1] * 4)
    last, off = [], 0
    for p in prefix:
        last.append(int(first[off + p - 1]) if p else -1)
        off += p
    ext = [T // 4] * 3 + [T - 3 * (T // 4)]
    loc = alloc.alloc_extend(prefix, ext, last)
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext)])
    return size, loc, positions


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("T", [512, 37])
def test_qwen3_8b_drafter_shapes_in_pools(impl, page_size, cache_dtype, T, seed):
    """Qwen3-8B drafter shapes, caches of a MHATokenToKVPool (page size 1 or 64) whose slots
    come from a KVAllocator appending to 4 requests with random prefixes."""
    available(impl)
    from specattn.backends.pools import MHATokenToKVPool
    size, loc, positions = _pool_slots(page_size, T, seed)
    pool = MHATokenToKVPool(size, page_size, cache_dtype, QWEN["Hkv"], QWEN["D"], QWEN["L"],
                            device="cuda")
    inp = make_inputs(T=T, L=QWEN["L"], Hkv=QWEN["Hkv"], D=QWEN["D"], H=QWEN["H"],
                      max_pos=8192, num_slots=pool.num_slots, dtype=torch.bfloat16,
                      cache_dtype=cache_dtype, seed=seed, loc=loc, positions=positions,
                      norm_dtype=torch.bfloat16)
    for mine, theirs in zip(inp["k_buffers"] + inp["v_buffers"], pool.buffers):
        theirs.copy_(mine)  # poisoned
    inp["k_buffers"], inp["v_buffers"] = pool.k_buffer, pool.v_buffer
    kw = dict(k_scale=0.05, v_scale=0.02) if cache_dtype == FP8 else {}
    exp, ref = clone_inputs(inp), clone_inputs(inp)
    before = [b.clone() for b in pool.buffers]
    run(inp, impl, **kw)
    torch.cuda.synchronize()
    epilogue_reference(exp, **kw)
    run_reference(ref, **kw)
    check_untouched(inp, before)
    check_vs_epilogue(inp, exp)
    check_contract(inp, ref, rot=QWEN["D"], **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["cuda", "triton"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_cuda_graph_capture_and_replay(impl, cache_dtype, seed):
    """Capture once (after one eager warm-up call), then replay on new hidden states,
    positions and slots copied into the static inputs: results as the reference on them."""
    available(impl)
    T, num_slots = 64, 512
    kw = dict(k_scale=0.05, v_scale=0.02) if cache_dtype == FP8 else {}
    inp = make_inputs(T=T, L=QWEN["L"], Hkv=QWEN["Hkv"], D=QWEN["D"], H=1024, max_pos=4096,
                      num_slots=num_slots, dtype=torch.bfloat16, cache_dtype=cache_dtype,
                      seed=seed)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(inp, impl, **kw)  # warm-up: compiles, builds the Triton pointer table
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(inp, impl, **kw)
    for round_ in range(2):
        new = make_inputs(T=T, L=QWEN["L"], Hkv=QWEN["Hkv"], D=QWEN["D"], H=1024, max_pos=4096,
                          num_slots=num_slots, dtype=torch.bfloat16, cache_dtype=cache_dtype,
                          seed=seed + 1 + round_)
        for a in ("hidden", "positions", "out_cache_loc"):
            inp[a].copy_(new[a])
        for b in inp["k_buffers"] + inp["v_buffers"]:
            _poison(b, "nan")
        before = [b.clone() for b in inp["k_buffers"] + inp["v_buffers"]]
        exp, ref = clone_inputs(inp), clone_inputs(inp)
        graph.replay()
        torch.cuda.synchronize()
        epilogue_reference(exp, **kw)
        run_reference(ref, **kw)
        check_untouched(inp, before)
        check_vs_epilogue(inp, exp)
        check_contract(inp, ref, rot=QWEN["D"], **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_auto_picks_triton_above_cuda_head_dim_limit(seed):
    from specattn.ops.kv_materialize import CUDA_MAX_HEAD_DIM
    inp = make_inputs(T=3, L=1, Hkv=1, D=2 * CUDA_MAX_HEAD_DIM, H=32, dtype=torch.bfloat16,
                      cache_dtype=torch.bfloat16, seed=seed)
    exp = clone_inputs(inp)
    run(inp, "auto")
    epilogue_reference(exp)
    check_vs_epilogue(inp, exp)
    if registry.availability("materialize_kv")["cuda"] is None:
        with pytest.raises(ValueError, match="head dims <= 256"):
            run(clone_inputs(inp), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@needs_ext
def test_epilogue_op_rejects_bad_arguments():
    """The raw op checks what it relies on (the wrapper validates the rest first)."""
    inp = make_inputs(T=4, dtype=torch.bfloat16, cache_dtype=torch.bfloat16)
    kv = torch.mm(inp["hidden"], inp["w_kv"].t())
    op = torch.ops.specattn.materialize_kv_epilogue
    args = [kv, inp["k_norm_weight"], inp["positions"], inp["cos_sin_cache"],
            inp["out_cache_loc"], inp["k_buffers"], inp["v_buffers"], 1e-6, None, 1.0, 1.0]
    bad = list(args)
    bad[0] = kv[:, :-1]
    with pytest.raises(RuntimeError, match="kv must be"):
        op(*bad)
    bad = list(args)
    bad[6] = inp["v_buffers"][:-1]
    with pytest.raises(RuntimeError, match="as many v_buffers"):
        op(*bad)
    bad = list(args)
    bad[9] = 0.5
    with pytest.raises(RuntimeError, match="float8_e4m3fn caches only"):
        op(*bad)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@needs_ext
def test_sanitizer_smoke():
    """Small CUDA-impl calls covering the vector path, the scalar / partner-reload path
    (D = 20, R = 10), fp8, bias, int32 indices, a tail block, and a 0-token call: run this
    under compute-sanitizer memcheck / racecheck (see the module docstring)."""
    cfgs = [dict(T=5, L=2, Hkv=8, D=128, cache_dtype=torch.bfloat16, dtype=torch.bfloat16),
            dict(T=3, L=3, Hkv=3, D=20, rot=10, cache_dtype=FP8, bias=True,
                 idx_dtype=torch.int32),
            dict(T=7, L=1, Hkv=1, D=256, cache_dtype=torch.float32, dtype=torch.float16),
            dict(T=0)]
    for i, cfg in enumerate(cfgs):
        inp = make_inputs(seed=i, **cfg)
        exp = clone_inputs(inp)
        kw = dict(k_scale=0.5, v_scale=0.5) if cfg.get("cache_dtype") == FP8 else {}
        run(inp, "cuda", **kw)
        torch.cuda.synchronize()
        if cfg["T"]:
            epilogue_reference(exp, **kw)
            check_vs_epilogue(inp, exp)


@triton.jit
def _cast_kernel(x_ptr, o_ptr, n, FP8: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    if FP8:
        tl.store(o_ptr + i, _fp8e4m3_bits(x), mask=i < n)
    else:
        tl.store(o_ptr + i, _bf16_bits(x), mask=i < n)


@pytest.mark.parametrize("target", ["fp8", "bf16"])
def test_triton_rounding_helpers_are_exact(target):
    """The Triton kernel's bit-level casts (RTNE; fp8 saturating) equal torch's casts on
    every fp8 / bf16 rounding tie, the subnormal range, saturation, signed zeros, NaN and
    random float32 bit patterns."""
    g = torch.Generator().manual_seed(0)
    if target == "fp8":
        codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
        mids = (codes[:-1] + codes[1:]) / 2  # exact ties between neighbours
        vals = torch.cat([codes, mids, mids.nextafter(torch.tensor(0.0)),
                          mids.nextafter(torch.tensor(1e9)),
                          torch.rand(4000, generator=g) * 2 ** -6,
                          torch.randn(4000, generator=g) * 40,
                          torch.tensor([448.0, 460.0, 464.0, 500.0, 1e30, 0.0])])
        vals = torch.cat([vals, -vals, torch.tensor([float("nan"), float("inf"), -float("inf")])])
        expect = vals.clamp(-448, 448).to(FP8).view(torch.uint8)
        out = torch.empty(vals.shape, dtype=torch.uint8)
    else:
        bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (8000,), generator=g, dtype=torch.int64)
        vals = bits.to(torch.int32).view(torch.float32)
        hi = torch.randint(-2 ** 15, 2 ** 15, (4000,), generator=g).to(torch.int32)
        ties = (hi << 16) | 0x8000  # exactly halfway between two bf16 neighbours
        vals = torch.cat([vals, ties.view(torch.float32),
                          torch.tensor([0.0, -0.0, 3.4e38, 1e-40, float("inf"), float("nan")])])
        expect = vals.to(torch.bfloat16).view(torch.uint16)
        out = torch.empty(vals.shape, dtype=torch.uint16)
    x = vals.contiguous().to(DEV)
    out = out.to(DEV)
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), FP8=target == "fp8",
                                                 BLOCK=1024)
    got, expect = out.cpu(), expect.contiguous()
    nan = torch.isnan(vals)  # NaN in: any NaN code out (payloads differ from torch's)
    if target == "fp8":
        assert ((got[nan] & 0x7F) == 0x7F).all()
    else:
        assert torch.isnan(got[nan].view(torch.bfloat16).float()).all()
    got, expect, vals = got[~nan], expect[~nan], vals[~nan]
    bad = got != expect
    assert not bad.any(), f"{int(bad.sum())} mismatches, e.g. at {vals[bad][:5].tolist()}"
