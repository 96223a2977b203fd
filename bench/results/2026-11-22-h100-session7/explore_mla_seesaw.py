"""Scratch: seesaw MLA kernel correctness + timing on the GPU (not committed)."""
import sys, time, torch
from specattn.triton_kernels import attention_mla_sm90 as m
from specattn.triton_kernels.attention_mla import mla_paged_attention

torch.manual_seed(0)
dev = "cuda"

def make(bs, L, H=128, ps=64, n=1, tree=False):
    width = (L + n + ps - 1) // ps * ps
    pages = torch.randperm(bs * width // ps)[: bs * width // ps].view(bs, -1)
    rtt = (pages[:, :, None] * ps + torch.arange(ps)).flatten(1).int().to(dev)
    kv = torch.randn(bs * width, 1, 576, dtype=torch.bfloat16, device=dev)
    q = torch.randn(bs * n, H, 576, dtype=torch.bfloat16, device=dev)
    seq = torch.full((bs,), L, dtype=torch.int32, device=dev)
    qo = (torch.arange(bs + 1, dtype=torch.int32, device=dev) * n)
    tm = None
    if tree:
        W = (n + 31) // 32
        bits = torch.rand(bs, n, n, device=dev) < 0.3
        bits |= torch.eye(n, dtype=torch.bool, device=dev)
        bits = torch.tril(bits)
        w = torch.zeros(bs, n, W * 32, dtype=torch.int64, device=dev)
        w[:, :, :n] = bits.long()
        tm = (w.view(bs, n, W, 32) << torch.arange(32, device=dev)).sum(-1)
        tm = torch.where(tm >= 2**31, tm - 2**32, tm).int()
    return q, kv, rtt, torch.arange(bs, device=dev), seq, qo, tm, n

def run(args, **kw):
    q, kv, rtt, rpi, seq, qo, tm, n = args
    return mla_paged_attention(q, kv, rtt, rpi, seq, qo, tm, n, 0.07, 512, page_size=64, **kw)


def bench(fn, reps=50):
    """Median us of ``reps`` CUDA-graph replays of ``fn`` (after 3 eager warm-up calls)."""
    for _ in range(3): fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); g.replay(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) * 1000)
    ts.sort(); return ts[len(ts) // 2]

def flashmla_call(a, bs):
    """FlashMLA (legacy SM90 dense decode) on the same inputs, page 64."""
    import flash_mla
    q, kv, rtt, rpi, seq, qo, tm, n = a
    bt = (rtt[:, ::64] // 64).int()
    kvc = kv.view(-1, 64, 1, 576)
    q4 = q.view(bs, 1, 128, 576)
    meta, _ = flash_mla.get_mla_metadata()
    meta.tile_scheduler_metadata, meta.num_splits = flash_mla.get_mla_decoding_metadata(
        seq, 128, 1, 128, is_fp8_kvcache=False, topk=None, use_legacy=True)
    return lambda: flash_mla.flash_mla_with_kvcache(q4, kvc, bt, seq, 512, meta, softmax_scale=0.07,
                                                    causal=False, use_legacy=True)

what = sys.argv[1]
if what == "check":
    for (bs, L, n, tree) in [(3, 0, 1, False), (2, 1, 1, False), (4, 63, 1, False), (4, 64, 1, False),
                             (3, 129, 1, False), (2, 1000, 1, False), (2, 8191, 1, False),
                             (2, 300, 7, False), (2, 200, 33, True), (1, 4096, 64, True), (2, 70, 64, True)]:
        a = make(bs, L, n=n, tree=tree)
        for splits in (1, 3):
            ref = run(a, num_splits=splits, sm90=False).float()
            for ss in (False, True):
                for c in ((3,) if not ss else (3, 103)):
                    m._SEESAW_TMA = int(c < 100)
                    out = torch.full_like(ref, float("nan")).to(torch.bfloat16)
                    o = run(a, num_splits=splits, sm90=True, seesaw=ss, out=out).float()
                    torch.cuda.synchronize()
                    err = (o - ref).abs().max().item()
                    print(f"bs{bs} L{L} n{n} tree{int(tree)} splits{splits} seesaw{int(ss)} ch{c}: "
                          f"max|d|={err:.2e} finite={bool(torch.isfinite(o).all())}", flush=True)
elif what == "time":
    bs, L = 128, 8192
    a = make(bs, L)
    fm = flashmla_call(a, bs)
    out = torch.empty(bs, 128, 512, dtype=torch.bfloat16, device=dev)
    res = {}
    for rep in range(3):
        res.setdefault("flashmla", []).append(bench(fm))
        for splits in (1, 2):
            res.setdefault(f"split_s{splits}", []).append(bench(lambda: run(a, num_splits=splits, sm90=True, seesaw=False, out=out, check_bounds=False)))
            for c in (3, 103):
                m._SEESAW_TMA = int(c < 100)
                res.setdefault(f"seesaw_c{c}_s{splits}", []).append(bench(lambda: run(a, num_splits=splits, sm90=True, seesaw=True, out=out, check_bounds=False)))
    for k, v in res.items():
        print(f"{k:20s} " + " ".join(f"{x:8.1f}" for x in v) + f"   vs flashmla {min(v)/min(res['flashmla']):.2f}x", flush=True)
if what == "time2":
    bs, L = 128, 8192
    a = make(bs, L)
    fm = flashmla_call(a, bs)
    out = torch.empty(bs, 128, 512, dtype=torch.bfloat16, device=dev)
    t = make(16, 4096, n=64, tree=True)
    tout = torch.empty(16 * 64, 128, 512, dtype=torch.bfloat16, device=dev)
    for rep in range(3):
        f = bench(fm)
        ss = bench(lambda: run(a, num_splits=1, sm90=True, seesaw=True, out=out, check_bounds=False))
        tv_ss = bench(lambda: run(t, num_splits=1, sm90=True, seesaw=True, out=tout, check_bounds=False))
        tv_sp = bench(lambda: run(t, num_splits=1, sm90=True, seesaw=False, out=tout, check_bounds=False))
        print(f"{sys.argv[2] if len(sys.argv) > 2 else ''} flashmla {f:.1f} seesaw {ss:.1f} ({ss/f:.2f}x) | tree16x4096 seesaw {tv_ss:.1f} split {tv_sp:.1f}", flush=True)
