"""ggml_sparq_attn (the CPU op of the patched ggml) against the Numba reference (docs/spec.md SparQ).

Runs against $SPARQ_CPP_LIB_DIR (or the installed llama_cpp's lib/); skipped when that build has
no ggml_sparq_attn. The reference is fed the values the op reads (f16 / dequantized q8_0 cache).
Tolerances (SPEC "Numerical contract"): max|diff| <= 1e-3 * max|y| for f16 and q8_0 caches,
1e-5 for f32 caches.
"""
from __future__ import annotations

import numpy as np
import pytest

from sparq_cpp.bindings import ggml_ops as go
from sparq_cpp.reference.attention import DenseAttention, ExactTopKAttention, SparQAttention

if not go.has_sparq_attn():
    pytest.skip("the ggml build has no ggml_sparq_attn (set SPARQ_CPP_LIB_DIR to a patched build)",
                allow_module_level=True)

from conftest import OP_TOL, assert_close, make_cache, make_mask, make_qkv  # noqa: E402


def run_both(q, k, v, mask, pos, r, top_k, l, mean_value=True, kv_type="f16", kt_type=None, kt_pad=3, n_threads=2,
             scale=None, sink=0):
    D = q.shape[-1]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    y, kv, vv = go.sparq_attn(q, k, v, mask, pos, scale, r, top_k, l, mean_value, kv_type=kv_type, kt_type=kt_type,
                              kt_pad=kt_pad, n_threads=n_threads, return_values=True, n_sink=sink)
    ref = SparQAttention(r, top_k, l, mean_value, sink=sink)(q, kv, vv, mask, pos, scale)
    return y, ref


# the first positions always kept (the attention sink): one, several sequences (each has its own first positions),
# no local window, all of the budget the local window leaves; one query row (kv heads per thread) and several
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("sink,l,n_seq,n_q", [(1, 16, 1, 1), (4, 16, 3, 3), (64, 0, 1, 2), (48, 16, 2, 1), (1, 16, 1, 6)])
@pytest.mark.parametrize("kind", ["random", "planted"])
def test_sink_matches_reference(kind, sink, l, n_seq, n_q, kv_type):
    rng = np.random.default_rng(sink * 10 + n_seq + (kind == "planted"))
    n_head_kv, g, D, n_kv = 2, 4, 64, 1500
    q, k, v = make_qkv(rng, n_q, n_head_kv * g, n_head_kv, D, n_kv, kind)
    seq, pos = make_cache(rng, n_kv, n_seq=n_seq, shuffle=True)
    mask = make_mask(rng, seq, pos, n_q, n_seq=n_seq)
    kt_type = "f32" if kv_type == "q8_0" else None
    y, ref = run_both(q, k, v, mask, pos, 16, 64, l, kv_type=kv_type, kt_type=kt_type, sink=sink)
    assert_close(y, ref, OP_TOL[kv_type])


def test_sink_keeps_a_low_scored_first_position():
    """A first position whose key points away from the query is dropped without the sink, kept with it."""
    rng = np.random.default_rng(5)
    D, n_kv = 64, 600
    q, k, v = make_qkv(rng, 1, 4, 1, D, n_kv, "random")
    pos = np.arange(n_kv, dtype=np.int32)
    k[0] = -8.0 * q[0, 0] / np.linalg.norm(q[0, 0])  # position 0: the lowest score of every head
    v[0] = 50.0  # and a value that shows in the output when it is attended
    mask = np.ones((1, n_kv), dtype=bool)
    y0, ref0 = run_both(q, k, v, mask, pos, 64, 32, 8, mean_value=False)
    y1, ref1 = run_both(q, k, v, mask, pos, 64, 32, 8, mean_value=False, sink=1)
    assert_close(y0, ref0, OP_TOL["f16"])
    assert_close(y1, ref1, OP_TOL["f16"])
    assert np.abs(y1 - y0).max() > 1e-3 * np.abs(y0).max()


# against the reference


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", ["random", "planted"])
def test_matches_reference(kind, D, g, kv_type):
    rng = np.random.default_rng(D * 100 + g * 10 + len(kv_type) + (kind == "planted"))
    n_head_kv = 2
    n_kv = 1500
    q, k, v = make_qkv(rng, 1, n_head_kv * g, n_head_kv, D, n_kv, kind)
    seq, pos = make_cache(rng, n_kv)
    mask = make_mask(rng, seq, pos, 1)
    # q8_0: rank from an f32 copy of the dequantized keys so the op and the reference rank the same numbers
    kt_type = "f32" if kv_type == "q8_0" else None
    y, ref = run_both(q, k, v, mask, pos, 16, 64, 16, kv_type=kv_type, kt_type=kt_type)
    assert_close(y, ref, OP_TOL[kv_type])


@pytest.mark.parametrize("r", [1, 7, 8, 16, 32, 64])
@pytest.mark.parametrize("top_k", [1, 7, 100, 700, 1100])
@pytest.mark.parametrize("l_mode", ["0", "k/4", "k"])
def test_parameter_sweep(r, top_k, l_mode):
    rng = np.random.default_rng(r * 1000 + top_k)
    D, n_kv = 64, 1000
    l = {"0": 0, "k/4": top_k // 4, "k": top_k}[l_mode]
    q, k, v = make_qkv(rng, 1, 8, 2, D, n_kv, "planted" if r % 2 else "random")
    seq, pos = make_cache(rng, n_kv, hole_frac=0.1, shuffle=True)
    mask = make_mask(rng, seq, pos, 1)
    y, ref = run_both(q, k, v, mask, pos, r, top_k, l, kv_type="f16")
    assert_close(y, ref, OP_TOL["f16"])


@pytest.mark.parametrize("boost", [30.0, 400.0])
@pytest.mark.parametrize("g", [1, 4])
def test_scores_far_above_the_first_block(boost, g):
    """A few keys whose approximate scores exceed those of their chunk's first cells by `boost`: the
    AVX2 kernel takes exp(score - max of the first block) while scoring, so +30 runs through that
    path with large exponentials, and +400 (exp would overflow) through its fallback (score again,
    then the exponentials). Both must still match the reference."""
    rng = np.random.default_rng(int(boost) + g)
    D, n_kv, n_head_kv = 64, 2500, 2
    q, k, v = make_qkv(rng, 1, n_head_kv * g, n_head_kv, D, n_kv)
    k *= 0.1
    for h in range(n_head_kv):
        qa = q[0, h * g:(h + 1) * g].sum(axis=0)
        for cell in (300, 700, 1500, 2400):  # in chunks 0, 0, 1, 2 (1024 cells each), not in their first 64 cells
            x = np.sign(qa) * np.abs(qa) ** 2
            k[cell, h] = x * boost / np.abs(qa @ x / np.sqrt(D) / g)
    seq, pos = make_cache(rng, n_kv)
    mask = make_mask(rng, seq, pos, 1)
    y, ref = run_both(q, k, v, mask, pos, 16, 64, 16, kv_type="f16")
    assert_close(y, ref, OP_TOL["f16"])


# MHA (g = 1), 8 kv heads: with at least 4 (row, kv head) items per thread the kernel gives each thread whole kv
# heads (scoring, selection and exact attention of a head on one thread); with fewer (one query row, 3 threads) it
# splits the (kv head, chunk) pairs of the row between the threads and selects after a barrier. Both schedules
# must select the same cells: the results are bit-identical for 1, 2 and 3 threads, and match the reference.


def mha_case(seed, n_kv, kind="random", n_q=1):
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, n_q, 8, 8, 128, n_kv, kind)
    seq, pos = make_cache(rng, n_kv, n_seq=2, hole_frac=0.05, shuffle=True)
    mask = make_mask(rng, seq, pos, n_q, n_seq=2)
    return q, k, v, mask, pos


@pytest.mark.parametrize("kind", ["random", "planted"])
@pytest.mark.parametrize("top_k,l", [(1, 0), (64, 16), (128, 32), (300, 0), (1500, 375)])
def test_mha_per_head_selection_matches_reference(kind, top_k, l):
    q, k, v, mask, pos = mha_case(41 + top_k, 6000, kind, n_q=2)
    y, ref = run_both(q, k, v, mask, pos, 16, top_k, l, kv_type="f16")
    assert_close(y, ref, OP_TOL["f16"])
    scale = 1.0 / np.sqrt(128)
    ys = [go.sparq_attn(q, k, v, mask, pos, scale, 16, top_k, l, True, n_threads=nt) for nt in (1, 2, 3)]
    assert np.array_equal(ys[0], ys[1])
    assert np.array_equal(ys[0], ys[2])


def test_mha_rising_scores_and_ties():
    """Scores that rise with the cell index and a run of 600 equal keys (more equal scores than top_k, so
    ties, broken by position, decide part of the selection): the per-head and the split schedules select the
    same cells."""
    rng = np.random.default_rng(43)
    n_kv, D = 6000, 128
    q, k, v, mask, pos = mha_case(43, n_kv)
    ramp = np.linspace(0.0, 3.0, n_kv)[:, None, None]
    k = k * 0.2 + ramp * np.sign(q[0])[None] / np.sqrt(D)
    k[2000:2600] = k[2000]  # 600 equal keys, more than top_k, among the high scores
    k[2000:2600] += 0.5 * np.sign(q[0])[None]
    pos = np.arange(n_kv, dtype=np.int32)
    rng.shuffle(pos)
    mask = np.ones((1, n_kv), dtype=bool)
    scale = 1.0 / np.sqrt(D)
    for top_k, l in ((128, 32), (400, 0)):
        ys = [go.sparq_attn(q, k, v, mask, pos, scale, 16, top_k, l, True, n_threads=nt) for nt in (1, 2, 3)]
        assert np.array_equal(ys[0], ys[1])
        assert np.array_equal(ys[0], ys[2])


def test_equal_query_sums_choose_the_lowest_components():
    """|q| summed over the group is the same in every component, so SPEC's tie rule (the lower component first)
    alone decides which r components rank the cells. The keys carry a strong signal in components 0..r-1 and an
    opposite one in the others: any other choice ranks other cells, and the output moves far from the reference."""
    rng = np.random.default_rng(53)
    n_kv, D, r = 4000, 128, 16
    q = np.ones((1, 8, D), dtype=np.float32)
    q[..., 1::2] = -1.0
    k = 0.1 * rng.standard_normal((n_kv, 8, D)).astype(np.float32)
    hot = rng.choice(n_kv, size=64, replace=False)
    cold = rng.choice(np.setdiff1d(np.arange(n_kv), hot), size=64, replace=False)
    k[hot, :, :r] += 3.0 * q[0, :, :r]
    k[cold, :, r:] += 3.0 * q[0, :, r:]
    v = rng.standard_normal((n_kv, 8, D)).astype(np.float32)
    v[hot] += 5.0
    mask = np.ones((1, n_kv), dtype=bool)
    pos = np.arange(n_kv, dtype=np.int32)
    y, ref = run_both(q, k, v, mask, pos, r, 64, 0, kv_type="f16")
    assert_close(y, ref, OP_TOL["f16"])
    assert y.mean() > 2.0  # the hot cells' values dominate: the first r components were the ones used


def test_mha_scores_that_underflow():
    """A few keys far above the rest (+200 in the score: the others' softmax weights underflow to 0 in f32, so
    the selection past those few goes by position): the per-head and the split schedules select the same cells."""
    n_kv, D = 5000, 128
    q, k, v, mask, pos = mha_case(47, n_kv)
    k *= 0.1
    for h in range(8):
        x = np.sign(q[0, h]) * np.abs(q[0, h]) ** 2
        for cell in (100, 1900, 4500):
            k[cell, h] = x * 200.0 / np.abs(q[0, h] @ x / np.sqrt(D))
    mask[:, [100, 1900, 4500]] = True
    scale = 1.0 / np.sqrt(D)
    ys = [go.sparq_attn(q, k, v, mask, pos, scale, 16, 128, 32, True, n_threads=nt) for nt in (1, 2, 3)]
    assert np.array_equal(ys[0], ys[1])
    assert np.array_equal(ys[0], ys[2])


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("mean_value", [True, False])
def test_sequences_holes_shuffled_batches(kv_type, mean_value):
    """Several sequences in one cache, empty cells, shuffled cell positions, causal multi-row batch,
    vmean computed by the op (NULL)."""
    rng = np.random.default_rng(7 + mean_value)
    D, n_kv, n_seq, n_q = 128, 2000, 3, 12
    q, k, v = make_qkv(rng, n_q, 8, 2, D, n_kv)
    seq, pos = make_cache(rng, n_kv, n_seq=n_seq, hole_frac=0.15, shuffle=True)
    mask = make_mask(rng, seq, pos, n_q, n_seq=n_seq, causal=True)
    kt_type = "f32" if kv_type == "q8_0" else None
    y, ref = run_both(q, k, v, mask, pos, 16, 96, 24, mean_value, kv_type=kv_type, kt_type=kt_type)
    assert_close(y, ref, OP_TOL[kv_type])


def test_prompt_batch_causal():
    """A prompt-like batch: 64 causal rows of one sequence, short rows select everything."""
    rng = np.random.default_rng(11)
    D, n_kv, n_q = 64, 400, 64
    q, k, v = make_qkv(rng, n_q, 4, 4, D, n_kv)
    _, pos = make_cache(rng, n_kv, shuffle=True)
    mask = np.stack([pos <= n_kv - n_q + t for t in range(n_q)])  # row t sees positions <= 336 + t
    y, ref = run_both(q, k, v, mask, pos, 8, 350, 32)
    assert_close(y, ref, OP_TOL["f16"])


def test_empty_row_gives_zero():
    rng = np.random.default_rng(3)
    q, k, v = make_qkv(rng, 3, 4, 2, 64, 300)
    pos = np.arange(300, dtype=np.int32)
    mask = np.ones((3, 300), dtype=bool)
    mask[1] = False
    y, ref = run_both(q, k, v, mask, pos, 8, 32, 8)
    assert np.all(y[1] == 0)
    assert_close(y, ref, OP_TOL["f16"])


def test_vmean_tensor_matches_computed_mean():
    rng = np.random.default_rng(5)
    D, n_kv = 64, 900
    q, k, v = make_qkv(rng, 2, 8, 2, D, n_kv)
    seq, pos = make_cache(rng, n_kv, n_seq=2)
    mask = make_mask(rng, seq, pos, 2, n_seq=2)
    scale = 1.0 / np.sqrt(D)
    y0, kv, vv = go.sparq_attn(q, k, v, mask, pos, scale, 8, 64, 16, True, return_values=True)
    vmean = np.stack([vv[mask[t]].astype(np.float64).mean(axis=0) for t in range(2)]).astype(np.float32)
    y1 = go.sparq_attn(q, k, v, mask, pos, scale, 8, 64, 16, True, vmean=vmean)
    assert_close(y1, y0, 1e-5)


# invariants


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("g", [1, 4])
def test_all_visible_selected_equals_dense(kv_type, g):
    """top_k >= n_visible: alpha = 1 and the result is dense attention (== ggml_flash_attn_ext)."""
    rng = np.random.default_rng(g)
    D, n_kv, n_q = 128, 700, 3
    q, k, v = make_qkv(rng, n_q, 2 * g, 2, D, n_kv)
    seq, pos = make_cache(rng, n_kv, n_seq=2, hole_frac=0.1, shuffle=True)
    mask = make_mask(rng, seq, pos, n_q, n_seq=2)
    scale = 1.0 / np.sqrt(D)
    y, kv, vv = go.sparq_attn(q, k, v, mask, pos, scale, 4, n_kv, 8, True, kv_type=kv_type, return_values=True)
    dense = DenseAttention()(q, kv, vv, mask, pos, scale)
    assert_close(y, dense, OP_TOL[kv_type])
    fa = go.flash_attn_ext(q, k, v, mask, pos, scale, kv_type=kv_type)
    # CPU flash attention rounds Q to f16 and accumulates V in f16 for f16 caches
    assert_close(y, fa, 1e-5 if kv_type == "f32" else 1e-2)


@pytest.mark.parametrize("mean_value", [False, True])
def test_r_equals_D_is_exact_topk(mean_value):
    """r = D: the approximate scores are the exact ones, so SparQ is exact top-k (+ mean value)."""
    rng = np.random.default_rng(17)
    D, n_kv, g = 64, 1200, 4
    q, k, v = make_qkv(rng, 2, 2 * g, 2, D, n_kv, "planted")
    seq, pos = make_cache(rng, n_kv, n_seq=2, shuffle=True)
    mask = make_mask(rng, seq, pos, 2, n_seq=2)
    scale = 1.0 / np.sqrt(D)
    top_k, l = 80, 20
    y, kv, vv = go.sparq_attn(q, k, v, mask, pos, scale, D, top_k, l, mean_value, kv_type="f32", return_values=True)
    ex = ExactTopKAttention(top_k, l)
    y_top = ex(q, kv, vv, mask, pos, scale).astype(np.float64)
    if mean_value:
        sel = ex.last_selection
        for t in range(q.shape[0]):
            vis = np.nonzero(mask[t])[0]
            for j in range(q.shape[1]):
                h = j // g
                s = scale * (kv[vis, h].astype(np.float64) @ q[t, j].astype(np.float64))
                p = np.exp(s - s.max())
                p /= p.sum()
                cells = sel[t, h][sel[t, h] >= 0]
                alpha = p[np.isin(vis, cells)].sum()
                vmean = vv[vis, h].astype(np.float64).mean(axis=0)
                y_top[t, j] = alpha * y_top[t, j] + (1 - alpha) * vmean
    assert_close(y, y_top, 1e-5)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_masked_cells_are_never_read(kv_type):
    """NaN / inf in every cell a row cannot see (other sequences, holes, the padded kt columns)
    must not change a single bit of the result."""
    rng = np.random.default_rng(23)
    D, n_kv, n_q = 64, 1500, 4
    q, k, v = make_qkv(rng, n_q, 8, 2, D, n_kv)
    seq, pos = make_cache(rng, n_kv, n_seq=2, hole_frac=0.2, shuffle=True)
    mask = make_mask(rng, seq, pos, n_q, n_seq=2)
    # rows 0, 2 see sequence 0; poison sequence 1 and the holes, as seen from sequence 0
    rows = [0, 2]
    bad = ~mask[rows].any(axis=0)
    scale = 1.0 / np.sqrt(D)
    k0, v0 = k.copy(), v.copy()
    k0[bad] = 0.0
    v0[bad] = 0.0
    kb, vb = k.copy(), v.copy()
    kb[bad] = np.nan
    vb[bad] = np.inf
    kb[bad & (np.arange(n_kv) % 2 == 0)] = np.inf
    for top_k, mv in ((50, True), (50, False), (n_kv, True)):
        clean = go.sparq_attn(q[rows], k0, v0, mask[rows], pos, scale, 8, top_k, 10, mv, kv_type=kv_type, kt_pad=5)
        with np.errstate(invalid="ignore"):  # quantizing the poisoned rows
            dirty = go.sparq_attn(q[rows], kb, vb, mask[rows], pos, scale, 8, top_k, 10, mv, kv_type=kv_type, kt_pad=5)
        assert np.all(np.isfinite(dirty))
        assert np.array_equal(clean, dirty)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_thread_count_does_not_change_result(kv_type):
    rng = np.random.default_rng(29)
    D, n_kv, n_q = 128, 5000, 3
    q, k, v = make_qkv(rng, n_q, 8, 2, D, n_kv)
    seq, pos = make_cache(rng, n_kv, n_seq=3, hole_frac=0.05, shuffle=True)
    mask = make_mask(rng, seq, pos, n_q, n_seq=3)
    scale = 1.0 / np.sqrt(D)
    ys = [go.sparq_attn(q, k, v, mask, pos, scale, 16, 128, 32, True, kv_type=kv_type, n_threads=nt)
          for nt in (1, 2, 3)]
    assert np.array_equal(ys[0], ys[1])
    assert np.array_equal(ys[0], ys[2])


def test_model_scale_not_1_over_sqrt_D():
    """kq_scale != 1/sqrt(D): the approximate scores use kq_scale*sqrt(D)/tau."""
    rng = np.random.default_rng(31)
    q, k, v = make_qkv(rng, 1, 8, 2, 64, 1000)
    pos = np.arange(1000, dtype=np.int32)
    mask = np.ones((1, 1000), dtype=bool)
    y, ref = run_both(q, k, v, mask, pos, 8, 64, 16, scale=0.0625 * 1.7)
    assert_close(y, ref, OP_TOL["f16"])


def test_unusable_lib_dir_raises_sparq_error(monkeypatch, tmp_path):
    from sparq_cpp.errors import SparqError
    monkeypatch.setenv("SPARQ_CPP_LIB_DIR", str(tmp_path))
    assert not go.has_sparq_attn()
    with pytest.raises(SparqError):
        go.lib()


def test_tensor_data_gets_ggml_buffer_alignment():
    # numpy aligns to 16 bytes, ggml's CPU buffers to 64: the cache rows must start where llama.cpp's would
    import ctypes
    vals = np.arange(4096, dtype=np.float16)

    def at(offset):
        raw = np.zeros(vals.nbytes + 128, np.uint8)
        off = -raw.ctypes.data % 64 + offset
        out = raw[off:off + vals.nbytes].view(np.float16)
        out[...] = vals
        return out

    misaligned, aligned = at(16), at(0)
    with go.Graph(n_tensors=4) as g:
        t = g.tensor(misaligned, "f16")
        assert t.contents.data % 64 == 0
        got = np.ctypeslib.as_array((ctypes.c_uint16 * vals.size).from_address(t.contents.data))
        assert np.array_equal(got, vals.view(np.uint16))
        assert g.tensor(aligned, "f16").contents.data == aligned.ctypes.data  # no copy when already aligned


# long contexts


@pytest.mark.slow
@pytest.mark.parametrize("n_kv", [8192, 32768])
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("kind", ["random", "planted"])
def test_long_context(n_kv, kv_type, kind):
    rng = np.random.default_rng(n_kv + len(kv_type))
    D, g = 128, 4
    q, k, v = make_qkv(rng, 1, 4 * g, 4, D, n_kv, kind)
    seq, pos = make_cache(rng, n_kv, n_seq=2, hole_frac=0.02, shuffle=True)
    mask = make_mask(rng, seq, pos, 2, n_seq=2)
    q = np.concatenate([q, q[:, ::-1].copy()])
    kt_type = "f32" if kv_type == "q8_0" else None
    for r, top_k, l in ((16, 128, 32), (32, 512, 0), (1, 64, 64)):
        y, ref = run_both(q, k, v, mask, pos, r, top_k, l, kv_type=kv_type, kt_type=kt_type)
        assert_close(y, ref, OP_TOL[kv_type])


@pytest.mark.slow
@pytest.mark.parametrize("g", [1, 8])
def test_long_context_threads_and_dense(g):
    rng = np.random.default_rng(37 + g)
    D, n_kv = 128, 16384
    q, k, v = make_qkv(rng, 1, 2 * g, 2, D, n_kv)
    pos = rng.permutation(n_kv).astype(np.int32)
    mask = np.ones((1, n_kv), dtype=bool)
    mask[0, rng.random(n_kv) < 0.1] = False
    scale = 1.0 / np.sqrt(D)
    ys = [go.sparq_attn(q, k, v, mask, pos, scale, 16, 128, 32, True, n_threads=nt) for nt in (1, 2)]
    assert np.array_equal(ys[0], ys[1])
    y, kv, vv = go.sparq_attn(q, k, v, mask, pos, scale, 16, n_kv, 32, True, kv_type="f32", return_values=True)
    assert_close(y, DenseAttention()(q, kv, vv, mask, pos, scale), 1e-5)
