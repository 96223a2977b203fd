"""Tree shapes by batch size (``SpecConfig.num_draft_tokens_by_batch``): EAGLE trees and
chains and DDTrees verify another number of tokens once a round's (padded) batch reaches a
threshold; the output stays the target's greedy one (float32, fresh random tiny models) and
each round's tree has the size of its batch, on the test run's ``--backend``."""
import random

import pytest

from runtime_backend import check_rows_restored, make_engine, uses_graphs
from specattn import ops
from specattn.spec_runtime.eagle3 import Eagle3Drafter
from specattn.spec_runtime.engine import SpecConfig
from specattn.spec_runtime.graph_runner import padded_sizes
from specattn.spec_runtime.model import LlamaModel
from specattn.spec_runtime.sampling import SamplingParams
from specattn.spec_runtime.strategies import parse_by_batch
from tiny_models import tiny_llama

V = 96
NEW = 20

SPECS = [SpecConfig("eagle", topk=2, num_steps=3, num_draft_tokens=7, draft_layers=1,
                    num_draft_tokens_by_batch=((3, 3),)),
         SpecConfig("eagle", topk=1, num_steps=4, num_draft_tokens=5, draft_layers=1,
                    num_draft_tokens_by_batch=((3, 2),)),
         SpecConfig("dflash", topk=3, block_size=5, num_draft_tokens=9, num_draft_tokens_by_batch=((3, 4),)),
         SpecConfig("dflash", topk=2, block_size=4, num_draft_tokens=3, num_draft_tokens_by_batch=((3, 7),))]
IDS = ["eagle-tree", "eagle-chain", "ddtree", "ddtree-grows"]


def test_validate():
    spec = SpecConfig("eagle", topk=4, num_steps=5, num_draft_tokens=32, num_draft_tokens_by_batch=((2, 16), (32, 8)))
    spec.validate()
    assert [spec.num_draft_tokens_for(b) for b in (1, 2, 31, 32, 64)] == [32, 16, 16, 8, 8]
    assert spec.max_num_draft_tokens() == 32 and spec.tokens_per_round() == 32
    grows = SpecConfig("dflash", topk=4, block_size=4, num_draft_tokens=3, num_draft_tokens_by_batch=((8, 9),))
    grows.validate()
    assert grows.tokens_per_round() == 9 and grows.num_draft_tokens_for(7) == 3
    assert SpecConfig("eagle", topk=1, num_steps=3, num_draft_tokens=4).num_draft_tokens_for(64) == 4
    bad = [(dict(algo="dflash", topk=1, num_draft_tokens_by_batch=((2, 1),)), "chain's .* must be >= 2"),
           (dict(algo="none"), "applies to EAGLE, n-gram and DFlash"),
           (dict(algo="ngram"), r"1 \+ chains \* num_steps with 0 <= chains <= topk=2, num_steps=3, got 3"),
           (dict(algo="ngram", num_draft_tokens_by_batch=((2, 10),)), "got 10"),     # 3 chains > topk 2
           (dict(algo="ngram", num_draft_tokens_by_batch=((2, 0),)), "got 0"),       # not even the root
           (dict(num_draft_tokens_by_batch=((1, 4),)), "increase from >= 2"),
           (dict(num_draft_tokens_by_batch=((4, 4), (4, 3))), "increase from >= 2"),
           (dict(num_draft_tokens_by_batch=((4, 1),)), "2 <= num_draft_tokens_by_batch's values"),
           (dict(num_draft_tokens_by_batch=((4, 12),)), "<= 11"),            # 2 + 2*4 candidates + root
           (dict(num_draft_tokens_by_batch=((4, True),)), "int pairs"),
           (dict(num_draft_tokens_by_batch=((4,),)), "int pairs")]
    for change, match in bad:
        kw = dict(dict(algo="eagle", topk=2, num_steps=3, num_draft_tokens=6, num_draft_tokens_by_batch=((2, 3),)),
                  **change)
        with pytest.raises(ValueError, match=match):
            SpecConfig(**kw).validate()
    hi = ops.num_tree_candidates(3, 4) + 1                  # DDTree: the candidates of block_size - 1 levels
    SpecConfig("dflash", topk=3, block_size=5, num_draft_tokens=4, num_draft_tokens_by_batch=((2, hi),)).validate()
    with pytest.raises(ValueError, match=f"<= {hi}, got {hi + 1}"):
        SpecConfig("dflash", topk=3, block_size=5, num_draft_tokens=4,
                   num_draft_tokens_by_batch=((2, hi + 1),)).validate()
    assert parse_by_batch("2:16, 32:8") == ((2, 16), (32, 8))
    ngram = SpecConfig("ngram", topk=4, num_steps=3, num_draft_tokens_by_batch=((16, 7), (32, 4)))
    ngram.validate()                                        # 4 chains of 3 drafts, then 2, then 1
    assert [ngram.num_draft_tokens_for(b) for b in (1, 15, 16, 32)] == [13, 13, 7, 4]
    assert ngram.max_num_draft_tokens() == ngram.tokens_per_round() == 13
    SpecConfig("ngram", topk=4, num_steps=3, num_draft_tokens_by_batch=((16, 7), (32, 1))).validate()   # off from 32


def _record_trees(monkeypatch) -> list:
    """``(request rows, D)`` of every tree built from now on."""
    seen, real = [], ops.build_tree

    def build_tree(parent_list, selected, *args, **kw):
        seen.append((parent_list.shape[0], selected.shape[1] + 1))
        return real(parent_list, selected, *args, **kw)

    monkeypatch.setattr(ops, "build_tree", build_tree)
    return seen


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_lossless_and_sized_by_batch(tmp_path, seed, spec, page_size, backend_name, monkeypatch):
    """Four requests, two of which stop early: rounds over 3-4 rows (padded to 4) and over
    1-2 rows each verify the tree of their batch size, and every output is the target's."""
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    rng = random.Random(seed)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    limits = [NEW, NEW, 5, 5]
    p = SamplingParams(max_new_tokens=NEW)
    base = make_engine(backend_name, cfg, dict(w), max_context=128, max_batch=4).generate(
        prompts, p, max_new_tokens=limits)
    seen = _record_trees(monkeypatch)
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=128, max_batch=4, page_size=page_size)
    res = eng.generate(prompts, p, max_new_tokens=limits)
    assert res.tokens == base.tokens, f"seed={seed}"
    padded = lambda bs: next(s for s in padded_sizes(4) if s >= bs)   # noqa: E731
    assert seen and all(d == spec.num_draft_tokens_for(padded(bs)) for bs, d in seen), seen
    assert {d for _, d in seen} == {spec.num_draft_tokens, spec.num_draft_tokens_by_batch[0][1]}, seen
    for per in res.accept_lengths:
        assert all(0 <= a <= spec.max_num_draft_tokens() - 1 for a in per), res.accept_lengths
    check_rows_restored(eng)


NGRAM = SpecConfig("ngram", topk=3, num_steps=2, ngram_size=3, num_draft_tokens_by_batch=((3, 3),))
NGRAM_OFF = SpecConfig("ngram", topk=2, num_steps=3, ngram_size=2, num_draft_tokens_by_batch=((3, 1),))


def _repeating_prompts(seed: int) -> list:
    """Four prompts that repeat a span (the n-gram lookups find matches)."""
    rng, prompts = random.Random(seed), []
    for _ in range(4):
        span = [rng.randrange(V) for _ in range(rng.randint(2, 5))]
        prompts.append([rng.randrange(V) for _ in range(rng.randint(0, 3))] + span * rng.randint(2, 4))
    return prompts


@pytest.mark.parametrize("spec,chains", [(NGRAM, (1, 3)), (NGRAM_OFF, (0, 2))], ids=["fewer", "off"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_ngram_lossless_and_sized_by_batch(tmp_path, seed, spec, chains, page_size, backend_name, monkeypatch):
    """N-gram drafting keeps 3 chains over 1-2 rows and its best one over 3-4 rows (or 2
    chains, then none: the root alone, nothing looked up).  Every output is the target's."""
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    prompts = _repeating_prompts(seed)
    limits, p = [NEW, NEW, 5, 5], SamplingParams(max_new_tokens=NEW)
    base = make_engine(backend_name, cfg, dict(w), max_context=128, max_batch=4).generate(
        prompts, p, max_new_tokens=limits)
    seen, real = [], ops.ngram_candidates

    def ngram_candidates(history, P, ngram_size, topk, num_steps, **kw):
        seen.append((history.shape[0], topk))
        return real(history, P, ngram_size, topk, num_steps, **kw)

    monkeypatch.setattr(ops, "ngram_candidates", ngram_candidates)
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=128, max_batch=4, page_size=page_size)
    res = eng.generate(prompts, p, max_new_tokens=limits)
    assert res.tokens == base.tokens, f"seed={seed}"
    few, many = chains
    assert {k for _, k in seen} == {few, many} - {0} and all(k == many for bs, k in seen if bs < 3), seen
    assert all(k == few for bs, k in seen if bs >= 3), seen
    assert any(bs >= 3 for bs, _ in seen) or few == 0, seen          # rounds over 3-4 rows ran
    for per in res.accept_lengths:
        assert all(0 <= a <= spec.num_steps for a in per), res.accept_lengths
    if few == 0:   # rounds over 3-4 rows looked nothing up and accepted nothing
        assert len(seen) < res.num_rounds and min(a for per in res.accept_lengths for a in per) == 0
    check_rows_restored(eng)


def test_eagle3_lossless_and_sized_by_batch(tmp_path, seed, backend_name, monkeypatch):
    """An EAGLE-3 drafter (its entries one index below the tokens, fed the target's features):
    a tree of 7 tokens over 1-2 rows, 3 over 3-4 (a draft extend of 3 tokens instead of 4)."""
    cfg, w = tiny_llama(tmp_path, seed, vocab=V, layers=5)
    target = LlamaModel(cfg, dict(w))
    drafter = Eagle3Drafter.from_target(target, seed=seed)
    rng = random.Random(seed)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 12))] for _ in range(4)]
    limits, p = [NEW, NEW, 5, 5], SamplingParams(max_new_tokens=NEW)
    base = make_engine(backend_name, target, max_context=128, max_batch=4).generate(prompts, p, max_new_tokens=limits)
    spec = SpecConfig("eagle", topk=2, num_steps=3, num_draft_tokens=7, num_draft_tokens_by_batch=((3, 3),))
    seen = _record_trees(monkeypatch)
    eng = make_engine(backend_name, target, spec=spec, max_context=128, max_batch=4, draft_model=drafter)
    assert eng.generate(prompts, p, max_new_tokens=limits).tokens == base.tokens, f"seed={seed}"
    assert {d for _, d in seen} == {3, 7} and all(d == (3 if bs >= 3 else 7) for bs, d in seen), seen
    check_rows_restored(eng)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS[:1] + SPECS[2:3], ids=IDS[:1] + IDS[2:3])
def test_graphs_lossless(tmp_path, seed, spec, backend_name):
    """CUDA graphs: each padded batch size's round graph holds its own tree; eager and replayed
    rounds give the target's output."""
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    rng = random.Random(seed)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    limits = [NEW, NEW, 5, 5]
    p = SamplingParams(max_new_tokens=NEW)
    kw = dict(device="cuda", max_context=128, max_batch=4)
    base = make_engine(backend_name, cfg, dict(w), **kw).generate(prompts, p, max_new_tokens=limits)
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, cuda_graph=True, **kw)
    assert uses_graphs(eng)
    assert eng.generate(prompts, p, max_new_tokens=limits).tokens == base.tokens, f"seed={seed}"
    eager = make_engine(backend_name, cfg, dict(w), spec=spec, cuda_graph=False, **kw)
    assert eager.generate(prompts, p, max_new_tokens=limits).tokens == base.tokens, f"seed={seed}"


@pytest.mark.gpu
def test_ngram_graphs_lossless(tmp_path, seed, backend_name):
    """CUDA graphs: n-gram rounds of 3 chains and of 1 (or 2 and none), replayed (a whole-round graph
    per padded batch size; a host-planned backend runs these verifies eagerly), give the
    target's output."""
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    prompts = _repeating_prompts(seed)
    limits, p = [NEW, NEW, 5, 5], SamplingParams(max_new_tokens=NEW)
    kw = dict(device="cuda", max_context=128, max_batch=4)
    base = make_engine(backend_name, cfg, dict(w), **kw).generate(prompts, p, max_new_tokens=limits)
    for spec in (NGRAM, NGRAM_OFF):
        eng = make_engine(backend_name, cfg, dict(w), spec=spec, cuda_graph=True, **kw)
        assert uses_graphs(eng) or not eng.whole_round_graphs
        assert eng.generate(prompts, p, max_new_tokens=limits).tokens == base.tokens, f"seed={seed} {spec}"
