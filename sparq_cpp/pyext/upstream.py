"""The pinned upstream: fetch the llama-cpp-python sdist from the package index, verify it, unpack it.

Upstream code never enters this repository; only `patches/pin.txt` names it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sparq_cpp.cache import cache_root, sha256_file  # here too: the build tooling's names for them
from sparq_cpp.errors import SparqError

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCHES_DIR = REPO_ROOT / "patches"


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    sdist: str
    sha256: str

    @classmethod
    def load(cls, path: Path | None = None) -> "Pin":
        path = path or PATCHES_DIR / "pin.txt"
        fields = {}
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                fields[key.strip()] = value.strip()
        try:
            return cls(**{k: fields[k] for k in ("package", "version", "sdist", "sha256")})
        except KeyError as e:
            raise SparqError(f"{path}: missing field {e.args[0]!r}") from None


def verify_sdist(path: Path, pin: Pin) -> None:
    got = sha256_file(path)
    if got != pin.sha256:
        raise SparqError(
            f"sdist hash mismatch for {path}: expected sha256 {pin.sha256}, got {got} "
            "(corrupted or foreign download; delete it to fetch again)"
        )


def fetch_sdist(pin: Pin | None = None, log=print) -> Path:
    """The verified sdist, downloaded once with pip (the only network the build uses)."""
    pin = pin or Pin.load()
    dest_dir = cache_root() / "sdist"
    path = dest_dir / pin.sdist
    if not path.exists():
        dest_dir.mkdir(parents=True, exist_ok=True)
        log(f"downloading {pin.package}=={pin.version} sdist from the package index")
        with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   f"{pin.package}=={pin.version}", "-d", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / pin.sdist
            if proc.returncode != 0 or not got.exists():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                raise SparqError(f"could not download {pin.sdist}: {' | '.join(tail)}")
            verify_sdist(got, pin)
            os.replace(got, path)
    verify_sdist(path, pin)
    return path


def unpack_sdist(sdist: Path, dest: Path) -> Path:
    """Unpack into `dest` (replaced if present); returns the sdist's top directory."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="tar")
    (top,) = [p for p in dest.iterdir() if p.is_dir()]
    # The sdist ships upstream's .git (and the submodule's .git file, which points nowhere here).
    # Neither is needed, and git would otherwise treat the tree as a repo when applying patches.
    for git in (top / ".git", top / "vendor" / "llama.cpp" / ".git"):
        if git.is_dir():
            shutil.rmtree(git)
        elif git.exists():
            git.unlink()
    return top
