"""``bench/scripts/runtime_matrix.py`` on the CPU: the end-to-end table's bf16 near-greedy
column (:mod:`specattn.spec_runtime.near_greedy`) and its cell format."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _matrix():
    spec = importlib.util.spec_from_file_location("runtime_matrix", ROOT / "bench/scripts/runtime_matrix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_near_greedy_cell():
    cell = _matrix().near_greedy_cell
    assert cell(None) == "-"
    assert cell(dict(max_ratio=0.21, vocab_share=0.004)) == "yes (0.21)"
    assert cell(dict(max_ratio=1.3, vocab_share=0.004)) == "**no** (1.30)"
    assert cell(dict(max_ratio=0.5, vocab_share=0.3)).startswith("**no**")  # no teeth: not a pass


@pytest.mark.slow
def test_bf16_rows_carry_the_near_greedy_measure(gguf_path, tmp_path, monkeypatch):
    """bf16 reference-backend rows on the real model (4 prompts x 4 tokens): each has a
    near-greedy measure over every emitted token, and it passes; float32 rows have none."""
    monkeypatch.chdir(ROOT)
    rc = _matrix().main(["--out", str(tmp_path), "--backends", "torch_reference", "--dtypes", "float32",
                         "bfloat16", "--algos", "none", "eagle_chain", "--repeats", "1",
                         "--max-new-tokens", "4", "--device", "cpu", "--no-warmup"])
    assert rc == 0
    runs = json.loads((tmp_path / "generate.json").read_text())["runs"]
    assert [(r["dtype"], r["name"]) for r in runs] == [("float32", "none"), ("float32", "eagle_chain"),
                                                      ("bfloat16", "none"), ("bfloat16", "eagle_chain")]
    for r in runs:
        ng = r.get("near_greedy")
        if r["dtype"] == "float32":
            assert ng is None
        else:
            assert ng["num_tokens"] == sum(len(o["tokens"]) for o in r["outputs"]) > 0
            assert ng["max_ratio"] <= 1.0 and ng["vocab_share"] <= 0.1
    table = (tmp_path / "generate_summary.md").read_text()
    assert "| near-greedy |" in table and table.count("| yes (") == 2


def test_compare_does_not_depend_on_run_order():
    """'= none' / '= ref' are set from every report present: a reference row that ran after
    the row it checks still counts (an H100 run had the reference last and an empty column)."""
    def rep(backend, name, *toks, **kw):
        return dict(backend=backend, dtype="bfloat16", name=name, outputs=[{"tokens": list(toks)}], **kw)
    reps = [rep("triton", "eagle_chain", 1, 2), rep("triton", "eagle_tree", 1, 4),
            rep("torch_reference", "eagle_chain", 1, 2), rep("torch_reference", "eagle_tree", 1, 2),
            rep("triton", "none", 1, 2), rep("flashinfer", "none", error="boom"),
            rep("torch_reference", "none", 1, 3)]
    _matrix().compare(reps)
    got = [(r.get("same_tokens_as_none"), r.get("same_tokens_as_reference")) for r in reps]
    assert got == [(True, True), (False, False), (False, None), (False, None), (None, False), (None, None),
                   (None, None)]
