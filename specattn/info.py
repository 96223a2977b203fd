"""What ``specattn info`` reports: versions, CUDA devices, and which backends / ops can run here.

Everything is collected into one plain dict (:func:`collect_info`) so the CLI can print it as
rich tables or as JSON. Nothing here needs a GPU: on a CPU-only machine the device list is
empty and every missing piece says why.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
from typing import Any, Dict, List, Optional

import torch

import specattn

# Optional packages shown in the versions table: display name -> (module, distribution).
OPTIONAL_MODULES = {
    "flashinfer": ("flashinfer", "flashinfer-python"),
    "flash_mla": ("flash_mla", "sgl-flash-mla"),
    "gguf": ("gguf", "gguf"),
    "transformers": ("transformers", "transformers"),
}


def module_version(module: str, dist: Optional[str] = None) -> str:
    """Version string of ``module`` (its ``__version__``, else the installed version of
    distribution ``dist``), ``"not installed"`` when it cannot be found, or
    ``"not importable (<error>)"`` when it is present but importing it fails."""
    try:
        if importlib.util.find_spec(module) is None:
            return "not installed"
    except (ImportError, ValueError):
        return "not installed"
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # a broken optional install must not break `specattn info`
        return f"not importable ({type(e).__name__}: {e})"
    version = getattr(mod, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version(dist or module)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown version"
    return str(version)


def theoretical_bandwidth_gbs(memory_clock_khz: int, bus_width_bits: int) -> Optional[float]:
    """Peak DRAM bandwidth in GB/s (1e9 bytes/s) of a double-data-rate memory.

    ``2 * clock_kHz * 1e3 * bus_bits / 8 / 1e9``. Returns None when either input is not
    positive (some drivers report 0 for unknown clocks).
    """
    if memory_clock_khz <= 0 or bus_width_bits <= 0:
        return None
    return 2.0 * memory_clock_khz * 1e3 * bus_width_bits / 8.0 / 1e9


def cuda_driver_attributes(ordinal: int) -> Dict[str, Any]:
    """Memory clock (kHz), bus width (bits) and theoretical bandwidth (GB/s) of CUDA device
    ``ordinal``, read with cuda-python's driver API (``cuDeviceGetAttribute``).

    Returns ``{"memory_clock_khz", "bus_width_bits", "theoretical_bandwidth_gbs"}``, or
    ``{"error": reason}`` when cuda-python is missing or the driver call fails; never raises.
    """
    try:
        from cuda.bindings import driver
    except ImportError as e:
        return {"error": f"cuda-python not installed ({e})"}
    attr = driver.CUdevice_attribute
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return {"error": f"cuInit failed: {err.name}"}
        err, dev = driver.cuDeviceGet(ordinal)
        if err != driver.CUresult.CUDA_SUCCESS:
            return {"error": f"cuDeviceGet({ordinal}) failed: {err.name}"}
        out = {}
        for key, a in (("memory_clock_khz", attr.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
                       ("bus_width_bits", attr.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)):
            err, value = driver.cuDeviceGetAttribute(a, dev)
            if err != driver.CUresult.CUDA_SUCCESS:
                return {"error": f"cuDeviceGetAttribute({a.name}) failed: {err.name}"}
            out[key] = int(value)
    except Exception as e:  # e.g. the driver library cannot be loaded
        return {"error": f"CUDA driver unavailable through cuda-python ({type(e).__name__}: {e})"}
    out["theoretical_bandwidth_gbs"] = theoretical_bandwidth_gbs(
        out["memory_clock_khz"], out["bus_width_bits"])
    return out


def device_info(ordinal: int) -> Dict[str, Any]:
    """Name, compute capability, SM count, L2 size (bytes), memory (bytes) of torch CUDA
    device ``ordinal``, plus :func:`cuda_driver_attributes`. Needs ``torch.cuda``."""
    p = torch.cuda.get_device_properties(ordinal)
    return {
        "index": ordinal,
        "name": p.name,
        "compute_capability": f"{p.major}.{p.minor}",
        "sm_count": p.multi_processor_count,
        "l2_cache_bytes": getattr(p, "L2_cache_size", None),
        "total_memory_bytes": p.total_memory,
        **cuda_driver_attributes(ordinal),
    }


def _versions() -> Dict[str, str]:
    out = {
        "specattn": specattn.__version__,
        "torch": torch.__version__,
        "triton": module_version("triton"),
        "python": platform.python_version(),
        "cuda-python": module_version("cuda.bindings", "cuda-python"),
    }
    for name, (module, dist) in OPTIONAL_MODULES.items():
        out[name] = module_version(module, dist)
    return out


def _backends() -> Dict[str, Optional[str]]:
    try:
        from specattn.backends import available_backends
    except Exception as e:
        return {"(backends)": f"specattn.backends.available_backends not importable ({e})"}
    try:
        return dict(available_backends())
    except Exception as e:
        return {"(backends)": f"available_backends() failed ({type(e).__name__}: {e})"}


def _ops() -> Dict[str, Dict[str, Optional[str]]]:
    from specattn.ops import registry
    return {name: registry.availability(name) for name in registry.names()}


def collect_info() -> Dict[str, Any]:
    """Everything ``specattn info`` shows, as a JSON-serialisable dict with keys
    ``versions``, ``cuda`` (``available``, ``torch_cuda``, ``device_count``, ``devices``),
    ``extension`` (``available``, ``reason``), ``backends`` (name -> None | reason) and
    ``ops`` (op -> impl -> None | reason). Never raises on a machine without a GPU."""
    from specattn import _ext

    cuda_ok = torch.cuda.is_available()
    devices: List[Dict[str, Any]] = []
    if cuda_ok:
        devices = [device_info(i) for i in range(torch.cuda.device_count())]
    return {
        "versions": _versions(),
        "cuda": {
            "available": cuda_ok,
            "torch_cuda": torch.version.cuda,
            "device_count": len(devices),
            "devices": devices,
        },
        "extension": {"available": bool(_ext.EXT_AVAILABLE), "reason": _ext.EXT_MISSING_REASON},
        "backends": _backends(),
        "ops": _ops(),
    }


def _status(reason: Optional[str]) -> str:
    return "[green]available[/]" if reason is None else f"[red]missing[/]: {reason}"


#: what an op implementation's cell says instead of repeating the extension's reason
EXT_REFERENCE = "needs specattn._C (see above)"


def short_reason(reason: Optional[str], ext_reason: Optional[str]) -> Optional[str]:
    """``reason`` with the CUDA extension's missing-reason (printed once, above the tables)
    replaced by the short :data:`EXT_REFERENCE`; None stays None."""
    if reason is None or not ext_reason or ext_reason not in reason:
        return reason
    return EXT_REFERENCE if reason.strip() == ext_reason.strip() else reason.replace(ext_reason, EXT_REFERENCE)


def render_info(info: Dict[str, Any], console) -> None:
    """Print :func:`collect_info`'s dict as rich tables on ``console`` (a ``rich.Console``).
    The extension's missing-reason is printed once; the op table refers to it."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="Versions", show_header=False)
    for name, version in info["versions"].items():
        t.add_row(escape(name), escape(version))
    console.print(t)

    cuda = info["cuda"]
    console.print(f"CUDA available: {'yes' if cuda['available'] else 'no'} "
                  f"(torch built with CUDA {cuda['torch_cuda'] or 'none'})")
    if cuda["devices"]:
        t = Table(title="CUDA devices")
        for col in ("#", "name", "CC", "SMs", "L2 (MB)", "memory (GiB)", "theoretical GB/s"):
            t.add_column(col)
        for d in cuda["devices"]:
            bw = d.get("theoretical_bandwidth_gbs")
            bw_text = f"{bw:.0f}" if bw is not None else escape(d.get("error", "unknown"))
            l2 = d.get("l2_cache_bytes")
            t.add_row(str(d["index"]), escape(d["name"]), d["compute_capability"], str(d["sm_count"]),
                      f"{l2 / 1e6:.0f}" if l2 else "?", f"{d['total_memory_bytes'] / 2**30:.1f}",
                      bw_text)
        console.print(t)

    ext = info["extension"]
    ext_reason = None if ext["available"] else str(ext["reason"])
    console.print(f"CUDA extension specattn._C: {_status(None if ext_reason is None else escape(ext_reason))}")

    t = Table(title="Backends")
    t.add_column("backend")
    t.add_column("status")
    for name, reason in info["backends"].items():
        reason = short_reason(reason, ext_reason)
        t.add_row(escape(name), _status(None if reason is None else escape(reason)))
    console.print(t)

    impls: List[str] = []
    for per_op in info["ops"].values():
        impls += [i for i in per_op if i not in impls]
    t = Table(title="Ops (implementations)")
    t.add_column("op")
    for impl in impls:
        t.add_column(impl)
    for op, per_op in info["ops"].items():
        cells = []
        for impl in impls:
            if impl not in per_op:
                cells.append("")
                continue
            reason = short_reason(per_op[impl], ext_reason)
            if reason is not None:
                reason = reason.replace(f" of {op}", "")  # the row names the op
            cells.append(_status(None if reason is None else escape(reason)))
        t.add_row(escape(op), *cells)
    console.print(t)
