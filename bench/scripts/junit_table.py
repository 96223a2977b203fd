"""Side-by-side table of pytest JUnit XML reports (one column per run):

    python3 bench/scripts/junit_table.py [--by-file] OUT.md LABEL=report.xml [LABEL=report.xml ...]

Rows are test ids (``file::name[params]``) in first-seen order; cells are ``pass``,
``FAIL``, ``ERROR``, ``skip: <reason>`` or ``-`` (not in that run), with the test's seconds.
A header line per run gives its totals.  ``--by-file``: one row per (run, test file) with its
counts instead, then every failure, error and distinct skip reason.  Standard library only.
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


STATUSES = ("pass", "FAIL", "ERROR", "skip")


def by_file(runs) -> list:
    """Markdown lines: per run and test file, the counts of each status and the seconds;
    then the failures / errors (each test) and the skip reasons (each distinct one, counted)."""
    lines = ["| run | test file | passed | failed | errors | skipped | s |", "|---|---|---|---|---|---|---|"]
    for label, res in runs:
        files = {}
        for k, (status, t, _) in res.items():
            f = files.setdefault(k.split("::", 1)[0], dict.fromkeys(STATUSES, 0) | {"t": 0.0})
            f[status] += 1
            f["t"] += t
        for name, f in files.items():
            lines.append(f"| {label} | `{name}` | {f['pass']} | {f['FAIL']} | {f['ERROR']} | {f['skip']} | "
                         f"{f['t']:.0f} |")
    bad = [(label, k, v) for label, res in runs for k, v in res.items() if v[0] in ("FAIL", "ERROR")]
    lines += ["", "Failures and errors:" + (" none." if not bad else "")]
    lines += [f"- {label}: `{k}` {v[0]}: {v[2][:300]}" for label, k, v in bad]
    reasons = {}
    for label, res in runs:
        for k, (status, _, msg) in res.items():
            if status == "skip":
                key = (label, k.split("::", 1)[0], msg[:200])
                reasons[key] = reasons.get(key, 0) + 1
    lines += ["", "Skip reasons:" + (" none." if not reasons else "")]
    lines += [f"- {label}: `{f}` x {n}: {msg}" for (label, f, msg), n in reasons.items()]
    return lines


def main(argv) -> int:
    files_only = bool(argv) and argv[0] == "--by-file"
    if files_only:
        argv = argv[1:]
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
        n = {s: sum(1 for v in res.values() if v[0] == s) for s in STATUSES}
        lines.append(f"- **{label}**: {n['pass']} passed, {n['FAIL']} failed, {n['ERROR']} errors, "
                     f"{n['skip']} skipped, {sum(v[1] for v in res.values()):.0f} s")
    if files_only:
        with open(argv[0], "w") as f:
            f.write("\n".join(lines + [""] + by_file(runs)) + "\n")
        return 0
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
