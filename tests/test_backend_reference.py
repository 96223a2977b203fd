"""TorchReferenceBackend against an independent naive formula, every mode x kind x page size,
eager and the graph builders (capture/replay metadata paths; real CUDA graphs on GPU)."""
import dataclasses
import random

import pytest
import torch

from scenarios import load_trial, make_scenario, naive_attention, random_qkv
from specattn.backends import (AttentionKind, ForwardBatch, ForwardMode, GraphInputBuffers,
                               TorchReferenceBackend, UnsupportedError)

MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]
GRAPH_MODES = [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]


def _check(sc, out, q, tol=1e-5):
    ref = naive_attention(sc, q)
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-12)
    assert err < tol, f"relative error {err}"


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bs", [1, 3])
def test_eager_matches_naive(mode, kind, page_size, bs, seed):
    sc = make_scenario(mode, kind=kind, bs=bs, page_size=page_size, D=random.Random(seed).choice([1, 4, 7]),
                       num_heads=4, num_kv_heads=random.Random(seed).choice([1, 2, 4]) if kind == "mha" else 1)
    be = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    q, k, v = random_qkv(sc)
    be.init_forward_metadata(sc.batch)
    out = be.forward(q, k, v, sc.layer, sc.batch)
    # the new KV landed at out_cache_loc
    cache = sc.kv_pool.get_key_buffer(sc.layer.layer_id)
    assert torch.equal(cache[sc.batch.out_cache_loc], k)
    _check(sc, out, q)


def test_gqa_groups_use_their_own_kv_head(seed):
    sc = make_scenario(ForwardMode.DECODE, bs=2, num_heads=8, num_kv_heads=2)
    be = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    q, k, v = random_qkv(sc)
    be.init_forward_metadata(sc.batch)
    _check(sc, be.forward(q, k, v, sc.layer, sc.batch), q)


def test_tree_mask_changes_the_output(seed):
    """Flipping one visible ancestor bit changes exactly that token's output."""
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=1, D=4, max_prefix=3)
    be = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    q, k, v = random_qkv(sc)
    be.init_forward_metadata(sc.batch)
    out1 = be.forward(q, k, v, sc.layer, sc.batch)
    sc.batch.tree_mask[0, 3, 0] ^= 1  # token 3 toggles its view of the root
    be.init_forward_metadata(sc.batch)
    out2 = be.forward(q, k, v, sc.layer, sc.batch, save_kv_cache=False)
    assert torch.equal(out1[:3], out2[:3])
    assert not torch.allclose(out1[3], out2[3])


def test_idle_and_empty():
    sc = make_scenario(ForwardMode.IDLE)
    be = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    be.init_forward_metadata(sc.batch)
    q = torch.randn(0, sc.layer.num_heads, sc.layer.head_dim)
    out = be.forward(q, None, None, sc.layer, sc.batch)
    assert out.shape == (0, sc.layer.num_heads, sc.layer.v_head_dim)


def test_bad_inputs_raise():
    sc = make_scenario(ForwardMode.DECODE, bs=2)
    be = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    q, k, v = random_qkv(sc)
    be.init_forward_metadata(sc.batch)
    with pytest.raises(ValueError):
        be.forward(q[:1], k, v, sc.layer, sc.batch)
    with pytest.raises(ValueError):
        be.forward(q, k[:, :1], v, sc.layer, sc.batch)
    bad = sc.batch.out_cache_loc.clone()
    sc.batch.out_cache_loc[0] = sc.kv_pool.num_slots  # out of range: raise before any write
    before = [b.clone() for b in sc.kv_pool.buffers]
    with pytest.raises(IndexError):
        be.forward(q, k, v, sc.layer, sc.batch)
    assert all(torch.equal(a, b) for a, b in zip(before, sc.kv_pool.buffers))
    sc.batch.out_cache_loc.copy_(bad)


def test_stale_metadata_and_unreadable_slots_are_refused(seed):
    """A forward on a batch of another token count than the metadata's raises, and eager
    metadata refuses a slot past the KV pool and stale host copies of the lengths."""
    rng = random.Random(seed)
    sc = make_scenario(ForwardMode.EXTEND, bs=2, extend_lens=[3, 2], rng=rng)
    be = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    b = sc.batch
    be.init_forward_metadata(b)
    other = ForwardBatch.extend(b.req_pool_indices, b.prefix_lens, torch.ones(2, dtype=torch.int32),
                                b.out_cache_loc[:2])
    q = torch.randn(2, sc.layer.num_heads, sc.layer.head_dim)
    with pytest.raises(RuntimeError, match="init_forward_metadata was not called"):
        be.forward(q, None, None, sc.layer, other, save_kv_cache=False)
    with pytest.raises(ValueError, match="host copies"):
        be.init_forward_metadata(dataclasses.replace(b, extend_lens=b.extend_lens.flip(0)))
    rtt = sc.req_pool.req_to_token
    r0, p0 = int(b.req_pool_indices[0]), int(b.prefix_lens[0])
    saved = int(rtt[r0, p0])
    rtt[r0, p0] = sc.kv_pool.num_slots
    with pytest.raises(ValueError, match="outside the KV pool"):
        be.init_forward_metadata(b)
    rtt[r0, p0] = saved
    be.init_forward_metadata(b)


def test_supports():
    for kind in AttentionKind:
        for mode in ForwardMode:
            assert TorchReferenceBackend.supports(mode, graph=False, kind=kind)
            assert TorchReferenceBackend.supports(mode, graph=True, kind=kind) == (mode != ForwardMode.EXTEND)
    sc = make_scenario(ForwardMode.EXTEND)
    be = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    be.init_cuda_graph_state(4, 32)
    with pytest.raises(ValueError):
        be.init_forward_metadata_capture_cuda_graph(sc.batch)


def _graph_case(mode, kind, page_size, device, use_graph, seed):
    """Capture at padded bs 4, replay twice with fresh live batches of bs 1..4."""
    rng = random.Random(seed)
    D = 1 if mode == ForwardMode.DECODE else 5
    first = make_scenario(mode, kind=kind, bs=4, D=D, page_size=page_size, device=device, rng=rng, capacity_bs=4)
    be = TorchReferenceBackend(first.req_pool, first.kv_pool)
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4 * D)
    bufs = GraphInputBuffers(4, D, device)
    layer = first.layer
    q_static = torch.zeros(4 * D, layer.num_heads, layer.head_dim, device=device)
    k_static = torch.zeros(4 * D, layer.num_kv_heads, layer.head_dim, device=device)
    v_static = torch.zeros(4 * D, layer.num_kv_heads, layer.v_head_dim, device=device)

    def run(b):
        return be.forward(q_static, k_static, None if kind == "mla" else v_static, layer, b)

    padded = bufs.fill(first.batch, 4)
    be.init_forward_metadata_capture_cuda_graph(padded)
    if use_graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run(padded)  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out_static = run(padded)
    for trial in range(2):
        bs = rng.randint(1, 4)
        sc = make_scenario(mode, kind=kind, bs=bs, D=D, page_size=page_size, device=device, rng=rng, capacity_bs=4)
        # live batch lives in the captured pools; garbage in the padded rows
        q, k, v, T = load_trial(first, sc, q_static, k_static, v_static)
        padded = bufs.fill(sc.batch, 4)
        be.init_forward_metadata_replay_cuda_graph(padded)
        if use_graph:
            out_static.fill_(float("nan"))
            g.replay()
            out = out_static[:T].clone()
        else:
            out = run(padded)[:T]
        _check(sc, out, q)


@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_builders_on_cpu(mode, kind, page_size, seed):
    """The capture/replay metadata path (static buffers, padding) without a real graph."""
    _graph_case(mode, kind, page_size, "cpu", False, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_replay(mode, kind, page_size, seed):
    _graph_case(mode, kind, page_size, "cuda", True, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_eager_on_gpu(mode, kind, seed):
    sc = make_scenario(mode, kind=kind, bs=3, page_size=16, device="cuda", dtype=torch.bfloat16)
    be = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    q, k, v = random_qkv(sc)
    be.init_forward_metadata(sc.batch)
    _check(sc, be.forward(q, k, v, sc.layer, sc.batch), q, tol=1e-2)
