"""Numba kernels for the reference attention (the oracle for the C/CUDA ops; see docs/spec.md).

Written for obviousness, not speed: one (query row, head or KV head) per parallel iteration,
float64 accumulation, only cells with ``mask[t, c]`` True are ever read.

Shapes: q [n_q, n_head, D]; k, v [n_kv, n_head_kv, D]; mask bool [n_q, n_kv]; kv_pos int32 [n_kv];
out float32 [n_q, n_head, D]. Query head j belongs to KV head j // (n_head // n_head_kv).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange


@numba.njit(cache=True)
def exact_attend(q, k, v, h, cells, kq_scale, y):
    """y[:] = softmax(kq_scale * q . K[cells, h]^T) . V[cells, h]  (float64 y, q one query head)."""
    n = cells.shape[0]
    D = q.shape[0]
    s = np.empty(n)
    m = -np.inf
    for p in range(n):
        acc = 0.0
        for d in range(D):
            acc += np.float64(q[d]) * np.float64(k[cells[p], h, d])
        s[p] = kq_scale * acc
        if s[p] > m:
            m = s[p]
    total = 0.0
    for p in range(n):
        s[p] = np.exp(s[p] - m)
        total += s[p]
    y[:] = 0.0
    for p in range(n):
        w = s[p] / total
        for d in range(D):
            y[d] += w * np.float64(v[cells[p], h, d])


@numba.njit(cache=True, parallel=True)
def dense_attention_kernel(q, k, v, mask, kq_scale, out):
    n_q, n_head, D = q.shape
    n_head_kv = k.shape[1]
    g = n_head // n_head_kv
    for it in prange(n_q * n_head):
        t = it // n_head
        j = it % n_head
        cells = np.nonzero(mask[t])[0]
        if cells.shape[0] == 0:  # nothing visible: defined as zero output
            out[t, j, :] = 0.0
            continue
        y = np.empty(D)
        exact_attend(q[t, j], k, v, j // g, cells, kq_scale, y)
        for d in range(D):
            out[t, j, d] = y[d]


@numba.njit(cache=True)
def recency_order(cells, kv_pos):
    """Visible-cell indices (into ``cells``) from most to least recent token position.

    Equal positions (only possible across sequences) fall back to the larger cell index first."""
    pos = np.empty(cells.shape[0], dtype=np.int64)
    for p in range(cells.shape[0]):
        pos[p] = kv_pos[cells[p]]
    asc = np.argsort(pos, kind="mergesort")  # stable: equal positions stay in cell order
    return asc[::-1].copy()


@numba.njit(cache=True)
def select_positions(cells, kv_pos, s_sum, topk, local, sink):
    """SPEC step 3 (indices into ``cells``, ascending): the ``local`` most recent, then the top (topk - local) of the
    others by s_sum, positions below ``sink`` ranked above every score, equal keys to the more recent position."""
    rec = recency_order(cells, kv_pos)
    rest = rec[local:]  # most recent first, so a stable sort breaks ties towards recency
    key = np.empty(rest.shape[0])
    for p in range(rest.shape[0]):
        key[p] = -np.inf if kv_pos[cells[rest[p]]] < sink else -s_sum[rest[p]]
    best = rest[np.argsort(key, kind="mergesort")[: topk - local]]
    return np.sort(np.concatenate((rec[:local], best)))


@numba.njit(cache=True, parallel=True)
def sparq_kernel(q, k, v, mask, kv_pos, kq_scale, r, topk, local, sink, mean_value, out, sel_out):
    """docs/spec.md SparQ steps 1-5 for every (query row, KV head).

    r = D with mean_value=False is exact top-k (SPEC "Baselines"). sel_out [n_q, n_head_kv, w]
    (w = min(topk, n_kv)) receives the selected cells in ascending cell order, padded with -1.
    """
    n_q, n_head, D = q.shape
    n_head_kv = k.shape[1]
    g = n_head // n_head_kv
    sqrt_d = np.sqrt(np.float64(D))
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

        # 1. components: top-r of the group's summed |q|; ties go to the lower component index
        a = np.zeros(D)
        for jj in range(g):
            for d in range(D):
                a[d] += abs(np.float64(q[t, h * g + jj, d]))
        i1 = np.argsort(-a, kind="mergesort")[:r]

        # 2. approximate scores per query head, softmax over the visible cells only
        s_hat = np.empty((g, n))
        for jj in range(g):
            qj = q[t, h * g + jj]
            l1_all = 0.0
            for d in range(D):
                l1_all += abs(np.float64(qj[d]))
            l1_sel = 0.0
            for c in i1:
                l1_sel += abs(np.float64(qj[c]))
            # scale = kq_scale * sqrt(D) / tau, tau = sqrt(D * l1_sel / l1_all); q_j = 0 -> uniform
            scale = 0.0 if l1_sel == 0.0 else kq_scale * sqrt_d / np.sqrt(D * l1_sel / l1_all)
            m = -np.inf
            for p in range(n):
                acc = 0.0
                for c in i1:
                    acc += np.float64(qj[c]) * np.float64(k[cells[p], h, c])
                s_hat[jj, p] = scale * acc
                if s_hat[jj, p] > m:
                    m = s_hat[jj, p]
            total = 0.0
            for p in range(n):
                s_hat[jj, p] = np.exp(s_hat[jj, p] - m)
                total += s_hat[jj, p]
            for p in range(n):
                s_hat[jj, p] /= total

        # 3. position selection shared by the group (indices into `cells`)
        all_selected = n <= topk
        if all_selected:
            chosen = np.arange(n)
        else:
            s_sum = np.zeros(n)
            for jj in range(g):
                for p in range(n):
                    s_sum[p] += s_hat[jj, p]
            chosen = select_positions(cells, kv_pos, s_sum, topk, local, sink)
        sel_cells = cells[chosen]
        for p in range(sel_cells.shape[0]):
            sel_out[t, h, p] = sel_cells[p]

        # v_mean over every visible cell of this sequence (not just the selected ones)
        v_mean = np.zeros(D)
        if mean_value and not all_selected:
            for p in range(n):
                for d in range(D):
                    v_mean[d] += np.float64(v[cells[p], h, d])
            for d in range(D):
                v_mean[d] /= n

        # 4-5. exact attention over the selection, then mean-value reallocation
        y = np.empty(D)
        for jj in range(g):
            j = h * g + jj
            exact_attend(q[t, j], k, v, h, sel_cells, kq_scale, y)
            if mean_value and not all_selected:
                alpha = 0.0
                for p in chosen:
                    alpha += s_hat[jj, p]
                for d in range(D):
                    y[d] = alpha * y[d] + (1.0 - alpha) * v_mean[d]
            for d in range(D):
                out[t, j, d] = y[d]
