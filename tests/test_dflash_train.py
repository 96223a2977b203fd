"""DFlash drafter training (spec_runtime/dflash.py ``DFlashDrafter``, spec_runtime/train_drafter.py
``--kind dflash``, spec_runtime/drafter_cli.py): z-lab's checkpoint layout and its size for the
real model, the dense training forward against the runtime's block forward over the backend,
the block masks (no future, no other block, no other sequence), anchor sampling and teacher
validity, the weighted soft cross-entropy, a tiny end-to-end training run that a runtime engine
then drafts with, and CLI errors.  CPU, float32."""
import dataclasses
import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from specattn.backends import ForwardBatch, ForwardMode, ReqToTokenPool, create_backend, pack_tree_mask
from specattn.spec_runtime import dflash
from specattn.spec_runtime.dflash import (DFlashConfig, DFlashDrafter, checkpoint_nbytes, context_layer_ids,
                                          fit_intermediate_size, init_weights)
from specattn.spec_runtime.drafter_cli import drafter_app
from specattn.spec_runtime.drafter_base import frequent_tokens, read_token_counts
from specattn.spec_runtime.engine import Engine, SpecConfig
from specattn.spec_runtime.loader import LlamaConfig, load_hf_dir, random_weights
from specattn.spec_runtime.model import LlamaModel
from specattn.spec_runtime.sampling import SamplingParams
from specattn.spec_runtime.train_drafter import (GenConfig, SequenceData, TrainConfig, block_valid, collate,
                                                 dflash_config_for, evaluate, generate_data, greedy_round_leads,
                                                 implied_accept_length, pack_sequences, sample_anchors, soft_ce,
                                                 target_features)
from tiny_models import random_prompts, tiny_llama

REAL = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                   rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                   bos_token_id=1, eos_token_ids=[2])


def _real_shapes(layers, taps, inter):
    """z-lab's tensor names and shapes for the real model, written out by hand."""
    out = {"fc.weight": (576, 576 * taps), "hidden_norm.weight": (576,)}
    for i in range(layers):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (576,), p + "self_attn.q_proj.weight": (576, 576),
                    p + "self_attn.k_proj.weight": (192, 576), p + "self_attn.v_proj.weight": (192, 576),
                    p + "self_attn.o_proj.weight": (576, 576), p + "self_attn.q_norm.weight": (64,),
                    p + "self_attn.k_norm.weight": (64,), p + "post_attention_layernorm.weight": (576,),
                    p + "mlp.gate_proj.weight": (inter, 576), p + "mlp.up_proj.weight": (inter, 576),
                    p + "mlp.down_proj.weight": (576, inter)})
    out["norm.weight"] = (576,)
    return out


def _target(seed, layers=4, vocab=96, hidden=64):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                      tie_word_embeddings=True, eos_token_ids=[])
    return cfg, LlamaModel(cfg, random_weights(cfg.param_shapes(), seed))


def _drafter(target, seed, layers=2, block=5, std=0.1):
    cfg = DFlashConfig.from_target(target.config, layers, 3, block_size=block, intermediate_size=48,
                                   num_target_layers=target.num_layers)
    return DFlashDrafter(target, config=cfg, weights=init_weights(cfg, seed, std=std, norm_jitter=0.1))


def _close(a, b, tol=1e-5):
    scale = max(1.0, float(b.abs().max()))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=tol * scale)


# ----------------------------------------------------------------------------- config / checkpoint

def test_real_model_layout_and_size():
    tc = TrainConfig(kind="dflash")
    cfg = dflash_config_for(REAL, 30, tc, "smollm2")
    assert (cfg.num_hidden_layers, cfg.intermediate_size, cfg.target_layer_ids) == (2, 896, [1, 14, 27])
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_target_layers) == (16, 16, 30)
    assert cfg.param_shapes() == _real_shapes(2, 3, 896)
    n = sum(math.prod(s) for s in _real_shapes(2, 3, 896).values())
    assert checkpoint_nbytes(cfg) == 2 * n == 11_730_176 and 2 * n + 8192 <= 12 * 2**20
    # the target's full MLP width does not fit 12 MiB with 2 layers; z-lab's 5 layers / 5 taps even less
    assert checkpoint_nbytes(DFlashConfig.from_target(REAL, 2, 3)) == 16_153_856
    zlab = DFlashConfig.from_target(REAL, 5, 5)
    assert checkpoint_nbytes(zlab) == 2 * sum(math.prod(s) for s in _real_shapes(5, 5, 1536).values()) == 38_722_304
    assert fit_intermediate_size(zlab, 12 * 2**20) is None
    with pytest.raises(ValueError, match="36.93 MiB"):
        dflash_config_for(REAL, 30, TrainConfig(kind="dflash", draft_layers=5, num_context_layers=5,
                                                draft_intermediate_size=1536), "x")
    with pytest.raises(ValueError, match="do not fit"):
        dflash_config_for(REAL, 30, TrainConfig(kind="dflash", draft_layers=5, num_context_layers=5), "x")
    assert dflash_config_for(REAL, 30, TrainConfig(kind="dflash", max_checkpoint_mib=0), "x").intermediate_size == 1536
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["num_hidden_layers"] == 2 and d["layer_types"] == ["full_attention"] * 2
    assert d["block_size"] == 16 and d["num_target_layers"] == 30 and d["attention_bias"] is False
    assert d["dflash_config"] == {"block_size": 16, "mask_token_id": 16, "target_layer_ids": [1, 14, 27]}
    assert d["tie_word_embeddings"] is False and d["hidden_act"] == "silu" and d["rope_theta"] == 100000.0
    assert (d["hidden_size"], d["intermediate_size"], d["num_attention_heads"], d["num_key_value_heads"],
            d["head_dim"], d["vocab_size"]) == (576, 896, 9, 3, 64, 49152)
    assert DFlashConfig.from_hf_dict(json.loads(json.dumps(d))).param_shapes() == cfg.param_shapes()
    assert context_layer_ids(30, 2) == [1, 27]     # z-lab's default: as many taps as draft layers


def test_checkpoint_roundtrip(tmp_path, seed):
    _, target = _target(seed)
    dr = _drafter(target, seed + 1)
    dr.save(tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
    shapes = dr.config.param_shapes()
    with safe_open(str(tmp_path / "d" / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(shapes)
        for n in f.keys():
            t = f.get_tensor(n)
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == shapes[n]
        # the stacked runtime layout maps back onto the per-layer K/V projections and norms
        kv = 2 * 16
        assert torch.equal(f.get_tensor("layers.1.self_attn.k_proj.weight"),
                           dr.w["w_kv"][2 * kv:3 * kv].to(torch.bfloat16))
        assert torch.equal(f.get_tensor("layers.1.self_attn.v_proj.weight"),
                           dr.w["w_kv"][3 * kv:4 * kv].to(torch.bfloat16))
        assert torch.equal(f.get_tensor("layers.0.self_attn.k_norm.weight"), dr.w["k_norm"][0].to(torch.bfloat16))
        assert torch.equal(f.get_tensor("layers.1.mlp.down_proj.weight"),
                           dr.w["layers.1.down_proj.weight"].to(torch.bfloat16))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["mask_token_id"] == 16
    back = DFlashDrafter.load(tmp_path / "d", target)
    assert back.context_layers == dr.context_layers and back.block_size == 5 and back.mask_token_id == 16
    sd, sd2 = dr.state_dict(), back.state_dict()
    assert list(sd) == list(shapes) and set(sd2) == set(sd)
    for k in sd:  # bf16 on disk: identical to the bf16 rounding of the original
        assert torch.equal(sd2[k], sd[k].to(torch.bfloat16).float()), k
    back.save(tmp_path / "e")   # second roundtrip: bit-identical
    assert (tmp_path / "e" / "model.safetensors").read_bytes() == (tmp_path / "d" / "model.safetensors").read_bytes()
    # a copy of the target's embedding, which some trainers save, is ignored
    w = load_file(str(tmp_path / "d" / "model.safetensors"))
    save_file(dict(w, **{"embed_tokens.weight": torch.zeros(96, 64)}), str(tmp_path / "d" / "model.safetensors"))
    DFlashDrafter.load(tmp_path / "d", target)


def test_load_errors(tmp_path, seed):
    _, target = _target(seed)
    dr = _drafter(target, seed)
    d = dr.save(tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    w = load_file(str(d / "model.safetensors"))

    def with_config(**kw):
        (d / "config.json").write_text(json.dumps({**cfg, **kw}))

    with pytest.raises(ValueError, match="hidden_size"):
        DFlashDrafter.load(d, _target(seed, hidden=32)[1])
    with pytest.raises(ValueError, match="vocab"):
        DFlashDrafter.load(d, _target(seed, vocab=120)[1])
    with pytest.raises(ValueError, match="num_target_layers=4"):
        DFlashDrafter.load(d, _target(seed, layers=6)[1])
    with_config(num_target_layers=None, dflash_config={**cfg["dflash_config"], "target_layer_ids": [0, 9]})
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashDrafter.load(d, target)
    with_config(dflash_config={**cfg["dflash_config"], "mask_token_id": 96})
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashDrafter.load(d, target)
    with_config(dflash_config={k: v for k, v in cfg["dflash_config"].items() if k != "mask_token_id"})
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashDrafter.load(d, target)
    with_config(dflash_config={**cfg["dflash_config"], "conv_kernel_size": 2, "conv_group_size": 16})
    with pytest.raises(ValueError, match="conv_kernel_size"):
        DFlashDrafter.load(d, target)
    with_config(layer_types=["sliding_attention"] * 2)
    with pytest.raises(ValueError, match="layer_types"):
        DFlashDrafter.load(d, target)
    with_config(architectures=["LlamaForCausalLMEagle3"])
    with pytest.raises(ValueError, match="DFlashDraftModel"):
        DFlashDrafter.load(d, target)
    with_config()
    save_file({k: v for k, v in w.items() if k != "layers.1.self_attn.q_norm.weight"}, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*q_norm"):
        DFlashDrafter.load(d, target)
    save_file(dict(w, **{"fc.weight": w["fc.weight"][:, :64].contiguous()}), str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        DFlashDrafter.load(d, target)
    with pytest.raises(FileNotFoundError):
        DFlashDrafter.load(tmp_path / "nothing", target)


# ----------------------------------------------------------------------------- forward equivalence

def test_dense_forward_equals_backend_block_forward(seed):
    """Packed rows through ``dense_forward`` == the runtime's block forward (context K/V
    materialized from the same features, TARGET_VERIFY + all-ones mask over the
    ``torch_reference`` backend), request by request, float32."""
    cfg, target = _target(seed)
    dr = _drafter(target, seed + 5)
    S = dr.block_size
    g = torch.Generator().manual_seed(seed)
    la, lb = 9, 12
    tokens = torch.randint(0, 96, (1, la + lb + 2), generator=g)
    seg = torch.tensor([[0] * la + [1] * lb + [-1] * 2])
    pos = torch.tensor([list(range(la)) + list(range(lb)) + [0, 0]])
    feats, _ = target_features(cfg, target.w, tokens, pos, seg, dr.context_layers)
    anchors = torch.tensor([[0, 4, la + 1, la + 7, la + lb - 1]])    # incl. a sequence start and end
    dense = dr.dense_forward(tokens, feats, pos, anchors, seg)[0]       # [N, S, H]

    req = ReqToTokenPool(8, 64)
    pool = dr.make_kv_pool(512)
    be = create_backend("torch_reference", req, pool)
    rows, P, locs, ids, nxt = [], [], [], [], 1
    for n, a in enumerate(anchors[0].tolist()):
        start = 0 if a < la else la                                     # the anchor's sequence
        p = a - start
        slots = torch.arange(nxt, nxt + p + S)
        nxt += p + S
        req.write(n, 0, slots)
        if p:
            dr.write_context_kv(feats[0, start:a], pos[0, start:a], slots[:p], pool)
        rows.append(n), P.append(p), locs.append(slots[p:])
        ids.append(torch.tensor([int(tokens[0, a])] + [dr.mask_token_id] * (S - 1)))
    bs = len(rows)
    positions = (torch.tensor(P)[:, None] + torch.arange(S)).flatten()
    mask = pack_tree_mask(torch.ones(bs, S, S, dtype=torch.bool))
    batch = ForwardBatch.fixed(ForwardMode.TARGET_VERIFY, rows, P, S, torch.cat(locs), positions=positions,
                               tree_mask=mask)
    batch.validate(req.req_to_token)
    be.init_forward_metadata(batch)
    got, _ = dr.forward(torch.cat(ids), batch, be)
    _close(got.view(bs, S, -1), dense)
    _close(dr.logits(got), dr.logits(dense.reshape(bs * S, -1)))


def test_block_masks(seed):
    """A block never sees the future (indices > its anchor, features >= it), other blocks, or
    other sequences; padding blocks (keep=False) change nothing either."""
    cfg, target = _target(seed)
    dr = _drafter(target, seed + 2)
    g = torch.Generator().manual_seed(seed + 1)
    T = 20
    tokens = torch.randint(0, 96, (1, T), generator=g)
    seg = torch.tensor([[0] * 12 + [1] * 8])
    pos = torch.tensor([list(range(12)) + list(range(8))])
    feats = torch.randn(1, T, 3 * 64, generator=g) * 3
    anchors = torch.tensor([[2, 6, 9, 14, 17]])
    base = dr.dense_forward(tokens, feats, pos, anchors, seg)
    # the future of anchor 6: later tokens and features at >= 6 of its sequence (and all of sequence 1)
    t2, f2 = tokens.clone(), feats.clone()
    t2[0, 7:] = (t2[0, 7:] + 1) % 96
    f2[0, 6:] += torch.randn(T - 6, 3 * 64, generator=g)
    out = dr.dense_forward(t2, f2, pos, anchors, seg)
    _close(out[0, :2], base[0, :2], tol=1e-6)               # anchors 2 and 6 see nothing that changed
    assert not torch.allclose(out[0, 2], base[0, 2])         # anchor 9 does
    # other blocks: the block of anchor 9 alone == among others; a padding block changes nothing
    alone = dr.dense_forward(tokens, feats, pos, anchors[:, 2:3], seg)
    _close(alone[0, 0], base[0, 2], tol=1e-6)
    padded = dr.dense_forward(tokens, feats, pos, torch.tensor([[9, 0]]), seg, keep=torch.tensor([[True, False]]))
    _close(padded[0, 0], base[0, 2], tol=1e-6)
    # other sequences: changing sequence 0 leaves the blocks of sequence 1 alone
    t3, f3 = tokens.clone(), feats.clone()
    t3[0, :12] = (t3[0, :12] + 5) % 96
    f3[0, :12] *= -1
    out = dr.dense_forward(t3, f3, pos, anchors, seg)
    _close(out[0, 3:], base[0, 3:], tol=1e-6)
    # and without segments one row is one sequence: anchor 14 then sees sequence 0 too
    assert not torch.allclose(dr.dense_forward(tokens, feats, pos, anchors)[0, 3], base[0, 3])
    with pytest.raises(ValueError, match="anchors"):
        dr.dense_forward(tokens, feats, pos, torch.tensor([[T]]), seg)


def test_anchor_sampling_and_teacher_validity():
    seg = torch.tensor([[0] * 6 + [1] * 5 + [-1] * 3, [2] * 14])
    lm = torch.tensor([[0, 0, 1, 1, 1, 0] + [0, 1, 1, 1, 1] + [0, 0, 0], [0] * 10 + [1] * 3 + [0]]).bool()
    g = torch.Generator().manual_seed(3)
    anchors, keep = sample_anchors(seg, lm, 5, g)
    assert anchors.shape == (2, 5) and keep.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    for b in range(2):
        a = anchors[b][keep[b]].tolist()
        assert a == sorted(set(a)) and all(lm[b, i] and seg[b, i] >= 0 for i in a)
    again = sample_anchors(seg, lm, 5, torch.Generator().manual_seed(3))
    assert torch.equal(again[0], anchors) and torch.equal(again[1], keep)
    assert sample_anchors(seg, lm, 100, torch.Generator().manual_seed(0))[1].sum() == 10   # all 7 + 3
    S = 4
    anchors = torch.tensor([[2, 3, 7, 10], [10, 11, 12, 0]])
    keep = torch.tensor([[True] * 4, [True, True, True, False]])
    got = block_valid(seg, lm, anchors, keep, S)
    for b in range(2):
        for n in range(4):
            a = int(anchors[b, n])
            for k in range(S):
                want = bool(keep[b, n]) and k >= 1 and all(
                    i < 14 and seg[b, i] == seg[b, a] and lm[b, i] for i in range(a, a + k))
                assert bool(got[b, n, k]) == want, (b, n, k)


def _packed_sequences(g, rows, T, vocab):
    """Random packed rows: sequences of a prompt (loss mask 0) then generated tokens, padding
    (-1) at each row's end; returns tokens, segments, loss_mask, per-sequence (row, start, end)."""
    tok = torch.randint(0, vocab, (rows, T), generator=g)
    seg = torch.full((rows, T), -1)
    lm = torch.zeros(rows, T, dtype=torch.bool)
    spans, sid = [], 0
    for b in range(rows):
        t = 0
        while t < T - 4:
            n = int(torch.randint(3, T - t + 1, (1,), generator=g))
            p = int(torch.randint(1, n, (1,), generator=g))        # prompt length, >= 1 generated token
            seg[b, t:t + n] = sid
            lm[b, t + p:t + n] = True
            spans.append((b, t, t + n, t + p))
            sid, t = sid + 1, t + n
    return tok, seg, lm, spans


def test_greedy_round_walk(seed):
    """The rounds of a greedy runtime: from each greedy sequence's first generated token, root
    ``p`` -> ``p + lead + 1`` (the lead stored at ``p - root_offset``), until a chain that is not
    inside the sequence; against a per-sequence simulation on random leads."""
    g = torch.Generator().manual_seed(seed)
    tok, seg, lm, spans = _packed_sequences(g, 3, 40, 8)
    lead = torch.randint(-1, 4, seg.shape, generator=g)
    greedy = (torch.rand(len(spans), generator=g) < 0.7).tolist()
    for off in (0, 1):
        want = []
        for sid, (b, start, end, first) in enumerate(spans):
            p = first
            while greedy[sid] and start <= p - off and p < end and int(lead[b, p - off]) >= 0:
                want.append(int(lead[b, p - off]))
                p += int(lead[b, p - off]) + 1
        assert greedy_round_leads(lead, seg, lm, greedy, root_offset=off) == want
    with pytest.raises(ValueError, match="must all be"):
        greedy_round_leads(lead[:, 1:], seg, lm, greedy)


def test_round_accept_length_equals_block_by_block_rounds(seed):
    """``evaluate(rounds=True)`` (one dense pass with a block at every generated token, then the
    walk) == running the rounds one block at a time through ``dense_forward``: the same
    rounds, the same mean tokens per verify.  A small vocabulary makes agreements common."""
    cfg, target = _target(seed, vocab=6)
    dr = _drafter(target, seed + 1, block=4)
    S = dr.block_size
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(8, 30, (5,), generator=g)]
    seqs = [torch.randint(0, 6, (n,), generator=g).tolist() for n in lens]
    prompt = [int(torch.randint(1, n - 2, (1,), generator=g)) for n in lens]
    data = SequenceData.from_sequences(seqs, prompt, [0] * 5, list(range(5)))
    tc = TrainConfig(kind="dflash", block_size=S, seq_len=32, batch_size=2)
    rows = pack_sequences(lens, 32)
    ev = evaluate(dr, target, data, rows, tc, rounds=True)
    leads = []
    for s, p0 in zip(seqs, prompt):
        x = torch.tensor([s])
        pos = torch.arange(len(s))[None]
        feats, th = target_features(cfg, target.w, x, pos, None, dr.context_layers)
        a = p0
        while a + S - 2 < len(s):                                        # the block's teachers exist
            hid = dr.dense_forward(x, feats, pos, torch.tensor([[a]]))[0, 0]
            pred = dr.logits(hid[1:]).argmax(-1)
            teach = (th[0, a:a + S - 1] @ dr.lm_head.T).argmax(-1)
            n = int((pred == teach).int().cumprod(0).sum())
            leads.append(n)
            a += n + 1
    assert ev["greedy_rounds"] == len(leads) > 0
    assert ev["greedy_round_accept_length"] == pytest.approx(1 + sum(leads) / len(leads))


def test_weighted_soft_ce_matches_autograd(seed):
    g = torch.Generator().manual_seed(seed)
    M, H, V = 29, 16, 50
    W = torch.randn(V, H, generator=g)
    h = torch.randn(M, H, generator=g, requires_grad=True)
    t = torch.randn(M, H, generator=g)
    wts = torch.rand(M, generator=g)
    wts = wts / wts.sum()
    loss, agree, rows = soft_ce(h, t, W, chunk=8, weights=wts, per_row=True)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    ce = -(torch.softmax(t @ W.T, -1) * torch.log_softmax(h2 @ W.T, -1)).sum(-1)
    (ce * wts).sum().backward()
    torch.testing.assert_close(loss, (ce * wts).sum().detach())
    torch.testing.assert_close(rows, ce.detach())
    torch.testing.assert_close(h.grad, h2.grad)
    assert torch.equal(agree, (h2 @ W.T).argmax(-1) == (t @ W.T).argmax(-1))


# ----------------------------------------------------------------------------- training end to end

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny model, its self-generated data and two DFlash trainings through the CLI with the
    same seed (30 steps each)."""
    tmp = tmp_path_factory.mktemp("dflash")
    cfg, w = tiny_llama(tmp / "target", 5)
    prompts = random_prompts(11, cfg.vocab_size, n=16, max_len=8)
    seeds = random_prompts(12, cfg.vocab_size, n=4, max_len=3)
    gen = GenConfig(gen_batch=16, max_new_tokens=24, samples_per_prompt=1, seed_max_new_tokens=16, seed=3)
    data = generate_data(cfg, w, prompts, seeds, gen=gen, seq_len=40, progress=False)
    data_file = data.save(tmp / "data.safetensors")
    args = ["train", "--kind", "dflash", "--model", str(tmp / "target"), "--data", str(data_file), "--device", "cpu",
            "--steps", "30", "--batch-size", "4", "--seq-len", "40", "--block-size", "4", "--num-anchors", "12",
            "--lr", "3e-3", "--warmup-steps", "4", "--eval-every", "20", "--eval-batches", "1", "--time-budget-s",
            "0", "--no-progress", "--seed", "7"]
    outs = []
    for name in ("a", "b"):
        r = CliRunner().invoke(drafter_app, args + ["--out", str(tmp / name)])
        assert r.exit_code == 0, r.output
        outs.append(tmp / name)
    return tmp, args, outs


def test_tiny_training_end_to_end(tiny_run):
    tmp, args, (a, b) = tiny_run
    assert sorted(p.name for p in a.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                   "token_frequencies.json", "train_log.json"]
    small = DFlashDrafter.load(a, LlamaModel(*load_hf_dir(tmp / "target")), draft_vocab_size=5)
    assert small.draft_vocab.tolist() == frequent_tokens(read_token_counts(a), 5).tolist()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()   # same seed
    log = json.loads((a / "train_log.json").read_text())
    assert log["kind"] == "dflash" and log["steps_done"] == 30 and log["stop_reason"] == "steps"
    assert log["mask_token_in_data"] == int((load_file(str(tmp / "data.safetensors"))["tokens"] == 16).sum())
    losses = [e["loss"] for e in log["train"]]
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses
    assert all(len(e["acc"]) == 3 for e in log["train"]) and log["eval"][0]["step"] == 20
    ev = log["final_eval"]
    assert len(ev["acc"]) == 3 and ev["accept_length"] == pytest.approx(implied_accept_length(ev["acc"]))
    chain = ev["greedy_chain_accept_length"]       # seed 7 holds out a prompt: greedy anchors exist
    assert ev["greedy_chain_rows"] > 0 and len(chain) == 3
    assert all(1.0 <= c <= j + 2 for j, c in enumerate(chain)) and chain == sorted(chain)
    walked = ev["greedy_round_accept_length"]     # the rounds of a greedy runtime over the same text
    assert ev["greedy_rounds"] > 0 and 1.0 <= walked <= len(chain) + 1
    card = (a / "README.md").read_text()
    assert f"**{walked:.2f}** tokens per verify" in card
    for text in ("# DFlash drafter", "specattn drafter train", "--kind dflash", "--seed 7", "--block-size 4",
                 "--draft-layers 2", "Held-out acceptance", "| position |", "DFlashDraftModel", "e2e results"):
        assert text in card, text
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["specattn"]["training"]["steps"] == 30 and cfg["dflash_config"]["block_size"] == 4
    # a different seed gives a different drafter
    r = CliRunner().invoke(drafter_app, args[:-1] + ["8", "--steps", "2", "--out", str(tmp / "c")])
    assert r.exit_code == 0, r.output
    assert (tmp / "c" / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()


def test_engine_drafts_with_the_trained_drafter(tiny_run, monkeypatch):
    """The trained checkpoint, loaded over the engine's target and put in place of the
    strategy's random drafter (what passing it as ``draft_model`` will do): lossless, and
    every round drafts exactly the argmax of the dense training forward's block at that
    round's anchor (the root's position), so it accepts exactly that block's leading
    agreements with the target -- the training path and the runtime draft the same block."""
    tmp, _, (a, _) = tiny_run
    cfg, w = load_hf_dir(tmp / "target")
    prompts = random_prompts(21, cfg.vocab_size, n=3, max_len=8)
    new, B = 16, 4
    ref = Engine(cfg, dict(w), max_context=128).generate(prompts, SamplingParams(max_new_tokens=new + B)).tokens
    rounds = []
    real = dflash.DFlashStrategy.propose_block

    def record(self, eng, rb, rows, block, *args):
        toks = real(self, eng, rb, rows, block, *args)
        rounds.extend((r, p, t) for r, p, t in zip(rows.tolist(), block.seq_lens.tolist(), toks.tolist())
                      if r < len(prompts))
        return toks

    monkeypatch.setattr(dflash.DFlashStrategy, "propose_block", record)
    eng = Engine(cfg, dict(w), spec=SpecConfig("dflash", block_size=B, draft_layers=2), max_context=128)
    dr = DFlashDrafter.load(a, eng.target)
    eng.strategy.drafter = eng.draft = dr
    eng.strategy.target_capture_layers = tuple(dr.context_layers)
    res = eng.generate(prompts, SamplingParams(max_new_tokens=new))
    assert res.tokens == [t[:new] for t in ref]
    for row, (p, out, acc) in enumerate(zip(prompts, ref, res.accept_lengths)):
        seq = torch.tensor([p + out])
        T = seq.shape[1]
        mine = [(P, t) for r, P, t in rounds if r == row]
        assert [P for P, _ in mine] == [len(p) + sum(x + 1 for x in acc[:i]) for i in range(len(acc))]
        feats, _ = target_features(cfg, eng.target.w, seq, torch.arange(T)[None], None, dr.context_layers)
        hid = dr.dense_forward(seq, feats, torch.arange(T)[None], torch.tensor([[P for P, _ in mine]]))[0]
        drafts = dr.logits(hid[:, 1:].reshape(-1, hid.shape[-1])).argmax(-1).view(len(mine), B - 1)
        for i, (P, toks) in enumerate(mine):
            assert toks == [int(seq[0, P])] + drafts[i].tolist(), (row, P)
            assert acc[i] == int(torch.cumprod((drafts[i] == seq[0, P + 1:P + B]).int(), 0).sum())


def test_cli_errors(tmp_path, tiny_run):
    tmp, _, _ = tiny_run
    runner = CliRunner()
    r = runner.invoke(drafter_app, ["train", "--help"])
    assert r.exit_code == 0
    for opt in ("--kind", "--block-size", "--draft-layers", "--num-context-layers", "--num-anchors",
                "--loss-decay-gamma", "--mask-token-id", "--max-checkpoint-mib", "--ttt-steps"):
        assert opt in r.output
    model = ["--model", str(tmp / "target"), "--data", str(tmp / "data.safetensors")]
    for bad, word in ((["--kind", "medusa"], "--kind"),
                      (["--kind", "dflash", "--ttt-steps", "3"], "--ttt-steps"),
                      (["--block-size", "8"], "--block-size"),
                      (["--draft-layers", "2"], "--draft-layers"),
                      (["--kind", "dflash", "--block-size", "1"], "--block-size"),
                      (["--kind", "dflash", "--block-size", "600"], "--block-size"),
                      (["--kind", "dflash", "--draft-layers", "0"], "--draft-layers"),
                      (["--kind", "dflash", "--num-anchors", "0"], "--num-anchors"),
                      (["--kind", "dflash", "--num-context-layers", "0"], "--num-context-layers"),
                      (["--kind", "dflash", "--loss-decay-gamma", "-1"], "--loss-decay-gamma"),
                      (["--kind", "dflash", "--mask-token-id", "-2"], "--mask-token-id"),
                      (["--kind", "dflash", "--max-checkpoint-mib", "-1"], "--max-checkpoint-mib"),
                      (["--kind", "dflash", "--mask-token-id", "96", *model], "mask_token_id"),
                      (["--kind", "dflash", "--num-context-layers", "9", *model], "num_context_layers"),
                      (["--kind", "dflash", "--max-checkpoint-mib", "0.01", *model], "--max-checkpoint-mib"),
                      (["--kind", "dflash", "--draft-intermediate-size", "4096", "--max-checkpoint-mib", "0.1",
                        *model], "MiB")):
        r = runner.invoke(drafter_app, ["train", "--out", str(tmp_path / "o"), "--device", "cpu", *bad])
        assert r.exit_code == 2, (bad, r.output)
        lines = [l for l in r.output.splitlines() if l.strip()]
        assert len(lines) == 1 and word in lines[0], (bad, r.output)


def test_init_from_run_evaluates_its_starting_weights(tiny_run, tmp_path):
    """A run with ``--init-from`` evaluates the weights it starts from on the held-out rows of
    its final evaluation (``init_eval``): with a negligible learning rate the two agree, and the
    card states the starting figures; a run from a random init has no ``init_eval``."""
    tmp, args, (a, _) = tiny_run
    assert "init_eval" not in json.loads((a / "train_log.json").read_text())
    cont = [x if x != "3e-3" else "1e-12" for x in args]
    cont[cont.index("--steps") + 1] = "1"
    r = CliRunner().invoke(drafter_app, cont + ["--out", str(tmp_path / "c"), "--init-from", str(a)])
    assert r.exit_code == 0, r.output
    log = json.loads((tmp_path / "c" / "train_log.json").read_text())
    ini, fin = log["init_eval"], log["final_eval"]
    assert ini["greedy_rounds"] == fin["greedy_rounds"] > 0 and ini["valid_rows"] == fin["valid_rows"]
    assert ini["acc"] == pytest.approx(fin["acc"]) and ini["greedy_round_accept_length"] == pytest.approx(
        fin["greedy_round_accept_length"])
    card = (tmp_path / "c" / "README.md").read_text()
    assert (f"The weights this run started from (`--init-from`), on the same held-out sequences: implied accept "
            f"length {ini['accept_length']:.2f}, walked {ini['greedy_round_accept_length']:.2f}") in card


def test_init_from_a_trained_drafter(tiny_run):
    """``TrainConfig.init_from``: a fresh DFlash drafter (another seed) takes every weight of
    a trained folder, the stacked context K/V projection included."""
    from specattn.spec_runtime.train_drafter import _load_init, _new_drafter
    tmp, _, (a, _) = tiny_run
    cfg, w = load_hf_dir(tmp / "target")
    target = LlamaModel(cfg, dict(w))
    trained = DFlashDrafter.load(a, target, dtype=torch.float32)
    tc = TrainConfig(kind="dflash", block_size=4, seed=123, init_from=str(a))
    fresh = _new_drafter(target, tc, None)
    assert any(not torch.equal(fresh.w[k], trained.w[k]) for k in trained.w)
    _load_init(fresh, target, tc)
    assert set(fresh.w) == set(trained.w) and all(torch.equal(fresh.w[k], trained.w[k]) for k in trained.w)


def test_init_from_of_another_target_fails_before_the_data(tiny_run, tmp_path, monkeypatch):
    """An ``--init-from`` drafter of another target, or one without weights, is refused right
    after the target loads (it used to fail after the data generation)."""
    import shutil

    from specattn.spec_runtime import train_drafter as T
    tmp, args, (a, _) = tiny_run
    cfg, _ = load_hf_dir(tmp / "target")
    T.check_init_from(a, cfg)
    wide, _ = tiny_llama(tmp_path / "wide", 5, hidden=96)
    with pytest.raises(ValueError, match="hidden_size=64, this target has 96"):
        T.check_init_from(a, wide)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(a / "config.json", bare / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors not found"):
        T.check_init_from(bare, cfg)

    def no_data(*a, **k):
        raise AssertionError("the data generation started")
    monkeypatch.setattr(T, "generate_data_sharded", no_data)
    cli = [x for x in args if x not in ("--data",)]
    cli = cli[:cli.index(str(tmp / "data.safetensors"))] + cli[cli.index(str(tmp / "data.safetensors")) + 1:]
    r = CliRunner().invoke(drafter_app, cli + ["--out", str(tmp_path / "k"), "--top-k", "97",
                                               "--prompts", str(_prompt_file(tmp_path))])
    assert r.exit_code == 2 and "top_k 97 exceeds the target's vocabulary of 96 tokens" in r.output, r.output
    cli[cli.index("--model") + 1] = str(tmp_path / "wide")
    r = CliRunner().invoke(drafter_app, cli + ["--out", str(tmp_path / "o"), "--init-from", str(a),
                                               "--prompts", str(_prompt_file(tmp_path))])
    assert r.exit_code == 2 and "hidden_size=64, this target has 96" in r.output, r.output


def _prompt_file(tmp_path):
    p = tmp_path / "prompts.txt"
    p.write_text("hello\nthere\n")
    return p


def test_training_needs_a_trainable_position_within_seq_len(tiny_run, tmp_path):
    """Data cut to a --seq-len that leaves no generated token trains nothing: refused, not a
    run of zero losses that exits 0; a shorter --seq-len than the data's is noted."""
    from specattn.spec_runtime.train_drafter import train
    tmp, args, _ = tiny_run
    short = [*args]
    short[short.index("--seq-len") + 1] = "8"
    short[short.index("--num-anchors") + 1] = "4"
    r = CliRunner().invoke(drafter_app, short + ["--out", str(tmp_path / "o")])
    assert "was generated with seq_len 40; this run cuts its sequences to 8 tokens" in " ".join(r.output.split())
    cfg, w = load_hf_dir(tmp / "target")
    seqs = [[1 + (i + j) % 90 for j in range(12)] for i in range(8)]      # prompts of 9 tokens, 3 generated
    data = SequenceData.from_sequences(seqs, [9] * 8, [0] * 8, list(range(8)),
                                       meta={"generation": {"seq_len": 12}})
    tc = TrainConfig(kind="dflash", seq_len=8, block_size=4, num_anchors=4, steps=1, batch_size=2, eval_frac=0.25,
                     time_budget_s=0, amp=False)
    with pytest.raises(ValueError, match="no position to train: .* past seq_len 8 \\(the data was generated with seq_len 12\\)"):
        train(LlamaModel(cfg, dict(w)), data, tc, progress=False)
    train(LlamaModel(cfg, dict(w)), data, dataclasses.replace(tc, seq_len=12), progress=False)   # 3 positions each


def test_card_states_the_warmup_the_schedule_ran():
    from specattn.spec_runtime.train_drafter import _warmup_text
    assert _warmup_text({"steps": 3, "warmup_steps": 1000}, {"planned_steps": [3]}) == \
        "2 steps of the 1000 asked, as the run was shorter"
    assert _warmup_text({"steps": 500, "warmup_steps": 100}, {"planned_steps": [500, 120]}) == "100"
    assert _warmup_text({"steps": 500, "warmup_steps": 100}, {"planned_steps": [500, 40]}).startswith("39 steps")
