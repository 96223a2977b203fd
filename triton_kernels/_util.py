"""Helpers shared by the Triton launchers (host side: the device guard and block sizes) and
kernels (device side: the bit-exact bf16 / fp8 e4m3 roundings :func:`bf16_bits` and
:func:`fp8e4m3_bits`).

Triton launches on the *current* CUDA device, so a call whose tensors live on another GPU
would launch there and fault.  :func:`on_tensor_device` makes the launchers run with the
device of their first tensor argument current (as ``torch.ops.specattn`` kernels do through
their C++ guard).  No-op for CPU tensors (the interpreter) and when the device is already
current (a cheap index exchange, safe inside CUDA-graph capture).
"""
from __future__ import annotations

import functools
import numbers
import os
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, Sequence) and not isinstance(x, str) and len(x) and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def on_tensor_device(fn):
    """Decorator: run ``fn`` with the CUDA device of its first tensor argument (or the first
    tensor of a first list argument) current."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = _first_tensor(args[0]) if args else None
        if t is None or not t.is_cuda:
            return fn(*args, **kwargs)
        with torch.cuda.device(t.device):
            return fn(*args, **kwargs)
    return wrapper


def next_pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= ``max(n, 1)``, at least ``lo`` (a ``tl.arange`` block size)."""
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def is_pow2(x) -> bool:
    """True for a positive int (not a bool) that is a power of two."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and not x & (x - 1)


FP8_KV_DTYPE = torch.float8_e4m3fn
FP32_TINY, FP32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


def _positive_f32(name: str, val, types: tuple) -> float:
    """``val`` as a Python float; ValueError naming ``name`` unless it is an instance of
    ``types`` (not a bool), finite and > 0 in float32's normal range."""
    if not (isinstance(val, types) and not isinstance(val, bool)
            and FP32_TINY <= float(val) <= FP32_MAX):
        raise ValueError(f"{name} must be a finite float > 0 in float32's normal range, got {val!r}")
    return float(val)


def check_sm_scale(sm_scale) -> float:
    """``sm_scale`` (the attention kernels' score scale) as a Python float.  Raises ValueError
    unless it is a real number (``numbers.Real``: Python and NumPy scalars, not a bool),
    finite and > 0 in float32's normal range: the kernels take a tile's row maximum before
    scaling it, so a scale <= 0 would pick the wrong maximum and turn a masked ``-inf`` score
    into ``+inf`` or NaN."""
    return _positive_f32("sm_scale", sm_scale, (numbers.Real,))


def check_dequant_scales(cache_dtype: torch.dtype, **scales) -> tuple:
    """The attention kernels' dequantization scales as Python floats, in keyword order.
    Raises ValueError for a scale that is not a finite real > 0, or not 1.0 for a cache that is
    not fp8 (e4m3)."""
    out = []
    for name, val in scales.items():
        val = _positive_f32(name, val, (int, float))
        if cache_dtype != FP8_KV_DTYPE and val != 1.0:
            raise ValueError(f"{name}={val} only applies to a float8_e4m3fn cache, got a "
                             f"{cache_dtype} one")
        out.append(val)
    return tuple(out)


def kv_conversion(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> tuple:
    """How a kernel feeds cache tiles to its dots: ``(upcast, cast_kv)``.  ``upcast``: q and the
    tiles go to float32 (dtypes differ and no cheaper path exists); ``cast_kv``: an fp8 cache
    under a bf16/fp16 ``q``: q and the tiles go to float16 (exact in fp16's range)."""
    cast_kv = cache_dtype == FP8_KV_DTYPE and q_dtype in (torch.bfloat16, torch.float16)
    return q_dtype != cache_dtype and not cast_kv, cast_kv


def require_device(t: torch.Tensor, op: str, interpret: bool) -> None:
    """Refuse a launch of the Triton ``op`` on a tensor off CUDA unless the launch runs in
    Triton's interpreter (``interpret``: the calling module's ``TRITON_INTERPRET`` flag).

    Raises:
        RuntimeError: ``t`` is not on a CUDA device and ``interpret`` is False.
    """
    if t.device.type != "cuda" and not interpret:
        raise RuntimeError(f"triton implementation of {op} unavailable for tensors on "
                           f"{t.device} (set TRITON_INTERPRET=1 to run it on the CPU)")


ATTENTION_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ATTENTION_CACHE_DTYPES = ATTENTION_Q_DTYPES + (FP8_KV_DTYPE,)


def check_attention_dtypes(q: torch.Tensor, cache: torch.Tensor, out: Optional[torch.Tensor],
                           out_shape: tuple) -> None:
    """The launchers' tensor checks: ``q`` fp32 / bf16 / fp16, the cache one of those or fp8
    e4m3, and a given ``out`` of ``out_shape`` in a float dtype on ``q``'s device with a
    contiguous last dim.

    Raises:
        ValueError: the first violation, named.
    """
    if q.dtype not in ATTENTION_Q_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if cache.dtype not in ATTENTION_CACHE_DTYPES:
        raise ValueError(f"the KV cache must be float32, bfloat16, float16 or float8_e4m3fn, got {cache.dtype}")
    if out is not None and (tuple(out.shape) != tuple(out_shape) or out.dtype not in ATTENTION_Q_DTYPES
                            or out.device != q.device or out.stride(-1) != 1):
        raise ValueError(f"out must be float32 / bfloat16 / float16 {list(out_shape)} on {q.device} with a "
                         f"contiguous last dim, got {out.dtype} {list(out.shape)} on {out.device}")


def check_out_apart(out: Optional[torch.Tensor], **caches: torch.Tensor) -> None:
    """Raise ValueError when a given ``out`` may share memory with a cache the kernel reads
    (byte spans overlap): its rows would be read after other programs wrote them.  ``out``
    may alias ``q`` (each program reads its own rows of ``q`` before it writes them)."""
    def span(t: torch.Tensor):   # [first, last + 1) byte addresses of t's elements
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    if out is None or out.numel() == 0:
        return
    lo, hi = span(out)
    for name, c in caches.items():
        if c.numel() and span(c)[0] < hi and lo < span(c)[1]:
            raise ValueError(f"out overlaps {name} in memory; the kernel reads it while writing out")


def check_paged_metadata(q: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         prefix_lens: torch.Tensor, qo_indptr: torch.Tensor, tree_mask, max_q: int,
                         num_splits: int, num_slots: int, check_bounds: bool, page_size: int = 1) -> None:
    """The metadata checks shared by the paged-attention launchers (MHA and MLA).

    Always (no host sync): dtypes (``req_pool_indices`` int64, ``prefix_lens`` / ``qo_indptr`` /
    ``req_to_token`` int32) and devices (``q``'s), shapes (``qo_indptr [bs + 1]``,
    ``prefix_lens [bs]``), contiguous ``req_pool_indices`` / ``prefix_lens`` / ``qo_indptr``
    (the kernels index them at stride 1), a ``tree_mask`` of at least ``[bs, max_q,
    ceil(max_q / 32)]`` int32 words with a contiguous last dim, ``num_splits >= 1``.

    With ``check_bounds`` (skipped during CUDA-graph capture; one host read): every index the
    kernel will follow is in range, so no launch reads or writes out of bounds:
    ``qo_indptr[0] == 0``, ``0 <= n <= max_q`` (``n`` = each request's new tokens),
    ``qo_indptr[-1] <= T`` (``== T`` with ``num_splits > 1``: the merge writes every row),
    ``prefix_lens >= 0``, ``prefix_lens + n <= req_to_token.shape[1]``, ``req_pool_indices`` rows of
    ``req_to_token``, the slots ``req_to_token[r, :prefix_lens + n]`` in ``[0, num_slots)``,
    and with ``page_size > 1`` the page layout the kernels' page paths rely on (position ``p``
    at slot offset ``p % page_size``).  Backends that validated the batch once pass
    ``check_bounds=False`` per layer.

    Raises:
        ValueError: the first violation, named.
    """
    bs = req_pool_indices.shape[0]
    if tree_mask is not None and (tree_mask.dtype != torch.int32 or tree_mask.dim() != 3
                                  or tree_mask.stride(2) != 1 or tree_mask.shape[0] < bs
                                  or tree_mask.shape[1] < max_q
                                  or tree_mask.shape[2] < (max_q + 31) // 32):
        raise ValueError(f"tree_mask must be int32 [>= {bs}, >= {max_q}, >= {(max_q + 31) // 32}] "
                         f"with a contiguous last dim, got {tree_mask.dtype} {list(tree_mask.shape)}")
    for name, t, dt in (("req_pool_indices", req_pool_indices, torch.int64),
                        ("prefix_lens", prefix_lens, torch.int32), ("qo_indptr", qo_indptr, torch.int32),
                        ("req_to_token", req_to_token, torch.int32)):
        if t.dtype != dt or t.device != q.device:
            raise ValueError(f"{name} must be {dt} on {q.device}, got {t.dtype} on {t.device}")
    if qo_indptr.shape != (bs + 1,) or prefix_lens.shape != (bs,):
        raise ValueError(f"qo_indptr must be [{bs + 1}] and prefix_lens [{bs}], got "
                         f"{list(qo_indptr.shape)} / {list(prefix_lens.shape)}")
    for name, t in (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens), ("qo_indptr", qo_indptr)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernels read it at stride 1)")
    if num_splits < 1:
        raise ValueError("num_splits must be >= 1")
    if not check_bounds or bs == 0 or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    rows, width = req_to_token.shape
    n = (qo_indptr[1:] - qo_indptr[:-1]).long()
    ends = prefix_lens.long() + n
    safe_rows = req_pool_indices.clamp(0, max(rows - 1, 0))
    pos = torch.arange(width, device=q.device)
    used = pos[None, :] < ends.clamp(max=width)[:, None]
    slots = req_to_token[safe_rows].long()
    big = torch.iinfo(torch.int64).max
    off_page = torch.where(used, (slots - pos[None, :]) % page_size, 0).max() if page_size > 1 else n.new_zeros(())
    stats = torch.stack([qo_indptr[0].long(), n.min(), n.max(), qo_indptr[-1].long(),
                         prefix_lens.min().long(), ends.max(), req_pool_indices.min(), req_pool_indices.max(),
                         torch.where(used, slots, big).min(), torch.where(used, slots, -1).max(),
                         off_page]).tolist()
    first, n_min, n_max, last, p_min, end_max, r_min, r_max, s_min, s_max, off = stats
    T = q.shape[0]
    problems = [
        (first != 0, f"qo_indptr[0] must be 0, got {first}"),
        (n_min < 0, "qo_indptr must be non-decreasing"),
        (n_max > max_q, f"a request has {n_max} new tokens, more than max_q = {max_q}"),
        (last > T, f"qo_indptr[-1] = {last} exceeds q's {T} rows"),
        (num_splits > 1 and last != T, f"with num_splits > 1 every row of q must belong to a "
                                       f"request: qo_indptr[-1] = {last}, T = {T}"),
        (p_min < 0, "prefix_lens must be >= 0"),
        (end_max > width, f"prefix_lens + new tokens reaches {end_max}, past req_to_token's width {width}"),
        (r_min < 0 or r_max >= rows, f"req_pool_indices must be in [0, {rows}), got [{r_min}, {r_max}]"),
        (s_max >= 0 and (s_min < 0 or s_max >= num_slots),
         f"req_to_token holds slots [{s_min}, {s_max}] for these requests, outside the cache's "
         f"[0, {num_slots})"),
        (off != 0, f"page_size = {page_size}, but req_to_token puts a position p of these requests "
                   f"at a slot s with s % {page_size} != p % {page_size} (the paged layout)"),
    ]
    for bad, why in problems:
        if bad:
            raise ValueError(why)


_FITTING_STAGES: dict = {}


def choose_gluon(sm90, why, conflicts: Sequence[str], schedule_key: str, schedule) -> bool:
    """Whether a launcher runs its Gluon sm_90 kernel.  ``why``: None when the kernel can run
    the call, else the reason (str); ``conflicts``: the config overrides set that it does not
    take; ``sm90`` / ``schedule`` (the kernel's ``schedule_key`` flag, e.g. ``"seesaw"``):
    the caller's True / False / None.  Raises ValueError when ``sm90`` or ``schedule`` is True
    and the kernel cannot run, naming why.  Host-only."""
    if why is None and conflicts:
        why = f"no {'/'.join(conflicts)} override"
    if sm90 and why is not None:
        raise ValueError(f"sm90=True needs {why}")
    if schedule and why is not None:
        raise ValueError(f"{schedule_key}=True needs the Gluon sm_90 kernel, which cannot run "
                         f"here: {why}")
    return why is None


def launch_fitting(kernel, grid, args: Sequence, kwargs: dict, num_stages: int) -> int:
    """``kernel[grid](*args, **kwargs, num_stages=...)`` with ``num_stages``, or fewer stages
    where this Triton's software pipelining of the config needs more shared memory than the
    GPU has.  Triton raises ``OutOfResources`` at a config's launch, before any work is
    enqueued (Triton versions buffer different stage counts: the defaults were measured with
    3.6, whose buffers a newer one may outgrow).  A config that fits costs nothing extra; for
    one that does not, the stage count that fits is remembered per (kernel, device,
    constexprs and warps, argument dtypes) and a RuntimeWarning says once that it was
    lowered.  Returns the stage count used.

    Raises:
        triton.runtime.errors.OutOfResources: not even one stage fits.
    """
    import warnings

    from triton.runtime.errors import OutOfResources
    try:
        kernel[grid](*args, **kwargs, num_stages=num_stages)
        return num_stages
    except OutOfResources:
        if num_stages <= 1:
            raise
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    key = (getattr(kernel, "fn", kernel), str(dev), tuple(sorted(kwargs.items(), key=lambda kv: kv[0])),
           tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor)), num_stages)
    stages = _FITTING_STAGES.get(key, num_stages - 1)
    while True:
        try:
            kernel[grid](*args, **kwargs, num_stages=stages)
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            continue
        if key not in _FITTING_STAGES:
            _FITTING_STAGES[key] = stages
            warnings.warn(f"{getattr(kernel, '__name__', kernel)}: num_stages {num_stages} needs more "
                          f"shared memory than this GPU has with this Triton; using {stages}",
                          RuntimeWarning, stacklevel=3)
        return stages


# ----------------------------------------------------------------------------- device side
# Rounding on the float32 bits: the Triton 3.9 interpreter's ``.to(bfloat16)`` truncates and
# its ``.to(float8e4nv)`` mis-rounds values just below a power of two (measured), so the
# kernels that store bf16 / fp8 caches round here (integer operations: exact in the
# interpreter and on the GPU alike) and store the bits through a uint16 / uint8 view.
@triton.jit
def bf16_bits(x):
    """float32 -> bfloat16 bit pattern (uint16), round to nearest even; NaN stays NaN."""
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    r = tl.where(nan, (b >> 16) | 0x40, r)
    return r.to(tl.uint16)


@triton.jit
def fp8e4m3_bits(x):
    """float32 -> float8_e4m3fn bit pattern (uint8): saturate to +-448, then round to
    nearest even (subnormals included); NaN -> 0x7F (sign kept).  The same code as
    ``x.clamp(-448, 448).to(torch.float8_e4m3fn)`` (:func:`specattn.ops.fp8.quantize_kv`
    after its division by the scale)."""
    sign = (x.to(tl.uint32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(x), 448.0)
    # subnormal range |x| < 2^-6: code = rtne(|x| * 2^9) in 0..8 (8 is the smallest normal)
    s = a * 512.0
    fl = tl.floor(s)
    fr = s - fl
    qi = fl.to(tl.uint32)
    up = (fr > 0.5) | ((fr == 0.5) & ((qi & 1) == 1))
    q_sub = qi + up.to(tl.uint32)
    # normal range: keep 3 mantissa bits with RTNE; exponent bias 127 -> 7
    ab = a.to(tl.uint32, bitcast=True)
    r = ab + 0x7FFFF + ((ab >> 20) & 1)
    q_norm = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    code = tl.where(a < 0.015625, q_sub, q_norm)
    code = tl.where(x != x, 0x7F, code)
    return (code | sign).to(tl.uint8)


# Programmatic dependent launch (sm_90+; on unless SPECATTN_PDL=0).  A kernel launched with it
# may start while the previous grid still runs: it must run ``gdc_wait`` in every program
# before it reads anything an earlier kernel wrote or writes anything one reads, and may do
# only side-effect-free work before that (an L2 prefetch of its weights).
PDL = os.environ.get("SPECATTN_PDL", "1") not in ("", "0")
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")   # read once, as the kernel modules do


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_kwargs(t: torch.Tensor) -> dict:
    """The launch options of programmatic dependent launch for a kernel on ``t``'s device.

    Returns ``dict(PDL=True, launch_pdl=True)`` (the kernel's ``PDL`` constexpr and
    Triton's launch attribute) when it applies: :data:`PDL` set (the environment variable
    ``SPECATTN_PDL``, default on), a CUDA tensor on a device of compute capability 9.0 or
    more, and not the Triton interpreter; else ``{}``.  The launch then lets the kernel's
    programs start while the previous kernel on the stream drains (they wait in
    ``gdc_wait`` before touching its outputs), inside CUDA graphs too, which hides most of
    the launch gap between the short kernels of a small-batch step (CUDA programming guide,
    "Programmatic Dependent Launch and Synchronization").
    """
    if not PDL or _INTERPRET or t.device.type != "cuda":
        return {}
    if not _pdl_device(t.device.index if t.device.index is not None else torch.cuda.current_device()):
        return {}
    return dict(PDL=True, launch_pdl=True)


@triton.jit
def gdc_enter(PDL: tl.constexpr):
    """The first statement of a kernel that may be launched with :func:`pdl_kwargs`: under
    ``PDL``, wait for the previous grid (its writes are then visible), then let the next
    grid launch; nothing otherwise."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
