"""``RoutedBackend`` and the engine's routing of modes its backend lacks (CPU, reference
backends standing in for FlashInfer-without-a-mode and for Triton):

- per-mode ``supports`` / metadata / forward go to the mode's backend, over the same pools;
- a forward whose metadata another mode's backend built fails instead of running stale;
- the engine routes exactly the missing modes to ``triton`` (``Engine.mode_routed``), names
  the routed backend ``primary+triton``, and the output equals the unrouted engine's;
- no route when the fallback lacks the mode too: construction names what is missing.
"""
import pytest
import torch

from specattn.backends import (AttentionLayer, ForwardBatch, ForwardMode, MHATokenToKVPool, ReqToTokenPool,
                               RoutedBackend, TorchReferenceBackend, UnsupportedError, pack_tree_mask)
from specattn.spec_runtime import engine as engine_mod
from specattn.spec_runtime.engine import Engine, SpecConfig
from tiny_models import random_prompts, tiny_llama
from specattn.spec_runtime.sampling import SamplingParams

M = ForwardMode


def lacking(*modes, name="lacking"):
    class Lacking(TorchReferenceBackend):
        @classmethod
        def supports(cls, mode, *, graph, kind):
            return mode not in modes and super().supports(mode, graph=graph, kind=kind)

    Lacking.name = name
    return Lacking


class Counting(TorchReferenceBackend):
    name = "counting"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def init_forward_metadata(self, batch):
        self.calls.append(batch.forward_mode)
        super().init_forward_metadata(batch)


def pools():
    req = ReqToTokenPool(4, 32, "cpu")
    kv = MHATokenToKVPool(64, 1, torch.float32, 2, 16, 1, "cpu")
    return req, kv


def test_routes_per_mode():
    req, kv = pools()
    primary = lacking(M.TARGET_VERIFY)(req, kv)
    other = Counting(req, kv)
    r = RoutedBackend(primary, {M.TARGET_VERIFY: other})
    assert r.name == "lacking+counting" and r.backend_for(M.DECODE) is primary
    assert r.supports(M.TARGET_VERIFY, graph=False, kind=r.kind)
    assert not primary.supports(M.TARGET_VERIFY, graph=False, kind=r.kind)
    req.write(0, 0, torch.arange(1, 9))
    decode = ForwardBatch.decode([0], [5], torch.tensor([6]))
    r.init_forward_metadata(decode)
    assert other.calls == [] and r.forward_metadata is primary.forward_metadata
    tree = pack_tree_mask(torch.ones(2, 2, dtype=torch.bool).tril()[None])
    verify = ForwardBatch.fixed(M.TARGET_VERIFY, torch.tensor([0]), torch.tensor([5]), 2, torch.tensor([6, 7]),
                                positions=torch.tensor([5, 6]), tree_mask=tree)
    layer = AttentionLayer.mha(0, 2, 2, 16)
    q, k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    with pytest.raises(RuntimeError, match="init_forward_metadata first"):
        r.forward(q, k, v, layer, verify)   # metadata is DECODE's, from the primary
    r.init_forward_metadata(verify)
    assert other.calls == [M.TARGET_VERIFY]
    out = r.forward(q, k, v, layer, verify)
    ref = TorchReferenceBackend(req, kv)
    ref.init_forward_metadata(verify)
    assert torch.equal(out, ref.forward(q, k, v, layer, verify))


def test_routes_need_the_same_pools():
    req, kv = pools()
    req2, kv2 = pools()
    with pytest.raises(ValueError, match="share the primary's pools"):
        RoutedBackend(TorchReferenceBackend(req, kv), {M.DECODE: TorchReferenceBackend(req, kv2)})
    with pytest.raises(ValueError, match="share the primary's pools"):
        RoutedBackend(TorchReferenceBackend(req, kv), {M.DECODE: TorchReferenceBackend(req2, kv)})
    with pytest.raises(ValueError, match="IDLE"):
        RoutedBackend(TorchReferenceBackend(req, kv), {M.IDLE: TorchReferenceBackend(req, kv)})


@pytest.fixture
def tiny(tmp_path, seed):
    cfg, w = tiny_llama(tmp_path, seed, vocab=80, layers=3)
    return cfg, w, random_prompts(seed, 80, max_len=10)


def fake_registry(monkeypatch, primary_cls, fallback_cls):
    built = {}

    def create(name, req, kv, **kw):
        b = (fallback_cls if name == "triton" else primary_cls)(req, kv, **kw)
        built.setdefault(b.name, []).append(b)
        return b

    monkeypatch.setattr(engine_mod, "create_backend", create)
    return built


def test_engine_routes_missing_modes(tiny, monkeypatch):
    cfg, w, prompts = tiny
    p = SamplingParams(max_new_tokens=12)
    spec = SpecConfig("eagle", 2, 3, 6, 2)
    want = Engine(cfg, dict(w), spec=spec, max_context=64).generate(prompts, p)
    built = fake_registry(monkeypatch, lacking(M.TARGET_VERIFY, M.DRAFT_EXTEND_V2, name="fi"),
                          lacking(name="triton"))
    eng = Engine(cfg, dict(w), spec=spec, max_context=64)
    assert eng.mode_routed == ["target:TARGET_VERIFY->triton", "draft:DRAFT_EXTEND_V2->triton"]
    assert isinstance(eng.target_backend, RoutedBackend) and eng.target_backend.name == "fi+triton"
    assert eng.target_backend.backend_for(M.EXTEND).name == "fi"
    assert eng.draft_backend.backend_for(M.DRAFT_EXTEND_V2).kv_pool is eng.draft_pool
    assert [b.topk for b in built["fi"]] == [2, 2]
    got = eng.generate(prompts, p)
    assert got.tokens == want.tokens and got.accept_lengths == want.accept_lengths
    # target-only needs neither routed mode: nothing is routed
    eng = Engine(cfg, dict(w), max_context=64)
    assert eng.mode_routed == [] and eng.target_backend.name == "fi"


def test_dflash_drafter_gets_no_chain_promise(tiny, monkeypatch):
    cfg, w, _ = tiny
    built = fake_registry(monkeypatch, lacking(name="fi"), lacking(name="triton"))
    Engine(cfg, dict(w), spec=SpecConfig("dflash", block_size=4), max_context=64)
    assert [b.topk for b in built["fi"]] == [1, None]   # target verifies a chain; the block is not one


def test_no_route_when_the_fallback_lacks_it(tiny, monkeypatch):
    cfg, w, _ = tiny
    fake_registry(monkeypatch, lacking(M.TARGET_VERIFY, name="fi"), lacking(M.TARGET_VERIFY, name="triton"))
    with pytest.raises(UnsupportedError, match="target TARGET_VERIFY"):
        Engine(cfg, dict(w), spec=SpecConfig("eagle", 1, 2, 3, 2), max_context=64)


def test_in_capture_metadata_goes_to_the_mode_backend():
    """``init_forward_metadata_in_capture`` is routed like the other builders: the mode's
    backend builds it (the triton backend reading the batch's tensors in place), and a
    forward of another mode's metadata still fails."""
    from specattn.backends.triton_backend import TritonBackend
    req, kv = pools()
    primary = lacking(M.DECODE)(req, kv)
    tb = TritonBackend(req, kv)
    r = RoutedBackend(primary, {M.DECODE: tb})
    r.init_cuda_graph_state(2, 8)
    req.write(0, 0, torch.arange(1, 9))
    decode = ForwardBatch.decode([0], torch.tensor([5], dtype=torch.int32), torch.tensor([6]))
    r.init_forward_metadata_in_capture(decode)
    assert r.forward_metadata is tb.forward_metadata
    assert tb.forward_metadata.prefix_lens is decode.prefix_lens
    layer = AttentionLayer.mha(0, 2, 2, 16)
    with pytest.raises(RuntimeError, match="last metadata"):
        r.forward(torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16), layer,
                  ForwardBatch.extend([0], [0], [3], torch.tensor([1, 2, 3])))
