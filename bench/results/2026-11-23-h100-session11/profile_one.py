"""Launches of the package's ping-pong tree-verify kernel at bs 64 / P 4096, page 1 (session
8's ``explore_tree_verify.make`` inputs) for Nsight Compute: two warm-up launches, then the
profiled one.  ``SPF=D``: the scratch loader of ``alt_kernel/attention_sm90_slotpf.py``
instead (``req_to_token`` lines prefetched into L1 ``D + 1`` tiles ahead)."""
import functools
import importlib.util
import os
import sys

import torch

import specattn.triton_kernels.attention as A

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "2026-11-22-h100-session8"))
from explore_tree_verify import make  # noqa: E402

if os.environ.get("SPF"):
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "specattn.triton_kernels.attention_sm90_slotpf",
        os.path.join(here, "alt_kernel", "attention_sm90_slotpf.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    A.sm90_tree_verify = functools.partial(mod.sm90_tree_verify, spf=int(os.environ["SPF"]))
q, k, v, rtt, rpi, seq, qo, tm, n = make(64, 4096)
for _ in range(3):
    A.paged_attention(q, k, v, rtt, rpi, seq, qo, tm, n, 0.088, 1, sm90=True, check_bounds=False)
torch.cuda.synchronize()
