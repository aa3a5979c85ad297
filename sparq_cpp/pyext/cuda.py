"""What a CUDA build of llama.cpp needs beyond nvcc: cuBLAS, the architectures, the driver library.

ggml's CUDA backend links cuBLAS, which a machine with only the CUDA compiler does not have. The build then
fetches the cuBLAS wheel that matches nvcc's major version from the package index, once, unpacks it into the
project's cache and points CMake at it, so nothing is installed by hand. Without a GPU, "native" architectures
cannot be detected: Ampere and Hopper (80;90) are built. Without the driver library (no GPU, no stub), ggml's
virtual-memory pool, the one thing that links it, is turned off (GGML_CUDA_NO_VMM).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sparq_cpp.errors import SparqError
from sparq_cpp.pyext.upstream import cache_root

# cuBLAS wheels pinned per CUDA major version
CUBLAS_WHEEL = {13: "nvidia-cublas==13.0.2.14", 12: "nvidia-cublas-cu12==12.9.3.13"}
# built when no GPU is there to name its own
DEFAULT_ARCHS = "80;90"


def find_nvcc() -> Path | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return Path(cand)
    return None


def cuda_major(nvcc: Path) -> int:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.", out)
    if not m:
        raise SparqError(f"{nvcc} --version: no release number in {out.strip()[-200:]!r}")
    return int(m.group(1))


def toolkit_root(nvcc: Path) -> Path:
    return nvcc.resolve().parent.parent


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    proc = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return proc.returncode == 0 and "GPU" in proc.stdout


def has_driver_library(nvcc: Path) -> bool:
    """libcuda.so, the driver or the toolkit's link stub."""
    root = toolkit_root(nvcc)
    stubs = [root / d / "stubs" / "libcuda.so" for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
    if any(p.is_file() for p in stubs):
        return True
    proc = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True) if shutil.which("ldconfig") else None
    return bool(proc and "libcuda.so" in proc.stdout)


@dataclass(frozen=True)
class Cublas:
    spec: str | None  # where it came from (a pinned wheel, an installed one); None: the toolkit's own
    include: Path
    libs: dict[str, Path]  # cublas, cublasLt -> shared library; empty for the toolkit's own


def _toolkit_cublas(nvcc: Path) -> Cublas | None:
    root = toolkit_root(nvcc)
    for inc, lib in ((root / "include", root / "lib64"),
                     (root / "targets/x86_64-linux/include", root / "targets/x86_64-linux/lib")):
        if (inc / "cublas_v2.h").is_file() and any(lib.glob("libcublas.so*")):
            return Cublas(None, inc, {})
    return None


def _installed_wheel(major: int, headers_only: bool) -> Cublas | None:
    """cuBLAS of a wheel installed into this Python environment."""
    site = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    for sub in (f"cu{major}", "cublas"):
        found = _found(site / sub, headers_only, f"installed {site / sub}")
        if found:
            return found
    return None


def _unpack(wheel: Path, dest: Path, headers_only: bool) -> None:
    with zipfile.ZipFile(wheel) as z:
        for n in z.namelist():
            if n.endswith("/") or not n.startswith("nvidia/"):
                continue
            if "/include/" in n or (not headers_only and "/lib/" in n):
                z.extract(n, dest)


def fetch_cublas(nvcc: Path, headers_only: bool = False, log=print) -> Cublas:
    """cuBLAS for nvcc's CUDA version: the toolkit's own, else the pinned wheel unpacked into the cache
    (downloaded once, about 400 MB; headers_only keeps just the headers, for a compile check)."""
    major = cuda_major(nvcc)
    own = _toolkit_cublas(nvcc) or _installed_wheel(major, headers_only)
    if own:
        return own
    spec = CUBLAS_WHEEL.get(major)
    if spec is None:
        raise SparqError(f"no pinned cuBLAS wheel for CUDA {major} (known: {sorted(CUBLAS_WHEEL)}); install cuBLAS "
                         "into the CUDA toolkit")
    dest = cache_root() / ("cuda-headers" if headers_only else "cuda") / spec.replace("==", "-")
    found = _found(dest, headers_only, spec)
    if found:
        return found
    tmp = dest.with_name(dest.name + ".download")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"fetching {spec} (cuBLAS for CUDA {major}) into {dest.parent}")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", str(tmp)],
                          capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl")) if tmp.exists() else []
    if proc.returncode != 0 or not wheels:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SparqError(f"cuBLAS not found in the CUDA toolkit and `pip download {spec}` failed: "
                         f"{proc.stderr.strip()[-300:]}")
    staging = dest.with_name(dest.name + ".unpack")
    shutil.rmtree(staging, ignore_errors=True)
    _unpack(wheels[0], staging, headers_only)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(staging, dest)  # whole or not at all
    found = _found(dest, headers_only, spec)
    if not found:
        raise SparqError(f"{spec}: no cublas_v2.h{'' if headers_only else ' or libcublas'} in the wheel")
    return found


def _found(dest: Path, headers_only: bool, spec: str) -> Cublas | None:
    if not dest.is_dir():
        return None
    header = next(iter(dest.rglob("cublas_v2.h")), None)
    if header is None:
        return None
    if headers_only:
        return Cublas(spec, header.parent, {})
    libs = {}
    for name in ("cublas", "cublasLt"):
        lib = next(iter(sorted(dest.rglob(f"lib{name}.so.*"))), None)
        if lib is None:
            return None
        libs[name] = lib
    return Cublas(spec, header.parent, libs)


def cmake_args(nvcc: Path, arch: str, cublas: Cublas) -> list[str]:
    """CMake arguments of a CUDA build with this toolkit; arch "auto": native with a GPU, else DEFAULT_ARCHS."""
    if arch == "auto":
        arch = "native" if has_gpu() else DEFAULT_ARCHS
    args = ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={arch}", f"-DCMAKE_CUDA_COMPILER={nvcc}"]
    if not has_driver_library(nvcc):
        args.append("-DGGML_CUDA_NO_VMM=ON")
    if cublas.spec:
        args += [f"-DCMAKE_CUDA_FLAGS=-I{cublas.include}",
                 f"-DCUDA_cublas_LIBRARY={cublas.libs['cublas']}", f"-DCUDA_cublasLt_LIBRARY={cublas.libs['cublasLt']}"]
    return args
