"""Loki reference attention (docs/spec.md "Loki"), in attention.py's interface:
``attn(q, k, v, mask, kv_pos, kq_scale, layer) -> y``.

q and k arrive as the model makes them (post-RoPE, unrotated); both are rotated by the layer's
per-KV-head basis P (q'_j = q_j P_h, k' = k P_h, P from calibration, columns sorted by explained
variance). Ranking uses the first d rotated components with the model's own kq_scale; selection
(group-summed scores, l most recent forced in, ties to the more recent) and the exact attention are
SparQ's, from kernels.py, so the two references cannot drift apart. There is no mean-value term.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from sparq_cpp.errors import SparqError
from sparq_cpp.reference.attention import check_inputs, check_int
from sparq_cpp.reference.kernels import exact_attend, select_positions


@numba.njit(cache=True, parallel=True)
def loki_kernel(qr, kr, v, mask, kv_pos, kq_scale, d, topk, local, sink, out, sel_out):
    """SPEC Loki on rotated qr [n_q, n_head, D], kr [n_kv, n_head_kv, D] for every (query row, KV head).

    sel_out [n_q, n_head_kv, min(topk, n_kv)] receives the selected cells ascending, padded with -1."""
    n_q, n_head, D = qr.shape
    n_head_kv = kr.shape[1]
    g = n_head // n_head_kv
    for it in prange(n_q * n_head_kv):
        t = it // n_head_kv
        h = it % n_head_kv
        sel_out[t, h, :] = -1
        cells = np.nonzero(mask[t])[0]
        n = cells.shape[0]
        if n == 0:
            for jj in range(g):
                out[t, h * g + jj, :] = 0.0
            continue

        if n <= topk:
            chosen = np.arange(n)
        else:
            # approximate scores from the first d components, summed over the group's softmaxes
            s_sum = np.zeros(n)
            s = np.empty(n)
            for jj in range(g):
                qj = qr[t, h * g + jj]
                m = -np.inf
                for p in range(n):
                    acc = 0.0
                    for c in range(d):
                        acc += np.float64(qj[c]) * np.float64(kr[cells[p], h, c])
                    s[p] = kq_scale * acc
                    if s[p] > m:
                        m = s[p]
                total = 0.0
                for p in range(n):
                    s[p] = np.exp(s[p] - m)
                    total += s[p]
                for p in range(n):
                    s_sum[p] += s[p] / total
            chosen = select_positions(cells, kv_pos, s_sum, topk, local, sink)
        sel_cells = cells[chosen]
        for p in range(sel_cells.shape[0]):
            sel_out[t, h, p] = sel_cells[p]

        y = np.empty(D)
        for jj in range(g):
            j = h * g + jj
            exact_attend(qr[t, j], kr, v, h, sel_cells, kq_scale, y)  # q'.k'^T == q.k^T (P orthonormal)
            for c in range(D):
                out[t, j, c] = y[c]


def _as_bases(projections) -> list:
    """Per layer, P float64 [n_head_kv, D, D], from a LokiProjection, an array [n_layer, n_head_kv, D, D]
    or a sequence of per-layer arrays."""
    P = getattr(projections, "P", projections)
    layers = [np.asarray(p, np.float64) for p in P]
    if not layers:
        raise SparqError("projections: no layers")
    for il, p in enumerate(layers):
        if p.ndim != 3 or p.shape[1] != p.shape[2] or p.shape != layers[0].shape:
            raise SparqError(f"projections: layer {il} has shape {p.shape}, expected [n_head_kv, D, D] "
                             f"like layer 0 {layers[0].shape}")
    return layers


class LokiAttention:
    """SPEC "Loki" with parameters d (1..D), k (>= 1), l (0..k, default 0), sink (0..k - l, default 0).

    ``projections``: the bases P (not P^T) per layer: ``read_projection(...)``'s result, an array
    [n_layer, n_head_kv, D, D] or a list of [n_head_kv, D, D]. ``last_selection`` is as SparQAttention's.
    """

    name = "loki"

    def __init__(self, projections, d, k, l=0, sink=0):
        self.P = _as_bases(projections)
        self.D = self.P[0].shape[-1]
        self.d = check_int("d", d, 1, self.D)
        self.k = check_int("k", k, 1)
        self.l = check_int("l", l, 0, self.k)
        self.sink = check_int("sink", sink, 0, self.k - self.l)
        self.last_selection = None

    def rotate(self, q, k, layer):
        """(q', k'): q [n_q, n_head, D] and k [n_kv, n_head_kv, D] in the layer's basis, float32."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < len(self.P):
            raise SparqError(f"layer {layer!r} is out of range (0..{len(self.P) - 1}, the projection's layers)")
        P = self.P[layer]
        n_head, n_head_kv = q.shape[1], k.shape[1]
        if P.shape[0] != n_head_kv or P.shape[-1] != k.shape[2]:
            raise SparqError(f"the projection of layer {layer} is for n_head_kv={P.shape[0]}, D={P.shape[-1]}; "
                             f"got keys with n_head_kv={n_head_kv}, D={k.shape[2]}")
        Pq = np.repeat(P, n_head // n_head_kv, axis=0)  # query head j uses KV head j // g
        qr = np.einsum("thi,hij->thj", q.astype(np.float64), Pq).astype(np.float32)
        kr = np.einsum("nhi,hij->nhj", k.astype(np.float64), P).astype(np.float32)
        return qr, kr

    def __call__(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        q, k, v, mask, kv_pos = check_inputs(q, k, v, mask, kv_pos)
        qr, kr = self.rotate(q, k, layer)
        out = np.empty(q.shape, dtype=np.float32)
        sel = np.empty((q.shape[0], k.shape[1], min(self.k, k.shape[0])), dtype=np.int32)
        loki_kernel(qr, kr, v, mask, kv_pos, float(kq_scale), self.d, self.k, self.l, self.sink, out, sel)
        self.last_selection = sel
        return out

    def __repr__(self):
        sink = f", sink={self.sink}" if self.sink else ""
        return f"LokiAttention(d={self.d}, k={self.k}, l={self.l}{sink}, layers={len(self.P)}, D={self.D})"
