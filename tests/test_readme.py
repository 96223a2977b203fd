"""The README's two set-up commands are exactly what CI runs."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ci_runs_the_readme_commands():
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Set up \(two commands\)\s+```bash\n(.*?)```", readme, re.S).group(1)
    commands = [c for c in block.strip().splitlines() if c.strip()]
    assert len(commands) == 2
    ci = [line.strip() for line in open(os.path.join(ROOT, ".ci", "run"))]
    for c in commands:
        assert c in ci, f"README command {c!r} is not in .ci/run"
