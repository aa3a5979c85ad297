"""Open a GGUF model in the patched llama.cpp, with the checks that turn bad input into clear errors."""
from __future__ import annotations

import os
from pathlib import Path

from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import GGUFSummary, check_gguf

CACHE_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise SparqError(f"llama-cpp-python is not installed here ({e}); run `make setup`") from None
    return llama_cpp


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def open_model(path, *, n_ctx: int = 4096, n_threads: int | None = None, seed: int = 0,
               flash_attn: bool = True, cache_type: str = "f16", n_batch: int = 512,
               logits_all: bool = False) -> tuple["object", GGUFSummary]:
    """A llama_cpp.Llama for `path` after checking the file; returns (llm, summary)."""
    summary = check_gguf(path)
    if n_ctx < 1:
        raise SparqError(f"--ctx-size must be >= 1, got {n_ctx}")
    if cache_type not in CACHE_TYPES:
        raise SparqError(f"cache type {cache_type!r} is not one of {', '.join(CACHE_TYPES)}")
    n_threads = n_threads or default_threads()
    if n_threads < 1:
        raise SparqError(f"--threads must be >= 1, got {n_threads}")
    llama_cpp = import_llama_cpp()
    try:
        llm = llama_cpp.Llama(
            model_path=str(Path(path)), n_ctx=n_ctx, n_batch=min(n_batch, n_ctx),
            n_ubatch=min(n_batch, n_ctx), n_threads=n_threads, n_threads_batch=n_threads,
            seed=seed, flash_attn=flash_attn, type_k=CACHE_TYPES[cache_type],
            type_v=CACHE_TYPES[cache_type], logits_all=logits_all, verbose=False,
        )
    except (ValueError, RuntimeError) as e:
        raise SparqError(f"llama.cpp could not load {path}: {e}") from None
    return llm, summary
