"""A/B (session 11) of how the ping-pong loader gets the slots of a TMA tile's runs, on pages
of 16 and 64 slots.  The package's loader loads the first slot of each run just before its
boxes, one dependent load after another (four per tile at page 16); the scratch module
``alt_kernel/attention_sm90_runs.py`` (``RUNS``): 1 the run slots of the next tile loaded a
tile ahead (with the gather's slots, as now), 2 the same with the gather's slots loaded just
in time, 3 the four run slots loaded together just before the tile.  ``lreg``: the loader's
registers (the warpgroups get ``232 - (lreg - 40) / 2``).

First a bit-exactness check against the package's kernel on paged inputs (random pages,
prefixes off the tile grid, splits 1 / 3), then the bench's ``tree_verify`` case (the
harness's timing) at the issue's three larger points, interleaved twice.  Prints max |diff|
and median us."""
import functools

import torch

import specattn.triton_kernels.attention as A
from explore_s11 import _alt
from specattn.bench import runner

orig = A.sm90_tree_verify
mod = _alt("runs")
dev, bf16 = "cuda", torch.bfloat16


def make_paged(bs, P, ps, n=64, H=32, Hkv=8, D=128, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    pages_per = -(-(P + n) // ps)
    pages = torch.randperm(bs * pages_per, device=dev, generator=g).view(bs, pages_per)
    slots = (pages[:, :, None] * ps + torch.arange(ps, device=dev)).view(bs, -1).int()
    num_slots = bs * pages_per * ps
    k = torch.randn(num_slots, Hkv, D, dtype=bf16, device=dev, generator=g)
    v = torch.randn(num_slots, Hkv, D, dtype=bf16, device=dev, generator=g)
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
    return q, k, v, slots, torch.arange(bs, device=dev), seq, qo, tm, n


def run(a, ps, splits, fn):
    q, k, v, rtt, rpi, seq, qo, tm, n = a
    A.sm90_tree_verify = fn
    try:
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=True,
                                 check_bounds=False, page_size=ps)
    finally:
        A.sm90_tree_verify = orig


VARIANTS = [(f"runs{r}" + (f"/l{lr}" if lr != 40 else ""),
             functools.partial(mod.sm90_tree_verify, runs=r, lreg=lr))
            for r, lr in [(1, 40), (3, 40), (1, 48)]]
if __name__ == "__main__":
    print(torch.cuda.get_device_name(), flush=True)
    for ps in (16, 64):
        for bs, P, S, n in [(3, 1000, 1, 64), (2, 4096, 3, 64), (1, 130, 3, 64), (4, 2000, 1, 40),
                            (2, 64, 1, 64), (5, 4100, 3, 33)]:
            a = make_paged(bs, P, ps, n=n, seed=bs * 100 + P + ps)
            ref = run(a, ps, S, orig).float()
            row = [f"{name} {(run(a, ps, S, fn).float() - ref).abs().max().item():.1e}"
                   for name, fn in VARIANTS]
            print(f"check page{ps} bs{bs} P{P} S{S} n{n}: max|d| vs package: " + ", ".join(row),
                  flush=True)
    for ps in (16, 64):
        for bs, prefix in ((16, 2048), (64, 4096), (16, 16384)):
            for rnd in range(2):
                row = []
                for name, fn in [("package", orig)] + VARIANTS:
                    A.sm90_tree_verify = fn
                    try:
                        r = runner.run_case("tree_verify", dict(bs=bs, prefix=prefix,
                                                                page_size=ps, impl="triton"),
                                            None, iters=100)
                    finally:
                        A.sm90_tree_verify = orig
                    row.append(f"{name} {r['median_us']:.1f}")
                    torch.cuda.empty_cache()
                print(f"page{ps} bs{bs} P{prefix} round {rnd}: " + "  ".join(row), flush=True)
