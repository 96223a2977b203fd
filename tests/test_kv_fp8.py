"""FP8 (e4m3) KV caches: the pools' quantization, the reference backend's dequantization and
the Triton backend reading fp8 in every mode, MHA/GQA and MLA, against the reference on the
same (quantized) cache.  The CPU runs use float32 queries (the interpreter has no correct
bf16 dot); GPU-marked tests use bf16 queries, page sizes 1/16/64, 16 and 128 MLA heads,
long prefixes and CUDA-graph replay."""
import os

import torch

if not torch.cuda.is_available():  # before triton / the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402

from scenarios import make_scenario, naive_attention  # noqa: E402
from specattn.backends import (ForwardMode, MHATokenToKVPool, MLATokenToKVPool,  # noqa: E402
                               TorchReferenceBackend)
from specattn.ops.fp8 import FP8_E4M3_MAX, quantize_kv  # noqa: E402

FP8 = torch.float8_e4m3fn
MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]
GRAPH_MODES = [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]


def _scales(rng: random.Random):
    """A random (k_scale, v_scale) pair over three decades, never exactly 1."""
    return tuple(10 ** rng.uniform(-2, 1) for _ in range(2))


# ------------------------------------------------------------------------- pools
def test_pool_quantizes_saturates_and_scales_per_layer(seed):
    rng = random.Random(seed)
    ks = [10 ** rng.uniform(-2, 1) for _ in range(3)]
    pool = MHATokenToKVPool(16, 1, FP8, 2, 16, 3, k_scale=ks, v_scale=0.5)
    for b in pool.buffers:
        b.fill_(float("nan"))                      # poison: only the written slots change
    loc = torch.tensor([3, 7, 2])
    k = torch.randn(3, 2, 16) * ks[1] * 40           # within +-448 * scale (but the poisoned row)
    k[0, 0, :4] = torch.tensor([1e6, -1e6, float("inf"), -float("inf")])   # saturate
    v = torch.randn(3, 2, 16)
    pool.set_kv_buffer(1, loc, k, v)
    kc = pool.k_buffer[1][loc].float() * ks[1]
    vc = pool.v_buffer[1][loc].float() * 0.5
    assert torch.isfinite(kc).all() and torch.isfinite(vc).all()
    assert torch.equal(kc[0, 0, :4], torch.tensor([1, -1, 1, -1.0]) * FP8_E4M3_MAX * ks[1])
    # RTNE to 3 mantissa bits: half a step (2^-4 relative) for normal values, half the
    # subnormal step 2^-9 * scale below 2^-6 * scale
    for got, want, s in ((kc[1:], k[1:], ks[1]), (vc, v, 0.5)):
        bound = torch.maximum(want.abs() * 2 ** -4, torch.full_like(want, 2 ** -10 * s))
        assert ((got - want).abs() <= bound * (1 + 1e-6)).all()
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[loc] = False
    assert torch.isnan(pool.k_buffer[1][untouched].float()).all()
    assert all(torch.isnan(pool.k_buffer[i].float()).all() for i in (0, 2))
    assert pool.kv_scales(2) == (ks[2], 0.5) and pool.is_fp8


def test_mla_pool_scale_and_errors():
    pool = MLATokenToKVPool(8, 1, FP8, 2, kv_lora_rank=32, qk_rope_head_dim=16, kv_scale=[0.1, 2.0])
    lat = torch.randn(2, 1, 48)
    pool.set_kv_buffer(0, torch.tensor([1, 4]), lat)
    assert torch.equal(pool.kv_buffer[0][[1, 4]], quantize_kv(lat, FP8, 0.1))
    assert pool.kv_scales(1) == (2.0, 2.0)
    with pytest.raises(ValueError, match="only applies to a float8_e4m3fn"):
        MLATokenToKVPool(8, 1, torch.bfloat16, 2, kv_lora_rank=32, qk_rope_head_dim=16, kv_scale=2.0)
    with pytest.raises(ValueError, match="one scale per layer"):
        MHATokenToKVPool(8, 1, FP8, 2, 16, 3, k_scale=[1.0, 2.0])
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and > 0"):
            MHATokenToKVPool(8, 1, FP8, 2, 16, 1, v_scale=bad)
    with pytest.raises(TypeError, match="Python float"):
        MHATokenToKVPool(8, 1, FP8, 2, 16, 1, k_scale="1")
    with pytest.raises(ValueError, match="KV pool dtype"):
        MHATokenToKVPool(8, 1, torch.float8_e5m2, 2, 16, 1)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_kv_move_copies_fp8_bytes(impl, seed):
    """The KV move (accepted path -> block front) of an fp8 pool: every layer's rows moved
    bit for bit (overlapping pairs: each target gets its source's value from before the call),
    nothing else touched."""
    if impl == "triton":
        pytest.importorskip("triton")
    rng = random.Random(seed)
    pool = MHATokenToKVPool(64, 1, FP8, 2, 16, 3, k_scale=_scales(rng)[0])
    for b in pool.buffers:
        b.copy_(torch.randn(b.shape).to(FP8))
    before = [b.clone() for b in pool.buffers]
    src = torch.tensor(rng.sample(range(1, 65), 6))
    tgt = torch.cat([src[:2], torch.tensor(rng.sample(sorted(set(range(1, 65)) - set(src.tolist())), 4))])
    tgt = tgt[torch.randperm(6)]
    pool.move_kv_cache(tgt, src, impl=impl)
    for now, old in zip(pool.buffers, before):
        want = old.clone()
        want[tgt] = old[src]
        assert torch.equal(now.view(torch.uint8), want.view(torch.uint8))


def test_reference_backend_reads_the_dequantized_cache(seed):
    """The reference backend on an fp8 pool equals the float64 oracle over the dequantized
    cache (this forward's K/V quantized by the pool on the way in)."""
    rng = random.Random(seed)
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=2, D=5, num_heads=4, num_kv_heads=2, head_dim=32,
                       max_prefix=30, dtype=FP8, kv_scales=_scales(rng), rng=rng)
    q, k, v = (torch.randn(sc.batch.num_tokens, h, 32) for h in (4, 2, 2))
    ref = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    ref.init_forward_metadata(sc.batch)
    out = ref.forward(q, k, v, sc.layer, sc.batch)
    assert (out.double() - naive_attention(sc, q)).abs().max() < 1e-5


# ------------------------------------------------------------------------- Triton, CPU
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_fp8_matches_reference(kind, mode, page_size, seed):
    pytest.importorskip("triton")
    from triton_cases import check
    rng = random.Random(seed)
    kw = dict(num_kv_heads=2, num_heads=4, head_dim=rng.choice([32, 64])) if kind == "mha" else \
        dict(num_heads=rng.choice([2, 4]))
    sc = make_scenario(mode, kind=kind, bs=rng.randint(1, 3), page_size=page_size, max_prefix=rng.choice([5, 70]),
                       D=rng.choice([1, 6]), dtype=FP8, kv_scales=_scales(rng), rng=rng, **kw)
    check(sc, splits=rng.choice([1, 3]))


def test_triton_fp8_matches_naive_oracle(seed):
    pytest.importorskip("triton")
    from triton_cases import rel_err, run_both
    rng = random.Random(seed)
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=2, D=7, page_size=16, num_heads=4, num_kv_heads=1,
                       head_dim=32, dtype=FP8, kv_scales=_scales(rng), rng=rng)
    out, _, q = run_both(sc, splits=2)
    assert rel_err(out, naive_attention(sc, q)) < 1e-5


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_triton_fp8_graph_builders_on_cpu(kind, seed):
    pytest.importorskip("triton")
    from triton_cases import graph_case
    rng = random.Random(seed)
    graph_case(kind, rng.choice(GRAPH_MODES), rng.choice([1, 16]), "cpu", False, seed, dtype=FP8,
               num_heads=4, D=5, padded_bs=3, trials=1, kv_scales=_scales(rng))


def test_triton_kernels_check_scales():
    pytest.importorskip("triton")
    from specattn.triton_kernels.attention import paged_attention
    from specattn.triton_kernels.attention_mla import mla_paged_attention
    sc = make_scenario(ForwardMode.DECODE, bs=1, num_heads=2, num_kv_heads=2, head_dim=16,
                       max_prefix=4, dtype=torch.float32)
    b, pool = sc.batch, sc.kv_pool
    args = (pool.get_key_buffer(1), pool.get_value_buffer(1), sc.req_pool.req_to_token,
            b.req_pool_indices, b.prefix_lens.int(), torch.tensor([0, 1], dtype=torch.int32), None, 1, 0.1)
    q = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="only applies to a float8_e4m3fn"):
        paged_attention(q, *args, v_scale=2.0)
    fp8_args = (args[0].to(FP8), args[1].to(FP8)) + args[2:]
    for bad in (0.0, float("nan"), True, -2.0):
        with pytest.raises(ValueError, match="finite float > 0"):
            paged_attention(q, *fp8_args, k_scale=bad)
    lat = torch.zeros(pool.num_slots, 1, 48)
    with pytest.raises(ValueError, match="only applies to a float8_e4m3fn"):
        mla_paged_attention(torch.randn(1, 2, 48), lat, *args[2:], 32, kv_scale=0.5)


# ------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_fp8_on_gpu(mode, page_size, head_dim, seed):
    """bf16 queries over fp8 caches (tiles converted in registers), GQA groups 1..8;
    TARGET_VERIFY with >= 128 packed rows per request runs the Gluon ping-pong kernel (its
    loader widens each tile in shared memory), fewer the portable kernel."""
    from triton_cases import check
    rng = random.Random(seed)
    for group in (1, rng.randint(2, 7), 8):
        hkv = rng.choice([1, 2, 4])
        sc = make_scenario(mode, bs=rng.randint(1, 6), page_size=page_size, device="cuda", dtype=FP8,
                           num_kv_heads=hkv, num_heads=hkv * group, head_dim=head_dim,
                           max_prefix=rng.choice([30, 2000]), D=rng.choice([1, 7, 33, 64]),
                           kv_scales=_scales(rng), rng=rng)
        assert sc.q_dtype == torch.bfloat16
        check(sc, splits=rng.choice([None, 1, 4]))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_fp8_narrow_decode_config(page_size, head_dim, seed):
    """The 2-warp, 2-stage programs that the backend runs for long fp8 decodes
    (``FP8_NARROW_CONFIG``) against the reference: decodes and verifies of up to 16 query rows
    per KV head, GQA groups 1..8, ragged prefixes across 128-key tile edges, 1 / 2 / 5 splits."""
    from specattn.backends.triton_backend import FP8_NARROW_CONFIG
    from triton_cases import check
    rng = random.Random(seed)
    for group in (1, rng.randint(2, 7), 8):
        hkv = rng.choice([1, 2, 8])
        mode = rng.choice([ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
        sc = make_scenario(mode, bs=rng.randint(1, 6), page_size=page_size, device="cuda", dtype=FP8,
                           num_kv_heads=hkv, num_heads=hkv * group, head_dim=head_dim,
                           max_prefix=rng.choice([300, 3000]), D=rng.randint(1, max(1, 16 // group)),
                           kv_scales=_scales(rng), rng=rng)
        check(sc, splits=rng.choice([1, 2, 5]), kernel_config=dict(FP8_NARROW_CONFIG))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_fp8_tree_verify(page_size, head_dim, seed):
    """The Gluon ping-pong tree verify over an fp8 cache (bf16 queries; the kernel runs its
    GEMMs in fp16) against the reference, and against the same kernel on fp16 queries over
    the cache widened to fp16 in global memory (both exact) with ``k_scale`` folded into
    ``sm_scale`` and ``v_scale`` applied after: equal up to float32 rounding (random trees,
    prefixes across tile and split edges, fresh scales, float32 outputs poisoned first).
    The synchronous schedule and 128-key tiles refuse an fp8 cache."""
    from triton_cases import check, rel_err
    from specattn.triton_kernels.attention import paged_attention
    rng = random.Random(seed)
    for _ in range(3):
        hkv = rng.choice([1, 2, 4])
        group, D = rng.choice([(4, 64), (8, 16), (3, 48), (2, 64)])
        sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=rng.randint(1, 5), page_size=page_size,
                           device="cuda", dtype=FP8, num_kv_heads=hkv, num_heads=hkv * group,
                           head_dim=head_dim, max_prefix=rng.choice([1, 63, 64, 65, 700, 3000]),
                           D=D, kv_scales=_scales(rng), rng=rng)
        splits = rng.choice([None, 1, 3])
        check(sc, splits=splits, kernel_config={"sm90": True})
        b, pool, lid = sc.batch, sc.kv_pool, sc.layer.layer_id
        k_scale, v_scale = pool.kv_scales(lid)
        k8, v8 = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        q = torch.randn(b.num_tokens, hkv * group, head_dim, device="cuda").bfloat16()
        meta = (sc.req_pool.req_to_token, b.req_pool_indices, b.prefix_lens.int(),
                b.qo_indptr().int(), b.tree_mask, D)
        sm_scale, num_splits = head_dim ** -0.5, splits or 2
        got, wide = (torch.full(q.shape, float("nan"), device="cuda") for _ in range(2))
        paged_attention(q, k8, v8, *meta, sm_scale, num_splits, got, sm90=True,
                        k_scale=k_scale, v_scale=v_scale)
        paged_attention(q.half(), k8.half(), v8.half(), *meta, sm_scale * k_scale, num_splits,
                        wide, sm90=True)
        assert torch.isfinite(got).all() and rel_err(got, wide * v_scale) < 1e-4
        with pytest.raises(ValueError, match="ping-pong schedule for an fp8 cache"):
            paged_attention(q, k8, v8, *meta, sm_scale, num_splits, sm90=True, pingpong=False,
                            k_scale=k_scale, v_scale=v_scale)
        with pytest.raises(ValueError, match="block_n must be 64 with an fp8 cache"):
            paged_attention(q, k8, v8, *meta, sm_scale, num_splits, sm90=True, block_n=128,
                            k_scale=k_scale, v_scale=v_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_triton_fp8_mla_on_gpu(mode, page_size, num_heads, seed):
    """The 512 + 64 latent in fp8 at 16 and 128 heads (on sm_90 both run the Gluon seesaw
    schedule, whose loader widens the fp8 tiles in shared memory), long prefixes, auto
    splits."""
    from triton_cases import check
    rng = random.Random(seed)
    sc = make_scenario(mode, kind="mla", bs=rng.randint(1, 4), page_size=page_size, device="cuda",
                       dtype=FP8, num_heads=num_heads, kv_lora_rank=512, qk_rope_head_dim=64,
                       max_prefix=rng.choice([30, 4000]), D=rng.choice([1, 7, 64]), num_layers=1,
                       kv_scales=_scales(rng), rng=rng)
    check(sc, splits=rng.choice([None, 1, 4]))


@pytest.mark.gpu
@pytest.mark.parametrize("kind,num_heads", [("mha", 8), ("mla", 16), ("mla", 64)])
@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 64])
def test_triton_fp8_cuda_graph_replay(kind, num_heads, mode, page_size, seed):
    """Graph replay of every graph mode on an fp8 cache; MLA runs the Gluon seesaw schedule on
    sm_90."""
    from triton_cases import graph_case
    rng = random.Random(seed)
    kw = dict(num_heads=num_heads, num_kv_heads=2, head_dim=128) if kind == "mha" else \
        dict(num_heads=num_heads, kv_lora_rank=512, qk_rope_head_dim=64)
    graph_case(kind, mode, page_size, "cuda", True, seed, dtype=FP8, D=rng.choice([5, 64]),
               max_prefix=rng.choice([20, 2000]), padded_bs=8, kv_scales=_scales(rng), **kw)


@pytest.mark.gpu
def test_fp8_attention_error_is_the_e4m3_rounding(seed):
    """The fp8 cache's whole effect on attention: bf16 decode over an fp8 pool vs the float32
    reference over the unquantized K/V stays within what one e4m3 rounding of K and V
    explains (relative 2^-4 per element: a few percent of the output), and far above the
    bf16 kernel's own error (so the cache really holds e4m3)."""
    from triton_cases import rel_err
    from specattn.backends.triton_backend import TritonBackend
    rng = random.Random(seed)
    sc = make_scenario(ForwardMode.DECODE, bs=4, device="cuda", dtype=FP8, num_kv_heads=2, num_heads=8,
                       head_dim=128, max_prefix=1000, kv_scales=(0.05, 0.05), rng=rng)
    exact = make_scenario(ForwardMode.DECODE, bs=4, device="cuda", dtype=torch.float32, num_kv_heads=2,
                          num_heads=8, head_dim=128, max_prefix=1000, rng=random.Random(0))
    exact.batch, exact.req_pool, exact.layer = sc.batch, sc.req_pool, sc.layer
    for dst, src in zip(exact.kv_pool.buffers, sc.kv_pool.buffers):
        dst.copy_(src.float() * 0.05 + torch.randn_like(dst) * 0.05 * 2 ** -5)  # off the fp8 grid
    for i, (kb, vb) in enumerate(zip(exact.kv_pool.k_buffer, exact.kv_pool.v_buffer)):
        sc.kv_pool.k_buffer[i].copy_(quantize_kv(kb, FP8, 0.05))
        sc.kv_pool.v_buffer[i].copy_(quantize_kv(vb, FP8, 0.05))
    q = torch.randn(sc.batch.num_tokens, 8, 128, device="cuda")
    be = TritonBackend(sc.req_pool, sc.kv_pool)
    be.init_forward_metadata(sc.batch)
    out = be.forward(q.bfloat16(), None, None, sc.layer, sc.batch, save_kv_cache=False)
    ref = TorchReferenceBackend(exact.req_pool, exact.kv_pool)
    ref.init_forward_metadata(exact.batch)
    expect = ref.forward(q, None, None, exact.layer, exact.batch, save_kv_cache=False)
    err = rel_err(out, expect)
    assert 2 ** -9 < err < 2 ** -4 * math.sqrt(2), err
