"""The end-to-end bench's model: the synthetic model it writes or the file it is given, its KV scales, its
Loki projection.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np

from sparq_cpp.bench import machine
from sparq_cpp.bench.e2e_config import BENCH_MODEL_CTX, BenchConfig, fmt_depth
from sparq_cpp.bench.e2e_memory import choose_layers, depth_estimate
from sparq_cpp.calib.pca import LokiPCA
from sparq_cpp.calib.projection import write_projection
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import metadata_value, open_gguf
from sparq_cpp.memory import ModelShape, shape_from_geometry, shape_from_gguf
from sparq_cpp.modelfactory import FACTORY_VERSION, PRESETS, cache_dir, qk_row_std, resolve_geometry, write_model
from sparq_cpp.outfile import fmt_bytes
from sparq_cpp.projection import read_projection

# ---- the model ---------------------------------------------------------------------------

def bench_model_path(preset: str, wtype: str, layers: int) -> Path:
    """The cached synthetic model for the bench: the factory's preset with n_ctx_train 128k."""
    key = json.dumps([FACTORY_VERSION, preset, wtype, layers, BENCH_MODEL_CTX])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / f"bench-{preset}-{wtype}-L{layers}-ctx{BENCH_MODEL_CTX // 1024}k-{digest}.gguf"


def plan_model(cfg: BenchConfig) -> tuple:
    """(path, ModelShape, how it was chosen, geometry to write or None). Writes nothing: for the
    synthetic model the shape comes from its geometry, so every check runs before the write."""
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
    try:
        reader = open_gguf(path)
        preset, seed = metadata_value(reader, "sparq.preset"), metadata_value(reader, "sparq.seed")
        if preset in PRESETS and seed is not None:
            geo = resolve_geometry(preset, layers=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                                   n_head_kv=shape.n_head_kv, n_ff=shape.n_ff, n_vocab=shape.n_vocab)
            k = np.stack([qk_row_std(geo, int(seed), il, geo.n_head_kv) for il in range(shape.n_layer)])
            return (k * math.sqrt(shape.n_embd)).astype(np.float32), None, "model factory row scales"
    except (SparqError, ImportError, TypeError, ValueError):
        pass
    return None, None, "unit"



def loki_projection(cfg: BenchConfig, path: Path, shape: ModelShape, log) -> tuple:
    """(projection file, how it was made) for the Loki mode: --loki-pca checked against the model, or a
    synthetic basis (random orthonormal per layer and KV head, written once next to the model). Decode time
    does not depend on the basis values, only on d, k and the cache, so the synthetic one times Loki
    honestly; it says nothing about Loki's accuracy."""
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
