"""Random batches for backend tests, and a naive dense-attention oracle written
independently of the backends (per token, explicit key lists, float64)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional

import torch

from specattn.backends import (AttentionKind, AttentionLayer, ForwardBatch, ForwardMode, KVAllocator,
                               MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool, pack_tree_mask)


def strided_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (1-D) as every other element of a buffer whose other elements are poison
    (10**6): the same values at stride 2, so a kernel that reads it at stride 1 reads poison."""
    buf = torch.full((2 * t.shape[0],), 10**6, dtype=t.dtype, device=t.device)
    buf[::2] = t
    return buf[::2]


def random_tree_parents(D: int, rng: random.Random) -> List[int]:
    """parents[0] = -1 (root); parents[j] < j."""
    return [-1] + [rng.randrange(j) for j in range(1, D)]


def ancestors_mask(parents: List[int]) -> torch.Tensor:
    D = len(parents)
    m = torch.zeros(D, D, dtype=torch.bool)
    for j in range(D):
        a = j
        while a >= 0:
            m[j, a] = True
            a = parents[a]
    return m


def depths(parents: List[int]) -> List[int]:
    d = []
    for j, p in enumerate(parents):
        d.append(0 if p < 0 else d[p] + 1)
    return d


@dataclass
class Scenario:
    batch: ForwardBatch
    layer: AttentionLayer
    req_pool: ReqToTokenPool
    kv_pool: object
    tree_dense: Optional[torch.Tensor]   # [bs, D, D] bool for TARGET_VERIFY
    q_dtype: torch.dtype = torch.float32  # the model's dtype (q, new K/V); the pool's unless fp8


def make_scenario(mode: ForwardMode, *, kind="mha", bs=2, page_size=1, num_heads=4, num_kv_heads=2,
                  head_dim=16, max_prefix=20, D=5, num_layers=2, device="cpu", dtype=torch.float32,
                  rng: Optional[random.Random] = None, kv_lora_rank=32, qk_rope_head_dim=16,
                  prefix_lens=None, extend_lens=None, capacity_bs=None, kv_scales=(1.0, 1.0)) -> Scenario:
    """A random batch of ``mode`` over pools of ``dtype`` filled with random old KV.  An fp8
    pool (``torch.float8_e4m3fn``) gets ``kv_scales`` (``(k_scale, v_scale)``; MLA takes the
    first) and the scenario's ``q_dtype`` is bf16 on a GPU, float32 on the CPU (whose Triton
    interpreter has no correct bf16 dot)."""
    cap = max(capacity_bs or bs, bs)
    fp8 = dtype == torch.float8_e4m3fn
    q_dtype = (torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16) if fp8 else dtype
    rng = rng or random.Random(torch.randint(0, 2**31, ()).item())
    ctx = max_prefix + max(D, 8) + page_size
    req_pool = ReqToTokenPool(cap + 3, ctx, device)
    size = page_size * (cap * (-(-ctx // page_size)) + 2)
    if kind == "mha":
        pool = MHATokenToKVPool(size, page_size, dtype, num_kv_heads, head_dim, num_layers, device,
                                k_scale=kv_scales[0], v_scale=kv_scales[1])
        layer = AttentionLayer.mha(num_layers - 1, num_heads, num_kv_heads, head_dim)
    else:
        pool = MLATokenToKVPool(size, page_size, dtype, num_layers, device, kv_lora_rank, qk_rope_head_dim,
                                kv_scale=kv_scales[0])
        layer = AttentionLayer.mla(num_layers - 1, num_heads, kv_lora_rank, qk_rope_head_dim, scaling=0.1)
    for b in pool.buffers:                      # random old KV everywhere, prefixes included
        b.copy_(torch.randn_like(b, dtype=torch.float32).to(dtype))
    alloc = KVAllocator(size, page_size, device)
    rows = req_pool.alloc(bs)
    rng.shuffle(rows)
    P = prefix_lens or [rng.randrange(0, max_prefix + 1) for _ in range(bs)]
    if mode == ForwardMode.EXTEND:
        n = extend_lens or [rng.randrange(1, 8) for _ in range(bs)]
    elif mode == ForwardMode.DECODE:
        n = [1] * bs
    else:
        n = [D] * bs
    locs = []
    for r, p, k in zip(rows, P, n):
        slots = alloc.alloc(p + k)
        req_pool.write(r, 0, slots)
        locs.append(slots[p:])
    out_cache_loc = torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64, device=device)
    tree_dense = None
    if mode == ForwardMode.EXTEND:
        batch = ForwardBatch.extend(rows, P, n, out_cache_loc, device=device)
    elif mode == ForwardMode.DECODE:
        batch = ForwardBatch.decode(rows, P, out_cache_loc, device=device)
    elif mode == ForwardMode.TARGET_VERIFY:
        parents = [random_tree_parents(D, rng) for _ in range(bs)]
        tree_dense = torch.stack([ancestors_mask(pa) for pa in parents]) if bs else \
            torch.zeros(0, D, D, dtype=torch.bool)
        pos = [p + d for p, pa in zip(P, parents) for d in depths(pa)]
        batch = ForwardBatch.fixed(mode, rows, P, D, out_cache_loc, positions=pos,
                                   tree_mask=pack_tree_mask(tree_dense.to(device)), device=device)
    elif mode == ForwardMode.DRAFT_EXTEND_V2:
        batch = ForwardBatch.fixed(mode, rows, P, D, out_cache_loc, device=device)
    else:
        batch = ForwardBatch.idle(device)
    batch.validate(req_pool.req_to_token)
    return Scenario(batch, layer, req_pool, pool, tree_dense, q_dtype)


def capture_forward(backend, q, k, v, layer, batch):
    """One warm-up ``backend.forward`` on a side stream (backends plan there, outside any
    capture), then the same forward captured in a CUDA graph: ``(graph, static output)``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        backend.forward(q, k, v, layer, batch)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, layer, batch)
    return graph, out


def random_qkv(sc: Scenario, dtype=None):
    layer, T = sc.layer, sc.batch.num_tokens
    dev = sc.batch.device
    dtype = dtype or sc.q_dtype
    q = torch.randn(T, layer.num_heads, layer.head_dim, device=dev).to(dtype)
    k = torch.randn(T, layer.num_kv_heads, layer.head_dim, device=dev).to(dtype)
    v = None if layer.kind == AttentionKind.MLA else \
        torch.randn(T, layer.num_kv_heads, layer.v_head_dim, device=dev).to(dtype)
    return q, k, v


def load_trial(first: Scenario, sc: Scenario, qs: torch.Tensor, ks: torch.Tensor,
               vs: Optional[torch.Tensor] = None):
    """A graph test's replay trial: copy ``sc``'s KV and ``req_to_token`` into ``first``'s
    pools (the ones the captured backend reads) and point ``sc`` at them, draw ``q, k, v``
    for ``sc`` and write them into the first ``n`` rows of the static inputs ``qs, ks, vs``
    (every other row redrawn: padding must not matter; ``vs`` may be given for a kind without
    ``v``, MLA: it is only redrawn).  Returns ``(q, k, v, n)``."""
    for dst, src in zip(first.kv_pool.buffers, sc.kv_pool.buffers):
        dst.copy_(src)
    first.req_pool.req_to_token.copy_(sc.req_pool.req_to_token)
    sc.kv_pool, sc.req_pool = first.kv_pool, first.req_pool
    q, k, v = random_qkv(sc)
    n = sc.batch.num_tokens
    qs.normal_(), ks.normal_()
    qs[:n].copy_(q), ks[:n].copy_(k)
    if vs is not None:
        vs.normal_()
        if v is not None:
            vs[:n].copy_(v)
    return q, k, v, n


def naive_attention(sc: Scenario, q: torch.Tensor) -> torch.Tensor:
    """Per token: list the visible key positions by the mode table, gather them from the
    cache via req_to_token, softmax in float64.  Reads the cache as it is now (after the
    forward wrote this batch's KV)."""
    b, layer = sc.batch, sc.layer
    mode = b.forward_mode
    k_scale, v_scale = sc.kv_pool.kv_scales(layer.layer_id)
    kc = sc.kv_pool.get_key_buffer(layer.layer_id).double().cpu() * k_scale
    vc = sc.kv_pool.get_value_buffer(layer.layer_id).double().cpu() * v_scale
    rtt = sc.req_pool.req_to_token.cpu()
    out = torch.zeros(b.num_tokens, layer.num_heads, layer.v_head_dim, dtype=torch.float64)
    t = 0
    G = layer.num_heads // layer.num_kv_heads
    for i in range(b.batch_size):
        r, P, n = int(b.req_pool_indices[i]), int(b.prefix_lens[i]), int(b.extend_lens[i])
        for j in range(n):
            if mode == ForwardMode.TARGET_VERIFY:
                vis = list(range(P)) + [P + m for m in range(n) if sc.tree_dense[i, j, m]]
            else:
                vis = list(range(P + j + 1))
            slots = rtt[r, vis].long()
            for h in range(layer.num_heads):
                qh = q[t, h].double().cpu()
                kh = kc[slots, h // G]
                s = (kh @ qh) * layer.scaling
                w = torch.softmax(s, 0)
                out[t, h] = w @ vc[slots, h // G]
            t += 1
    return out
