"""Check a GGUF file before llama.cpp sees it, so bad input gets one clear line instead of a crash."""
from __future__ import annotations

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

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


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


def open_gguf(path) -> "gguf.GGUFReader":
    """Open a GGUF, turning every way it can be unreadable into a SparqError."""
    import gguf

    path = Path(path)
    if not path.exists():
        raise SparqError(f"model file not found: {path}")
    if not path.is_file():
        raise SparqError(f"model path is not a file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise SparqError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
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


def check_gguf(path, archs=SUPPORTED_ARCHS) -> GGUFSummary:
    """Open `path` with the gguf package and check it is a complete GGUF of a supported architecture."""
    path = Path(path)
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise SparqError(f"{path} has no general.architecture key; not a model GGUF")
    if arch not in archs:
        raise SparqError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(archs)})")

    def hp(name, default=None):
        v = _field(reader, f"{arch}.{name}", default)
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
        n_vocab=len(tokens.data) if tokens is not None else hp("vocab_size", 0),
        file_type=_field(reader, "general.file_type"), name=str(_field(reader, "general.name", path.stem)),
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
