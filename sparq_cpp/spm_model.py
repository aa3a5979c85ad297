"""SentencePiece's tokenizer.model (a ModelProto protobuf), read and written without sentencepiece.

Hugging Face Llama checkpoints carry their SPM vocabulary in this file. Only the fields that
llama.cpp's "llama" tokenizer uses are read: the pieces (text, score, type), the model type (BPE:
merges by piece score, which is what llama.cpp implements), byte fallback, and the normalizer's
add_dummy_prefix (llama.cpp's add_space_prefix). Field numbers are sentencepiece_model.proto's.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from sparq_cpp.errors import SparqError

# SentencePiece.Type, which is also gguf's TokenType numbering
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2


@dataclass
class SpmModel:
    pieces: list[str]
    scores: list[float]
    types: list[int]
    model_type: int = BPE
    byte_fallback: bool = True
    add_dummy_prefix: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2


# ---- wire format ------------------------------------------------------------------------------

def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32 values are written as 10-byte varints
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes_field(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def _int_field(field: int, n: int) -> bytes:
    return _key(field, 0) + _varint(int(n))


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        if pos >= len(buf):
            raise SparqError("truncated varint")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, pos


def _fields(buf: bytes):
    """(field, wire type, value) for each field of a message; value is int, float bits or bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise SparqError(f"unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise SparqError("truncated protobuf message")
        yield field, wire, value


def _signed32(n: int) -> int:
    n &= (1 << 64) - 1
    return n - (1 << 64) if n >= 1 << 63 else n


# ---- ModelProto -------------------------------------------------------------------------------

def dumps(m: SpmModel) -> bytes:
    out = bytearray()
    for piece, score, typ in zip(m.pieces, m.scores, m.types):
        sp = _bytes_field(1, piece.encode("utf-8")) + _key(2, 5) + struct.pack("<f", score) + _int_field(3, typ)
        out += _bytes_field(1, sp)
    trainer = (_int_field(3, m.model_type) + _int_field(4, len(m.pieces)) + _int_field(35, m.byte_fallback)
               + _int_field(40, m.unk_id) + _int_field(41, m.bos_id) + _int_field(42, m.eos_id)
               + _int_field(43, -1))
    out += _bytes_field(2, trainer)
    normalizer = (_bytes_field(1, b"identity") + _int_field(3, m.add_dummy_prefix)
                  + _int_field(4, 0) + _int_field(5, 1))
    out += _bytes_field(3, normalizer)
    return bytes(out)


def loads(buf: bytes) -> SpmModel:
    """Parse a tokenizer.model; SparqError on anything that is not a SentencePiece model."""
    m = SpmModel([], [], [], model_type=UNIGRAM, byte_fallback=False, add_dummy_prefix=True)
    try:
        for field, wire, value in _fields(buf):
            if field == 1 and wire == 2:
                piece, score, typ = None, 0.0, NORMAL
                for f, w, v in _fields(value):
                    if f == 1 and w == 2:
                        piece = v.decode("utf-8")
                    elif f == 2 and w == 5:
                        (score,) = struct.unpack("<f", v)
                    elif f == 3 and w == 0:
                        typ = v
                if piece is None:
                    raise SparqError("a piece has no text")
                m.pieces.append(piece)
                m.scores.append(score)
                m.types.append(typ)
            elif field == 2 and wire == 2:
                for f, w, v in _fields(value):
                    if w != 0:
                        continue
                    if f == 3:
                        m.model_type = v
                    elif f == 35:
                        m.byte_fallback = bool(v)
                    elif f in (40, 41, 42):
                        setattr(m, {40: "unk_id", 41: "bos_id", 42: "eos_id"}[f], _signed32(v))
            elif field == 3 and wire == 2:
                for f, w, v in _fields(value):
                    if f == 3 and w == 0:
                        m.add_dummy_prefix = bool(v)
    except (UnicodeDecodeError, struct.error) as e:
        raise SparqError(f"not a SentencePiece model ({e})") from None
    if not m.pieces:
        raise SparqError("no pieces: not a SentencePiece model")
    return m
