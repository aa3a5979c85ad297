"""Open a GGUF model in the patched llama.cpp, with the checks that turn bad input into clear errors.

`prepare` is the one path from a model file and a setting to what a context is created with: sparq_cpp.Llama
(sparq_cpp/llama.py, `Llama(path, attention=SparQ(r=16, k=128))`: llama-cpp-python's Llama with the sparse
attention of the patch series switched on) and `sparq-cpp serve` (llama-server) both go through it.
`open_model` is the checked way the commands open a Llama. Nothing here imports llama_cpp.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparq_cpp import auto, lazy, system
from sparq_cpp.attention import ALISA, Attention, Auto, Dense, Loki, SparQ, parse_attention
from sparq_cpp.bindings import sparse_api
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import GGUFSummary, check_gguf, check_sparse, swa_layers
from sparq_cpp.memory import alisa_window_bytes, check_fits, context_estimate, shape_from_gguf
from sparq_cpp.projection import default_projection, read_projection

if TYPE_CHECKING:  # at run time llama_class() imports it on first use (it loads libllama)
    from sparq_cpp.llama import Llama

# The KV cache types sparq-cpp runs (the sparse kernels, the transfer model, the reference and the tests cover
# them), by name, with their ggml type numbers (llama-cpp-python's type_k/type_v, a state file's cells).
CACHE_TYPES = {"f16": 1, "q8_0": 8, "f32": 0}
CACHE_TYPE_NAMES = {v: k for k, v in CACHE_TYPES.items()}


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


GGML_MAX_N_THREADS = 512  # ggml.h: a thread pool holds at most this many


def max_threads() -> int:
    """The most threads accepted: 4 per logical CPU (more only queue for the same cores; a typo
    such as -t 1000 is caught), and never more than ggml's 512."""
    return min(GGML_MAX_N_THREADS, 4 * (os.cpu_count() or 1))


def check_threads(n: int, what: str = "--threads") -> int:
    if not 1 <= n <= max_threads():
        raise SparqError(f"{what} must be in 1..{max_threads()} (4 per logical CPU, at most "
                         f"{GGML_MAX_N_THREADS}), got {n}")
    return n


def c_params(attention, *, creation: bool = False):
    """The C parameters for `attention`; the Loki projection path only at creation (the basis is fixed
    for the context's life, NULL keeps it)."""
    p = sparse_api.default_params()
    if isinstance(attention, SparQ):
        sparse_api.fill(p, mode=sparse_api.LLAMA_SPARSE_ATTN_SPARQ, r=attention.r, k=attention.k, l=attention.local,
                        sink=attention.sink, mean_value=attention.mean_value, min_n_kv=attention.min_n_kv,
                        sparse_prompt=attention.sparse_prompt)
    elif isinstance(attention, Loki):
        sparse_api.fill(p, mode=sparse_api.LLAMA_SPARSE_ATTN_LOKI, d=attention.d, k=attention.k, l=attention.l,
                        sink=attention.sink, min_n_kv=attention.min_n_kv, sparse_prompt=attention.sparse_prompt,
                        loki_pre_rope=attention.variant == "pre")
        if creation and attention.projection is not None:
            p.loki_proj = str(attention.projection).encode()
    elif isinstance(attention, ALISA):
        sparse_api.fill(p, mode=sparse_api.LLAMA_SPARSE_ATTN_ALISA, c=attention.c, min_n_kv=attention.min_n_kv)
    else:
        p.mode = sparse_api.LLAMA_SPARSE_ATTN_DENSE
    return p


def display_name(attention) -> str:
    return {"sparq": "SparQ", "loki": "Loki", "alisa": "ALISA"}.get(attention.name, attention.name)


def check_loki_projection(attention: Loki, model_path) -> Loki:
    """The setting with the projection it will use: the one given, which must exist, be readable and have been
    made for this very model file (its fingerprint); else the model's embedded one; else `<model stem>.loki.gguf`
    next to the model (what `sparq-cpp calibrate` writes). Checked here because llama.cpp can only compare shapes
    and names."""
    if attention.projection is not None:
        read_projection(attention.projection, model_path=model_path, variant=attention.variant)
        return attention
    try:
        read_projection(model_path, variant=attention.variant)
        return attention
    except SparqError as e:
        embedded_error = e
    beside = default_projection(model_path)
    if beside.is_file():
        read_projection(beside, model_path=model_path, variant=attention.variant)
        return dataclasses.replace(attention, projection=str(beside))
    why = "has none embedded" if "no loki.version key" in str(embedded_error) else \
        f"has no usable one embedded ({embedded_error})"
    raise SparqError(f"Loki needs a projection: {model_path} {why} and there is no {beside}; make one with "
                     "`sparq-cpp calibrate` (it writes <model stem>.loki.gguf next to the model) or pass one "
                     "(--loki-pca FILE / Loki(projection=FILE))") from None


def check_alisa(model_path) -> None:
    """ALISA's window follows the cells of one full-attention cache: models with sliding-window layers are
    refused here by name (llama.cpp refuses them too, with a less specific message)."""
    if any(swa_layers(model_path) or ()):
        raise SparqError(f"{model_path}: ALISA cannot run on a model with sliding-window layers (its window of past "
                         "weights follows one full-attention cache); use SparQ or Loki")


def check_context_memory(model_path, summary, attention, *, n_ctx: int, type_k: str, type_v: str, flash_attn: bool,
                         n_batch: int, ubatch_size: int) -> None:
    """Refuses a context whose estimate (sparq_cpp.memory: weights, caches, compute, and llama_cpp's buffer of
    a batch's logits) exceeds the memory free now, before llama.cpp allocates anything, with the numbers."""
    shape = shape_from_gguf(model_path, summary)
    est = context_estimate(shape, kind=attention.name, n_ctx=n_ctx, type_k=type_k, type_v=type_v,
                           flash_attn=flash_attn, ubatch_size=ubatch_size, overhead=n_batch * shape.n_vocab * 4,
                           alisa_c=attention.c if isinstance(attention, ALISA) else None)
    check_fits(est, system.mem_available(), f"{Path(model_path).name} with a context of {n_ctx} tokens",
               "use a smaller context (n_ctx, -c) or a q8_0 cache (cache_type='q8_0', --cache-type q8_0)")


def check_alisa_memory(summary, n_ctx: int, c: float) -> None:
    """ALISA's window grows with the square of the context: refused with the number when it cannot fit
    in the memory free now, before llama.cpp allocates it (beyond RAM a process is killed without a word)."""
    need = alisa_window_bytes(summary.n_layer, n_ctx, c)
    avail = system.mem_available()
    if avail and need > avail:
        raise SparqError(f"ALISA at c = {c:g} and a context of {n_ctx} tokens keeps {need / 2**30:.1f} GiB of past "
                         f"weights ({summary.n_layer} layers x {n_ctx}^2 x c/2 floats), more than the "
                         f"{avail / 2**30:.1f} GiB free; use a smaller context (-c) or c")


def _cache_type_name(value, what: str) -> str:
    """A KV cache type given by name ("q8_0") or as llama-cpp-python's ggml type number (8)."""
    if isinstance(value, str) and value in CACHE_TYPES:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value in CACHE_TYPE_NAMES:
        return CACHE_TYPE_NAMES[value]
    raise SparqError(f"{what}={value!r}: sparq-cpp runs f32, f16 and q8_0 caches (as names, or ggml type numbers "
                     f"0, 1, 8; the sparse kernels and the transfer model cover those)")


CACHE_ARGUMENT_NAMES = ("cache_type", "type_k", "type_v")  # as Llama takes them; the commands: --cache-type, -ctk, -ctv


def cache_types(cache_type=None, type_k=None, type_v=None, *, names=CACHE_ARGUMENT_NAMES) -> tuple[str, str]:
    """(K type, V type) from `cache_type` (both) and `type_k`/`type_v` (names or ggml type numbers); f16 by
    default. A type_k or type_v that contradicts cache_type is refused, not overridden. `names`: how the caller
    spells the three (Llama's arguments, or the commands' --cache-type, -ctk and -ctv) for the errors."""
    both_name, k_name, v_name = names
    both = None if cache_type is None else _cache_type_name(cache_type, both_name)
    out = []
    for what, value in ((k_name, type_k), (v_name, type_v)):
        name = None if value is None else _cache_type_name(value, what)
        if both is not None and name is not None and name != both:
            given = (f"{what} {value} contradicts {both_name} {cache_type}" if what.startswith("-") else
                     f"{what}={value!r} contradicts {both_name}={cache_type!r}")  # an option, or an argument
            raise SparqError(f"{given}; give one of them")
        out.append(name or both or "f16")
    return out[0], out[1]


def as_attention(attention) -> Attention | Auto:
    """A settings object from what Llama and the commands take: one, a string in llama.cpp's syntax
    (parse_attention), or None for Dense()."""
    attention = parse_attention(attention) if isinstance(attention, str) else attention or Dense()
    if not isinstance(attention, (Dense, SparQ, Loki, ALISA, Auto)):
        raise SparqError(f"attention must be Dense(), SparQ(...), Loki(...), ALISA(...), Auto(...) or a string "
                         f"such as 'sparq:r=8,k=32', got {attention!r}")
    return attention


@dataclass(frozen=True)
class Opening:
    """A model file and the setting it is to be opened with, checked by prepare(): what sparq_cpp.Llama creates a
    context with, and what `sparq-cpp serve` starts llama-server with."""

    path: Path
    summary: GGUFSummary
    attention: Attention  # Auto resolved to its choice; Loki with the projection it will read
    type_k: str
    type_v: str
    n_ctx: int  # the context of one sequence the setting was checked for (0 given: the model's training context)
    auto_choice: str | None = None  # Auto: what it chose and why


def prepare(model_path, attention=None, *, n_ctx: int, cache_type=None, type_k=None, type_v=None,
            summary: GGUFSummary | None = None, cache_names=CACHE_ARGUMENT_NAMES) -> Opening:
    """The one way a model is opened with a setting (sparq_cpp.Llama, `sparq-cpp serve`): every check a context
    creation would fail on, once and before anything is loaded, with an error that names what is wrong. The
    model file (check_gguf, unless `summary` is its result already), the setting against it (Auto resolved for
    n_ctx positions of one sequence; n_ctx 0 is the model's training context), the cache types (cache_types, its
    arguments named `cache_names`), Loki's projection and ALISA's refusal of sliding-window models."""
    attention = as_attention(attention)
    summary = check_gguf(model_path) if summary is None else summary
    n_ctx = n_ctx or summary.n_ctx_train
    auto_choice = None
    if isinstance(attention, Auto):
        check_sparse(summary, "auto")
        attention, auto_choice = auto.resolve(attention, model_path, summary, n_ctx)
    if not isinstance(attention, Dense):  # before the head size: a model may have no attention heads at all
        check_sparse(summary, display_name(attention))
    attention.check(summary.head_dim)
    type_k, type_v = cache_types(cache_type, type_k, type_v, names=cache_names)
    if isinstance(attention, Loki):
        attention = check_loki_projection(attention, model_path)
    if isinstance(attention, ALISA):
        check_alisa(model_path)
    return Opening(Path(model_path), summary, attention, type_k, type_v, n_ctx, auto_choice)


def llama_class():
    """sparq_cpp.Llama (sparq_cpp.llama.Llama, a subclass of llama_cpp.Llama), imported on first use so that
    importing sparq_cpp, or a command's --help, does not load libllama."""
    return lazy.need("sparq_cpp.llama", "sparq_cpp.Llama").Llama


def __getattr__(name):  # `from sparq_cpp.llm import Llama` gives the class itself
    if name == "Llama":
        return llama_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_model(path, *, attention=None, n_ctx: int = 4096, n_threads: int | None = None, seed: int = 0,
               cache_type: str | None = None, n_batch: int = 512, logits_all: bool = False,
               flash_attn: bool = True, cache_type_k: str | None = None, cache_type_v: str | None = None,
               n_threads_batch: int | None = None, n_gpu_layers: int | None = None):
    """A checked Llama for `path`: (llm, summary). seed -1: a random one (llama.cpp's LLAMA_DEFAULT_SEED)."""
    if n_ctx < 1:
        raise SparqError(f"--ctx-size must be >= 1, got {n_ctx}")
    n_threads = check_threads(default_threads() if n_threads is None else n_threads)
    n_threads_batch = n_threads if n_threads_batch is None else check_threads(n_threads_batch, "--threads-batch")
    extra = {} if n_gpu_layers is None else {"n_gpu_layers": n_gpu_layers}
    llm = llama_class()(path, attention, cache_type=cache_type, type_k=cache_type_k, type_v=cache_type_v,
                n_ctx=n_ctx, n_batch=min(n_batch, n_ctx),
                n_ubatch=min(n_batch, n_ctx), n_threads=n_threads, n_threads_batch=n_threads_batch,
                seed=0xFFFFFFFF if seed == -1 else seed, flash_attn=flash_attn, logits_all=logits_all, **extra)
    return llm, llm.summary
