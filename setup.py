"""Build script for specattn.

The top-level folders are installed under the single ``specattn`` namespace:

    specattn/        -> specattn            (CLI, ops registry and reference ops)
    backends/        -> specattn.backends
    triton_kernels/  -> specattn.triton_kernels
    spec_runtime/    -> specattn.spec_runtime
    bench/           -> specattn.bench

The CUDA extension ``specattn._C`` is built from ``csrc/`` when the installed torch has
CUDA and nvcc is found (install with ``--no-build-isolation`` so it builds against that
torch).  Otherwise the pure-Python package is installed and one line says why; the reason
is also kept in ``specattn/_build_info.json`` for ``specattn info``.

Environment: ``SPECATTN_BUILD_EXT`` = ``auto`` (default) | ``1`` (fail if it cannot be
built) | ``0`` (never build); ``TORCH_CUDA_ARCH_LIST`` (default ``9.0``).
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
FOLDERS = {
    "specattn": "specattn",
    "specattn.backends": "backends",
    "specattn.triton_kernels": "triton_kernels",
    "specattn.spec_runtime": "spec_runtime",
    "specattn.bench": "bench",
}


def _packages():
    pkgs, pkg_dir = [], {}
    for name, folder in FOLDERS.items():
        pkgs.append(name)
        pkg_dir[name] = folder
        for sub in find_packages(os.path.join(ROOT, folder)):
            pkgs.append(f"{name}.{sub}")
            pkg_dir[f"{name}.{sub}"] = os.path.join(folder, *sub.split("."))
    return pkgs, pkg_dir


def _nvcc_version(cuda_home):
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _import_target_torch():
    """Import the torch installed in the environment being installed into.  pip's build
    isolation hides that environment's site-packages; its paths are still what sysconfig
    reports, so they are appended (after the isolated ones) and torch is found there."""
    try:
        import torch
    except ImportError:
        import sysconfig
        for key in ("purelib", "platlib"):
            path = sysconfig.get_paths()[key]
            if path not in sys.path:
                sys.path.append(path)
        import torch
    return torch


def _extension_plan():
    """Return (ext_modules, cmdclass, reason): reason is None when the extension is built."""
    mode = os.environ.get("SPECATTN_BUILD_EXT", "auto").lower()
    if mode in ("0", "no", "false"):
        return [], {}, "SPECATTN_BUILD_EXT=0"
    try:
        torch = _import_target_torch()
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as e:  # torch missing in the build environment
        return [], {}, f"torch not importable at build time ({type(e).__name__}); install torch first and use pip install --no-build-isolation"
    if torch.version.cuda is None:
        return [], {}, f"torch {torch.__version__} has no CUDA"
    nvcc = _nvcc_version(CUDA_HOME)
    if nvcc is None:
        return [], {}, "nvcc not found (set CUDA_HOME)"
    if nvcc[0] != int(torch.version.cuda.split(".")[0]):
        return [], {}, f"nvcc {nvcc[0]}.{nvcc[1]} does not match torch's CUDA {torch.version.cuda}"
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/*.cu"))
    ext = CUDAExtension(
        "specattn._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++20"],
                            "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}, None


ext_modules, cmdclass, reason = _extension_plan()
if reason is not None and os.environ.get("SPECATTN_BUILD_EXT", "auto") == "1":
    sys.exit(f"specattn: SPECATTN_BUILD_EXT=1 but the CUDA extension cannot be built: {reason}")
line = ("specattn: building CUDA extension specattn._C from csrc/" if reason is None else
        f"specattn: installing the pure-Python package without specattn._C: {reason}")
print(line, file=sys.stderr)
with open(os.path.join(ROOT, "specattn", "_build_info.json"), "w") as f:
    json.dump({"extension_built": reason is None, "reason": reason}, f)

packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir, ext_modules=ext_modules, cmdclass=cmdclass,
      package_data={"specattn": ["_build_info.json"],
                    "specattn.spec_runtime": ["data/*.txt", "assets/*/*"]})
