"""ctypes bindings for the sparse-attention C API that the patch series adds to libllama.

Kept apart from llama_cpp's own bindings, which resolve every symbol at import: a stock build
still imports llama_cpp, and only these functions report that the patches are missing.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

from sparq_cpp import lazy
from sparq_cpp.errors import SparqError

LLAMA_SPARSE_ATTN_DENSE = 0
LLAMA_SPARSE_ATTN_SPARQ = 1
LLAMA_SPARSE_ATTN_LOKI = 2
LLAMA_SPARSE_ATTN_ALISA = 3
MODES = {"dense": LLAMA_SPARSE_ATTN_DENSE, "sparq": LLAMA_SPARSE_ATTN_SPARQ, "loki": LLAMA_SPARSE_ATTN_LOKI,
         "alisa": LLAMA_SPARSE_ATTN_ALISA}
LLAMA_SPARSE_ATTN_ERR_PROJECTION = -17  # Loki projection missing, unreadable, or not made for this model


@lru_cache(maxsize=None)
def params_struct():
    """llama_cpp's llama_sparse_attn_params: the patched bindings declare it (llama.h's struct, a field of
    llama_context_params), so that one definition serves both; looked up on first use (importing llama_cpp
    loads libllama). `llama_sparse_attn_params` names it. A llama_cpp without it is not the patched build."""
    try:
        raw = lazy.llama_cpp("llama_cpp")
    except ImportError as e:
        raise SparqError(f"llama_cpp cannot be imported ({e}); run `make setup` to build and install it") from None
    cls = getattr(raw, "llama_sparse_attn_params", None)
    if cls is None:
        raise SparqError("the installed llama_cpp has no sparse attention parameters (a stock build); "
                         "run `make setup` to build the patched one")
    return cls


def __getattr__(name):  # sparse_api.llama_sparse_attn_params: the structure params_struct() finds
    if name == "llama_sparse_attn_params":
        return params_struct()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fill(params, **values):
    """Set fields of `params`. ctypes stores only the low 32 bits of an int32 field (2**32 + 5
    becomes 5), so a value that does not fit is refused here instead."""
    int32_fields = {name for name, ctype in params._fields_ if ctype is ctypes.c_int32}
    for name, value in values.items():
        if name in int32_fields and not -2**31 <= value <= 2**31 - 1:
            raise SparqError(f"{name} must be in {-2**31}..{2**31 - 1} (a C int32), got {value}")
        setattr(params, name, value)
    return params


@lru_cache(maxsize=None)
def lib():
    """libllama with the sparse attention API's signatures declared; SparqError on a build without it."""
    raw = lazy.llama_cpp("llama_cpp")
    llama_sparse_attn_params = params_struct()
    out = raw._lib
    try:
        out.llama_sparse_attn_default_params.restype = llama_sparse_attn_params
        out.llama_sparse_attn_default_params.argtypes = []
        out.llama_set_sparse_attn.restype = ctypes.c_int32
        out.llama_set_sparse_attn.argtypes = [ctypes.c_void_p, llama_sparse_attn_params]
        out.llama_get_sparse_attn.restype = ctypes.c_int32
        out.llama_get_sparse_attn.argtypes = [ctypes.c_void_p, ctypes.POINTER(llama_sparse_attn_params)]
        out.llama_sparse_attn_strerror.restype = ctypes.c_char_p
        out.llama_sparse_attn_strerror.argtypes = [ctypes.c_int32]
        out.llama_sparse_attn_parse.restype = ctypes.c_int32
        out.llama_sparse_attn_parse.argtypes = [ctypes.c_char_p, ctypes.POINTER(llama_sparse_attn_params),
                                                ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
        if "sparse_attn" not in dict(raw.llama_context_params._fields_):
            raise AttributeError("llama_context_params has no sparse_attn field")
        out.llama_sparse_attn_load_projection.restype = ctypes.c_int32
        out.llama_sparse_attn_load_projection.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_bool]
        out.llama_sparse_attn_upkeep_n_cells.restype = ctypes.c_uint64
        out.llama_sparse_attn_upkeep_n_cells.argtypes = [ctypes.c_void_p]
    except AttributeError as e:
        raise SparqError(f"the installed llama.cpp has no sparse attention API ({e}); "
                         "run `make setup` to build the patched one") from None
    return out


def available() -> bool:
    try:
        lib()
        return True
    except SparqError:
        return False


def default_params():
    return lib().llama_sparse_attn_default_params()


def strerror(code: int) -> str:
    return lib().llama_sparse_attn_strerror(code).decode()


def as_dict(params) -> dict:
    out = {name: getattr(params, name) for name, _ in params._fields_}
    if isinstance(out["loki_proj"], bytes):
        out["loki_proj"] = out["loki_proj"].decode(errors="replace")
    return out


def parse(spec: str):
    """llama.cpp's own reading of a setting string ("sparq:r=8,k=32", as --sparse-attn takes it); a
    malformed one raises SparqError with its message. The result keeps its projection path alive."""
    out = default_params()
    proj = ctypes.create_string_buffer(4096)
    err = ctypes.create_string_buffer(512)
    if lib().llama_sparse_attn_parse(spec.encode(), ctypes.byref(out), proj, len(proj), err, len(err)) != 0:
        shown = spec if len(spec) <= 64 else spec[:61] + "..."
        raise SparqError(f"sparse attention setting {shown!r}: {err.value.decode(errors='replace')}")
    out._proj = proj  # out.loki_proj points into it
    return out


def set_params(ctx, params) -> None:
    code = lib().llama_set_sparse_attn(ctx, params)
    if code != 0:
        raise SparqError(strerror(code))


def upkeep_n_cells(ctx) -> int:
    """Rows of K and of V (per layer) that SparQ's cache upkeep has read since the context was created
    (a rebuild of K^T or of the V sums counts every used cell, an edit the cells it touched)."""
    return int(lib().llama_sparse_attn_upkeep_n_cells(ctx))


def get_params(ctx):
    out = params_struct()()
    code = lib().llama_get_sparse_attn(ctx, ctypes.byref(out))
    if code != 0:
        raise SparqError(strerror(code))
    return out
