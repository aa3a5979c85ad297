"""The end-to-end bench's settings: its modes, the configuration, and their checks before anything runs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path


from sparq_cpp import lazy
from sparq_cpp.bench import machine
from sparq_cpp.bindings import sparse_api
from sparq_cpp.errors import SparqError
from sparq_cpp.llm import check_threads, default_threads
from sparq_cpp.memory import GIB, MIB
from sparq_cpp.outfile import check_writable, fmt_bytes

SCHEMA = "sparq-cpp-bench/1"
DEFAULT_DEPTHS = "1k,2k,4k,8k,16k,32k"
DEFAULT_MODES = "dense-fa,dense-nofa,dense-q8kv,sparq"
FILLS = ("synthetic", "prefill", "both")
AGREE_TOL = 0.05
BENCH_MODEL_CTX = 131072  # n_ctx_train written into the default synthetic model


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
    l: int | None = None  # SparQ's; None: k // 4, as everywhere
    d: int = 32
    loki_l: int = 0
    sink: int = 0         # SparQ's and Loki's first positions always kept
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
    block: int = 4        # steps of one mode per turn when modes alternate (after one untimed step)
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


def parse_modes(text, known=None) -> list:
    """'sparq,dense-fa' or a list -> the names in order, no duplicates; each one of `known` (the e2e bench's MODES)."""
    known = MODES if known is None else known
    items = [str(x).strip() for x in (text if isinstance(text, (list, tuple)) else str(text).split(",")) if str(x).strip()]
    if not items:
        raise SparqError("--modes: give at least one mode")
    for name in items:
        if name not in known:
            raise SparqError(f"--modes: unknown mode {name!r} (choose from {', '.join(known)})")
    return list(dict.fromkeys(items))


def fmt_depth(s: int) -> str:
    return f"{s // 1024}k" if s % 1024 == 0 else str(s)


# the settings named as the command spells them (the attention group's options, cli.options)
_OPTIONS = {"r": "--sparq-r", "k": "--sparse-k", "d": "--loki-d"}


def _option(name: str) -> str:
    return _OPTIONS.get(name, "--" + name.replace("_", "-"))


def validate(cfg: BenchConfig) -> BenchConfig:
    """Check everything that needs no model: numbers, modes, the build, output paths."""
    cfg = replace(cfg, depths=parse_depths(cfg.depths), modes=parse_modes(cfg.modes))
    if cfg.fill not in FILLS:
        raise SparqError(f"--fill: unknown {cfg.fill!r} (choose from {', '.join(FILLS)})")
    for name in ("repeats", "rounds", "r", "k", "d", "prefill_batch", "block"):
        if getattr(cfg, name) < 1:
            raise SparqError(f"{_option(name)}: must be >= 1, got {getattr(cfg, name)}")
    if cfg.l is None:
        cfg = replace(cfg, l=cfg.k // 4)
    for name in ("warmup", "prefill_max"):
        if getattr(cfg, name) < 0:
            raise SparqError(f"{_option(name)}: must be >= 0, got {getattr(cfg, name)}")
    if not 0 <= cfg.l <= cfg.k:
        raise SparqError(f"--sparse-l: SparQ's l must be in 0..k ({cfg.k}), got {cfg.l}")
    if not 0 <= cfg.loki_l <= cfg.k:
        raise SparqError(f"--sparse-l: Loki's l must be in 0..k ({cfg.k}), got {cfg.loki_l}")
    if not 0 <= cfg.sink <= cfg.k - max(cfg.l, cfg.loki_l):
        raise SparqError(f"--sparse-sink: must be in 0..k - l ({cfg.k - max(cfg.l, cfg.loki_l)}), got {cfg.sink}")
    if cfg.loki_pca is not None and not Path(cfg.loki_pca).is_file():
        raise SparqError(f"--loki-pca: file not found: {cfg.loki_pca}")
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
    return default_threads()


def _check_build(modes: list) -> None:
    lazy.llama_cpp()
    kinds = {MODES[m].kind for m in modes}
    if kinds - {"dense"}:
        if not sparse_api.available():
            bad = [m for m in modes if not MODES[m].dense]
            raise SparqError(f"--modes {','.join(bad)}: the installed llama.cpp has no sparse attention "
                             "API; run `make setup` to build the patched one")
