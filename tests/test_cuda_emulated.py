"""The CUDA kernel of the sparse attention op, its source executed on the CPU, against the CPU op.

No GPU: tests/cuda_emu/transform.py turns ggml-cuda/sparse-attn.cu of the current series into host C++ (only the
include, shared memory declarations and kernel launches change), tests/cuda_emu/emu.h emulates the CUDA thread model
(fibers, barriers, warp shuffles and ballots, the scratch pool; see its header for what it cannot show), and
tests/cuda_emu/emu_main.cpp runs the kernels on the cases of test-backend-ops and on the model's cache layout,
comparing each result with ggml's CPU op from the installed build (normalized mean squared error within
test-backend-ops's 5e-4, every value finite, all scratch returned).

This checks the kernels' logic: indexing, the selection (radix select, ties, the local window), the split exact
attention, the mean value, the barriers. It does not check that they run on a GPU, nor their speed: that is
`test-backend-ops -o SPARSE_ATTN -b CUDA0` on a CUDA build (`make gpu-check`).

The fast tier runs a subset (about a minute), the slow tier every case, and every case again with the scratch
bound so low that the rows go through the kernels in several groups.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_sources import KERNEL, installed_cpu_link, installed_lib_dir, patched_tree

HERE = Path(__file__).parent / "cuda_emu"
sys.path.insert(0, str(HERE))
from transform import transform  # noqa: E402


def _build(tree: Path, lib: Path, out_dir: Path, name: str, extra: tuple[str, ...] = ()) -> Path:
    (out_dir / "sparse-attn-emu.inc").write_text(transform((tree / KERNEL).read_text()))
    exe = out_dir / name
    cmd = ["g++", "-std=c++20", "-O1", "-U_FORTIFY_SOURCE", "-Wno-unknown-pragmas", *extra,
           f"-I{out_dir}", f"-I{HERE}", f"-I{tree / 'ggml' / 'include'}", f"-I{tree / 'ggml' / 'src'}",
           str(HERE / "emu_main.cpp"), "-o", str(exe),
           f"-L{lib}", "-lggml", "-lggml-base", installed_cpu_link(lib), f"-Wl,-rpath,{lib}", "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"emulator build failed:\n{proc.stderr[-4000:]}"
    return exe


@pytest.fixture(scope="module")
def emu_setup(tmp_path_factory):
    if not sys.platform.startswith("linux") or shutil.which("g++") is None:
        pytest.skip("the CUDA emulation needs g++ (C++20) and ucontext (Linux)")
    lib = installed_lib_dir()
    if lib is None:
        pytest.skip("no installed build with a CPU backend (run `make setup`): the CPU op is the reference")
    tree = patched_tree(tmp_path_factory.mktemp("sdist"))
    if not (tree / KERNEL).is_file():
        pytest.skip(f"the patched tree {tree} has no {KERNEL}: the series has no CUDA kernel yet")
    return tree, lib, tmp_path_factory.mktemp("emu")


def _run(exe: Path, what: str, timeout: int) -> None:
    proc = subprocess.run([str(exe), what], capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    bad = [line for line in out.splitlines() if not line.startswith("OK")]
    assert proc.returncode == 0, "\n".join(bad[-30:])
    assert re.match(r"0 of [1-9]\d* failed", out.splitlines()[-1]), out[-2000:]


def test_cuda_kernel_emulated_quick(emu_setup):
    tree, lib, tmp = emu_setup
    _run(_build(tree, lib, tmp, "emu_main"), "quick", timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["planted", "uniform", "layout"])
def test_cuda_kernel_emulated_all(emu_setup, what):
    tree, lib, tmp = emu_setup
    exe = tmp / "emu_main"
    if not exe.exists():
        exe = _build(tree, lib, tmp, "emu_main")
    _run(exe, what, timeout=3600)


@pytest.mark.slow
def test_cuda_kernel_emulated_row_groups(emu_setup):
    """Scratch bounded to 150 kB: the query rows go through the kernels in groups of one or a few."""
    tree, lib, tmp = emu_setup
    exe = _build(tree, lib, tmp, "emu_main_rows", ("-DSPARSE_ATTN_SCRATCH_ROWS_BYTES=150000",))
    _run(exe, "quick", timeout=1800)
