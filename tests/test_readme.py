"""The README is a user's guide whose commands run and whose figures come from the curated
results: its two set-up commands are what CI runs, every other command it shows parses
(and runs, where a CPU can run it), every number in its results tables is in the results
file the table names, and its links resolve."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from specattn import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
TORCH_CPU = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def _section(title: str) -> str:
    start = README.index(f"## {title}")
    nxt = README.find("\n## ", start + 1)
    return README[start:nxt if nxt >= 0 else len(README)]


def _blocks(text: str, lang: str = "bash"):
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _commands(block: str):
    """Commands of a bash block (continuations joined, comments dropped) as token lists."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        if tokens:
            out.append(tokens)
    return out


def _split(line: str):
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # a shell construct shlex does not parse
        return []


def _ci_lines():
    return [line.strip() for line in open(ROOT / ".ci" / "run")]


def test_ci_runs_the_readme_commands():
    """The set-up section: one block with exactly the two commands .ci/run runs, after the
    line that picks torch's CPU build."""
    blocks = _blocks(_section("Set up (two commands)"))
    ci = _ci_lines()
    lines = lambda b: [c.strip() for c in b.strip().splitlines() if c.strip()]  # noqa: E731
    two = [b for b in blocks if all(c in ci for c in lines(b))]
    assert len(two) == 1, blocks
    commands = lines(two[0])
    assert len(commands) == 2
    for c in commands:
        assert c in ci, f"README command {c!r} is not in .ci/run"
    first = blocks.index(two[0])
    assert [line.strip() for b in blocks[:first] for line in b.strip().splitlines()] == [TORCH_CPU]


def _all_commands():
    return [c for b in _blocks(README) for c in _commands(b)]


def _resolve(tokens):
    """``specattn A B ...`` -> (the click command, the path, the arguments it gets)."""
    group = typer.main.get_command(cli.app)
    path, args = [], list(tokens[1:])
    cmd = group
    while hasattr(cmd, "commands"):
        if args and args[0] in cmd.commands:
            path.append(args[0])
            cmd = cmd.commands[args.pop(0)]
        elif path == ["bench"]:  # `specattn bench CASE ...` is `specattn bench cases CASE ...`
            path.append("cases")
            cmd = cmd.commands["cases"]
        else:
            break
    return cmd, path, args


def test_every_command_is_one_a_test_or_ci_runs():
    """pip / pytest lines are CI's (plus the torch-build line); python files are the examples
    (tests/test_examples.py runs them); `python -m MOD` answers --help; every `specattn` line
    (also one launched as `torchrun ... -m specattn ...`) parses with its options (those a CPU
    can run are run below)."""
    ci = _ci_lines()
    seen = set()
    for tokens in _all_commands():
        line = shlex.join(tokens)
        if tokens[0] == "torchrun":   # a multi-process launch of the specattn command line
            assert "-m" in tokens and tokens[tokens.index("-m") + 1] == "specattn", line
            tokens = ["specattn", *tokens[tokens.index("-m") + 2:]]
        if tokens[0] == "pip" or tokens[:3] == ["python", "-m", "pytest"]:
            assert line in [shlex.join(t) for t in map(_split, ci) if t] or " ".join(tokens) == TORCH_CPU, line
        elif tokens[0] == "python" and tokens[1] == "-m":
            if tokens[2] not in seen:
                seen.add(tokens[2])
                res = subprocess.run([sys.executable, "-m", tokens[2], "--help"], cwd=ROOT,
                                     capture_output=True, text=True, timeout=120)
                assert res.returncode == 0, (line, res.stderr[-2000:])
        elif tokens[0] == "python":
            assert tokens[1].startswith("examples/") and (ROOT / tokens[1]).is_file(), line
        else:
            assert tokens[0] == "specattn", line
            cmd, path, args = _resolve(tokens)
            assert path, line
            cmd.make_context(" ".join(["specattn", *path]), list(args))  # raises on a bad option


@pytest.fixture
def runner():
    return CliRunner()


def test_cpu_commands_run(runner):
    for args in (["info", "--json"], ["bench", "--list"]):
        assert ["specattn", *args] in _all_commands()
        res = runner.invoke(cli.app, args)
        assert res.exit_code == 0, (args, res.output[-2000:])


def test_gpu_bench_case_lines_name_real_cases_and_params(runner, monkeypatch):
    """Without a GPU a bench-case line gets as far as the GPU check (exit 2 with the
    message): its case names and parameters were accepted."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines = [t for t in _all_commands() if t[:2] == ["specattn", "bench"]
             and _resolve(t)[1] == ["bench", "cases"] and "--list" not in t]
    assert lines
    for tokens in lines:
        res = runner.invoke(cli.app, tokens[1:])
        assert res.exit_code == 2 and "CUDA GPU is needed" in res.output, (tokens, res.output[-2000:])


def test_suite_redraw_line_runs(runner, tmp_path):
    lines = [t for t in _all_commands() if t[:3] == ["specattn", "bench", "suite"] and "--from" in t]
    assert lines
    for tokens in lines:
        res = runner.invoke(cli.app, [*tokens[1:], "--out", str(tmp_path)])
        assert res.exit_code == 0, res.output[-2000:]
        src = Path(ROOT / tokens[tokens.index("--from") + 1])
        assert (tmp_path / f"{src.stem}.md").read_text() == src.with_suffix(".md").read_text()


def _numbers(text: str):
    return set(re.findall(r"\d+(?:\.\d+)?", text))


def _tables():
    """``(results files named in the caption, body lines)`` for every README table; a table
    right after another shares its caption."""
    out, caption, refs, table = [], [], [], []
    for line in README.splitlines() + [""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            if caption:
                refs = re.findall(r"bench/results/[a-z0-9]+/[a-z_0-9]+\.md", " ".join(caption))
            out.append((refs, table[2:]))
            table, caption = [], []
        if line.startswith("#"):
            refs, caption = [], []
        elif line.strip():
            caption.append(line)
    return out


def test_table_figures_come_from_the_results_files():
    checked = 0
    for refs, body in _tables():
        if not refs:
            continue
        allowed = set()
        for ref in refs:
            md = ROOT / ref
            allowed |= _numbers(md.read_text())
            report = json.loads(md.with_suffix(".json").read_text())
            allowed |= _numbers(json.dumps([r.get("params", r.get("config", {})) for r in report["rows"]]))
        missing = sorted(_numbers("\n".join(body)) - allowed, key=float)
        assert not missing, f"README figures not in {refs}: {missing}"
        checked += 1
    assert checked >= 6  # e2e, attention x 2 GPUs, spec ops, KV move, KV materialization


def test_links_and_paths_resolve():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
    for path in re.findall(r"`((?:bench|docs|examples|backends|spec_runtime|tests)/[^`\s<>*]+)`", README):
        assert (ROOT / path).exists(), path


def test_no_work_log_issue_numbers_or_machine_paths():
    """The project's prose and results are a product, not a work log: no sitting-by-sitting
    narration, no issue numbers, no path of the machine the checkout lives on."""
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("bench/results/*/*.md"),
             *ROOT.glob("bench/results/*/*.json"), *ROOT.glob("bench/scripts/*")]
    patterns = [r"(?i)\bsess(?:ion)s?\b", r"(?i)\bissues?[ -]?#?\d"]
    patterns.append(re.escape(str(ROOT) + os.sep))   # the checkout's own path
    for f in files:
        text = f.read_text()
        for pattern in patterns:
            m = re.search(pattern, text)
            assert m is None, f"{f.relative_to(ROOT)}: {text[max(0, m.start() - 60):m.end() + 60]!r}"


def test_under_250_lines():
    assert len(README.splitlines()) < 250
