"""A bundle that checks the sparse attention op's CUDA kernels on a machine with a GPU (`make gpu-check`).

The CUDA kernels of GGML_OP_SPARSE_ATTN are compiled in CI (tests/test_cuda_compile.py) and run there under an
emulation of CUDA's thread model, but only a GPU can run them. This writes a self-contained folder (default
`.sparq-build/gpu-check`, about 4 MiB) that such a machine needs, with no network and no package index:

  llama-trimmed.tar.gz  the patched llama.cpp of the current series, trimmed to what the checks build: ggml (CPU and
                        CUDA backends), libllama (src/, include/), common/, tools/llama-bench,
                        tests/test-backend-ops.cpp and the vendored libraries common needs, with CMake lists cut
                        down to those targets (tests/, tools/, vendor/) and `sparq-ops/` (ggml and test-backend-ops
                        alone, the fallback when the whole tree does not configure); `sparq/` holds a copy-bandwidth
                        program (bw.cu), the model writer (write_model.py) and the Python it runs: this checkout's
                        sparq_cpp package and the gguf package it writes with (numpy, tqdm, pyyaml and requests
                        come from the machine's Python)
  run.sh                the check as stages under one deadline (`run.sh --help`): env, unpack, model (an 8-layer
                        Llama 2 7B-shaped q8_0 model, written there in the background), configure, build
                        (ggml-cuda and test-backend-ops), test (`test-backend-ops -o SPARSE_ATTN -b CUDA0`),
                        opbench (the op's perf cases beside flash attention), bandwidth, build-e2e (libllama, common,
                        llama-bench, in the background), e2e (llama-bench dense against SparQ at 4k-64k); each stage
                        has its own time limit from what is left, every stage runs whatever failed before it, logs
                        grow as written and summary.json (stage, status, seconds, key numbers) is rewritten after
                        each stage, into $OUT; `run.sh --dry-run` plans every stage and runs nothing
  SERIES                series hash, tarball digest, patch names (the work folder `<bundle>-work` is reused when
                        it matches)

On the GPU machine: `OUT=/some/dir .sparq-build/gpu-check/run.sh` (at most 570 s by default, `--budget`). Here:
`python -m tools.gpu_check --dry-run` writes the bundle and prints the plan; `dry_run(bundle)` returns it.

The bundle's own programs (run.sh, the op bench, bw.cu, the model writer, the CMake lists) are files in
tools/gpu-check/, which the fast tier checks (`bash -n`, compiles); this module assembles them with the tree.

The patched tree is taken as tests/test_cuda_compile.py takes it: `--tree DIR` (a `make tree` checkout), else the
installed build's tree if it was built from the current series, else the pinned sdist unpacked with the series
applied.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import click
import gguf

from sparq_cpp.pyext.build import installed_build
from sparq_cpp.pyext.patchtree import patch_tree, series, series_hash
from sparq_cpp.pyext.upstream import REPO_ROOT, fetch_sdist, unpack_sdist

DEFAULT_OUT = REPO_ROOT / ".sparq-build" / "gpu-check"
DEFAULT_BUDGET = 570  # seconds: the device runs one command for at most 600
# what travels to the device with the working tree, at most
TREE_LIMIT = 64 * 2**20

# what of ggml/src a CPU + CUDA build reads: its own files and these backend folders
GGML_SRC_DIRS = ("ggml-cpu", "ggml-cuda")
# the parts of the patched tree the bundle carries (folders whole, except ggml/src's other backends)
TREE_PARTS = ("CMakeLists.txt", "LICENSE", "cmake", "include", "src", "common", "ggml", "tools/llama-bench",
              "tests/test-backend-ops.cpp", "vendor/nlohmann", "vendor/sheredom", "vendor/cpp-httplib")
# the subpackages above the core, which the bundle leaves out (the model writer needs the core alone, and calib's pca
# and projection below)
UPPER_PACKAGES = ("pyext", "calib", "cli", "bench", "train", "evaluation")
# sparq_cpp.calib's modules the model writer needs (the Loki projection), and the package's __init__ in the bundle
CALIB_FILES = ("pca.py", "projection.py")
CALIB_INIT = '''"""Loki projection writing (the bundle's copy of sparq_cpp.calib: pca and projection only)."""\n'''
STAGES = ("env", "unpack", "model", "configure", "build", "build-e2e", "test", "opbench", "bandwidth", "e2e", "profile")
BACKGROUND_STAGES = ("model", "build-e2e")

# the bundle's own files, real files of this checkout (compiled and checked in the fast tier): CMake lists that replace
# the upstream ones of the folders the bundle trims, the copy-bandwidth program, the op bench, the model writer and
# run.sh, by their path in the bundle
SOURCES = REPO_ROOT / "tools" / "gpu-check"
BUNDLE_FILES = {"tests/CMakeLists.txt": "tests.cmake", "tools/CMakeLists.txt": "tools.cmake",
                "vendor/CMakeLists.txt": "vendor.cmake", "sparq-ops/CMakeLists.txt": "ops.cmake",
                "sparq/bw.cu": "bw.cu", "sparq/op-bench.cpp": "op-bench.cpp", "sparq/write_model.py": "write_model.py"}


def source(name: str) -> str:
    """One of tools/gpu-check's files."""
    return (SOURCES / name).read_text()


def installed_tree() -> Path | None:
    rec = installed_build()
    if not rec or rec.get("series_hash") != series_hash():
        return None
    for top in (Path(rec["root"]) / "src").glob("*"):
        llama = top / "vendor" / "llama.cpp"
        if (llama / "ggml" / "src" / "ggml-cuda").is_dir():
            return llama
    return None


def _keep(rel: Path, is_dir: bool) -> bool:
    """Whether a path of the patched tree (relative to it, inside TREE_PARTS) goes into the bundle."""
    parts = rel.parts
    if "__pycache__" in parts or ".git" in parts:
        return False
    if parts[:2] == ("ggml", "src") and len(parts) >= 3 and (is_dir or len(parts) > 3):
        return parts[2] in GGML_SRC_DIRS
    return True


def _python_files(root: Path, skip: tuple[str, ...] = ()) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix in (".py", ".typed") and not any(s in p.relative_to(root).parts for s in skip))


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def write_run_sh(out: Path) -> Path:
    """run.sh alone (the dry run needs nothing else)."""
    out.mkdir(parents=True, exist_ok=True)
    run = out / "run.sh"
    run.write_text(source("run.sh"))
    run.chmod(0o755)
    return run


def make_bundle(tree: Path, out: Path, package: Path | None = None, gguf_dir: Path | None = None,
                calib: Path | None = None) -> Path:
    """Write the bundle for the patched tree into out (replaced). package: the sparq_cpp folder to carry (default
    this checkout's), gguf_dir: the gguf package's (default the installed one), calib: the calib folder."""
    calib = calib or REPO_ROOT / "sparq_cpp" / "calib"
    if not (tree / "ggml" / "src" / "ggml-cuda" / "sparse-attn.cu").is_file():
        raise click.ClickException(f"{tree} has no ggml/src/ggml-cuda/sparse-attn.cu: the series has no CUDA kernel yet")
    missing = [p for p in TREE_PARTS if not (tree / p).exists()]
    if missing:
        raise click.ClickException(f"{tree} lacks {', '.join(missing)}")
    package = package or REPO_ROOT / "sparq_cpp"
    gguf_dir = gguf_dir or Path(gguf.__file__).parent
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    # gzip's header without a time: the same files give the same digest, and a second run on the same machine
    # keeps its build (run.sh's unpack stage compares SERIES)
    with open(out / "llama-trimmed.tar.gz", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w") as tar:
        for part in TREE_PARTS:
            def filt(info: tarfile.TarInfo):
                return info if _keep(Path(info.name), info.isdir()) else None
            tar.add(tree / part, arcname=part, filter=filt)
        for name, src in BUNDLE_FILES.items():
            _add_bytes(tar, name, source(src).encode())
        for root, arc, skip in ((package, "sparq/py/sparq_cpp", UPPER_PACKAGES),
                                (gguf_dir, "sparq/py/gguf", ("scripts",))):
            for f in _python_files(root, skip):
                tar.add(f, arcname=f"{arc}/{f.relative_to(root).as_posix()}")
        # the Loki projection writer, without the calibration that needs llama.cpp
        for name in CALIB_FILES:
            tar.add(calib / name, arcname=f"sparq/py/sparq_cpp/calib/{name}")
        _add_bytes(tar, "sparq/py/sparq_cpp/calib/__init__.py", CALIB_INIT.encode())
    write_run_sh(out)
    digest = hashlib.sha256((out / "llama-trimmed.tar.gz").read_bytes()).hexdigest()
    (out / "SERIES").write_text(f"series_hash {series_hash()}\ntree_tar_sha256 {digest}\n"
                                + "".join(p.name + "\n" for p in series()))
    return out


def bundle_size(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def dry_run(bundle: Path, budget: int = DEFAULT_BUDGET, worst: bool = False, env: dict | None = None) -> dict:
    """run.sh --dry-run of the bundle: the summary it writes (every stage "planned" or "skipped", its limit and
    commands), with the printed plan as "printed". Runs nothing; needs no GPU."""
    with tempfile.TemporaryDirectory() as tmp:
        e = {**os.environ, **(env or {}), "OUT": tmp}
        e.setdefault("GPU_CHECK_WORK", str(Path(tmp) / "work"))
        proc = subprocess.run(["bash", str(bundle / "run.sh"), "--dry-run=worst" if worst else "--dry-run",
                               "--budget", str(budget)], capture_output=True, text=True, env=e, timeout=60)
        if proc.returncode != 0:
            raise click.ClickException(f"run.sh --dry-run failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    summary["printed"] = proc.stdout
    return summary


@click.command()
@click.option("--tree", type=click.Path(file_okay=False, path_type=Path), help="A patched llama.cpp tree (make tree).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True)
@click.option("--dry-run", "dry", is_flag=True, help="Then print run.sh's plan (nothing runs, no GPU needed).")
@click.option("--budget", type=int, default=DEFAULT_BUDGET, show_default=True, help="Seconds, for --dry-run.")
def main(tree: Path | None, out: Path, dry: bool, budget: int):
    """Write the GPU check bundle (see the module's docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        if tree is None:
            tree = installed_tree()
        if tree is None:
            top = unpack_sdist(fetch_sdist(log=lambda *_: None), Path(tmp) / "sdist")
            tree = top / "vendor" / "llama.cpp"
            patch_tree(tree)
        make_bundle(tree, out)
    size = bundle_size(out)
    if size > TREE_LIMIT // 2:
        click.echo(f"warning: the bundle is {size / 2**20:.1f} MiB; with the working tree it must stay under "
                   f"{TREE_LIMIT // 2**20} MiB to travel to the device", err=True)
    if dry:
        click.echo(dry_run(out, budget)["printed"], nl=False)
    try:
        shown = out.relative_to(Path.cwd())
    except ValueError:
        shown = out
    click.echo(f"{out}: {size / 2**20:.1f} MiB. On the GPU machine (one command, {DEFAULT_BUDGET} s by default): "
               f"OUT=<dir> {shown}/run.sh   (carry {shown}; `run.sh --help`)")


if __name__ == "__main__":
    main()
