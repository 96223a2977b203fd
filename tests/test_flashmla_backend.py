"""FlashMLABackend.

CPU: the missing-package / no-GPU / not-SM90 messages, ``supports`` (DECODE, IDLE and chain
TARGET_VERIFY only; it does not depend on triton), constructor validation, the block-table
builder against a naive one, and the backend's eager and graph paths (DECODE and chain
TARGET_VERIFY) end to end against a *fake* ``flash_mla`` (below: FlashMLA's dense-decode
signature and semantics in float64; its scheduler output encodes ``cache_seqlens`` so stale
scheduler metadata in a replay is caught).  The modes FlashMLA lacks raise UnsupportedError
on their own and run through :class:`RoutedBackend` on the real TritonBackend (interpreter),
as the engine routes them (``Engine.mode_routed``).

fp8 (float8_e4m3fn) pools are refused at construction (UnsupportedConfigError: the dense fp8
decode wants fp8 queries; the message names triton and flashinfer).

GPU (``-m gpu``, real sgl-flash-mla on SM90): DECODE and chain TARGET_VERIFY eager and CUDA
graph (capture at a padded bs, replay smaller, outputs poisoned, replay under
``torch.cuda.set_sync_debug_mode("error")``: no host sync) against TorchReferenceBackend;
page_size 64, 512 + 64 latents, 16 / 64 / 128 heads, bf16; tree verify / EXTEND /
DRAFT_EXTEND_V2 routed to the Triton backend over the same pools.
"""
import dataclasses
import os
import random
import sys
import types

import torch

if not torch.cuda.is_available():  # the routed modes run Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from scenarios import capture_forward, load_trial, make_scenario, random_qkv  # noqa: E402
import specattn.backends.flashmla_backend as fmb  # noqa: E402
from specattn.backends import (AttentionKind, ForwardMode, GraphInputBuffers,  # noqa: E402
                               MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool,
                               RoutedBackend, TorchReferenceBackend, UnsupportedConfigError,
                               UnsupportedError, available_backends, create_backend,
                               pack_tree_mask)
from specattn.backends.flashmla_backend import FlashMLABackend, flashmla_block_table  # noqa: E402

MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def triton_mla(mode, graph):
    """Whether the Triton backend (where FlashMLA's missing modes go) runs ``mode`` for MLA."""
    try:
        from specattn.backends.triton_backend import TritonBackend
    except ImportError:
        return False
    return TritonBackend.supports(mode, graph=graph, kind=AttentionKind.MLA)


def routed(be, mode):
    """``be`` alone when it runs ``mode`` eagerly, else a :class:`RoutedBackend` sending
    ``mode`` to the Triton backend over the same pools (what the engine builds)."""
    if be.supports(mode, graph=False, kind=be.kind):
        return be
    tri = create_backend("triton", be.req_to_token_pool, be.kv_pool, topk=be.topk)
    return RoutedBackend(be, {mode: tri})


def chain(D, bs, device):
    m = torch.ones(D, D, dtype=torch.bool, device=device).tril()
    return pack_tree_mask(m).expand(bs, D, -1).contiguous()


def mla_scenario(mode, rng, device="cpu", dtype=torch.float32, **kw):
    kw.setdefault("num_heads", 4)
    return make_scenario(mode, kind="mla", page_size=64, kv_lora_rank=512, qk_rope_head_dim=64,
                         device=device, dtype=dtype, rng=rng, **kw)


# ------------------------------------------------------------------ messages and tables
def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    sc = make_scenario(ForwardMode.DECODE, kind="mla")
    with pytest.raises(ImportError, match=r'pip install "specattn\[flashmla\]"'):
        create_backend("flashmla", sc.req_pool, sc.kv_pool)
    assert "specattn[flashmla]" in available_backends()["flashmla"]
    from specattn import info
    assert "specattn[flashmla]" in info.collect_info()["backends"]["flashmla"]


def test_no_gpu_and_not_sm90_say_so(monkeypatch):
    fake = types.ModuleType("flash_mla")
    fake.has_legacy = lambda: True
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA GPU" in available_backends()["flashmla"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert "SM90" in available_backends()["flashmla"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    fake.has_legacy = lambda: False
    assert "legacy" in available_backends()["flashmla"]


def test_supports_table():
    """What FlashMLA itself runs: DECODE, IDLE, chain TARGET_VERIFY; eager and graph alike."""
    own = {ForwardMode.DECODE, ForwardMode.IDLE}
    for mode in ForwardMode:
        for graph in (False, True):
            assert not FlashMLABackend.supports(mode, graph=graph, kind=AttentionKind.MHA)
            for topk in (None, 1, 4):
                got = FlashMLABackend.supports(mode, graph=graph, kind=AttentionKind.MLA, topk=topk)
                want = mode in own or (mode == ForwardMode.TARGET_VERIFY and topk == 1)
                assert got == want, (mode, graph, topk)


def test_supports_does_not_depend_on_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "specattn.backends.triton_backend", None)  # no triton
    for mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND_V2, ForwardMode.TARGET_VERIFY):
        assert not FlashMLABackend.supports(mode, graph=False, kind=AttentionKind.MLA)
    assert FlashMLABackend.supports(ForwardMode.TARGET_VERIFY, graph=True, kind=AttentionKind.MLA,
                                    topk=1)
    assert FlashMLABackend.supports(ForwardMode.DECODE, graph=True, kind=AttentionKind.MLA)


def test_constructor_rejects_what_flashmla_cannot_run():
    req = ReqToTokenPool(4, 128)
    for pool, what in [(MHATokenToKVPool(128, 64, torch.bfloat16, 1, 64, 1), "MLA"),
                       (MLATokenToKVPool(128, 16, torch.bfloat16, 1), "page_size"),
                       (MLATokenToKVPool(128, 64, torch.bfloat16, 1, kv_lora_rank=256), "kv_lora_rank"),
                       (MLATokenToKVPool(128, 64, torch.float32, 1), "float32"),
                       (MLATokenToKVPool(128, 64, torch.bfloat16, 1), "CUDA")]:
        with pytest.raises(ValueError, match=what):
            FlashMLABackend(req, pool)
    with pytest.raises(ValueError, match="topk"):
        FlashMLABackend(req, MLATokenToKVPool(128, 64, torch.bfloat16, 1), topk=-1)


def test_fp8_pool_is_refused_naming_what_reads_it():
    """sgl-flash-mla's one dense fp8 decode wants fp8 queries too (it would quantize them): an
    fp8 latent pool is refused at construction, before flash_mla is imported, and the message
    says why and which backends read it."""
    req = ReqToTokenPool(4, 128)
    for pool in (MLATokenToKVPool(128, 64, torch.float8_e4m3fn, 1),
                 MLATokenToKVPool(128, 64, torch.float8_e4m3fn, 2, kv_scale=[0.5, 2.0])):
        with pytest.raises(UnsupportedConfigError, match="fp8 queries") as e:
            FlashMLABackend(req, pool)
        assert "triton" in str(e.value) and "flashinfer" in str(e.value)
    with pytest.raises(UnsupportedConfigError, match="page_size"):   # the geometry still first
        FlashMLABackend(req, MLATokenToKVPool(128, 16, torch.float8_e4m3fn, 1))


def test_block_table_matches_naive(seed):
    rng = random.Random(seed)
    sc = mla_scenario(ForwardMode.DECODE, rng, bs=rng.randint(1, 5), max_prefix=200, num_heads=2)
    b, rtt = sc.batch, sc.req_pool.req_to_token
    W = rtt.shape[1]
    want = [[int(rtt[int(r), k]) // 64 for k in range(0, W, 64)] for r in b.req_pool_indices]
    assert flashmla_block_table(rtt, b.req_pool_indices).tolist() == want
    for i, r in enumerate(b.req_pool_indices.tolist()):  # the pages really hold the tokens
        L = int(b.prefix_lens[i]) + 1
        assert all(int(rtt[r, p]) == want[i][p // 64] * 64 + p % 64 for p in range(L))
    out = torch.full((b.batch_size + 2, -(-W // 64)), -5, dtype=torch.int32)
    view = flashmla_block_table(rtt, b.req_pool_indices, out=out)
    assert view.data_ptr() == out.data_ptr() and view.tolist() == want
    assert (out[b.batch_size:] == -5).all()
    with pytest.raises(ValueError):
        flashmla_block_table(rtt, b.req_pool_indices, out=torch.zeros(1, 1, dtype=torch.int32))


def test_worked_example():
    pool = ReqToTokenPool(4, 128)
    pool.req_to_token[3, :101] = torch.cat([torch.arange(256, 320), torch.arange(576, 613)])
    pool.req_to_token[0, :6] = torch.arange(128, 134)
    table = flashmla_block_table(pool.req_to_token, torch.tensor([3, 0]))
    assert table[0].tolist() == [4, 9] and table[1, 0] == 2


# ------------------------------------------------------------------ a fake flash_mla (CPU)
def _fake_sched(seqlens_k, num_q_tokens_per_head_k, h_k, h_q=None, is_fp8_kvcache=False,
                topk=None, use_legacy=False):
    assert use_legacy and h_k == 1 and not is_fp8_kvcache and topk is None
    s_q = num_q_tokens_per_head_k // h_q
    parts = max(132 // -(-(s_q * h_q) // 64), 1)
    tile = torch.zeros(parts, 8, dtype=torch.int32, device=seqlens_k.device)
    tile[:, 0] = s_q
    splits = torch.zeros(seqlens_k.shape[0] + 1, dtype=torch.int32, device=seqlens_k.device)
    splits[1:] = torch.cumsum(seqlens_k, 0)
    return tile, splits


class _SchedMeta:
    tile_scheduler_metadata = None
    num_splits = None


def _fake_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                 num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None,
                 indices=None, use_legacy=False):
    assert use_legacy and indices is None and num_splits is None
    assert k_cache.shape[1:3] == (64, 1) and block_table.dtype == torch.int32
    b, s_q, H, d = q.shape
    meta = tile_scheduler_metadata
    want_tile, want_splits = _fake_sched(cache_seqlens, s_q * H, 1, H, use_legacy=True)
    assert torch.equal(meta.num_splits, want_splits), "stale scheduler metadata"
    assert torch.equal(meta.tile_scheduler_metadata, want_tile)
    out = torch.full((b, s_q, H, head_dim_v), float("nan"), dtype=torch.float64)
    for i in range(b):
        L = int(cache_seqlens[i])
        t = torch.arange(L)
        lat = k_cache[block_table[i, t // 64].long(), t % 64, 0].double()        # [L, 576]
        vis = torch.ones(s_q, L, dtype=torch.bool)
        if causal and s_q > 1:
            vis = torch.arange(L)[None] <= L - s_q + torch.arange(s_q)[:, None]
        s = torch.einsum("qhd,ld->hql", q[i].double(), lat) * softmax_scale
        p = torch.softmax(s.masked_fill(~vis[None], float("-inf")), -1)
        out[i] = torch.einsum("hql,ld->qhd", p, lat[:, :head_dim_v])
    return out.to(q.dtype), None


@pytest.fixture
def fake_flash_mla(monkeypatch):
    fm = types.ModuleType("flash_mla")
    fm.has_legacy = lambda: True
    fm.get_mla_metadata = lambda *a, **k: (_SchedMeta(), None)
    fm.get_mla_decoding_metadata = _fake_sched
    fm.flash_mla_with_kvcache = _fake_decode
    monkeypatch.setitem(sys.modules, "flash_mla", fm)
    monkeypatch.setattr(fmb, "_check_pools", lambda *a: None)       # CPU float32 pools
    monkeypatch.setattr(FlashMLABackend, "unavailable_reason", classmethod(lambda cls: None))
    return fm


def _reference(sc, q, k):
    ref = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    ref.init_forward_metadata(sc.batch)
    return ref.forward(q, k, None, sc.layer, sc.batch, save_kv_cache=False)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY], ids=lambda m: m.name)
def test_eager_against_reference_with_fake(fake_flash_mla, mode, seed):
    rng = random.Random(seed)
    sc = mla_scenario(mode, rng, bs=rng.randint(1, 3), max_prefix=rng.choice([0, 70, 130]),
                      D=rng.choice([1, 3, 6]))
    if mode == ForwardMode.TARGET_VERIFY:
        sc.batch.tree_mask = chain(sc.batch.num_tokens_per_req, sc.batch.batch_size, "cpu")
    be = create_backend("flashmla", sc.req_pool, sc.kv_pool, topk=1)
    q, k, _ = random_qkv(sc)
    be.init_forward_metadata(sc.batch)
    out = be.forward(q, k, None, sc.layer, sc.batch)
    assert be.forward_metadata.sched.heads == sc.layer.num_heads
    assert torch.isfinite(out).all() and rel_err(out, _reference(sc, q, k)) < 1e-5


def test_stale_metadata_of_another_token_count_is_refused(fake_flash_mla, seed):
    """TARGET_VERIFY metadata for 4 drafts per request must not serve a batch of 2 per request."""
    rng = random.Random(seed)
    long, short = (mla_scenario(ForwardMode.TARGET_VERIFY, rng, bs=2, D=D, max_prefix=40) for D in (4, 2))
    for sc in (long, short):
        sc.batch.tree_mask = chain(sc.batch.num_tokens_per_req, 2, "cpu")
    be = create_backend("flashmla", long.req_pool, long.kv_pool, topk=1)
    be.init_forward_metadata(long.batch)
    q, _, _ = random_qkv(short)
    with pytest.raises(RuntimeError, match="init_forward_metadata was not called"):
        be.forward(q, None, None, long.layer, short.batch, save_kv_cache=False)


def test_eager_metadata_refuses_rows_slots_and_stale_lengths(fake_flash_mla, seed):
    """A decode's ``req_pool_indices`` row past ``req_to_token``, a slot past the KV pool, and
    host copies of the lengths that differ from the tensors are refused before the block
    table is built."""
    sc = mla_scenario(ForwardMode.DECODE, random.Random(seed), bs=2, max_prefix=70)
    be = create_backend("flashmla", sc.req_pool, sc.kv_pool)
    b = sc.batch
    rtt = sc.req_pool.req_to_token
    with pytest.raises(ValueError, match="host copies"):
        be.init_forward_metadata(dataclasses.replace(b, prefix_lens=b.prefix_lens + 1))
    with pytest.raises(ValueError, match="req_pool_indices"):
        be.init_forward_metadata(dataclasses.replace(b, req_pool_indices=b.req_pool_indices.clone().fill_(-1)))
    r0, p0 = int(b.req_pool_indices[0]), int(b.prefix_lens[0])
    saved = int(rtt[r0, p0])
    rtt[r0, p0] = -1
    with pytest.raises(ValueError, match="outside the KV pool"):
        be.init_forward_metadata(b)
    rtt[r0, p0] = saved
    be.init_forward_metadata(b)


def test_chain_promise_is_checked_eagerly(fake_flash_mla):
    sc = mla_scenario(ForwardMode.TARGET_VERIFY, random.Random(1), bs=2, D=4, max_prefix=5)
    be = create_backend("flashmla", sc.req_pool, sc.kv_pool, topk=1)
    sc.batch.tree_mask = chain(4, 2, "cpu")
    sc.batch.tree_mask[1, 3] = 0b1001  # token 3 skips 1 and 2: a tree, not a chain
    with pytest.raises(ValueError, match="chain"):
        be.init_forward_metadata(sc.batch)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND_V2,
                                  ForwardMode.TARGET_VERIFY], ids=lambda m: m.name)
def test_routed_modes_with_fake(fake_flash_mla, mode, seed):
    """Tree verify / extend modes are not FlashMLA's: it refuses them (UnsupportedError, eager
    and graph), and a RoutedBackend runs them on the Triton backend over the same pools
    (interpreter on CPU), as the engine does."""
    rng = random.Random(seed)
    sc = mla_scenario(mode, rng, bs=1, max_prefix=8, D=3, num_heads=2)
    be = create_backend("flashmla", sc.req_pool, sc.kv_pool)   # topk unknown: trees
    q, k, _ = random_qkv(sc)
    with pytest.raises(UnsupportedError, match="route"):
        be.init_forward_metadata(sc.batch)
    be.init_cuda_graph_state(1, 3)
    with pytest.raises(ValueError, match="cannot be captured"):
        be.init_forward_metadata_capture_cuda_graph(sc.batch)
    if not triton_mla(mode, False):
        pytest.skip("the triton backend is not available here")
    if torch.cuda.is_available():
        pytest.skip("CPU tensors; the GPU tests cover the routed modes")
    r = routed(be, mode)
    assert r.name == "flashmla+triton" and r.backend_for(ForwardMode.DECODE) is be
    assert r.supports(mode, graph=True, kind=AttentionKind.MLA) == triton_mla(mode, True)
    r.init_forward_metadata(sc.batch)
    out = r.forward(q, k, None, sc.layer, sc.batch)
    assert rel_err(out, _reference(sc, q, k)) < 1e-5


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY], ids=lambda m: m.name)
def test_graph_builders_with_fake(fake_flash_mla, mode, seed):
    """Capture-metadata, warm-up forward (scheduler buffers), then replays through the same
    static buffers: the fake asserts the scheduler metadata was recomputed for each batch."""
    rng = random.Random(seed)
    padded_bs = 3
    D = 1 if mode == ForwardMode.DECODE else rng.choice([2, 5])
    common = dict(D=D, capacity_bs=padded_bs, max_prefix=150, num_heads=4)
    first = mla_scenario(mode, rng, bs=padded_bs, **common)
    if mode == ForwardMode.TARGET_VERIFY:
        first.batch.tree_mask = chain(D, padded_bs, "cpu")
    be = create_backend("flashmla", first.req_pool, first.kv_pool, topk=1)
    be.init_cuda_graph_state(padded_bs, padded_bs * D)
    bufs = GraphInputBuffers(padded_bs, D, "cpu")
    layer = first.layer
    qs = torch.zeros(padded_bs * D, layer.num_heads, layer.head_dim)
    ks = torch.zeros(padded_bs * D, 1, layer.head_dim)
    padded = bufs.fill(first.batch, padded_bs)
    be.init_forward_metadata_capture_cuda_graph(padded)
    be.forward(qs, ks, None, layer, padded)                       # warm-up
    sched = be.forward_metadata.sched
    static = be.forward_metadata.block_table
    for trial in range(3):
        bs = rng.randint(1, padded_bs)
        sc = mla_scenario(mode, rng, bs=bs, **common)
        if mode == ForwardMode.TARGET_VERIFY:
            sc.batch.tree_mask = chain(D, bs, "cpu")
        q, k, _, n = load_trial(first, sc, qs, ks)
        padded = bufs.fill(sc.batch, padded_bs)
        be.init_forward_metadata_replay_cuda_graph(padded)
        md = be.forward_metadata
        assert md.sched is sched and md.block_table.data_ptr() == static.data_ptr()
        out = be.forward(qs, ks, None, layer, padded)[:n]
        want = _reference(sc, q, k)
        assert torch.isfinite(out).all() and rel_err(out, want) < 1e-5, f"bs {bs}"


def test_graph_errors_with_fake(fake_flash_mla, monkeypatch):
    rng = random.Random(0)
    sc = mla_scenario(ForwardMode.DECODE, rng, bs=2, max_prefix=10)
    be = create_backend("flashmla", sc.req_pool, sc.kv_pool)
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        be.init_forward_metadata_capture_cuda_graph(sc.batch)
    be.init_cuda_graph_state(2, 2)
    with pytest.raises(RuntimeError, match="never captured"):
        be.init_forward_metadata_replay_cuda_graph(sc.batch)
    be.init_forward_metadata_capture_cuda_graph(sc.batch)
    q, k, _ = random_qkv(sc)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="warm-up"):
        be.forward(q, k, None, sc.layer, sc.batch)
    idle = make_scenario(ForwardMode.IDLE, kind="mla")
    be.init_forward_metadata(idle.batch)
    assert be.forward(torch.zeros(0, 4, 576), None, None, sc.layer, idle.batch).shape == (0, 4, 512)


@pytest.mark.parametrize("topk", [1, 2])
def test_engine_routes_what_flashmla_lacks(fake_flash_mla, topk, seed):
    """An engine over FlashMLA routes the modes FlashMLA lacks to triton (listed in
    ``Engine.mode_routed``) instead of refusing them, and runs EAGLE chains and trees."""
    if not triton_mla(ForwardMode.EXTEND, False):
        pytest.skip("the triton backend is not available here")
    if torch.cuda.is_available():
        pytest.skip("CPU tensors; the GPU runtime tests cover flashmla")
    from specattn.spec_runtime.engine import Engine, SpecConfig
    from specattn.spec_runtime.mla_model import MLAConfig, MLAModel
    from specattn.spec_runtime.sampling import SamplingParams
    cfg = MLAConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, kv_lora_rank=512, qk_nope_head_dim=16,
                    qk_rope_head_dim=64, v_head_dim=16)
    model = MLAModel(cfg, seed=seed)
    spec = SpecConfig("eagle", topk, 2, 3, 1)
    eng = Engine(model, spec=spec, backend="flashmla", page_size=64, max_context=128, max_batch=2)
    want = ["target:EXTEND->triton", "draft:EXTEND->triton", "draft:DRAFT_EXTEND_V2->triton"]
    if topk != 1:
        want.append("target:TARGET_VERIFY->triton")
    assert sorted(eng.mode_routed) == sorted(want)
    tb = eng.target_backend
    assert isinstance(tb, RoutedBackend) and tb.name == "flashmla+triton"
    assert tb.backend_for(ForwardMode.DECODE).name == "flashmla"
    assert tb.backend_for(ForwardMode.TARGET_VERIFY).name == ("flashmla" if topk == 1 else "triton")
    res = eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4))
    assert [len(t) for t in res.tokens] == [4, 4]


# ------------------------------------------------------------------ GPU (real flash_mla, SM90)
TOL = 1e-2


def _real(sc, **kw):
    pytest.importorskip("flash_mla")
    why = FlashMLABackend.unavailable_reason()
    if why:
        pytest.skip(why)
    return create_backend("flashmla", sc.req_pool, sc.kv_pool, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_eager_on_gpu(mode, heads, seed):
    rng = random.Random(seed)
    sc = mla_scenario(mode, rng, device="cuda", dtype=torch.bfloat16, bs=rng.randint(1, 6),
                      num_heads=heads, max_prefix=rng.choice([0, 63, 64, 700, 4000]),
                      D=rng.choice([1, 2, 4, 8]))
    topk = None
    if mode == ForwardMode.TARGET_VERIFY and rng.random() < 0.5:
        topk = 1
        sc.batch.tree_mask = chain(sc.batch.num_tokens_per_req, sc.batch.batch_size, "cuda")
    be = _real(sc, topk=topk)
    if not be.supports(mode, graph=False, kind=AttentionKind.MLA):
        if not triton_mla(mode, False):
            pytest.skip(f"{mode.name} is not FlashMLA's and the triton backend is not available")
        be = routed(be, mode)                   # as the engine routes it
    q, k, _ = random_qkv(sc)
    be.init_forward_metadata(sc.batch)
    out = be.forward(q, k, None, sc.layer, sc.batch)
    assert torch.isfinite(out).all()
    err = rel_err(out, _reference(sc, q, k))
    assert err < TOL, f"relative error {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY], ids=lambda m: m.name)
@pytest.mark.parametrize("heads", [16, 128])
def test_cuda_graph_replay_on_gpu(mode, heads, seed):
    rng = random.Random(seed)
    padded_bs = 8
    D = 1 if mode == ForwardMode.DECODE else rng.choice([2, 4, 8])
    common = dict(D=D, capacity_bs=padded_bs, max_prefix=rng.choice([100, 3000]), num_heads=heads,
                  device="cuda", dtype=torch.bfloat16)
    first = mla_scenario(mode, rng, bs=padded_bs, **common)
    if mode == ForwardMode.TARGET_VERIFY:
        first.batch.tree_mask = chain(D, padded_bs, "cuda")
    be = _real(first, topk=1)
    be.init_cuda_graph_state(padded_bs, padded_bs * D)
    bufs = GraphInputBuffers(padded_bs, D, "cuda")
    layer = first.layer
    qs = torch.zeros(padded_bs * D, heads, layer.head_dim, device="cuda", dtype=torch.bfloat16)
    ks = torch.zeros(padded_bs * D, 1, layer.head_dim, device="cuda", dtype=torch.bfloat16)
    padded = bufs.fill(first.batch, padded_bs)
    be.init_forward_metadata_capture_cuda_graph(padded)
    g, out_static = capture_forward(be, qs, ks, None, layer, padded)  # scheduler buffers in the warm-up
    for trial in range(3):
        bs = rng.randint(1, padded_bs - 1) if trial < 2 else padded_bs
        sc = mla_scenario(mode, rng, bs=bs, **common)
        if mode == ForwardMode.TARGET_VERIFY:
            sc.batch.tree_mask = chain(D, bs, "cuda")
        q, k, _, n = load_trial(first, sc, qs, ks)
        padded = bufs.fill(sc.batch, padded_bs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            be.init_forward_metadata_replay_cuda_graph(padded)    # device work only
            out_static.fill_(float("nan"))
            g.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out = out_static[:n].clone()
        assert torch.isfinite(out).all(), f"bs {bs}"
        err = rel_err(out, _reference(sc, q, k))
        assert err < TOL, f"relative error {err} (bs {bs})"
