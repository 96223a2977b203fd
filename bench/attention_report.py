"""The attention benchmark in one process: every tracked point for every impl,
side by side, with % of roofline and speedups against the library rows.

``python -m specattn.bench.attention_report OUTDIR [--iters N] [--only CASE ...]
[--no-check] [--page-size N]`` (what ``bench/scripts/gpu_attention.sh`` runs) measures the
harness ceilings once, runs every ``(case, params)`` of :data:`TRACKED_POINTS` (the fp8 KV
points of :func:`fp8_points` among them; FlashInfer's tree-verify split twice: with
``fi_backend="fa2"`` and with FlashInfer's default,
:data:`SPLIT_EXTRA_BACKENDS`; with ``--page-size``, the tree-verify points on pages of ``N``
slots: :func:`with_page_size`) through :func:`specattn.bench.runner.run_case` (a failing
point is recorded with its error and the rest still run), and writes into ``OUTDIR``:

- ``attention_<case>.json`` per case, in :func:`specattn.bench.runner.build_report`'s layout
  plus ``"errors": [{"params", "error"}]``;
- ``attention_summary.md`` (rewritten after every point, so a run cut short still has
  one): one markdown table (case, point, impl, median us, GB/s, TFLOP/s, % copy BW,
  % matmul, % roofline = the larger of the two, speedup against each FlashInfer / FlashMLA
  row of the same point, timing mode), the tracked targets, errors, and the correctness
  cross-check (:func:`cross_check`, run first: every impl of one small tree-verify input and
  one MLA decode input against the torch reference backend and against each other, max abs
  differences; it also pays the FlashInfer JIT compiles).

Everything except the run itself (:func:`summary_rows`, :func:`render_markdown`,
:func:`bar_lines`) is pure Python and runs anywhere.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import time
import traceback
from collections import OrderedDict
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .cases import get_case
from .cases_attention import IMPLS, LIBRARIES

Point = Tuple[str, Dict[str, Any]]

TREE_POINTS = ((1, 4096), (16, 2048), (64, 4096), (16, 16384))

MLA_HEADS = (16, 32, 64, 128)
"""MLA decode's head counts against FlashMLA: DeepSeek-V3's 128 and its shards under tensor
parallelism 2 / 4 / 8."""
MLA_CHAINS = (2, 4, 8)
"""Chain verify (MTP drafts, ``s_q`` tokens a request) against FlashMLA's causal decode, at 16
and 128 heads, bs 16 and 64, prefix 4096."""
MLA_HEAD_POINTS = tuple((bs, seq_len) for bs in (1, 16, 64, 128) for seq_len in (1024, 4096, 8192))
"""``(bs, seq_len)`` of the head-count sweep: Triton and FlashMLA at every point of every
head count of :data:`MLA_HEADS`."""

SPLIT_EXTRA_BACKENDS = ("auto",)
"""FlashInfer backends the tree-verify split is also timed with, after the case's default
(``fi_backend="fa2"``, what SGLang passes): ``"auto"`` is FlashInfer's own default (fa3 for
the prefix part on Hopper).  Published split figures for these points match it at the two
large points; fa2 is faster at page 1.  Such a row is
labelled ``flashinfer_split[auto]`` (:func:`impl_label`)."""


def _points() -> List[Point]:
    pts: List[Point] = []
    for bs, prefix in TREE_POINTS:
        for impl in IMPLS["tree_verify"]:
            pts.append(("tree_verify", dict(bs=bs, prefix=prefix, impl=impl)))
            if impl == "flashinfer_split":
                pts += [("tree_verify", dict(bs=bs, prefix=prefix, impl=impl, fi_backend=b))
                        for b in SPLIT_EXTRA_BACKENDS]
    for impl in IMPLS["mla_decode"]:
        pts.append(("mla_decode", dict(bs=128, seq_len=8192, impl=impl)))
    for heads in MLA_HEADS:
        for bs, seq_len in MLA_HEAD_POINTS:
            if (heads, bs, seq_len) != (128, 128, 8192):   # every impl above
                pts += [("mla_decode", dict(bs=bs, seq_len=seq_len, num_heads=heads, impl=impl))
                        for impl in ("triton", "flashmla")]
    for bs in (1, 16):
        for impl in IMPLS["mla_tree_verify"]:
            if impl != "flashmla":   # chains only
                pts.append(("mla_tree_verify", dict(bs=bs, prefix=4096, impl=impl)))
        for impl in ("triton", "triton_generic"):
            pts.append(("mla_tree_verify", dict(bs=bs, prefix=4096, num_heads=16, impl=impl)))
    for heads in (16, 128):
        for bs in (16, 64):
            for s_q in MLA_CHAINS:
                pts += [("mla_tree_verify", dict(bs=bs, prefix=4096, num_heads=heads, topk=1,
                                                 num_steps=s_q - 1, num_draft_tokens=s_q, impl=impl))
                        for impl in ("triton", "flashmla")]
    for bs in (1, 32, 128):
        for seq_len in (1024, 8192):
            for impl in IMPLS["decode"]:
                pts.append(("decode", dict(bs=bs, seq_len=seq_len, impl=impl)))
    for prefix in (0, 4096):
        for impl in IMPLS["extend"]:
            pts.append(("extend", dict(bs=1, prefix=prefix, new_tokens=2048, impl=impl)))
    pts += fp8_points()
    return pts


FP8 = "fp8_e4m3"


def fp8_points() -> List[Point]:
    """The fp8 (e4m3) KV-cache points: every decode and tree-verify point on Triton and
    FlashInfer (its fa2 kernels read fp8 with bf16 queries: the decode wrapper and the
    split), the MLA ones on Triton (no library has fp8 MLA tree verify; FlashMLA's dense
    decode takes a bf16 latent only).  Each pairs with the bf16 point of the same parameters
    (:func:`fp8_lines`)."""
    pts: List[Point] = []
    for bs, prefix in TREE_POINTS:
        for impl in ("triton", "flashinfer_split"):
            pts.append(("tree_verify", dict(bs=bs, prefix=prefix, impl=impl, kv_dtype=FP8)))
    pts.append(("mla_decode", dict(bs=128, seq_len=8192, impl="triton", kv_dtype=FP8)))
    for bs in (1, 16):
        pts.append(("mla_tree_verify", dict(bs=bs, prefix=4096, impl="triton", kv_dtype=FP8)))
    for bs in (1, 32, 128):
        for seq_len in (1024, 8192):
            for impl in IMPLS["decode"]:
                pts.append(("decode", dict(bs=bs, seq_len=seq_len, impl=impl, kv_dtype=FP8)))
    return pts


TRACKED_POINTS: List[Point] = _points()
"""Every tracked (case, overrides), library impls included."""


def with_page_size(points: Sequence[Point], page_size: Optional[int]) -> List[Point]:
    """``points`` with ``page_size`` set on the tree-verify ones (None: unchanged; the tracked
    points use the case default, page 1).  Their label then names the page size.  Raises
    ValueError for a page size < 1 or one that does not divide every tree-verify prefix
    (FlashInfer's split needs whole pages of prefix)."""
    if page_size is None:
        return list(points)
    if page_size < 1 or any(p[0] == "tree_verify" and p[1]["prefix"] % page_size for p in points):
        raise ValueError(f"page size {page_size} must be >= 1 and divide every tree-verify prefix")
    return [(n, dict(p, page_size=page_size) if n == "tree_verify" else p) for n, p in points]


# ----------------------------------------------------------------------------- summary
def _point_key(row: Dict[str, Any]) -> Tuple[str, Tuple]:
    params = {k: v for k, v in row["params"].items() if k not in ("impl", "fi_backend")}
    return row["name"], tuple(sorted(params.items(), key=lambda kv: kv[0]))


def impl_label(name: str, params: Dict[str, Any]) -> str:
    """A row's impl as the summary names it: ``params["impl"]``, with ``[backend]`` appended
    for a library impl run with a FlashInfer backend other than case ``name``'s default
    (``flashinfer_split[auto]``).  ``fi_backend`` is not part of the point (it only changes
    the FlashInfer rows), so such a row is one more library row of the same point."""
    impl = str(params.get("impl"))
    fb = params.get("fi_backend")
    if impl in LIBRARIES and fb is not None and fb != get_case(name).params.get("fi_backend"):
        return f"{impl}[{fb}]"
    return impl


def point_label(name: str, params: Dict[str, Any]) -> str:
    keys = {"tree_verify": ("bs", "prefix", "page_size"), "mla_tree_verify": ("bs", "prefix"),
            "mla_decode": ("bs", "seq_len"), "decode": ("bs", "seq_len"),
            "extend": ("bs", "prefix", "new_tokens")}.get(name, ())
    label = " ".join(f"{k}={params[k]}" for k in keys if k in params)
    if name == "mla_tree_verify" and params.get("topk") == 1:
        label += f" chain={params['num_draft_tokens']}"
    if name.startswith("mla") and params.get("num_heads", 128) != 128:
        label += f" heads={params['num_heads']}"
    return label + (" kv=fp8" if params.get("kv_dtype", "auto") != "auto" else "")


def pct_roofline(row: Dict[str, Any]) -> Optional[float]:
    """The larger of ``pct_copy_bw`` and ``pct_matmul`` (None when both are None): the
    roofline time ``max(bytes / BW, flops / peak)`` over the measured time, in percent."""
    vals = [v for v in (row.get("pct_copy_bw"), row.get("pct_matmul")) if v is not None]
    return max(vals) if vals else None


def summary_rows(results: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per result (``runner.run_case`` dicts with ``params["impl"]``), in input
    order, with ``point`` (label), ``params`` (the result's, less ``impl``), ``impl``
    (:func:`impl_label`), ``pct_roofline`` and ``speedup``: for a row whose impl is not a
    library impl, ``{library_label: library_time / row_time}`` over the library rows of the
    same case and parameters (``fi_backend`` aside; empty for library rows)."""
    by_point: Dict[Tuple, List[Dict[str, Any]]] = OrderedDict()
    for r in results:
        by_point.setdefault(_point_key(r), []).append(r)
    rows = []
    for r in results:
        impl = r["params"].get("impl")
        speed = {}
        if impl not in LIBRARIES:
            for o in by_point[_point_key(r)]:
                oi = o["params"].get("impl")
                if oi in LIBRARIES and o["median_us"] > 0:
                    speed[impl_label(o["name"], o["params"])] = o["median_us"] / r["median_us"]
        rows.append(dict(case=r["name"], point=point_label(r["name"], r["params"]),
                         params={k: v for k, v in r["params"].items() if k != "impl"},
                         impl=impl_label(r["name"], r["params"]),
                         median_us=r["median_us"], gbps=r.get("gbps"), tflops=r.get("tflops"),
                         pct_copy_bw=r.get("pct_copy_bw"), pct_matmul=r.get("pct_matmul"),
                         pct_roofline=pct_roofline(r), speedup=speed, mode=r.get("mode", ""),
                         flush_l2=r.get("flush_l2", False), note=r.get("note", "")))
    return rows


def _f(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render_markdown(rows: Sequence[Dict[str, Any]], title: str = "") -> str:
    """``rows`` (:func:`summary_rows`) as a markdown table (rich's MARKDOWN box)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    t = Table(box=box.MARKDOWN, title=None, show_edge=True)
    for col, just in (("case", "left"), ("point", "left"), ("impl", "left"),
                      ("median us", "right"), ("GB/s", "right"), ("TFLOP/s", "right"),
                      ("% copy BW", "right"), ("% matmul", "right"), ("% roofline", "right"),
                      ("speedup vs library", "left"), ("mode", "left")):
        t.add_column(col, justify=just)
    for r in rows:
        speed = ", ".join(f"{k} {v:.2f}x" for k, v in r["speedup"].items()) or "-"
        mode = ("graph" if r["mode"] == "cuda-graph" else r["mode"]) + (
            "+flush" if r["flush_l2"] else "")
        t.add_row(r["case"], r["point"], str(r["impl"]), f"{r['median_us']:.1f}",
                  _f(r["gbps"], ".0f"), _f(r["tflops"], ".1f"), _f(r["pct_copy_bw"], ".1f"),
                  _f(r["pct_matmul"], ".1f"), _f(r["pct_roofline"], ".1f"), speed, mode)
    buf = io.StringIO()
    Console(file=buf, width=400, color_system=None, markup=False, highlight=False).print(t)
    text = "\n".join(line.rstrip() for line in buf.getvalue().splitlines() if line.strip())
    return (f"{title}\n\n" if title else "") + text + "\n"


FP8_SPEEDUP_BARS = {("decode", "seq_len", 8192): 1.5, ("tree_verify", "prefix", 16384): 1.5}
"""Where bf16 is memory-bound, the fp8 cache must pay: ``(case, param, value) -> min speedup``
over bf16 (elsewhere fp8 must not be slower: 1.0)."""


def fp8_lines(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """One line per fp8 row of :func:`summary_rows`: its time against the bf16 row of the same
    case, parameters and impl (the default ``triton`` impl picks the Gluon kernels for bf16
    where they run, the portable ones for fp8), with the bar (:data:`FP8_SPEEDUP_BARS`, else
    >= 1.0x: never slower)."""
    def key(r, kv):
        p = {k: v for k, v in r["params"].items() if k not in ("kv_dtype",)}
        return r["case"], r["impl"], kv, tuple(sorted(p.items()))
    bf16 = {key(r, "auto"): r for r in rows if r["params"].get("kv_dtype", "auto") == "auto"}
    out = []
    for r in rows:
        if r["params"].get("kv_dtype", "auto") == "auto":
            continue
        b = bf16.get(key(r, "auto"))
        if b is None or r["median_us"] <= 0:
            continue
        x = b["median_us"] / r["median_us"]
        need = next((v for (c, k, val), v in FP8_SPEEDUP_BARS.items()
                     if c == r["case"] and r["params"].get(k) == val), 1.0)
        out.append(f"{r['case']} {r['point']}: {r['impl']} {r['median_us']:.1f} us, {x:.2f}x "
                   f"the bf16 cache's {b['median_us']:.1f} us ({'meets' if x >= need else 'MISSES'} "
                   f">= {need}x)")
    return out


def bar_lines(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """The tracked targets, one line each, for the rows present: Triton tree verify <= 40 us at
    bs=1 / >= 3x faster than the FlashInfer custom mask and >= 1.5x faster than the split at
    the larger points (one line per split row: ``flashinfer_split`` with fa2, and each of
    :data:`SPLIT_EXTRA_BACKENDS`); Triton MLA decode (each variant) within 1.5x of
    FlashMLA; the fp8 cache against bf16 (:func:`fp8_lines`)."""
    out = []
    for r in rows:
        if r["params"].get("kv_dtype", "auto") != "auto":
            continue    # (fp8_lines)
        if not str(r["impl"]).startswith("triton"):  # triton and its variants (triton_tma, triton_sm90)
            continue
        if r["case"] == "tree_verify":
            p = r.get("params", {})
            if (p.get("bs"), p.get("prefix")) == (1, 4096):  # whatever the page size
                ok = r["median_us"] <= 40.0
                out.append(f"tree_verify {r['point']}: {r['impl']} {r['median_us']:.1f} us "
                           f"({'meets' if ok else 'MISSES'} <= 40 us)")
            else:
                for lib, x in r["speedup"].items():
                    if lib == "flashinfer_mask":
                        need = 3.0
                    elif lib.startswith("flashinfer_split"):  # the split, any backend
                        need = 1.5
                    else:
                        continue
                    out.append(f"tree_verify {r['point']}: {r['impl']} {x:.2f}x vs {lib} "
                               f"({'meets' if x >= need else 'MISSES'} >= {need}x)")
        elif r["case"] in ("mla_decode", "mla_tree_verify") and "flashmla" in r["speedup"]:
            x = r["speedup"]["flashmla"]
            decode = r["case"] == "mla_decode"   # the 1.5x bar is MLA decode's
            out.append(f"{r['case']} {r['point']}: {r['impl']} {r['median_us']:.1f} us = "
                       f"{1 / x:.2f}x FlashMLA's time ("
                       + (f"{'meets' if 1 / x <= 1.5 else 'MISSES'} <= 1.5x; " if decode else "")
                       + f"{'meets' if 1 / x <= 1.0 else 'MISSES'} <= 1.0x at every head count)")
    return out + fp8_lines(rows)


# ----------------------------------------------------------------------------- GPU run
def cross_check(device: str = "cuda") -> List[str]:
    """Every impl of one small tree-verify input (bs 4, prefix 1000, 64 draft tokens, bf16),
    one MLA decode input (bs 4, 1000 keys, page 64) and one GQA decode input over an fp8 cache
    (bs 4, 1000 keys; the reference reads it dequantized) on the same inputs (same seed),
    against the torch reference backend and each other: one line per comparison with the
    max abs difference (an impl that fails says why)."""
    import torch

    from specattn.backends import TorchReferenceBackend

    lines = []
    for name, params in (("tree_verify", dict(bs=4, prefix=1000, input_sets=1)),
                         ("mla_decode", dict(bs=4, seq_len=1000, input_sets=1)),
                         ("decode", dict(bs=4, seq_len=1000, input_sets=1, kv_dtype=FP8))):
        outs, ref = {}, None
        for impl in IMPLS[name]:
            try:
                wl = get_case(name).build(device, impl=impl, **params)
                outs[impl] = wl.calls()[0]().float()
                if ref is None:
                    st = wl.state
                    be = TorchReferenceBackend(st["inputs"].req_pool, st["inputs"].kv_pool)
                    be.init_forward_metadata(st["batches"][0])
                    ref = be.forward(st["qs"][0], None, None, st["layer"], st["batches"][0],
                                     save_kv_cache=False).float()
                torch.cuda.synchronize()
                del wl
            except Exception as e:  # report and go on: one broken impl must not hide others
                lines.append(f"{name} impl={impl}: FAILED {type(e).__name__}: {e}")
        label = f"{name} ({', '.join(f'{k}={v}' for k, v in params.items())})"
        names = list(outs)
        for i, a in enumerate(names):
            if ref is not None:
                d = (outs[a] - ref).abs().max().item()
                lines.append(f"{label}: {a} vs torch reference: max abs diff {d:.3e}")
            for b in names[i + 1:]:
                d = (outs[a] - outs[b]).abs().max().item()
                lines.append(f"{label}: {a} vs {b}: max abs diff {d:.3e}")
        torch.cuda.empty_cache()
    return lines


def run_points(points: Sequence[Point], outdir: str, *, iters: int = 100, warmup: int = 3,
               log=print, check_lines: Sequence[str] = ()) -> Dict[str, Dict[str, Any]]:
    """Measure the ceilings once, run every point, write ``attention_<case>.json`` per case
    and ``attention_summary.md`` (with ``check_lines``) into ``outdir`` after every point;
    returns ``{case: report}``.  Raises RuntimeError without CUDA."""
    import torch

    import specattn
    from specattn.info import module_version

    from . import harness, runner

    harness.require_cuda()
    os.makedirs(outdir, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ceilings = harness.measure_ceilings()
    log(f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s, bf16 matmul "
        f"{ceilings.matmul_tflops:.0f} TFLOP/s")
    head = {"device": runner.device_summary(),
            "versions": {"specattn": specattn.__version__, "torch": torch.__version__,
                         "triton": module_version("triton"), "cuda": torch.version.cuda,
                         "flashinfer": module_version("flashinfer"),
                         "flash_mla": module_version("flash_mla")},
            "timestamp": stamp,
            "settings": {"iters": iters, "warmup": warmup, "use_graph": True,
                         "flush_l2": "auto"},
            "ceilings": asdict(ceilings)}
    reports: Dict[str, Dict[str, Any]] = OrderedDict()
    for name, params in points:
        rep = reports.setdefault(name, dict(head, cases=[], errors=[]))
        t0 = time.time()
        try:
            res = runner.run_case(name, dict(params), ceilings, iters=iters, warmup=warmup)
            rep["cases"].append(res)
            log(f"{name} {params}: {res['median_us']:.1f} us [{res['mode']}] "
                f"({time.time() - t0:.0f} s){'  NOTE ' + res['note'] if res['note'] else ''}")
        except Exception as e:
            rep["errors"].append({"params": params, "error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()[-4000:]})
            log(f"{name} {params}: FAILED {type(e).__name__}: {e}")
            torch.cuda.empty_cache()
        with open(os.path.join(outdir, f"attention_{name}.json"), "w") as f:
            json.dump(rep, f, indent=2)
            f.write("\n")
        write_summary(reports, os.path.join(outdir, "attention_summary.md"), check_lines)
    return reports


def write_summary(reports: Dict[str, Dict[str, Any]], path: str,
                  check_lines: Sequence[str] = ()) -> str:
    """Write the markdown summary of ``reports`` (:func:`run_points`) and the cross-check's
    ``check_lines`` to ``path``; returns its text."""
    results = [c for r in reports.values() for c in r["cases"]]
    rows = summary_rows(results)
    head = next(iter(reports.values()), {})
    dev, ceil = head.get("device", {}), head.get("ceilings", {})
    title = (f"# attention benchmark\n\n{dev.get('name', '?')}; ceilings: copy "
             f"{ceil.get('copy_gbps', 0):.0f} GB/s, bf16 matmul "
             f"{ceil.get('matmul_tflops', 0):.0f} TFLOP/s; versions "
             f"{head.get('versions', {})}; {head.get('timestamp', '')}")
    text = render_markdown(rows, title)
    bars = bar_lines(rows)
    errors = [f"- {n} {e['params']}: {e['error']}" for n, r in reports.items()
              for e in r.get("errors", [])]
    notes = [f"- {r['case']} {r['point']} {r['impl']}: {r['note']}" for r in rows if r["note"]]
    for header, lines in (("## bars", [f"- {b}" for b in bars]), ("## errors", errors),
                          ("## notes", notes),
                          ("## cross-check", [f"- {c}" for c in check_lines])):
        if lines:
            text += f"\n{header}\n\n" + "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line (module docstring).  Returns the exit code: 0, or 1 when a point or the
    cross-check failed."""
    ap = argparse.ArgumentParser(prog="python -m specattn.bench.attention_report",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--only", nargs="*", default=None, help="cases to run (default: all)")
    ap.add_argument("--no-check", action="store_true", help="skip the cross-check")
    ap.add_argument("--page-size", type=int, default=None,
                    help="run the tree-verify points on pages of N slots (default: 1)")
    args = ap.parse_args(argv)
    try:
        points = with_page_size(TRACKED_POINTS, args.page_size)
    except ValueError as e:
        ap.error(str(e))
    os.makedirs(args.outdir, exist_ok=True)
    lines: List[str] = []
    if not args.no_check:
        t0 = time.time()
        lines = cross_check()
        lines.append(f"(cross-check took {time.time() - t0:.0f} s, FlashInfer JIT included)")
        print("\n".join(lines), flush=True)
    pts = [p for p in points if not args.only or p[0] in args.only]
    reports = run_points(pts, args.outdir, iters=args.iters,
                         log=lambda s: print(s, flush=True), check_lines=lines)
    print(write_summary(reports, os.path.join(args.outdir, "attention_summary.md"), lines))
    failed = any("FAILED" in line for line in lines) or any(r["errors"] for r in reports.values())
    return 1 if failed else 0

if __name__ == "__main__":
    raise SystemExit(main())
