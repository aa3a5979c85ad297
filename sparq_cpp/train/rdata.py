"""Just enough of R's serialization format to read character vectors out of an R package's data.

R packages keep their datasets in a lazy-load database: `Rdata.rdx` (a gzipped serialized index:
offsets and lengths) and `Rdata.rdb` (one zlib-compressed serialized object per dataset, each
prefixed by its uncompressed length). Objects are written in XDR ("X\\n") format. Reading the
janeaustenr text needs strings, lists, symbols and attributes, nothing more, so R is not needed.
"""
from __future__ import annotations

import gzip
import struct
import zlib

from sparq_cpp.errors import SparqError

# SEXP types used here (R internals, "Serialization formats").
_SYMSXP, _LISTSXP, _CHARSXP, _LGLSXP, _INTSXP, _REALSXP, _STRSXP, _VECSXP = 1, 2, 9, 10, 13, 14, 16, 19
_REFSXP, _NILVALUE = 255, 254
_SPECIAL = {253, 252, 251, 250, 249, 248, 247, 242, 241}  # environments and markers: no payload
_HAS_ATTR, _HAS_TAG = 1 << 9, 1 << 10
_LATIN1 = 1 << 2 << 12


class _Reader:
    def __init__(self, buf: bytes):
        self.buf, self.pos, self.refs = buf, 0, []

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        if t == _NILVALUE:
            return None
        if t in _SPECIAL:
            return None
        if t == _REFSXP:
            return self.refs[(flags >> 8) - 1]
        if t == _SYMSXP:
            sym = ("symbol", self.item())
            self.refs.append(sym)
            return sym
        if t == _CHARSXP:
            n = self.int()
            if n == -1:
                return None  # NA_character_
            raw = self.buf[self.pos:self.pos + n]
            self.pos += n
            return raw.decode("latin-1" if flags & _LATIN1 else "utf-8")
        if t == _LISTSXP:  # pairlist node: [attr] [tag] car cdr
            attr = self.item() if flags & _HAS_ATTR else None
            tag = self.item() if flags & _HAS_TAG else None
            return ("pairlist", tag, self.item(), self.item(), attr)
        if t in (_LGLSXP, _INTSXP):
            n = self.int()
            out = list(struct.unpack_from(f">{n}i", self.buf, self.pos))
            self.pos += 4 * n
        elif t == _REALSXP:
            n = self.int()
            out = list(struct.unpack_from(f">{n}d", self.buf, self.pos))
            self.pos += 8 * n
        elif t in (_STRSXP, _VECSXP):
            out = [self.item() for _ in range(self.int())]
        else:
            raise SparqError(f"R data: unsupported object type {t}")
        if flags & _HAS_ATTR:
            self.item()  # names etc.: not needed, the caller knows the order
        return out


def unserialize(buf: bytes):
    """One R object from its XDR serialization (format version 2 or 3)."""
    if buf[:2] != b"X\n":
        raise SparqError("R data: not an XDR serialization")
    r = _Reader(buf)
    r.pos = 2
    version = r.int()
    r.int(), r.int()  # writer version, minimal reader version
    if version == 3:
        n = r.int()  # native encoding name: length, then bytes
        r.pos += n
    return r.item()


def lazyload_objects(rdx: bytes, rdb: bytes) -> list:
    """Every object of a lazy-load database, in the index's order (R keeps them sorted by name)."""
    try:
        index = unserialize(gzip.decompress(rdx))
        out = []
        for offset, length in index[0]:
            blob = rdb[offset:offset + length]
            out.append(unserialize(zlib.decompress(blob[4:])))
    except (OSError, zlib.error, struct.error, IndexError, TypeError) as e:
        raise SparqError(f"R data: damaged lazy-load database ({type(e).__name__}: {e})") from None
    return out
