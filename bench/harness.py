"""Timing on a CUDA device, the measured ceilings, and the statistics behind each figure.

Method: warm up, then time every iteration on its own with a pair of ``torch.cuda.Event``s
around either a CUDA-graph replay (default) or an eager call; report the median of at least
:data:`MIN_ITERS` iterations. Successive iterations rotate through the workload's input sets;
when those together are smaller than twice the L2 cache, a buffer of twice the L2 size is
written before every iteration (outside the timed region) so the cache is not what is timed.

The statistics helpers (:func:`median`, :func:`gbps`, :func:`tflops`, :func:`pct_of`,
:func:`summarize`) are pure Python and run anywhere.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .cases import Workload

MIN_ITERS = 50
MATMUL_N = 8192


# --------------------------------------------------------------------------- statistics


def median(times: Sequence[float]) -> float:
    """Median of ``times`` (any unit). Raises ValueError on an empty sequence."""
    if not times:
        raise ValueError("median of no timings")
    return float(statistics.median(times))


def percentile(times: Sequence[float], q: int) -> float:
    """The ``q``-th percentile (1..99, inclusive method) of ``times``; needs 2+ values."""
    return float(statistics.quantiles(times, n=100, method="inclusive")[q - 1])


def gbps(nbytes: int, seconds: float) -> Optional[float]:
    """Bandwidth in GB/s (1e9 bytes/s); None when ``nbytes`` is 0 (not a data-moving case).
    Raises ValueError when ``seconds <= 0``."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return nbytes / seconds / 1e9 if nbytes else None


def tflops(flops: int, seconds: float) -> Optional[float]:
    """Rate in TFLOP/s (1e12 flop/s); None when ``flops`` is 0. Raises ValueError when
    ``seconds <= 0``."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return flops / seconds / 1e12 if flops else None


def pct_of(value: Optional[float], ceiling: Optional[float]) -> Optional[float]:
    """``100 * value / ceiling``; None when either is None or the ceiling is not positive."""
    if value is None or ceiling is None or ceiling <= 0:
        return None
    return 100.0 * value / ceiling


@dataclass
class Ceilings:
    """Measured ceilings: copy bandwidth (GB/s, bytes read + written; the faster of a memcpy
    and a kernel copy, both kept) and bf16 matmul rate (TFLOP/s)."""
    copy_gbps: float
    matmul_tflops: float
    copy_bytes: int = 0
    matmul_n: int = MATMUL_N
    memcpy_gbps: Optional[float] = None
    kernel_copy_gbps: Optional[float] = None


@dataclass
class CaseResult:
    """One case's figures. Times in microseconds; ``pct_*`` in percent of the ceilings."""
    name: str
    median_us: float
    p10_us: float
    p90_us: float
    iters: int
    bytes: int
    flops: int
    gbps: Optional[float]
    tflops: Optional[float]
    pct_copy_bw: Optional[float]
    pct_matmul: Optional[float]
    meta: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("meta"))
        return d


def summarize(name: str, times_ms: Sequence[float], nbytes: int, flops: int,
              ceilings: Optional[Ceilings], **meta) -> CaseResult:
    """Turn per-iteration times (milliseconds) into a :class:`CaseResult`.

    Raises:
        ValueError: fewer than 2 timings, or a non-positive median.
    """
    if len(times_ms) < 2:
        raise ValueError(f"need at least 2 timings, got {len(times_ms)}")
    med_s = median(times_ms) / 1e3
    bw, rate = gbps(nbytes, med_s), tflops(flops, med_s)
    return CaseResult(
        name=name, median_us=med_s * 1e6, p10_us=percentile(times_ms, 10) * 1e3,
        p90_us=percentile(times_ms, 90) * 1e3, iters=len(times_ms), bytes=nbytes, flops=flops,
        gbps=bw, tflops=rate,
        pct_copy_bw=pct_of(bw, ceilings.copy_gbps if ceilings else None),
        pct_matmul=pct_of(rate, ceilings.matmul_tflops if ceilings else None),
        meta=dict(meta))


# --------------------------------------------------------------------------- timing


def require_cuda() -> None:
    """Raise RuntimeError unless torch sees a CUDA device."""
    if not torch.cuda.is_available():
        raise RuntimeError("a CUDA GPU is needed to time bench cases "
                           "(torch.cuda.is_available() is False)")


def l2_cache_bytes(device: int = 0) -> int:
    """L2 size in bytes of CUDA device ``device``."""
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def needs_l2_flush(num_input_sets: int, bytes_per_call: int, l2_bytes: int) -> bool:
    """True when rotating through ``num_input_sets`` sets of ``bytes_per_call`` bytes each
    touches less than twice ``l2_bytes``, so a set could still be cached when it comes round
    again (or when the case reports no bytes at all)."""
    return num_input_sets * bytes_per_call < 2 * l2_bytes


@dataclass
class Prepared:
    """A workload ready to time: one runner per input set (graph replays or eager calls), the
    L2 flush to run before each iteration (None when rotation suffices), and how."""
    runners: List[Callable[[], Any]]
    flush: Optional[Callable[[], Any]]
    mode: str  # "cuda-graph" | "eager"
    note: str = ""
    _keep: list = field(default_factory=list, repr=False)


def _capture(calls: List[Callable[[], Any]]) -> List[torch.cuda.CUDAGraph]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for c in calls:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            c()
        graphs.append(g)
    return graphs


def prepare(workload: Workload, *, use_graph: bool = True, flush_l2: Optional[bool] = None,
            warmup: int = 3) -> Prepared:
    """Warm ``workload`` up (``warmup`` eager calls per input set) and capture one CUDA graph
    per input set when ``use_graph`` (falling back to eager calls, with the reason in
    ``note``, if capture fails). ``flush_l2=None`` flushes only when the input sets together
    move less than twice the L2 size. The result holds ``workload``: its graphs replay
    into the workload's tensors, which must outlive them. Raises RuntimeError without CUDA."""
    require_cuda()
    calls = workload.calls()
    for _ in range(warmup):
        for c in calls:
            c()
    torch.cuda.synchronize()
    mode, note, runners, keep = "eager", "", calls, []
    if use_graph:
        try:
            graphs = _capture(calls)
            runners, keep, mode = [g.replay for g in graphs], [workload, *graphs], "cuda-graph"
        except Exception as e:  # not capturable (host sync, CPU work): time eager calls
            note = f"graph capture failed, timed eager: {type(e).__name__}: {e}"
            torch.cuda.synchronize()
    l2 = l2_cache_bytes()
    if flush_l2 is None:
        flush_l2 = needs_l2_flush(len(calls), workload.bytes, l2)
    flush = None
    if flush_l2:
        scratch = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
        keep.append(scratch)
        flush = scratch.zero_
    torch.cuda.synchronize()
    return Prepared(runners, flush, mode, note, keep)


def time_prepared(prep: Prepared, iters: int = 100) -> List[float]:
    """Time ``iters`` (>= :data:`MIN_ITERS`) iterations, rotating through ``prep.runners``;
    returns each iteration's device time in milliseconds. Raises ValueError if
    ``iters < MIN_ITERS``."""
    if iters < MIN_ITERS:
        raise ValueError(f"iters must be >= {MIN_ITERS}, got {iters}")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    n = len(prep.runners)
    for i in range(iters):
        if prep.flush is not None:
            prep.flush()
        starts[i].record()
        prep.runners[i % n]()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def measure_ceilings(iters: int = MIN_ITERS, copy_bytes: Optional[int] = None,
                     matmul_n: int = MATMUL_N) -> Ceilings:
    """Measure the copy bandwidth and the bf16 ``n^3`` matmul rate, each the median of
    ``iters`` graph-replayed iterations on random data.

    Copy: ``copy_bytes`` per buffer (default max(1 GiB, 16 x L2)) of bf16, counting bytes read
    plus written, timed two ways: ``Tensor.copy_`` (a driver memcpy) and an elementwise kernel
    (``torch.mul(src, 1, out=dst)``, SM-driven like our kernels; on an H100 it reaches about
    3.0 TB/s where the memcpy gets about 2.4). The ceiling is the faster of the two.
    Raises RuntimeError without CUDA.
    """
    require_cuda()
    copy_bytes = copy_bytes or max(1 << 30, 16 * l2_cache_bytes())
    src = torch.randn(copy_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_gbps = {}
    for kind, fn in (("memcpy", lambda: dst.copy_(src)),
                     ("kernel", lambda: torch.mul(src, 1, out=dst))):
        wl = Workload(fn=fn, bytes=2 * src.nbytes)
        t = median(time_prepared(prepare(wl, flush_l2=False), iters)) / 1e3
        copy_gbps[kind] = gbps(2 * src.nbytes, t)
    del src, dst

    a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    mm = Workload(fn=lambda: torch.matmul(a, b, out=c), bytes=3 * a.nbytes,
                  flops=2 * matmul_n ** 3)
    t_mm = median(time_prepared(prepare(mm, flush_l2=False), iters)) / 1e3
    del a, b, c, mm
    torch.cuda.empty_cache()
    return Ceilings(copy_gbps=max(copy_gbps.values()),
                    matmul_tflops=tflops(2 * matmul_n ** 3, t_mm),
                    copy_bytes=copy_bytes // 2 * 2, matmul_n=matmul_n,
                    memcpy_gbps=copy_gbps["memcpy"], kernel_copy_gbps=copy_gbps["kernel"])
