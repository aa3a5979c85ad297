"""Build the patched llama.cpp once per set of inputs, run it here, and install it.

One CMake build of the patched sdist gives both products, so nothing is compiled twice:
  - the llama-cpp-python wheel (libllama, libggml*), installed into the running environment;
  - the standalone tools (llama-bench, llama-cli, llama-completion, llama-server, test-backend-ops).
The build lives in `<cache>/build/<key>`, where the key hashes every input: the pinned sdist, the
patch series (every byte), the build options, and this file's BUILDER_VERSION. Same inputs: no
rebuild. Before a build is installed it runs here (sparq_cpp/pyext/smoke.py: the demo model through the Python
bindings in every mode and a stock tool, each in a child process); one that dies is not installed.
`python -m sparq_cpp.pyext.build [--cuda [--cuda-arch 90]]` (CUDA: sparq_cpp/pyext/cuda.py).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
from tqdm import tqdm

from sparq_cpp.errors import SparqError
from sparq_cpp.pyext import cuda as pcuda
from sparq_cpp.pyext import smoke
from sparq_cpp.pyext.patchtree import apply_series, bindings_series, patch_tree, series, series_hash
from sparq_cpp.pyext.upstream import PATCHES_DIR, Pin, cache_root, fetch_sdist, unpack_sdist

BUILDER_VERSION = 1
TOOLS = ["llama-bench", "llama-cli", "llama-completion", "llama-server", "test-backend-ops", "ggml-rpc-server"]
# ggml-rpc: layers on other machines' rpc-server (--rpc HOST:PORT), the first non-host backend we can test
LIB_TARGETS = ["llama", "ggml", "ggml-base", "ggml-cpu", "ggml-rpc"]
# Written into the environment that the build was installed into; `info` and the tools lookup read it.
INSTALL_RECORD = Path(sys.prefix) / "sparq-cpp-build.json"


@dataclass(frozen=True)
class BuildOptions:
    cuda_args: tuple[str, ...] = ()  # a CUDA build's CMake arguments (pyext.cuda.cmake_args); empty: CPU only
    native: bool = True
    extra_cmake_args: tuple[str, ...] = ()
    # one CPU backend per instruction-set level (ggml's GGML_CPU_ALL_VARIANTS), the best for the CPU at hand
    # loaded at run time (GGML_BACKEND_DL), as llama.cpp's release builds do: one build for many machines
    portable: bool = False

    @property
    def cuda(self) -> bool:
        return bool(self.cuda_args)

    def cmake_args(self) -> list[str]:
        args = [
            "-DLLAMA_BUILD_TOOLS=ON", "-DLLAVA_BUILD=OFF",  # mtmd comes with the tools; LLAVA would add it twice
            "-DLLAMA_BUILD_TESTS=ON", "-DLLAMA_TESTS_INSTALL=OFF",  # we pick test-backend-ops from the build
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_BUILD_APP=OFF", f"-DGGML_NATIVE={'ON' if self.native and not self.portable else 'OFF'}",
            "-DGGML_RPC=ON",
        ]
        if self.portable:
            args += ["-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"]
        return args + list(self.cuda_args) + list(self.extra_cmake_args)

    def targets(self) -> list[str]:
        # a portable build has no ggml-cpu target: ggml depends on every ggml-cpu-<variant> module
        libs = [t for t in LIB_TARGETS if not (self.portable and t == "ggml-cpu")]
        return libs + (["ggml-cuda"] if self.cuda else []) + TOOLS


def _machine_identity(opts: BuildOptions) -> str:
    """-march=native code is only valid on this kind of CPU, so a native build's key names it."""
    if not opts.native or opts.portable:
        return platform.machine()
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                flags += line + "\n"
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return platform.machine() + "\n" + flags


def build_key(opts: BuildOptions, pin: Pin | None = None, patches_dir: Path = PATCHES_DIR) -> str:
    pin = pin or Pin.load(patches_dir / "pin.txt")
    h = hashlib.sha256()
    for part in (f"builder={BUILDER_VERSION}", f"sdist={pin.sdist}:{pin.sha256}",
                 f"series={series_hash(patches_dir)}", f"cmake={opts.cmake_args()}", f"targets={opts.targets()}",
                 f"machine={_machine_identity(opts)}", f"python={sys.version_info[:2]}"):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


@dataclass
class Build:
    key: str
    root: Path
    wheel: Path
    tools: dict[str, str]
    options: dict
    series_hash: str
    pin: dict
    seconds: float = 0.0
    patches: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, root: Path) -> "Build | None":
        manifest = root / "manifest.json"
        if not manifest.exists():
            return None
        d = json.loads(manifest.read_text())
        d["root"], d["wheel"] = Path(d["root"]), Path(d["wheel"])
        return cls(**d)

    def save(self) -> None:
        d = asdict(self)
        d["root"], d["wheel"] = str(self.root), str(self.wheel)
        tmp = self.root / "manifest.json.tmp"
        tmp.write_text(json.dumps(d, indent=2))
        os.replace(tmp, self.root / "manifest.json")  # the manifest is what marks a build complete


def _run_with_progress(cmd: list[str], env: dict, log_path: Path, desc: str) -> None:
    """Run the build, showing ninja's [n/N] progress as a bar; on failure, the log's tail."""
    bar = tqdm(total=1, desc=desc, unit="step", disable=not sys.stderr.isatty())
    step = re.compile(rb"\[(\d+)/(\d+)\]")
    with open(log_path, "wb") as log, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                       stderr=subprocess.STDOUT) as proc:
        for line in proc.stdout:
            log.write(line)
            m = step.search(line)
            if m:
                bar.total = int(m.group(2))
                bar.n = int(m.group(1))
                bar.refresh()
        rc = proc.wait()
    bar.close()
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise SparqError(f"{desc} failed (exit {rc}); full log: {log_path}\n" + "\n".join(tail))


def build(opts: BuildOptions = BuildOptions(), log=print) -> Build:
    """The build for these inputs: from the cache when present, else compiled now (minutes)."""
    pin = Pin.load()
    patches = series()
    key = build_key(opts, pin)
    root = cache_root() / "build" / key
    root.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(root.parent / f"{key}.lock"):  # a second process waits for this build, not redoes it
        done = Build.load(root)
        if done is not None and done.wheel.exists():
            return done
        return _build_now(opts, pin, patches, key, root, log)


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_now(opts: BuildOptions, pin: Pin, patches: list[Path], key: str, root: Path, log) -> Build:
    if root.exists():
        shutil.rmtree(root)  # an interrupted build: start clean
    root.mkdir(parents=True)
    t0 = time.time()
    log(f"building patched llama.cpp (key {key}, {len(patches)} patches); log: {root / 'build.log'}")
    src = unpack_sdist(fetch_sdist(pin, log=log), root / "src")
    patch_tree(src / "vendor" / "llama.cpp")
    apply_series(src, bindings_series())

    env = dict(os.environ)
    env["CMAKE_ARGS"] = " ".join(opts.cmake_args())
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    # ggml uses ccache when it is installed; a base dir makes hits work across build keys,
    # so changing one patch recompiles only the files it touches.
    env.setdefault("CCACHE_BASEDIR", str(root))
    env.setdefault("CCACHE_DIR", str(cache_root() / "ccache"))
    env.setdefault("CCACHE_NOHASHDIR", "1")
    cmake_build = root / "cmake-build"
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-w", str(root / "wheel"),
           "-C", f"build-dir={cmake_build}", "-C", "cmake.build-type=Release",
           "-C", "build.targets=" + ";".join(opts.targets()), "-v"]
    _run_with_progress(cmd, env, root / "build.log", "build llama.cpp")

    (wheel,) = list((root / "wheel").glob("*.whl"))
    tools = {}
    for name in TOOLS:
        path = cmake_build / "bin" / name
        if not path.exists():
            raise SparqError(f"the build finished but {name} is missing from {path.parent}")
        tools[name] = str(path)
    b = Build(key=key, root=root, wheel=wheel, tools=tools, options=asdict(opts),
              series_hash=series_hash(), pin=asdict(pin), seconds=round(time.time() - t0, 1),
              patches=[p.name for p in patches])
    b.save()
    log(f"built in {b.seconds:.0f} s")
    return b


def installed_build() -> dict | None:
    """The record of the build installed into this environment, if any."""
    try:
        return json.loads(INSTALL_RECORD.read_text())
    except (OSError, ValueError):
        return None


def install(b: Build, log=print) -> bool:
    """Install the wheel into this environment unless this very build is installed already."""
    current = installed_build()
    if current and current.get("key") == b.key and _llama_cpp_importable():
        return False
    log(f"installing {b.wheel.name} (build {b.key}) into {sys.prefix}")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--force-reinstall", str(b.wheel)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SparqError(f"pip install of {b.wheel} failed: {proc.stderr.strip()[-500:]}")
    tmp = INSTALL_RECORD.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": b.key, "root": str(b.root), "tools": b.tools,
                               "series_hash": b.series_hash, "pin": b.pin, "patches": b.patches,
                               "options": b.options}, indent=2))
    os.replace(tmp, INSTALL_RECORD)
    return True


def _llama_cpp_importable() -> bool:
    proc = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True)
    return proc.returncode == 0


def tool_path(name: str) -> Path:
    """Path of a standalone tool from the installed build."""
    rec = installed_build()
    if not rec:
        raise SparqError("no patched llama.cpp build is installed here; run `make setup` first")
    path = Path(rec["tools"].get(name, ""))
    if not path.is_file():
        raise SparqError(f"tool {name} not found in build {rec['key']} ({path}); run `make setup` again")
    return path


@click.command()
@click.option("--cuda", is_flag=True, help="Also build the CUDA backend (nvcc needed; cuBLAS is fetched if the toolkit "
              "has none).")
@click.option("--cuda-arch", default="auto", show_default=True,
              help=f"CMAKE_CUDA_ARCHITECTURES, e.g. 90; auto: native with a GPU, else {pcuda.DEFAULT_ARCHS}.")
@click.option("--no-native", is_flag=True, help="Baseline CPU code (ggml's defaults) instead of -march=native.")
@click.option("--portable", is_flag=True, help="One CPU backend per instruction-set level (SSE4.2 to AVX-512 and "
              "AMX), the best for the CPU chosen at run time: a build for several kinds of machine.")
@click.option("--cmake-arg", "cmake_args", multiple=True, help="Extra CMake argument (repeatable).")
@click.option("--no-install", is_flag=True, help="Build (or find in the cache) but do not install.")
@click.option("--print-key", is_flag=True, help="Print the build key for these inputs and exit.")
@click.option("--smoke-again", is_flag=True, help="Run the smoke test even if this build passed it here before.")
def main(cuda, cuda_arch, no_native, portable, cmake_args, no_install, print_key, smoke_again):
    """Build (or reuse) the patched llama.cpp and install it into this environment."""
    try:
        cuda_args = ()
        if cuda:
            nvcc = pcuda.find_nvcc()
            if nvcc is None:
                raise SparqError("--cuda: nvcc not found (PATH, CUDACXX, /usr/local/cuda/bin); install the CUDA toolkit's "
                                 "compiler")
            cuda_args = tuple(pcuda.cmake_args(nvcc, cuda_arch, pcuda.fetch_cublas(nvcc)))
        opts = BuildOptions(cuda_args=cuda_args, native=not (no_native or portable), portable=portable,
                            extra_cmake_args=tuple(cmake_args))
        if print_key:
            click.echo(build_key(opts))
            return
        b = build(opts)
        if not no_install:
            smoke.check(b, log=click.echo, again=smoke_again)  # installed only after it ran here
        changed = False if no_install else install(b)
        click.echo(f"patched llama.cpp build {b.key}: {len(b.patches)} patches, "
                   f"{'installed' if changed else 'already installed' if not no_install else 'not installed'}; "
                   f"tools in {Path(b.tools['llama-bench']).parent}")
    except SparqError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
