"""DFlash in the reference runtime (``spec_runtime/dflash.py``): lossless block drafting on
fresh random tiny Llama models, the block forward against a dense non-causal reference, forced
full/partial acceptance, sampling, EOS; and the lossless check on CUDA (marked gpu).  Target
and drafter run on the test run's ``--backend`` (``tests/runtime_backend.py``)."""
import random

import pytest
import torch

from specattn import ops
from specattn.backends import ForwardBatch, ForwardMode, pack_tree_mask
from specattn.spec_runtime import dflash
from runtime_backend import check_rows_restored, make_engine, uses_graphs
from specattn.spec_runtime.engine import Request, SpecConfig
from specattn.spec_runtime.strategies import parse_by_batch
from specattn.spec_runtime.loader import LlamaConfig, load_hf_dir, write_random_hf_dir
from specattn.spec_runtime.model import rms_norm as rms_norm_ref
from specattn.spec_runtime.sampling import SamplingParams

NEW = 24
V = 96


def random_model(tmp_path, seed):
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      tie_word_embeddings=bool(seed % 2), eos_token_ids=[])
    return load_hf_dir(write_random_hf_dir(tmp_path, cfg, seed=seed))


def random_prompts(seed, n=None):
    rng = random.Random(seed)
    return [[rng.randrange(V) for _ in range(rng.randint(1, 12))] for _ in range(n or rng.randint(2, 4))]


# ---------------------------------------------------------------------- pieces
@pytest.mark.parametrize("D", [2, 4, 16, 33])
def test_chain_tree_equals_build_tree(D):
    P = torch.tensor([0, 5, 17])
    bs = P.shape[0]
    parent_list = torch.cat([torch.tensor([-1]), torch.arange(D - 2)]).expand(bs, D - 1)
    selected = torch.arange(D - 1).expand(bs, D - 1)
    want = ops.build_tree(parent_list, selected, P, 1, D - 1, D)
    got = dflash.chain_tree(P, D)
    for name, a, b in zip(want._fields, want, got):
        assert torch.equal(a.long(), b.long()), name


@pytest.mark.parametrize("D", [2, 5, 16])
def test_chain_compaction_is_identity(D):
    """What ``Engine.verify_and_compact(chain=True)`` relies on to skip the compaction and
    the KV move: on a chain in token order the verified path is already at the front of its
    block, so compaction returns its inputs and every move pair is the identity (random
    targets: every accept length from 0 to D - 1 occurs)."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    bs = 4 * D
    tree = dflash.chain_tree(torch.randint(0, 50, (bs,), generator=g), D)
    drafts = torch.randint(0, 3, (bs, D), generator=g)
    target = torch.where(torch.rand(bs, D, generator=g) < 0.7, drafts.roll(-1, 1), 3)
    target[0], target[1] = drafts[0].roll(-1), 3          # the edges: all accepted, none
    res = ops.verify_tree_greedy(drafts, tree.retrive_index, tree.retrive_next_token,
                                 tree.retrive_next_sibling, target, D - 1)
    assert int(res.accept_length[0]) == D - 1 and int(res.accept_length[1]) == 0
    loc = torch.randperm(2 * bs * D, generator=g)[:bs * D]
    hid = torch.randn(bs * D, 3, generator=g)
    cp = ops.compact_accepted_path(res.accept_index, res.accept_length, loc, D, predicts=res.predicts,
                                   hidden_states=hid)
    assert torch.equal(cp.src_index, torch.arange(bs * D))
    assert torch.equal(cp.predicts, res.predicts) and torch.equal(cp.hidden_states, hid)
    assert torch.equal(cp.tgt_loc, loc) and torch.equal(cp.src_loc, loc) and torch.equal(cp.out_cache_loc, loc)


def test_context_layer_ids():
    assert dflash.context_layer_ids(30, 3) == [1, 14, 27]   # DFlash's rule: 1 .. n-3
    assert dflash.context_layer_ids(36, 1) == [18]          # one tap: the middle layer
    assert dflash.context_layer_ids(4, 3) == [0, 2, 3]      # too shallow: spread over 0 .. n-1
    with pytest.raises(ValueError):
        dflash.context_layer_ids(4, 0)


def test_validate():
    SpecConfig("dflash", block_size=2).validate()
    SpecConfig("dflash", block_size=4, topk=8, num_draft_tokens=9).validate()
    with pytest.raises(ValueError):
        SpecConfig("dflash", block_size=1).validate()
    with pytest.raises(ValueError, match="topk <= 8"):
        SpecConfig("dflash", block_size=4, topk=9, num_draft_tokens=9).validate()
    spec = SpecConfig("dflash", block_size=16, block_size_by_batch=((16, 4), (64, 2)))
    spec.validate()
    assert [spec.block_size_for(b) for b in (1, 15, 16, 63, 64, 200)] == [16, 16, 4, 4, 2, 2]
    assert spec.tokens_per_round() == 16
    assert SpecConfig("dflash", block_size=4, block_size_by_batch=((2, 8),)).tokens_per_round() == 8
    assert parse_by_batch(" 16:4, 64:2 ") == ((16, 4), (64, 2)) and parse_by_batch("") == ()
    # a chain's verified tokens by batch: the first of its block, never more than the block
    spec = SpecConfig("dflash", block_size=16, block_size_by_batch=((16, 4),), num_draft_tokens_by_batch=((4, 8), (32, 6)))
    spec.validate()
    assert [spec.num_draft_tokens_for(b) for b in (1, 3, 4, 15, 16, 32)] == [16, 16, 8, 8, 4, 4]
    assert spec.tokens_per_round() == 16
    with pytest.raises(ValueError, match="must be >= 2"):
        SpecConfig("dflash", block_size=8, num_draft_tokens_by_batch=((4, 1),)).validate()
    for bad, match in ((dict(algo="eagle"), "DFlash chains"), (dict(topk=2, num_draft_tokens=3), "DFlash chains"),
                       (dict(block_size_by_batch=((1, 4),)), "increase from >= 2"),
                       (dict(block_size_by_batch=((8, 4), (8, 2))), "increase from >= 2"),
                       (dict(block_size_by_batch=((8, 1),)), "blocks must be >= 2"),
                       (dict(block_size_by_batch=((8,),)), "int pairs")):
        kw = {"algo": "dflash", "block_size_by_batch": ((2, 3),), **bad}
        with pytest.raises(ValueError, match=match):
            SpecConfig(**kw).validate()
    for text in ("16", "16:4:2", "a:4"):
        with pytest.raises(ValueError, match="MIN_BATCH:VALUE"):
            parse_by_batch(text)


def test_block_forward_is_noncausal_attention_over_context(tmp_path, backend_name):
    """TARGET_VERIFY + all-ones mask on the drafter == a dense non-causal reference over the
    materialized context K/V (from the prefill's captured target features) + the block; the
    fused inference path (``forward_logits``, with and without ``top_k``) writes the same
    block K/V and gives the same logits."""
    seed = random.randrange(2**31)
    cfg, w = random_model(tmp_path, seed)
    B = 5
    eng = make_engine(backend_name, cfg, dict(w), spec=SpecConfig("dflash", block_size=B), max_context=64)
    d = eng.draft
    feats = {}
    orig = d.write_context_kv
    d.write_context_kv = lambda f, pos, loc, pool: (feats.setdefault("f", f), orig(f, pos, loc, pool))
    prompts = random_prompts(seed, 2)
    reqs = [Request(i, p, row=i) for i, p in enumerate(prompts)]
    eng._prefill(reqs)
    rows = torch.arange(len(reqs))
    P = eng.prefix_lens[rows]
    ids = torch.full((len(reqs), B), d.mask_token_id)
    ids[:, 0] = eng.roots[rows]
    cols = P[:, None] + torch.arange(B)
    loc = eng.req_pool.req_to_token[rows[:, None], cols].long().flatten()
    mask = pack_tree_mask(torch.ones(len(reqs), B, B, dtype=torch.bool))
    batch = ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, rows, P, B, loc,
                                      positions=cols.flatten(), tree_mask=mask)
    batch.validate(eng.req_pool.req_to_token)
    eng.draft_backend.init_forward_metadata(batch)
    pool = eng.draft_backend.kv_pool
    got, _ = d.forward(ids.flatten(), batch, eng.draft_backend)
    got = got.view(len(reqs), B, -1)
    kv_unfused = [(pool.get_key_buffer(l)[loc].clone(), pool.get_value_buffer(l)[loc].clone())
                  for l in range(d.num_layers)]
    # the fused inference path (the engine's: forward_logits) writes the same block K/V and
    # gives the same logits and top-k
    for l in range(d.num_layers):
        pool.get_key_buffer(l)[loc] = float("nan")
        pool.get_value_buffer(l)[loc] = float("nan")
    fused, _ = d.forward_logits(ids.flatten(), batch, eng.draft_backend)
    (vals, toks), _ = d.forward_logits(ids.flatten(), batch, eng.draft_backend, top_k=3)
    for l, (k, v) in enumerate(kv_unfused):
        torch.testing.assert_close(pool.get_key_buffer(l)[loc], k, rtol=1e-4, atol=1e-4, msg=f"seed={seed}")
        torch.testing.assert_close(pool.get_value_buffer(l)[loc], v, rtol=1e-4, atol=1e-4, msg=f"seed={seed}")
    unfused = d.logits(got.flatten(0, 1))
    torch.testing.assert_close(fused, unfused, rtol=1e-4, atol=1e-4, msg=f"seed={seed}")
    ref_vals, ref_toks = ops.topk_log_probs(unfused, 3)
    torch.testing.assert_close(vals, ref_vals, rtol=1e-4, atol=1e-4, msg=f"seed={seed}")
    gaps = ref_vals[:, :-1] - ref_vals[:, 1:]            # distinct ranks: the same tokens
    clear = torch.cat([gaps[:, :1] > 1e-3, (gaps[:, :-1] > 1e-3) & (gaps[:, 1:] > 1e-3)], 1)
    assert torch.equal(toks[:, :2][clear], ref_toks[:, :2][clear]), f"seed={seed}"

    # dense reference, request by request
    from specattn.spec_runtime.model import apply_rope, rms_norm, rope_cos_sin
    c, W = cfg, d.w
    H, Hkv, Dh, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    ctx_all = d.context_hidden(feats["f"]).split([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        n = len(p)
        ctx, h = ctx_all[i], d.embed(ids[i])
        cos_c, sin_c = rope_cos_sin(torch.arange(n), Dh, c.rope_theta, torch.float32)
        cos_b, sin_b = rope_cos_sin(torch.arange(n, n + B), Dh, c.rope_theta, torch.float32)
        for l in range(d.num_layers):
            pre = f"layers.{l}."
            wkv = W["w_kv"][l * 2 * Hkv * Dh:(l + 1) * 2 * Hkv * Dh]

            def kv(x, cos, sin):
                t = (x @ wkv.T).view(-1, 2, Hkv, Dh)
                return apply_rope(rms_norm(t[:, 0], W["k_norm"][l], eps), cos, sin), t[:, 1]
            x = rms_norm(h, W[pre + "input_layernorm.weight"], eps)
            q = apply_rope(rms_norm((x @ W[pre + "q_proj.weight"].T).view(B, H, Dh),
                                    W[pre + "q_norm.weight"], eps), cos_b, sin_b)
            kc, vc = kv(ctx, cos_c, sin_c)
            kb, vb = kv(x, cos_b, sin_b)
            K = torch.cat([kc, kb]).repeat_interleave(H // Hkv, dim=1)
            Vv = torch.cat([vc, vb]).repeat_interleave(H // Hkv, dim=1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, K) / Dh ** 0.5, -1)  # no mask
            h = h + torch.einsum("hqk,khd->qhd", att, Vv).reshape(B, -1) @ W[pre + "o_proj.weight"].T
            x = rms_norm(h, W[pre + "post_attention_layernorm.weight"], eps)
            h = h + (torch.nn.functional.silu(x @ W[pre + "gate_proj.weight"].T)
                     * (x @ W[pre + "up_proj.weight"].T)) @ W[pre + "down_proj.weight"].T
        want = rms_norm(h, W["norm.weight"], eps)
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4, msg=f"seed={seed}")


# ---------------------------------------------------------------------- end to end
@pytest.mark.parametrize("block_size", [4, 16])
def test_dflash_lossless_random_models(tmp_path, block_size, backend_name):
    """Fresh random tiny models and mixed-length prompt batches: dflash == target-only greedy."""
    seed = random.randrange(2**31)
    cfg, w = random_model(tmp_path, seed)
    prompts = random_prompts(seed)
    base = make_engine(backend_name, cfg, dict(w), max_context=128).generate(
        prompts, SamplingParams(max_new_tokens=NEW))
    eng = make_engine(backend_name, cfg, dict(w), spec=SpecConfig("dflash", block_size=block_size),
                      max_context=128)
    assert eng.target_backend.name == eng.draft_backend.name == backend_name
    res = eng.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert res.tokens == base.tokens, f"seed={seed}"
    assert all(0 <= a <= block_size - 1 for per in res.accept_lengths for a in per)
    assert res.num_forward_target == 1 + max(len(per) for per in res.accept_lengths)
    check_rows_restored(eng)


@pytest.mark.parametrize("topk", [1, 4])
def test_dflash_draft_vocab_lossless(tmp_path, topk, backend_name):
    """A DFlash chain / DDTree drafting from a random subset of the vocabulary (FR-Spec) stays
    lossless; every draft lies in the subset (drafted as target ids, fused and unfused head
    alike); topk above the subset is refused; None restores the full vocabulary."""
    seed = random.randrange(2**31)
    cfg, w = random_model(tmp_path, seed)
    prompts = random_prompts(seed)
    p = SamplingParams(max_new_tokens=NEW)
    spec = SpecConfig("dflash", block_size=4, topk=topk, num_draft_tokens=4 if topk == 1 else 6)
    base = make_engine(backend_name, cfg, dict(w), max_context=128).generate(prompts, p)
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=128)
    drafter = eng.strategy.drafter
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:V // 3]
    drafter.set_draft_vocab(vocab)
    drafted = []
    block_top = eng.strategy.block_top
    eng.strategy.block_top = lambda *a, **k: (lambda r: drafted.append(r[2]) or r)(block_top(*a, **k))
    assert eng.generate(prompts, p).tokens == base.tokens, f"seed={seed}"
    allowed = set(vocab.tolist())
    assert drafted and all(set(t.flatten().tolist()) <= allowed for t in drafted)
    # the unfused head (trainable weights) drafts the same top-k over the subset
    h = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(drafter.dtype)
    fused = ops.rms_norm_matmul_topk(h, None, drafter._fused["head"], cfg.rms_norm_eps, 3,
                                     column_ids=drafter.draft_vocab)
    ref = ops.topk_log_probs(drafter.logits(rms_norm_ref(h, drafter.w["norm.weight"], cfg.rms_norm_eps))
                             [:, drafter.draft_vocab], 3)
    assert torch.equal(fused[1], drafter.draft_token_ids(ref[1]))
    drafter.set_draft_vocab(torch.arange(2))
    with pytest.raises(ValueError, match="draft vocabulary"):
        make_engine(backend_name, cfg, dict(w), spec=SpecConfig("dflash", block_size=4, topk=4, num_draft_tokens=6),
                    max_context=128, draft_model=drafter)
    drafter.set_draft_vocab(None)
    assert drafter.draft_vocab is None and drafter._fused["head"].shape[0] == V


@pytest.mark.parametrize("block_size", [4, 16])
def test_forced_acceptance_full_and_partial(tmp_path, monkeypatch, block_size, backend_name):
    """Drafts replaced by the target's own greedy continuation (so every draft is right), then
    every other round corrupted at a random block position k: each round must accept exactly
    B-1 (clean) or k-1 (corrupted) drafts, and the output stays the target's."""
    seed = random.randrange(2**31)
    cfg, w = random_model(tmp_path, seed)
    B = block_size
    prompts = random_prompts(seed)
    ref = make_engine(backend_name, cfg, dict(w), max_context=128).generate(
        prompts, SamplingParams(max_new_tokens=NEW + B)).tokens
    rng = random.Random(seed)
    expected = {i: [] for i in range(len(prompts))}
    real = dflash.DFlashStrategy.propose_block

    def oracle(self, engine, rb, rows, block, *args):
        toks = real(self, engine, rb, rows, block, *args).clone()      # the drafter still runs
        for i, (row, p) in enumerate(zip(rows.tolist(), block.seq_lens.tolist())):
            if row >= len(prompts):                          # a padding row
                continue
            n = p - len(prompts[row]) + 1                    # tokens emitted so far (root last)
            assert toks[i, 0] == ref[row][n - 1]
            toks[i, 1:] = torch.tensor(ref[row][n:n + B - 1])
            exp = B - 1
            if len(expected[row]) % 2:
                k = rng.randint(2, B - 1) if B > 2 else 1
                toks[i, k] = (toks[i, k] + 1) % V
                exp = k - 1
            expected[row].append(exp)
        return toks

    monkeypatch.setattr(dflash.DFlashStrategy, "propose_block", oracle)
    eng = make_engine(backend_name, cfg, dict(w), spec=SpecConfig("dflash", block_size=B), max_context=128)
    res = eng.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert res.tokens == [t[:NEW] for t in ref], f"seed={seed}"
    assert res.accept_lengths == [expected[i] for i in range(len(prompts))], f"seed={seed}"
    rounds = [a for per in res.accept_lengths for a in per]
    assert B - 1 in rounds and any(0 < a < B - 1 for a in rounds), rounds
    check_rows_restored(eng)


@pytest.mark.parametrize("by", ["block", "verify"])
def test_block_size_by_batch(tmp_path, monkeypatch, backend_name, by):
    """A smaller block, or a shorter verified chain of the same block, once the batch is
    large: with every draft right (the target's own continuation), rounds over 3-4 running
    requests (padded to 4) accept 2 drafts (block 3, or 3 of block 6's tokens verified), and
    after two requests end, rounds over 2 accept 5 (block 6); the output stays the target's."""
    seed = random.randrange(2**31)
    cfg, w = random_model(tmp_path, seed)
    prompts = random_prompts(seed, 4)
    ref = make_engine(backend_name, cfg, dict(w), max_context=128).generate(
        prompts, SamplingParams(max_new_tokens=NEW + 6)).tokens
    real = dflash.DFlashStrategy.propose_block

    def oracle(self, engine, rb, rows, block, *args):
        toks = real(self, engine, rb, rows, block, *args).clone()
        B = toks.shape[1]
        for i, (row, p) in enumerate(zip(rows.tolist(), block.seq_lens.tolist())):
            if row < len(prompts):
                n = p - len(prompts[row]) + 1
                toks[i, 1:] = torch.tensor(ref[row][n:n + B - 1])
        return toks

    monkeypatch.setattr(dflash.DFlashStrategy, "propose_block", oracle)
    spec = SpecConfig("dflash", block_size=6, **{("block_size_by_batch" if by == "block"
                                                  else "num_draft_tokens_by_batch"): ((3, 3),)})
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, max_context=128, max_batch=4)
    limits = [NEW, NEW, 6, 6]
    res = eng.generate(prompts, SamplingParams(max_new_tokens=NEW), max_new_tokens=limits)
    assert res.tokens == [t[:n] for t, n in zip(ref, limits)], f"seed={seed}"
    for per in res.accept_lengths[2:]:
        assert set(per) == {2}, res.accept_lengths
    for per in res.accept_lengths[:2]:
        assert per[0] == 2 and 5 in per and per == sorted(per) and set(per) == {2, 5}, res.accept_lengths
    check_rows_restored(eng)


def test_sampling_smoke(tmp_path, backend_name):
    seed = random.randrange(2**31)
    cfg, w = random_model(tmp_path, seed)
    prompts = random_prompts(seed, 3)
    eng = make_engine(backend_name, cfg, dict(w), spec=SpecConfig("dflash", block_size=8), max_context=128)
    limits = [5, 9, 13]
    res = eng.generate(prompts, SamplingParams(temperature=1.0, seed=seed, max_new_tokens=NEW),
                       max_new_tokens=limits)
    assert [len(t) for t in res.tokens] == limits
    assert res.finish_reasons == ["length"] * 3
    assert all(0 <= t < V for out in res.tokens for t in out)
    check_rows_restored(eng)
    again = make_engine(backend_name, cfg, dict(w), spec=SpecConfig("dflash", block_size=8),
                        max_context=128).generate(
        prompts, SamplingParams(temperature=1.0, seed=seed, max_new_tokens=NEW), max_new_tokens=limits)
    assert again.tokens == res.tokens  # seeded


def test_stops_on_eos(tmp_path, backend_name):
    seed = random.randrange(2**31)
    cfg, w = random_model(tmp_path, seed)
    prompts = random_prompts(seed, 3)
    base = make_engine(backend_name, cfg, dict(w), max_context=128).generate(
        prompts, SamplingParams(max_new_tokens=NEW)).tokens
    eos = base[0][4]
    eng = make_engine(backend_name, cfg, dict(w), spec=SpecConfig("dflash", block_size=4), max_context=128,
                      eos_token_ids=[eos])
    res = eng.generate(prompts, SamplingParams(max_new_tokens=NEW))
    for want, got, why in zip(base, res.tokens, res.finish_reasons):
        cut = want[:want.index(eos) + 1] if eos in want else want
        assert got == cut and why == ("eos" if eos in want else "length"), f"seed={seed}"
    check_rows_restored(eng)


# ---------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [4, 16])
def test_dflash_lossless_cuda(tmp_path, block_size, backend_name):
    """On CUDA, eager and with cuda_graph=True (the drafter's block forward replays a graph;
    the target's verify runs eagerly since it returns hidden states): == target-only greedy."""
    seed = random.randrange(2**31)
    cfg, w = random_model(tmp_path, seed)
    prompts = random_prompts(seed, 5)
    kw = dict(device="cuda", max_context=128, max_batch=5)
    base = make_engine(backend_name, cfg, dict(w), **kw).generate(prompts, SamplingParams(max_new_tokens=NEW))
    for graph in (False, True):
        eng = make_engine(backend_name, cfg, dict(w), spec=SpecConfig("dflash", block_size=block_size),
                          cuda_graph=graph, **kw)
        assert (uses_graphs(eng) or bool(eng.eager_routed)) == graph
        res = eng.generate(prompts, SamplingParams(max_new_tokens=NEW))
        assert res.tokens == base.tokens, f"seed={seed} cuda_graph={graph}"
        check_rows_restored(eng)
    res = eng.generate(prompts, SamplingParams(temperature=1.0, seed=seed, max_new_tokens=NEW))
    assert [len(t) for t in res.tokens] == [NEW] * len(prompts)


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [1, 4])
def test_dflash_draft_vocab_graphs_cuda(tmp_path, topk, backend_name):
    """On CUDA with whole-round graphs, a DFlash chain / DDTree drafting from a random third of
    the vocabulary (set before the engine captures its graphs) == target-only greedy."""
    seed = random.randrange(2**31)
    cfg, w = random_model(tmp_path, seed)
    prompts = random_prompts(seed, 5)
    kw = dict(device="cuda", max_context=128, max_batch=5)
    base = make_engine(backend_name, cfg, dict(w), **kw).generate(prompts, SamplingParams(max_new_tokens=NEW))
    vocab = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:V // 3]

    def drafter(target):
        d = dflash.DFlashDrafter(target, 2, max_positions=128, seed=seed)
        d.set_draft_vocab(vocab)
        return d

    spec = SpecConfig("dflash", block_size=4, topk=topk, num_draft_tokens=4 if topk == 1 else 6)
    eng = make_engine(backend_name, cfg, dict(w), spec=spec, cuda_graph=True, draft_model=drafter, **kw)
    assert (uses_graphs(eng) or bool(eng.eager_routed)) and eng.strategy.drafter.draft_vocab is not None
    res = eng.generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert res.tokens == base.tokens, f"seed={seed}"
    check_rows_restored(eng)


@pytest.mark.slow
def test_shipped_dflash_generate_equals_none(gguf_path, backend_name):
    """``specattn generate --algo dflash`` picks the shipped DFlash drafter for the default
    model and emits exactly ``--algo none``'s tokens (float32, CPU)."""
    import json
    from typer.testing import CliRunner
    from runtime_backend import skip_real_model_if_interpreted
    from specattn import cli
    from specattn.spec_runtime import cli as rcli
    skip_real_model_if_interpreted(backend_name)
    shape = dict(hidden_size=576, vocab_size=49152, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3)
    if rcli.default_drafter(type("C", (), shape), "dflash") is None:
        pytest.skip("no DFlash drafter is shipped for the default model")
    args = ["generate", "--prompt", "Explain photosynthesis in two sentences.", "--device", "cpu",
            "--max-new-tokens", "24", "--backend", backend_name, "--json", "--no-warmup"]
    runner = CliRunner()
    none = runner.invoke(cli.app, args)
    flash = runner.invoke(cli.app, args + ["--algo", "dflash", "--block-size", "16"])
    assert none.exit_code == 0 and flash.exit_code == 0, (none.output, flash.output)
    a, b = json.loads(none.stdout), json.loads(flash.stdout)
    assert b["drafter"] == "dflash"
    assert a["outputs"][0]["tokens"] == b["outputs"][0]["tokens"]
    assert b["mean_accept_length"] > 1.0


@pytest.mark.gpu
def test_block_size_by_batch_cuda(tmp_path, backend_name):
    """Per-batch blocks and per-batch verified chains on CUDA, eager and with graphs (a
    round graph per padded batch size, each with its own block or chain): requests of different lengths shrink the batch across the
    threshold, and the output stays target-only greedy."""
    seed = random.randrange(2**31)
    cfg, w = random_model(tmp_path, seed)
    prompts = random_prompts(seed, 5)
    limits = [NEW, 7, NEW, 4, 11]
    kw = dict(device="cuda", max_context=128, max_batch=5)
    base = make_engine(backend_name, cfg, dict(w), **kw).generate(
        prompts, SamplingParams(max_new_tokens=NEW), max_new_tokens=limits)
    for by, graph in [(b, g) for b in ("block_size_by_batch", "num_draft_tokens_by_batch") for g in (False, True)]:
        spec = SpecConfig("dflash", block_size=6, **{by: ((3, 3),)})   # a smaller block, or a shorter verify
        eng = make_engine(backend_name, cfg, dict(w), spec=spec, cuda_graph=graph, **kw)
        res = eng.generate(prompts, SamplingParams(max_new_tokens=NEW), max_new_tokens=limits)
        assert res.tokens == base.tokens, f"seed={seed} cuda_graph={graph} {by}"
        assert all(0 <= a <= 5 for per in res.accept_lengths for a in per)
        check_rows_restored(eng)
