"""pytest route for the bench cases: ``pytest bench --benchmark-only`` (needs a CUDA GPU).

Provides the measured ceilings, once per pytest run, and adds the GPU to pytest-benchmark's machine
info. Without CUDA the cases are skipped with a reason.
"""
import pytest
import torch

from specattn.bench import harness

NO_CUDA_REASON = "needs a CUDA GPU: bench cases are timed on the device"


@pytest.fixture(scope="package")
def ceilings():
    """:class:`harness.Ceilings` measured once per pytest run (copy bandwidth, bf16 matmul)."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA_REASON)
    return harness.measure_ceilings()


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["torch"] = torch.__version__
    if torch.cuda.is_available():
        from specattn.info import device_info
        machine_info["gpu"] = device_info(torch.cuda.current_device())
