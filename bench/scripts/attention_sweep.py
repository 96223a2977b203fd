"""Config sweep of the Triton paged-attention kernels on a GPU (tuning aid, not a bench case).

    python3 bench/scripts/attention_sweep.py [--only tree_verify,decode,extend,mla_decode,mla_tree_verify]
        [--json OUT.json] [--points bs/P/n,..] [--match KEY] [--kv-dtype fp8_e4m3]

For each workload point (the attention suite's points: GQA 32 q / 8 kv heads, head_dim 128, bf16,
page 1; MLA 128 heads, 512 + 64, page 64) it times every kernel config of a small grid with
``triton.testing.do_bench`` (CUDA events, L2 flushed between runs, median) and prints, per
point, the default config's time, the best config and its time.  Inputs are random (fresh per
run), keys at random slots of a larger cache, random 64-token trees.  The MLA points run only
when ``specattn.triton_kernels.attention_mla`` exists.  ``--kv-dtype fp8_e4m3`` keeps the
caches in fp8 e4m3 (the bf16 draws rounded once, scale 1.0; extend has no fp8 path and is
skipped) and adds 256-key tiles to the MHA grid (an fp8 key is half a bf16 key's bytes).

Every config is checked against the default config's output first (relative error < 2e-2),
so a config that miscompiles is reported, not timed.  Each config runs at the backend's base
split count (SM occupancy bounded by ``split_keys_mha``); the backend's coupled rules, which
pick a split count together with a config of their own (``fp8_narrow_splits``,
``wide_decode_splits``), are not applied here; the bench cases, which run the backend, time
them.
"""
from __future__ import annotations  # noqa: I001

import argparse
import itertools
import json
import random
import sys

import torch
import triton
import triton.testing

from specattn.backends import pack_tree_mask


def random_tree_mask(bs: int, D: int, device) -> torch.Tensor:
    """int32 ``[bs, D, ceil(D/32)]``: random trees, token j's parent uniform in [0, j)."""
    dense = torch.zeros(bs, D, D, dtype=torch.bool)
    for b in range(bs):
        par = [-1] + [random.randrange(j) for j in range(1, D)]
        for j in range(D):
            a = j
            while a >= 0:
                dense[b, j, a] = True
                a = par[a]
    return pack_tree_mask(dense).to(device)


def paged_inputs(bs, P, n, Hkv, Dk, Dv, dtype, device, page_size=1, shared_kv=False):
    """Caches with ``bs * (P + n)`` used slots at random pages, ``req_to_token`` [bs, P + n]."""
    L = P + n
    pages_per_req = -(-L // page_size)
    num_pages = bs * pages_per_req + 1
    perm = torch.randperm(num_pages - 1, device=device)[:bs * pages_per_req] + 1
    page_ids = perm.view(bs, pages_per_req)
    offs = torch.arange(L, device=device)
    req_to_token = (page_ids[:, offs // page_size] * page_size + offs % page_size).to(torch.int32)
    slots = num_pages * page_size
    k = torch.randn(slots, Hkv, Dk, dtype=dtype, device=device)
    v = k[..., :Dv] if shared_kv else torch.randn(slots, Hkv, Dv, dtype=dtype, device=device)
    return k, v, req_to_token.contiguous()


def mha_point(kind, bs, P, n, dtype=torch.bfloat16, H=32, Hkv=8, hd=128, device="cuda",
              kv_dtype=None):
    from specattn.backends.triton_backend import MAX_KV_SPLITS, split_keys_mha  # its split heuristic
    from specattn.triton_kernels.attention import choose_block_m, paged_attention
    k, v, rtt = paged_inputs(bs, P, n, Hkv, hd, hd, dtype, device)
    if kv_dtype is not None:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    q = torch.randn(bs * n, H, hd, dtype=dtype, device=device)
    rpi = torch.arange(bs, dtype=torch.int64, device=device)
    seq = torch.full((bs,), P, dtype=torch.int32, device=device)
    qo = torch.arange(bs + 1, dtype=torch.int32, device=device) * n
    tm = random_tree_mask(bs, n, device) if kind == "tree_verify" else None
    G = H // Hkv
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = -(-n * G // choose_block_m(n * G)) * Hkv * bs
    split_default = 1 if kind == "extend" else min(MAX_KV_SPLITS, max(1, 2 * sms // programs),
                                                   max(1, P // split_keys_mha(programs, n * G, choose_block_m(n * G))))

    def fn(cfg):
        cfg = dict(cfg)
        splits = cfg.pop("num_splits", split_default)
        return lambda: paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, hd ** -0.5,  # inputs built valid
                                       num_splits=splits, check_bounds=False, **cfg)

    grid = []
    bms = [16] if n * G <= 16 else ([32, 64] if n * G <= 64 else [64, 128])
    bns = [32, 64, 128] + ([256] if kv_dtype is not None else [])
    for bm, bn, w, st in itertools.product(bms, bns, [4, 8], [2, 3, 4]):
        if bm == 128 and w == 4:
            continue
        grid.append(dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st))
    grid.append(dict(off32=False))
    if kind != "extend":
        for s in sorted({1, 2, 4, 8, 16, 32} - {split_default}):
            grid.append(dict(num_splits=s))
    flops = 4 * bs * n * H * hd * (P + (n + 1) / 2)
    nbytes = 2 * bs * (P + n) * Hkv * hd * k.element_size() + 2 * q.numel() * q.element_size()
    return fn, grid, dict(flops=flops, bytes=nbytes, default_splits=split_default)


def mla_point(kind, bs, P, n, dtype=torch.bfloat16, H=128, rank=512, rope=64, device="cuda",
              kv_dtype=None):
    try:
        from specattn.triton_kernels import attention_mla as M
    except ImportError:
        return None
    kern = M.mla_paged_attention
    k, _, rtt = paged_inputs(bs, P, n, 1, rank + rope, rank, dtype, device, page_size=64)
    if kv_dtype is not None:
        k = k.to(kv_dtype)
    q = torch.randn(bs * n, H, rank + rope, dtype=dtype, device=device)
    rpi = torch.arange(bs, dtype=torch.int64, device=device)
    seq = torch.full((bs,), P, dtype=torch.int32, device=device)
    qo = torch.arange(bs + 1, dtype=torch.int32, device=device) * n
    tm = random_tree_mask(bs, n, device) if kind == "mla_tree_verify" else None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    split_default = max(1, min(32, sms // max(1, bs * -(-n * H // 64)), P // 256))

    def fn(cfg):
        cfg = dict(cfg)
        splits = cfg.pop("num_splits", split_default)
        return lambda: kern(q, k, rtt, rpi, seq, qo, tm, n, (rank + rope) ** -0.5,
                            kv_lora_rank=rank, num_splits=splits, page_size=64, **cfg)

    grid = [dict(num_splits=s) for s in (1, 2, 4, 8) if s != split_default]
    for bm, bn, dv, w, st in itertools.product([64, 128], [32, 64], [512, 256], [4, 8], [1, 2]):
        if bm == 128 and dv == 512:
            continue
        grid.append(dict(block_m=bm, block_n=bn, block_dv=dv, num_warps=w, num_stages=st))
        if dv == 256:  # prefix tiles by TMA (page 64 holds whole tiles)
            grid.append(dict(block_m=bm, block_n=bn, block_dv=dv, num_warps=w, num_stages=st, tma=True))
    flops = 2 * bs * n * H * (rank + rope + rank) * (P + (n + 1) / 2)
    nbytes = bs * (P + n) * (rank + rope) * k.element_size() + q.numel() * q.element_size() * 2
    return fn, grid, dict(flops=flops, bytes=nbytes, default_splits=split_default)


POINTS = {
    "tree_verify": [(1, 4096, 64), (16, 2048, 64), (64, 4096, 64), (16, 16384, 64)],
    "decode": [(1, 1024, 1), (1, 8192, 1), (32, 1024, 1), (32, 8192, 1), (128, 1024, 1), (128, 8192, 1)],
    "extend": [(1, 0, 2048), (1, 4096, 2048)],
    "mla_decode": [(128, 8192, 1), (16, 4096, 1)],
    "mla_tree_verify": [(1, 4096, 64), (16, 4096, 64)],
}


def bench(f) -> float:
    """Median ms of one call, replayed from a CUDA graph (no launch overhead; the L2 is not
    flushed, so small points read partly from the cache: a ranking aid, not a figure).

    Triton's ``do_bench_cudagraph`` warms up and captures on a fresh side stream that does
    not wait for the current one: the inputs' producers (and the reference call) must have
    finished first, or the side stream reads half-written index tables (an illegal address
    at a fresh point's first timing)."""
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(f, rep=30, return_mode="median")


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(POINTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--points", default=None, help="bs/P/n,... (overrides the kinds' points)")
    ap.add_argument("--match", default=None,
                    help="time only the grid configs that set this key (e.g. tma)")
    ap.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                    help="the caches' dtype: the points' (bf16) or fp8 e4m3")
    args = ap.parse_args(argv)
    torch.manual_seed(random.randrange(2**31))
    results = []
    print(f"device: {torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}")
    points = POINTS
    if args.points:
        points = {k: [tuple(int(x) for x in p.split("/")) for p in args.points.split(",")]
                  for k in args.only.split(",")}
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8_e4m3" else None
    for kind in args.only.split(","):
        if kind == "extend" and kv_dtype is not None:
            print("extend: no fp8 cache path, skipped")
            continue
        for bs, P, n in points[kind]:
            made = (mha_point if not kind.startswith("mla") else mla_point)(kind, bs, P, n,
                                                                           kv_dtype=kv_dtype)
            if made is None:
                print(f"{kind}: no MLA kernel module, skipped")
                break
            fn, grid, meta = made
            ref = fn({})()
            t_def = bench(fn({}))
            rows = []
            for cfg in (grid if args.match is None else [c for c in grid if c.get(args.match)]):
                try:
                    f = fn(cfg)
                    err = rel(f(), ref)
                    if not err < 2e-2:
                        rows.append((cfg, None, f"rel err {err:.2e}"))
                        continue
                    rows.append((cfg, bench(f), ""))
                except Exception as e:  # noqa: BLE001  (out of resources etc.: report, go on)
                    rows.append((cfg, None, f"{type(e).__name__}: {str(e)[:80]}"))
                finally:
                    torch.cuda.synchronize()
            ok = [r for r in rows if r[1] is not None]
            best = min(ok, key=lambda r: r[1]) if ok else (None, float("nan"), "")
            tf = meta["flops"] / (best[1] * 1e-3) / 1e12 if ok else float("nan")
            gb = meta["bytes"] / (best[1] * 1e-3) / 1e9 if ok else float("nan")
            print(f"{kind:>16} bs={bs:<3} P={P:<5} n={n:<4} default {t_def * 1e3:8.1f} us "
                  f"(splits {meta['default_splits']}) | best {best[1] * 1e3:8.1f} us "
                  f"{tf:6.1f} TF/s {gb:7.1f} GB/s {best[0]}")
            bad = [r for r in rows if r[1] is None]
            for cfg, _, why in bad[:3]:
                print(f"{'':>18} failed {cfg}: {why}")
            results.append(dict(kind=kind, bs=bs, P=P, n=n, kv_dtype=args.kv_dtype,
                                default_us=t_def * 1e3, meta=meta,
                                rows=[dict(cfg=c, us=None if t is None else t * 1e3, note=w)
                                      for c, t, w in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
