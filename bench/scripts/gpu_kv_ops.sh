#!/usr/bin/env bash
# On the GPU machine, from the repo root:  bash bench/scripts/gpu_kv_ops.sh $OUT
# Issue 5: builds specattn._C, runs the KV-move and KV-materialization tests (GPU and CPU
# ones), compute-sanitizer memcheck/racecheck on their sanitizer smoke tests, then the bench
# cases side by side: KV move (per-layer reference, CUDA staged, CUDA direct, Triton direct)
# at 256 and 4096 tokens, fused KV materialization (cuda, triton, unfused, gemm) at 512 and
# 4096 tokens, bf16 and fp8 caches.  Logs land in $1 (at most 8 files).
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
b() { timeout 120 python3 -m specattn bench "$@" 2>&1 | grep -v '^wrote' | tail -8; }
{
  echo "## KV move, 256 tokens"
  b kv_move_reference kv_move_reference_mha --json /tmp/j1.json
  b kv_move_reference kv_move_reference_mha -p impl=cuda --json /tmp/j2.json
  b kv_move_mla kv_move_mha -p impl=cuda --json /tmp/j3.json
  b kv_move_mla kv_move_mha -p impl=triton --json /tmp/j4.json
  echo "## KV move, 4096 tokens"
  b kv_move_reference kv_move_reference_mha -p impl=cuda -p tokens=4096 --json /tmp/j5.json
  b kv_move_mla kv_move_mha -p impl=cuda -p tokens=4096 --json /tmp/j6.json
  b kv_move_mla kv_move_mha -p impl=triton -p tokens=4096 --json /tmp/j7.json
  for t in 512 4096; do
    echo "## KV materialization, $t tokens (bf16 cache)"
    for i in gemm cuda triton unfused cuda_epilogue triton_epilogue; do b kv_materialize -p impl=$i -p tokens=$t --json /tmp/m_${i}_$t.json; done
    echo "## KV materialization, $t tokens (fp8 cache)"
    for i in cuda triton; do b kv_materialize -p impl=$i -p tokens=$t -p cache_dtype=float8_e4m3fn --json /tmp/m8_${i}_$t.json; done
  done
} 2>&1 | tee "$out/kv_bench.log"
python3 - "$out/bench_kv_ops.json" /tmp/j?.json /tmp/m*_*.json <<'PY'
import json, sys
json.dump({p: json.load(open(p)) for p in sys.argv[2:]}, open(sys.argv[1], "w"), indent=1)
PY
