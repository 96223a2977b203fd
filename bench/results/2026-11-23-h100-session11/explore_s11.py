"""Exploration (session 11): what a CTA of the ping-pong tree-verify kernel spends outside its
key loop, and whether a persistent form of the kernel wins it back.

``alt_kernel/attention_sm90_alt.py`` is a scratch copy of the package's module (git-ignored;
rebuild it with ``mkdir -p alt_kernel && patch -o alt_kernel/attention_sm90_alt.py
../../../triton_kernels/attention_sm90.py alt_kernel.diff``).  Its ping-pong kernel takes
``trace=`` (an int64 ``[num_ctas, 8]`` buffer: ``%clock64`` at entry, ``%smid``, when
warpgroup 0 sees the first tile, when its last PV GEMM is done, when warpgroup 0 / 1 have
stored, when the loader has issued tile 0, ``%globaltimer`` at entry).

Usage: ``python explore_s11.py trace|sweep|VARIANT...``; VARIANT ``default``, ``alt:K=V,..``
(keyword arguments of the scratch launcher) or ``p:K=V,..`` (``alt_kernel/
attention_sm90_persist.py``'s launcher: ``persist=1`` the persistent kernel, one CTA per SM,
``lreg`` the loader's registers, ``qbuf=2`` a second q buffer (five stages), ``mpf=1`` the
next item's scalars loaded at the start of this one) or ``s:spf=D``
(``alt_kernel/attention_sm90_slotpf.py``: the loader prefetches into L1 the
``req_to_token`` lines of the tile ``D + 1`` ahead) or ``r:rpf=D``
(``alt_kernel/attention_sm90_rowpf.py``: the m-block-0 CTA of each KV head prefetches into
L2, ``D`` tiles ahead, the whole slot rows (every KV head) of its share of the tile's keys,
``cp.async.bulk.prefetch.L2``) or ``m:mask=M`` (``alt_kernel/attention_sm90_mask.py``: the
tree-mask words of a tile holding draft keys: 0 gathered per score element as the package
does, 1 loaded once per row and selected per key, 2 none (diagnostic, wrong output)) or ``l:lreg=R`` (``alt_kernel/attention_sm90_l8.py``: an
8-warp loader with ``R`` registers, the warpgroups ``(512 - 2 R) / 2``, launched at 128;
``jit=1``: each tile's slots loaded just before its copies, none carried).  ``ptrace=VARIANT``: per-item events of
a persistent variant.  ``ROUNDS=r``: ``r`` rounds of timing, each replaying the variants'
graphs in turn (``bench_interleaved``).  Inputs and timer: session 8's
``explore_tree_verify.py`` (page 1, random slots, GQA 32 / 8, head_dim 128, bf16, 64-token
trees; median of 50 CUDA-graph replays)."""
import functools
import importlib.util
import os
import sys

import torch

import specattn.triton_kernels.attention as A

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "2026-11-22-h100-session8"))
from explore_tree_verify import bench, make  # noqa: E402

orig = A.sm90_tree_verify


def _alt(mod="alt"):
    name = f"specattn.triton_kernels.attention_sm90_{mod}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(HERE, "alt_kernel", f"attention_sm90_{mod}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _kw(variant):
    out = {}
    for item in filter(None, variant.split(":", 1)[1].split(",")):
        k, v = item.split("=")
        out[k] = int(v)
    return out


MODULES = {"alt": "alt", "p": "persist", "s": "slotpf", "r": "rowpf", "m": "mask", "l": "l8",
           "c": "combo"}


def variant_fn(variant, **extra):
    """The launcher of ``variant`` (``default``: the package's)."""
    if variant == "default":
        return orig
    return functools.partial(_alt(MODULES[variant.split(":")[0]]).sm90_tree_verify,
                             **_kw(variant), **extra)


def call(a, variant, splits, **extra):
    q, k, v, rtt, rpi, seq, qo, tm, n = a
    if variant is None:
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=False,
                                 check_bounds=False)
    if variant != "default":
        A.sm90_tree_verify = variant_fn(variant, **extra)
    try:
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=True,
                                 check_bounds=False)
    finally:
        A.sm90_tree_verify = orig


def bench_interleaved(fns, reps=60):
    """Median us of each of ``fns`` (CUDA graphs), replayed in turn ``reps`` times so that
    clock drift (this H100 slows under sustained load) hits every variant alike."""
    graphs = []
    for fn in fns:
        for _ in range(3):
            fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    ts = [[] for _ in fns]
    for _ in range(reps):
        for g, t in zip(graphs, ts):
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record(); g.replay(); e.record(); e.synchronize()
            t.append(s.elapsed_time(e) * 1000)
    return [sorted(t)[len(t) // 2] for t in ts]


def _q(v, f=0.5):
    return torch.tensor(v, dtype=torch.float64).quantile(f).item()


def trace_report(bs, P, splits):
    a = make(bs, P)
    n_cta = 2 * 8 * bs * splits
    tr = torch.zeros(n_cta, 8, dtype=torch.int64, device="cuda")
    for _ in range(3):  # warm (compile, L2 state as in a timed replay)
        call(a, "alt:", splits, trace=tr)
    torch.cuda.synchronize()
    t = tr.cpu().tolist()
    by_sm = {}
    for c in t:
        by_sm.setdefault(c[1], []).append(c)
    # clock rate from the first and last CTA of each SM (cycles per ns)
    rates = [(s[-1][0] - s[0][0]) / max(s[-1][7] - s[0][7], 1) for s in
             (sorted(v) for v in by_sm.values()) if len(s) > 1]
    ghz = _q(rates) if rates else 1.7
    us = lambda cyc: cyc / ghz / 1000  # noqa: E731
    start = [c[2] - c[0] for c in t]
    issue0 = [c[5] - c[0] for c in t]
    loop = [c[3] - c[2] for c in t]
    epi = [max(c[4], c[6]) - c[3] for c in t]
    gaps, busy, span = [], 0, 0
    for v in by_sm.values():
        v.sort()
        for p, nx in zip(v, v[1:]):
            gaps.append(nx[0] - max(p[4], p[6]))
    g_all = [c[7] for c in t]
    ends = []
    for v in by_sm.values():
        busy += sum(max(c[4], c[6]) - c[0] for c in v)
        ends.append(v[-1][7] + us(max(v[-1][4], v[-1][6]) - v[-1][0]) * 1000)
    span_ns = max(ends) - min(g_all)
    print(f"trace bs{bs} P{P} S{splits}: {len(by_sm)} SMs, {n_cta} CTAs, {ghz:.3f} GHz; "
          f"us median (p10, p90): entry->tile0 landed {us(_q(start)):.2f} ({us(_q(start, .1)):.2f}, "
          f"{us(_q(start, .9)):.2f}); entry->loader issued tile0 {us(_q(issue0)):.2f}; "
          f"loop {us(_q(loop)):.2f} ({us(_q(loop, .1)):.2f}, {us(_q(loop, .9)):.2f}); "
          f"epilogue {us(_q(epi)):.2f}; gap to next CTA on the SM "
          f"{us(_q(gaps)) if gaps else 0:.2f} ({us(_q(gaps, .1)) if gaps else 0:.2f}, "
          f"{us(_q(gaps, .9)) if gaps else 0:.2f}); kernel span {span_ns / 1000:.1f} us; "
          f"SM busy (in a CTA) {us(busy) / len(by_sm):.1f} us/SM", flush=True)


def ptrace_report(bs, P, splits, variant):
    """Per-item ``%clock64`` events of warpgroup 0 in the persistent kernel: item start
    (scalars ready), first tile landed, last PV GEMM done, rows stored."""
    a = make(bs, P)
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    tr = torch.zeros(nsm, 16, 4, dtype=torch.int64, device="cuda")
    for _ in range(3):
        tr.zero_()
        call(a, variant, splits, trace=tr)
    torch.cuda.synchronize()
    t = tr.cpu().double()
    ghz = 1.75
    first, loop, store, trans, start = [], [], [], [], []
    for c in range(nsm):
        items = [e for e in t[c] if e[3] > 0]
        for i, e in enumerate(items):
            loop.append((e[2] - e[1]).item())
            store.append((e[3] - e[2]).item())
            if i == 0:
                first.append((e[1] - e[0]).item())
            else:
                trans.append((e[1] - items[i - 1][3]).item())
                start.append((e[0] - items[i - 1][3]).item())
    f = lambda v: (f"{_q(v) / ghz / 1000:.2f} ({_q(v, .1) / ghz / 1000:.2f}, "  # noqa: E731
                   f"{_q(v, .9) / ghz / 1000:.2f})" if v else "-")
    print(f"ptrace bs{bs} P{P} S{splits} {variant} (us at {ghz} GHz, median (p10, p90)): first "
          f"item start->tile0 {f(first)}; loop {f(loop)}; last PV->stored {f(store)}; "
          f"stored->next item's scalars {f(start)}; stored->next item's tile0 {f(trans)}",
          flush=True)


CHECKS = [(3, 300, 1, 64), (2, 1000, 3, 64), (1, 77, 2, 64), (5, 129, 1, 64), (2, 200, 1, 8),
          (3, 500, 2, 20), (2, 0, 1, 64), (4, 5000, 4, 33), (2, 4096, 1, 64), (1, 130, 9, 64),
          (7, 1000, 1, 64), (150, 300, 1, 64), (40, 700, 2, 40), (2, 300, 1, 100),
          (1, 1000, 2, 96)]
POINTS = [(1, 4096, 8), (16, 2048, 1), (64, 4096, 1), (16, 16384, 1)]

if __name__ == "__main__":
    args = sys.argv[1:]
    print(torch.cuda.get_device_name(), flush=True)
    if "trace" in args:
        for bs, P, S in POINTS:
            trace_report(bs, P, S)
    if "sweep" in args:
        for bs, Ps in [(16, (256, 512, 1024, 2048, 4096, 8192, 16384)), (64, (1024, 2048, 4096)),
                       (132, (512, 2048))]:
            for P in Ps:
                a = make(bs, P)
                print(f"sweep bs{bs} P{P} S1: {bench(lambda: call(a, 'default', 1)):.1f}",
                      flush=True)
                del a
    for v in [a for a in args if a.startswith("ptrace=")]:
        for bs, P, S in POINTS[1:3]:
            ptrace_report(bs, P, S, v.split("=", 1)[1])
    rounds = int(os.environ.get("ROUNDS", "1"))
    variants = [v for v in args if v not in ("trace", "sweep") and not v.startswith("ptrace=")]
    if variants and not os.environ.get("NO_CHECKS"):
        for bs, P, S, n in CHECKS:
            a = make(bs, P, n=n, seed=bs * 1000 + P)
            ref = call(a, None, S).float()
            row = [f"{vv} {(call(a, vv, S).float() - ref).abs().max().item():.2e}"
                   for vv in variants]
            print(f"check bs{bs} P{P} S{S} n{n}: max|d| vs triton: " + ", ".join(row), flush=True)
    if variants:
        for bs, P, S in POINTS:
            a = make(bs, P)
            for rnd in range(rounds):
                ms = bench_interleaved([functools.partial(call, a, vv, S) for vv in variants])
                row = [f"{vv}: {m:.1f}" for vv, m in zip(variants, ms)]
                print(f"bs{bs} P{P} S{S} round {rnd} (interleaved): " + "  ".join(row),
                      flush=True)
            del a
