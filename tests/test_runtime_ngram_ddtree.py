"""N-gram drafting (``spec_runtime/ngram.py``) and DDTree (DFlash drafts verified as a tree,
``spec_runtime/dflash.py``; its candidates: ``tests/test_ops_ddtree.py``) in the runtime: the
n-gram tree shape against a naive reference, and lossless generation (== target-only greedy, float32) on fresh random tiny
models, paged == unpaged, on the test run's ``--backend``."""
import random

import pytest
import torch

from runtime_backend import check_rows_restored, make_engine, uses_graphs
from specattn import ops
from specattn.backends import unpack_tree_mask
from specattn.spec_runtime.engine import SpecConfig
from specattn.spec_runtime.ngram import chains_tree_shape
from specattn.spec_runtime.sampling import SamplingParams
from tiny_models import tiny_llama

V = 96


# ---------------------------------------------------------------------- pieces
@pytest.mark.parametrize("branches,depth", [(1, 1), (1, 4), (3, 2), (4, 5)])
def test_chains_tree_shape(branches, depth):
    mask, dep, nxt, sib = chains_tree_shape(branches, depth)
    D = 1 + branches * depth
    dense = unpack_tree_mask(mask, D)
    parent = [-1] + [0 if (j - 1) % depth == 0 else j - 1 for j in range(1, D)]
    for j in range(D):
        anc, a = set(), j
        while a >= 0:
            anc.add(a)
            a = parent[a]
        assert set(torch.nonzero(dense[j]).flatten().tolist()) == anc
        assert dep[j] == len(anc) - 1
    children = {j: [c for c in range(D) if parent[c] == j] for j in range(D)}
    for j in range(D):
        kids = children[j]
        assert nxt[j] == (kids[0] if kids else -1)
        for a, b in zip(kids, kids[1:] + [-1]):
            assert sib[a] == b


# ---------------------------------------------------------------------- end to end
def _repetitive_prompts(rng, n=3):
    """Prompts that repeat spans, so n-gram drafts have something to copy."""
    out = []
    for _ in range(n):
        span = [rng.randrange(V) for _ in range(rng.randint(3, 6))]
        out.append((span * 4)[:rng.randint(8, 20)])
    return out


@pytest.mark.parametrize("spec", [SpecConfig("ngram", topk=1, num_steps=4), SpecConfig("ngram", topk=3, num_steps=3, ngram_size=2),
                                  SpecConfig("dflash", topk=2, num_draft_tokens=6, block_size=4),
                                  SpecConfig("dflash", topk=4, num_draft_tokens=12, block_size=6),
                                  SpecConfig("dflash", topk=3, num_draft_tokens=3, block_size=2),
                                  SpecConfig("dflash", topk=4, num_draft_tokens=12, block_size=6, ddtree_depth_decay=0.6)],
                         ids=["ngram-chain", "ngram-tree", "ddtree-small", "ddtree", "ddtree-one-level", "ddtree-decay"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_lossless(tmp_path, seed, spec, page_size, backend_name):
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    prompts = _repetitive_prompts(random.Random(seed))
    p = SamplingParams(max_new_tokens=24)
    base = make_engine(backend_name, cfg, dict(w), max_context=96).generate(prompts, p)
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=96, page_size=page_size)
    res = eng.generate(prompts, p)
    assert res.tokens == base.tokens, f"seed={seed}"
    assert all(0 <= a <= spec.num_steps if spec.algo == "ngram" else 0 <= a <= spec.block_size - 1
               for per in res.accept_lengths for a in per)
    check_rows_restored(eng)
    if page_size > 1:
        flat = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=96).generate(prompts, p)
        assert res.accept_lengths == flat.accept_lengths


def test_ddtree_depth_decay_weighs_positions(tmp_path, seed, backend_name, monkeypatch):
    """``ddtree_depth_decay``: the DDTree's candidates are grown from the block's top-k
    log-probabilities with position ``k`` weighed ``decay ** (k - 1)`` (the first round, the
    same block forward either way), the output stays the target's greedy text, and
    SpecConfig refuses a decay that is not a finite number above 0."""
    from specattn import ops
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    prompts = _repetitive_prompts(random.Random(seed), 2)
    p = SamplingParams(max_new_tokens=12)
    seen = []
    orig = ops.ddtree_candidates

    def spy(vals, toks, **kw):   # the values the candidates are scored from
        w = kw.get("depth_weights")
        seen.append((vals if w is None else vals * w[:, None]).detach().clone())
        if w is not None:
            assert w.dtype == torch.float32 and w.shape == (vals.shape[1],)
        return orig(vals, toks, **kw)
    monkeypatch.setattr(ops, "ddtree_candidates", spy)
    base = make_engine(backend_name, cfg, dict(w), max_context=96).generate(prompts, p)
    outs = {}
    for decay in (1.0, 0.5):
        seen.clear()
        spec = SpecConfig("dflash", topk=3, num_draft_tokens=8, block_size=5, ddtree_depth_decay=decay)
        outs[decay] = (make_engine(backend_name, cfg, dict(w), spec=spec, max_context=96).generate(prompts, p), seen[0])
        assert outs[decay][0].tokens == base.tokens, f"seed={seed} decay={decay}"
    one, half = outs[1.0][1], outs[0.5][1]
    weights = 0.5 ** torch.arange(one.shape[1], dtype=one.dtype, device=one.device)
    assert torch.allclose(half, one * weights[:, None]) and not torch.equal(half, one)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ddtree_depth_decay"):
            SpecConfig("dflash", topk=3, num_draft_tokens=8, block_size=5, ddtree_depth_decay=bad).validate()


def test_ddtree_selection_past_the_fused_select(tmp_path, seed, backend_name, monkeypatch):
    """A DDTree with more candidates than ``ops.select_draft_tokens`` takes (made small
    here) selects its nodes with PyTorch ops: the same outputs and acceptance."""
    from specattn import ops
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    prompts = _repetitive_prompts(random.Random(seed))
    p, spec = SamplingParams(max_new_tokens=24), SpecConfig("dflash", topk=3, num_draft_tokens=8, block_size=5)
    fused = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=96).generate(prompts, p)
    monkeypatch.setattr(ops, "EAGLE_MAX_CANDIDATES", 4)
    torch_path = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=96).generate(prompts, p)
    assert torch_path.tokens == fused.tokens and torch_path.accept_lengths == fused.accept_lengths


def test_ngram_spec_limits():
    """SpecConfig takes n-gram chains up to the op's limits (the kernel unrolls ngram_size and
    topk) and refuses one past each."""
    SpecConfig("ngram", topk=ops.NGRAM_MAX_TOPK, num_steps=ops.NGRAM_MAX_STEPS, ngram_size=ops.NGRAM_MAX_SIZE).validate()
    for kw in (dict(topk=ops.NGRAM_MAX_TOPK + 1), dict(num_steps=ops.NGRAM_MAX_STEPS + 1),
               dict(ngram_size=ops.NGRAM_MAX_SIZE + 1), dict(topk=0)):
        with pytest.raises(ValueError, match="ngram needs topk in"):
            SpecConfig("ngram", **{"topk": 2, "num_steps": 2, **kw}).validate()


def test_ngram_accepts_on_repeated_text(tmp_path, seed, backend_name):
    """A target that copies (its greedy output of a repeated span repeats too, for a model
    with strong copying: here the check is only that n-gram drafts get accepted when the
    output repeats what came before)."""
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    rng = random.Random(seed)
    prompts = _repetitive_prompts(rng, 4)
    p = SamplingParams(max_new_tokens=40)
    base = make_engine(backend_name, cfg, dict(w), max_context=128).generate(prompts, p)
    res = make_engine(backend_name, cfg, dict(w), spec=SpecConfig("ngram", topk=4, num_steps=4),
                      max_context=128).generate(prompts, p)
    assert res.tokens == base.tokens
    # a random tiny model's greedy output falls into cycles: n-gram drafting must catch them
    assert sum(a for per in res.accept_lengths for a in per) > 0, f"seed={seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [SpecConfig("ngram", topk=3, num_steps=3), SpecConfig("dflash", topk=3, num_draft_tokens=10, block_size=6),
                                  SpecConfig("dflash", topk=3, num_draft_tokens=10, block_size=6, ddtree_depth_decay=0.8)],
                         ids=["ngram", "ddtree", "ddtree-decay"])
def test_graphs_lossless(tmp_path, seed, spec, backend_name):
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    prompts = _repetitive_prompts(random.Random(seed), 4)
    p = SamplingParams(max_new_tokens=24)
    kw = dict(device="cuda", max_context=128, max_batch=4)
    base = make_engine(backend_name, cfg, dict(w), **kw).generate(prompts, p)
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, cuda_graph=True, **kw)
    assert uses_graphs(eng)
    assert eng.generate(prompts, p).tokens == base.tokens, f"seed={seed}"
