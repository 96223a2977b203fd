"""The examples run as written on a CPU, and the README shows them verbatim."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "backend_quickstart.py"


def _run(*args, env=None):
    res = subprocess.run([sys.executable, str(QUICKSTART), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, **(env or {})})
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_backend_quickstart_runs_on_cpu():
    assert "torch_reference on cpu: TARGET_VERIFY output (8, 8, 64) matches" in _run()


def test_backend_quickstart_on_the_triton_backend_interpreted():
    """The same script on the `triton` backend, under Triton's CPU interpreter."""
    pytest.importorskip("triton")
    assert "triton on cpu:" in _run("triton", "cpu", env={"TRITON_INTERPRET": "1"})


def test_readme_shows_the_quickstart_verbatim():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert QUICKSTART.read_text() in blocks
