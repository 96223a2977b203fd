"""Shared cases for the Triton backend tests (MHA/GQA and MLA): eager comparison against
TorchReferenceBackend, and the CUDA-graph case (capture at a padded batch size, replay with
fresh smaller live batches, outputs poisoned), EXTEND included (static token count, padded
requests with ``n = 0``).  Importing this module does not import triton."""
from __future__ import annotations

import random
from typing import Optional

import torch

from scenarios import load_trial, make_scenario, random_qkv
from specattn.backends import ForwardBatch, ForwardMode, GraphInputBuffers, TorchReferenceBackend

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def run_both(sc, splits=None, q=None, kernel_config=None):
    """Triton forward (writes this batch's KV) then the reference on the same cache."""
    from specattn.backends.triton_backend import TritonBackend
    q0, k, v = random_qkv(sc)
    q = q0 if q is None else q
    tri = TritonBackend(sc.req_pool, sc.kv_pool, num_kv_splits=splits, kernel_config=kernel_config)
    tri.init_forward_metadata(sc.batch)
    out = tri.forward(q, k, v, sc.layer, sc.batch)
    ref = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    ref.init_forward_metadata(sc.batch)
    expect = ref.forward(q, k, v, sc.layer, sc.batch, save_kv_cache=False)
    assert out.dtype == q.dtype and out.shape == expect.shape
    assert torch.isfinite(out).all()
    return out, expect, q


def check(sc, splits=None, tol=None, kernel_config=None):
    out, expect, _ = run_both(sc, splits, kernel_config=kernel_config)
    err = rel_err(out, expect)
    assert err < (tol or TOL[sc.q_dtype]), f"relative error {err}"


def graph_case(kind: str, mode: ForwardMode, page_size: int, device, use_graph: bool, seed: int, *,
               dtype=torch.float32, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64,
               kv_lora_rank: int = 32, qk_rope_head_dim: int = 16, D: int = 5,
               splits: Optional[int] = None, max_prefix: int = 20, padded_bs: int = 4,
               ext_max: int = 7, kernel_config: Optional[dict] = None, trials: int = 2,
               kv_scales=(1.0, 1.0)) -> None:
    """Capture at ``padded_bs`` (from a full random batch), then ``trials`` replays with fresh
    live batches of bs ``1..padded_bs`` (the first strictly smaller), each checked against the
    reference backend run eagerly on the live batch.  EXTEND: live requests have
    ``1..ext_max`` tokens, the static token count is ``padded_bs * ext_max``.  With
    ``use_graph`` a real CUDA graph is captured and replayed under sync-debug "error" with its
    output poisoned; else only the capture/replay metadata path runs (CPU)."""
    from specattn.backends.triton_backend import TritonBackend
    rng = random.Random(seed)
    ext = mode == ForwardMode.EXTEND
    D = 1 if mode == ForwardMode.DECODE else (ext_max if ext else D)
    T_static = padded_bs * D
    kw = dict(kind=kind, D=D, page_size=page_size, device=device, rng=rng, capacity_bs=padded_bs,
              dtype=dtype, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
              kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, max_prefix=max_prefix,
              kv_scales=kv_scales)

    def scenario(bs):
        lens = [rng.randint(1, ext_max) for _ in range(bs)] if ext else None
        return make_scenario(mode, bs=bs, extend_lens=lens, **kw)

    first = scenario(padded_bs)
    be = TritonBackend(first.req_pool, first.kv_pool, num_kv_splits=splits, kernel_config=kernel_config)
    be.init_cuda_graph_state(max_bs=padded_bs, max_num_tokens=T_static)
    bufs = GraphInputBuffers(padded_bs, D, device)  # EXTEND: padded_bs * D tokens in all
    layer = first.layer
    qd = first.q_dtype
    q_static = torch.zeros(T_static, layer.num_heads, layer.head_dim, device=device, dtype=qd)
    k_static = torch.zeros(T_static, layer.num_kv_heads, layer.head_dim, device=device, dtype=qd)
    v_static = None if kind == "mla" else \
        torch.zeros(T_static, layer.num_kv_heads, layer.v_head_dim, device=device, dtype=qd)

    def run(b):
        return be.forward(q_static, k_static, v_static, layer, b)

    padded = bufs.fill(first.batch, padded_bs)
    be.init_forward_metadata_capture_cuda_graph(padded)
    captured = be.forward_metadata
    if use_graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run(padded)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out_static = run(padded)
    for trial in range(trials):
        bs = rng.randint(1, padded_bs - 1) if trial == 0 and padded_bs > 1 else rng.randint(1, padded_bs)
        sc = scenario(bs)
        q, k, v, T = load_trial(first, sc, q_static, k_static, v_static)  # garbage in padded rows
        padded = bufs.fill(sc.batch, padded_bs)
        if use_graph:
            torch.cuda.set_sync_debug_mode("error")
            try:
                be.init_forward_metadata_replay_cuda_graph(padded)
                out_static.fill_(float("nan"))
                g.replay()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            out = out_static[:T].clone()
        else:
            be.init_forward_metadata_replay_cuda_graph(padded)
            out = run(padded)[:T]
        md = be.forward_metadata
        for name in ("qo_indptr", "prefix_lens", "req_pool_indices"):  # the static buffers
            assert getattr(md, name).data_ptr() == getattr(captured, name).data_ptr()
        assert md.max_q == captured.max_q
        ref = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
        ref.init_forward_metadata(sc.batch)
        expect = ref.forward(q, k, v, layer, sc.batch)  # writes the live batch's KV (same values)
        assert torch.isfinite(out).all(), f"bs {bs}: non-finite rows"
        err = rel_err(out, expect)
        assert err < TOL[qd], f"relative error {err} (bs {bs}, seed {seed})"
