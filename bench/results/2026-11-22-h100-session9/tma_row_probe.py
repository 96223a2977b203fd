"""Probe: can TMA write one-row [1, 64] boxes into arbitrary rows of a 128-byte-swizzled
[64, 64] bf16 shared tile (a gathered K tile for wgmma, page size 1)?  Loads rows perm[i]
of a [N, 64] tensor into tile row i, reads the tile back, compares; then times a gather
loop.  Not run on a GPU: with Triton 3.6 (the device's) the kernel does not compile for
sm_90 -- ``smem.slice(i, 1, dim=0)`` fails with "We don't support splitting along the
swizzling pattern" (README, "Conclusion")."""
import sys
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

SW = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


@gluon.jit
def probe(desc, perm, out, REPS: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], SW)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    phase = 0
    for rep in range(REPS):
        mbarrier.expect(bar.index(0), 64 * 128)
        for i in gl.static_range(64):
            row = gl.load(perm + i)
            tma.async_copy_global_to_shared(desc, [row, 0], bar.index(0), smem.slice(i, 1, dim=0))
        mbarrier.wait(bar.index(0), phase)
        phase ^= 1
    x = smem.load(L)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    gl.store(out + r[:, None] * 64 + c[None, :], x)


if __name__ == "__main__":
    N = 4096
    src = torch.randn(N, 64, dtype=torch.bfloat16, device="cuda")
    perm = torch.randperm(N, device="cuda")[:64].int()
    out = torch.zeros(64, 64, dtype=torch.bfloat16, device="cuda")
    desc = TensorDescriptor.from_tensor(src, [1, 64], SW)
    probe[(1,)](desc, perm, out, REPS=1, num_warps=4)
    torch.cuda.synchronize()
    ok = torch.equal(out, src[perm.long()])
    print(torch.cuda.get_device_name(), "rows gathered correctly:", ok,
          "max|d|", (out.float() - src[perm.long()].float()).abs().max().item(), flush=True)
    # one CTA per SM, each gathering REPS tiles of 64 rows x 128 B (8 KB)
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    outs = torch.zeros(nsm, 64, 64, dtype=torch.bfloat16, device="cuda")
    for reps in (64, 256):
        f = lambda: probe[(nsm,)](desc, perm, outs, REPS=reps, num_warps=4)
        f(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(10):
            f()
        e.record(); e.synchronize()
        us = s.elapsed_time(e) * 100
        print(f"{nsm} CTAs x {reps} tiles of 64 single-row TMA boxes: {us:.1f} us, "
              f"{nsm * reps * 64 * 128 / us / 1e6:.2f} TB/s, "
              f"{us * 1e-6 * 1.755e9 / reps:.0f} cycles per 8 KB tile (at 1.755 GHz)", flush=True)
