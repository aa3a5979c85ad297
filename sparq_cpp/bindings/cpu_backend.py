"""ggml's backends as the installed build has them. Which library holds the CPU backend: `libggml-cpu.so`, or, in
a portable build (ggml's GGML_CPU_ALL_VARIANTS), the `libggml-cpu-<variant>.so` that ggml itself would load on
this CPU: the one whose `ggml_backend_score()` is highest (0: the CPU lacks an instruction it needs). And what
libllama's ggml registered: asked of the libggml that libllama uses (a wheel holds libggml.so and libggml.so.0
as two files, each with its own registry)."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from sparq_cpp import lazy


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


def _registry():
    lib = lazy.llama_cpp("llama_cpp")._lib
    for name, res, args in (("ggml_backend_reg_count", ctypes.c_size_t, []),
                            ("ggml_backend_reg_get", ctypes.c_void_p, [ctypes.c_size_t]),
                            ("ggml_backend_reg_name", ctypes.c_char_p, [ctypes.c_void_p]),
                            ("ggml_backend_dev_count", ctypes.c_size_t, []),
                            ("ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t]),
                            ("ggml_backend_dev_type", ctypes.c_int, [ctypes.c_void_p])):
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


def backend_names() -> list[str]:
    """Names of the ggml backends the build registered (CPU, CUDA, RPC, ...)."""
    lib = _registry()
    return [lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)).decode() for i in range(lib.ggml_backend_reg_count())]


GPU_DEVICE_TYPES = (1, 2)  # GGML_BACKEND_DEVICE_TYPE_GPU, _IGPU


def gpu_device_count() -> int:
    """GPU devices ggml registered (CUDA, ...); RPC servers count only once added with --rpc."""
    lib = _registry()
    return sum(lib.ggml_backend_dev_type(lib.ggml_backend_dev_get(i)) in GPU_DEVICE_TYPES
               for i in range(lib.ggml_backend_dev_count()))
