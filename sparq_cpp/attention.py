"""User-facing attention settings: Dense(), SparQ(...), Loki(...) and ALISA(...), checked against a model's geometry."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from sparq_cpp import transfer
from sparq_cpp.bindings import sparse_api
from sparq_cpp.errors import SparqError

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def _check_int32(settings, names) -> None:
    """These settings go into int32 fields of the C API, where ctypes would silently wrap a larger
    value (k = 2**32 + 5 runs as k = 5); refuse what does not fit, and non-integers. None = unset."""
    for name in names:
        value = getattr(settings, name)
        if value is None:
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise SparqError(f"{name} must be an integer, got {value!r}")
        if not INT32_MIN <= value <= INT32_MAX:
            raise SparqError(f"{name} must be in {INT32_MIN}..{INT32_MAX} (a C int32), got {value}")


def _check_sink(settings) -> None:
    if not 0 <= settings.sink <= settings.k - settings.local:
        raise SparqError(f"sink must be in 0..k - l ({settings.k - settings.local}), got {settings.sink}")


@dataclass(frozen=True)
class Dense:
    """llama.cpp's own attention (flash attention)."""

    name = "dense"

    def check(self, head_dim: int) -> None:
        pass

    def reads(self, n_kv: int, head_dim: int, cache_type: str = "f16") -> float:
        """Bytes of attention data one decode step reads per KV head (docs/spec.md transfer model)."""
        return transfer.dense_bytes(n_kv, head_dim, cache_type)


@dataclass(frozen=True)
class SparQ:
    """SparQ Attention (Ribar et al., 2024): rank positions with the r largest |q| components,
    attend to the top k (the l most recent always among them), mean-value reallocation.

    l=None means k // 4, as in the paper. The paper turns mean_value off for GQA models such as
    Llama 3 and Mistral; here it is on unless you say otherwise. sink: positions below it (the first
    tokens, where many models park attention whatever the query) are always among the k.
    """

    r: int = 16
    k: int = 128
    l: int | None = None
    mean_value: bool = True
    min_n_kv: int = 0
    sparse_prompt: bool = False
    sink: int = 0

    name = "sparq"

    def __post_init__(self):
        _check_int32(self, ("r", "k", "l", "min_n_kv", "sink"))
        # what needs no model is checked here, not when a context first uses the setting
        if self.r < 1:
            raise SparqError(f"r must be >= 1 (and at most the model's head size), got {self.r}")
        if self.k < 1:
            raise SparqError(f"k must be >= 1, got {self.k}")

    @property
    def local(self) -> int:
        return self.k // 4 if self.l is None else self.l

    def check(self, head_dim: int) -> None:
        if not 1 <= self.r <= head_dim:
            raise SparqError(f"r must be in 1..{head_dim} (the model's head size), got {self.r}")
        if self.k < 1:
            raise SparqError(f"k must be >= 1, got {self.k}")
        if not 0 <= self.local <= self.k:
            raise SparqError(f"l must be in 0..k ({self.k}), got {self.local}")
        _check_sink(self)
        if self.min_n_kv < 0:
            raise SparqError(f"min_n_kv must be >= 0, got {self.min_n_kv}")

    def reads(self, n_kv: int, head_dim: int, cache_type: str = "f16") -> float:
        kt_type = "f32" if cache_type == "f32" else "f16"
        return transfer.sparq_bytes(n_kv, head_dim, self.r, self.k, cache_type, kt_type)


@dataclass(frozen=True)
class Loki:
    """Loki (Singhania et al., 2024): q and k rotated into the keys' principal basis (per layer and KV
    head, from `sparq-cpp calibrate`), positions ranked with the first d components, attend to the top k
    (the l most recent always among them; l=0 by default, as in the paper). No mean value. sink: positions
    below it are always among the k (an attention sink: Loki's first components often rank it low).

    projection: the projection GGUF (None = the tensors embedded in the model by `calibrate --embed`);
    variant: the basis calibrated on keys "post" (default) or "pre" RoPE.
    """

    d: int = 32
    k: int = 128
    l: int = 0
    projection: str | None = None
    variant: str = "post"
    min_n_kv: int = 0
    sparse_prompt: bool = False
    sink: int = 0

    name = "loki"

    def __post_init__(self):
        _check_int32(self, ("d", "k", "l", "min_n_kv", "sink"))
        if self.d < 1:
            raise SparqError(f"d must be >= 1 (and at most the model's head size), got {self.d}")
        if self.k < 1:
            raise SparqError(f"k must be >= 1, got {self.k}")

    @property
    def local(self) -> int:
        return self.l

    def check(self, head_dim: int) -> None:
        if not 1 <= self.d <= head_dim:
            raise SparqError(f"d must be in 1..{head_dim} (the model's head size), got {self.d}")
        if self.k < 1:
            raise SparqError(f"k must be >= 1, got {self.k}")
        if not 0 <= self.l <= self.k:
            raise SparqError(f"l must be in 0..k ({self.k}), got {self.l}")
        _check_sink(self)
        if self.variant not in ("pre", "post"):
            raise SparqError(f"variant must be 'pre' or 'post', got {self.variant!r}")
        if self.min_n_kv < 0:
            raise SparqError(f"min_n_kv must be >= 0, got {self.min_n_kv}")

    def reads(self, n_kv: int, head_dim: int, cache_type: str = "f16") -> float:
        return transfer.loki_bytes(n_kv, head_dim, self.d, self.k, cache_type)


@dataclass(frozen=True)
class ALISA:
    """ALISA's Sparse Window Attention (Zhao et al., 2024): at a step that sees n positions, the
    k = floor(n*c/2) most recent ones and the k others with the largest attention weights of the last k
    steps (summed over heads) are attended, 2k in all. The cache keeps those weights of each of the last
    steps: about n_ctx**2 * c/2 floats per layer, so memory grows with the square of the context. One
    sequence per context; c can be lowered later, not raised. No mean value.
    """

    c: float = 0.125
    min_n_kv: int = 0

    name = "alisa"

    def __post_init__(self):
        _check_int32(self, ("min_n_kv",))
        # above 1 every position is kept (the tests' way to compare with dense); the CLI takes (0, 1]
        if isinstance(self.c, bool) or not isinstance(self.c, numbers.Real) or not math.isfinite(self.c) or self.c <= 0:
            raise SparqError(f"c must be a finite number > 0 (ALISA's caching ratio), got {self.c!r}")

    def check(self, head_dim: int) -> None:
        if self.min_n_kv < 0:
            raise SparqError(f"min_n_kv must be >= 0, got {self.min_n_kv}")

    def window(self, n_kv: int) -> int:
        return transfer.alisa_window(n_kv, self.c)

    def reads(self, n_kv: int, head_dim: int, cache_type: str = "f16") -> float:
        return transfer.alisa_bytes(n_kv, head_dim, self.c, cache_type)


@dataclass(frozen=True)
class Auto:
    """The SparQ or Loki setting with the best measured fidelity within `ratio` of dense reads, chosen from the
    model's calibration (`sparq-cpp calibrate` measures it; sparq_cpp.auto resolves it when a context is
    created, for its n_ctx). projection: the calibration GGUF (None = <model stem>.loki.gguf next to the model).
    max_loss: refuse a choice whose calibration probe measured it losing more than this share of dense's bits per
    character on any domain (0.03: 3%), naming the smallest measured ratio within it; None: no bound.
    """

    ratio: float = 0.125
    projection: str | None = None
    max_loss: float | None = None

    name = "auto"

    def __post_init__(self):
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, numbers.Real) or not 0 < self.ratio < 1:
            raise SparqError(f"ratio must be a number in (0, 1): attention data read / dense, got {self.ratio!r}")
        if self.max_loss is not None and (isinstance(self.max_loss, bool) or not isinstance(self.max_loss, numbers.Real)
                                          or not 0 < self.max_loss < 1):
            raise SparqError(f"max_loss must be a number in (0, 1): bits per character lost / dense's, got "
                             f"{self.max_loss!r}")

    def check(self, head_dim: int) -> None:
        pass


Attention = Dense | SparQ | Loki | ALISA


def spec(attention: Attention) -> str:
    """The setting string of `attention` as llama.cpp reads it (--sparse-attn, llama_sparse_attn_parse):
    "dense", "sparq:r=16,k=128,...", "loki:d=32,...,proj=FILE", "alisa:c=0.125,..."."""
    if isinstance(attention, SparQ):
        local = "" if attention.l is None else f"l={attention.l},"  # left out: llama.cpp's default, k/4
        local += f"sink={attention.sink}," if attention.sink else ""
        return (f"sparq:r={attention.r},k={attention.k},{local}mv={int(attention.mean_value)},"
                f"min_n_kv={attention.min_n_kv},prompt={'sparse' if attention.sparse_prompt else 'dense'}")
    if isinstance(attention, Loki):
        sink = f"sink={attention.sink}," if attention.sink else ""
        out = (f"loki:d={attention.d},k={attention.k},l={attention.l},{sink}min_n_kv={attention.min_n_kv},"
               f"prompt={'sparse' if attention.sparse_prompt else 'dense'},variant={attention.variant}")
        return out + (f",proj={attention.projection}" if attention.projection is not None else "")
    if isinstance(attention, ALISA):
        return f"alisa:c={attention.c!r},min_n_kv={attention.min_n_kv}"
    if isinstance(attention, Auto):  # sparq-cpp's own: llama.cpp's tools take the setting it resolves to
        return (f"auto:ratio={attention.ratio!r}" + (f",proj={attention.projection}" if attention.projection else "")
                + (f",max_loss={attention.max_loss!r}" if attention.max_loss is not None else ""))
    return "dense"


def _parse_auto(text: str) -> Auto:
    """"auto[:ratio=0.125,proj=FILE,max_loss=0.03]" (ratio and max_loss also as fractions, 1/8)."""
    head, _, rest = text.partition(":")
    if head != "auto":
        raise SparqError(f"attention spec {text!r}: expected auto[:ratio=R,proj=FILE,max_loss=B]")
    kw: dict = {}
    seen: set = set()
    for item in rest.split(",") if rest else []:
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise SparqError(f"attention spec {text!r}: {item!r} is not key=value")
        if key in seen:
            raise SparqError(f"attention spec {text!r}: {key} given twice")
        seen.add(key)
        if key in ("ratio", "max_loss"):
            try:
                kw[key] = float(Fraction(value))
            except (ValueError, ZeroDivisionError):
                raise SparqError(f"attention spec {text!r}: {key} {value!r} is not a number or fraction like 1/8") \
                    from None
        elif key == "proj":
            kw["projection"] = value
        else:
            raise SparqError(f"attention spec {text!r}: unknown key {key!r} for auto (ratio, proj, max_loss)")
    return Auto(**kw)


def _written(text: str, key: str) -> str | None:
    """The value of `key` as written in a setting string that llama.cpp's parser accepted."""
    for item in text.partition(":")[2].split(","):
        name, eq, value = item.partition("=")
        if name == key and eq:
            return value
    return None


def _exceeds(written: str, parsed: float, bound) -> bool:
    """Whether the number as written is above `bound`, exactly: llama.cpp reads it as a float32, which rounds
    1.0000001 down to 1. Hex floats and the like, which Decimal does not read, are compared as parsed."""
    try:
        return Decimal(written.strip()) > bound
    except InvalidOperation:
        return parsed > bound


def parse_attention(text: str) -> Attention | Auto:
    """Settings from a string as llama.cpp reads it (the tools' --sparse-attn, LLAMA_SPARSE_ATTN):
    "sparq:r=8,k=32", "loki:d=32,k=128,proj=model.loki.gguf", "alisa:c=0.125", "dense"; keys left out keep
    their defaults. Parsed by llama.cpp itself (llama_sparse_attn_parse), so both read it the same way.
    Keys: sparq r, k, l, sink, mv (1/0), min_n_kv, prompt (dense|sparse); loki d, k, l, sink, min_n_kv, prompt, proj,
    variant (post|pre); alisa c (in (0, 1], compared as written), min_n_kv. No spaces, each key once. "auto:ratio=0.125[,proj=FILE]" is this
    package's own (sparq_cpp.auto resolves it when the model is opened)."""
    if not isinstance(text, str):
        raise SparqError(f"attention spec must be a string, got {text!r}")
    if text == "auto" or text.startswith("auto:"):
        return _parse_auto(text)
    p = sparse_api.parse(text)
    prompt = bool(p.sparse_prompt)
    if p.mode == sparse_api.LLAMA_SPARSE_ATTN_SPARQ:
        return SparQ(r=p.r, k=p.k, l=None if p.l < 0 else p.l, mean_value=bool(p.mean_value), min_n_kv=p.min_n_kv,
                     sparse_prompt=prompt, sink=p.sink)
    if p.mode == sparse_api.LLAMA_SPARSE_ATTN_LOKI:
        proj = p.loki_proj.decode() if p.loki_proj else None
        return Loki(d=p.d, k=p.k, l=p.l, projection=proj, variant="pre" if p.loki_pre_rope else "post",
                    min_n_kv=p.min_n_kv, sparse_prompt=prompt, sink=p.sink)
    if p.mode == sparse_api.LLAMA_SPARSE_ATTN_ALISA:
        written = _written(text, "c")
        if written is not None and _exceeds(written, p.c, 1):
            raise SparqError(f"attention spec {text!r}: c must be at most 1 (ALISA's caching ratio, a share of the "
                             f"positions in (0, 1]), got {written}")
        return ALISA(c=float(f"{p.c:.7g}"), min_n_kv=p.min_n_kv)  # c as written, not its float32 neighbour
    return Dense()
