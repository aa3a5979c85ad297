"""The GPU check bundle (tools/gpu_check.py, `make gpu-check`), without a GPU: run.sh's plan (--dry-run), run.sh
run to the end with stand-ins for nvidia-smi, nvcc, cmake, test-backend-ops, llama-bench and the model writer (a
stage that fails or times out does not stop the later ones; the summary's shape and numbers), and what the bundle
carries (trimmed tree, CMake lists, the model writer with its own sparq_cpp and gguf). Seconds; nothing is built.

What this cannot show: that the bundle builds and runs on a GPU machine. That takes the machine (`make gpu-check`,
then run.sh there).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import gguf
import pytest

from cuda_sources import installed_lib_dir
from sparq_cpp.errors import SparqError
from sparq_cpp.pyext import cuda as pcuda
from tools import gpu_check

SUMMARY_KEYS = {"schema", "dry_run", "budget_s", "elapsed_s", "bundle", "work", "out", "stages"}
STAGE_KEYS = {"name", "status", "background", "rc", "start_s", "seconds", "limit_s", "log", "note", "commands", "numbers"}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle")
    gpu_check.write_run_sh(out)
    (out / "SERIES").write_text("series_hash test\n")
    return out


def _no_gpu_tools(tmp: Path) -> dict:
    """PATH with an nvidia-smi, nvcc and cmake that leave a mark when run: a dry run must run none of them."""
    fake = tmp / "marking-bin"
    fake.mkdir()
    for tool in ("nvidia-smi", "nvcc", "cmake"):
        (fake / tool).write_text(f"#!/bin/sh\ntouch {tmp}/ran-{tool}\nexit 1\n")
        (fake / tool).chmod(0o755)
    return {"PATH": f"{fake}:{os.environ['PATH']}", "CUDACXX": str(fake / "nvcc"), "JOBS": "16"}


def _stage(summary: dict, name: str) -> dict:
    return next(s for s in summary["stages"] if s["name"] == name)


def test_run_sh_syntax(bundle):
    assert subprocess.run(["bash", "-n", str(bundle / "run.sh")]).returncode == 0
    assert (bundle / "run.sh").read_text().startswith("#!/usr/bin/env bash\n")
    help_ = subprocess.run(["bash", str(bundle / "run.sh"), "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "--dry-run" in help_.stdout
    for bad in (["--budget", "ten"], ["nostage"]):
        proc = subprocess.run(["bash", str(bundle / "run.sh"), *bad], capture_output=True, text=True,
                              env={**os.environ, "OUT": str(bundle / "bad-out")})
        assert proc.returncode == 2, bad


def test_dry_run_plans_every_stage(bundle, tmp_path):
    env = _no_gpu_tools(tmp_path)
    summary = gpu_check.dry_run(bundle, env=env)
    assert not list(tmp_path.glob("ran-*")), "the dry run ran a tool"
    assert SUMMARY_KEYS <= summary.keys() and summary["dry_run"] is True and summary["budget_s"] == 570
    assert [s["name"] for s in summary["stages"]] == list(gpu_check.STAGES)
    for s in summary["stages"]:
        assert STAGE_KEYS <= s.keys()
        # the ncu profile gets what e2e leaves: nothing, when each stage takes its typical time
        assert s["status"] == ("skipped" if s["name"] == "profile" else "planned"), s
        if s["status"] == "skipped":
            assert "not enough time left" in s["note"]
            continue
        assert s["background"] == (s["name"] in gpu_check.BACKGROUND_STAGES)
        assert s["limit_s"] > 0 and s["commands"]
        # every stage ends by the deadline, the last foreground one with its margin
        assert s["start_s"] + s["limit_s"] <= summary["budget_s"], s
    fg = [s for s in summary["stages"] if not s["background"]]
    for a, b in zip(fg, fg[1:]):
        assert b["start_s"] == a["start_s"] + a["seconds"]
    cmds = {s["name"]: "\n".join(s["commands"]) for s in summary["stages"]}
    assert "nvidia-smi --query-gpu=name,compute_cap" in cmds["env"]
    for flag in ("-DCMAKE_CUDA_ARCHITECTURES=<compute capability from nvidia-smi>", "-DGGML_CUDA_GRAPHS=ON",
                 "-DGGML_CUDA_FA_ALL_QUANTS=OFF", "-DGGML_CUDA_FA_QUANTS=f16-f16,q8_0-q8_0", "-DLLAMA_BUILD_TOOLS=ON",
                 "GGML_CUDA_NO_VMM", "cuBLAS"):
        assert flag in cmds["configure"], flag
    assert "sparq-ops" in cmds["configure"]  # the fallback: ggml and test-backend-ops alone
    assert "--target test-backend-ops -j 16" in cmds["build"] and "--target sparq-op-bench" in cmds["build"]
    assert "nice -n 19" in cmds["build-e2e"] and "--target llama-bench" in cmds["build-e2e"]
    assert "test-backend-ops test -o SPARSE_ATTN -b CUDA0" in cmds["test"]
    assert "perf -o SPARSE_ATTN -b CUDA0" in cmds["opbench"] and "perf -o FLASH_ATTN_EXT" in cmds["opbench"]
    assert "sparq-op-bench -b CUDA0 -r 20" in cmds["opbench"]
    assert "sparq/bw.cu" in cmds["bandwidth"]
    assert "write_model.py" in cmds["model"]
    for d in (4096, 8192, 16384, 32768, 65536):
        assert f"-d {d} -o jsonl > e2e-dense-{d}" in cmds["e2e"]
        assert f"-d {d} -o jsonl --sparse-attn sparq:r=16,k=128 > e2e-sparse-{d}" in cmds["e2e"]
    assert cmds["e2e"].count("-fa 1") == 11  # and Loki at 32k, through the environment variable
    assert "LLAMA_SPARSE_ATTN=loki:d=32,k=128,proj=" in cmds["e2e"] and "-d 32768 -o jsonl > e2e-loki-32768" in cmds["e2e"]
    assert "write_model.py" in cmds["model"] and cmds["model"].endswith("--loki")
    longer = gpu_check.dry_run(bundle, budget=900, env=env)
    assert all(s["status"] == "planned" for s in longer["stages"])
    profile = "\n".join(_stage(longer, "profile")["commands"])
    assert "--print-summary per-kernel" in profile and "sparq-op-bench -b CUDA0" in profile
    assert "--ops sparq,flash" in profile  # the composed path's many small kernels stay out of the profile
    printed = summary["printed"]
    assert "dry run: nothing is executed" in printed
    for name in gpu_check.STAGES:
        assert f"== {name}: " in printed


def test_dry_run_worst_case_and_short_budget(bundle, tmp_path):
    env = _no_gpu_tools(tmp_path)
    worst = gpu_check.dry_run(bundle, worst=True, env=env)
    for s in worst["stages"]:  # each stage takes its whole limit, and still every stage but the profile fits
        if s["name"] == "profile":
            assert s["status"] == "skipped"
            continue
        assert s["status"] == "planned" and s["seconds"] == s["limit_s"]
        assert s["start_s"] + s["limit_s"] <= 570
    short = gpu_check.dry_run(bundle, budget=200, env=env)
    status = {s["name"]: s for s in short["stages"]}
    assert status["env"]["status"] == "planned" and status["configure"]["status"] == "planned"
    skipped = [n for n, s in status.items() if s["status"] == "skipped"]
    assert skipped and all("not enough time left" in status[n]["note"] for n in skipped)
    for s in short["stages"]:
        if s["status"] == "planned":
            assert s["start_s"] + s["limit_s"] <= 200
    assert not list(tmp_path.glob("ran-*"))


FAKE_TOOLS = {
    "nvidia-smi": r"""#!/bin/sh
case "$*" in
    *compute_cap*) echo "9.0" ;;
    *driver_version*) echo "580.159.04" ;;
    *memory.total*) echo "81559" ;;
    *name*) echo "Stand-in H100" ;;
    *) echo "GPU 0: Stand-in H100 (UUID: GPU-0)" ;;
esac
""",
    "nvcc": r"""#!/bin/bash
case "$*" in *--version*) echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0 ;; esac
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
printf '#!/bin/sh\necho "device Stand-in H100, cc 9.0"\necho "copy_gb_s 2950.5 (stand-in)"\necho "kernel_copy_gb_s 3010.0 (stand-in)"\n' > "$out"
chmod +x "$out"
""",
    "ncu": r"""#!/bin/bash
echo "  sparse_attn_select (8, 4, 1)x(512, 1, 1), Context 1, Stream 7: Duration 100 us (stand-in)"
""",
    "cmake": r"""#!/bin/bash
if [ "$1" = -S ]; then mkdir -p "$4/bin"; echo "$*" > "$4/CMakeCache.txt"; echo "-- Configuring done"; exit 0; fi
if [ "$1" = --build ]; then
    cp "$FAKE/$4" "$2/bin/$4" && echo "[1/1] Linking $4"; exit $?
fi
echo "cmake version 3.28.3"
""",
    "test-backend-ops": r"""#!/bin/bash
if [ "$1" = test ]; then
    echo "  SPARSE_ATTN(hs=128,nh=2,nr=4,kv=1000): OK"
    echo "  SPARSE_ATTN(hs=64,nh=2,nr=4,kv=1000): FAIL"
    echo "  1/2 tests passed"
    echo "  Backend CUDA0: FAIL"
    exit 1
fi
if [ "$3" = SPARSE_ATTN ]; then
    [ -n "${FAKE_HANG:-}" ] && sleep 100
    echo "  SPARSE_ATTN(hs=128,nh=8,nr=4,kv=32768,nb=1,r=16,top_k=128,type_KV=f16):     4000 runs -    25.00 us/run -   400.00 GB/s"
else
    echo "  FLASH_ATTN_EXT(hsk=128,hsv=128,nh=8,nr23=[4,1],kv=32768,nb=1,mask=1):       1000 runs -   100.00 us/run -  1300.00 GB/s"
fi
""",
    "sparq-op-bench": r"""#!/bin/bash
echo "backend CUDA0, 8 layers"
echo "op=sparq type=f16 nh=8 kv=32768 layers=8 us_per_layer=50.00 bytes_per_layer=8650752 gb_s=173.0"
echo "op=sparq-composed type=f16 nh=8 kv=32768 layers=8 us_per_layer=200.00 bytes_per_layer=8650752 gb_s=43.3 scratch_bytes_per_layer=33554432"
echo "op=flash type=f16 nh=8 kv=32768 layers=8 us_per_layer=100.00 bytes_per_layer=134217728 gb_s=1342.2"
echo "op=sparq type=q8_0 nh=32 kv=4096 layers=8 not supported or failed"
exit 1
""",
    "llama-bench": r"""#!/bin/bash
ts=100.5; d=0
[ -n "${LLAMA_SPARSE_ATTN:-}" ] && ts=120.6
while [ $# -gt 0 ]; do case "$1" in -d) d=$2 ;; --sparse-attn) ts=150.75 ;; esac; shift; done
echo "llama-bench stand-in at depth $d" >&2
echo "{\"n_depth\": $d, \"n_gen\": 32, \"avg_ts\": $ts, \"stddev_ts\": 0.5}"
""",
    "python": r"""#!/bin/bash
case "$1" in -c) exit 0 ;; esac
echo "model stand-in" > "$2"; echo "projection stand-in" > "${2%.gguf}.loki.gguf"; echo "{\"model\": \"$2\"}"
""",
}


def _fake_machine(tmp: Path) -> dict:
    fake = tmp / "fake"
    (fake / "bin").mkdir(parents=True)
    for name, text in FAKE_TOOLS.items():
        path = fake / ("bin" if name in ("nvidia-smi", "nvcc", "cmake", "ncu") else "") / name
        path.write_text(text)
        path.chmod(0o755)
    wheel = fake / "wheel" / "cu13"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    (wheel / "include" / "cublas_v2.h").write_text("")
    (wheel / "include" / "cuda_runtime.h").write_text("")  # another library's header: kept off the include path
    for lib in ("libcublas.so.13", "libcublasLt.so.13"):
        (wheel / "lib" / lib).write_text("")
    return {"PATH": f"{fake / 'bin'}:{os.environ['PATH']}", "FAKE": str(fake), "CUDACXX": str(fake / "bin" / "nvcc"),
            "PYTHON": str(fake / "python"), "CUBLAS_ROOT": str(fake / "wheel"), "JOBS": "16",
            "E2E_DEPTHS": "8192,4096", "E2E_LOKI_DEPTHS": "4096", "GPU_CHECK_WORK": str(tmp / "work"), "OUT": str(tmp / "out")}


def _run(bundle: Path, env: dict, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(["bash", str(bundle / "run.sh"), *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    return proc, json.loads((Path(env["OUT"]) / "summary.json").read_text())


def _fake_sources(bundle: Path, env: dict) -> None:
    """The unpack stage's input: a tarball with the files the stages check for."""
    src = Path(env["FAKE"]) / "tree"
    for rel in ("CMakeLists.txt", "sparq/bw.cu", "sparq/write_model.py"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("")
    with tarfile.open(bundle / "llama-trimmed.tar.gz", "w:gz") as tar:
        for rel in ("CMakeLists.txt", "sparq"):
            tar.add(src / rel, arcname=rel)


def test_stages_run_past_failures(tmp_path):
    bundle = tmp_path / "bundle"
    gpu_check.write_run_sh(bundle)
    (bundle / "SERIES").write_text("series_hash test\n")
    env = _fake_machine(tmp_path)
    _fake_sources(bundle, env)
    proc, summary = _run(bundle, env)
    assert proc.returncode == 0, proc.stderr
    st = {s["name"]: s for s in summary["stages"]}
    assert summary["dry_run"] is False and SUMMARY_KEYS <= summary.keys()
    assert all(STAGE_KEYS <= s.keys() for s in summary["stages"])
    env_n = st["env"]["numbers"]
    assert env_n["cuda_arch"] == "90" and env_n["compute_cap"] == "9.0" and env_n["gpu"] == "Stand-in H100"
    assert env_n["driver"] == "580.159.04" and env_n["cublas"].startswith("CUBLAS_ROOT")
    configure = "\n".join(st["configure"]["commands"])
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in configure
    assert f"-DCUDA_cublas_LIBRARY={env['CUBLAS_ROOT']}/cu13/lib/libcublas.so.13" in configure
    # the wheel's cuBLAS headers alone on the include path
    only = Path(env["GPU_CHECK_WORK"]) / "cublas-include"
    assert f"-DCMAKE_CUDA_FLAGS=-I{only}" in configure
    assert sorted(p.name for p in only.iterdir()) == ["cublas_v2.h"]
    assert "-DGGML_CUDA_NO_VMM=ON" in configure or "-DCUDA_cuda_driver_LIBRARY=" in configure
    # the test stage fails (one case), and every later stage still runs
    assert st["test"]["status"] == "failed" and st["test"]["rc"] == 1
    assert st["test"]["numbers"] == {"passed": 1, "total": 2, "failed": 1, "not_supported": 0}
    for name in ("env", "unpack", "model", "configure", "build", "build-e2e", "bandwidth", "e2e", "profile"):
        assert st[name]["status"] == "ok", st[name]
        assert isinstance(st[name]["seconds"], int) and st[name]["seconds"] <= st[name]["limit_s"]
    ob = st["opbench"]["numbers"]
    assert ob["sparse_attn"] == [{"case": "SPARSE_ATTN(hs=128,nh=8,nr=4,kv=32768,nb=1,r=16,top_k=128,type_KV=f16)",
                                  "us_per_run": 25.00, "gb_s": 400.00}]
    assert ob["flash_attn"][0]["us_per_run"] == 100.00
    assert ob["layered"] == [
        {"op": "sparq", "case": "type=f16 nh=8 kv=32768", "us_per_layer": 50.0, "gb_s": 173.0, "speedup_over_flash": 2.0},
        {"op": "sparq-composed", "case": "type=f16 nh=8 kv=32768", "us_per_layer": 200.0, "gb_s": 43.3,
         "speedup_over_flash": 0.5, "speedup_over_fused": 0.25, "scratch_bytes_per_layer": 33554432},
        {"op": "flash", "case": "type=f16 nh=8 kv=32768", "us_per_layer": 100.0, "gb_s": 1342.2}]
    assert st["opbench"]["status"] == "failed"  # the op bench's unsupported case
    assert st["bandwidth"]["numbers"]["copy_gb_s"] == 2950.5
    assert st["bandwidth"]["numbers"]["kernel_copy_gb_s"] == 3010.0
    e2e = st["e2e"]["numbers"]
    assert e2e["depths"] == [8192, 4096]
    assert e2e["dense_tg_ts"] == {"4096": 100.5, "8192": 100.5}
    assert e2e["sparse_tg_ts"] == {"4096": 150.75, "8192": 150.75}
    assert e2e["speedup"] == {"4096": 1.5, "8192": 1.5}
    assert e2e["loki_tg_ts"] == {"4096": 120.6} and e2e["loki_speedup"] == {"4096": 1.2}
    assert "LLAMA_SPARSE_ATTN=loki:d=32,k=128,proj=" in "\n".join(st["e2e"]["commands"])
    logs = sorted(p.name for p in Path(env["OUT"]).iterdir())
    assert len(logs) <= 8 and "summary.json" in logs, logs
    assert logs == sorted(["summary.json", "env.log", "model.log", "configure.log", "build.log", "test.log",
                           "bench.log", "e2e.log"])
    assert "llama-bench stand-in at depth 8192" in (Path(env["OUT"]) / "e2e.log").read_text()


def test_stage_timeout_and_selection(tmp_path):
    bundle = tmp_path / "bundle"
    gpu_check.write_run_sh(bundle)
    (bundle / "SERIES").write_text("series_hash test\n")
    env = _fake_machine(tmp_path)
    _fake_sources(bundle, env)
    env.update(FAKE_HANG="1", GPU_CHECK_LIMITS="opbench=2:0:1")
    t0 = time.monotonic()
    proc, summary = _run(bundle, env)
    assert time.monotonic() - t0 < 60
    st = {s["name"]: s for s in summary["stages"]}
    assert st["opbench"]["status"] == "timeout" and st["opbench"]["limit_s"] == 2
    assert st["bandwidth"]["status"] == "ok" and st["e2e"]["status"] == "ok"
    assert "rc=124" in (Path(env["OUT"]) / "bench.log").read_text()
    # a second run reuses the unpacked sources and the model; stages named on the command line run alone
    proc, summary = _run(bundle, {**env, "FAKE_HANG": ""}, "env", "unpack", "model", "test")
    st = {s["name"]: s for s in summary["stages"]}
    assert "already unpacked" in st["unpack"]["note"] and "already written" in st["model"]["note"]
    assert st["test"]["status"] == "failed" and st["build"]["status"] == "not selected"


def _fake_tree(root: Path) -> Path:
    files = ["CMakeLists.txt", "LICENSE", "cmake/common.cmake", "include/llama.h", "src/llama.cpp",
             "src/models/llama.cpp", "common/common.cpp", "common/jinja/lexer.cpp", "ggml/CMakeLists.txt",
             "ggml/include/ggml.h", "ggml/src/ggml.c", "ggml/src/CMakeLists.txt", "ggml/src/ggml-cuda/sparse-attn.cu",
             "ggml/src/ggml-cuda/template-instances/fattn-vec-f16-f16.cu", "ggml/src/ggml-cpu/ggml-cpu.c",
             "ggml/src/ggml-metal/ggml-metal.m", "ggml/src/ggml-vulkan/ggml-vulkan.cpp", "tools/llama-bench/llama-bench.cpp",
             "tools/llama-bench/CMakeLists.txt", "tools/server/server.cpp", "tools/CMakeLists.txt",
             "tests/test-backend-ops.cpp", "tests/test-sampling.cpp", "tests/CMakeLists.txt",
             "vendor/nlohmann/json.hpp", "vendor/sheredom/subprocess.h", "vendor/cpp-httplib/httplib.cpp",
             "vendor/miniaudio/miniaudio.h", "vendor/CMakeLists.txt", "examples/simple/simple.cpp"]
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"// {rel}\n")
    return root


def test_bundle_contents_and_model_writer(tmp_path):
    tree = _fake_tree(tmp_path / "tree")
    out = gpu_check.make_bundle(tree, tmp_path / "bundle")
    assert sorted(p.name for p in out.iterdir()) == ["SERIES", "llama-trimmed.tar.gz", "run.sh"]
    with tarfile.open(out / "llama-trimmed.tar.gz") as tar:
        names = set(tar.getnames())
        x = tmp_path / "x"
        tar.extractall(x, filter="data")
    for kept in ("CMakeLists.txt", "LICENSE", "src/models/llama.cpp", "common/jinja/lexer.cpp", "include/llama.h",
                 "ggml/src/ggml-cuda/sparse-attn.cu", "ggml/src/ggml-cpu/ggml-cpu.c", "ggml/src/ggml.c",
                 "tools/llama-bench/llama-bench.cpp", "tests/test-backend-ops.cpp", "vendor/cpp-httplib/httplib.cpp",
                 "sparq-ops/CMakeLists.txt", "sparq/bw.cu", "sparq/write_model.py",
                 "sparq/py/sparq_cpp/modelfactory.py", "sparq/py/gguf/gguf_writer.py",
                 "sparq/py/sparq_cpp/calib/__init__.py", "sparq/py/sparq_cpp/calib/projection.py"):
        assert kept in names, kept
    for dropped in ("ggml/src/ggml-metal", "ggml/src/ggml-vulkan/ggml-vulkan.cpp", "tools/server/server.cpp",
                    "tests/test-sampling.cpp", "vendor/miniaudio/miniaudio.h", "examples/simple/simple.cpp"):
        assert dropped not in names, dropped
    assert not [n for n in names if "__pycache__" in n or n.startswith("sparq/py/gguf/scripts")]
    # the trimmed folders get CMake lists of their own
    assert (x / "tests/CMakeLists.txt").read_text() == gpu_check.source("tests.cmake")
    assert "add_subdirectory(llama-bench)" in (x / "tools/CMakeLists.txt").read_text()
    assert "miniaudio" not in (x / "vendor/CMakeLists.txt").read_text()
    assert (out / "SERIES").read_text().startswith("series_hash ")
    # the same files give the same tarball (a second run on a machine keeps its build when SERIES matches)
    series1 = (out / "SERIES").read_text()
    time.sleep(1.1)
    assert gpu_check.make_bundle(tree, tmp_path / "bundle2").joinpath("SERIES").read_text() == series1

    # the model writer runs on the bundle's own sparq_cpp and gguf (a 1-layer tiny model here; the GPU machine
    # writes 8 layers of llama2-7b)
    model = tmp_path / "m.gguf"
    proc = subprocess.run([sys.executable, str(x / "sparq/write_model.py"), str(model), "1", "tiny", "--loki"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    for mod in ("gguf", "sparq_cpp"):
        assert Path(info["modules"][mod]).is_relative_to(x / "sparq/py"), info["modules"]
    reader = gguf.GGUFReader(model)
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "llama"
    assert reader.fields["llama.block_count"].parts[-1][0] == 1
    assert {t.tensor_type for t in reader.tensors if t.name.endswith("attn_q.weight")} == {gguf.GGMLQuantizationType.Q8_0}
    # and its Loki projection, read back by the bundle's sparq_cpp against the model: orthonormal, variance sorted
    assert info["loki"] == str(tmp_path / "m.loki.gguf")
    check = ("import sys, numpy as np; sys.path.insert(0, sys.argv[1]); "
             "from sparq_cpp.projection import read_projection; p = read_projection(sys.argv[2], sys.argv[3]); "
             "assert p.P.shape == (1, 4, 64, 64), p.P.shape; "
             "assert np.allclose(np.einsum('lhij,lhik->lhjk', p.P, p.P), np.eye(64)); "
             "assert (np.diff(p.explained_variance, axis=-1) <= 0).all(); print('ok')")
    proc = subprocess.run([sys.executable, "-c", check, str(x / "sparq/py"), info["loki"], str(model)],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_real_bundle_size(tmp_path):
    """The bundle of the current series (the installed build's tree) travels to the device with room to spare."""
    tree = gpu_check.installed_tree()
    if tree is None:
        pytest.skip("no installed build of the current series (make setup): its patched tree makes the bundle")
    out = gpu_check.make_bundle(tree, tmp_path / "bundle")
    size = gpu_check.bundle_size(out)
    assert size < 16 * 2**20, size
    with tarfile.open(out / "llama-trimmed.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"tools/llama-bench/llama-bench.cpp", "src/llama-sparse-attn.cpp", "ggml/src/ggml-cuda/sparse-attn.cu",
            "ggml/src/ggml-cpu/sparse-attn.cpp", "tests/test-backend-ops.cpp"} <= names


def test_op_bench_runs_on_the_cpu(tmp_path):
    """The bundle's op bench (sparq-op-bench) compiles against the installed build's ggml and times both ops on the
    CPU backend at a small size (on the GPU machine it runs on CUDA0 over caches larger than L2)."""
    tree, lib = gpu_check.installed_tree(), installed_lib_dir()
    if tree is None or lib is None or not (lib / "libggml.so").exists():
        pytest.skip("no installed build of the current series (make setup): its ggml builds the op bench")
    src = tmp_path / "op-bench.cpp"
    src.write_text(gpu_check.source("op-bench.cpp"))
    exe = tmp_path / "op-bench"
    proc = subprocess.run(["g++", "-O1", "-std=c++17", f"-I{tree / 'ggml' / 'include'}", str(src), f"-L{lib}", "-lggml",
                           "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # cwd: where ggml_backend_load_all finds a portable build's backend modules (a linked-in CPU backend needs none)
    proc = subprocess.run([str(exe), "-b", "CPU", "--types", "f16,q8_0", "--kv", "512", "--nh", "8", "-l", "2", "-r", "1"],
                          cwd=str(lib),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("op=")]
    assert [ln.split()[:2] for ln in lines] == [[f"op={op}", f"type={t}"] for t in ("f16", "q8_0")
                                                for op in ("sparq", "sparq-composed", "flash")]
    assert all("layers=2" in ln and "us_per_layer=" in ln for ln in lines)
    # what the opbench stage makes of them
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    (tmp_path / "op-bench.txt").write_text(proc.stdout)
    script = (f"source <(sed -n '/^jstr()/,/^# ---- running commands/p' {tmp_path / 'b' / 'run.sh'}); "
              f"source <(sed -n '/^layered_cases()/,/^}}/p' {tmp_path / 'b' / 'run.sh'}); "
              f"layered_cases {tmp_path / 'op-bench.txt'}")
    gpu_check.write_run_sh(tmp_path / "b")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)
    cases = json.loads(out.stdout)
    assert [c["op"] for c in cases] == ["sparq", "sparq-composed", "flash"] * 2
    assert all(c["speedup_over_flash"] > 0 for c in cases if c["op"] != "flash")
    assert all(c["speedup_over_fused"] > 0 and c["scratch_bytes_per_layer"] > 0 for c in cases if c["op"] == "sparq-composed")


@pytest.mark.slow
def test_real_bundle_configures_with_nvcc(tmp_path):
    """run.sh's env, unpack and configure stages on the bundle of the current series with this machine's nvcc (no GPU:
    sm_90; cuBLAS's headers from sparq_cpp/pyext/cuda.py, its libraries stand-in files, which configuring does not open)."""
    nvcc = pcuda.find_nvcc()
    tree = gpu_check.installed_tree()
    if nvcc is None or tree is None:
        pytest.skip("needs nvcc and an installed build of the current series")
    try:
        headers = pcuda.fetch_cublas(nvcc, headers_only=True, log=lambda *_: None).include
    except SparqError as e:
        pytest.skip(str(e))
    cublas = tmp_path / "cublas"
    (cublas / "lib").mkdir(parents=True)
    (cublas / "include").symlink_to(headers)
    for lib in ("libcublas.so.13", "libcublasLt.so.13"):
        (cublas / "lib" / lib).write_text("")
    out = gpu_check.make_bundle(tree, tmp_path / "bundle")
    env = {**os.environ, "CUBLAS_ROOT": str(cublas), "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work"),
           "CUDACXX": str(nvcc)}
    proc = subprocess.run(["bash", str(out / "run.sh"), "env", "unpack", "configure"], capture_output=True, text=True,
                          env=env, timeout=600)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    st = {s["name"]: s for s in summary["stages"]}
    assert st["configure"]["status"] == "ok", (tmp_path / "out" / "configure.log").read_text()[-3000:]
    assert "sparq-ops" not in st["configure"]["numbers"]["tree"]  # the whole tree, not the fallback
    ninja = (tmp_path / "work" / "build" / "build.ninja").read_text()
    for target in ("bin/test-backend-ops:", "bin/llama-bench:", "bin/sparq-op-bench:"):
        assert f"build {target}" in ninja, target
    assert "fattn-vec-instance-q8_0-q8_0.cu" in ninja and "fattn-vec-instance-q4_0-q4_0.cu" not in ninja
    assert "GGML_CUDA_USE_GRAPHS" in ninja


def test_the_bundle_files_are_code_that_is_checked(tmp_path):
    """tools/gpu-check holds the bundle's programs as real files: run.sh passes `bash -n`, the model writer
    compiles, bw.cu compiles with nvcc (where it is installed; op-bench.cpp is built and run on the CPU above), and
    the bundle carries them byte for byte."""
    from sparq_cpp.pyext import cuda as pcuda

    proc = subprocess.run(["bash", "-n", str(gpu_check.SOURCES / "run.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    compile(gpu_check.source("write_model.py"), "write_model.py", "exec")
    nvcc = pcuda.find_nvcc()
    if nvcc is not None:
        proc = subprocess.run([str(nvcc), "-c", str(gpu_check.SOURCES / "bw.cu"), "-o", str(tmp_path / "bw.o")],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(gpu_check.BUNDLE_FILES.values()) | {"run.sh"} == {p.name for p in gpu_check.SOURCES.iterdir()
                                                                 if p.name != "README.md"}
    run = gpu_check.write_run_sh(tmp_path / "b")
    assert run.read_bytes() == (gpu_check.SOURCES / "run.sh").read_bytes() and run.stat().st_mode & 0o111
