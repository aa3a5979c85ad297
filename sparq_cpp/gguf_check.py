"""Check a GGUF file before llama.cpp sees it, so bad input gets one clear line instead of a crash."""
from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from sparq_cpp.errors import SparqError
from sparq_cpp.geometry import ModelGeometry

GGUF_MAGIC = b"GGUF"
# Architectures with ordinary attention that the reference follows and the tests run sparse: the
# model factory writes each, llama.cpp's logits are checked against the reference, dense and sparse.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma3", "olmo2", "granite")

# What SparQ and Loki cannot run on, by llama.cpp architecture name (src/llama-arch.cpp and the
# models' load_arch_hparams); metadata and tensors catch the rest (sparse_refusal). Any other model
# llama.cpp loads may run dense, and sparse where llama.cpp's own check accepts it.
RECURRENT_ARCHS = ("mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7")  # llm_arch_is_recurrent
HYBRID_ARCHS = ("jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
                "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35",
                "qwen35moe", "qwen4exp", "deepseek4", "minimax-01")  # llm_arch_is_hybrid
ALIBI_ARCHS = ("bloom", "refact", "jina-bert-v2")  # set f_max_alibi_bias without a key
SOFTCAP_ARCHS = ("gemma2", "grok")  # attention logit soft-capping on by default (50, 30)
SINK_ARCHS = ("gpt-oss",)  # attention sinks (blk.N.attn_sinks); any model with such tensors too
MLA_ARCHS = ("deepseek2",)  # multi-head latent attention; any model with key_length_mla too


@dataclass(frozen=True, kw_only=True)
class GGUFSummary(ModelGeometry):
    """A GGUF's geometry as its metadata gives it (what the file does not set keeps ModelGeometry's
    default), and what else a check of the file learns."""
    path: Path
    file_type: int | None
    name: str
    sparse_refusal: str | None = None  # why SparQ and Loki cannot run on this model, or None


# llama.cpp keeps per-layer settings in arrays of LLAMA_MAX_LAYERS and asserts (aborts) above it.
MAX_LAYERS = 512


def metadata_value(reader, key, default=None):
    """The value of metadata `key` in a gguf reader, or `default`; a string that is not UTF-8 is a SparqError."""
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


def open_gguf(path) -> gguf.GGUFReader:
    """Open a GGUF, turning every way it can be unreadable into a SparqError."""
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


def _shortest_f32(x: float) -> float:
    """A float32 as the shortest decimal that reads back as the same float32 (1e-05, not 9.99999975e-06),
    so that a value read equals the value the file was written from."""
    packed = struct.pack("<f", x)
    for digits in range(1, 10):
        v = float(f"{x:.{digits}g}")
        try:
            if struct.pack("<f", v) == packed:
                return v
        except OverflowError:  # rounded past the largest float32
            pass
    return x  # inf, nan


class GGUFHeader:
    """A GGUF's metadata and tensor table, read directly: scalars decoded on request, arrays only
    counted. The gguf package's reader decodes every array element (a 49k-token vocabulary and its
    merges take seconds in Python); a check needs a few keys and the tensors' extents."""

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    STRING, ARRAY = 8, 9

    class _Array:
        def __init__(self, count, values=None):
            self.count = count
            self.values = values  # decoded for short arrays of numbers (per-layer settings), else None

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
            value = struct.unpack_from(fmt, buf, pos)[0]
            return (_shortest_f32(value) if fmt == "<f" else value), pos + struct.calcsize(fmt)
        if vtype == self.STRING:
            return self._string(buf, pos)
        if vtype == self.ARRAY:
            itype, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            values = None
            if itype in self._SCALARS:
                size = struct.calcsize(self._SCALARS[itype])
                if count <= MAX_LAYERS and pos + count * size <= len(buf):
                    values = list(struct.unpack_from(f"<{count}{self._SCALARS[itype][1:]}", buf, pos))
                pos += count * size
            elif itype == self.STRING:
                for _ in range(count):  # skipped, not decoded
                    (n,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8 + n
            else:
                for _ in range(count):
                    _, pos = self._value(buf, pos, itype)
            if pos > len(buf):
                raise ValueError("an array runs past the end of the file")
            return self._Array(count, values), pos
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


def _read_header(path: Path) -> GGUFHeader:
    _check_is_gguf(path)
    try:
        header = GGUFHeader(path)
    except (ValueError, struct.error, OverflowError, MemoryError) as e:
        raise SparqError(f"{path} is a damaged or truncated GGUF file ({type(e).__name__}: {e})") from None
    header.check_extents()
    return header


def sparse_refusal(reader: "GGUFHeader", arch: str) -> str | None:
    """Why sparse attention cannot work on this model (a phrase naming the cause), or None."""
    def num(key):
        v = reader.get(f"{arch}.{key}", 0)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else 0

    if arch in RECURRENT_ARCHS:
        return f"{arch} is a recurrent architecture (no KV cache to select from)"
    if arch in HYBRID_ARCHS:
        return f"{arch} has hybrid recurrent/attention memory"
    if arch in SOFTCAP_ARCHS or num("attn_logit_softcapping") > 0:
        return f"{arch} soft-caps its attention logits ({arch}.attn_logit_softcapping)"
    if arch in ALIBI_ARCHS or num("attention.max_alibi_bias") > 0 or (arch == "baichuan" and num("block_count") == 40):
        return f"{arch} uses ALiBi position biases"
    if arch in SINK_ARCHS or any(name.endswith(".attn_sinks") or name.endswith(".attn_sinks.weight")
                                 for name, *_ in reader.tensors):
        return f"{arch} uses attention sinks"
    if arch in MLA_ARCHS or num("attention.key_length_mla") > 0 or num("attention.kv_lora_rank") > 0:
        return f"{arch} uses multi-head latent attention (MLA)"
    return None


# llama.cpp's default sliding-window pattern where the GGUF gives none (load_swa_pattern's n_pattern)
_SWA_PATTERN_DEFAULT = {"gemma3": 6, "olmo2": 4}


def swa_layers(path) -> tuple | None:
    """Per layer, True for a sliding-window layer, for models with interleaved sliding-window attention
    (gemma3, olmo2 with a window); None for every other model."""
    reader = _read_header(Path(path))
    return _swa_layers(reader, reader.get("general.architecture"), path)


def _number(reader: GGUFHeader, key: str, default):
    v = reader.get(key, default)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _swa_layers(reader: GGUFHeader, arch, path) -> tuple | None:
    if arch not in _SWA_PATTERN_DEFAULT or not _number(reader, f"{arch}.attention.sliding_window", 0) > 0:
        return None
    n_layer = reader.get(f"{arch}.block_count")
    pattern = reader.get(f"{arch}.attention.sliding_window_pattern", _SWA_PATTERN_DEFAULT[arch])
    if isinstance(pattern, GGUFHeader._Array) and pattern.values is not None and len(pattern.values) >= n_layer:
        return tuple(bool(x) for x in pattern.values[:n_layer])  # per-layer flags, as load_swa_pattern reads them
    if not isinstance(pattern, int) or isinstance(pattern, bool):
        raise SparqError(f"{path}: {arch}.attention.sliding_window_pattern must be a number or per-layer flags")
    return tuple(pattern == 0 or il % pattern < pattern - 1 for il in range(n_layer))


def check_sparse(summary: GGUFSummary, what: str = "sparse attention") -> None:
    """One clear error when `what` (SparQ, Loki, ...) cannot run on the model summary describes."""
    if summary.sparse_refusal:
        raise SparqError(f"{summary.path}: {what} cannot run on this model: {summary.sparse_refusal}; "
                         "use dense attention")


def check_gguf(path, archs=None) -> GGUFSummary:
    """Check that `path` is a complete model GGUF (of one of `archs`, when given), reading only its
    metadata. The summary's sparse_refusal says whether SparQ and Loki can run on it. A file checked before
    and unchanged since (the same inode, size and modification time) is not read again."""
    path = Path(path)
    archs = None if archs is None else tuple(sorted(archs))
    try:
        st = path.stat()
    except OSError:
        return _check_gguf(path, archs)  # names what is wrong with the path
    return _check_unchanged((str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), path, archs)


@functools.lru_cache(maxsize=32)
def _check_unchanged(file_key: tuple, path: Path, archs) -> GGUFSummary:
    return _check_gguf(path, archs)


def _check_gguf(path: Path, archs) -> GGUFSummary:
    reader = _read_header(path)
    arch = reader.get("general.architecture")
    if arch is None:
        raise SparqError(f"{path} has no general.architecture key; not a model GGUF")
    if not isinstance(arch, str):
        raise SparqError(f"{path}: general.architecture must be a string, got {str(arch)[:60]}")
    if archs is not None and arch not in archs:
        raise SparqError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(archs)})")
    refusal = sparse_refusal(reader, arch)
    # recurrent and hybrid models may give per-layer arrays or no attention heads at all; llama.cpp
    # checks those itself, and they only ever run dense here
    lenient = arch in RECURRENT_ARCHS or arch in HYBRID_ARCHS

    def hp(name, default=None):
        v = reader.get(f"{arch}.{name}", default)
        if lenient and not (isinstance(v, int) and not isinstance(v, bool)):
            return 0
        if v is None:
            raise SparqError(f"{path}: missing key {arch}.{name}")
        if not isinstance(v, int) or isinstance(v, bool):  # e.g. a per-layer array
            raise SparqError(f"{path}: {arch}.{name} must be one integer, got {str(v)[:60]}")
        return v

    n_head = hp("attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")

    def num(name, default):
        return _number(reader, f"{arch}.{name}", default)

    summary = GGUFSummary(
        path=path, arch=arch, n_layer=hp("block_count"), n_embd=hp("embedding_length"),
        n_head=n_head, n_head_kv=hp("attention.head_count_kv", n_head),
        n_ff=int(num("feed_forward_length", 0)),  # 0 where given per layer
        n_ctx_train=hp("context_length"),
        n_vocab=tokens.count if isinstance(tokens, GGUFHeader._Array) else hp("vocab_size", 0),
        rope_freq_base=float(num("rope.freq_base", 10000.0)),
        rms_eps=float(num("attention.layer_norm_rms_epsilon", ModelGeometry.rms_eps)),
        key_length=hp("attention.key_length", 0) or None,
        rope_freq_base_swa=float(num("rope.freq_base_swa", 10000.0)),
        embedding_scale=float(num("embedding_scale", 0.0)), residual_scale=float(num("residual_scale", 0.0)),
        attention_scale=float(num("attention.scale", 0.0)), logit_scale=float(num("logit_scale", 0.0)),
        file_type=reader.get("general.file_type"), name=str(reader.get("general.name", path.stem)),
        sparse_refusal=refusal,
    )
    _check_geometry(summary, heads=not lenient)
    _check_values(reader, arch, path)
    window = _swa_layers(reader, arch, path)  # after the check: one flag per layer
    if window:
        summary = dataclasses.replace(summary, n_swa=int(num("attention.sliding_window", 0)), swa_layers=window)
    return summary


def _check_values(reader: GGUFHeader, arch: str, path: Path) -> None:
    """Metadata ggml would assert on later (llama.cpp's loader refuses these too, by name): norm epsilons
    (ggml_norm, ggml_rms_norm: a number >= 0), expert counts that do not fit, an odd rope dimension count or one
    above the key head size (ggml_rope)."""
    key = f"{path}: {arch}."
    for name in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"):
        v = reader.get(f"{arch}.{name}")
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise SparqError(f"{key}{name} must be a finite number >= 0, got {str(v)[:60]}")
    n_expert, n_used = reader.get(f"{arch}.expert_count", 0), reader.get(f"{arch}.expert_used_count", 0)
    if isinstance(n_expert, int) and isinstance(n_used, int) and not isinstance(n_expert, bool):
        if n_expert > 0 and not 1 <= n_used <= n_expert:
            raise SparqError(f"{key}expert_used_count must be in 1..expert_count ({n_expert}), got {n_used}")
        if n_expert == 0 and n_used:
            raise SparqError(f"{key}expert_used_count = {n_used} without expert_count")
    head = _key_head_size(reader, arch)
    for name, head_key in (("rope.dimension_count", "attention.key_length"),
                           ("rope.dimension_count_swa", "attention.key_length_swa")):
        v = reader.get(f"{arch}.{name}")
        if not isinstance(v, int) or isinstance(v, bool):
            continue
        if v % 2:
            raise SparqError(f"{key}{name} must be even (RoPE turns pairs of components), got {v}")
        size = reader.get(f"{arch}.{head_key}", head)
        if isinstance(size, int) and not isinstance(size, bool) and size > 0 and v > size:
            raise SparqError(f"{key}{name} must be at most the key head size ({size}), got {v}")


def _key_head_size(reader: GGUFHeader, arch: str) -> int | None:
    """The key head size as llama.cpp's loader takes it: key_length, else embedding_length / head_count."""
    size = reader.get(f"{arch}.attention.key_length")
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    n_embd, n_head = reader.get(f"{arch}.embedding_length"), reader.get(f"{arch}.attention.head_count")
    if isinstance(n_head, list) and n_head:
        n_head = n_head[0]
    ok = all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (n_embd, n_head))
    return n_embd // n_head if ok else None


def _check_geometry(s: GGUFSummary, heads: bool = True) -> None:
    """Values llama.cpp would divide by or assert on (an abort, not an error) are refused here."""
    key = f"{s.path}: {s.arch}."
    if not 1 <= s.n_layer <= MAX_LAYERS:
        raise SparqError(f"{key}block_count must be in 1..{MAX_LAYERS}, got {s.n_layer}")
    if not heads:
        return
    if s.n_head < 1:
        raise SparqError(f"{key}attention.head_count must be >= 1, got {s.n_head}")
    if not 1 <= s.n_head_kv <= s.n_head or s.n_head % s.n_head_kv:
        raise SparqError(f"{key}attention.head_count_kv must be >= 1 and divide head_count ({s.n_head}), "
                         f"got {s.n_head_kv}")
    if s.n_embd < s.n_head:
        raise SparqError(f"{key}embedding_length must be at least head_count ({s.n_head}), got {s.n_embd}")
