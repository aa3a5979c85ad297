"""ggml_loki_attn (the Loki ranking of GGML_OP_SPARSE_ATTN, CPU) against the Numba reference (docs/spec.md Loki).

The op takes q and k already in the Loki basis (llama.cpp rotates them before the cache); the reference
LokiAttention rotates them itself, so it gets an identity basis on the rotated values, or the real basis
on the unrotated ones where the test is about the rotation. The reference is fed the values the op
reads (f16 / dequantized q8_0 cache). Tolerances as in test_sparq_op.py (SPEC "Numerical contract").
"""
from __future__ import annotations

import numpy as np
import pytest

from sparq_cpp.bindings import ggml_ops as go
from sparq_cpp.reference.attention import DenseAttention
from sparq_cpp.reference.loki import LokiAttention

if not go.has_sparq_attn():
    pytest.skip("the ggml build has no SPARSE_ATTN op (set SPARQ_CPP_LIB_DIR to a patched build)",
                allow_module_level=True)

from conftest import OP_TOL, assert_close, identity, make_cache, make_mask, make_qkv  # noqa: E402


def random_basis(rng, n_head_kv, D):
    """Orthonormal P per KV head, as calibration makes (columns = components)."""
    return np.stack([np.linalg.qr(rng.standard_normal((D, D)))[0] for _ in range(n_head_kv)])[None]


def run_both(q, k, v, mask, pos, d, top_k, l, kv_type="f16", n_threads=2, scale=None, sink=0):
    """Op and reference on q, k already in the basis."""
    D = q.shape[-1]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    y, kv, vv = go.loki_attn(q, k, v, mask, pos, scale, d, top_k, l, kv_type=kv_type, n_threads=n_threads,
                             return_values=True, n_sink=sink)
    ref = LokiAttention(identity(D, k.shape[1]), d, top_k, l, sink=sink)(q, kv, vv, mask, pos, scale)
    return y, ref


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("sink,l,n_seq,n_q", [(1, 0, 1, 1), (4, 16, 3, 3), (64, 0, 1, 2), (48, 16, 2, 1), (2, 0, 2, 6)])
@pytest.mark.parametrize("kind", ["random", "planted"])
def test_sink_matches_reference(kind, sink, l, n_seq, n_q, kv_type):
    rng = np.random.default_rng(sink * 10 + n_seq + (kind == "planted") + 3)
    n_head_kv, g, D, n_kv = 2, 4, 64, 1500
    q, k, v = make_qkv(rng, n_q, n_head_kv * g, n_head_kv, D, n_kv, kind)
    seq, pos = make_cache(rng, n_kv, n_seq=n_seq, shuffle=True)
    mask = make_mask(rng, seq, pos, n_q, n_seq=n_seq)
    y, ref = run_both(q, k, v, mask, pos, 32, 64, l, kv_type=kv_type, sink=sink)
    assert_close(y, ref, OP_TOL[kv_type])


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", ["random", "planted"])
def test_matches_reference(kind, D, g, kv_type):
    rng = np.random.default_rng(D * 100 + g * 10 + len(kv_type) + (kind == "planted") + 7)
    n_head_kv, n_kv = 2, 1500
    q, k, v = make_qkv(rng, 1, n_head_kv * g, n_head_kv, D, n_kv, kind)
    seq, pos = make_cache(rng, n_kv)
    mask = make_mask(rng, seq, pos, 1)
    y, ref = run_both(q, k, v, mask, pos, 32, 64, 0, kv_type=kv_type)
    assert_close(y, ref, OP_TOL[kv_type])


def selection_margin(q, k, pos, d, top_k, l, scale):
    """All cells visible, one row: the smallest relative gap, over KV heads, between the last selected and
    the first unselected group score (SPEC step 3, in f64). Below f32 resolution the op (f32) and the
    reference (f64) may legitimately pick different cells, so the sweep avoids such inputs."""
    n, n_head_kv = k.shape[0], k.shape[1]
    if n <= top_k or top_k == l:
        return np.inf
    g = q.shape[1] // n_head_kv
    rest = np.argsort(-pos, kind="stable")[l:]  # the cells outside the local window
    gaps = []
    for h in range(n_head_kv):
        s_sum = np.zeros(n)
        for j in range(h * g, (h + 1) * g):
            s = scale * (k[:, h, :d].astype(np.float64) @ q[0, j, :d].astype(np.float64))
            e = np.exp(s - s.max())
            s_sum += e / e.sum()
        srt = np.sort(s_sum[rest])[::-1]
        gaps.append((srt[top_k - l - 1] - srt[top_k - l]) / srt[top_k - l - 1])
    return min(gaps)


@pytest.mark.parametrize("d", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("top_k", [1, 7, 100, 700, 1100])
@pytest.mark.parametrize("l_mode", ["0", "k/4", "k"])
def test_parameter_sweep(d, top_k, l_mode):
    D, n_kv = 64, 1000
    l = {"0": 0, "k/4": top_k // 4, "k": top_k}[l_mode]
    for attempt in range(20):  # the first input without a near-tie at the selection boundary
        rng = np.random.default_rng(d * 1000 + top_k + len(l_mode) + 7919 * attempt)
        q, k, v = make_qkv(rng, 1, 8, 2, D, n_kv, "planted")
        pos = rng.permutation(n_kv).astype(np.int32)
        kv = go.decode(go.encode(k.reshape(n_kv, -1), "f16"), "f16").reshape(k.shape)
        if selection_margin(q, kv, pos, d, top_k, l, 1.0 / np.sqrt(D)) > 1e-5:
            break
    else:
        pytest.fail("no input without a near-tie in 20 tries")
    mask = np.ones((1, n_kv), dtype=bool)
    y, ref = run_both(q, k, v, mask, pos, d, top_k, l)
    assert_close(y, ref, OP_TOL["f16"])


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_sequences_holes_shuffled_batches(kv_type):
    rng = np.random.default_rng(41 + len(kv_type))
    D, n_kv, n_q = 128, 2000, 6
    q, k, v = make_qkv(rng, n_q, 8, 2, D, n_kv, "planted")
    seq, pos = make_cache(rng, n_kv, n_seq=3, hole_frac=0.1, shuffle=True)
    mask = make_mask(rng, seq, pos, n_q, n_seq=3)
    y, ref = run_both(q, k, v, mask, pos, 16, 100, 20, kv_type=kv_type)
    assert_close(y, ref, OP_TOL[kv_type])


def test_prompt_batch_causal():
    rng = np.random.default_rng(43)
    D, n_kv, n_q = 64, 700, 9
    q, k, v = make_qkv(rng, n_q, 4, 4, D, n_kv)
    seq, pos = make_cache(rng, n_kv)
    mask = make_mask(rng, seq, pos, n_q, causal=True)
    y, ref = run_both(q, k, v, mask, pos, 8, 50, 5)
    assert_close(y, ref, OP_TOL["f16"])


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("g", [1, 4])
def test_d_equals_D_all_selected_equals_dense(kv_type, g):
    """d = D with every visible position selected: llama.cpp's dense flash attention on the same cache."""
    rng = np.random.default_rng(47 + g)
    D, n_kv = 128, 800
    q, k, v = make_qkv(rng, 2, 2 * g, 2, D, n_kv)
    seq, pos = make_cache(rng, n_kv, n_seq=2, hole_frac=0.1, shuffle=True)
    mask = make_mask(rng, seq, pos, 2, n_seq=2)
    scale = 1.0 / np.sqrt(D)
    y, kv, vv = go.loki_attn(q, k, v, mask, pos, scale, D, n_kv, 0, kv_type=kv_type, return_values=True)
    assert_close(y, DenseAttention()(q, kv, vv, mask, pos, scale), OP_TOL[kv_type])
    fa = go.flash_attn_ext(q, k, v, mask, pos, scale, kv_type=kv_type)
    # CPU flash attention rounds Q to f16 and accumulates V in f16 for f16 caches
    assert_close(y, fa, 1e-5 if kv_type == "f32" else 1e-2)


def test_rotated_cache_gives_the_same_dense_attention():
    """P orthonormal: attention over every position of the rotated cache equals dense attention over the
    unrotated one, and the reference (which rotates itself) agrees with the op on the same ranking."""
    rng = np.random.default_rng(53)
    D, n_kv, g = 128, 1200, 4
    q, k, v = make_qkv(rng, 1, 2 * g, 2, D, n_kv, "planted")
    pos = np.arange(n_kv, dtype=np.int32)
    mask = np.ones((1, n_kv), dtype=bool)
    scale = 1.0 / np.sqrt(D)
    ref = LokiAttention(random_basis(rng, 2, D), 24, 96, 8)
    qr, kr = ref.rotate(q, k, 0)
    y_all = go.loki_attn(qr, kr, v, mask, pos, scale, 24, n_kv, 0, kv_type="f32")
    assert_close(y_all, DenseAttention()(q, k, v, mask, pos, scale), 1e-5)
    y = go.loki_attn(qr, kr, v, mask, pos, scale, 24, 96, 8, kv_type="f32")
    assert_close(y, ref(q, k, v, mask, pos, scale), 1e-5)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_masked_cells_are_never_read(kv_type):
    rng = np.random.default_rng(59)
    D, n_kv, n_q = 64, 1500, 4
    q, k, v = make_qkv(rng, n_q, 8, 2, D, n_kv)
    seq, pos = make_cache(rng, n_kv, n_seq=2, hole_frac=0.2, shuffle=True)
    mask = make_mask(rng, seq, pos, n_q, n_seq=2)
    rows = [0, 2]
    bad = ~mask[rows].any(axis=0)
    scale = 1.0 / np.sqrt(D)
    k0, v0 = k.copy(), v.copy()
    k0[bad] = 0.0
    v0[bad] = 0.0
    kb, vb = k.copy(), v.copy()
    kb[bad] = np.nan
    vb[bad] = np.inf
    for top_k in (50, n_kv):
        clean = go.loki_attn(q[rows], k0, v0, mask[rows], pos, scale, 32, top_k, 10, kv_type=kv_type)
        with np.errstate(invalid="ignore"):
            dirty = go.loki_attn(q[rows], kb, vb, mask[rows], pos, scale, 32, top_k, 10, kv_type=kv_type)
        assert np.all(np.isfinite(dirty))
        assert np.array_equal(clean, dirty)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_thread_count_does_not_change_result(kv_type):
    rng = np.random.default_rng(61)
    D, n_kv, n_q = 128, 5000, 3
    q, k, v = make_qkv(rng, n_q, 8, 2, D, n_kv)
    seq, pos = make_cache(rng, n_kv, n_seq=3, hole_frac=0.05, shuffle=True)
    mask = make_mask(rng, seq, pos, n_q, n_seq=3)
    scale = 1.0 / np.sqrt(D)
    ys = [go.loki_attn(q, k, v, mask, pos, scale, 32, 128, 0, kv_type=kv_type, n_threads=nt) for nt in (1, 2, 3)]
    assert np.array_equal(ys[0], ys[1])
    assert np.array_equal(ys[0], ys[2])


def test_decode_many_heads():
    """32 KV heads, one row: the kernel's kv-heads-per-thread mode (as in a Llama 2 7B decode step)."""
    rng = np.random.default_rng(67)
    D, n_kv = 128, 3000
    q, k, v = make_qkv(rng, 1, 32, 32, D, n_kv, "planted")
    pos = np.arange(n_kv, dtype=np.int32)
    mask = np.ones((1, n_kv), dtype=bool)
    y, ref = run_both(q, k, v, mask, pos, 32, 128, 0)
    assert_close(y, ref, OP_TOL["f16"])


@pytest.mark.slow
@pytest.mark.parametrize("n_kv", [8192, 32768])
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("kind", ["random", "planted"])
def test_long_context(n_kv, kv_type, kind):
    rng = np.random.default_rng(n_kv + len(kv_type) + 3)
    D, g = 128, 4
    q, k, v = make_qkv(rng, 1, 4 * g, 4, D, n_kv, kind)
    seq, pos = make_cache(rng, n_kv, n_seq=2, hole_frac=0.02, shuffle=True)
    mask = make_mask(rng, seq, pos, 2, n_seq=2)
    q = np.concatenate([q, q[:, ::-1].copy()])
    for d, top_k, l in ((32, 128, 0), (16, 512, 32), (1, 64, 64)):
        y, ref = run_both(q, k, v, mask, pos, d, top_k, l, kv_type=kv_type)
        assert_close(y, ref, OP_TOL[kv_type])
