"""Fused Llama-layer ops: RMSNorm folded into the GEMM that consumes it, RoPE and the KV-cache
store folded into the QKV projection, the residual add folded into o_proj / down_proj.

One decoder layer of a Llama-family model (``spec_runtime/model.py``) then takes four GEMM
launches plus attention::

    q = qkv_rope_store(h, input_layernorm, w_qkv, eps, positions, cos_sin_cache,
                       out_cache_loc, k_cache, v_cache, H, Hkv, D)   # norm + QKV + RoPE + store
    o = attention(q, ...)
    matmul_residual(o.view(T, H * D), w_o, h)                         # h += o @ w_o.T
    a = rms_norm_swiglu(h, post_attention_layernorm, w_gate, w_up, eps)
    matmul_residual(a, w_down, h)                                     # h += a @ w_down.T

and the final norm + LM head is ``rms_norm_matmul(h, norm, lm_head, eps, out_dtype=float32)``.
The fast form folds each norm weight into the GEMM weight that reads the norm once
(:func:`fold_rms_norm_weight`, then ``norm_weight=None``) and has each residual GEMM hand
the next norm its rows' sums of squares (``_, ss = matmul_residual(..., return_row_sumsq=True)``,
then ``row_sumsq=ss``).

Implementations (registry ops of the same names; each takes its reference's signature):

- ``reference``: plain PyTorch, the model's own sequence of operations in the activation
  dtype (``*_reference`` below; no validation).
- ``triton``: one launch per op (:mod:`specattn.triton_kernels.fused_llama`); CUDA-graph
  capturable; also runs in the CPU interpreter (``TRITON_INTERPRET=1``).

``impl="auto"`` takes Triton for CUDA tensors when Triton is importable (and, for
:func:`qkv_rope_store`, ``head_dim`` is a power of two >= 32), else the reference; CPU
tensors always get the reference.  There is no CUDA C++ implementation.

Precision contract (``dt`` = the activation dtype; "reference" = the ``*_reference``
functions, i.e. the model's unfused sequence).  The Triton kernels compute the same
functions with float32 accumulation and fewer roundings:

- RMSNorm prologue: the reference rounds ``x * rsqrt(mean(x^2) + eps)`` to ``dt`` and then
  ``norm_weight * that`` to ``dt`` again before the GEMM; the bf16 / float32 kernels round
  ``x * norm_weight`` to ``dt`` once and apply the row scale to the float32 accumulator
  after the K loop (float16: the row scale first, then one rounding, so un-normalized
  products cannot overflow float16).  With the norm weight folded into ``W``
  (``norm_weight=None``) ``x`` enters the dot unrounded and ``W * norm_weight`` was rounded
  to ``dt`` once, at fold time.  Mathematically the same ``RMSNorm(x) @ W^T``.
- Epilogues run in float32 with ONE rounding to the output dtype at the store: the RoPE
  rotation (with the float32 cos/sin of ``cos_sin_cache``; the reference rounds cos/sin and
  every product to ``dt``), ``silu(g) * u`` (the reference rounds ``g``, ``u``, ``silu(g)``
  and the product), ``residual + x @ W^T`` (the reference rounds the product, then the sum)
  and the float32 logits of ``out_dtype=torch.float32`` (the reference rounds to ``dt``
  first, as ``LlamaModel.logits`` does).
- So against the exact result (float64 on the same ``dt`` inputs) the kernels' error is at
  most the reference's, up to float32 accumulation order.  Error measure: ``|out - exact|``
  over the rms of the exact output row (SwiGLU: over ``|u| rms(g) + |silu(g)| rms(u)`` per
  element, how the GEMMs' errors propagate).  Measured by tests/test_ops_fused_llama.py
  (Triton compiled for an H100, and in the CPU interpreter):

  ===========  =====================  ==========================================
  dtype        Triton, max            reference (unfused, the model's sequence)
  ===========  =====================  ==========================================
  float32      1.5e-6 (K <= 100),     same order (cuBLAS / CPU GEMM accumulation)
               6.7e-6 (K = 576, 1536)
  bfloat16     1.4e-2                 3.6e-2 (Q after RoPE), 1.5e-2 elsewhere
  float16      1.9e-3                 5.0e-3
  ===========  =====================  ==========================================

  The 16-bit numbers include the final rounding of the output (up to ``2^-8 |out|``, relative
  to the row rms several times that for the row's largest elements); beyond one such
  rounding, Triton's bf16 error is below 8e-3 (float16 1.1e-3).  The tests bound Triton by
  1e-4 (float32) and 2e-2 (16-bit) beyond one output rounding, the reference by 1e-4 /
  5e-2.  With float32 activations the dots are IEEE float32 (never TF32).
- The RoPE'd and stored values follow the same contract (cache stores round once, from
  float32, to the cache dtype, which may differ from ``dt``).
- float8_e4m3fn caches (:func:`qkv_rope_store` with ``k_scale`` / ``v_scale``): the stored
  ``x / scale`` is rounded once more, to e4m3 (round to nearest even, saturating at
  +-448, :func:`specattn.ops.fp8.quantize_kv`), which adds one e4m3 step to the contract
  above: ``2^-3 * |ref|`` relative (normal range, ``|x / scale| >= 2^-6``) plus the
  subnormal step ``2^-9 * scale`` (absolute); values past ``448 * scale`` store +-448.
  The Triton kernel divides in float32 (IEEE) and rounds on the bits, so it stores exactly
  ``quantize_kv`` of its float32 values (measured bit for bit in the interpreter); against
  the reference, float32 activations give the same codes or (about 1 element in 50,000)
  adjacent ones where a rounding boundary lies between the two float32 results; with 16-bit
  activations the reference rounds K / V to ``dt`` before quantizing, so codes of values
  near zero can differ by more.  Measured, beyond ``dt``'s own error: at most 0.47 of an
  e4m3 step (float32 activations), 0.36 (16-bit).
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
import torch.nn.functional as F

from . import registry
from .checks import INDEX_DTYPES, capturing, check_disjoint, check_index_range, check_tensor
from .fp8 import KV_CACHE_DTYPES, check_kv_scale, quantize_kv
from .topk import MAX_K as TOPK_MAX_K, topk_log_probs_reference

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

__all__ = ["rms_norm_matmul", "rms_norm_matmul_topk", "qkv_rope_store", "matmul_residual", "rms_norm_swiglu",
           "rms_norm_matmul_reference", "rms_norm_matmul_topk_reference", "qkv_rope_store_reference",
           "matmul_residual_reference", "rms_norm_swiglu_reference", "llama_rms_norm_reference",
           "fold_rms_norm_weight"]

_TRITON_MODULE = "specattn.triton_kernels.fused_llama"


# ------------------------------------------------------------------------------------------
# references: the model's unfused sequence, in the activation dtype
# ------------------------------------------------------------------------------------------

def llama_rms_norm_reference(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                             row_sumsq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Llama RMSNorm over the last dim: ``weight * (x.float() * rsqrt(mean(x.float()^2) +
    eps)).to(x.dtype)``, returned in ``x.dtype`` (HF ``LlamaRMSNorm``; the same operations
    as ``spec_runtime.model.rms_norm``); ``weight`` None: no weight (folded into the next
    GEMM, :func:`fold_rms_norm_weight`); ``row_sumsq`` ``[P, M]``: ``sum(x^2)`` per row as
    partial sums (:func:`matmul_residual` ``return_row_sumsq``)."""
    xf = x.float()
    ms = xf.pow(2).mean(-1, keepdim=True) if row_sumsq is None else (row_sumsq.sum(0) / x.shape[-1])[:, None]
    xf = xf * torch.rsqrt(ms + eps)
    return xf.to(x.dtype) if weight is None else weight * xf.to(x.dtype)


def fold_rms_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor,
                         columns: Optional[slice] = None) -> torch.Tensor:
    """``weight * norm_weight`` column-wise: the GEMM weight that reads the RMSNorm's output
    with the norm's weight folded in, so ``RMSNorm(x, g) @ W^T == RMSNorm(x, None) @
    fold_rms_norm_weight(W, g)^T`` (exact in real arithmetic).  Pass the result with
    ``norm_weight=None`` to :func:`rms_norm_matmul`, :func:`rms_norm_swiglu` and
    :func:`qkv_rope_store`: their kernels then feed ``x`` to the tensor cores as loaded
    instead of multiplying it by ``g`` in registers first.  With the rows' sums of squares
    handed over as well (:func:`matmul_residual` ``return_row_sumsq``; H200, bf16, SmolLM2
    shapes, ``M`` = 16 / 256 rows): gate/up 6.2 -> 5.3 / 12.1 -> 7.5 us, QKV 7.5 -> 5.7 /
    9.0 -> 6.2, the LM head 19.5 -> 18.8 / 89.0 -> 49.6.  Done once, where the weights are
    loaded.

    Args:
        weight: ``[N, K]`` float tensor (``torch.nn.Linear`` layout).
        norm_weight: ``[K]`` (or ``[columns]`` of ``K``), same device.
        columns: the ``K``-range that the norm feeds (default all ``K``): an EAGLE-3
            layer's QKV weight reads two normalized inputs side by side and folds each.
    Returns:
        a new contiguous ``[N, K]`` tensor in ``weight``'s dtype (the product taken in
        float32, rounded once); the columns outside ``columns`` are copied unchanged.
    Raises:
        TypeError: non-tensors, a ``columns`` that is not a slice.  ValueError: mismatched
        shapes or devices, non-float dtypes.
    """
    check_tensor("weight", weight, dim=2, dtypes=FLOAT_DTYPES)
    if columns is not None and not isinstance(columns, slice):
        raise TypeError(f"columns must be a slice of the K columns, got {type(columns).__name__}")
    cols = columns if columns is not None else slice(0, weight.shape[1])
    width = len(range(*cols.indices(weight.shape[1])))
    check_tensor("norm_weight", norm_weight, dtypes=FLOAT_DTYPES, device=weight.device, shape=(width,))
    out = weight.detach().clone().contiguous()
    out[:, cols] = (weight[:, cols].float() * norm_weight.float()[None, :]).to(weight.dtype)
    return out


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]; cos / sin [T, D] in x's dtype (HF rotate_half)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def rms_norm_matmul_reference(x: torch.Tensor, norm_weight: Optional[torch.Tensor], weight: torch.Tensor,
                              eps: float, *, out_dtype: Optional[torch.dtype] = None,
                              row_sumsq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference of :func:`rms_norm_matmul`: ``(RMSNorm(x) @ weight.T).to(out_dtype)``, the
    GEMM in ``x.dtype`` (no validation)."""
    y = llama_rms_norm_reference(x, norm_weight, eps, row_sumsq) @ weight.T
    return y if out_dtype is None else y.to(out_dtype)


def rms_norm_matmul_topk_reference(x: torch.Tensor, norm_weight: Optional[torch.Tensor], weight: torch.Tensor,
                                   eps: float, k: int, *, row_sumsq: Optional[torch.Tensor] = None,
                                   column_ids: Optional[torch.Tensor] = None):
    """Reference of :func:`rms_norm_matmul_topk`: :func:`specattn.ops.topk_log_probs_reference`
    of ``rms_norm_matmul_reference(..., out_dtype=torch.float32)``, the columns mapped
    through ``column_ids`` (no validation)."""
    logits = rms_norm_matmul_reference(x, norm_weight, weight, eps, out_dtype=torch.float32, row_sumsq=row_sumsq)
    values, indices = topk_log_probs_reference(logits, k)
    return values, (indices if column_ids is None else column_ids[indices].long())


def qkv_rope_store_reference(x: torch.Tensor, norm_weight: Optional[torch.Tensor], w_qkv: torch.Tensor,
                             eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                             out_cache_loc: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                             head_dim: int, x2: Optional[torch.Tensor] = None,
                             norm_weight2: Optional[torch.Tensor] = None,
                             row_sumsq: Optional[torch.Tensor] = None, *, k_scale: float = 1.0,
                             v_scale: float = 1.0, q_norm_weight: Optional[torch.Tensor] = None,
                             k_norm_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference of :func:`qkv_rope_store` (no validation): the model's sequence in
    ``x.dtype``: norm (each input on its own, then concatenated, when ``x2`` is given), the
    Q / K / V projections (slices of ``w_qkv``), the per-head Q / K norms where given
    (:func:`llama_rms_norm_reference` over each head), RoPE with cos/sin cast to ``x.dtype``, then
    ``k_cache[out_cache_loc] = quantize_kv(k, k_cache.dtype, k_scale)`` / ``v_cache[...] =
    quantize_kv(v, v_cache.dtype, v_scale)`` (:func:`specattn.ops.fp8.quantize_kv`: a plain
    cast, or for float8_e4m3fn ``clamp(x / scale, +-448)`` rounded to nearest even)."""
    T, H, Hkv, D = x.shape[0], num_heads, num_kv_heads, head_dim
    n = llama_rms_norm_reference(x, norm_weight, eps, row_sumsq)
    if x2 is not None:
        n = torch.cat([n, llama_rms_norm_reference(x2, norm_weight2, eps)], dim=-1)
    q = (n @ w_qkv[:H * D].T).view(T, H, D)
    k = (n @ w_qkv[H * D:(H + Hkv) * D].T).view(T, Hkv, D)
    v = (n @ w_qkv[(H + Hkv) * D:].T).view(T, Hkv, D)
    if q_norm_weight is not None:
        q = llama_rms_norm_reference(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = llama_rms_norm_reference(k, k_norm_weight, eps)
    cs = cos_sin_cache[positions.long()].float()
    half = D // 2
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1).to(x.dtype)
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1).to(x.dtype)
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    loc = out_cache_loc.long()
    k_cache[loc] = quantize_kv(k, k_cache.dtype, k_scale)
    v_cache[loc] = quantize_kv(v, v_cache.dtype, v_scale)
    return q


def matmul_residual_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
                              return_row_sumsq: bool = False, copy_to: Optional[torch.Tensor] = None):
    """Reference of :func:`matmul_residual`: ``residual += x @ weight.T`` (in ``x.dtype``, in
    place; then ``copy_to[:] = residual`` when given); returns ``residual``, with
    ``return_row_sumsq`` also ``[1, M]`` float32 ``sum(residual^2)`` per row (no validation)."""
    residual += x @ weight.T
    if copy_to is not None:
        copy_to.copy_(residual)
    if return_row_sumsq:
        return residual, residual.float().pow(2).sum(-1)[None, :]
    return residual


def rms_norm_swiglu_reference(x: torch.Tensor, norm_weight: Optional[torch.Tensor], w_gate: torch.Tensor,
                              w_up: torch.Tensor, eps: float, *,
                              row_sumsq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference of :func:`rms_norm_swiglu`: ``silu(n @ w_gate.T) * (n @ w_up.T)`` with
    ``n = RMSNorm(x)``, in ``x.dtype`` (no validation)."""
    n = llama_rms_norm_reference(x, norm_weight, eps, row_sumsq)
    return F.silu(n @ w_gate.T) * (n @ w_up.T)


_REFERENCES = {
    "rms_norm_matmul": rms_norm_matmul_reference,
    "rms_norm_matmul_topk": rms_norm_matmul_topk_reference,
    "qkv_rope_store": qkv_rope_store_reference,
    "matmul_residual": matmul_residual_reference,
    "rms_norm_swiglu": rms_norm_swiglu_reference,
}
for _name, _ref in _REFERENCES.items():
    registry.register(_name, "reference", (lambda f: lambda: f)(_ref))
    registry.register(_name, "triton", registry.from_module(_TRITON_MODULE, _name, "Triton"))


# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------

def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (
            math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    return float(eps)


def _check_x(x) -> torch.Tensor:
    """Activations ``[M, K >= 1]``; a copy with a contiguous last dim if needed."""
    check_tensor("x", x, dim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] < 1:
        raise ValueError(f"x must be [M, K] with K >= 1, got {list(x.shape)}")
    return x if x.stride(1) == 1 or x.shape[0] == 0 else x.contiguous()


def _check_weight(name: str, w, x: torch.Tensor, rows: Optional[int] = None) -> None:
    check_tensor(name, w, dtypes=(x.dtype,), device=x.device, shape=(rows, x.shape[1]))
    if w.stride(1) != 1 and w.shape[0] > 0:
        raise ValueError(f"{name} must have a contiguous last dim (stride(1) == 1), got strides "
                         f"{list(w.stride())}; make it contiguous once, where it is loaded")


def _check_norm_weight(norm_weight, x: torch.Tensor) -> Optional[torch.Tensor]:
    """``[K]`` in ``x``'s dtype (or None: folded into the weight); a contiguous copy if
    strided (the kernels read it densely)."""
    if norm_weight is None:
        return None
    check_tensor("norm_weight", norm_weight, dtypes=(x.dtype,), device=x.device,
                 shape=(x.shape[1],))
    return norm_weight if norm_weight.stride(0) == 1 else norm_weight.contiguous()


def _check_row_sumsq(row_sumsq, x: torch.Tensor) -> Optional[torch.Tensor]:
    """``[P >= 1, M]`` float32 on ``x``'s device, unit stride along ``M`` (or None)."""
    if row_sumsq is None:
        return None
    check_tensor("row_sumsq", row_sumsq, dim=2, dtypes=(torch.float32,), device=x.device,
                 shape=(None, x.shape[0]))
    if row_sumsq.shape[0] < 1:
        raise ValueError(f"row_sumsq must be [P >= 1, M], got {list(row_sumsq.shape)}")
    return row_sumsq if row_sumsq.stride(1) == 1 or x.shape[0] <= 1 else row_sumsq.contiguous()


def _check_int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return int(v)


def _run(name: str, impl: str, dev: torch.device):
    return registry.dispatch(name, impl, dev)


# ------------------------------------------------------------------------------------------
# public wrappers
# ------------------------------------------------------------------------------------------

def rms_norm_matmul(x: torch.Tensor, norm_weight: Optional[torch.Tensor], weight: torch.Tensor,
                    eps: float, *, out_dtype: Optional[torch.dtype] = None,
                    row_sumsq: Optional[torch.Tensor] = None, impl: str = "auto") -> torch.Tensor:
    """``RMSNorm(x, norm_weight) @ weight.T`` in one launch (final norm + LM head).

    ``RMSNorm(x, g) = g * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)``
    (Llama / HF ``LlamaRMSNorm``).

    Args:
        x: ``[M, K]`` float32 / bfloat16 / float16 activations (``M`` may be 0; a last dim
            that is not contiguous is copied first).
        norm_weight: ``[K]``, ``x.dtype``: the RMSNorm weight; None: a norm without weight
            (folded into ``weight`` by :func:`fold_rms_norm_weight`: faster).
        weight: ``[N, K]``, ``x.dtype``, contiguous last dim (``torch.nn.Linear`` layout).
        eps: RMSNorm epsilon, a finite float > 0.
        out_dtype: dtype of the result, one of the three float dtypes (default ``x.dtype``;
            the LM head asks ``torch.float32`` logits).
        row_sumsq: optional ``[P, M]`` float32 partial sums of ``x^2`` per row (see
            :func:`rms_norm_swiglu`).
        impl: ``"auto"`` | ``"triton"`` | ``"reference"`` (see the module docstring).
    Returns:
        ``[M, N]`` in ``out_dtype``, a new tensor.
    Raises:
        TypeError: a non-tensor argument.  ValueError: wrong ranks, shapes, dtypes or devices,
        ``K == 0``, a weight without a contiguous last dim, bad ``eps`` / ``out_dtype``, a
        ``row_sumsq`` not float32 ``[P >= 1, M]`` on ``x``'s device.
        RuntimeError: a forced ``impl`` unavailable here.
    """
    x = _check_x(x)
    norm_weight = _check_norm_weight(norm_weight, x)
    _check_weight("weight", weight, x)
    eps = _check_eps(eps)
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be None or one of {[str(d) for d in FLOAT_DTYPES]}, "
                         f"got {out_dtype!r}")
    row_sumsq = _check_row_sumsq(row_sumsq, x)
    return _run("rms_norm_matmul", impl, x.device)(x, norm_weight, weight, eps,
                                                    out_dtype=out_dtype, row_sumsq=row_sumsq)


def rms_norm_matmul_topk(x: torch.Tensor, norm_weight: Optional[torch.Tensor], weight: torch.Tensor,
                         eps: float, k: int, *, row_sumsq: Optional[torch.Tensor] = None,
                         column_ids: Optional[torch.Tensor] = None, impl: str = "auto"):
    """The ``k`` largest log-probabilities of each row of the float32 logits
    ``RMSNorm(x, norm_weight) @ weight.T`` and their columns, without the logits in memory
    (an LM head feeding a drafting step's top-k or a greedy verify's argmax).

    Equals :func:`specattn.ops.topk_log_probs` of :func:`rms_norm_matmul` with
    ``out_dtype=torch.float32`` (same tie rule: among equal logits the lower column first;
    ``k = 1`` is the argmax).  Triton: the GEMM's epilogue keeps each column tile's top-``k``
    order keys and ``(max, sum exp)`` per row, one merge launch reduces them (two launches in
    all, against a GEMM, a chunked top-k and its merge; the float32 logits, ``4 M N`` bytes,
    are never written); past ``next_pow2(column tiles) * next_pow2(k) = 8192`` merged keys
    per row it takes that two-step path.

    Args:
        x, norm_weight, weight, eps, row_sumsq: as :func:`rms_norm_matmul`.
        k: ``1 <= k <= min(N, 16)``.
        column_ids: optional int32 / int64 ``[N]`` on ``x``'s device: return
            ``column_ids[column]`` as the indices (a draft vocabulary's token ids); the order
            (ties included) is still by column.  Values are not range-checked.
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``.
    Returns:
        ``(values float32 [M, k], indices int64 [M, k])``, best first; ``values`` are
        ``logit - logsumexp(row)``.
    Raises:
        TypeError / ValueError: as :func:`rms_norm_matmul`, ``k`` not an int in
        ``[1, min(N, 16)]``, or ``column_ids`` not an int32 / int64 ``[N]`` tensor on
        ``x``'s device.  RuntimeError: a forced ``impl`` unavailable here.
    """
    x = _check_x(x)
    norm_weight = _check_norm_weight(norm_weight, x)
    _check_weight("weight", weight, x)
    eps = _check_eps(eps)
    k = _check_int("k", k, 1)
    if k > min(weight.shape[0], TOPK_MAX_K):
        raise ValueError(f"k must be <= min(N, {TOPK_MAX_K}) = {min(weight.shape[0], TOPK_MAX_K)}, got {k}")
    row_sumsq = _check_row_sumsq(row_sumsq, x)
    if column_ids is not None:
        check_tensor("column_ids", column_ids, dtypes=(torch.int32, torch.int64), device=x.device,
                     shape=(weight.shape[0],))
        column_ids = column_ids.contiguous()
    return _run("rms_norm_matmul_topk", impl, x.device)(x, norm_weight, weight, eps, k, row_sumsq=row_sumsq,
                                                         column_ids=column_ids)


def matmul_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
                    return_row_sumsq: bool = False, copy_to: Optional[torch.Tensor] = None,
                    impl: str = "auto"):
    """``residual += x @ weight.T`` in place, in one launch (o_proj / down_proj with the
    residual add).  With ``return_row_sumsq`` the same launch also returns each updated
    row's sum of squares (of the values as stored), as ``P`` float32 partial sums
    ``[P, M]`` (one per column tile of the kernel; ``P = 1`` for the reference), for the
    RMSNorm that reads this residual next (``row_sumsq=`` of :func:`qkv_rope_store`,
    :func:`rms_norm_swiglu`, :func:`rms_norm_matmul`): the residual-add-then-norm fusion of
    serving engines, split across the two GEMMs so the consumer's loop stays a pure GEMM.

    Args:
        x: ``[M, K]`` float32 / bfloat16 / float16 (a last dim that is not contiguous is
            copied first).
        weight: ``[N, K]``, ``x.dtype``, contiguous last dim.
        residual: ``[M, N]``, ``x.dtype``, contiguous last dim, rows not overlapping each
            other, disjoint from ``x`` and ``weight``; updated in place.
        return_row_sumsq: also return the partial sums of squares.
        copy_to: optional ``[M, N]``, ``x.dtype``, contiguous last dim, rows not overlapping,
            disjoint from ``residual``, ``x`` and ``weight``: also receives the updated rows
            (e.g. a column block of a wider tensor that collects a model's hidden states after
            several layers), in the same launch.
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``.
    Returns:
        ``residual``, or ``(residual, row_sumsq [P, M] float32)``.
    Raises:
        TypeError: a non-tensor argument.  ValueError: wrong ranks, shapes, dtypes or devices,
        ``K == 0``, a weight or residual (or ``copy_to``) without a contiguous last dim, a
        residual (or ``copy_to``) whose rows overlap or that overlaps ``x`` / ``weight`` (or
        each other).  RuntimeError: a forced ``impl`` unavailable here.
    """
    x = _check_x(x)
    _check_weight("weight", weight, x)
    M, N = x.shape[0], weight.shape[0]
    outs = [("residual", residual)] + ([] if copy_to is None else [("copy_to", copy_to)])
    for name, t in outs:
        check_tensor(name, t, dtypes=(x.dtype,), device=x.device, shape=(M, N))
        if M > 0 and N > 0 and (t.stride(1) != 1 or (M > 1 and t.stride(0) < N)):
            raise ValueError(f"{name} must have a contiguous last dim and non-overlapping rows, "
                             f"got strides {list(t.stride())}")
        check_disjoint(name, t, "x", x)
        check_disjoint(name, t, "weight", weight)
    if copy_to is not None:
        check_disjoint("copy_to", copy_to, "residual", residual)
    return _run("matmul_residual", impl, x.device)(x, weight, residual,
                                                    return_row_sumsq=bool(return_row_sumsq), copy_to=copy_to)


def rms_norm_swiglu(x: torch.Tensor, norm_weight: Optional[torch.Tensor], w_gate: torch.Tensor,
                    w_up: torch.Tensor, eps: float, *, row_sumsq: Optional[torch.Tensor] = None,
                    impl: str = "auto") -> torch.Tensor:
    """``silu(n @ w_gate.T) * (n @ w_up.T)`` with ``n = RMSNorm(x, norm_weight)``, in one
    launch (post-attention norm + the MLP's gate and up projections).

    Args:
        x: ``[M, K]`` float32 / bfloat16 / float16.
        norm_weight: ``[K]``, ``x.dtype``; None: folded into both weights
            (:func:`fold_rms_norm_weight`: faster).
        w_gate, w_up: ``[I, K]`` each, ``x.dtype``, contiguous last dims.
        eps: RMSNorm epsilon, a finite float > 0.
        row_sumsq: optional ``[P, M]`` float32: ``sum(x^2)`` of each row as ``P`` partial sums,
            as :func:`matmul_residual` returns them for the ``x`` it just updated
            (``return_row_sumsq=True``); the norm then reads them instead of summing ``x``
            itself, so the kernel's loop over ``x`` is a pure GEMM.  Not checked against
            ``x``: sums of another tensor give a wrong norm.
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``.
    Returns:
        ``[M, I]`` in ``x.dtype``, a new tensor.
    Raises:
        TypeError: a non-tensor argument.  ValueError: wrong ranks, shapes, dtypes or devices,
        ``K == 0``, gate and up shapes that differ, a weight without a contiguous last dim,
        bad ``eps``, a ``row_sumsq`` not float32 ``[P >= 1, M]`` on ``x``'s device.
        RuntimeError: a forced ``impl`` unavailable here.
    """
    x = _check_x(x)
    norm_weight = _check_norm_weight(norm_weight, x)
    _check_weight("w_gate", w_gate, x)
    _check_weight("w_up", w_up, x, rows=w_gate.shape[0])
    eps = _check_eps(eps)
    row_sumsq = _check_row_sumsq(row_sumsq, x)
    return _run("rms_norm_swiglu", impl, x.device)(x, norm_weight, w_gate, w_up, eps, row_sumsq=row_sumsq)


def _qkv_impl(impl: str, device: torch.device, head_dim: int) -> str:
    """``impl`` for :func:`qkv_rope_store`, with ``auto`` resolved to ``reference`` where the
    Triton kernel cannot take ``head_dim`` (not a power of two >= 32)."""
    if impl != "auto" or torch.device(device).type != "cuda":
        return impl
    if registry.availability("qkv_rope_store")["triton"] is not None:
        return impl
    from specattn.triton_kernels.fused_llama import qkv_head_dim_supported
    return impl if qkv_head_dim_supported(head_dim) else "reference"


def qkv_rope_store(x: torch.Tensor, norm_weight: Optional[torch.Tensor], w_qkv: torch.Tensor, eps: float,
                   positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   out_cache_loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int, *,
                   x2: Optional[torch.Tensor] = None, norm_weight2: Optional[torch.Tensor] = None,
                   row_sumsq: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                   v_scale: float = 1.0, q_norm_weight: Optional[torch.Tensor] = None,
                   k_norm_weight: Optional[torch.Tensor] = None, check_values: bool = True,
                   impl: str = "auto") -> torch.Tensor:
    """Input RMSNorm + fused QKV projection + neox RoPE on Q and K + K/V cache store, in one
    launch.  Returns Q.

    With ``q_norm_weight`` / ``k_norm_weight`` each Q / K head is RMS-normalized over its
    ``D`` values (epsilon ``eps``) and scaled by that weight before RoPE: the per-head
    ``q_norm`` / ``k_norm`` of Qwen3-style layers (a DFlash draft layer).

    With ``x2`` the projection reads ``cat([RMSNorm(x, norm_weight), RMSNorm(x2,
    norm_weight2)])`` (each input normalized on its own), ``w_qkv`` then has ``K + K2``
    columns: the attention input of an EAGLE-3 draft layer (embedding and hidden state).

    With ``y = RMSNorm(x, norm_weight) @ w_qkv.T`` viewed as ``[M, H + 2*Hkv, D]`` (``H =
    num_heads``, ``Hkv = num_kv_heads``, ``D = head_dim``): ``q = rope(y[:, :H])``,
    ``k = rope(y[:, H:H + Hkv])``, ``v = y[:, H + Hkv:]``, where ``rope`` rotates halves over
    the whole head (HF ``rotate_half``): with ``c, s = cos_sin_cache[positions[m]].chunk(2)``,
    ``out[:D/2] = y[:D/2] * c - y[D/2:] * s`` and ``out[D/2:] = y[D/2:] * c + y[:D/2] * s``.
    Then ``k_cache[out_cache_loc[m]] = k[m]`` and ``v_cache[out_cache_loc[m]] = v[m]``, cast
    to the cache dtype; other cache slots are untouched.  A float8_e4m3fn cache stores
    ``quantize_kv(k, k_cache.dtype, k_scale)`` (:mod:`specattn.ops.fp8`): ``clamp(k /
    k_scale, -448, 448)`` rounded to nearest even, saturating (a finite value never becomes
    inf or NaN), so ``k ~= k_cache.float() * k_scale``; V likewise with ``v_scale``.

    Args:
        x: ``[M, K]`` float32 / bfloat16 / float16 activations (the residual stream).
        norm_weight: ``[K]``, ``x.dtype``: the input RMSNorm weight; None: folded into
            ``w_qkv`` (:func:`fold_rms_norm_weight`: faster).
        w_qkv: ``[(H + 2*Hkv) * D, K]``, ``x.dtype``, contiguous last dim:
            ``cat([W_q, W_k, W_v])`` of the layer's ``torch.nn.Linear`` weights.
        eps: RMSNorm epsilon, a finite float > 0.
        positions: ``[M]`` int64 / int32 token positions, in ``[0, max_pos)``.
        cos_sin_cache: ``[max_pos, D]`` float (float32 as made by
            :func:`specattn.ops.make_cos_sin_cache` ``(max_pos, D, rope_theta)``): row ``p``
            is ``cat(cos(p * inv_freq), sin(p * inv_freq))``.
        out_cache_loc: ``[M]`` int32 / int64 cache slots, distinct, in ``[0, num_slots)``.
        k_cache, v_cache: ``[num_slots, Hkv, D]`` contiguous, one dtype (float32 / bfloat16 /
            float16 / float8_e4m3fn, may differ from ``x.dtype``) and shape, disjoint;
            written in place.
        num_heads, num_kv_heads: ``H >= 1``, ``Hkv >= 1``.
        head_dim: ``D``, even (the Triton kernel: a power of two >= 32).
        x2, norm_weight2: optional second input ``[M, K2]`` (``x.dtype``) and its RMSNorm
            weight ``[K2]``: given with ``x2`` exactly when ``norm_weight`` is given (both
            norms folded into ``w_qkv``, or neither).
        row_sumsq: optional ``[P, M]`` float32 partial sums of ``x^2`` per row (of ``x``,
            not ``x2``; see :func:`rms_norm_swiglu`).
        q_norm_weight, k_norm_weight: optional ``[D]``, ``x.dtype``: per-head RMSNorm weights
            of Q and of K (either, both or neither).
        k_scale, v_scale: the fp8 caches' dequantization scales (Python floats, finite and
            > 0; a KV pool's ``kv_scales(layer_id)``): the stored value is ``k / k_scale``
            (``v / v_scale``).  Must be 1.0 (the default) for other cache dtypes.
        check_values: run the value checks under Raises (default; one host sync each);
            ``False`` skips them so the call never syncs (a runtime's hot path, whose slots and
            positions come from its own allocator).  The Triton kernel then skips the cache
            stores of rows with an out-of-range slot or position (their Q rows are
            unspecified); the reference indexes with torch, which raises for a slot or position
            past the end but counts a negative one from the end (out-of-range input is
            undefined there).
        impl: ``"auto"`` | ``"triton"`` | ``"reference"``; ``auto`` on CUDA takes Triton
            when ``D`` is a power of two >= 32, else the reference.
    Returns:
        ``q``: ``[M, H, D]`` in ``x.dtype``, a new contiguous tensor.
    Raises:
        TypeError: a non-tensor argument.  ValueError: wrong ranks, shapes, dtypes or devices,
        ``K == 0``, bad head counts / ``head_dim`` / ``eps``, a ``w_qkv`` without a contiguous
        last dim, caches not contiguous or overlapping (each other or ``x``, ``x2``,
        ``w_qkv``, ``cos_sin_cache``), a ``cos_sin_cache`` not
        ``[>= 1, D]``, repeated slots in ``out_cache_loc``, a ``row_sumsq`` not float32
        ``[P >= 1, M]``, ``x2`` and the norm weights not given together;
        ``impl="triton"`` with a head dim it does not take; a ``k_scale`` / ``v_scale``
        that is not finite and > 0, or not 1.0 with caches that are not float8_e4m3fn.
        TypeError also for a ``k_scale`` / ``v_scale`` that is not a real number (bools
        included).
        IndexError: a slot outside ``[0, num_slots)`` or a position outside ``[0, max_pos)``.
        RuntimeError: a forced ``impl`` unavailable here.
        The value checks (IndexError, repeated slots) cost host syncs and are skipped with
        ``check_values=False`` and while a CUDA graph is being captured.  Every check runs
        before anything is written.
    """
    x = _check_x(x)
    dev = x.device
    M, K = x.shape
    H = _check_int("num_heads", num_heads, 1)
    Hkv = _check_int("num_kv_heads", num_kv_heads, 1)
    D = _check_int("head_dim", head_dim, 2)
    if D % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates halves), got {D}")
    norm_weight = _check_norm_weight(norm_weight, x)
    if x2 is None and norm_weight2 is not None:
        raise ValueError("norm_weight2 needs x2")
    if x2 is not None and (norm_weight is None) != (norm_weight2 is None):
        raise ValueError("with x2, norm_weight and norm_weight2 go together (both given, or both "
                         "None: folded into w_qkv)")
    K_in = K
    if x2 is not None:
        x2 = _check_x(x2)
        check_tensor("x2", x2, dtypes=(x.dtype,), device=dev, shape=(M, None))
        if norm_weight2 is not None:
            check_tensor("norm_weight2", norm_weight2, dtypes=(x.dtype,), device=dev, shape=(x2.shape[1],))
            norm_weight2 = norm_weight2.contiguous()
        K_in = K + x2.shape[1]
    check_tensor("w_qkv", w_qkv, dtypes=(x.dtype,), device=dev, shape=((H + 2 * Hkv) * D, K_in))
    if w_qkv.stride(1) != 1 and w_qkv.shape[0] > 0:
        raise ValueError(f"w_qkv must have a contiguous last dim (stride(1) == 1), got strides "
                         f"{list(w_qkv.stride())}; make it contiguous once, where it is loaded")
    eps = _check_eps(eps)
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, device=dev, shape=(M,))
    check_tensor("out_cache_loc", out_cache_loc, dtypes=INDEX_DTYPES, device=dev, shape=(M,))
    check_tensor("cos_sin_cache", cos_sin_cache, dim=2, dtypes=FLOAT_DTYPES, device=dev)
    max_pos = cos_sin_cache.shape[0]
    if max_pos < 1 or cos_sin_cache.shape[1] != D:
        raise ValueError(f"cos_sin_cache must be [max_pos >= 1, head_dim = {D}], got "
                         f"{list(cos_sin_cache.shape)}")
    check_tensor("k_cache", k_cache, dim=3, dtypes=KV_CACHE_DTYPES, device=dev,
                 shape=(None, Hkv, D))
    num_slots = k_cache.shape[0]
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), device=dev,
                 shape=(num_slots, Hkv, D))
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not c.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    check_disjoint("k_cache", k_cache, "v_cache", v_cache)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):    # written while these are read
        for name_in, t in (("x", x), ("x2", x2), ("w_qkv", w_qkv), ("cos_sin_cache", cos_sin_cache)):
            check_disjoint(name, c, name_in, t)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_scale = check_kv_scale("k_scale", k_scale, fp8)
    v_scale = check_kv_scale("v_scale", v_scale, fp8)
    row_sumsq = _check_row_sumsq(row_sumsq, x)
    head_norms = {}
    for name, g in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if g is not None:
            check_tensor(name, g, dtypes=(x.dtype,), device=dev, shape=(D,))
            head_norms[name] = g.contiguous()
    impl = _qkv_impl(impl, dev, D)
    fn = _run("qkv_rope_store", impl, dev)
    if impl == "triton":
        from specattn.triton_kernels.fused_llama import QKV_MIN_HEAD_DIM, qkv_head_dim_supported
        if not qkv_head_dim_supported(D):
            raise ValueError(f"impl='triton' needs head_dim a power of two >= "
                             f"{QKV_MIN_HEAD_DIM}, got {D}; use impl='reference' or 'auto'")
    if check_values and M > 0:
        check_index_range("out_cache_loc", out_cache_loc, num_slots)
        check_index_range("positions", positions, max_pos)
        if not capturing() and torch.unique(out_cache_loc).numel() != M:
            raise ValueError("out_cache_loc repeats a slot; the cache write would be ambiguous")
    return fn(x, norm_weight, w_qkv, eps, positions, cos_sin_cache, out_cache_loc, k_cache,
              v_cache, H, Hkv, D, x2, norm_weight2, row_sumsq=row_sumsq, k_scale=k_scale,
              v_scale=v_scale, **head_norms)
