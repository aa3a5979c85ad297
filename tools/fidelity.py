"""Ranking fidelity of sparse attention, measured on a model's own queries and keys.

SparQ and Loki attend to the k positions that an approximate score ranks highest. How well that ranking
finds the positions exact attention weights most is a property of the model's q and k, and can be
measured without generating anything:

- `QKVCapture` (sparq_cpp/calib/qkv.py) runs a GGUF model through llama.cpp and copies out, per layer, the
  RoPE'd q (times the q scale the graph applies after RoPE) and k.
- `row_fidelity` takes query rows and the keys they see and, for each ranking, reports the recall of
  the exact top-k (the share of the k positions with the largest exact attention, summed over the GQA
  group, that the ranking also puts in its top k) and the attention mass its top k holds (the exact
  softmax weight, averaged over the group's heads, on the positions it picks; the exact top-k's own
  mass is the ceiling).
- Rankings: `sparq` (r query components with the largest |q| summed over the group, SparQ's
  temperature; docs/spec.md), `loki` (the first d components in the calibrated PCA basis of the keys)
  and `pca-sparq` (SparQ's choice of the r largest |q'| components, in the same PCA basis: q' = q P,
  k' = k P). No local window: this measures the ranking alone.
- `op_check` checks that llama.cpp's SparQ op, inside the model's graph, selects what the reference
  (sparq_cpp.reference) selects on the same q, K and V, layer by layer.

`python -m tools.fidelity --help` (from a checkout) runs the measurement on a model and a text and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from sparq_cpp import lazy
from sparq_cpp.attention import SparQ
from sparq_cpp.calib.qkv import (QKVCapture, exact_weights, full_attention_layers, loki_weights, score_scales,
                                 sparq_weights)
from sparq_cpp.calib.run import calibrate
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import check_gguf
from sparq_cpp.outfile import atomic_write, check_writable
from sparq_cpp.real_models import MODELS, fetch

METHODS = ("sparq", "loki", "pca-sparq")


# ---- rankings ----------------------------------------------------------------------------------------

def top_k(scores: np.ndarray, k: int, mask: np.ndarray) -> np.ndarray:
    """bool [R, n]: each row's k largest visible scores (ties in any order)."""
    s = np.where(mask, scores, -np.inf)
    idx = np.argpartition(-s, k - 1, axis=1)[:, :k]
    sel = np.zeros(s.shape, bool)
    np.put_along_axis(sel, idx, True, axis=1)
    return sel & mask


def row_fidelity(Q, K, kq_scale, mask, k, rankings: dict, P=None) -> dict:
    """For query rows Q [R, g, D] of one KV head over keys K [n, D] (visible where mask [R, n]): per
    ranking name -> (recall [R], mass [R]), plus "exact" -> (1, the exact top-k's mass). `rankings` maps a
    name to a function (Q, K, Qp, Kp, mask) -> approximate weights [R, g, n], where Qp = Q P and Kp = K P
    (None without the basis P)."""
    w = exact_weights(Q, K, kq_scale, mask).mean(1)  # [R, n], the group's mean weight
    best = top_k(w, k, mask)
    Qp, Kp = (None, None) if P is None else (Q @ P, K @ P)
    out = {"exact": (np.ones(len(Q)), (w * best).sum(1))}
    for name, f in rankings.items():
        sel = top_k(f(Q, K, Qp, Kp, mask).sum(1), k, mask)
        out[name] = ((sel & best).sum(1) / k, (w * sel).sum(1))
    return out


def rankings_for(methods, params, kq_scale=1.0) -> dict:
    """Ranking functions for row_fidelity by name ("sparq:r=16", "loki:d=32", "pca-sparq:r=16"); loki and
    pca-sparq need the KV head's basis (columns by decreasing variance) there."""
    out = {}
    for m in methods:
        for p in params:
            if m == "sparq":
                out[f"sparq:r={p}"] = lambda Q, K, Qp, Kp, mask, p=p: sparq_weights(Q, K, kq_scale, p, mask)
            elif m == "loki":
                out[f"loki:d={p}"] = lambda Q, K, Qp, Kp, mask, p=p: loki_weights(Qp, Kp, kq_scale, p, mask)
            elif m == "pca-sparq":
                out[f"pca-sparq:r={p}"] = lambda Q, K, Qp, Kp, mask, p=p: sparq_weights(Qp, Kp, kq_scale, p, mask)
            else:
                raise SparqError(f"unknown ranking {m!r} (known: {', '.join(METHODS)})")
    return out


def concentration(Q, r) -> float:
    """Mean share of ||q||_1 held by the r largest |q| components (per query head): SparQ's premise."""
    a = np.sort(np.abs(Q), axis=-1)[..., ::-1]
    return float((a[..., :r].sum(-1) / a.sum(-1)).mean())


# ---- the measurement ---------------------------------------------------------------------------------

def measure(model_path, text: str, *, lengths=(512, 2048, 4096), n_windows: int = 8, n_rows: int = 32,
            k_fraction: float = 1 / 8, params=None, basis=None, methods=METHODS, n_threads=None,
            log=print) -> dict:
    """Ranking fidelity per full-attention layer and KV head on windows of `text`: each window is BOS plus
    max(lengths) - 1 tokens (consecutive, not overlapping); for each S in lengths the last n_rows query
    rows before position S (they see S - n_rows + 1 .. S positions) rank with k = S * k_fraction.
    `basis`: P [n_layer, n_head_kv, D, D] (sparq_cpp.calib.LokiPCA.components["post"]); without it only
    SparQ runs. Returns a dict for JSON: the settings and, per (layer, head, S, ranking), each window's
    mean recall and mass."""
    s = check_gguf(model_path)
    D, g = s.head_dim, s.n_head // s.n_head_kv
    params = list(params or [D // 32, D // 16, D // 8, D // 4, D // 2])
    S_max = max(lengths)
    if basis is None:
        methods = [m for m in methods if m == "sparq"]
    layers = full_attention_layers(model_path)
    cells: dict = {}
    conc: dict = {}
    t0 = time.time()
    with QKVCapture(model_path, layers=layers, ctx_size=S_max, n_threads=n_threads) as cap:
        toks = cap.tokenize(text)
        per = S_max - (cap.bos is not None)
        if len(toks) < per * n_windows:
            raise SparqError(f"the text is {len(toks)} tokens: {n_windows} windows of {S_max} need {per * n_windows}")
        kq_scale = cap.kq_scale
        for w in range(n_windows):
            window = ([cap.bos] if cap.bos is not None else []) + toks[w * per:(w + 1) * per]
            got = cap.run(window)
            for il in layers:
                q, kk = got[il]["q"].astype(np.float64), got[il]["k"].astype(np.float64)
                for h in range(s.n_head_kv):
                    P = None if basis is None else np.asarray(basis[il, h], np.float64)
                    fns = rankings_for(methods, params, kq_scale)
                    for S in lengths:
                        k = max(1, int(S * k_fraction))
                        rows = np.arange(S - n_rows, S)
                        Q = q[rows, h * g:(h + 1) * g]
                        K = kk[:S, h]
                        mask = np.arange(S)[None, :] <= rows[:, None]
                        for name, (rec, mass) in row_fidelity(Q, K, kq_scale, mask, k, fns, P).items():
                            c = cells.setdefault((il, h, S, name), {"recall": [], "mass": []})
                            c["recall"].append(float(rec.mean()))
                            c["mass"].append(float(mass.mean()))
                    Qall = q[:, h * g:(h + 1) * g]
                    cc = conc.setdefault((il, h), {"raw": [], "pca": []})
                    cc["raw"].append(concentration(Qall, D // 8))
                    if P is not None:
                        cc["pca"].append(concentration(Qall @ P, D // 8))
            log(f"window {w + 1}/{n_windows}: {time.time() - t0:.0f} s")
    return {
        "model": s.name, "model_file": Path(model_path).name, "arch": s.arch, "n_layer": s.n_layer,
        "full_attention_layers": layers, "n_head": s.n_head, "n_head_kv": s.n_head_kv, "head_dim": D,
        "q_scale": score_scales(model_path)[0], "kq_scale": score_scales(model_path)[1],
        "lengths": list(lengths), "n_windows": n_windows, "n_rows": n_rows, "k_fraction": k_fraction,
        "params": params, "methods": list(methods),
        "cells": [{"layer": il, "head": h, "S": S, "ranking": name, **v} for (il, h, S, name), v in cells.items()],
        "q_concentration": [{"layer": il, "head": h, "r": D // 8, "raw": float(np.mean(v["raw"])),
                             "pca": float(np.mean(v["pca"])) if v["pca"] else None} for (il, h), v in conc.items()],
    }


def mean_se(values) -> tuple[float, float]:
    v = np.asarray(values, float)
    return float(v.mean()), (float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else float("nan"))


def summarize(res: dict, metric: str = "mass") -> dict:
    """{(S, ranking): (mean, se)} over layers and heads: each window's mean over the (layer, head) cells,
    then mean and standard error over windows."""
    by: dict = {}
    for c in res["cells"]:
        by.setdefault((c["S"], c["ranking"]), []).append(c[metric])
    return {key: mean_se(np.mean(np.array(v), axis=0)) for key, v in by.items()}


def per_layer_choice(res: dict, metric: str = "mass") -> dict:
    """Per (layer, head) and parameter value, the method with the best `metric` on the even windows
    (pooled over S), scored on the odd windows; against each fixed method on the odd windows.
    Returns {param: {"choice": {(layer, head): method}, S: {"chosen": (mean, se), method: (mean, se)}}}."""
    cells = {(c["layer"], c["head"], c["S"], c["ranking"]): np.asarray(c[metric]) for c in res["cells"]}
    heads = sorted({(c["layer"], c["head"]) for c in res["cells"]})
    out = {}
    for p in res["params"]:
        names = {m: f"{m}:{'d' if m == 'loki' else 'r'}={p}" for m in res["methods"]}
        choice = {}
        for lh in heads:
            score = {m: np.mean([cells[(*lh, S, n)][0::2].mean() for S in res["lengths"]]) for m, n in names.items()}
            choice[lh] = max(score, key=score.get)
        entry = {"choice": choice}
        for S in res["lengths"]:
            odd = lambda n, lh: cells[(*lh, S, n)][1::2]  # noqa: E731
            entry[S] = {"chosen": mean_se(np.mean([odd(names[choice[lh]], lh) for lh in heads], axis=0))}
            for m, n in names.items():
                entry[S][m] = mean_se(np.mean([odd(n, lh) for lh in heads], axis=0))
        out[p] = entry
    return out


def plot(results: list, path, metric: str = "recall") -> None:
    """One panel per result (model) and S: `metric` against r (SparQ, SparQ in the PCA basis) or d (Loki), the
    mean over layers and KV heads with its standard error over windows; the exact top-k's mass as a line."""
    plt = lazy.pyplot()
    lengths = results[0]["lengths"]
    fig, axes = plt.subplots(len(results), len(lengths), figsize=(4 * len(lengths), 3.2 * len(results)),
                             squeeze=False, sharey=True)
    styles = {"sparq": ("SparQ (r)", "C0", "o"), "loki": ("Loki (d)", "C1", "s"),
              "pca-sparq": ("SparQ in the PCA basis (r)", "C2", "^")}
    for row, res in zip(axes, results):
        summ = summarize(res, metric)
        for ax, S in zip(row, lengths):
            for m in res["methods"]:
                key = "d" if m == "loki" else "r"
                xs = [p for p in res["params"] if (S, f"{m}:{key}={p}") in summ]
                ys = np.array([summ[(S, f"{m}:{key}={p}")] for p in xs])
                label, color, marker = styles[m]
                ax.errorbar(xs, ys[:, 0], yerr=ys[:, 1], label=label, color=color, marker=marker, capsize=2)
            if metric == "mass":
                ax.axhline(summ[(S, "exact")][0], color="k", ls="--", lw=0.8, label="exact top-k")
            ax.set_xscale("log", base=2)
            ax.set_xticks(res["params"], [str(p) for p in res["params"]])
            ax.set_title(f"{res['model']}, S = {S}, k = S/{round(1 / res['k_fraction'])}", fontsize=9)
            ax.set_xlabel(f"components r or d (of D = {res['head_dim']})")
            ax.grid(alpha=0.3)
        row[0].set_ylabel({"recall": "recall of the exact top-k", "mass": "exact attention mass kept"}[metric])
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110), "--plot")
    finally:
        plt.close(fig)


# ---- llama.cpp's SparQ against the reference, in the model's graph -----------------------------------

def op_check(model_path, tokens, *, r: int, k: int, l: int, mean_value: bool = False, n_decode: int = 4,
             n_threads=None, rows_from: int | None = None) -> list[dict]:
    """Run `tokens[:-n_decode]` as a prompt whose rows all go through llama.cpp's SparQ op (f32 cache), then
    the last n_decode tokens one decode step each, capturing q, k, v and the op's output in every full-
    attention layer. For the rows from `rows_from` (default k: earlier rows select every position) and
    each KV head: the reference (SparQAttention) on the same q, K, V; the op's distance from it, and the
    distance a one-position change of the reference's selection would make (the boundary's weakest
    selected position swapped for the strongest unselected one). Returns one dict per layer."""
    SparQAttention = lazy.need("sparq_cpp.reference.attention", "the op check (the reference)").SparQAttention
    s = check_gguf(model_path)
    g = s.n_head // s.n_head_kv
    n_prompt = len(tokens) - n_decode
    att = SparQ(r=r, k=k, l=l, mean_value=mean_value, sparse_prompt=True)
    with QKVCapture(model_path, attention=att, ctx_size=len(tokens), n_threads=n_threads,
                    want=("q", "k", "v", "out")) as cap:
        kq_scale = cap.kq_scale
        got = [cap.run(tokens[:n_prompt])] + [cap.run(tokens[i:i + 1], fresh=False) for i in range(n_prompt, len(tokens))]
    report = []
    rows = np.arange(k if rows_from is None else rows_from, len(tokens))
    for il in sorted(got[0]):
        cat = {key: np.concatenate([part[il][key] for part in got]) for key in ("q", "k", "v", "out")}
        q, K, V, out = cat["q"], cat["k"], cat["v"], cat["out"]
        kv_pos = np.arange(len(tokens), dtype=np.int32)
        mask = kv_pos[None, :] <= rows[:, None]
        ref = SparQAttention(r, k, l, mean_value)
        want = ref(q[rows], K, V, mask, kv_pos, kq_scale, il)
        sel = ref.last_selection
        d_op, d_swap = [], []
        for i, t in enumerate(rows):
            n = t + 1
            for h in range(s.n_head_kv):
                hs = slice(h * g, (h + 1) * g)
                y_ref = want[i, hs].astype(np.float64)
                scale = np.abs(y_ref).max()
                d_op.append(float(np.abs(out[t, hs] - y_ref).max() / scale))
                d_swap.append(_swap_distance(q[t, hs], K[:n, h], V[:n, h], sel[i, h], kq_scale, r, k, l, mean_value,
                                             y_ref) / scale if n > k else float("inf"))
        d_op, d_swap = np.array(d_op), np.array(d_swap)
        sparse = np.isfinite(d_swap)
        report.append({
            "layer": il, "rows": int(len(rows)), "decode_rows": n_decode, "kv_heads": s.n_head_kv,
            "max_rel_diff": float(d_op.max()), "median_rel_diff": float(np.median(d_op)),
            "min_swap_rel_diff": float(d_swap[sparse].min()) if sparse.any() else None,
            "median_swap_rel_diff": float(np.median(d_swap[sparse])) if sparse.any() else None,
            "rows_within_1e-4": int((d_op <= 1e-4).sum()),
            "rows_closer_than_a_swap": int((d_op[sparse] < 0.1 * d_swap[sparse]).sum()),
            "sparse_rows": int(sparse.sum()),
        })
    return report


def _swap_distance(Qg, K, V, sel_cells, kq_scale, r, k, l, mean_value, y_ref) -> float:
    """max |y' - y_ref| where y' attends to the reference's selection with its weakest ranked position
    (outside the l most recent) replaced by the strongest unselected one."""
    n = K.shape[0]
    mask = np.ones((1, n), bool)
    s_hat = sparq_weights(Qg[None].astype(np.float64), K.astype(np.float64), kq_scale, r, mask)[0]  # [g, n]
    score = s_hat.sum(0)
    chosen = np.zeros(n, bool)
    chosen[sel_cells[sel_cells >= 0]] = True
    local = np.zeros(n, bool)
    if l:
        local[n - l:] = True
    cand_out = np.where(chosen & ~local, score, np.inf)
    cand_in = np.where(~chosen, score, -np.inf)
    swap = chosen.copy()
    swap[np.argmin(cand_out)] = False
    swap[np.argmax(cand_in)] = True
    ys = []
    for j in range(Qg.shape[0]):
        logits = kq_scale * (K[swap].astype(np.float64) @ Qg[j].astype(np.float64))
        w = np.exp(logits - logits.max())
        w /= w.sum()
        y = w @ V[swap].astype(np.float64)
        if mean_value:
            alpha = s_hat[j, swap].sum()
            y = alpha * y + (1 - alpha) * V.astype(np.float64).mean(0)
        ys.append(y)
    return float(np.abs(np.array(ys) - y_ref).max())


# ---- command line ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file or a name from sparq_cpp.real_models")
    ap.add_argument("--text", required=True, help="text to measure on (held out from --calib-text)")
    ap.add_argument("--calib-text", help="text for Loki's PCA bases (loki and pca-sparq need it)")
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--calib-ctx", type=int, default=2048)
    ap.add_argument("--lengths", default="512,2048,4096")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--params", help="r and d values, comma-separated (default D/32 .. D/2)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--op-check", help="TOKENS,r,k,l: also check llama.cpp's SparQ op against the reference")
    ap.add_argument("--json", required=True)
    ap.add_argument("--plot", help="a PNG of recall against r and d (the mass: PATH with -mass before .png)")
    a = ap.parse_args(argv)
    check_writable(a.json, "--json")  # now, not after the run
    if a.plot:
        check_writable(a.plot, "--plot")
    model = fetch(a.model) if a.model in MODELS else Path(a.model)
    text = Path(a.text).read_text(encoding="utf-8")
    result: dict = {"command": "python -m tools.fidelity " + " ".join(argv or sys.argv[1:])}
    basis = None
    if a.calib_text:
        t0 = time.time()
        pca = calibrate(model, Path(a.calib_text).read_text(encoding="utf-8"), n_tokens=a.calib_tokens,
                        ctx_size=a.calib_ctx, n_threads=a.threads)
        basis = pca.components["post"]
        layers = full_attention_layers(model)
        result["key_rank_90"] = {str(il): pca.rank_at("post")[il].tolist() for il in layers}
        print(f"calibrated on {pca.n_tokens} tokens in {time.time() - t0:.0f} s", file=sys.stderr)
    if a.op_check:
        n_tok, r, k, l = (int(x) for x in a.op_check.split(","))
        with QKVCapture(model, layers=[], ctx_size=8) as cap:
            toks = cap.tokenize(text)
            bos = cap.bos
        toks = ([bos] if bos is not None else []) + toks[-n_tok:]  # the text's end: not in the windows below
        t0 = time.time()
        result["op_check"] = {"tokens": n_tok, "r": r, "k": k, "l": l, "mean_value": False,
                              "layers": op_check(model, toks, r=r, k=k, l=l, n_threads=a.threads)}
        print(f"op check in {time.time() - t0:.0f} s: {json.dumps(result['op_check']['layers'])}", file=sys.stderr)
    params = [int(x) for x in a.params.split(",")] if a.params else None
    res = measure(model, text, lengths=[int(x) for x in a.lengths.split(",")], n_windows=a.windows, n_rows=a.rows,
                  params=params, basis=basis, n_threads=a.threads, log=lambda m: print(m, file=sys.stderr))
    result.update(res)
    result["per_layer_choice"] = {
        str(q): {"choice": {f"{il}/{h}": m for (il, h), m in e["choice"].items()},
                 **{str(S): {m: list(v) for m, v in e[S].items()} for S in res["lengths"]}}
        for q, e in per_layer_choice(res).items()}
    atomic_write(a.json, lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n"), "--json")
    if a.plot:
        plot([result], a.plot, "recall")
        plot([result], str(Path(a.plot).with_suffix("")) + "-mass.png", "mass")
    for metric in ("recall", "mass"):
        print(f"\n{metric} (mean over layers and KV heads; +- standard error over {res['n_windows']} windows)")
        summ = summarize(res, metric)
        names = sorted({n for _, n in summ}, key=lambda n: (n.split(":")[0], int(n.split("=")[-1]) if "=" in n else 0))
        print("ranking".ljust(18) + "".join(f"S={S}".rjust(18) for S in res["lengths"]))
        for n in names:
            print(n.ljust(18) + "".join(f"{summ[(S, n)][0]:.3f} +- {summ[(S, n)][1]:.3f}".rjust(18)
                                          for S in res["lengths"]))
    for line in per_layer_lines(res):
        print(line)
    return 0


def per_layer_lines(res: dict) -> list[str]:
    """Text tables: per layer and KV head, recall and mass at r = d = D/8 for each S (means over windows); then
    the cross-validated per-layer choice of method."""
    D = res["head_dim"]
    p = D // 8 if D // 8 in res["params"] else res["params"][len(res["params"]) // 2]
    cells = {(c["layer"], c["head"], c["S"], c["ranking"]): c for c in res["cells"]}
    lines = [f"\nper layer and KV head, r = d = {p}: recall / mass (means over {res['n_windows']} windows)"]
    names = [f"{m}:{'d' if m == 'loki' else 'r'}={p}" for m in res["methods"]]
    lines.append("layer head S".ljust(18) + "".join(n.rjust(18) for n in names) + "exact mass".rjust(12))
    for il in res["full_attention_layers"]:
        for h in range(res["n_head_kv"]):
            for S in res["lengths"]:
                row = f"{il:5d} {h:4d} {S:6d}".ljust(18)
                for n in names:
                    c = cells[(il, h, S, n)]
                    row += f"{np.mean(c['recall']):.3f} / {np.mean(c['mass']):.3f}".rjust(18)
                row += f"{np.mean(cells[(il, h, S, 'exact')]['mass']):.3f}".rjust(12)
                lines.append(row)
    choice = per_layer_choice(res)
    lines.append("\nper-layer choice of method (chosen on the even windows by mass, scored on the odd ones): mass")
    for q, entry in choice.items():
        picks = {}
        for m in entry["choice"].values():
            picks[m] = picks.get(m, 0) + 1
        for S in res["lengths"]:
            e = entry[S]
            lines.append(f"r = d = {q:3d}, S = {S:5d}: chosen {e['chosen'][0]:.3f} +- {e['chosen'][1]:.3f}; "
                         + ", ".join(f"{m} {e[m][0]:.3f}" for m in res["methods"]) + f"  (picks: {picks})")
    return lines


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SparqError as e:  # one line, as the sparq-cpp commands print it
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
