"""Pluggable reference attention: ``attn(q, k, v, mask, kv_pos, kq_scale, layer) -> y``.

- q: float32 [n_q, n_head, D]; k, v: float32 [n_kv, n_head_kv, D], the cache contents as stored;
- mask: bool [n_q, n_kv], True = visible (same sequence, causal, inside any window);
- kv_pos: int32 [n_kv], token position of each cache cell (cell order is not position order);
- kq_scale: float, the model's score scale; layer: int (for per-layer state such as Loki's basis).
Returns float32 [n_q, n_head, D]. Query head j uses KV head j // (n_head // n_head_kv).

The arithmetic lives in Numba kernels (kernels.py); these classes validate and dispatch.
"""

from __future__ import annotations

import numpy as np

from sparq_cpp.errors import SparqError
from sparq_cpp.reference import kernels


def check_inputs(q, k, v, mask, kv_pos):
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise SparqError(f"q, k, v must be 3-d, got {q.shape}, {k.shape}, {v.shape}")
    n_q, n_head, D = q.shape
    n_kv, n_head_kv, Dk = k.shape
    if v.shape != k.shape:
        raise SparqError(f"v shape {v.shape} differs from k shape {k.shape}")
    if Dk != D:
        raise SparqError(f"head size of q ({D}) and k ({Dk}) differ")
    if n_head_kv < 1 or n_head % n_head_kv:
        raise SparqError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
    if mask.shape != (n_q, n_kv):
        raise SparqError(f"mask shape {mask.shape}, expected {(n_q, n_kv)}")
    if kv_pos.shape != (n_kv,):
        raise SparqError(f"kv_pos shape {kv_pos.shape}, expected {(n_kv,)}")
    return (np.ascontiguousarray(q, dtype=np.float32), np.ascontiguousarray(k, dtype=np.float32),
            np.ascontiguousarray(v, dtype=np.float32), np.ascontiguousarray(mask, dtype=np.bool_),
            np.ascontiguousarray(kv_pos, dtype=np.int32))


class DenseAttention:
    """SPEC "Dense attention": softmax(kq_scale * q . K[P]^T) . V[P]; a row with no visible cell gives 0."""

    name = "dense"

    def __call__(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        q, k, v, mask, kv_pos = check_inputs(q, k, v, mask, kv_pos)
        out = np.empty(q.shape, dtype=np.float32)
        kernels.dense_attention_kernel(q, k, v, mask, float(kq_scale), out)
        return out

    def __repr__(self):
        return "DenseAttention()"


def check_int(name, value, lo, hi=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SparqError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise SparqError(f"{name} = {value} is out of range ({rng})")
    return int(value)


class SparQAttention:
    """SPEC "SparQ": group-shared top-r components, approximate scores, top-k positions with the
    l most recent and the positions below ``sink`` forced in, exact attention over them, optional
    mean-value reallocation.

    ``last_selection`` holds the cells chosen on the last call: int32 [n_q, n_head_kv, min(k, n_kv)],
    ascending per row, padded with -1 (for comparing selections with the C/CUDA ops).
    """

    name = "sparq"

    def __init__(self, r, k, l=None, mean_value=True, sink=0):
        self.r = check_int("r", r, 1)
        self.k = check_int("k", k, 1)
        self.l = self.k // 4 if l is None else check_int("l", l, 0, self.k)
        self.sink = check_int("sink", sink, 0, self.k - self.l)
        self.mean_value = bool(mean_value)
        self.last_selection = None

    def _r_for(self, D):
        if self.r > D:
            raise SparqError(f"r = {self.r} is out of range (1..{D}, the head size)")
        return self.r

    def __call__(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        q, k, v, mask, kv_pos = check_inputs(q, k, v, mask, kv_pos)
        r = self._r_for(q.shape[2])
        out = np.empty(q.shape, dtype=np.float32)
        sel = np.empty((q.shape[0], k.shape[1], min(self.k, k.shape[0])), dtype=np.int32)
        kernels.sparq_kernel(q, k, v, mask, kv_pos, float(kq_scale), r, self.k, self.l, self.sink,
                             self.mean_value, out, sel)
        self.last_selection = sel
        return out

    def __repr__(self):
        sink = f", sink={self.sink}" if self.sink else ""
        return f"SparQAttention(r={self.r}, k={self.k}, l={self.l}{sink}, mean_value={self.mean_value})"


class ExactTopKAttention(SparQAttention):
    """SPEC "Baselines", exact top-k: exact softmax scores over all visible cells, summed over the
    GQA group, keep the top k (optionally the l most recent forced in), exact attention over them.
    It is SparQ with r = D (then tau = sqrt(D), so s_hat is the exact softmax) and no mean value."""

    name = "exact-topk"

    def __init__(self, k, l=0):
        super().__init__(r=1, k=k, l=l, mean_value=False)

    def _r_for(self, D):
        return D

    def __repr__(self):
        return f"ExactTopKAttention(k={self.k}, l={self.l})"
