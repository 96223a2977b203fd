"""Side-by-side table of pytest JUnit XML reports (one column per run):

    python3 bench/scripts/junit_table.py OUT.md LABEL=report.xml [LABEL=report.xml ...]

Rows are test ids (``file::name[params]``) in first-seen order; cells are ``pass``,
``FAIL``, ``ERROR``, ``skip: <reason>`` or ``-`` (not in that run), with the test's seconds.
A header line per run gives its totals.  Standard library only.
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def read(path: str):
    """``{test id: (status, seconds, message)}`` in file order, or raise OSError/ParseError."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        file = cls.replace(".", "/") + ".py" if cls else "?"
        status, msg = "pass", ""
        for tag, label in (("failure", "FAIL"), ("error", "ERROR"), ("skipped", "skip")):
            el = case.find(tag)
            if el is not None:
                status, msg = label, (el.get("message") or "").replace("|", "/").replace("\n", " ")
                break
        out[f"{file}::{name}"] = (status, float(case.get("time", 0.0)), msg)
    return out


def main(argv) -> int:
    if len(argv) < 2 or any("=" not in a for a in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    runs, rows = [], []
    for arg in argv[1:]:
        label, path = arg.split("=", 1)
        try:
            res = read(path)
        except (OSError, ET.ParseError) as e:
            res, label = {}, f"{label} (no report: {type(e).__name__})"
        runs.append((label, res))
        rows += [k for k in res if k not in rows]
    lines = []
    for label, res in runs:
        n = {s: sum(1 for v in res.values() if v[0] == s) for s in ("pass", "FAIL", "ERROR", "skip")}
        lines.append(f"- **{label}**: {n['pass']} passed, {n['FAIL']} failed, {n['ERROR']} errors, "
                     f"{n['skip']} skipped, {sum(v[1] for v in res.values()):.0f} s")
    lines += ["", "| test | " + " | ".join(l for l, _ in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for k in rows:
        cells = []
        for _, res in runs:
            if k not in res:
                cells.append("-")
                continue
            status, t, msg = res[k]
            cells.append(f"{status} {t:.1f}s" + (f": {msg[:100]}" if msg and status != "pass" else ""))
        lines.append(f"| `{k}` | " + " | ".join(cells) + " |")
    with open(argv[0], "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
