"""What a llama.cpp context needs in memory, estimated from the model file before anything is allocated, and the
refusal of one that would not fit: beyond the memory free, a process is killed without a word (or the machine
swaps). The Python API, `generate` and `serve` check with it; the benchmarks plan their contexts with it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from sparq_cpp import transfer
from sparq_cpp.errors import SparqError
from sparq_cpp.geometry import ModelGeometry, geometry_fields
from sparq_cpp.gguf_check import check_gguf, open_gguf
from sparq_cpp.outfile import fmt_bytes

KV_PAD = 256  # llama.cpp pads the cache size to a multiple of 256 cells
MIB = 1 << 20
GIB = 1 << 30
UBATCH = 512  # llama.cpp's default micro-batch (-ub)
OVERHEAD = 200 * MIB  # the process's own allocations beyond the model, caches and compute


@dataclass(frozen=True, kw_only=True)
class ModelShape(ModelGeometry):
    """What the memory estimate and the transfer model need to know about a model: its geometry and
    the bytes of its weights."""

    weight_bytes: int  # the whole file's tensors (all resident while decoding)
    weight_bytes_per_token: int  # what one decode step reads

    def as_dict(self) -> dict:
        return asdict(self) | {"head_dim": self.head_dim, "n_embd_kv": self.n_embd_kv}


def shape_from_gguf(path, summary=None) -> ModelShape:
    """A ModelShape from a GGUF's metadata (summary: check_gguf's, where the caller has it) and tensor sizes."""
    s = summary or check_gguf(path)
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


def alisa_window_bytes(n_layer: int, n_ctx: int, c: float) -> int:
    """The bytes of ALISA's window of past weights, as llama.cpp allocates it per layer: f32 rows over the
    cache's cells for the steps of the longest window plus two, a row of zeros, and the running sums."""
    n_ring = min(max(1, int((n_ctx + 1) * c / 2)), n_ctx) + 2
    return n_layer * n_ctx * (n_ring + 2) * 4


def cache_bytes(shape: ModelShape, cells, kind: str, type_k: str, type_v: str | None = None) -> dict:
    """Bytes of a KV cache of `cells` cells in every layer (or a list: the cells of each layer): K and V in
    their cache types, and SparQ's transposed K copy (f16; f32 for an f32 K cache)."""
    type_v = type_k if type_v is None else type_v
    per_layer = cells if isinstance(cells, (list, tuple)) else [cells] * shape.n_layer
    total = sum(per_layer) * shape.n_embd_kv
    kv = total * (transfer.bytes_per_element(type_k) + transfer.bytes_per_element(type_v))
    kt = total * (4 if type_k == "f32" else 2) if kind == "sparq" else 0
    return {"kv_cache": int(kv), "k_transposed": int(kt)}


def compute_bytes(shape: ModelShape, ubatch: int, n_kv: int, flash_attn: bool) -> int:
    """llama.cpp's compute buffer for a micro-batch of `ubatch` tokens attending to `n_kv` cells: activations
    and logits, 64 MiB of graph, and without flash attention the KQ matrix (f32, every head)."""
    out = ubatch * 4 * (2 * shape.n_vocab + 4 * max(shape.n_ff, shape.n_embd) + 16 * shape.n_embd) + 64 * MIB
    if not flash_attn:
        out += 2 * ubatch * n_kv * shape.n_head * 4
    return int(out)


def context_estimate(shape: ModelShape, *, kind: str, n_ctx: int, n_seq: int = 1, type_k: str = "f16",
                     type_v: str = "f16", flash_attn: bool = True, alisa_c: float | None = None,
                     ubatch_size: int = UBATCH, overhead: int = OVERHEAD) -> dict:
    """Resident bytes of a model with a context of n_ctx cells over n_seq sequences (one cache stream each, as
    llama-server runs its slots without -kvu), by part: the weights (memory-mapped, all resident), K and V (each
    sequence's share of n_ctx, padded to 256 cells; a sliding-window layer keeps its window plus a micro-batch,
    as llama.cpp does without --swa-full), SparQ's transposed K copy, ALISA's window of past weights, the compute
    buffer and a fixed overhead. `per_user` is one sequence's caches and window."""
    n_seq = max(1, n_seq)
    cells = -(-max(1, n_ctx // n_seq) // KV_PAD) * KV_PAD
    per_layer = [min(cells, -(-(shape.n_swa + ubatch_size) // KV_PAD) * KV_PAD) if shape.is_swa(il) else cells
                 for il in range(shape.n_layer)]
    cache = cache_bytes(shape, [c * n_seq for c in per_layer], kind, type_k, type_v)
    window = alisa_window_bytes(shape.n_layer, cells, alisa_c) * n_seq if kind == "alisa" and alisa_c else 0
    parts = {"weights": shape.weight_bytes, **cache, "alisa_window": int(window),
             "compute": compute_bytes(shape, min(ubatch_size, n_ctx), cells, flash_attn), "overhead": overhead}
    parts["total"] = sum(parts.values())
    parts["per_user"] = (parts["kv_cache"] + parts["k_transposed"] + parts["alisa_window"]) // n_seq
    parts["cells_per_slot"] = cells
    return parts


def check_fits(est: dict, available: int, what: str, advice: str) -> None:
    """Refuses an estimate above the memory available now (0: unknown, nothing refused), with the numbers and
    `advice` (what to change)."""
    if available and est["total"] > available:
        caches = est["kv_cache"] + est["k_transposed"] + est["alisa_window"]
        raise SparqError(f"{what} would need about {fmt_bytes(est['total'])} (weights {fmt_bytes(est['weights'])}, "
                         f"caches {fmt_bytes(caches)}, compute {fmt_bytes(est['compute'])}), more than the "
                         f"{fmt_bytes(available)} available; {advice}")
