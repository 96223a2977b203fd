"""The engine's backend handling and the timing path of ``specattn generate``:

- ``Engine.required_modes`` per algorithm; a backend whose ``supports()`` says no to a needed
  mode (eager) makes construction raise ``UnsupportedError`` naming every missing (model,
  mode, kind); under CUDA graphs a mode it cannot capture runs eagerly (``eager_routed``) and
  the output is unchanged (gpu);
- ``measured_generate`` warms up with the same generation and times only the measured one;
  the JSON report says whether warm-up ran and which backend target and drafter used;
- the ``generate`` command end to end on a tiny random model (its loader stubbed), CPU.
"""
import json

import pytest
from typer.testing import CliRunner

from specattn.backends import ForwardMode, TorchReferenceBackend, UnsupportedError
from specattn.spec_runtime import engine as engine_mod
from specattn.spec_runtime.engine import Engine, SpecConfig
from tiny_models import random_prompts, tiny_llama
from specattn.spec_runtime.sampling import SamplingParams

V = 96
M = ForwardMode


@pytest.fixture
def tiny(tmp_path, seed):
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    return cfg, w, random_prompts(seed, V)


def restricted_backend(monkeypatch, eager_no=(), graph_no=(), device_metadata=True):
    """Make the engine build a reference backend that says no to ``eager_no`` modes (eager and
    graph) and to ``graph_no`` modes in graphs (and, with ``device_metadata=False``, claims
    to plan on the host like FlashInfer); returns the list of backends built."""
    built = []

    class Restricted(TorchReferenceBackend):
        name = "restricted"

        @classmethod
        def supports(cls, mode, *, graph, kind):
            if mode in eager_no or (graph and mode in graph_no):
                return False
            return super().supports(mode, graph=graph, kind=kind)

    Restricted.device_metadata = device_metadata

    def create(name, req_pool, kv_pool, **kw):
        built.append(Restricted(req_pool, kv_pool))
        return built[-1]

    monkeypatch.setattr(engine_mod, "create_backend", create)
    return built


# ---------------------------------------------------------------------- supports()
@pytest.mark.parametrize("spec,want", [
    (SpecConfig("none"), [("target", M.EXTEND), ("target", M.DECODE)]),
    (SpecConfig("eagle", 2, 3, 6, 2), [("target", M.EXTEND), ("target", M.TARGET_VERIFY), ("draft", M.EXTEND),
                                       ("draft", M.DRAFT_EXTEND_V2), ("draft", M.DECODE)]),
    (SpecConfig("eagle", 1, 1, 2, 2), [("target", M.EXTEND), ("target", M.TARGET_VERIFY), ("draft", M.EXTEND),
                                       ("draft", M.DRAFT_EXTEND_V2)]),
    (SpecConfig("dflash", block_size=4), [("target", M.EXTEND), ("target", M.TARGET_VERIFY),
                                          ("draft", M.TARGET_VERIFY)]),
], ids=["none", "eagle", "eagle-1step", "dflash"])
def test_required_modes(tiny, spec, want):
    cfg, w, _ = tiny
    eng = Engine(cfg, dict(w), spec=spec, max_context=64)
    assert eng.required_modes() == want
    assert eng.graph_modes == [] and eng.eager_routed == []
    if spec.algo != "none":  # the drafter has its own backend instance over its own pool
        assert eng.draft_backend is not eng.target_backend and eng.draft_backend.kv_pool is eng.draft_pool


def test_unsupported_modes_are_named(tiny, monkeypatch):
    cfg, w, prompts = tiny
    restricted_backend(monkeypatch, eager_no=(M.DRAFT_EXTEND_V2, M.TARGET_VERIFY))
    with pytest.raises(UnsupportedError) as e:
        Engine(cfg, dict(w), spec=SpecConfig("eagle", 2, 3, 6, 2), max_context=64)
    msg = str(e.value)
    assert "'restricted'" in msg and "target TARGET_VERIFY (MHA)" in msg and "draft DRAFT_EXTEND_V2 (MHA)" in msg
    assert "'eagle'" in msg and "DECODE" not in msg
    with pytest.raises(UnsupportedError, match="draft TARGET_VERIFY"):
        Engine(cfg, dict(w), spec=SpecConfig("dflash", block_size=4), max_context=64)
    # target-only needs neither: it runs
    eng = Engine(cfg, dict(w), spec=SpecConfig("none"), max_context=64)
    assert eng.target_backend.name == "restricted"
    assert len(eng.generate(prompts, SamplingParams(max_new_tokens=3)).tokens[0]) == 3


def test_unsupported_kind_is_named(monkeypatch, seed):
    from specattn.spec_runtime.mla_model import MLAConfig, MLAModel

    class NoMLA(TorchReferenceBackend):
        name = "no_mla"

        @classmethod
        def supports(cls, mode, *, graph, kind):
            return kind.name != "MLA"

    monkeypatch.setattr(engine_mod, "create_backend", lambda name, r, k, **kw: NoMLA(r, k))
    with pytest.raises(UnsupportedError, match=r"target EXTEND \(MLA\)"):
        Engine(MLAModel(MLAConfig(vocab_size=64), seed=seed), spec=SpecConfig("eagle", 1, 2, 3, 2), max_context=64)


def test_ready_model_sets_the_pools_device(seed):
    """A ready model brings its device: the request pool and the state follow it (a GPU run
    once put them on the CPU default beside a CUDA model), and a different ``device`` is an
    error, not a silent split."""
    from specattn.spec_runtime.mla_model import MLAConfig, MLAModel
    model = MLAModel(MLAConfig(vocab_size=64), seed=seed)
    eng = Engine(model, spec=SpecConfig("eagle", 1, 2, 3, 2), max_context=64)
    assert eng.req_pool.device == eng.prefix_lens.device == eng.target_pool.device == model.device
    with pytest.raises(ValueError, match="differs from the ready model"):
        Engine(model, device="meta", max_context=64)


@pytest.mark.gpu
def test_graph_routing_runs_uncapturable_modes_eagerly(tiny, monkeypatch):
    """A backend that cannot capture TARGET_VERIFY: the engine graphs the drafter's modes,
    runs the verify eagerly, and the output equals the plain eager engine's."""
    cfg, w, prompts = tiny
    kw = dict(device="cuda", max_context=128, max_batch=len(prompts))
    p = SamplingParams(max_new_tokens=16)
    want = Engine(cfg, dict(w), **kw).generate(prompts, p).tokens
    built = restricted_backend(monkeypatch, graph_no=(M.TARGET_VERIFY,))
    eng = Engine(cfg, dict(w), spec=SpecConfig("eagle", 2, 3, 6, 2), cuda_graph=True, **kw)
    assert [b.name for b in built] == ["restricted", "restricted"]
    assert eng.eager_routed == ["target:TARGET_VERIFY"]
    assert eng.graph_modes == ["draft:DRAFT_EXTEND_V2", "draft:DECODE"]
    assert (id(eng.target), M.TARGET_VERIFY) not in eng.runners and len(eng.runners) == 2
    assert eng.generate(prompts, p).tokens == want
    eng = Engine(cfg, dict(w), spec=SpecConfig("dflash", block_size=4), cuda_graph=True, **kw)
    assert eng.eager_routed == ["draft:TARGET_VERIFY", "target:TARGET_VERIFY"] and not eng.runners
    assert eng.generate(prompts, p).tokens == want


# ---------------------------------------------------------------------- warm-up and report
class StubTokenizer:
    """``encode``: bytes mod the vocabulary; ``decode``: the ids as text."""

    def encode(self, text):
        return [b % V for b in text.encode()][:12] or [1]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_measured_generate_times_only_the_measured_run(tiny, monkeypatch):
    from specattn.spec_runtime.cli import measured_generate, report_dict
    cfg, w, prompts = tiny
    eng = Engine(cfg, dict(w), spec=SpecConfig("eagle", 2, 3, 6, 2), max_context=64)
    calls = []
    real = eng.generate
    monkeypatch.setattr(eng, "generate", lambda *a, **k: calls.append(k.get("progress")) or real(*a, **k))
    params = SamplingParams(max_new_tokens=8)
    res, warm_s = measured_generate(eng, prompts, params, warmup=True, progress=print)
    assert len(calls) == 2 and calls[0] is None and calls[1] is print  # warm-up first, untracked
    assert warm_s > 0 and res.seconds > 0
    assert res.tokens == real(prompts, params).tokens                 # same run, same tokens
    texts = [f"p{i}" for i in range(len(prompts))]
    r = report_dict(eng, res, warm_s, texts=texts, tok=StubTokenizer(), algo="eagle", backend="torch_reference",
                    dtype="float32", topk=2, num_steps=3, num_draft_tokens=6, block_size=16)
    assert r["warmup"] is True and r["warmup_seconds"] == warm_s
    assert r["tokens_per_s"] == pytest.approx(res.num_tokens / res.seconds)
    assert r["target_backend"] == r["draft_backend"] == "torch_reference"
    assert r["cuda_graph"] is False and r["graph_modes"] == [] and r["eager_routed"] == []
    assert r["mean_accept_length"] == res.mean_accept_length and r["block_size"] is None
    calls.clear()
    res, warm_s = measured_generate(eng, prompts, params, warmup=False)
    assert len(calls) == 1 and warm_s is None


def _cli(monkeypatch, tiny, *args):
    from specattn import cli
    from specattn.spec_runtime import cli as rcli
    cfg, w, _ = tiny
    monkeypatch.setattr(rcli, "load_model", lambda model, dtype: (cfg, dict(w), StubTokenizer()))
    return CliRunner().invoke(cli.app, ["generate", "--prompt", "hello there", "--raw",
                                        "--device", "cpu", "--max-new-tokens", "5", *args])


def test_generate_command_json(tiny, monkeypatch):
    res = _cli(monkeypatch, tiny, "--algo", "eagle", "--topk", "2", "--num-draft-tokens", "5",
               "--draft-layers", "2", "--json", "--warmup")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["warmup"] is True and r["warmup_seconds"] > 0 and r["tokens"] == 5
    assert r["target_backend"] == r["draft_backend"] == "torch_reference" and r["draft_layers"] == 2
    res = _cli(monkeypatch, tiny, "--algo", "dflash", "--block-size", "4", "--json")   # CPU default: no warm-up
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["warmup"] is False and r["warmup_seconds"] is None and r["draft_backend"] == "torch_reference"
    res = _cli(monkeypatch, tiny)                                                      # the text report
    assert res.exit_code == 0 and "no warm-up" in res.stdout, res.output
    res = _cli(monkeypatch, tiny, "--prompt", "a second one", "--json")               # --prompt repeated
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["outputs"]) == 2


def test_generate_text_report_prints_text_verbatim(tiny, monkeypatch):
    """The text report prints prompts and generated text as they are: no Rich markup (a
    ``[/b]`` used to crash the command after generating, ``[b]`` tags vanished), no emoji
    codes, no hard wrap of long lines."""
    weird = "x[/b] [b]y[/b] :smile: " + "w" * 200
    monkeypatch.setattr(StubTokenizer, "decode", lambda self, ids, skip_special_tokens=True: weird)
    res = _cli(monkeypatch, tiny, "--prompt", "Explain [/bold] and [green]z[/green]")
    assert res.exit_code == 0, res.output
    assert weird in res.stdout.splitlines()
    assert "Explain [/bold] and [green]z[/green]" in res.stdout


def _error_line(res, code=2):
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == code and len(lines) == 1, (res.exit_code, res.output)
    assert lines[0].startswith("specattn generate: error: "), lines[0]
    return lines[0]


def test_generate_context_length_is_checked(tiny, monkeypatch):
    """Prompt + --max-new-tokens past ``max_position_embeddings`` is refused (it used to run
    past the model's context silently); exactly the context is fine."""
    import dataclasses
    cfg, w, p = tiny
    n = len(StubTokenizer().encode("hello there"))
    short = (dataclasses.replace(cfg, max_position_embeddings=n + 5), w, p)
    res = _cli(monkeypatch, short, "--json")                                     # n + 5 positions
    assert res.exit_code == 0, res.output
    line = _error_line(_cli(monkeypatch, short, "--max-new-tokens", "6"))
    assert f"the longest prompt ({n} tokens) + --max-new-tokens 6 exceeds the model's context of {n + 5}" in line


def test_generate_drafter_options_that_would_not_apply(tiny, monkeypatch):
    """--draft-layers and --draft-vocab are refused where they would be ignored, with the
    target's bounds named."""
    from specattn.spec_runtime import cli as rcli
    line = _error_line(_cli(monkeypatch, tiny, "--algo", "eagle", "--self-draft", "--draft-layers", "5"))
    assert "--draft-layers must be <= 4 (the target's layers), got 5" in line
    line = _error_line(_cli(monkeypatch, tiny, "--algo", "eagle", "--draft-vocab", "16"))   # no EAGLE-3 fits
    assert "--draft-vocab does not apply" in line and "full vocabulary" in line
    line = _error_line(_cli(monkeypatch, tiny, "--algo", "dflash", "--block-size", "4", "--draft-vocab", "16"))
    assert "--draft-vocab does not apply to a random-init DFlash drafter" in line
    res = _cli(monkeypatch, tiny, "--algo", "eagle", "--draft-vocab", "0", "--json")        # 0: all, harmless
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["draft_vocab"] is None
    monkeypatch.setattr(rcli, "default_drafter", lambda cfg, algo="eagle": rcli.DEFAULT_EAGLE3)  # a drafter fits
    line = _error_line(_cli(monkeypatch, tiny, "--algo", "eagle", "--draft-layers", "2"))
    assert "--draft-layers does not apply" in line and "--self-draft" in line
    line = _error_line(_cli(monkeypatch, tiny, "--algo", "eagle", "--draft-vocab", str(V + 1)))
    assert f"--draft-vocab must be <= {V} (the vocabulary), got {V + 1}" in line


def test_generate_without_a_chat_template_names_raw(tiny, monkeypatch):
    from specattn import cli
    from specattn.spec_runtime import cli as rcli
    cfg, w, _ = tiny
    monkeypatch.setattr(rcli, "load_model", lambda model, dtype: (cfg, dict(w), StubTokenizer()))
    res = CliRunner().invoke(cli.app, ["generate", "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "2"])
    assert "the tokenizer has no chat template; use --raw" in _error_line(res)


def test_generate_load_failure_of_a_given_model(tiny, monkeypatch, tmp_path):
    """A given --model that fails to load says so (it used to point at `model fetch`)."""
    from specattn import cli
    from specattn.spec_runtime import cli as rcli
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")

    def load(m, dtype):
        raise NotImplementedError("Dequantization for F64 is not yet implemented")
    monkeypatch.setattr(rcli, "load_model", load)
    res = CliRunner().invoke(cli.app, ["generate", "--prompt", "hi", "--device", "cpu", "--model", str(model)])
    line = _error_line(res, 1)
    assert f"--model {model}: cannot load it (Dequantization for F64" in line and "model fetch" not in line


def test_generate_report_names_only_settings_that_ran(tiny, monkeypatch, tmp_path):
    """The JSON report's speculative fields are None where the algorithm has no such setting,
    ``num_draft_tokens`` is what a round verifies, and the sampling settings and stop tokens
    that ran are reported: a HF folder's tokenizer EOS joins the config's, a GGUF's (the
    default model) does not."""
    cfg, w, p = tiny
    monkeypatch.setattr(StubTokenizer, "eos_token_id", 7, raising=False)
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in ("config.json", "tokenizer.json"):      # what the checks look for; loading is stubbed
        (hf / f).write_text("{}")
    res = _cli(monkeypatch, tiny, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["eos_token_ids"] == [], res.output
    want = {("none",): (None, None, None), ("ngram", "--topk", "2", "--num-steps", "3"): (2, 3, 7),
            ("dflash", "--block-size", "4"): (1, None, 4),
            ("dflash", "--block-size", "4", "--topk", "2", "--num-draft-tokens", "5"): (2, None, 5),
            ("eagle", "--draft-layers", "1"): (1, 3, 4)}
    for args, (topk, steps, tokens) in want.items():
        res = _cli(monkeypatch, tiny, "--algo", *args, "--json", "--model", str(hf))
        assert res.exit_code == 0, (args, res.output)
        r = json.loads(res.stdout)
        assert (r["topk"], r["num_steps"], r["num_draft_tokens"]) == (topk, steps, tokens), args
        assert r["eos_token_ids"] == [7] and r["max_new_tokens"] == 5
        assert r["temperature"] == 0 and r["top_k"] is None and r["seed"] is None
    res = _cli(monkeypatch, tiny, "--temperature", "0.7", "--top-k", "5", "--seed", "3", "--json")
    r = json.loads(res.stdout)
    assert (r["temperature"], r["top_k"], r["top_p"], r["seed"]) == (0.7, 5, 1.0, 3)
    assert not res.stderr.strip()
    res = _cli(monkeypatch, tiny, "--top-k", "5", "--seed", "3", "--json")     # greedy: a note, then the run
    assert res.exit_code == 0 and "--top-k, --seed do nothing at --temperature 0" in res.stderr


def test_generate_prompts_file_lines(tiny, monkeypatch, tmp_path):
    """--prompts: a UTF-8 byte-order mark is dropped and only line ends split prompts (form
    feeds and U+2028 used to split one line into two prompts)."""
    f = tmp_path / "p.txt"
    f.write_bytes("\ufeffWhat is 2+2?\r\n\r\n   \r\nName a color.\x0cAnd a fruit.\r\nSay hi \u2028 please\n".encode())
    from specattn import cli
    from specattn.spec_runtime import cli as rcli
    cfg, w, _ = tiny
    monkeypatch.setattr(rcli, "load_model", lambda model, dtype: (cfg, dict(w), StubTokenizer()))
    res = CliRunner().invoke(cli.app, ["generate", "--prompts", str(f), "--raw", "--device", "cpu",
                                       "--max-new-tokens", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert [o["prompt"] for o in json.loads(res.stdout)["outputs"]] == [
        "What is 2+2?", "Name a color.\x0cAnd a fruit.", "Say hi \u2028 please"]


def test_generate_command_bad_backend(tiny, monkeypatch):
    res = _cli(monkeypatch, tiny, "--backend", "nope")
    assert res.exit_code == 2 and "unknown backend 'nope'" in res.output, res.output


@pytest.mark.parametrize("spec", [SpecConfig("none"), SpecConfig("eagle", 2, 3, 6, 2), SpecConfig("dflash", block_size=4)],
                         ids=["none", "eagle", "dflash"])
def test_batches_carry_host_lengths(tiny, spec, monkeypatch):
    """With a backend that plans on the host (``device_metadata = False``, as FlashInfer),
    every batch the engine runs carries ``prefix_lens_cpu`` / ``extend_lens_cpu`` equal to its
    device lengths (the planner then reads no device value), and the graph buffers pad them
    like the device ones."""
    from specattn.backends import GraphInputBuffers
    cfg, w, prompts = tiny
    seen = []
    real = TorchReferenceBackend.init_forward_metadata
    restricted_backend(monkeypatch, device_metadata=False)

    def init(self, batch):  # every forward of the target and the drafter builds its metadata here
        assert batch.prefix_lens_cpu is not None and batch.extend_lens_cpu is not None, batch.forward_mode
        assert batch.prefix_lens_cpu.tolist() == batch.prefix_lens.tolist()
        assert batch.extend_lens_cpu.tolist() == batch.extend_lens.tolist()
        if batch.forward_mode != M.EXTEND:
            pad = GraphInputBuffers(batch.batch_size + 2, batch.num_tokens_per_req or 1, "cpu").fill(
                batch, batch.batch_size + 2)
            assert pad.prefix_lens_cpu.tolist() == pad.prefix_lens.tolist()
            assert pad.extend_lens_cpu.tolist() == pad.extend_lens.tolist()
        seen.append(batch.forward_mode)
        return real(self, batch)

    monkeypatch.setattr(TorchReferenceBackend, "init_forward_metadata", init)
    eng = Engine(cfg, dict(w), spec=spec, max_context=64)
    eng.generate(prompts, SamplingParams(max_new_tokens=6))
    assert set(seen) == {m for _, m in eng.required_modes()}


@pytest.mark.parametrize("mode", [M.DECODE, M.TARGET_VERIFY, M.DRAFT_EXTEND_V2], ids=lambda m: m.name)
def test_capture_batch_carries_host_lengths(mode):
    """The graph runner's capture batch (empty, padded to bs 3) has host lengths equal to its
    device ones, like every replay batch."""
    from specattn.backends import GraphInputBuffers
    from specattn.spec_runtime.graph_runner import empty_batch
    D = 1 if mode == M.DECODE else 4
    padded = GraphInputBuffers(4, D, "cpu").fill(empty_batch(mode, D, "cpu"), 3)
    assert padded.prefix_lens_cpu.tolist() == padded.prefix_lens.tolist() == [0, 0, 0]
    assert padded.extend_lens_cpu.tolist() == padded.extend_lens.tolist() == [D] * 3


def test_generate_command_ngram_and_ddtree(tiny, monkeypatch):
    """``--algo ngram`` (chains copied from the history) and DFlash trees (``--topk`` > 1)
    run end to end from the command line; n-gram options under another algo are refused."""
    res = _cli(monkeypatch, tiny, "--algo", "ngram", "--topk", "2", "--num-steps", "3", "--ngram-size", "2",
               "--json")
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["algo"] == "ngram" and r["tokens"] == 5 and r["drafter"] is None
    res = _cli(monkeypatch, tiny, "--algo", "dflash", "--topk", "3", "--num-draft-tokens", "8", "--block-size", "4",
               "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["drafter"] == "dflash-random-init"
    res = _cli(monkeypatch, tiny, "--algo", "eagle", "--ngram-size", "3")
    assert res.exit_code == 2 and "--ngram-size" in res.output
