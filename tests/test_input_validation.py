"""Bad input to the attention launchers, the Triton backend and the small ops is refused with
a named Python error before any kernel runs: strided metadata the kernels would read at
stride 1, a wrong ``out``, mismatched caches, unsupported dtypes, a slot table that breaks
the page layout, stale or inconsistent batch metadata, a layer that does not fit the pool,
aliasing KV buffers, and integer values an int32 output would wrap.  CPU (Triton's
interpreter for the kernels that do run)."""
import dataclasses
import os
import random

import torch

if not torch.cuda.is_available():  # before triton / the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from scenarios import make_scenario, strided_view  # noqa: E402
from specattn import ops  # noqa: E402
from specattn.backends import ForwardBatch, ForwardMode, ReqToTokenPool  # noqa: E402
from specattn.backends.triton_backend import TritonBackend  # noqa: E402
from specattn.triton_kernels.attention import paged_attention  # noqa: E402
from specattn.triton_kernels.attention_mla import mla_paged_attention  # noqa: E402


def _launch_args(seed, kind="mha"):
    sc = make_scenario(ForwardMode.EXTEND, kind=kind, bs=2, rng=random.Random(seed), max_prefix=12)
    b = sc.batch
    qo = torch.zeros(b.batch_size + 1, dtype=torch.int32)
    qo[1:] = torch.cumsum(b.extend_lens, 0)
    q = torch.randn(b.num_tokens, sc.layer.num_heads, sc.layer.head_dim)
    meta = dict(req_to_token=sc.req_pool.req_to_token, req_pool_indices=b.req_pool_indices.clone(),
                prefix_lens=b.prefix_lens.int().clone(), qo_indptr=qo, tree_mask=None,
                max_q=int(b.extend_lens.max()), sm_scale=0.2)
    return sc, q, meta


def _mha(sc, q, meta, **kw):
    return paged_attention(q, sc.kv_pool.get_key_buffer(1), sc.kv_pool.get_value_buffer(1), **{**meta, **kw})


def test_launchers_refuse_strided_metadata(seed):
    for kind in ("mha", "mla"):
        sc, q, meta = _launch_args(seed, kind)
        for name in ("req_pool_indices", "prefix_lens", "qo_indptr"):
            bad = {**meta, name: strided_view(meta[name])}
            with pytest.raises(ValueError, match=f"{name} must be contiguous"):
                if kind == "mha":
                    _mha(sc, q, bad)
                else:
                    mla_paged_attention(q, sc.kv_pool.get_key_buffer(1), **bad, kv_lora_rank=32)


def test_mha_launcher_checks_out_caches_and_dtypes(seed):
    sc, q, meta = _launch_args(seed)
    k, v = sc.kv_pool.get_key_buffer(1), sc.kv_pool.get_value_buffer(1)
    T, H, Dv = q.shape[0], q.shape[1], v.shape[2]
    good = _mha(sc, q, meta)
    for out in (torch.empty(T - 1, H, Dv), torch.empty(T, 1, Dv), torch.empty(T, H, 2 * Dv)[..., ::2],
                torch.empty(T, H, Dv, dtype=torch.int32)):
        with pytest.raises(ValueError, match="out must be"):
            _mha(sc, q, meta, out=out)
    out = torch.full((T, H, Dv), float("nan"))
    assert _mha(sc, q, meta, out=out) is out and torch.equal(out, good)
    with pytest.raises(ValueError, match="slots"):
        paged_attention(q, k, v[: v.shape[0] // 2], **meta)
    for bad_q in (q.int(), q.double()):
        with pytest.raises(ValueError, match="q must be"):
            paged_attention(bad_q, k, v, **meta)
    with pytest.raises(ValueError, match="KV cache must be"):
        paged_attention(q, k.to(torch.int8), v.to(torch.int8), **meta)
    with pytest.raises(ValueError, match="3-D"):
        paged_attention(q, k.flatten(1), v, **meta)


def test_launchers_check_the_page_layout(seed):
    """With ``page_size > 1`` a position ``p`` must sit at a slot ``s`` with ``s % page_size ==
    p % page_size``; an aligned table (pages in any order) passes."""
    sc, q, meta = _launch_args(seed)
    rtt = meta["req_to_token"].clone()
    ps = 4
    for r in meta["req_pool_indices"].tolist():
        pages = torch.randperm(rtt.shape[1] // ps + 1)[: -(-rtt.shape[1] // ps)]
        rtt[r] = (pages[:, None] * ps + torch.arange(ps)).flatten()[: rtt.shape[1]]
    assert int(rtt.max()) < sc.kv_pool.get_key_buffer(1).shape[0]     # the pool holds every page
    ok = _mha(sc, q, {**meta, "req_to_token": rtt}, page_size=ps)
    assert torch.isfinite(ok).all()
    r0 = int(meta["req_pool_indices"][0])
    rtt[r0, 0] ^= 1                                # the same page, another offset
    with pytest.raises(ValueError, match="paged layout"):
        _mha(sc, q, {**meta, "req_to_token": rtt}, page_size=ps)


def _backend(seed, mode=ForwardMode.EXTEND, kind="mha", **kw):
    sc = make_scenario(mode, kind=kind, bs=2, rng=random.Random(seed), max_prefix=12, **kw)
    be = TritonBackend(sc.req_pool, sc.kv_pool)
    return sc, be


def test_backend_refuses_stale_metadata_of_another_token_count(seed):
    sc, be = _backend(seed, extend_lens=[3, 2])
    b = sc.batch
    be.init_forward_metadata(b)
    n1 = torch.ones(b.batch_size, dtype=torch.int32)
    other = ForwardBatch.extend(b.req_pool_indices, b.prefix_lens, n1, b.out_cache_loc[: b.batch_size])
    q = torch.randn(other.num_tokens, sc.layer.num_heads, sc.layer.head_dim)
    with pytest.raises(RuntimeError, match="init_forward_metadata was not called"):
        be.forward(q, None, None, sc.layer, other, save_kv_cache=False)


def test_backend_refuses_inconsistent_batches(seed):
    sc, be = _backend(seed)
    b = sc.batch
    rows, P, loc = b.req_pool_indices, b.prefix_lens, b.out_cache_loc
    n = b.extend_lens
    with pytest.raises(ValueError, match="prefix_lens must be >= 0"):     # the constructors refuse them
        ForwardBatch.extend(rows, torch.tensor([-3, 1]), n, loc)
    with pytest.raises(ValueError, match="extend_lens must be >= 0"):
        ForwardBatch.extend(rows, P, torch.tensor([int(n.sum()) + 1, -1]), loc, positions=torch.zeros_like(loc))
    neg_p = torch.tensor([-3, 1], dtype=torch.int32)
    neg_n = torch.tensor([int(n.sum()) + 1, -1], dtype=torch.int32)
    cases = [
        (ForwardBatch.extend(rows, P, n + 1, loc, positions=torch.zeros_like(loc)), "sum\\(extend_lens\\)"),
        (dataclasses.replace(b, prefix_lens=neg_p, prefix_lens_cpu=neg_p.clone()), ">= 0"),  # built by hand
        (dataclasses.replace(b, extend_lens=neg_n, extend_lens_cpu=neg_n.clone()), ">= 0"),
        (ForwardBatch.decode(rows, P[:1], loc[:2]), "prefix_lens"),
    ]
    for batch, match in cases:
        with pytest.raises(ValueError, match=match):
            be.init_forward_metadata(batch)
    stale = dataclasses.replace(b, prefix_lens=b.prefix_lens + 1)     # host copies left as they were
    with pytest.raises(ValueError, match="host copies"):
        be.init_forward_metadata(stale)
    rtt = sc.req_pool.req_to_token
    r0, p0 = int(rows[0]), int(P[0])
    saved = int(rtt[r0, p0])
    rtt[r0, p0] = sc.kv_pool.get_key_buffer(0).shape[0] + 3            # a slot past the pool
    with pytest.raises(ValueError, match="outside the KV pool"):
        be.init_forward_metadata(b)
    rtt[r0, p0] = saved
    be.init_forward_metadata(b)                                         # the batch itself is fine


def test_graph_metadata_checks_the_batch_layout(seed):
    sc, be = _backend(seed, ForwardMode.TARGET_VERIFY, D=3)
    b = sc.batch
    be.init_cuda_graph_state(2, 6)
    be.init_forward_metadata_capture_cuda_graph(b)
    for bad, match in ((dataclasses.replace(b, tree_mask=b.tree_mask.bool()), "tree_mask"),
                       (dataclasses.replace(b, tree_mask=b.tree_mask[:1]), "tree_mask"),
                       (dataclasses.replace(b, tree_mask=None), "tree_mask"),
                       (dataclasses.replace(b, prefix_lens=b.prefix_lens[:1]), "prefix_lens")):
        with pytest.raises(ValueError, match=match):
            be.init_forward_metadata_replay_cuda_graph(bad)


def test_forward_checks_the_layer_against_the_pool(seed):
    for kind in ("mha", "mla"):
        sc, be = _backend(seed, kind=kind)
        be.init_forward_metadata(sc.batch)
        lay = sc.layer
        T = sc.batch.num_tokens
        q = torch.randn(T, lay.num_heads, lay.head_dim)
        bad = [dataclasses.replace(lay, layer_id=-1), dataclasses.replace(lay, layer_id=lay.layer_id + 1)]
        if kind == "mha":
            bad.append(dataclasses.replace(lay, v_head_dim=lay.v_head_dim // 2))
        else:
            bad.append(dataclasses.replace(lay, kv_lora_rank=16, qk_rope_head_dim=32))
        for layer in bad:
            with pytest.raises(ValueError, match="layer"):
                be.forward(q, None, None, layer, sc.batch, save_kv_cache=False)
        assert be.forward(q, None, None, lay, sc.batch, save_kv_cache=False).shape[-1] == lay.v_head_dim


def test_small_argument_checks():
    sc = make_scenario(ForwardMode.DECODE, bs=1)
    for bad in (2.5, True, 0, 65):
        with pytest.raises(ValueError, match="num_kv_splits"):
            TritonBackend(sc.req_pool, sc.kv_pool, num_kv_splits=bad)
    pool = ReqToTokenPool(4, 8, "cpu")
    with pytest.raises(ValueError, match="n must be"):
        pool.alloc(-1)
    assert pool.alloc(0) == [] and len(pool.alloc(4)) == 4 and pool.alloc(1) is None


# ------------------------------------------------------------------------- small ops
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_move_kv_cache_refuses_aliasing_buffers(impl):
    buf = torch.arange(16.).view(8, 2)
    tgt, src = torch.tensor([0, 1]), torch.tensor([1, 0])
    for buffers in ([buf, buf], [torch.zeros(8, 2), buf, buf.view(8, 1, 2)]):
        with pytest.raises(ValueError, match="share memory"):
            ops.move_kv_cache(buffers, tgt, src, impl=impl)
    big = torch.zeros(24, 2)
    with pytest.raises(ValueError, match="share memory"):    # one buffer inside another's bytes
        ops.move_kv_cache([big.view(8, 6), big[4:12]], tgt, src, impl=impl)
    with pytest.raises(ValueError, match="slot dimension"):
        ops.move_kv_cache([torch.tensor(1.0)], tgt, src, impl=impl)
    a, b = torch.arange(16.).view(8, 2), torch.arange(16.).view(8, 2) + 100   # disjoint: fine
    ops.move_kv_cache([a, b], tgt, src, impl=impl)
    assert a[0].tolist() == [2.0, 3.0] and b[1].tolist() == [100.0, 101.0]


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_int32_outputs_refuse_values_they_cannot_hold(impl):
    D = 3
    cand = torch.tensor([[5, 6, 7]])
    ridx = torch.arange(D)[None]
    nxt = torch.tensor([[1, 2, -1]])
    sib = torch.full((1, D), -1)
    for tp, ok in (([[6, 7, 2**31]], False), ([[6, 7, 2**31 - 1]], True), ([[6, 7, -2**31]], True)):
        args = (cand, ridx, nxt, sib, torch.tensor(tp), D - 1)
        if ok:
            assert ops.verify_tree_greedy(*args, impl=impl).accept_length.tolist() == [2]
        else:
            with pytest.raises(IndexError, match="target_predict"):
                ops.verify_tree_greedy(*args, impl=impl)
    rtt = torch.zeros(4, 6, dtype=torch.int32)
    fork = dict(src_rows=torch.tensor([[0]]), dst_rows=torch.tensor([[1]]), first_col=torch.tensor([0]), num_cols=2,
                new_col=torch.tensor([2]))
    with pytest.raises(IndexError, match="new_slots"):
        ops.fork_req_to_token_rows(rtt, **fork, new_slots=torch.tensor([[2**32 + 5]]), impl=impl)
    ops.fork_req_to_token_rows(rtt, **fork, new_slots=torch.tensor([[2**31 - 1]]), impl=impl)
    assert int(rtt[1, 2]) == 2**31 - 1


def _small(name):
    from specattn.backends import MHATokenToKVPool, create_backend
    rp = ReqToTokenPool(4, 16)
    kp = MHATokenToKVPool(64, 1, torch.float32, 1, 16, 2)
    rp.write(0, 0, torch.tensor([1, 2, 3, 4, 5, 6]))
    rp.write(1, 0, torch.tensor([7, 8, 9, 10, 11, 12]))
    return rp, kp, create_backend(name, rp, kp)


@pytest.mark.parametrize("name", ["torch_reference", "triton"])
def test_a_refused_batch_never_runs_on_old_metadata(name):
    """After an init_forward_metadata that raised, forward raises instead of running the
    refused batch on the previous batch's metadata (it used to write the KV and attend)."""
    from specattn.backends import AttentionLayer
    rp, kp, be = _small(name)
    lay = AttentionLayer.mha(0, 2, 1, 16)
    good = ForwardBatch.decode([0, 1], [3, 3], [4, 10])
    q, k, v = torch.randn(2, 2, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    be.init_forward_metadata(good)
    be.forward(q, k, v, lay, good)
    bad = ForwardBatch.decode([0, 1], [16, 3], [4, 10])          # P + 1 = 17 > req_to_token's 16
    with pytest.raises(ValueError):
        be.init_forward_metadata(bad)
    before = kp.get_key_buffer(0).clone()
    with pytest.raises(RuntimeError, match="init_forward_metadata was not called"):
        be.forward(q, k, v, lay, bad)
    assert torch.equal(kp.get_key_buffer(0), before)


@pytest.mark.parametrize("name", ["torch_reference", "triton"])
def test_forward_checks_q_and_the_layer_before_writing_kv(name):
    from specattn.backends import AttentionKind, AttentionLayer
    rp, kp, be = _small(name)
    good = ForwardBatch.decode([0, 1], [3, 3], [4, 10])
    be.init_forward_metadata(good)
    k, v = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    before = kp.get_key_buffer(0).clone()
    for q in (torch.randn(2, 2, 16).round().long(), torch.randn(2, 2, 16) > 0, torch.randn(2, 2, 16).double()):
        with pytest.raises(ValueError, match="q must be a float32, bfloat16 or float16 tensor"):
            be.forward(q, k, v, AttentionLayer.mha(0, 2, 1, 16), good)
    odd = AttentionLayer(0, AttentionKind.MHA, 3, 2, 16, 16, 0.25)    # 2 KV heads do not divide 3
    with pytest.raises(ValueError, match="must divide layer.num_heads"):
        be.forward(torch.randn(2, 3, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16), odd, good)
    assert torch.equal(kp.get_key_buffer(0), before)


def test_reference_backend_refuses_what_triton_refuses():
    """The oracle checks the batch layout like the Triton backend (it used to run a DECODE
    batch of two tokens per request as an extend, or leave an extra token's output zero)."""
    rp, kp, ref = _small("torch_reference")
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)   # noqa: E731
    extra = ForwardBatch(ForwardMode.EXTEND, torch.tensor([0, 1]), i32([3, 3]), i32([2, 1]),
                         torch.tensor([4, 5, 10, 11]), torch.tensor([3, 4, 3, 4]))
    two = ForwardBatch(ForwardMode.DECODE, torch.tensor([0, 1]), i32([3, 3]), i32([2, 2]),
                       torch.tensor([4, 5, 10, 11]), torch.tensor([3, 4, 3, 4]))
    page0 = ForwardBatch.decode([0, 1], [3, 3], [0, 0])     # slots req_to_token does not list (page 0)
    for batch, match in ((extra, r"sum\(extend_lens\)"), (two, "DECODE needs extend_lens == 1"),
                         (page0, r"req_to_token\[0, 3:4\] != out_cache_loc")):
        with pytest.raises(ValueError, match=match):
            ref.init_forward_metadata(batch)


def test_layer_and_mla_pool_dims():
    from specattn.backends import AttentionKind, AttentionLayer, MLATokenToKVPool, create_backend
    for kw, match in ((dict(head_dim=-16), "head_dim must be >= 1"), (dict(head_dim=16, v_head_dim=0),
                      "v_head_dim must be >= 1"), (dict(head_dim=16, scaling=float("nan")), "scaling"),
                      (dict(head_dim=16, scaling=0.0), "scaling")):
        with pytest.raises(ValueError, match=match):
            AttentionLayer.mha(0, 2, 1, **kw)
    rp = ReqToTokenPool(2, 16)
    kp = MLATokenToKVPool(32, 1, torch.float32, 1, kv_lora_rank=16, qk_rope_head_dim=16)
    rp.write(0, 0, torch.tensor([1, 2, 3, 4]))
    be = create_backend("torch_reference", rp, kp)
    b = ForwardBatch.decode([0], [3], [4])
    be.init_forward_metadata(b)
    for lay, match in ((AttentionLayer(0, AttentionKind.MLA, 2, 1, 32, 8, 0.1, 16, 16), "v_head_dim = 8"),
                       (AttentionLayer(0, AttentionKind.MLA, 4, 2, 32, 16, 0.1, 16, 16), "num_kv_heads = 2"),
                       (AttentionLayer(0, AttentionKind.MLA, 2, 1, 40, 16, 0.1, 16, 16), "head_dim = 40")):
        with pytest.raises(ValueError, match=match):
            be.forward(torch.randn(1, lay.num_heads, lay.head_dim), torch.randn(1, 1, 32), None, lay, b)


def test_graph_buffers_refuse_fields_of_the_wrong_shape():
    from specattn.backends import GraphInputBuffers, pack_tree_mask
    gb = GraphInputBuffers(4, 4, "cpu")
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)   # noqa: E731
    chain = pack_tree_mask(torch.ones(3, 3, dtype=torch.bool).tril())
    broadcast = ForwardBatch(ForwardMode.TARGET_VERIFY, torch.tensor([0, 1]), i32([3, 3]), i32([3, 3]),
                             torch.tensor([4, 5, 6, 10, 11, 12]), torch.tensor([3, 4, 5, 3, 4, 5]),
                             num_tokens_per_req=3, tree_mask=chain[None])
    short = ForwardBatch(ForwardMode.DECODE, torch.tensor([0, 1]), i32([3, 3]), i32([1, 1]), torch.tensor([4]),
                         torch.tensor([3]))
    floats = ForwardBatch(ForwardMode.DECODE, torch.tensor([0, 1]), torch.tensor([3.7, 2.2]), i32([1, 1]),
                          torch.tensor([4, 10]), torch.tensor([3, 3]))
    before = gb.prefix_lens.clone()
    for batch, match in ((broadcast, "tree_mask"), (short, r"out_cache_loc must be an integer \[2\]"),
                         (floats, "prefix_lens must be an integer")):
        with pytest.raises(ValueError, match=match):
            gb.fill(batch, 2)
    assert torch.equal(gb.prefix_lens, before)
    with pytest.raises(ValueError, match="padded_bs must be an int"):
        gb.fill(ForwardBatch.decode([0, 1], [3, 3], [4, 10]), 2.0)
    with pytest.raises(ValueError, match="max_bs must be an int >= 1"):
        GraphInputBuffers(-1, 4, "cpu")


def test_tree_mask_bits_past_d_and_list_masks():
    from specattn.backends import pack_tree_mask
    chain = pack_tree_mask(torch.ones(3, 3, dtype=torch.bool).tril())
    b = ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, [0], [3], 3, [4, 5, 6], positions=[3, 4, 5],
                           tree_mask=chain.tolist() and [chain.tolist()])
    assert b.tree_mask.dtype == torch.int32
    b.validate()
    bad = chain.clone()
    bad[1, 0] |= 1 << 10
    with pytest.raises(ValueError, match="bits set past num_tokens_per_req = 3"):
        ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, [0], [3], 3, [4, 5, 6], positions=[3, 4, 5],
                           tree_mask=bad[None]).validate()


def test_routed_backend_argument_types():
    from specattn.backends import RoutedBackend
    _, _, ref = _small("torch_reference")
    for routes, error in (({2: ref}, TypeError), ({"TARGET_VERIFY": ref}, TypeError),
                          ({ForwardMode.DECODE: None}, TypeError), ([(ForwardMode.DECODE, ref)], TypeError)):
        with pytest.raises(error):
            RoutedBackend(ref, routes)
    with pytest.raises(TypeError, match="primary must be an AttentionBackend"):
        RoutedBackend("torch_reference", {})
