"""The CUDA sources of the sparse attention op compile with nvcc for sm_80 and sm_90.

A compile check only: nothing here needs or uses a GPU, and a kernel that compiles is not a kernel that was run
(`test-backend-ops -o SPARSE_ATTN -b CUDA0` on a CUDA build checks the results against the CPU).

The files are those of the patched tree that the current patch series gives: the tree unpacked by the installed
build when it was built from this series, otherwise a fresh unpack of the pinned sdist with the series applied
(about 15 s). `SPARQ_CUDA_COMPILE_TREE=/path/to/llama.cpp` checks another patched tree instead (a `make tree`
checkout before `make export`, say).

Each file is compiled once for both architectures (two code generations in one nvcc call), the two files in
parallel: about a minute on 2 cores. The flags are those of ggml's CMake build of the CUDA backend (Release,
-DGGML_CUDA_NO_VMM=ON). ggml-cuda includes cuBLAS's headers; they are taken from the CUDA installation, from an
installed nvidia-cublas wheel, or from that wheel downloaded once with pip into the project's cache (headers only
are kept). Skipped, with the reason, when nvcc, the architectures or the headers are not available.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cuda_sources import KERNEL, patched_tree
from sparq_cpp.pyext.upstream import cache_root

ARCHS = ("80", "90")
# the new kernel, and the backend file whose dispatch and supports_op call it
SOURCES = (KERNEL, "ggml/src/ggml-cuda/ggml-cuda.cu")
# cuBLAS wheels whose headers match a CUDA major version
CUBLAS_WHEEL = {13: "nvidia-cublas==13.0.2.14", 12: "nvidia-cublas-cu12==12.9.3.13"}


def _nvcc() -> Path | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return Path(cand)
    return None


def _cuda_major(nvcc: Path) -> int:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.", out)
    assert m, out
    return int(m.group(1))


def _extract_headers(wheel: Path, dest: Path) -> Path | None:
    """The include/ folder of a cuBLAS wheel, unpacked under dest."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if "/include/" in n and not n.endswith("/")]
        for n in names:
            z.extract(n, dest)
    for h in dest.rglob("cublas_v2.h"):
        return h.parent
    return None


def _cublas_include(nvcc: Path, major: int) -> Path | str:
    """A folder holding cublas_v2.h, or the reason there is none."""
    env = os.environ.get("SPARQ_CUBLAS_INCLUDE")
    cands = [Path(env)] if env else []
    root = nvcc.resolve().parent.parent
    cands += [root / "include", root / "targets" / "x86_64-linux" / "include", Path("/usr/include")]
    site = Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    cands += [site / f"cu{major}" / "include", site / "cublas" / "include"]
    for c in cands:
        if (c / "cublas_v2.h").is_file():
            return c

    pkg = CUBLAS_WHEEL.get(major)
    if pkg is None:
        return f"no cuBLAS headers for CUDA {major} (set SPARQ_CUBLAS_INCLUDE)"
    dest = cache_root() / "cuda-headers" / pkg.replace("==", "-")
    found = next(iter(dest.rglob("cublas_v2.h")), None) if dest.exists() else None
    if found:
        return found.parent
    tmp = dest.with_name(dest.name + ".download")
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", pkg, "-d", str(tmp)],
                          capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl")) if tmp.exists() else []
    if proc.returncode != 0 or not wheels:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"cuBLAS headers not found and `pip download {pkg}` failed: {proc.stderr.strip()[-300:]}"
    shutil.rmtree(dest, ignore_errors=True)
    inc = _extract_headers(wheels[0], dest)
    shutil.rmtree(tmp, ignore_errors=True)
    return inc if inc else f"{pkg} has no cublas_v2.h"


@pytest.fixture(scope="module")
def toolchain():
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, CUDACXX, /usr/local/cuda/bin): the CUDA compile check needs the CUDA toolkit")
    archs = subprocess.run([str(nvcc), "--list-gpu-arch"], capture_output=True, text=True).stdout
    missing = [a for a in ARCHS if f"compute_{a}" not in archs]
    if missing:
        pytest.skip(f"{nvcc} cannot generate code for sm_{', sm_'.join(missing)}")
    major = _cuda_major(nvcc)
    inc = _cublas_include(nvcc, major)
    if isinstance(inc, str):
        pytest.skip(inc)
    return nvcc, inc


@pytest.fixture(scope="module")
def llama_tree(tmp_path_factory):
    return patched_tree(tmp_path_factory.mktemp("sdist"))


def _compile_cmd(nvcc: Path, inc: Path, tree: Path, src: str, out: Path) -> list[str]:
    cmd = [str(nvcc), "-forward-unknown-to-host-compiler",
           "-DGGML_BACKEND_BUILD", "-DGGML_BACKEND_SHARED", "-DGGML_CUDA_NO_VMM", "-DGGML_CUDA_USE_GRAPHS",
           "-DGGML_SCHED_MAX_COPIES=4", "-DGGML_SHARED", "-D_GNU_SOURCE", "-D_XOPEN_SOURCE=600", "-Dggml_cuda_EXPORTS",
           f"-I{tree / 'ggml' / 'src'}", f"-I{tree / 'ggml' / 'include'}", f"-I{inc}",
           "-O3", "-DNDEBUG"]
    for a in ARCHS:
        cmd.append(f"--generate-code=arch=compute_{a},code=[compute_{a},sm_{a}]")
    cmd += ["-Xcompiler=-fPIC", "-use_fast_math", "-extended-lambda", "-std=c++17",
            "-x", "cu", "-c", str(tree / src), "-o", str(out)]
    return cmd


def test_cuda_sources_compile(toolchain, llama_tree, tmp_path):
    nvcc, inc = toolchain
    missing = [s for s in SOURCES if not (llama_tree / s).is_file()]
    if missing:
        pytest.skip(f"the patched tree {llama_tree} has no {', '.join(missing)}: the series has no CUDA kernel yet")

    def run(src: str):
        out = tmp_path / (Path(src).stem + ".o")
        proc = subprocess.run(_compile_cmd(nvcc, inc, llama_tree, src, out), capture_output=True, text=True, timeout=900)
        return src, proc, out

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, SOURCES))

    errors = [f"{src} (sm_{', sm_'.join(ARCHS)}):\n{(proc.stdout + proc.stderr)[-4000:]}"
              for src, proc, _ in results if proc.returncode != 0]
    assert not errors, "nvcc failed:\n" + "\n".join(errors)
    for src, _, out in results:
        assert out.is_file() and out.stat().st_size > 0, src
