import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/scenarios.py


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed():
    """A fresh seed per test run (printed on failure) so inputs are new each time."""
    s = int.from_bytes(os.urandom(4), "little")
    print(f"seed={s}")
    torch.manual_seed(s)
    return s
