"""The CUDA sources of the sparse attention op compile with nvcc for sm_80 and sm_90.

A compile check only: nothing here needs or uses a GPU, and a kernel that compiles is not a kernel that was run
(`test-backend-ops -o SPARSE_ATTN -b CUDA0` on a CUDA build checks the results against the CPU).

The files are those of the patched tree that the current patch series gives: the tree unpacked by the installed
build when it was built from this series, otherwise a fresh unpack of the pinned sdist with the series applied
(about 15 s). `SPARQ_CUDA_COMPILE_TREE=/path/to/llama.cpp` checks another patched tree instead (a `make tree`
checkout before `make export`, say).

Each file is compiled once for both architectures (two code generations in one nvcc call), the two files in
parallel: about a minute on 2 cores. The flags are those of ggml's CMake build of the CUDA backend (Release,
-DGGML_CUDA_NO_VMM=ON). ggml-cuda includes cuBLAS's headers; they are those the build uses (sparq_cpp/pyext/cuda.py: the
CUDA installation's, an installed nvidia-cublas wheel's, or the pinned wheel's, downloaded once with pip into the
project's cache; for this check, headers only). Skipped, with the reason, when nvcc, the architectures or the headers are not available.
"""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cuda_sources import KERNEL, patched_tree
from sparq_cpp.errors import SparqError
from sparq_cpp.pyext import cuda as pcuda

ARCHS = ("80", "90")
# the new kernel, and the backend file whose dispatch and supports_op call it
SOURCES = (KERNEL, "ggml/src/ggml-cuda/ggml-cuda.cu")


@pytest.fixture(scope="module")
def toolchain():
    nvcc = pcuda.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH, CUDACXX, /usr/local/cuda/bin): the CUDA compile check needs the CUDA toolkit")
    archs = subprocess.run([str(nvcc), "--list-gpu-arch"], capture_output=True, text=True).stdout
    missing = [a for a in ARCHS if f"compute_{a}" not in archs]
    if missing:
        pytest.skip(f"{nvcc} cannot generate code for sm_{', sm_'.join(missing)}")
    if os.environ.get("SPARQ_CUBLAS_INCLUDE"):
        return nvcc, Path(os.environ["SPARQ_CUBLAS_INCLUDE"])
    try:
        return nvcc, pcuda.fetch_cublas(nvcc, headers_only=True, log=lambda *_: None).include
    except SparqError as e:
        pytest.skip(str(e))


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
