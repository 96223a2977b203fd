"""The attention bench cases (``bench/cases_attention.py``) and their report
(``bench/attention_report.py``).

CPU: the input builders (pools, page tables, trees, batches), the byte / flop accounting,
the metadata handed to FlashInfer (decoded back and compared with what the Triton backend
reads) and FlashMLA, impl validation and the missing-library errors, the Triton impl of
every case against the torch reference backend (Triton interpreter, float32, tiny shapes),
and the summary table.  GPU (marked ``gpu``): every impl, FlashInfer / FlashMLA included
when installed, against the reference at small bf16 shapes, and graph capture."""
import os

import torch

if not torch.cuda.is_available():  # before triton / the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from specattn.backends import TorchReferenceBackend  # noqa: E402
from specattn.ops.tree_mask import unpack_tree_mask  # noqa: E402
from specattn.bench import attention_report as rep  # noqa: E402
from specattn.bench import cases_attention as ca  # noqa: E402
from specattn.bench.cases import CASES, get_case  # noqa: E402

MHA_SMALL = dict(num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
MLA_SMALL = dict(num_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, dtype="float32")
TREE_SMALL = dict(num_draft_tokens=6, topk=2, num_steps=3)


def small(name, **kw):
    """CPU-sized overrides of case ``name``."""
    base = {"tree_verify": dict(bs=2, prefix=13, **TREE_SMALL, **MHA_SMALL),
            "mla_tree_verify": dict(bs=2, prefix=11, **TREE_SMALL, **MLA_SMALL),
            "decode": dict(bs=3, seq_len=21, **MHA_SMALL),
            "mla_decode": dict(bs=3, seq_len=21, **MLA_SMALL),
            "extend": dict(bs=2, prefix=9, new_tokens=5, **MHA_SMALL)}[name]
    return {**base, "input_sets": 2, **kw}


def reference(wl, i):
    st = wl.state
    be = TorchReferenceBackend(st["inputs"].req_pool, st["inputs"].kv_pool)
    be.init_forward_metadata(st["batches"][i])
    return be.forward(st["qs"][i], None, None, st["layer"], st["batches"][i],
                      save_kv_cache=False)


def slots_of(pset, page_size, i, lo, hi):
    """Slots of key positions [lo, hi) of request i from its page table."""
    p = torch.arange(lo, hi)
    return pset.page_table[i].cpu().long()[p // page_size] * page_size + p % page_size


# ------------------------------------------------------------------------ registry
def test_cases_registered_with_issue_defaults():
    tv = CASES["tree_verify"].params
    assert (tv["bs"], tv["prefix"], tv["num_draft_tokens"], tv["num_heads"], tv["num_kv_heads"],
            tv["head_dim"], tv["dtype"], tv["page_size"]) == (1, 4096, 64, 32, 8, 128,
                                                              "bfloat16", 1)
    md = CASES["mla_decode"].params
    assert (md["bs"], md["seq_len"], md["num_heads"], md["kv_lora_rank"],
            md["qk_rope_head_dim"], md["page_size"]) == (128, 8192, 128, 512, 64, 64)
    assert CASES["mla_tree_verify"].params["num_draft_tokens"] == 64
    assert CASES["extend"].params["new_tokens"] == 2048
    for name, impls in ca.IMPLS.items():
        assert CASES[name].params["impl"] == "triton"
        assert all(i in CASES[name].description for i in impls)


def test_issue_points_cover_the_issue_and_are_valid():
    pts = rep.TRACKED_POINTS
    for name, params in pts:
        assert set(params) <= set(CASES[name].params), (name, params)
        assert params["impl"] in ca.IMPLS[name]
    tv = {(p["bs"], p["prefix"], p["impl"]) for n, p in pts if n == "tree_verify"}
    assert tv == {(bs, pre, i) for bs, pre in rep.TREE_POINTS for i in ca.IMPLS["tree_verify"]}
    assert set(rep.TREE_POINTS) == {(1, 4096), (16, 2048), (64, 4096), (16, 16384)}
    backends = [(p["bs"], p["prefix"], p.get("fi_backend")) for n, p in pts
                if n == "tree_verify" and p["impl"] == "flashinfer_split" and "kv_dtype" not in p]
    assert backends == [(bs, pre, b) for bs, pre in rep.TREE_POINTS
                        for b in (None,) + rep.SPLIT_EXTRA_BACKENDS]
    assert rep.SPLIT_EXTRA_BACKENDS == ("auto",)
    assert not any("fi_backend" in p for n, p in pts if p["impl"] != "flashinfer_split")
    dec = {(p["bs"], p["seq_len"], p["impl"]) for n, p in pts if n == "decode"}
    assert dec == {(b, s, i) for b in (1, 32, 128) for s in (1024, 8192)
                   for i in ("triton", "flashinfer")}
    mla = {(p.get("num_heads", 128), p["bs"], p["seq_len"], p["impl"])
           for n, p in pts if n == "mla_decode" and "kv_dtype" not in p}
    assert mla == {(128, 128, 8192, i)
                   for i in ("triton", "triton_generic", "triton_sm90_split", "triton_tma", "flashmla")} | {
        (h, b, s, i) for h in (16, 32, 64, 128) for b in (1, 16, 64, 128) for s in (1024, 4096, 8192)
        for i in ("triton", "flashmla")}
    labels = [rep.point_label(n, p) for n, p in pts if n == "mla_decode"]
    assert len(labels) == len(set((lb, p["impl"]) for lb, (n, p) in
                                  zip(labels, [q for q in pts if q[0] == "mla_decode"])))   # one row per label + impl
    assert "bs=64 seq_len=4096 heads=16" in labels and "bs=128 seq_len=8192" in labels
    trees = {(p["bs"], p["prefix"], p.get("num_heads", 128), p["impl"]) for n, p in pts
             if n == "mla_tree_verify" and "topk" not in p and "kv_dtype" not in p}
    assert trees == {(b, 4096, 128, i) for b in (1, 16) for i in ca.IMPLS["mla_tree_verify"] if i != "flashmla"} | {
        (b, 4096, 16, i) for b in (1, 16) for i in ("triton", "triton_generic")}
    chains = {(p["bs"], p["num_heads"], p["num_draft_tokens"], p["num_steps"], p["impl"]) for n, p in pts
              if n == "mla_tree_verify" and p.get("topk") == 1}
    assert chains == {(b, h, s, s - 1, i) for b in (16, 64) for h in (16, 128) for s in (2, 4, 8)
                      for i in ("triton", "flashmla")}
    assert rep.point_label("mla_tree_verify", dict(bs=16, prefix=4096, topk=1, num_draft_tokens=4,
                                                   num_heads=16)) == "bs=16 prefix=4096 chain=4 heads=16"
    assert {(p["prefix"], p["new_tokens"], p["impl"]) for n, p in pts if n == "extend"} == {
        (pre, 2048, i) for pre in (0, 4096) for i in ("triton", "flashinfer")}


def test_with_page_size_sets_only_tree_verify_and_labels_it():
    pts = rep.with_page_size(rep.TRACKED_POINTS, 64)
    assert len(pts) == len(rep.TRACKED_POINTS)
    for (n, p), (n0, p0) in zip(pts, rep.TRACKED_POINTS):
        assert n == n0 and p == (dict(p0, page_size=64) if n == "tree_verify" else p0)
    assert rep.TRACKED_POINTS[0][1].get("page_size") is None  # the issue's points are untouched
    assert rep.with_page_size(rep.TRACKED_POINTS, None) == rep.TRACKED_POINTS
    assert rep.point_label("tree_verify", pts[0][1]) == "bs=1 prefix=4096 page_size=64"
    assert rep.point_label("tree_verify", rep.TRACKED_POINTS[0][1]) == "bs=1 prefix=4096"
    for bad in (0, 3, 4097):  # 3 and 4097 leave part of a prefix page
        with pytest.raises(ValueError, match="divide every tree-verify prefix"):
            rep.with_page_size(rep.TRACKED_POINTS, bad)


def test_bench_list_shows_the_attention_cases(monkeypatch):
    from typer.testing import CliRunner

    from specattn import cli
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(cli.app, ["bench", "--list"])
    assert res.exit_code == 0, res.output
    for name in ca.IMPLS:
        assert name in res.stdout


# ------------------------------------------------------------------------ accounting
def test_bytes_and_flops_formulas():
    gqa = ca.AttnShape.mha(32, 8, 128, "bfloat16")
    # tree verify bs=1, P=4096, D=64: K and V of 4160 keys x 8 heads x 128, q and o 64 x 32 x 128
    assert ca.attention_bytes(gqa, 4160, 64) == 2 * (4160 * 8 * 256 + 64 * 32 * 256)
    assert ca.attention_flops(gqa, 1000) == 2 * 32 * 256 * 1000
    mla = ca.AttnShape.mla(128, 512, 64, "bfloat16")
    assert (mla.head_dim, mla.v_head_dim, mla.num_kv_heads) == (576, 512, 1)
    assert ca.attention_bytes(mla, 8192, 1) == 2 * (8192 * 576 + 128 * (576 + 512))
    assert ca.attention_flops(mla, 8192) == 2 * 128 * (576 + 512) * 8192
    assert ca.attention_bytes(ca.AttnShape.mha(4, 2, 16, "float32"), 10, 3) == \
        4 * (10 * 2 * 32 + 3 * 4 * 32)
    assert ca.auto_input_sets(1) == ca.MAX_AUTO_SETS
    assert ca.auto_input_sets(ca.AUTO_SETS_BUDGET // 2) == 2
    assert ca.auto_input_sets(10 * ca.AUTO_SETS_BUDGET) == 1


def _visible_pairs(wl, name, p):
    """Visible (token, key) pairs per set, counted bit by bit from the batch itself."""
    out = []
    for b in wl.state["batches"]:
        P = b.prefix_lens.cpu().tolist()
        n = b.extend_lens.cpu().tolist()
        if name.endswith("tree_verify"):
            words = b.tree_mask.cpu().tolist()
            bits = sum(bin(w & 0xFFFFFFFF).count("1") for req in words for row in req for w in row)
            out.append(sum(pi * ni for pi, ni in zip(P, n)) + bits)
        elif name.endswith("decode"):
            out.append(sum(pi + 1 for pi in P))
        else:
            out.append(sum(ni * pi + ni * (ni + 1) // 2 for pi, ni in zip(P, n)))
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", sorted(ca.IMPLS))
def test_triton_impl_matches_reference_on_cpu(name, page_size, seed):
    wl = get_case(name).build("cpu", **small(name, page_size=page_size, seed=seed % 1000))
    st = wl.state
    shape, inputs = st["inputs"].shape, st["inputs"]
    assert len(wl.input_sets) == 2 and inputs.page_size == page_size
    # accounting: bytes from the batch shape, flops from the visible pairs
    b0 = st["batches"][0]
    keys = int((b0.prefix_lens + b0.extend_lens).sum())
    assert wl.bytes == ca.attention_bytes(shape, keys, b0.num_tokens)
    vis = _visible_pairs(wl, name, small(name))
    assert wl.flops == ca.attention_flops(shape, round(sum(vis) / len(vis)))
    # input sets touch disjoint slots; page tables agree with req_to_token; the forward's
    # tokens sit at positions P .. P+n-1
    rtt = inputs.req_pool.req_to_token
    seen = set()
    for pset in inputs.sets:
        for i, r in enumerate(pset.rows):
            kv = pset.kv_lens[i]
            slots = rtt[r, :kv].long()
            assert torch.equal(slots, slots_of(pset, page_size, i, 0, kv))
            assert not seen & set(slots.tolist())
            seen |= set(slots.tolist())
        loc = torch.cat([rtt[r, p:p + n].long() for r, p, n in
                         zip(pset.rows, pset.prefix_lens, pset.extend_lens)])
        assert torch.equal(loc, pset.out_cache_loc)
    assert 0 not in seen  # page 0 is the pool's reserved page
    assert not torch.equal(st["qs"][0], st["qs"][1])
    # the timed call equals the reference on every input set
    for i, call in enumerate(wl.calls()):
        out = call()
        ref = reference(wl, i)
        assert out.shape == ref.shape == (b0.num_tokens, shape.num_heads, shape.v_head_dim)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    if name.endswith("tree_verify"):  # real trees: root, ancestors and self, nothing later
        for b in st["batches"]:
            dense = unpack_tree_mask(b.tree_mask.cpu(), b.num_tokens_per_req)
            assert dense[:, :, 0].all() and dense.diagonal(dim1=1, dim2=2).all()
            assert not dense.triu(1).any()


@pytest.mark.parametrize("name", ["mla_decode", "mla_tree_verify"])
def test_triton_tma_impl_matches_reference_on_cpu(name, seed):
    """impl=triton_tma (TMA prefix tiles; page 32 holds whole 32-key tiles): the reference's
    answer, with prefixes of two full tiles and a partial one."""
    kw = dict(seq_len=72) if name == "mla_decode" else dict(prefix=70)
    wl = get_case(name).build("cpu", **small(name, page_size=32, seed=seed % 1000, impl="triton_tma", **kw))
    assert all(be.kernel_config == {"tma": True} for be, _, _ in wl.input_sets)
    for i, call in enumerate(wl.calls()):
        torch.testing.assert_close(call(), reference(wl, i), rtol=1e-4, atol=1e-5)


def test_same_seed_same_inputs():
    a = get_case("tree_verify").build("cpu", **small("tree_verify", seed=5))
    b = get_case("tree_verify").build("cpu", **small("tree_verify", seed=5))
    assert torch.equal(a.state["inputs"].kv_pool.k_buffer[0], b.state["inputs"].kv_pool.k_buffer[0])
    assert all(torch.equal(x, y) for x, y in zip(a.state["qs"], b.state["qs"]))
    assert all(torch.equal(x, y) for x, y in zip(a.state["tree_masks"], b.state["tree_masks"]))


def test_contiguous_pages_are_in_order():
    wl = get_case("decode").build("cpu", **small("decode", contiguous=True, page_size=4))
    tables = torch.cat([s.page_table.cpu() for s in wl.state["inputs"].sets])
    assert sorted(tables.flatten().tolist()) == list(range(1, tables.numel() + 1))
    assert (tables[:, 1:] - tables[:, :-1] == 1).all()


# ------------------------------------------------------------------------ library metadata
@pytest.mark.parametrize("page_size", [1, 4])
def test_flashinfer_mask_metadata_decodes_to_what_triton_reads(page_size, seed):
    wl = get_case("tree_verify").build("cpu", **small("tree_verify", bs=3, prefix=12,
                                                      page_size=page_size, seed=seed % 1000))
    inputs = wl.state["inputs"]
    rtt = inputs.req_pool.req_to_token
    for pset, tm in zip(inputs.sets, wl.state["tree_masks"]):
        D, bs = pset.extend_lens[0], len(pset.rows)
        md = ca.flashinfer_verify_metadata(rtt, pset, tm, page_size, split=False)
        assert md["qo_indptr"].tolist() == [i * D for i in range(bs + 1)]
        indptr, indices, last = md["kv"]
        dense = unpack_tree_mask(tm, D)
        mbytes = md["packed_mask"]
        for i, (r, P) in enumerate(zip(pset.rows, pset.prefix_lens)):
            pages = indices[indptr[i]:indptr[i + 1]].long()
            kv_len = (len(pages) - 1) * page_size + int(last[i])
            assert kv_len == P + D and 1 <= int(last[i]) <= page_size
            slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:kv_len]
            assert torch.equal(slots, rtt[r, :kv_len].long())
            # FlashInfer's bit (j * kv_len + k), little-endian, from the BYTE offset indptr[i]
            start = int(md["mask_indptr"][i])
            assert int(md["mask_indptr"][i + 1]) - start == (D * kv_len + 7) // 8
            seg = mbytes[start:start + (D * kv_len + 7) // 8].long()
            bits = ((seg[:, None] >> torch.arange(8)) & 1).flatten()[:D * kv_len].view(D, kv_len)
            want = torch.cat([torch.ones(D, P, dtype=torch.bool), dense[i]], 1)
            assert torch.equal(bits.bool(), want)


@pytest.mark.parametrize("page_size", [1, 4])
def test_backend_kv_metadata_equals_the_page_tables(page_size, seed):
    """The FlashInfer backend's builders (what the bench plans with) over ``req_to_token`` give
    the page tables' own description of each request's keys."""
    wl = get_case("decode").build("cpu", **small("decode", bs=3, page_size=page_size,
                                                 seed=seed % 1000))
    inputs = wl.state["inputs"]
    for pset in inputs.sets:
        got = ca.flashinfer_kv_metadata(inputs.req_pool.req_to_token, pset, page_size)
        want = ca.flashinfer_page_metadata(pset.page_table, pset.kv_lens, page_size)
        assert all(g.dtype == torch.int32 and torch.equal(g, w) for g, w in zip(got, want))


def test_flashinfer_split_metadata_and_alignment():
    ps = 4
    wl = get_case("tree_verify").build("cpu", **small("tree_verify", bs=2, prefix=12, page_size=ps))
    inputs = wl.state["inputs"]
    rtt = inputs.req_pool.req_to_token
    pset, tm = inputs.sets[0], wl.state["tree_masks"][0]
    D = pset.extend_lens[0]
    md = ca.flashinfer_verify_metadata(rtt, pset, tm, ps, split=True)
    for part, lo, n in (("prefix_kv", 0, 12), ("draft_kv", 12, D)):
        indptr, indices, last = md[part]
        for i, r in enumerate(pset.rows):
            pages = indices[indptr[i]:indptr[i + 1]].long()
            assert (len(pages) - 1) * ps + int(last[i]) == n
            slots = (pages[:, None] * ps + torch.arange(ps)).flatten()[:n]
            assert torch.equal(slots, rtt[r, lo:lo + n].long())
    dense = unpack_tree_mask(tm, D)
    for i in range(2):
        start = int(md["mask_indptr"][i])
        seg = md["packed_mask"][start:start + (D * D + 7) // 8].long()
        bits = ((seg[:, None] >> torch.arange(8)) & 1).flatten()[:D * D].view(D, D)
        assert torch.equal(bits.bool(), dense[i])
    # a prefix that does not start the draft keys on a page boundary is refused
    bad = get_case("tree_verify").build("cpu", **small("tree_verify", prefix=13, page_size=ps))
    with pytest.raises(ValueError, match="multiple of page_size"):
        ca.flashinfer_verify_metadata(bad.state["inputs"].req_pool.req_to_token,
                                      bad.state["inputs"].sets[0], bad.state["tree_masks"][0],
                                      ps, split=True)
    with pytest.raises(ValueError, match="multiple of"):
        ca.flashinfer_page_metadata(pset.page_table, [3, 3], ps, first_key=2)
    with pytest.raises(ValueError, match="more than"):
        ca.flashinfer_page_metadata(pset.page_table, [10 ** 4, 1], ps)


def test_install_mask_indptr_overwrites_the_bit_offsets():
    bits = torch.tensor([0, 64 * 4160, 2 * 64 * 4160], dtype=torch.int32)
    byte_offsets = torch.tensor([0, 64 * 4160 // 8, 2 * 64 * 4160 // 8], dtype=torch.int32)
    w = SimpleNamespace(_mask_indptr_buf=bits.clone())
    ca.install_mask_indptr(w, byte_offsets)
    assert torch.equal(w._mask_indptr_buf, byte_offsets)
    with pytest.raises(RuntimeError, match="2201"):
        ca.install_mask_indptr(SimpleNamespace(), byte_offsets)
    with pytest.raises(RuntimeError, match="2201"):
        ca.install_mask_indptr(SimpleNamespace(_mask_indptr_buf=bits[:2]), byte_offsets)


def test_flashmla_block_table_and_paged_views():
    wl = get_case("mla_decode").build("cpu", **small("mla_decode", page_size=8))
    inputs = wl.state["inputs"]
    rtt = inputs.req_pool.req_to_token
    latent = inputs.kv_pool.get_key_buffer(0)
    paged = ca.paged_view(latent, 8)
    assert paged.shape == (latent.shape[0] // 8, 8, 1, 48) and paged.data_ptr() == latent.data_ptr()
    for pset in inputs.sets:
        assert pset.page_table.dtype == torch.int32 and pset.page_table.is_contiguous()
        for i, r in enumerate(pset.rows):
            L = pset.kv_lens[i]
            assert L == 21 and pset.page_table.shape[1] == -(-L // 8)
            p = torch.arange(L)
            pages = pset.page_table[i].long()[p // 8]
            assert torch.equal(paged[pages, p % 8], latent[rtt[r, :L].long()])


# ------------------------------------------------------------------------ library fakes
# Torch stand-ins with the documented semantics of the calls the impls make, so the plumbing
# (plan args, paged layout, packed mask + byte offsets, lse base 2, merge, block table) is
# checked on the CPU.  Like FlashInfer 0.7.2, plan(packed_custom_mask=...) leaves the mask
# indptr in BITS (flashinfer PR #2201) while the "kernel" reads it as BYTES.
def _fake_attend(q, k, v, vis, scale):
    """q [n, H, D], k/v [kv, Hkv, *], vis [n, kv] bool -> (out [n, H, Dv], lse2 [n, H])."""
    G = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = torch.einsum("nhd,khd->nhk", q.double(), k) * scale
    s = s.masked_fill(~vis[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("nhk,khd->nhd", torch.exp(s - lse[..., None]), v), lse / math.log(2)


class _FakePrefill:
    def __init__(self, workspace, kv_layout, backend="auto", use_tensor_cores=False):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.backend = backend

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads,
             head_dim, page_size, head_dim_vo=None, packed_custom_mask=None, causal=False,
             sm_scale=None, q_data_type=None, kv_data_type=None):
        self.qo, self.ind, self.idx, self.last = (t.long().cpu() for t in (
            qo_indptr, kv_indptr, kv_indices, last_page_len))
        self.ps, self.causal, self.scale = page_size, causal, sm_scale
        self.heads = (num_qo_heads, num_kv_heads, head_dim, head_dim_vo or head_dim)
        kv_len = (self.ind[1:] - self.ind[:-1] - 1) * page_size + self.last
        self._custom_mask_buf = packed_custom_mask
        self._mask_indptr_buf = None if packed_custom_mask is None else torch.cat(
            [torch.zeros(1, dtype=torch.long),
             ((self.qo[1:] - self.qo[:-1]) * kv_len).cumsum(0)]).to(torch.int32)

    def run(self, q, paged_kv_cache, out=None, lse=None, return_lse=False):
        k_cache, v_cache = paged_kv_cache
        H, Hkv, D, Dv = self.heads
        assert q.shape[1:] == (H, D) and k_cache.shape[1:] == (self.ps, Hkv, D)
        for b in range(len(self.qo) - 1):
            pages = self.idx[self.ind[b]:self.ind[b + 1]]
            kv_len = (len(pages) - 1) * self.ps + int(self.last[b])
            k = k_cache[pages].flatten(0, 1)[:kv_len]
            v = v_cache[pages].flatten(0, 1)[:kv_len]
            q0, q1 = int(self.qo[b]), int(self.qo[b + 1])
            n = q1 - q0
            j, kk = torch.arange(n)[:, None], torch.arange(kv_len)[None, :]
            if self._custom_mask_buf is not None:
                bit = j * kv_len + kk
                buf = self._custom_mask_buf.long().cpu()
                at = int(self._mask_indptr_buf[b]) + bit // 8  # past the end reads zeros here
                byte = torch.where(at < len(buf), buf[at.clamp(max=len(buf) - 1)], 0)
                vis = ((byte >> (bit % 8)) & 1).bool()
            elif self.causal:
                vis = kk <= j + kv_len - n
            else:
                vis = torch.ones(n, kv_len, dtype=torch.bool)
            o, s = _fake_attend(q[q0:q1], k, v, vis, self.scale)
            out[q0:q1] = o.to(out.dtype)
            if return_lse:
                lse[q0:q1] = s.float()
        return (out, lse) if return_lse else out


class _FakeDecode(_FakePrefill):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, sm_scale=None, q_data_type=None, kv_data_type=None):
        bs = indptr.shape[0] - 1
        super().plan(torch.arange(bs + 1), indptr, indices, last_page_len, num_qo_heads,
                     num_kv_heads, head_dim, page_size, sm_scale=sm_scale)


def _fake_merge_state(va, sa, vb, sb):
    m = torch.maximum(sa, sb)
    wa, wb = torch.exp2(sa - m), torch.exp2(sb - m)
    v = (wa[..., None] * va.double() + wb[..., None] * vb.double()) / (wa + wb)[..., None]
    return v.to(va.dtype), m + torch.log2(wa + wb)


def _fake_flash_mla():
    def get_mla_decoding_metadata(seqlens_k, num_q_tokens_per_head_k, h_k, h_q=None,
                                  is_fp8_kvcache=False, topk=None, use_legacy=False):
        assert use_legacy and not is_fp8_kvcache and topk is None and h_k == 1
        return ("tile", seqlens_k.clone())

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta,
                               softmax_scale=None, causal=False, use_legacy=False):
        assert use_legacy and not causal and meta.tile_scheduler_metadata == "tile"
        b, s_q, H, D = q.shape
        out = torch.empty(b, s_q, H, head_dim_v, dtype=q.dtype)
        for i in range(b):
            L = int(cache_seqlens[i])
            lat = k_cache[block_table[i].long()].flatten(0, 1)[:L]
            o, _ = _fake_attend(q[i], lat, lat[..., :head_dim_v],
                                torch.ones(s_q, L, dtype=torch.bool), softmax_scale)
            out[i] = o.to(q.dtype)
        return out, None

    return SimpleNamespace(
        has_legacy=lambda: True,
        get_mla_metadata=lambda *a, **k: (SimpleNamespace(tile_scheduler_metadata=None,
                                                          num_splits=None), None),
        get_mla_decoding_metadata=get_mla_decoding_metadata,
        flash_mla_with_kvcache=flash_mla_with_kvcache)


@pytest.fixture
def fake_libraries(monkeypatch):
    """FlashInfer and FlashMLA replaced by the fakes, library impls allowed on the CPU."""
    monkeypatch.setitem(sys.modules, "flashinfer", SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_FakePrefill,
        BatchDecodeWithPagedKVCacheWrapper=_FakeDecode, merge_state=_fake_merge_state))
    monkeypatch.setitem(sys.modules, "flash_mla", _fake_flash_mla())
    real = ca.check_impl
    monkeypatch.setattr(ca, "check_impl", lambda name, impl, device: real(name, impl, "cuda"))


LIB_CASES = [("tree_verify", "flashinfer_mask", dict(page_size=1)),
             ("tree_verify", "flashinfer_mask", dict(page_size=4, prefix=12)),
             ("tree_verify", "flashinfer_split", dict(page_size=1)),
             ("tree_verify", "flashinfer_split", dict(page_size=4, prefix=12)),
             ("decode", "flashinfer", dict(page_size=4)),
             ("extend", "flashinfer", dict(page_size=4)),
             ("extend", "flashinfer", dict(page_size=1, prefix=0)),
             ("mla_decode", "flashmla", dict(page_size=8))]


@pytest.mark.parametrize("name,impl,kw", LIB_CASES, ids=lambda x: str(x))
def test_library_impls_compute_the_same_attention(fake_libraries, name, impl, kw, seed):
    wl = get_case(name).build("cpu", **small(name, impl=impl, bs=3, seed=seed % 1000, **kw))
    tri = get_case(name).build("cpu", **small(name, bs=3, seed=seed % 1000, **kw))
    assert (wl.bytes, wl.flops) == (tri.bytes, tri.flops)  # one accounting for every impl
    for i, call in enumerate(wl.calls()):
        out = call()
        torch.testing.assert_close(out, reference(wl, i), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out, tri.calls()[i](), rtol=1e-4, atol=1e-5)


def test_mask_offsets_fix_is_needed_for_bs_above_1(fake_libraries, monkeypatch):
    monkeypatch.setattr(ca, "install_mask_indptr", lambda w, indptr: None)
    wl = get_case("tree_verify").build("cpu", **small("tree_verify", impl="flashinfer_mask",
                                                      bs=3, input_sets=1))
    out = wl.calls()[0]()
    D = small("tree_verify")["num_draft_tokens"]
    ref = reference(wl, 0)
    torch.testing.assert_close(out[:D], ref[:D])                   # request 0: offset 0
    assert not torch.allclose(out[D:], ref[D:], rtol=1e-3, atol=1e-3)  # the others: wrong bits


# ------------------------------------------------------------------------ validation
def test_impl_validation_and_library_errors(monkeypatch):
    with pytest.raises(ValueError, match="impl must be one of"):
        get_case("tree_verify").build("cpu", **small("tree_verify", impl="flashmla"))
    with pytest.raises(ValueError, match="impl must be one of"):
        get_case("mla_tree_verify").build("cpu", **small("mla_tree_verify", impl="flashinfer_mask"))
    for name, impl in (("tree_verify", "flashinfer_mask"), ("tree_verify", "flashinfer_split"),
                       ("decode", "flashinfer"), ("extend", "flashinfer"),
                       ("mla_decode", "flashmla")):
        with pytest.raises(ValueError, match="CUDA device"):
            get_case(name).build("cpu", **small(name, impl=impl))
    for impl, extra in (("flashinfer_mask", "specattn[flashinfer]"),
                        ("flashmla", "specattn[flashmla]")):
        monkeypatch.setitem(sys.modules, ca.LIBRARIES[impl][0], None)  # import -> ImportError
        with pytest.raises(ImportError, match=r"pip install " + extra.replace("[", r"\[")):
            ca.require_library(impl)


@pytest.mark.parametrize("name,kw,match", [
    ("tree_verify", dict(dtype="int8"), "dtype"),
    ("tree_verify", dict(num_kv_heads=3), "divide"),
    ("tree_verify", dict(num_draft_tokens=40), "candidates"),
    ("tree_verify", dict(bs=0), "bs"),
    ("tree_verify", dict(prefix=-1), "prefix"),
    ("decode", dict(seq_len=0), "seq_len"),
    ("extend", dict(new_tokens=0), "new_tokens"),
    ("mla_decode", dict(page_size=0), "page_size"),
])
def test_bad_params_raise_value_error(name, kw, match):
    with pytest.raises(ValueError, match=match):
        get_case(name).build("cpu", **small(name, **kw))


def test_split_prefix_checked_before_any_library_import(monkeypatch):
    monkeypatch.setattr(ca, "check_impl", lambda *a: None)  # pretend we are on a GPU
    for kw in (dict(prefix=0), dict(prefix=13, page_size=4)):
        with pytest.raises(ValueError, match="flashinfer_split needs a prefix"):
            get_case("tree_verify").build("cpu", **small("tree_verify", impl="flashinfer_split",
                                                         **kw))


# ------------------------------------------------------------------------ summary
def _result(name, impl, us, params, bw=None, mm=None, mode="cuda-graph"):
    return dict(name=name, params={**params, "impl": impl}, median_us=us, gbps=1.0,
                tflops=2.0, pct_copy_bw=bw, pct_matmul=mm, mode=mode, flush_l2=False, note="")


def test_summary_rows_speedups_and_roofline():
    p1, p2 = dict(bs=1, prefix=4096), dict(bs=64, prefix=4096)
    res = [_result("tree_verify", "triton", 30.0, p1, 10.0, 20.0),
           _result("tree_verify", "flashinfer_mask", 120.0, p1, 5.0, None),
           _result("tree_verify", "flashinfer_split", 240.0, p1),
           _result("tree_verify", "triton", 500.0, p2, 70.0, 40.0),
           _result("tree_verify", "flashinfer_mask", 2500.0, p2),
           _result("tree_verify", "flashinfer_split", 700.0, p2),
           _result("mla_decode", "triton", 900.0, dict(bs=128, seq_len=8192)),
           _result("mla_decode", "flashmla", 538.0, dict(bs=128, seq_len=8192)),
           _result("mla_decode", "triton_tma", 700.0, dict(bs=128, seq_len=8192))]
    rows = rep.summary_rows(res)
    assert [r["impl"] for r in rows] == [r["params"]["impl"] for r in res]
    assert rows[0]["point"] == "bs=1 prefix=4096"
    assert rows[0]["speedup"] == {"flashinfer_mask": 4.0, "flashinfer_split": 8.0}
    assert rows[3]["speedup"] == {"flashinfer_mask": 5.0, "flashinfer_split": 1.4}
    assert rows[1]["speedup"] == {} and rows[7]["speedup"] == {}
    assert rows[0]["pct_roofline"] == 20.0 and rows[3]["pct_roofline"] == 70.0
    assert rows[1]["pct_roofline"] == 5.0 and rows[2]["pct_roofline"] is None
    md = rep.render_markdown(rows, "# title")
    lines = md.splitlines()
    assert lines[0] == "# title"
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 2 + len(rows)  # header, separator, rows
    assert "% roofline" in table[0] and "flashinfer_mask 4.00x" in md
    bars = rep.bar_lines(rows)
    assert any("meets <= 40 us" in b for b in bars)
    assert not any("bs=1" in b and "flashinfer" in b for b in bars)  # bs 1: only <= 40 us
    assert any("5.00x vs flashinfer_mask (meets >= 3.0x)" in b for b in bars)
    assert any("1.40x vs flashinfer_split (MISSES >= 1.5x)" in b for b in bars)
    assert any("mla_decode" in b and ": triton 900.0 us" in b and "MISSES <= 1.5x" in b for b in bars)
    assert any("triton_tma 700.0 us = 1.30x FlashMLA's time (meets <= 1.5x; MISSES <= 1.0x at every head count)" in b
               for b in bars)


def test_flashmla_verifies_chains_only():
    """FlashMLA's causal decode is a chain verify: a tree (topk > 1) is refused before any
    input is built, naming why; the check runs before the CUDA-device one."""
    with pytest.raises(ValueError, match="flashmla' verifies chains only.*topk=8"):
        CASES["mla_tree_verify"].build("cpu", impl="flashmla")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        CASES["mla_tree_verify"].build("cpu", impl="flashmla", topk=1, num_steps=3, num_draft_tokens=4)


def test_split_backends_are_library_rows_of_one_point():
    """A FlashInfer row with a non-default ``fi_backend`` is one more library row of the same
    point, labelled with its backend; the Triton rows get a speedup and a bar line for each."""
    p = dict(bs=64, prefix=4096)
    res = [_result("tree_verify", "triton", 600.0, p),
           _result("tree_verify", "flashinfer_split", 870.0, p),
           _result("tree_verify", "flashinfer_split", 1200.0, dict(p, fi_backend="auto")),
           _result("tree_verify", "flashinfer_mask", 2400.0, dict(p, fi_backend="fa2")),
           _result("decode", "flashinfer", 20.0, dict(bs=1, seq_len=1024, fi_backend="auto")),
           _result("decode", "triton", 10.0, dict(bs=1, seq_len=1024))]
    rows = rep.summary_rows(res)
    assert [r["impl"] for r in rows] == ["triton", "flashinfer_split", "flashinfer_split[auto]",
                                         "flashinfer_mask", "flashinfer[auto]", "triton"]
    assert rows[0]["speedup"] == pytest.approx({"flashinfer_split": 1.45,
                                                "flashinfer_split[auto]": 2.0,
                                                "flashinfer_mask": 4.0})
    assert rows[5]["speedup"] == {"flashinfer[auto]": 2.0}
    assert all(r["point"] == "bs=64 prefix=4096" for r in rows[:4])
    bars = rep.bar_lines(rows)
    assert bars == ["tree_verify bs=64 prefix=4096: triton 1.45x vs flashinfer_split (MISSES >= 1.5x)",
                    "tree_verify bs=64 prefix=4096: triton 2.00x vs flashinfer_split[auto] (meets >= 1.5x)",
                    "tree_verify bs=64 prefix=4096: triton 4.00x vs flashinfer_mask (meets >= 3.0x)"]
    assert "flashinfer_split[auto]" in rep.render_markdown(rows)
    # the runner fills in every case parameter (page_size too): bs 1 still gets its own bar
    full = dict(CASES["tree_verify"].params, bs=1, prefix=4096)
    one = rep.summary_rows([_result("tree_verify", "triton", 41.0, full),
                            _result("tree_verify", "flashinfer_split", 90.0, full)])
    assert one[0]["point"] == "bs=1 prefix=4096 page_size=1"
    assert rep.bar_lines(one) == ["tree_verify bs=1 prefix=4096 page_size=1: triton 41.0 us "
                                  "(MISSES <= 40 us)"]
    assert rep.impl_label("tree_verify", dict(impl="triton", fi_backend="auto")) == "triton"


def test_fp8_points_pair_with_their_bf16_rows():
    """An fp8-cache row is its own point (``kv=fp8`` in the label), gets library speedups only
    against fp8 library rows, and one line against the bf16 row of the same parameters and
    impl: >= 1.5x where bf16 is memory-bound (decode at 8192 keys, verify at prefix 16384),
    else never slower."""
    fp8 = dict(kv_dtype="fp8_e4m3")
    d8, d1 = dict(bs=32, seq_len=8192), dict(bs=1, seq_len=1024)
    tv = dict(bs=16, prefix=16384)
    res = [_result("decode", "triton", 300.0, d8), _result("decode", "triton", 180.0, dict(d8, **fp8)),
           _result("decode", "flashinfer", 400.0, dict(d8, **fp8)),
           _result("decode", "triton", 10.0, d1), _result("decode", "triton", 11.0, dict(d1, **fp8)),
           _result("tree_verify", "triton", 600.0, tv), _result("tree_verify", "triton", 500.0, dict(tv, **fp8)),
           _result("mla_decode", "triton", 80.0, dict(bs=128, seq_len=8192, **fp8))]   # no bf16 pair
    rows = rep.summary_rows(res)
    assert rows[1]["point"] == "bs=32 seq_len=8192 kv=fp8" and rows[0]["point"] == "bs=32 seq_len=8192"
    assert rows[1]["speedup"] == pytest.approx({"flashinfer": 400 / 180}) and rows[0]["speedup"] == {}
    assert rep.fp8_lines(rows) == [
        "decode bs=32 seq_len=8192 kv=fp8: triton 180.0 us, 1.67x the bf16 cache's 300.0 us (meets >= 1.5x)",
        "decode bs=1 seq_len=1024 kv=fp8: triton 11.0 us, 0.91x the bf16 cache's 10.0 us (MISSES >= 1.0x)",
        "tree_verify bs=16 prefix=16384 kv=fp8: triton 500.0 us, 1.20x the bf16 cache's 600.0 us "
        "(MISSES >= 1.5x)"]
    assert rep.bar_lines(rows)[-3:] == rep.fp8_lines(rows)
    pts = rep.fp8_points()
    assert all(p["kv_dtype"] == "fp8_e4m3" and p["impl"] != "flashmla" for _, p in pts)
    assert {n for n, _ in pts} == {"tree_verify", "mla_decode", "mla_tree_verify", "decode"}
    assert all(pt in rep.TRACKED_POINTS for pt in pts)


def test_fp8_shape_bytes_and_bad_kv_dtype():
    """An fp8 cache halves the KV bytes of the accounting (q and o stay bf16)."""
    gqa = ca.AttnShape.mha(32, 8, 128, "bfloat16", "fp8_e4m3")
    assert gqa.cache_dtype == torch.float8_e4m3fn and gqa.dtype == torch.bfloat16
    assert ca.attention_bytes(gqa, 4160, 64) == 4160 * 8 * 256 + 2 * 64 * 32 * 256
    mla = ca.AttnShape.mla(128, 512, 64, "bfloat16", "fp8_e4m3")
    assert ca.attention_bytes(mla, 8192, 1) == 8192 * 576 + 2 * 128 * (576 + 512)
    assert mla.make_pool(64, 64, "cpu").dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_dtype must be one of auto | fp8_e4m3"):
        ca.AttnShape.mha(32, 8, 128, "bfloat16", "fp8_e5m2")


def test_write_summary_lists_errors_and_notes(tmp_path):
    r = _result("decode", "triton", 10.0, dict(bs=1, seq_len=1024), mode="eager")
    r["note"] = "graph capture failed"
    reports = {"decode": dict(device={"name": "X"}, ceilings={"copy_gbps": 3000.0,
                                                             "matmul_tflops": 700.0},
                              cases=[r], errors=[{"params": {"impl": "flashinfer"},
                                                  "error": "ImportError: nope"}])}
    text = rep.write_summary(reports, str(tmp_path / "s.md"))
    assert (tmp_path / "s.md").read_text() == text
    assert "ImportError: nope" in text and "graph capture failed" in text and "X" in text


# ------------------------------------------------------------------------ GPU
GPU_SMALL = {
    "tree_verify": dict(bs=3, prefix=300, num_draft_tokens=24, topk=4, num_steps=4),
    "mla_tree_verify": dict(bs=2, prefix=200, num_draft_tokens=16, topk=4, num_steps=3),
    "decode": dict(bs=5, seq_len=700),
    "mla_decode": dict(bs=5, seq_len=700),
    "extend": dict(bs=2, prefix=128, new_tokens=100),
}
GPU_SMALL_CHAIN = dict(bs=3, prefix=200, num_draft_tokens=4, topk=1, num_steps=3, num_heads=16)
"""FlashMLA verifies chains only (the heads of a TP-8 shard: four tokens fill a Gluon tile)."""


@pytest.mark.gpu
@pytest.mark.parametrize("name,impl", [(n, i) for n, impls in sorted(ca.IMPLS.items())
                                       for i in impls])
def test_every_impl_matches_reference_on_gpu(name, impl, seed):
    if impl in ca.LIBRARIES:
        pytest.importorskip(ca.LIBRARIES[impl][0])
    small = GPU_SMALL_CHAIN if (name, impl) == ("mla_tree_verify", "flashmla") else GPU_SMALL[name]
    wl = get_case(name).build("cuda", impl=impl, input_sets=2, seed=seed % 1000, **small)
    for i, call in enumerate(wl.calls()):
        out = call()
        ref = reference(wl, i)
        assert out.shape == ref.shape and out.dtype == torch.bfloat16
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        assert err < 2e-2, f"{name} impl={impl} set {i}: relative error {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ca.IMPLS))
def test_triton_impl_is_graph_captured(name):
    from specattn.bench import harness
    wl = get_case(name).build("cuda", input_sets=2, **GPU_SMALL[name])
    prep = harness.prepare(wl)
    assert prep.mode == "cuda-graph", prep.note
    assert len(harness.time_prepared(prep, harness.MIN_ITERS)) == harness.MIN_ITERS


@pytest.mark.gpu
def test_cross_check_runs_on_gpu():
    lines = rep.cross_check()
    assert any("triton vs torch reference" in line for line in lines)
    assert not any("triton: FAILED" in line for line in lines)
