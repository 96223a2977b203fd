#!/usr/bin/env bash
# On a GPU machine without network, from the repo root, with the model's GGUF on the machine
# (SPECATTN_MODEL_PATH) and gguf importable (or its wheel in the folder $SPECATTN_WHEELS):
#   bash bench/scripts/gpu_runtime.sh $OUT
# Builds specattn._C, then (~7.5 min on a fresh H100; the phases share a deadline of RT_BUDGET_S,
# default 540 s from the start, so a run stays within 10 minutes):
#  1. the runtime's lossless GPU tests (CUDA graphs on, float32) with --backend torch_reference
#     (plus the reference backend's own GPU tests and the engine's graph-routing test) and with
#     --backend triton: target and drafter on that backend; real model == HF greedy, EAGLE
#     chains/trees and DFlash == target-only greedy, the random MLA model (a backend whose
#     supports() lacks a mode the engine needs skips, saying which);
#  2. end to end on the real model (SmolLM2-135M-Instruct, 4 prompts x 64 tokens, batch 4,
#     CUDA graphs, one untimed warm-up run then 3 measured runs): none / EAGLE chain / EAGLE
#     tree / DFlash (random-init drafter) x torch_reference / triton x float32 / bfloat16.
# Backends: RT_BACKENDS (default "torch_reference triton") for the tests, RT_MATRIX_BACKENDS
# (default the same) and RT_MATRIX_PAGES (page size per matrix backend, default 1 each) for
# phase 2.  flashinfer / flashmla need their packages (pip extras `flashinfer`, `flashmla`), e.g.
# RT_BACKENDS="flashinfer flashmla" RT_MATRIX_BACKENDS="triton flashinfer" RT_MATRIX_PAGES="1 16"
# RT_DTYPES=bfloat16 bash bench/scripts/gpu_runtime.sh $OUT (the real model is a Llama: FlashMLA,
# MLA only, runs in the tests on the random MLA model).
# Phase 1 also runs the bf16 near-greedy checks (tests/test_runtime_lowp.py) per backend.
# Files in $OUT (7):
#   device.txt               GPU, versions, phase timings
#   gpu_tests_summary.md     the GPU tests, one column per backend (pass/FAIL/skip + reason, s)
#   gpu_tests_torch_reference.log, gpu_tests_triton.log   pytest output
#   generate_summary.md      the end-to-end table (tokens/s, accept length, lossless flags)
#   generate.json            every end-to-end report (outputs, histograms, per-run timings)
#   errors.log               build output tail and generation stderr
# The kernel tests, benches and compute-sanitizer runs are in gpu_tree_ops.sh / gpu_kv_ops.sh.
set -u
out=${1:?output dir}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 SPECATTN_MODEL_PATH=${SPECATTN_MODEL_PATH:?set SPECATTN_MODEL_PATH to the GGUF (the machine has no network)}
export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ SPECATTN_BUILD_EXT=1 SPECATTN_REQUIRE_MODEL=1
wheels=${SPECATTN_WHEELS:-}
if ! python3 -c "import gguf" 2>/dev/null && [ -n "$wheels" ] && ls "$wheels"/gguf-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$wheels"/gguf-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
t0=$SECONDS; budget=${RT_BUDGET_S:-540}
phase() { echo "phase $1: $((SECONDS - t0)) s since start" >> "$out/device.txt"; }
left() {  # seconds for the next phase: min(cap, what the deadline leaves after a reserve)
  local l=$((budget - (SECONDS - t0) - $2)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 10 ] && l=10; echo "$l"; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  > "$out/device.txt" 2>&1
python3 -m pip install -e . --no-build-isolation --no-deps -q > /tmp/rt_build.log 2>&1
tail -3 /tmp/rt_build.log > "$out/errors.log"
python3 -c "import specattn._ext as e; print('ext', e.EXT_AVAILABLE, e.EXT_MISSING_REASON)" >> "$out/device.txt" 2>&1
phase build

# 1. lossless GPU tests, one run per backend (the reference's own tests only once), in
# RT_XDIST pytest-xdist workers (default 4; 0 = one process): on a fresh machine the Triton
# run JIT-compiles its kernels, which took past its 220 s in one process
xdist=""
if [ "${RT_XDIST:-4}" -gt 0 ] && python3 -c "import xdist" 2>/dev/null; then xdist="-n ${RT_XDIST:-4}"; fi
files="tests/test_runtime_gpu.py tests/test_runtime_dflash.py tests/test_runtime_mla.py tests/test_runtime_lowp.py tests/test_runtime_paging.py"
backends=${RT_BACKENDS:-torch_reference triton}
for b in $backends; do
  extra=""; [ "$b" = torch_reference ] && extra="tests/test_backend_reference.py tests/test_runtime_backends.py"
  cap=200; [ "$b" = triton ] && cap=220   # triton: JIT compiles
  timeout "$(left $cap 200)" python3 -m pytest -m gpu --backend "$b" $files $extra $xdist -q -p no:warnings -p no:cacheprovider \
    -rs --durations=5 --junitxml="/tmp/rt_junit_$b.xml" > "$out/gpu_tests_$b.log" 2>&1
  echo "pytest --backend $b: exit $?" >> "$out/gpu_tests_$b.log"
  tail -2 "$out/gpu_tests_$b.log"
  phase "tests_$b"
done
python3 bench/scripts/junit_table.py "$out/gpu_tests_summary.md" $(for b in $backends; do echo "$b=/tmp/rt_junit_$b.xml"; done)

# 2. end to end, side by side (writes its tables after every configuration)
gen_s=$(left 300 10)
timeout "$gen_s" python3 bench/scripts/runtime_matrix.py --out "$out" --backends ${RT_MATRIX_BACKENDS:-$backends} \
  --page-size ${RT_MATRIX_PAGES:-1} --dtypes ${RT_DTYPES:-float32 bfloat16} --repeats 3 --max-new-tokens 64 --budget-s $((gen_s - 45)) 2>> "$out/errors.log"
echo "runtime_matrix: exit $?" >> "$out/errors.log"
phase generate
cat "$out/generate_summary.md"
