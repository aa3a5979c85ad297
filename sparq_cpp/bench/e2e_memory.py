"""What each end-to-end bench context needs in memory (the parts as sparq_cpp.memory estimates them), and how the
bench's modes and layers are planned to fit.
"""
from __future__ import annotations

from sparq_cpp import transfer
from sparq_cpp.bench.stateblob import LAYOUT_KT, KVLayout, SparseLayout, blob_size
from sparq_cpp.bench.e2e_config import MODES, BenchConfig, Mode
from sparq_cpp.memory import KV_PAD, MIB, ModelShape, cache_bytes, compute_bytes

# ---- memory ------------------------------------------------------------------------------

def n_ctx_for(depth: int, steps: int = 1) -> int:
    """The context for a cache filled to `depth`, then `steps` decode steps."""
    return -(-(depth + max(1, steps)) // KV_PAD) * KV_PAD


def fills_at(cfg: BenchConfig, depth: int) -> list:
    if cfg.fill == "both":
        return ["synthetic", "prefill"] if depth <= cfg.prefill_max else ["synthetic"]
    return [cfg.fill]


def ubatch(fills: list, n_ctx: int, prefill_batch: int) -> int:
    """The micro-batch of a context: the prefill batch where it prefills, else 32; never more than n_ctx."""
    return min(prefill_batch if "prefill" in fills else 32, n_ctx)


def estimate_memory(shape: ModelShape, mode: Mode, depth: int, fills: list, prefill_batch: int = 512) -> dict:
    """Peak resident bytes of one (mode, depth) run, by part, before anything is allocated.

    One context per fill (with --fill both, a synthetic-filled and a prefilled context are alive
    together so their steps can alternate), each: K and V caches (n_ctx cells, padded to 256) +
    the transposed K copy (SparQ) + compute buffers (ubatch-sized; the KQ matrix without flash
    attention; llama-cpp-python's batch). Shared: the weights (memory-mapped, all resident), the
    larger of the synthetic state blob (alive while it loads; SparQ's holds K^T as well) and the host
    buffers of SparQ's rebuild of the K copy from K (K as f32, K^T as f32 and f16), and a fixed 400 MiB
    for Python, numpy and llama.cpp's own allocations.
    """
    L, Ekv = shape.n_layer, shape.n_embd_kv
    n_ctx = n_ctx_for(depth)
    bpe = transfer.bytes_per_element(mode.cache_type)
    kv = kt = compute = 0
    for fill in fills:
        cache = cache_bytes(shape, n_ctx, mode.kind, mode.cache_type)
        kv += cache["kv_cache"]
        kt += cache["k_transposed"]
        ub = ubatch([fill], n_ctx, prefill_batch)
        compute += compute_bytes(shape, ub, n_ctx, mode.flash_attn)
        compute += ub * n_ctx * 4  # llama-cpp-python's batch: n_seq_max = n_ctx seq ids per token
    transient = 0
    if "synthetic" in fills:
        layout = KVLayout(L, Ekv, Ekv, mode.cache_type, not mode.flash_attn)
        # a SparQ context's state carries K^T too
        transient = blob_size(layout, depth, SparseLayout(LAYOUT_KT) if mode.kind == "sparq" else None)
        if mode.kind == "sparq":
            transient = max(transient, n_ctx * Ekv * (bpe + 4 + 4 + 2))
    parts = {"weights": shape.weight_bytes, "kv_cache": kv, "k_transposed": kt, "compute": compute,
             "transient": transient, "overhead": 400 * MIB}
    parts = {k: int(v) for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def depth_estimate(shape: ModelShape, cfg: BenchConfig, depth: int) -> dict:
    """The estimate of the most demanding mode at this depth (modes run one at a time)."""
    ests = {m: estimate_memory(shape, MODES[m], depth, fills_at(cfg, depth), cfg.prefill_batch) for m in cfg.modes}
    worst = max(ests, key=lambda m: ests[m]["total"])
    return {"mode": worst, **ests[worst]}


def group_estimate(shape: ModelShape, cfg: BenchConfig, depth: int, modes: list) -> dict:
    """Peak of several modes' contexts alive at once: their caches and compute buffers add up,
    the weights (one memory-mapped file), the transient and the overhead do not."""
    ests = [estimate_memory(shape, MODES[m], depth, fills_at(cfg, depth), cfg.prefill_batch) for m in modes]
    out = {k: sum(e[k] for e in ests) for k in ("kv_cache", "k_transposed", "compute")}
    out["weights"], out["overhead"] = ests[0]["weights"], ests[0]["overhead"]
    out["transient"] = max(e["transient"] for e in ests)
    out["total"] = sum(out.values())
    return out


def plan_groups(shape: ModelShape, cfg: BenchConfig, depth: int, budget: int, baseline: str | None = None) -> list:
    """Modes whose contexts can be alive together at this depth, packed greedily (with --interleave
    off, or where memory allows nothing more, one mode per group). Within a group the timed steps of
    the modes alternate (in --modes order), so a slow spell of the machine (or of the host under a
    virtual machine, which no CPU counter here sees) hits them alike.

    Speed-ups divide the baseline's time by a sparse mode's, so the two should share a window:
    `baseline` (the faster dense baseline measured so far) is packed first, then the sparse modes,
    then the rest in --modes order."""
    if not cfg.interleave:
        return [[m] for m in cfg.modes]
    first = [baseline] if baseline in cfg.modes else []
    order = first + [m for m in cfg.modes if not MODES[m].dense and m not in first] + \
        [m for m in cfg.modes if MODES[m].dense and m not in first]
    groups, cur = [], []
    for m in order:
        if cur and group_estimate(shape, cfg, depth, cur + [m])["total"] > budget:
            groups.append(cur)
            cur = []
        cur.append(m)
    groups.append(cur)
    return [sorted(g, key=cfg.modes.index) for g in groups]


def choose_layers(geo_for, cfg: BenchConfig, budget: int, max_layers: int) -> int:
    """Most layers (up to the preset's) whose peak at the largest depth fits the budget; rounded
    down to a multiple of 4 from 4 up, so that the model cache holds few variants."""
    best = 0
    for L in range(1, max_layers + 1):
        if depth_estimate(geo_for(L), cfg, max(cfg.depths))["total"] <= budget:
            best = L
        else:
            break
    if best >= 4:
        best -= best % 4
    return best
