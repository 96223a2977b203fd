"""End to end on the real model, side by side: algorithms x attention backends x dtypes.

    python3 bench/scripts/runtime_matrix.py --out DIR [--backends torch_reference triton]
        [--dtypes float32 bfloat16] [--algos none eagle_chain eagle_tree dflash]
        [--repeats 3] [--max-new-tokens 64] [--budget-s 270] [--device cuda] [--page-size 1 ..]

Each configuration is what ``specattn generate --prompts bench/prompts.txt --json`` runs (the
same engine, :func:`~specattn.spec_runtime.cli.engine_for`; the same warm-up and report,
:func:`~specattn.spec_runtime.cli.measured_generate` / ``report_dict``), in one process so the
model is loaded once per dtype: CUDA graphs on (on cuda), one untimed warm-up generation of the
same prompts (Triton JIT compiles, lazy init), then ``--repeats`` measured runs; tokens/s is
their median (every run in ``tokens_per_s_runs``).  Writes, after every configuration (a
timeout keeps what is done):

- ``DIR/generate.json``: every report (outputs included) plus ``same_tokens_as_none`` (the
  output equals target-only decoding on the same backend and dtype: lossless, expected in
  float32) and ``same_tokens_as_reference`` (equals ``torch_reference`` for the same algo
  and dtype); for bf16 / fp16 ``near_greedy``: every emitted token measured against the
  float32 greedy choice on its own context, up to the precision's near-ties
  (:mod:`specattn.spec_runtime.near_greedy`: the float32 model over the same rounded
  weights, teacher-forced; ``max_ratio <= 1`` and ``vocab_share <= 0.1`` pass), the
  low-precision counterpart of "= none", which bf16 runs do not meet token for token;
- ``DIR/generate_summary.md``: one table.

A configuration that fails (e.g. a backend without a mode: ``UnsupportedError``) is recorded
with its error and the others go on.  ``--budget-s``: configurations not started within
that many seconds are recorded as skipped.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ALGOS = {  # name -> SpecConfig fields (as README's end-to-end table)
    "none": dict(algo="none"),
    "eagle_chain": dict(algo="eagle", topk=1, num_steps=3, num_draft_tokens=4, draft_layers=24),
    "eagle_tree": dict(algo="eagle", topk=4, num_steps=4, num_draft_tokens=12, draft_layers=24),
    "dflash": dict(algo="dflash", block_size=16),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


NEAR_GREEDY_MAX_SHARE = 0.1  # as tests/test_runtime_lowp.py


def near_greedy_cell(ng) -> str:
    """The table cell of a report's ``near_greedy`` dict: ``-`` (float32, not measured),
    ``yes (r)`` or ``**no** (r)`` with ``r`` the worst token's gap / tolerance ratio."""
    if not ng:
        return "-"
    ok = ng["max_ratio"] <= 1.0 and ng["vocab_share"] <= NEAR_GREEDY_MAX_SHARE
    return f"{'yes' if ok else '**no**'} ({ng['max_ratio']:.2f})"


def _row(r: dict) -> str:
    if "error" in r:
        return (f"| {r['dtype']} | {r['name']} | {r['backend']} | {r['error'].splitlines()[0][:90]} "
                f"| | | | | | | |")
    runs = r["tokens_per_s_runs"]
    flag = {True: "yes", False: "**no**", None: "-"}
    backend = r["target_backend"] + (f" (page {r['page_size']})" if r.get("page_size", 1) != 1 else "")
    routed = f"; routed: {', '.join(r['mode_routed'])}" if r.get("mode_routed") else ""
    return (f"| {r['dtype']} | {r['name']} | {backend} | {r['tokens_per_s']:.1f} "
            f"| {min(runs):.1f}-{max(runs):.1f} | {r['mean_accept_length']:.2f} | {r['target_forwards']} "
            f"| {flag[r['same_tokens_as_none']]} | {flag[r['same_tokens_as_reference']]} "
            f"| {near_greedy_cell(r.get('near_greedy'))} "
            f"| {'on' if r['cuda_graph'] else 'off'}{' (eager: ' + ', '.join(r['eager_routed']) + ')' if r['eager_routed'] else ''}{routed} |")


def compare(reports: list) -> None:
    """Set every report's ``same_tokens_as_none`` / ``same_tokens_as_reference`` from the
    reports present, whatever order they ran in (None where the counterpart is missing)."""
    def toks(x):
        return [o["tokens"] for o in x["outputs"]]

    ok = [x for x in reports if "error" not in x]
    for r in ok:
        none = next((x for x in ok if x["backend"] == r["backend"] and x["dtype"] == r["dtype"]
                     and x["name"] == "none"), None)
        ref = next((x for x in ok if x["backend"] == "torch_reference" and x["dtype"] == r["dtype"]
                    and x["name"] == r["name"]), None)
        r["same_tokens_as_none"] = toks(none) == toks(r) if none is not None and r["name"] != "none" else None
        r["same_tokens_as_reference"] = (toks(ref) == toks(r) if ref is not None
                                         and r["backend"] != "torch_reference" else None)


def write(out: Path, reports: list, meta: dict) -> None:
    compare(reports)
    (out / "generate.json").write_text(json.dumps({"meta": meta, "runs": reports}, indent=1))
    lines = [f"# End to end: {meta['model']}, {meta['prompts']} prompts x {meta['max_new_tokens']} new tokens, "
             f"batch {meta['prompts']}, {meta['device_name']}",
             "",
             f"tokens/s: median of {meta['repeats']} measured runs "
             f"{'after one untimed warm-up run' if meta['warmup'] else '(no warm-up)'} (range: min-max); accept: mean tokens per target verify; = none: same tokens as target-only "
             f"decoding on the same backend and dtype (lossless); = ref: same tokens as torch_reference "
             f"(same algo, dtype); near-greedy (bf16/fp16): every token the float32 greedy choice up to "
             f"the precision's near-ties (worst gap / tolerance in brackets, <= 1 passes), the "
             f"low-precision form of lossless.  Spec ops: impl=auto.",
             "",
             "| dtype | algo | backend | tokens/s | range | accept | target fwd | = none | = ref | near-greedy | graphs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row(r) for r in reports]
    (out / "generate_summary.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--backends", nargs="+", default=["torch_reference", "triton"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=list(ALGOS))
    ap.add_argument("--prompts", type=Path, default=Path("bench/prompts.txt"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--no-near-greedy", action="store_true",
                    help="skip the bf16/fp16 near-greedy measure (a float32 copy of the model)")
    ap.add_argument("--page-size", type=int, nargs="+", default=[1],
                    help="KV page size per backend, in --backends order (one value: all); FlashMLA needs 64")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.max_new_tokens < 1:
        ap.error("--repeats and --max-new-tokens must be >= 1")
    if len(a.page_size) not in (1, len(a.backends)):
        ap.error("--page-size: one value, or one per backend")
    page_of = dict(zip(a.backends, a.page_size * len(a.backends) if len(a.page_size) == 1 else a.page_size))

    from specattn.spec_runtime import loader
    from specattn.spec_runtime.cli import engine_for, load_model, measured_generate, report_dict
    from specattn.spec_runtime.engine import SpecConfig
    from specattn.spec_runtime.model import LlamaModel
    from specattn.spec_runtime.model_fetch import fetch_model
    from specattn.spec_runtime.near_greedy import near_greedy
    from specattn.spec_runtime.sampling import SamplingParams

    a.out.mkdir(parents=True, exist_ok=True)
    texts = [l for l in a.prompts.read_text().splitlines() if l.strip()]
    dev = torch.empty(0, device=a.device).device
    meta = {"model": fetch_model().name, "prompts": len(texts), "max_new_tokens": a.max_new_tokens,
            "repeats": a.repeats, "warmup": not a.no_warmup, "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    t_start = time.perf_counter()
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    reports = []
    for dtype in a.dtypes:
        cfg, w, tok = load_model(None, DTYPES[dtype])
        ids = [loader.apply_chat_template(tok, t) for t in texts]
        oracle = None  # (float32 model, run-dtype model) over the same rounded weights
        if DTYPES[dtype] != torch.float32 and not a.no_near_greedy:
            low = {k: v.to(DTYPES[dtype]) for k, v in w.items()}
            oracle = (LlamaModel(cfg, {k: v.float() for k, v in low.items()}, dev, torch.float32),
                      LlamaModel(cfg, low, dev, DTYPES[dtype]))
        for name in a.algos:
            for backend in a.backends:
                base = {"name": name, "backend": backend, "dtype": dtype}
                if a.budget_s is not None and time.perf_counter() - t_start > a.budget_s:
                    reports.append({**base, "error": f"skipped: past the {a.budget_s:.0f} s budget"})
                    write(a.out, reports, meta)
                    continue
                t0 = time.perf_counter()
                eng = None
                try:
                    spec = SpecConfig(**ALGOS[name])
                    eng = engine_for(cfg, dict(w), ids, spec, backend=backend, device=str(dev),
                                     dtype=DTYPES[dtype], max_new_tokens=a.max_new_tokens,
                                     page_size=page_of[backend])
                    setup_s = time.perf_counter() - t0
                    res, warm_s = measured_generate(eng, ids, params, warmup=not a.no_warmup)
                    runs, stable = [res], True
                    for _ in range(a.repeats - 1):
                        runs.append(eng.generate(ids, params))
                        stable &= runs[-1].tokens == res.tokens
                    r = report_dict(eng, res, warm_s, texts=texts, tok=tok, backend=backend, dtype=dtype,
                                    **{k: getattr(spec, k) for k in ("algo", "topk", "num_steps",
                                                                     "num_draft_tokens", "block_size")})
                    tps = [x.num_tokens / x.seconds for x in runs]
                    r.update(base, tokens_per_s=statistics.median(tps), tokens_per_s_runs=tps,
                             seconds_runs=[x.seconds for x in runs], same_tokens_every_run=stable,
                             setup_seconds=setup_s)
                    toks = [o["tokens"] for o in r["outputs"]]
                    if oracle is not None:
                        r["near_greedy"] = dataclasses.asdict(near_greedy(*oracle, ids, toks))
                    print(f"{dtype:>9} {name:>12} {backend:>16}: {r['tokens_per_s']:7.1f} tok/s "
                          f"(runs {', '.join(f'{x:.1f}' for x in tps)}), accept {r['mean_accept_length']:.2f}, "
                          f"setup {setup_s:.1f} s, warm-up {warm_s or 0:.1f} s"
                          f"{', near-greedy ' + near_greedy_cell(r['near_greedy']) if oracle else ''}", flush=True)
                except Exception as e:  # record and go on
                    traceback.print_exc()
                    reports.append({**base, "error": f"{type(e).__name__}: {e}"})
                    print(f"{dtype:>9} {name:>12} {backend:>16}: FAILED {type(e).__name__}: {e}", flush=True)
                else:
                    reports.append(r)
                finally:
                    del eng
                    gc.collect()
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                write(a.out, reports, meta)
        del w, oracle
    meta["seconds"] = time.perf_counter() - t_start
    write(a.out, reports, meta)
    return 1 if any("error" in r and not r["error"].startswith("skipped") for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
