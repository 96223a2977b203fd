"""Exploration: Gluon MHA tree verify with 256-row CTAs (all 64 tokens x 4 heads of a
(request, KV head) in one CTA, so each K/V tile is gathered once, not twice) vs the 128-row
kernel.  Usage: python explore_tree_verify.py VARIANT... where VARIANT =
bm,bn,stages,warps[,split_ring[,noload]] (e.g. 128,128,3,8 256,32,4,16 128,64,6,8,1);
warps 0 = the warp-specialized ping-pong kernel, whose 5th field is its OPTS bits (1: q in
registers, 2: no loads); noload variants skip the in-loop K/V copies (a diagnostic: wrong output, not checked).  Prints max |diff| vs the first variant and vs the portable
Triton kernel, then the median us of 50 CUDA-graph replays per point and split count."""
import functools
import os
import sys

import torch

import specattn.triton_kernels.attention as A

dev, bf16 = "cuda", torch.bfloat16
orig = A.sm90_tree_verify


def make(bs, P, n=64, H=32, Hkv=8, D=128, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    width = P + n
    slots = torch.randperm(bs * width, device=dev, generator=g).int().view(bs, width)
    k = torch.randn(bs * width, Hkv, D, dtype=bf16, device=dev, generator=g)
    v = torch.randn(bs * width, Hkv, D, dtype=bf16, device=dev, generator=g)
    q = torch.randn(bs * n, H, D, dtype=bf16, device=dev, generator=g)
    seq = torch.full((bs,), P, dtype=torch.int32, device=dev)
    qo = torch.arange(bs + 1, dtype=torch.int32, device=dev) * n
    W = (n + 31) // 32
    bits = torch.rand(bs, n, n, device=dev, generator=g) < 0.3
    bits = torch.tril(bits | torch.eye(n, dtype=torch.bool, device=dev))
    w = torch.zeros(bs, n, W * 32, dtype=torch.int64, device=dev)
    w[:, :, :n] = bits.long()
    tm = (w.view(bs, n, W, 32) << torch.arange(32, device=dev)).sum(-1)
    tm = torch.where(tm >= 2**31, tm - 2**32, tm).int()
    return (q, k, v, slots, torch.arange(bs, device=dev), seq, qo, tm, n)


def call(a, variant, splits):
    q, k, v, rtt, rpi, seq, qo, tm, n = a
    if variant is None:
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=False,
                                 check_bounds=False)
    bm, bn, st, nw, split_ring, noload = (tuple(variant) + (0, 0))[:6]
    os.environ["SPECATTN_TV_NOLOAD"] = str(noload)
    os.environ["SPECATTN_TV_OPTS"] = str(split_ring if nw == 0 else 0)
    A.sm90_tree_verify = functools.partial(orig, block_m=bm, stages=st, num_warps=nw,
                                           split_ring=bool(split_ring) and nw > 0, ws=nw == 0)
    try:
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=True,
                                 block_n=bn, check_bounds=False)
    finally:
        A.sm90_tree_verify = orig


def bench(fn, reps=50):
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); g.replay(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) * 1000)
    ts.sort()
    return ts[len(ts) // 2]


if __name__ == "__main__":
    checks_only = "--checks-only" in sys.argv
    variants = [tuple(int(x) for x in v.split(",")) for v in sys.argv[1:] if not v.startswith("--")]
    print(torch.cuda.get_device_name(), flush=True)
    # correctness on small shapes (several splits, P not a tile multiple)
    for bs, P, S, n in [(3, 300, 1, 64), (2, 1000, 3, 64), (1, 77, 2, 64), (5, 129, 1, 64),
                        (2, 200, 1, 8), (3, 500, 2, 20), (2, 0, 1, 64), (4, 5000, 4, 33)]:
        a = make(bs, P, n=n, seed=bs * 1000 + P)
        ref = call(a, None, S).float()
        for vv in variants:
            if (len(vv) > 5 and vv[5]) or (vv[3] == 0 and len(vv) > 4 and vv[4] & 2):
                continue
            o = call(a, vv, S).float()
            print(f"check bs{bs} P{P} S{S} n{n} {vv}: max|d| vs triton {(o - ref).abs().max().item():.3e}",
                  flush=True)
    if checks_only:
        sys.exit(0)
    for bs, P, splits in [(1, 4096, (8, 16)), (16, 2048, (1, 2)), (64, 4096, (1,)), (16, 16384, (1, 2))]:
        a = make(bs, P)
        for S in splits:
            row = []
            for vv in variants:
                row.append(f"{vv}: {bench(lambda: call(a, vv, S)):.1f}")
            print(f"bs{bs} P{P} S{S}: " + "  ".join(row), flush=True)
        del a
        torch.cuda.empty_cache()
