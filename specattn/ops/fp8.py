"""FP8 (e4m3) KV-cache storage: the one definition every KV writer and reader shares.

A ``float8_e4m3fn`` cache holds ``clamp(x / scale, -448, 448)`` rounded to e4m3 (round to
nearest even, saturating: an overflow stores +-448, never inf or NaN), so ``x ~=
cache.float() * scale``.  ``scale`` is a positive float per layer (per K and V for MHA, one
for MLA's latent), 1.0 by default: SGLang's ``set_kv_buffer`` and vLLM's ``k_scale`` /
``v_scale`` follow the same convention (the stored value is divided by the scale, readers
multiply by it).  e4m3 keeps 3 mantissa bits: a relative step of 2^-3 for normal values
(``|x / scale| >= 2^-6``) and an absolute step of ``2^-9 * scale`` below that.
"""
from __future__ import annotations

import math
import numbers
from typing import List, Sequence, Union

import torch

__all__ = ["FP8_E4M3_MAX", "FLOAT_DTYPES", "KV_CACHE_DTYPES", "check_kv_scale", "check_kv_scales",
           "quantize_kv"]

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP32_TINY, FP32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV_CACHE_DTYPES = FLOAT_DTYPES + (torch.float8_e4m3fn,)


def check_kv_scale(name: str, scale, fp8: bool) -> float:
    """``scale`` as a Python float.

    Raises:
        TypeError: not a real number (bools included).
        ValueError: not finite and > 0, or != 1.0 for a cache that is not fp8 (such a cache
            stores values unscaled).
    """
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be a Python float, got {type(scale).__name__}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be finite and > 0, got {scale}")
    if not FP32_TINY <= scale <= FP32_MAX:   # the kernels take it as a float32
        raise ValueError(f"{name}={scale} is outside float32's normal range")
    if not fp8 and scale != 1.0:
        raise ValueError(f"{name}={scale} only applies to a float8_e4m3fn cache; the cache "
                         f"holds unscaled values, pass 1.0")
    return scale


def check_kv_scales(name: str, scales: Union[float, Sequence[float]], layer_num: int,
                    fp8: bool) -> List[float]:
    """One scale per layer from a float (every layer) or a sequence of ``layer_num`` floats.
    Errors as :func:`check_kv_scale`, plus ValueError for a sequence of the wrong length."""
    if isinstance(scales, (list, tuple)) or (isinstance(scales, torch.Tensor) and scales.dim() == 1):
        vals = [float(s) if isinstance(s, torch.Tensor) else s for s in scales]
        if len(vals) != layer_num:
            raise ValueError(f"{name} needs one scale per layer ({layer_num}), got {len(vals)}")
        return [check_kv_scale(f"{name}[{i}]", s, fp8) for i, s in enumerate(vals)]
    return [check_kv_scale(name, scales, fp8)] * layer_num


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as stored in a cache of ``dtype``: fp8 ``clamp(x / scale, +-448)`` cast (RTNE,
    saturating like ``__nv_cvt_float_to_fp8(.., __NV_SATFINITE, __NV_E4M3)``), other dtypes a
    plain cast (``scale`` must be 1.0 for them; not checked here)."""
    if dtype == torch.float8_e4m3fn:
        return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return x.to(dtype)
