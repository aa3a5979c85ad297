"""End-to-end token latency against sequence length S, for dense and sparse attention in llama.cpp.

For each depth S and mode, a context is filled with S positions, then the time of ONE single-token
decode at position S is measured: `warmup` steps, then `repeats` timed steps, each followed by
`llama_memory_seq_rm(mem, 0, S, -1)` (outside the timing) so that every step decodes at the same
depth. A step is `llama_decode` + `llama_synchronize`: embedding, every layer, the output head.

Two ways to reach depth S:
  - synthetic (default): a llama.cpp sequence-state blob written here (bench/stateblob.py) with S
    positions of random K and V rows at the model's scale, loaded with `llama_state_seq_set_data`.
    Nothing is computed, so 32k positions take seconds instead of an hour of prefill on 2 cores.
  - prefill: the real thing, random tokens through the model in batches of 512.
`--fill both` does both where prefill is affordable (S <= prefill_max), in two contexts whose
timed steps alternate, and checks that the decode latencies agree within 5%: decode cost depends
on the cache's size, not on its values.

The transfer model (bench/transfer_model.py) gives the bytes each token reads; the machine's read
bandwidth is measured (bench/machine.py); the bound on a mode's speed-up is
bytes(baseline) / bytes(mode), where the baseline is the faster of the f16 dense modes
(dense-fa, dense-nofa) measured at that S.
"""
from __future__ import annotations

import ctypes
import datetime as _dt
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from sparq_cpp.bench import machine
from sparq_cpp.bench.stateblob import KVLayout, blob_size, synthetic_state
from sparq_cpp.bench.transfer_model import ModelShape, shape_from_geometry, shape_from_gguf, token_bytes
from sparq_cpp.errors import SparqError
from sparq_cpp.outfile import atomic_write, check_writable

SCHEMA = "sparq-cpp-bench/1"
DEFAULT_DEPTHS = "1k,2k,4k,8k,16k,32k"
DEFAULT_MODES = "dense-fa,dense-nofa,dense-q8kv,sparq"
FILLS = ("synthetic", "prefill", "both")
AGREE_TOL = 0.05
KV_PAD = 256  # llama.cpp pads the cache size to a multiple of 256 cells
BENCH_MODEL_CTX = 131072  # n_ctx_train written into the default synthetic model
MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Mode:
    name: str
    kind: str  # dense, sparq, loki
    cache_type: str
    flash_attn: bool
    about: str

    @property
    def dense(self) -> bool:
        return self.kind == "dense"


MODES = {m.name: m for m in (
    Mode("dense-fa", "dense", "f16", True, "dense attention, flash attention on, f16 cache"),
    Mode("dense-nofa", "dense", "f16", False, "dense attention, flash attention off (V transposed), f16 cache"),
    Mode("dense-q8kv", "dense", "q8_0", True, "dense attention, flash attention on, q8_0 K and V"),
    Mode("sparq", "sparq", "f16", True, "SparQ, f16 cache + f16 transposed K copy"),
    Mode("sparq-q8kv", "sparq", "q8_0", True, "SparQ, q8_0 cache + f16 transposed K copy"),
    Mode("loki", "loki", "f16", True, "Loki, f16 cache (keys in the PCA basis)"),
)}
BASELINE_MODES = ("dense-fa", "dense-nofa")  # the f16 dense baselines


@dataclass
class BenchConfig:
    depths: list = field(default_factory=lambda: parse_depths(DEFAULT_DEPTHS))
    modes: list = field(default_factory=lambda: parse_modes(DEFAULT_MODES))
    model: Path | None = None
    preset: str = "llama2-7b"
    wtype: str = "q8_0"
    layers: int | None = None
    r: int = 16
    k: int = 128
    l: int = 32
    d: int = 32
    loki_l: int = 0
    loki_pca: Path | None = None  # None: a synthetic basis for the model (decode time does not depend on it)
    mean_value: bool = True
    repeats: int = 15
    rounds: int = 1       # the whole sweep this many times, fresh contexts each time; samples pooled
    warmup: int = 2
    fill: str = "synthetic"
    prefill_max: int = 4096
    prefill_batch: int = 512
    threads: int | None = None
    seed: int = 0
    json_path: Path | None = None
    plot_path: Path | None = None
    beyond_train_ctx: bool = False
    mem_fraction: float = 0.8
    disturbed_frac: float = 0.02
    max_extra_steps: int | None = None
    max_retry_s: float = 300.0
    wait_quiet: float = 0.0
    interleave: bool = True
    bandwidth_bytes: int = GIB
    progress: bool = True


# ---- input -------------------------------------------------------------------------------

_DEPTH_RE = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$")


def parse_depths(text) -> list:
    """'1k,2k,4096' -> [1024, 2048, 4096] (k = 1024, m = 1048576), sorted, no duplicates."""
    if isinstance(text, (list, tuple)):
        items = list(text)
    else:
        items = [x for x in str(text).split(",") if x.strip()]
    if not items:
        raise SparqError("--depths: give at least one depth, e.g. 1k,2k,4k")
    out = []
    for item in items:
        if isinstance(item, int):
            value = item
        else:
            m = _DEPTH_RE.match(str(item))
            if not m:
                raise SparqError(f"--depths: cannot read {item!r} (use numbers like 512, 1k, 32k)")
            value = int(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20}[m.group(2).lower()]
        if value < 1:
            raise SparqError(f"--depths: a depth must be >= 1, got {item!r}")
        out.append(value)
    return sorted(set(out))


def parse_modes(text) -> list:
    items = list(text) if isinstance(text, (list, tuple)) else [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise SparqError("--modes: give at least one mode")
    for name in items:
        if name not in MODES:
            raise SparqError(f"--modes: unknown mode {name!r} (choose from {', '.join(MODES)})")
    return list(dict.fromkeys(items))


def fmt_depth(s: int) -> str:
    return f"{s // 1024}k" if s % 1024 == 0 else str(s)


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def validate(cfg: BenchConfig) -> BenchConfig:
    """Check everything that needs no model: numbers, modes, the build, output paths."""
    cfg = replace(cfg, depths=parse_depths(cfg.depths), modes=parse_modes(cfg.modes))
    if cfg.fill not in FILLS:
        raise SparqError(f"--fill: unknown {cfg.fill!r} (choose from {', '.join(FILLS)})")
    for name in ("repeats", "rounds", "r", "k", "d", "prefill_batch"):
        if getattr(cfg, name) < 1:
            raise SparqError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(cfg, name)}")
    for name in ("warmup", "l", "prefill_max"):
        if getattr(cfg, name) < 0:
            raise SparqError(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(cfg, name)}")
    if cfg.l > cfg.k:
        raise SparqError(f"--l: must be in 0..k ({cfg.k}), got {cfg.l}")
    if not 0 <= cfg.loki_l <= cfg.k:
        raise SparqError(f"--loki-l: must be in 0..k ({cfg.k}), got {cfg.loki_l}")
    if cfg.loki_pca is not None and not Path(cfg.loki_pca).is_file():
        raise SparqError(f"--loki-pca: file not found: {cfg.loki_pca}")
    from sparq_cpp.llm import check_threads

    cfg = replace(cfg, threads=check_threads(cfg.threads if cfg.threads is not None else _default_threads()))
    if not 0 < cfg.mem_fraction <= 1:
        raise SparqError(f"--mem-fraction: must be in (0, 1], got {cfg.mem_fraction}")
    _check_bandwidth_buffer(cfg)
    if cfg.disturbed_frac < 0:
        raise SparqError(f"--disturbed-frac: must be >= 0, got {cfg.disturbed_frac}")
    if cfg.max_extra_steps is not None and cfg.max_extra_steps < 0:
        raise SparqError(f"--max-extra-steps: must be >= 0, got {cfg.max_extra_steps}")
    if cfg.layers is not None and cfg.layers < 1:
        raise SparqError(f"--layers: must be >= 1, got {cfg.layers}")
    if cfg.model is not None and cfg.layers is not None:
        raise SparqError("--layers applies to the synthetic model only; not with --model")
    if os.environ.get("LLAMA_SPARSE_ATTN"):
        raise SparqError("LLAMA_SPARSE_ATTN is set in the environment; unset it: the bench sets the "
                         "attention of each mode itself and the variable would change the dense baselines")
    _check_build(cfg.modes)
    if cfg.json_path is not None:
        cfg = replace(cfg, json_path=check_writable(cfg.json_path, "--json"))
    if cfg.plot_path is not None:
        cfg = replace(cfg, plot_path=check_writable(cfg.plot_path, "--plot"))
    return cfg


def _check_bandwidth_buffer(cfg: BenchConfig) -> None:
    """At least 1 MiB (a buffer of no pages reads at 0 GB/s, which every speed-up bound divides by),
    and no more than the memory available."""
    if cfg.bandwidth_bytes < MIB:
        raise SparqError(f"--bandwidth-mib: must be >= 1, got {cfg.bandwidth_bytes / MIB:g}")
    avail = machine.mem_available()  # 0: unknown
    if avail and cfg.bandwidth_bytes > avail:
        raise SparqError(f"--bandwidth-mib: {cfg.bandwidth_bytes // MIB} MiB is more than the memory available "
                         f"({fmt_bytes(avail)})")


def _default_threads() -> int:
    from sparq_cpp.llm import default_threads

    return default_threads()


def _check_build(modes: list) -> None:
    from sparq_cpp.llm import import_llama_cpp

    import_llama_cpp()
    kinds = {MODES[m].kind for m in modes}
    if kinds - {"dense"}:
        from sparq_cpp.pyext import sparse_api

        if not sparse_api.available():
            bad = [m for m in modes if not MODES[m].dense]
            raise SparqError(f"--modes {','.join(bad)}: the installed llama.cpp has no sparse attention "
                             "API; run `make setup` to build the patched one")
        if "loki" in kinds and not sparse_api.loki_available():
            raise SparqError("--modes loki: the installed llama.cpp build has no Loki runtime "
                             "(no llama_sparse_attn_load_projection); run `make setup` or drop loki from --modes")


def loki_projection(cfg: BenchConfig, path: Path, shape: ModelShape, log) -> tuple:
    """(projection file, how it was made) for the Loki mode: --loki-pca checked against the model, or a
    synthetic basis (random orthonormal per layer and KV head, written once next to the model). Decode time
    does not depend on the basis values, only on d, k and the cache, so the synthetic one times Loki
    honestly; it says nothing about Loki's accuracy."""
    from sparq_cpp.calib.pca import LokiPCA
    from sparq_cpp.calib.projection import read_projection, write_projection

    if cfg.loki_pca is not None:
        read_projection(cfg.loki_pca, model_path=path)
        return Path(cfg.loki_pca), "calibrated (--loki-pca)"
    out = path.with_name(path.stem + ".loki-synthetic.gguf")
    if out.is_file():
        try:
            read_projection(out, model_path=path)
            return out, "synthetic (random orthonormal basis)"
        except SparqError:
            pass
    log(f"writing a synthetic Loki basis {out.name} (random orthonormal; timing only)")
    rng = np.random.default_rng(cfg.seed)
    L, H, D = shape.n_layer, shape.n_head_kv, shape.head_dim
    P = np.stack([np.stack([np.linalg.qr(rng.standard_normal((D, D)))[0] for _ in range(H)]) for _ in range(L)])
    var = np.broadcast_to(np.linspace(1.0, 0.01, D), (L, H, D)).copy()
    pca = LokiPCA(components={"pre": P, "post": P}, explained_variance={"pre": var, "post": var}, n_tokens=0)
    write_projection(out, pca, path, ctx_size=0)
    return out, "synthetic (random orthonormal basis)"


# ---- memory ------------------------------------------------------------------------------

def n_ctx_for(depth: int) -> int:
    return -(-(depth + 1) // KV_PAD) * KV_PAD


def fills_at(cfg: BenchConfig, depth: int) -> list:
    if cfg.fill == "both":
        return ["synthetic", "prefill"] if depth <= cfg.prefill_max else ["synthetic"]
    return [cfg.fill]


def _ubatch(fills: list, n_ctx: int, prefill_batch: int) -> int:
    return min(prefill_batch if "prefill" in fills else 32, n_ctx)


def estimate_memory(shape: ModelShape, mode: Mode, depth: int, fills: list, prefill_batch: int = 512) -> dict:
    """Peak resident bytes of one (mode, depth) run, by part, before anything is allocated.

    One context per fill (with --fill both, a synthetic-filled and a prefilled context are alive
    together so their steps can alternate), each: K and V caches (n_ctx cells, padded to 256) +
    the transposed K copy (SparQ) + compute buffers (ubatch-sized; the KQ matrix without flash
    attention; llama-cpp-python's batch). Shared: the weights (memory-mapped, all resident), the
    larger of the synthetic state blob (alive while it loads) and the host buffers of SparQ's
    rebuild of the K copy after a state load (K as f32, K^T as f32 and f16), and a fixed 400 MiB
    for Python, numpy and llama.cpp's own allocations.
    """
    L, Ekv, E = shape.n_layer, shape.n_embd_kv, shape.n_embd
    n_ctx = n_ctx_for(depth)
    bpe = {"f32": 4, "f16": 2, "q8_0": 34 / 32}[mode.cache_type]
    kv = kt = compute = 0
    for fill in fills:
        kv += 2 * L * n_ctx * Ekv * bpe
        kt += L * n_ctx * Ekv * (4 if mode.cache_type == "f32" else 2) if mode.kind == "sparq" else 0
        ub = _ubatch([fill], n_ctx, prefill_batch)
        compute += ub * 4 * (2 * shape.n_vocab + 4 * max(shape.n_ff, E) + 16 * E) + 64 * MIB
        if not mode.flash_attn:
            compute += 2 * ub * n_ctx * shape.n_head * 4
        compute += ub * n_ctx * 4  # llama-cpp-python's batch: n_seq_max = n_ctx seq ids per token
    transient = 0
    if "synthetic" in fills:
        layout = KVLayout(L, Ekv, Ekv, mode.cache_type, not mode.flash_attn)
        transient = blob_size(layout, depth)
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


def faster_baseline(results: list) -> str | None:
    """The f16 dense baseline with the lower median at the deepest depth measured so far."""
    prim = _primary(results)
    keys = [(d, m) for (d, m) in prim if m in BASELINE_MODES]
    if not keys:
        return None
    deepest = max(d for d, _ in keys)
    return min((m for d, m in keys if d == deepest), key=lambda m: prim[(deepest, m)]["median_s"])


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


# ---- the model ---------------------------------------------------------------------------

def bench_model_path(preset: str, wtype: str, layers: int) -> Path:
    """The cached synthetic model for the bench: the factory's preset with n_ctx_train 128k."""
    import hashlib

    from sparq_cpp.modelfactory import FACTORY_VERSION, cache_dir

    key = json.dumps([FACTORY_VERSION, preset, wtype, layers, BENCH_MODEL_CTX])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / f"bench-{preset}-{wtype}-L{layers}-ctx{BENCH_MODEL_CTX // 1024}k-{digest}.gguf"


def plan_model(cfg: BenchConfig) -> tuple:
    """(path, ModelShape, how it was chosen, geometry to write or None). Writes nothing: for the
    synthetic model the shape comes from its geometry, so every check runs before the write."""
    from sparq_cpp.modelfactory import PRESETS, resolve_geometry

    if cfg.model is not None:
        path = Path(cfg.model).expanduser()
        return path, shape_from_gguf(path), "given", None
    resolve_geometry(cfg.preset, wtype=cfg.wtype)  # names a bad preset or wtype

    def geo_for(L):
        return resolve_geometry(cfg.preset, layers=L, wtype=cfg.wtype, n_ctx_train=BENCH_MODEL_CTX)

    if cfg.layers is not None:
        layers, how = cfg.layers, f"--layers {cfg.layers}"
    else:
        budget = int(cfg.mem_fraction * machine.mem_available())
        shape_for = lambda L: shape_from_geometry(geo_for(L), cfg.wtype)  # noqa: E731
        layers = choose_layers(shape_for, cfg, budget, PRESETS[cfg.preset].n_layer)
        if layers < 1:
            est = depth_estimate(shape_for(1), cfg, max(cfg.depths))
            raise SparqError(f"--depths: depth {fmt_depth(max(cfg.depths))} does not fit this machine's memory "
                             f"even with 1 layer (estimated peak {fmt_bytes(est['total'])}, "
                             f"budget {fmt_bytes(budget)} = {cfg.mem_fraction:.0%} of available memory)")
        how = (f"auto: the most layers of {cfg.preset} whose peak at S={fmt_depth(max(cfg.depths))} fits "
               f"{cfg.mem_fraction:.0%} of available memory ({fmt_bytes(budget)}), rounded down to a multiple of 4")
    geo = geo_for(layers)
    path = bench_model_path(cfg.preset, cfg.wtype, layers)
    return path, shape_from_geometry(geo, cfg.wtype), how, (None if path.exists() else geo)


def ensure_model(cfg: BenchConfig, path: Path, geo, log) -> ModelShape:
    """Write the synthetic model if it is not cached yet; the shape as read back from the file."""
    from sparq_cpp.modelfactory import write_model

    if geo is not None:
        log(f"writing the synthetic model {path.name} ({fmt_bytes(shape_from_geometry(geo, cfg.wtype).weight_bytes)})")
        write_model(path, cfg.preset, layers=geo.n_layer, wtype=cfg.wtype, seed=0, progress=cfg.progress,
                    make_parents=True, n_ctx_train=BENCH_MODEL_CTX)
    return shape_from_gguf(path)


def kv_scales(path, shape: ModelShape) -> tuple:
    """Per-layer std of each K and V component for the synthetic fill.

    For a model-factory file (it records its preset and seed) these are the model's own: a key
    component's std is its attn_k row's std times sqrt(n_embd) (RMS-normed input), values have
    unit std; checked against a real prefill to within ~5% per component. Other models: 1.
    """
    from sparq_cpp.gguf_check import _field, open_gguf

    try:
        from sparq_cpp.modelfactory import PRESETS, _qk_row_std, resolve_geometry

        reader = open_gguf(path)
        preset, seed = _field(reader, "sparq.preset"), _field(reader, "sparq.seed")
        if preset in PRESETS and seed is not None:
            geo = resolve_geometry(preset, layers=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                                   n_head_kv=shape.n_head_kv, n_ff=shape.n_ff, n_vocab=shape.n_vocab)
            k = np.stack([_qk_row_std(geo, int(seed), il, geo.n_head_kv) for il in range(shape.n_layer)])
            return (k * math.sqrt(shape.n_embd)).astype(np.float32), None, "model factory row scales"
    except (SparqError, ImportError, TypeError, ValueError):
        pass
    return None, None, "unit"


# ---- running -----------------------------------------------------------------------------

class _Context:
    """One llama.cpp context for a mode, with the low-level handles the steps need."""

    def __init__(self, path, shape: ModelShape, mode: Mode, cfg: BenchConfig, depth: int, fills: list):
        from sparq_cpp.attention import Dense, Loki, SparQ
        from sparq_cpp.llm import Llama, import_llama_cpp

        self.lc = import_llama_cpp()
        self.mode, self.depth = mode, depth
        n_ctx = n_ctx_for(depth)
        self.n_batch = _ubatch(fills, n_ctx, cfg.prefill_batch)
        if mode.dense:
            att = Dense()
        elif mode.kind == "loki":
            att = Loki(d=cfg.d, k=cfg.k, l=cfg.loki_l, projection=cfg.loki_pca)
        else:
            att = SparQ(r=cfg.r, k=cfg.k, l=cfg.l, mean_value=cfg.mean_value)
        self.llm = Llama(path, att, cache_type=mode.cache_type, n_ctx=n_ctx, n_batch=self.n_batch,
                         n_ubatch=self.n_batch, n_threads=cfg.threads, n_threads_batch=cfg.threads,
                         flash_attn=mode.flash_attn, seed=cfg.seed, logits_all=False)
        self.batch = None
        try:
            self.ctx = self.llm._ctx.ctx
            self.mem = self.lc.llama_get_memory(self.ctx)
            self.layout = KVLayout(shape.n_layer, shape.n_embd_kv, shape.n_embd_kv, mode.cache_type,
                                   not mode.flash_attn)
            self.attention = self._attention_in_effect()
            want = {"sparq": 1, "loki": 2}.get(mode.kind, 0)
            if not mode.dense and self.attention.get("mode") != want:
                raise SparqError(f"{mode.name}: the context did not switch {mode.kind} on ({self.attention})")
            if mode.dense and self.attention.get("mode", 0) != 0:
                raise SparqError(f"{mode.name}: the context runs sparse attention ({self.attention})")
            self.batch = self.lc.llama_batch_init(max(1, self.n_batch), 0, 1)
        except BaseException:
            self.llm.close()
            raise

    def _attention_in_effect(self) -> dict:
        from sparq_cpp.pyext import sparse_api

        if not sparse_api.available():
            return {"mode": 0, "api": "stock build"}
        return sparse_api.get_params(self.ctx).as_dict()

    def close(self):
        if self.batch is not None:
            self.lc.llama_batch_free(self.batch)
            self.batch = None
        self.llm.close()

    def clear(self):
        self.lc.llama_memory_clear(self.mem, True)

    def pos_max(self) -> int:
        return self.lc.llama_memory_seq_pos_max(self.mem, 0)

    def _set_batch(self, tokens, pos0: int, last_logits: bool):
        b = self.batch
        for i, t in enumerate(tokens):
            b.token[i] = int(t)
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 0
        if last_logits:
            b.logits[len(tokens) - 1] = 1
        b.n_tokens = len(tokens)

    def fill_synthetic(self, depth: int, k_std, v_std, seed: int, progress=None) -> float:
        t0 = time.perf_counter()
        blob = synthetic_state(self.layout, depth, seed=seed, k_std=k_std, v_std=v_std, progress=progress)
        self.clear()
        n = self.lc.llama_state_seq_set_data(self.ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                             len(blob), 0)
        size = len(blob)
        del blob
        if n != size:
            raise SparqError(f"{self.mode.name}: llama.cpp did not load the synthetic state at S={depth} "
                             f"(read {n} of {size} bytes)")
        if self.pos_max() != depth - 1:
            raise SparqError(f"{self.mode.name}: after the state load the cache ends at {self.pos_max()}, "
                             f"not {depth - 1}")
        return time.perf_counter() - t0

    def fill_prefill(self, depth: int, seed: int, n_vocab: int, progress=None) -> float:
        rng = np.random.default_rng([seed, depth])
        tokens = rng.integers(3, n_vocab, depth)
        self.clear()
        t0 = time.perf_counter()
        for p0 in range(0, depth, self.n_batch):
            chunk = tokens[p0:p0 + self.n_batch]
            self._set_batch(chunk, p0, last_logits=p0 + len(chunk) == depth)
            rc = self.lc.llama_decode(self.ctx, self.batch)
            if rc != 0:
                raise SparqError(f"{self.mode.name}: llama_decode failed during prefill at {p0} (code {rc})")
            if progress:
                progress(len(chunk))
        self.lc.llama_synchronize(self.ctx)
        if self.pos_max() != depth - 1:
            raise SparqError(f"{self.mode.name}: after prefill the cache ends at {self.pos_max()}, not {depth - 1}")
        return time.perf_counter() - t0

    def step(self, depth: int, token: int) -> tuple:
        """One timed single-token decode at position `depth`, then its cell removed again:
        (seconds, seconds our threads waited for a CPU during it or None)."""
        self._set_batch([token], depth, last_logits=True)
        w0 = machine.run_queue_wait_ns()
        t0 = time.perf_counter()
        rc = self.lc.llama_decode(self.ctx, self.batch)
        self.lc.llama_synchronize(self.ctx)
        dt = time.perf_counter() - t0
        w1 = machine.run_queue_wait_ns()
        wait = (w1 - w0) * 1e-9 if w0 is not None and w1 is not None else None
        if rc != 0:
            raise SparqError(f"{self.mode.name}: llama_decode failed at S={depth} (code {rc})")
        if self.pos_max() != depth:
            raise SparqError(f"{self.mode.name}: the decode did not land at position {depth}")
        if not self.lc.llama_memory_seq_rm(self.mem, 0, depth, -1) or self.pos_max() != depth - 1:
            raise SparqError(f"{self.mode.name}: could not remove position {depth} again")
        return dt, wait


def _warmup_steps(cfg: BenchConfig, mode: Mode, fill: str) -> int:
    """Steps after the first one, untimed (the first step is timed and reported on its own)."""
    return cfg.warmup


def _stats(samples: list) -> dict:
    a = np.asarray(samples, float)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median_s": float(med), "q1_s": float(q1), "q3_s": float(q3), "min_s": float(a.min()),
            "max_s": float(a.max()), "mean_s": float(a.mean())}


def _sample_stats(rec: dict, repeats: int) -> dict:
    """Median, IQR, ... of a record's undisturbed steps when there are at least half of `repeats`
    of them, else of all its steps."""
    good = [t for t, bad in zip(rec["samples_s"], rec["disturbed"]) if not bad]
    use_good = len(good) >= max(1, -(-repeats // 2))
    return {"stats_from": "undisturbed steps" if use_good else "all steps (machine busy throughout)",
            "n_used": len(good) if use_good else len(rec["samples_s"]),
            **_stats(good if use_good else rec["samples_s"])}


def pool_rounds(results: list, repeats: int) -> list:
    """One record per (depth, mode, fill) from the records of several rounds: their steps pooled,
    the statistics over the pool (a round whose window hit a slow spell, or whose contexts landed
    badly in memory, is outvoted), and each round's own median kept under "rounds"."""
    pooled: dict = {}
    for r in results:
        key = (r["depth"], r["mode"], r["fill"])
        if key not in pooled:
            pooled[key] = {**{k: v for k, v in r.items() if k != "round"}, "samples_s": [], "run_queue_wait_s": [],
                           "disturbed": [], "first_step_s": [], "warmup_s": [], "fill_s": 0.0, "rounds": []}
        p = pooled[key]
        for f in ("samples_s", "run_queue_wait_s", "disturbed", "first_step_s", "warmup_s"):
            p[f] = p[f] + list(r.get(f, []))  # runs written before the first step was timed have none
        p["fill_s"] += r["fill_s"]
        p["rounds"].append({k: r[k] for k in ("median_s", "q1_s", "q3_s", "n_used", "timed_with",
                                               "other_processes_cpu_share", "waited_for_quiet_s")})
    out = []
    for p in pooled.values():
        p.update(_sample_stats(p, repeats * len(p["rounds"])))
        p["effective_gbs"] = p["bytes"]["total"] / p["median_s"] / 1e9
        out.append(p)
    return out


def _run_group(path, shape, modes: list, cfg: BenchConfig, depth: int, fills: list, token: int, k_std, v_std,
               bar) -> list:
    """Time some modes at one depth: one context per (mode, fill), each filled and warmed up, then
    their timed steps alternate round-robin (mode A synthetic, A prefill, B synthetic, ...) so that
    a slow spell of a shared machine hits them all alike.

    A step during which our threads waited for a CPU for more than `disturbed_frac` of its time
    (another process took a core) is kept in the JSON but marked disturbed, and another step is
    taken instead, up to `max_extra_steps` more steps per context and `max_retry_s` seconds. The
    statistics use the undisturbed steps when there are at least half of `repeats` of them, else
    all steps (and the record says so).
    """
    tag = f"S={fmt_depth(depth)} {','.join(m.name for m in modes)}"
    ctxs, fill_s, first, warm, samples = {}, {}, {}, {}, {}
    max_extra = cfg.max_extra_steps if cfg.max_extra_steps is not None else 3 * cfg.repeats
    try:
        for mode in modes:
            for fill in fills:
                key = (mode.name, fill)
                bar.set_postfix_str(f"S={fmt_depth(depth)} {mode.name}: {fill} fill")
                c = ctxs[key] = _Context(path, shape, mode, cfg, depth, [fill])
                if fill == "synthetic":
                    fill_s[key] = c.fill_synthetic(depth, k_std, v_std, cfg.seed)
                else:
                    fill_s[key] = c.fill_prefill(depth, cfg.seed, shape.n_vocab)
        waited = 0.0
        if cfg.wait_quiet > 0:
            bar.set_postfix_str(f"{tag}: waiting for a quiet machine")
            waited = machine.wait_quiet(cfg.wait_quiet)
        bar.set_postfix_str(f"{tag}: decode")
        mon = machine.CpuMonitor()
        for key, c in ctxs.items():
            # the first step after the fill: after a state load it includes SparQ's cache upkeep
            first[key] = c.step(depth, token)[0]
            bar.update(1)
            warm[key] = []
            for _ in range(_warmup_steps(cfg, MODES[key[0]], key[1])):
                warm[key].append(c.step(depth, token)[0])
                bar.update(1)
            samples[key] = []
        kept = dict.fromkeys(ctxs, 0)
        t_start = time.perf_counter()
        while any(kept[k] < cfg.repeats for k in ctxs):
            for key, c in ctxs.items():
                if kept[key] >= cfg.repeats or len(samples[key]) >= cfg.repeats + max_extra:
                    continue
                dt, wait = c.step(depth, token)
                disturbed = wait is not None and wait > cfg.disturbed_frac * dt
                samples[key].append((dt, wait, disturbed))
                if not disturbed:
                    kept[key] += 1
                    bar.update(1)
                else:
                    n_dist = sum(x[2] for k in samples for x in samples[k])
                    bar.set_postfix_str(f"{tag}: decode, {n_dist} disturbed")
                    time.sleep(0.2)
            exhausted = all(kept[k] >= cfg.repeats or len(samples[k]) >= cfg.repeats + max_extra for k in ctxs)
            timed_out = (time.perf_counter() - t_start > cfg.max_retry_s
                         and all(len(samples[k]) >= cfg.repeats for k in ctxs))
            if exhausted or timed_out:
                bar.update(sum(max(0, cfg.repeats - kept[k]) for k in ctxs))
                break
        others = mon.foreign_share()
    finally:
        for c in ctxs.values():
            c.close()
    out = []
    for mode in modes:
        by = token_bytes(shape, mode.kind, depth, mode.cache_type, r=cfg.r, k=cfg.k, d=cfg.d)
        for fill in fills:
            key = (mode.name, fill)
            rec = {"depth": depth, "mode": mode.name, "fill": fill, "samples_s": [x[0] for x in samples[key]],
                   "run_queue_wait_s": [x[1] for x in samples[key]], "disturbed": [x[2] for x in samples[key]]}
            rec.update(_sample_stats(rec, cfg.repeats))
            out.append({**rec, "first_step_s": [first[key]], "warmup_s": warm[key], "fill_s": fill_s[key], "bytes": by,
                        "effective_gbs": by["total"] / rec["median_s"] / 1e9,
                        "attention": ctxs[key].attention, "n_ctx": n_ctx_for(depth),
                        "timed_with": [m.name for m in modes],
                        "other_processes_cpu_share": others, "waited_for_quiet_s": waited})
    return out


def _build_record() -> dict | None:
    from sparq_cpp.pyext.build import installed_build

    rec = installed_build()
    if rec is None:
        return None
    return {k: rec.get(k) for k in ("key", "series_hash", "options", "patches", "pin")}


def run(cfg: BenchConfig, log=print) -> dict:
    """Run the sweep and return the result (the JSON document); writes --json and --plot if set."""
    from tqdm import tqdm

    cfg = validate(cfg)
    path, shape, how, to_write = plan_model(cfg)
    max_depth = max(cfg.depths)
    if max_depth + 1 > shape.n_ctx_train and not cfg.beyond_train_ctx:
        raise SparqError(f"--depths: depth {fmt_depth(max_depth)} is beyond the model's context "
                         f"({shape.n_ctx_train} positions, trained); pass --beyond-train-ctx to time it anyway")
    log(f"model     {path} ({how})")
    log(f"          {shape.n_layer} layers, n_embd {shape.n_embd}, {shape.n_head} heads / {shape.n_head_kv} KV heads "
        f"of {shape.head_dim}, n_ff {shape.n_ff}, n_vocab {shape.n_vocab}; weights {fmt_bytes(shape.weight_bytes)}, "
        f"{fmt_bytes(shape.weight_bytes_per_token)} read per token")

    avail = machine.mem_available()
    budget = int(cfg.mem_fraction * avail)
    estimates = {}
    log(f"memory    available {fmt_bytes(avail)}, budget {fmt_bytes(budget)} ({cfg.mem_fraction:.0%}); "
        f"estimated peak per depth (the most demanding mode):")
    for depth in cfg.depths:
        est = depth_estimate(shape, cfg, depth)
        estimates[depth] = est
        log(f"          S={fmt_depth(depth):>5} {est['mode']:<11} {fmt_bytes(est['total']):>10} = weights "
            f"{fmt_bytes(est['weights'])} + KV {fmt_bytes(est['kv_cache'])} + K^T {fmt_bytes(est['k_transposed'])} "
            f"+ compute {fmt_bytes(est['compute'])} + transient {fmt_bytes(est['transient'])} "
            f"+ overhead {fmt_bytes(est['overhead'])}")
    for depth in cfg.depths:
        if estimates[depth]["total"] > budget:
            raise SparqError(f"--depths: depth {fmt_depth(depth)} does not fit this machine's memory: estimated peak "
                             f"{fmt_bytes(estimates[depth]['total'])} ({estimates[depth]['mode']}) > budget "
                             f"{fmt_bytes(budget)}; use fewer --layers or smaller --depths")
    first_base = next((m for m in cfg.modes if m in BASELINE_MODES), None)
    for depth in cfg.depths:
        g = plan_groups(shape, cfg, depth, budget, first_base)
        peak = max(group_estimate(shape, cfg, depth, x)["total"] for x in g)
        log(f"          S={fmt_depth(depth):>5} timed together: {' | '.join(','.join(x) for x in g)} "
            f"(peak {fmt_bytes(peak)})" + ("; the faster dense baseline so far joins the sparse modes"
                                            if len(g) > 1 else ""))

    shape = ensure_model(cfg, path, to_write, log)
    loki_basis = None
    if any(MODES[m].kind == "loki" for m in cfg.modes):
        cfg.loki_pca, loki_basis = loki_projection(cfg, path, shape, log)
        log(f"loki      basis {cfg.loki_pca.name}: {loki_basis}; d={cfg.d}, k={cfg.k}, l={cfg.loki_l}")
    info = machine.machine_info()
    log(f"machine   {info['cpu_model']}, {info['cores_usable']} cores, {fmt_bytes(info['mem_total_bytes'] or 0)} RAM; "
        f"{cfg.threads} threads")
    mon = machine.CpuMonitor()
    time.sleep(0.5)
    busy = mon.foreign_share()
    info["other_processes_cpu_share_at_start"] = busy
    if busy is not None and busy > 0.1:
        log(f"warning   other processes use {100 * busy:.0f}% of the CPU right now: timings with {cfg.threads} "
            f"threads will be disturbed (see the 'others' column)")
    if cfg.wait_quiet > 0:
        machine.wait_quiet(cfg.wait_quiet)
    bw = machine.measure_bandwidth(cfg.threads, cfg.bandwidth_bytes)
    log(f"bandwidth {bw['best_gbs']:.1f} GB/s best, {bw['median_gbs']:.1f} median of {len(bw['passes_gbs'])} passes "
        f"({bw['method']}, {fmt_bytes(bw['buffer_bytes'])})")
    build = _build_record()
    lib = _library()
    log(f"build     {build['key'] if build else 'none recorded (stock llama-cpp-python?)'}; libllama {lib.get('libllama')}"
        + (" (LLAMA_CPP_LIB_PATH overrides the installed build)" if lib.get("LLAMA_CPP_LIB_PATH") else ""))
    k_std, v_std, scale_how = kv_scales(path, shape)

    tasks = [(d, m, f) for d in cfg.depths for m in cfg.modes for f in fills_at(cfg, d)]
    steps = cfg.rounds * sum(1 + _warmup_steps(cfg, MODES[m], f) + cfg.repeats for _, m, f in tasks)
    bar = tqdm(total=steps, desc="bench", unit="step", disable=not cfg.progress, leave=False)
    rng = np.random.default_rng(cfg.seed)
    token = int(rng.integers(3, shape.n_vocab))
    results = []
    try:
        # rounds run the whole sweep again (minutes apart for the same depth), with fresh contexts
        for rnd in range(cfg.rounds):
            for depth in cfg.depths:
                fills = fills_at(cfg, depth)
                if rnd == 0:
                    groups = plan_groups(shape, cfg, depth, budget, faster_baseline(results) or first_base)
                    estimates[depth]["groups"] = groups
                    estimates[depth]["group_peak"] = max(group_estimate(shape, cfg, depth, x)["total"] for x in groups)
                    if len(groups) > 1:
                        log(f"S={fmt_depth(depth)}: timing {' | '.join(','.join(x) for x in groups)}")
                for group in estimates[depth]["groups"]:
                    recs = _run_group(path, shape, [MODES[m] for m in group], cfg, depth, fills, token,
                                      k_std, v_std, bar)
                    results += [{**r, "round": rnd} for r in recs]
    finally:
        bar.close()
    results = pool_rounds(results, cfg.repeats)

    doc = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "machine": {**info, "threads": cfg.threads, "bandwidth": bw, "build": build,
                    "llama_cpp_python": _llama_cpp_version(), "library": _library(),
                    "system_info": _system_info()},
        "model": {"path": str(path), "chosen": how, **shape.as_dict()},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "modes": {m: asdict(MODES[m]) for m in cfg.modes},
        "loki_basis": loki_basis,
        "synthetic_kv_scale": scale_how,
        "memory_estimate": {str(d): e for d, e in estimates.items()},
        "transfer_model": "weights touched + docs/spec.md KV reads per layer and KV head, n = S + 1 (bench/transfer_model.py)",
        "results": results,
    }
    # measured again at the end: on a shared machine the better of the two is the machine's
    if cfg.wait_quiet > 0:
        machine.wait_quiet(cfg.wait_quiet)
    bw_end = machine.measure_bandwidth(cfg.threads, cfg.bandwidth_bytes)
    bw["at_end"] = bw_end
    bw["at_start_best_gbs"] = bw["best_gbs"]
    bw["best_gbs"] = max(bw["best_gbs"], bw_end["best_gbs"])
    log(f"bandwidth {bw_end['best_gbs']:.1f} GB/s best at the end; using {bw['best_gbs']:.1f} GB/s")
    doc["summary"] = summarize(results, bw["best_gbs"])
    doc["fill_agreement"] = fill_agreement(results)
    if cfg.json_path is not None:
        atomic_write(cfg.json_path, lambda tmp: tmp.write_text(json.dumps(doc, indent=1)), "--json")
    if cfg.plot_path is not None:
        atomic_write(cfg.plot_path, lambda tmp: plot(doc, tmp), "--plot")
    return doc


def _library() -> dict:
    """The libllama actually loaded (LLAMA_CPP_LIB_PATH can point away from the installed build)."""
    try:
        from llama_cpp import llama_cpp as raw

        return {"libllama": getattr(raw._lib, "_name", None), "LLAMA_CPP_LIB_PATH": os.environ.get("LLAMA_CPP_LIB_PATH")}
    except ImportError:
        return {}


def _llama_cpp_version() -> str | None:
    try:
        import llama_cpp

        return llama_cpp.__version__
    except ImportError:
        return None


def _system_info() -> str | None:
    try:
        import llama_cpp

        return llama_cpp.llama_print_system_info().decode().strip()
    except Exception:  # noqa: BLE001 (informational only)
        return None


# ---- analysis ----------------------------------------------------------------------------

def _primary(results: list) -> dict:
    """(depth, mode) -> the record used for speed-ups: the synthetic fill where measured."""
    out = {}
    for r in results:
        key = (r["depth"], r["mode"])
        if key not in out or r["fill"] == "synthetic":
            out[key] = r
    return out


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
            row = {"depth": depth, "mode": m, "fill": r["fill"], "median_s": r["median_s"],
                   "first_step_s": float(np.median(first)) if first else None,
                   "first_step_vs_base": None,
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
            lines.append(f"  S={fmt_depth(s['depth']):>5} {s['mode']:<11} {s['fill']:<9} {1e3 * s['first_step_s']:>8.1f} ms  "
                         f"{vb:>10}  {s['first_step_s'] / s['median_s']:.2f}x steady")
    if doc.get("fill_agreement"):
        lines.append("")
        lines.append("fill agreement (decode latency after a real prefill vs after the synthetic state load):")
        for a in doc["fill_agreement"]:
            lines.append(f"  S={fmt_depth(a['depth']):>5} {a['mode']:<11} synthetic {1e3 * a['synthetic_median_s']:.1f} ms, "
                         f"prefill {1e3 * a['prefill_median_s']:.1f} ms: {100 * a['rel_diff']:+.1f}% "
                         f"{'ok' if a['agree'] else 'DISAGREE'} (tolerance {100 * a['tolerance']:.0f}%)")
    return "\n".join(lines)


def plot(doc: dict, out_path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
