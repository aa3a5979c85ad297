"""The sparse attention op on another architecture: ggml cross-built for aarch64 (Debian's
gcc-aarch64-linux-gnu), run under qemu-aarch64 (Debian's qemu-user) by tests/op_runner/op_runner.c.

Inputs are laid out exactly as bindings.ggml_ops lays them out for the host's op (its KVCache, q_tensor and
mask_tensor build the views), recorded instead of handed to ggml, written to a file, computed by the
runner, and read back. The ggml build is cached beside the installed build (same patched sources).
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparq_cpp.bindings.cpu_backend import cpu_library
from sparq_cpp.bindings import ggml_ops as go
from sparq_cpp.pyext.build import installed_build

RUNNER_SRC = Path(__file__).parent / "op_runner" / "op_runner.c"
CROSS = "aarch64-linux-gnu-"
ARM_ARCH = "armv8.2-a+dotprod+fp16"  # a current Arm laptop or server core
QEMU = "qemu-aarch64"
TYPE_SIZE = {go.GGML_TYPE_F32: 4, go.GGML_TYPE_F16: 2, go.GGML_TYPE_I32: 4, go.GGML_TYPE_Q8_0: go.Q8_0_BLOCK_BYTES}
BLOCK = {go.GGML_TYPE_Q8_0: go.QK8_0}


def missing_tools() -> list[str]:
    need = [CROSS + "gcc", CROSS + "g++", QEMU, "cmake", "ninja"]
    return [t for t in need if shutil.which(t) is None]


def llama_source() -> Path:
    rec = installed_build()
    if not rec:
        raise RuntimeError("no patched llama.cpp build is installed; run `make setup`")
    src = Path(rec["root"]) / "src" / f"llama_cpp_python-{rec['pin']['version']}" / "vendor" / "llama.cpp"
    if not (src / "ggml").is_dir():
        raise RuntimeError(f"the installed build's sources are gone: {src}")
    return src


def cross_cmake_args(src: Path, build: Path) -> list[str]:
    launcher = ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"] if shutil.which("ccache") else []
    return ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
            f"-DCMAKE_C_COMPILER={CROSS}gcc", f"-DCMAKE_CXX_COMPILER={CROSS}g++", *launcher,
            "-DGGML_NATIVE=OFF", f"-DGGML_CPU_ARM_ARCH={ARM_ARCH}", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_OPENMP=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_CURL=OFF"]


def build_arm_runner(log=print) -> Path:
    """The statically linked aarch64 op runner, built once per installed build."""
    src = llama_source()
    root = src.parents[3] / "aarch64"
    exe = root / "op_runner"
    if exe.exists() and exe.stat().st_mtime >= RUNNER_SRC.stat().st_mtime:
        return exe
    build = root / "cmake-build"
    if not (build / "build.ninja").exists():
        log(f"configuring the aarch64 cross-build of ggml in {build}")
        subprocess.run(cross_cmake_args(src, build), check=True, capture_output=True, text=True)
    log("building ggml for aarch64 (a few minutes the first time)")
    subprocess.run(["ninja", "-C", str(build), "-j2", "ggml-base", "ggml-cpu", "ggml"], check=True,
                   capture_output=True, text=True)
    libs = [build / "ggml" / "src" / name for name in ("libggml.a", "libggml-cpu.a", "libggml-base.a")]
    tmp = exe.with_suffix(".tmp")
    subprocess.run([CROSS + "g++", "-O2", "-static", "-x", "c", str(RUNNER_SRC), "-x", "none",
                    "-I", str(src / "ggml" / "include"), *map(str, libs), "-lm", "-lpthread", "-o", str(tmp)],
                   check=True, capture_output=True, text=True)
    os.replace(tmp, exe)
    return exe


@dataclass
class _Recorded:
    """A tensor as the runner will rebuild it: a view (ne, nb, offset) of its own buffer."""
    buffer: np.ndarray
    type: int
    ne: tuple
    nb: tuple
    offset: int = 0

    @property
    def contents(self):  # ggml_ops reads t.contents.ne
        return self


class RecordedGraph:
    """Stands in for ggml_ops.Graph where KVCache, q_tensor and mask_tensor build their tensors."""

    def tensor(self, data: np.ndarray, type_name: str, ne=None) -> _Recorded:
        data = np.ascontiguousarray(data)
        t = go.TYPES[type_name]
        if ne is None:
            ne = list(data.shape[::-1])
            if type_name == "q8_0":
                ne[0] = ne[0] // go.Q8_0_BLOCK_BYTES * go.QK8_0
        ne = tuple(list(ne) + [1] * (4 - len(ne)))
        nb = [TYPE_SIZE[t]]
        nb.append(ne[0] // BLOCK.get(t, 1) * TYPE_SIZE[t])
        nb += [nb[1] * ne[1], nb[1] * ne[1] * ne[2]]
        assert nb[3] * ne[3] == data.nbytes, (ne, data.nbytes)
        return _Recorded(data, t, ne, tuple(nb))

    def view(self, t: _Recorded, ne, nb, offset: int = 0) -> _Recorded:
        return _Recorded(t.buffer, t.type, tuple(ne), (TYPE_SIZE[t.type], *nb), t.offset + offset)


def _write_input(path: Path, rank: int, n_threads: int, scale: float, r_or_d: int, top_k: int, n_local: int,
                 mean_value: bool, slots: list[_Recorded | None], c: float = 0.0) -> None:
    with open(path, "wb") as f:
        f.write(b"SQOP" + struct.pack("<IIIfiiiif", 2, rank, n_threads, scale, r_or_d, top_k, n_local, int(mean_value), c))
        for s in slots:
            if s is None:
                f.write(struct.pack("<I", 0))
                continue
            raw = s.buffer.tobytes()
            f.write(struct.pack("<II4q4QQQ", 1, s.type, *s.ne, *s.nb, s.offset, len(raw)))
            f.write(raw)


def _run(cmd: list[str], slots, rank, n_threads, scale, r_or_d, top_k, n_local, mean_value, shape, c=0.0) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
        _write_input(inp, rank, n_threads, scale, r_or_d, top_k, n_local, mean_value, slots, c)
        proc = subprocess.run([*cmd, str(inp), str(out)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"op runner failed ({proc.returncode}): {proc.stderr[-2000:]}")
        data = out.read_bytes()
    ne = struct.unpack_from("<4q", data)
    y = np.frombuffer(data, dtype=np.float32, offset=32)
    assert y.size == int(np.prod(ne)), ne
    return y.reshape(shape).copy()


def sparq_attn(cmd, q, k, v, mask, kv_pos, scale, r, top_k, n_local, mean_value=True, *, kv_type="f16",
               kt_type=None, kt_pad=0, vmean=None, n_threads=2):
    """As ggml_ops.sparq_attn(..., return_values=True), computed by the runner `cmd`."""
    g = RecordedGraph()
    cache = go.KVCache(g, k, v, kv_type, kt_type, kt_pad)
    vt = None if vmean is None else g.tensor(np.ascontiguousarray(vmean, dtype=np.float32), "f32")
    slots = [go.q_tensor(g, q), cache.k, cache.kt, cache.v, go.mask_tensor(g, mask),
             g.tensor(np.ascontiguousarray(kv_pos, dtype=np.int32), "i32"), vt]
    y = _run(cmd, slots, 0, n_threads, scale, r, top_k, n_local, mean_value, q.shape)
    return y, cache.k_values, cache.v_values


def loki_attn(cmd, q, k, v, mask, kv_pos, scale, d, top_k, n_local=0, *, kv_type="f16", n_threads=2):
    """As ggml_ops.loki_attn(..., return_values=True), computed by the runner `cmd`."""
    g = RecordedGraph()
    cache = go.KVCache(g, k, v, kv_type, need_kt=False)
    slots = [go.q_tensor(g, q), cache.k, None, cache.v, go.mask_tensor(g, mask),
             g.tensor(np.ascontiguousarray(kv_pos, dtype=np.int32), "i32"), None]
    y = _run(cmd, slots, 1, n_threads, scale, d, top_k, n_local, False, q.shape)
    return y, cache.k_values, cache.v_values


def alisa_attn(cmd, q, k, v, mask, kv_pos, scale, sums, c, *, kv_type="f16", n_threads=2):
    """As ggml_ops.alisa_attn(..., return_values=True), computed by the runner `cmd`: (y, weights, k, v)."""
    g = RecordedGraph()
    cache = go.KVCache(g, k, v, kv_type, need_kt=False)
    sums = np.ascontiguousarray(sums, dtype=np.float32)
    slots = [go.q_tensor(g, q), cache.k, None, cache.v, go.mask_tensor(g, mask),
             g.tensor(np.ascontiguousarray(kv_pos, dtype=np.int32), "i32"), g.tensor(sums, "f32")]
    n_y, n_w = int(np.prod(q.shape)), q.shape[0] * sums.shape[-2] * sums.shape[-1]
    flat = _run(cmd, slots, 2, n_threads, scale, 0, 0, 0, False, (n_y + n_w,), c)
    return (flat[:n_y].reshape(q.shape), flat[n_y:].reshape(q.shape[0], sums.shape[-2], sums.shape[-1]),
            cache.k_values, cache.v_values)


def build_host_runner(directory: Path) -> list[str]:
    """The runner built for this machine against the installed ggml: checks the runner itself."""
    src = llama_source()
    lib = go.lib_dir()
    exe = directory / "op_runner-host"
    cpu, variant = cpu_library(lib)  # a portable build's CPU backend is the variant for this CPU
    subprocess.run(["gcc", "-O2", str(RUNNER_SRC), "-I", str(src / "ggml" / "include"), f"-L{lib}",
                    "-lggml", "-lggml-base", "-lggml-cpu" if variant is None else f"-l:{cpu.name}",
                    f"-Wl,-rpath,{lib}", "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return [str(exe)]

