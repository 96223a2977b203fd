"""The ``specattn`` command line: ``specattn info`` and ``specattn bench``.

Exit codes: 0 success; 2 bad usage, an unknown case or parameter, or no CUDA GPU for
``specattn bench`` (``specattn bench --list`` works anywhere).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="specattn: attention kernels and backends for speculative decoding.")

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


@app.command()
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


def _register_runtime() -> None:
    """The runtime's commands (imported lazily by typer only when run)."""
    from specattn.spec_runtime.cli import generate, model_app
    app.command("generate")(generate)
    app.add_typer(model_app, name="model")


_register_runtime()


def main() -> None:
    """Console-script entry point (``specattn``)."""
    app()


if __name__ == "__main__":
    main()
