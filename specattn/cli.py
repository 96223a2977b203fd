"""The ``specattn`` command line: ``specattn info``, ``specattn bench`` (kernel cases, and
``specattn bench e2e``: the runtime end to end), ``specattn generate``, ``specattn model``,
``specattn drafter``.

Exit codes: 0 success; 2 bad usage, an unknown case or parameter, or no CUDA GPU for
``specattn bench`` (``specattn bench --list`` and ``specattn bench plot`` work anywhere).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import typer
from rich.console import Console
from typer.core import TyperGroup

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="specattn: attention kernels and backends for speculative decoding.")


class _CasesByDefault(TyperGroup):
    """``specattn bench ARGS``: ARGS not naming a subcommand go to ``bench cases`` (so
    ``specattn bench tree_build -p impl=torch`` and ``specattn bench --list`` work)."""

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["cases", *args]
        return super().parse_args(ctx, args)


bench_app = typer.Typer(cls=_CasesByDefault, add_completion=False,
                        help="Benchmarks: kernel cases (default), the runtime end to end (e2e).")
app.add_typer(bench_app, name="bench")

NO_GPU_MESSAGE = ("specattn bench: a CUDA GPU is needed to time cases "
                  "(torch.cuda.is_available() is False); `specattn bench --list` works anywhere.")


@app.command()
def info(as_json: bool = typer.Option(False, "--json", help="Print the report as JSON.")):
    """Versions, CUDA devices, and which backends and ops are available here (and why not)."""
    from specattn.info import collect_info, render_info

    data = collect_info()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        render_info(data, Console())


def parse_params(items: List[str]) -> Dict[str, Any]:
    """``["tokens=64", "dtype=float16"]`` -> ``{"tokens": 64, "dtype": "float16"}``: values
    are Python literals where they parse as one, else strings. Raises typer.BadParameter for
    an item without ``=``."""
    out: Dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--param")
        try:
            out[key.strip()] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key.strip()] = value
    return out


@bench_app.command("cases")
def bench(
    cases: Optional[List[str]] = typer.Argument(None, help="Case names (default: all)."),
    list_: bool = typer.Option(False, "--list", help="List the cases and exit."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the report here."),
    param: List[str] = typer.Option([], "--param", "-p",
                                    help="Override a case parameter, KEY=VALUE (repeatable)."),
    iters: int = typer.Option(100, min=50, help="Timed iterations per case (median taken)."),
    warmup: int = typer.Option(3, min=1, help="Warm-up calls per input set."),
    graph: bool = typer.Option(True, "--graph/--eager", help="Time CUDA-graph replays or eager calls."),
    flush_l2: Optional[bool] = typer.Option(
        None, "--flush-l2/--no-flush-l2",
        help="Flush L2 before each iteration (default: only if the input sets fit in 2x L2)."),
):
    """Time bench cases on the GPU against the measured copy-bandwidth and matmul ceilings."""
    from specattn.bench import runner
    from specattn.bench.cases import CASES, case_names

    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)  # piped / logged: don't squeeze the tables
    if list_:
        from rich.markup import escape
        from rich.table import Table
        t = Table(title="bench cases")
        for col in ("case", "description", "params"):
            t.add_column(col)
        for c in runner.list_cases():
            t.add_row(escape(c["name"]), escape(c["description"]),
                      escape(", ".join(f"{k}={v}" for k, v in c["params"].items())))
        console.print(t)
        return
    names = list(cases) if cases else case_names()
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise typer.BadParameter(f"unknown case(s) {unknown}; known: {case_names()}",
                                 param_hint="CASES")
    overrides = parse_params(param)
    for n in names:
        bad = sorted(set(overrides) - set(CASES[n].params))
        if bad:
            raise typer.BadParameter(f"case {n!r} has no parameter(s) {bad}; "
                                     f"it has {sorted(CASES[n].params)}", param_hint="--param")

    import torch
    if not torch.cuda.is_available():
        typer.echo(NO_GPU_MESSAGE, err=True)
        raise typer.Exit(code=2)

    report = runner.build_report(names, overrides, iters=iters, warmup=warmup, use_graph=graph,
                                 flush_l2=flush_l2)
    runner.render_report(report, console)
    if json_path is not None:
        runner.write_json(report, str(json_path))
        console.print(f"wrote {json_path}")


@bench_app.command("e2e")
def bench_e2e(
    out: Optional[Path] = typer.Option(None, help="Results folder (default bench/results/<gpu>/)."),
    algos: str = typer.Option("none,eagle_chain,eagle_tree,dflash", help="Comma-separated algorithms."),
    batch_sizes: str = typer.Option("1,4,16,64", "--bs", help="Comma-separated batch sizes."),
    backend: str = typer.Option("triton", help="Attention backend."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 | float16 | float32"),
    max_new_tokens: int = typer.Option(128, min=1),
    min_requests: int = typer.Option(4, min=1, help="Requests per batch size (batch 1: that many runs)."),
    chain: str = typer.Option("1,5,6", help="EAGLE chain: topk,num_steps,num_draft_tokens."),
    tree: str = typer.Option("4,5,16", help="EAGLE tree: topk,num_steps,num_draft_tokens."),
    block_size: int = typer.Option(16, min=2, help="DFlash block."),
    drafter: Optional[Path] = typer.Option(None, help="EAGLE-3 drafter folder (default: the shipped one)."),
    prompts: Optional[Path] = typer.Option(None, help="Prompt file (default: the eval set)."),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="Also time HF transformers' static-cache generate."),
    profile: bool = typer.Option(True, "--profile/--no-profile", help="Kernels and kernel time per step."),
    check: bool = typer.Option(True, "--check/--no-check", help="Check every output against target-only decoding."),
):
    """Time the main job on the real model: algo x batch size, one process, one GPU; write
    e2e.json, e2e.md (and e2e.png where matplotlib is installed)."""
    from specattn.bench import e2e

    def triple(text: str, name: str) -> dict:
        try:
            k, s_, d = (int(x) for x in text.split(","))
        except ValueError:
            raise typer.BadParameter(f"expected topk,num_steps,num_draft_tokens, got {text!r}", param_hint=name)
        return dict(topk=k, num_steps=s_, num_draft_tokens=d)

    try:
        sizes = [int(x) for x in batch_sizes.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {batch_sizes!r}", param_hint="--bs")
    names = [a.strip() for a in algos.split(",") if a.strip()]
    cfg = e2e.E2EConfig(algos=names, batch_sizes=sizes, backend=backend, dtype=dtype,
                        max_new_tokens=max_new_tokens, min_requests=min_requests,
                        chain=triple(chain, "--chain"), tree=triple(tree, "--tree"), block_size=block_size,
                        drafter=str(drafter) if drafter else None, prompts=str(prompts) if prompts else None,
                        peers=peers, profile=profile, check=check)
    for a in names:
        try:
            e2e.spec_fields(a, cfg)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--algos")
    if min(sizes, default=0) < 1:
        raise typer.BadParameter("batch sizes must be >= 1", param_hint="--bs")
    import torch
    if not torch.cuda.is_available():
        typer.echo(NO_GPU_MESSAGE, err=True)
        raise typer.Exit(code=2)
    console = Console(stderr=True)
    where = {}

    def save(report: dict) -> None:  # after every row: a stopped run keeps what it measured
        folder = out or Path("bench/results") / e2e.gpu_slug(report["device"]["name"])
        where["paths"] = e2e.write_results(report, folder)

    report = e2e.run_e2e(cfg, progress=lambda msg: console.print(f"[dim]{msg}[/]"), on_row=save)
    save(report)
    for p in where["paths"]:
        console.print(f"wrote {p}")
    typer.echo(e2e.markdown(report))


@bench_app.command("plot")
def bench_plot(results: Path = typer.Argument(..., help="A suite's JSON (e.g. bench/results/h100/e2e.json).")):
    """Redraw a suite's PNG from its JSON (needs matplotlib)."""
    from specattn.bench import e2e
    if not results.is_file():
        raise typer.BadParameter(f"no such file: {results}", param_hint="RESULTS")
    report = json.loads(results.read_text())
    if report.get("suite") != e2e.SUITE:
        raise typer.BadParameter(f"{results} is not an e2e results file", param_hint="RESULTS")
    png = results.with_suffix(".png")
    if not e2e.render_png(report, png):
        typer.echo("matplotlib is not installed: pip install matplotlib", err=True)
        raise typer.Exit(code=1)
    typer.echo(f"wrote {png}")


def _register_runtime() -> None:
    """The runtime's commands (imported lazily by typer only when run)."""
    from specattn.spec_runtime.cli import generate, model_app
    app.command("generate")(generate)
    app.add_typer(model_app, name="model")
    from specattn.spec_runtime.drafter_cli import drafter_app
    app.add_typer(drafter_app, name="drafter")


_register_runtime()


def main() -> None:
    """Console-script entry point (``specattn``)."""
    app()


if __name__ == "__main__":
    main()
