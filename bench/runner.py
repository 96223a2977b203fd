"""Runs bench cases on the GPU and reports them: a rich table, and a JSON document.

JSON layout (``build_report``)::

    {"device": {"name", "compute_capability", "sm_count", "l2_cache_bytes",
                "theoretical_bandwidth_gbs", ...},
     "versions": {"specattn", "torch", "triton", "cuda"},
     "timestamp": ISO 8601 (UTC),
     "settings": {"iters", "warmup", "use_graph", "flush_l2"},
     "ceilings": {"copy_gbps", "matmul_tflops", "copy_bytes", "matmul_n", "memcpy_gbps",
                  "kernel_copy_gbps"},
     "cases": [{"name", "description", "params", "mode", "note", "flush_l2", "median_us",
                "p10_us", "p90_us", "iters", "bytes", "flops", "gbps", "tflops",
                "pct_copy_bw", "pct_matmul"}, ...]}
"""
from __future__ import annotations

import gc
import json
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import harness
from .cases import get_case


def run_case(name: str, overrides: Dict[str, Any], ceilings: Optional[harness.Ceilings], *,
             iters: int = 100, warmup: int = 3, use_graph: bool = True,
             flush_l2: Optional[bool] = None) -> Dict[str, Any]:
    """Build case ``name`` on CUDA with ``overrides``, time it, and return its figures as a
    dict (see the module docstring). Raises KeyError / ValueError for a bad name / param."""
    c = get_case(name)
    wl = c.build("cuda", **overrides)
    prep = harness.prepare(wl, use_graph=use_graph, flush_l2=flush_l2, warmup=warmup)
    times = harness.time_prepared(prep, iters)
    res = harness.summarize(name, times, wl.bytes, wl.flops, ceilings,
                            description=c.description, params={**c.params, **overrides},
                            mode=prep.mode, note=prep.note, flush_l2=prep.flush is not None)
    del wl, prep
    gc.collect()
    torch.cuda.empty_cache()
    return res.to_dict()


def device_summary() -> Dict[str, Any]:
    """Name, compute capability, SMs, L2, theoretical bandwidth of the current device."""
    from specattn.info import device_info
    return device_info(torch.cuda.current_device())


def build_report(names: Sequence[str], overrides: Dict[str, Any], *, iters: int = 100,
                 warmup: int = 3, use_graph: bool = True,
                 flush_l2: Optional[bool] = None) -> Dict[str, Any]:
    """Measure the ceilings, then run every case in ``names``; returns the JSON-ready report.
    Raises RuntimeError without CUDA."""
    import specattn
    from specattn.info import module_version

    harness.require_cuda()
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    ceilings = harness.measure_ceilings()
    cases = [run_case(n, overrides, ceilings, iters=iters, warmup=warmup, use_graph=use_graph,
                      flush_l2=flush_l2) for n in names]
    return {
        "device": device_summary(),
        "versions": {"specattn": specattn.__version__, "torch": torch.__version__,
                     "triton": module_version("triton"), "cuda": torch.version.cuda},
        "timestamp": stamp,
        "settings": {"iters": iters, "warmup": warmup, "use_graph": use_graph,
                     "flush_l2": "auto" if flush_l2 is None else flush_l2},
        "ceilings": asdict(ceilings),
        "cases": cases,
    }


def write_json(report: Dict[str, Any], path: str) -> None:
    """Write ``report`` to ``path`` as indented JSON."""
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render_report(report: Dict[str, Any], console) -> None:
    """Print ``report`` as a rich table on ``console``."""
    from rich.markup import escape
    from rich.table import Table

    ceil, dev = report["ceilings"], report["device"]
    title = (f"{dev['name']}  |  copy {ceil['copy_gbps']:.0f} GB/s  |  "
             f"bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s  |  {report['timestamp']}")
    t = Table(title=escape(title))
    t.add_column("case", no_wrap=True)
    for col in ("median us", "p10-p90 us", "GB/s", "TFLOP/s", "% copy BW", "% matmul"):
        t.add_column(col, justify="right")
    t.add_column("mode")
    for r in report["cases"]:
        mode = ("graph" if r["mode"] == "cuda-graph" else r["mode"]) + (
            "+flush" if r["flush_l2"] else "")
        t.add_row(escape(r["name"]), f"{r['median_us']:.1f}", f"{r['p10_us']:.1f}-{r['p90_us']:.1f}",
                  _fmt(r["gbps"], ".0f"), _fmt(r["tflops"], ".1f"), _fmt(r["pct_copy_bw"], ".1f"),
                  _fmt(r["pct_matmul"], ".1f"), mode)
    console.print(t)
    for r in report["cases"]:
        if r["note"]:
            console.print(f"[yellow]{escape(r['name'])}[/]: {escape(r['note'])}")


def list_cases() -> List[Dict[str, Any]]:
    """``[{"name", "description", "params"}]`` for every registered case, sorted by name."""
    from .cases import CASES, case_names
    return [{"name": n, "description": CASES[n].description, "params": CASES[n].params}
            for n in case_names()]
