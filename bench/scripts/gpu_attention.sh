#!/usr/bin/env bash
# The attention suite on a GPU machine, from the repo root, with FlashInfer and sgl-flash-mla
# importable (FLASHINFER_CUDA_ARCH_LIST=9.0a) and the package installed:
#   bash bench/scripts/gpu_attention.sh OUT
# 1. python -m specattn.bench.attention_report OUT: the cross-check (every impl of one small
#    tree-verify input, one MLA decode input and one fp8-cache decode input against the torch
#    reference and each other, max abs diff), then every point for every impl, raw reports written after each point:
#      tree_verify     bs/prefix 1/4096 16/2048 64/4096 16/16384  triton|triton_generic|triton_sm90_sync|
#                      flashinfer_mask|flashinfer_split (the split twice: fi_backend fa2, and
#                      FlashInfer's default "auto", fa3 for the prefix part on Hopper)
#      mla_decode      bs 128, seq_len 8192                        triton variants|flashmla
#                      16|32|64|128 heads x bs 1|16|64|128 x seq_len 1024|4096|8192  triton|flashmla
#      mla_tree_verify bs 1|16, prefix 4096                        triton variants (16 heads: triton|triton_generic)
#                      chains of 2|4|8 (topk 1), 16|128 heads, bs 16|64  triton|flashmla (causal s_q)
#      decode          bs 1|32|128 x seq_len 1024|8192             triton|flashinfer
#      extend          bs 1, 2048 new tokens, prefix 0|4096        triton|flashinfer
#      and over an fp8 e4m3 cache (kv_dtype=fp8_e4m3): the decode and tree-verify points on
#      triton|flashinfer (decode) / triton|flashinfer_split (tree verify), the MLA ones on triton
# 2. specattn bench suite attention --from OUT: the curated files attention.{json,md,png} in
#    SUITE_OUT (default bench/results/<gpu>/), and a copy of attention.json in OUT (from another
#    machine, `specattn bench suite attention --from OUT/attention.json` redraws the three files).
# FlashInfer JIT-compiles 3 modules on a cold cache (~40 s each); FlashMLA is prebuilt.
# Files in OUT: attention_<case>.json x 5 (raw reports), attention_summary.md, attention.log,
# attention.json.  The measurement is capped at GPU_ATTENTION_BUDGET_S (default 540 s; the whole
# suite takes about 410 s on an H100).
# Optional: GPU_ATTENTION_ONLY="tree_verify mla_decode" runs a subset of the cases; runs of
# different subsets into the same OUT add up (step 2 reads every raw report there), so a suite
# too long for one job runs in parts;
# GPU_ATTENTION_PAGE_SIZE=64 runs the tree-verify points on pages of 64 slots (then keep the
# curated files out of bench/results: set SUITE_OUT).
set -u
out=${1:?output dir}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
budget=${GPU_ATTENTION_BUDGET_S:-540}
log="$out/attention.log"
start=$(date +%s)
commit=${SPECATTN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  echo "commit $commit"
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
  124|137) echo "== STOPPED at the ${budget}s budget: the points done so far are in $out" | tee -a "$log" ;;
  *) echo "== exit $rc: some point or the cross-check failed (see 'errors' / 'cross-check' in $out/attention_summary.md)" | tee -a "$log" ;;
esac

suite_out=${SUITE_OUT:-bench/results/$(python3 -c "import torch; from specattn.bench.e2e import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))")}
python3 -m specattn bench suite attention --from "$out" --out "$suite_out" --commit "$commit" > /dev/null 2>> "$log" \
  && cp "$suite_out/attention.json" "$out/" && echo "== suite files in $suite_out" | tee -a "$log"
echo "== done in $(( $(date +%s) - start )) s; files: $(ls "$out" | tr '\n' ' ')" | tee -a "$log"
exit $rc
