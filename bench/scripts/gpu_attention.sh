#!/usr/bin/env bash
# On the GPU machine, from the repo root, after `source .device/setup.sh` (FlashInfer and
# sgl-flash-mla on PYTHONPATH, FLASHINFER_CUDA_ARCH_LIST=9.0a) and a build of the package:
#   bash bench/scripts/gpu_attention.sh $OUT
# Issue 6's attention benchmark, side by side in one process
# (python -m specattn.bench.attention_report): first the correctness cross-check (every impl
# of one small tree-verify input and one MLA decode input vs the torch reference and vs each
# other, max abs diff), then every issue point for every impl:
#   tree_verify     bs/prefix 1/4096 16/2048 64/4096 16/16384  triton|flashinfer_mask|flashinfer_split
#                   (the split twice: fi_backend fa2, and FlashInfer's default "auto", fa3 on Hopper)
#   mla_decode      bs 128, seq_len 8192                        triton|flashmla
#   mla_tree_verify bs 1|16, prefix 4096                        triton
#   decode          bs 1|32|128 x seq_len 1024|8192             triton|flashinfer
#   extend          bs 1, 2048 new tokens, prefix 0|4096        triton|flashinfer
# FlashInfer JIT-compiles 3 modules on a cold cache (~40 s each): the fa2 batch-prefill module
# (bf16, head_dim 128, int32 indices; custom mask, split, tensor-core decode, extend),
# `cascade` (merge_state) and, on Hopper, the fa3 one (the split's prefix part under "auto").
# FlashMLA is prebuilt.
# Writes 7 files into $1: attention_<case>.json x 5 (runner's report layout + errors),
# attention_summary.md (table, bars, errors, cross-check; rewritten after every point) and
# attention.log.  The whole run is capped at GPU_ATTENTION_BUDGET_S (default 345 s).
# Optional: GPU_ATTENTION_ONLY="tree_verify mla_decode" runs a subset of the cases;
# GPU_ATTENTION_PAGE_SIZE=64 runs the tree-verify points on pages of 64 slots.
set -u
out=${1:?output dir}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
budget=${GPU_ATTENTION_BUDGET_S:-345}
log="$out/attention.log"
start=$(date +%s)
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  git rev-parse HEAD 2>/dev/null || true
  python3 - <<'PY'
import torch, triton
from specattn.info import module_version
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "flashinfer", module_version("flashinfer"), "flash_mla", module_version("flash_mla"))
for m in ("flashinfer", "flash_mla"):
    try:
        __import__(m)
    except Exception as e:
        print(f"WARNING: import {m} failed ({type(e).__name__}: {e}): its rows will be errors")
PY
} 2>&1 | tee "$log"

only=()
if [[ -n ${GPU_ATTENTION_ONLY:-} ]]; then only=(--only $GPU_ATTENTION_ONLY); fi
if [[ -n ${GPU_ATTENTION_PAGE_SIZE:-} ]]; then only+=(--page-size "$GPU_ATTENTION_PAGE_SIZE"); fi
timeout -k 10 "$budget" python3 -m specattn.bench.attention_report "$out" "${only[@]}" 2>&1 \
  | tee -a "$log"
rc=${PIPESTATUS[0]}
case $rc in
  0) echo "== all points and the cross-check ran" | tee -a "$log" ;;
  124|137) echo "== STOPPED at the ${budget}s budget: $out/attention_summary.md has the points done so far" | tee -a "$log" ;;
  *) echo "== exit $rc: some point or the cross-check failed (see 'errors' / 'cross-check' in $out/attention_summary.md)" | tee -a "$log" ;;
esac
echo "== done in $(( $(date +%s) - start )) s; files: $(ls "$out" | tr '\n' ' ')" | tee -a "$log"
exit $rc
