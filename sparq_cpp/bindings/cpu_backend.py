"""Which library holds ggml's CPU backend in a build: `libggml-cpu.so`, or, in a portable build (ggml's
GGML_CPU_ALL_VARIANTS), the `libggml-cpu-<variant>.so` that ggml itself would load on this CPU: the one
whose `ggml_backend_score()` is highest (0: the CPU lacks an instruction it needs)."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path


def variants(lib_dir: Path) -> dict[str, int]:
    """variant name -> score on this CPU, for every libggml-cpu-<variant>.so in lib_dir."""
    out = {}
    for path in sorted(lib_dir.glob("libggml-cpu-*.so")):
        name = path.name[len("libggml-cpu-"):-len(".so")]
        try:
            lib = ctypes.CDLL(str(path), mode=getattr(os, "RTLD_LOCAL", 0))
            score = lib.ggml_backend_score
        except (OSError, AttributeError):
            continue
        score.restype = ctypes.c_int
        score.argtypes = []
        out[name] = int(score())
    return out


def cpu_library(lib_dir: Path) -> tuple[Path, str | None]:
    """(the CPU backend's library, the variant's name or None for a single-variant build)."""
    single = lib_dir / "libggml-cpu.so"
    if single.exists():
        return single, None
    scores = variants(lib_dir)
    usable = {n: s for n, s in scores.items() if s > 0}
    if not usable:
        raise FileNotFoundError(f"no libggml-cpu.so in {lib_dir}, and no libggml-cpu-<variant>.so that runs on this "
                                f"CPU (found {sorted(scores) or 'none'})")
    best = max(usable, key=lambda n: usable[n])  # ggml_backend_load_best keeps the first of equal scores
    return lib_dir / f"libggml-cpu-{best}.so", best
