"""Write llama.cpp sequence-state blobs ourselves: S positions of synthetic K and V in one go.

The format is the one `llama_state_seq_get_data` writes and `llama_state_seq_set_data` reads in
the pinned llama.cpp (llama-context.cpp `state_seq_get_data`, llama-kv-cache.cpp `state_write`,
`state_write_meta`, `state_write_data`), for a plain `llama_kv_cache` (Llama: no SWA, no M-RoPE,
no PLE, so no per-cell `ext`), one stream, all little-endian:

    u32 magic 0xaf143cd8, i32 seq_id                         (llama_context)
    u32 n_stream                                             (llama_kv_cache::state_write)
    per stream: u32 cell_count, then if cell_count > 0:
      meta, per cell: i32 pos, u32 n_seq_id (= 1), i32 seq_id
      data: u32 v_trans, u32 n_layer
        per layer: i32 k_type, u64 k_row_bytes, cell_count rows of K
        v_trans == 0: per layer: i32 v_type, u64 v_row_bytes, cell_count rows of V
        v_trans == 1: per layer: i32 v_type, u32 v_elem_bytes, u32 n_embd_v_gqa,
                      then V transposed: n_embd_v_gqa runs of cell_count elements

A cache with a sparse attention layout writes a header before n_stream, and SparQ's transposed K
copy after each stream's data (llama-kv-cache.cpp `state_write_layout`, `state_write_kt`):

    u32 0x54415053 ("SPAT"), u32 version (1), u32 layout bits (1: K^T, 2: Loki, 4: ALISA),
    f32 ALISA c, u64 Loki basis fingerprint
    ... per stream after the data, with K^T: u32 has_kt, then if 1, per layer:
        i32 kt_type (f32 for an f32 K, else f16), u32 n_embd_k_gqa, then K^T: n_embd_k_gqa runs of
        cell_count elements (K dequantized, transposed)

A blob with K^T fills a SparQ context as the state of a SparQ context does (its first step reads V
for the sums, not K again); a dense context skips the K^T. A blob without it fills both, and a
SparQ context then rebuilds K^T from K at its first step. The V sums are never serialised.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from sparq_cpp.errors import SparqError
from sparq_cpp.llm import CACHE_TYPE_NAMES, CACHE_TYPES  # the cache types and their ggml type numbers

STATE_SEQ_MAGIC = 0xAF143CD8  # llama-context.cpp io_magic
LAYOUT_MAGIC = 0x54415053  # llama-kv-cache.cpp LLAMA_KV_STATE_LAYOUT_MAGIC
LAYOUT_VERSION = 1
LAYOUT_KT, LAYOUT_LOKI, LAYOUT_ALISA = 1, 2, 4
QK8_0 = 32
_Q8_0_BLOCK = 2 + QK8_0
_POOL = 1 << 22  # random values drawn once per blob; rows are windows of it at random offsets
_CHUNK_ROWS = 2048


@dataclass(frozen=True)
class KVLayout:
    """What a llama_kv_cache's state depends on: layer count, row sizes, cache type, V layout."""

    n_layer: int
    n_embd_k_gqa: int
    n_embd_v_gqa: int
    cache_type: str = "f16"  # K and V both
    v_trans: bool = False  # llama.cpp stores V transposed when flash attention is off

    def __post_init__(self):
        if self.cache_type not in CACHE_TYPES:
            raise SparqError(f"cache type {self.cache_type!r} is not one of {', '.join(CACHE_TYPES)}")
        if self.cache_type == "q8_0":
            if self.v_trans:
                raise SparqError("a q8_0 V cache needs flash attention (llama.cpp cannot store it transposed)")
            if self.n_embd_k_gqa % QK8_0 or self.n_embd_v_gqa % QK8_0:
                raise SparqError(f"q8_0 rows must be a multiple of {QK8_0} elements")

    def row_bytes(self, n: int) -> int:
        if self.cache_type == "q8_0":
            return n // QK8_0 * _Q8_0_BLOCK
        return n * (4 if self.cache_type == "f32" else 2)

    @property
    def elem_bytes(self) -> int:
        return 4 if self.cache_type == "f32" else 2  # only used for a transposed (never q8_0) V


@dataclass(frozen=True)
class SparseLayout:
    """The header a cache with a sparse attention layout writes first: LAYOUT_* bits, ALISA's c,
    the Loki basis fingerprint."""

    bits: int
    alisa_c: float = 0.0
    basis: int = 0

    @property
    def kt(self) -> bool:
        return bool(self.bits & LAYOUT_KT)


def sparse_layout(blob) -> SparseLayout | None:
    """The sparse attention layout a sequence-state blob starts with (None: a plain cache's state).
    The state of an empty sequence gives a context's own layout."""
    buf = bytes(blob[:32])
    if len(buf) < 12 or struct.unpack_from("<I", buf, 8)[0] != LAYOUT_MAGIC:
        return None
    version, bits, c, basis = struct.unpack_from("<IIfQ", buf, 12)
    if version != LAYOUT_VERSION:
        raise SparqError(f"unsupported state layout version {version}")
    return SparseLayout(bits, c, basis)


def blob_size(layout: KVLayout, n_cells: int, sparse: SparseLayout | None = None) -> int:
    """Bytes of a one-sequence state blob holding n_cells cells."""
    size = 4 + 4 + 4 + 4  # magic, seq_id, n_stream, cell_count
    if sparse is not None:
        size += 4 + 4 + 4 + 4 + 8  # the layout header
    if n_cells == 0:
        return size
    if sparse is not None and sparse.bits & LAYOUT_ALISA:
        raise SparqError("synthetic states of an ALISA cache (its window of weights) are not written here")
    if sparse is not None and sparse.kt:
        size += 4 + layout.n_layer * (8 + n_cells * layout.n_embd_k_gqa * kt_elem_bytes(layout))
    size += n_cells * 12 + 8
    size += layout.n_layer * (12 + n_cells * layout.row_bytes(layout.n_embd_k_gqa))
    if layout.v_trans:
        size += layout.n_layer * (12 + n_cells * layout.n_embd_v_gqa * layout.elem_bytes)
    else:
        size += layout.n_layer * (12 + n_cells * layout.row_bytes(layout.n_embd_v_gqa))
    return size


def kt_elem_bytes(layout: KVLayout) -> int:
    """SparQ's K^T is f32 for an f32 K, else f16."""
    return 4 if layout.cache_type == "f32" else 2


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_0_ref on rows of x: (rows, n) f32 -> (rows, n/32*34) uint8."""
    rows, n = x.shape
    blocks = x.reshape(rows, n // QK8_0, QK8_0)
    d = np.abs(blocks).max(axis=-1) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    out = np.empty((rows, n // QK8_0, _Q8_0_BLOCK), np.uint8)
    out[:, :, :2] = d.astype(np.float16).view(np.uint8).reshape(rows, n // QK8_0, 2)
    out[:, :, 2:] = np.rint(blocks * inv[:, :, None]).astype(np.int8).view(np.uint8)
    return out.reshape(rows, -1)


def dequantize_q8_0(raw: np.ndarray, n: int) -> np.ndarray:
    rows = raw.shape[0]
    blocks = raw.reshape(rows, n // QK8_0, _Q8_0_BLOCK)
    d = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, :, 2:].view(np.int8).astype(np.float32)
    return (q * d).reshape(rows, n)


def _encode_rows(x: np.ndarray, cache_type: str) -> np.ndarray:
    """(rows, n) f32 -> the cache's row bytes (rows, row_bytes) as uint8."""
    if cache_type == "q8_0":
        return quantize_q8_0(x)
    dtype = np.float32 if cache_type == "f32" else np.float16
    return np.ascontiguousarray(x.astype(dtype, copy=False)).view(np.uint8)


class _Writer:
    def __init__(self, size: int):
        self.buf = np.empty(size, np.uint8)
        self.off = 0

    def pack(self, fmt: str, *values) -> None:
        n = struct.calcsize(fmt)
        struct.pack_into(fmt, self.buf, self.off, *values)
        self.off += n

    def take(self, n: int) -> np.ndarray:
        out = self.buf[self.off:self.off + n]
        self.off += n
        return out


def synthetic_state(layout: KVLayout, n_cells: int, *, seed: int = 0, k_std=None, v_std=None,
                    seq_id: int = 0, sparse: SparseLayout | None = None, progress=None) -> np.ndarray:
    """A state blob for one sequence with positions 0..n_cells-1 and random K and V rows.

    k_std / v_std: per-layer arrays of per-component standard deviations ((n_layer, n_embd) or
    broadcastable), default 1. The values are Gaussian: each row is a window of a pool of
    N(0, 1) draws at a random offset (much faster than fresh draws, and the rows are as good as
    independent for attention), times the per-component std, then stored in the cache type
    (q8_0 quantized like ggml does). The same seed gives the same values for every cache type and
    V layout. sparse: the layout header of the context it is for (sparse_layout() of its empty
    state); with K^T (SparQ) the blob holds K^T as the cache would (the K rows as stored, dequantized,
    transposed). progress(n) is called with the number of rows written per chunk.
    """
    if n_cells < 0:
        raise SparqError(f"cell count must be >= 0, got {n_cells}")
    L, Ek, Ev = layout.n_layer, layout.n_embd_k_gqa, layout.n_embd_v_gqa
    k_std = np.broadcast_to(np.ones(1, np.float32) if k_std is None else np.asarray(k_std, np.float32), (L, Ek))
    v_std = np.broadcast_to(np.ones(1, np.float32) if v_std is None else np.asarray(v_std, np.float32), (L, Ev))
    w = _Writer(blob_size(layout, n_cells, sparse))
    w.pack("<Ii", STATE_SEQ_MAGIC, seq_id)
    if sparse is not None:
        w.pack("<IIIfQ", LAYOUT_MAGIC, LAYOUT_VERSION, sparse.bits, sparse.alisa_c, sparse.basis)
    kt = sparse is not None and sparse.kt
    w.pack("<II", 1, n_cells)
    if n_cells == 0:
        return w.buf
    meta = w.take(12 * n_cells).view("<i4").reshape(n_cells, 3)
    meta[:, 0] = np.arange(n_cells, dtype=np.int32)
    meta[:, 1] = 1
    meta[:, 2] = seq_id
    w.pack("<II", int(layout.v_trans), L)

    rng = np.random.default_rng(seed)
    pool = rng.standard_normal(_POOL + max(Ek, Ev), dtype=np.float32)
    windows = {E: np.lib.stride_tricks.sliding_window_view(pool, E) for E in {Ek, Ev}}

    def rows(il: int, which: int, E: int):
        """Chunks (r0, (rows, E) f32) of layer il's K (which=0) or V (which=1) values."""
        r = np.random.default_rng([seed, il, which])
        std = (k_std if which == 0 else v_std)[il]
        for r0 in range(0, n_cells, _CHUNK_ROWS):
            n = min(_CHUNK_ROWS, n_cells - r0)
            x = windows[E][r.integers(0, _POOL, n)]  # fancy indexing copies the windows
            x *= std
            yield r0, x

    t = CACHE_TYPES[layout.cache_type]
    krow = layout.row_bytes(Ek)
    k_rows = []  # per layer, the K rows as stored, for K^T
    for il in range(L):
        w.pack("<iQ", t, krow)
        dst = w.take(n_cells * krow).reshape(n_cells, krow)
        for r0, x in rows(il, 0, Ek):
            dst[r0:r0 + len(x)] = _encode_rows(x, layout.cache_type)
            if progress:
                progress(len(x))
        k_rows.append(dst)
    for il in range(L):
        if layout.v_trans:
            w.pack("<iII", t, layout.elem_bytes, Ev)
            dtype = np.float32 if layout.cache_type == "f32" else np.float16
            dst = w.take(n_cells * Ev * layout.elem_bytes).view(dtype).reshape(Ev, n_cells)
            for r0, x in rows(il, 1, Ev):
                dst[:, r0:r0 + len(x)] = x.T
                if progress:
                    progress(len(x))
        else:
            vrow = layout.row_bytes(Ev)
            w.pack("<iQ", t, vrow)
            dst = w.take(n_cells * vrow).reshape(n_cells, vrow)
            for r0, x in rows(il, 1, Ev):
                dst[r0:r0 + len(x)] = _encode_rows(x, layout.cache_type)
                if progress:
                    progress(len(x))
    if kt:
        kt_type = np.float32 if kt_elem_bytes(layout) == 4 else np.float16
        w.pack("<I", 1)
        for il in range(L):
            w.pack("<iI", CACHE_TYPES["f32" if kt_type is np.float32 else "f16"], Ek)
            dst = w.take(n_cells * Ek * kt_elem_bytes(layout)).view(kt_type).reshape(Ek, n_cells)
            for r0 in range(0, n_cells, _CHUNK_ROWS):
                raw = k_rows[il][r0:r0 + _CHUNK_ROWS]
                if layout.cache_type == "q8_0":
                    x = dequantize_q8_0(raw, Ek)
                else:
                    x = raw.view(np.float32 if layout.cache_type == "f32" else np.float16)
                dst[:, r0:r0 + len(raw)] = x.T
    assert w.off == len(w.buf), (w.off, len(w.buf))
    return w.buf


@dataclass
class ParsedState:
    seq_id: int
    positions: np.ndarray
    v_trans: bool
    k_types: list
    v_types: list
    k: list  # per layer: (cells, row_bytes) uint8
    v: list  # per layer: (cells, row_bytes) uint8, or (n_embd_v_gqa, cells) elements if v_trans
    kt: list = None  # per layer: SparQ's K^T (n_embd_k_gqa, cells), when the state has it


def parse_state(blob, n_embd_v_gqa: int | None = None) -> ParsedState:
    """Read a one-stream sequence-state blob (as written by llama.cpp or by synthetic_state)."""
    buf = np.frombuffer(bytes(blob), np.uint8) if not isinstance(blob, np.ndarray) else blob
    off = 0

    def unpack(fmt):
        nonlocal off
        vals = struct.unpack_from(fmt, buf, off)
        off += struct.calcsize(fmt)
        return vals

    def take(n):
        nonlocal off
        out = buf[off:off + n]
        if len(out) != n:
            raise SparqError("state blob is truncated")
        off += n
        return out

    magic, seq_id = unpack("<Ii")
    if magic != STATE_SEQ_MAGIC:
        raise SparqError(f"not a sequence-state blob (magic {magic:#x})")
    (n_stream,) = unpack("<I")
    layout_bits = 0
    if n_stream == LAYOUT_MAGIC:
        version, layout_bits, _c, _basis = unpack("<IIfQ")
        if version != LAYOUT_VERSION or layout_bits & LAYOUT_ALISA:
            raise SparqError(f"unsupported state layout (version {version}, bits {layout_bits:#x})")
        (n_stream,) = unpack("<I")
    if n_stream != 1:
        raise SparqError(f"only one-stream states are supported, got {n_stream}")
    (n_cells,) = unpack("<I")
    if n_cells == 0:
        return ParsedState(seq_id, np.zeros(0, np.int32), False, [], [], [], [], [])
    pos = np.empty(n_cells, np.int32)
    for i in range(n_cells):
        p, n_seq = unpack("<iI")
        unpack(f"<{n_seq}i")
        pos[i] = p
    v_trans, n_layer = unpack("<II")
    k_types, v_types, ks, vs = [], [], [], []
    for _ in range(n_layer):
        t, row = unpack("<iQ")
        k_types.append(CACHE_TYPE_NAMES.get(t, t))
        ks.append(take(n_cells * row).reshape(n_cells, row))
    for _ in range(n_layer):
        if v_trans:
            t, el, E = unpack("<iII")
            v_types.append(CACHE_TYPE_NAMES.get(t, t))
            vs.append(take(n_cells * E * el).reshape(E, n_cells * el))
        else:
            t, row = unpack("<iQ")
            v_types.append(CACHE_TYPE_NAMES.get(t, t))
            vs.append(take(n_cells * row).reshape(n_cells, row))
    kts = []
    if layout_bits & LAYOUT_KT:
        (has_kt,) = unpack("<I")
        for _ in range(n_layer if has_kt else 0):
            t, E = unpack("<iI")
            dtype = {0: np.float32, 1: np.float16}.get(t)
            if dtype is None:
                raise SparqError(f"K^T of type {t} is not f32 or f16")
            kts.append(take(n_cells * E * np.dtype(dtype).itemsize).view(dtype).reshape(E, n_cells))
    if off != len(buf):
        raise SparqError(f"state blob has {len(buf) - off} bytes after the end")
    return ParsedState(seq_id, pos, bool(v_trans), k_types, v_types, ks, vs, kts)
