"""The training text: Jane Austen's six novels, from Debian's r-cran-janeaustenr package.

Source and licence: the novels are in the public domain (first published 1811-1818; the texts are
Project Gutenberg's, packaged by Julia Silge for CRAN as `janeaustenr`, package code MIT-licensed,
and by Debian as `r-cran-janeaustenr` 1.0.0-1, section main). Getting it needs only the Debian
archive, which a fresh Debian/Ubuntu machine can reach:

    apt-get download r-cran-janeaustenr=1.0.0-1      # any directory; no root needed

`fetch()` runs that command into the cache (or takes a .deb you already have), checks the pinned
sha256, and reads the texts out of the package's R data without R: a .deb is an `ar` archive
holding `data.tar.xz`, and the texts are character vectors in an R lazy-load database.
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from sparq_cpp.cache import sha256_file
from sparq_cpp.errors import SparqError
from sparq_cpp.train.rdata import lazyload_objects

PACKAGE = "r-cran-janeaustenr"
VERSION = "1.0.0-1"
DEB_NAME = f"{PACKAGE}_{VERSION}_all.deb"
DEB_SHA256 = "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"
_DATA = "./usr/lib/R/site-library/janeaustenr/data/Rdata."
SOURCE = (f"Jane Austen's six novels (public domain; Project Gutenberg texts via CRAN janeaustenr, MIT), "
          f"Debian package {PACKAGE} {VERSION}")


def cache_dir() -> Path:
    root = os.environ.get("SPARQ_CPP_CACHE") or "~/.cache/sparq-cpp"
    return Path(root).expanduser() / "corpus"


def fetch(deb: str | Path | None = None) -> Path:
    """The pinned .deb in the cache, downloaded with apt-get if needed; SparqError if unobtainable."""
    target = cache_dir() / DEB_NAME
    if deb is not None:
        deb = Path(deb)
        if not deb.is_file():
            raise SparqError(f"--deb: file not found: {deb}")
        if sha256_file(deb) != DEB_SHA256:
            raise SparqError(f"--deb: {deb} is not {DEB_NAME} (sha256 differs)")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(deb, target)
    if target.is_file() and sha256_file(target) == DEB_SHA256:
        return target
    if shutil.which("apt-get") is None:
        raise SparqError(f"cannot fetch the corpus: apt-get not found; download {DEB_NAME} from a Debian "
                         f"mirror (pool/main/r/{PACKAGE}/) and pass it with --deb")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        r = subprocess.run(["apt-get", "download", f"{PACKAGE}={VERSION}"], cwd=tmp,
                           capture_output=True, text=True)
        got = Path(tmp) / DEB_NAME
        if r.returncode != 0 or not got.is_file():
            msg = (r.stderr or r.stdout).strip().splitlines()
            raise SparqError(f"apt-get download {PACKAGE}={VERSION} failed: {msg[-1] if msg else r.returncode} "
                             f"(run `apt-get update` first, or pass the .deb with --deb)")
        if sha256_file(got) != DEB_SHA256:
            raise SparqError(f"downloaded {DEB_NAME} has an unexpected sha256; not using it")
        os.replace(got, target)
    return target


def _ar_member(deb: bytes, prefix: str) -> bytes:
    """The first member of an ar archive whose name starts with prefix."""
    if deb[:8] != b"!<arch>\n":
        raise SparqError("corpus: the .deb is not an ar archive")
    pos = 8
    while pos + 60 <= len(deb):
        header = deb[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        if name.startswith(prefix):
            return deb[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
    raise SparqError(f"corpus: no {prefix}* in the .deb")


def _novels_from_deb(deb_path: Path) -> list[list[str]]:
    data = _ar_member(deb_path.read_bytes(), "data.tar")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        rdx = tar.extractfile(_DATA + "rdx").read()
        rdb = tar.extractfile(_DATA + "rdb").read()
    return lazyload_objects(rdx, rdb)


def _paragraphs(lines: list[str]) -> list[str]:
    """Gutenberg lines are wrapped at ~70 columns: join each paragraph's lines into one line."""
    paras, cur = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            cur.append(line)
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return paras


def load_novels(deb: str | Path | None = None) -> dict[str, str]:
    """{title: text}, paragraphs separated by a blank line, in a fixed (alphabetical) order."""
    novels = {}
    for lines in _novels_from_deb(fetch(deb)):
        paras = _paragraphs(lines)
        novels[paras[0].title()] = "\n\n".join(paras) + "\n"
    if len(novels) != 6:
        raise SparqError(f"corpus: expected 6 novels, found {len(novels)}")
    return dict(sorted(novels.items()))


def split(novels: dict[str, str], val_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """(train texts, validation texts): the last val_fraction of each novel is held out."""
    train, val = [], []
    for text in novels.values():
        cut = text.rfind("\n\n", 0, int(len(text) * (1 - val_fraction))) + 2
        train.append(text[:cut])
        val.append(text[cut:])
    return train, val
