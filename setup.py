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
is also kept in ``specattn/_build_info.json`` for ``specattn info``.  In automatic mode a
compile or link failure also falls back to the pure-Python package (with its one-line
reason); ``_build_info.json`` is written after the build, with its true outcome.

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


def build_mode() -> str:
    """``SPECATTN_BUILD_EXT`` normalised: ``"auto"`` (unset or anything else), ``"1"``
    (yes / true: the extension must build) or ``"0"`` (no / false: never build)."""
    mode = os.environ.get("SPECATTN_BUILD_EXT", "auto").strip().lower()
    if mode in ("1", "yes", "true", "on"):
        return "1"
    if mode in ("0", "no", "false", "off"):
        return "0"
    return "auto"


def write_build_info(built: bool, reason, folders=None) -> None:
    """Record the build's outcome in ``<folder>/_build_info.json`` for every existing
    folder (default: the source tree's ``specattn/``): ``{"extension_built": built,
    "reason": reason}`` (what ``specattn info`` shows when ``specattn._C`` is missing)."""
    for folder in folders or [os.path.join(ROOT, "specattn")]:
        if os.path.isdir(folder):
            with open(os.path.join(folder, "_build_info.json"), "w") as f:
                json.dump({"extension_built": bool(built), "reason": reason}, f)


def one_line_failure(err: BaseException) -> str:
    """The one-line reason an extension build failed: the error's type and its first line,
    with a failed command shortened to its program name."""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    m = re.match(r"""command\s+'?\[?'?([^'",\]\s]+).*?((?:returned non-zero|failed with) exit (?:code|status) -?\d+)""",
                 first, re.I | re.S)
    if m:
        first = f"{os.path.basename(m.group(1))} {m.group(2)}"
    return (f"building specattn._C failed ({type(err).__name__}{': ' + first[:160] if first else ''}); "
            "the compiler's output is in the pip install -v log")


def fallback_build_ext(base, strict: bool):
    """A ``build_ext`` command class derived from ``base`` (torch's ``BuildExtension``) that
    records the true outcome in ``_build_info.json`` after the build.

    With ``strict`` (``SPECATTN_BUILD_EXT=1``) a failed compile or link raises as usual.
    Otherwise (automatic mode) a failure installs the pure-Python package: the outputs of
    the failed extensions (in the build folder and, for in-place builds, a stale library
    from an earlier build in the source tree) are removed, the extensions are dropped from
    the command's outputs, and one line says why.
    """

    class FallbackBuildExt(base):
        def run(self):
            reason, inplace = None, self.inplace
            try:
                super().run()
            except Exception as e:  # compile errors, LinkError, CalledProcessError, ...
                self.inplace = inplace  # setuptools clears it while building
                reason = one_line_failure(e)
                if strict:
                    write_build_info(False, reason, self._info_folders())
                    raise
                for ext in self.extensions:
                    for path in self._ext_paths(ext):
                        if os.path.exists(path):
                            os.remove(path)
                self.extensions = []
                print(f"specattn: installing the pure-Python package without specattn._C: {reason}",
                      file=sys.stderr)
            if reason is None and not self.extensions:
                reason = "no extension to build"
            write_build_info(reason is None, reason, self._info_folders())

        def _ext_paths(self, ext):
            """Where ``ext``'s library goes: the build folder and the source tree (in place)."""
            paths = [self.get_ext_fullpath(ext.name)]
            package = ".".join(ext.name.split(".")[:-1])
            try:
                package_dir = self.get_finalized_command("build_py").get_package_dir(package)
            except Exception:  # no build_py (not a setuptools distribution): build folder only
                return paths
            return paths + [os.path.join(package_dir, os.path.basename(self.get_ext_filename(ext.name)))]

        def _info_folders(self):
            folders = [os.path.join(ROOT, "specattn")]
            if not self.inplace and self.build_lib:
                folders.append(os.path.join(self.build_lib, "specattn"))
            return folders

    FallbackBuildExt.__name__ = FallbackBuildExt.__qualname__ = f"Fallback{base.__name__}"
    return FallbackBuildExt


def extension_plan(mode: str = None):
    """Return ``(ext_modules, cmdclass, reason)``: ``reason`` is None when the extension is
    to be built (its build may still fail: see :func:`fallback_build_ext`), else the
    one-line reason it is not."""
    mode = build_mode() if mode is None else mode
    if mode == "0":
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
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")) + glob.glob(os.path.join(ROOT, "csrc", "*.cu")))
    sources = [os.path.relpath(s, ROOT) for s in sources]
    ext = CUDAExtension(
        "specattn._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++20"],
                            "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]},
    )
    base = BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)
    return [ext], {"build_ext": fallback_build_ext(base, strict=mode == "1")}, None


def main() -> None:
    """Plan the extension, say what will happen in one line, and run setuptools."""
    mode = build_mode()
    ext_modules, cmdclass, reason = extension_plan(mode)
    if reason is not None and mode == "1":
        sys.exit(f"specattn: SPECATTN_BUILD_EXT=1 but the CUDA extension cannot be built: {reason}")
    if reason is None:
        print("specattn: building CUDA extension specattn._C from csrc/", file=sys.stderr)
        # until the build has run (pip also runs this file only to read the metadata), the
        # extension is not built; the build command records the outcome
        if not os.path.exists(os.path.join(ROOT, "specattn", "_build_info.json")):
            write_build_info(False, "the build step has not run yet")
    else:
        print(f"specattn: installing the pure-Python package without specattn._C: {reason}",
              file=sys.stderr)
        write_build_info(False, reason)
    packages, package_dir = _packages()
    setup(packages=packages, package_dir=package_dir, ext_modules=ext_modules, cmdclass=cmdclass,
          package_data={"specattn": ["_build_info.json"],
                        "specattn.spec_runtime": ["data/*.txt", "assets/*/*"]})


if __name__ == "__main__":
    main()
