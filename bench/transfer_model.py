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

from dataclasses import asdict, dataclass

from sparq_cpp import transfer
from sparq_cpp.errors import SparqError
from sparq_cpp.geometry import ModelGeometry, geometry_fields
from sparq_cpp.gguf_check import check_gguf, open_gguf


@dataclass(frozen=True, kw_only=True)
class ModelShape(ModelGeometry):
    """What the memory estimate and the transfer model need to know about a model: its geometry and
    the bytes of its weights."""

    weight_bytes: int  # the whole file's tensors (all resident while decoding)
    weight_bytes_per_token: int  # what one decode step reads

    def as_dict(self) -> dict:
        return asdict(self) | {"head_dim": self.head_dim, "n_embd_kv": self.n_embd_kv}


def shape_from_gguf(path) -> ModelShape:
    """A ModelShape from a GGUF's metadata and tensor sizes."""
    s = check_gguf(path)
    reader = open_gguf(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    rows = {t.name: int(t.shape[-1]) if len(t.shape) > 1 else 1 for t in reader.tensors}
    if "token_embd.weight" not in sizes:
        raise SparqError(f"{path}: no token_embd.weight tensor")
    total = sum(sizes.values())
    emb = sizes["token_embd.weight"]
    per_token = total - emb + emb // max(1, rows["token_embd.weight"])
    if "output.weight" not in sizes:  # tied embeddings: the head reads the whole embedding
        per_token += emb - emb // max(1, rows["token_embd.weight"])
    return ModelShape(**geometry_fields(s), weight_bytes=total, weight_bytes_per_token=per_token)


def shape_from_geometry(geo: ModelGeometry, wtype: str) -> ModelShape:
    """The ModelShape the model factory's file for geo and wtype will have (before writing it)."""
    bpe = transfer.bytes_per_element(wtype)
    E, Eq, Ekv = geo.n_embd, geo.n_head * geo.head_dim, geo.n_head_kv * geo.head_dim
    mats = Eq * E + 2 * Ekv * E + E * Eq + 3 * geo.n_ff * E
    per_layer = mats * bpe + 2 * E * 4
    emb = geo.n_vocab * E * bpe
    total = geo.n_layer * per_layer + 2 * emb + E * 4
    per_token = total - emb + E * bpe
    return ModelShape(**geometry_fields(geo), weight_bytes=int(total), weight_bytes_per_token=int(per_token))


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
