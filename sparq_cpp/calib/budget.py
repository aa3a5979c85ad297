"""Which sparse setting keeps the most attention at a budget, measured on a model's own q and k.

For each target compression ratio (attention data read / dense, docs/spec.md) SparQ and Loki can spend the
budget differently: more query components (r) or principal components (d) for the ranking, or more positions
(k) attended. `candidates` lists, per ratio, SparQ and Loki with the rank at 1/2, 1 and 3/2 of the transfer
formula's split (rank about ratio * D), the largest k that fits at S positions, the l most recent kept
(SparQ k/4; Loki 0 as in its paper, or k/4), and with or without the first position always kept (sink = 1: many
models park attention on it whatever the query; Loki's first components often rank it low). `measure_budget` runs the
model over windows of a text and scores every candidate per full-attention layer by the error of the attention
output it would compute: ||y_sel - y|| / ||y||, y exact attention and y_sel the same restricted (and
renormalised) to the positions the candidate attends to, its l most recent included (no mean value), averaged
over the last query rows of each window and the query heads; the exact top-k's error at the same k is the
floor. It also records the attention mass kept (the exact softmax weight, the mean over the GQA group's heads,
on those positions). The output error is what decides: on Gemma 3 SparQ and Loki keep similar mass in a layer
whose output only one of them gets right (docs/accuracy.md). The result goes into the calibration GGUF (calib.projection), where `--attn auto` reads it
(sparq_cpp.auto).
"""
from __future__ import annotations

import numpy as np

from sparq_cpp import transfer
from sparq_cpp.calib.qkv import QKVCapture, exact_weights, full_attention_layers, loki_weights, sparq_weights
from sparq_cpp.calib.run import text_tokens
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import check_gguf

RATIOS = (1 / 4, 1 / 8, 1 / 16)
RANK_SHARES = (0.5, 1.0, 1.5)
LOCAL_SHARES = {"sparq": (0.25,), "loki": (0.0, 0.25)}  # l / k: SparQ's default; Loki's paper (0) and SparQ's
SINKS = (0, 1)  # the first positions always kept: none (the papers), or the first (BOS, where models put it)


def candidates(ratios, S: int, D: int, loki: bool = True) -> list[dict]:
    """Settings per ratio: {"ratio", "method", "rank", "k", "l", "sink"} (l from LOCAL_SHARES, sink from SINKS),
    k at S."""
    out = []
    for t in ratios:
        for method in ("sparq", "loki") if loki else ("sparq",):
            base = max(1, round(t * D))
            for rank in sorted({min(D, max(1, round(base * f))) for f in RANK_SHARES}):
                got = transfer.rank_split(method, t, S, D, rank)
                if got is None or got[1] >= S:
                    continue  # out of reach, or dense at S
                rank, k = got
                for share in LOCAL_SHARES[method]:
                    for sink in SINKS:
                        if sink <= k - int(k * share):
                            out.append({"ratio": t, "method": method, "rank": rank, "k": k, "l": int(k * share),
                                        "sink": sink})
    return out


def selection(scores: np.ndarray, mask: np.ndarray, k: int, l: int, rows: np.ndarray, sink: int = 0) -> np.ndarray:
    """bool [R, n]: per query row, its l most recent visible positions and the k - l others with the largest
    scores, positions below sink first (as the op selects; ties in any order). Position = index here."""
    R, n = scores.shape
    pos = np.arange(n)[None, :]
    local = mask & (pos > rows[:, None] - l) if l > 0 else np.zeros_like(mask)
    s = np.where(mask & ~local, scores, -np.inf)
    if sink > 0:
        s = np.where(mask & ~local & (pos < sink), np.inf, s)
    rest = k - l
    sel = local.copy()
    if rest > 0:
        idx = np.argpartition(-s, rest - 1, axis=1)[:, :rest]
        top = np.zeros_like(mask)
        np.put_along_axis(top, idx, True, axis=1)
        sel |= top & (s > -np.inf)
    return sel


def _mass(w: np.ndarray, sel: np.ndarray) -> float:
    return float((w * sel).sum(1).mean())


def _error(W: np.ndarray, V: np.ndarray, y: np.ndarray, sel: np.ndarray) -> float:
    """Mean relative error ||y_sel - y|| / ||y|| over rows and heads of attention restricted to `sel` (W [R, g, n]
    exact weights, V [n, D], y = W V)."""
    Ws = np.where(sel[:, None, :], W, 0.0)
    Ws /= Ws.sum(-1, keepdims=True)
    ys = Ws @ V
    return float((np.linalg.norm(ys - y, axis=-1) / np.maximum(np.linalg.norm(y, axis=-1), 1e-30)).mean())


def measure_budget(model_path, text: str, *, basis=None, skip_tokens: int = 0, ratios=RATIOS, S: int = 2048,
                   n_windows: int = 4, n_rows: int = 32, n_threads=None, log=lambda msg: None) -> dict:
    """Attention mass kept by each candidate per full-attention layer (means over KV heads, rows and windows)
    on consecutive windows of `text` (each BOS plus S - 1 tokens where the model adds BOS) after its first
    skip_tokens tokens (those the basis was fitted on: "held_out" is then true), or from its start when the
    text has too few tokens beyond them. `basis`: Loki's P [n_layer, n_head_kv, D, D]
    (LokiPCA.components["post"]); without it only SparQ is scored."""
    s = check_gguf(model_path)
    D, g = s.head_dim, s.n_head // s.n_head_kv
    cands = candidates(ratios, S, D, loki=basis is not None)
    if not cands:
        raise SparqError(f"no sparse setting reads less than dense at S = {S}: use a larger --ctx-size")
    layers = full_attention_layers(model_path)
    mass = np.zeros((len(cands), len(layers)))
    exact = np.zeros((len(cands), len(layers)))
    error = np.zeros((len(cands), len(layers)))
    exact_error = np.zeros((len(cands), len(layers)))
    with QKVCapture(model_path, layers=layers, ctx_size=S, n_threads=n_threads, want=("q", "k", "v")) as cap:
        per = S - (cap.bos is not None)
        tokens = text_tokens(cap.tokenize, text, skip_tokens + n_windows * per)
        held_out = len(tokens) - skip_tokens >= per
        if held_out:
            tokens = tokens[skip_tokens:]
        n_windows = min(n_windows, len(tokens) // per)
        if n_windows < 1:
            raise SparqError(f"the text is {len(tokens)} tokens; measuring fidelity needs one window of {per}")
        kq_scale = cap.kq_scale
        rows = np.arange(S - n_rows, S)
        mask = np.arange(S)[None, :] <= rows[:, None]
        for w in range(n_windows):
            window = ([cap.bos] if cap.bos is not None else []) + tokens[w * per:(w + 1) * per]
            got = cap.run(window)
            for j, il in enumerate(layers):
                q, kk = got[il]["q"].astype(np.float64), got[il]["k"].astype(np.float64)
                vv = got[il]["v"].astype(np.float64)
                for h in range(s.n_head_kv):
                    Q, K, V = q[rows, h * g:(h + 1) * g], kk[:S, h], vv[:S, h]
                    W = exact_weights(Q, K, kq_scale, mask)  # [R, g, n]
                    y = W @ V
                    wts = W.mean(1)  # [R, n]
                    P = None if basis is None else np.asarray(basis[il, h], np.float64)
                    Qp, Kp = (None, None) if P is None else (Q @ P, K @ P)
                    for i, c in enumerate(cands):
                        if c["method"] == "sparq":
                            approx = sparq_weights(Q, K, kq_scale, c["rank"], mask).sum(1)
                        else:
                            approx = loki_weights(Qp, Kp, kq_scale, c["rank"], mask).sum(1)
                        sel = selection(approx, mask, c["k"], c["l"], rows, c["sink"])
                        best = selection(wts, mask, c["k"], 0, rows)
                        mass[i, j] += _mass(wts, sel)
                        exact[i, j] += _mass(wts, best)
                        error[i, j] += _error(W, V, y, sel)
                        exact_error[i, j] += _error(W, V, y, best)
            log(f"fidelity window {w + 1}/{n_windows}")
    n = n_windows * s.n_head_kv
    return {"ctx": S, "windows": n_windows, "held_out": held_out, "rows": n_rows, "layers": layers, "candidates": cands,
            "mass": (mass / n).tolist(), "exact_mass": (exact / n).tolist(),
            "error": (error / n).tolist(), "exact_error": (exact_error / n).tolist()}
