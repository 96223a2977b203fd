"""End to end on the real model (SmolLM2-135M-Instruct GGUF), float32, CPU: our target-only
greedy equals HF transformers' greedy token for token, and EAGLE chains and trees equal our
target-only greedy (lossless), on a batch of chat prompts of different lengths.

Every engine runs on the ``--backend`` of the test run (default ``torch_reference``;
``tests/runtime_backend.py``): with a Triton backend on a CPU-only machine the real-model
tests skip (interpreter too slow) and the tiny random-model tests run in the interpreter."""
import random

import pytest
import torch

from runtime_backend import (SHIPPED_IDS, SHIPPED_SPECS, check_rows_restored, make_engine,
                            skip_real_model_if_interpreted)
from specattn.spec_runtime.engine import SpecConfig, default_min_free_slots
from specattn.spec_runtime.loader import LlamaConfig, apply_chat_template, hf_greedy, load_hf_dir, write_random_hf_dir
from specattn.spec_runtime.sampling import SamplingParams

PROMPTS = ["What is the capital of France?",
           "Write a haiku about the sea.",
           "List three prime numbers and explain why each is prime, briefly."]
NEW = 32


@pytest.fixture(scope="module")
def chat_ids(tokenizer):
    return [apply_chat_template(tokenizer, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def target_greedy(gguf_loaded, chat_ids, backend_name):
    skip_real_model_if_interpreted(backend_name)
    cfg, w = gguf_loaded
    eng = make_engine(backend_name, cfg, dict(w), spec=SpecConfig("none"), max_context=256)
    return eng.generate(chat_ids, SamplingParams(max_new_tokens=NEW)).tokens


@pytest.mark.slow
def test_target_greedy_matches_hf(hf_oracle, chat_ids, target_greedy):
    assert len({len(c) for c in chat_ids}) == len(chat_ids)  # mixed lengths in one batch
    for ids, ours in zip(chat_ids, target_greedy):
        assert ours == hf_greedy(hf_oracle, ids, NEW)


EAGLE = [SpecConfig("eagle", topk=1, num_steps=3, num_draft_tokens=4, draft_layers=24),
         SpecConfig("eagle", topk=2, num_steps=3, num_draft_tokens=6, draft_layers=24),
         SpecConfig("eagle", topk=4, num_steps=4, num_draft_tokens=12, draft_layers=24)]


@pytest.mark.slow
@pytest.mark.parametrize("spec", EAGLE, ids=lambda s: f"topk{s.topk}-steps{s.num_steps}-d{s.num_draft_tokens}")
def test_eagle_lossless(gguf_loaded, chat_ids, target_greedy, spec, backend_name):
    cfg, w = gguf_loaded
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=256)
    assert eng.target_backend.name == eng.draft_backend.name == backend_name
    res = eng.generate(chat_ids, SamplingParams(max_new_tokens=NEW))
    assert res.tokens == target_greedy
    rounds = [a for per in res.accept_lengths for a in per]
    cap = min(spec.num_steps, spec.num_draft_tokens - 1)
    assert 0 in rounds and any(0 < a < cap for a in rounds) and cap in rounds, rounds
    assert res.num_forward_target < len(chat_ids) * NEW  # fewer target forwards than tokens


def test_requests_stop_on_their_own(gguf_loaded, chat_ids, target_greedy, backend_name):
    """Per-request limits and EOS: each request is a prefix of its unlimited output, the
    others go on, and the rows hold their reserved slots again."""
    cfg, w = gguf_loaded
    eos = target_greedy[0][5]  # pretend this token is an EOS: request 0 stops there
    eng = make_engine(backend_name, cfg, dict(w), spec=EAGLE[1], max_context=256, eos_token_ids=[eos])
    res = eng.generate(chat_ids, SamplingParams(max_new_tokens=NEW), max_new_tokens=[NEW, 7, 20])
    assert res.tokens[0] == target_greedy[0][:target_greedy[0].index(eos) + 1]
    assert res.finish_reasons[0] == "eos"
    for i, n in ((1, 7), (2, 20)):
        want = target_greedy[i][:n]
        if eos in want:
            want = want[:want.index(eos) + 1]
        assert res.tokens[i] == want
    check_rows_restored(eng)


@pytest.mark.parametrize("spec", [SpecConfig("eagle", 1, 1, 2, 1), SpecConfig("eagle", 3, 2, 7, 2),
                                  SpecConfig("eagle", 2, 5, 6, 3)], ids=str)
def test_eagle_lossless_random_models(tmp_path, spec, backend_name):
    """Fresh random tiny models and prompts each run: eagle == target-only greedy."""
    seed = random.randrange(2**31)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=bool(seed % 2), eos_token_ids=[])
    cfg, w = load_hf_dir(write_random_hf_dir(tmp_path, cfg, seed=seed))
    rng = random.Random(seed)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 4))]
    base = make_engine(backend_name, cfg, dict(w), max_context=128).generate(
        prompts, SamplingParams(max_new_tokens=24))
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=128)
    assert eng.target_backend.name == eng.draft_backend.name == backend_name
    res = eng.generate(prompts, SamplingParams(max_new_tokens=24))
    assert res.tokens == base.tokens, f"seed={seed}"


def test_eagle_with_a_separate_draft_checkpoint(tmp_path, backend_name):
    """A separate small draft model (other weights, fewer layers, same vocabulary)."""
    from specattn.spec_runtime.model import LlamaModel
    seed = random.randrange(2**31)
    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, eos_token_ids=[])
    cfg, w = load_hf_dir(write_random_hf_dir(tmp_path / "t", LlamaConfig(num_hidden_layers=4, **kw), seed=seed))
    dcfg, dw = load_hf_dir(write_random_hf_dir(tmp_path / "d", LlamaConfig(num_hidden_layers=1, **kw), seed=seed + 1))
    rng = random.Random(seed)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    p = SamplingParams(max_new_tokens=20)
    base = make_engine(backend_name, cfg, dict(w), max_context=128).generate(prompts, p)
    draft = LlamaModel(dcfg, dw)
    eng = make_engine(backend_name, cfg, dict(w), spec=SpecConfig("eagle", 2, 3, 6), max_context=128,
                      draft_model=draft)
    assert eng.draft is draft and eng.draft_pool.layer_num == 1
    assert eng.draft_backend.name == backend_name and eng.draft_backend.kv_pool is eng.draft_pool
    assert eng.generate(prompts, p).tokens == base.tokens, f"seed={seed}"
    bad = LlamaModel(LlamaConfig(num_hidden_layers=1, **{**kw, "vocab_size": 97}),
                     {k: v for k, v in load_hf_dir(write_random_hf_dir(
                         tmp_path / "b", LlamaConfig(num_hidden_layers=1, **{**kw, "vocab_size": 97})))[1].items()})
    with pytest.raises(ValueError):
        make_engine(backend_name, cfg, dict(w), spec=SpecConfig("eagle", 2, 3, 6), max_context=128, draft_model=bad)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SHIPPED_SPECS, ids=SHIPPED_IDS)
def test_shipped_drafter_lossless(gguf_loaded, chat_ids, target_greedy, spec, backend_name):
    """The EAGLE-3 and DFlash drafters shipped for this model (trained by ``specattn drafter
    train``): float32 output == target-only greedy (chains, an EAGLE tree, a DDTree), and
    they accept drafts."""
    from specattn.spec_runtime.cli import default_drafter, drafter_factory
    cfg, w = gguf_loaded
    path = default_drafter(cfg, spec.algo)
    if path is None:
        pytest.skip(f"no {spec.algo} drafter is shipped for this model")
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=256,
                      draft_model=drafter_factory(path, "cpu", torch.float32))
    res = eng.generate(chat_ids, SamplingParams(max_new_tokens=NEW))
    assert res.tokens == target_greedy
    assert res.mean_accept_length > (1.5 if spec.algo == "eagle" else 1.3), res.mean_accept_length


def continuous_batching_case(tmp_path, spec, backend_name, lo, hi):
    """A tiny random model, ``lo..hi`` random prompts with limits of 1-20 tokens (some finish
    at their first token), and what a batch of their own gives: ``(seed, config, weights,
    prompts, limits, GenerateResult)``."""
    from tiny_models import tiny_llama
    seed = random.randrange(2**31)
    cfg, w = tiny_llama(tmp_path, seed, vocab=96, layers=3)
    rng = random.Random(seed)
    n = rng.randint(lo, hi)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    limits = [rng.choice([1, 2, 7, 20]) for _ in range(n)]
    want = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=128, max_batch=n).generate(
        prompts, SamplingParams(max_new_tokens=20), max_new_tokens=limits)
    return seed, cfg, w, prompts, limits, want


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig("eagle", 1, 3, 4), SpecConfig("eagle", 3, 3, 8, 2),
                                  SpecConfig("dflash", block_size=4), SpecConfig("ngram", 2, 2, 5)], ids=str)
def test_more_prompts_than_rows(tmp_path, spec, backend_name):
    """More prompts than ``max_batch``: the waiting ones take the rows of finished requests
    (continuous batching) and every request gets exactly what a batch of its own would:
    different lengths and limits (some finish at their first token), rows reused several
    times, and the rows restored afterwards."""
    seed, cfg, w, prompts, limits, want = continuous_batching_case(tmp_path, spec, backend_name, 5, 9)
    n = len(prompts)
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=128, max_batch=2)
    got = eng.generate(prompts, SamplingParams(max_new_tokens=20), max_new_tokens=limits)
    assert got.tokens == want.tokens, f"seed={seed}"
    assert [len(t) for t in got.tokens] == limits and got.finish_reasons == ["length"] * n
    check_rows_restored(eng)
    # an EOS that request 0 samples as its root: it (and any other) stops there, rounds queued
    # for it before its root was read are dropped
    eos = [want.tokens[0][0]]
    kw = dict(spec=spec, max_context=128, eos_token_ids=eos)
    want = make_engine(backend_name, cfg, dict(w), max_batch=n, **kw).generate(
        prompts, SamplingParams(max_new_tokens=20), max_new_tokens=limits)
    got = make_engine(backend_name, cfg, dict(w), max_batch=2, **kw).generate(
        prompts, SamplingParams(max_new_tokens=20), max_new_tokens=limits)
    assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons, f"seed={seed}"
    assert got.tokens[0] == eos and got.finish_reasons[0] == "eos"


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig("eagle", 1, 3, 4), SpecConfig("eagle", 3, 3, 8, 2),
                                  SpecConfig("dflash", block_size=4), SpecConfig("ngram", 2, 2, 5)], ids=str)
def test_overlapped_loop(tmp_path, spec, backend_name):
    """The host loop of whole-round graphs (``overlap``: round ``n + 1`` queued before round
    ``n`` is read), run here on eager rounds: continuous batching with EOS and length stops
    gives every request what a batch of its own would, tokens of finished requests'
    in-flight rounds are dropped, and a request the rounds in flight surely finish joins no
    further round (plain decoding spends exactly one step per generated token past the root)."""
    seed, cfg, w, prompts, limits, want = continuous_batching_case(tmp_path, spec, backend_name, 5, 9)
    limits[:3] = [2, 7, 1]    # a root and one round, a longer one, a root alone
    n = len(prompts)
    for eos in ([], [want.tokens[0][0]]):
        kw = dict(spec=spec, max_context=128, eos_token_ids=eos)
        ref = make_engine(backend_name, cfg, dict(w), max_batch=n, **kw).generate(
            prompts, SamplingParams(max_new_tokens=20), max_new_tokens=limits)
        for max_batch in (1, 2):
            eng = make_engine(backend_name, cfg, dict(w), max_batch=max_batch, overlap=True, **kw)
            got = eng.generate(prompts, SamplingParams(max_new_tokens=20), max_new_tokens=limits)
            assert got.tokens == ref.tokens and got.finish_reasons == ref.finish_reasons, \
                f"seed={seed} max_batch={max_batch} eos={eos}"
            check_rows_restored(eng)
            if spec.algo == "none" and not eos and max_batch == 1:   # no wasted step at a length limit
                assert got.num_rounds == sum(m - 1 for m in limits)
    assert make_engine(backend_name, cfg, dict(w), spec=spec, max_context=128).overlap is None


def test_rows_to_launch():
    """A request joins the next round unless the rounds in flight surely finish it."""
    from specattn.spec_runtime.engine import Engine, Request
    a, b, c = (Request(i, [1], row=i, max_new_tokens=m) for i, m in enumerate((4, 4, 9)))
    a.output, b.output, c.output = [5, 6, 7], [5, 6], [5]
    assert Engine.rows_to_launch([a, b, c], []) == [a, b, c]
    assert Engine.rows_to_launch([a, b, c], [[a, b, c]]) == [b, c]          # a: 3 + 1 >= 4
    assert Engine.rows_to_launch([a, b, c], [[a, b, c], [b, c]]) == [c]     # b: 2 + 2 >= 4
    assert Engine.rows_to_launch([a, b], [[a, b], [a, b]]) == []
    assert Engine.rows_to_launch([a, b, c], [], [a]) == [b, c]               # a's root is still to come


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig("eagle", 1, 3, 4), SpecConfig("eagle", 3, 3, 8, 2),
                                  SpecConfig("dflash", block_size=4), SpecConfig("ngram", 2, 2, 5)], ids=str)
def test_per_mode_graph_plan(tmp_path, spec, monkeypatch):
    """Backends that plan on the host (FlashInfer, FlashMLA) get per-mode graphs: the engine
    asks the strategy for its plan, sizes each backend's graph state for every entry and
    makes one runner per (model, mode).  Run on a CPU with the capture itself stubbed out:
    every plan entry names a model, a backend of its role, a capturable mode and sizes."""
    import specattn.spec_runtime.engine as engine_mod
    from specattn.spec_runtime.engine import Engine
    from tiny_models import tiny_llama
    cfg, w = tiny_llama(tmp_path, 0, vocab=96, layers=3)
    from specattn.spec_runtime.model import LlamaModel
    eng = Engine(LlamaModel(cfg, dict(w), "cpu"), spec=spec, max_context=64, max_batch=3)
    runners, states = [], []
    monkeypatch.setattr(engine_mod.GraphRunner, "__init__",
                        lambda self, model, backend, mode, D, sizes, pool: runners.append((model, backend, mode, D,
                                                                                            list(sizes))))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    for role in ("target", "draft"):
        be = eng.backend_of(role) if role == "target" or eng.draft is not None else None
        if be is not None:
            monkeypatch.setattr(be, "device_metadata", False, raising=False)
            monkeypatch.setattr(be, "init_cuda_graph_state", lambda bs, nt, _be=be: states.append((_be, bs, nt)))
    eng._plan_graphs()
    assert not eng.whole_round_graphs
    plan = eng.strategy.per_mode_graph_plan(eng)
    assert len(runners) == len(plan) and eng.graph_modes
    for (role, model, backend, mode, D, bs), got in zip(plan, runners):
        assert backend is eng.backend_of(role) and model in (eng.target, eng.draft) and D >= 1 and bs >= 3
        assert got == (model, backend, mode, D, [s for s in got[4] if s <= bs]) and got[4][-1] >= bs
        assert any(b is backend and n >= D for b, _, n in states)


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig("eagle", 3, 3, 8, 2), SpecConfig("ngram", 2, 2, 5)],
                         ids=str)
def test_admission_batching(tmp_path, spec, backend_name):
    """``min_free_slots > 1``: freed rows wait for others before one shared prefill, and
    every request still gets what a batch of its own would; ``max_admission_delay=0`` is the
    schedule of ``min_free_slots=1``; the rule itself on its edges."""
    seed, cfg, w, prompts, limits, want = continuous_batching_case(tmp_path, spec, backend_name, 8, 12)
    n = len(prompts)
    prefills = {}
    for m, delay in ((1, 16), (3, 1000), (3, 2), (4, 0)):
        eng = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=128, max_batch=4,
                          min_free_slots=m, max_admission_delay=delay)
        sizes = []
        orig = eng._prefill
        eng._prefill = lambda reqs, defer=False: (sizes.append(len(reqs)), orig(reqs, defer))[1]
        got = eng.generate(prompts, SamplingParams(max_new_tokens=20), max_new_tokens=limits)
        assert got.tokens == want.tokens, f"seed={seed} min_free_slots={m} delay={delay}"
        check_rows_restored(eng)
        assert sum(sizes) == n and sizes[0] == 4
        prefills[m, delay] = len(sizes)
    assert prefills[4, 0] == prefills[1, 16], (f"seed={seed}", prefills)   # no delay: the same schedule
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=128, max_batch=4, min_free_slots=3,
                      max_admission_delay=5)
    assert eng.admission_due(running=0, free=1, waiting=9, rounds_held=0)      # nothing runs: admit
    assert not eng.admission_due(running=3, free=1, waiting=9, rounds_held=4)
    assert eng.admission_due(running=3, free=1, waiting=9, rounds_held=5)      # waited long enough
    assert eng.admission_due(running=1, free=3, waiting=9, rounds_held=0)
    assert eng.admission_due(running=3, free=1, waiting=1, rounds_held=0)      # all the queue fits
    assert not eng.admission_due(running=2, free=2, waiting=5, rounds_held=0)
    assert make_engine(backend_name, cfg, dict(w), spec=spec, max_context=128, max_batch=4).min_free_slots == 1
    assert [default_min_free_slots(b) for b in (1, 2, 4, 6, 7, 8, 16, 24, 64, 256)] == [1, 1, 1, 1, 2, 2, 3, 4, 7, 15]
    with pytest.raises(ValueError, match="max_batch"):
        default_min_free_slots(0)
    for bad in (dict(min_free_slots=0), dict(min_free_slots=5), dict(max_admission_delay=-1)):
        with pytest.raises(ValueError, match="min_free_slots|max_admission_delay"):
            make_engine(backend_name, cfg, dict(w), spec=spec, max_context=128, max_batch=4, **bad)


def test_generate_input_errors(tmp_path, seed, backend_name):
    """Prompt ids outside the vocabulary (a negative one would index the embedding from its
    end) or not ints (a float would be truncated), non-int limits, bad sampling parameters
    and an empty prompt are clear errors before anything runs; EOS ids given as 0-d tensors
    or numpy ints stop generation like ints; a prompt given as a tensor equals its list."""
    import numpy as np
    from tiny_models import tiny_llama
    cfg, w = tiny_llama(tmp_path, seed, vocab=96, layers=2)
    eng = make_engine(backend_name, cfg, dict(w), max_context=64)
    p = SamplingParams(max_new_tokens=4)
    for prompt, exc, msg in (([1, -1], ValueError, r"token id -1, outside the vocabulary \[0, 96\)"),
                             ([1, 96], ValueError, "token id 96"), ([1, 2.7], TypeError, "int token ids"),
                             ([[1, 2]], TypeError, "int token ids"), (["a"], TypeError, "int token ids"),
                             ([], ValueError, "prompt 1 is empty")):
        with pytest.raises(exc, match=msg):
            eng.generate([[3, 4], prompt], p)
    with pytest.raises(TypeError, match="max_new_tokens must be ints"):
        eng.generate([[1, 2]], p, max_new_tokens=[2.5])
    with pytest.raises(ValueError, match=r"\+ 3 positions one round may write past them does not fit max_context 64"):
        eng.generate([[1] * 52], SamplingParams(max_new_tokens=10))
    for kw, exc in ((dict(top_p=0.0), ValueError), (dict(top_p=-1.0), ValueError),
                    (dict(temperature=float("nan")), ValueError), (dict(temperature=-0.5), ValueError),
                    (dict(max_new_tokens=2.5), TypeError), (dict(top_k=True), TypeError), (dict(seed=1.5), TypeError)):
        with pytest.raises(exc):
            SamplingParams(**kw)
    out = eng.generate([[5, 6, 7]], p).tokens[0]
    assert eng.generate([torch.tensor([5, 6, 7])], p).tokens[0] == out
    stop = out[1]
    for ids in ([stop], [torch.tensor(stop)], [np.int64(stop)], torch.tensor([stop])):
        got = make_engine(backend_name, cfg, dict(w), max_context=64, eos_token_ids=ids).generate([[5, 6, 7]], p)
        assert got.tokens[0] == out[:out.index(stop) + 1], ids
    for bad in (["</s>"], 5, [True], "12"):
        with pytest.raises(TypeError, match="eos_token_ids must be a sequence of int token ids"):
            make_engine(backend_name, cfg, dict(w), max_context=64, eos_token_ids=bad)
    for bad in ([96], [-1]):   # an EOS that cannot occur would never end a request
        with pytest.raises(ValueError, match=r"eos_token_ids must lie in the vocabulary \[0, 96\)"):
            make_engine(backend_name, cfg, dict(w), max_context=64, eos_token_ids=bad)
    for prompt in ([True, False], torch.tensor([True, False]), np.array([True, False]), torch.tensor(5)):
        with pytest.raises(TypeError, match="prompt 0 must be a sequence of int token ids"):
            eng.generate([prompt], p)
    with pytest.raises(TypeError, match="prompts must be a sequence"):
        eng.generate((x for x in [[1, 2]]), p)
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        eng.generate([[1, 2]], {"max_new_tokens": 3})
    with pytest.raises(TypeError, match="max_new_tokens must be a sequence of per-prompt limits"):
        eng.generate([[1, 2]], p, max_new_tokens=3)
    for seed in (-1, 2 ** 64):   # torch's generator would wrap -1 onto 2**64 - 1
        with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
            SamplingParams(temperature=1.0, seed=seed)
    assert eng.generate([[5, 6, 7]], p).tokens[0] == out              # still usable after the refusals


def test_engine_and_spec_config_types(tmp_path, seed, backend_name):
    """Sizes that are not ints (floats, bools, strings) are TypeErrors naming the field, not
    torch errors from deep inside; ``draft_layers=0`` is refused, not the default; a topk
    over the vocabulary is refused at construction (it used to fail inside generate)."""
    import numpy as np
    from tiny_models import tiny_llama
    cfg, w = tiny_llama(tmp_path, seed, vocab=96, layers=2)
    for kw in (dict(topk=2.0), dict(num_steps="3"), dict(num_draft_tokens=True), dict(block_size=2.5),
               dict(ngram_size=1.0), dict(draft_layers=1.5), dict(ddtree_depth_decay=True)):
        name = next(iter(kw))
        with pytest.raises(TypeError, match=f"{name} must be"):
            SpecConfig(**{**dict(algo="eagle", topk=2, num_steps=3, num_draft_tokens=6), **kw}).validate()
    SpecConfig("dflash", block_size=4, topk=2, num_draft_tokens=4, ddtree_depth_decay=np.float32(0.5)).validate()
    SpecConfig("eagle", np.int64(2), 3, 6).validate()
    for algo in ("eagle", "dflash"):
        with pytest.raises(ValueError, match="draft_layers must be >= 1"):
            SpecConfig(algo, draft_layers=0).validate()
    with pytest.raises(ValueError, match="draft_layers must be in \\[1, 2\\]"):
        make_engine(backend_name, cfg, dict(w), spec=SpecConfig("eagle", 1, 3, 4, draft_layers=3), max_context=64)
    with pytest.raises(ValueError, match="topk=100 exceeds the 96-token vocabulary"):
        make_engine(backend_name, cfg, dict(w), spec=SpecConfig("eagle", 100, 1, 101, 2), max_context=512)
    for kw in (dict(max_batch=2.0), dict(max_context=64.0), dict(max_batch=True), dict(min_free_slots=1.5),
               dict(max_admission_delay=1.5), dict(page_size=1.0)):
        with pytest.raises(TypeError, match=f"{next(iter(kw))} must be an int"):
            make_engine(backend_name, cfg, dict(w), **{"max_context": 64, **kw})
    with pytest.raises(ValueError, match="max_context must be >= 1"):
        make_engine(backend_name, cfg, dict(w), max_context=0)
    with pytest.raises(TypeError, match="spec must be a SpecConfig"):
        make_engine(backend_name, cfg, dict(w), spec="eagle", max_context=64)
