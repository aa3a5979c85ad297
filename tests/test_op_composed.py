"""The GPU bundle's second SparQ path, "sparq-composed" (tools/gpu_check.py's op bench, build_sparq_composed): the
SparQ step from existing ggml ops only (top_k of the group's |q|, get_rows of K^T rows, out_prod, soft_max, top_k over
the cells with the local window as a bias, get_rows of K and V, mul_mat + soft_max_ext + mul_mat, the mean-value mix).
Here it runs on the CPU backend of the installed build's ggml, in the op bench's --check mode, beside the fused
GGML_OP_SPARSE_ATTN on the same cache, and both against the Numba reference (SPEC "Numerical contract": max|diff| <=
1e-3 * max|y| on f16 caches, 1e-5 on f32): random inputs (no ties) and planted-sparse ones, GQA (4 query heads per KV
head) and g = 1, k < n_kv and k >= n_kv, l = 0 and l > 0, mean value on and off. The composed path's selection is
compared with the reference's cell by cell. What this cannot show: the path's speed and support on CUDA (the GPU
bundle's opbench stage times it beside the fused op and flash attention).
"""
from __future__ import annotations

import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from conftest import OP_TOL, assert_close, make_qkv
from cuda_sources import installed_lib_dir
from sparq_cpp.pyext.build import installed_build
from sparq_cpp.reference.attention import SparQAttention
from tools import gpu_check


def _headers() -> Path | None:
    """ggml's headers of the build that installed_lib_dir() holds: the installed tree of the current series, else
    that build's own tree (the library and its headers agree even while the series in this checkout moves on)."""
    tree = gpu_check.installed_tree()
    if tree is None:
        rec = installed_build()
        trees = sorted((Path(rec["root"]) / "src").glob("*/vendor/llama.cpp")) if rec else []
        tree = trees[0] if trees else None
    inc = tree / "ggml" / "include" if tree else None
    if inc is None or "ggml_sparq_attn(" not in (inc / "ggml.h").read_text():
        return None
    return inc


# the op bench runs in the library folder: ggml_backend_load_all finds a portable build's backend modules there
# (a build with the CPU backend linked in needs none)
@pytest.fixture(scope="module")
def op_bench(tmp_path_factory) -> Path:
    lib, inc = installed_lib_dir(), _headers()
    if lib is None or inc is None or not (lib / "libggml.so").exists():
        pytest.skip("no installed build with ggml_sparq_attn (make setup): its ggml builds the op bench")
    d = tmp_path_factory.mktemp("op-composed")
    src = d / "op-bench.cpp"
    src.write_text(gpu_check.source("op-bench.cpp"))
    exe = d / "op-bench"
    proc = subprocess.run(["g++", "-O1", "-std=c++17", f"-I{inc}", str(src), f"-L{lib}", "-lggml", "-lggml-base",
                           f"-Wl,-rpath,{lib}", "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


def _check(exe: Path, tmp: Path, q, k, v, *, kv_type, r, top_k, l, mean_value):
    """Runs --check on q [1, hq, D], k and v [n_kv, nh, D]; returns the fused and composed results [1, hq, D], the
    composed selection [nh, min(k, n_kv)], K and V as stored [n_kv, nh, D] and the printed line."""
    _, hq, D = q.shape
    n_kv, nh, _ = k.shape
    q[0].astype(np.float32).tofile(tmp / "q.f32")
    k.transpose(1, 0, 2).astype(np.float32).tofile(tmp / "k.f32")
    v.transpose(1, 0, 2).astype(np.float32).tofile(tmp / "v.f32")
    proc = subprocess.run([str(exe), "--check", str(tmp), "-b", "CPU", "-t", "2", "--types", kv_type, "--nh", str(nh),
                           "--hq", str(hq), "--hs", str(D), "--kv", str(n_kv), "--r", str(r), "--k", str(top_k),
                           "--local", str(l), "--mean", str(int(mean_value))],
                          capture_output=True, text=True, timeout=120, cwd=str(installed_lib_dir()))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(f"check type={kv_type} hq={hq} nh={nh} kv={n_kv}"), line

    def load(name, dtype, shape):
        return np.fromfile(tmp / name, dtype=dtype).reshape(shape)

    fused = load("fused.f32", np.float32, (1, hq, D))
    composed = load("composed.f32", np.float32, (1, hq, D))
    sel = load("sel.i32", np.int32, (nh, min(top_k, n_kv)))
    k_st = load("k_stored.f32", np.float32, (nh, n_kv, D)).transpose(1, 0, 2)
    v_st = load("v_stored.f32", np.float32, (nh, n_kv, D)).transpose(1, 0, 2)
    return fused, composed, sel, k_st, v_st, line


CASES = [  # (kind, g, n_head_kv, D, n_kv, r, top_k, l, mean_value)
    ("random", 4, 2, 128, 700, 16, 64, 16, True),
    ("random", 4, 2, 128, 700, 16, 64, 0, False),
    ("random", 4, 2, 64, 700, 8, 64, 0, True),
    ("random", 1, 4, 128, 500, 16, 32, 8, True),
    ("planted", 4, 2, 128, 700, 16, 32, 8, True),
    ("planted", 4, 2, 128, 700, 16, 32, 0, False),
    ("planted", 1, 2, 64, 400, 8, 16, 4, False),
    ("random", 4, 2, 128, 300, 16, 300, 16, True),   # k = n_kv: every cell, alpha = 1
    ("random", 4, 2, 128, 300, 16, 512, 0, True),    # k > n_kv
    ("planted", 4, 2, 128, 300, 16, 400, 100, False),
]


@pytest.mark.parametrize("kind,g,nh,D,n_kv,r,top_k,l,mean_value", CASES)
def test_composed_matches_fused_and_reference(op_bench, tmp_path, kind, g, nh, D, n_kv, r, top_k, l, mean_value):
    rng = np.random.default_rng(zlib.crc32(repr((kind, g, nh, D, n_kv, r, top_k, l, mean_value)).encode()))
    q, k, v = make_qkv(rng, 1, nh * g, nh, D, n_kv, kind)
    fused, composed, sel, k_st, v_st, _ = _check(op_bench, tmp_path, q, k, v, kv_type="f16", r=r, top_k=top_k, l=l,
                                                 mean_value=mean_value)
    assert np.array_equal(k_st, k.astype(np.float16).astype(np.float32))  # f16 cache: K^T holds the same values
    assert_close(composed, fused, OP_TOL["f16"])
    mask = np.ones((1, n_kv), dtype=bool)
    pos = np.arange(n_kv, dtype=np.int32)
    attn = SparQAttention(r, top_k, l, mean_value)
    ref = attn(q, k_st, v_st, mask, pos, 1.0 / np.sqrt(D))
    assert_close(composed, ref, OP_TOL["f16"])
    assert_close(fused, ref, OP_TOL["f16"])
    # the same cells as the reference (its selection is ascending per KV head)
    assert np.array_equal(np.sort(sel, axis=1), attn.last_selection[0])
    if l and top_k < n_kv:
        assert np.all(np.isin(np.arange(n_kv - l, n_kv), sel))  # the local window is in every KV head's selection


@pytest.mark.parametrize("kv_type", ["f32", "q8_0"])
def test_composed_matches_fused_on_other_caches(op_bench, tmp_path, kv_type):
    """f32 and q8_0 caches: K^T is f16 of the keys, so the ranking reads other numbers than K holds; the composed path
    and the fused op read the same ones (the reference ranks from K, so it is left out here)."""
    rng = np.random.default_rng(7 + len(kv_type))
    q, k, v = make_qkv(rng, 1, 8, 2, 128, 700, "planted")
    fused, composed, *_ = _check(op_bench, tmp_path, q, k, v, kv_type=kv_type, r=16, top_k=64, l=16, mean_value=True)
    assert_close(composed, fused, OP_TOL[kv_type])


def test_timing_lines(op_bench):
    """The timing mode prints the composed op between the fused op and flash attention, with its scratch bytes."""
    proc = subprocess.run([str(op_bench), "-b", "CPU", "-t", "2", "--types", "f16", "--kv", "512", "--nh", "8", "-l", "2",
                           "-r", "1"], capture_output=True, text=True, timeout=120, cwd=str(installed_lib_dir()))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("op=")]
    assert [ln.split()[0] for ln in lines] == ["op=sparq", "op=sparq-composed", "op=flash"]
    assert all("layers=2" in ln and "us_per_layer=" in ln and "gb_s=" in ln for ln in lines)
    fused, composed = (dict(kv.split("=") for kv in ln.split()[1:]) for ln in lines[:2])
    assert fused["bytes_per_layer"] == composed["bytes_per_layer"]  # the same cache reads
    assert int(composed["scratch_bytes_per_layer"]) > 0
    proc = subprocess.run([str(op_bench), "-b", "CPU", "--types", "f16", "--kv", "512", "--nh", "8", "-l", "1", "-r", "1",
                           "--ops", "sparq,flash"], capture_output=True, text=True, timeout=120, cwd=str(installed_lib_dir()))
    assert [ln.split()[0] for ln in proc.stdout.splitlines() if ln.startswith("op=")] == ["op=sparq", "op=flash"]
