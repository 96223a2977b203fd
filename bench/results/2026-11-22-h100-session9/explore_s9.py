"""Exploration (session 9): where an iteration of the ping-pong tree-verify kernel spends its
cycles, and variants of it.  ``alt_kernel/attention_sm90_alt.py`` is a scratch copy of the
package's module with an ``OPTS`` bit mask on the ping-pong kernel; it is not committed (it
repeats the module): rebuild it with ``mkdir -p alt_kernel && patch -o
alt_kernel/attention_sm90_alt.py ../../../triton_kernels/attention_sm90.py alt_kernel.diff``
(the module as of commit 4d25ed9; only its docstring differs from 5562ddd's).

OPTS bits: 1 ``%clock64`` trace; 2 lazy rescale (the running max moves only when a row's
max grows by more than 8 in log2 units, one flag for the warpgroup); 4 the scale folded
into the exponent (one FFMA); 8 no proxy fence (diagnostic); 16 score GEMM one tile ahead,
in flight across the loop's back edge; 32 half the exponentials in software (a degree-3
polynomial on the FMA pipe); 64 warpgroup 1's first turn after warpgroup 0's first
softmax; 128 each turn handed over after the row maxima rather than after the GEMM issue;
256 with 128, the exponentials kept after that hand-over (an smem round trip of the maxima);
512 with 128, only warpgroup 0 hands over late; 1024 an 8-warp loader (registers 224 / 32);
2048 score GEMM one tile ahead, waited at the end of the iteration (nothing in flight across
the back edge); 4096 registers 240 / 24; 8192 the PV wait kept after the softmax (an smem
store and a warpgroup barrier); 16384 no turn barriers; 32768 the loop's score GEMM over
half of ``head_dim`` (diagnostic, wrong output); 65536 / 131072 the loader loads the slots
of 2 / 3 tiles ahead; 262144 registers 224 / 56; 1048576 the loader alone (the compute
warpgroups only wait for each stage and free it; diagnostic, wrong output); 2097152 the
compute alone (the loader fills the ring once and then only arrives; diagnostic, wrong
output).

Usage: ``[TRACE_OPTS=a,b] python explore_s9.py [--trace] VARIANT...`` with VARIANT
``default`` (the package's kernel) or ``alt:OPTS``.  Prints max |diff| vs the portable
Triton kernel on small shapes; with --trace, for each traced OPTS (default 0) at bs 16 / P
2048 and bs 64 / P 4096, the median (p10, p90) cycles of each segment of an iteration over
every CTA and iterations 4 .. min(n, 80) - 4; then the median us of 50 CUDA-graph replays
per point.  Inputs and timer: session 8's ``explore_tree_verify.py``."""
import functools
import importlib.util
import os
import sys

import torch

import specattn.triton_kernels.attention as A

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "2026-11-22-h100-session8"))
from explore_tree_verify import bench, make  # noqa: E402  (session 8's inputs and timer)

orig = A.sm90_tree_verify


def _alt():
    name = "specattn.triton_kernels.attention_sm90_alt"
    if name not in sys.modules:
        path = os.path.join(HERE, "alt_kernel", "attention_sm90_alt.py")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def call(a, variant, splits, trace=None):
    q, k, v, rtt, rpi, seq, qo, tm, n = a
    if variant is None:
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=False,
                                 check_bounds=False)
    if variant == "default":
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=True,
                                 check_bounds=False)
    opts = int(variant.split(":")[1])
    A.sm90_tree_verify = functools.partial(_alt().sm90_tree_verify, opts=opts, trace=trace)
    try:
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=True,
                                 check_bounds=False)
    finally:
        A.sm90_tree_verify = orig


def trace_report(bs, P, opts):
    a = make(bs, P)
    n_cta = 2 * 8 * bs
    tr = torch.zeros(n_cta, 3, 80, 8, dtype=torch.int64, device="cuda")
    call(a, f"alt:{opts | 1}", 1, trace=tr)
    torch.cuda.synchronize()
    t = tr.cpu().double()
    n_tiles = (P + 64 + 63) // 64
    js = list(range(4, min(n_tiles, 80) - 4))
    seg = {k: [] for k in ("rescale+full", "turn wait", "issue+S", "softmax", "max", "exp+sum",
                           "PV wait", "period", "wg1-wg0", "loader lead", "loader issue")}
    for c in range(n_cta):
        for w in (0, 1):
            e = t[c, w]
            for j in js:
                seg["rescale+full"].append(e[j, 0] - e[j - 1, 4])
                seg["turn wait"].append(e[j, 1] - e[j, 0])
                seg["issue+S"].append(e[j, 2] - e[j, 1])
                seg["softmax"].append(e[j, 3] - e[j, 2])
                seg["max"].append(e[j, 5] - e[j, 2])
                seg["exp+sum"].append(e[j, 3] - e[j, 5])
                seg["PV wait"].append(e[j, 4] - e[j, 3])
                seg["period"].append(e[j + 1, 1] - e[j, 1])
        for j in js:
            seg["wg1-wg0"].append(t[c, 1, j, 1] - t[c, 0, j, 1])
            seg["loader lead"].append(t[c, 0, j, 0] - t[c, 2, j, 1])
            seg["loader issue"].append(t[c, 2, j, 1] - t[c, 2, j, 0])
    out = []
    for k, v in seg.items():
        v = torch.tensor(v)
        out.append(f"{k} {v.median().item():.0f} (p10 {v.quantile(0.1).item():.0f}, "
                   f"p90 {v.quantile(0.9).item():.0f})")
    print(f"trace bs{bs} P{P} opts{opts}: " + "; ".join(out), flush=True)


if __name__ == "__main__":
    do_trace = "--trace" in sys.argv
    variants = [v for v in sys.argv[1:] if not v.startswith("--")]
    print(torch.cuda.get_device_name(), flush=True)
    for bs, P, S, n in [(3, 300, 1, 64), (2, 1000, 3, 64), (1, 77, 2, 64), (5, 129, 1, 64),
                        (2, 200, 1, 8), (3, 500, 2, 20), (2, 0, 1, 64), (4, 5000, 4, 33),
                        (2, 4096, 1, 64), (1, 130, 9, 64)]:
        a = make(bs, P, n=n, seed=bs * 1000 + P)
        ref = call(a, None, S).float()
        row = [f"{vv} {(call(a, vv, S).float() - ref).abs().max().item():.2e}" for vv in variants]
        print(f"check bs{bs} P{P} S{S} n{n}: max|d| vs triton: " + ", ".join(row), flush=True)
    if do_trace:
        for bs, P in [(16, 2048), (64, 4096)]:
            for o in [int(x) for x in os.environ.get("TRACE_OPTS", "0").split(",")]:
                trace_report(bs, P, o)
    for bs, P, splits in [(1, 4096, (8,)), (16, 2048, (1,)), (64, 4096, (1,)), (16, 16384, (1,))]:
        a = make(bs, P)
        for S in splits:
            row = [f"{vv}: {bench(lambda: call(a, vv, S)):.1f}" for vv in variants]
            print(f"bs{bs} P{P} S{S}: " + "  ".join(row), flush=True)
        del a
        torch.cuda.empty_cache()
