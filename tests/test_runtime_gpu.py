"""The runtime's lossless checks on a GPU with CUDA graphs on (marked gpu), float32, on the
``--backend`` of the test run (``tests/runtime_backend.py``; ``--backend triton`` runs the
Triton kernels, whose float32 path is IEEE, no TF32): target and drafter share it."""
import random

import pytest
import torch

from runtime_backend import SHIPPED_IDS, SHIPPED_SPECS, check_rows_restored, make_engine, uses_graphs
from specattn.backends import ForwardMode
from specattn.spec_runtime.engine import SpecConfig
from specattn.spec_runtime.loader import (LlamaConfig, apply_chat_template, hf_greedy, load_hf_dir,
                                          write_random_hf_dir)
from specattn.spec_runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu
SPECS = [SpecConfig("eagle", 1, 3, 4, 24), SpecConfig("eagle", 2, 3, 6, 24), SpecConfig("eagle", 4, 4, 12, 24)]


def _graphed(eng, spec):
    """The engine captured graphs (modes the backend cannot capture run eagerly: listed in
    ``eng.eager_routed``, printed) and the drafter runs on the target's backend."""
    assert uses_graphs(eng), "no CUDA graphs were captured"
    print(f"graphs: {eng.graph_modes}; routed eager: {eng.eager_routed}")
    if spec.algo != "none":
        assert eng.draft_backend.name == eng.target_backend.name
    return eng


def _random_model(tmp_path, max_prompt: int):
    """``(seed, config, weights, 5 random prompts of 1 .. max_prompt tokens)`` of a fresh
    4-layer random Llama (vocabulary 96, no end token)."""
    seed = random.randrange(2**31)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=True, eos_token_ids=[])
    cfg, w = load_hf_dir(write_random_hf_dir(tmp_path, cfg, seed=seed))
    rng = random.Random(seed)
    return seed, cfg, w, [[rng.randrange(96) for _ in range(rng.randint(1, max_prompt))] for _ in range(5)]


def test_graphs_match_eager_random_model(tmp_path, backend_name):
    seed, cfg, w, prompts = _random_model(tmp_path, 12)
    p = SamplingParams(max_new_tokens=24)
    kw = dict(device="cuda", max_context=128, max_batch=5)
    eager = make_engine(backend_name, cfg, dict(w), **kw).generate(prompts, p)
    graph = _graphed(make_engine(backend_name, cfg, dict(w), cuda_graph=True, **kw), SpecConfig())
    graph = graph.generate(prompts, p)
    assert graph.tokens == eager.tokens, f"seed={seed}"
    for spec in (SpecConfig("eagle", 1, 3, 4, 2), SpecConfig("eagle", 3, 3, 8, 3)):
        eng = _graphed(make_engine(backend_name, cfg, dict(w), spec=spec, cuda_graph=True, **kw), spec)
        res = eng.generate(prompts, p)
        assert res.tokens == eager.tokens, f"seed={seed} {spec}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pdl_matches_serialized_launches(tmp_path, backend_name, dtype, monkeypatch):
    """Programmatic dependent launch (the fused layer kernels, attention, its merge and the
    spec ops start while the previous kernel drains) changes no result: the same tokens and accept lengths
    as serialized launches, CUDA graphs on, plain decoding and an EAGLE tree."""
    from specattn.triton_kernels import _util
    seed, cfg, w, prompts = _random_model(tmp_path, 40)
    p = SamplingParams(max_new_tokens=24)
    kw = dict(device="cuda", max_context=128, max_batch=5, cuda_graph=True, dtype=dtype)
    for spec in (SpecConfig(), SpecConfig("eagle", 3, 3, 8, 3)):
        runs = []
        for pdl in (False, True):
            monkeypatch.setattr(_util, "PDL", pdl)
            res = _graphed(make_engine(backend_name, cfg, dict(w), spec=spec, **kw), spec).generate(prompts, p)
            runs.append((res.tokens, res.accept_lengths))
        assert runs[0] == runs[1], f"seed={seed} {spec} {dtype}"


@pytest.fixture(scope="module")
def chat_ids(tokenizer):
    return [apply_chat_template(tokenizer, t) for t in
            ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers and explain why each is prime, briefly."]]


@pytest.fixture(scope="module")
def gpu_target(gguf_loaded, chat_ids, backend_name):
    cfg, w = gguf_loaded
    eng = make_engine(backend_name, cfg, dict(w), device="cuda", cuda_graph=True, max_context=256, max_batch=3)
    return _graphed(eng, SpecConfig()).generate(chat_ids, SamplingParams(max_new_tokens=32)).tokens


def test_real_model_graph_matches_hf(gguf_path, chat_ids, gpu_target):
    from specattn.spec_runtime.loader import load_hf_oracle
    hf = load_hf_oracle(gguf_path, device="cuda")
    for ids, ours in zip(chat_ids, gpu_target):
        assert ours == hf_greedy(hf, ids, 32)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"topk{s.topk}-d{s.num_draft_tokens}")
def test_real_model_eagle_graph_lossless(gguf_loaded, chat_ids, gpu_target, spec, backend_name):
    cfg, w = gguf_loaded
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, device="cuda", cuda_graph=True, max_context=256,
                      max_batch=3)
    res = _graphed(eng, spec).generate(chat_ids, SamplingParams(max_new_tokens=32))
    assert res.tokens == gpu_target


def test_real_model_dflash_graph_lossless(gguf_loaded, chat_ids, gpu_target, backend_name):
    """DFlash (random-init block drafter, graphed block forward; the target's verify eager)
    on the real model: == target-only greedy, both on the chosen backend."""
    cfg, w = gguf_loaded
    spec = SpecConfig("dflash", block_size=8)
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, device="cuda", cuda_graph=True, max_context=256,
                      max_batch=3)
    assert "draft:TARGET_VERIFY" in eng.graph_modes or "draft:TARGET_VERIFY" in eng.eager_routed
    res = _graphed(eng, spec).generate(chat_ids, SamplingParams(max_new_tokens=32))
    assert res.tokens == gpu_target


@pytest.mark.parametrize("spec", SHIPPED_SPECS, ids=SHIPPED_IDS)
def test_real_model_shipped_drafter_graph_lossless(gguf_loaded, chat_ids, gpu_target, spec, backend_name):
    """The shipped EAGLE-3 and DFlash drafters with whole-round CUDA graphs: == target-only
    greedy."""
    from specattn.spec_runtime.cli import default_drafter, drafter_factory
    cfg, w = gguf_loaded
    path = default_drafter(cfg, spec.algo)
    if path is None:
        pytest.skip(f"no {spec.algo} drafter is shipped for this model")
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, device="cuda", cuda_graph=True, max_context=256,
                      max_batch=3, draft_model=drafter_factory(path, "cuda", torch.float32))
    res = _graphed(eng, spec).generate(chat_ids, SamplingParams(max_new_tokens=32))
    assert res.tokens == gpu_target


def _tiny_algo(tmp_path, algo: str, layers: int):
    """``(seed, rng, target on cuda, SpecConfig, drafter or None)`` of a fresh tiny random
    model for ``algo`` in none | eagle3 (a random EAGLE-3 drafter) | dflash | ngram."""
    from specattn.spec_runtime.eagle3 import Eagle3Drafter
    from specattn.spec_runtime.model import LlamaModel
    from tiny_models import tiny_llama
    seed = random.randrange(2**31)
    cfg, w = tiny_llama(tmp_path, seed, vocab=96, layers=layers)
    target = LlamaModel(cfg, dict(w), "cuda")
    spec = {"none": SpecConfig(), "eagle3": SpecConfig("eagle", 2, 3, 6), "ngram": SpecConfig("ngram"),
            "dflash": SpecConfig("dflash", block_size=4)}[algo]
    drafter = Eagle3Drafter.from_target(target, seed=seed) if algo == "eagle3" else None
    return seed, random.Random(seed), target, spec, drafter


@pytest.mark.parametrize("algo", ["none", "eagle3", "dflash", "ngram"])
def test_prefill_graphs_match_eager(tmp_path, algo, backend_name):
    """Prefills replayed from CUDA graphs (padded requests and tokens; the graph of a padded
    size reused for other prompt sets; a prompt set past ``prefill_graph_tokens`` prefilled
    eagerly) generate exactly what the eager engine does, float32."""
    seed, rng, target, spec, drafter = _tiny_algo(tmp_path, algo, layers=4)
    kw = dict(spec=spec, max_context=160, max_batch=6, draft_model=drafter)
    eager = make_engine(backend_name, target, cuda_graph=False, **kw)
    graph = make_engine(backend_name, target, cuda_graph=True, prefill_graph_tokens=64, **kw)
    if not graph.whole_round_graphs:
        pytest.skip(f"--backend {backend_name} plans on the host: no prefill graphs")
    tb = graph.backend_of("target")
    if not tb.supports(ForwardMode.EXTEND, graph=True, kind=tb.kind):
        pytest.skip(f"--backend {backend_name} does not capture EXTEND: prefills run eagerly")
    assert graph.prefill_graphs_on
    p = SamplingParams(max_new_tokens=12)
    for n, lo, hi in ((3, 1, 9), (1, 34, 40), (5, 8, 12), (3, 1, 9), (6, 14, 30)):   # the last: > 64 tokens
        prompts = [[rng.randrange(96) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
        want = eager.generate(prompts, p)
        got = graph.generate(prompts, p)
        assert got.tokens == want.tokens, f"seed={seed} {algo} {n} prompts"
        assert got.accept_lengths == want.accept_lengths
    assert {k[:2] for k in graph.prefill_graphs} == {(4, 32), (1, 64), (6, 64)}   # padded_sizes(6): 1, 2, 4, 6
    check_rows_restored(graph)


@pytest.mark.parametrize("algo", ["none", "eagle3", "dflash", "ngram"])
def test_more_prompts_than_rows_graphs(tmp_path, algo, backend_name):
    """Continuous batching under whole-round graphs and the overlapped host loop: rows freed
    while the next round is in flight are prefilled again; every request's tokens equal an
    eager engine's with a row per prompt (float32)."""
    seed, rng, target, spec, drafter = _tiny_algo(tmp_path, algo, layers=3)
    n = 11
    prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 20))] for _ in range(n)]
    limits = [rng.choice([1, 3, 9, 24]) for _ in range(n)]
    p = SamplingParams(max_new_tokens=24)
    want = make_engine(backend_name, target, spec=spec, max_context=128, max_batch=n, draft_model=drafter
                       ).generate(prompts, p, max_new_tokens=limits)
    eng = make_engine(backend_name, target, spec=spec, max_context=128, max_batch=3, draft_model=drafter,
                      cuda_graph=True)
    for _ in range(2):   # the second run replays graphs captured in the first
        got = eng.generate(prompts, p, max_new_tokens=limits)
        assert got.tokens == want.tokens, f"seed={seed} {algo}"
    check_rows_restored(eng)
