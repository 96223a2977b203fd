"""setup.py without a CUDA toolchain: the extension plan, the one-line reasons, and the
build command's fallback to the pure-Python package when the build or link fails (only with
``SPECATTN_BUILD_EXT=1`` does a failed build fail the install).  ``_build_info.json`` is
written after the build, with its true outcome."""
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore:setup.py install is deprecated")


@pytest.fixture
def setup_py(monkeypatch, tmp_path):
    """setup.py imported as a module (``setup()`` only runs as ``__main__``), its ROOT moved
    to ``tmp_path`` so nothing is written into the source tree."""
    spec = importlib.util.spec_from_file_location("specattn_setup_under_test", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "specattn").mkdir()
    monkeypatch.setattr(mod, "ROOT", str(tmp_path))
    monkeypatch.delenv("SPECATTN_BUILD_EXT", raising=False)
    return mod


def info(tmp_path):
    return json.loads((tmp_path / "specattn" / "_build_info.json").read_text())


@pytest.mark.parametrize("value,mode", [(None, "auto"), ("auto", "auto"), ("1", "1"), ("yes", "1"),
                                        ("0", "0"), ("False", "0"), ("bogus", "auto")])
def test_build_mode(setup_py, monkeypatch, value, mode):
    if value is not None:
        monkeypatch.setenv("SPECATTN_BUILD_EXT", value)
    assert setup_py.build_mode() == mode


def fake_torch(cuda):
    return types.SimpleNamespace(__version__="2.99.0", version=types.SimpleNamespace(cuda=cuda))


def test_plan_reasons(setup_py, monkeypatch):
    assert setup_py.extension_plan("0") == ([], {}, "SPECATTN_BUILD_EXT=0")
    monkeypatch.setattr(setup_py, "_import_target_torch", lambda: fake_torch(None))
    assert setup_py.extension_plan("auto")[2] == "torch 2.99.0 has no CUDA"
    monkeypatch.setattr(setup_py, "_import_target_torch", lambda: fake_torch("12.8"))
    monkeypatch.setattr(setup_py, "_nvcc_version", lambda home: None)
    assert setup_py.extension_plan("auto")[2] == "nvcc not found (set CUDA_HOME)"
    monkeypatch.setattr(setup_py, "_nvcc_version", lambda home: (13, 0))
    assert setup_py.extension_plan("auto")[2] == "nvcc 13.0 does not match torch's CUDA 12.8"

    def no_torch():
        raise ImportError("No module named 'torch'")
    monkeypatch.setattr(setup_py, "_import_target_torch", no_torch)
    assert "torch not importable" in setup_py.extension_plan("auto")[2]


def test_plan_builds_with_the_fallback_command(setup_py, monkeypatch, tmp_path):
    import setuptools
    import torch.utils.cpp_extension as cpp
    monkeypatch.setattr(setup_py, "_import_target_torch", lambda: fake_torch("12.8"))
    monkeypatch.setattr(setup_py, "_nvcc_version", lambda home: (12, 9))
    monkeypatch.setattr(cpp, "CUDAExtension", lambda name, sources, **kw: setuptools.Extension(name, sources))
    (tmp_path / "csrc").mkdir()
    for name in ("ops.cpp", "tree.cu"):
        (tmp_path / "csrc" / name).write_text("")
    for mode, strict in (("auto", False), ("1", True)):
        exts, cmdclass, reason = setup_py.extension_plan(mode)
        assert reason is None and [e.name for e in exts] == ["specattn._C"]
        assert exts[0].sources == ["csrc/ops.cpp", "csrc/tree.cu"]
        cmd = cmdclass["build_ext"]
        assert issubclass(cmd, cpp.BuildExtension) and cmd.__name__.startswith("Fallback")


def test_main_writes_the_reason_and_exits_when_strict(setup_py, monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(setup_py, "setup", lambda **kw: calls.append(kw))
    monkeypatch.setattr(setup_py, "extension_plan", lambda mode: ([], {}, "torch 2.99.0 has no CUDA"))
    setup_py.main()
    assert calls and calls[0]["ext_modules"] == []
    assert info(tmp_path) == {"extension_built": False, "reason": "torch 2.99.0 has no CUDA"}
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specattn: installing the pure-Python package without specattn._C: torch 2.99.0 has no CUDA"]
    monkeypatch.setenv("SPECATTN_BUILD_EXT", "1")
    with pytest.raises(SystemExit, match="SPECATTN_BUILD_EXT=1 but the CUDA extension cannot be built"):
        setup_py.main()
    # a planned build records nothing as built before the build has run
    monkeypatch.setenv("SPECATTN_BUILD_EXT", "auto")
    (tmp_path / "specattn" / "_build_info.json").unlink()
    monkeypatch.setattr(setup_py, "extension_plan", lambda mode: (["ext"], {}, None))
    setup_py.main()
    assert info(tmp_path)["extension_built"] is False


# ---------------------------------------------------------------- the build command itself
needs_cc = pytest.mark.skipif(shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc") is None,
                              reason="needs a C compiler")


def run_build_ext(setup_py, tmp_path, monkeypatch, *, libraries, strict, base=None):
    """Build one tiny C extension ``specattn._C`` in place under ``tmp_path`` with the
    fallback command over setuptools' own ``build_ext``."""
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext
    monkeypatch.chdir(tmp_path)
    (tmp_path / "specattn" / "__init__.py").write_text("")
    (tmp_path / "fake.c").write_text(
        "#include <Python.h>\n"
        "static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, \"_C\", NULL, -1, NULL};\n"
        "PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&m); }\n")
    cmd = setup_py.fallback_build_ext(base or build_ext, strict=strict)
    dist = Distribution({"name": "fake", "packages": ["specattn"],
                         "ext_modules": [Extension("specattn._C", ["fake.c"], libraries=libraries)],
                         "cmdclass": {"build_ext": cmd}})
    dist.script_args = ["build_ext", "--inplace", "--build-temp", str(tmp_path / "tmp")]
    dist.parse_command_line()
    dist.run_commands()
    return dist.get_command_obj("build_ext")


@needs_cc
def test_link_failure_falls_back_in_auto_mode(setup_py, tmp_path, monkeypatch, capsys):
    """``cannot find -l...`` at link time: the install goes on without the extension, a
    stale library from an earlier build is removed, and the reason is recorded once."""
    stale = tmp_path / "specattn" / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"an earlier build")
    cmd = run_build_ext(setup_py, tmp_path, monkeypatch, libraries=["specattn_no_such_cudart"], strict=False)
    got = info(tmp_path)
    assert got["extension_built"] is False
    assert got["reason"].startswith("building specattn._C failed (LinkError: ") and "\n" not in got["reason"]
    assert "exit" in got["reason"] and "-shared" not in got["reason"]   # the command is shortened
    assert not stale.exists() and cmd.extensions == [] and cmd.get_outputs() == [] and cmd.inplace
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("specattn:")]
    assert lines == [f"specattn: installing the pure-Python package without specattn._C: {got['reason']}"]


@needs_cc
def test_link_failure_fails_when_strict(setup_py, tmp_path, monkeypatch):
    with pytest.raises(Exception) as e:
        run_build_ext(setup_py, tmp_path, monkeypatch, libraries=["specattn_no_such_cudart"], strict=True)
    assert "Link" in type(e.value).__name__ or "link" in str(e.value).lower() or "failed" in str(e.value)
    assert info(tmp_path)["extension_built"] is False


@needs_cc
def test_successful_build_is_recorded_after_it(setup_py, tmp_path, monkeypatch):
    cmd = run_build_ext(setup_py, tmp_path, monkeypatch, libraries=[], strict=False)
    assert info(tmp_path) == {"extension_built": True, "reason": None}
    assert [Path(p).exists() for p in cmd.get_outputs()] == [True]


def test_compile_failure_falls_back_without_a_compiler(setup_py, tmp_path, monkeypatch):
    """The same fallback with a build command whose compile step raises (no toolchain needed)."""
    from setuptools.command.build_ext import build_ext

    class FailingCompile(build_ext):
        def build_extension(self, ext):
            raise RuntimeError("Error compiling objects for extension\nnvcc fatal: ...")

    run_build_ext(setup_py, tmp_path, monkeypatch, libraries=[], strict=False, base=FailingCompile)
    assert info(tmp_path) == {"extension_built": False, "reason": setup_py.one_line_failure(
        RuntimeError("Error compiling objects for extension"))}
    with pytest.raises(RuntimeError, match="Error compiling objects"):
        run_build_ext(setup_py, tmp_path, monkeypatch, libraries=[], strict=True, base=FailingCompile)
