"""TritonBackend (MHA/GQA) against TorchReferenceBackend, every mode, eager and the graph
builders (EXTEND included; MLA is in test_triton_backend_mla.py).  On a CPU-only machine the
kernel runs in Triton's interpreter (small shapes, float32, tolerance 1e-5 relative);
GPU-marked tests cover bf16/fp16, page sizes 1/16/64, GQA groups 1..8, head_dim 64/128, trees
up to 64 draft tokens, prefixes up to 32k and real CUDA graphs (capture at a padded bs, replay
with a smaller one, outputs poisoned), EXTEND in real graphs too."""
import functools
import os

import torch

if not torch.cuda.is_available():  # before triton / the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from scenarios import make_scenario, naive_attention, random_qkv  # noqa: E402
from specattn.backends import (AttentionKind, ForwardBatch, ForwardMode,  # noqa: E402
                               ReqToTokenPool, create_backend, pack_tree_mask)
from specattn.backends.triton_backend import TritonBackend  # noqa: E402
from specattn.triton_kernels.attention import paged_attention  # noqa: E402
from triton_cases import check, rel_err, run_both  # noqa: E402

MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]
GRAPH_MODES = [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]


# ------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_eager_matches_reference(mode, page_size, group, seed):
    rng = random.Random(seed)
    sc = make_scenario(mode, bs=rng.randint(1, 3), page_size=page_size, num_kv_heads=2,
                       num_heads=2 * group, head_dim=64, max_prefix=rng.choice([5, 80]),
                       D=rng.choice([1, 4, 7]), rng=rng)
    check(sc, splits=rng.choice([1, 3]))


def test_extend_empty_prefix_and_multi_tile_rows(seed):
    """Empty prefixes; 40 tokens x G 2 = 80 rows: two row tiles, causal bound per tile."""
    rng = random.Random(seed)
    sc = make_scenario(ForwardMode.EXTEND, bs=3, num_heads=4, num_kv_heads=2, head_dim=64,
                       max_prefix=60, prefix_lens=[0, 0, 17], extend_lens=[40, 1, 33], rng=rng)
    check(sc)


@pytest.mark.parametrize("D", [1, 33])
def test_target_verify_tree_words(D, seed):
    """D = 1 (root only) and D = 33 (two mask words, bit 31 = sign bit, three row tiles)."""
    rng = random.Random(seed)
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=2, D=D, num_heads=8, num_kv_heads=2,
                       head_dim=64, max_prefix=50, rng=rng)
    check(sc, splits=rng.choice([1, 2]))


def test_head_dim_128_and_odd_dims(seed):
    rng = random.Random(seed)
    check(make_scenario(ForwardMode.TARGET_VERIFY, bs=2, D=6, num_heads=4, num_kv_heads=1,
                        head_dim=128, max_prefix=40, rng=rng), splits=2)
    check(make_scenario(ForwardMode.EXTEND, bs=2, num_heads=3, num_kv_heads=3, head_dim=24,
                        max_prefix=10, rng=rng))


def test_fp16_cache_and_fp32_queries_over_it(seed):
    """The tensor-core path (fp16 dots, fp32 accumulation) and the upcast path (q dtype !=
    cache dtype).  bf16 is GPU-only: the interpreter's bf16 tl.dot is wrong."""
    rng = random.Random(seed)
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=2, D=9, num_heads=4, num_kv_heads=2,
                       head_dim=64, max_prefix=70, dtype=torch.float16, rng=rng)
    check(sc, splits=2)
    sc = make_scenario(ForwardMode.EXTEND, bs=2, num_heads=4, num_kv_heads=2, head_dim=64,
                       max_prefix=30, dtype=torch.float16, rng=rng)
    out, expect, q = run_both(sc, q=random_qkv(sc, torch.float32)[0])
    assert out.dtype == torch.float32 and rel_err(out, expect) < 1e-5


def test_matches_naive_oracle(seed):
    """The independent float64 oracle agrees too (not only the reference backend)."""
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=2, D=5, page_size=16, num_heads=4,
                       num_kv_heads=2, head_dim=32, rng=random.Random(seed))
    out, _, q = run_both(sc, splits=2)
    assert rel_err(out, naive_attention(sc, q)) < 1e-5


def test_tree_mask_changes_only_its_row(seed):
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=1, D=4, max_prefix=3, head_dim=32,
                       rng=random.Random(seed))
    q, k, v = random_qkv(sc)
    be = TritonBackend(sc.req_pool, sc.kv_pool)
    be.init_forward_metadata(sc.batch)
    out1 = be.forward(q, k, v, sc.layer, sc.batch)
    sc.batch.tree_mask[0, 3, 0] ^= 1
    be.init_forward_metadata(sc.batch)
    out2 = be.forward(q, k, v, sc.layer, sc.batch, save_kv_cache=False)
    assert torch.equal(out1[:3], out2[:3])
    assert not torch.allclose(out1[3], out2[3])


def test_kernel_writes_every_row_and_no_key_gives_zero():
    """Poisoned output: every token row written; a tree row with no bit and P = 0 -> zeros."""
    torch.manual_seed(0)
    rtt = torch.arange(2 * 8, dtype=torch.int32).view(2, 8)
    kc, vc = torch.randn(16, 1, 16), torch.randn(16, 1, 16)
    q = torch.randn(6, 2, 16)
    tree = pack_tree_mask(torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
                          .expand(2, 3, 3).contiguous())
    for splits in (1, 2):
        out = torch.full((6, 2, 16), float("nan"))
        paged_attention(q, kc, vc, rtt, torch.tensor([1, 0]), torch.tensor([4, 0], dtype=torch.int32),
                        torch.tensor([0, 3, 6], dtype=torch.int32), tree, 3, 0.25,
                        num_splits=splits, out=out)
        assert torch.isfinite(out).all()
        assert torch.equal(out[5], torch.zeros(2, 16))  # request 1 (P = 0), empty row
        assert out[2].abs().sum() > 0                    # request 0 row 2 still sees its prefix


def test_default_config_short_loop_tiles():
    """With a prefix bound and < 128 rows, each program's key count picks the tiles: one
    stage and the smallest ``block_n`` covering the keys in two iterations up to
    ``SHORT_LOOP_KEYS`` keys (128 keys for heads of 128 at up to 16 rows), 128-key
    three-stage tiles past it, 16-row tiles throughout; without a bound (or for fp32, or 128+ rows) the configs do not depend on it."""
    from specattn.triton_kernels.attention import SHORT_LOOP_KEYS, default_config
    cfg = lambda rows, splits, bound: default_config(rows, 64, False, splits, bound)  # noqa: E731
    assert cfg(48, 8, 200) == dict(block_m=16, block_n=32, num_warps=4, num_stages=1)     # 25 keys
    assert cfg(48, 8, 900) == dict(block_m=16, block_n=64, num_warps=4, num_stages=1)     # 113 keys
    assert cfg(3, 1, 200)["block_n"] == 128 and cfg(3, 1, 200)["num_stages"] == 1
    assert cfg(3, 1, SHORT_LOOP_KEYS + 1) == dict(block_m=16, block_n=128, num_warps=4, num_stages=3)
    assert cfg(48, 1, 0)["block_n"] == 32
    assert cfg(3, 8, None) == dict(block_m=16, block_n=128, num_warps=4, num_stages=4)
    assert cfg(48, 8, None) == cfg(96, 1, None) == dict(block_m=64, block_n=64, num_warps=4, num_stages=4)
    assert cfg(128, 1, 200) == cfg(128, 1, None)
    assert default_config(48, 64, True, 8, 200) == default_config(48, 64, True, 8, None)
    # heads of 128 at decode sizes (<= 16 rows): one-stage 128-key tiles up to SHORT_LOOP_KEYS
    wide = lambda rows, splits, bound: default_config(rows, 128, False, splits, bound)  # noqa: E731
    assert wide(4, 16, 1023) == wide(16, 16, 200) == dict(block_m=16, block_n=128, num_warps=4, num_stages=1)
    assert wide(4, 1, SHORT_LOOP_KEYS + 1) == dict(block_m=16, block_n=128, num_warps=4, num_stages=3)
    assert wide(17, 16, 1023)["block_n"] == cfg(17, 16, 1023)["block_n"] == 32          # 64 keys, 2 iterations
    assert default_config(4, 256, False, 16, 1023) == dict(block_m=16, block_n=32, num_warps=4, num_stages=2)


@pytest.mark.gpu
@pytest.mark.parametrize("D,tree", [(1, False), (6, False), (16, True), (32, True)])
def test_gpu_max_prefix_changes_tiles_not_results(D, tree, seed):
    """bf16, GQA 3: the short-loop tiles that a prefix bound selects give the pipelined
    tiles' result (fp32 accumulation: within bf16 rounding), for bounds below, at and above
    the true prefixes and several split counts; output rows poisoned first."""
    gen = torch.Generator().manual_seed(seed)
    bs, Hkv, G, Dh = 3, 3, 3, 64
    P = torch.tensor([200, 37, 900], dtype=torch.int32)
    W = int(P.max()) + D + 8
    slots = bs * W + 16
    rtt = torch.randperm(slots, generator=gen)[:bs * W].view(bs, W).int().cuda()
    kc = torch.randn(slots, Hkv, Dh, generator=gen).to(torch.bfloat16).cuda()
    vc = torch.randn(slots, Hkv, Dh, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(bs * D, Hkv * G, Dh, generator=gen).to(torch.bfloat16).cuda()
    qo = torch.arange(0, bs * D + 1, D, dtype=torch.int32).cuda()
    dense = torch.tril(torch.rand(bs, D, D, generator=gen) < 0.4) | torch.eye(D, dtype=torch.bool)
    tm = pack_tree_mask(dense).cuda() if tree else None
    args = (q, kc, vc, rtt, torch.arange(bs).cuda(), P.cuda(), qo, tm, D, 0.125)
    for splits in (1, 4, 8):
        ref = paged_attention(*args, num_splits=splits, sm90=False).float()
        for bound in (0, 64, 200, 900, 4096):
            out = torch.full_like(q, float("nan"))
            got = paged_attention(*args, num_splits=splits, sm90=False, max_prefix=bound, out=out)
            assert torch.isfinite(got).all() and rel_err(got.float(), ref) < 1e-2, (splits, bound)


@pytest.mark.parametrize("kw,msg", [(dict(page_size=v), "page_size must be an int >= 1")
                                    for v in (0, -64, True, 64.0, "64")]
                         + [(dict(max_prefix=v), "max_prefix must be None or an int")
                            for v in (-1, 2.0, True, "8")])
def test_paged_attention_rejects_bad_page_size_and_max_prefix(kw, msg):
    """``page_size`` must be an int >= 1 (a promise about ``req_to_token``), ``max_prefix``
    None or an int >= 0 (a tile hint): both checked first."""
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=1, head_dim=16, rng=random.Random(0))
    with pytest.raises(ValueError, match=msg):
        paged_attention(torch.zeros(4, 4, 16), torch.zeros(8, 2, 16), torch.zeros(8, 2, 16),
                        sc.req_pool.req_to_token, torch.zeros(1, dtype=torch.int64),
                        torch.zeros(1, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
                        None, 4, 0.25, **kw)


@pytest.mark.parametrize("sm_scale", [0.0, -0.25, float("nan"), float("inf"), 1e-40, True, "0.25"])
def test_paged_attention_rejects_bad_sm_scale(sm_scale):
    """``sm_scale`` must be a finite float > 0: the kernels take a tile's row maximum before
    scaling it (a scale <= 0 would turn masked scores into +inf or NaN)."""
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=1, head_dim=16, rng=random.Random(0))
    with pytest.raises(ValueError, match="sm_scale must be a finite float > 0"):
        paged_attention(torch.zeros(4, 4, 16), torch.zeros(8, 2, 16), torch.zeros(8, 2, 16),
                        sc.req_pool.req_to_token, torch.zeros(1, dtype=torch.int64),
                        torch.zeros(1, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
                        None, 4, sm_scale)


def test_sm90_tree_verify_errors_and_eligibility():
    """``sm90=True`` where the Gluon tree-verify kernel cannot run is a ValueError naming why;
    the backend applies MHA's ``sm90`` to TARGET_VERIFY only."""
    from specattn.triton_kernels.attention_sm90 import sm90_tree_verify_supported
    rng = random.Random(0)
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=2, head_dim=64, rng=rng)
    be = TritonBackend(sc.req_pool, sc.kv_pool, kernel_config={"sm90": True})
    be.init_forward_metadata(sc.batch)
    q, k, v = random_qkv(sc)
    with pytest.raises(ValueError, match="sm90=True needs .*sm_90 GPU"):
        be.forward(q, k, v, sc.layer, sc.batch)
    dec = make_scenario(ForwardMode.DECODE, bs=2, head_dim=64, rng=rng)
    check(dec, kernel_config={"sm90": True})  # DECODE ignores MHA's sm90
    why = sm90_tree_verify_supported(torch.zeros(2, 4, 32), torch.zeros(8, 2, 32, dtype=torch.float16),
                                     torch.zeros(8, 2, 16), None)
    for need in ("sm_90", "TARGET_VERIFY", "bf16/fp16", "head_dim == v_head_dim"):
        assert need in why, (need, why)
    # an fp8 cache under bf16 queries: the ping-pong schedule takes it, the synchronous does not
    fp8 = torch.zeros(8, 2, 64, dtype=torch.float8_e4m3fn)
    tm = torch.zeros(1, 4, 1, dtype=torch.int32)
    q16 = torch.zeros(4, 4, 64, dtype=torch.bfloat16)
    why = sm90_tree_verify_supported(q16, fp8, fp8, tm)
    assert "bf16/fp16" not in why and "ping-pong" not in why, why
    why = sm90_tree_verify_supported(q16, fp8, fp8, tm, pingpong=False)
    assert "ping-pong schedule for an fp8 cache" in why, why
    why = sm90_tree_verify_supported(q16.float(), fp8, fp8, tm)
    assert "bf16/fp16 q" in why, why
    with pytest.raises(ValueError, match="sm90 must be a bool"):
        TritonBackend(sc.req_pool, sc.kv_pool, kernel_config={"sm90": "yes"})
    with pytest.raises(ValueError, match="pingpong must be a bool"):
        TritonBackend(sc.req_pool, sc.kv_pool, kernel_config={"pingpong": 1})
    # pingpong=True names the Gluon kernel: a ValueError where it cannot run, for TARGET_VERIFY
    be = TritonBackend(sc.req_pool, sc.kv_pool, kernel_config={"pingpong": True})
    be.init_forward_metadata(sc.batch)
    with pytest.raises(ValueError, match="pingpong=True needs the Gluon"):
        be.forward(q, k, v, sc.layer, sc.batch)
    check(dec, kernel_config={"pingpong": True})  # DECODE ignores MHA's pingpong
    check(sc, kernel_config={"pingpong": False})  # the synchronous schedule: nothing to refuse
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        TritonBackend(sc.req_pool, sc.kv_pool, kernel_config={"num_warps": 12})


def test_idle():
    sc = make_scenario(ForwardMode.IDLE)
    be = create_backend("triton", sc.req_pool, sc.kv_pool)
    be.init_forward_metadata(sc.batch)
    out = be.forward(torch.randn(0, sc.layer.num_heads, sc.layer.head_dim), None, None, sc.layer, sc.batch)
    assert out.shape == (0, sc.layer.num_heads, sc.layer.v_head_dim)


def test_supports_and_errors():
    """Every mode, eager and graph (EXTEND with a static token count), MHA and MLA."""
    for mode in ForwardMode:
        for graph in (False, True):
            for kind in AttentionKind:
                assert TritonBackend.supports(mode, graph=graph, kind=kind)
    sc = make_scenario(ForwardMode.EXTEND)
    be = TritonBackend(sc.req_pool, sc.kv_pool)
    be.init_cuda_graph_state(4, sc.batch.num_tokens - 1)  # one token short
    with pytest.raises(ValueError, match="exceeds"):
        be.init_forward_metadata_capture_cuda_graph(sc.batch)
    be = TritonBackend(sc.req_pool, sc.kv_pool)
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        be.init_forward_metadata_capture_cuda_graph(sc.batch)
    with pytest.raises(ValueError):
        TritonBackend(sc.req_pool, sc.kv_pool, num_kv_splits=0)
    with pytest.raises(ValueError, match="unknown"):
        TritonBackend(sc.req_pool, sc.kv_pool, kernel_config=dict(block_dv=64))


def test_eager_metadata_rejects_bad_batches():
    """Out-of-range request rows and malformed tree masks fail before any kernel runs."""
    import dataclasses
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=2, D=5)
    be = TritonBackend(sc.req_pool, sc.kv_pool)
    rows = sc.batch.req_pool_indices.clone()
    rows[1] = sc.req_pool.req_to_token.shape[0]
    with pytest.raises(ValueError, match="req_pool_indices"):
        be.init_forward_metadata(dataclasses.replace(sc.batch, req_pool_indices=rows))
    with pytest.raises(ValueError, match="req_pool_indices"):
        be.init_forward_metadata(dataclasses.replace(sc.batch, req_pool_indices=rows.fill_(-1)))
    with pytest.raises(ValueError, match="tree_mask"):
        be.init_forward_metadata(dataclasses.replace(sc.batch, tree_mask=sc.batch.tree_mask[:1]))
    with pytest.raises(ValueError, match="tree_mask"):
        be.init_forward_metadata(dataclasses.replace(sc.batch, tree_mask=None))
    be.init_forward_metadata(sc.batch)  # the unmodified batch still passes


def test_kernel_config_reaches_the_kernel(seed):
    """A forced MHA config (block_m 16, block_n 16, 2 warps, 1 stage) gives the same answer."""
    rng = random.Random(seed)
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=2, D=6, num_heads=4, num_kv_heads=2,
                       head_dim=32, max_prefix=40, rng=rng)
    from triton_cases import check as check_cfg
    check_cfg(sc, splits=2, kernel_config=dict(block_m=16, block_n=16, num_warps=2, num_stages=1))


def test_worked_example_metadata():
    """The TARGET_VERIFY example of the module docstrings."""
    pool = ReqToTokenPool(4, 16)
    pool.req_to_token[3, :11] = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23, 24, 25, 26])
    pool.req_to_token[0, :8] = torch.tensor([7, 8, 30, 31, 32, 33, 34, 35])
    b = ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, [3, 0], [8, 5], 3, [24, 25, 26, 33, 34, 35],
                           positions=[8, 9, 10, 5, 6, 6],
                           tree_mask=torch.tensor([[[1], [3], [7]], [[1], [3], [5]]], dtype=torch.int32))
    from specattn.backends.pools import MHATokenToKVPool
    be = TritonBackend(pool, MHATokenToKVPool(64, 1, torch.float32, 1, 16, 1))
    be.init_forward_metadata(b)
    md = be.forward_metadata
    assert md.qo_indptr.tolist() == [0, 3, 6] and md.prefix_lens.tolist() == [8, 5]
    assert md.req_pool_indices.tolist() == [3, 0] and md.max_q == 3
    assert md.tree_mask.flatten().tolist() == [1, 3, 7, 1, 3, 5]


def _graph_case(mode, page_size, device, use_graph, seed, dtype=torch.float32, group=2,
                head_dim=64, D=5, splits=None, max_prefix=20, padded_bs=4):
    """:func:`triton_cases.graph_case` for an MHA layer of 2 KV heads x ``group``."""
    from triton_cases import graph_case
    graph_case("mha", mode, page_size, device, use_graph, seed, dtype=dtype, num_heads=2 * group,
               num_kv_heads=2, head_dim=head_dim, D=D, splits=splits, max_prefix=max_prefix,
               padded_bs=padded_bs)


@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_builders_on_cpu(mode, page_size, seed):
    """Capture/replay metadata path (static buffers, padding) without a real graph."""
    _graph_case(mode, page_size, "cpu", False, seed, splits=random.Random(seed).choice([1, 2]))


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_graph_builders_on_cpu(page_size, seed):
    """EXTEND under the graph builders: static token count, padded requests with n = 0,
    max_q = min(T, req_to_token width)."""
    from triton_cases import graph_case
    graph_case("mha", ForwardMode.EXTEND, page_size, "cpu", False, seed, num_heads=4,
               num_kv_heads=2, head_dim=32, padded_bs=3, ext_max=6)


# ------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("ext_max", [7, 100])
def test_extend_cuda_graph_replay(page_size, dtype, ext_max, seed):
    """EXTEND captured in a real CUDA graph (static token count padded_bs * ext_max), replayed
    with fewer requests and tokens, outputs poisoned, under sync-debug 'error'."""
    from triton_cases import graph_case
    rng = random.Random(seed)
    group = rng.choice([1, 4, 8])
    graph_case("mha", ForwardMode.EXTEND, page_size, "cuda", True, seed, dtype=dtype,
               num_heads=2 * group, num_kv_heads=2, head_dim=rng.choice([64, 128]),
               max_prefix=rng.choice([20, 2000]), padded_bs=8, ext_max=ext_max)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_eager_on_gpu(mode, dtype, page_size, head_dim, seed):
    rng = random.Random(seed)
    for group in (1, rng.randint(2, 7), 8):
        hkv = rng.choice([1, 2, 4])
        sc = make_scenario(mode, bs=rng.randint(1, 6), page_size=page_size, device="cuda", dtype=dtype,
                           num_kv_heads=hkv, num_heads=hkv * group, head_dim=head_dim,
                           max_prefix=rng.choice([30, 700]), D=rng.choice([1, 7, 33, 64]), rng=rng)
        check(sc, splits=rng.choice([None, 1, 4]))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                                  ForwardMode.EXTEND], ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 64])
def test_long_prefix_on_gpu(mode, page_size, seed):
    """Prefixes up to 32k, GQA group 4, bf16, auto split-KV."""
    rng = random.Random(seed)
    P = [32768, rng.randint(1, 9000)]
    sc = make_scenario(mode, bs=2, page_size=page_size, device="cuda", dtype=torch.bfloat16,
                       num_kv_heads=2, num_heads=8, head_dim=128, max_prefix=32768, prefix_lens=P,
                       extend_lens=[64, 200], D=64, num_layers=1, rng=rng)
    check(sc)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("splits", [None, 1])
def test_cuda_graph_replay(mode, page_size, dtype, splits, seed):
    rng = random.Random(seed)
    _graph_case(mode, page_size, "cuda", True, seed, dtype=dtype, group=rng.choice([1, 4, 8]),
                head_dim=rng.choice([64, 128]), D=rng.choice([5, 33, 64]), splits=splits,
                max_prefix=rng.choice([20, 2000]), padded_bs=8)


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon tree-verify kernel needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_n", [64, 128, None])
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "sync"])
def test_sm90_tree_verify_matches_reference(dtype, page_size, head_dim, block_n, pingpong, seed):
    """The Gluon tree-verify kernel (``sm90=True``), both schedules, against the reference:
    GQA groups 1..8, random trees of 1..64 tokens (mask words crossing 32; at most 64 rows,
    leaving warpgroup 1 of the ping-pong kernel no row), prefixes 0, at and around tile
    boundaries and long, split and not; at pages 16 and 64 the ping-pong kernel's whole
    64-key tiles at a page boundary come by TMA (the backend passes the pool's page size)."""
    rng = random.Random(seed)
    for group in (1, rng.randint(2, 7), 8):
        hkv = rng.choice([1, 2, 8])
        bs = rng.randint(1, 5)
        bn = block_n or 128
        P = [rng.choice([0, 1, bn - 1, bn, bn + 1, rng.randint(2, 5000)])
             for _ in range(bs)]
        sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=bs, page_size=page_size, device="cuda",
                           dtype=dtype, num_kv_heads=hkv, num_heads=hkv * group, head_dim=head_dim,
                           max_prefix=5000, prefix_lens=P, D=rng.choice([1, 7, 33, 64]),
                           num_layers=1, rng=rng)
        check(sc, splits=rng.choice([None, 1, 3]),
              kernel_config={"sm90": True, "block_n": block_n, "pingpong": pingpong})


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon tree-verify kernel needs an sm_90 GPU")
def test_sm90_tree_verify_poison_and_agrees_with_triton(seed):
    """NaN in every cache row no request uses never reaches the output, rows of other
    requests are untouched (poisoned ``out`` outside them stays NaN), and the Gluon kernel
    agrees with the Triton kernel, split and not."""
    gen = torch.Generator().manual_seed(seed)
    Hkv, G, Dh, D, bs = 2, 4, 128, 64, 3
    P = torch.tensor([0, 129, 1000], dtype=torch.int32)
    width = 1100
    rtt = torch.randperm(bs * width * 2, generator=gen)[:bs * width].view(bs, width).int().cuda()
    kc = torch.full((bs * width * 2, Hkv, Dh), float("nan"), dtype=torch.bfloat16, device="cuda")
    vc = kc.clone()
    for b in range(bs):
        used = rtt[b, :P[b] + D].long()
        kc[used] = torch.randn(used.numel(), Hkv, Dh, generator=gen).to(kc)
        vc[used] = torch.randn(used.numel(), Hkv, Dh, generator=gen).to(kc)
    parents = torch.tensor([-1] + [random.Random(seed + i).randrange(i) for i in range(1, D)])
    dense = torch.zeros(D, D, dtype=torch.bool)
    for i in range(D):
        a = i
        while a >= 0:
            dense[i, a] = True
            a = int(parents[a])
    tree = pack_tree_mask(dense[None].expand(bs, D, D).contiguous()).cuda()
    q = torch.randn(bs * D, Hkv * G, Dh, generator=gen).to(kc)
    qo = torch.arange(0, bs * D + 1, D, dtype=torch.int32).cuda()
    args = (q, kc, vc, rtt, torch.arange(bs).cuda(), P.cuda(), qo, tree, D, 0.09)
    for splits, bn, pp in ((1, 128, False), (4, None, False), (1, 64, False), (1, None, True),
                           (4, None, True), (1, 128, True), (9, None, True)):
        a = paged_attention(*args, num_splits=splits, sm90=False)
        out = torch.full((bs * D + 5, Hkv * G, Dh), float("nan"), dtype=q.dtype, device="cuda")
        b = paged_attention(*args, num_splits=splits, sm90=True, block_n=bn, pingpong=pp,
                            out=out[:bs * D])
        assert torch.isfinite(b).all() and rel_err(a.float(), b.float()) < 1e-2, (splits, bn, pp)
        assert torch.isnan(out[bs * D:]).all()
    # the default (sm90=None) takes the Gluon kernel here (64 tokens x G 4 = 256 rows)
    assert torch.equal(paged_attention(*args, num_splits=1), paged_attention(*args, num_splits=1, sm90=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon tree-verify kernel needs an sm_90 GPU")
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "sync"])
def test_sm90_tree_verify_graph_replay(page_size, pingpong, seed):
    """Captured at a padded bs, replayed with a smaller one (padded requests: no tokens)."""
    from triton_cases import graph_case
    graph_case("mha", ForwardMode.TARGET_VERIFY, page_size, "cuda", True, seed,
               dtype=torch.bfloat16, num_heads=32, num_kv_heads=8, head_dim=128, D=64,
               max_prefix=2000, padded_bs=8, kernel_config={"sm90": True, "pingpong": pingpong})


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon tree-verify kernel needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page", [16, 32, 64])
def test_sm90_tree_verify_tma_pages(head_dim, page, seed, monkeypatch):
    """Pages of ``page`` slots in random order, ``page_size=page``: whole 64-key tiles at a
    page boundary by TMA, one box per page run (prefix tiles, all-draft tiles at ``P % 64 ==
    0``, a last split starting at ``P = 80``), partial tiles and the tiles of a last split
    starting off a page boundary by ``cp.async``.  Every slot no request uses is NaN (the
    tails of last pages too) and stays out of the output; the output equals the
    ``cp.async``-only run (``page_size=1``, in the TMA kernel's tile order:
    ``masked_first=True``) bit for bit and the Triton kernel's within bf16; and the promise
    is used: unchecked (``check_bounds=False``), a row that breaks the page layout gives
    another output; checked, it is refused."""
    import specattn.triton_kernels.attention as attention_mod
    monkeypatch.setattr(attention_mod, "sm90_tree_verify",
                        functools.partial(attention_mod.sm90_tree_verify, masked_first=True))
    gen = torch.Generator().manual_seed(seed)
    Hkv, G, D = 2, 4, 64
    P = torch.tensor([0, 64, 80, 128, 129, 1000, 4096, 5000], dtype=torch.int32)
    bs, per_req = len(P), -(-(int(P.max()) + D) // page)
    pages = torch.randperm(bs * per_req + 3, generator=gen)[:bs * per_req].view(bs, per_req)
    pos = torch.arange(per_req * page)
    rtt = (pages[:, pos // page] * page + pos % page).int().cuda()
    kc = torch.full(((bs * per_req + 3) * page, Hkv, head_dim), float("nan"), dtype=torch.bfloat16,
                    device="cuda")
    vc = kc.clone()
    for b in range(bs):
        used = rtt[b, :P[b] + D].long()
        kc[used] = torch.randn(used.numel(), Hkv, head_dim, generator=gen).to(kc)
        vc[used] = torch.randn(used.numel(), Hkv, head_dim, generator=gen).to(kc)
    dense = torch.tril(torch.rand(bs, D, D, generator=gen) < 0.3) | torch.eye(D, dtype=torch.bool)
    tree = pack_tree_mask(dense).cuda()
    q = torch.randn(bs * D, Hkv * G, head_dim, generator=gen).to(kc)
    qo = torch.arange(0, bs * D + 1, D, dtype=torch.int32).cuda()
    args = (q, kc, vc, rtt, torch.arange(bs).cuda(), P.cuda(), qo, tree, D, 0.09)
    for splits in (1, 3, 9):
        ref = paged_attention(*args, num_splits=splits, sm90=False)
        cp = paged_attention(*args, num_splits=splits, sm90=True, pingpong=True)
        out = torch.full((bs * D + 5, Hkv * G, head_dim), float("nan"), dtype=q.dtype, device="cuda")
        tma = paged_attention(*args, num_splits=splits, sm90=True, pingpong=True, page_size=page,
                              out=out[:bs * D])
        assert torch.isfinite(tma).all() and torch.equal(tma, cp), splits
        assert rel_err(ref.float(), tma.float()) < 1e-2, splits
        assert torch.isnan(out[bs * D:]).all()
    # key 3 pointed at key 70's slot inside a whole prefix tile: the gather reads the new
    # slot, the TMA copy reads the page's (consecutive) slots as promised
    broken = rtt.clone()
    broken[6, 3] = broken[6, 70]
    args_b = (q, kc, vc, broken) + args[4:]
    gathered = paged_attention(*args_b, num_splits=1, sm90=True, pingpong=True)
    assert not torch.equal(gathered, paged_attention(*args_b, num_splits=1, sm90=True, pingpong=True,
                                                      page_size=page, check_bounds=False))
    with pytest.raises(ValueError, match="paged layout"):  # checked, the broken promise is refused
        paged_attention(*args_b, num_splits=1, sm90=True, pingpong=True, page_size=page)


# ------------------------------------------------------------------------- end to end
def _random_model(tmp_path, seed, layers):
    from specattn.spec_runtime.loader import LlamaConfig, load_hf_dir, write_random_hf_dir
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=True, eos_token_ids=[])
    return load_hf_dir(write_random_hf_dir(tmp_path, cfg, seed=seed))


def _engine_tokens(cfg, w, prompts, new, backend, spec=None, **kw):
    from specattn.spec_runtime.engine import Engine, SpecConfig
    from specattn.spec_runtime.sampling import SamplingParams
    eng = Engine(cfg, dict(w), spec=spec or SpecConfig("none"), backend=backend, max_context=128,
                 max_batch=len(prompts), **kw)
    return eng.generate(prompts, SamplingParams(max_new_tokens=new)).tokens


@pytest.mark.slow
def test_engine_eagle_tree_lossless_with_triton(tmp_path, seed):
    """Greedy EAGLE tree decoding through the Triton backend equals target-only greedy
    through the reference backend (random 2-layer model, CPU eager)."""
    from specattn.spec_runtime.engine import SpecConfig
    cfg, w = _random_model(tmp_path, seed % 1000, 2)
    rng = random.Random(seed)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    want = _engine_tokens(cfg, w, prompts, 10, "torch_reference")
    assert _engine_tokens(cfg, w, prompts, 10, "triton", SpecConfig("eagle", 3, 3, 8, 1)) == want


@pytest.mark.gpu
def test_engine_cuda_graphs_lossless_with_triton(tmp_path, seed):
    """CUDA graphs on (DECODE, TARGET_VERIFY, DRAFT_EXTEND_V2 captured with the Triton
    backend): target-only and EAGLE chain/tree equal the reference backend's eager greedy."""
    from specattn.spec_runtime.engine import SpecConfig
    cfg, w = _random_model(tmp_path, seed % 1000, 4)
    rng = random.Random(seed)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 12))] for _ in range(5)]
    want = _engine_tokens(cfg, w, prompts, 24, "torch_reference", device="cuda")
    for spec in (None, SpecConfig("eagle", 1, 3, 4, 2), SpecConfig("eagle", 3, 3, 8, 3)):
        got = _engine_tokens(cfg, w, prompts, 24, "triton", spec, device="cuda", cuda_graph=True)
        assert got == want, f"seed={seed} {spec}"


def test_graph_prefix_bound_reaches_the_split_rule(seed):
    """``graph_prefix_bound`` set around a capture becomes the graph metadata's ``max_prefix``
    (None when unset), and ``split_keys_mha`` asks longer splits of fuller batches: 32 keys up
    to a bs-1 16-token verify's 144 query rows in flight, proportionally more above."""
    from specattn.backends.triton_backend import MIN_SPLIT_KEYS_MHA, SPLIT_WORK_UNIT, split_keys_mha
    sc = make_scenario(ForwardMode.DECODE, bs=2, device="cpu", rng=random.Random(seed), max_prefix=20)
    be = TritonBackend(sc.req_pool, sc.kv_pool)
    be.init_cuda_graph_state(2, 2)
    be.init_forward_metadata_capture_cuda_graph(sc.batch)
    assert be.forward_metadata.max_prefix is None
    be.graph_prefix_bound = 256
    be.init_forward_metadata_replay_cuda_graph(sc.batch)
    assert be.forward_metadata.max_prefix == 256
    assert split_keys_mha(3, 48, 64) == MIN_SPLIT_KEYS_MHA                   # bs-1 16-token verify, 3 KV heads
    assert split_keys_mha(3, 3, 16) == MIN_SPLIT_KEYS_MHA                    # bs-1 decode (rows padded to 16)
    assert split_keys_mha(48, 48, 64) == MIN_SPLIT_KEYS_MHA * (48 * 48 // SPLIT_WORK_UNIT)   # bs 16 verify
    assert split_keys_mha(192, 3, 16) > split_keys_mha(48, 3, 16) > split_keys_mha(12, 3, 16)


def _rule_samples(min_programs, max_programs, min_sms, head_dims, n=2000):
    """``n`` random inputs of a split rule, each as ``(seed, programs, num_sms, max_prefix,
    head_dim, hbm_bytes_per_s)`` (the seed, fresh per call, names the failing draw)."""
    rng = random.Random(seed_value := torch.randint(0, 2**31, ()).item())
    for _ in range(n):
        yield (seed_value, rng.randint(min_programs, max_programs), rng.randint(min_sms, 200),
               rng.randint(0, 200000), rng.choice(head_dims), rng.uniform(0, 8e12))


def _split_plan(*, mode, dtype, q_dtype, bs, bandwidth, max_prefix=8191, head_dim=128, **kw):
    """The Triton backend's (split count, kernel config) for a CPU batch of ``bs`` requests of
    32 / 8 heads of ``head_dim`` as if on a 132-SM GPU of ``bandwidth`` bytes/s with a host
    prefix bound ``max_prefix`` (the split rules' tests)."""
    sc = make_scenario(mode, bs=bs, device="cpu", dtype=dtype, max_prefix=20, D=2, num_heads=32,
                       num_kv_heads=8, head_dim=head_dim)
    be = TritonBackend(sc.req_pool, sc.kv_pool, **kw)
    be.init_forward_metadata(sc.batch)
    be._num_sms, be._hbm_bytes_per_s = 132, bandwidth
    be.forward_metadata.max_prefix = max_prefix
    return be._num_splits(be.forward_metadata, sc.layer, q_dtype)


def test_fp8_narrow_decode_rule():
    """fp8-cache MHA decode switches to 2-warp programs (``FP8_NARROW_CONFIG``) split to about
    four programs per SM only where each still reads ``FP8_NARROW_KEYS`` keys, for heads of
    64, or of 128 on a GPU with ``FP8_NARROW_SM_BANDWIDTH`` per SM: the sweeps' winners (132
    SMs; an H200: bs 32 / 128 / 64 / 16 of 8 KV heads of 128 over 8,192 / 8,192 / 4,096 /
    16,384 keys; an H100 too at 3 KV heads of 64) and not their losers (bs 1 / 8 x 8,192, bs
    32 x 1,024; heads of 128 on an H100).  The backend takes it for decode-sized rows over an
    fp8 cache with 16-bit queries and no kernel config of its own (decode, or a verify of at
    most 16 query rows per KV head), and nowhere else."""
    from specattn.backends.triton_backend import (FP8_NARROW_CONFIG, FP8_NARROW_KEYS, FP8_NARROW_SM_BANDWIDTH,
                                                  MAX_KV_SPLITS, fp8_narrow_splits, hbm_bytes_per_s)
    h100, h200 = (hbm_bytes_per_s(SimpleNamespace(memory_clock_rate=c, memory_bus_width=w))
                  for c, w in ((2619000, 5120), (3201000, 6016)))
    assert abs(h100 - 3.352e12) < 1e9 and abs(h200 - 4.814e12) < 1e9
    assert hbm_bytes_per_s(None) == hbm_bytes_per_s(SimpleNamespace(multi_processor_count=132)) == 0.0
    points = ((256, 8191), (1024, 8191), (512, 4095), (128, 16383))
    assert [fp8_narrow_splits(p, 132, P, 128, h200) for p, P in points] == [2, 1, 1, 4]
    assert [fp8_narrow_splits(p, 132, P, 128, h100) for p, P in points] == [0, 0, 0, 0]
    assert fp8_narrow_splits(192, 132, 8191, 64, h100) == fp8_narrow_splits(192, 132, 8191, 64, h200) == 2
    assert [fp8_narrow_splits(p, 132, P, 128, h200) for p, P in ((8, 8191), (64, 8191), (256, 1023), (0, 8191),
                                                                (8, 0))] == [0, 0, 0, 0, 0]
    assert fp8_narrow_splits(256, 0, 8191, 128, h200) == fp8_narrow_splits(256, 132, 8191, 256, h200) == 0
    for seed_value, programs, sms, P, hd, bw in _rule_samples(1, 5000, 1, (32, 64, 128, 256)):
        s = fp8_narrow_splits(programs, sms, P, hd, bw)
        assert s == 0 or (1 <= s <= MAX_KV_SPLITS and P // s >= FP8_NARROW_KEYS and hd <= 128
                          and (hd <= 64 or bw >= FP8_NARROW_SM_BANDWIDTH * sms)), (seed_value, programs, sms, P, hd, bw, s)

    def plan(dtype, q_dtype, max_prefix, mode=ForwardMode.DECODE, D=5, bandwidth=h200, **kw):
        sc = make_scenario(mode, bs=2, device="cpu", dtype=dtype, max_prefix=20, D=D)
        be = TritonBackend(sc.req_pool, sc.kv_pool, **kw)
        assert be._hbm_bytes_per_s == 0.0          # a CPU pool
        be.init_forward_metadata(sc.batch)
        be._num_sms, be._hbm_bytes_per_s = 132, bandwidth
        be.forward_metadata.max_prefix = max_prefix
        return be._num_splits(be.forward_metadata, sc.layer, q_dtype)

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    # 2 requests x 2 KV heads of 16 = 4 programs: 16 splits, each over >= 2,048 keys from 32,768 on
    assert plan(fp8, bf16, 40000) == (16, FP8_NARROW_CONFIG)
    assert plan(fp8, torch.float16, 40000, bandwidth=h100) == (16, FP8_NARROW_CONFIG)
    # a verify of 5 tokens x 2 queries per KV head (10 rows, one 16-row tile) is decode-sized
    assert plan(fp8, bf16, 40000, ForwardMode.TARGET_VERIFY) == (16, FP8_NARROW_CONFIG)
    for args, kw in (((fp8, bf16, 8191), {}), ((bf16, bf16, 40000), {}), ((fp8, torch.float32, 40000), {}),
                     ((fp8, bf16, 40000), {"kernel_config": {"num_warps": 4}}),
                     ((fp8, bf16, 40000, ForwardMode.TARGET_VERIFY, 9), {})):     # 18 rows
        splits, config = plan(*args, **kw)
        assert config is not FP8_NARROW_CONFIG and config.get("num_warps") != 2, (args, kw)
        assert 1 <= splits <= MAX_KV_SPLITS


def test_wide_decode_split_rule():
    """An MHA DECODE that 16 splits leave under two programs per SM splits wider, into
    ``WIDE_SPLIT_CONFIG`` programs about three per SM (at most ``MAX_WIDE_SPLITS``), where the
    sweep measured it: heads of 128, 2,048+ keys, an H200's bandwidth per SM (bs 1 of 8 KV
    heads: 48 splits).  Not at bs 2 (16 programs), short prefixes, heads of 64, on an H100, in
    other modes, nor under a kernel config of the backend's own; over an fp8 cache the narrow
    programs keep precedence where they apply."""
    from specattn.backends.triton_backend import (FP8_NARROW_CONFIG, FP8_NARROW_SM_BANDWIDTH, MAX_KV_SPLITS,
                                                  MAX_WIDE_SPLITS, WIDE_SPLIT_CONFIG, WIDE_SPLIT_KEYS,
                                                  hbm_bytes_per_s, wide_decode_splits)
    h100, h200 = (hbm_bytes_per_s(SimpleNamespace(memory_clock_rate=c, memory_bus_width=w))
                  for c, w in ((2619000, 5120), (3201000, 6016)))
    assert [wide_decode_splits(8, 132, P, 128, h200) for P in (2047, 2048, 4095, 8191, 100000)] == [0, 48, 48, 48, 48]
    assert [wide_decode_splits(p, 132, 8191, 128, h200) for p in (1, 4, 12, 15, 16, 32, 0)] == [48, 48, 33, 26, 0, 0, 0]
    assert wide_decode_splits(8, 132, 8191, 128, h100) == wide_decode_splits(8, 132, 8191, 64, h200) == 0
    assert wide_decode_splits(8, 0, 8191, 128, h200) == wide_decode_splits(8, 132, 8191, 256, h200) == 0
    for seed_value, programs, sms, P, hd, bw in _rule_samples(0, 400, 0, (64, 128, 256)):
        s = wide_decode_splits(programs, sms, P, hd, bw)
        assert s == 0 or (MAX_KV_SPLITS < s <= MAX_WIDE_SPLITS and P >= WIDE_SPLIT_KEYS and hd == 128
                          and bw >= FP8_NARROW_SM_BANDWIDTH * sms and programs * MAX_KV_SPLITS < 2 * sms
                          and programs * s <= 3 * sms), (seed_value, programs, sms, P, hd, bw, s)

    plan = functools.partial(_split_plan, mode=ForwardMode.DECODE, dtype=torch.float32, q_dtype=torch.float32, bs=1,
                             bandwidth=h200)

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    assert plan() == (48, WIDE_SPLIT_CONFIG)                          # bs 1 x 8 KV heads of 128
    assert plan(dtype=fp8, q_dtype=bf16) == (48, WIDE_SPLIT_CONFIG)   # narrow: 16 splits of 512 keys, too short
    assert plan(dtype=fp8, q_dtype=bf16, max_prefix=40000) == (16, FP8_NARROW_CONFIG)
    for kw in (dict(bs=2), dict(max_prefix=2047), dict(bandwidth=h100), dict(head_dim=64),
               dict(mode=ForwardMode.TARGET_VERIFY), dict(kernel_config={"num_warps": 4})):
        splits, config = plan(**kw)
        assert config is not WIDE_SPLIT_CONFIG and 1 <= splits <= MAX_KV_SPLITS, kw


def test_fp8_single_warp_decode_rule():
    """fp8-cache MHA DECODE on an H200-class GPU runs 1-warp programs
    (``FP8_SINGLE_WARP_CONFIG``) split to the count nearest eight programs per SM, where the
    sweep measured them winning (132 SMs, 8 KV heads of 128: bs 8 / 16 / 32 / 64 / 128 over
    8,192 / 16,384 / 8,192 / 2,048-8,192 / 8,192 keys; 3 or 8 KV heads of 64) and not where
    it did not run them: a bs-1 / bs-4 decode (too few programs even in 16 splits), fewer than
    512 keys a program, an H100, heads over 128, a bf16 cache, a verify, or under a kernel
    config of the backend's own.  Elsewhere the narrow and wide rules stay as before."""
    from specattn.backends.triton_backend import (FP8_NARROW_CONFIG, FP8_NARROW_SM_BANDWIDTH, FP8_SINGLE_WARP_CONFIG,
                                                  FP8_SINGLE_WARP_KEYS, FP8_SINGLE_WARP_MIN_WAVES, MAX_KV_SPLITS,
                                                  WIDE_SPLIT_CONFIG, fp8_single_warp_splits, hbm_bytes_per_s)
    h100, h200 = (hbm_bytes_per_s(SimpleNamespace(memory_clock_rate=c, memory_bus_width=w))
                  for c, w in ((2619000, 5120), (3201000, 6016)))
    # (programs, keys) of the sweep's points -> the split counts it ran
    points = ((256, 8191), (1024, 8191), (512, 4095), (128, 16383), (64, 8191), (512, 2047), (192, 8191), (256, 4095))
    assert [fp8_single_warp_splits(p, 132, P, 128, h200) for p, P in points] == [4, 1, 2, 8, 16, 2, 6, 4]
    assert [fp8_single_warp_splits(p, 132, P, 64, h200) for p, P in points[-2:]] == [6, 4]
    assert [fp8_single_warp_splits(p, 132, P, 128, h100) for p, P in points] == [0] * len(points)
    assert [fp8_single_warp_splits(p, 132, P, 128, h200) for p, P in ((8, 8191), (32, 8191), (49, 100000), (256, 1023),
                                                                      (1024, 511), (0, 8191), (64, 0))] == [0] * 7
    assert fp8_single_warp_splits(50, 132, 8191, 128, h200) == 16          # 800 programs >= 6 per SM
    assert fp8_single_warp_splits(256, 0, 8191, 128, h200) == fp8_single_warp_splits(256, 132, 8191, 256, h200) == 0
    for seed_value, programs, sms, P, hd, bw in _rule_samples(0, 5000, 0, (32, 64, 128, 256)):
        s = fp8_single_warp_splits(programs, sms, P, hd, bw)
        assert s == 0 or (1 <= s <= MAX_KV_SPLITS and -(-P // s) >= FP8_SINGLE_WARP_KEYS and hd <= 128
                          and bw >= FP8_NARROW_SM_BANDWIDTH * sms
                          and programs * MAX_KV_SPLITS >= FP8_SINGLE_WARP_MIN_WAVES * sms
                          and (s == MAX_KV_SPLITS or programs * s - 8 * sms >= -programs / 2)   # nearest,
                          and (s == 1 or programs * s - 8 * sms <= programs / 2)                # clamped
                          ), (seed_value, programs, sms, P, hd, bw, s)

    plan = functools.partial(_split_plan, mode=ForwardMode.DECODE, dtype=torch.float8_e4m3fn, q_dtype=torch.bfloat16,
                             bs=8, bandwidth=h200)

    assert plan() == (16, FP8_SINGLE_WARP_CONFIG)                      # bs 8 x 8 KV heads: 64 programs
    assert plan(bs=32) == (4, FP8_SINGLE_WARP_CONFIG) and plan(head_dim=64, bs=32) == (4, FP8_SINGLE_WARP_CONFIG)
    assert plan(q_dtype=torch.float16, bs=16, max_prefix=16383) == (8, FP8_SINGLE_WARP_CONFIG)
    assert plan(bs=1) == (48, WIDE_SPLIT_CONFIG)                       # too few programs: the wide splits stay
    assert plan(bs=4, max_prefix=40000) == (16, FP8_NARROW_CONFIG)     # ... and the narrow ones
    assert plan(bandwidth=h100, bs=32, head_dim=64) == (2, FP8_NARROW_CONFIG)      # H100: the narrow ones
    for kw in (dict(max_prefix=8191, bandwidth=h100), dict(max_prefix=16 * 511 - 1),
               dict(dtype=torch.bfloat16, q_dtype=torch.bfloat16),
               dict(q_dtype=torch.float32), dict(mode=ForwardMode.TARGET_VERIFY), dict(kernel_config={"num_warps": 4})):
        splits, config = plan(**kw)
        assert config is not FP8_SINGLE_WARP_CONFIG and config.get("num_warps") != 1 and 1 <= splits, kw


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_single_warp_config_matches_reference(device, seed):
    """The 1-warp fp8 decode programs (``FP8_SINGLE_WARP_CONFIG``) against the reference:
    heads of 128 and 64, pages of 1 and 16, 1 to 16 splits, prefixes across 32-key tile edges
    (on the CPU short ones over a float32 cache; on a GPU fp8 and bf16 caches over thousands
    of keys with bf16 queries)."""
    from specattn.backends.triton_backend import FP8_SINGLE_WARP_CONFIG, MAX_KV_SPLITS
    from triton_cases import check as check_cfg
    rng = random.Random(seed)
    dtypes = [torch.float32] if device == "cpu" else [torch.float8_e4m3fn, torch.bfloat16]
    for dtype in dtypes:
        for page_size, head_dim in ((1, 128), (16, 64), (16, 128)):
            hkv = rng.choice([1, 2]) if device == "cpu" else rng.choice([3, 8])
            sc = make_scenario(ForwardMode.DECODE, bs=rng.randint(1, 3), page_size=page_size, device=device,
                               dtype=dtype, num_kv_heads=hkv, num_heads=rng.choice([1, 3, 4]) * hkv, head_dim=head_dim,
                               max_prefix=rng.choice([40, 97]) if device == "cpu" else rng.choice([1500, 4100]),
                               rng=rng)
            check_cfg(sc, splits=rng.choice([1, 3, MAX_KV_SPLITS]), kernel_config=dict(FP8_SINGLE_WARP_CONFIG))


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_single_warp_config_graph_replay(page_size, seed):
    """CUDA-graph capture and replay of an fp8 DECODE in the 1-warp programs
    (``FP8_SINGLE_WARP_CONFIG``) at the split counts the rule picks (1 to 16), over thousands
    of keys, bs 1..8 live in a bs-8 graph, against the reference (output poisoned first)."""
    from specattn.backends.triton_backend import FP8_SINGLE_WARP_CONFIG
    from triton_cases import graph_case
    rng = random.Random(seed)
    graph_case("mha", ForwardMode.DECODE, page_size, "cuda", True, seed, dtype=torch.float8_e4m3fn,
               num_heads=rng.choice([8, 32]), num_kv_heads=8, head_dim=rng.choice([64, 128]),
               splits=rng.choice([1, 2, 4, 16]), max_prefix=rng.choice([1100, 4100]), padded_bs=8,
               kernel_config=dict(FP8_SINGLE_WARP_CONFIG), kv_scales=(rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_wide_split_config_matches_reference(device, seed):
    """The programs of wide DECODE splits (``WIDE_SPLIT_CONFIG``) in up to ``MAX_WIDE_SPLITS``
    splits against the reference: heads of 128, GQA 4, pages of 1 and 16, prefixes across
    64-key tile edges (on the CPU short ones, so that most splits hold no key and exit at
    once); on a GPU bf16 and fp8 caches over thousands of keys."""
    from specattn.backends.triton_backend import MAX_WIDE_SPLITS, WIDE_SPLIT_CONFIG
    from triton_cases import check as check_cfg
    rng = random.Random(seed)
    dtypes = [torch.float32] if device == "cpu" else [torch.bfloat16, torch.float8_e4m3fn]
    for dtype in dtypes:
        for page_size in (1, 16):
            hkv = rng.choice([1, 2]) if device == "cpu" else rng.choice([2, 8])
            sc = make_scenario(ForwardMode.DECODE, bs=rng.randint(1, 2), page_size=page_size, device=device,
                               dtype=dtype, num_kv_heads=hkv, num_heads=4 * hkv, head_dim=128,
                               max_prefix=rng.choice([70, 130]) if device == "cpu" else rng.choice([2100, 5000]),
                               rng=rng)
            check_cfg(sc, splits=rng.choice([33, MAX_WIDE_SPLITS]), kernel_config=dict(WIDE_SPLIT_CONFIG))


def test_mla_splits_are_whole_tiles_and_never_empty():
    """The MLA split count: the occupancy limit, two 64-key tiles a split at least, and as
    even as whole tiles allow, so that no split of the kernels' ``cdiv(cdiv(P, S), 64) * 64``
    chunks is empty (7 splits over 1,023 keys would leave one without a prefix key; the sweep's best counts
    at bs 1 / 16 are 8 and 32 / 8)."""
    from specattn.backends.triton_backend import mla_splits
    assert mla_splits(32, 1023) == 8 and mla_splits(32, 4095) == 32 and mla_splits(32, 8191) == 32
    assert mla_splits(8, 1023) == 8 and mla_splits(8, 4095) == 8 and mla_splits(1, 8191) == 1
    assert mla_splits(32, 100) == 1 and mla_splits(32, 1) == 1 and mla_splits(0, 500) == 1
    rng = random.Random(0)
    for _ in range(2000):
        limit, P = rng.randint(1, 40), rng.randint(1, 20000)
        S = mla_splits(limit, P)
        c = -(-(-(-P // S)) // 64) * 64
        assert 1 <= S <= limit and (S == 1 or P // S >= 64), (limit, P, S)
        assert (S - 1) * c < P, (limit, P, S)          # the last split holds keys too


def test_in_capture_metadata_reads_the_batch_in_place(seed):
    """Inside a whole-round capture the graph metadata takes the batch's own prefix lengths
    (int32), rows (int64) and tree mask where their layout fits, with no copies, and attends
    exactly as the copying builder; a batch tensor of another dtype is copied instead."""
    import dataclasses
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        sc = make_scenario(mode, bs=3, device="cpu", rng=random.Random(seed), max_prefix=20, D=4)
        be = TritonBackend(sc.req_pool, sc.kv_pool)
        be.init_cuda_graph_state(3, sc.batch.num_tokens)
        q, k, v = random_qkv(sc)
        be.init_forward_metadata_capture_cuda_graph(sc.batch)
        want = be.forward(q, k, v, sc.layer, sc.batch)
        batch = dataclasses.replace(sc.batch, prefix_lens=sc.batch.prefix_lens.to(torch.int32).clone(),
                                    req_pool_indices=sc.batch.req_pool_indices.long().clone())
        be.init_forward_metadata_in_capture(batch)
        md = be.forward_metadata
        assert md.prefix_lens is batch.prefix_lens and md.req_pool_indices is batch.req_pool_indices
        assert md.tree_mask is batch.tree_mask      # (None for DECODE)
        assert torch.equal(be.forward(q, k, v, sc.layer, batch), want)
        copied = dataclasses.replace(batch, prefix_lens=batch.prefix_lens.long())
        be.init_forward_metadata_in_capture(copied)
        assert be.forward_metadata.prefix_lens is not copied.prefix_lens
        assert torch.equal(be.forward_metadata.prefix_lens, batch.prefix_lens)
        assert torch.equal(be.forward(q, k, v, sc.layer, copied), want)
