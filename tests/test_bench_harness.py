"""The bench harness on the CPU: statistics, the case registry, the kv-move cases' results,
and the report rendering. (Timing itself needs CUDA: ``pytest bench --benchmark-only``.)"""
import json

import pytest
import torch
from rich.console import Console

from specattn.bench import cases, harness, runner


# ------------------------------------------------------------------ statistics


def test_median():
    assert harness.median([3.0, 1.0, 2.0]) == 2.0
    assert harness.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError):
        harness.median([])


def test_rates_and_percentages():
    assert harness.gbps(2_000_000_000, 1e-3) == pytest.approx(2000.0)
    assert harness.tflops(2 * 8192 ** 3, 1.4e-3) == pytest.approx(785.4, rel=1e-3)
    assert harness.gbps(0, 1.0) is None and harness.tflops(0, 1.0) is None
    with pytest.raises(ValueError):
        harness.gbps(1, 0.0)
    assert harness.pct_of(1500.0, 3000.0) == pytest.approx(50.0)
    assert harness.pct_of(None, 3000.0) is None
    assert harness.pct_of(10.0, 0.0) is None


def test_summarize():
    times_ms = [i * 1e-3 for i in range(101, 0, -1)]  # 1..101 us, unsorted
    ceil = harness.Ceilings(copy_gbps=2000.0, matmul_tflops=800.0)
    r = harness.summarize("x", times_ms, nbytes=51_000_000, flops=0, ceilings=ceil, mode="eager")
    assert r.median_us == pytest.approx(51.0)
    assert r.p10_us == pytest.approx(11.0) and r.p90_us == pytest.approx(91.0)
    assert r.gbps == pytest.approx(1000.0)  # 51 MB in 51 us
    assert r.pct_copy_bw == pytest.approx(50.0)
    assert r.tflops is None and r.pct_matmul is None
    assert r.iters == 101
    d = r.to_dict()
    assert d["mode"] == "eager" and "meta" not in d and d["name"] == "x"

    r = harness.summarize("mm", [2.0, 2.0], nbytes=0, flops=int(1.6e12), ceilings=ceil)
    assert r.tflops == pytest.approx(800.0) and r.pct_matmul == pytest.approx(100.0)
    assert r.gbps is None and r.pct_copy_bw is None
    r = harness.summarize("nc", [1.0, 1.0], nbytes=10 ** 9, flops=0, ceilings=None)
    assert r.gbps == pytest.approx(1000.0) and r.pct_copy_bw is None
    with pytest.raises(ValueError):
        harness.summarize("x", [1.0], 1, 0, ceil)


def test_needs_l2_flush():
    l2 = 50 * 2 ** 20
    assert harness.needs_l2_flush(8, 36 * 2 ** 20, l2) is False  # 288 MiB rotated
    assert harness.needs_l2_flush(1, 10 * 2 ** 20, l2) is True
    assert harness.needs_l2_flush(4, 25 * 2 ** 20, l2) is False  # exactly 2x L2
    assert harness.needs_l2_flush(1, 0, l2) is True


def test_timing_guards(monkeypatch):
    prep = harness.Prepared(runners=[lambda: None], flush=None, mode="eager")
    with pytest.raises(ValueError, match=">= 50"):
        harness.time_prepared(prep, iters=harness.MIN_ITERS - 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        harness.prepare(cases.Workload(fn=lambda: None, bytes=1))
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        harness.measure_ceilings()


def test_prepared_graphs_keep_their_workload_alive(monkeypatch):
    """A captured graph replays into the workload's tensors: dropping the workload after
    ``prepare`` (as a loop over several configurations does) must not free them."""
    import gc
    import weakref

    class Graph:
        def replay(self):
            pass
    monkeypatch.setattr(harness, "require_cuda", lambda: None)
    monkeypatch.setattr(harness, "_capture", lambda calls: [Graph() for _ in calls])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(harness, "l2_cache_bytes", lambda *a: 1 << 20)
    wl = cases.Workload(fn=lambda x: None, bytes=1, input_sets=[(torch.zeros(3),), (torch.ones(3),)])
    ref = weakref.ref(wl)
    prep = harness.prepare(wl, use_graph=True, flush_l2=False, warmup=1)
    del wl
    gc.collect()
    assert prep.mode == "cuda-graph" and len(prep.runners) == 2
    assert ref() is not None
    del prep
    gc.collect()
    assert ref() is None


# ------------------------------------------------------------------ registry


def test_registry_add_build_and_errors(monkeypatch):
    monkeypatch.setattr(cases, "CASES", {})
    seen = {}

    @cases.case("toy", "a toy case", n=4, scale=2.0)
    def _toy(device, *, n, scale):
        seen.update(device=device, n=n, scale=scale)
        x = torch.ones(n, device=device)
        return cases.Workload(fn=lambda: x.mul_(scale), bytes=2 * x.nbytes)

    assert cases.case_names() == ["toy"]
    wl = cases.get_case("toy").build("cpu", n=8)
    assert seen == {"device": torch.device("cpu"), "n": 8, "scale": 2.0}
    assert wl.bytes == 64 and wl.flops == 0
    with pytest.raises(ValueError, match="no parameter"):
        cases.get_case("toy").build("cpu", m=1)
    with pytest.raises(KeyError, match="toy"):
        cases.get_case("nope")
    with pytest.raises(ValueError, match="already registered"):
        cases.case("toy", "again")(_toy)


def test_workload_calls_rotate_input_sets():
    got = []
    wl = cases.Workload(fn=lambda a, b: got.append((a, b)), bytes=1,
                        input_sets=[(1, 2), (3, 4)])
    calls = wl.calls()
    assert len(calls) == 2
    for c in calls:
        c()
    assert got == [(1, 2), (3, 4)]
    plain = cases.Workload(fn=lambda: got.append("plain"), bytes=1)
    assert plain.calls() == [plain.fn]


def test_kv_move_cases_registered_with_expected_defaults():
    mla = cases.get_case("kv_move_reference").params
    assert (mla["layers"], mla["kv_per_layer"], mla["heads"], mla["width"], mla["tokens"]) == (
        61, 1, 1, 576, 256)
    mha = cases.get_case("kv_move_reference_mha").params
    assert (mha["layers"], mha["kv_per_layer"], mha["heads"], mha["width"]) == (32, 2, 8, 128)
    assert mla["dtype"] == mha["dtype"] == "bfloat16"
    assert {c["name"] for c in runner.list_cases()} >= {"kv_move_reference",
                                                        "kv_move_reference_mha"}


@pytest.mark.parametrize("name", ["kv_move_reference", "kv_move_reference_mha"])
def test_kv_move_case_moves_rows_on_cpu(name):
    c = cases.get_case(name)
    small = dict(layers=3, tokens=5, width=16, input_sets=3, dtype="float32")
    wl = c.build("cpu", **small)
    buffers = wl.state["buffers"]
    kv, heads = c.params["kv_per_layer"], c.params["heads"]
    slots = 2 * 5 * 3
    assert len(buffers) == 3 * kv
    assert all(b.shape == (slots, heads, 16) for b in buffers)
    assert wl.bytes == 2 * 5 * heads * 16 * 4 * 3 * kv  # rows read + written, fp32
    assert wl.flops == 0
    # all slots of all sets distinct and in range: rotating never re-touches a row
    every = torch.cat([torch.cat(s) for s in wl.input_sets])
    assert every.numel() == slots and torch.unique(every).numel() == slots

    for call, (tgt, src) in zip(wl.calls(), wl.input_sets):
        before = [b.clone() for b in buffers]
        call()
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[tgt] = False
        for b, old in zip(buffers, before):
            assert torch.equal(b[tgt], old[src])
            assert torch.equal(b[untouched], old[untouched])
            assert not torch.equal(b, old)  # random data: the move changed something


def test_kv_move_case_bf16_bytes():
    wl = cases.get_case("kv_move_reference").build("cpu", layers=2, tokens=4, input_sets=2)
    assert wl.state["buffers"][0].dtype == torch.bfloat16
    assert wl.bytes == 2 * 4 * 576 * 2 * 2  # read+write x tokens x row bytes x layers


# ------------------------------------------------------------------ report


def _report():
    return {
        "device": {"name": "Fake GPU"}, "versions": {"torch": "x"}, "timestamp": "2026-01-01",
        "settings": {}, "ceilings": {"copy_gbps": 3000.0, "matmul_tflops": 800.0},
        "cases": [harness.summarize("kv_move_reference", [0.05, 0.05, 0.05], 45_000_000, 0,
                                    harness.Ceilings(3000.0, 800.0), mode="cuda-graph",
                                    note="", flush_l2=False, description="d", params={}).to_dict()],
    }


def test_render_and_write_report(tmp_path):
    rep = _report()
    console = Console(record=True, width=200)
    runner.render_report(rep, console)
    text = console.export_text()
    assert "kv_move_reference" in text and "Fake GPU" in text
    assert "50.0" in text  # median us
    assert "900" in text and "30.0" in text  # 45 MB / 50 us = 900 GB/s = 30% of 3000
    path = tmp_path / "r.json"
    runner.write_json(rep, str(path))
    back = json.loads(path.read_text())
    assert back["cases"][0]["gbps"] == pytest.approx(900.0)
    assert back["cases"][0]["pct_matmul"] is None
