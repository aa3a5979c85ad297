"""Bytes one decode step (batch 1) reads: the weights it touches plus the KV cache reads of docs/spec.md.

Weights: every matrix and norm of every layer, the output norm and head, and one row of the token
embedding (a tied head, with no output.weight, reads the whole embedding), at their stored size
(q8_0: 34 bytes per 32 values). KV, per layer and KV head, from docs/spec.md's element counts in the
cache's real types (sparq_cpp.transfer): dense `(2n*D + 2*D)` elements of the cache type; SparQ
`n*r` from the transposed K copy (f16, f32 for an f32 cache) + `(2k*D + 2*D)` of the cache type +
`2*D` f32 (the V sum read and written); Loki `n*d + 2k*D + 2*D` of the cache type. n is the
number of visible positions: the S cached ones plus the new token, n = S + 1.
Activations, logits and the KQ mask are left out (under 1% at 7B shapes).
"""
from __future__ import annotations

from sparq_cpp import transfer
from sparq_cpp.errors import SparqError
from sparq_cpp.memory import ModelShape


def kv_bytes_per_head(kind: str, n: int, D: int, cache_type: str, *, r: int = 16, k: int = 128,
                      d: int = 32) -> float:
    """Attention data one decode step reads for one layer and KV head (docs/spec.md), in bytes."""
    if kind == "dense":
        return transfer.dense_bytes(n, D, cache_type)
    if kind == "sparq":
        kt_type = "f32" if cache_type == "f32" else "f16"
        return transfer.sparq_bytes(n, D, r, k, cache_type, kt_type)
    if kind == "loki":
        # + the layer's basis for this head (f32 D x D), read to rotate q and the new k
        return transfer.loki_bytes(n, D, d, k, cache_type) + D * D * 4
    raise SparqError(f"no transfer model for attention kind {kind!r}")


def token_bytes(shape: ModelShape, kind: str, depth: int, cache_type: str, **params) -> dict:
    """{'weights', 'kv', 'total'} bytes one token reads at depth S (n = S + 1 visible positions)."""
    n = depth + 1
    kv = shape.n_layer * shape.n_head_kv * kv_bytes_per_head(kind, n, shape.head_dim, cache_type, **params)
    return {"weights": float(shape.weight_bytes_per_token), "kv": float(kv),
            "total": float(shape.weight_bytes_per_token + kv), "n": n}
