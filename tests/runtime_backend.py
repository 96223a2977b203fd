"""The runtime tests' backend choice (``pytest --backend NAME`` or ``$SPECATTN_TEST_BACKEND``,
default ``torch_reference``; the option and the ``backend_name`` fixture live in conftest.py).

Policy:

- every engine in ``tests/test_runtime*.py`` (target and drafter) is built over the chosen
  backend, through :func:`make_engine`; a backend whose ``supports()`` says no to a mode the
  algorithm needs for the model's attention kind makes the test SKIP with the engine's
  message (``UnsupportedError``, e.g. MLA on a backend without MLA kernels); modes it cannot
  capture in a CUDA graph are run eagerly by the engine (``Engine.eager_routed``);
- on a CPU-only machine a non-reference backend runs in Triton's interpreter
  (``TRITON_INTERPRET=1``, set by conftest.py): the tiny random models run, the real
  30-layer model is skipped (:func:`skip_real_model_if_interpreted`: ~2.5 s per forward);
  the lossless checks on the real model with ``--backend triton`` are GPU runs (CUDA graphs
  on, float32, where the Triton kernel takes its IEEE fp32 path);
- on a GPU machine (no interpreter) the tests whose tensors live on the CPU skip with a
  non-reference backend (:func:`skip_cpu_tensors_without_interpreter`): run ``-m gpu`` there.
"""
from __future__ import annotations

import os

import pytest
import torch

from specattn.backends import UnsupportedError
from specattn.spec_runtime.engine import SpecConfig

__all__ = ["interpreted", "skip_real_model_if_interpreted", "skip_if_interpreted",
           "skip_cpu_tensors_without_interpreter", "make_engine", "require_support",
           "check_rows_restored", "uses_graphs", "SHIPPED_SPECS", "SHIPPED_IDS"]


def interpreted(name: str) -> bool:
    """True when backend ``name`` runs its kernels on CPU tensors in Triton's interpreter here."""
    return name != "torch_reference" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def skip_cpu_tensors_without_interpreter(name: str, device) -> None:
    """Skip when a non-reference backend would get CPU tensors without the interpreter (a GPU
    machine: conftest.py sets ``TRITON_INTERPRET=1`` only where there is no GPU)."""
    if (name != "torch_reference" and torch.device(device).type == "cpu"
            and os.environ.get("TRITON_INTERPRET", "0") != "1"):
        pytest.skip(f"--backend {name}: this test's tensors are on the CPU and TRITON_INTERPRET is "
                    f"not set (a GPU machine); run the gpu-marked tests (-m gpu) here")


def skip_if_interpreted(name: str, why: str) -> None:
    """Skip the calling test when ``name`` runs in the CPU interpreter, saying ``why``."""
    if interpreted(name):
        pytest.skip(f"--backend {name} on a CPU-only machine runs in Triton's interpreter: {why}; "
                    f"run it on a GPU")


def skip_real_model_if_interpreted(name: str) -> None:
    """Skip tests on the real model (SmolLM2-135M, 30 layers) under the CPU interpreter."""
    skip_if_interpreted(name, "~2.5 s per forward of the 30-layer real model (tens of minutes "
                              "per test); the tiny random-model tests cover this backend on CPU")


def make_engine(name: str, *args, **kwargs):
    """``Engine(*args, backend=name, **kwargs)``, or skip when the backend does not support a
    mode the engine needs (the engine's ``UnsupportedError`` message is the reason) or cannot
    run on the engine's CPU tensors here (:func:`skip_cpu_tensors_without_interpreter`)."""
    from specattn.spec_runtime.engine import Engine
    try:
        eng = Engine(*args, backend=name, **kwargs)
    except UnsupportedError as e:
        pytest.skip(f"--backend {name}: {e}")
    skip_cpu_tensors_without_interpreter(name, eng.device)
    return eng


def make_backend(name: str, req_to_token_pool, kv_pool, **kwargs):
    """``create_backend(name, ...)``, or skip when the backend cannot run these pools here
    (``UnsupportedError``, e.g. FlashInfer with a float32 pool)."""
    from specattn.backends import create_backend
    try:
        return create_backend(name, req_to_token_pool, kv_pool, **kwargs)
    except UnsupportedError as e:
        pytest.skip(f"--backend {name}: {e}")


def require_support(backend, *modes, graph: bool = False) -> None:
    """Skip unless ``backend.supports(mode, graph=graph, kind=backend.kind)`` for every mode."""
    skip_cpu_tensors_without_interpreter(backend.name, backend.req_to_token_pool.device)
    missing = [m.name for m in modes if not backend.supports(m, graph=graph, kind=backend.kind)]
    if missing:
        pytest.skip(f"--backend {backend.name} does not support {', '.join(missing)} for "
                    f"{backend.kind.name}{' in CUDA graphs' if graph else ''}")


def check_rows_restored(eng) -> None:
    """After ``generate``: every request row still lists the slots reserved for it (position
    ``p`` at offset ``p % page_size`` of its own pages, the dummy row all zeros), and every
    EAGLE scratch row equals its request row again (the beams' columns were undone)."""
    rtt = eng.req_pool.req_to_token.cpu().long()
    B, ps, W = eng.max_batch, eng.page_size, eng.max_context
    pos = torch.arange(W)
    pages = 1 + torch.arange(B)[:, None] * (W // ps) + pos // ps
    assert torch.equal(rtt[:B], pages * ps + pos % ps), "a request row was changed"
    assert not rtt[B].any(), "the dummy row was changed"
    if eng.scratch_rows is not None:
        sr = eng.scratch_rows.cpu()
        for r in range(B + 1):
            assert torch.equal(rtt[sr[r]], rtt[r].expand(sr.shape[1], W)), f"scratch rows of {r} not restored"


def uses_graphs(eng) -> bool:
    """Whether the engine replays any CUDA graph (whole rounds or per-mode forwards)."""
    return bool(eng.round_graphs or eng.runners)


#: the shipped drafters' configurations the lossless tests run (CPU: test_runtime, CUDA graphs: test_runtime_gpu)
SHIPPED_SPECS = [SpecConfig("eagle", topk=1, num_steps=5, num_draft_tokens=6),
                 SpecConfig("eagle", topk=4, num_steps=5, num_draft_tokens=16),
                 SpecConfig("dflash", block_size=16),
                 SpecConfig("dflash", topk=4, num_draft_tokens=16, block_size=16)]
SHIPPED_IDS = ["eagle3-chain", "eagle3-tree", "dflash-chain", "dflash-ddtree"]
