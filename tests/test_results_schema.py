"""The curated results, ``bench/results/<gpu>/<suite>.{json,md,png}``: every file has the
suite schema, its markdown is what the suite's writer makes of its JSON, its plot exists,
and ``specattn bench suite NAME --from`` rebuilds them (from the JSON, or from an earlier
run's raw reports).  The e2e files' schema is tests/test_bench_e2e.py's."""
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specattn import cli
from specattn.bench import suites
from specattn.bench.e2e import gpu_slug

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SUITE_JSONS = sorted(p for p in RESULTS.glob("*/*.json") if p.stem != "e2e")
ALL_JSONS = sorted(RESULTS.glob("*/*.json"))


def _id(p: Path) -> str:
    return f"{p.parent.name}/{p.stem}"


#: the latest run of every gpu-marked test, written by bench/scripts/gpu_tests.sh
GPU_TESTS = "gpu_tests.md"


def test_only_curated_files():
    """One folder per GPU, holding only the latest run of each suite (three files each) and
    of the GPU tests."""
    assert SUITE_JSONS, "no curated results"
    for entry in RESULTS.iterdir():
        assert entry.is_dir(), entry
        for f in entry.iterdir():
            if f.name == GPU_TESTS:
                continue
            assert f.stem in suites.SUITES and f.suffix in (".json", ".md", ".png"), f
            assert all(f.with_suffix(s).is_file() for s in (".json", ".md", ".png")), f


@pytest.mark.parametrize("path", sorted(RESULTS.glob(f"*/{GPU_TESTS}")), ids=lambda p: p.parent.name)
def test_gpu_tests_summary(path):
    """The GPU test summary names its device (the folder's GPU) and commit, and counts runs."""
    text = path.read_text()
    lines = text.splitlines()
    assert lines[0] == "# GPU tests"
    assert gpu_slug(lines[2].split(",")[0]) == path.parent.name
    assert re.search(r"commit `[0-9a-f]{40}`", lines[2])
    assert re.search(r"^- \*\*\w+\*\*: \d+ passed, \d+ failed, \d+ errors, \d+ skipped", text, re.M)


@pytest.mark.parametrize("path", SUITE_JSONS, ids=_id)
def test_suite_file(path):
    assert suites.check_results_file(path) == []
    rep = json.loads(path.read_text())
    assert gpu_slug(rep["device"]["name"]) == path.parent.name
    assert rep["timestamp"][:4].isdigit() and rep["versions"]["torch"]
    for r in rep["rows"]:
        if r["impl"] in ("triton", "cuda") and r["case"] != "kv_materialize":
            assert r["mode"] == "cuda-graph", r  # the suites time graph replays
    if rep.get("commit_note"):
        assert len(rep["commit"]) == 40


@pytest.mark.parametrize("path", ALL_JSONS, ids=_id)
def test_suite_command_rebuilds_the_files(path, tmp_path):
    res = CliRunner().invoke(cli.app, ["bench", "suite", path.stem, "--from", str(path), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output[-3000:]
    assert (tmp_path / path.name).read_text() == path.read_text()
    assert (tmp_path / f"{path.stem}.md").read_text() == path.with_suffix(".md").read_text()


def test_checker_finds_a_stale_markdown(tmp_path):
    src = RESULTS / "h100" / "spec_ops.json"
    folder = tmp_path / "h100"
    folder.mkdir()
    rep = json.loads(src.read_text())
    rep["rows"][0]["median_us"] *= 2
    (folder / "spec_ops.json").write_text(json.dumps(rep))
    (folder / "spec_ops.md").write_text(src.with_suffix(".md").read_text())
    problems = suites.check_results_file(folder / "spec_ops.json")
    assert any("markdown writer" in p for p in problems) and any("spec_ops.png" in p for p in problems)


def _case(name, impl, median, **params):
    return {"name": name, "median_us": median, "p10_us": median * 0.9, "p90_us": median * 1.1,
            "iters": 100, "bytes": 1000, "flops": 0, "gbps": 1e-3 / median, "tflops": None,
            "pct_copy_bw": 10.0, "pct_matmul": None, "description": "d", "mode": "cuda-graph",
            "note": "", "flush_l2": False, "params": {"impl": impl, **params}}


def _raw(cases, stamp, errors=()):
    return {"device": {"name": "NVIDIA H100 80GB HBM3"}, "versions": {"torch": "2.x", "triton": "3.x"},
            "timestamp": stamp, "settings": {"iters": 100, "use_graph": True},
            "ceilings": {"copy_gbps": 3000.0, "matmul_tflops": 750.0}, "cases": list(cases),
            "errors": list(errors)}


def test_from_raw_reports_of_the_gpu_scripts(tmp_path):
    """spec_ops from one `specattn bench --json` file and a combined {impl: report} file:
    rows in table order, speedups over the PyTorch anchor, errors kept, the earliest report's
    header."""
    tb = dict(bs=64, topk=8, num_steps=5, num_draft_tokens=64)
    (tmp_path / "bench_torch.json").write_text(json.dumps(_raw([_case("tree_build", "torch", 170.0, **tb)],
                                                               "2026-01-01T10:00:05Z")))
    combined = {"triton": _raw([_case("tree_build", "triton", 17.0, **tb)], "2026-01-01T10:00:09Z"),
                "cuda": _raw([_case("tree_build", "floor", 3.0, **tb), _case("tree_build", "cuda", 8.5, **tb),
                              _case("kv_move_mla", "cuda", 5.0)],
                             "2026-01-01T10:00:01Z", [{"case": "compaction", "params": {}, "error": "boom"}])}
    (tmp_path / "bench_tree_ops.json").write_text(json.dumps(combined))
    (tmp_path / "other.json").write_text(json.dumps({"meta": 1}))
    rep = suites.from_run("spec_ops", tmp_path, commit="a" * 40)
    assert [(r["impl"], r["median_us"]) for r in rep["rows"]] == [
        ("cuda", 8.5), ("triton", 17.0), ("torch", 170.0), ("floor: one-element kernel", 3.0)]
    assert rep["rows"][0]["speedup"] == {"torch": pytest.approx(20.0)} and rep["rows"][2]["speedup"] == {}
    assert rep["rows"][3]["speedup"] == {}  # a floor is no implementation
    assert rep["timestamp"] == "2026-01-01T10:00:01Z" and rep["commit"] == "a" * 40 and "commit_note" not in rep
    assert rep["errors"] == [{"case": "compaction", "params": {}, "error": "boom"}]
    paths = suites.write_results(rep, tmp_path / "h100")
    assert (tmp_path / "h100" / "spec_ops.md").read_text() == suites.markdown(rep)
    md = suites.markdown(rep)
    assert "cuda 8.5 us (MISSES <= 6 us; floor in this run 3.0 us)" in md and "- compaction {}: boom" in md
    assert {p.suffix for p in paths} >= {".json", ".md"}
    with pytest.raises(ValueError, match="no report holds a case of suite 'kv_ops'"):
        suites.from_run("kv_ops", tmp_path / "h100")


def test_from_raw_attention_reports_and_the_commit_from_git(tmp_path, monkeypatch):
    """The attention_report layout (one file per case, errors without a case, the cross-check
    in attention_summary.md); without --commit the commit comes from git, said so."""
    pts = dict(bs=16, prefix=2048, page_size=1)
    (tmp_path / "attention_tree_verify.json").write_text(json.dumps(_raw(
        [_case("tree_verify", "triton", 90.0, **pts), _case("tree_verify", "flashinfer_mask", 300.0, **pts),
         _case("tree_verify", "flashinfer_split", 135.0, fi_backend="fa2", **pts)],
        "2026-01-01T00:00:00Z", [{"params": {"impl": "triton_generic"}, "error": "RuntimeError: x"}])))
    (tmp_path / "attention_summary.md").write_text(
        "# t\n\n| a |\n\n## bars\n\n- x\n\n## cross-check\n\n- tree_verify: triton vs torch reference: "
        "max abs diff 1e-03\n- (cross-check took 3 s)\n")
    monkeypatch.setattr(suites, "git_last_commit", lambda path: "b" * 40)
    rep = suites.from_run("attention", tmp_path)
    assert rep["commit"] == "b" * 40 and rep["commit_note"] == suites.UNRECORDED_COMMIT
    assert list(rep)[:5] == ["suite", "device", "versions", "commit", "commit_note"]
    triton = rep["rows"][0]
    assert triton["point"] == "bs=16 prefix=2048 page_size=1"
    assert triton["speedup"] == {"flashinfer_mask": pytest.approx(300 / 90), "flashinfer_split": pytest.approx(1.5)}
    assert rep["errors"][0]["case"] == "tree_verify" and rep["checks"] == [
        "tree_verify: triton vs torch reference: max abs diff 1e-03"]
    md = suites.markdown(rep)
    assert "3.33x vs flashinfer_mask (meets >= 3.0x)" in md and "## Cross-check" in md


def test_suite_in_parts_keeps_every_library_version(tmp_path):
    """A suite run in parts (the MLA cases where only FlashMLA is installed, then the rest
    with FlashInfer): the header names both libraries, the earliest part's device and date."""
    mla = _raw([_case("mla_decode", "triton", 600.0, bs=128, seq_len=8192)], "2026-01-01T00:00:00Z")
    mla["versions"].update(flashinfer="not installed", flash_mla="1.0.0")
    tv = _raw([_case("tree_verify", "triton", 90.0, bs=16, prefix=2048, page_size=1)], "2026-01-01T00:05:00Z")
    tv["versions"].update(flashinfer="0.7.2", flash_mla="1.0.0", torch="other")
    (tmp_path / "attention_mla_decode.json").write_text(json.dumps(mla))
    (tmp_path / "attention_tree_verify.json").write_text(json.dumps(tv))
    rep = suites.from_run("attention", tmp_path, commit="c" * 40)
    assert rep["versions"] == {"torch": "2.x", "triton": "3.x", "flashinfer": "0.7.2", "flash_mla": "1.0.0"}
    assert rep["timestamp"] == "2026-01-01T00:00:00Z" and len(rep["rows"]) == 2
    assert "ceilings_by_part" not in rep and "measured their own ceilings" not in suites.markdown(rep)


def test_suite_in_parts_names_each_parts_ceilings(tmp_path):
    """Parts that measured different ceilings (on two GPUs of one host): the JSON lists each
    part's cases and ceilings, the markdown says whose percentages use which; the file passes
    the results check."""
    mla = _raw([_case("mla_decode", "triton", 600.0, bs=128, seq_len=8192),
                _case("mla_decode", "triton", 90.0, bs=16, seq_len=4096),
                _case("mla_tree_verify", "triton", 130.0, bs=1, prefix=4096)], "2026-01-01T00:00:00Z")
    mla["ceilings"] = {"copy_gbps": 2990.0, "matmul_tflops": 701.0}
    tv = _raw([_case("tree_verify", "triton", 90.0, bs=16, prefix=2048, page_size=1)], "2026-01-01T00:00:01Z")
    dec = _raw([_case("decode", "triton", 20.0, bs=1, seq_len=1024)], "2026-01-01T00:00:02Z")
    for name, r in (("mla_decode", mla), ("tree_verify", tv), ("decode", dec)):
        (tmp_path / f"attention_{name}.json").write_text(json.dumps(r))
    rep = suites.from_run("attention", tmp_path, commit="c" * 40)
    assert rep["ceilings"] == mla["ceilings"]
    assert rep["ceilings_by_part"] == [
        {"cases": ["mla_decode", "mla_tree_verify"], "copy_gbps": 2990.0, "matmul_tflops": 701.0},
        {"cases": ["tree_verify", "decode"], "copy_gbps": 3000.0, "matmul_tflops": 750.0}]
    assert ("each row's percentages are of its part's: mla_decode, mla_tree_verify: copy 2990 GB/s, "
            "bf16 matmul 701 TFLOP/s; tree_verify, decode: copy 3000 GB/s, bf16 matmul 750 TFLOP/s."
            ) in suites.markdown(rep)
    suites.write_results(rep, tmp_path / "h100")
    assert suites.check_results_file(tmp_path / "h100" / "attention.json") == []


def test_suite_in_parts_merges_the_cross_checks(tmp_path):
    """Each part's cross-check, one ``attention_summary*.md`` per part: every line once; an
    implementation that failed only because its library was missing in one part is dropped
    where another part checked it, and kept where none did."""
    head = "# summary\n\n## cross-check\n\n"
    miss = "- {c} impl={i}: FAILED ImportError: impl='{i}' needs lib (import failed); install it\n"
    (tmp_path / "attention_summary_mla.md").write_text(
        head + "- mla_decode (bs=4): triton vs flashmla: max abs diff 3.9e-03\n"
        "- tree_verify (bs=4): triton vs torch reference: max abs diff 2.0e-03\n"
        + miss.format(c="tree_verify", i="flashinfer_mask") + miss.format(c="decode", i="flashinfer"))
    (tmp_path / "attention_summary.md").write_text(
        head + "- tree_verify (bs=4): triton vs torch reference: max abs diff 2.0e-03\n"
        "- tree_verify (bs=4): triton vs flashinfer_mask: max abs diff 2.0e-03\n"
        + miss.format(c="mla_decode", i="flashmla") + "\n## other\n\n- x: FAILED elsewhere\n")
    lines = suites.summary_checks(tmp_path)
    assert lines.count("tree_verify (bs=4): triton vs torch reference: max abs diff 2.0e-03") == 1
    assert not any("flashinfer_mask: FAILED" in ln or "flashmla: FAILED" in ln for ln in lines)
    assert any(ln.startswith("decode impl=flashinfer: FAILED") for ln in lines)   # checked nowhere
    assert not any("elsewhere" in ln for ln in lines) and len(lines) == 4


def test_suite_command_errors():
    runner = CliRunner()
    res = runner.invoke(cli.app, ["bench", "suite", "nope"])
    assert res.exit_code == 2 and "unknown suite" in res.output
    res = runner.invoke(cli.app, ["bench", "suite", "kv_ops", "--from", "no/such/dir"])
    assert res.exit_code == 2 and "no such file or folder" in res.output
    res = runner.invoke(cli.app, ["bench", "suite", "kv_ops", "--from", str(RESULTS / "h100" / "spec_ops.json")])
    assert res.exit_code == 2 and "not a kv_ops results file" in res.output


def test_suite_points_use_registered_cases_and_params():
    from specattn.bench.cases import CASES
    for name in ("attention", "spec_ops", "kv_ops"):
        pts = suites.suite_points(name)
        assert pts
        for case, params, _ in pts:
            assert case in suites.SUITE_INFO[name].cases
            assert set(params) <= set(CASES[case].params), (case, params)


def test_run_suite_on_a_stubbed_gpu(monkeypatch):
    """run_suite's loop without a GPU: every point through runner.run_case, a failing point
    recorded and the rest still run, the attention cross-check kept."""
    from specattn.bench import attention_report, harness, runner

    calls = []

    def run_case(case, params, ceilings, iters, warmup):
        calls.append((case, dict(params), iters))
        if params.get("impl") == "triton" and params.get("tokens") == 4096:
            raise RuntimeError("no such kernel")
        out = _case(case, params.get("impl"), 10.0 if params.get("impl") != "reference" else 100.0,
                    **{k: v for k, v in params.items() if k != "impl"})
        from specattn.bench.cases import CASES
        out["params"] = {**CASES[case].params, **params}
        return out

    monkeypatch.setattr(harness, "require_cuda", lambda: None)
    monkeypatch.setattr(harness, "measure_ceilings", lambda: harness.Ceilings(copy_gbps=3000.0, matmul_tflops=700.0))
    monkeypatch.setattr(runner, "run_case", run_case)
    monkeypatch.setattr(runner, "device_summary", lambda: {"name": "NVIDIA H100 80GB HBM3"})
    monkeypatch.setattr(attention_report, "cross_check", lambda: ["tree_verify: a vs b: max abs diff 0"])
    monkeypatch.setenv("SPECATTN_COMMIT", "c" * 40)
    rep = suites.run_suite("kv_ops", iters=50, log=lambda msg: None)
    assert len(calls) == len(suites.suite_points("kv_ops")) and all(c[2] == 50 for c in calls)
    assert rep["commit"] == "c" * 40 and rep["suite"] == "kv_ops"
    assert {e["case"] for e in rep["errors"]} == {"kv_move_mla", "kv_move_mha", "kv_materialize"}
    assert len(rep["rows"]) + len(rep["errors"]) == len(calls)
    move = [r for r in rep["rows"] if r["point"].startswith("MLA") and r["point"].endswith("tokens=256")]
    assert [r["impl"] for r in move] == ["reference", "cuda staged", "cuda direct", "triton direct",
                                         "floor: one contiguous copy"]
    assert move[2]["speedup"] == {"reference": pytest.approx(10.0)} and move[4]["speedup"] == {}
    assert "cuda direct 10.0 us (meets <= 15 us; floor in this run 10.0 us)" in suites.markdown(rep)
    rep = suites.run_suite("attention", log=lambda msg: None)
    assert rep["checks"] == ["tree_verify: a vs b: max abs diff 0"] and "flashinfer" in rep["versions"]
    assert len(rep["rows"]) == len(suites.suite_points("attention"))
