"""The engine with KV pages larger than one token (``Engine(page_size=...)``), on the test
run's ``--backend`` (CPU: the reference backend, or Triton's interpreter):

- page layout: every forward's ``req_to_token`` rows put position ``p`` at offset
  ``p % page_size`` of one page per ``page_size`` positions (what FlashMLA's block table and
  the Triton MLA kernel's one-slot-per-tile path read), for the requests AND the EAGLE beams;
- the same tokens AND the same accept lengths as with one-token pages, float32: the drafter's
  KV is unchanged by paging (beams with ``topk > 1`` each write a private copy of the page
  holding their draft position; a shared page would corrupt the other beams' drafts, which
  verification hides in the tokens but not in the accept lengths);
- every request row lists its reserved pages again after ``generate``, and the beams' scratch
  rows equal their request rows (the draft columns were undone);
- EAGLE chains and trees, DFlash, the MLA model; prompts crossing page boundaries.
"""
import random

import pytest
import torch

from runtime_backend import check_rows_restored, make_engine, uses_graphs
from specattn.backends import ForwardMode
from specattn.spec_runtime.engine import Engine, SpecConfig
from specattn.spec_runtime.mla_model import MLAConfig, MLAModel
from specattn.spec_runtime.sampling import SamplingParams
from tiny_models import tiny_llama

V = 96


@pytest.fixture
def tiny(tmp_path, seed):
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    rng = random.Random(seed)
    # lengths straddling page boundaries of 4 and 8: 3, 4, 5, 8, 9 .. 14
    prompts = [[rng.randrange(V) for _ in range(n)] for n in rng.sample([3, 4, 5, 8, 9, 14], 3)]
    return cfg, w, prompts


def watch_layout(monkeypatch, page_size):
    """Check every forward's rows against the page layout; returns the list of modes seen."""
    seen = []
    real = Engine.forward

    def run(self, role, tokens, batch, *args, **kwargs):
        rtt = self.req_pool.req_to_token
        span = int((batch.prefix_lens + batch.extend_lens).max()) if batch.batch_size else 0
        if span:
            rows = rtt[batch.req_pool_indices.long(), :span].long()
            pos = torch.arange(span, device=rows.device)
            first = rows[:, pos - pos % page_size]                  # slot of each page's first position
            mask = pos[None, :] < (batch.prefix_lens + batch.extend_lens).long()[:, None]
            assert torch.equal((rows - first)[mask], (pos % page_size).expand_as(rows)[mask]), \
                f"{batch.forward_mode.name}: a row breaks the page layout"
            assert torch.equal((first % page_size)[mask], torch.zeros_like(first)[mask])
        seen.append(batch.forward_mode)
        return real(self, role, tokens, batch, *args, **kwargs)

    monkeypatch.setattr(Engine, "forward", run)
    return seen


def generate_pair(backend_name, model_args, spec, prompts, page_size, monkeypatch, **kw):
    p = SamplingParams(max_new_tokens=20)
    base = make_engine(backend_name, *model_args, spec=spec, max_context=64, **kw).generate(prompts, p)
    seen = watch_layout(monkeypatch, page_size)
    eng = make_engine(backend_name, *model_args, spec=spec, max_context=64, page_size=page_size, **kw)
    res = eng.generate(prompts, p)
    assert eng.target_pool.page_size == page_size
    check_rows_restored(eng)
    return base, res, seen


@pytest.mark.parametrize("page_size", [4, 8])
@pytest.mark.parametrize("spec", [SpecConfig("none"), SpecConfig("eagle", 1, 3, 4, 2),
                                  SpecConfig("eagle", 3, 3, 8, 3), SpecConfig("eagle", 4, 4, 12, 3)],
                         ids=["none", "chain", "tree", "wide-tree"])
def test_paged_equals_unpaged(tiny, spec, page_size, backend_name, monkeypatch):
    cfg, w, prompts = tiny
    base, res, seen = generate_pair(backend_name, (cfg, dict(w)), spec, prompts, page_size, monkeypatch)
    assert res.tokens == base.tokens
    assert res.accept_lengths == base.accept_lengths
    if spec.algo == "eagle" and spec.num_steps > 1:
        assert ForwardMode.DECODE in seen  # the beams' draft steps were checked too


def test_paged_dflash(tiny, backend_name, monkeypatch):
    cfg, w, prompts = tiny
    base, res, _ = generate_pair(backend_name, (cfg, dict(w)), SpecConfig("dflash", block_size=6),
                                 prompts, 8, monkeypatch)
    assert res.tokens == base.tokens and res.accept_lengths == base.accept_lengths


@pytest.mark.parametrize("page_size", [8, 32])
def test_paged_mla(seed, page_size, backend_name, monkeypatch):
    """Page 32 holds whole key tiles of the Triton MLA kernel (32 keys here): its
    one-slot-per-tile path reads these rows."""
    model = MLAModel(MLAConfig(vocab_size=128), seed=seed)
    rng = random.Random(seed)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 14))] for _ in range(3)]
    base, res, _ = generate_pair(backend_name, (model,), SpecConfig("eagle", 2, 3, 6, 2), prompts,
                                 page_size, monkeypatch)
    assert res.tokens == base.tokens and res.accept_lengths == base.accept_lengths


def test_shared_beam_page_is_caught(tiny, monkeypatch):
    """The accept-length comparison has teeth: beams writing one shared page (no private
    copy) change the drafts."""
    cfg, w, prompts = tiny
    spec = SpecConfig("eagle", 3, 3, 8, 3)
    p = SamplingParams(max_new_tokens=20)
    base = Engine(cfg, dict(w), spec=spec, max_context=64).generate(prompts, p)

    eng = Engine(cfg, dict(w), spec=spec, max_context=64, page_size=8)
    S = spec.num_steps   # every beam of a request writes beam 0's scratch page of each step
    eng.scratch_pages.copy_(eng.scratch_pages[:, :S - 1].repeat(1, spec.topk))
    bad = eng.generate(prompts, p)
    assert bad.tokens == base.tokens          # verification keeps the output lossless ...
    assert bad.accept_lengths != base.accept_lengths   # ... but the drafts were corrupted


def test_page_size_must_divide_max_context(tiny):
    cfg, w, _ = tiny
    with pytest.raises(ValueError, match="multiple of page_size"):
        Engine(cfg, dict(w), max_context=60, page_size=8)
    with pytest.raises(ValueError, match="multiple of page_size"):
        Engine(cfg, dict(w), max_context=64, page_size=0)


def test_paged_sampling_equals_unpaged(tiny, backend_name, monkeypatch):
    """Speculative sampling (temperature 0.8, one seed): the paged run draws the same tokens."""
    cfg, w, prompts = tiny
    spec = SpecConfig("eagle", 2, 3, 6, 3)
    p = SamplingParams(temperature=0.8, max_new_tokens=20, seed=7)
    base = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=64).generate(prompts, p)
    watch_layout(monkeypatch, 8)
    res = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=64, page_size=8).generate(prompts, p)
    assert res.tokens == base.tokens and res.accept_lengths == base.accept_lengths


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_paged_graphs_on_gpu(tmp_path, seed, kind, page_size, backend_name):
    """CUDA graphs over paged rows (beams with private pages, padded graph batches): the same
    tokens as the unpaged eager engine, float32 on the run's backend (one without float32
    kernels skips, saying so); on the reference backend, whose graph and eager arithmetic are
    the same, the same accept lengths too (kernels that split differently in graphs may flip
    a drafter near-tie)."""
    if kind == "llama":
        cfg, w = tiny_llama(tmp_path, seed, vocab=V)
        args, vocab = (cfg, dict(w)), V
    else:
        args, vocab = (MLAModel(MLAConfig(vocab_size=128), device="cuda", seed=seed),), 128
    kw = dict(device="cuda") if kind == "llama" else {}
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(3)]
    p = SamplingParams(max_new_tokens=24)
    for spec in (SpecConfig("eagle", 1, 3, 4, 2), SpecConfig("eagle", 3, 3, 8, 3)):
        base = make_engine(backend_name, *args, spec=spec, max_context=128, max_batch=3, **kw).generate(prompts, p)
        eng = make_engine(backend_name, *args, spec=spec, max_context=128, max_batch=3, page_size=page_size,
                          cuda_graph=True, **kw)
        assert uses_graphs(eng), "no CUDA graphs were captured"
        res = eng.generate(prompts, p)
        assert res.tokens == base.tokens, f"seed={seed} {spec}"
        if backend_name == "torch_reference":
            assert res.accept_lengths == base.accept_lengths, f"seed={seed} {spec}"
