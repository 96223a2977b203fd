#!/usr/bin/env bash
# On the GPU machine, from the repo root, after `source .device/setup.sh`:
#   bash bench/scripts/gpu_foundation.sh $OUT
# Builds specattn._C, runs the GPU tests, `specattn info`, the KV-move bench cases and
# compute-sanitizer memcheck/racecheck on the CUDA KV move.  Logs land in $1.
set -u
out=${1:?output dir}
export PYTHONUNBUFFERED=1
# the image's default /opt/gcc links libstdc++ statically into _C.so, which crashes on
# TORCH_CHECK messages; build with the system compiler
export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ SPECATTN_BUILD_EXT=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -3; python3 -c "import specattn._ext as e; print(\"ext:\", e.EXT_AVAILABLE, e.EXT_MISSING_REASON)"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > "$out/device.txt"
python3 -m specattn info | tee "$out/info.txt"
python3 -m specattn info --json > "$out/info.json"
python3 -m pytest -m gpu tests -q -p no:warnings 2>&1 | tee "$out/gpu_tests.log" | tail -5
python3 -m specattn bench kv_move_reference kv_move_reference_mha --json "$out/bench_kv_move_reference.json" 2>&1 | tail -15
python3 -m specattn bench kv_move_reference kv_move_reference_mha -p impl=cuda --json "$out/bench_kv_move_cuda.json" 2>&1 | tail -15
python3 -m specattn bench kv_move_reference kv_move_reference_mha -p impl=cuda -p tokens=4096 --json "$out/bench_kv_move_cuda_4096.json" 2>&1 | tail -15
for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest tests/test_kv_move_cuda.py -q -x -p no:warnings \
    > "$out/sanitizer_$tool.log" 2>&1
  echo "compute-sanitizer --tool $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$out/sanitizer_$tool.log") clean summaries)" | tee -a "$out/sanitizer_summary.txt"
done
