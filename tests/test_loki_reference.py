"""LokiAttention (SPEC "Loki") against a plain-numpy loop, dense attention and exact top-k."""
from __future__ import annotations

import numpy as np
import pytest

from sparq_cpp.errors import SparqError
from sparq_cpp.reference.attention import DenseAttention, ExactTopKAttention
from sparq_cpp.reference.loki import LokiAttention


def orthonormal(rng, n_layer, n_head_kv, D):
    """Random orthonormal bases P [n_layer, n_head_kv, D, D] (QR of Gaussians)."""
    q, _ = np.linalg.qr(rng.standard_normal((n_layer, n_head_kv, D, D)))
    return q


def case(rng, n_q=3, n_kv=40, n_head=4, n_head_kv=2, D=16, n_layer=2):
    """Random q, k, v; a causal-ish mask with holes; kv_pos a permutation (cell order != position order)."""
    q = rng.standard_normal((n_q, n_head, D)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head_kv, D)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head_kv, D)).astype(np.float32)
    kv_pos = rng.permutation(n_kv).astype(np.int32)
    mask = np.zeros((n_q, n_kv), bool)
    for t in range(n_q):
        mask[t] = (kv_pos <= n_kv - n_q + t) & (rng.random(n_kv) > 0.1)
    return q, k, v, mask, kv_pos, orthonormal(rng, n_layer, n_head_kv, D)


def loki_loop(q, k, v, mask, kv_pos, kq_scale, P, d, topk, l):
    """SPEC "Loki" written out plainly: returns (y, selected cells per (t, h) as sorted lists)."""
    n_q, n_head, D = q.shape
    n_head_kv = k.shape[1]
    g = n_head // n_head_kv
    y = np.zeros(q.shape)
    sel = {}
    for t in range(n_q):
        cells = list(np.nonzero(mask[t])[0])
        for h in range(n_head_kv):
            if not cells:
                sel[t, h] = []
                continue
            kr = k[cells, h].astype(np.float64) @ P[h]
            if len(cells) <= topk:
                chosen = cells
            else:
                s_sum = np.zeros(len(cells))
                for j in range(h * g, (h + 1) * g):
                    qr = q[t, j].astype(np.float64) @ P[h]
                    s = kq_scale * (kr[:, :d] @ qr[:d])
                    e = np.exp(s - s.max())
                    s_sum += e / e.sum()
                # recency: larger position first, then larger cell index
                by_recency = sorted(range(len(cells)), key=lambda p: (-kv_pos[cells[p]], -cells[p]))
                forced, rest = by_recency[:l], by_recency[l:]
                rank = {p: r for r, p in enumerate(by_recency)}
                best = sorted(rest, key=lambda p: (-s_sum[p], rank[p]))[: topk - l]
                chosen = [cells[p] for p in forced + best]
            chosen = sorted(chosen)
            sel[t, h] = chosen
            for j in range(h * g, (h + 1) * g):  # exact attention, in the original basis
                s = kq_scale * (k[chosen, h].astype(np.float64) @ q[t, j].astype(np.float64))
                w = np.exp(s - s.max())
                y[t, j] = (w / w.sum()) @ v[chosen, h].astype(np.float64)
    return y, sel


def assert_matches_loop(attn, P, args, kq_scale, layer):
    q, k, v, mask, kv_pos = args
    y = attn(q, k, v, mask, kv_pos, kq_scale, layer)
    y_ref, sel_ref = loki_loop(q, k, v, mask, kv_pos, kq_scale, P[layer], attn.d, attn.k, attn.l)
    scale = max(np.abs(y_ref).max(), 1e-30)
    assert np.abs(y - y_ref).max() <= 1e-5 * scale
    for (t, h), cells in sel_ref.items():
        got = [c for c in attn.last_selection[t, h] if c >= 0]
        assert got == cells, (t, h)
    return y


@pytest.mark.parametrize("n_head,n_head_kv", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("d,k,l", [(4, 8, 0), (1, 5, 2), (16, 12, 3), (8, 100, 0)])
def test_matches_loop_random(n_head, n_head_kv, d, k, l):
    rng = np.random.default_rng(n_head * 100 + n_head_kv * 10 + d + k + l)
    q, k_, v, mask, kv_pos, P = case(rng, n_head=n_head, n_head_kv=n_head_kv)
    attn = LokiAttention(P, d=d, k=k, l=l)
    for layer in (0, 1):
        assert_matches_loop(attn, P, (q, k_, v, mask, kv_pos), 0.25, layer)


def test_matches_loop_planted():
    """A few keys aligned with the queries along the top components must be found and selected."""
    rng = np.random.default_rng(7)
    q, k, v, mask, kv_pos, P = case(rng, n_q=2, n_kv=64, n_head=4, n_head_kv=2, D=16)
    mask[:] = True
    planted = [5, 17, 40]
    for h in range(2):
        qdir = (q[0, 2 * h] + q[0, 2 * h + 1]).astype(np.float64) @ P[0, h]
        for c in planted:
            kr = np.zeros(16)
            kr[:4] = 4 * qdir[:4] / np.linalg.norm(qdir[:4])
            k[c, h] = (kr @ P[0, h].T).astype(np.float32)  # back to the original basis
    attn = LokiAttention(P, d=4, k=6, l=0)
    assert_matches_loop(attn, P, (q, k, v, mask, kv_pos), 1.0, 0)
    for h in range(2):
        assert set(planted) <= set(attn.last_selection[0, h].tolist())


def test_ties_go_to_the_more_recent_position():
    rng = np.random.default_rng(3)
    q, k, v, mask, kv_pos, P = case(rng, n_q=1, n_kv=30, n_head=2, n_head_kv=1, D=8, n_layer=1)
    k[:] = k[0]  # every key equal: every approximate score ties
    mask[:] = True
    attn = LokiAttention(P, d=3, k=7, l=2)
    assert_matches_loop(attn, P, (q, k, v, mask, kv_pos), 0.5, 0)
    newest = sorted(np.argsort(-kv_pos, kind="stable")[:7].tolist())
    assert attn.last_selection[0, 0].tolist() == newest


def test_full_d_and_k_is_dense():
    rng = np.random.default_rng(11)
    q, k, v, mask, kv_pos, P = case(rng, n_kv=33, n_head=4, n_head_kv=2, D=16)
    y = LokiAttention(P, d=16, k=33)(q, k, v, mask, kv_pos, 0.25, 1)
    y_dense = DenseAttention()(q, k, v, mask, kv_pos, 0.25)
    assert np.abs(y - y_dense).max() <= 1e-5 * np.abs(y_dense).max()


def test_full_d_is_exact_topk():
    """With d = D the approximate scores are the exact ones (P orthonormal): SPEC's exact top-k."""
    rng = np.random.default_rng(12)
    q, k, v, mask, kv_pos, P = case(rng, n_kv=50, n_head=4, n_head_kv=2, D=16)
    loki = LokiAttention(P, d=16, k=9, l=2)
    exact = ExactTopKAttention(k=9, l=2)
    y = loki(q, k, v, mask, kv_pos, 0.25, 0)
    y_exact = exact(q, k, v, mask, kv_pos, 0.25)
    assert np.array_equal(loki.last_selection, exact.last_selection)
    assert np.abs(y - y_exact).max() <= 1e-5 * np.abs(y_exact).max()


def test_rotated_cache_gives_the_same_dense_attention():
    rng = np.random.default_rng(13)
    q, k, v, mask, kv_pos, P = case(rng, n_kv=40, n_head=4, n_head_kv=2, D=16)
    attn = LokiAttention(P, d=4, k=8)
    qr, kr = attn.rotate(q, k, 1)
    dense = DenseAttention()
    y, y_rot = dense(q, k, v, mask, kv_pos, 0.25), dense(qr, kr, v, mask, kv_pos, 0.25)
    assert np.abs(y - y_rot).max() <= 1e-5 * np.abs(y).max()


def test_accepts_a_projection_object():
    class Proj:  # what read_projection returns, as far as LokiAttention cares
        P = orthonormal(np.random.default_rng(0), 2, 2, 16).astype(np.float32)

    assert LokiAttention(Proj(), d=4, k=8).D == 16


@pytest.mark.parametrize("kwargs,needle", [
    (dict(d=0, k=8), "d = 0"), (dict(d=17, k=8), "d = 17"), (dict(d=4, k=0), "k = 0"),
    (dict(d=4, k=8, l=9), "l = 9"), (dict(d=4.0, k=8), "d must be an integer"),
])
def test_bad_parameters(kwargs, needle):
    P = orthonormal(np.random.default_rng(0), 1, 2, 16)
    with pytest.raises(SparqError, match=needle):
        LokiAttention(P, **kwargs)


def test_bad_layer_and_geometry():
    rng = np.random.default_rng(1)
    q, k, v, mask, kv_pos, P = case(rng, n_head=4, n_head_kv=2, D=16, n_layer=2)
    attn = LokiAttention(P, d=4, k=8)
    with pytest.raises(SparqError, match="layer 2"):
        attn(q, k, v, mask, kv_pos, 0.25, 2)
    q4, k4, v4, mask4, pos4, _ = case(rng, n_head=4, n_head_kv=4, D=16)
    with pytest.raises(SparqError, match="n_head_kv=2"):
        attn(q4, k4, v4, mask4, pos4, 0.25, 0)
    with pytest.raises(SparqError, match="projections"):
        LokiAttention(np.zeros((2, 2, 16, 8)), d=4, k=8)
