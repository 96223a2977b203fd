"""Fused KV materialization for DFlash drafters: context hidden states -> K/V of every draft
layer, written straight into the draft KV cache.

A DFlash drafter attends over the *context* tokens with K/V computed from the target model's
(projected) hidden states, not from its own layers' outputs: every draft layer ``l`` has

    k_l = RoPE(RMSNorm_l(hidden @ W_k[l]^T))       v_l = hidden @ W_v[l]^T

for the same ``hidden``.  SGLang does this per layer (``DFlashAttention.kv_proj_only`` slices
the K/V rows of the fused QKV weight, ``apply_k_norm``, ``apply_k_rope``, then
``set_kv_buffer``: python/sglang/srt/models/dflash.py); stacking the K/V rows of all layers
into one weight turns the projections into ONE GEMM ``hidden @ w_kv^T`` whose output rows
are already in (layer, K|V, head, dim) order, which a fused kernel can normalize, rotate,
cast and scatter in one pass.  This module holds the plain-PyTorch reference of that op and
its validated public wrapper (``materialize_kv``); faster implementations register under the
same op name.

Implementations (registry op ``materialize_kv``; all take the reference's signature):

- ``reference``: :func:`materialize_kv_reference`, float32 GEMM on float32 copies.
- ``cuda``: ONE ``torch.mm(hidden, w_kv.T)`` in the input dtype (cuBLAS: bf16 in, fp32
  accumulate, bf16 out), then ONE launch of ``torch.ops.specattn.materialize_kv_epilogue``
  (csrc/kv_materialize.cu) over all tokens x layers x K/V x heads: K RMSNorm + neox RoPE,
  ``kv_bias`` (added in float32 in the epilogue), cast, store into every layer's cache.
  Per-layer cache pointers travel in a ``__grid_constant__`` parameter table.  Head dims
  ``D <= 256`` (``impl="auto"`` sends larger heads to Triton).  Head and rotary dims that are
  multiples of 16 with contiguous, 16-byte aligned side inputs (every common drafter) take
  a kernel that gives each lane the K and V of 16 dims of one head (both RoPE halves) with
  all its DRAM loads in flight at once; other shapes a generic kernel.  fp8 scaling there is
  ``x * (1 / scale)`` with the reciprocal rounded to float32 once, which is how torch's CUDA
  division by a Python scalar (so the reference run on a GPU, and SGLang's
  ``set_kv_buffer``) computes ``x / scale``.
  With ``hidden_norm_weight`` (DFlash's ``hidden_norm`` applied to un-normed rows) the GEMM
  is :func:`specattn.ops.rms_norm_matmul` instead, the norm in its prologue (Triton).
- ``triton``: the same GEMM, then one Triton launch
  (:mod:`specattn.triton_kernels.kv_materialize`); per-layer caches through a device table of
  offsets built once per buffer list (first call per buffer list must be eager, before any
  CUDA-graph capture).  Also runs in the CPU interpreter (``TRITON_INTERPRET=1``).

Both fast paths: no host sync, no allocation but the GEMM output (caching allocator,
current stream), CUDA-graph capturable; the wrapper's index checks sync (skipped during
capture).

Precision contract of the fast paths (the reference does everything in float32):

- The GEMM output is rounded to the input dtype before the epilogue; everything after it
  is float32 with one rounding at the store (RTNE; fp8: saturating ``clamp(x / scale,
  +-448)`` then RTNE, like the reference).
- bf16 activations: every stored K element differs from the reference by at most
  ``2^-6 * (|ref[i]| + |ref[partner(i)]|) + 2^-10 * rms(ref row)`` (``partner(i) = i +- R/2``,
  absent for V and for dims past ``R``); fp8 caches add one e4m3 step (``2^-3 * |ref|``)
  plus the subnormal step ``2^-9 * scale``.  With ``kv_bias``, ``|ref[j]|`` reads
  ``|ref[j]| + beta[j]``: the bias is added after the GEMM output is rounded, so where it
  cancels the projection the projection's rounding remains.  ``beta`` is the bias at the
  output's scale, ``|bias|`` for V and ``|bias| * |k_norm_weight| / rms(pre-norm K head
  row)`` for K (found by a CI run with a random bias cancelling a projection element).  Tested at the Qwen3-8B drafter shape; the
  measured worst case is about half of it (two bf16 roundings of the pair magnitude).
- float32 activations: the GEMM is float32 as long as TF32 is off
  (``torch.backends.cuda.matmul.allow_tf32 = False``, torch's default); then the results
  match the reference to float32 rounding (accumulation order): float32 caches within a
  few ulp (tested: 1e-5), 16-bit / fp8 caches bit-exact or one step apart at a rounding
  boundary.  With TF32 on, expect ~1e-3 relative.
- Compared with the reference run on the SAME rounded GEMM output (how the tests isolate
  the epilogue), the fast paths evaluate the same float32 formula and differ only by float32
  rounding: the summation order of ``mean(x^2)``, ``rsqrt`` vs ``1 / sqrt``, FMA contraction
  (Triton), ``x / scale`` vs ``x * (1 / scale)``.  That is a few ulp of each result, so 16-bit
  / fp8 caches are bit-exact but for one-step differences at rounding boundaries (~1e-5 of
  the elements), EXCEPT where RoPE's ``y_i cos - y_p sin`` cancels: there the difference is
  a few ulp of ``|y_i| + |y_p|``, which can be several cache steps of the small result (a
  few elements in millions at the Qwen3-8B drafter shape).  Exact bound and derivation:
  ``check_vs_epilogue`` in tests/test_kv_materialize_fast.py.
"""
from __future__ import annotations

import math
import numbers
from typing import List, Optional, Sequence

import torch

from . import registry
from .checks import INDEX_DTYPES, capturing, check_index_range, check_int, check_tensor, check_writes_disjoint
from .fp8 import FLOAT_DTYPES, KV_CACHE_DTYPES, check_kv_scale, quantize_kv
from .fused_llama import llama_rms_norm_reference, rms_norm_matmul


# ------------------------------------------------------------------------------------------
# building blocks
# ------------------------------------------------------------------------------------------

def make_cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0, *,
                       device: Optional[torch.device] = None) -> torch.Tensor:
    """The rotary cos/sin cache of SGLang / vLLM (``RotaryEmbedding._compute_cos_sin_cache``).

    Returns a float32 ``[max_pos, rotary_dim]`` tensor whose row ``p`` is
    ``cat(cos(p * inv_freq), sin(p * inv_freq))`` with
    ``inv_freq[i] = base ** (-2i / rotary_dim)`` for ``i < rotary_dim // 2``: the first half
    of a row holds the cosines, the second half the sines (plain RoPE, no scaling), computed
    in float32 on the CPU like SGLang's, then moved to ``device``.

    Raises:
        TypeError: ``max_pos`` or ``rotary_dim`` not an int (never truncated).  ValueError:
        ``max_pos < 1``, ``rotary_dim`` not a positive even number, ``base`` not finite and > 0.
    """
    max_pos, rotary_dim = check_int("max_pos", max_pos), check_int("rotary_dim", rotary_dim)
    if max_pos < 1:
        raise ValueError(f"max_pos must be >= 1, got {max_pos}")
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if not (math.isfinite(base) and base > 0):
        raise ValueError(f"base must be finite and > 0, got {base}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    t = torch.arange(int(max_pos), dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return cache if device is None else cache.to(device)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in float32: ``x / sqrt(mean(x**2) + eps) * weight``.

    ``weight`` broadcasts against ``x`` (e.g. ``[D]``, or ``[1, L, 1, D]`` for per-layer
    weights of a ``[T, L, H, D]`` tensor).  Plain multiplicative weight (HF/Qwen3 ``RMSNorm``,
    not Gemma's ``1 + weight``).  Returns float32.
    """
    x = x.float()
    inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * inv_rms * weight.float()


def apply_rope_neox_reference(x: torch.Tensor, positions: torch.Tensor,
                              cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Neox-style ("rotate halves") RoPE of ``x [T, ..., D]`` at ``positions [T]``, in float32.

    With ``R = cos_sin_cache.shape[-1]`` (the rotary dim, even, ``<= D``), ``cos, sin =
    cos_sin_cache[positions].chunk(2, -1)`` and ``x1 = x[..., :R/2]``, ``x2 = x[..., R/2:R]``:
    ``out = cat(x1*cos - x2*sin, x2*cos + x1*sin, x[..., R:])`` (SGLang / vLLM
    ``_apply_rotary_emb(is_neox_style=True)``; dims past ``R`` pass through).  Returns float32.
    """
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    cs = cos_sin_cache.float()[positions.long()]  # [T, R]
    shape = (cs.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cs[:, :half].reshape(shape), cs[:, half:].reshape(shape)
    x = x.float()
    x1, x2 = x[..., :half], x[..., half:rot]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]), dim=-1)


def stack_kv_proj_weights(k_weights: Sequence[torch.Tensor],
                          v_weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Build ``w_kv`` from per-layer K and V projection weights (each ``[Hkv*D, hidden]``).

    Returns ``cat([k_0, v_0, k_1, v_1, ...])``: ``[num_layers * 2 * Hkv * D, hidden]``, the
    layout :func:`materialize_kv` expects.  From an SGLang DFlash drafter this is
    ``torch.cat([layer.self_attn.qkv_proj.weight[q_size : q_size + 2 * kv_size] for layer
    in model.layers])`` (the fused QKV weight already holds K then V).

    Raises:
        ValueError: unequal counts, none, or a weight that is not 2-D or differs from the
        first in dtype, device or hidden size.  TypeError: a weight that is not a tensor.
    """
    if len(k_weights) != len(v_weights) or not k_weights:
        raise ValueError(f"need as many K as V weights (>= 1), got {len(k_weights)} and "
                         f"{len(v_weights)}")
    first = k_weights[0]
    for i, (k, v) in enumerate(zip(k_weights, v_weights)):
        for name, t in ((f"k_weights[{i}]", k), (f"v_weights[{i}]", v)):
            check_tensor(name, t, dim=2, dtypes=(first.dtype,), device=first.device, shape=(None, first.shape[1]))
    return torch.cat([w for pair in zip(k_weights, v_weights) for w in pair], dim=0)


def _store(buf: torch.Tensor, loc: torch.Tensor, val: torch.Tensor, scale: float) -> None:
    buf[loc] = quantize_kv(val, buf.dtype, scale)


# ------------------------------------------------------------------------------------------
# reference implementation
# ------------------------------------------------------------------------------------------

def materialize_kv_reference(hidden: torch.Tensor, w_kv: torch.Tensor,
                             k_norm_weight: torch.Tensor, positions: torch.Tensor,
                             cos_sin_cache: torch.Tensor, out_cache_loc: torch.Tensor,
                             k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
                             *, eps: float, kv_bias: Optional[torch.Tensor] = None,
                             k_scale: float = 1.0, v_scale: float = 1.0,
                             hidden_norm_weight: Optional[torch.Tensor] = None) -> None:
    """Plain-PyTorch reference of :func:`materialize_kv` (no validation; float32 math after
    ``hidden_norm_weight``'s RMSNorm, which runs in ``hidden``'s dtype as the model's does)."""
    num_layers = len(k_buffers)
    _, hkv, d = k_buffers[0].shape
    t = hidden.shape[0]
    if hidden_norm_weight is not None:
        hidden = llama_rms_norm_reference(hidden, hidden_norm_weight, eps)
    kv = hidden.float() @ w_kv.float().t()  # ONE GEMM for all layers: [T, L*2*Hkv*D]
    if kv_bias is not None:
        kv = kv + kv_bias.float()
    kv = kv.view(t, num_layers, 2, hkv, d)
    k = rms_norm_reference(kv[:, :, 0], k_norm_weight.view(1, num_layers, 1, d), eps)
    k = apply_rope_neox_reference(k, positions, cos_sin_cache)  # [T, L, Hkv, D]
    v = kv[:, :, 1]
    loc = out_cache_loc.long()
    for layer in range(num_layers):
        _store(k_buffers[layer], loc, k[:, layer], k_scale)
        _store(v_buffers[layer], loc, v[:, layer], v_scale)


registry.register("materialize_kv", "reference", lambda: materialize_kv_reference)


# ------------------------------------------------------------------------------------------
# fast implementations: one torch GEMM + one fused epilogue launch
# ------------------------------------------------------------------------------------------

CUDA_MAX_HEAD_DIM = 256  # csrc/kv_materialize.cu: up to 32 lanes x 8 dims per head row


def _load_cuda():
    """The ``cuda`` implementation: ``kv = hidden @ w_kv.T`` through torch (cuBLAS, input
    dtype), then ``torch.ops.specattn.materialize_kv_epilogue`` (csrc/kv_materialize.cu) in
    one launch.  Raises ImportError when the extension is missing or lacks the op."""
    op = registry.from_ext("materialize_kv_epilogue")()

    def materialize_kv_cuda(hidden, w_kv, k_norm_weight, positions, cos_sin_cache, out_cache_loc,
                            k_buffers, v_buffers, *, eps, kv_bias=None, k_scale=1.0,
                            v_scale=1.0, hidden_norm_weight=None):
        if hidden.device.type != "cuda":
            raise RuntimeError(f"cuda implementation of materialize_kv unavailable for tensors "
                               f"on {hidden.device}")
        d = k_buffers[0].shape[2]
        if d > CUDA_MAX_HEAD_DIM:
            raise ValueError(f"the cuda materialize_kv supports head dims <= {CUDA_MAX_HEAD_DIM}, "
                             f"got {d}; use impl='triton'")
        if hidden.shape[0] == 0:
            return
        # the ONE GEMM: [T, L*2*Hkv*D] in hidden's dtype (with the norm in its prologue)
        kv = torch.mm(hidden, w_kv.t()) if hidden_norm_weight is None else \
            rms_norm_matmul(hidden, hidden_norm_weight, w_kv, eps)
        op(kv, k_norm_weight, positions, cos_sin_cache, out_cache_loc, list(k_buffers),
           list(v_buffers), float(eps), kv_bias, float(k_scale), float(v_scale))

    return materialize_kv_cuda


registry.register("materialize_kv", "cuda", _load_cuda)
registry.register("materialize_kv", "triton",
                  registry.from_module("specattn.triton_kernels.kv_materialize", "materialize_kv",
                                       "Triton"))


# ------------------------------------------------------------------------------------------
# public wrapper
# ------------------------------------------------------------------------------------------

def _check_buffers(name: str, bufs, dev, num_layers: Optional[int]) -> List[torch.Tensor]:
    if isinstance(bufs, torch.Tensor) or not isinstance(bufs, (list, tuple)):
        raise TypeError(f"{name} must be a list of per-layer tensors, got {type(bufs).__name__}")
    bufs = list(bufs)
    if not bufs:
        raise ValueError(f"{name} must hold at least one tensor (one per draft layer)")
    if num_layers is not None and len(bufs) != num_layers:
        raise ValueError(f"{name} has {len(bufs)} layers, k_buffers has {num_layers}")
    for i, b in enumerate(bufs):
        check_tensor(f"{name}[{i}]", b, dim=3, dtypes=KV_CACHE_DTYPES, device=dev)
        if not b.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous")
    return bufs


def materialize_kv(hidden: torch.Tensor, w_kv: torch.Tensor, k_norm_weight: torch.Tensor,
                   positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   out_cache_loc: torch.Tensor, k_buffers: Sequence[torch.Tensor],
                   v_buffers: Sequence[torch.Tensor], *, eps: float = 1e-6,
                   kv_bias: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                   v_scale: float = 1.0, hidden_norm_weight: Optional[torch.Tensor] = None,
                   check_values: bool = True, impl: str = "auto") -> None:
    """Compute the K/V of every DFlash draft layer for context tokens and write them into the
    draft KV cache, in place.

    For each token ``t``, layer ``l`` and KV head ``h`` (``L`` layers, ``Hkv`` heads of
    ``D`` dims), with ``kv = hidden @ w_kv.T (+ kv_bias)`` viewed as ``[T, L, 2, Hkv, D]``::

        k = RoPE_neox(RMSNorm(kv[t, l, 0, h], k_norm_weight[l], eps), positions[t])
        v = kv[t, l, 1, h]
        k_buffers[l][out_cache_loc[t], h] = cast(k / k_scale)   # scale: fp8 caches only
        v_buffers[l][out_cache_loc[t], h] = cast(v / v_scale)

    All math runs in float32 (the GEMM on float32 copies of the inputs); the only rounding to
    the cache dtype happens at the store.  Slots not in ``out_cache_loc`` are left untouched.
    K gets RMSNorm then RoPE; V gets neither; there is no Q (DFlash drafters never query
    with context tokens).  Source: DFlash (z-lab, block-diffusion drafter) as served by
    SGLang, ``DFlashAttention.kv_proj_only`` / ``apply_k_norm`` / ``apply_k_rope`` +
    ``set_kv_buffer`` in python/sglang/srt/models/dflash.py, fused across layers.

    Args:
        hidden: ``[T, hidden_size]`` float32/float16/bfloat16, the drafter's context hidden
            states (in DFlash: ``hidden_norm(fc(concat of target-layer hidden states))``).
        w_kv: ``[L * 2 * Hkv * D, hidden_size]``, same dtype as ``hidden``: the K and V
            projection weights of all draft layers stacked along rows, per layer K then V,
            each head-major.  Row ``l*2*Hkv*D + s*Hkv*D + h*D + d`` (``s`` = 0 for K, 1 for V)
            produces dim ``d`` of head ``h`` of layer ``l``.  So ``hidden @ w_kv.T`` is one GEMM
            for all layers; build it with :func:`stack_kv_proj_weights`.
        k_norm_weight: ``[L, D]`` float, per-layer K RMSNorm weight (applied per head over
            ``D``, multiplicative: ``x * rsqrt(mean(x^2) + eps) * w``).
        positions: ``[T]`` int64 (or int32) RoPE positions, in ``[0, max_pos)``.
        cos_sin_cache: ``[max_pos, R]`` float (float32 recommended), SGLang/vLLM layout: row
            ``p`` = ``cat(cos(p*inv_freq), sin(p*inv_freq))`` (first half cos, second half
            sin).  ``R`` is the rotary dim: even, ``<= D`` (normally ``R == D``; dims past
            ``R`` are not rotated).  See :func:`make_cos_sin_cache`.
        out_cache_loc: ``[T]`` int32/int64 cache slots, distinct, in ``[0, num_slots)``.
        k_buffers, v_buffers: lists of ``L`` contiguous ``[num_slots, Hkv, D]`` tensors, all of
            one dtype (float32, float16, bfloat16 or float8_e4m3fn) and one device.
        eps: RMSNorm epsilon (> 0), the drafter's ``rms_norm_eps``.
        kv_bias: optional ``[L * 2 * Hkv * D]`` float bias of the projection (same row order
            as ``w_kv``), for drafters with ``attention_bias``; ``None`` for the usual none.
        k_scale, v_scale: Python floats > 0, the fp8 dequantization scales: a float8_e4m3fn
            cache stores ``clamp(k / k_scale, -448, 448)`` cast to fp8 (round to nearest,
            saturating: no inf/NaN from overflow), so ``k ~= cache.float() * k_scale``
            (SGLang's ``set_kv_buffer`` divides by the layer's ``k_scale`` likewise).  Must be
            1.0 for non-fp8 caches.
        hidden_norm_weight: optional ``[hidden_size]`` tensor of ``hidden``'s dtype: RMSNorm
            ``hidden`` with this weight and ``eps`` first (Llama's, as
            :func:`specattn.ops.rms_norm_matmul`), i.e. pass DFlash's ``fc`` output and its
            ``hidden_norm`` weight instead of the normed states.  The fast paths run the norm
            in the GEMM's prologue (:func:`specattn.ops.rms_norm_matmul`, its precision
            contract): one launch instead of a norm's several.
        impl: ``"auto"`` | ``"cuda"`` | ``"triton"`` | ``"reference"``.  ``"auto"``: CUDA
            when the extension is built and the tensors are on a GPU (Triton for head dims
            above 256), else Triton on a GPU, else the reference.  The fast paths' precision
            contract (bf16 GEMM output rounding): see the module docstring.
        check_values: run the value checks under Raises (default); ``False``: skip them and
            never sync with the host (the hot path of a runtime whose slots and positions
            come from its own allocator).
    Raises:
        TypeError: a non-tensor argument, buffers not given as a list, non-float scales.
        ValueError: wrong ranks / shapes / dtypes, tensors on different devices, non-contiguous
            cache buffers, buffers that share memory with each other or with an input,
            K/V layer counts or shapes that disagree with ``w_kv`` /
            ``k_norm_weight``, an odd or too large rotary dim, ``eps <= 0``, bad scales,
            repeated slots in ``out_cache_loc``.
        IndexError: a slot outside ``[0, num_slots)`` or a position outside ``[0, max_pos)``
            (one host sync each; skipped during CUDA-graph capture).
        All checks run before anything is written.  ``check_values=False`` skips the value
        checks (slot / position ranges, repeated slots), so the eager call never syncs with
        the host either; the CUDA / Triton kernels then skip the rows of out-of-range slots or
        positions instead of touching memory, and the reference indexes with torch, which
        raises for a slot or position past the end but counts a negative one from the end
        (out-of-range input is undefined there).  Shape, dtype and device checks always run (they read no device memory).
    """
    check_tensor("hidden", hidden, dim=2, dtypes=FLOAT_DTYPES)
    dev = hidden.device
    num_tokens, hidden_size = hidden.shape
    k_buffers = _check_buffers("k_buffers", k_buffers, dev, None)
    num_layers = len(k_buffers)
    v_buffers = _check_buffers("v_buffers", v_buffers, dev, num_layers)
    num_slots, hkv, d = k_buffers[0].shape
    cache_dtype = k_buffers[0].dtype
    for name, bufs in (("k_buffers", k_buffers), ("v_buffers", v_buffers)):
        for i, b in enumerate(bufs):
            if b.shape != k_buffers[0].shape:
                raise ValueError(f"{name}[{i}] has shape {list(b.shape)}, k_buffers[0] has "
                                 f"{list(k_buffers[0].shape)}")
            if b.dtype != cache_dtype:
                raise ValueError(f"{name}[{i}] has dtype {b.dtype}, k_buffers[0] has {cache_dtype}")
    if hkv < 1 or d < 2:
        raise ValueError(f"cache buffers must be [num_slots, Hkv >= 1, D >= 2], got "
                         f"{list(k_buffers[0].shape)}")
    rows = num_layers * 2 * hkv * d
    check_tensor("w_kv", w_kv, dtypes=(hidden.dtype,), device=dev, shape=(rows, hidden_size))
    check_tensor("k_norm_weight", k_norm_weight, dtypes=FLOAT_DTYPES, device=dev,
                 shape=(num_layers, d))
    if kv_bias is not None:
        check_tensor("kv_bias", kv_bias, dtypes=FLOAT_DTYPES, device=dev, shape=(rows,))
    if hidden_norm_weight is not None:
        check_tensor("hidden_norm_weight", hidden_norm_weight, dtypes=(hidden.dtype,), device=dev,
                     shape=(hidden_size,))
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, device=dev, shape=(num_tokens,))
    check_tensor("out_cache_loc", out_cache_loc, dtypes=INDEX_DTYPES, device=dev,
                 shape=(num_tokens,))
    check_tensor("cos_sin_cache", cos_sin_cache, dim=2, dtypes=FLOAT_DTYPES, device=dev)
    max_pos, rot = cos_sin_cache.shape
    if max_pos < 1 or rot < 2 or rot % 2 or rot > d:
        raise ValueError(f"cos_sin_cache must be [max_pos >= 1, rotary_dim] with an even "
                         f"rotary_dim <= head dim {d}, got {list(cos_sin_cache.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (
            math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    fp8 = cache_dtype == torch.float8_e4m3fn
    k_scale = check_kv_scale("k_scale", k_scale, fp8)
    v_scale = check_kv_scale("v_scale", v_scale, fp8)
    check_writes_disjoint([(f"k_buffers[{i}]", b) for i, b in enumerate(k_buffers)]
                          + [(f"v_buffers[{i}]", b) for i, b in enumerate(v_buffers)],
                          [("hidden", hidden), ("w_kv", w_kv), ("k_norm_weight", k_norm_weight),
                           ("cos_sin_cache", cos_sin_cache), ("positions", positions),
                           ("out_cache_loc", out_cache_loc), ("kv_bias", kv_bias),
                           ("hidden_norm_weight", hidden_norm_weight)])
    if num_tokens == 0:
        return
    if check_values:
        check_index_range("out_cache_loc", out_cache_loc, num_slots)
        check_index_range("positions", positions, max_pos)
        if not capturing() and torch.unique(out_cache_loc).numel() != num_tokens:
            raise ValueError("out_cache_loc repeats a slot; the write would be ambiguous")
    if impl == "auto" and d > CUDA_MAX_HEAD_DIM and dev.type == "cuda":
        # the CUDA kernel covers head dims <= 256; larger heads take the next candidate
        avail = registry.availability("materialize_kv")
        impl = "triton" if avail["triton"] is None else "reference"
    registry.dispatch("materialize_kv", impl, dev)(
        hidden, w_kv, k_norm_weight, positions, cos_sin_cache, out_cache_loc, k_buffers,
        v_buffers, eps=float(eps), kv_bias=kv_bias, k_scale=k_scale, v_scale=v_scale,
        hidden_norm_weight=hidden_norm_weight)
