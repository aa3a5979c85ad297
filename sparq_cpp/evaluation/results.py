"""Results of an evaluation: a summary per (task, method, target), text tables, the JSON document
(every sample) and the SparQ paper's style of figure (score vs compression, one line per method).
Files are written atomically (a temporary file in the same folder, then renamed)."""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from sparq_cpp.evaluation.tasks import HIGHER_IS_BETTER, SCORE_NAMES, base
from sparq_cpp.lazy import pyplot
from sparq_cpp.outfile import atomic_write


def summarize(records) -> list[dict]:
    groups = defaultdict(list)
    for r in records:
        groups[(r["task"], r["method"], r["target"])].append(r)
    rows = []
    for (task, method, target), rs in groups.items():
        scores = [r["score"] for r in rs]
        n = len(scores)
        mean = sum(scores) / n
        sd = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1)) if n > 1 else 0.0
        ks = sorted({r["params"].get("k") for r in rs if "k" in r["params"]})
        rows.append({"task": task, "method": method, "target": target, "n": n, "score": mean,
                     "stderr": sd / math.sqrt(n) if n > 1 else 0.0,
                     "ratio": sum(r["ratio"] for r in rs) / n,
                     "k": (ks[0] if len(ks) == 1 else f"{ks[0]}-{ks[-1]}") if ks else None,
                     "params": rs[0]["params"], "seconds": sum(r["seconds"] for r in rs)})
    rows.sort(key=lambda x: (x["task"], x["method"] != "dense", x["method"], -x["target"]))
    index = defaultdict(dict)  # (task, method, target) -> {sample: record}
    for r in records:
        index[(r["task"], r["method"], r["target"])][r["sample"]] = r
    _add_paired(rows, records, index)
    _add_backend_agreement(rows, index)
    return rows


def _parting(a: dict, b: dict) -> dict:
    """Where two generations of one sample part: the step and the smaller of the two backends' margins
    there (best logit minus the next best; None for records written before margins were kept)."""
    ta, tb = a["output_tokens"], b["output_tokens"]
    step = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    ma, mb = a.get("output_margins"), b.get("output_margins")
    margin = min(ma[step], mb[step]) if ma and mb and step < len(ma) and step < len(mb) else None
    return {"sample": a["sample"], "step": step, "margin": margin}


def _add_backend_agreement(rows, index) -> None:
    """rows of METHOD@ref run beside METHOD (llama.cpp) get "vs_llama": how far llama.cpp's scores are
    from the reference's on the same samples (the mean score's difference, the largest per-sample
    difference) and, for generations, in how many samples the two produced the same tokens and, for
    the others, where they part and how close the best two logits were there ("parted")."""
    for row in rows:
        method, _, backend = row["method"].partition("@")
        ref = index[(row["task"], row["method"], row["target"])]
        if not ref or next(iter(ref.values())).get("backend") != "ref":
            continue
        # METHOD@ref beside METHOD, or a reference-first METHOD (alisa) beside METHOD@llama
        llama = index.get((row["task"], method if backend == "ref" else f"{method}@llama", row["target"]), {})
        common = [s for s in ref if s in llama]
        if not common:
            continue
        diffs = [llama[s]["score"] - ref[s]["score"] for s in common]
        gen = [s for s in common if "output_tokens" in ref[s] and "output_tokens" in llama[s]]
        row["vs_llama"] = {"n": len(common), "mean_diff": sum(diffs) / len(diffs),
                           "max_abs_diff": max(abs(d) for d in diffs),
                           "same_tokens": sum(llama[s]["output_tokens"] == ref[s]["output_tokens"] for s in gen)
                           if gen else None}
        if gen:
            row["vs_llama"]["parted"] = [_parting(llama[s], ref[s]) for s in gen
                                         if llama[s]["output_tokens"] != ref[s]["output_tokens"]]


def _add_paired(rows, records, index) -> None:
    """rows[i]["vs_dense"]: the method's score minus dense's on the same samples (mean, its standard
    error, and the mean relative to dense's mean over those samples). The samples are shared, so the
    paired difference is far less noisy than the two means' own errors suggest."""
    dense = defaultdict(dict)
    for r in records:
        if r["method"].split("@")[0] == "dense":
            dense[(r["task"], r["backend"])].setdefault(r["sample"], r["score"])
    for row in rows:
        if row["method"].split("@")[0] == "dense":
            continue
        rs = list(index[(row["task"], row["method"], row["target"])].values())
        # dense of the same backend if there is one (llama.cpp's against llama.cpp's), else any dense
        base = dense.get((row["task"], rs[0]["backend"])) or next(
            (d for (t, _), d in dense.items() if t == row["task"]), None)
        pairs = [(r["score"], base[r["sample"]]) for r in rs if base and r["sample"] in base]
        n = len(pairs)
        if n == 0:
            continue
        diffs = [a - b for a, b in pairs]
        mean = sum(diffs) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (n - 1)) if n > 1 else 0.0
        dmean = sum(b for _, b in pairs) / n
        row["vs_dense"] = {"n": n, "diff": mean, "stderr": sd / math.sqrt(n) if n > 1 else 0.0,
                           "rel": mean / dmean if dmean else None, "dense": dmean,
                           "same": sum(a == b for a, b in pairs)}


def domains(rows) -> list[dict]:
    """Bits per character per domain ("bpc:NAME" tasks), per method and target against dense on the same samples:
    [{"method", "target", "domains": {name: {"n", "dense", "score", "diff", "stderr", "rel", "rel_stderr"}},
    "worst": the domain of the largest relative loss, "worst_rel", "worst_rel_stderr"}]."""
    out = {}
    for row in rows:
        if base(row["task"]) != "bpc" or row["task"] == "bpc" or "vs_dense" not in row:
            continue
        v = row["vs_dense"]
        if not v.get("dense"):
            continue
        entry = out.setdefault((row["method"], row["target"]), {"method": row["method"], "target": row["target"],
                                                                 "domains": {}})
        entry["domains"][row["task"].split(":", 1)[1]] = {
            "n": v["n"], "dense": v["dense"], "score": v["dense"] + v["diff"], "diff": v["diff"],
            "stderr": v["stderr"], "rel": v["diff"] / v["dense"], "rel_stderr": v["stderr"] / v["dense"]}
    for entry in out.values():
        worst = max(entry["domains"], key=lambda d: entry["domains"][d]["rel"])
        entry.update(worst=worst, worst_rel=entry["domains"][worst]["rel"],
                     worst_rel_stderr=entry["domains"][worst]["rel_stderr"])
    return sorted(out.values(), key=lambda e: (e["method"], -e["target"]))


def grid(records) -> list[dict]:
    """needle / kv: mean score per (method, target, length, depth), the paper's heatmap cells."""
    groups = defaultdict(list)
    for r in records:
        if "depth" in r.get("meta", {}):
            groups[(r["task"], r["method"], r["target"], r["meta"]["length"], r["meta"]["depth"])].append(r)
    return [{"task": t, "method": m, "target": tg, "length": ln, "depth": dp, "n": len(rs),
             "score": sum(r["score"] for r in rs) / len(rs), "ratio": sum(r["ratio"] for r in rs) / len(rs)}
            for (t, m, tg, ln, dp), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2],
                                                                                   kv[0][3], kv[0][4]))]


def _fmt_target(t: float) -> str:
    return "1" if t >= 1 else f"1/{round(1 / t)}" if abs(1 / t - round(1 / t)) < 1e-9 else f"{t:g}"


def format_table(doc: dict) -> str:
    """One table per task: a row per method, a column per target (score and achieved ratio)."""
    rows = doc.get("summary") or summarize(doc["records"])
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        trs = [r for r in rows if r["task"] == task]
        targets = sorted({r["target"] for r in trs}, reverse=True)
        better = "higher" if HIGHER_IS_BETTER[base(task)] else "lower"
        out.append(f"{task}: {SCORE_NAMES[base(task)]} ({better} is better); cell = mean score (achieved ratio), n samples")
        head = ["method"] + [_fmt_target(t) for t in targets]
        table = [head]
        for method in dict.fromkeys(r["method"] for r in trs):
            cells = [method]
            for t in targets:
                hit = [r for r in trs if r["method"] == method and r["target"] == t]
                cells.append(f"{hit[0]['score']:.4g} ({hit[0]['ratio']:.3f}) n={hit[0]['n']}" if hit else "-")
            table.append(cells)
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        for i, row in enumerate(table):
            out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if i == 0:
                out.append("  ".join("-" * w for w in widths))
        out.append("")
        paired = [r for r in trs if "vs_dense" in r]
        if paired:
            # generation tasks score whole answers, so many samples come out exactly as dense's
            generated = HIGHER_IS_BETTER[base(task)]
            out.append(f"{task} against dense on the same samples: mean difference +- standard error "
                       "(relative to dense)" + (", samples scored the same as dense" if generated else ""))
            for r in paired:
                v = r["vs_dense"]
                rel = f" ({v['rel']:+.1%})" if v["rel"] is not None else ""
                same = f", {v['same']} of {v['n']} the same" if generated else f", n={v['n']}"
                out.append(f"  {r['method']} at {_fmt_target(r['target'])}: {v['diff']:+.4g} +- {v['stderr']:.2g}{rel}{same}")
            out.append("")
    by_domain = doc.get("domains") or domains(rows)
    if by_domain:
        out.append("bits per character by domain against dense on the same samples: relative difference +- "
                   "standard error; worst = the domain that loses most")
        for e in by_domain:
            cells = ", ".join(f"{d} {v['rel']:+.2%} +- {v['rel_stderr']:.2%}" for d, v in e["domains"].items())
            out.append(f"  {e['method']} at {_fmt_target(e['target'])}: {cells}; worst {e['worst']}")
        out.append("")
    agree = [r for r in rows if "vs_llama" in r]
    if agree:
        out.append("llama.cpp against the reference (METHOD against METHOD@ref, same samples and settings): "
                   "difference of the mean score, largest difference of one sample, generations with the same tokens")
        for r in agree:
            v = r["vs_llama"]
            same = f", same tokens in {v['same_tokens']} of {v['n']}" if v["same_tokens"] is not None else ""
            parted = v.get("parted") or []
            if parted:
                where = [f"{p['sample']} at token {p['step']}"
                         + (f", best two logits {p['margin']:.2g} apart" if p["margin"] is not None else "")
                         for p in parted[:4]]
                same += f" (parting: {'; '.join(where)}{'; ...' if len(parted) > 4 else ''})"
            out.append(f"  {r['task']} {r['method'].split('@')[0]} at {_fmt_target(r['target'])}: "
                       f"{v['mean_diff']:+.2g}, max {v['max_abs_diff']:.2g}{same}")
        out.append("")
    for s in doc.get("skipped", []):
        out.append(f"skipped: {s['reason']}")
    return "\n".join(out).rstrip() + "\n"


def write_json(doc: dict, path) -> Path:
    data = json.dumps(doc, indent=1, default=str).encode()
    return atomic_write(path, lambda tmp: tmp.write_bytes(data), "--json")


def plot(doc: dict, path) -> Path:
    """Score vs compression ratio (log2 axis, achieved ratios), a panel per task, a line per method;
    dense is the point at 1 and a dotted line across, as in the SparQ paper's figures."""
    plt = pyplot()
    rows = doc.get("summary") or summarize(doc["records"])
    task_names = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(task_names), figsize=(4.2 * len(task_names), 3.6), squeeze=False)
    for ax, task in zip(axes[0], task_names):
        trs = [r for r in rows if r["task"] == task]
        dense = [r for r in trs if r["method"].startswith("dense")]
        for d in dense:
            ax.axhline(d["score"], color="0.4", ls=":", lw=1)
        for method in dict.fromkeys(r["method"] for r in trs):
            pts = sorted((r["ratio"], r["score"], r["stderr"]) for r in trs if r["method"] == method)
            xs, ys, es = zip(*pts)
            line, = ax.plot(xs, ys, marker="o" if not method.startswith("dense") else "*", ms=5 if
                            not method.startswith("dense") else 10, label=method)
            if any(es):
                ax.fill_between(xs, [y - e for y, e in zip(ys, es)], [y + e for y, e in zip(ys, es)],
                                color=line.get_color(), alpha=0.15, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("compression ratio (attention data read / dense)")
        ax.set_ylabel(SCORE_NAMES[base(task)] + (" ↑" if HIGHER_IS_BETTER[base(task)] else " ↓"))
        ax.set_title(task)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    model = doc.get("model", {}).get("name", "")
    fig.suptitle(f"{model}: score vs compression", fontsize=10)
    fig.tight_layout()

    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110), "--plot")
    finally:
        plt.close(fig)
