"""Minimal ctypes binding to ggml: build a graph of a few ops on the CPU and run it.

Enough for testing and timing single ops (ggml_sparq_attn, ggml_flash_attn_ext) against numpy data,
without llama.cpp: tensors are metadata in a ``no_alloc`` ggml context whose ``data`` points into
numpy arrays (kept alive by the ``Graph``), so views with arbitrary strides (a transposed K copy
inside a wider buffer, a permuted cache view) are plain ``ggml_view_4d`` calls.

Libraries: ``$SPARQ_CPP_LIB_DIR`` if set, else the ``lib/`` folder of the installed ``llama_cpp``
package. ``ggml_sparq_attn`` and ``ggml_loki_attn`` (both from the SPARSE_ATTN patch) are resolved
lazily, so this module loads against a stock build and raises ``SparqError`` only when the op is used
(``has_sparq_attn()`` tells beforehand).

Shapes follow the reference (sparq_cpp.reference.attention): q [n_q, n_head, D], k/v
[n_kv, n_head_kv, D], mask bool [n_q, n_kv], kv_pos int32 [n_kv]; results [n_q, n_head, D].
numpy shape = ggml ``ne`` reversed.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from sparq_cpp.bindings.cpu_backend import cpu_library
from sparq_cpp.errors import SparqError

# enum ggml_type (ggml.h)
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_Q8_0 = 8
GGML_TYPE_I32 = 26
TYPES = {"f32": GGML_TYPE_F32, "f16": GGML_TYPE_F16, "q8_0": GGML_TYPE_Q8_0, "i32": GGML_TYPE_I32}
QK8_0 = 32
Q8_0_BLOCK_BYTES = 34

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64
GGML_MAX_N_THREADS = 512
GGML_DEFAULT_GRAPH_SIZE = 2048


class ggml_init_params(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class ggml_tensor(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class ggml_cplan(ctypes.Structure):
    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


class ggml_threadpool_params(ctypes.Structure):
    _fields_ = [
        ("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


T_P = ctypes.POINTER(ggml_tensor)
VP = ctypes.c_void_p


def lib_dir() -> Path:
    """Where libggml*.so are: $SPARQ_CPP_LIB_DIR, else the installed llama_cpp package's lib/."""
    env = os.environ.get("SPARQ_CPP_LIB_DIR")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        raise SparqError("no ggml libraries: set SPARQ_CPP_LIB_DIR or install the patched llama_cpp package")
    return Path(spec.origin).parent / "lib"


class _Lib:
    def __init__(self, directory: Path):
        self.dir = directory
        mode = getattr(os, "RTLD_GLOBAL", 0)
        try:
            self.base = ctypes.CDLL(str(directory / "libggml-base.so"), mode=mode)
            self.cpu = ctypes.CDLL(str(cpu_library(directory)[0]), mode=mode)
        except (OSError, FileNotFoundError) as e:
            raise SparqError(f"cannot load ggml from {directory}: {e}") from e
        b, c = self.base, self.cpu

        def fn(lib, name, res, *args):
            f = getattr(lib, name)
            f.restype, f.argtypes = res, list(args)
            return f

        self.ggml_init = fn(b, "ggml_init", VP, ggml_init_params)
        self.ggml_free = fn(b, "ggml_free", None, VP)
        self.ggml_tensor_overhead = fn(b, "ggml_tensor_overhead", ctypes.c_size_t)
        self.ggml_graph_overhead_custom = fn(b, "ggml_graph_overhead_custom", ctypes.c_size_t, ctypes.c_size_t, ctypes.c_bool)
        self.ggml_new_tensor = fn(b, "ggml_new_tensor", T_P, VP, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64))
        self.ggml_view_4d = fn(b, "ggml_view_4d", T_P, VP, T_P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_int64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t)
        self.ggml_nbytes = fn(b, "ggml_nbytes", ctypes.c_size_t, T_P)
        self.ggml_cpy = fn(b, "ggml_cpy", T_P, VP, T_P, T_P)
        self.ggml_transpose = fn(b, "ggml_transpose", T_P, VP, T_P)
        self.ggml_row_size = fn(b, "ggml_row_size", ctypes.c_size_t, ctypes.c_int, ctypes.c_int64)
        self.ggml_flash_attn_ext = fn(b, "ggml_flash_attn_ext", T_P, VP, T_P, T_P, T_P, T_P,
                                      ctypes.c_float, ctypes.c_float, ctypes.c_float)
        self.ggml_new_graph_custom = fn(b, "ggml_new_graph_custom", VP, VP, ctypes.c_size_t, ctypes.c_bool)
        self.ggml_build_forward_expand = fn(b, "ggml_build_forward_expand", None, VP, T_P)
        self.ggml_threadpool_params_init = fn(b, "ggml_threadpool_params_init", None,
                                              ctypes.POINTER(ggml_threadpool_params), ctypes.c_int)
        self.ggml_cpu_init = fn(c, "ggml_cpu_init", None)
        self.ggml_graph_plan = fn(c, "ggml_graph_plan", ggml_cplan, VP, ctypes.c_int, VP)
        self.ggml_graph_compute = fn(c, "ggml_graph_compute", ctypes.c_int, VP, ctypes.POINTER(ggml_cplan))
        self.ggml_threadpool_new = fn(c, "ggml_threadpool_new", VP, ctypes.POINTER(ggml_threadpool_params))
        self.ggml_threadpool_free = fn(c, "ggml_threadpool_free", None, VP)
        self.ggml_cpu_init()
        self._sparq = None
        self._loki = None
        self._alisa = None

    @property
    def has_sparq_attn(self) -> bool:
        """Whether this is a patched build (it has the SPARSE_ATTN op's constructors)."""
        return hasattr(self.base, "ggml_sparq_attn")

    def _check_patched(self) -> None:
        if not self.has_sparq_attn:
            raise SparqError(f"ggml_sparq_attn is missing from {self.dir / 'libggml-base.so'}: "
                             "this is a stock ggml build, build the patched one")

    @property
    def ggml_sparq_attn(self):
        if self._sparq is None:
            self._check_patched()
            f = self.base.ggml_sparq_attn
            f.restype = T_P
            f.argtypes = [VP, T_P, T_P, T_P, T_P, T_P, T_P, T_P, ctypes.c_float,
                          ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_bool]
            self._sparq = f
        return self._sparq

    @property
    def ggml_loki_attn(self):
        if self._loki is None:
            self._check_patched()
            f = self.base.ggml_loki_attn
            f.restype = T_P
            f.argtypes = [VP, T_P, T_P, T_P, T_P, T_P, ctypes.c_float, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
            self._loki = f
        return self._loki

    @property
    def ggml_sparse_attn_set_sink(self):
        if not hasattr(self.base, "ggml_sparse_attn_set_sink"):
            raise SparqError(f"ggml_sparse_attn_set_sink is missing from {self.dir / 'libggml-base.so'}: "
                             "this build predates the attention sink, build the patched one again")
        f = self.base.ggml_sparse_attn_set_sink
        f.restype, f.argtypes = None, [T_P, ctypes.c_int32]
        return f

    @property
    def ggml_alisa_attn(self):
        if self._alisa is None:
            if not hasattr(self.base, "ggml_alisa_attn"):
                raise SparqError(f"ggml_alisa_attn is missing from {self.dir / 'libggml-base.so'}: "
                                 "this build predates the ALISA ranking, build the patched one again")
            f = self.base.ggml_alisa_attn
            f.restype = T_P
            f.argtypes = [VP, T_P, T_P, T_P, T_P, T_P, T_P, ctypes.c_float, ctypes.c_float]
            self._alisa = f
        return self._alisa


_LIBS: dict[Path, _Lib] = {}


def lib(directory: Path | None = None) -> _Lib:
    d = Path(directory) if directory is not None else lib_dir()
    if d not in _LIBS:
        _LIBS[d] = _Lib(d)
    return _LIBS[d]


def sparse_attn_phases(directory: Path | None = None) -> tuple[int, int, int] | None:
    """Nanoseconds the CPU kernel spent in each phase (ranking, selection, attention) since the last call, summed
    over threads and calls; None for a build without -DGGML_SPARSE_ATTN_PROFILE (the counters cost nothing there
    because they do not exist)."""
    cpu = lib(directory).cpu
    try:
        f = cpu.ggml_cpu_sparse_attn_phases
    except AttributeError:
        return None
    f.restype, f.argtypes = None, [ctypes.POINTER(ctypes.c_int64)]
    out = (ctypes.c_int64 * 3)()
    f(out)
    return out[0], out[1], out[2]


def has_sparq_attn(directory: Path | None = None) -> bool:
    try:
        return lib(directory).has_sparq_attn
    except SparqError:
        return False


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Q8_0 bytes of x (last dim a multiple of 32) as uint8 [..., n/32*34], via gguf.quants."""
    return quantize(np.ascontiguousarray(x, dtype=np.float32), GGMLQuantizationType.Q8_0)


def dequantize_q8_0(b: np.ndarray) -> np.ndarray:
    return dequantize(b, GGMLQuantizationType.Q8_0).astype(np.float32)


def encode(x: np.ndarray, type_name: str) -> np.ndarray:
    """numpy data laid out as ggml stores type_name (rows along the last axis)."""
    if type_name == "f32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if type_name == "f16":
        return np.ascontiguousarray(x, dtype=np.float16)
    if type_name == "i32":
        return np.ascontiguousarray(x, dtype=np.int32)
    if type_name == "q8_0":
        return quantize_q8_0(x)
    raise SparqError(f"unsupported tensor type {type_name!r}")


def decode(x: np.ndarray, type_name: str) -> np.ndarray:
    """The float32 values that ggml sees in encode(x, type_name)'s bytes."""
    if type_name == "q8_0":
        return dequantize_q8_0(x)
    return np.asarray(x).astype(np.float32)


class Graph:
    """One ggml context (tensor metadata only) plus the numpy buffers the tensors point into."""

    def __init__(self, n_tensors: int = 256, directory: Path | None = None):
        self.lib = lib(directory)
        L = self.lib
        size = n_tensors * L.ggml_tensor_overhead() + L.ggml_graph_overhead_custom(GGML_DEFAULT_GRAPH_SIZE, False) + 4096
        self.ctx = L.ggml_init(ggml_init_params(size, None, True))
        if not self.ctx:
            raise SparqError("ggml_init failed")
        self._keep: list[np.ndarray] = []
        self._outputs: list[tuple[object, np.ndarray]] = []
        self._writes: list = []  # nodes that write into tensors given by tensor() (ggml_cpy)
        self._work = None
        self._threadpool = None
        self._gf = None

    def close(self):
        if self._threadpool:
            self.lib.ggml_threadpool_free(self._threadpool)
            self._threadpool = None
        if self.ctx:
            self.lib.ggml_free(self.ctx)
            self.ctx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # tensors

    def tensor(self, data: np.ndarray, type_name: str, ne: tuple[int, ...] | None = None):
        """A tensor over ``data`` (already encoded for type_name), or over a 64-byte aligned copy of it
        where it is not aligned (see aligned). ne defaults to data.shape reversed (for q8_0 the last axis
        is bytes: ne0 = bytes/34*32)."""
        data = aligned(np.ascontiguousarray(data))
        if ne is None:
            shape = list(data.shape[::-1])
            if type_name == "q8_0":
                shape[0] = shape[0] // Q8_0_BLOCK_BYTES * QK8_0
            ne = tuple(shape)
        ne4 = (ctypes.c_int64 * 4)(*(list(ne) + [1] * (4 - len(ne))))
        t = self.lib.ggml_new_tensor(self.ctx, TYPES[type_name], len(ne), ne4)
        if self.lib.ggml_nbytes(t) != data.nbytes:
            raise SparqError(f"tensor ne={ne} {type_name} needs {self.lib.ggml_nbytes(t)} bytes, data has {data.nbytes}")
        t.contents.data = data.ctypes.data
        self._keep.append(data)
        return t

    def view(self, t, ne: tuple[int, int, int, int], nb: tuple[int, int, int], offset: int = 0):
        """ggml_view_4d: ne0..ne3, byte strides nb1..nb3, byte offset."""
        return self.lib.ggml_view_4d(self.ctx, t, *ne, *nb, offset)

    def output(self, t, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Give the (f32) op result t a numpy buffer; returns it (filled by compute())."""
        ne = list(t.contents.ne)
        out = np.full(ne[::-1] if shape is None else shape, np.nan, dtype=np.float32)
        if out.nbytes != self.lib.ggml_nbytes(t):
            raise SparqError("output buffer size mismatch")
        t.contents.data = out.ctypes.data
        self._keep.append(out)
        self._outputs.append((t, out))
        return out

    # ops

    def transpose(self, t):
        return self.lib.ggml_transpose(self.ctx, t)

    def copy(self, src, dst):
        """ggml_cpy: src converted into dst (a tensor() or a view of one, whose numpy buffer it fills)."""
        node = self.lib.ggml_cpy(self.ctx, src, dst)
        self._writes.append(node)
        return node

    def sparq_attn(self, q, k, kt, v, mask, pos, vmean, scale, r, top_k, n_local, mean_value, n_sink=0):
        out = self.lib.ggml_sparq_attn(self.ctx, q, k, kt, v, mask, pos, vmean, scale, r, top_k, n_local, mean_value)
        if n_sink:
            self.lib.ggml_sparse_attn_set_sink(out, n_sink)
        return out

    def loki_attn(self, q, k, v, mask, pos, scale, d, top_k, n_local, n_sink=0):
        out = self.lib.ggml_loki_attn(self.ctx, q, k, v, mask, pos, scale, d, top_k, n_local)
        if n_sink:
            self.lib.ggml_sparse_attn_set_sink(out, n_sink)
        return out

    def alisa_attn(self, q, k, v, mask, pos, sums, scale, c):
        return self.lib.ggml_alisa_attn(self.ctx, q, k, v, mask, pos, sums, scale, c)

    def flash_attn_ext(self, q, k, v, mask, scale, max_bias=0.0, logit_softcap=0.0):
        return self.lib.ggml_flash_attn_ext(self.ctx, q, k, v, mask, scale, max_bias, logit_softcap)

    # compute

    def build(self, n_threads: int = 2):
        """Build the graph of every output() and plan it; the work buffer is kept for repeats."""
        L = self.lib
        self._gf = L.ggml_new_graph_custom(self.ctx, GGML_DEFAULT_GRAPH_SIZE, False)
        for t in [t for t, _ in self._outputs] + self._writes:
            L.ggml_build_forward_expand(self._gf, t)
        if self._threadpool:
            L.ggml_threadpool_free(self._threadpool)
        tpp = ggml_threadpool_params()
        L.ggml_threadpool_params_init(ctypes.byref(tpp), n_threads)
        self._threadpool = L.ggml_threadpool_new(ctypes.byref(tpp))
        self._plan = L.ggml_graph_plan(self._gf, n_threads, self._threadpool)
        self._work = np.empty(max(self._plan.work_size, 1), dtype=np.uint8)
        self._plan.work_data = self._work.ctypes.data
        self._n_threads = n_threads

    @property
    def work_size(self) -> int:
        return int(self._plan.work_size)

    def compute(self, n_threads: int = 2):
        if self._gf is None or self._n_threads != n_threads:
            self.build(n_threads)
        st = self.lib.ggml_graph_compute(self._gf, ctypes.byref(self._plan))
        if st != 0:
            raise SparqError(f"ggml_graph_compute failed with status {st}")
        return [out for _, out in self._outputs]


# High-level helpers in the reference's layout


def aligned(data: np.ndarray, align: int = 64) -> np.ndarray:
    """data at an address that is a multiple of align, copied if it is not: ggml allocates its CPU buffers
    64-byte aligned (ggml_aligned_malloc), numpy only 16, and a kernel that reads scattered rows touches one
    cache line more per row when they straddle lines."""
    if data.ctypes.data % align == 0:
        return data
    buf = np.empty(data.nbytes + align, np.uint8)
    off = -buf.ctypes.data % align
    out = buf[off:off + data.nbytes].view(data.dtype).reshape(data.shape)
    out[...] = data
    return out


class KVCache:
    """K, V (row-major, like llama.cpp's cache with flash attention) and the transposed K copy,
    as ggml views into numpy buffers. k, v: float32 [n_kv, n_head_kv, D] (values before encoding).

    kt_pad extra cells make the transposed buffer [n_head_kv*D, n_kv + kt_pad] so kt is a strided
    view (as it is in a cache of kv_size > n_kv cells); the padding is filled with NaN."""

    def __init__(self, g: Graph, k: np.ndarray, v: np.ndarray, kv_type: str = "f16", kt_type: str | None = None,
                 kt_pad: int = 0, need_kt: bool = True):
        n_kv, n_head_kv, D = k.shape
        self.n_kv, self.n_head_kv, self.D = n_kv, n_head_kv, D
        kt_type = kt_type or ("f32" if kv_type == "f32" else "f16")
        self.kv_type, self.kt_type = kv_type, kt_type

        kb = encode(k.reshape(n_kv, n_head_kv * D), kv_type)
        vb = encode(v.reshape(n_kv, n_head_kv * D), kv_type)
        # what the kernels read back, for the reference
        self.k_values = decode(kb, kv_type).reshape(n_kv, n_head_kv, D)
        self.v_values = decode(vb, kv_type).reshape(n_kv, n_head_kv, D)

        row = kb.shape[1] * kb.itemsize  # bytes per cell (all heads)
        head = row // n_head_kv
        kbuf = g.tensor(kb, kv_type)
        vbuf = g.tensor(vb, kv_type)
        self.k = g.view(kbuf, (D, n_kv, n_head_kv, 1), (row, head, row * n_kv))
        self.v = g.view(vbuf, (D, n_kv, n_head_kv, 1), (row, head, row * n_kv))

        self.kt = None
        if need_kt:
            kv_size = n_kv + kt_pad
            ktb = np.full((n_head_kv * D, kv_size), np.nan, dtype=np.float32)
            ktb[:, :n_kv] = self.k_values.reshape(n_kv, n_head_kv * D).T
            ktb = encode(ktb, kt_type)
            ts = ktb.itemsize
            ktbuf = g.tensor(ktb, kt_type)
            self.kt = g.view(ktbuf, (n_kv, D, n_head_kv, 1), (kv_size * ts, D * kv_size * ts, D * kv_size * ts * n_head_kv))


def mask_tensor(g: Graph, mask: np.ndarray):
    """bool [n_q, n_kv] (True = visible) -> f16 [n_kv, n_q] with 0 / -INF."""
    m = np.where(mask, np.float16(0), np.float16(-np.inf)).astype(np.float16)
    return g.tensor(m, "f16")


def q_tensor(g: Graph, q: np.ndarray):
    """q [n_q, n_head, D] -> ggml [D, n_q, n_head, 1] (a permuted view, as llama.cpp passes it)."""
    n_q, n_head, D = q.shape
    qb = g.tensor(np.ascontiguousarray(q, dtype=np.float32), "f32")  # ne [D, n_head, n_q]
    return g.view(qb, (D, n_q, n_head, 1), (n_head * D * 4, D * 4, n_head * D * n_q * 4))


def sparq_attn(q, k, v, mask, kv_pos, kq_scale, r, top_k, n_local, mean_value=True, *, kv_type="f16",
               kt_type=None, vmean=None, kt_pad=0, n_threads=2, directory=None, return_values=False, n_sink=0):
    """Run ggml_sparq_attn once. Returns y [n_q, n_head, D] (and with return_values, the decoded
    k, v values the op saw). vmean: optional float32 [n_q, n_head_kv, D]. n_sink: positions below it are kept."""
    with Graph(directory=directory) as g:
        cache = KVCache(g, k, v, kv_type, kt_type, kt_pad)
        qt = q_tensor(g, q)
        mt = mask_tensor(g, mask)
        pt = g.tensor(np.ascontiguousarray(kv_pos, dtype=np.int32), "i32")
        vt = None
        if vmean is not None:
            vt = g.tensor(np.ascontiguousarray(vmean, dtype=np.float32), "f32")  # ne [D, n_head_kv, n_q]
        out = g.sparq_attn(qt, cache.k, cache.kt, cache.v, mt, pt, vt, kq_scale, r, top_k, n_local, mean_value, n_sink)
        y = g.output(out, q.shape)  # ne [D, n_head, n_q] -> numpy [n_q, n_head, D]
        g.compute(n_threads)
        y = y.copy()
        if return_values:
            return y, cache.k_values, cache.v_values
        return y


def loki_attn(q, k, v, mask, kv_pos, kq_scale, d, top_k, n_local=0, *, kv_type="f16", n_threads=2, directory=None,
              return_values=False, n_sink=0):
    """Run ggml_loki_attn once on q and k already in the Loki basis. Returns y [n_q, n_head, D] (and with
    return_values, the decoded k, v values the op saw). n_sink: positions below it are kept."""
    with Graph(directory=directory) as g:
        cache = KVCache(g, k, v, kv_type, need_kt=False)
        qt = q_tensor(g, q)
        mt = mask_tensor(g, mask)
        pt = g.tensor(np.ascontiguousarray(kv_pos, dtype=np.int32), "i32")
        out = g.loki_attn(qt, cache.k, cache.v, mt, pt, kq_scale, d, top_k, n_local, n_sink)
        y = g.output(out, q.shape)
        g.compute(n_threads)
        y = y.copy()
        if return_values:
            return y, cache.k_values, cache.v_values
        return y


def alisa_attn(q, k, v, mask, kv_pos, kq_scale, sums, c, *, kv_type="f16", n_threads=2, directory=None,
               return_values=False):
    """Run ggml_alisa_attn once. sums: float32 [n_set, n_kv] (every row) or [n_q, n_set, n_kv] (per row), the
    window sums of the set(s): n_set 1 (one selection for every head) or n_head_kv. Returns y [n_q, n_head, D]
    and the weights [n_q, n_set, n_kv] (each set's query heads' softmax weights summed; with return_values also
    the decoded k, v values the op saw)."""
    if isinstance(c, bool) or not isinstance(c, (int, float, np.integer, np.floating)) or not np.isfinite(c) or c <= 0:
        raise SparqError(f"ALISA's caching ratio c must be a finite number > 0, got {c!r}")
    sums = np.ascontiguousarray(sums, dtype=np.float32)
    n_q, n_kv, n_head_kv = q.shape[0], k.shape[0], k.shape[1]
    if sums.ndim not in (2, 3) or sums.shape[-1] != n_kv or sums.shape[-2] not in (1, n_head_kv) \
            or (sums.ndim == 3 and sums.shape[0] != n_q):
        raise SparqError(f"ALISA's sums must be [1 or n_head_kv={n_head_kv}, n_kv={n_kv}] or [n_q={n_q}, ..., n_kv], "
                         f"got {sums.shape}")
    n_set = sums.shape[-2]
    with Graph(directory=directory) as g:
        cache = KVCache(g, k, v, kv_type, need_kt=False)
        qt = q_tensor(g, q)
        mt = mask_tensor(g, mask)
        pt = g.tensor(np.ascontiguousarray(kv_pos, dtype=np.int32), "i32")
        st = g.tensor(sums, "f32")
        out = g.alisa_attn(qt, cache.k, cache.v, mt, pt, st, kq_scale, c)
        flat = g.output(out).reshape(-1)
        g.compute(n_threads)
        n_y = int(np.prod(q.shape))
        y = flat[:n_y].reshape(q.shape).copy()
        w = flat[n_y:].reshape(n_q, n_set, n_kv).copy()
        if return_values:
            return y, w, cache.k_values, cache.v_values
        return y, w


def flash_attn_ext(q, k, v, mask, kv_pos, kq_scale, *, kv_type="f16", n_threads=2, directory=None):
    """Dense ggml_flash_attn_ext on the same layout (kv_pos unused). Returns y [n_q, n_head, D]."""
    with Graph(directory=directory) as g:
        cache = KVCache(g, k, v, kv_type, need_kt=False)
        qt = q_tensor(g, q)
        mt = mask_tensor(g, mask)
        out = g.flash_attn_ext(qt, cache.k, cache.v, mt, kq_scale)
        y = g.output(out, q.shape)
        g.compute(n_threads)
        return y.copy()
