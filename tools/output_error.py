"""The error of each full-attention layer's output when attention is restricted to what a ranking selects.

For windows of a text, with a paragraph of random common words placed near the start and repeated at the end
(the `copy` task's layout), the model runs densely through llama.cpp and its q, k and v are captured in every
full-attention layer. For query rows of the repeated paragraph ("copy" rows: the model must find the first copy)
and rows of ordinary text before it ("text" rows), each ranking selects k positions (its l most recent kept) and
the attention output over them is compared with exact attention: ||y_sel - y|| / ||y||, the mean over rows and
query heads. Rankings: the exact top-k, SparQ(r), Loki(d), and Loki(d) with the first position (the attention
sink) always kept. This is one layer at a time on the dense run's inputs; errors do not compound here as they do
in a sparse run.

`python -m tools.output_error --help` runs it and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from sparq_cpp.calib.budget import selection
from sparq_cpp.calib.qkv import QKVCapture, exact_weights, full_attention_layers, loki_weights, sparq_weights
from sparq_cpp.errors import SparqError
from sparq_cpp.outfile import atomic_write, check_writable
from sparq_cpp.projection import read_projection
from sparq_cpp.real_models import MODELS, fetch

COMMON_WORDS = ("the and to of a her I was in it she not that be he had you as his for with but is have my at all so "
                "by which on him they very said would could been there this").split()


def rel_error(W: np.ndarray, V: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """Per row: the mean over query heads of ||y_sel - y|| / ||y|| (W [R, g, n] exact weights, V [n, D])."""
    y = W @ V
    Ws = np.where(sel[:, None, :], W, 0.0)
    Ws /= Ws.sum(-1, keepdims=True)
    return (np.linalg.norm(Ws @ V - y, axis=-1) / np.linalg.norm(y, axis=-1)).mean(1)


def with_sink(scores: np.ndarray) -> np.ndarray:
    """The scores with the first position ranked above every other (finite: selection drops non-finite ones)."""
    out = scores.copy()
    out[:, 0] = scores.max(1) + 1.0
    return out


def measure(model_path, text: str, projection, *, ctx: int = 2048, n_windows: int = 4, copy_words: int = 64,
            r: int = 32, d: int = 32, k_fraction: float = 1 / 16, local: float = 0.25, n_rows: int = 32,
            seed: int = 0, n_threads=None) -> dict:
    P = read_projection(projection, model_path=model_path).P
    layers = full_attention_layers(model_path)
    rng = np.random.default_rng(seed)
    k = max(1, int(ctx * k_fraction))
    l = int(k * local)
    rankings = ("exact", f"sparq:r={r}", f"loki:d={d}", f"loki:d={d}+sink")
    err: dict = {}
    with QKVCapture(model_path, layers=layers, ctx_size=ctx, n_threads=n_threads, want=("q", "k", "v")) as cap:
        chars = len(text) // n_windows
        if chars < 4 * ctx:
            raise SparqError(f"the text is too short for {n_windows} windows of {ctx} tokens")
        for w in range(n_windows):
            para = " ".join(rng.choice(COMMON_WORDS, copy_words))
            body = text[w * chars:(w + 1) * chars]
            cut = body.find(". ", len(body) // 40) + 2
            p_toks = cap.tokenize(" " + para)
            sep = cap.tokenize("\n\n")
            head = ([cap.bos] if cap.bos is not None else []) + cap.tokenize(body[:cut] + "\n\n" + para + "\n\n" +
                                                                            body[cut:])
            head = head[:ctx - len(p_toks) - len(sep)]
            toks = head + sep + p_toks
            got = cap.run(toks)
            n = len(toks)
            row_sets = {"copy": np.arange(n - n_rows, n), "text": np.arange(len(head) - n_rows, len(head))}
            for il in layers:
                q, kk, vv = (got[il][x].astype(np.float64) for x in ("q", "k", "v"))
                g = q.shape[1] // kk.shape[1]
                for h in range(kk.shape[1]):
                    Pm = P[il, h].astype(np.float64)
                    for kind, rows in row_sets.items():
                        m = rows[-1] + 1
                        mask = np.arange(m)[None, :] <= rows[:, None]
                        Q, K, V = q[rows, h * g:(h + 1) * g], kk[:m, h], vv[:m, h]
                        W = exact_weights(Q, K, 1.0 * cap.kq_scale, mask)
                        loki = loki_weights(Q @ Pm, K @ Pm, cap.kq_scale, d, mask).sum(1)
                        scores = {"exact": W.mean(1), f"sparq:r={r}": sparq_weights(Q, K, cap.kq_scale, r, mask).sum(1),
                                  f"loki:d={d}": loki, f"loki:d={d}+sink": with_sink(loki)}
                        for name in rankings:
                            sel = selection(scores[name], mask, k, 0 if name == "exact" else l, rows)
                            err.setdefault((kind, il, name), []).append(float(rel_error(W, V, sel).mean()))
    return {"model": Path(model_path).name, "ctx": ctx, "windows": n_windows, "copy_words": copy_words, "k": k,
            "l": l, "rows": n_rows, "layers": layers, "rankings": list(rankings),
            "error": [{"rows": kind, "layer": il, "ranking": name, "per_window_head": v, "mean": float(np.mean(v)),
                       "se": float(np.std(v, ddof=1) / np.sqrt(len(v))) if len(v) > 1 else None}
                      for (kind, il, name), v in err.items()]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.output_error", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file or a name from sparq_cpp.real_models")
    ap.add_argument("--text", required=True)
    ap.add_argument("--projection", required=True, help="the model's calibration (Loki's basis)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--r", type=int, default=32)
    ap.add_argument("--d", type=int, default=32)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    check_writable(a.json, "--json")  # now, not after the run
    model = fetch(a.model) if a.model in MODELS else Path(a.model)
    res = measure(model, Path(a.text).read_text(encoding="utf-8"), a.projection, ctx=a.ctx, n_windows=a.windows,
                  r=a.r, d=a.d, n_threads=a.threads)
    res["command"] = "python -m tools.output_error " + " ".join(argv or sys.argv[1:])
    atomic_write(a.json, lambda tmp: tmp.write_text(json.dumps(res, indent=1) + "\n"), "--json")
    print(f"relative error of the attention output, k = {res['k']}, l = {res['l']} (exact top-k: l = 0); mean +- se "
          f"over {res['windows']} windows x KV heads")
    print("rows  layer " + "".join(n.rjust(22) for n in res["rankings"]))
    by = {(e["rows"], e["layer"], e["ranking"]): e for e in res["error"]}
    for kind in ("text", "copy"):
        for il in res["layers"]:
            print(f"{kind:5s} {il:5d} " + "".join(
                f"{by[(kind, il, n)]['mean']:.3f} +- {by[(kind, il, n)]['se'] or 0:.3f}".rjust(22)
                for n in res["rankings"]))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SparqError as e:  # one line, as the sparq-cpp commands print it
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
