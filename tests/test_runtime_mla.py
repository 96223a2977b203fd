"""The runtime on a DeepSeek-style MLA model (``spec_runtime/mla_model.py``, absorbed form,
random init, float32):

- the absorbed model through the backend (default ``TorchReferenceBackend``) equals an independent *non-absorbed*
  dense oracle (below: per-head K/V materialised from the latent, causal attention over one
  sequence, float64): logits of a chunked batched prefill, the latents in the KV pool, and the
  engine's target-only greedy continuation;
- EAGLE chains and trees on it are lossless (== target-only greedy), fresh models and prompts
  every run (the seed is printed and in every assertion message);
- the same on a GPU with CUDA graphs (marked ``gpu``).

The backend is the test run's ``--backend`` (``tests/runtime_backend.py``): a backend whose
``supports()`` has no MLA makes these tests skip, saying so.
"""
import math
import random

import pytest
import torch

from runtime_backend import check_rows_restored, make_backend, make_engine, require_support, uses_graphs
from specattn.backends import (AttentionKind, ForwardBatch, ForwardMode, KVAllocator, MLATokenToKVPool,
                               ReqToTokenPool, TorchReferenceBackend)
from specattn.spec_runtime.engine import SpecConfig
from specattn.spec_runtime.mla_model import MLAConfig, MLAModel, random_mla_weights
from specattn.spec_runtime.sampling import SamplingParams

V = 128


# ------------------------------------------------------------------ the non-absorbed oracle
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope_neox(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """``x [N, ..., d]``: dims ``i`` and ``i + d/2`` rotated by ``pos * theta^(-2i/d)``."""
    d = x.shape[-1]
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)   # [N, d/2]
    ang = ang.view(ang.shape[0], *([1] * (x.dim() - 2)), d // 2)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], dim=-1)


def dense_oracle(cfg: MLAConfig, weights, ids):
    """Non-absorbed MLA decoder over ONE sequence ``ids`` (positions 0..N-1), float64, CPU.

    Returns ``(logits [N, V] float64, latents)`` with ``latents[i] = cat(c_kv, rope(k_pe))
    [N, kv_lora_rank + rope]`` of layer ``i`` (what the absorbed model must cache).
    """
    w = {k: t.detach().cpu().double() for k, t in weights.items()}
    H, nope, rope, vd, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.kv_lora_rank)
    eps, N = cfg.rms_norm_eps, len(ids)
    pos = torch.arange(N)
    h = w["model.embed_tokens.weight"][torch.as_tensor(ids)]
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    latents = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        x = _rms(h, w[f"model.layers.{i}.input_layernorm.weight"], eps)
        if cfg.q_lora_rank is None:
            q = x @ w[p + "q_proj.weight"].T
        else:
            q = _rms(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], eps) @ w[p + "q_b_proj.weight"].T
        q = q.view(N, H, nope + rope)
        kv_a = x @ w[p + "kv_a_proj_with_mqa.weight"].T
        c_kv = _rms(kv_a[:, :r], w[p + "kv_a_layernorm.weight"], eps)                # [N, r]
        k_pe = _rope_neox(kv_a[:, r:], pos, cfg.rope_theta)                          # [N, rope]
        latents.append(torch.cat([c_kv, k_pe], -1))
        kv = (c_kv @ w[p + "kv_b_proj.weight"].T).view(N, H, nope + vd)              # full per-head K/V
        k = torch.cat([kv[..., :nope], k_pe[:, None, :].expand(N, H, rope)], -1)     # [N, H, nope+rope]
        v = kv[..., nope:]                                                           # [N, H, vd]
        q = torch.cat([q[..., :nope], _rope_neox(q[..., nope:], pos, cfg.rope_theta)], -1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(nope + rope)
        a = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        o = torch.einsum("hts,shd->thd", a, v).reshape(N, H * vd)
        h = h + o @ w[p + "o_proj.weight"].T
        x = _rms(h, w[f"model.layers.{i}.post_attention_layernorm.weight"], eps)
        mp = f"model.layers.{i}.mlp."
        g = torch.nn.functional.silu(x @ w[mp + "gate_proj.weight"].T) * (x @ w[mp + "up_proj.weight"].T)
        h = h + g @ w[mp + "down_proj.weight"].T
    h = _rms(h, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return h @ head.T, latents


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _prompts(rng: random.Random, n: int, lo: int = 1, hi: int = 14):
    """``n`` random prompts of distinct lengths (mixed-length batch)."""
    lens = rng.sample(range(lo, hi + 1), n)
    return [[rng.randrange(V) for _ in range(L)] for L in lens]


# ------------------------------------------------------------------ 1. absorbed == non-absorbed
@pytest.mark.parametrize("q_lora_rank,tied", [(None, True), (24, False)], ids=["plainq-tied", "qlora-untied"])
def test_chunked_prefill_matches_dense_oracle(seed, q_lora_rank, tied, backend_name):
    """Two EXTEND chunks of a batch of 3 mixed-length prompts (the second reads the first's
    cached latents): every token's logits and every cached latent equal the oracle's."""
    cfg = MLAConfig(vocab_size=V, q_lora_rank=q_lora_rank, tie_word_embeddings=tied)
    model = MLAModel(cfg, seed=seed)
    rng = random.Random(seed)
    seqs = _prompts(rng, 3, 4, 16)
    cut = [rng.randint(1, len(s) - 1) for s in seqs]                 # chunk 1 = s[:cut], chunk 2 = rest
    req = ReqToTokenPool(4, 32)
    pool = model.make_kv_pool(128)
    alloc = KVAllocator(128)
    backend = make_backend(backend_name, req, pool)
    require_support(backend, ForwardMode.EXTEND)
    rows = [2, 0, 3]                                                 # not in order on purpose
    slots = [alloc.alloc(len(s)) for s in seqs]
    for r, s in zip(rows, slots):
        req.write(r, 0, s)
    got = [[] for _ in seqs]
    for chunk in (0, 1):
        P = [0] * 3 if chunk == 0 else cut
        n = [c if chunk == 0 else len(s) - c for s, c in zip(seqs, cut)]
        ids = torch.tensor([t for s, p, k in zip(seqs, P, n) for t in s[p:p + k]])
        loc = torch.cat([sl[p:p + k] for sl, p, k in zip(slots, P, n)])
        batch = ForwardBatch.extend(rows, P, n, loc)
        batch.validate(req.req_to_token)
        backend.init_forward_metadata(batch)
        hidden, _ = model.forward(ids, batch, backend)
        logits = model.logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (sum(n), V)
        for i, part in enumerate(logits.split(n)):
            got[i].append(part)
    for i, s in enumerate(seqs):
        ref, latents = dense_oracle(cfg, model.w, s)
        err = _rel_err(torch.cat(got[i]), ref)
        assert err < 1e-4, f"seed={seed} prompt {i}: logits rel err {err}"
        for layer, lat in enumerate(latents):
            cached = pool.get_key_buffer(layer)[slots[i]][:, 0]
            err = _rel_err(cached, lat)
            assert err < 1e-4, f"seed={seed} prompt {i} layer {layer}: cached latent rel err {err}"


def test_target_greedy_matches_dense_oracle(seed, backend_name):
    """``Engine(SpecConfig("none"))`` greedy (prefill + DECODE steps over the absorbed model)
    == the oracle's greedy, checked token by token by teacher forcing: at every step the
    oracle's argmax over prompt + output so far is the token we emitted."""
    model = MLAModel(MLAConfig(vocab_size=V), seed=seed)
    prompts = _prompts(random.Random(seed), 4)
    res = make_engine(backend_name, model, spec=SpecConfig("none"), max_context=128).generate(
        prompts, SamplingParams(max_new_tokens=20))
    assert [len(t) for t in res.tokens] == [20] * 4
    assert len({t for out in res.tokens for t in out}) > 8, f"seed={seed}: degenerate continuations"
    for i, (p, out) in enumerate(zip(prompts, res.tokens)):
        ref, _ = dense_oracle(model.config, model.w, p + out[:-1])
        want = ref[len(p) - 1:].argmax(-1).tolist()
        assert out == want, f"seed={seed} prompt {i}: {out} != oracle {want}"


# ------------------------------------------------------------------ 2. lossless EAGLE
SPECS = [SpecConfig("eagle", topk=1, num_steps=1, num_draft_tokens=2, draft_layers=2),   # shortest chain
         SpecConfig("eagle", topk=1, num_steps=3, num_draft_tokens=4, draft_layers=3),   # chain
         SpecConfig("eagle", topk=2, num_steps=3, num_draft_tokens=6, draft_layers=3),   # tree
         SpecConfig("eagle", topk=3, num_steps=2, num_draft_tokens=7, draft_layers=2),   # wide tree
         SpecConfig("eagle", topk=2, num_steps=4, num_draft_tokens=8, draft_layers=4)]   # drafter == target


def _spec_id(s: SpecConfig) -> str:
    return f"topk{s.topk}-steps{s.num_steps}-d{s.num_draft_tokens}-L{s.draft_layers}"


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_eagle_lossless(seed, spec, backend_name):
    """EAGLE greedy == target-only greedy on a batch of mixed-length prompts with mixed
    per-request limits; the drafts are really used (some accepted, and unless the drafter is
    the whole target, some rejected)."""
    model = MLAModel(MLAConfig(vocab_size=V, tie_word_embeddings=bool(seed % 2)), seed=seed)
    rng = random.Random(seed)
    prompts = _prompts(rng, 4)
    limits = [rng.randint(12, 28) for _ in prompts]
    params = SamplingParams(max_new_tokens=28)
    base = make_engine(backend_name, model, spec=SpecConfig("none"), max_context=128).generate(
        prompts, params, max_new_tokens=limits)
    eng = make_engine(backend_name, model, spec=spec, max_context=128)
    assert eng.target_backend.kind == AttentionKind.MLA and isinstance(eng.draft_pool, MLATokenToKVPool)
    assert eng.target_backend.name == eng.draft_backend.name == backend_name
    assert eng.draft.num_layers == spec.draft_layers
    res = eng.generate(prompts, params, max_new_tokens=limits)
    assert res.tokens == base.tokens, f"seed={seed} {spec}"
    assert [len(t) for t in res.tokens] == limits
    rounds = [a for per in res.accept_lengths for a in per]
    cap = min(spec.num_steps, spec.num_draft_tokens - 1)
    assert sum(rounds) > 0, f"seed={seed}: no draft ever accepted"
    if spec.draft_layers < model.num_layers:
        assert 0 in rounds or cap > max(rounds), f"seed={seed}: drafts never rejected: {rounds}"
    assert res.num_forward_target < sum(limits)
    check_rows_restored(eng)


# ------------------------------------------------------------------ the model's interface
def test_model_interface(seed):
    cfg = MLAConfig(vocab_size=V)
    a, b = random_mla_weights(cfg, seed), random_mla_weights(cfg, seed)
    assert all(torch.equal(a[k], b[k]) for k in a)                           # deterministic
    assert not torch.equal(a["model.embed_tokens.weight"], random_mla_weights(cfg, seed + 1)["model.embed_tokens.weight"])
    model = MLAModel(cfg, a)
    assert model.num_layers == 4 and model.vocab_size == V and model.device == torch.device("cpu")
    assert model.layers[0].kind == AttentionKind.MLA and model.layers[0].head_dim == 48
    assert model.layers[0].v_head_dim == 32 and model.layers[0].scaling == pytest.approx(32 ** -0.5)
    draft = model.with_layers(2)
    assert draft.num_layers == 2 and draft.w is model.w
    assert draft.w["model.norm.weight"].data_ptr() == a["model.norm.weight"].data_ptr()
    pool = draft.make_kv_pool(16)
    assert isinstance(pool, MLATokenToKVPool) and pool.layer_num == 2
    assert pool.get_key_buffer(0).shape == (17, 1, 48) and pool.get_value_buffer(0).shape == (17, 1, 32)
    with pytest.raises(ValueError):
        model.with_layers(5)
    bad = dict(a)
    bad["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="kv_b_proj"):
        MLAModel(cfg, bad)
    with pytest.raises(ValueError):
        MLAConfig(qk_rope_head_dim=15)
    # capture_layers: the residual stream after those layers; the drafter's is the target's
    req, kv = ReqToTokenPool(1, 16), model.make_kv_pool(16)
    be = TorchReferenceBackend(req, kv)
    ids = torch.randint(0, V, (5,))
    req.write(0, 0, torch.arange(1, 6))
    batch = ForwardBatch.extend([0], [0], [5], torch.arange(1, 6))
    be.init_forward_metadata(batch)
    hidden, caps = model.forward(ids, batch, be, capture_layers=(1, 3))
    assert hidden.shape == (5, 64) and len(caps) == 2 and not torch.allclose(caps[0], caps[1])
    dbe = TorchReferenceBackend(req, pool)
    dbe.init_forward_metadata(batch)
    dhidden, dcaps = draft.forward(ids, batch, dbe, capture_layers=(1,))
    assert torch.equal(dcaps[0], caps[0]) and not torch.allclose(dhidden, hidden)


# ------------------------------------------------------------------ 3. GPU + CUDA graphs
@pytest.mark.gpu
def test_eagle_lossless_cuda_graphs(seed, backend_name):
    """On CUDA with graphs (DECODE / TARGET_VERIFY / DRAFT_EXTEND_V2 replayed over the MLA
    pools): target-only with graphs == eager, and EAGLE chains and trees with graphs == it."""
    model = MLAModel(MLAConfig(vocab_size=V), device="cuda", seed=seed)
    assert model.device.type == "cuda" and model.w["model.norm.weight"].is_cuda
    rng = random.Random(seed)
    prompts = _prompts(rng, 5)
    limits = [rng.randint(12, 28) for _ in prompts]
    params = SamplingParams(max_new_tokens=28)
    kw = dict(device="cuda", max_context=128, max_batch=5)
    eager = make_engine(backend_name, model, spec=SpecConfig("none"), **kw).generate(
        prompts, params, max_new_tokens=limits)
    graph = make_engine(backend_name, model, spec=SpecConfig("none"), cuda_graph=True, **kw)
    assert uses_graphs(graph) and len(graph.graph_modes) + len(graph.eager_routed) == 1, \
        (graph.graph_modes, graph.eager_routed)
    assert graph.generate(prompts, params, max_new_tokens=limits).tokens == eager.tokens, f"seed={seed}"
    for spec in SPECS[1:]:
        eng = make_engine(backend_name, model, spec=spec, cuda_graph=True, **kw)
        assert uses_graphs(eng) and len(eng.graph_modes) + len(eng.eager_routed) == 3, \
            (eng.graph_modes, eng.eager_routed)
        res = eng.generate(prompts, params, max_new_tokens=limits)
        assert res.tokens == eager.tokens, f"seed={seed} {spec}"
        assert sum(a for per in res.accept_lengths for a in per) > 0, f"seed={seed} {spec}"
