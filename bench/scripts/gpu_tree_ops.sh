#!/usr/bin/env bash
# The spec-ops suite on a GPU machine, from the repo root (only python3 + torch + triton are
# needed):
#   bash bench/scripts/gpu_tree_ops.sh OUT
# Builds specattn._C, runs the GPU tests of the EAGLE tree ops, then `specattn bench suite
# spec_ops` (tree_build / verify_greedy / verify_sampling / compaction for impl=cuda, triton,
# torch (the PyTorch anchors) and reference (not verify_sampling: its reference copies the
# 2.1 GB probs tensor to the host every call)) into SUITE_OUT (default bench/results/<gpu>/),
# then compute-sanitizer memcheck and racecheck on the CUDA tree-op tests selected by
# `-k sanitizer`.
# Every step runs under `timeout`, clamped to a global budget (GPU_TREE_OPS_BUDGET_S, default
# 480 s), so the script ends well inside 9 minutes; a step that does not fit is skipped.
# Files in OUT: device.txt, gpu_tests.log, bench.log, spec_ops.json (a copy of the suite's;
# from another machine `specattn bench suite spec_ops --from OUT/spec_ops.json` redraws the
# three files), sanitizer_memcheck.log, sanitizer_racecheck.log, sanitizer_summary.txt.
set -u
out=${1:?output dir}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# the image's default /opt/gcc links libstdc++ statically into _C.so, which crashes on
# TORCH_CHECK messages; build with the system compiler
export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ SPECATTN_BUILD_EXT=1
start=$(date +%s)
budget=${GPU_TREE_OPS_BUDGET_S:-480}

# step CAP CMD...: CMD under `timeout min(CAP, seconds left - 15)`; skipped (status 124) when
# fewer than 20 s are left.
step() {
  local cap=$1; shift
  local left=$(( budget - ($(date +%s) - start) - 15 ))
  if (( left < 20 )); then echo "SKIPPED (time budget): $*"; return 124; fi
  (( cap < left )) || cap=$left
  timeout -k 5 "$cap" "$@"
}

echo "== build ($(date -u +%T))"
step 240 python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -3
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  git rev-parse HEAD 2>/dev/null || true
  python3 -c "import torch, triton, specattn._ext as e; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); print('ext:', e.EXT_AVAILABLE, e.EXT_MISSING_REASON)"
  python3 -c "from specattn.ops import registry as r; [print(n, {k: v or 'ok' for k, v in r.availability(n).items()}) for n in ('build_tree', 'verify_tree_greedy', 'tree_speculative_sampling', 'compact_accepted_path')]"
} > "$out/device.txt" 2>&1
cat "$out/device.txt"

echo "== GPU tests ($(date -u +%T))"
tests=()
for f in tests/test_tree_ops_cuda.py tests/test_tree_sampling.py tests/test_triton_tree_ops.py; do
  if [[ -f $f ]]; then tests+=("$f"); else echo "missing: $f" | tee -a "$out/gpu_tests.log"; fi
done
if (( ${#tests[@]} )); then
  step 150 python3 -m pytest -m gpu "${tests[@]}" -q -p no:warnings 2>&1 | tee -a "$out/gpu_tests.log" | tail -8
  echo "pytest exit ${PIPESTATUS[0]}" | tee -a "$out/gpu_tests.log"
fi

echo "== bench ($(date -u +%T))"
export SPECATTN_COMMIT=${SPECATTN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  # the JSON's commit
suite_out=${SUITE_OUT:-bench/results/$(python3 -c "import torch; from specattn.bench.e2e import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))")}
step 330 python3 -m specattn bench suite spec_ops --out "$suite_out" > "$out/bench.log" 2>&1
echo "suite exit $?" | tee -a "$out/bench.log"
tail -30 "$out/bench.log"
cp "$suite_out/spec_ops.json" "$out/" 2>/dev/null

echo "== compute-sanitizer ($(date -u +%T))"
san_tests=()
for f in tests/test_tree_ops_cuda.py tests/test_tree_sampling.py; do [[ -f $f ]] && san_tests+=("$f"); done
for tool in memcheck racecheck; do
  log="$out/sanitizer_$tool.log"
  if (( ${#san_tests[@]} )); then
    step 150 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest "${san_tests[@]}" \
      -q -k sanitizer -p no:warnings > "$log" 2>&1
    rc=$?
  else
    echo "no CUDA tree-op test files" > "$log"; rc=-1
  fi
  if (( $(stat -c %s "$log") > 3000000 )); then  # keep the file small enough to come back
    { head -c 1500000 "$log"; echo; echo "... [trimmed] ..."; tail -c 1500000 "$log"; } > "$log.trim" && mv "$log.trim" "$log"
  fi
  echo "compute-sanitizer --tool $tool: exit $rc; $(grep -c 'ERROR SUMMARY: 0 errors' "$log") x 'ERROR SUMMARY: 0 errors', $(grep -c 'RACECHECK SUMMARY: 0 hazards' "$log") x 'RACECHECK SUMMARY: 0 hazards'; pytest: $(grep -E '(passed|failed|error|no tests ran).* in [0-9.]+s' "$log" | tail -1)" \
    | tee -a "$out/sanitizer_summary.txt"
done
echo "== done in $(( $(date +%s) - start )) s; files: $(ls "$out" | tr '\n' ' ')"
