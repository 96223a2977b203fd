#!/usr/bin/env bash
# Compile every csrc/*.cu and csrc/*.cpp (compile only, no link) against the installed
# torch's headers, for sm_90, so that a CUDA/C++ compile error fails CI on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob
files=(csrc/*.cu csrc/*.cpp)
if [ ${#files[@]} -eq 0 ]; then echo "csrc: nothing to compile"; exit 0; fi
if ! command -v nvcc >/dev/null; then echo "csrc: nvcc not found; cannot prove csrc/ compiles" >&2; exit 1; fi
read -r TI PYI ABI < <(python - <<'PY'
import os, sysconfig, torch
print(os.path.join(os.path.dirname(torch.__file__), "include"), sysconfig.get_paths()["include"],
      int(torch._C._GLIBCXX_USE_CXX11_ABI))
PY
)
out=$(mktemp -d)
# CPU wheels of torch ship c10/cuda headers but not the one CMake generates for CUDA builds;
# stand in for it (its whole content in CUDA wheels is this define).
mkdir -p "$out/shim/c10/cuda/impl"
if [ ! -f "$TI/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$out/shim/c10/cuda/impl/cuda_cmake_macros.h"
fi
flags=(-c -std=c++20 -O2 -I"$TI" -I"$out/shim" -I"$TI/torch/csrc/api/include" -I"$PYI" -Icsrc
       -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI="$ABI")
pids=()
for f in "${files[@]}"; do
  case "$f" in
    *.cu)  nvcc "${flags[@]}" -gencode=arch=compute_90,code=sm_90 --expt-relaxed-constexpr \
             -Xcompiler -fPIC "$f" -o "$out/$(basename "$f").o" & ;;
    *.cpp) nvcc "${flags[@]}" -x cu -Xcompiler -fPIC "$f" -o "$out/$(basename "$f").o" & ;;
  esac
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
[ $rc -eq 0 ] && echo "csrc: ${#files[@]} files compile for sm_90" || echo "csrc: compile FAILED" >&2
rm -rf "$out"
exit $rc
