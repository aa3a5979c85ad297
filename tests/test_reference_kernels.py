"""Numba reference attention vs an independent plain-numpy SparQ, plus the SPEC invariants."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from sparq_cpp.errors import SparqError
from sparq_cpp.reference.attention import DenseAttention, ExactTopKAttention, SparQAttention


# ---------------------------------------------------------------- independent plain-numpy SparQ

def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def sparq_numpy(q, k, v, mask, kv_pos, kq_scale, r, topk, l, mean_value):
    """docs/spec.md SparQ written from the text, loop by loop; returns (y, {(t, h): selected cells})."""
    q, k, v = q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)
    n_q, n_head, D = q.shape
    n_head_kv = k.shape[1]
    g = n_head // n_head_kv
    y = np.zeros((n_q, n_head, D))
    chosen = {}
    for t in range(n_q):
        P = [c for c in range(k.shape[0]) if mask[t, c]]
        if not P:
            continue
        for h in range(n_head_kv):
            group = list(range(h * g, (h + 1) * g))
            a = sum(np.abs(q[t, j]) for j in group)
            i1 = sorted(range(D), key=lambda d: (-a[d], d))[:r]
            s_hat = {}
            for j in group:
                tau = math.sqrt(D * np.abs(q[t, j, i1]).sum() / np.abs(q[t, j]).sum())
                scale = kq_scale * math.sqrt(D) / tau
                logits = np.array([scale * np.dot(q[t, j, i1], k[c, h, i1]) for c in P])
                s_hat[j] = dict(zip(P, _softmax(logits)))
            s_sum = {c: sum(s_hat[j][c] for j in group) for c in P}
            if len(P) <= topk:
                I = list(P)
            else:
                recent = sorted(P, key=lambda c: (kv_pos[c], c), reverse=True)
                rest = sorted(recent[l:], key=lambda c: (-s_sum[c], -kv_pos[c], -c))
                I = recent[:l] + rest[: topk - l]
            chosen[(t, h)] = sorted(I)
            v_mean = np.mean([v[c, h] for c in P], axis=0)
            for j in group:
                w = _softmax(np.array([kq_scale * np.dot(q[t, j], k[c, h]) for c in I]))
                y_top = sum(wi * v[c, h] for wi, c in zip(w, I))
                alpha = 1.0 if len(I) == len(P) else sum(s_hat[j][c] for c in I)
                y[t, j] = alpha * y_top + (1 - alpha) * v_mean if mean_value else y_top
    return y, chosen


def exact_topk_numpy(q, k, v, mask, kv_pos, kq_scale, topk, l, mean_value):
    """Exact top-k (SPEC Baselines), optionally with SparQ's mean-value reallocation, alpha = exact mass."""
    q, k, v = q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)
    n_q, n_head, D = q.shape
    g = n_head // k.shape[1]
    y = np.zeros((n_q, n_head, D))
    for t in range(n_q):
        P = np.flatnonzero(mask[t])
        for h in range(k.shape[1]):
            p = {j: _softmax(kq_scale * k[P, h] @ q[t, j]) for j in range(h * g, (h + 1) * g)}
            s_sum = sum(p.values())
            order = sorted(range(len(P)), key=lambda i: (kv_pos[P[i]], P[i]), reverse=True)
            rest = sorted(order[l:], key=lambda i: (-s_sum[i], -kv_pos[P[i]], -P[i]))
            sel = order[:l] + rest[: topk - l] if len(P) > topk else order
            for j, pj in p.items():
                w = _softmax(kq_scale * k[P[sel], h] @ q[t, j])
                y_top = w @ v[P[sel], h]
                alpha = pj[sel].sum() if len(sel) < len(P) else 1.0
                y[t, j] = alpha * y_top + (1 - alpha) * v[P, h].mean(0) if mean_value else y_top
    return y


# ---------------------------------------------------------------- inputs

def make_case(seed, D, g, n_kv, n_head_kv=2, n_seq=3, hole_frac=0.1, planted=False, n_q=4):
    """Cells of several sequences plus empty holes, in shuffled cell order; queries at the end of
    sequences and in the middle (causal). Returns q, k, v, mask, kv_pos, visible-by-any."""
    rng = np.random.default_rng(seed)
    n_head = g * n_head_kv
    seq = rng.integers(0, n_seq, size=n_kv)
    seq[rng.random(n_kv) < hole_frac] = -1
    kv_pos = np.zeros(n_kv, dtype=np.int32)
    for s in range(n_seq):
        idx = np.flatnonzero(seq == s)
        kv_pos[idx] = rng.permutation(len(idx))  # shuffled cell order within the sequence
    kv_pos[seq == -1] = rng.integers(0, 10 * n_kv, size=int((seq == -1).sum()))
    q = rng.standard_normal((n_q, n_head, D)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head_kv, D)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head_kv, D)).astype(np.float32)
    if planted:  # heavy-tailed q, a few keys strongly aligned with it
        q *= np.exp(1.5 * rng.standard_normal((n_q, n_head, D))).astype(np.float32)
        for t in range(n_q):
            for h in range(n_head_kv):
                hot = rng.choice(n_kv, size=5, replace=False)
                k[hot, h] += (3.0 * q[t, h * g] / np.linalg.norm(q[t, h * g]) * math.sqrt(D)).astype(np.float32)
    mask = np.zeros((n_q, n_kv), dtype=bool)
    for t in range(n_q):
        s = t % n_seq
        n_s = int((seq == s).sum())
        p = n_s - 1 if t < n_seq else int(rng.integers(0, max(n_s, 1)))
        mask[t] = (seq == s) & (kv_pos <= p)
    return q, k, v, mask, kv_pos


def check_against_numpy(q, k, v, mask, kv_pos, r, topk, l, mean_value, scale=None):
    D = q.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    attn = SparQAttention(r=r, k=topk, l=l, mean_value=mean_value)
    y = attn(q, k, v, mask, kv_pos, scale)
    y_ref, chosen = sparq_numpy(q, k, v, mask, kv_pos, scale, r, topk, l, mean_value)
    for (t, h), cells in chosen.items():
        got = attn.last_selection[t, h]
        assert got[got >= 0].tolist() == cells, (t, h)
    tol = 1e-5 * max(np.abs(y_ref).max(), 1e-30)
    assert np.abs(y - y_ref).max() <= tol
    return y


# ---------------------------------------------------------------- Numba vs numpy

FAST_GRID = [  # (D, g, n_kv, r, k, l, planted) chosen to touch every axis of the brief
    (64, 1, 300, 1, 1, 0, False), (64, 4, 300, 8, 20, 5, True), (128, 8, 200, 16, 32, 32, False),
    (128, 1, 500, 128, 50, 12, True), (64, 8, 150, 64, 400, 100, False), (128, 4, 2000, 16, 64, 16, True),
    (64, 4, 2000, 1, 128, 0, True), (128, 8, 1000, 8, 7, 1, False),
]


@pytest.mark.parametrize("D,g,n_kv,r,topk,l,planted", FAST_GRID)
@pytest.mark.parametrize("mean_value", [True, False])
def test_sparq_matches_numpy(D, g, n_kv, r, topk, l, planted, mean_value):
    case = make_case(D * 7 + g * 3 + n_kv + r, D, g, n_kv, planted=planted, n_q=3)
    check_against_numpy(*case, r, topk, l, mean_value)


@pytest.mark.slow
@pytest.mark.parametrize("D,g", list(itertools.product([64, 128], [1, 4, 8])))
def test_sparq_matches_numpy_sweep(D, g):
    for n_kv in (100, 3000):
        for planted in (False, True):
            case = make_case(D + g + n_kv, D, g, n_kv, planted=planted, n_q=4)
            n_max = int(case[3].sum(1).max())
            for r in (1, 8, 16, D):
                for topk in (1, 5, n_max // 3, n_max - 1, n_max, n_max + 7):
                    for l in sorted({0, topk // 4, topk}):
                        check_against_numpy(*case, r, max(topk, 1), min(l, max(topk, 1)), True)


def test_non_default_kq_scale():
    case = make_case(5, 64, 4, 400, planted=True)
    check_against_numpy(*case, 8, 16, 4, True, scale=0.3)


# ---------------------------------------------------------------- SPEC invariants

@pytest.mark.parametrize("D,g", [(64, 1), (128, 4), (64, 8)])
def test_selecting_everything_is_dense(D, g):
    q, k, v, mask, kv_pos = make_case(11 + D + g, D, g, 700, planted=True)
    dense = DenseAttention()(q, k, v, mask, kv_pos, 1 / math.sqrt(D))
    n_max = int(mask.sum(1).max())
    for attn in (SparQAttention(1, n_max), SparQAttention(D, n_max + 5, l=n_max), ExactTopKAttention(n_max)):
        y = attn(q, k, v, mask, kv_pos, 1 / math.sqrt(D))
        assert np.abs(y - dense).max() <= 1e-6 * np.abs(dense).max(), attn


def test_dense_matches_numpy():
    q, k, v, mask, kv_pos = make_case(3, 64, 4, 500)
    dense = DenseAttention()(q, k, v, mask, kv_pos, 0.125)
    for t in range(q.shape[0]):
        P = np.flatnonzero(mask[t])
        for j in range(q.shape[1]):
            w = _softmax(0.125 * k[P, j // 4].astype(np.float64) @ q[t, j])
            assert np.allclose(dense[t, j], w @ v[P, j // 4], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mean_value", [True, False])
def test_r_equal_d_is_exact_topk(mean_value):
    D = 64
    q, k, v, mask, kv_pos = make_case(21, D, 4, 600, planted=True)
    for topk, l in ((10, 0), (40, 10), (7, 7)):
        y = SparQAttention(D, topk, l=l, mean_value=mean_value)(q, k, v, mask, kv_pos, 1 / math.sqrt(D))
        ref = exact_topk_numpy(q, k, v, mask, kv_pos, 1 / math.sqrt(D), topk, l, mean_value)
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
        if not mean_value:
            yk = ExactTopKAttention(topk, l=l)(q, k, v, mask, kv_pos, 1 / math.sqrt(D))
            assert np.array_equal(yk, y)


@pytest.mark.parametrize("attn", [DenseAttention(), SparQAttention(8, 16), SparQAttention(1, 5, l=0),
                                  ExactTopKAttention(12, l=3), SparQAttention(16, 30, mean_value=False)])
def test_masked_cells_never_matter(attn):
    """Each row equals the same op on its visible cells alone (compacted, reshuffled), while every
    masked cell holds NaN, huge values and the most recent positions."""
    D = 64
    q, k, v, mask, kv_pos = make_case(31, D, 4, 800, planted=True, n_q=5)
    rng = np.random.default_rng(0)
    for t in range(q.shape[0]):
        kt, vt, post = k.copy(), v.copy(), kv_pos.copy()
        hidden = ~mask[t]
        kt[hidden] = np.nan
        vt[hidden] = 1e30
        kt[np.flatnonzero(hidden)[::2]] = 1e30
        post[hidden] = 10**6
        y = attn(q[t : t + 1], kt, vt, mask[t : t + 1], post, 0.125)
        assert np.isfinite(y).all()
        P = rng.permutation(np.flatnonzero(mask[t]))
        y_c = attn(q[t : t + 1], k[P], v[P], np.ones((1, len(P)), bool), kv_pos[P], 0.125)
        assert np.abs(y - y_c).max() <= 1e-6 * np.abs(y_c).max()


def test_ties_break_towards_recent_positions():
    # identical keys: every score ties, so the selection is the most recent positions
    n, D = 50, 16
    q = np.ones((1, 1, D), np.float32)
    k = np.ones((n, 1, D), np.float32)
    v = np.arange(n, dtype=np.float32)[:, None, None].repeat(D, 2)
    kv_pos = np.random.default_rng(1).permutation(n).astype(np.int32)
    attn = SparQAttention(4, 6, l=0, mean_value=False)
    y = attn(q, k, v, np.ones((1, n), bool), kv_pos, 0.25)
    sel = attn.last_selection[0, 0]
    assert sorted(kv_pos[sel].tolist()) == list(range(n - 6, n))
    assert np.allclose(y[0, 0], v[sel, 0, 0].mean())


def test_local_window_uses_positions_not_cells():
    n, D = 40, 16
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, D)).astype(np.float32)
    k = rng.standard_normal((n, 1, D)).astype(np.float32)
    v = rng.standard_normal((n, 1, D)).astype(np.float32)
    kv_pos = rng.permutation(n).astype(np.int32)
    attn = SparQAttention(D, 8, l=8)
    attn(q, k, v, np.ones((1, n), bool), kv_pos, 0.25)
    assert sorted(kv_pos[attn.last_selection[0, 0]].tolist()) == list(range(32, 40))


def test_row_without_visible_cells_is_zero():
    q, k, v, mask, kv_pos = make_case(4, 64, 1, 50)
    mask[1] = False
    for attn in (DenseAttention(), SparQAttention(4, 4)):
        y = attn(q, k, v, mask, kv_pos, 0.125)
        assert np.all(y[1] == 0) and np.isfinite(y).all()


def test_zero_query_gives_uniform_scores():
    q, k, v, mask, kv_pos = make_case(6, 64, 4, 300)
    q[0, :4] = 0.0  # the whole first group: s_hat is uniform, attention is a mean
    y = SparQAttention(8, 300)(q, k, v, mask, kv_pos, 0.125)
    assert np.isfinite(y).all()
    attn = SparQAttention(8, 10, l=0)
    y_sparse = attn(q, k, v, mask, kv_pos, 0.125)
    P, sel = np.flatnonzero(mask[0]), attn.last_selection[0, 0]
    alpha = len(sel) / len(P)  # uniform s_hat; exact attention over the selection is a plain mean
    expect = alpha * v[sel, 0].mean(0) + (1 - alpha) * v[P, 0].mean(0)
    assert np.allclose(y_sparse[0, 0], expect, atol=1e-5)


def test_bad_parameters():
    q, k, v, mask, kv_pos = make_case(0, 64, 2, 30)
    for kwargs, name in (({"r": 0, "k": 4}, "r"), ({"r": 8, "k": 0}, "k"), ({"r": 8, "k": 4, "l": 5}, "l"),
                         ({"r": 8, "k": 4, "l": -1}, "l"), ({"r": 2.5, "k": 4}, "r"), ({"r": 8, "k": True}, "k")):
        with pytest.raises(SparqError, match=rf"\b{name}\b"):
            SparQAttention(**kwargs)
    with pytest.raises(SparqError, match=r"\br = 65\b"):
        SparQAttention(65, 4)(q, k, v, mask, kv_pos, 0.125)
    with pytest.raises(SparqError, match=r"\bk\b"):
        ExactTopKAttention(0)
    with pytest.raises(SparqError, match="mask"):
        DenseAttention()(q, k, v, mask[:, :-1], kv_pos, 0.125)
    with pytest.raises(SparqError, match="n_head"):
        DenseAttention()(q[:, :3], k, v, mask, kv_pos, 0.125)
    with pytest.raises(SparqError, match="kv_pos"):
        SparQAttention(4, 4)(q, k, v, mask, kv_pos[:-1], 0.125)


def test_settings_refused_when_made_not_when_applied():
    from sparq_cpp import Loki, SparQ, SparqError

    for make, needle in ((lambda: SparQ(r=0), "r must be >= 1"), (lambda: SparQ(k=0), "k must be >= 1"),
                         (lambda: Loki(d=0), "d must be >= 1"), (lambda: Loki(k=-1), "k must be >= 1")):
        with pytest.raises(SparqError, match=needle):
            make()
