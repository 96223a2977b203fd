"""``launch_fitting``: a config whose pipelining needs more shared memory than the GPU has
(Triton raises ``OutOfResources`` at its first launch, before enqueuing work) is launched
again with fewer stages; the count that fits is remembered (later launches try the asked
count, then that one) and a RuntimeWarning says so once; a config that fits launches once;
one that never fits raises.  A fake kernel stands in for the GPU's limit."""
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")
from triton.runtime.errors import OutOfResources  # noqa: E402

from specattn.triton_kernels import _util  # noqa: E402


class FakeKernel:
    """Fits ``max_stages`` stages; records every launch's stage count."""

    def __init__(self, max_stages):
        self.max_stages, self.launches = max_stages, []

    def __getitem__(self, grid):
        def launch(*args, num_stages, **kwargs):
            self.launches.append(num_stages)
            if num_stages > self.max_stages:
                raise OutOfResources(num_stages * 65536, self.max_stages * 65536, "shared memory")
        return launch


def test_lowers_stages_until_it_fits_and_remembers():
    k = FakeKernel(max_stages=2)
    args, kw = (torch.zeros(3), 7), dict(BLOCK_M=64, num_warps=8)
    with pytest.warns(RuntimeWarning, match="num_stages 4 .* using 2"):
        assert _util.launch_fitting(k, (1,), args, kw, 4) == 2
    assert k.launches == [4, 3, 2]
    assert _util.launch_fitting(k, (1,), args, kw, 4) == 2   # remembered: no search, no warning
    assert k.launches == [4, 3, 2, 4, 2]
    assert _util.launch_fitting(k, (1,), args, dict(kw, BLOCK_M=32), 2) == 2   # fits: one launch
    assert k.launches[-1] == 2 and len(k.launches) == 6
    assert _util.launch_fitting(k, (1,), (torch.zeros(3, dtype=torch.float16), 7), kw, 1) == 1


def test_raises_when_nothing_fits():
    k = FakeKernel(max_stages=0)
    with pytest.raises(OutOfResources):
        _util.launch_fitting(k, (1,), (torch.zeros(1),), dict(BLOCK_N=16), 3)
    assert k.launches == [3, 2, 1]


def test_pdl_kwargs_only_on_a_hopper_device(monkeypatch):
    """Programmatic dependent launch: never on CPU tensors or under the interpreter, nor when
    switched off; on a CUDA device of compute capability >= 9 both the kernel's ``PDL``
    constexpr and Triton's launch attribute."""
    assert _util.pdl_kwargs(torch.zeros(2)) == {}
    monkeypatch.setattr(_util, "PDL", False)
    assert _util.pdl_kwargs(torch.zeros(2)) == {}
    if torch.cuda.is_available():
        assert _util.pdl_kwargs(torch.zeros(2, device="cuda")) == {}
        monkeypatch.setattr(_util, "PDL", True)
        want = torch.cuda.get_device_capability()[0] >= 9 and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        assert _util.pdl_kwargs(torch.zeros(2, device="cuda")) == (
            dict(PDL=True, launch_pdl=True) if want else {})
