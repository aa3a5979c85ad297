"""A bundle for checking the sparse attention op's CUDA kernel on a machine with a GPU (`make gpu-check`).

The CUDA kernel of GGML_OP_SPARSE_ATTN is compiled in CI (tests/test_cuda_compile.py) but can only be run where
there is a GPU. This writes a self-contained folder (default `.sparq-build/gpu-check`, a few MiB) that such a
machine needs, with no network:

  llama-trimmed.tar.gz  the patched llama.cpp of the current series, trimmed to ggml (CPU and CUDA backends) and
                        tests/test-backend-ops.cpp, with a small CMakeLists.txt that builds only test-backend-ops
  run.sh                `run.sh build` configures and builds it with CUDA for the GPU present (CMake, nvcc and a
                        C++ compiler needed) in `<bundle>-work` beside the bundle (so that a fresh copy of the
                        bundle, as a device run carries it, keeps the build); `run.sh test` runs `test-backend-ops -o SPARSE_ATTN -b CUDA0` (every
                        SparQ and Loki case against the CPU backend, planted inputs); `run.sh bench` times the op
                        (`test-backend-ops perf -o SPARSE_ATTN`, the decode shapes at 4k-32k cells) beside flash
                        attention. Logs go to $OUT if it is set, else to the bundle's folder.

The patched tree is taken as tests/test_cuda_compile.py takes it: `--tree DIR` (a `make tree` checkout), else the
installed build's tree if it was built from the current series, else the pinned sdist unpacked with the series
applied.
"""
from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
import tempfile
from pathlib import Path

import click

from sparq_cpp.pyext.patchtree import patch_tree, series, series_hash
from sparq_cpp.pyext.upstream import REPO_ROOT, fetch_sdist, unpack_sdist

DEFAULT_OUT = REPO_ROOT / ".sparq-build" / "gpu-check"

# what of ggml/src a CPU + CUDA build reads: its own files and these backend folders
GGML_SRC_DIRS = ("ggml-cpu", "ggml-cuda")

CMAKELISTS = """\
# test-backend-ops and ggml (CPU and CUDA backends) only, from the patched llama.cpp of the sparq-cpp series
cmake_minimum_required(VERSION 3.14)
project(sparq-gpu-check C CXX)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_subdirectory(ggml)
add_executable(test-backend-ops tests/test-backend-ops.cpp)
target_link_libraries(test-backend-ops PRIVATE ggml)
target_compile_features(test-backend-ops PRIVATE cxx_std_17)
"""

RUN_SH = r"""#!/usr/bin/env bash
# sparq-cpp GPU check: build test-backend-ops with CUDA, check SPARSE_ATTN (SparQ and Loki) against the CPU, time it.
#   run.sh build   configure and build (CMAKE_CUDA_ARCHITECTURES=native unless CUDA_ARCH is set; JOBS=nproc)
#   run.sh test    test-backend-ops -o SPARSE_ATTN -b CUDA0
#   run.sh bench   test-backend-ops perf for SPARSE_ATTN and FLASH_ATTN_EXT on CUDA0
#   run.sh all     the three
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
LOGS="${OUT:-$HERE}"
mkdir -p "$LOGS"
# the sources and the build live beside the bundle, not in it: a new copy of the bundle keeps the build
WORK="${GPU_CHECK_WORK:-$HERE-work}"
SRC="$WORK/src"
BUILD="$WORK/build"
TBO="$BUILD/bin/test-backend-ops"

build() {
    command -v cmake >/dev/null || { echo "cmake not found"; exit 2; }
    command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || { echo "nvcc not found"; exit 2; }
    command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
    nvidia-smi -L || true
    # unpacked again when the bundle is of another series or tree
    if ! cmp -s "$HERE/SERIES" "$WORK/SERIES"; then
        rm -rf "$SRC" && mkdir -p "$SRC" && tar xzf "$HERE/llama-trimmed.tar.gz" -C "$SRC" && cp "$HERE/SERIES" "$WORK/SERIES"
    fi
    gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    cmake -S "$SRC" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-native}" -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON \
        2>&1 | tee "$LOGS/configure.log"
    cmake --build "$BUILD" --target test-backend-ops -j "${JOBS:-$(nproc)}" 2>&1 | tail -n 40 | tee "$LOGS/build.log"
    test -x "$TBO"
}

run_test() {
    test -x "$TBO" || { echo "not built: run.sh build first"; exit 2; }
    "$TBO" -o SPARSE_ATTN -b CUDA0 2>&1 | tee "$LOGS/test-sparse-attn.log"
    # test-backend-ops exits non-zero when a case fails; a case CUDA refuses (supports_op) is reported as not supported
    grep -c "not supported" "$LOGS/test-sparse-attn.log" | sed 's/^/cases not supported by CUDA0: /' || true
}

run_bench() {
    test -x "$TBO" || { echo "not built: run.sh build first"; exit 2; }
    "$TBO" perf -o SPARSE_ATTN -b CUDA0 2>&1 | tee "$LOGS/perf-sparse-attn.log"
    # dense flash attention at the decode shapes of the SPARSE_ATTN perf cases
    "$TBO" perf -o FLASH_ATTN_EXT -b CUDA0 -p 'hsk=128,hsv=128,nh=(32|8),nr23=\[(1|4),1\],kv=(4096|16384|32768),nb=1,' \
        2>&1 | tee "$LOGS/perf-flash-attn.log"
}

case "${1:-all}" in
    build) build ;;
    test)  run_test ;;
    bench) run_bench ;;
    all)   build; run_test; run_bench ;;
    *) echo "usage: run.sh build|test|bench|all"; exit 2 ;;
esac
"""


def _installed_tree() -> Path | None:
    try:
        from sparq_cpp.pyext.build import installed_build
    except ImportError:
        return None
    rec = installed_build()
    if not rec or rec.get("series_hash") != series_hash():
        return None
    for top in (Path(rec["root"]) / "src").glob("*"):
        llama = top / "vendor" / "llama.cpp"
        if (llama / "ggml" / "src" / "ggml-cuda").is_dir():
            return llama
    return None


def _keep(path: Path, tree: Path) -> bool:
    rel = path.relative_to(tree)
    parts = rel.parts
    if parts[0] == "ggml":
        if len(parts) >= 3 and parts[1] == "src" and (path.is_dir() or len(parts) > 3):
            return parts[2] in GGML_SRC_DIRS
        return True
    return rel.as_posix() == "tests/test-backend-ops.cpp"


def make_bundle(tree: Path, out: Path) -> Path:
    if not (tree / "ggml" / "src" / "ggml-cuda" / "sparse-attn.cu").is_file():
        raise click.ClickException(f"{tree} has no ggml/src/ggml-cuda/sparse-attn.cu: the series has no CUDA kernel yet")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tarfile.open(out / "llama-trimmed.tar.gz", "w:gz") as tar:
        for top in ("ggml", "tests/test-backend-ops.cpp"):
            def filt(info: tarfile.TarInfo, top=top):
                p = tree / info.name
                return info if _keep(p, tree) else None
            tar.add(tree / top, arcname=top, filter=filt)
        data = CMAKELISTS.encode()
        info = tarfile.TarInfo("CMakeLists.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    run = out / "run.sh"
    run.write_text(RUN_SH)
    run.chmod(0o755)
    digest = hashlib.sha256((out / "llama-trimmed.tar.gz").read_bytes()).hexdigest()
    (out / "SERIES").write_text(f"series_hash {series_hash()}\ntree_tar_sha256 {digest}\n" + "".join(p.name + "\n" for p in series()))
    return out


@click.command()
@click.option("--tree", type=click.Path(file_okay=False, path_type=Path), help="A patched llama.cpp tree (make tree).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True)
def main(tree: Path | None, out: Path):
    """Write the GPU check bundle (see the module's docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        if tree is None:
            tree = _installed_tree()
        if tree is None:
            top = unpack_sdist(fetch_sdist(log=lambda *_: None), Path(tmp) / "sdist")
            tree = top / "vendor" / "llama.cpp"
            patch_tree(tree)
        make_bundle(tree, out)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    click.echo(f"{out}: {size/2**20:.1f} MiB; on the GPU machine: {out.name}/run.sh build && {out.name}/run.sh test && {out.name}/run.sh bench")


if __name__ == "__main__":
    main()
