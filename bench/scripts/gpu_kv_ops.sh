#!/usr/bin/env bash
# The KV-ops suite on a GPU machine, from the repo root:  bash bench/scripts/gpu_kv_ops.sh OUT
# Builds specattn._C, runs the KV-move and KV-materialization tests (GPU and CPU ones),
# compute-sanitizer memcheck/racecheck on their sanitizer smoke tests, then `specattn bench
# suite kv_ops` into SUITE_OUT (default bench/results/<gpu>/): KV move (per-layer reference,
# CUDA staged, CUDA direct, Triton direct) at 256 and 4096 tokens, fused KV materialization
# (cuda, triton, their epilogues alone, unfused, gemm) at 512 and 4096 tokens, bf16 and fp8
# caches.  Files in OUT: device.txt, kv_tests.log, kv_sanitizer_{memcheck,racecheck}.log,
# kv_sanitizer_summary.txt, kv_bench.log, kv_ops.json (a copy of the suite's; from another
# machine `specattn bench suite kv_ops --from OUT/kv_ops.json` redraws the three files).
set -u
out=${1:?output dir}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ SPECATTN_BUILD_EXT=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -3
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c "import torch, triton, specattn._ext as e; print('torch', torch.__version__, 'triton', triton.__version__, 'ext', e.EXT_AVAILABLE, e.EXT_MISSING_REASON)"; } > "$out/device.txt" 2>&1
cat "$out/device.txt"
timeout 240 python3 -m pytest tests/test_kv_move_cuda.py tests/test_kv_move_triton.py \
  tests/test_kv_materialize_fast.py tests/test_ops_kv_materialize.py tests/test_contract.py \
  tests/test_ops_compaction.py -q -p no:warnings -rf 2>&1 | tee "$out/kv_tests.log" | tail -15
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest \
    tests/test_kv_move_cuda.py tests/test_kv_materialize_fast.py -q -p no:warnings -k sanitizer \
    > "$out/kv_sanitizer_$tool.log" 2>&1
  echo "compute-sanitizer --tool $tool: exit $? ($(grep -c -E 'ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards' "$out/kv_sanitizer_$tool.log") clean summaries; $(tail -1 "$out/kv_sanitizer_$tool.log"))" | tee -a "$out/kv_sanitizer_summary.txt"
done
export SPECATTN_COMMIT=${SPECATTN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  # the JSON's commit
suite_out=${SUITE_OUT:-bench/results/$(python3 -c "import torch; from specattn.bench.e2e import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))")}
timeout 300 python3 -m specattn bench suite kv_ops --out "$suite_out" > "$out/kv_bench.log" 2>&1
echo "suite exit $?" | tee -a "$out/kv_bench.log"
tail -45 "$out/kv_bench.log"
cp "$suite_out/kv_ops.json" "$out/" 2>/dev/null
