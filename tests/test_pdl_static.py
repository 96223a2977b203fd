"""Programmatic dependent launch is only safe when a kernel waits for the previous grid
before it touches memory an earlier kernel wrote.  A static check of the Triton sources
(``triton_kernels/*.py``, parsed, nothing run):

- every launch with ``**pdl_kwargs(...)`` launches a ``@triton.jit`` kernel that has a
  ``PDL`` parameter;
- in every kernel with a ``PDL`` parameter, no load, store or atomic runs before its first
  ``gdc_enter`` / ``_pdl_enter`` call (which waits for the previous grid);
- the kernels of a step (fused GEMM and QKV, attention, merge, spec ops) are among them."""
import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "triton_kernels"
ENTER = {"gdc_enter", "_pdl_enter"}
MEMORY = {"load", "store", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min",
          "atomic_and", "atomic_or", "atomic_xor", "async_copy_global_to_shared"}


def _call_name(node) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _calls(node):
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


@functools.lru_cache(maxsize=None)
def _kernels():
    """``{name: (path, FunctionDef)}`` of every kernel with a ``PDL`` parameter (the
    ``gdc_enter`` helper aside), and ``[(path, kernel name, line)]`` of every kernel launched
    (``kernel[grid](...)`` or ``launch_fitting(kernel, ...)``) by a function that passes
    ``**pdl_kwargs(...)``."""
    pdl, launches = {}, []
    for path in sorted(SRC.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            if any(a.arg == "PDL" for a in node.args.args) and node.name != "gdc_enter":
                pdl[node.name] = (path.name, node)
            if not any(k.arg is None and isinstance(k.value, ast.Call)
                       and _call_name(k.value) in ("pdl_kwargs", "_pdl_kwargs")
                       for c in _calls(node) for k in c.keywords):
                continue
            for c in _calls(node):
                target = c.func.value if isinstance(c.func, ast.Subscript) else \
                    c.args[0] if _call_name(c) == "launch_fitting" and c.args else None
                if isinstance(target, ast.Name):
                    launches.append((path.name, target.id, c.lineno))
    return pdl, launches


def test_every_pdl_launch_targets_a_kernel_that_waits():
    pdl, launches = _kernels()
    assert launches, "no launch passes pdl_kwargs"
    for path, name, line in launches:
        assert name in pdl, f"{path}:{line}: {name} is launched with pdl_kwargs but has no PDL parameter"
    launched = {name for _, name, _ in launches}
    for name in ("_gemm_kernel", "_qkv_rope_kernel", "_attn_fwd_kernel", "merge_kernel", "_build_tree_kernel",
                 "_verify_greedy_kernel", "_compact_kernel", "_move_rows_kernel", "_commit_kernel", "_merge_kernel"):
        assert name in launched, f"{name} is not launched with pdl_kwargs"


@pytest.mark.parametrize("name", sorted(_kernels()[0]))
def test_no_memory_access_before_the_wait(name):
    path, fn = _kernels()[0][name]
    body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(
        getattr(fn.body[0], "value", None), ast.Constant) else fn.body
    for stmt in body:
        names = [_call_name(c) for c in _calls(stmt)]
        if ENTER & set(names):
            # inside the statement that enters, nothing touches memory before the enter call
            first = min(i for i, n in enumerate(names) if n in ENTER)
            assert not MEMORY & set(names[:first]), f"{path}: {name}: memory access before the wait"
            return
        touched = MEMORY & set(names)
        assert not touched, f"{path}: {name} line {stmt.lineno}: {sorted(touched)} before gdc_enter / _pdl_enter"
    pytest.fail(f"{path}: {name} has a PDL parameter but never calls gdc_enter / _pdl_enter")
