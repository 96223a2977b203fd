"""EAGLE-3 drafting in the runtime (an :class:`~specattn.spec_runtime.eagle3.Eagle3Drafter`
fed the target's aux hidden states, its entries one index below the token positions):
lossless against target-only greedy for chains and trees, paged == unpaged (tokens and accept
lengths), with CUDA graphs on a GPU, and the shipped drafter on the real model through
``specattn generate`` (float32, CPU: ``--algo eagle`` == ``--algo none`` token for token)."""
import json
import random

import pytest
import torch
from typer.testing import CliRunner

from runtime_backend import check_rows_restored, make_engine, skip_real_model_if_interpreted, uses_graphs
from specattn.spec_runtime.eagle3 import Eagle3Drafter
from specattn.spec_runtime.engine import SpecConfig
from specattn.spec_runtime.model import LlamaModel
from specattn.spec_runtime.sampling import SamplingParams
from tiny_models import tiny_llama

V = 96
SPECS = [SpecConfig("eagle", 1, 4, 5), SpecConfig("eagle", 3, 3, 8), SpecConfig("eagle", 2, 1, 3)]


def _setup(tmp_path, seed, device="cpu"):
    cfg, w = tiny_llama(tmp_path, seed, vocab=V, layers=5)
    target = LlamaModel(cfg, dict(w), device)
    rng = random.Random(seed)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 14))] for _ in range(3)]
    return target, Eagle3Drafter.from_target(target, seed=seed), prompts


@pytest.mark.parametrize("spec", SPECS, ids=["chain", "tree", "one-step"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_eagle3_lossless(tmp_path, seed, spec, page_size, backend_name):
    target, drafter, prompts = _setup(tmp_path, seed)
    p = SamplingParams(max_new_tokens=20)
    base = make_engine(backend_name, target, max_context=64).generate(prompts, p)
    eng = make_engine(backend_name, target, spec=spec, max_context=64, draft_model=drafter, page_size=page_size)
    assert eng.draft is drafter and eng.strategy.target_capture_layers == tuple(drafter.aux_layer_ids)
    res = eng.generate(prompts, p)
    assert res.tokens == base.tokens, f"seed={seed}"
    check_rows_restored(eng)
    if page_size > 1:
        flat = make_engine(backend_name, target, spec=spec, max_context=64, draft_model=drafter).generate(prompts, p)
        assert res.accept_lengths == flat.accept_lengths


@pytest.mark.parametrize("spec", SPECS[:2], ids=["chain", "tree"])
def test_eagle3_draft_vocab_lossless(tmp_path, seed, spec, backend_name):
    """Drafting from a random subset of the vocabulary (FR-Spec) stays lossless: drafts are
    mapped back to token ids, the verify is unchanged; topk above the subset is refused."""
    target, drafter, prompts = _setup(tmp_path, seed)
    g = torch.Generator().manual_seed(seed)
    drafter.set_draft_vocab(torch.randperm(V, generator=g)[:max(spec.topk, V // 3)])
    p = SamplingParams(max_new_tokens=20)
    base = make_engine(backend_name, target, max_context=64).generate(prompts, p)
    res = make_engine(backend_name, target, spec=spec, max_context=64, draft_model=drafter).generate(prompts, p)
    assert res.tokens == base.tokens, f"seed={seed}"
    drafter.set_draft_vocab(torch.arange(2))
    with pytest.raises(ValueError, match="draft vocabulary"):
        make_engine(backend_name, target, spec=SpecConfig("eagle", 3, 3, 8), max_context=64, draft_model=drafter)


def test_eagle3_factory_and_sampling(tmp_path, seed, backend_name):
    """A drafter factory (``target -> drafter``) is built over the engine's target; sampling
    is seeded and every request gets its token budget."""
    target, drafter, prompts = _setup(tmp_path, seed)
    built = []
    eng = make_engine(backend_name, target, spec=SPECS[1], max_context=64,
                      draft_model=lambda t: built.append(t) or drafter)
    assert built == [target]
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_new_tokens=12)
    a, b = eng.generate(prompts, p), eng.generate(prompts, p)
    assert a.tokens == b.tokens and [len(t) for t in a.tokens] == [12] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS[:2], ids=["chain", "tree"])
def test_eagle3_graphs_lossless(tmp_path, seed, spec, backend_name):
    target, drafter, prompts = _setup(tmp_path, seed, "cuda")
    p = SamplingParams(max_new_tokens=24)
    kw = dict(max_context=128, max_batch=3)
    base = make_engine(backend_name, target, **kw).generate(prompts, p)
    eng = make_engine(backend_name, target, spec=spec, draft_model=drafter, cuda_graph=True, **kw)
    assert uses_graphs(eng)
    res = eng.generate(prompts, p)
    assert res.tokens == base.tokens, f"seed={seed}"
    check_rows_restored(eng)


@pytest.mark.slow
def test_shipped_drafter_generate_equals_none(gguf_path, backend_name, monkeypatch):
    """``specattn generate --algo eagle`` picks the shipped EAGLE-3 drafter for the default
    model (drafting from its 16,384 most frequent tokens unless ``--draft-vocab 0``) and emits
    exactly ``--algo none``'s tokens (float32, CPU)."""
    from specattn import cli
    from specattn.spec_runtime import cli as rcli
    skip_real_model_if_interpreted(backend_name)
    if rcli.default_drafter(type("C", (), dict(hidden_size=576, vocab_size=49152, num_hidden_layers=30,
                                               num_attention_heads=9, num_key_value_heads=3))) is None:
        pytest.skip("no EAGLE-3 drafter is shipped for the default model")
    args = ["generate", "--prompt", "Explain photosynthesis in two sentences.", "--device", "cpu",
            "--max-new-tokens", "24", "--backend", backend_name, "--json", "--no-warmup"]
    runner = CliRunner()
    none = runner.invoke(cli.app, args)
    eagle = runner.invoke(cli.app, args + ["--algo", "eagle", "--topk", "1", "--num-steps", "4",
                                           "--num-draft-tokens", "5"])
    full = runner.invoke(cli.app, args + ["--algo", "eagle", "--topk", "1", "--num-steps", "4",
                                          "--num-draft-tokens", "5", "--draft-vocab", "0"])
    assert none.exit_code == 0 and eagle.exit_code == 0 and full.exit_code == 0, (none.output, eagle.output,
                                                                                  full.output)
    a, b, c = json.loads(none.stdout), json.loads(eagle.stdout), json.loads(full.stdout)
    assert b["drafter"] == "eagle3" and b["draft_vocab"] == 16384 and c["draft_vocab"] is None   # default: FR-Spec
    assert a["outputs"][0]["tokens"] == b["outputs"][0]["tokens"] == c["outputs"][0]["tokens"]
    assert b["mean_accept_length"] > 1.0 and c["mean_accept_length"] > 1.0
