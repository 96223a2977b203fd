"""Backend edges: a forward refused for its metadata writes no KV, a pool write refuses
sources that share memory with the pool, NaN inputs give NaN (not a plausible value) in every
backend, split-KV included, and the reference never reads past a request's keys.

On a CPU-only machine the Triton backend runs in Triton's interpreter."""
import copy
import os
import random

import torch

if not torch.cuda.is_available():  # before triton / specattn's Triton kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from scenarios import make_scenario, random_qkv  # noqa: E402
from specattn.backends import ForwardMode, MHATokenToKVPool, MLATokenToKVPool, create_backend  # noqa: E402

pytest.importorskip("triton")
NAMES = ["torch_reference", "triton"]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _run(sc, name, q, k, v, **kw):
    s = copy.deepcopy(sc)
    be = create_backend(name, s.req_pool, s.kv_pool, **kw)
    be.init_forward_metadata(s.batch)
    return be.forward(q.clone(), k.clone(), v.clone(), s.layer, s.batch)


@pytest.mark.parametrize("name", NAMES)
def test_refused_forward_writes_no_kv(name, seed):
    """A forward without metadata, or with metadata of another mode of the same size, raises
    before this forward's K/V reach the pool."""
    rng = random.Random(seed)
    sc = make_scenario(ForwardMode.DECODE, bs=2, rng=rng, device=DEV)
    other = make_scenario(ForwardMode.DRAFT_EXTEND_V2, bs=2, rng=rng, device=DEV)
    be = create_backend(name, sc.req_pool, sc.kv_pool)
    q, k, v = random_qkv(sc)
    for build in (None, other.batch):
        if build is not None:
            try:
                be.init_forward_metadata(build)
            except ValueError:       # the other batch does not fit these pools: no metadata then
                continue
        before = [t.clone() for t in sc.kv_pool.buffers]
        with pytest.raises(RuntimeError, match="init_forward_metadata was not called"):
            be.forward(q, k, v, sc.layer, sc.batch)
        assert all(torch.equal(a, b) for a, b in zip(before, sc.kv_pool.buffers))


def test_set_kv_buffer_refuses_sources_in_the_pool():
    p = MHATokenToKVPool(8, 1, torch.float32, 1, 4, 1, DEV)
    new, loc = torch.ones(2, 1, 4, device=DEV), torch.tensor([1, 2], device=DEV)
    before = [t.clone() for t in p.buffers]
    with pytest.raises(ValueError, match="v_buffer and cache_v overlap"):
        p.set_kv_buffer(0, loc, new, p.v_buffer[0][2:4])
    with pytest.raises(ValueError, match="k_buffer and cache_k overlap"):
        p.set_kv_buffer(0, loc, p.k_buffer[0][2:4], new)
    assert all(torch.equal(a, b) for a, b in zip(before, p.buffers))          # nothing written
    m = MLATokenToKVPool(8, 1, torch.float32, 1, DEV, kv_lora_rank=16, qk_rope_head_dim=16)
    with pytest.raises(ValueError, match="kv_buffer and cache_k overlap"):
        m.set_kv_buffer(0, loc, m.kv_buffer[0][3:5])
    p.set_kv_buffer(0, loc, new, new)                                          # k and v one tensor: fine
    assert torch.equal(p.k_buffer[0][1:3], new) and torch.equal(p.v_buffer[0][1:3], new)


@pytest.mark.parametrize("splits", [1, 4])
def test_nan_inputs_give_nan_in_every_backend(seed, splits):
    """A NaN query, or a NaN key the row sees (in one of several KV splits), makes the row NaN
    in both backends: the Triton kernels read ``l == 0`` as an empty row and let a NaN
    through the split merge, where they had returned zeros or dropped the split."""
    rng = random.Random(seed)
    sc = make_scenario(ForwardMode.DECODE, bs=1, prefix_lens=[40], max_prefix=40, rng=rng, device=DEV)
    q, k, v = random_qkv(sc)
    q[0, 0] = float("nan")
    for name in NAMES:
        kw = {"num_kv_splits": splits} if name == "triton" else {}
        o = _run(sc, name, q, k, v, **kw)
        assert torch.isnan(o[0, 0]).all() and not torch.isnan(o[0, 1:]).any(), name
    q, k, v = random_qkv(sc)
    slot = sc.req_pool.req_to_token[sc.batch.req_pool_indices[0], 5].long()
    sc.kv_pool.get_key_buffer(sc.layer.layer_id)[slot] = float("nan")
    for name in NAMES:
        kw = {"num_kv_splits": splits} if name == "triton" else {}
        assert torch.isnan(_run(sc, name, q, k, v, **kw)).all(), name


def test_reference_reads_no_slot_past_a_request(seed):
    """NaN in a slot no request owns (slot 0, where padded graph rows write) stays out of
    every row: the reference's gathered width past a request's keys reads as 0."""
    sc = make_scenario(ForwardMode.DECODE, bs=2, prefix_lens=[6, 1], rng=random.Random(seed), device=DEV)
    sc.kv_pool.get_value_buffer(sc.layer.layer_id)[0] = float("nan")
    q, k, v = random_qkv(sc)
    for name in NAMES:
        assert not torch.isnan(_run(sc, name, q, k, v)).any(), name


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2], ids=lambda m: m.name)
def test_fixed_count_modes_need_equal_extend_lens(name, mode, seed):
    """In TARGET_VERIFY / DRAFT_EXTEND_V2 every request has ``num_tokens_per_req`` tokens (the
    graph path assumes it): eager metadata refuses lengths that differ even when their sum
    is the batch's token count."""
    sc = make_scenario(mode, bs=2, D=4, rng=random.Random(seed), device=DEV)
    be = create_backend(name, sc.req_pool, sc.kv_pool)
    be.init_forward_metadata(sc.batch)                                           # as built: fine
    uneven = torch.tensor([3, 5], dtype=sc.batch.extend_lens.dtype)
    sc.batch.extend_lens = uneven.to(DEV)
    if sc.batch.extend_lens_cpu is not None:
        sc.batch.extend_lens_cpu = uneven
    with pytest.raises(ValueError, match="needs extend_lens == num_tokens_per_req = 4"):
        be.init_forward_metadata(sc.batch)


def test_kernel_out_must_not_overlap_the_caches(seed):
    """``paged_attention`` / ``mla_paged_attention`` with an ``out`` that shares memory with a
    cache they read raise before the launch (``out`` aliasing ``q`` stays allowed)."""
    from specattn.triton_kernels.attention import paged_attention
    from specattn.triton_kernels.attention_mla import mla_paged_attention
    g = torch.Generator().manual_seed(seed)
    rtt, rpi = torch.arange(16, dtype=torch.int32)[None].contiguous(), torch.tensor([0])
    meta = (rtt, rpi, torch.tensor([3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), None, 1, 0.25)
    kc, vc = torch.randn(16, 4, 16, generator=g), torch.randn(16, 4, 16, generator=g)
    q = torch.randn(1, 4, 16, generator=g)
    with pytest.raises(ValueError, match="out overlaps v_cache"):
        paged_attention(q, kc, vc, *meta, out=vc[5:6])
    ref = paged_attention(q, kc, vc, *meta)
    assert torch.equal(paged_attention(q, kc, vc, *meta, out=q), ref)     # out = q: fine
    kv = torch.randn(16, 1, 32, generator=g)
    with pytest.raises(ValueError, match="out overlaps kv_cache"):
        mla_paged_attention(torch.randn(1, 1, 32, generator=g), kv, *meta, 16, out=kv[2:3, :, :16])
