"""`specattn info` / `specattn bench` on the CPU: output, JSON keys, exit codes."""
import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from specattn import cli, info

runner = CliRunner()

OPTIONAL = ("flashinfer", "flash_mla", "gguf", "transformers")


def test_info_prints_tables():
    res = runner.invoke(cli.app, ["info"])
    assert res.exit_code == 0, res.output
    for text in ("Versions", "torch", "triton", "python", "CUDA available", "Backends",
                 "torch_reference", "Ops", "move_kv_cache", "reference"):
        assert text in res.stdout, text


def test_info_json_keys_and_values():
    res = runner.invoke(cli.app, ["info", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data) == {"versions", "cuda", "extension", "backends", "ops"}
    v = data["versions"]
    assert v["torch"] == torch.__version__
    assert v["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    for name in ("specattn", "triton", "cuda-python") + OPTIONAL:
        assert isinstance(v[name], str) and v[name], name
    assert data["cuda"]["available"] is torch.cuda.is_available()
    assert data["cuda"]["device_count"] == len(data["cuda"]["devices"])
    from specattn import _ext
    assert data["extension"] == {"available": _ext.EXT_AVAILABLE, "reason": _ext.EXT_MISSING_REASON}
    assert data["ops"]["move_kv_cache"]["reference"] is None
    assert set(data["ops"]["move_kv_cache"]) == {"cuda", "triton", "reference"}
    assert data["backends"].get("torch_reference", "absent") is None
    # every missing backend / impl says why
    for reason in data["backends"].values():
        assert reason is None or (isinstance(reason, str) and reason)
    for impls in data["ops"].values():
        for reason in impls.values():
            assert reason is None or (isinstance(reason, str) and reason)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")
def test_info_cpu_only_has_no_devices():
    data = info.collect_info()
    assert data["cuda"]["devices"] == [] and data["cuda"]["available"] is False


def test_module_version_missing_and_present():
    assert info.module_version("specattn_no_such_module_xyz") == "not installed"
    assert info.module_version("torch") == torch.__version__
    # no __version__ attribute: falls back to the distribution's metadata
    import importlib.metadata
    assert info.module_version("typer", "typer") == importlib.metadata.version("typer")


def test_optional_module_not_installed_is_reported(monkeypatch):
    monkeypatch.setitem(info.OPTIONAL_MODULES, "flashinfer", ("specattn_no_such_mod", "nope"))
    assert info.collect_info()["versions"]["flashinfer"] == "not installed"


def test_theoretical_bandwidth():
    # H100 SXM HBM3: 2619 MHz, 5120-bit bus -> 2 * 2.619e9 * 640 B = 3352.3 GB/s
    assert info.theoretical_bandwidth_gbs(2_619_000, 5120) == pytest.approx(3352.32)
    assert info.theoretical_bandwidth_gbs(1_000_000, 64) == pytest.approx(16.0)
    assert info.theoretical_bandwidth_gbs(0, 5120) is None


def test_cuda_python_missing_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes the import fail
    out = info.cuda_driver_attributes(0)
    assert "cuda-python not installed" in out["error"]


def test_cuda_driver_attributes_uses_driver_api(monkeypatch):
    driver = pytest.importorskip("cuda.bindings.driver")
    ok = driver.CUresult.CUDA_SUCCESS
    attr = driver.CUdevice_attribute
    values = {attr.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: 2_619_000,
              attr.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: 5120}
    calls = []
    monkeypatch.setattr(driver, "cuInit", lambda flags: (ok,))
    monkeypatch.setattr(driver, "cuDeviceGet", lambda i: (calls.append(i) or ok, f"dev{i}"))
    monkeypatch.setattr(driver, "cuDeviceGetAttribute", lambda a, dev: (ok, values[a]))
    out = info.cuda_driver_attributes(3)
    assert calls == [3]
    assert out["memory_clock_khz"] == 2_619_000 and out["bus_width_bits"] == 5120
    assert out["theoretical_bandwidth_gbs"] == pytest.approx(3352.32)

    monkeypatch.setattr(driver, "cuInit",
                        lambda flags: (driver.CUresult.CUDA_ERROR_NO_DEVICE,))
    assert "CUDA_ERROR_NO_DEVICE" in info.cuda_driver_attributes(0)["error"]

    def boom(flags):
        raise OSError("libcuda.so not found")
    monkeypatch.setattr(driver, "cuInit", boom)
    assert "libcuda.so not found" in info.cuda_driver_attributes(0)["error"]


def test_backends_failure_is_reported_not_raised(monkeypatch):
    import specattn.backends as backends

    def broken():
        raise RuntimeError("lead's code exploded")
    monkeypatch.setattr(backends, "available_backends", broken)
    data = info.collect_info()
    assert "lead's code exploded" in data["backends"]["(backends)"]


def test_bench_list_works_anywhere(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(cli.app, ["bench", "--list"])
    assert res.exit_code == 0, res.output
    assert "kv_move_reference" in res.stdout and "kv_move_reference_mha" in res.stdout


def test_bench_without_gpu_exits_2(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for args in (["bench"], ["bench", "kv_move_reference", "--json", "x.json"]):
        res = runner.invoke(cli.app, args)
        assert res.exit_code == 2, res.output
        assert res.stderr.strip() == cli.NO_GPU_MESSAGE
        assert "CUDA GPU is needed" in res.stderr


def test_bench_bad_case_or_param_exits_2():
    res = runner.invoke(cli.app, ["bench", "no_such_case"])
    assert res.exit_code == 2 and "unknown case" in res.output
    res = runner.invoke(cli.app, ["bench", "kv_move_reference", "-p", "bogus=1"])
    assert res.exit_code == 2 and "bogus" in res.output
    res = runner.invoke(cli.app, ["bench", "--iters", "10"])
    assert res.exit_code == 2  # fewer than 50 timed iterations is refused


def test_parse_params():
    assert cli.parse_params(["tokens=64", "dtype=float16", "x=1.5", "impl='triton'"]) == {
        "tokens": 64, "dtype": "float16", "x": 1.5, "impl": "triton"}
    import typer
    with pytest.raises(typer.BadParameter):
        cli.parse_params(["tokens64"])


def test_python_m_specattn_subprocess():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "specattn", "info", "--json"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ops"]["move_kv_cache"]["reference"] is None
    out = subprocess.run([sys.executable, "-m", "specattn.cli", "bench"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == cli.NO_GPU_MESSAGE
