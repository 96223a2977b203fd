"""``specattn bench e2e`` on the CPU: its pieces (algorithm specs, timing arithmetic on a tiny
engine, the markdown / JSON / PNG writers), the command's argument errors, and the schema of
every committed e2e results file (so the README's figures cannot drift from them)."""
import hashlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from specattn import cli
from specattn.bench import e2e
from specattn.spec_runtime.engine import Engine, SpecConfig
from tiny_models import random_prompts, tiny_llama

ROOT = Path(__file__).resolve().parent.parent
ROW_KEYS = {"algo", "backend", "dtype", "bs", "tokens_per_s", "accept_length", "kernels_per_step",
            "gpu_busy", "lossless"}
PEER_ROW_KEYS = {"algo", "backend", "dtype", "bs", "tokens_per_s", "accept_length", "speedup"}
TOP_KEYS = {"suite", "device", "versions", "commit", "timestamp", "settings", "ceilings", "rows"}


def test_spec_fields():
    cfg = e2e.E2EConfig(chain=dict(topk=1, num_steps=4, num_draft_tokens=5))
    assert e2e.spec_fields("none", cfg) == {"algo": "none"}
    assert e2e.spec_fields("eagle_chain", cfg) == {"algo": "eagle", "topk": 1, "num_steps": 4, "num_draft_tokens": 5}
    assert e2e.spec_fields("dflash", cfg)["block_size"] == 16
    assert e2e.spec_fields("dflash", cfg)["block_size_by_batch"] == ()      # the chain keeps its block
    assert "block_size_by_batch" not in e2e.spec_fields("ddtree", cfg)
    assert e2e.spec_fields("dflash", e2e.E2EConfig(block_size_by_batch=[[8, 2]]))["block_size_by_batch"] == ((8, 2),)
    assert e2e.spec_fields("dflash", cfg)["num_draft_tokens_by_batch"] == ((4, 8), (16, 4))   # and verifies less of it
    assert e2e.spec_fields("dflash", e2e.E2EConfig(dflash_verify_by_batch=[]))["num_draft_tokens_by_batch"] == ()
    assert e2e.spec_fields("eagle_tree", cfg)["num_draft_tokens_by_batch"] == ((2, 16), (32, 8))   # trees only
    assert e2e.spec_fields("ddtree", cfg)["num_draft_tokens_by_batch"] == ((2, 16), (32, 8))
    assert "num_draft_tokens_by_batch" not in e2e.spec_fields("eagle_chain", cfg)
    assert e2e.spec_fields("ddtree", e2e.E2EConfig(ddtree_by_batch=[]))["num_draft_tokens_by_batch"] == ()
    assert e2e.spec_fields("ddtree", cfg)["ddtree_depth_decay"] == SpecConfig().ddtree_depth_decay == 0.8
    assert e2e.spec_fields("ddtree", e2e.E2EConfig(ddtree_depth_decay=1.0))["ddtree_depth_decay"] == 1.0
    assert "ddtree_depth_decay" not in e2e.spec_fields("dflash", cfg)
    assert e2e.spec_fields("eagle_tree", e2e.E2EConfig(tree_by_batch=[[4, 6]]))["num_draft_tokens_by_batch"] == ((4, 6),)
    ngram = e2e.E2EConfig(ngram=dict(topk=3, num_steps=2, ngram_size=4), ngram_topk_by_batch=[[8, 2], [32, 1]])
    assert e2e.spec_fields("ngram", ngram)["num_draft_tokens_by_batch"] == ((8, 5), (32, 3))   # 1 + topk * 2
    assert e2e.spec_fields("ngram", cfg)["num_draft_tokens_by_batch"] == ((16, 5),)     # one chain of 4 from batch 16
    for algo in e2e.DEFAULT_ALGOS:
        SpecConfig(**e2e.spec_fields(algo, e2e.E2EConfig())).validate()
    with pytest.raises(ValueError, match="unknown algo"):
        e2e.spec_fields("medusa", cfg)


def test_gpu_slug():
    assert e2e.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert e2e.gpu_slug("NVIDIA H200") == "h200"
    assert e2e.gpu_slug("Some Card 9") == "somecard9"


def test_measure_engine_on_a_tiny_model(tmp_path, seed):
    """Rounds, tokens and step time add up (profiling records no kernel on the CPU); more
    prompts than rows go through one generate call."""
    cfg, w = tiny_llama(tmp_path, seed, vocab=96)
    prompts = random_prompts(seed, 96, n=4)
    eng = Engine(cfg, dict(w), spec=SpecConfig("eagle", 1, 3, 4, 2), max_batch=2, max_context=64)
    row, outs = e2e.measure_engine(eng, [prompts[:2], prompts[2:]], 9, profile=False)
    assert row["tokens"] == 4 * 9 and len(outs) == 4 and all(len(o) == 9 for o in outs)
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
    assert 1.0 <= row["accept_length"] <= 4.0 and row["rounds"] >= 2 * 9 // 4
    assert row["gpu_busy"] is None and row["kernels_per_step"] is None
    row, _ = e2e.measure_engine(eng, [prompts], 9, profile=True)   # on the CPU: no kernels recorded
    assert row["kernels_per_step"] == 0 and row["kernel_ms_per_step"] == 0 and row["tokens"] == 4 * 9


def test_measure_engine_retimes_a_stalled_row(tmp_path, seed, monkeypatch):
    """A GPU busy fraction under the bound (here: a profiler that reports almost no kernel
    time) times the row once more and keeps the timing with the shorter step (``step_ms``;
    its tokens/s comes from the same timing, which includes the prefill, so it need not be
    the higher one); the first one's figures stay in ``retimed``, and the markdown names the
    row.  Bound 0: never re-timed."""
    cfg, w = tiny_llama(tmp_path, seed, vocab=96)
    prompts = random_prompts(seed, 96, n=3)
    eng = Engine(cfg, dict(w), spec=SpecConfig("eagle", 1, 3, 4, 2), max_batch=2, max_context=64)
    monkeypatch.setattr(e2e, "_profile_kernels", lambda fn: (7, 1e-6, fn()))
    row, outs = e2e.measure_engine(eng, [prompts], 9, profile=True, retime_below_busy=0.0)
    assert "retimed" not in row and len(outs) == 3
    row, outs = e2e.measure_engine(eng, [prompts], 9, profile=True, retime_below_busy=0.5)
    first = row["retimed"]
    assert set(first) == {"tokens_per_s", "step_ms"}
    assert row["step_ms"] <= first["step_ms"]
    if row["step_ms"] == first["step_ms"]:     # the first timing kept, whole
        assert row["tokens_per_s"] == first["tokens_per_s"]
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
    assert row["gpu_busy"] == pytest.approx(row["kernel_ms_per_step"] / row["profiled_step_ms"])
    assert row["tokens"] == 3 * 9 and all(len(o) == 9 for o in outs)
    row.update(algo="dflash", prompt_set="chat", bs=1, dtype="bfloat16", backend="triton", speedup=1.5,
               lossless="exact")
    md = e2e.markdown(_report([row]))
    assert "Re-timed" in md and f"chat dflash bs 1 (first {first['tokens_per_s']:.1f} tokens/s, " in md
    row["retimed"] = dict(first, gpu_busy=0.42)      # a row of a run from before profiled_step_ms
    assert "(first " in e2e.markdown(_report([row])) and "at GPU busy 0.42)" in e2e.markdown(_report([row]))


def test_gpu_busy_uses_the_profiled_prompts_own_rounds(tmp_path, seed, monkeypatch):
    """``gpu_busy`` divides the profiled prompts' kernel time per round by THEIR rounds' wall
    time (``profiled_step_ms``, timed unprofiled), not by the whole run's rounds: with more
    prompts than the profile takes, a profiler that reports a fixed kernel time gives a
    ``gpu_busy`` equal to that time over ``profiled_step_ms``, whatever ``step_ms`` is."""
    cfg, w = tiny_llama(tmp_path, seed, vocab=96)
    prompts = random_prompts(seed, 96, n=6)
    eng = Engine(cfg, dict(w), spec=SpecConfig("eagle", 1, 3, 4, 2), max_batch=1, max_context=64)
    calls = []

    def fake_profile(fn):
        res = fn()
        calls.append(res.rounds)
        return 0, (5.0 if len(calls) % 2 else 1.0), res     # full run, then prefill-only run
    monkeypatch.setattr(e2e, "_profile_kernels", fake_profile)
    row, _ = e2e.measure_engine(eng, [prompts], 9, profile=True)
    rounds = max(calls[0] - calls[1], 1)
    assert row["kernel_ms_per_step"] == pytest.approx(4.0 / rounds)
    assert row["profiled_step_ms"] > 0 and row["profiled_step_ms"] != row["step_ms"]
    assert row["gpu_busy"] == pytest.approx(row["kernel_ms_per_step"] / row["profiled_step_ms"])


def _report(rows):
    return {"suite": "e2e", "device": {"name": "NVIDIA H100 80GB HBM3"},
            "versions": {"torch": "2.x", "triton": "3.x"}, "commit": "abc", "timestamp": "2026-01-01T00:00:00+00:00",
            "settings": {"max_new_tokens": 8}, "ceilings": {}, "model": "m", "num_prompts": 4, "rows": rows}


def test_writers(tmp_path):
    rows = [dict(algo="none", backend="triton", dtype="bfloat16", bs=1, tokens_per_s=1000.0, accept_length=1.0,
                 step_ms=1.0, kernels_per_step=200.0, kernel_ms_per_step=0.9, gpu_busy=0.9, lossless="reference",
                 speedup=1.0),
            dict(algo="eagle_chain", backend="triton", dtype="bfloat16", bs=1, tokens_per_s=2500.0,
                 accept_length=3.2, step_ms=1.3, kernels_per_step=300.0, kernel_ms_per_step=1.2, gpu_busy=0.92,
                 lossless="exact", speedup=2.5),
            dict(algo="hf_static", backend="transformers", dtype="bfloat16", bs=1, error="RuntimeError: x")]
    paths = e2e.write_results(_report(rows), tmp_path / "h100")
    names = {p.name for p in paths}
    assert {"e2e.json", "e2e.md"} <= names
    md = (tmp_path / "h100" / "e2e.md").read_text()
    assert "| chat | eagle_chain | 1 | bfloat16 | triton | 2500.0 | 2.50 | 3.20 |" in md and "error: RuntimeError" in md
    assert "DFlash chain" not in md                                   # no DFlash rows
    rep = _report(rows + [dict(rows[1], algo="dflash")])
    rep["settings"].update(block_size=16, block_size_by_batch=[[16, 4], [64, 2]])
    e2e.write_results(rep, tmp_path / "h100")
    assert "DFlash chain: block 16, 4 from batch 16, 2 from batch 64." in (tmp_path / "h100" / "e2e.md").read_text()
    rep["settings"].update(block_size_by_batch=[], dflash_verify_by_batch=[[4, 8], [16, 4]])
    e2e.write_results(rep, tmp_path / "h100")
    assert ("DFlash chain: block 16; the verify keeps its first 8 tokens from batch 4, 4 from batch 16."
            in (tmp_path / "h100" / "e2e.md").read_text())
    (tmp_path / "h100" / "e2e.md").write_text("stale")   # bench plot rewrites the table from the JSON
    res = CliRunner().invoke(cli.app, ["bench", "plot", str(tmp_path / "h100" / "e2e.json")])
    assert (tmp_path / "h100" / "e2e.md").read_text() == e2e.markdown(rep) and "e2e.md" in res.output
    rep = _report(rows + [dict(rows[1], algo="ddtree"), dict(rows[1], algo="eagle_tree")])
    rep["settings"].update(block_size=16, block_size_by_batch=[[16, 4]], ddtree=dict(topk=8, num_draft_tokens=32),
                           ddtree_by_batch=[[2, 16], [32, 8]], chain=dict(topk=1, num_steps=5, num_draft_tokens=6),
                           tree=dict(topk=4, num_steps=5, num_draft_tokens=32), tree_by_batch=[[2, 16]])
    e2e.write_results(rep, tmp_path / "h100")
    md = (tmp_path / "h100" / "e2e.md").read_text()
    assert "DDTree: topk 8, 32 tokens, 16 from batch 2, 8 from batch 32." in md and "DFlash chain" not in md
    assert "tree (4, 5, 32) (topk, num_steps, num_draft_tokens) (tree tokens 32, 16 from batch 2)." in md
    assert "N-gram" not in md and "weighed" not in md
    rep["settings"]["ddtree_depth_decay"] = 0.8
    e2e.write_results(rep, tmp_path / "h100")
    assert ("DDTree: topk 8, 32 tokens, 16 from batch 2, 8 from batch 32, position k's log-probabilities "
            "weighed 0.8 ** (k - 1).") in (tmp_path / "h100" / "e2e.md").read_text()
    rep = _report(rows + [dict(rows[1], algo="ngram")])
    rep["settings"].update(ngram=dict(topk=4, num_steps=4, ngram_size=3), ngram_topk_by_batch=[[16, 2], [32, 1]])
    e2e.write_results(rep, tmp_path / "h100")
    assert ("N-gram: 4 chains of 4 (suffixes of up to 3 tokens), 2 from batch 16, 1 from batch 32."
            in (tmp_path / "h100" / "e2e.md").read_text())
    assert json.loads((tmp_path / "h100" / "e2e.json").read_text())["rows"][1]["accept_length"] == 3.2


def test_merge_parts_of_one_run(tmp_path):
    """A run made in two jobs (--bs 1,4 then --bs 16): one report, rows in batch order, the
    batch sizes together; parts of different runs or measuring one row twice are refused;
    `bench suite e2e --from` merges the parts below a folder."""
    def row(algo, bs, tps):
        return dict(algo=algo, prompt_set="chat", backend="triton", dtype="bfloat16", bs=bs, tokens_per_s=tps,
                    accept_length=1.0, speedup=1.0)
    a = _report([row("none", 1, 100.0), row("ngram", 1, 150.0), row("none", 4, 300.0)])
    a["settings"].update(batch_sizes=[1, 4])
    b = _report([row("none", 16, 900.0), row("ngram", 16, 950.0)])
    b["settings"].update(batch_sizes=[16])
    b["timestamp"], b["device"] = "2026-01-01T00:20:00+00:00", dict(a["device"], sms=132)
    m = e2e.merge_parts([b, a])
    assert [(r["algo"], r["bs"]) for r in m["rows"]] == [("none", 1), ("ngram", 1), ("none", 4), ("none", 16),
                                                         ("ngram", 16)]
    assert m["settings"] == {"max_new_tokens": 8, "batch_sizes": [1, 4, 16]}
    assert m["timestamp"] == a["timestamp"] and e2e.unmeasured_rows(m) == []
    with pytest.raises(ValueError, match="row .*'none', 16.* is in two parts"):
        e2e.merge_parts([a, b, b])
    with pytest.raises(ValueError, match="differ in commit, settings"):
        e2e.merge_parts([a, dict(b, commit="other", settings={"max_new_tokens": 9, "batch_sizes": [16]})])
    with pytest.raises(ValueError, match="no e2e reports"):
        e2e.merge_parts([])
    for name, part in (("p1", a), ("p2", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "e2e.json").write_text(json.dumps(part))
    out = tmp_path / "out"
    res = CliRunner().invoke(cli.app, ["bench", "suite", "e2e", "--from", str(tmp_path), "--out", str(out),
                                       "--commit", "c" * 40])
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "e2e.json").read_text())
    assert rep["commit"] == "c" * 40 and len(rep["rows"]) == 5 and rep["settings"]["batch_sizes"] == [1, 4, 16]


def test_png_bars_keep_prompt_sets_apart():
    """Both prompt sets run target-only decoding and n-gram at a batch size: each row gets
    its own bar (the copy-heavy set's labelled), errors get none."""
    row = dict(backend="triton", dtype="bfloat16", accept_length=1.0)
    rows = [dict(row, algo="none", bs=1, tokens_per_s=1000.0, prompt_set="chat"),
            dict(row, algo="ngram", bs=1, tokens_per_s=1400.0, accept_length=1.44, prompt_set="chat"),
            dict(row, algo="none", bs=1, tokens_per_s=990.0, prompt_set="repetitive"),
            dict(row, algo="ngram", bs=1, tokens_per_s=1900.0, accept_length=1.96, prompt_set="repetitive"),
            dict(row, algo="none", bs=4, tokens_per_s=4000.0),                 # no prompt_set: chat
            dict(algo="hf_static", backend="transformers", dtype="bfloat16", bs=4, error="x")]
    bars = e2e.png_bars(_report(rows))
    assert list(bars) == [1, 4]
    assert bars[1] == [("none", "none", 1000.0, 1.0), ("ngram", "ngram", 1400.0, 1.44),
                       ("none (repetitive)", "none", 990.0, 1.0), ("ngram (repetitive)", "ngram", 1900.0, 1.96)]
    assert bars[4] == [("none", "none", 4000.0, 1.0)]


def test_cli_errors():
    runner = CliRunner()
    res = runner.invoke(cli.app, ["bench", "e2e", "--algos", "medusa"])
    assert res.exit_code == 2 and "unknown algo" in res.output
    for bad in ("16", "1:4", "16:1"):
        res = runner.invoke(cli.app, ["bench", "e2e", "--block-size-by-batch", bad])
        assert res.exit_code == 2 and "block-size-by-batch" in res.output, res.output
    for flag, bad, why in (("--tree-by-batch", "2:99", "<= 69"), ("--ddtree-by-batch", "1:8", "increase from"),
                           ("--ddtree-by-batch", "2-8", "MIN_BATCH:VALUE"), ("--ngram-topk-by-batch", "16:-1", "between 0 (no speculation) and"),
                           ("--ngram-topk-by-batch", "16:5", "topk (4), got '16:5'"), ("--ngram-topk-by-batch", "0:1", "from >= 2"),
                           ("--dflash-verify-by-batch", "16:1", "must be >= 2")):
        res = runner.invoke(cli.app, ["bench", "e2e", flag, bad])
        assert res.exit_code == 2 and flag in res.output and why in res.output, res.output
    res = runner.invoke(cli.app, ["bench", "e2e", "--chain", "1,2"])
    assert res.exit_code == 2 and "topk,num_steps,num_draft_tokens" in res.output
    res = runner.invoke(cli.app, ["bench", "e2e", "--ddtree", "4,500"])
    assert res.exit_code == 2 and "num_draft_tokens" in res.output
    res = runner.invoke(cli.app, ["bench", "e2e", "--ddtree-depth-decay", "0"])
    assert res.exit_code == 2 and "--ddtree-depth-decay" in res.output and "> 0" in res.output, res.output
    res = runner.invoke(cli.app, ["bench", "plot", "nope.json"])
    assert res.exit_code == 2 and "no such file" in res.output


@pytest.mark.parametrize("path", sorted(ROOT.glob("bench/results/*/e2e.json")), ids=lambda p: p.parent.name)
def test_committed_e2e_results_schema(path):
    report = json.loads(path.read_text())
    assert TOP_KEYS <= set(report) and report["suite"] == "e2e"
    assert report["commit"] and report["device"]["name"]
    assert e2e.gpu_slug(report["device"]["name"]) == path.parent.name
    for r in report["rows"]:
        if "error" in r:
            continue
        keys = PEER_ROW_KEYS if r["algo"] == "hf_static" else ROW_KEYS   # a peer: no profile
        assert keys <= set(r), sorted(keys - set(r))
        assert r["tokens_per_s"] > 0 and r["accept_length"] >= 1.0
    assert (path.parent / "e2e.md").read_text() == e2e.markdown(report)


class _Tok:
    def encode(self, text):
        return [b % 96 for b in text.encode()][:10] or [1]


def test_run_e2e_dry_run_on_cpu(tmp_path, seed, monkeypatch):
    """The whole suite on a tiny model on the CPU (no graphs, no profiler, no peers): one
    row per (algo, bs), speedups against target-only decoding, every spec row lossless (with
    admission batching on), and the EAGLE rows on an EAGLE-3 drafter loaded from a folder."""
    from specattn.spec_runtime import cli as rcli
    from specattn.spec_runtime.eagle3 import Eagle3Drafter
    from specattn.spec_runtime.model import LlamaModel
    cfg, w = tiny_llama(tmp_path, seed, vocab=96)
    from specattn.spec_runtime import loader
    monkeypatch.setattr(rcli, "load_model", lambda model, dtype: (cfg, dict(w), _Tok()))
    monkeypatch.setattr(loader, "apply_chat_template", lambda tok, text: tok.encode(text))
    drafter = Eagle3Drafter.from_target(LlamaModel(cfg, dict(w)), seed=seed).save(tmp_path / "drafter")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"prompt number {i}" for i in range(8)) + "\n")
    seen = []
    conf = e2e.E2EConfig(batch_sizes=(1, 2), max_new_tokens=6, min_requests=2, dtype="float32",
                         backend="torch_reference", prompts=str(prompts), drafter=str(drafter), peers=False,
                         profile=False, model="tiny", device="cpu", block_size=4,
                         tree=dict(topk=2, num_steps=3, num_draft_tokens=5), tree_by_batch=((2, 3),),
                         ddtree=dict(topk=2, num_draft_tokens=6), ddtree_by_batch=((2, 4),), ngram=dict(topk=2, num_steps=3, ngram_size=2),
                         min_free_slots=2)
    report = e2e.run_e2e(conf, on_row=lambda r: seen.append(len(r["rows"])))
    rows = report["rows"]
    chat = [(r["algo"], r["bs"]) for r in rows if r["prompt_set"] == "chat"]
    rep = [(r["algo"], r["bs"]) for r in rows if r["prompt_set"] == "repetitive"]
    assert chat == [(a, b) for b in (1, 2) for a in e2e.DEFAULT_ALGOS]
    assert rep == [(a, b) for b in (1, 2) for a in e2e.DEFAULT_REPETITIVE_ALGOS]
    assert seen == list(range(1, len(rows) + 1))
    for r in rows:
        assert r["lossless"] == ("reference" if r["algo"] == "none" else "exact"), r
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / next(
            x["tokens_per_s"] for x in rows if x["algo"] == "none" and x["bs"] == r["bs"]
            and x["prompt_set"] == r["prompt_set"]))
    assert {r["drafter"] for r in rows if r["algo"].startswith("eagle")} == {drafter.name}
    digest = hashlib.sha256((drafter / "model.safetensors").read_bytes()).hexdigest()[:16]
    assert report["drafters"]["eagle"] == {"name": drafter.name, "sha256": digest}
    assert report["settings"]["drafter"] == drafter.name and report["settings"]["prompts"] == "prompts.txt"
    paths = e2e.write_results(report, tmp_path / "out")
    assert (tmp_path / "out" / "e2e.md").read_text() == e2e.markdown(report)
    assert e2e.unmeasured_rows(report) == [] and "Not measured" not in e2e.markdown(report)
    stopped = dict(report, rows=[r for r in rows if not (r["bs"] == 2 and r["algo"] in ("ddtree", "ngram"))])
    assert e2e.unmeasured_rows(stopped) == [("chat", "ddtree", 2), ("chat", "ngram", 2), ("repetitive", "ngram", 2)]
    assert e2e.markdown(stopped).endswith("chat ddtree bs 2, chat ngram bs 2, repetitive ngram bs 2.\n")
    assert {(r["bs"], r["min_free_slots"]) for r in rows} == {(1, 1), (2, 2)}
    assert "prefilled once 1 (bs 1), 2 (bs 2) rows are free" in e2e.markdown(report)


def test_response_tokens():
    rows = [[5, 2, 7, 2], [5, 6], [], [2], [9, 3, 3]]
    assert e2e.response_tokens(rows, (2, 3)) == [[5, 2], [5, 6], [], [2], [9, 3]]
    assert e2e.response_tokens(rows, ()) == rows


@pytest.mark.parametrize("stop_at_eos", [True, False])
def test_run_e2e_stops_requests_at_eos(tmp_path, seed, monkeypatch, stop_at_eos):
    """With ``stop_at_eos`` every request ends at the model's end token (here every token is
    one, so each request emits exactly one); without, each runs ``max_new_tokens``."""
    from specattn.spec_runtime import cli as rcli
    from specattn.spec_runtime import loader
    cfg, w = tiny_llama(tmp_path, seed, vocab=96)
    cfg.eos_token_ids = list(range(96))
    monkeypatch.setattr(rcli, "load_model", lambda model, dtype: (cfg, dict(w), _Tok()))
    monkeypatch.setattr(loader, "apply_chat_template", lambda tok, text: tok.encode(text))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"prompt {i}" for i in range(4)) + "\n")
    conf = e2e.E2EConfig(algos=("none", "ngram"), repetitive_algos=(), batch_sizes=(1, 2), max_new_tokens=5,
                         min_requests=4, requests_per_row=2, dtype="float32", backend="torch_reference",
                         prompts=str(prompts), peers=False, profile=False, model="tiny", device="cpu",
                         ngram=dict(topk=2, num_steps=3, ngram_size=2), stop_at_eos=stop_at_eos)
    rows = e2e.run_e2e(conf)["rows"]
    assert [(r["algo"], r["bs"]) for r in rows] == [("none", 1), ("ngram", 1), ("none", 2), ("ngram", 2)]
    for r in rows:
        assert r["tokens"] == 4 * (1 if stop_at_eos else 5), r
        assert r["lossless"] in ("reference", "exact")
    md = e2e.markdown({**_report(rows), "settings": {"max_new_tokens": 5, "stop_at_eos": stop_at_eos}})
    assert ("up to 5 new tokens per request" in md) == stop_at_eos


@pytest.mark.parametrize("cycle", [True, False])
def test_run_e2e_cycles_a_short_prompt_set(tmp_path, seed, monkeypatch, cycle):
    """A batch size's requests (``requests_per_row`` per row) cycle a shorter prompt set, in
    order, so a batch above the set's size runs too; without cycling the requests are cut to
    the set and that batch size is skipped (and not planned)."""
    from specattn.spec_runtime import cli as rcli
    from specattn.spec_runtime import loader
    from specattn.spec_runtime import engine as eng_mod
    cfg, w = tiny_llama(tmp_path, seed, vocab=96)
    cfg.eos_token_ids = list(range(96))   # every request emits one token
    monkeypatch.setattr(rcli, "load_model", lambda model, dtype: (cfg, dict(w), _Tok()))
    monkeypatch.setattr(loader, "apply_chat_template", lambda tok, text: tok.encode(text))
    served = []
    orig = eng_mod.Engine.generate

    def spy(self, prompts, *a, **kw):
        served.append((self.max_batch, [list(p) for p in prompts]))
        return orig(self, prompts, *a, **kw)
    monkeypatch.setattr(eng_mod.Engine, "generate", spy)
    texts = ["ab", "cd", "ef"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(texts) + "\n")
    conf = e2e.E2EConfig(algos=("none",), repetitive_algos=(), batch_sizes=(2, 4), max_new_tokens=3,
                         min_requests=1, requests_per_row=2, cycle_prompts=cycle, dtype="float32",
                         backend="torch_reference", prompts=str(prompts), peers=False, profile=False,
                         model="tiny", device="cpu")
    report = e2e.run_e2e(conf)
    ids = [_Tok().encode(t) for t in texts]
    if cycle:
        assert [(r["bs"], r["requests"], r["tokens"]) for r in report["rows"]] == [(2, 4, 4), (4, 8, 8)]
        assert {bs: p for bs, p in served} == {2: [ids[i % 3] for i in range(4)], 4: [ids[i % 3] for i in range(8)]}
        assert ("(at least 1 requests per batch size and 2 per request row, a set cycled where it is shorter)"
                in e2e.markdown(report))
    else:
        assert [(r["bs"], r["requests"], r["tokens"]) for r in report["rows"]] == [(2, 2, 2)]
        assert {bs: p for bs, p in served} == {2: ids[:2]}
        assert "cycled" not in e2e.markdown(report)
    assert e2e.unmeasured_rows(report) == []


def test_busy_ms_is_the_union_of_intervals():
    """Overlapping kernels (programmatic dependent launch) count once, gaps not at all, on
    shuffled random intervals against a dense microsecond grid."""
    import random
    rng = random.Random()
    spans = [(a, a + rng.randint(1, 30)) for a in (rng.randint(0, 400) for _ in range(rng.randint(1, 40)))]
    grid = set()
    for a, b in spans:
        grid.update(range(a, b))
    rng.shuffle(spans)
    assert e2e.busy_ms(spans) == pytest.approx(len(grid) / 1e3)
    assert e2e.busy_ms([]) == 0.0
    assert e2e.busy_ms([(0.0, 5.0), (5.0, 7.0), (2.0, 3.0)]) == pytest.approx(7e-3)


def test_ddtree_depth_decay_defaults_agree():
    """``specattn generate``'s and ``specattn bench e2e``'s ``--ddtree-depth-decay`` default to
    SpecConfig's and E2EConfig's value (one default, whatever the entry point)."""
    import typer.main
    root = typer.main.get_command(cli.app)
    want = SpecConfig().ddtree_depth_decay
    assert e2e.E2EConfig().ddtree_depth_decay == want
    for path in (["generate"], ["bench", "e2e"]):
        cmd = root
        for name in path:
            cmd = cmd.commands[name]
        (param,) = [p for p in cmd.params if p.name == "ddtree_depth_decay"]
        assert param.default == want, path
