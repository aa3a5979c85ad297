"""Open a GGUF model in the patched llama.cpp, with the checks that turn bad input into clear errors.

`sparq_cpp.Llama(path, attention=SparQ(r=16, k=128))` is llama-cpp-python's Llama with the sparse
attention of the patch series switched on; `open_model` is the checked way the CLI opens one.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sparq_cpp import auto, lazy, system
from sparq_cpp.attention import ALISA, Attention, Auto, Dense, Loki, SparQ, parse_attention
from sparq_cpp.bindings import sparse_api
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import GGUFSummary, check_gguf, check_sparse, swa_layers
from sparq_cpp.memory import alisa_window_bytes, check_fits, context_estimate, shape_from_gguf
from sparq_cpp.projection import default_projection, read_projection

CACHE_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}  # name -> ggml type number (llama-cpp-python's type_k/type_v)
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


def cache_types(cache_type=None, type_k=None, type_v=None) -> tuple[str, str]:
    """(K type, V type) from `cache_type` (both) and llama-cpp-python's `type_k`/`type_v`; f16 by default.
    A type_k or type_v that contradicts cache_type is refused, not overridden."""
    both = None if cache_type is None else _cache_type_name(cache_type, "cache_type")
    out = []
    for what, value in (("type_k", type_k), ("type_v", type_v)):
        name = None if value is None else _cache_type_name(value, what)
        if both is not None and name is not None and name != both:
            raise SparqError(f"{what}={value!r} contradicts cache_type={cache_type!r}; pass one of them")
        out.append(name or both or "f16")
    return out[0], out[1]


def _llama_class():
    llama_cpp = lazy.llama_cpp()

    class Llama(llama_cpp.Llama):
        """llama_cpp.Llama with an `attention` setting: Dense(), SparQ(...), Loki(...) or ALISA(...), or the
        same as a string in LLAMA_SPARSE_ATTN's syntax ("sparq:r=8,k=32", "loki:d=32,proj=m.loki.gguf",
        "alisa:c=0.125", "dense"); or Auto(ratio=0.125) ("auto:ratio=0.125"): the setting with the best fidelity
        the model's calibration measured within that budget (sparq_cpp.auto; `auto_choice` says which and why).

        What a mode keeps in the cache (SparQ: a transposed copy of K and the V sums; Loki: keys in the
        projection's basis; ALISA: a window of past attention weights) is decided when the context is
        created, so pass the attention here; `set_attention` then changes the settings between decode
        calls without recreating the context. The KV cache types are `cache_type` for both, or
        llama-cpp-python's `type_k`/`type_v` (names or ggml type numbers): f32, f16 (default) or q8_0.
        Errors are SparqError, a ValueError whose message names what is wrong.
        """

        def __init__(self, model_path: str | os.PathLike, attention: Attention | str | None = None, *,
                     cache_type: str | None = None, **kwargs) -> None:
            attention = parse_attention(attention) if isinstance(attention, str) else attention or Dense()
            if not isinstance(attention, (Dense, SparQ, Loki, ALISA, Auto)):
                raise SparqError(f"attention must be Dense(), SparQ(...), Loki(...), ALISA(...), Auto(...) or a string "
                                 f"such as 'sparq:r=8,k=32', got {attention!r}")
            summary = check_gguf(model_path)
            self.auto_choice: str | None = None  # why Auto resolved to what it did
            if isinstance(attention, Auto):
                check_sparse(summary, "auto")
                attention, self.auto_choice = auto.resolve(attention, model_path, summary,
                                                           kwargs.get("n_ctx", 512) or summary.n_ctx_train)
            sparse = not isinstance(attention, Dense)
            if sparse:  # before the head size: a model may have no attention heads at all
                check_sparse(summary, display_name(attention))
            attention.check(summary.head_dim)
            type_k, type_v = cache_types(cache_type, kwargs.pop("type_k", None), kwargs.pop("type_v", None))
            kwargs.setdefault("verbose", False)
            kwargs.update(type_k=CACHE_TYPES[type_k], type_v=CACHE_TYPES[type_v])
            if isinstance(attention, Loki):
                attention = check_loki_projection(attention, model_path)
            if isinstance(attention, ALISA):
                check_alisa(model_path)
                n_ctx = kwargs.get("n_ctx", 512) or summary.n_ctx_train
                check_alisa_memory(summary, -(-n_ctx // 256) * 256, attention.c)  # llama.cpp pads to 256 cells
            if sparse:
                if kwargs.get("flash_attn") is False:
                    raise SparqError(f"{attention.name} needs flash attention (V stored row-major); "
                                     "do not pass flash_attn=False")
                kwargs["flash_attn"] = True
                # the mode the context is created for, in llama_context_params (patches/bindings)
                kwargs["sparse_attn"] = c_params(attention, creation=True)
            check_context_memory(model_path, summary, attention,
                                 n_ctx=kwargs.get("n_ctx", 512) or summary.n_ctx_train, type_k=type_k, type_v=type_v,
                                 flash_attn=bool(kwargs.get("flash_attn")),
                                 n_batch=kwargs.get("n_batch", 512), ubatch_size=kwargs.get("n_ubatch", 512))
            try:
                super().__init__(model_path=str(model_path), **kwargs)
            except (ValueError, RuntimeError) as e:
                raise SparqError(f"llama.cpp could not load {model_path} with {attention.name} attention: {e}") from None
            self.summary: GGUFSummary = summary
            self.cache_type_k, self.cache_type_v = type_k, type_v
            self.cache_type: str | None = type_k if type_k == type_v else None  # None: K and V differ
            self.attention = attention
            self._alisa_window = isinstance(attention, ALISA)  # the context keeps ALISA's window of past weights
            self._prompt_next = False  # set by generate: its next eval is the part of a prompt not cached

        def generate(self, tokens, *args, **kwargs):
            self._prompt_next = True  # the next eval is this prompt's (what llama_cpp did not find cached)
            return super().generate(tokens, *args, **kwargs)

        def eval(self, tokens) -> None:
            """llama_cpp's eval, which first removes the cached positions from n_tokens on. An ALISA context
            refuses to remove what its window cannot follow (the middle, or too much of the end): then the
            kept tokens are processed again as a prompt, as llama-server does, before `tokens`.

            A prompt that was all cached but its last token (llama_cpp's prefix reuse re-evaluates that one for
            its logits) is evaluated with the token before it, as one batch: alone it would be a sparse decode
            step where the first time the prompt batch attended densely, and the same request would give
            another text (llama-server does the same)."""
            if self._prompt_next:
                self._prompt_next = False
                if len(tokens) == 1 and self.n_tokens > 0 and not isinstance(self.attention, Dense):
                    self.n_tokens -= 1
                    tokens = [int(self.input_ids[self.n_tokens]), *tokens]
            if self._alisa_window and not self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1):
                keep = [int(t) for t in self.input_ids[: self.n_tokens]]
                self._ctx.kv_cache_clear()
                self.n_tokens = 0
                if keep:
                    super().eval(keep)
            super().eval(tokens)
            if not self._logits_all and tokens:
                # llama-cpp-python 0.3.36 leaves `scores` unwritten without logits_all; earlier versions kept the
                # last position's logits there, and reading that row would otherwise return stale memory
                logits = np.ctypeslib.as_array(self._ctx.get_logits_ith(-1), shape=(self._n_vocab,))
                self.scores[self.n_tokens - 1, :] = logits

        def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
            """llama_cpp's tokenize, with a buffer sized by the text: llama-cpp-python sizes it by the model's
            training context, 8 GiB for a file that claims 2^31 tokens. A text of n bytes has at most n + 2."""
            lc = lazy.llama_cpp()
            n_max = len(text) + 8
            while True:
                buf = (lc.llama_token * n_max)()
                n = lc.llama_tokenize(self._model.vocab, text, len(text), buf, n_max, add_bos, special)
                if n >= 0:
                    return list(buf[:n])
                if -n <= n_max:
                    raise SparqError(f"llama.cpp could not tokenize the text ({n})")
                n_max = -n

        def close(self) -> None:
            if hasattr(self, "_stack"):  # a constructor that raised leaves nothing to close
                super().close()

        def set_attention(self, attention: Attention | str) -> None:
            """Change the attention between decode calls, without a new context (a settings object or a string
            as in the constructor). Within what the context was created with: a SparQ context switches to other
            SparQ settings or Dense(); a Loki context to other d, k, l (its basis stays) or Dense(); an ALISA
            context to Dense() or a c no larger than the one it was created with; a dense context stays dense.
            What the context cannot do is refused with SparqError."""
            if isinstance(attention, str):
                attention = parse_attention(attention)
            attention.check(self.summary.head_dim)
            sparse_api.set_params(self._ctx.ctx, c_params(attention))
            self.attention = attention

    return Llama


if TYPE_CHECKING:  # what llama_class() makes, declared for type checkers and IDEs
    import llama_cpp

    class Llama(llama_cpp.Llama):
        summary: GGUFSummary
        attention: Attention
        cache_type: str | None
        cache_type_k: str
        cache_type_v: str

        def __init__(self, model_path: str | os.PathLike, attention: Attention | str | None = None, *,
                     cache_type: str | None = None, **kwargs: Any) -> None: ...

        def set_attention(self, attention: Attention | str) -> None: ...


_LLAMA = None


def llama_class():
    """The Llama class: a subclass of llama_cpp.Llama, made on first use so that importing sparq_cpp does
    not need llama-cpp-python."""
    global _LLAMA
    if _LLAMA is None:
        _LLAMA = _llama_class()
        _LLAMA.__module__, _LLAMA.__qualname__ = __name__, "Llama"
    return _LLAMA


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
