"""Interleaved A/B (session 11) of three small loader/prologue changes together, in the
scratch module ``alt_kernel/attention_sm90_combo.py`` (launcher keywords): ``hoist=1`` the
request's ``seq_lens`` / ``req_pool_indices`` loaded before the CTA's branch on its token
count (one dependent load less before tile 0); ``runs64=1`` on pages of 64 slots, the slot
of the next TMA tile loaded a tile ahead (section 4's ``runs1``, without the page-16 case
that spills); ``spf=D`` section 6's L1 prefetch of the ``req_to_token`` lines.

Checks: page 1 against the portable Triton kernel (``explore_s11.CHECKS``); page 64
bit-equal to the package's kernel (``runs_ab``'s shapes).  Timing: the issue's four points
at page 1 (``explore_tree_verify.make``) and page 64 (``runs_ab.make_paged``), each round
replaying every variant's CUDA graph in turn (``explore_s11.bench_interleaved``).
Usage: ``ROUNDS=r PAGES=1,64 CHECK_PAGES=64 python combo_ab.py VARIANT...`` with VARIANT ``default``,
``c:k=v,..`` or any of ``explore_s11.py``'s variants."""
import functools
import os
import sys

import torch

import specattn.triton_kernels.attention as A
from explore_s11 import CHECKS, POINTS, bench_interleaved, make, variant_fn
from runs_ab import make_paged

orig = A.sm90_tree_verify


def run(a, ps, splits, variant, sm90=True):
    q, k, v, rtt, rpi, seq, qo, tm, n = a
    A.sm90_tree_verify = variant_fn(variant)
    try:
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=sm90,
                                 check_bounds=False, page_size=ps)
    finally:
        A.sm90_tree_verify = orig


if __name__ == "__main__":
    variants = sys.argv[1:]
    rounds = int(os.environ.get("ROUNDS", "2"))
    print(torch.cuda.get_device_name(), flush=True)
    for bs, P, S, n in CHECKS:
        a = make(bs, P, n=n, seed=bs * 1000 + P)
        ref = run(a, 1, S, "default", sm90=False).float()
        row = [f"{v} {(run(a, 1, S, v).float() - ref).abs().max().item():.2e}" for v in variants]
        print(f"check page1 bs{bs} P{P} S{S} n{n}: max|d| vs triton: " + ", ".join(row),
              flush=True)
    for ps in [int(x) for x in os.environ.get("CHECK_PAGES", "64").split(",")]:
        for bs, P, S, n in [(3, 1000, 1, 64), (2, 4096, 3, 64), (1, 130, 3, 64),
                            (4, 2000, 1, 40), (2, 64, 1, 64), (5, 4100, 3, 33)]:
            a = make_paged(bs, P, ps, n=n, seed=bs * 100 + P)
            ref = run(a, ps, S, "default").float()
            row = [f"{v} {(run(a, ps, S, v).float() - ref).abs().max().item():.1e}"
                   for v in variants]
            print(f"check page{ps} bs{bs} P{P} S{S} n{n}: max|d| vs package: " + ", ".join(row),
                  flush=True)
    for ps in [int(x) for x in os.environ.get("PAGES", "1,64").split(",")]:
        for bs, P, S in POINTS:
            a = make(bs, P) if ps == 1 else make_paged(bs, P, 64)
            for rnd in range(rounds):
                ms = bench_interleaved([functools.partial(run, a, ps, S, v) for v in variants])
                print(f"page{ps} bs{bs} P{P} S{S} round {rnd}: "
                      + "  ".join(f"{v}: {m:.1f}" for v, m in zip(variants, ms)), flush=True)
            del a
