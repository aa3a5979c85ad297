"""Two `sparq-cpp bench` JSON files side by side: does a rerun reproduce the speed-ups?"""
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
    """Per (S, mode) with a speed-up in both runs: both speed-ups and their relative difference."""
    sb = {(r["depth"], r["mode"]): r for r in b["summary"]}
    rows = []
    for ra in a["summary"]:
        rb = sb.get((ra["depth"], ra["mode"]))
        if rb is None or ra.get("speedup") is None or rb.get("speedup") is None:
            continue
        rel = (rb["speedup"] - ra["speedup"]) / ra["speedup"]
        rows.append({"depth": ra["depth"], "mode": ra["mode"], "speedup_a": ra["speedup"],
                     "speedup_b": rb["speedup"], "rel_diff": rel, "agree": abs(rel) <= tol})
    if not rows:
        raise SparqError("the two runs have no (S, mode) with a speed-up in common")
    return rows


def format_comparison(rows: list, tol: float = RERUN_TOL) -> str:
    lines = ["    S  mode        speed-up A  speed-up B    diff",
             *(f"{fmt_depth(r['depth']):>5}  {r['mode']:<10} {r['speedup_a']:>10.2f}x {r['speedup_b']:>10.2f}x "
               f"{100 * r['rel_diff']:>+6.1f}%{'' if r['agree'] else '  !'}" for r in rows)]
    bad = [r for r in rows if not r["agree"]]
    lines.append(f"{len(rows) - len(bad)} of {len(rows)} speed-ups reproduced within {tol:.0%}"
                 + ("; ! marks the others" if bad else ""))
    return "\n".join(lines)
