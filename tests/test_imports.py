"""Imports, each module on its own, and the one-way layering.

- Every module of the installed package (``specattn`` and its subpackages ``backends``,
  ``ops``, ``triton_kernels``, ``spec_runtime``, ``bench``, walked with pkgutil) imports ALONE
  in a fresh interpreter: no module relies on another having been imported first (a circular
  import that only works in one order fails here).  A module that needs an optional package
  that is not installed (flashinfer, flash_mla) is skipped, saying so.
- Importing a module loads no module of a layer above its own: kernels
  (``specattn.triton_kernels``) < ops (``specattn.ops``) < backends (``specattn.backends``) <
  runtime (``specattn.spec_runtime``) < bench (``specattn.bench``).
- The library's commands (``specattn.cli``, ``specattn.info``, ``specattn.spec_runtime.cli``)
  do not import the bench.

One subprocess per module, run in parallel on a thread pool.
"""
from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys

import pytest

PACKAGES = ("specattn", "specattn.backends", "specattn.ops", "specattn.triton_kernels",
            "specattn.spec_runtime", "specattn.bench")
OPTIONAL = ("flashinfer", "flash_mla")
# lowest first: a module of one layer may import the layers below it, never those above
LAYERS = ("specattn.triton_kernels", "specattn.ops", "specattn.backends", "specattn.spec_runtime",
          "specattn.bench")
TIMEOUT_S = 300
REPORT = ("import json, sys\n"
          "import {name}\n"
          "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'specattn')))")


def package_modules():
    """Every module name of the installed package, sorted."""
    names = set()
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        names.add(pkg)
        names.update(info.name for info in pkgutil.walk_packages(mod.__path__, prefix=pkg + "."))
    return sorted(names)


MODULES = package_modules()


def layer(name: str):
    """Index of ``name``'s layer in :data:`LAYERS` (None: the top-level package's own modules)."""
    for i, pkg in enumerate(LAYERS):
        if name == pkg or name.startswith(pkg + "."):
            return i
    return None


def _import_alone(name: str):
    run = subprocess.run([sys.executable, "-c", REPORT.format(name=name)], capture_output=True,
                         text=True, timeout=TIMEOUT_S, env=dict(os.environ))
    return run.returncode, run.stdout, run.stderr


@pytest.fixture(scope="module")
def imported():
    """``{module: (returncode, stdout, stderr)}`` of ``import module`` in a fresh interpreter
    each, run in parallel."""
    workers = max(2, min(8, 2 * (os.cpu_count() or 1)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(MODULES, pool.map(_import_alone, MODULES)))


def test_the_walk_finds_every_subpackage():
    for pkg in PACKAGES:
        assert pkg in MODULES
    for mod in ("specattn.ops.tree_mask", "specattn.backends.routing",
                "specattn.triton_kernels.attention_common", "specattn.triton_kernels.gluon_common",
                "specattn.spec_runtime.engine", "specattn.bench.cases"):
        assert mod in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_module_imports_alone(imported, name):
    rc, out, err = imported[name]
    if rc != 0:
        missing = re.search(r"No module named '(%s)(\.[\w.]*)?'" % "|".join(OPTIONAL), err)
        if missing:
            pytest.skip(f"{name} needs {missing.group(1)}, not installed here")
        pytest.fail(f"`python -c 'import {name}'` failed:\n{err[-3000:]}")
    loaded = json.loads(out.strip().splitlines()[-1])
    own = layer(name)
    if own is not None:
        above = [m for m in loaded if layer(m) is not None and layer(m) > own]
        assert not above, f"importing {name} imports a higher layer: {above}"


def test_commands_do_not_import_the_bench():
    code = ("import sys\n"
            "import specattn.cli, specattn.info, specattn.spec_runtime.cli\n"
            "bench = sorted(m for m in sys.modules if m == 'specattn.bench' "
            "or m.startswith('specattn.bench.'))\n"
            "assert not bench, bench\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
