"""TritonBackend with absorbed MLA (``triton_kernels/attention_mla.py``) against
TorchReferenceBackend, every mode, eager and the graph builders, plus the kernel config.

On a CPU-only machine the kernel runs in Triton's interpreter: small latents
(``kv_lora_rank = 32``, ``qk_rope_head_dim = 16``), 2-8 heads, float32 (tolerance 1e-5
relative), split and unsplit, both ``block_dv`` choices, page sizes 1 and 16, trees crossing a
32-bit mask word.  GPU-marked tests: ``kv_lora_rank = 512 + 64``, 16 and 128 heads,
bf16/fp16/fp32, page sizes 1/16/64, prefixes up to 8k, random trees up to 64 draft tokens, real
CUDA graphs (capture at a padded bs, replay with a smaller one, outputs poisoned), EXTEND in
graphs, and a smoke run of the sweepable kernel configs; on sm_90 the Gluon kernels at 1, 16,
24, 48, 64, 96 and 128 heads (a tile of one token's heads, or of several tokens' rows)."""
import os

import torch

if not torch.cuda.is_available():  # before triton / the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from scenarios import make_scenario, naive_attention, random_qkv  # noqa: E402
from specattn.backends import (AttentionKind, ForwardBatch, ForwardMode,  # noqa: E402
                               MLATokenToKVPool, ReqToTokenPool, create_backend, pack_tree_mask)
from specattn.backends.triton_backend import TritonBackend  # noqa: E402
from specattn.triton_kernels.attention_mla import mla_paged_attention  # noqa: E402
from triton_cases import check, graph_case, rel_err, run_both  # noqa: E402

MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]
GRAPH_MODES = MODES  # EXTEND too (static token count)


def mla_scenario(mode, rng, *, bs, num_heads=4, page_size=1, max_prefix=40, D=5, **kw):
    return make_scenario(mode, kind="mla", bs=bs, num_heads=num_heads, page_size=page_size,
                         max_prefix=max_prefix, D=D, rng=rng, **kw)


# ------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bs", [1, 3])
def test_mla_eager_matches_reference(mode, page_size, bs, seed):
    """Every mode, split or not, full or half value width per program, block_n 16 or 32 (with
    page 16 and block_n 16 the prefix tiles take the one-slot-per-page path)."""
    rng = random.Random(seed)
    sc = mla_scenario(mode, rng, bs=bs, page_size=page_size, num_heads=rng.choice([2, 4, 8]),
                      max_prefix=rng.choice([5, 40]), D=rng.choice([1, 4, 7]))
    check(sc, splits=rng.choice([1, 3]), kernel_config={"block_dv": rng.choice([16, 32]),
                                                         "block_n": rng.choice([16, 32])})


def test_mla_tree_crossing_mask_word(seed):
    """D = 40: two int32 mask words (bit 31 = sign bit); 40 tokens x 2 heads = 80 rows (two
    row tiles of 64 and a partial one at block_m 32)."""
    rng = random.Random(seed)
    sc = mla_scenario(ForwardMode.TARGET_VERIFY, rng, bs=2, num_heads=2, D=40, max_prefix=30)
    check(sc, splits=2, kernel_config={"block_m": 32})


def test_mla_matches_naive_oracle_and_mask_locality(seed):
    """The independent float64 oracle agrees; flipping one mask bit changes only its row."""
    rng = random.Random(seed)
    sc = mla_scenario(ForwardMode.TARGET_VERIFY, rng, bs=2, D=5, page_size=16, num_heads=4)
    out, _, q = run_both(sc, splits=2)
    assert rel_err(out, naive_attention(sc, q)) < 1e-5
    be = TritonBackend(sc.req_pool, sc.kv_pool)
    be.init_forward_metadata(sc.batch)
    out1 = be.forward(q, None, None, sc.layer, sc.batch, save_kv_cache=False)
    sc.batch.tree_mask[1, 4, 0] ^= 1  # bit 0 of request 1's last row: the root
    be.init_forward_metadata(sc.batch)
    out2 = be.forward(q, None, None, sc.layer, sc.batch, save_kv_cache=False)
    assert torch.equal(out1[:9], out2[:9])
    assert not torch.allclose(out1[9], out2[9])


def test_mla_extend_long_rows_and_fp16(seed):
    """EXTEND with empty prefixes and 20 tokens x 8 heads = 160 rows (three row tiles, the
    causal bound per tile); an fp16 cache (tensor-core path) and fp32 queries over it
    (upcast).  bf16 is GPU-only (the interpreter's bf16 tl.dot is wrong)."""
    rng = random.Random(seed)
    check(mla_scenario(ForwardMode.EXTEND, rng, bs=3, num_heads=8, prefix_lens=[0, 0, 9],
                       extend_lens=[20, 1, 13]))
    sc = mla_scenario(ForwardMode.TARGET_VERIFY, rng, bs=2, D=6, dtype=torch.float16)
    check(sc, splits=2)
    out, expect, _ = run_both(sc, q=random_qkv(sc, torch.float32)[0])
    assert out.dtype == torch.float32 and rel_err(out, expect) < 1e-5


def test_mla_kernel_poison_empty_rows_and_block_dv():
    """Poisoned output: every token row written; a tree row with no bit and P = 0 -> zeros;
    block_dv = r / 2 gives the full-width answer; empty batches return at once."""
    torch.manual_seed(0)
    r, dr, H = 32, 16, 2
    rtt = torch.arange(2 * 8, dtype=torch.int32).view(2, 8)
    kv = torch.randn(16, 1, r + dr)
    q = torch.randn(6, H, r + dr)
    tree = pack_tree_mask(torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
                          .expand(2, 3, 3).contiguous())
    args = (rtt, torch.tensor([1, 0]), torch.tensor([4, 0], dtype=torch.int32),
            torch.tensor([0, 3, 6], dtype=torch.int32), tree, 3, 0.25, r)
    outs = []
    for splits in (1, 2):
        for dv in (r, r // 2):
            out = torch.full((6, H, r), float("nan"))
            mla_paged_attention(q, kv, *args, num_splits=splits, out=out, block_dv=dv)
            assert torch.isfinite(out).all()
            assert torch.equal(out[5], torch.zeros(H, r))  # request 1 (P = 0), empty row
            assert out[2].abs().sum() > 0                    # request 0 row 2 sees its prefix
            outs.append(out)
    for o in outs[1:]:
        assert rel_err(o, outs[0]) < 1e-6
    empty = mla_paged_attention(q[:0], kv, rtt, torch.zeros(0, dtype=torch.int64),
                                torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                None, 0, 0.25, r)
    assert empty.shape == (0, H, r)


def test_mla_kernel_page_tiles():
    """page_size % block_n == 0: one slot per prefix tile.  Same answer as the per-key gather
    on a page-ordered slot table (P crossing pages, split and not); a slot table that breaks
    the page layout is refused by the bounds check, and without it gives a different answer
    (the one-slot path is really taken)."""
    torch.manual_seed(1)
    r, H, ps = 32, 4, 16
    pages = torch.randperm(8)[:6] + 1                           # pages 1..8 in random order
    rtt = (pages[:, None] * ps + torch.arange(ps)).flatten()[None].int().repeat(2, 1)  # [2, 96]
    rtt[1] = rtt[1].flip(0)                                     # row 1: not page-ordered
    kv = torch.randn(10 * ps, 1, r + 16)
    q = torch.randn(2, H, r + 16)
    qo, seq = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([57], dtype=torch.int32)
    for row, same in ((0, True), (1, False)):
        rpi = torch.tensor([row])
        for splits in (1, 3):
            a = mla_paged_attention(q[:1], kv, rtt, rpi, seq, qo, None, 1, 0.2, r, splits, block_n=16)
            if not same:
                with pytest.raises(ValueError, match="paged layout"):
                    mla_paged_attention(q[:1], kv, rtt, rpi, seq, qo, None, 1, 0.2, r, splits, block_n=16,
                                        page_size=ps)
            b = mla_paged_attention(q[:1], kv, rtt, rpi, seq, qo, None, 1, 0.2, r, splits, block_n=16,
                                    page_size=ps, check_bounds=same)
            assert (rel_err(a, b) < 1e-6) == same


@pytest.mark.parametrize("block_dv", [16, 32])
def test_mla_kernel_tma_tiles(block_dv, seed):
    """``tma=True``: the prefix's full tiles come through TMA descriptors, the partial tile and
    the draft tokens through the gather path.  Same answer as the gather path (P crossing
    pages, with and without a partial tile, split and not, a tree); poisoned rows past P in
    the last page never leak in (NaN there would poison the output)."""
    r, rope, H, ps, D = 32, 16, 4, 16, 3
    pages = torch.randperm(8)[:6] + 1
    rtt = (pages[:, None] * ps + torch.arange(ps)).flatten()[None].int()          # [1, 96]
    kv = torch.randn(10 * ps, 1, r + rope)
    tree = pack_tree_mask(torch.ones(D, D, dtype=torch.bool).tril()[None])
    for P in (48, 57):
        used = rtt[0, :P + D].long()
        poison = torch.ones(kv.shape[0], dtype=torch.bool)
        poison[used] = False
        kv[poison] = float("nan")
        q = torch.randn(D, H, r + rope)
        args = (q, kv, rtt, torch.tensor([0]), torch.tensor([P], dtype=torch.int32),
                torch.tensor([0, D], dtype=torch.int32), tree, D, 0.2, r)
        for splits in (1, 2):
            kw = dict(num_splits=splits, block_n=16, block_dv=block_dv, page_size=ps)
            a = mla_paged_attention(*args, **kw)
            b = mla_paged_attention(*args, **kw, tma=True)
            assert torch.isfinite(b).all() and rel_err(a, b) < 1e-5, (P, splits)
        kv[poison] = 0.0


def test_mla_kernel_tma_errors():
    r, ps = 32, 16
    rtt = torch.arange(32, dtype=torch.int32).view(1, 32)
    kv = torch.zeros(48, 1, r + 16)
    args = (torch.zeros(1, 2, r + 16), kv, rtt, torch.tensor([0]), torch.tensor([20], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), None, 1, 0.2, r)
    with pytest.raises(ValueError, match="dividing page_size"):
        mla_paged_attention(*args, block_n=32, page_size=ps, tma=True)
    with pytest.raises(ValueError, match="tma must be a bool"):
        mla_paged_attention(*args, block_n=16, page_size=ps, tma=1)
    wide = torch.zeros(48, 1, 512 + 64)
    with pytest.raises(ValueError, match="<= 256"):
        mla_paged_attention(torch.zeros(1, 2, 576), wide, rtt, torch.tensor([0]),
                            torch.tensor([20], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                            None, 1, 0.2, 512, block_n=16, block_dv=512, page_size=ps, tma=True)


def test_mla_kernel_input_errors():
    r = 32
    rtt = torch.zeros(2, 8, dtype=torch.int32)
    kv = torch.zeros(16, 1, r + 16)
    base = dict(req_to_token=rtt, req_pool_indices=torch.tensor([0]),
                prefix_lens=torch.tensor([1], dtype=torch.int32),
                qo_indptr=torch.tensor([0, 1], dtype=torch.int32), tree_mask=None, max_q=1,
                sm_scale=1.0, kv_lora_rank=r)
    q = torch.zeros(1, 2, r + 16)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        mla_paged_attention(torch.zeros(1, 2, r + 8), torch.zeros(16, 1, r + 8), **base)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_paged_attention(q, torch.zeros(16, 2, r + 16), **base)
    with pytest.raises(ValueError, match="block_dv"):
        mla_paged_attention(q, kv, **base, block_dv=64)
    with pytest.raises(ValueError, match="block_n"):
        mla_paged_attention(q, kv, **base, block_n=24)
    with pytest.raises(ValueError, match="prefix_lens"):
        mla_paged_attention(q, kv, **{**base, "prefix_lens": torch.tensor([1])})
    with pytest.raises(ValueError, match="tree_mask"):
        mla_paged_attention(q, kv, **{**base, "tree_mask": torch.zeros(1, 1, 1, dtype=torch.int64)})


def test_mla_sm90_errors_and_eligibility():
    """``sm90=True`` where the Gluon MLA kernel cannot run is a ValueError naming why; the
    eligibility check lists every unmet need; the backend passes ``sm90`` to every mode."""
    from specattn.triton_kernels.attention_mla_sm90 import sm90_mla_supported
    rtt = torch.arange(32, dtype=torch.int32).view(1, 32)
    base = dict(req_to_token=rtt, req_pool_indices=torch.tensor([0]),
                prefix_lens=torch.tensor([20], dtype=torch.int32),
                qo_indptr=torch.tensor([0, 1], dtype=torch.int32), tree_mask=None, max_q=1,
                sm_scale=0.1, kv_lora_rank=512)
    q, kv = torch.zeros(1, 64, 576, dtype=torch.bfloat16), torch.zeros(40, 1, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sm_90 GPU"):
        mla_paged_attention(q, kv, **base, sm90=True)
    for bad in (0.0, -0.1, float("nan"), float("inf"), True):   # checked before anything else
        with pytest.raises(ValueError, match="sm_scale must be a finite float > 0"):
            mla_paged_attention(q, kv, **{**base, "sm_scale": bad})
    with pytest.raises(ValueError, match="sm90 must be a bool"):
        mla_paged_attention(q, kv, **base, sm90=1)
    with pytest.raises(ValueError, match="seesaw must be a bool"):
        mla_paged_attention(q, kv, **base, seesaw="yes")
    with pytest.raises(ValueError, match="seesaw=True runs 64-key tiles"):
        mla_paged_attention(q, kv, **base, seesaw=True, block_n=32)
    with pytest.raises(ValueError, match="seesaw=True needs the Gluon sm_90 kernel.*sm_90 GPU"):
        mla_paged_attention(q, kv, **base, seesaw=True)
    with pytest.raises(ValueError, match="seesaw=True needs the Gluon sm_90 kernel.*sm90=False"):
        mla_paged_attention(q, kv, **base, seesaw=True, sm90=False)
    assert "fp8" not in (sm90_mla_supported(q, kv.to(torch.float8_e4m3fn), 512) or "")   # an fp8 cache: eligible
    why = sm90_mla_supported(torch.zeros(2, 48, 40), torch.zeros(40, 1, 40), 32)
    for need in ("sm_90", "bf16/fp16", "kv_lora_rank 512"):
        assert need in why, (need, why)
    assert "divisible" not in why and "head count" not in why   # any head count: packed rows
    # the backend honours sm90=True in every mode (so a CPU run fails loudly)
    rng = random.Random(0)
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        sc = mla_scenario(mode, rng, bs=2)
        be = TritonBackend(sc.req_pool, sc.kv_pool, kernel_config={"sm90": True})
        be.init_forward_metadata(sc.batch)
        q, k, v = random_qkv(sc)
        with pytest.raises(ValueError, match="sm90=True needs"):
            be.forward(q, k, v, sc.layer, sc.batch)


def test_gluon_kernels_run_on_their_triton_release_only():
    """The Gluon kernels use one Triton minor release's experimental Gluon API: any other
    release, or a version that does not parse, turns them off (the callers then run the
    portable kernels), and the reason names both versions."""
    import triton
    from specattn.triton_kernels import gluon_common as G
    major, minor = G.GLUON_TRITON
    assert G.gluon_api_matches(f"{major}.{minor}.0") and G.gluon_api_matches(f"{major}.{minor}.1+git3f2a")
    for other in (f"{major}.{minor + 1}.0", f"{major}.{minor - 1}.2", f"{major + 1}.{minor}.0",
                  f"{major}", "nightly", ""):
        assert not G.gluon_api_matches(other), other
    if not G.gluon_api_matches(triton.__version__):
        assert not G.HAVE_GLUON
    why = " / ".join(G.sm90_device_needs(torch.zeros(1)))
    assert "sm_90 GPU" in why
    assert (f"Triton {major}.{minor} with Gluon (this is Triton {triton.__version__})" in why) != G.HAVE_GLUON


def test_mla_idle_and_supports():
    sc = make_scenario(ForwardMode.IDLE, kind="mla")
    be = create_backend("triton", sc.req_pool, sc.kv_pool)
    be.init_forward_metadata(sc.batch)
    out = be.forward(torch.randn(0, sc.layer.num_heads, sc.layer.head_dim), None, None, sc.layer, sc.batch)
    assert out.shape == (0, sc.layer.num_heads, sc.layer.v_head_dim)
    for mode in ForwardMode:
        for graph in (False, True):
            assert TritonBackend.supports(mode, graph=graph, kind=AttentionKind.MLA)


def test_kernel_config_validation():
    mla = MLATokenToKVPool(64, 1, torch.float32, 1, kv_lora_rank=32, qk_rope_head_dim=16)
    req = ReqToTokenPool(2, 16)
    TritonBackend(req, mla, kernel_config=dict(block_m=32, block_n=16, block_dv=16, num_warps=2,
                                               num_stages=1))
    for bad, match in ((dict(block_x=16), "unknown"), (dict(block_m=48), "block_m"),
                       (dict(block_n=8), "block_n"), (dict(num_warps=3), "num_warps"),
                       (dict(block_dv=8), "block_dv"), (dict(block_dv=64), "block_dv"),
                       (dict(num_stages=0), "num_stages"), (dict(block_m=32.0), "block_m")):
        with pytest.raises(ValueError, match=match):
            TritonBackend(req, mla, kernel_config=bad)
    with pytest.raises(ValueError, match="kernel_config"):
        TritonBackend(req, mla, kernel_config=[("block_m", 16)])
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        TritonBackend(req, MLATokenToKVPool(64, 1, torch.float32, 1, kv_lora_rank=32, qk_rope_head_dim=8))
    from specattn.backends.pools import MHATokenToKVPool
    mha = MHATokenToKVPool(64, 1, torch.float32, 1, 16, 1)
    TritonBackend(req, mha, kernel_config=dict(block_m=16, block_n=16, num_warps=4, num_stages=2))
    with pytest.raises(ValueError, match="unknown"):
        TritonBackend(req, mha, kernel_config=dict(block_dv=16))


def test_mla_worked_example():
    """The MLA example of the backend's module docstring (small dims): 3 tokens x 16 heads of
    a request are 48 packed rows, one tile; output [6, 16, r]."""
    pool = ReqToTokenPool(4, 16)
    pool.req_to_token[3, :11] = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23, 24, 25, 26])
    pool.req_to_token[0, :8] = torch.tensor([7, 8, 30, 31, 32, 33, 34, 35])
    b = ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, [3, 0], [8, 5], 3, [24, 25, 26, 33, 34, 35],
                           positions=[8, 9, 10, 5, 6, 6],
                           tree_mask=torch.tensor([[[1], [3], [7]], [[1], [3], [5]]], dtype=torch.int32))
    kv = MLATokenToKVPool(64, 1, torch.float32, 1, kv_lora_rank=32, qk_rope_head_dim=16)
    kv.kv_buffer[0].normal_()
    be = TritonBackend(pool, kv)
    be.init_forward_metadata(b)
    md = be.forward_metadata
    assert md.qo_indptr.tolist() == [0, 3, 6] and md.max_q == 3
    from specattn.backends import AttentionLayer
    layer = AttentionLayer.mla(0, 16, 32, 16)
    out = be.forward(torch.randn(6, 16, 48), None, None, layer, b, save_kv_cache=False)
    assert out.shape == (6, 16, 32) and torch.isfinite(out).all()


@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_graph_builders_on_cpu(mode, page_size, seed):
    """Capture/replay metadata path (static buffers, padding) without a real graph."""
    graph_case("mla", mode, page_size, "cpu", False, seed, num_heads=4,
               splits=random.Random(seed).choice([1, 2]), D=5, padded_bs=3, trials=1)


# ------------------------------------------------------------------------- GPU
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_mla_eager_on_gpu(mode, dtype, page_size, num_heads, seed):
    rng = random.Random(seed)
    sc = mla_scenario(mode, rng, bs=rng.randint(1, 6), page_size=page_size, device="cuda",
                      dtype=dtype, num_heads=num_heads, kv_lora_rank=512, qk_rope_head_dim=64,
                      max_prefix=rng.choice([30, 700]), D=rng.choice([1, 7, 33, 64]), num_layers=1)
    check(sc, splits=rng.choice([1, 4]))  # auto splits: the long-prefix and graph tests


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 64])
def test_mla_long_prefix_on_gpu(mode, page_size, seed):
    """Prefixes up to 8k, 128 heads, bf16, auto split-KV; 64-token random trees."""
    rng = random.Random(seed)
    P = [8192, rng.randint(1, 8192)]
    sc = mla_scenario(mode, rng, bs=2, page_size=page_size, device="cuda", dtype=torch.bfloat16,
                      num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, max_prefix=8192,
                      prefix_lens=P, extend_lens=[64, 37], D=64, num_layers=1)
    check(sc)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("splits", [None, 1])
def test_mla_cuda_graph_replay(mode, page_size, dtype, splits, seed):
    rng = random.Random(seed)
    graph_case("mla", mode, page_size, "cuda", True, seed, dtype=dtype,
               num_heads=rng.choice([16, 128]), kv_lora_rank=512, qk_rope_head_dim=64,
               D=rng.choice([5, 33, 64]), splits=splits, max_prefix=rng.choice([20, 2000]),
               padded_bs=8, ext_max=rng.choice([7, 64]))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY], ids=lambda m: m.name)
@pytest.mark.parametrize("config", [
    dict(block_dv=256), dict(block_n=16), dict(block_n=64, num_stages=1), dict(num_warps=4),
    dict(block_m=64, block_n=16, block_dv=512, num_stages=3), dict(block_m=32, block_dv=256, num_warps=4),
    dict(block_m=128, block_dv=256, num_stages=1), dict(block_m=128, block_dv=256, num_stages=1, tma=True),
    dict(block_m=64, block_n=32, block_dv=256, num_stages=2, tma=True)],
    ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_mla_kernel_configs_on_gpu(mode, config, seed):
    """Every sweepable knob compiles and stays correct (bf16, 128 heads, 512 + 64)."""
    rng = random.Random(seed)
    sc = mla_scenario(mode, rng, bs=3, page_size=64, device="cuda", dtype=torch.bfloat16,
                      num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, max_prefix=1500,
                      D=64, num_layers=1)
    check(sc, splits=rng.choice([1, 3]), kernel_config=config)


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon MLA kernel needs an sm_90 GPU")
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("block_n, seesaw", [(32, False), (64, False), (64, True)],
                         ids=["split32", "split64", "seesaw"])
@pytest.mark.parametrize("num_heads", [16, 64, 128])
def test_mla_sm90_matches_reference(mode, dtype, page_size, block_n, seesaw, num_heads, seed):
    """The Gluon MLA kernels (``sm90=True``; key split at 32/64-key tiles, seesaw) against
    the reference backend in every mode: prefixes at and around tile boundaries (0, 1,
    block_n - 1, block_n, ..., an odd and an even tile count), up to 8k, random trees of
    1..64 tokens, split and not; at 16 heads a tile packs the rows of four tokens."""
    rng = random.Random(seed)
    P = [0, 1, block_n - 1, block_n, block_n + 1, rng.randint(1, 3000), 8191]
    rng.shuffle(P)
    bs = rng.randint(1, 4 if mode == ForwardMode.DECODE else 3)
    sc = mla_scenario(mode, rng, bs=bs, page_size=page_size, device="cuda",
                      dtype=dtype, num_heads=num_heads, kv_lora_rank=512, qk_rope_head_dim=64,
                      max_prefix=8192, prefix_lens=P[:bs], D=rng.choice([1, 7, 33, 64]),
                      num_layers=1)
    check(sc, splits=rng.choice([None, 1, 3, 16]),
          kernel_config={"sm90": True, "block_n": block_n, "seesaw": seesaw})


def _packed_batch(rng, gen, bs, prefixes):
    """A random paged batch for the packed-row tests: page size 1 or 64, 1..9 new tokens a
    request, prefixes drawn from ``prefixes`` (an int: a random one up to it joins them).
    Returns ``(ps, n, max_q, P, width, rtt)`` (``rtt`` on the GPU, pages shuffled)."""
    ps = rng.choice([1, 64])
    n = [rng.randint(1, 9) for _ in range(bs)]
    max_q = max(n)
    P = torch.tensor([rng.choice(prefixes[:-1] + [rng.randint(1, prefixes[-1])]) for _ in range(bs)],
                     dtype=torch.int32)
    width = -(-(int(P.max()) + max_q) // 64) * 64
    pages = torch.randperm(bs * width // ps * 2, generator=gen)[:bs * width // ps].view(bs, -1)
    rtt = (pages[:, :, None] * ps + torch.arange(ps)).flatten(1).int().cuda()
    return ps, n, max_q, P, width, rtt


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon MLA kernel needs an sm_90 GPU")
@pytest.mark.parametrize("num_heads", [1, 24, 48, 96])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_mla_sm90_packed_rows_cross_tokens(num_heads, tree, seed):
    """Head counts whose 64-row tiles straddle tokens (24, 48, 96: a tile starts inside a
    token) or hold 64 tokens (1 head): every kernel against the portable one over the same
    packed rows, with per-request token counts of 1..9 (tiles that end inside a request, a
    request of one token next to longer ones), causal and tree masks, split and not, pages of 1
    and 64; the output's rows are poisoned with NaN first and each must be written."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    H, bs = num_heads, rng.randint(2, 5)
    ps, n, max_q, P, width, rtt = _packed_batch(rng, gen, bs, [0, 1, 63, 64, 65, 700])
    kv = torch.randn(bs * width * 2, 1, 576, generator=gen).to(torch.bfloat16).cuda()
    qo = torch.tensor([0] + n).cumsum(0).int().cuda()
    T = int(qo[-1])
    q = torch.randn(T, H, 576, generator=gen).to(kv)
    tm = None
    if tree:  # each token sees itself and a random subset of the tokens before it
        vis = torch.tril(torch.rand(bs, max_q, max_q, generator=gen) < 0.5) | torch.eye(max_q, dtype=torch.bool)
        words = (vis.long() << torch.arange(max_q)).sum(-1, keepdim=True)
        tm = words.int().cuda()
    args = (q, kv, rtt, torch.arange(bs).cuda(), P.cuda(), qo, tm, max_q, 0.07, 512)
    for splits in (1, 3):
        ref = mla_paged_attention(*args, num_splits=splits, sm90=False).float()
        for kw in (dict(seesaw=True), dict(seesaw=False, block_n=64), dict(seesaw=False, block_n=32)):
            out = torch.full_like(q[..., :512], float("nan"))
            got = mla_paged_attention(*args, num_splits=splits, sm90=True, page_size=ps, out=out, **kw)
            assert torch.isfinite(got).all(), (splits, kw)
            assert rel_err(ref, got.float()) < 2e-2, (splits, kw)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon MLA kernel needs an sm_90 GPU")
@pytest.mark.parametrize("num_heads", [16, 48, 128])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mla_sm90_fp8_schedules_match_portable(num_heads, tree, dtype, seed):
    """An fp8 e4m3 cache with a random scale: the seesaw schedule (its loader widens each
    tile in place in shared memory) and the key split (64- and 32-key tiles) against the
    portable kernel over the same bytes.  Prefixes at and around tile boundaries and long
    ones (several tiles, so both stages are reused), 1..9 tokens per request, causal and tree
    masks, split and not, pages of 1 and 64, NaN in every cache row no request uses, the
    output poisoned with NaN first."""
    from specattn.ops.fp8 import quantize_kv
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    H, bs = num_heads, rng.randint(2, 4)
    ps, n, max_q, P, width, rtt = _packed_batch(rng, gen, bs, [0, 1, 63, 64, 65, 127, 3000])
    scale = 10 ** rng.uniform(-2, 0)
    kv = torch.full((bs * width * 2, 1, 576), float("nan"), device="cuda").to(torch.float8_e4m3fn)
    for b in range(bs):
        used = rtt[b, :int(P[b]) + n[b]].long()
        kv[used] = quantize_kv(torch.randn(used.numel(), 1, 576, generator=gen).cuda() * scale * 4,
                               torch.float8_e4m3fn, scale)
    qo = torch.tensor([0] + n).cumsum(0).int().cuda()
    q = torch.randn(int(qo[-1]), H, 576, generator=gen).to(dtype).cuda()
    tm = None
    if tree:
        vis = torch.tril(torch.rand(bs, max_q, max_q, generator=gen) < 0.5) | torch.eye(max_q, dtype=torch.bool)
        tm = (vis.long() << torch.arange(max_q)).sum(-1, keepdim=True).int().cuda()
    args = (q, kv, rtt, torch.arange(bs).cuda(), P.cuda(), qo, tm, max_q, 0.07, 512)
    for splits in (1, 3):
        ref = mla_paged_attention(*args, num_splits=splits, sm90=False, kv_scale=scale).float()
        assert torch.isfinite(ref).all()
        for kw in (dict(seesaw=True), dict(seesaw=False, block_n=64), dict(seesaw=False, block_n=32)):
            out = torch.full_like(q[..., :512], float("nan"))
            got = mla_paged_attention(*args, num_splits=splits, sm90=True, page_size=ps, out=out,
                                      kv_scale=scale, **kw)
            assert torch.isfinite(got).all(), (splits, kw)
            assert rel_err(ref, got.float()) < 2e-2, (splits, kw, rel_err(ref, got.float()))
        # the default on sm_90 is the seesaw schedule
        dflt = mla_paged_attention(*args, num_splits=splits, page_size=ps, kv_scale=scale)
        assert rel_err(ref, dflt.float()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon MLA kernel needs an sm_90 GPU")
def test_mla_sm90_decode_poison_and_default_agree(seed):
    """NaN in every cache row no request uses never reaches the output (masked copies read
    nothing past a request's keys; the seesaw kernel's TMA tiles of whole pages stop before a
    partial last tile), and the Gluon kernels agree with the Triton kernel."""
    gen = torch.Generator().manual_seed(seed)
    H, ps, bs = 128, 64, 5
    P = torch.tensor([0, 63, 64, 1000, 4097], dtype=torch.int32)
    width = 4160
    rtt = torch.randperm(bs * width // ps * 2, generator=gen)[:bs * width // ps].view(bs, -1)
    rtt = (rtt[:, :, None] * ps + torch.arange(ps)).flatten(1).int().cuda()
    kv = torch.full((bs * width * 2 + ps, 1, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    for b in range(bs):
        used = rtt[b, :P[b] + 1].long()
        kv[used] = torch.randn(used.numel(), 1, 576, generator=gen).to(kv)
    q = torch.randn(bs, H, 576, generator=gen).to(kv)
    args = (q, kv, rtt, torch.arange(bs).cuda(), P.cuda(), torch.arange(bs + 1, dtype=torch.int32).cuda(),
            None, 1, 0.07, 512)
    for splits in (1, 4):
        a = mla_paged_attention(*args, num_splits=splits, sm90=False)
        for seesaw in (False, True):
            out = torch.full_like(a, float("nan"))
            b = mla_paged_attention(*args, num_splits=splits, sm90=True, seesaw=seesaw, out=out,
                                    page_size=ps)
            assert torch.isfinite(b).all() and rel_err(a.float(), b.float()) < 2e-2, (splits, seesaw)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon MLA kernel needs an sm_90 GPU")
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_mla_sm90_seesaw_tma_tiles_at_unaligned_split(tree, seed):
    """Page 64: the seesaw kernel copies whole-page tiles by TMA.  With split-KV the last
    split starts at ``P``, which need not be a multiple of 64, so a full 64-key tile from there
    spans two pages and must be gathered per key (a TMA copy from its first slot read the
    wrong page: max error 2.0 at P = 70, 64 new tokens, 3 splits)."""
    gen = torch.Generator().manual_seed(seed)
    ps, H, n = 64, 64, 64
    P = torch.tensor([1, 65, 70, 130, 191], dtype=torch.int32)
    bs = P.numel()
    width = 4 * ps
    pages = torch.randperm(bs * width // ps, generator=gen).view(bs, -1)
    rtt = (pages[:, :, None] * ps + torch.arange(ps)).flatten(1).int().cuda()
    kv = torch.randn(bs * width, 1, 576, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(bs * n, H, 576, generator=gen).to(kv)
    tm = None
    if tree:  # every draft token sees the ones before it and a random half of them
        vis = torch.tril(torch.rand(bs, n, n, generator=gen) < 0.5) | torch.eye(n, dtype=torch.bool)
        words = (vis.view(bs, n, 2, 32).long() << torch.arange(32)).sum(-1)
        tm = torch.where(words >= 2 ** 31, words - 2 ** 32, words).int().cuda()
    args = (q, kv, rtt, torch.arange(bs).cuda(), P.cuda(),
            torch.arange(bs + 1, dtype=torch.int32).cuda() * n, tm, n, 0.07, 512)
    ref = mla_paged_attention(*args, num_splits=3, sm90=False).float()
    for splits in (3, 16):
        out = torch.full_like(q[..., :512], float("nan"))
        got = mla_paged_attention(*args, num_splits=splits, seesaw=True, page_size=ps, out=out)
        assert rel_err(ref, got.float()) < 2e-2, splits


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Gluon MLA kernel needs an sm_90 GPU")
@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_mla_sm90_graph_replay(mode, page_size, num_heads, seed):
    """Captured at a padded bs, replayed with a smaller one (padded requests: no tokens); at
    16 heads the tiles pack several tokens' rows."""
    graph_case("mla", mode, page_size, "cuda", True, seed, dtype=torch.bfloat16,
               num_heads=num_heads, kv_lora_rank=512, qk_rope_head_dim=64, max_prefix=2000,
               D=random.Random(seed).choice([5, 64]), padded_bs=8, ext_max=20,
               kernel_config={"sm90": True})
