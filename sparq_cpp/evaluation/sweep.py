"""Settings that hit a target compression ratio at sequence length S (docs/spec.md's transfer formulas, read
from sparq_cpp.transfer: k is the largest whose reads fit, the formulas being linear in k).

Per method (D the head size; dense reads 2*S*D + 2*D per KV head and step):
- sparq: r = round(target * D) (unless fixed), so ranking takes about half the budget; k from the
  rest: S*r + 2*k*D + 4*D = target * dense; l = k/4 (unless another share is given). If k < 1, r shrinks.
- loki: the same with d for r and 2*D for 4*D.
- h2o: 2*k*D + 2*D + 2*S = target * dense; l = k/4.
- lm-infinite: 2*k*D + 2*D = target * dense; needs k > 16 (its first 16 positions).
- alisa: caching ratio c with k = floor(n*c/2) (2k positions) chosen so that
  2*(2k)*D + 2*D + 2*S + 8*k = target * dense at S (c = (2k + 1)/S, so floor(S*c/2) is k); k then grows
  with n as ALISA's does.
- exact-topk reads all of K, so it cannot go below 1/2: k = target * S (the share of positions it
  keeps equals the target, as the paper's oracle comparison does) and its real ratio is reported.
- dense: ratio 1 only.
A target no setting reaches gives None (the run is skipped and listed). The ratio achieved over a
sample's actual steps is measured by ``ratio_over_steps`` and is what tables and plots show.
"""
from __future__ import annotations

from fractions import Fraction

from sparq_cpp import transfer
from sparq_cpp.errors import SparqError

METHODS = ("dense", "sparq", "loki", "exact-topk", "h2o", "lm-infinite", "alisa")


def parse_ratios(text: str) -> list[float]:
    """'1,1/2,1/4' -> [1.0, 0.5, 0.25]; each in (0, 1]."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = float(Fraction(part))
        except (ValueError, ZeroDivisionError):
            raise SparqError(f"compression ratio {part!r} is not a number or fraction like 1/8") from None
        if not 0 < value <= 1:
            raise SparqError(f"compression ratio {part} is outside (0, 1]")
        out.append(value)
    if not out:
        raise SparqError("no compression ratios given")
    return sorted(set(out), reverse=True)


def _split_rank(target, S, D, method, fixed):
    """(rank, k) for a ranking method: its reads at rank and k within target * dense."""
    if fixed is not None and not 1 <= fixed <= D:  # 0 would otherwise read as "not fixed"
        raise SparqError(f"a fixed r or d must be in 1..{D} (the head size), got {fixed}")
    return transfer.rank_split(method, target, S, D, fixed)


def settings(method: str, target: float, S: int, D: int, *, r: int | None = None, d: int | None = None,
             local: float = 0.25, sink: int = 0, loki_local: float = 0.0) -> dict | None:
    """Parameters of `method` for `target` at S visible positions, or None if out of reach. `local`: SparQ's
    l as a share of k (docs/spec.md's default 1/4); `loki_local`: Loki's (0 by default); `sink`: SparQ's and Loki's
    first positions kept (within k, so the reads are the same)."""
    if method not in METHODS:
        raise SparqError(f"unknown method {method!r} (known: {', '.join(METHODS)})")
    if method == "dense":
        return {} if target >= 1 else None
    if target >= 1:
        return None  # ratio 1 is dense itself
    budget = target * transfer.dense_elements(S, D)
    if method in ("sparq", "loki"):
        got = _split_rank(target, S, D, method, r if method == "sparq" else d)
        if got is None:
            return None
        rank, k = got
        out = {"r" if method == "sparq" else "d": rank, "k": k,
               "l": int(k * (local if method == "sparq" else loki_local))}
        if sink:
            out["sink"] = min(sink, k - out["l"])
        return out
    if method == "h2o":
        k = transfer.largest_k(lambda k: transfer.h2o_elements(S, D, k), budget)
        return {"k": k, "l": k // 4} if k >= 1 else None
    if method == "lm-infinite":
        k = transfer.largest_k(lambda k: transfer.lm_infinite_elements(S, D, k), budget)
        return {"k": k} if k > 16 else None
    if method == "exact-topk":
        k = int(target * S)
        return {"k": k} if k >= 1 else None
    if method == "alisa":
        # c = (2k + 1)/S, so that ALISA's window at S, floor(S*c/2), is k
        k = transfer.largest_k(lambda k: transfer.alisa_elements(S, D, (2 * k + 1) / S), budget)
        return {"c": (2 * k + 1) / S, "k": k} if k >= 1 else None
    raise AssertionError(method)


def elements(method: str, p: dict, n: int, D: int) -> float:
    if method == "dense":
        return transfer.dense_elements(n, D)
    if method == "sparq":
        return transfer.sparq_elements(n, D, p["r"], p["k"])
    if method == "loki":
        return transfer.loki_elements(n, D, p["d"], p["k"])
    if method == "exact-topk":
        return transfer.exact_topk_elements(n, D, p["k"])
    if method == "h2o":
        return transfer.h2o_elements(n, D, p["k"])
    if method == "lm-infinite":
        return transfer.lm_infinite_elements(n, D, p["k"])
    if method == "alisa":
        return transfer.alisa_elements(n, D, p["c"])
    raise SparqError(f"unknown method {method!r}")


def ratio_over_steps(method: str, p: dict, ns, D: int) -> float:
    """Reads of all the method's steps (at visible positions ns) over dense reads of the same steps."""
    ns = list(ns)
    return sum(elements(method, p, n, D) for n in ns) / sum(transfer.dense_elements(n, D) for n in ns)
