"""docs/spec.md's transfer model: attention data one decode step reads, per KV head, for each method.

Element counts follow docs/spec.md exactly; `bytes_per_element` turns them into bytes for a cache type.
"""
from __future__ import annotations

import math

# ggml block sizes: q8_0 stores 32 int8 values and one f16 scale (34 bytes per 32 elements).
BYTES_PER_ELEMENT = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def bytes_per_element(cache_type: str) -> float:
    try:
        return BYTES_PER_ELEMENT[cache_type]
    except KeyError:
        raise ValueError(f"unknown cache type {cache_type!r}") from None


def dense_elements(n: int, D: int) -> float:
    return 2 * n * D + 2 * D


def sparq_elements(n: int, D: int, r: int, k: int) -> float:
    k = min(k, n)
    return n * r + 2 * k * D + 4 * D


def loki_elements(n: int, D: int, d: int, k: int) -> float:
    k = min(k, n)
    return n * d + 2 * k * D + 2 * D


def exact_topk_elements(n: int, D: int, k: int) -> float:
    k = min(k, n)
    return n * D + k * D + 2 * D


def h2o_elements(n: int, D: int, k: int) -> float:
    k = min(k, n)
    return 2 * k * D + 2 * D + 2 * n


def lm_infinite_elements(n: int, D: int, k: int) -> float:
    k = min(k, n)
    return 2 * k * D + 2 * D


def alisa_window(n: int, c: float) -> int:
    """ALISA's k at n visible positions for caching ratio c: floor(n*c/2), at least 1."""
    return max(1, int(math.floor(n * c / 2)))


def alisa_elements(n: int, D: int, c: float) -> float:
    """ALISA's Sparse Window Attention (docs/spec.md): the K and V rows of its min(2k, n) positions,
    the new k and v, and the local attention sums: 2*n + 8*k. The ranking reads the n sums; while
    the window still holds prompt rows (dense ones) their part is one row of precomputed suffix
    sums (n); each decode step adds its row (the sums at its 2k positions) and subtracts the row
    leaving the window (its 2k weights, 2k positions and the sums there): 8*k."""
    k = alisa_window(n, c)
    return 2 * min(2 * k, n) * D + 2 * D + 2 * n + 8 * k


def sparq_bytes(n: int, D: int, r: int, k: int, cache_type: str = "f16", kt_type: str = "f16") -> float:
    """SparQ in llama.cpp's real types: the n*r ranking reads come from the transposed K copy."""
    k = min(k, n)
    return n * r * bytes_per_element(kt_type) + (2 * k * D + 2 * D) * bytes_per_element(cache_type) + 2 * D * 4


def loki_bytes(n: int, D: int, d: int, k: int, cache_type: str = "f16") -> float:
    """Loki in llama.cpp's real types: the n*d ranking reads are a prefix of each cached K row, read in
    whole blocks for a quantized cache (d rounded up to 32 for q8_0)."""
    k = min(k, n)
    blk = 32 if cache_type in ("q8_0", "q4_0") else 1
    d_read = min(D, -(-d // blk) * blk)
    return (n * d_read + 2 * k * D + 2 * D) * bytes_per_element(cache_type)


def alisa_bytes(n: int, D: int, c: float, cache_type: str = "f16") -> float:
    """ALISA in llama.cpp's real types: the K and V rows of its positions in the cache type, the window
    sums and their upkeep (alisa_elements' 2*n + 8*k) in f32."""
    k = alisa_window(n, c)
    return (2 * min(2 * k, n) * D + 2 * D) * bytes_per_element(cache_type) + (2 * n + 8 * k) * 4


def dense_bytes(n: int, D: int, cache_type: str = "f16") -> float:
    return dense_elements(n, D) * bytes_per_element(cache_type)


def largest_k(reads, budget) -> int:
    """The largest k whose reads (a method's transfer formula at n, in k: a constant plus a multiple of k while
    k is below n) stay within budget; below 1 when none does."""
    slope = reads(2) - reads(1)
    return int((budget - (reads(1) - slope)) // slope)


def rank_split(method: str, target: float, n: int, D: int, rank: int | None = None) -> tuple[int, int] | None:
    """(rank, k) of SparQ (rank r) or Loki (rank d) reading `target` times dense at n positions: rank about
    target * D (so ranking takes about half of the reads, docs/spec.md) unless given, k the largest that fits;
    None when nothing fits."""
    budget = target * dense_elements(n, D)
    formula = sparq_elements if method == "sparq" else loki_elements
    ranks = [rank] if rank is not None else range(max(1, min(D, round(target * D))), 0, -1)
    for rk in ranks:
        k = largest_k(lambda k: formula(n, D, rk, k), budget)
        if k >= 1:
            return rk, k
    return None


def compression(method_elements: float, n: int, D: int) -> float:
    """A method's reads divided by dense reads (docs/spec.md's compression ratio)."""
    return method_elements / dense_elements(n, D)
