"""Text of four domains, each cut into a calibration part and a held-out part: what `sparq-cpp calibrate` fits
and probes on, and what `sparq-cpp eval --domain` scores, so that a setting is chosen and checked on text unlike
one novel.

| domain | source | licence |
| --- | --- | --- |
| prose | Jane Austen's six novels (sparq_cpp.train.corpus: Debian's r-cran-janeaustenr 1.0.0-1); held out: the last 5% of each novel, calibration: the start of each training part | public domain (package code MIT) |
| docs | the Python Language Reference's topics as plain text, `pydoc_data.topics` of the running Python (every CPython has it); topics alternate between the parts in sorted order | PSF License |
| code | the Python standard library's source of the running Python: held out `argparse`, `difflib`, `ipaddress`; calibration `configparser`, `statistics`, `fractions`, `calendar`, `heapq`, `textwrap`, `gettext`, `csv`, `shlex` | PSF License |
| chat | the English conversations of chatterbot-corpus 1.3.3 (a PyPI wheel fetched once with pip and checked by sha256), written as a "User:"/"Assistant:" transcript; conversations alternate between the parts | BSD 3-Clause |

The docs and code parts are those of the Python that runs the build (its version is in the manifest); the
others are pinned. The same inputs give the same bytes: `build()` writes `<domain>.heldout.txt` and
`<domain>.calib.txt` per domain, `calib-mixed.txt` (the default calibration corpus: the four calibration parts
in turns of about one 2048-token context each, so that any prefix of a few contexts covers every domain) and
`domains.json` (sources, licences, characters and sha256 of every file).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pydoc_data.topics
import yaml

from sparq_cpp.cache import cache_root, sha256_file
from sparq_cpp.errors import SparqError
from sparq_cpp.outfile import atomic_write
from sparq_cpp.train import corpus

DOMAINS = ("prose", "docs", "code", "chat")
VERSION = 1  # of the recipe: a change of cut or source is a new version (a new cache folder)

CODE_HELDOUT = ("argparse", "difflib", "ipaddress")
CODE_CALIB = ("configparser", "statistics", "fractions", "calendar", "heapq", "textwrap", "gettext", "csv", "shlex")
CHAT_WHEEL = "chatterbot_corpus-1.3.3-py2.py3-none-any.whl"
CHAT_PACKAGE = "chatterbot-corpus==1.3.3"
CHAT_SHA256 = "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154"
PROSE_CALIB_CHARS = 40_000   # of each novel's training part
MIX_CHARS = 8_000            # a turn of the mixed corpus: about one 2048-token context of prose

SOURCES = {
    "prose": (corpus.SOURCE, "public domain (package code MIT)"),
    "docs": ("the Python Language Reference's topics (pydoc_data.topics) of Python {py}", "PSF License"),
    "code": ("the Python {py} standard library's source", "PSF License"),
    "chat": (f"the English conversations of {CHAT_PACKAGE} (PyPI wheel, sha256 {CHAT_SHA256[:12]}...)",
             "BSD 3-Clause"),
}


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def _head(text: str, n: int) -> str:
    """The whole paragraphs within the first n characters (the first n characters if one is longer)."""
    if len(text) <= n:
        return text.strip()
    cut = text.rfind("\n\n", 0, n)
    return text[:cut if cut > 0 else n].strip()


def prose(deb=None) -> tuple[str, str]:
    """(held out, calibration): the last 5% of each novel; the first 40k characters of each training part."""
    train, val = corpus.split(corpus.load_novels(deb))
    return ("\n\n".join(t.strip() for t in val) + "\n",
            "\n\n".join(_head(t, PROSE_CALIB_CHARS) for t in train) + "\n")


def docs() -> tuple[str, str]:
    """(held out, calibration): the odd and the even topics in sorted order, each under its name."""
    topics = sorted(pydoc_data.topics.topics.items())

    def join(part):
        return "\n\n".join(f"{name}\n{'=' * len(name)}\n\n{text.strip()}" for name, text in part) + "\n"

    return join(topics[1::2]), join(topics[0::2])


def code() -> tuple[str, str]:
    """(held out, calibration): the named standard library modules' source, each under a '# file:' line."""
    root = Path(sysconfig.get_paths()["stdlib"])

    def join(names):
        out = []
        for name in names:
            path = root / f"{name}.py"
            if not path.is_file():
                raise SparqError(f"the code domain needs the Python standard library's {name}.py, not found in {root}")
            out.append(f"# file: {name}.py\n" + path.read_text(encoding="utf-8"))
        return "\n\n".join(s.rstrip() for s in out) + "\n"

    return join(CODE_HELDOUT), join(CODE_CALIB)


def chat_wheel() -> Path:
    """chatterbot-corpus's wheel in the cache, downloaded with pip on first use and checked by sha256."""
    target = cache_root() / "corpus" / CHAT_WHEEL
    if target.is_file() and sha256_file(target) == CHAT_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", CHAT_PACKAGE, "--no-deps", "-q", "-d", tmp],
                              capture_output=True, text=True)
        got = Path(tmp) / CHAT_WHEEL
        if proc.returncode != 0 or not got.is_file():
            raise SparqError(f"could not download {CHAT_PACKAGE} (the chat domain's text): "
                             f"{(proc.stderr or proc.stdout).strip()[-300:]}")
        if sha256_file(got) != CHAT_SHA256:
            raise SparqError(f"{CHAT_WHEEL} does not match its pinned sha256; refusing to use it")
        os.replace(got, target)
    return target


def conversations(wheel: Path) -> list[list[str]]:
    """The English conversations of the wheel, file by file in sorted order, each a list of turns."""
    out = []
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith("chatterbot_corpus/data/english/")
                       and n.endswith(".yml"))
        if not names:
            raise SparqError(f"{wheel.name} holds no English conversations")
        for name in names:
            doc = yaml.safe_load(z.read(name).decode("utf-8"))
            for conv in doc.get("conversations") or []:
                turns = [" ".join(str(t).split()) if "\n" not in str(t).strip() else str(t).strip() for t in conv]
                if len(turns) >= 2:
                    out.append(turns)
    return out


def _transcript(convs: list[list[str]]) -> str:
    return "\n\n".join("\n".join(f"{'User' if i % 2 == 0 else 'Assistant'}: {t}" for i, t in enumerate(c))
                       for c in convs) + "\n"


def chat() -> tuple[str, str]:
    """(held out, calibration): the odd and the even conversations, as transcripts."""
    convs = conversations(chat_wheel())
    return _transcript(convs[1::2]), _transcript(convs[0::2])


def _pieces(text: str, n: int) -> list[str]:
    """text in pieces of about n characters, cut at blank lines where there is one (else at a line break)."""
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + n)
        if end < len(text):
            cut = text.rfind("\n\n", start + n // 2, end)
            cut = cut if cut > 0 else text.rfind("\n", start + n // 2, end)
            end = cut + 1 if cut > 0 else end
        piece = text[start:end].strip()
        if piece:
            out.append(piece)
        start = end
    return out


def mixed(calib: dict[str, str], n: int = MIX_CHARS) -> str:
    """The calibration parts in turns of about n characters (code and chat tokenize denser than prose, so a turn
    of each is about as many tokens), domain by domain in DOMAINS order, until every part is used up."""
    pieces = {d: _pieces(calib[d], n) for d in DOMAINS if d in calib}
    out = []
    for i in range(max(map(len, pieces.values()))):
        out += [p[i] for p in pieces.values() if i < len(p)]
    return "\n\n".join(out) + "\n"


def texts(deb=None) -> dict[str, tuple[str, str]]:
    """{domain: (held out, calibration)}."""
    return {"prose": prose(deb), "docs": docs(), "code": code(), "chat": chat()}


def build(out, deb=None) -> dict:
    """Writes the domain files under `out` (see the module's doc); returns the manifest ({"domains": {name:
    {"heldout": path, "calib": path, ...}}, "mixed": path, ...})."""
    out = Path(out)
    parts = texts(deb)
    files = {}
    for d, (held, cal) in parts.items():
        files[f"{d}.heldout.txt"] = held
        files[f"{d}.calib.txt"] = cal
    files["calib-mixed.txt"] = mixed({d: cal for d, (_, cal) in parts.items()})

    def write(name, text):
        return atomic_write(out / name, lambda tmp: tmp.write_text(text, encoding="utf-8"), "--out", make_parents=True)

    paths = {name: write(name, text) for name, text in files.items()}
    py = python_version()
    manifest = {
        "version": VERSION, "python": py,
        "domains": {d: {"source": SOURCES[d][0].format(py=py), "licence": SOURCES[d][1],
                        "heldout": str(paths[f"{d}.heldout.txt"]), "calib": str(paths[f"{d}.calib.txt"]),
                        "heldout_chars": len(parts[d][0]), "calib_chars": len(parts[d][1]),
                        "heldout_sha256": hashlib.sha256(parts[d][0].encode()).hexdigest(),
                        "calib_sha256": hashlib.sha256(parts[d][1].encode()).hexdigest()} for d in parts},
        "mixed": str(paths["calib-mixed.txt"]), "mixed_chars": len(files["calib-mixed.txt"]),
        "mixed_sha256": hashlib.sha256(files["calib-mixed.txt"].encode()).hexdigest(),
    }
    write("domains.json", json.dumps(manifest, indent=1) + "\n")
    return manifest


def cached(deb=None, log=lambda msg: None) -> dict:
    """The manifest of the domain files in the cache (built there on first use, per recipe version and Python
    version: the docs and code parts are that Python's)."""
    where = cache_root() / "corpus" / f"domains-v{VERSION}-py{python_version()}"
    manifest = where / "domains.json"
    if manifest.is_file():
        doc = json.loads(manifest.read_text())
        if all(Path(v[k]).is_file() for v in doc["domains"].values() for k in ("heldout", "calib")) \
                and Path(doc["mixed"]).is_file():
            return doc
    log(f"building the held-out domains ({', '.join(DOMAINS)}) into {where}")
    return build(where, deb)


def heldout_texts(manifest: dict) -> dict[str, str]:
    """{domain: held-out text} of a manifest."""
    return {d: Path(v["heldout"]).read_text(encoding="utf-8") for d, v in manifest["domains"].items()}
