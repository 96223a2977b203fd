"""Exploration (session 12): session 11's interleaved A/B driver with this session's scratch
kernels, at page 1 and on pages of ``PAGES``.

The scratch kernels are git-ignored copies of the package's ``triton_kernels/attention_sm90.py``
as it was before this session's kept change (commits a34da23 / ad77610, the same kernel code),
rebuilt from the diffs here::

    mkdir -p alt_kernel
    git show a34da23:triton_kernels/attention_sm90.py > /tmp/attention_sm90_a34da23.py
    for m in n128 nobr two brk two2 diag tree pl hyb o32 wo; do
      patch -o alt_kernel/attention_sm90_$m.py /tmp/attention_sm90_a34da23.py ${m}_kernel.diff
    done
    git show ad77610:triton_kernels/attention_sm90.py > alt_kernel/attention_sm90_old.py
    patch -o alt_kernel/attention_sm90_rev.py alt_kernel/attention_sm90_old.py rev_kernel.diff

Session 11's ``combo_ab.py`` (imported for its paged inputs and launcher) needs its own
``alt_kernel/attention_sm90_runs.py``: rebuild it as that folder's README says.

VARIANT (launcher keywords after the colon):

- ``default``: the package's kernel;
- ``n:bn=B,lw=W,stages=S``: 128-key tiles (``bn=128``), gathered as 64-key pieces, ``P`` carried
  in the input dtype, ``lw`` loader warps (README section 1);
- ``o:``: every tile masked (no whole-prefix-tile branch); ``b:``: a never-taken branch after
  the softmax, so ptxas waits for the PV GEMM after it; ``q:pl=1|2``: that branch after the
  row max / after the exponentials (section 2);
- ``w:``: two loops, whole prefix tiles (no mask code) then the rest (always masked);
  ``t:``: ``w`` with ``b``'s branch; ``h:tmin=T``: ``w``'s loops when a CTA has >= ``T``
  tiles, else the package's loop (section 3);
- ``r:``: the row max / sum as a tree of in-thread halvings (section 4);
- ``d:diag=1|2|3``: diagnostics with wrong output: half of each tile gathered / no copies /
  no compute (section 5);
- ``z:``: the gather's row offsets in int32, shared by K and V; ``y:``: ``w`` + ``z``
  (section 6);
- ``v:``: the masked tiles first, their loop always masked (section 7; the kept form, now the
  package's ``default``, tests each tile in that loop); ``x:``: the package's kernel before
  it.

Usage: ``ROUNDS=r [NO_CHECKS=1] [PAGES=1,64] [CHECK_PAGES=64] [POINTS="bs/P/S ..."] python
explore_s12.py VARIANT...``.  Checks: page 1 against the portable Triton kernel on session 11's
15 small shapes (``explore_s11.CHECKS``), each page of ``CHECK_PAGES`` against the package's
kernel; then each point timed interleaved (``explore_s11.bench_interleaved``: every round
replays every variant's CUDA graph in turn, median of 60)."""
import functools
import importlib.util
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "2026-11-23-h100-session11"))
import explore_s11 as E  # noqa: E402

SCRATCH = {"n": "n128", "o": "nobr", "w": "two", "b": "brk", "t": "two2", "d": "diag", "r": "tree",
           "q": "pl", "h": "hyb", "z": "o32", "y": "wo", "v": "rev", "x": "old"}
for mod in SCRATCH.values():
    name = f"specattn.triton_kernels.attention_sm90_{mod}"
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(HERE, "alt_kernel", f"attention_sm90_{mod}.py"))
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
E.MODULES.update(SCRATCH)

if __name__ == "__main__":
    from combo_ab import make_paged, run  # noqa: E402  (session 11's paged inputs and launcher)
    print(torch.cuda.get_device_name(), flush=True)
    variants = sys.argv[1:]
    points = [tuple(int(x) for x in p.split("/")) for p in
              os.environ.get("POINTS", "1/4096/8 16/2048/1 64/4096/1 16/16384/1").split()]
    if not os.environ.get("NO_CHECKS"):
        for bs, P, S, n in E.CHECKS:
            a = E.make(bs, P, n=n, seed=bs * 1000 + P)
            ref = E.call(a, None, S).float()
            row = [f"{v} {(E.call(a, v, S).float() - ref).abs().max().item():.2e}"
                   for v in variants]
            print(f"check bs{bs} P{P} S{S} n{n}: max|d| vs triton: " + ", ".join(row), flush=True)
        for ps in [int(x) for x in os.environ.get("CHECK_PAGES", "").split(",") if x]:
            for bs, P, S, n in [(3, 1000, 1, 64), (2, 4096, 3, 64), (1, 130, 3, 64),
                                (4, 2000, 1, 40), (2, 64, 1, 64), (5, 4100, 3, 33)]:
                a = make_paged(bs, P, ps, n=n, seed=bs * 100 + P)
                ref = run(a, ps, S, "default").float()
                row = [f"{v} {(run(a, ps, S, v).float() - ref).abs().max().item():.1e}"
                       for v in variants]
                print(f"check page{ps} bs{bs} P{P} S{S} n{n}: max|d| vs package: "
                      + ", ".join(row), flush=True)
    for ps in [int(x) for x in os.environ.get("PAGES", "1").split(",")]:
        for bs, P, S in points:
            a = E.make(bs, P) if ps == 1 else make_paged(bs, P, ps)
            for rnd in range(int(os.environ.get("ROUNDS", "2"))):
                ms = E.bench_interleaved([functools.partial(run, a, ps, S, v) for v in variants])
                print(f"page{ps} bs{bs} P{P} S{S} round {rnd} (interleaved): "
                      + "  ".join(f"{v}: {m:.1f}" for v, m in zip(variants, ms)), flush=True)
            del a
