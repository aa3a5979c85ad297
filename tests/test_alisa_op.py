"""ggml_alisa_attn (the ALISA ranking of GGML_OP_SPARSE_ATTN, CPU) against the reference (docs/spec.md, ALISA).

The op is one step of Sparse Window Attention: the caller gives each row's window sums (the attention weights of
the last k steps, summed over heads), the op keeps the k most recent visible positions and the k others with the
largest sums, attends exactly over them and returns, beside the result, the row's weights summed over each set's
query heads (the next steps' sums). Here a reference SWAAttention runs a sequence (a dense prompt, then decode
steps) and the op is given the reference's sums at every step: its result, its selection and its weights must be
the reference's. The reference reads the values the op reads (f16 / dequantized q8_0 cache).
"""
from __future__ import annotations

import numpy as np
import pytest

from sparq_cpp.errors import SparqError
from sparq_cpp.bindings import ggml_ops as go
from sparq_cpp.reference.alisa import SWAAttention
from sparq_cpp.reference.attention import DenseAttention

if not go.has_sparq_attn() or not hasattr(go.lib().base, "ggml_alisa_attn"):
    pytest.skip("the ggml build has no ALISA ranking (set SPARQ_CPP_LIB_DIR to a patched build)",
                allow_module_level=True)

from conftest import OP_TOL, assert_close, make_qkv  # noqa: E402


def sequence(rng, T, n_head, n_head_kv, D, kind, shuffle):
    """q, k, v of a sequence of T tokens stored in cells cell_of[t] (shuffled: not in position order)."""
    q, k, v = make_qkv(rng, T, n_head, n_head_kv, D, T, kind)
    cell_of = rng.permutation(T) if shuffle else np.arange(T)
    kc, vc = np.empty_like(k), np.empty_like(v)
    kc[cell_of], vc[cell_of] = k, v
    cpos = np.empty(T, dtype=np.int32)
    cpos[cell_of] = np.arange(T, dtype=np.int32)
    return q, kc, vc, cpos


def visible(cpos, rows):
    return np.array([cpos <= t for t in rows])


def selection_of(w):
    """The cells a row's weights are not zero at, per set (every weight of a selected cell is > 0)."""
    return [set(np.nonzero(wu)[0].tolist()) for wu in w]


def gap_ok(S, sel_ref, local, rel=1e-5):
    """Whether the selection does not depend on rounding the sums to f32: the smallest sum kept by rank is
    clearly above the largest one left out."""
    rest = np.setdiff1d(np.arange(S.size), np.array(sorted(local), dtype=np.int64))
    kept = np.array(sorted(set(sel_ref) - set(local)), dtype=np.int64)
    out = np.setdiff1d(rest, kept)
    if kept.size == 0 or out.size == 0:
        return True
    return S[kept].min() - S[out].max() > rel * max(S.max(), 1e-30)


def run_steps(q, k, v, cpos, n_prompt, c, per_kv_head, kv_type, n_threads=2, scale=None):
    """The reference over the sequence, the op at every decode step on the reference's sums. Returns the worst
    result and weight errors and the number of steps whose selection was checked."""
    T, n_head, D = q.shape
    n_head_kv = k.shape[1]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    # the values the op reads, for the reference
    _, _, kv, vv = go.alisa_attn(q[:1], k, v, visible(cpos, [0]), cpos, scale, np.zeros((1, T)), c,
                                 kv_type=kv_type, return_values=True)
    swa = SWAAttention(c, per_kv_head)
    swa.prompt_call(q[:n_prompt], kv, vv, visible(cpos, range(n_prompt)), cpos, scale, layer=0)
    n_set = n_head_kv if per_kv_head else 1
    worst_y = worst_w = 0.0
    n_checked = 0
    for t in range(n_prompt, T):
        mask = visible(cpos, [t])
        n = int(mask.sum())
        kk = swa.window(n)
        S = swa.window_sum(0, kk, T, n_set)
        y, w = go.alisa_attn(q[t:t + 1], k, v, mask, cpos, scale, S, c, kv_type=kv_type, n_threads=n_threads)
        ref = swa(q[t:t + 1], kv, vv, mask, cpos, scale, layer=0)
        worst_y = max(worst_y, float(np.abs(y - ref).max() / np.abs(ref).max()))
        cells, rw = swa._rows[0][-1]
        want = np.zeros((n_set, T))
        want[:, cells] = rw
        worst_w = max(worst_w, float(np.abs(w[0] - want).max()))
        got_sel = selection_of(w[0])
        order = np.lexsort((np.arange(T), cpos))[::-1]  # most recent first
        local = set(order[mask[0][order]][:kk].tolist())
        for u in range(n_set):
            ref_sel = set(swa.last_selection[0, u].tolist()) - {-1}
            if 2 * kk >= n or gap_ok(S[u], ref_sel, local):
                assert got_sel[u] == ref_sel, (t, u)
                n_checked += 1
    return worst_y, worst_w, n_checked


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("n_head,n_head_kv", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("per_kv_head", [False, True])
@pytest.mark.parametrize("kind", ["random", "planted"])
def test_decode_steps_match_reference(kind, per_kv_head, n_head, n_head_kv, kv_type):
    rng = np.random.default_rng(n_head * 100 + n_head_kv * 10 + per_kv_head + len(kv_type) + (kind == "planted"))
    T, n_prompt, D = 340, 300, 64
    q, k, v, cpos = sequence(rng, T, n_head, n_head_kv, D, kind, shuffle=True)
    wy, ww, n_checked = run_steps(q, k, v, cpos, n_prompt, 0.25, per_kv_head, kv_type)
    assert wy <= OP_TOL[kv_type]
    assert ww <= 1e-5 * n_head  # weights summed over up to n_head query heads, each at most 1
    assert n_checked >= 0.9 * (T - n_prompt) * (n_head_kv if per_kv_head else 1)


@pytest.mark.parametrize("c", [0.05, 0.125, 0.5])
def test_ratios_and_head_size_128(c):
    rng = np.random.default_rng(int(c * 1000))
    q, k, v, cpos = sequence(rng, 600, 8, 2, 128, "random", shuffle=False)
    wy, ww, n_checked = run_steps(q, k, v, cpos, 560, c, False, "f16")
    assert wy <= OP_TOL["f16"] and ww <= 1e-4 and n_checked >= 36


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_every_position_kept_equals_dense(kv_type):
    """c = 2: 2k >= n, every visible position is kept: dense attention, and the weights are the dense softmax
    summed over the heads."""
    rng = np.random.default_rng(3)
    T, D = 400, 64
    q, k, v, cpos = sequence(rng, T, 8, 2, D, "random", shuffle=True)
    rows = [200, 399]
    mask = visible(cpos, rows)
    S = rng.random((2, T))  # ignored when every position is kept
    y, w, kv, vv = go.alisa_attn(q[rows], k, v, mask, cpos, 0.125, S, 2.0, kv_type=kv_type, return_values=True)
    ref = DenseAttention()(q[rows], kv, vv, mask, cpos, 0.125)
    assert_close(y, ref, OP_TOL[kv_type])
    yf = go.flash_attn_ext(q[rows], k, v, mask, cpos, 0.125, kv_type=kv_type)
    # CPU flash attention rounds Q to f16 and accumulates V in f16 for f16 caches
    assert_close(y, yf, 1e-5 if kv_type == "f32" else 1e-2)
    for i, t in enumerate(rows):
        s = 0.125 * np.einsum("hd,nhd->hn", q[t].astype(np.float64), np.repeat(kv, 4, axis=1).astype(np.float64))
        s = np.where(mask[i], s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        assert np.abs(w[i, 0] - p[:4].sum(0)).max() <= 1e-5 and np.abs(w[i, 1] - p[4:].sum(0)).max() <= 1e-5


def test_rows_with_their_own_sums_and_sequences():
    """Several rows in one call (two sequences, each row its own sums) give what each row gives alone."""
    rng = np.random.default_rng(11)
    n_kv, D = 800, 64
    seq = rng.integers(0, 2, n_kv)
    pos = np.zeros(n_kv, dtype=np.int32)
    for s in range(2):
        cells = np.nonzero(seq == s)[0]
        pos[cells] = rng.permutation(cells.size)
    q, k, v = make_qkv(rng, 4, 8, 2, D, n_kv)
    mask = np.array([seq == t % 2 for t in range(4)])
    mask[2] &= pos < 300  # a row that sees an earlier part of its sequence
    S = rng.random((4, 2, n_kv)).astype(np.float32)
    y, w = go.alisa_attn(q, k, v, mask, pos, 0.125, S, 0.2, n_threads=3)
    for t in range(4):
        y1, w1 = go.alisa_attn(q[t:t + 1], k, v, mask[t:t + 1], pos, 0.125, S[t], 0.2, n_threads=1)
        assert np.array_equal(y[t], y1[0]) and np.array_equal(w[t], w1[0])
        n = int(mask[t].sum())
        kk = max(1, int(np.floor(n * 0.2 / 2)))
        for u in range(2):
            sel = np.nonzero(w[t, u])[0]
            assert sel.size == 2 * kk and mask[t, sel].all()
            # the most recent k of the row's visible cells are kept
            vis = np.nonzero(mask[t])[0]
            recent = vis[np.argsort(pos[vis])[::-1][:kk]]
            assert set(recent.tolist()) <= set(sel.tolist())


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_thread_count_does_not_change_result(n_threads):
    rng = np.random.default_rng(5)
    n_kv = 1200
    q, k, v = make_qkv(rng, 2, 8, 4, 64, n_kv)
    pos = np.arange(n_kv, dtype=np.int32)
    mask = np.ones((2, n_kv), bool)
    S = rng.random((4, n_kv)).astype(np.float32)
    want = go.alisa_attn(q, k, v, mask, pos, 0.125, S, 0.1, n_threads=1)
    got = go.alisa_attn(q, k, v, mask, pos, 0.125, S, 0.1, n_threads=n_threads)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_masked_cells_are_never_read():
    rng = np.random.default_rng(8)
    n_kv = 900
    q, k, v = make_qkv(rng, 1, 4, 2, 64, n_kv)
    pos = np.arange(n_kv, dtype=np.int32)
    mask = rng.random((1, n_kv)) < 0.6
    S = rng.random((1, n_kv)).astype(np.float32)
    S[0, ~mask[0]] = 1e9  # large sums of masked cells must not draw them in
    want = go.alisa_attn(q, k, v, mask, pos, 0.125, S, 0.125, kv_type="f32")
    k2, v2 = k.copy(), v.copy()
    k2[~mask[0]] = np.nan
    v2[~mask[0]] = np.nan
    y, w = go.alisa_attn(q, k2, v2, mask, pos, 0.125, S, 0.125, kv_type="f32")
    assert np.all(np.isfinite(y)) and np.array_equal(y, want[0]) and np.array_equal(w, want[1])
    assert not w[0, 0, ~mask[0]].any()


def test_bad_parameters_are_refused_before_ggml():
    rng = np.random.default_rng(0)
    q, k, v = make_qkv(rng, 1, 4, 2, 64, 100)
    pos = np.arange(100, dtype=np.int32)
    mask = np.ones((1, 100), bool)
    for c in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(SparqError, match="caching ratio"):
            go.alisa_attn(q, k, v, mask, pos, 0.125, np.zeros((1, 100)), c)
    with pytest.raises(SparqError, match="sums"):
        go.alisa_attn(q, k, v, mask, pos, 0.125, np.zeros((3, 100)), 0.25)
