"""EAGLE-3 drafter (spec_runtime/eagle3.py) and its trainer (spec_runtime/train_drafter.py,
spec_runtime/drafter_cli.py): checkpoint format, the cache-based inference forward against the
dense training-time-test forward, the TTT attention mask against a naive per-row loop, the
chunked distillation loss, data packing, and a tiny end-to-end training run.  CPU, float32."""
import dataclasses
import json
import math

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from specattn.backends import ForwardBatch, ReqToTokenPool, create_backend
from specattn.spec_runtime.drafter_cli import drafter_app
from specattn.spec_runtime.eagle3 import (TOKEN_FREQUENCIES_FILE, Eagle3Config, Eagle3Drafter, checkpoint_nbytes,
                                          default_aux_layer_ids, frequent_tokens, init_weights, read_token_counts)
from specattn.spec_runtime.loader import LlamaConfig, load_hf_dir, random_weights, write_random_hf_dir
from specattn.spec_runtime.model import LlamaModel
from specattn.spec_runtime.train_drafter import (GenConfig, SequenceData, collate, generate_data, generate_self_prompts,
                                                 implied_accept_length, pack_sequences, read_prompts,
                                                 soft_ce, step_valid, target_features, DEFAULT_EVAL_PROMPTS,
                                                 DEFAULT_TRAIN_PROMPTS)
from tiny_models import random_prompts, tiny_llama

CKPT_SHAPES_REAL = {  # SmolLM2-135M: H=576, I=1536, 9 q / 3 kv heads of 64
    "fc.weight": (576, 1728),
    "midlayer.input_layernorm.weight": (576,),
    "midlayer.hidden_norm.weight": (576,),
    "midlayer.self_attn.q_proj.weight": (576, 1152),
    "midlayer.self_attn.k_proj.weight": (192, 1152),
    "midlayer.self_attn.v_proj.weight": (192, 1152),
    "midlayer.self_attn.o_proj.weight": (576, 576),
    "midlayer.post_attention_layernorm.weight": (576,),
    "midlayer.mlp.gate_proj.weight": (1536, 576),
    "midlayer.mlp.up_proj.weight": (1536, 576),
    "midlayer.mlp.down_proj.weight": (576, 1536),
    "norm.weight": (576,),
}


def _target(seed, tied=True, layers=4, vocab=96):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                      tie_word_embeddings=tied, eos_token_ids=[])
    return cfg, LlamaModel(cfg, random_weights(cfg.param_shapes(), seed))


def _drafter(target, seed, std=0.1):
    ec = Eagle3Config.from_target(target.config)
    return Eagle3Drafter(target, ec, init_weights(ec, seed, std=std, norm_jitter=0.1))


def _close(a, b, tol=1e-5):
    scale = max(1.0, float(b.abs().max()))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=tol * scale)


# ----------------------------------------------------------------------------- config / checkpoint

def test_default_aux_layer_ids():
    assert default_aux_layer_ids(30) == [1, 14, 26]
    assert default_aux_layer_ids(32) == [1, 15, 28]
    for L in range(1, 12):
        ids = default_aux_layer_ids(L)
        assert len(ids) == 3 and ids == sorted(ids) and all(0 <= i < L for i in ids)
        if L >= 3:
            assert len(set(ids)) == 3
    with pytest.raises(ValueError):
        default_aux_layer_ids(0)


def test_real_model_checkpoint_shapes_and_size():
    real = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                       rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_ids=[2])
    ec = Eagle3Config.from_target(real)
    assert ec.param_shapes() == CKPT_SHAPES_REAL
    assert ec.aux_layer_ids == [1, 14, 26]
    nbytes = checkpoint_nbytes(ec)
    assert nbytes == 2 * sum(math.prod(s) for s in CKPT_SHAPES_REAL.values()) == 10_179_072
    assert nbytes + 4096 <= 12 * 2**20            # + a generous safetensors header
    d = ec.to_hf_dict()
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["num_hidden_layers"] == 1
    assert d["tie_word_embeddings"] is False and d["torch_dtype"] == "bfloat16" and d["hidden_act"] == "silu"
    assert "draft_vocab_size" not in d and "eagle_aux_hidden_state_layer_ids" not in json.dumps(d)
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert k in d
    assert d["rope_theta"] == 100000.0 and d["vocab_size"] == 49152 and d["eos_token_id"] == 2


def test_checkpoint_roundtrip(tmp_path, seed):
    _, target = _target(seed)
    dr = _drafter(target, seed + 1)
    dr.save(tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(tmp_path / "d" / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert sorted(names) == sorted(dr.config.param_shapes())
        for n in names:
            t = f.get_tensor(n)
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == dr.config.param_shapes()[n]
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and "draft_vocab_size" not in cfg
    back = Eagle3Drafter.load(tmp_path / "d", target)
    assert back.aux_layer_ids == dr.aux_layer_ids and back.config.param_shapes() == dr.config.param_shapes()
    sd, sd2 = dr.state_dict(), back.state_dict()
    assert set(sd) == set(sd2)
    for k in sd:  # bf16 on disk: identical to the bf16 rounding of the original
        assert torch.equal(sd2[k], sd[k].to(torch.bfloat16).float()), k
    back.save(tmp_path / "e")   # second roundtrip: bit-identical
    back2 = Eagle3Drafter.load(tmp_path / "e", target)
    for k in sd2:
        assert torch.equal(back2.state_dict()[k], sd2[k])


def test_load_errors(tmp_path, seed):
    _, target = _target(seed)
    dr = _drafter(target, seed)
    dr.save(tmp_path / "d")
    wide_cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_ids=[])
    with pytest.raises(ValueError, match="hidden_size"):
        Eagle3Drafter.load(tmp_path / "d", LlamaModel(wide_cfg, random_weights(wide_cfg.param_shapes(), 0)))
    _, other_vocab = _target(seed, vocab=120)
    with pytest.raises(ValueError, match="vocab"):
        Eagle3Drafter.load(tmp_path / "d", other_vocab)
    _, shallow = _target(seed, layers=2)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        Eagle3Drafter.load(tmp_path / "d", shallow)
    # wrong tensor shape / extra maps / reduced vocabulary / wrong architecture / missing files
    from safetensors.torch import load_file, save_file
    w = load_file(str(tmp_path / "d" / "model.safetensors"))
    bad = dict(w, **{"fc.weight": w["fc.weight"][:, :10].contiguous()})
    save_file(bad, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        Eagle3Drafter.load(tmp_path / "d", target)
    save_file(dict(w, d2t=torch.zeros(96, dtype=torch.int64)), str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):
        Eagle3Drafter.load(tmp_path / "d", target)
    save_file(w, str(tmp_path / "d" / "model.safetensors"))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps(dict(cfg, draft_vocab_size=32)))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Drafter.load(tmp_path / "d", target)
    (tmp_path / "d" / "config.json").write_text(json.dumps(dict(cfg, architectures=["LlamaForCausalLM"])))
    with pytest.raises(ValueError, match="EAGLE-3"):
        Eagle3Drafter.load(tmp_path / "d", target)
    with pytest.raises(FileNotFoundError):
        Eagle3Drafter.load(tmp_path / "nothing", target)


# ----------------------------------------------------------------------------- forward equivalence

@pytest.mark.parametrize("tied", [True, False])
def test_inference_forward_equals_dense_ttt(seed, tied):
    """The backend forward (EXTEND over a prefix of entries, then DECODE steps of a drafted
    chain, several requests batched) equals the dense training forward's step-0 rows and its
    TTT step-k rows, in float32: checks pairing, positions and the TTT attention pattern."""
    cfg, target = _target(seed, tied=tied)
    dr = _drafter(target, seed + 7)
    g = torch.Generator().manual_seed(seed)
    n, K = 14, 4
    x = torch.randint(0, cfg.vocab_size, (1, n), generator=g)
    pos = torch.arange(n)[None]
    feats, th = target_features(cfg, target.w, x, pos, None, dr.aux_layer_ids)
    # the dense teacher equals the runtime's target forward (aux layers and final hidden)
    req = ReqToTokenPool(4, 64)
    tpool = target.make_kv_pool(128)
    tb = create_backend("torch_reference", req, tpool)
    slots = torch.arange(1, n + 1)
    req.write(0, 0, slots)
    b = ForwardBatch.extend([0], [0], [n], slots)
    tb.init_forward_metadata(b)
    hid, caps = target.forward(x[0], b, tb, capture_layers=dr.aux_layer_ids)
    _close(th[0], hid)
    _close(feats[0], torch.cat(caps, -1))

    outs = dr.dense_forward(x, feats, pos, None, K)
    ts = sorted(torch.randperm(n - K - 1, generator=g)[:3].tolist())      # chain start entries
    req = ReqToTokenPool(8, 64)
    pool = dr.make_kv_pool(256)
    be = create_backend("torch_reference", req, pool)
    rows, ids, hin, locs, nxt = [5, 2, 0], [], [], [], 1
    for r, t in zip(rows, ts):          # request r: entries 0..t (x_1..x_{t+1} with g_0..g_t)
        s = torch.arange(nxt, nxt + t + 1 + K)
        nxt += t + 1 + K
        req.write(r, 0, s[:t + 1])
        locs.append(s)
        ids.append(x[0, 1:t + 2])
        hin.append(feats[0, :t + 1])
    lens = [t + 1 for t in ts]
    b = ForwardBatch.extend(rows, [0, 0, 0], lens, torch.cat([l[:t + 1] for l, t in zip(locs, ts)]))
    b.validate(req.req_to_token)
    be.init_forward_metadata(b)
    pre, logits = dr.forward(torch.cat(ids), b, be, torch.cat(hin))
    assert pre.shape == (sum(lens), cfg.hidden_size) and logits.dtype == torch.float32
    assert logits.shape == (sum(lens), cfg.vocab_size)
    ref0 = outs[0][0][torch.cat([torch.arange(t + 1) for t in ts])]
    _close(pre, ref0)
    _close(logits, dr.logits(ref0))
    h = pre[torch.tensor(lens).cumsum(0) - 1]
    for k in range(1, K):               # draft step k: token x_{t+1+k}, position t+k, own hidden
        P = [t + k for t in ts]
        loc = torch.stack([l[t + k] for l, t in zip(locs, ts)])
        for i, r in enumerate(rows):
            req.write(r, P[i], loc[i:i + 1])
        b = ForwardBatch.decode(rows, P, loc)
        be.init_forward_metadata(b)
        ids_k = torch.stack([x[0, t + 1 + k] for t in ts])
        # hidden_rows: the same rows read from a larger buffer (poisoned elsewhere), untouched
        perm = torch.randperm(len(rows) + 2, generator=g)[:len(rows)]
        buf = torch.full((len(rows) + 2, cfg.hidden_size), float("nan"))
        buf[perm] = h
        kept = buf.clone()
        h_rows, logits_rows = dr.forward(ids_k, b, be, buf, hidden_rows=perm)
        assert torch.equal(buf.nan_to_num(7.0), kept.nan_to_num(7.0))
        with pytest.raises(ValueError, match="hidden_rows"):
            dr.forward(ids_k, b, be, buf, hidden_rows=perm[:1])
        h, logits = dr.forward(ids_k, b, be, h)
        assert torch.equal(h_rows, h) and torch.equal(logits_rows, logits)
        ref = outs[k][0][ts]
        _close(h, ref)
        _close(logits, dr.logits(ref))


def _naive_ttt(dr, tokens, feats, pos, seg, K):
    """Per row and step, explicit key lists: step-0 keys of rows j <= t of the same sequence
    + the row's own keys of steps 1..k; one softmax."""
    c = dr.config
    T = tokens.shape[0]
    G, scale = c.num_attention_heads // c.num_key_value_heads, c.head_dim ** -0.5
    from specattn.spec_runtime.model import apply_rope, rope_cos_sin

    def qkv(tok, h, p):
        q, k, v = dr._qkv(dr.embed_tokens[tok][None], h[None])
        cos, sin = rope_cos_sin(torch.tensor([p]), c.head_dim, c.rope_theta, q.dtype)
        return apply_rope(q, cos, sin)[0], apply_rope(k, cos, sin)[0], v[0]

    def tok_at(i):
        return int(tokens[i]) if i < T else 0

    h0 = dr.project_hidden(feats)
    k0, v0 = [], []
    for t in range(T):
        _, k, v = qkv(tok_at(t + 1), h0[t], int(pos[t]))
        k0.append(k), v0.append(v)
    out = torch.zeros(K, T, c.hidden_size)
    for t in range(T):
        if seg[t] < 0:
            continue
        h, ks, vs = h0[t], [], []
        ctx = [j for j in range(t + 1) if seg[j] == seg[t]]
        for k in range(K):
            q, kk, vv = qkv(tok_at(t + 1 + k), h, int(pos[t]) + k)
            if k > 0:
                ks.append(kk), vs.append(vv)
            keys = torch.stack([k0[j] for j in ctx] + ks)        # [n, nkv, hd]
            vals = torch.stack([v0[j] for j in ctx] + vs)
            o = []
            for head in range(c.num_attention_heads):
                s = keys[:, head // G] @ q[head] * scale
                o.append(torch.softmax(s, 0) @ vals[:, head // G])
            h = dr._finish(h[None], torch.cat(o)[None])[0]
            out[k, t] = h
    return out


def test_ttt_mask_matches_naive_loop(seed):
    """Packed rows (two sequences + padding) through the dense TTT == per-row explicit loops."""
    cfg, target = _target(seed)
    dr = _drafter(target, seed + 3)
    g = torch.Generator().manual_seed(seed)
    T, K = 13, 3
    seg = torch.tensor([[0] * 6 + [1] * 5 + [-1] * 2, [2] * 11 + [-1] * 2])
    pos = torch.stack([torch.tensor(list(range(6)) + list(range(5)) + [0, 0]), torch.tensor(list(range(11)) + [0, 0])])
    tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=g)
    feats = torch.randn(2, T, 3 * cfg.hidden_size, generator=g) * 3
    outs = dr.dense_forward(tokens, feats, pos, seg, K)
    for b in range(2):
        ref = _naive_ttt(dr, tokens[b], feats[b], pos[b], seg[b], K)
        keep = seg[b] >= 0
        for k in range(K):
            _close(outs[k][b][keep], ref[k][keep])
    # a packed row == each sequence on its own (attention never crosses sequences)
    alone = dr.dense_forward(tokens[:1, 6:11], feats[:1, 6:11], pos[:1, 6:11], None, K)
    valid = [step_valid(seg, torch.ones_like(seg, dtype=torch.bool), k)[0, 6:11] for k in range(K)]
    for k in range(K):
        _close(outs[k][0, 6:11][valid[k]], alone[k][0][valid[k]])


def test_teacher_packed_equals_separate(seed):
    cfg, target = _target(seed)
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(0, cfg.vocab_size, (1, 7), generator=g), torch.randint(0, cfg.vocab_size, (1, 5), generator=g)
    row = torch.cat([a, b, torch.zeros(1, 2, dtype=torch.int64)], 1)
    seg = torch.tensor([[0] * 7 + [1] * 5 + [-1] * 2])
    pos = torch.tensor([list(range(7)) + list(range(5)) + [0, 0]])
    ids = [0, 2, 3]
    f, h = target_features(cfg, target.w, row, pos, seg, ids)
    fa, ha = target_features(cfg, target.w, a, torch.arange(7)[None], None, ids)
    fb, hb = target_features(cfg, target.w, b, torch.arange(5)[None], None, ids)
    _close(f[0, :7], fa[0]), _close(f[0, 7:12], fb[0]), _close(h[0, :7], ha[0]), _close(h[0, 7:12], hb[0])


# ----------------------------------------------------------------------------- loss, data

def test_soft_ce_matches_autograd(seed):
    g = torch.Generator().manual_seed(seed)
    M, H, V = 37, 16, 50
    W = torch.randn(V, H, generator=g)
    h = torch.randn(M, H, generator=g, requires_grad=True)
    t = torch.randn(M, H, generator=g)
    loss, agree = soft_ce(h, t, W, chunk=8)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    ref = -(torch.softmax(t @ W.T, -1) * torch.log_softmax(h2 @ W.T, -1)).sum(-1).mean()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, h2.grad)
    assert torch.equal(agree, (h2 @ W.T).argmax(-1) == (t @ W.T).argmax(-1))
    with torch.no_grad():
        l2, _ = soft_ce(h.detach(), t, W, chunk=1000)
    torch.testing.assert_close(l2, ref.detach())
    assert implied_accept_length([0.5, 0.5]) == 1.75 and implied_accept_length([]) == 1.0


def test_data_roundtrip_packing_and_masks(tmp_path):
    seqs = [[5, 6, 7, 8, 9], [1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 2], [7, 7, 7]]
    data = SequenceData.from_sequences(seqs, [2, 1, 4, 1], [0, 1, 1, 2], [0, 1, 2, 3], eos_token_ids=[2],
                                       meta={"x": 1})
    assert data.loss_mask[:5].tolist() == [False, False, True, True, True]
    assert data.loss_mask[7:17].tolist() == [False] * 4 + [True] * 5 + [False]   # final EOS excluded
    assert data.stats()["sampled_sequences"] == 2 and data.stats()["tokens"] == 20
    data.save(tmp_path / "d.safetensors")
    back = SequenceData.load(tmp_path / "d.safetensors", vocab_size=12)
    for k in ("tokens", "offsets", "loss_mask", "kind", "group"):
        assert torch.equal(getattr(back, k), getattr(data, k))
    assert back.meta == {"x": 1}
    with pytest.raises(ValueError, match="token ids"):
        SequenceData.load(tmp_path / "d.safetensors", vocab_size=10)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError):
        SequenceData.load(tmp_path / "junk.safetensors")
    rows = pack_sequences(data.lengths.tolist(), 8)
    assert sorted(i for r in rows for i in r) == [0, 2, 3]            # the 2-token one is dropped
    assert all(sum(min(int(data.lengths[i]), 8) for i in r) <= 8 for r in rows)
    assert rows == pack_sequences(data.lengths.tolist(), 8)
    batch = collate(data, rows, 8)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            n = min(int(data.lengths[i]), 8 - at)
            assert batch["segments"][r, at:at + n].eq(i).all()
            assert batch["positions"][r, at:at + n].tolist() == list(range(n))
            at += n
        assert batch["segments"][r, at:].eq(-1).all()
    v = step_valid(batch["segments"], batch["loss_mask"], 0)
    # a valid row's teacher (t+1) is in the same sequence and in the loss mask
    for r, t in v.nonzero().tolist():
        assert batch["segments"][r, t + 1] == batch["segments"][r, t] and batch["loss_mask"][r, t + 1]


def test_prompt_files():
    train, ev = read_prompts(DEFAULT_TRAIN_PROMPTS), read_prompts(DEFAULT_EVAL_PROMPTS)
    assert len(train) >= 600 and len(ev) == 64
    assert len(set(train)) == len(train) and len(set(ev)) == len(ev) and not set(train) & set(ev)


def test_self_prompts(tmp_path):
    cfg, w = tiny_llama(tmp_path / "target", 9)
    cfg = dataclasses.replace(cfg, eos_token_ids=list(range(0, cfg.vocab_size, 4)))   # queries end soon
    eos = set(cfg.eos_token_ids)
    pre = random_prompts(4, cfg.vocab_size, n=1, max_len=6)[0]
    gen = GenConfig(gen_batch=8, self_prompts=20, self_prompt_max_tokens=12, seed=5)
    q, meta = generate_self_prompts(cfg, w, pre, gen=gen, progress=False)
    assert meta["requested"] == 20 and meta["ended"] == len(q) and 10 <= len(q) <= 20
    assert all(not eos & set(x) and len(x) < 12 for x in q)       # end token dropped, never cut ones
    assert len({tuple(x) for x in q}) > len(q) // 2                # rows sample independently
    assert generate_self_prompts(cfg, w, pre, gen=gen, progress=False)[0] == q     # seeded
    other = generate_self_prompts(cfg, w, pre, gen=dataclasses.replace(gen, seed=6), progress=False)[0]
    assert other != q
    assert generate_self_prompts(cfg, w, pre, gen=dataclasses.replace(gen, self_prompts=0), progress=False)[0] == []
    with pytest.raises(ValueError, match="pre_query"):
        generate_self_prompts(cfg, w, [], gen=gen, progress=False)
    with pytest.raises(ValueError, match="no end token"):
        generate_self_prompts(dataclasses.replace(cfg, eos_token_ids=[]), w, pre, gen=gen, progress=False)
    with pytest.raises(ValueError, match="self_prompts"):
        generate_self_prompts(cfg, w, pre, gen=dataclasses.replace(gen, self_prompts=-1), progress=False)


def test_self_prompts_from_openers(tmp_path):
    """``self_prompt_openers``: that fraction of the samples continue ``pre_query`` + a random
    opener, and the opener's ids lead the query they end (counted in ``opened``); no opener at
    fraction 0; seeded; bad fractions and missing or empty openers raise."""
    cfg, w = tiny_llama(tmp_path / "target", 9)
    cfg = dataclasses.replace(cfg, eos_token_ids=list(range(0, cfg.vocab_size, 4)))
    eos = set(cfg.eos_token_ids)
    pre = random_prompts(4, cfg.vocab_size, n=1, max_len=6)[0]
    openers = [[1, 2, 3], [5], [6, 7]]                   # no end token inside
    gen = GenConfig(gen_batch=8, self_prompts=40, self_prompt_max_tokens=12, seed=3, self_prompt_openers=1.0)
    q, meta = generate_self_prompts(cfg, w, pre, gen=gen, openers=openers, progress=False)
    assert len(q) == meta["ended"] == meta["opened"] >= 10
    assert all(any(x[:len(o)] == o for o in openers) for x in q)
    assert {next(tuple(o) for o in openers if x[:len(o)] == o) for x in q} == {tuple(o) for o in openers}
    assert all(not eos & set(x) for x in q)
    assert generate_self_prompts(cfg, w, pre, gen=gen, openers=openers, progress=False)[0] == q   # seeded
    half, hm = generate_self_prompts(cfg, w, pre, gen=dataclasses.replace(gen, self_prompt_openers=0.5),
                                     openers=openers, progress=False)
    assert 0 < hm["opened"] < hm["ended"]
    none, nm = generate_self_prompts(cfg, w, pre, gen=dataclasses.replace(gen, self_prompt_openers=0.0),
                                     openers=openers, progress=False)
    assert nm["opened"] == 0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="self_prompt_openers"):
            generate_self_prompts(cfg, w, pre, gen=dataclasses.replace(gen, self_prompt_openers=bad),
                                  openers=openers, progress=False)
    for bad in ((), [[1], []]):
        with pytest.raises(ValueError, match="needs openers"):
            generate_self_prompts(cfg, w, pre, gen=gen, openers=bad, progress=False)


def test_query_openers():
    """The openers are the first 1-4 words of the given prompts, seeded, every length drawn."""
    from specattn.spec_runtime.train_drafter import query_openers
    prompts = ["Classify the sentiment of this review", "Write a Rust function", "Hi", "  "]
    got = query_openers(prompts, 400, seed=1)
    assert got == query_openers(prompts, 400, seed=1) and got != query_openers(prompts, 400, seed=2)
    assert 0 < len(got) <= 400 and all(any(p.split()[:len(g.split())] == g.split() for p in prompts) for g in got)
    assert {len(g.split()) for g in got} == {1, 2, 3, 4} and "Hi" in got
    assert query_openers([], 5) == [] and query_openers(prompts, 0) == []


def test_run_training_with_self_prompts(tmp_path, monkeypatch):
    """``run_training`` with ``self_prompts``: the target's own queries join the prompt file's
    (decoded, distinct, chat-templated), the data meta counts them and the card names them."""
    from specattn.spec_runtime import loader
    from specattn.spec_runtime.train_drafter import RunOptions, TrainConfig, run_training
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      eos_token_ids=list(range(0, 96, 7)))
    model_dir = write_random_hf_dir(tmp_path / "target", cfg, seed=3)

    class Tok:   # token i <-> the letter chr(48 + i): decode / encode round-trip exactly
        chat_template = "fake"

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(48 + int(i)) for i in ids)

        def encode(self, text, add_special_tokens=False):
            return [ord(c) - 48 for c in text]
    monkeypatch.setattr(loader, "load_tokenizer", lambda path: Tok())
    monkeypatch.setattr(loader, "chat_user_prefix_ids", lambda tok: [5, 6, 7])
    monkeypatch.setattr(loader, "apply_chat_template", lambda tok, text: [5, 6, 7] + tok.encode(text) + [8])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ABC\nDEFG\nHI\n")
    gen = GenConfig(gen_batch=8, max_new_tokens=6, samples_per_prompt=1, seed_max_new_tokens=4,
                    self_prompts=12, self_prompt_max_tokens=12, seed=2)
    tc = TrainConfig(kind="eagle3", seq_len=24, batch_size=2, steps=2, ttt_steps=2, warmup_steps=1,
                     eval_every=0, eval_batches=1, time_budget_s=0, amp=False)
    res = run_training(RunOptions(out=tmp_path / "out", model=str(model_dir), prompts=prompts,
                                  data=tmp_path / "data.safetensors", num_seeds=2, gen=gen, train=tc,
                                  progress=False))
    meta = SequenceData.load(tmp_path / "data.safetensors").meta
    sp = meta["self_prompts"]
    assert sp["requested"] == 12 and 1 <= sp["kept"] <= sp["ended"] <= 12
    assert meta["file_prompts"] == 3 and meta["prompts"] == 3 + sp["kept"]
    # every self-written prompt's tokens sit after the pre-query ids in its sequences
    data = SequenceData.load(tmp_path / "data.safetensors")
    firsts = {tuple(data.tokens[int(data.offsets[i]):int(data.offsets[i]) + 3].tolist())
              for i in range(data.num_sequences) if int(data.group[i]) < meta["prompts"]}
    assert firsts == {(5, 6, 7)}
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"{sp['kept']} written by the target itself" in card and "3 from `prompts.txt`" in card
    assert res["data_stats"]["sequences"] == data.num_sequences
    assert sp["opened"] == 0 and "first words of a file prompt" not in card

    # every self-written query from an opener: its text starts with a file prompt's word (one-word prompts)
    gen = dataclasses.replace(gen, self_prompt_openers=1.0)
    run_training(RunOptions(out=tmp_path / "out2", model=str(model_dir), prompts=prompts,
                            data=tmp_path / "data2.safetensors", num_seeds=2, gen=gen, train=tc, progress=False))
    meta = SequenceData.load(tmp_path / "data2.safetensors").meta
    sp = meta["self_prompts"]
    assert sp["opened"] == sp["ended"] >= 1 and sp["kept"] >= 1
    data = SequenceData.load(tmp_path / "data2.safetensors")
    words = [Tok().encode(t) for t in ("ABC", "DEFG", "HI")]
    selfs = [data.tokens[int(data.offsets[i]) + 3:int(data.offsets[i + 1])].tolist()
             for i in range(data.num_sequences) if 3 <= int(data.group[i]) < meta["prompts"]]
    assert selfs and all(any(x[:len(o)] == o for o in words) for x in selfs)
    card = (tmp_path / "out2" / "README.md").read_text()
    assert f"({sp['opened']} of them from the first words of a file prompt)" in card


# ----------------------------------------------------------------------------- training end to end

def _tiny_data(tmp_path, cfg, w):
    prompts = random_prompts(11, cfg.vocab_size, n=16, max_len=8)
    seeds = random_prompts(12, cfg.vocab_size, n=4, max_len=3)
    gen = GenConfig(gen_batch=16, max_new_tokens=20, samples_per_prompt=1, seed_max_new_tokens=16, seed=3)
    data = generate_data(cfg, w, prompts, seeds, gen=gen, seq_len=40, progress=False)
    assert data.num_sequences == 36 and data.meta["chunks_done"] == data.meta["chunks_total"] == 3
    st = data.stats()
    assert (st["greedy_sequences"], st["sampled_sequences"], st["seed_sequences"]) == (16, 16, 4)
    # every sequence is its prompt followed by the generated tokens; the loss mask marks the latter
    for i in range(data.num_sequences):
        s, e = int(data.offsets[i]), int(data.offsets[i + 1])
        g = int(data.group[i])
        src = prompts[g] if g < len(prompts) else seeds[g - len(prompts)]
        assert data.tokens[s:s + len(src)].tolist() == src
        assert data.loss_mask[s:e].tolist() == [False] * len(src) + [True] * (e - s - len(src))
    return data.save(tmp_path / "data.safetensors")


def test_tiny_training_end_to_end(tmp_path):
    cfg, w = tiny_llama(tmp_path / "target", 5)
    model_dir = tmp_path / "target"
    data_file = _tiny_data(tmp_path, cfg, w)
    runner = CliRunner()
    args = ["train", "--model", str(model_dir), "--data", str(data_file), "--device", "cpu", "--steps", "30",
            "--batch-size", "4", "--seq-len", "40", "--ttt-steps", "3", "--lr", "3e-3", "--warmup-steps", "4",
            "--eval-every", "20", "--eval-batches", "1", "--time-budget-s", "0", "--no-progress", "--seed", "7"]
    outs = []
    for name in ("a", "b"):
        r = runner.invoke(drafter_app, args + ["--out", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
        outs.append(tmp_path / name)
    a, b = outs
    assert sorted(p.name for p in a.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                   "token_frequencies.json", "train_log.json"]
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()   # same seed
    # the generated tokens' counts, and a drafter loaded over its most frequent ones
    from safetensors.torch import load_file
    d = load_file(str(data_file))
    want = torch.bincount(d["tokens"][d["loss_mask"].bool()].long(), minlength=cfg.vocab_size)
    assert torch.equal(read_token_counts(a), want)
    target = LlamaModel(cfg, dict(w))
    small = Eagle3Drafter.load(a, target, draft_vocab_size=7)
    assert small.draft_vocab.tolist() == frequent_tokens(want, 7).tolist()
    assert small.logits(torch.randn(3, cfg.hidden_size)).shape == (3, 7)
    log = json.loads((a / "train_log.json").read_text())
    losses = [e["loss"] for e in log["train"]]
    assert log["steps_done"] == 30 and log["stop_reason"] == "steps"
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses
    ev = log["final_eval"]
    assert len(ev["acc"]) == 3 and ev["accept_length"] == pytest.approx(implied_accept_length(ev["acc"]))
    chain = ev["greedy_chain_accept_length"]      # seed 7 holds out a prompt: greedy rows exist
    assert ev["greedy_chain_rows"] > 0 and len(chain) == 3
    assert all(1.0 <= c <= j + 2 for j, c in enumerate(chain)) and chain == sorted(chain)
    walked = ev["greedy_round_accept_length"]     # the rounds of a greedy runtime over the same text
    assert ev["greedy_rounds"] > 0 and 1.0 <= walked <= len(chain) + 1
    card = (a / "README.md").read_text()
    assert f"**{walked:.2f}** tokens per verify" in card
    assert "specattn drafter train" in card and "--seed 7" in card and "Held-out acceptance" in card
    assert "e2e results" in card
    cfg_json = json.loads((a / "config.json").read_text())
    assert cfg_json["specattn"]["training"]["steps"] == 30
    target = LlamaModel(*load_hf_dir(model_dir))
    dr = Eagle3Drafter.load(a, target)
    assert dr.aux_layer_ids == default_aux_layer_ids(4)
    # a different seed gives a different drafter
    r = runner.invoke(drafter_app, args[:-1] + ["8", "--steps", "2", "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "c" / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()


def test_cli_help_and_bad_arguments(tmp_path):
    runner = CliRunner()
    r = runner.invoke(drafter_app, ["train", "--help"])
    assert r.exit_code == 0
    for opt in ("--out", "--data", "--ttt-steps", "--time-budget-s", "--gen-batch", "--backend", "--self-prompts",
                "--self-prompt-openers"):
        assert opt in r.output
    for bad, word in ((["--steps", "0"], "--steps"), (["--device", "tpu"], "--device"),
                      (["--dtype", "int8"], "--dtype"), (["--eval-frac", "1.5"], "--eval-frac"),
                      (["--backend", "nope"], "--backend"), (["--model", str(tmp_path / "missing")], "--model"),
                      (["--prompts", str(tmp_path / "none.txt")], "prompt file"),
                      (["--self-prompts", "-1"], "--self-prompts"),
                      (["--self-prompt-max-tokens", "0"], "--self-prompt-max-tokens"),
                      (["--self-prompt-openers", "1.5"], "--self-prompt-openers"),
                      (["--self-prompt-openers", "-0.5"], "--self-prompt-openers")):
        r = runner.invoke(drafter_app, ["train", "--out", str(tmp_path / "o"), "--device", "cpu", *bad])
        assert r.exit_code == 2, (bad, r.output)
        lines = [l for l in r.output.splitlines() if l.strip()]
        assert len(lines) == 1 and word in lines[0], (bad, r.output)


def test_draft_vocab(tmp_path, seed):
    """FR-Spec draft vocabulary: ranking by count (ties to the lower id), logits over the
    kept rows of the target's head, columns mapped back to token ids, clear errors."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 5, (40,), generator=g)
    top = frequent_tokens(counts, 40)
    key = [(-int(counts[i]), int(i)) for i in top]
    assert key == sorted(key) and sorted(top.tolist()) == list(range(40))
    assert frequent_tokens(counts, 3).tolist() == top[:3].tolist()
    with pytest.raises(ValueError, match="n <= 40"):
        frequent_tokens(counts, 41)
    cfg, w = tiny_llama(tmp_path, seed)
    target = LlamaModel(cfg, dict(w))
    d = Eagle3Drafter.from_target(target, seed=seed)
    x = torch.randn(4, cfg.hidden_size, generator=g)
    full = d.logits(x)
    ids = torch.randperm(cfg.vocab_size, generator=g)[:9]
    d.set_draft_vocab(ids)
    sub = d.logits(x)
    assert sub.shape == (4, 9) and torch.allclose(sub, full[:, ids], atol=1e-5)
    cols = torch.randint(0, 9, (4, 3), generator=g)
    assert torch.equal(d.draft_token_ids(cols), ids[cols])
    for bad, msg in [(ids[:0], "non-empty"), (ids.float(), "integer"), (torch.tensor([0, 0]), "repeated"),
                     (torch.tensor([cfg.vocab_size]), "lie in")]:
        with pytest.raises(ValueError, match=msg):
            d.set_draft_vocab(bad)
    d.set_draft_vocab(None)
    assert torch.equal(d.logits(x), full) and torch.equal(d.draft_token_ids(cols), cols)
    d.save(tmp_path / "dr")
    with pytest.raises(FileNotFoundError, match="token_frequencies.json"):
        Eagle3Drafter.load(tmp_path / "dr", target, draft_vocab_size=5)
    (tmp_path / "dr" / TOKEN_FREQUENCIES_FILE).write_text('{"vocab_size": 3, "counts": [1, 2]}')
    with pytest.raises(ValueError, match="counts must be"):
        Eagle3Drafter.load(tmp_path / "dr", target, draft_vocab_size=5)


def test_default_draft_vocab_size(tmp_path):
    """The commands' default draft vocabulary: DEFAULT_DRAFT_VOCAB for a folder with token
    counts over a larger vocabulary (the shipped drafter), else None (the full vocabulary)."""
    from specattn.spec_runtime.cli import default_drafter
    from specattn.spec_runtime.eagle3 import DEFAULT_DRAFT_VOCAB, default_draft_vocab_size
    from specattn.spec_runtime.loader import LlamaConfig as Cfg
    shipped = default_drafter(Cfg(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                  num_attention_heads=9, num_key_value_heads=3, head_dim=64))
    assert shipped is not None and default_draft_vocab_size(shipped) == DEFAULT_DRAFT_VOCAB
    assert default_draft_vocab_size(tmp_path) is None                       # no counts
    for vocab, want in ((DEFAULT_DRAFT_VOCAB, None), (DEFAULT_DRAFT_VOCAB + 1, DEFAULT_DRAFT_VOCAB)):
        (tmp_path / TOKEN_FREQUENCIES_FILE).write_text(json.dumps({"vocab_size": vocab, "counts": [1] * vocab}))
        assert default_draft_vocab_size(tmp_path) == want
    (tmp_path / TOKEN_FREQUENCIES_FILE).write_text("not json")
    assert default_draft_vocab_size(tmp_path) is None


def test_training_continues_from_a_drafter(tmp_path):
    """``--init-from``: a second run starts from the first run's weights (its initial
    held-out agreement is the first run's final one, not a random init's) and says so in its
    card; a missing folder is refused before anything loads."""
    from specattn.spec_runtime.train_drafter import TrainConfig, _load_init, _new_drafter
    cfg, w = tiny_llama(tmp_path / "target", 5)
    data_file = _tiny_data(tmp_path, cfg, w)
    args = ["train", "--model", str(tmp_path / "target"), "--data", str(data_file), "--device", "cpu",
            "--batch-size", "4", "--seq-len", "40", "--ttt-steps", "2", "--lr", "3e-3", "--warmup-steps", "2",
            "--eval-every", "0", "--eval-batches", "1", "--time-budget-s", "0", "--no-progress", "--seed", "3"]
    runner = CliRunner()
    r = runner.invoke(drafter_app, args + ["--steps", "20", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    target = LlamaModel(cfg, dict(w))
    tc = TrainConfig(init_from=str(tmp_path / "a"), seed=99)
    fresh = _new_drafter(target, tc, None)
    _load_init(fresh, target, tc)
    trained = Eagle3Drafter.load(tmp_path / "a", target, dtype=torch.float32)
    assert all(torch.equal(fresh.w[k], trained.w[k]) for k in trained.w)
    r = runner.invoke(drafter_app, args + ["--steps", "1", "--lr", "1e-9", "--init-from", str(tmp_path / "a"),
                                           "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    first = json.loads((tmp_path / "a" / "train_log.json").read_text())["final_eval"]["acc"]
    second = json.loads((tmp_path / "b" / "train_log.json").read_text())["final_eval"]["acc"]
    assert second == pytest.approx(first, abs=0.02)         # one step at lr 1e-9: the same drafter
    init = json.loads((tmp_path / "b" / "train_log.json").read_text())["init_eval"]["acc"]
    assert init == pytest.approx(second, abs=1e-6)           # the starting weights, on the same rows
    card = (tmp_path / "b" / "README.md").read_text()
    assert "initialized from the weights of `a`" in card
    assert "same seed, same split" in card and "optimistic" not in card     # both runs: --seed 3
    r = runner.invoke(drafter_app, args[:-2] + ["--seed", "4", "--steps", "1", "--lr", "1e-9",
                                                "--init-from", str(tmp_path / "a"), "--out", str(tmp_path / "d")])
    assert r.exit_code == 0, r.output
    card = (tmp_path / "d" / "README.md").read_text()     # another split: held-out figures flagged
    assert "split the prompts with seed 3" in card and "optimistic" in card
    r = runner.invoke(drafter_app, args + ["--steps", "1", "--init-from", str(tmp_path / "nowhere"),
                                           "--out", str(tmp_path / "c")])
    assert r.exit_code != 0 and "--init-from" in r.output


def test_training_continues_in_place_only_with_overwrite(tmp_path):
    """``--init-from A --out A``: refused while A holds a drafter, unless ``--overwrite``; then
    the run starts from A's weights (read before anything is written) and replaces A's files."""
    cfg, w = tiny_llama(tmp_path / "target", 5)
    data_file = _tiny_data(tmp_path, cfg, w)
    a = tmp_path / "a"
    args = ["train", "--model", str(tmp_path / "target"), "--data", str(data_file), "--device", "cpu",
            "--batch-size", "4", "--seq-len", "40", "--ttt-steps", "2", "--lr", "3e-3", "--warmup-steps", "2",
            "--eval-every", "0", "--eval-batches", "1", "--time-budget-s", "0", "--no-progress", "--seed", "3",
            "--out", str(a)]
    runner = CliRunner()
    r = runner.invoke(drafter_app, args + ["--steps", "20"])
    assert r.exit_code == 0, r.output
    before = {p.name: p.read_bytes() for p in a.iterdir()}
    first = json.loads(before["train_log.json"])["final_eval"]["acc"]
    for extra in ([], ["--init-from", str(a)]):
        r = runner.invoke(drafter_app, args + ["--steps", "1", *extra])
        assert r.exit_code == 2 and "already holds a drafter's files" in r.output and "--overwrite" in r.output
        assert {p.name: p.read_bytes() for p in a.iterdir()} == before
    r = runner.invoke(drafter_app, args + ["--steps", "1", "--lr", "1e-9", "--init-from", str(a), "--overwrite"])
    assert r.exit_code == 0, r.output
    log = json.loads((a / "train_log.json").read_text())
    assert log["steps_done"] == 1 and "--overwrite" in log["command"]
    assert log["init_eval"]["acc"] == pytest.approx(first, abs=1e-6)     # the first run's weights
    assert "initialized from the weights of `a`" in (a / "README.md").read_text()
    assert json.loads((a / "config.json").read_text())["specattn"]["training"]["steps"] == 1
