"""Compile the Triton attention and tree-verify kernels for SM90 offline (no GPU needed) and
record what a refactor must not change: the multiset of PTX instructions and, where
``ptxas`` is installed, registers and spill bytes per kernel config.

    python3 bench/scripts/kernel_ptx.py --out /tmp/before      # on the old revision
    python3 bench/scripts/kernel_ptx.py --out /tmp/after       # on the new one
    python3 bench/scripts/kernel_ptx.py --compare /tmp/before /tmp/after

``--compare`` prints each config whose instruction counts, registers or spills differ and
exits 1 if any does.  Equal results mean the change only reordered instructions (e.g. code
moved into inlined ``@triton.jit`` helpers): a performance-neutral refactor can be shown on
a machine without a GPU.  Configs: ``CONFIGS`` below (MHA/MLA attention at several mask /
split / value-split settings, greedy and sampling tree verify, and with Gluon the ping-pong
GQA tree verify over bf16 and fp8 caches and the MLA seesaw at 16 / 128 heads, causal / tree,
with TMA tiles, gathered tiles and an fp8 cache; the Gluon kernels only under the Triton
release they are written for, ``gluon_common.GLUON_TRITON``).  Compare two revisions under the SAME Triton:
absolute figures depend on its version (e.g. Triton 3.9 here buffers one more pipeline stage
than the GPU machine's 3.6, so its shared-memory sizes differ).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _configs():
    import triton.language as tl
    from specattn.triton_kernels import attention as A, attention_mla as M
    from specattn.triton_kernels import tree_ops as T, tree_sampling as S
    out = []
    for mask, splits, slot, dt, ieee in ((0, 1, tl.int32, "bf16", False), (1, 4, tl.int64, "bf16", False),
                                         (1, 1, tl.int32, "fp32", True), (0, 1, tl.int32, "fp8", False)):
        c = dict(GROUP=4, HEAD_DIM=128, V_DIM=128, BLOCK_D=128, BLOCK_DV=128, BLOCK_M=64, BLOCK_N=64,
                 MASK_MODE=mask, NUM_SPLITS=splits, IEEE=ieee, UPCAST=False, CAST_KV=dt == "fp8",
                 SCALE_V=dt == "fp8", SLOT_T=slot)
        out.append((f"mha_mask{mask}_splits{splits}_{dt}", A._attn_fwd_kernel, dt, c, 4))
    # decode-shaped fp8 tiles (16 rows, 128 keys): the fp8 decode's default config
    c = dict(GROUP=4, HEAD_DIM=128, V_DIM=128, BLOCK_D=128, BLOCK_DV=128, BLOCK_M=16, BLOCK_N=128,
             MASK_MODE=0, NUM_SPLITS=1, IEEE=False, UPCAST=False, CAST_KV=True, SCALE_V=True,
             SLOT_T=tl.int32)
    out.append(("mha_decode_fp8", A._attn_fwd_kernel, "fp8", c, 4))
    # ... and the 2-warp split programs the backend runs for long fp8 decodes (fp8_narrow_splits)
    out.append(("mha_decode_fp8_narrow", A._attn_fwd_kernel, "fp8", dict(c, NUM_SPLITS=2), 2))
    for mask, splits, ndv, contig, tma, dt in ((0, 1, 1, 1, False, "bf16"), (1, 4, 2, 0, False, "bf16"),
                                               (1, 2, 1, 1, False, "bf16"), (0, 4, 2, 1, True, "bf16"),
                                               (0, 1, 1, 1, False, "fp8")):
        c = dict(NUM_HEADS=16, KV_LORA=512, ROPE=64, BLOCK_M=64, BLOCK_N=32, BLOCK_DV=512 // ndv,
                 NUM_DV=ndv, MASK_MODE=mask, NUM_SPLITS=splits, CONTIG=contig, IEEE=False, UPCAST=False,
                 CAST_KV=dt == "fp8", SCALE_V=dt == "fp8", TMA=tma)
        if not tma:  # unused descriptors: constexpr None
            c.update(desc_v=None, desc_pe=None)
        out.append((f"mla_mask{mask}_splits{splits}_dv{ndv}_contig{contig}{'_tma' if tma else ''}"
                     f"{'_fp8' if dt == 'fp8' else ''}", M._mla_fwd_kernel, dt, c, 8))
    out.append(("verify_greedy", T._verify_greedy_kernel, None, dict(BLOCK_D=64, BLOCK_S=8), 4))
    out.append(("verify_sampling", S._tree_sampling_kernel, None,
                dict(HAS_DRAFT=True, BLOCK_D=64, BLOCK_S=8, BLOCK_V=1024), 4))
    from specattn.triton_kernels import attention_sm90 as G
    if G.HAVE_GLUON:  # the Gluon ping-pong tree verify as sm90_tree_verify launches it (page 1)
        base = dict(GROUP=4, HEAD_DIM=128, BLOCK_N=64, TMA_ROWS=0, LW=8, MASKED_FIRST=False,
                    k_desc=None, v_desc=None)
        for splits in (1, 4):
            out.append((f"gqa_sm90_pingpong_splits{splits}_bf16", G._tree_verify_ws_kernel, "bf16",
                        dict(base, NUM_SPLITS=splits, STAGES=6, F8_STAGES=0, SCALE_V=False), 4,
                        dict(maxnreg=128)))
        out.append(("gqa_sm90_pingpong_fp8", G._tree_verify_ws_kernel, "fp8",
                    dict(base, NUM_SPLITS=1, STAGES=4, F8_STAGES=3, SCALE_V=True), 4,
                    dict(maxnreg=128)))
        # the Gluon MLA seesaw as sm90_mla_attention launches it
        from specattn.triton_kernels import attention_mla_sm90 as MS
        for heads, splits, tree, tiles in ((128, 1, False, "tma"), (128, 4, True, "tma"),
                                           (16, 4, True, "gather"), (128, 4, False, "fp8"),
                                           (16, 1, True, "fp8")):
            c = dict(H=heads, NUM_SPLITS=splits, TREE=tree, TMA=tiles == "tma", FP8=tiles == "fp8")
            if tiles != "tma":
                c.update(kv_desc=None)
            out.append((f"mla_sm90_seesaw_h{heads}_splits{splits}_{'tree' if tree else 'causal'}_{tiles}",
                        MS._mla_seesaw_kernel, "fp8" if tiles == "fp8" else "bf16", c, 4,
                        dict(maxnreg=168)))
    return out


def _kv_desc_type() -> str:
    """The mangled type of the MLA seesaw's TMA descriptor, as its launcher builds it
    (``[64, 64]`` bf16 boxes, 128-byte swizzle)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    from specattn.triton_kernels.gluon_common import SW128
    return mangle_type(TensorDescriptor.from_tensor(torch.empty(64, 576, dtype=torch.bfloat16),
                                                    [64, 64], SW128.value))


def _signature(fn, dt, consts) -> dict:
    sig = {}
    for n in fn.arg_names:
        if dt == "fp8" and n in ("K", "V", "KV"):   # an fp8 cache under bf16 queries and output
            sig[n] = "*fp8e4nv"
        elif dt == "fp8" and n in ("Q", "O"):
            sig[n] = "*bf16"
        elif dt is not None and n in ("Q", "K", "V", "O", "KV"):
            sig[n] = "*" + dt
        elif n in ("O_PART", "LSE_PART"):
            sig[n] = "*fp32"
        elif n in ("req_to_token", "prefix_lens", "qo_indptr", "tree_mask"):
            sig[n] = "*i32"
        elif n == "req_pool_indices":
            sig[n] = "*i64"
        elif n in ("qk_scale", "v_scale") or n.startswith("th_"):
            sig[n] = "fp32"
        elif n == "desc_v":  # host TMA descriptors of the MLA kernel (BLOCK_N x BLOCK_DV / ROPE boxes)
            sig[n] = f"tensordesc<{dt}[{consts['BLOCK_N']}, {consts['BLOCK_DV']}]>"
        elif n == "desc_pe":
            sig[n] = f"tensordesc<{dt}[{consts['BLOCK_N']}, {consts['ROPE']}]>"
        elif n == "kv_desc" and "kv_desc" not in consts:
            sig[n] = _kv_desc_type()
        elif n.endswith("_ptr"):
            sig[n] = "*fp32" if n[:2] in ("us", "uf", "tp", "dp") else "*i64"
        else:
            sig[n] = "i32"
    sig.update({k: "constexpr" for k in consts})
    return sig


def _instructions(ptx: str) -> dict:
    count = collections.Counter()
    for line in ptx.splitlines():
        line = line.strip()
        if not line or line.startswith(("$", ".", "{", "}", "//", ")")) or line.endswith(":"):
            continue
        words = line.split()
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        count[op.rstrip(";")] += 1
    return dict(count)


def _ptxas(ptx: str) -> dict:
    exe = shutil.which("ptxas")
    if exe is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(re.sub(r"^\.version \d+\.\d+", ".version 8.7", ptx, flags=re.M))  # ptxas of CUDA 13.0
        run = subprocess.run([exe, "-arch=sm_90a", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
                             capture_output=True, text=True)
    text = run.stdout + run.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else None}


def dump(out: Path) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for name, fn, dt, consts, warps, *extra in _configs():
        sig = _signature(fn, dt, consts)
        # as the JIT specialises on a GPU: 16-byte aligned pointers, strides divisible by 16
        # (without it every load compiles to 2-byte scalar loads and the figures mislead), and
        # the MLA seesaw's runtime ``zero`` (0 is divisible by 16)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig.get(n, "").startswith("*") or n.startswith("stride_") or n == "zero"}
        gluon = type(fn).__name__ == "GluonJITFunction"
        if gluon:  # Gluon kernels compile from their own source class (no pipeliner stages)
            from triton.experimental.gluon._runtime import GluonASTSource as source
        else:
            source = ASTSource
        src = source(fn=fn, signature=sig, attrs=attrs,
                     constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        opts = dict(num_warps=warps, **({} if gluon else {"num_stages": 2}),
                    **(extra[0] if extra else {}))
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
        (out / f"{name}.ptx").write_text(ptx)
        report[name] = {"instructions": _instructions(ptx), **_ptxas(ptx)}
        print(name, sum(report[name]["instructions"].values()), "instructions",
              {k: v for k, v in report[name].items() if k != "instructions"}, flush=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True))


def compare(a: Path, b: Path) -> int:
    ra, rb = (json.loads((d / "report.json").read_text()) for d in (a, b))
    bad = 0
    for name in sorted(set(ra) | set(rb)):
        x, y = ra.get(name), rb.get(name)
        if x is None or y is None:
            print(f"{name}: only in {'b' if x is None else 'a'}")
            bad += 1
            continue
        ops = {k: (x["instructions"].get(k, 0), y["instructions"].get(k, 0))
               for k in set(x["instructions"]) | set(y["instructions"])
               if x["instructions"].get(k, 0) != y["instructions"].get(k, 0)}
        other = {k: (x.get(k), y.get(k)) for k in ("registers", "spill_store_bytes") if x.get(k) != y.get(k)}
        if ops or other:
            bad += 1
            print(f"{name}: differs {other} {ops}")
        else:
            print(f"{name}: same")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", type=Path)
    g.add_argument("--compare", type=Path, nargs=2)
    a = ap.parse_args(argv)
    if a.out is not None:
        dump(a.out)
        return 0
    return compare(*a.compare)


if __name__ == "__main__":
    sys.exit(main())
