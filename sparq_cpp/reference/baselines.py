"""Evaluation baselines of docs/spec.md ("Baselines used in evaluation", the SparQ paper's Appendix G) in
reference/attention.py's interface ``attn(q, k, v, mask, kv_pos, kq_scale, layer) -> y``, plus the
compression ratio of any reference attention from docs/spec.md's transfer formulas.

Budget convention, shared with SparQ here: ``k`` counts every position a query attends to, the
query's own (just stored) position included, so a step reads ``2*k*D`` cached elements as SPEC's
formulas say. (The paper's H2O code keeps ``k + 1``, calling the current token "free".)

- LMInfiniteAttention: the first ``n_first`` (16) visible positions plus the ``k - n_first`` most
  recent. Stateless.
- H2OAttention (Zhang et al., 2023; the SparQ paper's fixed-budget variant): each KV head keeps
  the ``l`` (default ``k/4``) most recent live positions plus the ``k - l`` live ones with the
  largest accumulated attention score; everything else is evicted for good. The score of a position
  is the sum, over every query row that attended to it since ``reset()`` and over the query heads
  of the KV head's GQA group, of its exact softmax weight (the paper's code averages over the group:
  the same ranking). Ties go to the more recent position, as in SparQ.
  Prompt handling follows the paper's code: the prompt is attended densely (nothing is evicted
  while it is processed, as llama.cpp keeps a prompt dense) but its attention weights are
  accumulated, so the first decode step evicts the prompt down to ``k`` by those scores. Call
  ``prompt_call`` for prompt batches (``DensePrompt`` does), ``__call__`` for decode rows; several
  rows in one ``__call__`` are processed in row order, each evicting before it attends, so a batch
  of teacher-forced tokens equals decoding them one at a time. State is per layer and KV head and
  indexed by cache cell: one sequence whose cache only grows, until ``reset()``. (Scores only grow,
  so a later decode step could not rank an evicted cell back in anyway; the eviction record keeps
  dead cells out of later dense batches too.)
- SWAAttention: ALISA's Sparse Window Attention is in reference/alisa.py; ``RecordPrompt`` lets it record
  a prompt beside H2O's in one dense prefill.
- ExactTopKAttention (FlexGen-style exact top-k) is reference/attention.py's, unchanged.
- DensePrompt(method): prompt batches dense (or the method's own ``prompt_call``), later calls
  by the method: how the evaluation runs every sparse method, matching llama.cpp's default of dense
  prompt batches and sparse decode.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from sparq_cpp import transfer
from sparq_cpp.errors import SparqError
from sparq_cpp.reference.attention import DenseAttention, check_inputs, check_int
from sparq_cpp.reference.kernels import exact_attend, recency_order

LM_INFINITE_FIRST = 16  # the paper's "first 16 tokens"


@numba.njit(cache=True, parallel=True)
def lm_infinite_kernel(q, k, v, mask, kv_pos, kq_scale, topk, n_first, out, sel_out):
    """First n_first + most recent (topk - n_first) visible cells per query row (shared by all heads)."""
    n_q, n_head, D = q.shape
    n_head_kv = k.shape[1]
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
            rec = recency_order(cells, kv_pos)  # most recent first
            chosen = np.sort(np.concatenate((rec[n - n_first:], rec[: topk - n_first])))
        sel_cells = cells[chosen]
        for p in range(sel_cells.shape[0]):
            sel_out[t, h, p] = sel_cells[p]
        y = np.empty(D)
        for jj in range(g):
            exact_attend(q[t, h * g + jj], k, v, h, sel_cells, kq_scale, y)
            for c in range(D):
                out[t, h * g + jj, c] = y[c]


@numba.njit(cache=True, parallel=True)
def h2o_kernel(q, k, v, mask, kv_pos, kq_scale, topk, local, evict, score, alive, out, sel_out):
    """H2O over the rows of q in order, KV heads in parallel; score/alive [n_kv, n_head_kv] are the
    layer's state, updated in place. evict=False (prompt) attends to every live visible cell."""
    n_q, n_head, D = q.shape
    n_head_kv = k.shape[1]
    g = n_head // n_head_kv
    for h in prange(n_head_kv):
        w = np.empty(k.shape[0])
        for t in range(n_q):  # in order: each row sees the evictions of the rows before it
            sel_out[t, h, :] = -1
            n = 0
            for c in range(k.shape[0]):
                if mask[t, c] and alive[c, h]:
                    n += 1
            cells = np.empty(n, dtype=np.int64)
            n = 0
            for c in range(k.shape[0]):
                if mask[t, c] and alive[c, h]:
                    cells[n] = c
                    n += 1
            if n == 0:
                for jj in range(g):
                    out[t, h * g + jj, :] = 0.0
                continue
            if evict and n > topk:
                rec = recency_order(cells, kv_pos)
                rest = rec[local:]  # most recent first, so a stable sort breaks ties towards recency
                key = np.empty(rest.shape[0])
                for p in range(rest.shape[0]):
                    key[p] = -score[cells[rest[p]], h]
                order = np.argsort(key, kind="mergesort")
                for p in order[topk - local:]:
                    alive[cells[rest[p]], h] = False  # gone for good
                cells = np.sort(np.concatenate((cells[rec[:local]], cells[rest[order[: topk - local]]])))
                n = cells.shape[0]
            for p in range(min(n, sel_out.shape[2])):
                sel_out[t, h, p] = cells[p]
            y = np.empty(D)
            for jj in range(g):
                j = h * g + jj
                exact_attend(q[t, j], k, v, h, cells, kq_scale, y)
                for c in range(D):
                    out[t, j, c] = y[c]
                # the softmax weights once more, to accumulate them (same arithmetic as exact_attend)
                m = -np.inf
                for p in range(n):
                    acc = 0.0
                    for c in range(D):
                        acc += np.float64(q[t, j, c]) * np.float64(k[cells[p], h, c])
                    w[p] = kq_scale * acc
                    if w[p] > m:
                        m = w[p]
                total = 0.0
                for p in range(n):
                    w[p] = np.exp(w[p] - m)
                    total += w[p]
                for p in range(n):
                    score[cells[p], h] += w[p] / total


PROMPT_BLOCK = 256  # query rows per block of the blocked prompt path


def h2o_prompt_blocked(q, k, v, mask, kq_scale, score, alive, out, sel_out, block=PROMPT_BLOCK):
    """What ``h2o_kernel`` computes with evict=False (prompt rows: every live visible cell, weights
    accumulated into ``score``), as float64 matrix products over blocks of query rows and a KV head's
    whole GQA group at once: the prompt of an 8k-token sample in minutes instead of the per-row loop's
    hours. Same arithmetic up to float64 summation order (tests/test_baselines.py compares the two)."""
    n_q, n_head, D = q.shape
    n_kv, n_head_kv = k.shape[0], k.shape[1]
    g = n_head // n_head_kv
    sel_out[:] = -1
    for h in range(n_head_kv):
        vis_h = mask & alive[:, h][None, :]
        rows, cols = np.nonzero(vis_h)  # row-major: each row's cells ascending
        slot = np.cumsum(vis_h, axis=1)[rows, cols] - 1
        sel_out[rows, h, slot] = cols
        for t0 in range(0, n_q, block):
            t1 = min(n_q, t0 + block)
            vis = vis_h[t0:t1]
            seen = vis.any(axis=0)
            if not seen.any():
                out[t0:t1, h * g:(h + 1) * g, :] = 0.0
                continue
            c_lo = int(np.argmax(seen))
            c_hi = n_kv - int(np.argmax(seen[::-1]))
            vis = vis[:, c_lo:c_hi]
            kh = k[c_lo:c_hi, h, :].astype(np.float64)
            vh = v[c_lo:c_hi, h, :].astype(np.float64)
            qg = q[t0:t1, h * g:(h + 1) * g, :].astype(np.float64).reshape((t1 - t0) * g, D)
            s = (qg @ kh.T).reshape(t1 - t0, g, c_hi - c_lo)
            s *= kq_scale
            np.copyto(s, -np.inf, where=~vis[:, None, :])
            m = s.max(axis=2, keepdims=True)
            empty = ~np.isfinite(m)  # a row with no live visible cell: output 0, no weights
            m[empty] = 0.0
            s -= m
            np.exp(s, out=s)
            total = s.sum(axis=2, keepdims=True)
            total[empty] = 1.0
            s /= total
            out[t0:t1, h * g:(h + 1) * g, :] = (s.reshape((t1 - t0) * g, c_hi - c_lo) @ vh).reshape(t1 - t0, g, D)
            score[c_lo:c_hi, h] += s.sum(axis=(0, 1))


class LMInfiniteAttention:
    """SPEC "Baselines", LM-Infinite / StreamingLLM: the first ``n_first`` visible positions (by
    token position) plus the ``k - n_first`` most recent; every position when ``n <= k``.
    ``last_selection`` is as SparQAttention's."""

    name = "lm-infinite"

    def __init__(self, k, n_first=LM_INFINITE_FIRST):
        self.k = check_int("k", k, 1)
        self.n_first = check_int("n_first", n_first, 0, self.k)
        self.last_selection = None

    def __call__(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        q, k, v, mask, kv_pos = check_inputs(q, k, v, mask, kv_pos)
        out = np.empty(q.shape, dtype=np.float32)
        sel = np.empty((q.shape[0], k.shape[1], min(self.k, k.shape[0])), dtype=np.int32)
        lm_infinite_kernel(q, k, v, mask, kv_pos, float(kq_scale), self.k, self.n_first, out, sel)
        self.last_selection = sel
        return out

    def __repr__(self):
        return f"LMInfiniteAttention(k={self.k}, n_first={self.n_first})"


class H2OAttention:
    """SPEC "Baselines", H2O: ``k - l`` heavy hitters by accumulated attention score plus the ``l``
    (default ``k // 4``) most recent, per KV head, evicted positions gone for good (module docstring:
    prompt handling and state). ``alive(layer)`` is the layer's bool [n_cells, n_head_kv] of cells not
    evicted; ``last_selection`` holds the attended cells, width min(k, n_kv) (n_kv for prompt rows)."""

    name = "h2o"
    blocked_prompt = True  # prompt rows through h2o_prompt_blocked; False: h2o_kernel's row loop

    def __init__(self, k, l=None):
        self.k = check_int("k", k, 1)
        self.l = self.k // 4 if l is None else check_int("l", l, 0, self.k)
        self.last_selection = None
        self.reset()

    def reset(self):
        """Forget every score and eviction: call before each new sequence (with a new KV cache)."""
        self._score: dict[int, np.ndarray] = {}
        self._alive: dict[int, np.ndarray] = {}

    def with_budget(self, k, l=None):
        """A new H2O with budget k (and l, default k // 4) that starts from this one's scores and
        evictions: one prompt's state serves a sweep over budgets."""
        other = H2OAttention(k, l)
        other._score = {il: a.copy() for il, a in self._score.items()}
        other._alive = {il: a.copy() for il, a in self._alive.items()}
        return other

    def alive(self, layer):
        return self._alive[layer].copy()

    def scores(self, layer):
        return self._score[layer].copy()

    def _state(self, layer, n_kv, n_head_kv):
        score, alive = self._score.get(layer), self._alive.get(layer)
        if score is None:
            score, alive = np.zeros((0, n_head_kv)), np.ones((0, n_head_kv), np.bool_)
        if score.shape[0] > n_kv or score.shape[1] != n_head_kv:
            raise SparqError(f"H2O layer {layer}: the cache went from {score.shape[0]} to {n_kv} cells "
                             f"({n_head_kv} KV heads); H2O state is for one growing sequence, call reset() first")
        if score.shape[0] < n_kv:  # new cells: live, no score yet
            extra = n_kv - score.shape[0]
            score = np.concatenate((score, np.zeros((extra, n_head_kv))))
            alive = np.concatenate((alive, np.ones((extra, n_head_kv), np.bool_)))
        self._score[layer], self._alive[layer] = score, alive
        return score, alive

    def _run(self, q, k, v, mask, kv_pos, kq_scale, layer, evict):
        q, k, v, mask, kv_pos = check_inputs(q, k, v, mask, kv_pos)
        score, alive = self._state(layer, k.shape[0], k.shape[1])
        out = np.empty(q.shape, dtype=np.float32)
        width = min(self.k, k.shape[0]) if evict else k.shape[0]
        sel = np.empty((q.shape[0], k.shape[1], width), dtype=np.int32)
        if evict or not self.blocked_prompt:
            h2o_kernel(q, k, v, mask, kv_pos, float(kq_scale), self.k, self.l, evict, score, alive, out, sel)
        else:
            h2o_prompt_blocked(q, k, v, mask, float(kq_scale), score, alive, out, sel)
        self.last_selection = sel
        return out

    def __call__(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        """Decode rows: evict down to k, attend, accumulate."""
        return self._run(q, k, v, mask, kv_pos, kq_scale, layer, True)

    def prompt_call(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        """Prompt rows: attend to every live visible cell (dense), accumulate, evict nothing."""
        return self._run(q, k, v, mask, kv_pos, kq_scale, layer, False)

    def __repr__(self):
        return f"H2OAttention(k={self.k}, l={self.l})"


class DensePrompt:
    """Runs ``method`` the way the evaluation (and llama.cpp with sparse_prompt off) does: while
    ``prompt`` is True every row is dense (through the method's ``prompt_call`` if it keeps state),
    afterwards the method decides. ``reset()`` resets the method's state and sets ``prompt`` again."""

    def __init__(self, method):
        self.method = method
        self.name = method.name
        self.prompt = True
        self._dense = DenseAttention()

    def reset(self):
        if hasattr(self.method, "reset"):
            self.method.reset()
        self.prompt = True

    def __call__(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        if not self.prompt:
            return self.method(q, k, v, mask, kv_pos, kq_scale, layer)
        prompt_call = getattr(self.method, "prompt_call", None)
        if prompt_call is not None:
            return prompt_call(q, k, v, mask, kv_pos, kq_scale, layer)
        return self._dense(q, k, v, mask, kv_pos, kq_scale, layer)

    def __repr__(self):
        return f"DensePrompt({self.method!r})"


def reads(method, n: int, D: int) -> float:
    """Elements of attention data one decode step of ``method`` reads per KV head at n visible
    positions (docs/spec.md's transfer formulas); method is any reference attention (or DensePrompt)."""
    method = getattr(method, "method", method)
    name = getattr(method, "name", None)
    if name == "dense":
        return transfer.dense_elements(n, D)
    if name == "sparq":
        return transfer.sparq_elements(n, D, min(method.r, D), method.k)
    if name == "exact-topk":
        return transfer.exact_topk_elements(n, D, method.k)
    if name == "loki":
        return transfer.loki_elements(n, D, method.d, method.k)
    if name == "h2o":
        return transfer.h2o_elements(n, D, method.k)
    if name == "lm-infinite":
        return transfer.lm_infinite_elements(n, D, method.k)
    if name == "alisa":
        return transfer.alisa_elements(n, D, method.c)
    raise SparqError(f"no transfer formula for attention {method!r}")


def compression_ratio(method, n: int, D: int) -> float:
    """docs/spec.md's compression ratio: the method's reads over dense reads at n visible positions."""
    if n < 1 or D < 1:
        raise SparqError(f"compression ratio needs n >= 1 and D >= 1, got n={n}, D={D}")
    return transfer.compression(reads(method, n, D), n, D)


class RecordPrompt:
    """``attention`` (e.g. a DensePrompt in its prompt phase) whose rows every recorder also sees
    through its ``record_prompt``: one dense prefill records the state of several methods."""

    def __init__(self, attention, *recorders):
        self.attention = attention
        self.recorders = recorders
        self.name = getattr(attention, "name", None)

    def __call__(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        y = self.attention(q, k, v, mask, kv_pos, kq_scale, layer)
        for r in self.recorders:
            r.record_prompt(q, k, v, mask, kv_pos, kq_scale, layer)
        return y

    def __repr__(self):
        return f"RecordPrompt({self.attention!r}, {', '.join(map(repr, self.recorders))})"
