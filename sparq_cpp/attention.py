"""User-facing attention settings: Dense(), SparQ(...), Loki(...) and ALISA(...), checked against a model's geometry."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from sparq_cpp import transfer
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
    Llama 3 and Mistral; here it is on unless you say otherwise.
    """

    r: int = 16
    k: int = 128
    l: int | None = None
    mean_value: bool = True
    min_n_kv: int = 0
    sparse_prompt: bool = False

    name = "sparq"

    def __post_init__(self):
        _check_int32(self, ("r", "k", "l", "min_n_kv"))

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
        if self.min_n_kv < 0:
            raise SparqError(f"min_n_kv must be >= 0, got {self.min_n_kv}")

    def reads(self, n_kv: int, head_dim: int, cache_type: str = "f16") -> float:
        kt_type = "f32" if cache_type == "f32" else "f16"
        return transfer.sparq_bytes(n_kv, head_dim, self.r, self.k, cache_type, kt_type)


@dataclass(frozen=True)
class Loki:
    """Loki (Singhania et al., 2024): q and k rotated into the keys' principal basis (per layer and KV
    head, from `sparq-cpp calibrate`), positions ranked with the first d components, attend to the top k
    (the l most recent always among them; l=0 by default, as in the paper). No mean value.

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

    name = "loki"

    def __post_init__(self):
        _check_int32(self, ("d", "k", "l", "min_n_kv"))

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


Attention = Dense | SparQ | Loki | ALISA


# LLAMA_SPARSE_ATTN's keys per mode (README), and the settings field each one sets.
_SPEC_KEYS = {
    "sparq": {"r": "r", "k": "k", "l": "l", "mv": "mean_value", "min_n_kv": "min_n_kv", "prompt": "sparse_prompt"},
    "loki": {"d": "d", "k": "k", "l": "l", "min_n_kv": "min_n_kv", "prompt": "sparse_prompt", "proj": "projection",
             "variant": "variant"},
    "alisa": {"c": "c", "min_n_kv": "min_n_kv"},
    "dense": {},
}


def parse_attention(spec: str) -> Attention:
    """Settings from a string in the syntax of the LLAMA_SPARSE_ATTN environment variable: "sparq:r=8,k=32",
    "loki:d=32,k=128,proj=model.loki.gguf", "alisa:c=0.125", "dense"; keys left out keep their defaults.
    Keys: sparq r, k, l, mv (1/0), min_n_kv, prompt (dense|sparse); loki d, k, l, min_n_kv, prompt, proj,
    variant (post|pre); alisa c, min_n_kv. No spaces, each key once."""
    if not isinstance(spec, str):
        raise SparqError(f"attention spec must be a string, got {spec!r}")
    mode, _, rest = spec.partition(":")
    if mode not in _SPEC_KEYS:
        raise SparqError(f"attention {spec!r}: the mode must be one of {', '.join(_SPEC_KEYS)} "
                         "(e.g. 'sparq:r=8,k=32')")
    keys, fields = _SPEC_KEYS[mode], {}
    for item in rest.split(",") if rest else ():
        key, eq, value = item.partition("=")
        if key not in keys:
            known = ", ".join(keys) or "none"
            raise SparqError(f"attention {spec!r}: unknown key {key!r} for {mode} (keys: {known})")
        if not eq or not value:
            raise SparqError(f"attention {spec!r}: {key} needs a value ({key}=...)")
        if keys[key] in fields:
            raise SparqError(f"attention {spec!r}: {key} is given twice")
        fields[keys[key]] = _spec_value(spec, key, value)
    cls = {"sparq": SparQ, "loki": Loki, "alisa": ALISA, "dense": Dense}[mode]
    return cls(**fields)


def _spec_value(spec: str, key: str, value: str):
    if key in ("proj", "variant"):
        return value
    if key == "prompt":
        if value not in ("dense", "sparse"):
            raise SparqError(f"attention {spec!r}: prompt must be dense or sparse, got {value!r}")
        return value == "sparse"
    if key == "mv":
        if value not in ("0", "1"):
            raise SparqError(f"attention {spec!r}: mv must be 1 or 0, got {value!r}")
        return value == "1"
    try:
        return float(value) if key == "c" else int(value)
    except ValueError:
        kind = "a number" if key == "c" else "an integer"
        raise SparqError(f"attention {spec!r}: {key} must be {kind}, got {value!r}") from None
