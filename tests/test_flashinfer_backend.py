"""FlashInferBackend.

CPU: lazy imports, the missing-package / no-GPU messages (``create_backend``,
``available_backends``, ``specattn info``), ``supports``, constructor validation, the
pure-torch metadata builders against naive constructions, and the backend's eager and graph
metadata paths run end to end against a *fake* flashinfer module (below) that implements
FlashInfer 0.7.2's wrapper signatures and semantics in float64 -- including its stored
bit-offset ``mask_indptr`` for ``packed_custom_mask`` (PR #2201), so the backend's fix is
exercised.

GPU (``-m gpu``, real flashinfer-python 0.7.2): every supported mode x eager / CUDA graph
(capture at a padded bs, replay with smaller live batches, outputs poisoned) against
TorchReferenceBackend; page sizes 1 / 16, GQA groups 1 / 4 / 8, head_dim 64 / 128, bf16, random
trees up to 64 draft tokens; MLA (512 + 64) EXTEND / DECODE / DRAFT_EXTEND_V2 / chain verify.
JIT modules compiled by the GPU tests: fa2 batch-prefill (bf16, head_dim 64), (bf16,
head_dim 128) -- the decode wrapper with tensor cores reuses them -- and batch-MLA (bf16,
512, 64, fa3 on SM90).

fp8 (float8_e4m3fn) KV caches: CPU -- the pools FlashInfer cannot run are refused
(UnsupportedConfigError naming the triton backend), and through the fake (which checks the
planned q / kv dtypes and applies ``k_scale`` / ``v_scale`` / ``ckv_scale`` as FlashInfer does)
every mode, MHA and MLA, eager and graph metadata, against attention over the dequantized cache
(``cache.float() * scale``) with per-layer scales != 1.  GPU: the same against the real kernels
(MHA every mode eager and in CUDA graphs; MLA on SM90 only, skipped elsewhere), more JIT
modules: fa2 batch-prefill (q bf16, kv e4m3, head_dim 64 / 128), (q fp16, kv e4m3, 128) and
batch-MLA (bf16, e4m3, 512, 64).
"""
import dataclasses
import random
import subprocess
import sys
import types

import pytest
import torch

from scenarios import capture_forward, load_trial, make_scenario, random_qkv
from specattn.backends import (AttentionKind, ForwardBatch, ForwardMode, GraphInputBuffers,
                               MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool,
                               TorchReferenceBackend, UnsupportedConfigError, UnsupportedError,
                               available_backends, create_backend, pack_tree_mask,
                               tree_mask_to_flashinfer)
import specattn.backends.flashinfer_backend as fb
from specattn.backends.flashinfer_backend import (FlashInferBackend, flashinfer_packed_mask,
                                                  paged_kv_indices, paged_kv_layout)
from specattn.ops.tree_mask import chain_tree_mask, flashinfer_mask_bytes

MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]
GRAPH_MODES = [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]


def chain(D, bs, device):
    """A batch of chain masks (what ``topk=1`` drafts verify)."""
    return chain_tree_mask(D, device).expand(bs, D, -1).contiguous()


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


# ------------------------------------------------------------------ imports and messages
def test_importing_backends_imports_neither_package():
    code = ("import sys, specattn.backends, specattn.backends.flashinfer_backend, "
            "specattn.backends.flashmla_backend; "
            "assert 'flashinfer' not in sys.modules and 'flash_mla' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ModuleNotFoundError
    sc = make_scenario(ForwardMode.DECODE)
    with pytest.raises(ImportError, match=r'pip install "specattn\[flashinfer\]"'):
        create_backend("flashinfer", sc.req_pool, sc.kv_pool)
    assert "specattn[flashinfer]" in available_backends()["flashinfer"]
    from specattn import info
    assert "specattn[flashinfer]" in info.collect_info()["backends"]["flashinfer"]


def test_package_without_gpu_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA GPU" in available_backends()["flashinfer"]


def test_supports_table():
    for mode in ForwardMode:
        for graph in (False, True):
            want = (not graph) or mode.is_cuda_graph()
            assert FlashInferBackend.supports(mode, graph=graph, kind=AttentionKind.MHA) == want
            mla = FlashInferBackend.supports(mode, graph=graph, kind=AttentionKind.MLA)
            assert mla == (want and mode != ForwardMode.TARGET_VERIFY)
            chain = FlashInferBackend.supports(mode, graph=graph, kind=AttentionKind.MLA, topk=1)
            assert chain == want


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_constructor_rejects_what_flashinfer_cannot_run(kind):
    req = ReqToTokenPool(4, 64)
    if kind == "mha":
        pools = [(MHATokenToKVPool(64, 1, torch.float32, 2, 64, 1), "float32"),
                 (MHATokenToKVPool(64, 1, torch.bfloat16, 2, 96, 1), "head_dim"),
                 (MHATokenToKVPool(64, 1, torch.bfloat16, 2, 64, 1, v_head_dim=128), "v_head_dim"),
                 (MHATokenToKVPool(64, 1, torch.bfloat16, 2, 64, 1), "CUDA")]
    else:
        pools = [(MLATokenToKVPool(64, 1, torch.float16, 1, kv_lora_rank=32, qk_rope_head_dim=16),
                  "kv_lora_rank"),
                 (MLATokenToKVPool(64, 1, torch.float32, 1), "float32"),
                 (MLATokenToKVPool(64, 1, torch.bfloat16, 1), "CUDA")]
    for pool, what in pools:
        with pytest.raises(ValueError, match=what):
            FlashInferBackend(req, pool)
    with pytest.raises(ValueError, match="topk"):
        FlashInferBackend(req, pools[-1][0], topk=0)


# ------------------------------------------------------------------ builders vs naive
def _naive_layout(sc):
    b, ps = sc.batch, sc.kv_pool.page_size
    rtt = sc.req_pool.req_to_token
    qo, kvp, last, idx = [0], [0], [], []
    for i in range(b.batch_size):
        r, P, n = int(b.req_pool_indices[i]), int(b.prefix_lens[i]), int(b.extend_lens[i])
        L = P + n
        slots = rtt[r, :L].tolist()
        pages = [slots[p] // ps for p in range(0, L, ps)]
        for p, s in enumerate(slots):  # the pool convention the builder relies on
            assert s // ps == pages[p // ps] and s % ps == p % ps
        idx += pages
        qo.append(qo[-1] + n)
        kvp.append(kvp[-1] + len(pages))
        last.append(L - (len(pages) - 1) * ps)
    return qo, kvp, last, idx


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_kv_builders_match_naive(mode, page_size, seed):
    rng = random.Random(seed)
    for _ in range(3):
        sc = make_scenario(mode, bs=rng.randint(1, 5), page_size=page_size,
                           max_prefix=rng.choice([0, 3, 40]), D=rng.choice([1, 5, 17]), rng=rng)
        b = sc.batch
        qo, kvp, last, idx = _naive_layout(sc)
        lay = paged_kv_layout(b.prefix_lens, b.extend_lens, page_size)
        assert lay.qo_indptr.tolist() == qo and lay.kv_indptr.tolist() == kvp
        assert lay.kv_last_page_len.tolist() == last
        assert lay.kv_lens.tolist() == (b.prefix_lens + b.extend_lens).tolist()
        assert all(t.dtype == torch.int32 for t in (lay.qo_indptr, lay.kv_indptr, lay.kv_last_page_len))
        got = paged_kv_indices(sc.req_pool.req_to_token, b.req_pool_indices, lay.kv_indptr,
                               page_size, lay.num_pages)
        assert got.dtype == torch.int32 and got.tolist() == idx
        out = torch.full((len(idx) + 7,), -7, dtype=torch.int32)   # poisoned static buffer
        view = paged_kv_indices(sc.req_pool.req_to_token, b.req_pool_indices, lay.kv_indptr,
                                page_size, lay.num_pages, out=out)
        assert view.data_ptr() == out.data_ptr() and out[:len(idx)].tolist() == idx
        assert (out[len(idx):] == -7).all()


def test_builders_on_empty_batch():
    e = torch.zeros(0, dtype=torch.int32)
    lay = paged_kv_layout(e, e, 16)
    assert lay.qo_indptr.tolist() == [0] and lay.num_pages == 0
    rtt = torch.zeros(2, 8, dtype=torch.int32)
    assert paged_kv_indices(rtt, e.long(), lay.kv_indptr, 16, 0).numel() == 0
    m, ip = flashinfer_packed_mask(torch.zeros(0, 3, 1, dtype=torch.int32), e, 0)
    assert m.numel() == 0 and ip.tolist() == [0]


def test_worked_example():
    """The module docstring's numbers."""
    pool = ReqToTokenPool(4, 16)
    pool.req_to_token[3, :11] = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23, 24, 25, 26])
    pool.req_to_token[0, :8] = torch.tensor([7, 8, 30, 31, 32, 33, 34, 35])
    P, n = torch.tensor([8, 5], dtype=torch.int32), torch.tensor([3, 3], dtype=torch.int32)
    lay = paged_kv_layout(P, n, 1)
    assert lay.qo_indptr.tolist() == [0, 3, 6] and lay.kv_lens.tolist() == [11, 8]
    assert lay.kv_indptr.tolist() == [0, 11, 19] and lay.kv_last_page_len.tolist() == [1, 1]
    assert paged_kv_indices(pool.req_to_token, torch.tensor([3, 0]), lay.kv_indptr, 1, 19).tolist() == \
        [10, 11, 12, 13, 20, 21, 22, 23, 24, 25, 26, 7, 8, 30, 31, 32, 33, 34, 35]
    tm = torch.tensor([[[1], [3], [7]], [[1], [3], [5]]], dtype=torch.int32)
    m, ip = flashinfer_packed_mask(tm, P, int(flashinfer_mask_bytes(P, 3).sum()))
    assert ip.tolist() == [0, 5, 8] and m.tolist() == [255, 249, 223, 255, 1, 63, 127, 191]


def test_packed_mask_matches_tree_mask_to_flashinfer(seed):
    """Random trees and random bit patterns, D across word and byte boundaries, P = 0 ..;
    into fresh tensors and into a poisoned static buffer."""
    from scenarios import ancestors_mask, random_tree_parents
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(60):
        bs = rng.randint(1, 4)
        D = rng.choice([1, 2, 3, 7, 8, 9, 31, 32, 33, 63, 64])
        P = torch.tensor([rng.choice([0, 1, 2, 5, 7, 8, 9, 100, 1000]) for _ in range(bs)],
                         dtype=torch.int32)
        if trial % 3:
            dense = torch.stack([ancestors_mask(random_tree_parents(D, rng)) for _ in range(bs)])
        else:
            dense = torch.rand(bs, D, D, generator=gen) < 0.5
        tm = pack_tree_mask(dense)
        nbytes = int(flashinfer_mask_bytes(P, D).sum())
        want, want_ip = tree_mask_to_flashinfer(tm, P)
        words = None
        if trial % 2:
            words = torch.randint(-2**31, 2**31 - 1, ((nbytes + 3) // 4 + 5,), dtype=torch.int32,
                                  generator=gen)
        got, ip = flashinfer_packed_mask(tm, P, nbytes, out_words=words)
        assert got.dtype == torch.uint8 and torch.equal(got, want), f"D={D} P={P.tolist()}"
        assert torch.equal(ip, want_ip)
        if words is not None:
            assert got.data_ptr() == words.data_ptr()


def test_packed_mask_rejects_bad_input():
    tm = torch.zeros(2, 3, 1, dtype=torch.int32)
    P = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError):
        flashinfer_packed_mask(tm.long(), P, 4)
    with pytest.raises(ValueError):
        flashinfer_packed_mask(tm, P[:1], 4)
    with pytest.raises(ValueError):
        flashinfer_packed_mask(tm, P, 40, out_words=torch.zeros(2, dtype=torch.int32))


# ------------------------------------------------------------------ a fake flashinfer (CPU)
def _paged_keys(cache, indices, start, end, last, ps):
    pages = indices[start:end].long()
    L = (len(pages) - 1) * ps + int(last) if len(pages) else 0
    t = torch.arange(L)
    return cache[pages[t // ps], t % ps], L


def _attend(q, k, v, visible, scale):
    """q [n, H, d], k [L, Hkv, d], v [L, Hkv, dv], visible [n, L] -> [n, H, dv] float64."""
    G = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)


class _FakePaged:
    """FlashInfer 0.7.2's paged prefill/decode wrappers (the signatures the backend uses),
    reading the metadata the way the kernels do (mask_indptr as *byte* offsets)."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend="auto", use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, decode=False):
        assert kv_layout == "NHD" and backend == "fa2"
        self.decode, self.graph = decode, use_cuda_graph
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf if not decode else paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buf if not decode else paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf if not decode \
            else paged_kv_last_page_len_buffer
        self._custom_mask_buf, self._mask_indptr_buf = custom_mask_buf, mask_indptr_buf
        self.plans = 0

    def _stage(self, name, src):
        src = src.to(torch.int32)
        if self.graph:
            buf = getattr(self, name)
            buf[:src.numel()].copy_(src)
        else:
            setattr(self, name, src.clone())

    def plan(self, *args, **kw):
        self.plans += 1
        if self.decode:
            indptr, indices, last, H, Hkv, d, ps = args
            qo = torch.arange(len(last) + 1, dtype=torch.int32)
            causal, packed = False, None
        else:
            qo, indptr, indices, last, H, Hkv, d, ps = args
            causal, packed = kw.get("causal", False), kw.get("packed_custom_mask")
            assert kw.get("head_dim_vo") in (None, d)
        for t in (qo, indptr, indices, last):
            assert t.dtype == torch.int32
        self.ps, self.causal, self.sm_scale = ps, causal, kw.get("sm_scale")
        self.q_dtype, self.kv_dtype = kw["q_data_type"], kw["kv_data_type"]
        assert self.q_dtype != torch.float8_e4m3fn     # fa2: no fp8 queries (an assert in its JIT)
        self.qo_host = qo.cpu()
        if self.graph and self._qo_indptr_buf is not None:
            self._qo_indptr_buf.copy_(qo)
        self._stage("_paged_kv_indptr_buf", indptr)
        self._stage("_paged_kv_indices_buf", indices)
        self._stage("_paged_kv_last_page_len_buf", last)
        if packed is not None:   # 0.7.2: bit offsets, cumsum(qo_len * kv_len)
            kv_len = (indptr[1:] - indptr[:-1] - 1) * ps + last
            bits = torch.cat([torch.zeros(1, dtype=torch.int64),
                              torch.cumsum((qo[1:] - qo[:-1]).long() * kv_len.long(), 0)]).int()
            if self.graph:
                self._custom_mask_buf[:packed.numel()].copy_(packed)
                self._mask_indptr_buf.copy_(bits)
            else:
                self._custom_mask_buf, self._mask_indptr_buf = packed.clone(), bits
        elif not self.graph:
            self._custom_mask_buf = None

    def run(self, q, paged_kv_cache, q_scale=None, k_scale=None, v_scale=None):
        k_cache, v_cache = paged_kv_cache
        assert q.dtype == self.q_dtype and k_cache.dtype == v_cache.dtype == self.kv_dtype
        # FlashInfer: k_scale folds into the softmax scale, v_scale multiplies the output
        scale = (self.sm_scale if self.sm_scale is not None else q.shape[-1] ** -0.5) * (q_scale or 1)
        scale *= k_scale if k_scale is not None else 1.0
        ind, last = self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf
        ip = self._paged_kv_indptr_buf.cpu()
        qo = self.qo_host
        out = torch.full((q.shape[0], q.shape[1], v_cache.shape[-1]), float("nan"), dtype=torch.float64)
        for i in range(len(qo) - 1):
            a, b = int(qo[i]), int(qo[i + 1])
            k, L = _paged_keys(k_cache, ind, int(ip[i]), int(ip[i + 1]), last[i], self.ps)
            v, _ = _paged_keys(v_cache, ind, int(ip[i]), int(ip[i + 1]), last[i], self.ps)
            n = b - a
            jj, kk = torch.arange(n)[:, None], torch.arange(L)[None, :]
            if self._custom_mask_buf is not None and not self.decode:
                off = int(self._mask_indptr_buf[i]) * 8 + jj * L + kk
                byte = self._custom_mask_buf.long()[off // 8]
                vis = ((byte >> (off % 8)) & 1).bool()
            elif self.causal:
                vis = kk <= L - n + jj
            else:
                vis = torch.ones(n, L, dtype=torch.bool)
            out[a:b] = _attend(q[a:b], k, v, vis, scale)
        return (out * (v_scale if v_scale is not None else 1.0)).to(q.dtype)


class _FakeMLA:
    """``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (canonical-metadata form)."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto"):
        self.graph = use_cuda_graph
        self.bufs = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                         kv_len_arr=kv_len_arr)

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
             sm_scale, q_data_type, kv_data_type, scale_mode="default"):
        fp8 = kv_data_type == torch.float8_e4m3fn   # fa2/fa3: bf16 queries, kv-per-tensor scales
        assert (q_data_type == torch.bfloat16 and scale_mode == "kv-per-tensor") if fp8 else \
            (q_data_type == kv_data_type and scale_mode == "default")
        self.q_dtype, self.kv_dtype, self.fp8 = q_data_type, kv_data_type, fp8
        for name in self.bufs:
            src = getattr(metadata, name)
            assert src.dtype == torch.int32 and src.is_contiguous()
            if self.graph:
                assert name == "kv_indices" or self.bufs[name].shape == src.shape
                self.bufs[name][:src.numel()].copy_(src)
            else:
                self.bufs[name] = src.clone()
        self.ckv, self.ps, self.causal, self.scale, self.H = (head_dim_ckv, page_size, causal,
                                                              sm_scale, num_heads)

    def run(self, *, query, kv_cache, ckv_scale=None, kpe_scale=None):
        assert query.shape[1] == self.H and kv_cache.dim() == 3
        assert query.dtype == self.q_dtype and kv_cache.dtype == self.kv_dtype
        # FlashInfer 0.7.2: both scales exactly when the plan is fp8 (else a ValueError)
        assert (ckv_scale is not None and kpe_scale is not None) == self.fp8
        qo, ip = self.bufs["qo_indptr"].cpu(), self.bufs["kv_indptr"].cpu()
        lens = self.bufs["kv_len_arr"].cpu()
        out = torch.full((*query.shape[:2], self.ckv), float("nan"), dtype=torch.float64)
        for i in range(len(lens)):
            a, b, L = int(qo[i]), int(qo[i + 1]), int(lens[i])
            pages = self.bufs["kv_indices"][int(ip[i]):int(ip[i + 1])].long()
            t = torch.arange(L)
            lat = kv_cache[pages[t // self.ps], t % self.ps][:, None, :].double()   # [L, 1, 576]
            if self.fp8:   # dequantized in the kernel: c_kv * ckv_scale, k_pe * kpe_scale
                lat = torch.cat([lat[..., :self.ckv] * ckv_scale, lat[..., self.ckv:] * kpe_scale], -1)
            n = b - a
            jj, kk = torch.arange(n)[:, None], torch.arange(L)[None, :]
            vis = kk <= L - n + jj if self.causal else torch.ones(n, L, dtype=torch.bool)
            out[a:b] = _attend(query[a:b], lat, lat[..., :self.ckv], vis, self.scale)
        return out.to(query.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """Install the fake as ``flashinfer`` / ``flashinfer.mla`` and let CPU pools through."""
    from dataclasses import dataclass

    @dataclass
    class MLAPlanMetadata:
        qo_indptr: torch.Tensor
        kv_indptr: torch.Tensor
        kv_indices: torch.Tensor
        kv_len_arr: torch.Tensor

        @classmethod
        def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
            return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)

    fi = types.ModuleType("flashinfer")
    fi.BatchPrefillWithPagedKVCacheWrapper = _FakePaged
    fi.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **k: _FakePaged(*a, decode=True, **k)
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper, mla.MLAPlanMetadata = _FakeMLA, MLAPlanMetadata
    fi.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setattr(fb, "_check_pools", lambda *a, **k: None)   # CPU float32 / fp8 pools
    monkeypatch.setattr(FlashInferBackend, "unavailable_reason", classmethod(lambda cls: None))
    return fi


def _mla_kw():
    return dict(kind="mla", kv_lora_rank=128, qk_rope_head_dim=64, num_heads=4)


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_eager_against_reference_with_fake(fake_flashinfer, kind, mode, page_size, seed):
    rng = random.Random(seed)
    topk = None
    kw = dict(num_heads=4 * rng.choice([1, 2]), num_kv_heads=rng.choice([1, 2]), head_dim=64) \
        if kind == "mha" else _mla_kw()
    if kind == "mla" and mode == ForwardMode.TARGET_VERIFY:
        topk = 1
    sc = make_scenario(mode, bs=rng.randint(1, 4), page_size=page_size, max_prefix=rng.choice([0, 30]),
                       D=rng.choice([1, 6, 33]), rng=rng, **kw)
    if topk == 1:  # a chain: causal among the drafts
        D = sc.batch.num_tokens_per_req
        sc.batch.tree_mask = chain(D, sc.batch.batch_size, "cpu")
    be = create_backend("flashinfer", sc.req_pool, sc.kv_pool, topk=topk, workspace_bytes=16)
    q, k, v = random_qkv(sc)
    for step in range(2):  # 2nd batch: planned inside init_forward_metadata (key known)
        be.init_forward_metadata(sc.batch)
        assert (be.forward_metadata.planned_key is not None) == (step == 1)
        out = be.forward(q, k, v, sc.layer, sc.batch)
        ref = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
        ref.init_forward_metadata(sc.batch)
        want = ref.forward(q, k, v, sc.layer, sc.batch, save_kv_cache=False)
        assert out.dtype == q.dtype and torch.isfinite(out).all()
        assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_stale_metadata_of_another_token_count_is_refused(fake_flashinfer, kind, seed):
    """Metadata planned for one batch must not serve a batch of the same mode and size with
    another token count: the planned qo_indptr would send the kernels past q."""
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=64) if kind == "mha" else _mla_kw()
    sc = make_scenario(ForwardMode.EXTEND, bs=2, extend_lens=[3, 2], rng=random.Random(seed), **kw)
    be = create_backend("flashinfer", sc.req_pool, sc.kv_pool, workspace_bytes=16)
    q, k, v = random_qkv(sc)
    be.init_forward_metadata(sc.batch)
    be.forward(q, k, v, sc.layer, sc.batch)
    b = sc.batch
    other = ForwardBatch.extend(b.req_pool_indices, b.prefix_lens, torch.ones(2, dtype=torch.int32),
                                b.out_cache_loc[:2])
    with pytest.raises(RuntimeError, match="init_forward_metadata was not called"):
        be.forward(q[:2], None, None, sc.layer, other, save_kv_cache=False)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_eager_metadata_refuses_rows_slots_and_stale_lengths(fake_flashinfer, kind, seed):
    """What the plan and the kernels would read is checked before either runs: a
    ``req_pool_indices`` row past ``req_to_token``, a slot past the KV pool, host copies of the
    lengths that differ from the tensors."""
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=64) if kind == "mha" else _mla_kw()
    sc = make_scenario(ForwardMode.EXTEND, bs=2, extend_lens=[3, 2], rng=random.Random(seed), **kw)
    be = create_backend("flashinfer", sc.req_pool, sc.kv_pool, workspace_bytes=16)
    b = sc.batch
    rtt = sc.req_pool.req_to_token
    with pytest.raises(ValueError, match="host copies"):
        be.init_forward_metadata(dataclasses.replace(b, prefix_lens=b.prefix_lens + 1))
    with pytest.raises(ValueError, match="req_pool_indices"):
        be.init_forward_metadata(dataclasses.replace(b, req_pool_indices=b.req_pool_indices.clone().fill_(rtt.shape[0])))
    r0, p0 = int(b.req_pool_indices[1]), int(b.prefix_lens[1])
    saved = int(rtt[r0, p0])
    rtt[r0, p0] = sc.kv_pool.get_key_buffer(0).shape[0]                # one past the pool
    with pytest.raises(ValueError, match="outside the KV pool"):
        be.init_forward_metadata(b)
    rtt[r0, p0] = saved
    be.init_forward_metadata(b)                                         # the batch itself is fine


def test_mla_tree_verify_is_refused(fake_flashinfer):
    sc = make_scenario(ForwardMode.TARGET_VERIFY, D=4, **_mla_kw())
    be = create_backend("flashinfer", sc.req_pool, sc.kv_pool, workspace_bytes=16)
    assert not be.supports(ForwardMode.TARGET_VERIFY, graph=False, kind=AttentionKind.MLA)
    with pytest.raises(UnsupportedError, match="tree"):
        be.init_forward_metadata(sc.batch)
    chain = create_backend("flashinfer", sc.req_pool, sc.kv_pool, topk=1, workspace_bytes=16)
    assert chain.supports(ForwardMode.TARGET_VERIFY, graph=True, kind=AttentionKind.MLA)
    sc.batch.tree_mask[0, -1] = 1  # not a chain
    with pytest.raises(ValueError, match="chain"):
        chain.init_forward_metadata(sc.batch)


def _graph_case_fake(kind, mode, page_size, seed, padded_bs=4):
    """Capture-metadata at ``padded_bs``, warm-up forward (plans), then replays with fresh live
    batches through the same static buffers (no real graph on CPU)."""
    rng = random.Random(seed)
    D = 1 if mode == ForwardMode.DECODE else rng.choice([3, 9, 33])
    kw = dict(num_heads=8, num_kv_heads=2, head_dim=64) if kind == "mha" else _mla_kw()
    topk = 1 if kind == "mla" else None
    common = dict(D=D, page_size=page_size, rng=rng, capacity_bs=padded_bs, max_prefix=25, **kw)
    first = make_scenario(mode, bs=padded_bs, **common)
    be = create_backend("flashinfer", first.req_pool, first.kv_pool, topk=topk, workspace_bytes=16)
    be.init_cuda_graph_state(padded_bs, padded_bs * D)
    bufs = GraphInputBuffers(padded_bs, D, "cpu")
    layer = first.layer
    T = padded_bs * D
    qs = torch.zeros(T, layer.num_heads, layer.head_dim)
    ks = torch.zeros(T, layer.num_kv_heads, layer.head_dim)
    vs = None if kind == "mla" else torch.zeros(T, layer.num_kv_heads, layer.v_head_dim)
    be.init_forward_metadata_capture_cuda_graph(bufs.fill(first.batch, padded_bs))
    captured = be.forward_metadata
    assert captured.planned_key is None                # no layer seen yet: the warm-up plans
    be.forward(qs, ks, vs, layer, bufs.fill(first.batch, padded_bs))
    assert captured.planned_key is not None
    for trial in range(3):
        bs = rng.randint(1, padded_bs)
        sc = make_scenario(mode, bs=bs, **common)
        if kind == "mla" and mode == ForwardMode.TARGET_VERIFY:
            sc.batch.tree_mask = chain(D, bs, "cpu")
        q, k, v, n = load_trial(first, sc, qs, ks, vs)
        padded = bufs.fill(sc.batch, padded_bs)
        be.init_forward_metadata_replay_cuda_graph(padded)
        md = be.forward_metadata
        assert md.wrapper is captured.wrapper
        assert md.kv_indices.data_ptr() == captured.kv_indices.data_ptr()   # static buffers
        out = be.forward(qs, ks, vs, layer, padded)[:n]
        ref = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
        ref.init_forward_metadata(sc.batch)
        want = ref.forward(q, k, v, layer, sc.batch)
        assert torch.isfinite(out).all() and rel_err(out, want) < 1e-5, f"bs {bs}"
    return be


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_builders_with_fake(fake_flashinfer, kind, mode, page_size, seed):
    _graph_case_fake(kind, mode, page_size, seed)


def test_graph_errors_with_fake(fake_flashinfer, monkeypatch):
    sc = make_scenario(ForwardMode.TARGET_VERIFY, bs=2, num_heads=4, num_kv_heads=2, head_dim=64)
    be = create_backend("flashinfer", sc.req_pool, sc.kv_pool, workspace_bytes=16)
    with pytest.raises(ValueError):   # EXTEND is not capturable
        be.init_forward_metadata_capture_cuda_graph(make_scenario(ForwardMode.EXTEND).batch)
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        be.init_forward_metadata_capture_cuda_graph(sc.batch)
    be.init_cuda_graph_state(2, 2 * sc.batch.num_tokens_per_req)
    with pytest.raises(RuntimeError, match="never captured"):
        be.init_forward_metadata_replay_cuda_graph(sc.batch)
    be.init_forward_metadata_capture_cuda_graph(sc.batch)
    q, k, v = random_qkv(sc)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="warm-up"):
        be.forward(q, k, v, sc.layer, sc.batch)


def test_idle_and_empty_with_fake(fake_flashinfer):
    sc = make_scenario(ForwardMode.IDLE, num_heads=4, num_kv_heads=2, head_dim=64)
    be = create_backend("flashinfer", sc.req_pool, sc.kv_pool, workspace_bytes=16)
    be.init_forward_metadata(sc.batch)
    out = be.forward(torch.randn(0, 4, 64), None, None, sc.layer, sc.batch)
    assert out.shape == (0, 4, 64)


# ------------------------------------------------------------------ GPU (real flashinfer)
TOL = 1e-2  # bf16 relative (Frobenius) error against the float32 reference


def _gpu_backend(sc, **kw):
    pytest.importorskip("flashinfer")
    return create_backend("flashinfer", sc.req_pool, sc.kv_pool, **kw)


def _check_gpu(sc, be):
    q, k, v = random_qkv(sc)
    be.init_forward_metadata(sc.batch)
    out = be.forward(q, k, v, sc.layer, sc.batch)
    ref = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    ref.init_forward_metadata(sc.batch)
    want = ref.forward(q, k, v, sc.layer, sc.batch, save_kv_cache=False)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    err = rel_err(out, want)
    assert err < TOL, f"relative error {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_eager_on_gpu(mode, page_size, head_dim, seed):
    rng = random.Random(seed)
    for group in (1, 4, 8):
        hkv = rng.choice([1, 2, 4])
        sc = make_scenario(mode, bs=rng.randint(1, 6), page_size=page_size, device="cuda",
                           dtype=torch.bfloat16, num_kv_heads=hkv, num_heads=hkv * group,
                           head_dim=head_dim, max_prefix=rng.choice([0, 30, 700]),
                           D=rng.choice([1, 7, 33, 64]), rng=rng)
        _check_gpu(sc, _gpu_backend(sc))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_eager_on_gpu(mode, page_size, seed):
    rng = random.Random(seed)
    sc = make_scenario(mode, kind="mla", bs=rng.randint(1, 6), page_size=page_size, device="cuda",
                       dtype=torch.bfloat16, num_heads=rng.choice([16, 64]), kv_lora_rank=512,
                       qk_rope_head_dim=64, max_prefix=rng.choice([5, 600]),
                       D=rng.choice([1, 4, 8]), rng=rng)
    topk = 1 if mode == ForwardMode.TARGET_VERIFY else None
    if topk:
        b = sc.batch
        b.tree_mask = chain(b.num_tokens_per_req, b.batch_size, "cuda")
    _check_gpu(sc, _gpu_backend(sc, topk=topk))


def _gpu_graph_case(kind, mode, page_size, seed, group=4, head_dim=128, D=5, padded_bs=8,
                    max_prefix=300):
    """Capture at ``padded_bs`` (warm-up plans), replay with fresh live batches of bs <
    padded_bs and = padded_bs; outputs poisoned before each replay."""
    pytest.importorskip("flashinfer")
    rng = random.Random(seed)
    D = 1 if mode == ForwardMode.DECODE else D
    if kind == "mha":
        kw = dict(num_heads=2 * group, num_kv_heads=2, head_dim=head_dim)
    else:
        kw = dict(kind="mla", num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64)
    common = dict(D=D, page_size=page_size, device="cuda", rng=rng, capacity_bs=padded_bs,
                  dtype=torch.bfloat16, max_prefix=max_prefix, **kw)
    first = make_scenario(mode, bs=padded_bs, **common)
    topk = 1 if kind == "mla" else None
    be = create_backend("flashinfer", first.req_pool, first.kv_pool, topk=topk)
    be.init_cuda_graph_state(padded_bs, padded_bs * D)
    bufs = GraphInputBuffers(padded_bs, D, "cuda")
    layer = first.layer
    T = padded_bs * D
    qs = torch.zeros(T, layer.num_heads, layer.head_dim, device="cuda", dtype=torch.bfloat16)
    ks = torch.zeros(T, layer.num_kv_heads, layer.head_dim, device="cuda", dtype=torch.bfloat16)
    vs = None if kind == "mla" else torch.zeros(T, layer.num_kv_heads, layer.v_head_dim,
                                                device="cuda", dtype=torch.bfloat16)
    padded = bufs.fill(first.batch, padded_bs)
    be.init_forward_metadata_capture_cuda_graph(padded)
    g, out_static = capture_forward(be, qs, ks, vs, layer, padded)   # plans in the warm-up
    for trial in range(3):
        bs = rng.randint(1, padded_bs - 1) if trial < 2 else padded_bs
        sc = make_scenario(mode, bs=bs, **common)
        if kind == "mla" and mode == ForwardMode.TARGET_VERIFY:
            sc.batch.tree_mask = chain(D, bs, "cuda")
        q, k, v, n = load_trial(first, sc, qs, ks, vs)
        be.init_forward_metadata_replay_cuda_graph(bufs.fill(sc.batch, padded_bs))
        out_static.fill_(float("nan"))
        g.replay()
        out = out_static[:n].clone()
        ref = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
        ref.init_forward_metadata(sc.batch)
        want = ref.forward(q, k, v, layer, sc.batch)
        assert torch.isfinite(out).all(), f"bs {bs}"
        err = rel_err(out, want)
        assert err < TOL, f"relative error {err} (bs {bs})"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_graph_replay_on_gpu(mode, page_size, head_dim, seed):
    rng = random.Random(seed)
    _gpu_graph_case("mha", mode, page_size, seed, group=rng.choice([1, 4, 8]), head_dim=head_dim,
                    D=rng.choice([5, 33, 64]), max_prefix=rng.choice([20, 2000]))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_cuda_graph_replay_on_gpu(mode, page_size, seed):
    _gpu_graph_case("mla", mode, page_size, seed, D=random.Random(seed).choice([2, 4, 8]))


# ------------------------------------------------------------------ fp8 (e4m3) KV caches
FP8 = torch.float8_e4m3fn
# Per-layer dequantization scales (the tests' layer is the last one, so a backend reading
# another layer's scale is caught; an MLA latent takes K_SCALES).  Powers of two: products
# with them are exact in bf16, the dtype FlashInfer's MLA kernel multiplies in, so the kernels
# see the dequantized cache exactly.
K_SCALES, V_SCALES = [4.0, 0.5], [0.125, 2.0]
SCALES = dict(dtype=FP8, kv_scales=(K_SCALES, V_SCALES))


def _dequant_reference(sc, q):
    """float32 attention of ``sc``'s batch over its fp8 cache as it is now (after the forward
    wrote this batch's KV): the reference backend, which reads ``cache.float() * scale`` with
    the layer's scales.  The fp8 rounding of the cache is in both this and the backend's
    result."""
    ref = TorchReferenceBackend(sc.req_pool, sc.kv_pool)
    ref.init_forward_metadata(sc.batch)
    return ref.forward(q.float(), None, None, sc.layer, sc.batch, save_kv_cache=False)


def _fp8_eager(sc, be, q_dtype):
    """One eager forward of ``sc`` with ``q_dtype`` queries; returns the relative error against
    :func:`_dequant_reference` of the queries the kernels see (cast to ``be.query_dtype``)."""
    q, k, v = random_qkv(sc, dtype=q_dtype)
    be.init_forward_metadata(sc.batch)
    out = be.forward(q, k, v, sc.layer, sc.batch)
    assert out.dtype == q_dtype and out.shape == (q.shape[0], q.shape[1], sc.layer.v_head_dim)
    assert torch.isfinite(out).all()
    return rel_err(out, _dequant_reference(sc, q.to(be.query_dtype(q_dtype))))


def test_fp8_pools_flashinfer_cannot_run_are_refused(monkeypatch):
    """fp8 pools pass the dtype check; what FlashInfer 0.7.2 does not run raises
    UnsupportedConfigError from the constructor, before flashinfer is imported."""
    req = ReqToTokenPool(4, 64)
    mha = MHATokenToKVPool(64, 1, FP8, 2, 64, 1)
    mla = MLATokenToKVPool(64, 1, FP8, 1)
    with pytest.raises(UnsupportedConfigError, match="prefill_backend='fa2'"):   # fa3: fp8 q only
        FlashInferBackend(req, mha, prefill_backend="fa3")
    with pytest.raises(UnsupportedConfigError, match="512 .*triton"):
        FlashInferBackend(req, MLATokenToKVPool(64, 1, FP8, 1, kv_lora_rank=256, qk_rope_head_dim=64))
    with pytest.raises(UnsupportedConfigError, match="mla_backend"):
        FlashInferBackend(req, mla, mla_backend="trtllm-gen")
    for pool in (mha, mla):      # accepted: CPU pools get as far as the device check
        with pytest.raises(ValueError, match="CUDA") as e:
            FlashInferBackend(req, pool)
        assert not isinstance(e.value, UnsupportedConfigError)
    # MLA reads an fp8 latent on SM90 only; the check reads the pools' GPU (stubs: no GPU here)
    gpu = torch.device("cuda", 0)
    req_gpu = types.SimpleNamespace(device=gpu)
    mla_gpu = types.SimpleNamespace(dtype=FP8, kv_lora_rank=512, qk_rope_head_dim=64, device=gpu)
    mha_gpu = types.SimpleNamespace(dtype=FP8, head_dim=128, v_head_dim=128, device=gpu)
    for cap in ((8, 0), (8, 9), (10, 0), (12, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=cap: c)
        with pytest.raises(UnsupportedConfigError, match=r"SM90 .*SM%d%d.*triton" % cap):
            fb._check_pools(req_gpu, mla_gpu, AttentionKind.MLA)
        fb._check_pools(req_gpu, mha_gpu, AttentionKind.MHA)          # fa2 on any GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    fb._check_pools(req_gpu, mla_gpu, AttentionKind.MLA)
    for backend in ("fa2", "fa3"):
        fb._check_pools(req_gpu, mla_gpu, AttentionKind.MLA, mla_backend=backend)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_fp8_query_dtype_is_never_fp8(fake_flashinfer, kind):
    """The compute dtype of the queries: 16-bit always (FlashInfer's fa2 asserts against fp8
    queries); MHA keeps a bf16/fp16 query's own, MLA runs bf16 (its only fp8 form)."""
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=64) if kind == "mha" else _mla_kw()
    sc = make_scenario(ForwardMode.DECODE, dtype=FP8, **kw)
    be = create_backend("flashinfer", sc.req_pool, sc.kv_pool, workspace_bytes=16)
    want16 = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float16 if kind == "mha"
              else torch.bfloat16}
    for dt in (torch.bfloat16, torch.float16, torch.float32, FP8):
        assert be.query_dtype(dt) == want16.get(dt, torch.bfloat16)
    bf = make_scenario(ForwardMode.DECODE, dtype=torch.float32, **kw)   # other pools: theirs
    assert create_backend("flashinfer", bf.req_pool, bf.kv_pool,
                          workspace_bytes=16).query_dtype(torch.bfloat16) == torch.float32


FP8_FAKE_TOL = 2.0 ** -8   # the fake rounds only its output, to the compute dtype: <= 2^-9


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_eager_with_fake(fake_flashinfer, kind, mode, page_size, q_dtype, seed):
    """fp8 pools through the fake: plans with kv_data_type e4m3 and 16-bit queries, the
    layer's scales reach ``run``, output in the query's dtype; against the dequantized cache."""
    rng = random.Random(seed)
    kw = dict(num_heads=4 * rng.choice([1, 2]), num_kv_heads=rng.choice([1, 2]), head_dim=64) \
        if kind == "mha" else _mla_kw()
    topk = 1 if kind == "mla" and mode == ForwardMode.TARGET_VERIFY else None
    sc = make_scenario(mode, bs=rng.randint(1, 4), page_size=page_size, max_prefix=rng.choice([0, 30]),
                       D=rng.choice([1, 6, 33]), rng=rng, **SCALES, **kw)
    if topk == 1:
        sc.batch.tree_mask = chain(sc.batch.num_tokens_per_req, sc.batch.batch_size, "cpu")
    be = create_backend("flashinfer", sc.req_pool, sc.kv_pool, topk=topk, workspace_bytes=16)
    for step in range(2):   # the 2nd plans ahead in init_forward_metadata with the same key
        err = _fp8_eager(sc, be, q_dtype)
        assert err < FP8_FAKE_TOL, f"relative error {err}"
        assert be.forward_metadata.planned_key[-1] == be.query_dtype(q_dtype)


def _fp8_graph_case(kind, mode, page_size, seed, device, tol, padded_bs=4, D=5, max_prefix=40,
                    head_dim=64, heads=8, **backend_kw):
    """fp8 pool, bf16 queries: capture-metadata at ``padded_bs``, warm-up forward (plans), then
    replays with fresh live batches (bs < padded_bs and = padded_bs) through the same static
    buffers; on CUDA a real graph is captured and replayed (outputs poisoned first).  Each
    trial's cache goes into the captured pools (raw e4m3 bytes), compared with the dequantized cache."""
    rng = random.Random(seed)
    D = 1 if mode == ForwardMode.DECODE else D
    if kind == "mha":
        kw = dict(num_heads=heads, num_kv_heads=2, head_dim=head_dim)
    else:
        kw = dict(kind="mla", num_heads=heads, kv_lora_rank=512 if device != "cpu" else 128,
                  qk_rope_head_dim=64)
    common = dict(D=D, page_size=page_size, device=device, rng=rng, capacity_bs=padded_bs,
                  max_prefix=max_prefix, **SCALES, **kw)
    first = make_scenario(mode, bs=padded_bs, **common)
    be = create_backend("flashinfer", first.req_pool, first.kv_pool,
                        topk=1 if kind == "mla" else None, **backend_kw)
    be.init_cuda_graph_state(padded_bs, padded_bs * D)
    bufs = GraphInputBuffers(padded_bs, D, device)
    layer, T, bf = first.layer, padded_bs * D, torch.bfloat16
    qs = torch.zeros(T, layer.num_heads, layer.head_dim, device=device, dtype=bf)
    ks = torch.zeros(T, layer.num_kv_heads, layer.head_dim, device=device, dtype=bf)
    vs = None if kind == "mla" else torch.zeros(T, layer.num_kv_heads, layer.v_head_dim,
                                                device=device, dtype=bf)
    padded = bufs.fill(first.batch, padded_bs)
    be.init_forward_metadata_capture_cuda_graph(padded)
    graph = None
    if device == "cpu":
        be.forward(qs, ks, vs, layer, padded)          # warm-up: plans
    else:
        graph, out_static = capture_forward(be, qs, ks, vs, layer, padded)
    for trial in range(3):
        bs = rng.randint(1, padded_bs - 1) if trial < 2 else padded_bs
        sc = make_scenario(mode, bs=bs, **common)
        if kind == "mla" and mode == ForwardMode.TARGET_VERIFY:
            sc.batch.tree_mask = chain(D, bs, device)
        for dst, src in zip(first.kv_pool.buffers, sc.kv_pool.buffers):   # raw e4m3 bytes
            dst.copy_(src)
        first.req_pool.req_to_token.copy_(sc.req_pool.req_to_token)
        sc.kv_pool, sc.req_pool = first.kv_pool, first.req_pool
        q, k, v = random_qkv(sc, dtype=bf)
        n = sc.batch.num_tokens
        qs.normal_(), ks.normal_()
        qs[:n].copy_(q), ks[:n].copy_(k)
        if vs is not None:
            vs.normal_()
            vs[:n].copy_(v)
        padded = bufs.fill(sc.batch, padded_bs)
        be.init_forward_metadata_replay_cuda_graph(padded)
        if graph is None:
            out = be.forward(qs, ks, vs, layer, padded)[:n]
        else:
            out_static.fill_(float("nan"))
            graph.replay()
            out = out_static[:n].clone()
        assert out.dtype == bf and torch.isfinite(out).all(), f"bs {bs}"
        err = rel_err(out, _dequant_reference(sc, q))
        assert err < tol, f"relative error {err} (bs {bs})"


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_graph_builders_with_fake(fake_flashinfer, kind, mode, page_size, seed):
    _fp8_graph_case(kind, mode, page_size, seed, "cpu", FP8_FAKE_TOL,
                    heads=8 if kind == "mha" else 4, workspace_bytes=16)


# GPU: the kernels see exactly the dequantized cache (e4m3 -> bf16/fp16 is exact; MHA folds
# k_scale into the fp32 softmax scale and multiplies the output by v_scale = 2.0, exact; MLA
# multiplies by its power-of-two scale in bf16, exact), so what remains is the 16-bit rounding
# of P and of the output (each <= 2^-9 relative), as in the bf16-cache tests: the same TOL.


def _fp8_gpu_backend(sc, **kw):
    pytest.importorskip("flashinfer")
    if isinstance(sc.kv_pool, MLATokenToKVPool):
        major, minor = torch.cuda.get_device_capability()
        if major != 9:
            with pytest.raises(UnsupportedConfigError, match="SM90"):
                create_backend("flashinfer", sc.req_pool, sc.kv_pool, **kw)
            pytest.skip(f"FlashInfer reads an fp8 MLA latent on SM90 only (this GPU: SM{major}{minor})")
    return create_backend("flashinfer", sc.req_pool, sc.kv_pool, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_eager_on_gpu(mode, page_size, head_dim, seed):
    rng = random.Random(seed)
    for group in (1, 4, 8):
        hkv = rng.choice([1, 2, 4])
        sc = make_scenario(mode, bs=rng.randint(1, 6), page_size=page_size, device="cuda",
                           num_kv_heads=hkv, num_heads=hkv * group, head_dim=head_dim,
                           max_prefix=rng.choice([0, 30, 700]), D=rng.choice([1, 7, 33, 64]),
                           rng=rng, **SCALES)
        err = _fp8_eager(sc, _fp8_gpu_backend(sc), torch.bfloat16)
        assert err < TOL, f"relative error {err} (group {group})"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=lambda m: m.name)
def test_fp8_fp16_queries_on_gpu(mode, seed):
    """fp16 queries over an fp8 cache run in fp16 (their own dtype), output fp16."""
    rng = random.Random(seed)
    sc = make_scenario(mode, bs=3, page_size=16, device="cuda", num_kv_heads=2, num_heads=8,
                       head_dim=128, max_prefix=300, rng=rng, **SCALES)
    be = _fp8_gpu_backend(sc)
    assert be.query_dtype(torch.float16) == torch.float16
    err = _fp8_eager(sc, be, torch.float16)
    assert err < TOL, f"relative error {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_mla_eager_on_gpu(mode, page_size, seed):
    rng = random.Random(seed)
    sc = make_scenario(mode, kind="mla", bs=rng.randint(1, 6), page_size=page_size, device="cuda",
                       num_heads=rng.choice([16, 64]), kv_lora_rank=512, qk_rope_head_dim=64,
                       max_prefix=rng.choice([5, 600]), D=rng.choice([1, 4, 8]), rng=rng, **SCALES)
    topk = 1 if mode == ForwardMode.TARGET_VERIFY else None
    if topk:
        b = sc.batch
        b.tree_mask = chain(b.num_tokens_per_req, b.batch_size, "cuda")
    err = _fp8_eager(sc, _fp8_gpu_backend(sc, topk=topk), torch.bfloat16)
    assert err < TOL, f"relative error {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("mode", GRAPH_MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_cuda_graph_replay_on_gpu(kind, mode, page_size, seed):
    """The scales are Python floats per layer: captured with the kernels, right at replay."""
    pytest.importorskip("flashinfer")
    if kind == "mla" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashInfer reads an fp8 MLA latent on SM90 only")
    rng = random.Random(seed)
    _fp8_graph_case(kind, mode, page_size, seed, "cuda", TOL, padded_bs=8,
                    D=rng.choice([2, 4, 8]) if kind == "mla" else rng.choice([5, 33]),
                    max_prefix=rng.choice([20, 1500]), head_dim=128, heads=16 if kind == "mla" else 8)
