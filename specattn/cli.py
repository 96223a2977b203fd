"""The ``specattn`` command line: ``specattn info``, ``specattn bench`` (kernel cases, and
``specattn bench e2e``: the runtime end to end), ``specattn generate``, ``specattn model``,
``specattn drafter``.

Errors are one line on stderr: a mistake on the command line is ``specattn <command>: error:
...`` (exit status 2), anything else that goes wrong is ``specattn: error: <message>``
(exit status 1); ``specattn --debug <command>`` (or ``SPECATTN_DEBUG=1``) shows the full
traceback instead.

Exit codes: 0 success; 1 the command failed; 2 bad usage, an unknown case, parameter or
parameter value (checked by the case, before any GPU is looked for), or no CUDA GPU for
``specattn bench`` (``specattn bench --list`` and ``specattn bench plot`` work anywhere).

Importing this module imports neither ``specattn.bench`` nor the runtime's engine: the bench
commands import what they run.
"""
from __future__ import annotations

import ast
import errno
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import typer
import typer.core
from rich.console import Console
from typer.core import TyperGroup

PROG = "specattn"

# the click typer runs on: recent typer vendors its own copy (typer._click), older typer uses click
_click = getattr(typer.core, "_click", None) or typer.core.click
ClickException = _click.exceptions.ClickException
UsageError = _click.exceptions.UsageError
BadParameter = _click.exceptions.BadParameter
NoSuchOption = _click.exceptions.NoSuchOption
Exit = typer.Exit
Abort = typer.Abort


def one_line(text: str) -> str:
    """``text`` on one line (runs of whitespace, newlines included, become one space)."""
    return " ".join(str(text).split())


def usage_error_line(err: ClickException) -> str:
    """The one line a click usage error prints: ``specattn <command>: error: <message>``,
    with a pointer to ``--help`` for errors that are not about one value."""
    words, ctx = [], getattr(err, "ctx", None)
    while ctx is not None and ctx.parent is not None:  # the subcommands' names, not the program's
        words.insert(0, ctx.info_name)
        ctx = ctx.parent
    where = " ".join([PROG, *words])
    msg = one_line(err.format_message())
    if isinstance(err, NoSuchOption) and getattr(err, "option_name", None) == "--debug" and words:
        msg += f" (--debug goes before the command: {PROG} --debug {' '.join(words)} ...)"
    elif isinstance(err, UsageError) and not isinstance(err, BadParameter):
        msg += f" (see `{where} --help`)"
    return f"{where}: error: {msg}"


def unexpected_error_line(err: BaseException) -> str:
    """The one line an unexpected exception prints: ``specattn: error: <message> (<type>)``."""
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{PROG}: error: {text + ' ' if text else ''}({type(err).__name__}; {PROG} --debug shows the traceback)"


class CommandGroup(TyperGroup):
    """A specattn command group (every group of the CLI is one): a usage error about the
    arguments of its subcommand that click raised without a context -- its parser's ``Option
    '--x' does not take a value.`` and ``Option '--x' requires an argument.`` have none --
    gets the subcommand's, so that :func:`usage_error_line` names the subcommand (``specattn
    drafter train: error: ...``) and not the bare program."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UsageError as e:
            name = ctx.invoked_subcommand   # set before the subcommand's arguments are parsed
            cmd = self.get_command(ctx, name) if e.ctx is None and name else None
            if cmd is not None:
                e.ctx, e.cmd = cmd.context_class(cmd, info_name=name, parent=ctx), cmd
            raise


class SpecattnGroup(CommandGroup):
    """The top-level command group: click's usage errors print one line (exit status 2)
    instead of a panel, and an exception a command did not handle prints one line (exit
    status 1) unless ``--debug`` is given."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (ClickException, Exit, Abort):
            raise
        except Exception as e:
            if ctx.params.get("debug") or (isinstance(e, OSError) and e.errno == errno.EPIPE):
                raise
            typer.echo(unexpected_error_line(e), err=True)
            raise Exit(1) from e

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=False, **extra)
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                              standalone_mode=False, **extra)
        except ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # a bare group: its help (typer may have shown it)
                if e.format_message().strip():
                    typer.echo(e.format_message(), err=True)
            else:
                typer.echo(usage_error_line(e), err=True)
            sys.exit(e.exit_code)
        except Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


app = typer.Typer(cls=SpecattnGroup, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_enable=False,
                  help="specattn: attention kernels and backends for speculative decoding.")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", envvar="SPECATTN_DEBUG",
                                     help="Show the full traceback of an error (also SPECATTN_DEBUG=1).")):
    """specattn: attention kernels and backends for speculative decoding."""


class _CasesByDefault(CommandGroup):
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
    if list_ and (cases or param or json_path is not None):
        raise typer.BadParameter("--list lists the cases and takes no case, --param or --json",
                                 param_hint="--list")
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
        try:   # the case's own check of its params: no GPU needed
            CASES[n].validate(**overrides)
        except (ValueError, TypeError) as err:
            raise typer.BadParameter(f"case {n!r}: {err}", param_hint="--param")
    if json_path is not None and (json_path.is_dir() or not json_path.absolute().parent.is_dir()):
        raise typer.BadParameter(f"cannot write a file at {json_path} (a folder, or no such folder)",
                                 param_hint="--json")

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


def _check_e2e_paths(out, prompts, drafter, dflash_drafter) -> None:
    """``bench e2e``'s paths, before the model loads."""
    from specattn.spec_runtime.cli import is_dflash_dir, is_eagle3_dir, out_dir_problem
    why = out_dir_problem(out)
    if why:
        raise typer.BadParameter(why, param_hint="--out")
    if prompts is not None:
        if not prompts.is_file():
            raise typer.BadParameter(f"no such file: {prompts}", param_hint="--prompts")
        if not any(line.strip() for line in prompts.read_text().splitlines()):
            raise typer.BadParameter(f"{prompts} holds no prompt", param_hint="--prompts")
    for flag, path, is_kind, kind in (("--drafter", drafter, is_eagle3_dir, "an EAGLE-3"),
                                      ("--dflash-drafter", dflash_drafter, is_dflash_dir, "a DFlash")):
        if path is not None and not is_kind(path):
            raise typer.BadParameter(f"{path} does not hold {kind} drafter (a folder whose config.json "
                                     f"names its architecture)", param_hint=flag)


@bench_app.command("e2e")
def bench_e2e(
    out: Optional[Path] = typer.Option(None, help="Results folder (default bench/results/<gpu>/)."),
    algos: str = typer.Option("none,eagle_chain,eagle_tree,dflash,ddtree,ngram",
                              help="Comma-separated algorithms on the chat prompts."),
    repetitive_algos: str = typer.Option("none,ngram", help="Comma-separated algorithms on the copy-heavy "
                                                           "prompt set ('' skips it)."),
    batch_sizes: str = typer.Option("1,4,16,64", "--bs", help="Comma-separated batch sizes."),
    backend: str = typer.Option("triton", help="Attention backend."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 | float16 | float32"),
    max_new_tokens: int = typer.Option(128, min=1, help="Most tokens a request generates."),
    stop_at_eos: bool = typer.Option(True, "--stop-at-eos/--ignore-eos",
                                     help="End a request at the model's end-of-turn token (as served), "
                                          "or run every request the full max-new-tokens."),
    min_requests: int = typer.Option(64, min=1, help="At least this many requests per batch size (batch 1: "
                                                    "that many runs; 64: every chat prompt once)."),
    requests_per_row: int = typer.Option(8, min=1, help="At least this many requests per request row: "
                                                        "waiting ones take the rows of finished ones."),
    cycle_prompts: bool = typer.Option(True, "--cycle-prompts/--no-cycle-prompts",
                                       help="Repeat a prompt set shorter than a batch size's requests "
                                            "(else: fewer requests, and a batch size above the set skipped)."),
    min_free_slots: Optional[int] = typer.Option(None, min=1, help="Admission batching: prefill waiting requests "
                                                 "once this many rows are free (capped by the batch size; "
                                                 "default: the engine's, round(sqrt(bs)) - 1, at least 1)."),
    chain: str = typer.Option("1,5,6", help="EAGLE chain: topk,num_steps,num_draft_tokens."),
    tree: str = typer.Option("4,5,32", help="EAGLE tree: topk,num_steps,num_draft_tokens."),
    tree_by_batch: str = typer.Option("2:16,32:8", "--tree-by-batch",
                                      help="EAGLE tree: MIN_BATCH:TOKENS,... another num_draft_tokens for rounds "
                                           "over at least MIN_BATCH requests ('' keeps the tree's)."),
    block_size: int = typer.Option(16, min=2, help="DFlash block."),
    block_size_by_batch: str = typer.Option("", "--block-size-by-batch",
                                            help="DFlash chain: MIN_BATCH:BLOCK,... a smaller block for rounds "
                                                 "over at least MIN_BATCH requests ('' keeps --block-size)."),
    dflash_verify_by_batch: str = typer.Option("4:8,16:4", "--dflash-verify-by-batch",
                                               help="DFlash chain: MIN_BATCH:TOKENS,... verify only the block's "
                                                    "first TOKENS (root included) for rounds over at least "
                                                    "MIN_BATCH requests ('' verifies the whole block)."),
    ddtree: str = typer.Option("8,32", help="DDTree: topk,num_draft_tokens (DFlash drafts verified as a tree)."),
    ddtree_depth_decay: float = typer.Option(0.8, "--ddtree-depth-decay",
                                             help="DDTree: block position k's log-probabilities weigh "
                                                  "DECAY ** (k - 1) in a node's score (< 1 favours depth)."),
    ddtree_by_batch: str = typer.Option("2:16,32:8", "--ddtree-by-batch",
                                        help="DDTree: MIN_BATCH:TOKENS,... another num_draft_tokens for rounds "
                                             "over at least MIN_BATCH requests ('' keeps --ddtree's)."),
    ngram: str = typer.Option("4,4,4", help="N-gram: topk (chains),num_steps,ngram_size."),
    ngram_topk_by_batch: str = typer.Option("16:1", "--ngram-topk-by-batch",
                                            help="N-gram: MIN_BATCH:TOPK,... fewer chains (the best matches; 0: "
                                                 "none, a decode step) for rounds over at least MIN_BATCH requests "
                                                 "('' keeps --ngram's)."),
    drafter: Optional[Path] = typer.Option(None, help="EAGLE-3 drafter folder (default: the shipped one)."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", min=0,
                                              help="EAGLE-3 and DFlash: draft only from the N most frequent "
                                                   "tokens (FR-Spec); 0 = all.  Default: 16384 for a drafter "
                                                   "that ships token counts over a larger vocabulary, else all."),
    dflash_drafter: Optional[Path] = typer.Option(None, help="DFlash drafter folder (default: the shipped one)."),
    prompts: Optional[Path] = typer.Option(None, help="Prompt file (default: the eval set)."),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="Also time HF transformers' static-cache generate."),
    profile: bool = typer.Option(True, "--profile/--no-profile", help="Kernels and kernel time per step."),
    retime_below_busy: float = typer.Option(0.85, "--retime-below-busy", min=0.0, max=1.0,
                                            help="With --profile: time a row once more when the profiled "
                                                 "kernel time per round is under this fraction of its timed "
                                                 "round (a host stall), keeping the faster timing; 0 = never."),
    check: bool = typer.Option(True, "--check/--no-check", help="Check every output against target-only decoding."),
):
    """Time the main job on the real model: algo x batch size, one process, one GPU; write
    e2e.json, e2e.md (and e2e.png where matplotlib is installed)."""
    from specattn.bench import e2e

    def ints(text: str, name: str, fields) -> dict:
        try:
            vals = [int(x) for x in text.split(",")]
        except ValueError:
            vals = []
        if len(vals) != len(fields):
            raise typer.BadParameter(f"expected {','.join(fields)}, got {text!r}", param_hint=name)
        return dict(zip(fields, vals))

    def triple(text: str, name: str) -> dict:
        return ints(text, name, ("topk", "num_steps", "num_draft_tokens"))

    from specattn.spec_runtime.strategies import SpecConfig, parse_by_batch
    chain_cfg, tree_cfg = triple(chain, "--chain"), triple(tree, "--tree")
    ddtree_cfg = ints(ddtree, "--ddtree", ("topk", "num_draft_tokens"))
    ngram_cfg = ints(ngram, "--ngram", ("topk", "num_steps", "ngram_size"))
    if ddtree_cfg["topk"] < 2:
        raise typer.BadParameter(f"a DDTree's topk must be >= 2 (1 is the DFlash chain), got {ddtree_cfg['topk']}",
                                 param_hint="--ddtree")
    for flag, spec_of in (("--chain", lambda: SpecConfig("eagle", **chain_cfg)),
                          ("--tree", lambda: SpecConfig("eagle", **tree_cfg)),
                          ("--ddtree", lambda: SpecConfig("dflash", block_size=block_size, **ddtree_cfg)),
                          ("--ngram", lambda: SpecConfig("ngram", **ngram_cfg))):
        try:   # each shape on its own flag, used by --algos or not
            spec_of().validate()
        except (ValueError, TypeError) as e:
            raise typer.BadParameter(str(e), param_hint=flag)
    _check_e2e_paths(out, prompts, drafter, dflash_drafter)
    if dtype not in ("bfloat16", "float16", "float32"):
        raise typer.BadParameter(f"expected bfloat16 | float16 | float32, got {dtype!r}", param_hint="--dtype")
    from specattn.backends import available_backends
    if backend not in available_backends():
        raise typer.BadParameter(f"unknown backend {backend!r}; known: {', '.join(sorted(available_backends()))}",
                                 param_hint="--backend")
    try:
        SpecConfig("dflash", ddtree_depth_decay=ddtree_depth_decay).validate()
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--ddtree-depth-decay")
    checks = (("--block-size-by-batch", block_size_by_batch,
               lambda v: SpecConfig("dflash", block_size=block_size, block_size_by_batch=v)),
              ("--dflash-verify-by-batch", dflash_verify_by_batch,
               lambda v: SpecConfig("dflash", block_size=block_size, num_draft_tokens_by_batch=v)),
              ("--tree-by-batch", tree_by_batch,
               lambda v: SpecConfig("eagle", **tree_cfg, num_draft_tokens_by_batch=v)),
              ("--ddtree-by-batch", ddtree_by_batch,
               lambda v: SpecConfig("dflash", block_size=block_size, **ddtree_cfg, num_draft_tokens_by_batch=v)),
              ("--ngram-topk-by-batch", ngram_topk_by_batch,
               lambda v: SpecConfig(**e2e.spec_fields("ngram", e2e.E2EConfig(ngram=ngram_cfg,
                                                                              ngram_topk_by_batch=v)))))
    by_batch = {}
    for flag, text, spec_of in checks:
        try:
            by_batch[flag] = parse_by_batch(text)
            if flag == "--ngram-topk-by-batch" and not all(0 <= k <= ngram_cfg["topk"] for _, k in by_batch[flag]):
                raise ValueError(f"each TOPK must be between 0 (no speculation) and --ngram's topk "
                                 f"({ngram_cfg['topk']}), got {text!r}")
            spec_of(by_batch[flag]).validate()
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint=flag)
    try:
        sizes = [int(x) for x in batch_sizes.split(",")]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {batch_sizes!r}", param_hint="--bs")
    if len(set(sizes)) != len(sizes):
        raise typer.BadParameter(f"a batch size is repeated in {batch_sizes!r}", param_hint="--bs")
    names = [a.strip() for a in algos.split(",") if a.strip()]
    rep_names = [a.strip() for a in repetitive_algos.split(",") if a.strip()]
    for flag, given in (("--algos", names), ("--repetitive-algos", rep_names)):
        if len(set(given)) != len(given):
            raise typer.BadParameter(f"an algorithm is repeated in {','.join(given)!r}", param_hint=flag)
    cfg = e2e.E2EConfig(algos=names, batch_sizes=sizes, backend=backend, dtype=dtype,
                        max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos, min_requests=min_requests,
                        requests_per_row=requests_per_row, cycle_prompts=cycle_prompts,
                        min_free_slots=min_free_slots,
                        chain=chain_cfg, tree=tree_cfg, block_size=block_size,
                        block_size_by_batch=by_batch["--block-size-by-batch"],
                        dflash_verify_by_batch=by_batch["--dflash-verify-by-batch"],
                        tree_by_batch=by_batch["--tree-by-batch"],
                        ddtree=ddtree_cfg, ddtree_by_batch=by_batch["--ddtree-by-batch"],
                        ddtree_depth_decay=ddtree_depth_decay,
                        ngram=ngram_cfg, ngram_topk_by_batch=by_batch["--ngram-topk-by-batch"],
                        repetitive_algos=rep_names,
                        drafter=str(drafter) if drafter else None, draft_vocab=draft_vocab,
                        prompts=str(prompts) if prompts else None,
                        dflash_drafter=str(dflash_drafter) if dflash_drafter else None,
                        peers=peers, profile=profile, retime_below_busy=retime_below_busy, check=check)
    for flag, given in (("--algos", names), ("--repetitive-algos", rep_names)):
        for a in given:
            try:
                SpecConfig(**e2e.spec_fields(a, cfg)).validate()
            except (ValueError, KeyError) as err:
                raise typer.BadParameter(str(err.args[0] if isinstance(err, KeyError) else err), param_hint=flag)
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
def bench_plot(results: Path = typer.Argument(..., help="An e2e run's JSON (e.g. bench/results/h100/e2e.json).")):
    """Rewrite an e2e run's markdown table and redraw its PNG from its JSON (the PNG needs
    matplotlib)."""
    from specattn.bench import e2e, suites
    if not results.is_file():
        raise typer.BadParameter(f"no such file: {results}", param_hint="RESULTS")
    try:
        report = suites.load_report(results, e2e.SUITE)
    except ValueError as err:   # not JSON, no suite report, another suite's
        raise typer.BadParameter(str(err), param_hint="RESULTS")
    results.with_suffix(".md").write_text(e2e.markdown(report))
    typer.echo(f"wrote {results.with_suffix('.md')}")
    png = results.with_suffix(".png")
    if not e2e.render_png(report, png):
        typer.echo("matplotlib is not installed: pip install matplotlib", err=True)
        raise typer.Exit(code=1)
    typer.echo(f"wrote {png}")


@bench_app.command("suite")
def bench_suite(
    name: str = typer.Argument(..., help="attention | spec_ops | kv_ops | e2e"),
    out: Optional[Path] = typer.Option(None, help="Results folder (default bench/results/<gpu>/)."),
    from_: Optional[Path] = typer.Option(
        None, "--from", help="Build the files from an earlier run instead of running: the folder of "
                             "its raw reports (attention_*.json of `python -m specattn.bench."
                             "attention_report`, `specattn bench ... --json` files), or a suite JSON."),
    commit: Optional[str] = typer.Option(None, help="With --from: the commit the run measured."),
    commit_note: Optional[str] = typer.Option(None, help="With --from: where that commit comes from."),
    iters: Optional[int] = typer.Option(
        None, min=50, show_default="100",
        help="Timed iterations per point (median taken) of the kernel suites; the e2e suite "
             "times whole requests, and --from times nothing."),
):
    """Run a benchmark suite (or rebuild it from an earlier run with --from) and write
    <suite>.json, <suite>.md and <suite>.png (matplotlib) into bench/results/<gpu>/."""
    from specattn.bench import suites

    if name not in suites.SUITES:
        raise typer.BadParameter(f"unknown suite {name!r}; known: {', '.join(suites.SUITES)}",
                                 param_hint="NAME")
    if iters is not None and from_ is not None:   # None: not given (100 when a suite runs)
        raise typer.BadParameter("--from rebuilds the files from an earlier run and times nothing",
                                 param_hint="--iters")
    if iters is not None and name == "e2e":
        raise typer.BadParameter("the e2e suite has no timed iterations: it times whole requests "
                                 "(`specattn bench e2e --min-requests/--requests-per-row` set how many)",
                                 param_hint="--iters")
    from specattn.spec_runtime.cli import out_dir_problem
    why = out_dir_problem(out)
    if why:
        raise typer.BadParameter(why, param_hint="--out")
    if from_ is None and (commit is not None or commit_note is not None):
        raise typer.BadParameter("--commit and --commit-note go with --from (a run here records its own "
                                 "commit)", param_hint="--commit")
    console = Console(stderr=True)
    if from_ is not None:
        try:
            report = suites.from_run(name, from_, commit=commit, commit_note=commit_note)
        except (FileNotFoundError, ValueError) as err:
            raise typer.BadParameter(str(err), param_hint="--from")
    else:
        import torch
        if not torch.cuda.is_available():
            typer.echo(NO_GPU_MESSAGE, err=True)
            raise typer.Exit(code=2)
        report = suites.run_suite(name, iters=100 if iters is None else iters, log=lambda msg: console.print(
            msg, style="dim", markup=False, highlight=False))
    for path in suites.write_results(report, out or suites.default_out(report)):
        console.print(f"wrote {path}")
    typer.echo(suites.markdown(report))


def _register_runtime() -> None:
    """The runtime's commands (imported lazily by typer only when run)."""
    from specattn.spec_runtime.cli import generate, model_app
    app.command("generate")(generate)
    app.add_typer(model_app, name="model", cls=CommandGroup)
    from specattn.spec_runtime.drafter_cli import drafter_app
    app.add_typer(drafter_app, name="drafter", cls=CommandGroup)


_register_runtime()


def main() -> None:
    """Console-script entry point (``specattn``)."""
    app()


if __name__ == "__main__":
    main()
