"""Two `sparq-cpp bench` JSON files side by side: does a rerun reproduce the step times and the speed-ups?

Also the check that a schedule does not move a mode's figure: the same modes timed interleaved
(`--interleave`) and each alone (`--no-interleave`) should agree within noise at every depth."""
from __future__ import annotations

import json
from pathlib import Path

from sparq_cpp.bench.e2e import SCHEMA, fmt_depth
from sparq_cpp.errors import SparqError

RERUN_TOL = 0.10


def load(path) -> dict:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise SparqError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SparqError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise SparqError(f"{path}: not a `sparq-cpp bench --json` file (schema {SCHEMA!r})")
    return doc


def compare(a: dict, b: dict, tol: float = RERUN_TOL) -> list:
    """Per (S, mode) in both runs: the two median step times and speed-ups (None where a run has no
    speed-up for it) and their relative differences; `agree` when both are within tol."""
    sb = {(r["depth"], r["mode"]): r for r in b["summary"]}
    rows = []
    for ra in a["summary"]:
        rb = sb.get((ra["depth"], ra["mode"]))
        if rb is None:
            continue
        step_rel = (rb["median_s"] - ra["median_s"]) / ra["median_s"]
        row = {"depth": ra["depth"], "mode": ra["mode"], "median_a": ra["median_s"], "median_b": rb["median_s"],
               "step_rel_diff": step_rel, "speedup_a": ra.get("speedup"), "speedup_b": rb.get("speedup"),
               "rel_diff": None}
        if row["speedup_a"] is not None and row["speedup_b"] is not None:
            row["rel_diff"] = (row["speedup_b"] - row["speedup_a"]) / row["speedup_a"]
        row["agree"] = abs(step_rel) <= tol and (row["rel_diff"] is None or abs(row["rel_diff"]) <= tol)
        rows.append(row)
    if not rows:
        raise SparqError("the two runs have no (S, mode) in common")
    return rows


def format_comparison(rows: list, tol: float = RERUN_TOL) -> str:
    def sp(x):
        return f"{x:>10.2f}x" if x is not None else f"{'-':>11}"
    lines = ["    S  mode        step A ms  step B ms    diff  speed-up A  speed-up B    diff"]
    for r in rows:
        rel = f"{100 * r['rel_diff']:>+6.1f}%" if r["rel_diff"] is not None else f"{'':>7}"
        lines.append(f"{fmt_depth(r['depth']):>5}  {r['mode']:<10} {1e3 * r['median_a']:>9.1f} {1e3 * r['median_b']:>10.1f} "
                     f"{100 * r['step_rel_diff']:>+6.1f}% {sp(r['speedup_a'])} {sp(r['speedup_b'])} {rel}"
                     f"{'' if r['agree'] else '  !'}")
    bad = [r for r in rows if not r["agree"]]
    lines.append(f"{len(rows) - len(bad)} of {len(rows)} (S, mode) reproduced within {tol:.0%}"
                 + ("; ! marks the others" if bad else ""))
    return "\n".join(lines)
