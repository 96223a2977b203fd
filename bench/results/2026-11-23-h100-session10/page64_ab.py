"""A/B of the tree-verify TMA path on the bench's own inputs (``tree_verify`` case, the
harness's timing), interleaved twice per point so that clock drift hits every variant
alike.  Variants, impl ``triton`` unless named: ``tma`` page 64 (whole tiles by TMA);
``gather`` page 64 with the per-key ``cp.async`` gather forced (``sm90_tree_verify`` called
with ``page_size=1``); ``page1`` page 1; ``fma`` page 64 on the scratch kernel
``alt_kernel/attention_sm90_fma.py`` (TMA plus the scale folded into the exponent's FFMA;
``--fma``); ``split`` FlashInfer's split at page 64 (``--split``, needs FlashInfer).
Prints the median us of each run."""
import importlib.util
import os
import sys

import torch

import specattn.triton_kernels.attention as A
from specattn.bench import runner

orig = A.sm90_tree_verify


def gather(*args, **kw):
    return orig(*args, **{**kw, "page_size": 1})


def scratch(stem):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "alt_kernel",
                        f"attention_sm90_{stem}.py")
    spec = importlib.util.spec_from_file_location(f"specattn.triton_kernels.attention_sm90_{stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod.sm90_tree_verify


variants = [("tma", 64, "triton", orig), ("gather", 64, "triton", gather), ("page1", 1, "triton", orig)]
if "--fma" in sys.argv:
    variants.append(("fma", 64, "triton", scratch("fma")))
if "--split" in sys.argv:
    variants.append(("split", 64, "flashinfer_split", orig))
print(torch.cuda.get_device_name(), flush=True)
for bs, prefix in ((16, 2048), (64, 4096), (16, 16384)):
    for rnd in range(2):
        for name, page, impl, fn in variants:
            A.sm90_tree_verify = fn
            try:
                r = runner.run_case("tree_verify", dict(bs=bs, prefix=prefix, page_size=page,
                                                        impl=impl), None, iters=100)
            finally:
                A.sm90_tree_verify = orig
            print(f"bs{bs} P{prefix} round {rnd} {name}: {r['median_us']:.1f} us [{r['mode']}]",
                  flush=True)
            torch.cuda.empty_cache()
