#!/usr/bin/env bash
# End-to-end generation on the real model on this machine's CPU (float32, reference backend):
#   bash bench/scripts/cpu_runtime.sh OUT_DIR
set -u
out=${1:?output dir}; mkdir -p "$out"
run() {
  name=$1; shift
  specattn generate --prompts bench/prompts.txt --device cpu --max-new-tokens 64 --json "$@" > "$out/gen_$name.json"
  python3 - "$out/gen_$name.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:>12}: {r['tokens_per_s']:.1f} tok/s, mean accept {r['mean_accept_length']:.2f}, "
      f"{r['target_forwards']} target forwards")
PY
}
{ date -u +%FT%TZ; nproc; python3 -c "import torch; print('torch', torch.__version__)"
run none --algo none
run eagle_chain --algo eagle --topk 1 --num-steps 3 --num-draft-tokens 4 --draft-layers 24
run eagle_tree --algo eagle --topk 4 --num-steps 4 --num-draft-tokens 12 --draft-layers 24
run dflash --algo dflash --block-size 16
} | tee "$out/generate_summary.txt"
