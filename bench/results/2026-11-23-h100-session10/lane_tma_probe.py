"""Probe: can each loader thread gather its own key rows by TMA (page size 1) into a
128-byte-swizzled wgmma tile, and how fast is that next to the ``cp.async`` gather?

Gluon 3.6 cannot express a one-row TMA destination in a swizzled tile (session 9's
``tma_row_probe.py``; a ``[1, 64]`` NVMMA tile is refused: "expected collapsed shapePerCTA to
be at least [8, 64]").  Here every thread issues ``cp.async.bulk.tensor.2d`` itself through
inline PTX, with a ``[1, 64]`` box (128 B, SWIZZLE_128B) written at ``tile + row * 128``:
the TMA unit swizzles by shared-memory address, so rows land where wgmma expects them.  The
tensor map lives in global memory (``cuTensorMapEncodeTiled`` through ctypes); the shared
addresses are ``global_smem`` plus the offsets Triton's allocation pass gives the ring and
its barriers (read by running that pass on the kernel's TTGIR, then compiled in).

Prints: the device, whether a gathered [64, 128] tile matches ``src[perm]`` (with rows of
slot -1 zero-filled), then for each mode the time for every SM to gather ``REPS`` tiles of
64 rows x 256 B (K only) through a ring of 4 / 8 / 12 tiles: 0 = per-thread TMA,
1 = ``cp.async`` (the kernel's loader)."""
import ctypes
import re
import sys

import torch
import triton
from triton._C.libtriton import ir, passes, nvidia
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

SW = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

_TMA_ROW = gl.constexpr("""{
.reg .b32 sb, dst, bar;
mov.b32 sb, global_smem;
add.s32 dst, sb, $1;
add.s32 bar, sb, $2;
mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], 128;
cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [$3, {$4, $5}], [bar];
mov.b32 $0, 0;
}""")


@gluon.jit
def gather_probe(tmap, src, perm, out, n_perm, stride_src,
                 REPS: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr,
                 TILE_OFF: gl.constexpr, BAR_OFF: gl.constexpr):
    tiles = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 64, 128], SW)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=128)
    fence_async_shared()
    gl.thread_barrier()
    RL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    lane = gl.arange(0, 128, layout=RL)
    row = lane // 2
    half = lane % 2
    tm = (gl.full([128], 0, gl.int64, RL) + tmap.to(gl.int64, bitcast=True)) if MODE == 0 else 0
    if MODE == 0:
        gl.inline_asm_elementwise("fence.proxy.tensormap::generic.acquire.gpu [$1], 128; mov.b32 $0, 0;",
                                  "=r,l", [tm], dtype=gl.int32, is_pure=False, pack=1)
    pid = gl.program_id(0)
    for t in range(REPS):
        st = t % STAGES
        base = (pid * REPS + t) * 64
        if MODE == 0:
            slot = gl.load(perm + (base + row) % n_perm)
            gl.inline_asm_elementwise(_TMA_ROW, "=r,r,r,l,r,r",
                                      [TILE_OFF + st * 16384 + half * 8192 + row * 128,
                                       gl.full([128], BAR_OFF, gl.int32, RL) + st * 8, tm,
                                       half * 64, slot], dtype=gl.int32, is_pure=False, pack=1)
        else:
            r = gl.arange(0, 64, layout=gl.SliceLayout(1, LD))
            slot = gl.load(perm + (base + r) % n_perm)
            d = gl.arange(0, 128, layout=gl.SliceLayout(0, LD))
            async_copy.async_copy_global_to_shared(
                tiles.index(st), src + slot.to(gl.int64)[:, None] * stride_src + d[None, :],
                mask=(slot >= 0)[:, None])
            async_copy.mbarrier_arrive(bars.index(st), increment_count=False)
        if t >= STAGES - 1:
            u = t - (STAGES - 1)
            mbarrier.wait(bars.index(u % STAGES), (u // STAGES) & 1)
    for u in range(gl.maximum(REPS - (STAGES - 1), 0), REPS):
        mbarrier.wait(bars.index(u % STAGES), (u // STAGES) & 1)
    if pid == 0:
        L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        x = tiles.index((REPS - 1) % STAGES).load(L)
        rr = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
        cc = gl.arange(0, 128, layout=gl.SliceLayout(0, L))
        gl.store(out + rr[:, None] * 128 + cc[None, :], x)


def smem_offsets(compiled):
    """``allocation.offset`` of each ``ttg.local_alloc`` in program order, from Triton's own
    allocation pass run on the kernel's TTGIR."""
    ctx = ir.context()
    ir.load_dialects(ctx)
    nvidia.load_dialects(ctx)
    import tempfile, os
    with tempfile.NamedTemporaryFile("w", suffix=".ttgir", delete=False) as f:
        f.write(compiled.asm["ttgir"])
    mod = ir.parse_mlir_module(f.name, ctx)
    os.unlink(f.name)
    mod.context = ctx
    pm = ir.pass_manager(ctx)
    passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, 90, 87)
    pm.run(mod, "smem_offsets")
    return [int(m.group(1)) for m in re.finditer(r"ttg\.local_alloc.*?allocation\.offset = (\d+) : i32", str(mod))]


def tensor_map(t: torch.Tensor, box_rows: int, box_cols: int) -> torch.Tensor:
    """A CUtensorMap (128 bytes, on ``t``'s device) over the 2-D bf16 tensor ``t``, box
    ``[box_rows, box_cols]``, SWIZZLE_128B, out-of-bounds rows zero-filled."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int]
    raw = (ctypes.c_uint8 * 256)()
    at = (ctypes.addressof(raw) + 63) & ~63  # CUtensorMap is 64-byte aligned
    u64x2, u32x2 = ctypes.c_uint64 * 2, ctypes.c_uint32 * 2
    dims = u64x2(t.shape[1], t.shape[0])
    strides = (ctypes.c_uint64 * 1)(t.stride(0) * t.element_size())
    box, estr = u32x2(box_cols, box_rows), u32x2(1, 1)
    rc = lib.cuTensorMapEncodeTiled(at, 9, 2, t.data_ptr(), ctypes.addressof(dims),
                                    ctypes.addressof(strides), ctypes.addressof(box),
                                    ctypes.addressof(estr), 0, 3, 2, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {rc}")
    buf = ctypes.string_at(at, 128)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).to(t.device)


def main():
    dev = "cuda"
    N = 1 << 20
    src = torch.randn(N, 128, dtype=torch.bfloat16, device=dev)
    tmap = tensor_map(src, 1, 64)
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), "SMs", nsm, flush=True)
    for mode, stages in ((0, 4), (0, 8), (0, 12), (1, 4), (1, 8), (1, 12)):
        for reps in (1, 64, 512):
            perm = torch.randint(0, N, (nsm * reps * 64,), device=dev, dtype=torch.int32)
            perm[(reps - 1) * 64 + 60:(reps - 1) * 64 + 64] = -1  # last tile of CTA 0: 4 empty rows
            out = torch.full((64, 128), float("nan"), dtype=torch.bfloat16, device=dev)
            kw = dict(REPS=reps, STAGES=stages, MODE=mode, num_warps=4)
            k = gather_probe.warmup(tmap, src, perm, out, perm.numel(), src.stride(0),
                                    TILE_OFF=0, BAR_OFF=0, grid=(nsm,), **kw)
            offs = smem_offsets(k)
            k2 = gather_probe.warmup(tmap, src, perm, out, perm.numel(), src.stride(0),
                                     TILE_OFF=offs[0], BAR_OFF=offs[1], grid=(nsm,), **kw)
            assert smem_offsets(k2) == offs, (smem_offsets(k2), offs)
            args = (tmap, src, perm, out, perm.numel(), src.stride(0))
            f = lambda: gather_probe[(nsm,)](*args, TILE_OFF=offs[0], BAR_OFF=offs[1], **kw)
            f()
            torch.cuda.synchronize()
            idx = perm[(reps - 1) * 64:reps * 64].long()
            ref = torch.where((idx >= 0)[:, None], src[idx.clamp(min=0)], 0)
            ok = torch.equal(out, ref)
            if reps == 1:
                print(f"mode {mode} stages {stages}: smem offsets {offs}; tile gathered correctly: {ok}", flush=True)
                continue
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            ts = []
            for _ in range(20):
                s.record(); f(); e.record(); e.synchronize()
                ts.append(s.elapsed_time(e) * 1e3)
            us = sorted(ts)[len(ts) // 2]
            print(f"mode {mode} stages {stages} reps {reps}: {us:.1f} us, {nsm * reps * 64 * 256 / us / 1e6:.2f} TB/s, "
                  f"{us * 1e-6 * 1.755e9 / reps:.0f} cycles per 16 KB tile; correct {ok}", flush=True)


if __name__ == "__main__":
    main()
