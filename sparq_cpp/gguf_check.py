"""Check a GGUF file before llama.cpp sees it, so bad input gets one clear line instead of a crash."""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from sparq_cpp.errors import SparqError

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHS = ("llama",)


@dataclass(frozen=True)
class GGUFSummary:
    path: Path
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ctx_train: int
    n_vocab: int
    file_type: int | None
    name: str
    key_length: int | None = None  # {arch}.attention.key_length, where the model sets its head size

    @property
    def head_dim(self) -> int:
        return self.key_length if self.key_length else self.n_embd // self.n_head


# llama.cpp keeps per-layer settings in arrays of LLAMA_MAX_LAYERS and asserts (aborts) above it.
MAX_LAYERS = 512


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except UnicodeDecodeError:
        where = getattr(reader.data, "filename", None) or "GGUF"
        raise SparqError(f"{where}: metadata key {key} is not UTF-8 text") from None


def _check_is_gguf(path: Path) -> None:
    """An existing file that starts with the GGUF magic."""
    if not path.exists():
        raise SparqError(f"model file not found: {path}")
    if not path.is_file():
        raise SparqError(f"model path is not a file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise SparqError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")


def open_gguf(path) -> "gguf.GGUFReader":
    """Open a GGUF, turning every way it can be unreadable into a SparqError."""
    import gguf

    path = Path(path)
    _check_is_gguf(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/IndexError/struct errors on damage
        raise SparqError(f"{path} is a damaged or truncated GGUF file ({type(e).__name__}: {e})") from None
    # The reader memory-maps tensor data lazily; a truncated file shows as data past the end.
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise SparqError(f"{path} is truncated: tensor {t.name} ends past the end of the file")
    return reader


class _Header:
    """A GGUF's metadata and tensor table, read directly: scalars decoded on request, arrays only
    counted. The gguf package's reader decodes every array element (a 49k-token vocabulary and its
    merges take seconds in Python); a check needs a few keys and the tensors' extents."""

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    STRING, ARRAY = 8, 9

    class _Array:
        def __init__(self, count):
            self.count = count

        def __str__(self):
            return f"an array of {self.count} values"

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse(buf)
        finally:
            buf.close()

    def _parse(self, buf):
        self.size = len(buf)
        pos = 4
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, pos)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
        pos += 20
        self.fields: dict = {}
        for _ in range(n_kv):
            key, pos = self._string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            self.fields[key.decode(errors="replace")], pos = self._value(buf, pos, vtype)
        self.tensors = []
        for _ in range(n_tensors):
            name, pos = self._string(buf, pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            ttype, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            self.tensors.append((name.decode(errors="replace"), dims, ttype, offset))
        align = self.fields.get("general.alignment", 32)
        align = align if isinstance(align, int) and align > 0 else 32
        self.data_start = -(-pos // align) * align

    def _string(self, buf, pos):
        (n,) = struct.unpack_from("<Q", buf, pos)
        if pos + 8 + n > len(buf):
            raise ValueError("a string runs past the end of the file")
        return bytes(buf[pos + 8: pos + 8 + n]), pos + 8 + n

    def _value(self, buf, pos, vtype):
        if vtype in self._SCALARS:
            fmt = self._SCALARS[vtype]
            return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype == self.STRING:
            return self._string(buf, pos)
        if vtype == self.ARRAY:
            itype, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if itype in self._SCALARS:
                pos += count * struct.calcsize(self._SCALARS[itype])
            elif itype == self.STRING:
                for _ in range(count):  # skipped, not decoded
                    (n,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8 + n
            else:
                for _ in range(count):
                    _, pos = self._value(buf, pos, itype)
            if pos > len(buf):
                raise ValueError("an array runs past the end of the file")
            return self._Array(count), pos
        raise ValueError(f"unknown metadata value type {vtype}")

    def get(self, key, default=None):
        """A scalar or string value (strings must be UTF-8), an array's element count as _Array."""
        v = self.fields.get(key)
        if v is None:
            return default
        if isinstance(v, bytes):
            try:
                return v.decode()
            except UnicodeDecodeError:
                raise SparqError(f"{self.path}: metadata key {key} is not UTF-8 text") from None
        return v

    def check_extents(self) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        for name, dims, ttype, offset in self.tensors:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise SparqError(f"{self.path} is a damaged GGUF file: tensor {name} has unknown type {ttype}") from None
            n = 1
            for d in dims:
                n *= d
            if self.data_start + offset + n // block * type_size > self.size:
                raise SparqError(f"{self.path} is truncated: tensor {name} ends past the end of the file")


def _read_header(path: Path) -> _Header:
    _check_is_gguf(path)
    try:
        header = _Header(path)
    except (ValueError, struct.error, OverflowError, MemoryError) as e:
        raise SparqError(f"{path} is a damaged or truncated GGUF file ({type(e).__name__}: {e})") from None
    header.check_extents()
    return header


def check_gguf(path, archs=SUPPORTED_ARCHS) -> GGUFSummary:
    """Check that `path` is a complete GGUF of a supported architecture, reading only its metadata."""
    path = Path(path)
    reader = _read_header(path)
    arch = reader.get("general.architecture")
    if arch is None:
        raise SparqError(f"{path} has no general.architecture key; not a model GGUF")
    if arch not in archs:
        raise SparqError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(archs)})")

    def hp(name, default=None):
        v = reader.get(f"{arch}.{name}", default)
        if v is None:
            raise SparqError(f"{path}: missing key {arch}.{name}")
        if not isinstance(v, int) or isinstance(v, bool):  # e.g. a per-layer array
            raise SparqError(f"{path}: {arch}.{name} must be one integer, got {str(v)[:60]}")
        return v

    n_head = hp("attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    summary = GGUFSummary(
        path=path, arch=arch, n_layer=hp("block_count"), n_embd=hp("embedding_length"),
        n_head=n_head, n_head_kv=hp("attention.head_count_kv", n_head),
        n_ctx_train=hp("context_length"),
        n_vocab=tokens.count if isinstance(tokens, _Header._Array) else hp("vocab_size", 0),
        file_type=reader.get("general.file_type"), name=str(reader.get("general.name", path.stem)),
        key_length=hp("attention.key_length", 0) or None,
    )
    _check_geometry(summary)
    return summary


def _check_geometry(s: GGUFSummary) -> None:
    """Values llama.cpp would divide by or assert on (an abort, not an error) are refused here."""
    key = f"{s.path}: {s.arch}."
    if not 1 <= s.n_layer <= MAX_LAYERS:
        raise SparqError(f"{key}block_count must be in 1..{MAX_LAYERS}, got {s.n_layer}")
    if s.n_head < 1:
        raise SparqError(f"{key}attention.head_count must be >= 1, got {s.n_head}")
    if not 1 <= s.n_head_kv <= s.n_head or s.n_head % s.n_head_kv:
        raise SparqError(f"{key}attention.head_count_kv must be >= 1 and divide head_count ({s.n_head}), "
                         f"got {s.n_head_kv}")
    if s.n_embd < s.n_head:
        raise SparqError(f"{key}embedding_length must be at least head_count ({s.n_head}), got {s.n_embd}")
