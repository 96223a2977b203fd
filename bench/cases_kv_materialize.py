"""Bench case of the fused KV materialization for DFlash drafters .

``kv_materialize``: context hidden states -> K/V of every draft layer, written into the
draft KV cache, at the size of a Qwen3-8B drafter (hidden 4096, 8 KV heads x 128, 5 draft
layers; ``-p tokens=4096`` for the long-context figure), bf16 activations and weights,
float32 cos/sin cache, bf16 cache (``-p cache_dtype=float8_e4m3fn`` for fp8).  ``impl``:

- ``cuda`` | ``triton`` | ``reference`` | ``auto``: the public wrapper
  :func:`specattn.ops.materialize_kv` (its host-syncing index checks are skipped during
  CUDA-graph capture, so graph replays time the implementation alone): ONE GEMM then ONE
  fused epilogue launch (``reference``: float32 GEMM on float32 copies + per-layer torch ops);
- ``unfused``: what an engine without the fused kernel runs (SGLang's per-layer DFlash path:
  ``kv_proj_only`` -> ``apply_k_norm`` -> ``apply_k_rope`` -> ``set_kv_buffer``, here with
  ONE GEMM for all layers as a head start): ``torch.mm``, the rotary cos/sin gathered once,
  then per layer ``F.rms_norm`` on K, neox RoPE in torch ops (bf16, as SGLang's native
  rotary path computes in the activation dtype) and two ``index_put`` scatters (K and V);
- ``gemm``: the GEMM ``hidden @ w_kv.T`` alone (the floor for the fused path);
- ``cuda_epilogue`` | ``triton_epilogue``: the fused epilogue alone (one launch of
  ``torch.ops.specattn.materialize_kv_epilogue`` / the Triton ``materialize_kv_epilogue``) on
  a GEMM output computed once at setup; its ``bytes`` are what it must move: the GEMM output
  read once + the cache rows written (the floor: bytes / copy bandwidth).

``bytes`` = hidden + ``w_kv`` read once + the cache rows written (the minimum traffic of the
op; the GEMM output round trip of the two-launch design is not counted), ``flops`` =
``2 * tokens * hidden * rows`` with ``rows = layers * 2 * kv_heads * head_dim``.  Bars
targets: fused >= 2x faster than ``unfused`` and within 1.25x of ``gemm``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specattn.ops import make_cos_sin_cache, materialize_kv
from specattn.ops.fp8 import FLOAT_DTYPES, KV_CACHE_DTYPES

from .cases import Workload, case, check_choice, positive_ints, torch_dtype

__all__ = ["IMPLS", "unfused_materialize_kv"]

IMPLS = ("auto", "cuda", "triton", "reference", "unfused", "gemm", "cuda_epilogue",
         "triton_epilogue")


def unfused_materialize_kv(hidden, w_kv, k_norm_weight, positions, cos_sin_cache, out_cache_loc,
                           k_buffers, v_buffers, *, eps):
    """The unfused baseline: one GEMM, then per layer K RMSNorm, RoPE and separate K / V
    scatters, in torch ops (no validation; no fp8 scaling).  Same results as
    :func:`specattn.ops.materialize_kv` up to bf16 rounding of the intermediate steps."""
    num_layers = len(k_buffers)
    _, hkv, d = k_buffers[0].shape
    t = hidden.shape[0]
    half = cos_sin_cache.shape[1] // 2
    kv = torch.mm(hidden, w_kv.t()).view(t, num_layers, 2, hkv, d)
    cs = cos_sin_cache[positions].to(hidden.dtype)  # once for all layers
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    loc = out_cache_loc.long()
    for layer in range(num_layers):
        k = F.rms_norm(kv[:, layer, 0], (d,), k_norm_weight[layer], eps)
        k1, k2 = k[..., :half], k[..., half:2 * half]
        k = torch.cat((k1 * cos - k2 * sin, k2 * cos + k1 * sin, k[..., 2 * half:]), dim=-1)
        k_buffers[layer][loc] = k.to(k_buffers[layer].dtype)
        v_buffers[layer][loc] = kv[:, layer, 1].to(v_buffers[layer].dtype)


def _check_kv_materialize(*, tokens, hidden, layers, kv_heads, head_dim, dtype, cache_dtype,
                          impl, seed):
    check_choice("impl", impl, IMPLS)
    positive_ints(tokens=tokens, hidden=hidden, layers=layers, kv_heads=kv_heads,
                  head_dim=head_dim)
    torch_dtype("dtype", dtype, FLOAT_DTYPES)
    fp8 = torch_dtype("cache_dtype", cache_dtype, KV_CACHE_DTYPES) == torch.float8_e4m3fn
    if fp8 and impl == "unfused":
        raise ValueError("impl='unfused' has no fp8 scaling; use cache_dtype=bfloat16")


@case("kv_materialize",
      "DFlash fused KV materialization, Qwen3-8B drafter: hidden 4096, 5 layers x 8 KV heads x "
      "128, bf16, 512 tokens; impl=cuda|triton|reference|unfused|gemm|cuda_epilogue|"
      "triton_epilogue",
      check=_check_kv_materialize,
      tokens=512, hidden=4096, layers=5, kv_heads=8, head_dim=128, dtype="bfloat16",
      cache_dtype="bfloat16", impl="cuda", seed=0)
def _kv_materialize(device, *, tokens, hidden, layers, kv_heads, head_dim, dtype, cache_dtype,
                    impl, seed):
    dt, cdt = getattr(torch, dtype), getattr(torch, cache_dtype)
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = layers * 2 * kv_heads * head_dim
    num_slots = 2 * tokens + 64
    max_pos = max(2 * tokens, 4096)
    x = torch.randn(tokens, hidden, generator=g).to(device, dt)
    w_kv = (torch.randn(rows, hidden, generator=g) / math.sqrt(hidden)).to(device, dt)
    k_norm = (1.0 + 0.1 * torch.randn(layers, head_dim, generator=g)).to(device, dt)
    cos_sin = make_cos_sin_cache(max_pos, head_dim, 1e6, device=device)
    positions = torch.randint(0, max_pos, (tokens,), generator=g).to(device)
    loc = torch.randperm(num_slots, generator=g)[:tokens].to(device)
    k_bufs = [torch.zeros(num_slots, kv_heads, head_dim, dtype=cdt, device=device)
              for _ in range(layers)]
    v_bufs = [torch.zeros_like(b) for b in k_bufs]
    fp8 = cdt == torch.float8_e4m3fn
    scales = dict(k_scale=0.05, v_scale=0.05) if fp8 else {}
    eps = 1e-6

    if impl == "gemm":
        def fn():
            torch.mm(x, w_kv.t())
    elif impl == "unfused":   # the case's check refuses it with an fp8 cache
        def fn():
            unfused_materialize_kv(x, w_kv, k_norm, positions, cos_sin, loc, k_bufs, v_bufs,
                                   eps=eps)
    elif impl.endswith("_epilogue"):
        kv = torch.mm(x, w_kv.t())  # the GEMM output, once
        if impl == "cuda_epilogue":
            from specattn import _ext
            if not _ext.EXT_AVAILABLE:
                raise RuntimeError(f"impl='cuda_epilogue' needs specattn._C: "
                                   f"{_ext.EXT_MISSING_REASON}")
            op = torch.ops.specattn.materialize_kv_epilogue
            ks, vs = scales.get("k_scale", 1.0), scales.get("v_scale", 1.0)

            def fn():
                op(kv, k_norm, positions, cos_sin, loc, k_bufs, v_bufs, eps, None, ks, vs)
        else:
            from specattn.triton_kernels.kv_materialize import materialize_kv_epilogue

            def fn():
                materialize_kv_epilogue(kv, k_norm, positions, cos_sin, loc, k_bufs, v_bufs,
                                        eps=eps, **scales)
    else:
        def fn():
            materialize_kv(x, w_kv, k_norm, positions, cos_sin, loc, k_bufs, v_bufs, eps=eps,
                           impl=impl, **scales)

    written = tokens * rows * cdt.itemsize
    if impl.endswith("_epilogue"):
        return Workload(fn=fn, bytes=kv.nbytes + written, flops=0,
                        state={"k_buffers": k_bufs, "v_buffers": v_bufs, "out_cache_loc": loc})
    return Workload(fn=fn, bytes=x.nbytes + w_kv.nbytes + written,
                    flops=2 * tokens * hidden * rows,
                    state={"k_buffers": k_bufs, "v_buffers": v_bufs, "out_cache_loc": loc})
