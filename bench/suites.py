"""Benchmark suites and their curated results, ``bench/results/<gpu>/<suite>.{json,md,png}``.

``specattn bench suite NAME`` runs one suite on the GPU (or, with ``--from``, rebuilds its
files from an earlier run's raw reports) and writes three files into ``bench/results/<gpu>/``
(``<gpu>`` = :func:`specattn.bench.e2e.gpu_slug` of the device): the JSON, a markdown table
(:func:`markdown`, a pure function of the JSON) and a PNG plot (:func:`render_png`,
matplotlib).

Suites:

- ``attention``: every point of :data:`specattn.bench.attention_report.TRACKED_POINTS` (tree
  verify, MLA decode, MLA tree verify, decode, extend) for every implementation, the
  FlashInfer / FlashMLA rows included, after the cross-check of every implementation
  against the torch reference (:func:`specattn.bench.attention_report.cross_check`);
- ``spec_ops``: tree build, greedy verify, stochastic verify and compaction for
  ``impl=cuda|triton|torch|reference`` (``torch``: the vectorized PyTorch anchors of
  ``bench/torch_anchors.py``; ``reference``: the Python-loop oracle, eager, no stochastic
  verify);
- ``kv_ops``: ``move_kv_cache`` (per-layer reference, CUDA staged, CUDA / Triton direct) at
  256 and 4096 tokens, MLA and MHA layouts; fused KV materialization (CUDA, Triton, their
  epilogues alone, the unfused form and the projection GEMM alone) at 512 and 4096 tokens,
  bf16 and fp8 caches;
- ``e2e``: :mod:`specattn.bench.e2e` (its own JSON rows and writers).

JSON (every suite but ``e2e``)::

    {"suite", "device", "versions", "commit", "commit_note" (optional), "timestamp",
     "settings", "ceilings", "ceilings_by_part" (optional), "rows": [ROW, ...],
     "errors": [{"case", "params", "error"}], "checks": [line, ...]}

    ROW = {"case", "point", "impl", "params", "median_us", "p10_us", "p90_us", "iters",
           "gbps", "tflops", "pct_copy_bw", "pct_matmul", "pct_roofline", "speedup",
           "mode", "flush_l2", "note"}

``point`` names the workload (rows of one point run identical inputs); ``impl`` the
implementation; ``speedup`` maps each reference row of the same point (the libraries for
``attention``, the PyTorch anchor for ``spec_ops``, the per-layer copy / the unfused form /
the GEMM alone for ``kv_ops``) to ``its time / this row's time``; ``pct_roofline`` is the
larger of ``pct_copy_bw`` and ``pct_matmul`` (the roofline time over the measured time).
``ceilings_by_part`` is there when a run in parts measured different ceilings in its parts
(``[{"cases", "copy_gbps", "matmul_tflops"}, ...]``): each row's percentages are of its own
part's ceilings, ``ceilings`` are the first part's.  ``commit`` is the commit whose code was
measured; ``commit_note`` says where it comes from when the run did not record it itself.

Everything except :func:`run_suite` is pure Python and runs anywhere.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

SUITES = ("attention", "spec_ops", "kv_ops", "e2e")
TOP_KEYS = ("suite", "device", "versions", "commit", "timestamp", "settings", "ceilings", "rows")
ROW_KEYS = ("case", "point", "impl", "params", "median_us", "p10_us", "p90_us", "gbps", "tflops",
            "pct_roofline", "speedup", "mode")
E2E_KEYS = TOP_KEYS + ("model", "num_prompts")   # the e2e JSON's: its markdown reads these too

Point = Tuple[str, Dict[str, Any], Dict[str, Any]]  # (case, overrides, run_case kwargs)


# ----------------------------------------------------------------------------- suites
def _kv_layout(p: Dict[str, Any]) -> str:
    return (f"MLA {p['layers']} layers x {p['width']}" if p.get("kv_per_layer") == 1
            else f"MHA {p['layers']} layers x K,V x {p['heads']} x {p['width']}")


def _point(case: str, p: Dict[str, Any]) -> str:
    """The workload of a row, without its implementation."""
    if case in ("tree_verify", "mla_tree_verify", "mla_decode", "decode", "extend"):
        from .attention_report import point_label
        return point_label(case, p)
    if case.startswith("kv_move"):
        return f"{_kv_layout(p)}, tokens={p['tokens']}"
    keys = {"tree_build": ("bs", "topk", "num_steps", "num_draft_tokens"),
            "verify_greedy": ("bs", "num_draft_tokens"),
            "verify_sampling": ("bs", "num_draft_tokens", "vocab"),
            "compaction": ("bs", "num_draft_tokens", "hidden"),
            "kv_materialize": ("tokens", "cache_dtype")}.get(case, ())
    return " ".join(f"{k}={p[k]}" for k in keys if k in p)


def _impl(case: str, p: Dict[str, Any]) -> str:
    impl = str(p.get("impl"))
    if impl == "floor":
        return FLOOR_IMPL[_op(case)]
    if case.startswith("kv_move") and impl != "reference":
        return f"{impl} {'staged' if p.get('group_size') is None else 'direct'}"
    if case in ("tree_verify", "mla_tree_verify", "mla_decode", "decode", "extend"):
        from .attention_report import impl_label
        return impl_label(case, p)
    return impl


def _op(case: str) -> str:
    return "kv_move" if case.startswith("kv_move") else case


def _is_reference(case: str, p: Dict[str, Any], suite: str) -> bool:
    impl = p.get("impl")
    if suite == "attention":
        from .cases_attention import LIBRARIES
        return impl in LIBRARIES
    if suite == "spec_ops":
        return impl == "torch"
    if case.startswith("kv_move"):
        return impl == "reference"
    return impl in ("unfused", "gemm")


#: the floor rows' labels: what any one-launch implementation pays at the same point, timed
#: the same way (bench/cases.py, bench/cases_tree.py)
FLOOR_IMPL = {"kv_move": "floor: one contiguous copy", "tree_build": "floor: one-element kernel"}
#: latency targets (us) per (op, point prefix); checked by :func:`targets`
LATENCY_BARS = {("tree_build", ""): 6.0, ("kv_move", "MLA"): 15.0, ("kv_move", "MHA"): 20.0}


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    cases: Tuple[str, ...]                  # the bench cases it reports, in table order
    impl_order: Tuple[str, ...] = ()        # row order within a point (others: as found)


SUITE_INFO: Dict[str, Suite] = {
    "attention": Suite("attention", "Attention kernels",
                       ("tree_verify", "mla_decode", "mla_tree_verify", "decode", "extend")),
    "spec_ops": Suite("spec_ops", "Speculative-decoding ops",
                      ("tree_build", "verify_greedy", "verify_sampling", "compaction"),
                      ("cuda", "triton", "torch", "reference", FLOOR_IMPL["tree_build"])),
    "kv_ops": Suite("kv_ops", "KV ops",
                    ("kv_move_reference", "kv_move_mla", "kv_move_reference_mha", "kv_move_mha",
                     "kv_materialize"),
                    ("reference", "cuda staged", "cuda direct", "triton direct", FLOOR_IMPL["kv_move"],
                     "gemm", "cuda", "triton", "unfused", "cuda_epilogue", "triton_epilogue")),
}


def suite_points(name: str) -> List[Point]:
    """What :func:`run_suite` measures for suite ``name`` (not ``e2e``)."""
    if name == "attention":
        from .attention_report import TRACKED_POINTS
        return [(c, dict(p), {}) for c, p in TRACKED_POINTS]
    if name == "spec_ops":
        pts: List[Point] = []
        for impl in ("cuda", "triton", "torch"):
            pts += [(c, dict(impl=impl), {}) for c in SUITE_INFO[name].cases]
        # the Python-loop oracle syncs with the host; its stochastic verify copies the
        # 2.1 GB probabilities to the host every call, so it is left out
        pts += [(c, dict(impl="reference"), dict(iters=50, warmup=1))
                for c in ("tree_build", "verify_greedy", "compaction")]
        pts.append(("tree_build", dict(impl="floor"), {}))
        return pts
    if name == "kv_ops":
        pts = []
        for tokens in (256, 4096):
            impls = ("reference", "cuda") if tokens == 256 else ("cuda",)
            for c_ref, c_dir in (("kv_move_reference", "kv_move_mla"),
                                 ("kv_move_reference_mha", "kv_move_mha")):
                pts += [(c_ref, dict(impl=i, tokens=tokens), {}) for i in impls]
                pts += [(c_dir, dict(impl=i, tokens=tokens), {}) for i in ("cuda", "triton", "floor")]
        for tokens in (512, 4096):
            pts += [("kv_materialize", dict(impl=i, tokens=tokens), {})
                    for i in ("gemm", "cuda", "triton", "unfused", "cuda_epilogue", "triton_epilogue")]
            pts += [("kv_materialize", dict(impl=i, tokens=tokens, cache_dtype="float8_e4m3fn"), {})
                    for i in ("cuda", "triton")]
        return pts
    raise ValueError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")


# ----------------------------------------------------------------------------- rows
def pct_roofline(r: Dict[str, Any]) -> Optional[float]:
    vals = [v for v in (r.get("pct_copy_bw"), r.get("pct_matmul")) if v is not None]
    return max(vals) if vals else None


def build_rows(suite: str, results: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows (module docstring) from ``runner.run_case`` results of ``suite``'s cases, in
    table order, with their speedups over the reference rows of the same point."""
    info = SUITE_INFO[suite]
    rows, seen_points = [], {}
    for res in results:
        case, p = res["name"], dict(res["params"])
        if case not in info.cases:
            continue
        row = dict(case=case, point=_point(case, p), impl=_impl(case, p), params=p,
                   median_us=res["median_us"], p10_us=res.get("p10_us"), p90_us=res.get("p90_us"),
                   iters=res.get("iters"), gbps=res.get("gbps"), tflops=res.get("tflops"),
                   pct_copy_bw=res.get("pct_copy_bw"), pct_matmul=res.get("pct_matmul"),
                   pct_roofline=pct_roofline(res), speedup={}, mode=res.get("mode", ""),
                   flush_l2=bool(res.get("flush_l2", False)), note=res.get("note", ""))
        seen_points.setdefault((_op(case), row["point"]), len(seen_points))
        rows.append(row)
    ops = list(dict.fromkeys(_op(c) for c in info.cases))

    def key(ir):
        i, r = ir
        rank = info.impl_order.index(r["impl"]) if r["impl"] in info.impl_order else len(info.impl_order)
        return ops.index(_op(r["case"])), seen_points[(_op(r["case"]), r["point"])], rank, i

    rows = [r for _, r in sorted(enumerate(rows), key=key)]
    for r in rows:
        if _is_reference(r["case"], r["params"], suite) or r["params"].get("impl") == "floor" \
                or (suite == "spec_ops" and r["impl"] == "reference"):
            continue  # the references themselves, the floors, and the Python-loop oracle
        for o in rows:
            if (_op(o["case"]), o["point"]) == (_op(r["case"]), r["point"]) and o["median_us"] > 0 \
                    and _is_reference(o["case"], o["params"], suite):
                r["speedup"][o["impl"]] = o["median_us"] / r["median_us"]
    return rows


def targets(report: Dict[str, Any]) -> List[str]:
    """The suite's targets, one line each, for the rows present ("meets" / "MISSES")."""
    rows, suite = report["rows"], report["suite"]
    out: List[str] = []
    ok = lambda good: "meets" if good else "MISSES"  # noqa: E731
    if suite == "attention":
        from .attention_report import bar_lines
        return bar_lines(rows)
    floors = {(_op(r["case"]), r["point"]): r["median_us"] for r in rows if r["params"].get("impl") == "floor"}

    def latency(op: str, r: Dict[str, Any]) -> None:
        bar = next((v for (o, pre), v in LATENCY_BARS.items() if o == op and r["point"].startswith(pre)), None)
        if bar is None:
            return
        f = floors.get((op, r["point"]))
        out.append(f"{op} {r['point']}: {r['impl']} {r['median_us']:.1f} us ({ok(r['median_us'] <= bar)} "
                   f"<= {bar:g} us" + (f"; floor in this run {f:.1f} us" if f is not None else "") + ")")

    for r in rows:
        p, x = r["params"], r["speedup"]
        if suite == "spec_ops" and r["case"] == "tree_build" and r["impl"] in ("cuda", "triton"):
            latency("tree_build", r)
        elif suite == "kv_ops" and r["impl"].endswith("direct"):
            if p.get("tokens") == 256:
                latency("kv_move", r)
            if "reference" in x:
                out.append(f"kv_move {r['point']}: {r['impl']} {x['reference']:.1f}x the per-layer "
                           f"copy ({ok(x['reference'] >= 10.0)} >= 10x)")
            if p.get("tokens", 0) >= 4096 and r.get("pct_copy_bw") is not None:
                out.append(f"kv_move {r['point']}: {r['impl']} {r['pct_copy_bw']:.1f} % of copy "
                           f"bandwidth ({ok(r['pct_copy_bw'] >= 70.0)} >= 70 %)")
        elif suite == "kv_ops" and r["case"] == "kv_materialize" and r["impl"] in ("cuda", "triton"):
            if "unfused" in x:
                out.append(f"kv_materialize {r['point']}: {r['impl']} {x['unfused']:.2f}x the "
                           f"unfused form ({ok(x['unfused'] >= 2.0)} >= 2x)")
            if "gemm" in x:
                out.append(f"kv_materialize {r['point']}: {r['impl']} {1 / x['gemm']:.2f}x the "
                           f"GEMM's time ({ok(1 / x['gemm'] <= 1.25)} <= 1.25x)")
    return out


# ----------------------------------------------------------------------------- reports
def raw_reports(run_dir: Path) -> List[Dict[str, Any]]:
    """Every ``runner.build_report``-layout report in ``run_dir``'s ``*.json`` files: a file
    holding one (``specattn bench ... --json``, ``attention_<case>.json``), or several as
    the values of one object (the combined files the GPU scripts wrote)."""
    out = []
    for path in sorted(glob.glob(os.path.join(str(run_dir), "*.json"))):
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "cases" in data:
            out.append(data)
        elif isinstance(data, dict):
            out += [v for v in data.values() if isinstance(v, dict) and "cases" in v]
    return sorted(out, key=lambda r: r.get("timestamp") or "")


_MISSING_LIB = re.compile(r"^(\w+) impl=(\w+): FAILED ImportError: impl='\w+' needs ")


def summary_checks(run_dir: Path) -> List[str]:
    """The cross-check lines of ``run_dir/attention_summary*.md`` (``attention_report``; one
    file per part where the suite ran in parts on machines with different libraries), each
    line once.  An implementation that failed in one part only because its library was not
    installed there is dropped if another part checked it."""
    lines: List[str] = []
    for path in sorted(Path(run_dir).glob("attention_summary*.md")):
        inside = False
        for line in path.read_text().splitlines():
            if line.startswith("## "):
                inside = line.strip() == "## cross-check"
            elif (inside and line.startswith("- ") and ("max abs diff" in line or "FAILED" in line)
                  and line[2:] not in lines):
                lines.append(line[2:])

    def checked_elsewhere(case: str, impl: str) -> bool:
        return any(ln.startswith(case + " ") and f" {impl} " in ln.replace(":", " ")
                   and "FAILED" not in ln for ln in lines)
    return [ln for ln in lines
            if not ((m := _MISSING_LIB.match(ln)) and checked_elsewhere(m.group(1), m.group(2)))]


def _errors(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A raw report's errors as ``{"case", "params", "error"}`` (attention_report's carry no
    case: their report's)."""
    default = report["cases"][0]["name"] if report.get("cases") else ""
    out = []
    for e in report.get("errors", []):
        if isinstance(e, dict):
            out.append({"case": e.get("case") or default, "params": e.get("params", {}),
                        "error": e.get("error", "")})
        else:  # the GPU scripts' combined files: a log tail
            out.append({"case": default, "params": {}, "error": str(e)[-500:]})
    return out


def _installed(version: Any) -> bool:
    """Whether a raw report's version string names an installed library
    (:func:`specattn.info.module_version` says ``"not installed"`` / ``"not importable
    (...)"`` otherwise)."""
    return bool(version) and not str(version).startswith("not ")


def make_report(suite: str, reports: Sequence[Dict[str, Any]], *, commit: Optional[str],
                commit_note: Optional[str] = None, checks: Sequence[str] = ()) -> Dict[str, Any]:
    """The suite JSON from raw reports (the earliest's device, settings, ceilings and
    timestamp; its versions, with a library it lacked taken from a later report that had it,
    as when the suite runs in parts; every report's cases of the suite and errors).  Raises
    ValueError when no report holds a case of the suite."""
    info = SUITE_INFO[suite]
    reports = sorted((r for r in reports if any(c["name"] in info.cases for c in r["cases"])
                      or any(e["case"] in info.cases for e in _errors(r))),
                     key=lambda r: r.get("timestamp") or "")
    if not reports:
        raise ValueError(f"no report holds a case of suite {suite!r} ({', '.join(info.cases)})")
    head = reports[0]
    versions = dict(head["versions"])
    for r in reports[1:]:
        versions.update({k: v for k, v in r.get("versions", {}).items()
                         if _installed(v) and not _installed(versions.get(k))})
    rep = {"suite": suite, "device": head["device"], "versions": versions, "commit": commit}
    if commit_note:
        rep["commit_note"] = commit_note
    rep.update(timestamp=head["timestamp"], settings=head.get("settings", {}),
               ceilings=head["ceilings"],
               rows=build_rows(suite, [c for r in reports for c in r["cases"]]),
               errors=[e for r in reports for e in _errors(r) if e["case"] in info.cases],
               checks=list(checks))
    parts = _ceiling_parts(reports, info.cases)
    if parts:
        rep["ceilings_by_part"] = parts
    return rep


def _ceiling_parts(reports: Sequence[Dict[str, Any]], cases: Sequence[str]) -> List[Dict[str, Any]]:
    """When the raw reports measured different ceilings (parts of a run on different GPUs or
    at different times), one ``{"cases", "copy_gbps", "matmul_tflops"}`` per distinct pair, in
    report order: each row's percentages are of its own part's ceilings, not of ``ceilings``.
    Empty when every report has the same ceilings."""
    parts: List[Dict[str, Any]] = []
    for r in reports:
        c = r.get("ceilings") or {}
        key = (c.get("copy_gbps"), c.get("matmul_tflops"))
        names = list(dict.fromkeys(x["name"] for x in r["cases"] if x["name"] in cases))
        same = [p for p in parts if (p["copy_gbps"], p["matmul_tflops"]) == key]
        if same:
            same[0]["cases"] += [n for n in names if n not in same[0]["cases"]]
        else:
            parts.append({"cases": names, "copy_gbps": key[0], "matmul_tflops": key[1]})
    return parts if len(parts) > 1 else []


def git_last_commit(path: Path) -> Optional[str]:
    """The commit that last touched ``path`` (``git log -1``), or None."""
    path = Path(path).resolve()
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%H", "--", str(path)],
                             cwd=path if path.is_dir() else path.parent, capture_output=True,
                             text=True, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


UNRECORDED_COMMIT = ("the run did not record its commit: the commit that last touched its raw "
                     "reports (git log)")


def from_report(rep: Dict[str, Any], *, commit: Optional[str] = None,
                commit_note: Optional[str] = None) -> Dict[str, Any]:
    """A suite JSON as is, or with ``commit`` (and ``commit_note``) in place of its own."""
    if not commit:
        return rep
    out = {}
    for k, v in rep.items():
        if k == "commit_note":
            continue
        out[k] = commit if k == "commit" else v
        if k == "commit" and commit_note:
            out["commit_note"] = commit_note
    return out


def load_report(path: Path, suite: Optional[str] = None) -> Dict[str, Any]:
    """The suite JSON at ``path`` (a file): an object with every key of :data:`TOP_KEYS`
    (``e2e``: of :data:`E2E_KEYS`), ``device`` an object and ``rows`` a list; with ``suite``,
    that suite's.

    Raises:
        ValueError: ``<path> is not valid JSON: <the decoder's message>``, or what makes the
            JSON no suite report (its type, the keys it lacks), or another suite's report.
    """
    path = Path(path)
    try:
        rep = json.loads(path.read_text())
    except ValueError as e:   # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    named = rep.get("suite", suite) if isinstance(rep, dict) else suite
    keys = E2E_KEYS if named == "e2e" else TOP_KEYS
    if not isinstance(rep, dict):
        raise ValueError(f"{path} is not a suite report: it holds a JSON {_json_kind(rep)}, not an "
                         f"object with the keys {', '.join(keys)}")
    if suite is not None and "suite" in rep and rep["suite"] != suite:
        raise ValueError(f"{path} is not {'an' if suite[0] in 'aeiou' else 'a'} {suite} results file "
                         f"(its suite is {rep['suite']!r})")
    missing = [k for k in keys if k not in rep]
    if missing:
        raise ValueError(f"{path} is not a suite report: it has no {', '.join(map(repr, missing))} "
                         f"key{'s' if len(missing) > 1 else ''}")
    for key, kind in (("device", dict), ("rows", list)):
        if not isinstance(rep[key], kind):
            raise ValueError(f"{path} is not a suite report: its {key!r} is a JSON "
                             f"{_json_kind(rep[key])}, not {'an object' if kind is dict else 'a list'}")
    return rep


def _json_kind(value: Any) -> str:
    """The JSON type name of a parsed JSON value."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    return "null" if value is None else "number"


def from_run(suite: str, source: Path, *, commit: Optional[str] = None,
             commit_note: Optional[str] = None) -> Dict[str, Any]:
    """Suite ``suite``'s JSON from an earlier run: ``source`` is the folder of its raw
    reports (for ``e2e``: a folder with ``e2e.json``, or with several below it -- a run made
    in parts, merged by :func:`specattn.bench.e2e.merge_parts`), or a suite JSON (rewritten
    as is, ``commit`` / ``commit_note`` applied).  Without ``commit``, a raw run gets the commit
    that last touched ``source`` in git, and a ``commit_note`` saying so.

    Raises:
        FileNotFoundError: no such file or folder.  ValueError: nothing of the suite there, or
            a suite JSON that :func:`load_report` refuses (not valid JSON, no suite report,
            another suite's).
    """
    source = Path(source)
    if source.is_dir() and suite == "e2e":
        parts = sorted(source.rglob("e2e.json"))
        if len(parts) > 1:   # a run made in parts (one job per --bs list): one report
            from .e2e import merge_parts
            rep = merge_parts([load_report(p, suite) for p in parts])
            return from_report(rep, commit=commit, commit_note=commit_note)
        source = parts[0] if parts else source / "e2e.json"
    if source.is_file():
        return from_report(load_report(source, suite), commit=commit, commit_note=commit_note)
    if not source.is_dir():
        raise FileNotFoundError(f"no such file or folder: {source}")
    if not commit:
        commit, commit_note = git_last_commit(source), commit_note or UNRECORDED_COMMIT
    return make_report(suite, raw_reports(source), commit=commit, commit_note=commit_note,
                       checks=summary_checks(source) if suite == "attention" else ())


# ----------------------------------------------------------------------------- GPU run
def run_suite(suite: str, *, iters: int = 100, warmup: int = 3,
              log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Run suite ``suite`` on the GPU (module docstring) and return its JSON.  A point that
    fails is recorded in ``errors`` and the rest still run.  Raises RuntimeError without
    CUDA."""
    import gc
    import time
    import traceback

    import torch

    import specattn
    from specattn.info import module_version

    from . import e2e, harness, runner

    harness.require_cuda()
    if suite == "e2e":
        return e2e.run_e2e(e2e.E2EConfig(), progress=log)
    checks: List[str] = []
    if suite == "attention":
        from .attention_report import cross_check
        checks = cross_check()
        for line in checks:
            log(line)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ceilings = harness.measure_ceilings()
    versions = {"specattn": specattn.__version__, "torch": torch.__version__,
                "triton": module_version("triton"), "cuda": torch.version.cuda}
    if suite == "attention":
        versions.update(flashinfer=module_version("flashinfer"), flash_mla=module_version("flash_mla"))
    raw = {"device": runner.device_summary(), "versions": versions, "timestamp": stamp,
           "settings": {"iters": iters, "warmup": warmup, "use_graph": True, "flush_l2": "auto"},
           "ceilings": asdict(ceilings), "cases": [], "errors": []}
    for case, params, kw in suite_points(suite):
        kw = {"iters": iters, "warmup": warmup, **kw}
        try:
            res = runner.run_case(case, params, ceilings, **kw)
            raw["cases"].append(res)
            log(f"{case} {params}: {res['median_us']:.1f} us [{res['mode']}]")
        except Exception as e:  # one failing impl (e.g. no CUDA extension) must not stop the rest
            raw["errors"].append({"case": case, "params": params, "error": f"{type(e).__name__}: {e}"})
            log(f"{case} {params}: FAILED {type(e).__name__}: {e}")
            log(traceback.format_exc(limit=2))
            gc.collect()
            torch.cuda.empty_cache()
    return make_report(suite, [raw], commit=e2e.git_commit(), checks=checks)


# ----------------------------------------------------------------------------- output
def _f(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(report: Dict[str, Any]) -> str:
    """The suite JSON as markdown: a header (device, date, commit, versions, ceilings), one
    table row per JSON row, then the targets, errors and cross-check lines."""
    if report["suite"] == "e2e":
        from .e2e import markdown as e2e_markdown
        return e2e_markdown(report)
    info, dev, ceil = SUITE_INFO[report["suite"]], report["device"], report["ceilings"]
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v)
    iters = sorted({r["iters"] for r in report["rows"] if r.get("iters")}) or ["?"]
    lines = [f"# {info.title}: {dev['name']}", "",
             f"{report['timestamp']}, commit `{(report.get('commit') or 'unknown')[:12]}`; {versions}.",
             f"Ceilings measured in the run: copy {ceil['copy_gbps']:.0f} GB/s, bf16 matmul "
             f"{ceil['matmul_tflops']:.0f} TFLOP/s.  Times in us: the median of "
             f"{' or '.join(map(str, iters))} timed calls per row (mode `graph`: CUDA-graph replays, "
             f"`eager`: eager calls; `+flush`: L2 flushed before each).  Speedup: the named row's "
             f"time over this row's, same point."]
    if report.get("ceilings_by_part"):
        lines += ["", "The parts of this run measured their own ceilings, and each row's "
                  "percentages are of its part's: " + "; ".join(
                      f"{', '.join(p['cases'])}: copy {p['copy_gbps']:.0f} GB/s, bf16 matmul "
                      f"{p['matmul_tflops']:.0f} TFLOP/s" for p in report["ceilings_by_part"]) + "."]
    if report.get("commit_note"):
        lines += ["", f"Commit: {report['commit_note']}."]
    lines += ["", "| case | point | impl | median us | p10-p90 us | GB/s | TFLOP/s | % roofline | "
              "speedup | mode |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        speed = ", ".join(f"{k} {v:.2f}x" for k, v in r["speedup"].items()) or "-"
        mode = ("graph" if r["mode"] == "cuda-graph" else r["mode"]) + ("+flush" if r.get("flush_l2") else "")
        spread = ("-" if r.get("p10_us") is None else f"{r['p10_us']:.1f}-{r['p90_us']:.1f}")
        lines.append(f"| {r['case']} | {r['point']} | {r['impl']} | {r['median_us']:.1f} | {spread} | "
                     f"{_f(r['gbps'], '.0f')} | {_f(r['tflops'], '.1f')} | {_f(r['pct_roofline'], '.1f')} | "
                     f"{speed} | {mode} |")
    sections = (("Targets", [f"- {t}" for t in targets(report)]),
                ("Errors", [f"- {e['case']} {e['params']}: {e['error']}" for e in report.get("errors", [])]),
                ("Notes", [f"- {r['case']} {r['point']} {r['impl']}: {r['note']}"
                           for r in report["rows"] if r.get("note")]),
                ("Cross-check (every implementation on the same inputs)",
                 [f"- {c}" for c in report.get("checks", [])]))
    for title, body in sections:
        if body:
            lines += ["", f"## {title}", "", *body]
    return "\n".join(lines) + "\n"


def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def render_png(report: Dict[str, Any], path: Path) -> bool:
    """The suite's plot: for ``attention``, time (log) and % of the roofline per point and
    implementation, one column per case; for ``spec_ops`` / ``kv_ops``, time (log) per point
    and implementation.  Returns False (nothing written) without matplotlib."""
    if report["suite"] == "e2e":
        from .e2e import render_png as e2e_png
        return e2e_png(report, path)
    plt = _plt()
    if plt is None:
        return False
    rows = report["rows"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = plt.get_cmap("tab10" if len(impls) <= 10 else "tab20")
    color = {impl: colors(i) for i, impl in enumerate(impls)}
    ops = list(dict.fromkeys(_op(r["case"]) for r in rows))
    title = (f"{SUITE_INFO[report['suite']].title}, {report['device']['name']} "
             f"({report['timestamp'][:10]}, commit {(report.get('commit') or '?')[:7]})")

    def bars(ax, op_rows, value, horizontal):
        points = list(dict.fromkeys(r["point"] for r in op_rows))
        here = list(dict.fromkeys(r["impl"] for r in op_rows))
        width = 0.8 / max(len(here), 1)
        for k, impl in enumerate(here):
            xs, ys = [], []
            for i, pt in enumerate(points):
                r = next((r for r in op_rows if r["point"] == pt and r["impl"] == impl), None)
                if r is not None and value(r) is not None:
                    xs.append(i + (k - (len(here) - 1) / 2) * width)
                    ys.append(value(r))
            (ax.barh if horizontal else ax.bar)(xs, ys, width, color=color[impl], label=impl)
            if horizontal:
                for x, y in zip(xs, ys):
                    ax.annotate(f"{y:.1f}", (y, x), xytext=(2, 0), textcoords="offset points",
                                va="center", fontsize=6)
        short = [pt.replace("seq_len=", "L=").replace("prefix=", "P=").replace("new_tokens=", "new=")
                 .replace("page_size=", "page=").replace("num_draft_tokens=", "tokens=") for pt in points]
        labels = short if horizontal else [pt.replace(" ", "\n") for pt in short]
        if horizontal:
            ax.set_yticks(range(len(points)), labels, fontsize=7)
            ax.invert_yaxis()
        else:
            ax.set_xticks(range(len(points)), labels, fontsize=6)

    if report["suite"] == "attention":
        fig, axes = plt.subplots(2, len(ops), figsize=(3.6 * len(ops), 7), squeeze=False)
        for j, op in enumerate(ops):
            op_rows = [r for r in rows if _op(r["case"]) == op]
            bars(axes[0][j], op_rows, lambda r: r["median_us"], False)
            times = [r["median_us"] for r in op_rows]
            if max(times) > 20 * min(times):
                axes[0][j].set_yscale("log")
            axes[0][j].set_title(op, fontsize=9)
            bars(axes[1][j], op_rows, lambda r: r["pct_roofline"], False)
            axes[1][j].set_ylim(0, 110)
        axes[0][0].set_ylabel("median us")
        axes[1][0].set_ylabel("% of roofline")
    else:
        from matplotlib.ticker import NullFormatter
        fig, axes = plt.subplots(len(ops), 1, figsize=(9, 1.5 + 0.22 * len(rows) + 0.3 * len(ops)),
                                 squeeze=False, height_ratios=[
                                     sum(_op(r["case"]) == op for r in rows) for op in ops])
        for j, op in enumerate(ops):
            ax = axes[j][0]
            bars(ax, [r for r in rows if _op(r["case"]) == op], lambda r: r["median_us"], True)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.margins(x=0.12)
            ax.set_title(op, fontsize=9)
        axes[-1][0].set_xlabel("median us (log)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[i]) for i in impls]
    fig.legend(handles, impls, loc="lower center", ncol=min(len(impls), 6), fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06 if len(impls) <= 6 else 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_results(report: Dict[str, Any], out_dir: Path) -> List[Path]:
    """``out_dir/<suite>.json`` + ``.md`` (+ ``.png`` where matplotlib is installed)."""
    if report["suite"] == "e2e":
        from .e2e import write_results as e2e_write
        return e2e_write(report, Path(out_dir))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = report["suite"]
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown(report))
    if render_png(report, out_dir / f"{name}.png"):
        paths.append(out_dir / f"{name}.png")
    return paths


def default_out(report: Dict[str, Any], root: Path = Path("bench/results")) -> Path:
    """``bench/results/<gpu>/`` for the report's device."""
    from .e2e import gpu_slug
    return Path(root) / gpu_slug(report["device"]["name"])


def check_results_file(path: Path) -> List[str]:
    """What is wrong with a committed suite JSON (not ``e2e``: tests/test_bench_e2e.py checks
    those): the schema, the markdown next to it, the PNG's presence.  Empty when fine."""
    path = Path(path)
    rep = json.loads(path.read_text())
    bad = [f"missing key {k!r}" for k in TOP_KEYS if k not in rep]
    if bad:
        return bad
    if rep["suite"] != path.stem:
        bad.append(f"suite {rep['suite']!r} in a file named {path.name}")
    if rep["suite"] not in SUITE_INFO:
        return bad + [f"unknown suite {rep['suite']!r}"]
    from .e2e import gpu_slug
    if gpu_slug(rep["device"].get("name", "")) != path.parent.name:
        bad.append(f"device {rep['device'].get('name')!r} in folder {path.parent.name}")
    if not rep["commit"]:
        bad.append("no commit")
    for k in ("copy_gbps", "matmul_tflops"):
        if not (rep["ceilings"] or {}).get(k):
            bad.append(f"no ceiling {k}")
    if not rep["rows"]:
        bad.append("no rows")
    for i, r in enumerate(rep["rows"]):
        miss = [k for k in ROW_KEYS if k not in r]
        if miss:
            bad.append(f"row {i}: missing {miss}")
        elif r["case"] not in SUITE_INFO[rep["suite"]].cases or not r["median_us"] > 0:
            bad.append(f"row {i}: case {r['case']!r}, median {r['median_us']}")
    md = path.with_suffix(".md")
    if not md.is_file() or md.read_text() != markdown(rep):
        bad.append(f"{md.name} is not what the suite's markdown writer makes of {path.name}")
    if not path.with_suffix(".png").is_file():
        bad.append(f"no {path.with_suffix('.png').name}")
    return bad
