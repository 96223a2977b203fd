"""Exploration: ping-pong tree-verify variants (tile size, loader registers) against the
synchronous kernel, same inputs as ``explore_tree_verify.py``.  Usage: python
explore_pingpong.py VARIANT... with VARIANT = ``sync``, ``default`` (the package's kernel as
it is), ``pair`` (a tile-pair schedule, for a launcher with ``pair``; README, run 14),
``BLOCK_N,LOADER_REGS`` (e.g. ``64,40 128,56``, for a launcher with ``loader_regs``) or
``alt:BLOCK_N,LOADER_REGS[,SLOTS_AHEAD]`` (ran ``alt_kernel/attention_sm90_alt.py``, a
scratch copy of the kernel that is not kept; README, runs 6-7).  Prints max |diff| vs the
portable Triton kernel on small shapes, then the median us of 50 CUDA-graph replays per
point."""
import functools
import sys

import torch

import specattn.triton_kernels.attention as A
from explore_tree_verify import bench, make

orig = A.sm90_tree_verify


def _alt():
    """``alt_kernel/attention_sm90_alt.py`` loaded as a sibling of the package's module."""
    import importlib.util
    import os
    name = "specattn.triton_kernels.attention_sm90_alt"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "alt_kernel",
                            "attention_sm90_alt.py")
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def call(a, variant, splits):
    q, k, v, rtt, rpi, seq, qo, tm, n = a
    if variant is None:
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=False,
                                 check_bounds=False)
    if variant in ("sync", "default"):
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=True,
                                 pingpong=variant == "default", check_bounds=False)
    if variant == "pair":
        A.sm90_tree_verify = functools.partial(orig, pair=True)
        try:
            return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=True,
                                     check_bounds=False)
        finally:
            A.sm90_tree_verify = orig
    fn = orig
    if variant.startswith("alt:"):
        fn, variant = _alt().sm90_tree_verify, variant[4:]
    bn, regs, *ahead = (int(x) for x in variant.split(","))
    extra = {"slots_ahead": ahead[0]} if ahead else {}
    A.sm90_tree_verify = functools.partial(fn, loader_regs=regs, **extra)
    try:
        return A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, splits, sm90=True,
                                 block_n=bn, check_bounds=False)
    finally:
        A.sm90_tree_verify = orig


if __name__ == "__main__":
    variants = sys.argv[1:]
    print(torch.cuda.get_device_name(), flush=True)
    for bs, P, S, n in [(3, 300, 1, 64), (2, 1000, 3, 64), (1, 77, 2, 64), (5, 129, 1, 64),
                        (2, 200, 1, 8), (3, 500, 2, 20), (2, 0, 1, 64), (4, 5000, 4, 33),
                        (2, 4096, 1, 64), (1, 130, 9, 64)]:
        a = make(bs, P, n=n, seed=bs * 1000 + P)
        ref = call(a, None, S).float()
        worst = max((call(a, vv, S).float() - ref).abs().max().item() for vv in variants)
        print(f"check bs{bs} P{P} S{S} n{n}: worst max|d| vs triton {worst:.3e}", flush=True)
    for bs, P, splits in [(1, 4096, (8,)), (16, 2048, (1,)), (64, 4096, (1,)), (16, 16384, (1,))]:
        a = make(bs, P)
        for S in splits:
            row = [f"{vv}: {bench(lambda: call(a, vv, S)):.1f}" for vv in variants]
            print(f"bs{bs} P{P} S{S}: " + "  ".join(row), flush=True)
        del a
        torch.cuda.empty_cache()
