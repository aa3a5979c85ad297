"""The per-domain table of docs/accuracy.md, rendered from `sparq-cpp eval --domain` JSON files:

    python -m tools.domain_table docs/eval-gemma3-domains-1in8.json ...

One row of dense's bits per character per model, then a row per method and ratio: each domain's loss against dense
on the same windows (relative, +- its standard error) and the worst domain."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from sparq_cpp import doctable
from sparq_cpp.errors import SparqError
from sparq_cpp.evaluation import results

NAMES = {"gemma-3-270m-q4_k_m.gguf": "Gemma 3 270M", "SmolLM2-135M-Instruct.Q4_1.gguf": "SmolLM2-135M"}


def _setting(method: str, params: dict) -> str:
    name = {"sparq": "SparQ", "loki": "Loki", "exact-topk": "exact top-k"}.get(method.split("@")[0], method)
    keys = [f"{k} = {params[k]}" for k in ("r", "d", "k", "l", "sink") if k in params]
    return f"{name} ({', '.join(keys)})" if keys else name


def _ratio(t: float) -> str:
    return "1" if t >= 1 else f"1/{round(1 / t)}" if abs(1 / t - round(1 / t)) < 1e-9 else f"{t:g}"


def rows(doc: dict, where: str) -> tuple[str, list[str], list[list[str]]]:
    """(model, domains, table rows) of one eval document."""
    summary = doc.get("summary") or results.summarize(doc["records"])
    by_domain = doc.get("domains") or results.domains(summary)
    if not by_domain:
        raise SparqError(f"{where} has no per-domain results (run sparq-cpp eval with --domain)")
    order = [t.split(":", 1)[1] for t in doc.get("config", {}).get("tasks", []) if t.startswith("bpc:")]
    names = [d for d in order if d in by_domain[0]["domains"]] or list(by_domain[0]["domains"])
    model = NAMES.get(Path(doc["model"]["path"]).name, doc["model"]["name"])
    dense = {r["task"].split(":", 1)[1]: r for r in summary if r["method"].split("@")[0] == "dense"
             and r["task"].startswith("bpc:")}
    out = [[model, "dense (bits per character)", "1"]
           + [f"{dense[d]['score']:.3f}" if d in dense else "" for d in names] + [""]]
    for e in by_domain:
        params = next(r["params"] for r in summary if r["method"] == e["method"] and r["target"] == e["target"]
                      and r["task"] == f"bpc:{names[0]}")
        cells = [f"{e['domains'][d]['rel']:+.1%} ± {e['domains'][d]['rel_stderr'] * 100:.1f}" if d in e["domains"]
                 else "" for d in names]
        n = {v["n"] for v in e["domains"].values()}
        out.append([model, _setting(e["method"], params), _ratio(e["target"])] + cells
                   + [f"{e['worst']} ({e['worst_rel']:+.1%}), n = {'/'.join(map(str, sorted(n)))}"])
    return model, names, out


def markdown(paths) -> str:
    """The table of every file's rows, in the order given (their domains must agree); a row that an earlier file
    gave, figures and all (a setting run again on the same windows by the same build), is not repeated."""
    names, table = None, []
    for path in paths:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        _, got, body = rows(doc, str(path))
        if names is not None and got != names:
            raise SparqError(f"{path} has domains {got}, the files before it {names}")
        names = got
        # a model's dense row once; a row another file gave already (the same setting, the same figures) once
        table += [r for r in body if r not in table and (r[1] != "dense (bits per character)" or r[0] not in
                                                         {t[0] for t in table})]
    return doctable.markdown_table(["model", "setting", "ratio"] + names + ["worst domain"], table)


def main(argv=None) -> int:
    return doctable.main(sys.argv[1:] if argv is None else argv, markdown, "python -m tools.domain_table EVAL.json [...]")


if __name__ == "__main__":
    sys.exit(main())
