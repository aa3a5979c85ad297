"""Methods and the two backends that run them: llama.cpp (dense, sparq, loki, and alisa and exact-topk as
alisa@llama and exact-topk@llama) and the numpy/Numba reference (every method: dense, sparq, loki, exact-topk, h2o, lm-infinite, alisa; its session is
ref_session.py's, which needs numba).

A backend session holds one model context and runs one sample at a time:
``prefill(tokens)`` puts the prompt but its last token into the cache with dense attention;
``use(method, params)`` picks the attention for what follows; ``feed(tokens)`` runs tokens through
the model with it (several tokens: every row through the method, as decoding them one by one would)
and returns their logits; ``rewind()`` drops everything after the prefill, so the settings of a
sweep share one prefill. llama.cpp's sparse contexts keep multi-token prompt batches dense and
decode sparse, so its prefill never hands it a one-token batch; the reference wraps methods in
``DensePrompt`` for the same effect (and H2O accumulates the prompt's attention scores there).

exact-topk@llama is llama.cpp's SparQ with r = the head size, l = 0, no first positions forced in and no mean
value: with every component the approximate scores are the exact softmax (tau = sqrt(D)), so its selection is the
exact top-k of the group-summed softmax, the reference's ExactTopKAttention (docs/spec.md "Baselines"). It runs in
the SparQ context, sharing its prefill.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparq_cpp.attention import ALISA, Dense, Loki, SparQ
from sparq_cpp.errors import SparqError
from sparq_cpp.evaluation.sweep import METHODS
from sparq_cpp.llm import open_model

BACKENDS = ("llama", "ref")
LLAMA_METHODS = ("dense", "sparq", "loki", "alisa", "exact-topk")
DEFAULT_BACKEND = {"dense": "llama", "sparq": "llama", "loki": "llama", "exact-topk": "ref", "h2o": "ref",
                   "lm-infinite": "ref", "alisa": "ref"}


@dataclass(frozen=True)
class MethodSpec:
    method: str
    backend: str

    @property
    def label(self) -> str:
        return self.method if self.backend == DEFAULT_BACKEND[self.method] else f"{self.method}@{self.backend}"


def parse_methods(text: str) -> list[MethodSpec]:
    """'dense,sparq,h2o,sparq@ref,alisa@llama' -> specs; llama.cpp runs dense/sparq/loki (and alisa when asked),
    the reference the rest."""
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        name, _, backend = part.partition("@")
        if name not in METHODS:
            raise SparqError(f"unknown method {name!r} (known: {', '.join(METHODS)}; "
                             f"add @ref or @llama to pick the backend)")
        backend = backend or DEFAULT_BACKEND[name]
        if backend not in BACKENDS:
            raise SparqError(f"unknown backend {backend!r} in {part!r} (known: llama, ref)")
        if backend == "llama" and name not in LLAMA_METHODS:
            raise SparqError(f"{name} runs only on the reference (write {name} or {name}@ref)")
        spec = MethodSpec(name, backend)
        if spec not in out:
            out.append(spec)
    if not out:
        raise SparqError("no methods given")
    return out


def _chunks(n: int, size: int) -> list[int]:
    """Batch sizes covering n tokens, each <= size and none of exactly 1 token unless n == 1
    (llama.cpp would run a one-token batch through the sparse method)."""
    sizes = [size] * (n // size) + ([n % size] if n % size else [])
    if len(sizes) > 1 and sizes[-1] == 1:
        sizes[-2] -= 1
        sizes[-1] = 2
    return sizes


class LlamaSession:
    """One llama.cpp context: a dense one for dense, a SparQ (or Loki) one for the sparse settings."""

    def __init__(self, model_path, method: str, *, n_ctx: int, cache_type: str, threads: int | None,
                 mean_value: bool, loki_projection=None, logits_all: bool = False, alisa_c: float | None = None):
        self.method, self.mean_value, self.loki_projection = method, mean_value, loki_projection
        if method == "dense":
            first = Dense()
        elif method in ("sparq", "exact-topk"):
            first = SparQ(r=1, k=1, mean_value=mean_value)
        elif method == "loki":
            first = self._loki(d=1, k=1)
        elif method == "alisa":
            # the window's memory is sized for the largest c of the sweep; the prompt is attended densely
            first = ALISA(c=alisa_c)
        else:
            raise SparqError(f"{method} does not run on llama.cpp")
        self.n_batch = min(512, n_ctx)
        self.llm, self.summary = open_model(model_path, attention=first, n_ctx=n_ctx, n_threads=threads,
                                            cache_type=cache_type, n_batch=self.n_batch, logits_all=logits_all)
        self.n_vocab = self.llm.n_vocab()
        self.n_prefill = 0
        self._prompt = []

    def _loki(self, **kw):
        return Loki(projection=self.loki_projection, **kw)

    def _attention(self, params: dict, sparse_rows: bool, method: str | None = None):
        if self.method == "dense" or (self.method == "alisa" and not sparse_rows):
            return Dense()
        if method == "exact-topk" or (method is None and self.method == "exact-topk"):
            return SparQ(r=self.summary.head_dim, k=params["k"], l=0, mean_value=False, sparse_prompt=sparse_rows)
        if self.method == "alisa":
            return ALISA(c=params["c"])
        if self.method == "sparq":
            return SparQ(r=params["r"], k=params["k"], l=params["l"], mean_value=self.mean_value,
                         sparse_prompt=sparse_rows, sink=params.get("sink", 0))
        return self._loki(d=params["d"], k=params["k"], l=params.get("l", 0), sparse_prompt=sparse_rows,
                          sink=params.get("sink", 0))

    def _last_logits(self, rows: int) -> np.ndarray:
        ctx = self.llm._ctx
        return np.stack([np.ctypeslib.as_array(ctx.get_logits_ith(i - rows), shape=(self.n_vocab,)).copy()
                         for i in range(rows)]) if rows else np.empty((0, self.n_vocab), np.float32)

    def prefill(self, tokens):
        self._prompt = list(tokens)
        self.llm.n_tokens = 0  # the next eval removes every cell from here on
        if self.method != "dense":  # multi-token batches dense (sparse_prompt off)
            self.llm.set_attention(self._attention({"r": 1, "d": 1, "k": 1, "l": 0}, sparse_rows=False))
        pos = 0
        for size in _chunks(len(tokens), self.n_batch):
            self.llm.eval(tokens[pos: pos + size])
            pos += size
        self.n_prefill = len(tokens)

    def rewind(self):
        # ALISA's window follows the removal of the steps after the prompt only while the ring holds the steps
        # of the prompt's window; else the prompt is attended again (densely, as the first time)
        if self.method == "alisa" and not self.llm._ctx.kv_cache_seq_rm(-1, self.n_prefill, -1):
            attention = self.llm.attention
            self.prefill(self._prompt)
            self.llm.set_attention(attention)
        self.llm.n_tokens = self.n_prefill

    def use(self, params: dict, method: str | None = None):
        """Attend with the session's method, or with llama.cpp's dense attention (method "dense") or exact top-k
        (method "exact-topk") in a SparQ context: its prefill is a dense one, so they share it."""
        if method == "dense" and self.method != "dense":
            self.llm.set_attention(Dense())
        elif self.method != "dense":
            self.llm.set_attention(self._attention(params, sparse_rows=True, method=method))

    def feed(self, tokens) -> np.ndarray:
        if len(tokens) > 1 and not self.llm._logits_all:
            raise SparqError("internal: feeding several tokens needs a context with logits_all")
        out = []
        step = 1 if self.method == "alisa" else self.n_batch  # ALISA's steps are one token each
        for pos in range(0, len(tokens), step):
            batch = list(tokens[pos: pos + step])
            self.llm.eval(batch)
            out.append(self._last_logits(len(batch)))
        return np.concatenate(out)

    def score(self, tokens, targets) -> np.ndarray:
        """Bits (-log2 p) of targets[i] given tokens[:i + 1], the tokens fed one decode step each: one row of
        logits is held at a time, so memory does not grow with the vocabulary times the context (the context
        needs no logits_all)."""
        bits = np.empty(len(targets))
        for i, (token, target) in enumerate(zip(tokens, targets, strict=True)):
            self.llm.eval([token])
            x = self._last_logits(1)[0].astype(np.float64)
            m = x.max()
            bits[i] = (m + np.log(np.exp(x - m).sum()) - x[target]) / np.log(2.0)
        return bits

    def close(self):
        self.llm.close()


def mean_value_default(n_head: int, n_head_kv: int, flag: bool | None) -> bool:
    """The paper turns SparQ's mean-value reallocation off for GQA models; on for MHA."""
    return (n_head == n_head_kv) if flag is None else bool(flag)


def with_mean_value(params: dict, mean_value: bool) -> dict:
    return dict(params, mean_value=mean_value) if "r" in params else params
