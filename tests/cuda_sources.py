"""Where the CUDA tests find the patched llama.cpp of the current series and the installed ggml libraries."""
from __future__ import annotations

import os
from pathlib import Path

from sparq_cpp.bindings.cpu_backend import cpu_library
from sparq_cpp.pyext.patchtree import patch_tree, series_hash
from sparq_cpp.pyext.upstream import fetch_sdist, unpack_sdist

KERNEL = "ggml/src/ggml-cuda/sparse-attn.cu"

# trees unpacked in this test session, by series hash
_UNPACKED: dict[str, Path] = {}


def _installed_record() -> dict | None:
    try:
        from sparq_cpp.pyext.build import installed_build
    except ImportError:
        return None
    return installed_build()


def installed_tree() -> Path | None:
    """The installed build's patched llama.cpp, if it was built from the current series."""
    rec = _installed_record()
    if not rec or rec.get("series_hash") != series_hash():
        return None
    for top in (Path(rec["root"]) / "src").glob("*"):
        llama = top / "vendor" / "llama.cpp"
        if (llama / "ggml" / "src" / "ggml-cuda" / "ggml-cuda.cu").is_file():
            return llama
    return None


def patched_tree(tmp_dir: Path) -> Path:
    """$SPARQ_CUDA_COMPILE_TREE (another patched tree, e.g. `make tree` before `make export`), else the installed
    build's tree if it was built from the current series, else the pinned sdist unpacked into tmp_dir with the
    series applied (about 15 s, once per test session)."""
    env = os.environ.get("SPARQ_CUDA_COMPILE_TREE")
    if env:
        return Path(env)
    tree = installed_tree()
    if tree is None:
        key = series_hash()
        tree = _UNPACKED.get(key)
        if tree is None or not tree.is_dir():
            top = unpack_sdist(fetch_sdist(log=lambda *_: None), tmp_dir)
            tree = _UNPACKED[key] = top / "vendor" / "llama.cpp"
            patch_tree(tree)
    return tree


def installed_lib_dir() -> Path | None:
    """The folder of the installed build's libggml*.so (the CPU op is the reference)."""
    rec = _installed_record()
    if not rec:
        return None
    d = Path(rec["root"]) / "cmake-build" / "bin"
    return d if (d / "libggml-base.so").exists() and _has_cpu(d) else None


def _has_cpu(d: Path) -> bool:
    try:
        cpu_library(d)
        return True
    except FileNotFoundError:
        return False


def installed_cpu_link(lib_dir: Path) -> str:
    """The linker flag for the CPU backend this machine runs: libggml-cpu.so, or a portable build's variant."""
    path, variant = cpu_library(lib_dir)
    return "-lggml-cpu" if variant is None else f"-l:{path.name}"
