"""The Triton launchers run with their tensors' CUDA device current (``_util.on_tensor_device``)."""
import os

import torch

if not torch.cuda.is_available():  # before triton / specattn are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from specattn.triton_kernels._util import on_tensor_device  # noqa: E402


def test_guard_is_transparent_on_cpu():
    seen = []

    @on_tensor_device
    def f(x, y=1):
        seen.append((x, y))
        return "ok"

    t = torch.zeros(2)
    assert f(t, y=3) == "ok" and seen[-1][1] == 3
    assert f([t, t]) == "ok" and f(None) == "ok" and f("s") == "ok"
    assert f.__name__ == "f"  # functools.wraps keeps the public name and docstring


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_guard_switches_device():
    @on_tensor_device
    def current(x):
        return torch.cuda.current_device()

    torch.cuda.set_device(0)
    assert current(torch.zeros(1, device="cuda:1")) == 1
    assert current([torch.zeros(1, device="cuda:1")]) == 1
    assert torch.cuda.current_device() == 0
