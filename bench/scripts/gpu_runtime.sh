#!/usr/bin/env bash
# On the GPU machine, from the repo root, after the model's two parts were put
# (bash .model-a/put.sh; bash .model-b/put.sh) and gguf is importable (`source
# .device/setup.sh`, or the gguf wheel alone carried in .whl: this script installs it):
#   bash bench/scripts/gpu_runtime.sh $OUT
# Builds specattn._C, runs the backend and runtime GPU tests (reference backend eager +
# graphs, the runtime's lossless checks with CUDA graphs, where the spec ops now dispatch to
# the CUDA kernels) and end-to-end generation on the real model: none / EAGLE chain / EAGLE
# tree / DFlash (random-init drafter), CUDA graphs on.  The kernel tests, benches and
# compute-sanitizer runs are in gpu_tree_ops.sh and gpu_kv_ops.sh.
set -u
out=${1:?output dir}
export PYTHONUNBUFFERED=1 SPECATTN_MODEL_PATH=/tmp/specattn-model/SmolLM2-135M-Instruct.Q4_1.gguf
export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ SPECATTN_BUILD_EXT=1
if ! python3 -c "import gguf" 2>/dev/null && ls .whl/gguf-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -3
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > "$out/device.txt"
python3 -m pytest -m gpu tests/test_backend_reference.py tests/test_runtime_gpu.py \
  tests/test_runtime_dflash.py tests/test_runtime_mla.py -q -p no:warnings 2>&1 | tee "$out/gpu_tests.log" | tail -8
run() {  # name, then generate flags
  name=$1; shift
  python3 -m specattn generate --prompts bench/prompts.txt --device cuda --max-new-tokens 64 --json "$@" \
    > "$out/gen_$name.json" 2>> "$out/gen_errors.log" || tail -5 "$out/gen_errors.log"
  python3 - "$out/gen_$name.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:>12}: {r['tokens_per_s']:.1f} tok/s, mean accept {r['mean_accept_length']:.2f}, "
      f"{r['target_forwards']} target forwards, graph={r['cuda_graph']}")
PY
}
{
run none --algo none
run eagle_chain --algo eagle --topk 1 --num-steps 3 --num-draft-tokens 4 --draft-layers 24
run eagle_tree --algo eagle --topk 4 --num-steps 4 --num-draft-tokens 12 --draft-layers 24
run dflash --algo dflash --block-size 16
} | tee "$out/generate_summary.txt"
