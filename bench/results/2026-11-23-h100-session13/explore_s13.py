"""Exploration (session 13): ``q`` as the register operand of the ping-pong kernel's score
GEMM, timed interleaved against the kernel without it.

Why: a 64-key score GEMM with both operands in shared memory (``m64n64k16``, ``q`` and ``K``)
reads 4 KiB of shared memory per 32 tensor-core cycles at peak, the shared-memory bandwidth
of an SM (128 B/cycle), while the loader's ``cp.async`` writes land in the same memory.  With
``q`` in registers the score GEMM reads only ``K``.  Session 8 had measured this form slower
(702 / 657 us vs 676, on the 4-warp-loader kernel of then); offline, ptxas now fits it in the
compute's 224 registers without spills.

Scratch kernels (git-ignored), rebuilt with::

    mkdir -p alt_kernel
    git show cd5a8c4:triton_kernels/attention_sm90.py > alt_kernel/attention_sm90_old.py
    patch -o alt_kernel/attention_sm90_qr.py alt_kernel/attention_sm90_old.py qr_kernel.diff

VARIANT: ``default`` (the package's kernel), ``x:`` (cd5a8c4's, before this session's
change), ``qr:`` (cd5a8c4's with ``q`` in registers on the page-1 path only: the first try).

Usage: ``ROUNDS=r [NO_CHECKS=1] [PAGES=1,64] [POINTS="bs/P/S ..."] python explore_s13.py
VARIANT...``.  Checks: page 1 against the portable Triton kernel on session 11's 15 small
shapes (``explore_s11.CHECKS``), page 64 against the first variant on six shapes; then each
point timed interleaved (``explore_s11.bench_interleaved``: every round replays every
variant's CUDA graph in turn, median of 60).  Paged inputs as session 11's
``runs_ab.make_paged`` (random pages, page-ordered slots)."""
import functools
import importlib.util
import os
import sys

import torch

import specattn.triton_kernels.attention as A

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "2026-11-23-h100-session11"))
import explore_s11 as E  # noqa: E402

for mod in ("qr", "old"):
    name = f"specattn.triton_kernels.attention_sm90_{mod}"
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(HERE, "alt_kernel", f"attention_sm90_{mod}.py"))
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    E.MODULES[mod] = mod
E.MODULES["x"] = "old"
dev, bf16 = "cuda", torch.bfloat16


def make_paged(bs, P, ps, n=64, H=32, Hkv=8, D=128, seed=0):
    """Session 11's paged inputs: ``bs`` requests of ``P`` prefix keys and ``n`` tree tokens on
    random pages of ``ps`` slots, random 30 %-dense causal tree masks."""
    g = torch.Generator(device=dev).manual_seed(seed)
    pages_per = -(-(P + n) // ps)
    pages = torch.randperm(bs * pages_per, device=dev, generator=g).view(bs, pages_per)
    slots = (pages[:, :, None] * ps + torch.arange(ps, device=dev)).view(bs, -1).int()
    k, v = (torch.randn(bs * pages_per * ps, Hkv, D, dtype=bf16, device=dev, generator=g)
            for _ in range(2))
    q = torch.randn(bs * n, H, D, dtype=bf16, device=dev, generator=g)
    seq = torch.full((bs,), P, dtype=torch.int32, device=dev)
    qo = torch.arange(bs + 1, dtype=torch.int32, device=dev) * n
    bits = torch.rand(bs, n, n, device=dev, generator=g) < 0.3
    bits = torch.tril(bits | torch.eye(n, dtype=torch.bool, device=dev))
    W = (n + 31) // 32
    w = torch.zeros(bs, n, W * 32, dtype=torch.int64, device=dev)
    w[:, :, :n] = bits.long()
    tm = (w.view(bs, n, W, 32) << torch.arange(32, device=dev)).sum(-1)
    tm = torch.where(tm >= 2**31, tm - 2**32, tm).int()
    return q, k, v, slots, torch.arange(bs, device=dev), seq, qo, tm, n


def run(a, ps, splits, variant):
    """Tree verify of inputs ``a`` on pages of ``ps`` by ``variant``'s launcher."""
    q, k, v, rtt, rpi, seq, qo, tm, n = a
    A.sm90_tree_verify = E.variant_fn(variant)
    try:
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=True,
                                 check_bounds=False, page_size=ps)
    finally:
        A.sm90_tree_verify = E.orig


if __name__ == "__main__":
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
        for bs, P, S, n in [(3, 1000, 1, 64), (2, 4096, 3, 64), (1, 130, 3, 64),
                            (4, 2000, 1, 40), (2, 64, 1, 64), (5, 4100, 3, 33)]:
            a = make_paged(bs, P, 64, n=n, seed=bs * 100 + P)
            ref = run(a, 64, S, variants[0]).float()
            row = [f"{v} {(run(a, 64, S, v).float() - ref).abs().max().item():.1e}"
                   for v in variants[1:]]
            print(f"check page64 bs{bs} P{P} S{S} n{n}: max|d| vs {variants[0]}: "
                  + ", ".join(row), flush=True)
    for ps in [int(x) for x in os.environ.get("PAGES", "1").split(",")]:
        for bs, P, S in points:
            a = E.make(bs, P) if ps == 1 else make_paged(bs, P, ps)
            for rnd in range(int(os.environ.get("ROUNDS", "3"))):
                ms = E.bench_interleaved([functools.partial(run, a, ps, S, v) for v in variants])
                print(f"page{ps} bs{bs} P{P} S{S} round {rnd} (interleaved): "
                      + "  ".join(f"{v}: {m:.1f}" for v, m in zip(variants, ms)), flush=True)
            del a
