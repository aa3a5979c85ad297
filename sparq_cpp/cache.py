"""The per-user cache every clone on the machine shares (builds, the pinned sdist, generated and fetched
models), and the file hash that checks what is kept there."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    """Where builds, sdists and generated models are cached (shared by every clone on the machine)."""
    return Path(os.environ.get("SPARQ_CPP_CACHE", Path.home() / ".cache" / "sparq-cpp"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
