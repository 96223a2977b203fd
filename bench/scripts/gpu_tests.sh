#!/usr/bin/env bash
# Every gpu-marked test, on a GPU machine, from the repo root, with the package installed (the
# CUDA extension built), FlashInfer and sgl-flash-mla importable and, for the real-model tests,
# SPECATTN_MODEL_PATH naming the model's GGUF (SPECATTN_REQUIRE_MODEL=1 is set: a missing model
# fails them instead of skipping):
#   bash bench/scripts/gpu_tests.sh OUT PART [PART ...]
# PART:
#   backends  the attention backends' files (Triton MHA / MLA, FlashInfer, FlashMLA, the torch
#             reference backend, FP8 KV caches) and the attention bench cases
#   ops       every other file but the real model's: KV move and materialization, tree ops,
#             sampling, top-k, EAGLE draft ops, n-gram, row ops, the device guard
#   model     tests/test_ops_fused_llama.py and tests/test_runtime*.py (the runtime's tests use
#             the default reference attention backend; the real model is loaded)
#   triton    tests/test_runtime*.py again with --backend triton (target and drafters on the
#             Triton backend)
# pytest runs as `python3 -P -m pytest`: the checkout's folders never shadow the installed
# package (an installed, non-editable package works too).
# Each part is one pytest run (GPU_TESTS_WORKERS xdist workers, default 12) under
# `timeout GPU_TESTS_TIMEOUT` (default 540 s) writing OUT/junit_PART.xml and OUT/tests_PART.log;
# then OUT/summary.md counts every junit_*.xml in OUT per part and test file
# (bench/scripts/junit_table.py --by-file), with the device and the commit on top
# (SPECATTN_COMMIT, else git's HEAD).
# Parts may run in separate calls: pass the same OUT folder (or copy the XML files there).
set -u
out=${1:?output dir}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 SPECATTN_REQUIRE_MODEL=1
workers=${GPU_TESTS_WORKERS:-12}
common=(-q -p no:warnings -p no:cacheprovider -rfE -m gpu -n "$workers")
model_files=(tests/test_ops_fused_llama.py tests/test_runtime*.py)
backend_files=(tests/test_triton_backend.py tests/test_triton_backend_mla.py tests/test_flashinfer_backend.py
               tests/test_flashmla_backend.py tests/test_backend_reference.py tests/test_bench_attention.py
               tests/test_kv_fp8.py)

for part in "$@"; do
  case $part in
    backends) args=("${backend_files[@]}") ;;
    ops)
      ignore=(); for f in "${model_files[@]}" "${backend_files[@]}"; do ignore+=(--ignore "$f"); done
      args=(tests "${ignore[@]}") ;;
    model) args=("${model_files[@]}") ;;
    triton) args=(--backend triton tests/test_runtime*.py) ;;
    *) echo "unknown part: $part (backends | ops | model | triton)" >&2; exit 2 ;;
  esac
  t0=$SECONDS
  timeout -k 10 "${GPU_TESTS_TIMEOUT:-540}" python3 -P -m pytest "${common[@]}" "${args[@]}" \
    --junitxml="$out/junit_$part.xml" > "$out/tests_$part.log" 2>&1
  echo "part $part: pytest exit $?, $((SECONDS - t0)) s" | tee -a "$out/tests_$part.log"
  tail -4 "$out/tests_$part.log"
done

{
  echo "# GPU tests"
  echo
  commit=${SPECATTN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
  COMMIT=$commit python3 - <<'EOF'
import os
from datetime import datetime, timezone
import torch, triton
commit = os.environ["COMMIT"]
print(f"{torch.cuda.get_device_name()}, {datetime.now(timezone.utc):%Y-%m-%d}, commit `{commit}`; "
      f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}.")
EOF
  echo
} > "$out/summary_head.md"
runs=()
for x in "$out"/junit_*.xml; do [ -f "$x" ] && runs+=("$(basename "$x" .xml | sed 's/^junit_//')=$x"); done
python3 bench/scripts/junit_table.py --by-file "$out/summary_body.md" "${runs[@]}" \
  && cat "$out/summary_head.md" "$out/summary_body.md" > "$out/summary.md" && rm -f "$out/summary_head.md" "$out/summary_body.md"
head -8 "$out/summary.md"
