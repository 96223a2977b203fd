"""Offline: compile a module's ping-pong tree-verify kernel for sm_90a (no GPU needed) and
print the order of its key SASS instructions, runs collapsed (``8xHGMMA...``).

Section 2 of the README reads the compute loop from this: where ``WARPGROUP.DEPBAR.LE gsb0,
0x0`` (the wait for the PV GEMM) falls relative to the softmax's ``MUFU.EX2``.  Needs a
Triton 3.6 with its bundled ``ptxas``/``cuobjdump`` (``pip install triton==3.6.0
--target DIR`` on any machine; ``PYTHONPATH=DIR``).

Usage: ``python sass_order.py [MODULE.py] [JSON constexprs] [maxnreg]``, e.g.
``python sass_order.py alt_kernel/attention_sm90_pl.py '{"PL": 1}'``; defaults: the package's
module, the page-1 gather (64-key tiles, 6 stages, 8 loader warps, GQA group 4, head_dim
128, no TMA, tile order as at page 1 where the module has ``MASKED_FIRST``), ``maxnreg=128``."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from itertools import groupby
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

HERE = Path(__file__).resolve().parent
KEY = re.compile(r"HGMMA\S*|WARPGROUP\.DEPBAR\S* gsb0, 0x\d|BAR\.SYNC\S*|SYNCS\.\S+|MUFU\.EX2"
                 r"|SHFL\.BFLY|BRA|LDGSTS|STL|LDL|EXIT")


def compile_ws(path, consts, maxnreg):
    """(cubin path, ptxas -v lines) of ``path``'s ``_tree_verify_ws_kernel``."""
    spec = importlib.util.spec_from_file_location("specattn.triton_kernels._sass_probe", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    fn = mod._tree_verify_ws_kernel
    ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "O_PART": "*fp32",
           "LSE_PART": "*fp32", "req_to_token": "*i32", "seq_lens": "*i32",
           "qo_indptr": "*i32", "tree_mask": "*i32", "req_pool_indices": "*i64",
           "qk_scale": "fp32", "k_desc": "constexpr", "v_desc": "constexpr"}
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig = {n: ptr.get(n, "i32") for n in fn.arg_names}
    sig.update({k: "constexpr" for k in consts})
    cx = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    cx[(fn.arg_names.index("k_desc"),)] = None
    cx[(fn.arg_names.index("v_desc"),)] = None
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n.startswith("stride_")}
    k = triton.compile(GluonASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=cx),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, maxnreg=maxnreg))
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    out = Path(tempfile.mkdtemp()) / "k.cubin"
    ptx = out.with_suffix(".ptx")
    ptx.write_text(k.asm["ptx"])
    r = subprocess.run([str(bindir / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(out)],
                       capture_output=True, text=True, check=True)
    return out, [s.strip() for s in (r.stdout + r.stderr).splitlines() if "spill" in s]


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else str(HERE / "../../../triton_kernels/attention_sm90.py")
    consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_N=64, NUM_SPLITS=1, STAGES=6, TMA_ROWS=0, LW=8,
                  MASKED_FIRST=False)
    consts.update(json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    cubin, spills = compile_ws(path, consts, int(sys.argv[3]) if len(sys.argv) > 3 else 128)
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    sass = subprocess.run([str(bindir / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    ops = [m.group(0) for line in sass.splitlines() for m in [KEY.search(line)] if m]
    print(spills)
    print(" ".join(f"{n}x{op}" if n > 1 else op
                   for op, n in ((op, len(list(g))) for op, g in groupby(ops))))
