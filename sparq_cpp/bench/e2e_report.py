"""The end-to-end bench's results: speed-ups against the bound, the fills' agreement, the table and the plot.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from sparq_cpp.bench.e2e_config import AGREE_TOL, BASELINE_MODES, MODES, fmt_depth
from sparq_cpp.lazy import pyplot

# ---- analysis ----------------------------------------------------------------------------

def _primary(results: list) -> dict:
    """(depth, mode) -> the record used for speed-ups: the synthetic fill where measured."""
    out = {}
    for r in results:
        key = (r["depth"], r["mode"])
        if key not in out or r["fill"] == "synthetic":
            out[key] = r
    return out



def faster_baseline(results: list) -> str | None:
    """The f16 dense baseline with the lower median at the deepest depth measured so far."""
    prim = _primary(results)
    keys = [(d, m) for (d, m) in prim if m in BASELINE_MODES]
    if not keys:
        return None
    deepest = max(d for d, _ in keys)
    return min((m for d, m in keys if d == deepest), key=lambda m: prim[(deepest, m)]["median_s"])

def _round_speedups(base: dict, rec: dict) -> list | None:
    """The speed-up within each round (both modes were timed in the same window of that round): how far
    the machine's state moves it between rounds, which pooling the steps hides."""
    rb, rr = base.get("rounds") or [], rec.get("rounds") or []
    if len(rb) < 2 or len(rb) != len(rr):
        return None
    return [b["median_s"] / r["median_s"] for b, r in zip(rb, rr)]


def summarize(results: list, bandwidth_gbs: float) -> list:
    """Per (depth, mode): speed-up over the faster f16 dense baseline, its bandwidth bound, the
    fraction reached, and the latency the bandwidth alone would give (bytes / bandwidth)."""
    prim = _primary(results)
    rows = []
    for depth in sorted({d for d, _ in prim}):
        here = {m: r for (d, m), r in prim.items() if d == depth}
        base_pool = [m for m in here if m in BASELINE_MODES] or [m for m in here if MODES[m].dense]
        base = min(base_pool, key=lambda m: here[m]["median_s"]) if base_pool else None
        for m, r in here.items():
            first = r.get("first_step_s") or []
            rewind = r.get("rewind_step_s") or []
            load = r.get("state_load_s") or []
            row = {"depth": depth, "mode": m, "fill": r["fill"], "median_s": r["median_s"],
                   "first_step_s": float(np.median(first)) if first else None,
                   "rewind_step_s": float(np.median(rewind)) if rewind else None,
                   "rewind_vs_steady": float(np.median(rewind)) / r["median_s"] if rewind else None,
                   "first_step_vs_base": None,
                   "state_load_s": float(np.median(load)) if load else None, "state_bytes": r.get("state_bytes"),
                   "load_and_first_vs_base": None,
                   "bytes_total": r["bytes"]["total"],
                   "bandwidth_time_s": r["bytes"]["total"] / (bandwidth_gbs * 1e9),
                   "bandwidth_fraction": r["bytes"]["total"] / r["median_s"] / (bandwidth_gbs * 1e9),
                   "baseline": base, "speedup": None, "bound": None, "fraction_of_bound": None}
            if base is not None and m != base and not (MODES[m].dense and m in BASELINE_MODES):
                b = here[base]
                row["speedup"] = b["median_s"] / r["median_s"]
                row["bound"] = b["bytes"]["total"] / r["bytes"]["total"]
                row["fraction_of_bound"] = row["speedup"] / row["bound"]
                row["speedup_rounds"] = _round_speedups(b, r)
            base_first = here[base].get("first_step_s") if base is not None else None
            if row["first_step_s"] and base_first:
                row["first_step_vs_base"] = row["first_step_s"] / float(np.median(base_first))
            base_load = here[base].get("state_load_s") if base is not None else None
            if row["first_step_s"] and load and base_first and base_load:
                # what a restore costs before the next token: the load and the first step (SparQ's state is larger)
                row["load_and_first_vs_base"] = ((row["state_load_s"] + row["first_step_s"])
                                                 / (float(np.median(base_load)) + float(np.median(base_first))))
            rows.append(row)
    return rows


def fill_agreement(results: list) -> list:
    by = {}
    for r in results:
        by.setdefault((r["depth"], r["mode"]), {})[r["fill"]] = r
    out = []
    for (depth, mode), f in sorted(by.items()):
        if "synthetic" in f and "prefill" in f:
            s, p = f["synthetic"]["median_s"], f["prefill"]["median_s"]
            rel = (p - s) / s
            out.append({"depth": depth, "mode": mode, "synthetic_median_s": s, "prefill_median_s": p,
                        "rel_diff": rel, "agree": abs(rel) <= AGREE_TOL, "tolerance": AGREE_TOL})
    return out


def format_table(doc: dict) -> str:
    summ = {(r["depth"], r["mode"]): r for r in doc["summary"]}
    m, mach = doc["model"], doc["machine"]
    lines = [f"{Path(m['path']).name}: {m['n_layer']} layers; {mach['cpu_model']}, {mach['threads']} threads, "
             f"read bandwidth {mach['bandwidth']['best_gbs']:.1f} GB/s; one token at depth S, "
             f"{doc['config']['repeats']} timed steps each (+ warm-up)"
             + (f", in each of {doc['config']['rounds']} rounds, pooled" if doc['config'].get('rounds', 1) > 1 else ""),
             f"speed-up: over the faster of {', '.join(BASELINE_MODES)} ('base'); bound: bytes(base) / bytes(mode); "
             f"others: CPU share other processes used meanwhile; kept: undisturbed steps used / steps taken "
             f"(! = machine busy throughout, all steps used)"
             + ("; rounds: the smallest and largest speed-up of a single round" if doc['config'].get('rounds', 1) > 1 else ""),
             f"{'S':>5}  {'mode':<11} {'fill':<9} {'median ms':>9} {'IQR ms':>15} {'min-max ms':>15} "
             f"{'MB/token':>9} {'GB/s':>6} {'speed-up':>8} {'bound':>6} {'of bound':>8} {'others':>6} {'kept':>6}"
             + (f" {'rounds':>11}" if doc['config'].get('rounds', 1) > 1 else "")]
    for r in doc["results"]:
        s = summ.get((r["depth"], r["mode"]))
        primary = s is not None and s["fill"] == r["fill"]
        sp = f"{s['speedup']:.2f}x" if primary and s["speedup"] is not None else ("base" if primary and s["baseline"] == r["mode"] else "")
        bd = f"{s['bound']:.2f}x" if primary and s["bound"] is not None else ""
        fr = f"{100 * s['fraction_of_bound']:.0f}%" if primary and s["fraction_of_bound"] is not None else ""
        o = r.get("other_processes_cpu_share")
        oth = "" if o is None else f"{100 * o:.0f}%"
        n_all = len(r["samples_s"])
        kept = f"{r.get('n_used', n_all)}/{n_all}" + ("" if r.get("stats_from", "undisturbed").startswith("undisturbed") else "!")
        lines.append(f"{fmt_depth(r['depth']):>5}  {r['mode']:<11} {r['fill']:<9} {1e3 * r['median_s']:>9.1f} "
                     f"{1e3 * r['q1_s']:>7.1f}-{1e3 * r['q3_s']:<7.1f} {1e3 * r['min_s']:>7.1f}-{1e3 * r['max_s']:<7.1f} "
                     f"{r['bytes']['total'] / 1e6:>9.0f} {r['effective_gbs']:>6.1f} {sp:>8} {bd:>6} {fr:>8} {oth:>6} {kept:>6}"
                     + (f" {min(s['speedup_rounds']):>5.2f}-{max(s['speedup_rounds']):.2f}x"
                        if primary and s.get("speedup_rounds") else ""))
    firsts = [s for s in doc["summary"] if s.get("first_step_s")]
    if firsts:
        lines.append("")
        lines.append("first step after the fill (a state load for 'synthetic': SparQ's cache upkeep runs in it), "
                     "median over rounds; 'x base' against the baseline's first step, 'x steady' against the mode's "
                     "own median step:")
        for s in firsts:
            vb = f"{s['first_step_vs_base']:.2f}x base" if s.get("first_step_vs_base") else "base" if s["baseline"] == s["mode"] else ""
            ld = ""
            if s.get("state_load_s") is not None:
                ld = f"  state load {1e3 * s['state_load_s']:.1f} ms ({s['state_bytes'] / 2**20:.0f} MiB)"
                if s.get("load_and_first_vs_base"):
                    ld += f", load + first step {s['load_and_first_vs_base']:.2f}x base"
            lines.append(f"  S={fmt_depth(s['depth']):>5} {s['mode']:<11} {s['fill']:<9} {1e3 * s['first_step_s']:>8.1f} ms  "
                         f"{vb:>10}  {s['first_step_s'] / s['median_s']:.2f}x steady{ld}")
    rewinds = [s for s in doc["summary"] if s.get("rewind_step_s")]
    if rewinds:
        lines.append("")
        lines.append("a step right after removing the last token (speculative decoding, prompt reuse, regenerate), "
                     "median; 'x steady' against the mode's own median step:")
        for s in rewinds:
            lines.append(f"  S={fmt_depth(s['depth']):>5} {s['mode']:<11} {s['fill']:<9} {1e3 * s['rewind_step_s']:>8.1f} ms  "
                         f"{s['rewind_vs_steady']:.2f}x steady")
    if doc.get("fill_agreement"):
        lines.append("")
        lines.append("fill agreement (decode latency after a real prefill vs after the synthetic state load):")
        for a in doc["fill_agreement"]:
            lines.append(f"  S={fmt_depth(a['depth']):>5} {a['mode']:<11} synthetic {1e3 * a['synthetic_median_s']:.1f} ms, "
                         f"prefill {1e3 * a['prefill_median_s']:.1f} ms: {100 * a['rel_diff']:+.1f}% "
                         f"{'ok' if a['agree'] else 'DISAGREE'} (tolerance {100 * a['tolerance']:.0f}%)")
    return "\n".join(lines)


def plot(doc: dict, out_path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {}
    modes = list(doc["config"]["modes"])
    cmap = plt.get_cmap("tab10")
    for i, m in enumerate(modes):
        colors[m] = cmap(i % 10)
    for m in modes:
        for fill, style in (("synthetic", "-o"), ("prefill", "--x")):
            rs = sorted((r for r in doc["results"] if r["mode"] == m and r["fill"] == fill), key=lambda r: r["depth"])
            if not rs:
                continue
            x = [r["depth"] for r in rs]
            y = np.array([1e3 * r["median_s"] for r in rs])
            lo = y - np.array([1e3 * r["q1_s"] for r in rs])
            hi = np.array([1e3 * r["q3_s"] for r in rs]) - y
            ax1.errorbar(x, y, yerr=[lo, hi], fmt=style, color=colors[m], capsize=3,
                         label=m if fill == "synthetic" else f"{m} (prefill)")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("sequence length S (positions in the cache)")
    ax1.set_ylabel("time per token (ms, median; bars: IQR)")
    ax1.set_title("end-to-end decode latency")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    any_speedup = False
    for m in modes:
        rs = sorted((r for r in doc["summary"] if r["mode"] == m and r["speedup"] is not None), key=lambda r: r["depth"])
        if not rs:
            continue
        any_speedup = True
        x = [r["depth"] for r in rs]
        ax2.plot(x, [r["speedup"] for r in rs], "-o", color=colors[m], label=f"{m} measured")
        ax2.plot(x, [r["bound"] for r in rs], ":", color=colors[m], label=f"{m} bandwidth bound")
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("sequence length S")
    ax2.set_ylabel("speed-up over the faster f16 dense baseline")
    ax2.set_title("speed-up and its bound bytes(dense)/bytes(mode)")
    ax2.grid(True, which="both", alpha=0.3)
    if any_speedup:
        ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        depths = sorted({r["depth"] for r in doc["results"]})
        ax.set_xticks(depths)
        ax.set_xticklabels([fmt_depth(d) for d in depths])
    m = doc["model"]
    fig.suptitle(f"{Path(m['path']).name}: {m['n_layer']} layers, {doc['machine']['threads']} threads, "
                 f"{doc['machine']['cpu_model']}, {doc['machine']['bandwidth']['best_gbs']:.1f} GB/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, format="png", dpi=110)
    plt.close(fig)
