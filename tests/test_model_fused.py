"""The Llama model's fused path (``LlamaModel.forward_logits`` with ``fused=True``: the
fused ops of :mod:`specattn.ops.fused_llama`, which store the KV themselves and call the
backend with ``save_kv_cache=False``) against the op-by-op reference path, on the CPU (where
the fused ops run their references): the same logits and the same KV cache for EXTEND /
DECODE / TARGET_VERIFY batches, and the same tokens end to end through the engine."""
import random

import pytest
import torch

from specattn.backends import ForwardBatch, ForwardMode, ReqToTokenPool, create_backend, pack_tree_mask
from specattn.spec_runtime.engine import Engine, SpecConfig
from specattn.spec_runtime.model import LlamaModel
from specattn.spec_runtime.sampling import SamplingParams
from tiny_models import random_prompts, tiny_llama

V = 96


@pytest.fixture
def models(tmp_path, seed):
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    return cfg, LlamaModel(cfg, dict(w), fused=False), LlamaModel(cfg, dict(w), fused=True)


def _run(model, batches, ids_list):
    """Run the batches in order over fresh pools; returns the logits and the final K cache."""
    req = ReqToTokenPool(4, 64)
    pool = model.make_kv_pool(256)
    pool.k_buffer[0].fill_(float("nan"))  # poison: every read key must have been written
    req.req_to_token[:2] = torch.arange(1, 129).view(2, 64)
    backend = create_backend("torch_reference", req, pool)
    model.reserve_positions(64)
    out = []
    for batch, ids in zip(batches, ids_list):
        backend.init_forward_metadata(batch)
        out.append(model.forward_logits(ids, batch, backend, capture_layers=[0, model.num_layers - 1]))
    return out, pool


def test_fused_forward_equals_reference(models, seed):
    cfg, ref, fused = models
    g = torch.Generator().manual_seed(seed)
    rows, rtt = [0, 1], torch.arange(1, 129).view(2, 64)
    P = [5, 3]
    ext = ForwardBatch.extend(rows, [0, 0], P, torch.cat([rtt[0, :5], rtt[1, :3]]))
    dec = ForwardBatch.decode(rows, P, torch.stack([rtt[0, 5], rtt[1, 3]]))
    D = 3
    mask = pack_tree_mask(torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, D, D))
    pos = torch.tensor([6, 7, 7, 4, 5, 5])
    ver = ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, rows, [6, 4], D,
                             torch.cat([rtt[0, 6:9], rtt[1, 4:7]]), positions=pos, tree_mask=mask)
    ids = [torch.randint(0, V, (n,), generator=g) for n in (8, 2, 6)]
    (a, pool_a), (b, pool_b) = _run(ref, [ext, dec, ver], ids), _run(fused, [ext, dec, ver], ids)
    # float32 rounding only: the fused path folds the norm weights into the GEMM weights
    # (one rounding of W * g) and sums in another order; bound relative to each tensor's scale
    close = lambda got, want: torch.testing.assert_close(  # noqa: E731
        got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for (la, ca), (lb, cb) in zip(a, b):
        close(lb, la)
        assert ca.shape == cb.shape == (la.shape[0], 2 * cfg.hidden_size)
        close(cb, ca)
    written = torch.cat([rtt[0, :9], rtt[1, :7]])
    for ka, kb in zip(pool_a.k_buffer + pool_a.v_buffer, pool_b.k_buffer + pool_b.v_buffer):
        close(kb[written], ka[written])


def test_fused_qkv_weights_are_views(models):
    cfg, _, fused = models
    p = "model.layers.0.self_attn."
    qkv = fused.w[p + "qkv_proj.weight"]
    assert fused.w[p + "q_proj.weight"].data_ptr() == qkv.data_ptr()
    assert fused.w[p + "v_proj.weight"].shape == (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size)


@pytest.mark.parametrize("spec", [SpecConfig("none"), SpecConfig("eagle", 2, 3, 6, 2), SpecConfig("dflash", block_size=4)],
                         ids=["none", "eagle", "dflash"])
def test_engine_with_fused_model_equals_reference(tmp_path, seed, spec):
    cfg, w = tiny_llama(tmp_path, seed, vocab=V)
    prompts = random_prompts(seed, V)
    p = SamplingParams(max_new_tokens=12)
    want = Engine(LlamaModel(cfg, dict(w), fused=False), spec=spec, max_context=64).generate(prompts, p)
    got = Engine(LlamaModel(cfg, dict(w), fused=True), spec=spec, max_context=64).generate(prompts, p)
    assert got.tokens == want.tokens, f"seed={seed}"
