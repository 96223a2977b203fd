#!/usr/bin/env bash
# On a GPU machine, from the repo root, with FlashInfer and sgl-flash-mla installed (pip extras
# `flashinfer`, `flashmla`; a saved FlashInfer JIT cache in ~/.cache/flashinfer saves compiles):
#   bash bench/scripts/gpu_backends.sh $OUT
# The backends' GPU tests (~4 min on an H100 with the FlashInfer cache; phases share a
# deadline of GB_BUDGET_S, default 540 s):
#  1. FlashInfer / FlashMLA backends vs the reference (eager and graph replay), and the Triton
#     backend's float32 MHA tests;
#  2. the runtime on the random MLA model at FlashMLA shapes, bf16, CUDA graphs, pages 1 and
#     64, per backend (triton, flashinfer, flashmla): every token the float32 greedy choice up
#     to bf16 near-ties (tests/test_runtime_lowp.py), plus the float32 runtime GPU tests on the
#     random models (a backend without float32 skips them, saying so).
# Files in $OUT: device.txt, backends.log, runtime_<backend>.log, summary.md,
# flashinfer-cache.tgz (the JIT cache after the run).
set -u
out=${1:?output dir}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ SPECATTN_BUILD_EXT=${SPECATTN_BUILD_EXT:-0}
t0=$SECONDS; budget=${GB_BUDGET_S:-540}
left() { local l=$((budget - (SECONDS - t0) - $2)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 10 ] && l=10; echo "$l"; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"; } > "$out/device.txt" 2>&1
python3 -m pip install -e . --no-build-isolation --no-deps -q >> "$out/device.txt" 2>&1
common="-q -p no:warnings -p no:cacheprovider -rs --durations=5"

# 8 workers: the unit tests are Triton/FlashInfer JIT-bound (one process ran 63 % of them in 240 s)
timeout "$(left 240 240)" python3 -m pytest -n "${GB_WORKERS:-8}" -m gpu tests/test_flashinfer_backend.py tests/test_flashmla_backend.py \
  tests/test_triton_backend.py -k "not (triton_backend and (bfloat16 or float16))" $common \
  --junitxml=/tmp/gb_backends.xml > "$out/backends.log" 2>&1
echo "exit $?, $((SECONDS - t0)) s" >> "$out/backends.log"; tail -3 "$out/backends.log"

for b in triton flashinfer flashmla; do
  timeout "$(left 120 20)" python3 -m pytest -m gpu --backend "$b" tests/test_runtime_lowp.py -k "mla or graphs_match" \
    tests/test_runtime_mla.py tests/test_runtime_gpu.py::test_graphs_match_eager_random_model -s $common \
    --junitxml="/tmp/gb_rt_$b.xml" > "$out/runtime_$b.log" 2>&1
  echo "exit $?, $((SECONDS - t0)) s" >> "$out/runtime_$b.log"; tail -2 "$out/runtime_$b.log"
done
python3 bench/scripts/junit_table.py "$out/summary.md" backends=/tmp/gb_backends.xml \
  triton=/tmp/gb_rt_triton.xml flashinfer=/tmp/gb_rt_flashinfer.xml flashmla=/tmp/gb_rt_flashmla.xml
# the FlashInfer JIT cache, to restore into ~/.cache/flashinfer next time (new shapes compile once)
tar czf "$out/flashinfer-cache.tgz" -C ~/.cache flashinfer 2>/dev/null
