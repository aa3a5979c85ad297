"""The sparse attention op on aarch64: ggml cross-built with Debian's gcc-aarch64-linux-gnu and run under
qemu-aarch64 (Debian's qemu-user), against the Numba reference on random and planted inputs: a subset in
the fast tier (SparQ, Loki and ALISA; f16 and q8_0 caches), every case in the slow tier. Also in the fast
tier: the kernel's source compiles for aarch64, and the runner reproduces the host's op bit for bit.
`.ci/run` installs the tools (`apt-get install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user`);
the run fails if these checks are skipped (tests/conftest.py, REQUIRED_TESTS)."""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from sparq_cpp.bindings import ggml_ops as go

if not go.has_sparq_attn():
    pytest.skip("the ggml build has no ggml_sparq_attn (run `make setup`)", allow_module_level=True)

import op_runner as orun  # noqa: E402
from sparq_cpp.reference.attention import DenseAttention, SparQAttention  # noqa: E402
from sparq_cpp.reference.loki import LokiAttention  # noqa: E402
from conftest import OP_TOL, assert_close, identity, make_cache, make_mask, make_qkv  # noqa: E402

MISSING = orun.missing_tools()
needs_cross = pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)}")


def test_host_runner_reproduces_the_host_op(tmp_path):
    """The runner and its input file carry the views exactly: built for this machine, it gives the op's
    result bit for bit (so a difference on aarch64 is the kernel's, not the harness's)."""
    cmd = orun.build_host_runner(tmp_path)
    rng = np.random.default_rng(3)
    q, k, v = make_qkv(rng, 3, 8, 2, 64, 700, "planted")
    seq, pos = make_cache(rng, 700, n_seq=2, hole_frac=0.1, shuffle=True)
    mask = make_mask(rng, seq, pos, 3, n_seq=2)
    scale = 0.125
    for kv_type in ("f16", "q8_0"):
        y, _, _ = orun.sparq_attn(cmd, q, k, v, mask, pos, scale, 8, 48, 8, kv_type=kv_type, kt_pad=5)
        assert np.array_equal(y, go.sparq_attn(q, k, v, mask, pos, scale, 8, 48, 8, True, kv_type=kv_type, kt_pad=5))
        y, _, _ = orun.loki_attn(cmd, q, k, v, mask, pos, scale, 16, 48, 8, kv_type=kv_type)
        assert np.array_equal(y, go.loki_attn(q, k, v, mask, pos, scale, 16, 48, 8, kv_type=kv_type))


@needs_cross
def test_kernel_compiles_for_aarch64(tmp_path):
    """The CPU backend's op sources (the kernel, its dispatch, the tiled transposed copy) compile for aarch64 with
    NEON, fp16 and dot product: a compile error on Arm fails here, without building or running the rest."""
    build = tmp_path / "aarch64"
    src = orun.llama_source()
    subprocess.run(orun.cross_cmake_args(src, build), check=True, capture_output=True, text=True)
    objs = [f"ggml/src/CMakeFiles/ggml-cpu.dir/ggml-cpu/{name}.o" for name in ("sparse-attn.cpp", "ops.cpp", "ggml-cpu.c")]
    proc = subprocess.run(["ninja", "-C", str(build), "-j2", *objs], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.fixture(scope="module")
def arm():
    if MISSING:
        pytest.skip(f"not installed: {', '.join(MISSING)}")
    return [orun.QEMU, str(orun.build_arm_runner(log=lambda *_: None))]


slow = pytest.mark.slow


@slow
@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", ["random", "planted"])
def test_sparq_matches_reference_on_aarch64(arm, kind, D, g, kv_type):
    rng = np.random.default_rng(D * 100 + g * 10 + len(kv_type) + (kind == "planted"))
    n_head_kv, n_kv = 2, 1500
    q, k, v = make_qkv(rng, 1, n_head_kv * g, n_head_kv, D, n_kv, kind)
    seq, pos = make_cache(rng, n_kv)
    mask = make_mask(rng, seq, pos, 1)
    scale = 1.0 / np.sqrt(D)
    kt_type = "f32" if kv_type == "q8_0" else None  # rank the same numbers as the reference
    y, kv, vv = orun.sparq_attn(arm, q, k, v, mask, pos, scale, 16, 64, 16, kv_type=kv_type, kt_type=kt_type,
                                kt_pad=3)
    assert_close(y, SparQAttention(16, 64, 16, True)(q, kv, vv, mask, pos, scale), OP_TOL[kv_type])


@slow
@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("kind", ["random", "planted"])
def test_loki_matches_reference_on_aarch64(arm, kind, g, kv_type):
    rng = np.random.default_rng(g * 10 + len(kv_type) + (kind == "planted") + 7)
    D, n_head_kv, n_kv = 128, 2, 1500
    q, k, v = make_qkv(rng, 1, n_head_kv * g, n_head_kv, D, n_kv, kind)
    seq, pos = make_cache(rng, n_kv)
    mask = make_mask(rng, seq, pos, 1)
    scale = 1.0 / np.sqrt(D)
    y, kv, vv = orun.loki_attn(arm, q, k, v, mask, pos, scale, 32, 64, 0, kv_type=kv_type)
    assert_close(y, LokiAttention(identity(D, n_head_kv), 32, 64, 0)(q, kv, vv, mask, pos, scale), OP_TOL[kv_type])


@slow
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("mean_value", [True, False])
def test_sequences_holes_causal_rows_on_aarch64(arm, kv_type, mean_value):
    """Several sequences, empty cells, shuffled positions, a causal multi-row batch, 1 and 3 threads."""
    rng = np.random.default_rng(7 + mean_value)
    D, n_kv, n_seq, n_q = 128, 2000, 3, 12
    q, k, v = make_qkv(rng, n_q, 8, 2, D, n_kv)
    seq, pos = make_cache(rng, n_kv, n_seq=n_seq, hole_frac=0.15, shuffle=True)
    mask = make_mask(rng, seq, pos, n_q, n_seq=n_seq, causal=True)
    scale = 1.0 / np.sqrt(D)
    kt_type = "f32" if kv_type == "q8_0" else None
    ys = []
    for nt in (1, 3):
        y, kv, vv = orun.sparq_attn(arm, q, k, v, mask, pos, scale, 16, 96, 24, mean_value, kv_type=kv_type,
                                    kt_type=kt_type, n_threads=nt)
        assert_close(y, SparQAttention(16, 96, 24, mean_value)(q, kv, vv, mask, pos, scale), OP_TOL[kv_type])
        ys.append(y)
    assert np.array_equal(ys[0], ys[1])


@slow
@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_all_visible_selected_equals_dense_on_aarch64(arm, kv_type):
    rng = np.random.default_rng(2)
    D, n_kv, n_q = 128, 700, 3
    q, k, v = make_qkv(rng, n_q, 8, 2, D, n_kv)
    seq, pos = make_cache(rng, n_kv, n_seq=2, hole_frac=0.1, shuffle=True)
    mask = make_mask(rng, seq, pos, n_q, n_seq=2)
    scale = 1.0 / np.sqrt(D)
    y, kv, vv = orun.sparq_attn(arm, q, k, v, mask, pos, scale, 4, n_kv, 8, kv_type=kv_type)
    assert_close(y, DenseAttention()(q, kv, vv, mask, pos, scale), OP_TOL[kv_type])
    y, kv, vv = orun.loki_attn(arm, q, k, v, mask, pos, scale, 8, n_kv, 0, kv_type=kv_type)
    assert_close(y, DenseAttention()(q, kv, vv, mask, pos, scale), OP_TOL[kv_type])


def alisa_reference(q, k, v, mask, pos, scale, sums, c):
    """One step of ALISA's Sparse Window Attention from its definition: per row, the k = max(1, floor(n*c/2))
    most recent visible cells and the k others with the largest window sums (the sums are distinct here),
    then exact attention over those; the weights of each set's query heads summed. One set for every head."""
    n_q, n_head, D = q.shape
    g = n_head // k.shape[1]
    y = np.zeros((n_q, n_head, v.shape[2]))
    w = np.zeros((n_q, 1, k.shape[0]))
    for t in range(n_q):
        vis = np.nonzero(mask[t])[0]
        kk = max(1, int(np.floor(vis.size * c / 2)))
        recent = vis[np.argsort(-pos[vis], kind="stable")[:kk]]
        others = np.setdiff1d(vis, recent)
        keep = np.concatenate([recent, others[np.argsort(-sums[0, others], kind="stable")[:kk]]])
        for h in range(n_head):
            z = scale * (k[keep, h // g] @ q[t, h])
            p = np.exp(z - z.max())
            p /= p.sum()
            y[t, h] = p @ v[keep, h // g]
            w[t, 0, keep] += p
    return y, w


def _one_row(rng, kind, shuffle=False):
    """One decode row over 1500 cells: 8 query heads on 2 KV heads of 128, and its scale."""
    D, n_head_kv, n_kv = 128, 2, 1500
    q, k, v = make_qkv(rng, 1, n_head_kv * 4, n_head_kv, D, n_kv, kind)
    seq, pos = make_cache(rng, n_kv, shuffle=shuffle)
    return q, k, v, make_mask(rng, seq, pos, 1), pos, 1.0 / np.sqrt(D)


def _check_sparq(arm, kind, kv_type, seed):
    q, k, v, mask, pos, scale = _one_row(np.random.default_rng(seed), kind)
    kt_type = "f32" if kv_type == "q8_0" else None  # rank the same numbers as the reference
    y, kv, vv = orun.sparq_attn(arm, q, k, v, mask, pos, scale, 16, 64, 16, kv_type=kv_type, kt_type=kt_type)
    assert_close(y, SparQAttention(16, 64, 16, True)(q, kv, vv, mask, pos, scale), OP_TOL[kv_type])


def _check_loki(arm, kind, kv_type, seed):
    q, k, v, mask, pos, scale = _one_row(np.random.default_rng(seed), kind)
    y, kv, vv = orun.loki_attn(arm, q, k, v, mask, pos, scale, 32, 64, 0, kv_type=kv_type)
    assert_close(y, LokiAttention(identity(q.shape[2], k.shape[1]), 32, 64, 0)(q, kv, vv, mask, pos, scale),
                 OP_TOL[kv_type])


def _check_alisa(arm, kind, kv_type, seed):
    rng = np.random.default_rng(seed)
    q, k, v, mask, pos, scale = _one_row(rng, kind, shuffle=True)
    c, n_kv = 0.1, k.shape[0]
    sums = rng.permutation(n_kv).astype(np.float32)[None] / n_kv  # distinct: the selection has no ties
    y, w, kv, vv = orun.alisa_attn(arm, q, k, v, mask, pos, scale, sums, c, kv_type=kv_type)
    y_ref, w_ref = alisa_reference(q, kv, vv, mask, pos, scale, sums, c)
    assert_close(y, y_ref, OP_TOL[kv_type])
    assert np.abs(w - w_ref).max() <= 1e-5 * q.shape[1]


CHECKS = {"sparq": _check_sparq, "loki": _check_loki, "alisa": _check_alisa}


# the fast tier's subset: each ranking on random and planted inputs, f16 and q8_0 caches
@pytest.mark.parametrize("kind,kv_type", [("random", "f16"), ("planted", "q8_0")])
@pytest.mark.parametrize("rank", list(CHECKS))
def test_neon_subset_matches_reference_on_aarch64(arm, rank, kind, kv_type):
    CHECKS[rank](arm, kind, kv_type, seed=11 + len(kv_type) + (kind == "planted"))


@slow
@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("kind", ["random", "planted"])
def test_alisa_matches_reference_on_aarch64(arm, kind, kv_type):
    _check_alisa(arm, kind, kv_type, seed=31 + len(kv_type) + (kind == "planted"))
