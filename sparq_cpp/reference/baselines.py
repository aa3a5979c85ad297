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
- SWAAttention: ALISA's Sparse Window Attention (Algorithm 1), the k = floor(n*c/2) most recent
  positions plus the k others with the largest attention weights of the last k steps; its class
  docstring gives the reading of the algorithm, the seeding from the prompt and the head grouping.
  ``RecordPrompt`` lets it record a prompt beside H2O's in one dense prefill.
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
from sparq_cpp.reference.attention import DenseAttention, _check_inputs, _check_int
from sparq_cpp.reference.kernels import _exact_attend, _recency_order

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
            rec = _recency_order(cells, kv_pos)  # most recent first
            chosen = np.sort(np.concatenate((rec[n - n_first:], rec[: topk - n_first])))
        sel_cells = cells[chosen]
        for p in range(sel_cells.shape[0]):
            sel_out[t, h, p] = sel_cells[p]
        y = np.empty(D)
        for jj in range(g):
            _exact_attend(q[t, h * g + jj], k, v, h, sel_cells, kq_scale, y)
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
                rec = _recency_order(cells, kv_pos)
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
                _exact_attend(q[t, j], k, v, h, cells, kq_scale, y)
                for c in range(D):
                    out[t, j, c] = y[c]
                # the softmax weights once more, to accumulate them (same arithmetic as _exact_attend)
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
        self.k = _check_int("k", k, 1)
        self.n_first = _check_int("n_first", n_first, 0, self.k)
        self.last_selection = None

    def __call__(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        q, k, v, mask, kv_pos = _check_inputs(q, k, v, mask, kv_pos)
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
        self.k = _check_int("k", k, 1)
        self.l = self.k // 4 if l is None else _check_int("l", l, 0, self.k)
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
        q, k, v, mask, kv_pos = _check_inputs(q, k, v, mask, kv_pos)
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


class SWAAttention:
    """ALISA's Sparse Window Attention (Zhao et al., 2024, Algorithm 1) with caching ratio ``c``.

    At a step whose query sees ``n`` positions, ``k = floor(n*c/2)`` (at least 1):
    - locally static: the ``k`` most recent visible positions (by token position; the query's own,
      just stored position is one of them, the project's budget convention);
    - globally dynamic: the ``k`` other visible positions with the largest local attention sum
      ``S``, the sum of the attention weights of the last ``k`` steps (the ``k`` query rows processed
      before this one, in order), summed over heads; equal sums go to the more recent position;
    - exact attention of every query head over those ``2k`` positions (every visible position when
      ``2k >= n``). The weights of this step, zero outside its set, join the window of the next
      steps: a position no step of the last ``k`` selected has ``S = 0`` and loses every tie to a
      more recent one, so in practice it is gone, as with H2O (but a position can come back while
      some row of the window still weighs it).

    Reading of Algorithm 1. Line 2's ``AW[n-k : n-1]`` is taken as the attention-weight rows of the
    ``k`` steps before the current one (the current row is not computed yet when the set is chosen;
    Algorithm 1's ``AW`` is the "previous attention weight", each step's line-7 output); line 3 is the
    ``k`` most recent positions including the current one; ``I = [I^l, I^g]`` holds ``2k`` distinct
    positions ("evenly splits final tokens into k globally dynamic and k local static tokens"), so
    line 4's argmax runs over the positions outside ``I^l``. A decode row's weights are those of its
    sparse softmax over its ``2k`` positions (line 7), zero elsewhere.

    Prompt (the seeding). The prompt is attended densely, as llama.cpp and every method here keep
    a prompt batch dense; its rows' dense softmax weights over their visible positions are recorded
    (``prompt_call`` / ``record_prompt``), so the first sparse step's ``S`` sums the prompt's last
    ``k`` rows (its dense weights), and later steps slide the window from the prompt's rows into
    the decode rows: after ``k`` sparse steps no prompt row is left in it. With ``k`` growing with
    ``n`` (``c/2`` per step), the window's start advances by 0 or 1 row per step.

    Heads. The paper reduces the local attention sum "along the head dimension": one ``S`` and one
    set per layer, over all query heads (``per_kv_head=False``, the default): every KV head of the
    layer reads the same positions. ``per_kv_head=True`` sums only over the query heads of a KV
    head's GQA group and chooses per KV head (H2O's grouping here). For a model with one KV head the
    two are the same.

    State: per layer, every recorded row as (cells, weights [units, m]) in float64: one sequence whose
    cache only grows, until ``reset()``; ``with_ratio`` starts a new ratio from the same prompt rows.
    The prompt rows take about ``n_prompt**2 / 2`` float64 per layer and unit. ``last_selection``:
    [n_q, n_head_kv, width] cells in ascending order, -1 padded.
    """

    name = "alisa"

    def __init__(self, c, per_kv_head=False, keep_c=None):
        for name, val in (("c", c), ("keep_c", c if keep_c is None else keep_c)):
            if isinstance(val, bool) or not isinstance(val, (int, float, np.integer, np.floating)) \
                    or not np.isfinite(val) or val <= 0:
                raise SparqError(f"ALISA's caching ratio {name} must be a finite number > 0, got {val!r}")
        self.c = float(c)
        # prompt rows no window of a ratio up to keep_c can reach are dropped; None keeps every row
        self.keep_c = None if keep_c is None else max(float(keep_c), self.c)
        self.per_kv_head = bool(per_kv_head)
        self.last_selection = None
        self.reset()

    def reset(self):
        """Forget every recorded row: call before each new sequence (with a new KV cache)."""
        self._prompt_rows: dict[int, list] = {}
        self._dropped: dict[int, int] = {}  # prompt rows dropped from the front, per layer
        self._rows: dict[int, list] = {}

    def window(self, n: int) -> int:
        """Algorithm 1's k at n visible positions: floor(n*c/2), at least 1."""
        return transfer.alisa_window(n, self.c)

    def with_ratio(self, c):
        """A new SWA with caching ratio c that starts from this one's prompt rows (its decode rows are
        not carried over): one prompt's record serves a sweep over ratios."""
        if self.keep_c is not None and c > self.keep_c:
            raise SparqError(f"ALISA: this record keeps the prompt rows for caching ratios up to {self.keep_c:g}, "
                             f"not {c:g}; record the prompt again")
        other = SWAAttention(c, self.per_kv_head, self.keep_c)
        other._prompt_rows = {il: list(rows) for il, rows in self._prompt_rows.items()}
        other._dropped = dict(self._dropped)
        return other

    def _units(self, n_head, n_head_kv):
        """Lists of the query heads summed into each S (and sharing its selection)."""
        g = n_head // n_head_kv
        if self.per_kv_head:
            return [list(range(h * g, (h + 1) * g)) for h in range(n_head_kv)]
        return [list(range(n_head))]

    def _check_layer(self, layer, units):
        for rows in (self._prompt_rows.get(layer, ()), self._rows.get(layer, ())):
            if rows and rows[-1][1].shape[0] != len(units):
                raise SparqError(f"ALISA layer {layer}: recorded rows have {rows[-1][1].shape[0]} head groups, "
                                 f"this call {len(units)}; SWA state is for one model and sequence, call reset()")

    def window_sum(self, layer, k, n_kv, n_units=1):
        """S [n_units, n_kv]: the weights of the last k recorded rows of the layer (prompt, then decode)."""
        prompt, dec = self._prompt_rows.get(layer, []), self._rows.get(layer, [])
        if k > len(dec) + len(prompt) and self._dropped.get(layer, 0):
            raise SparqError(f"ALISA layer {layer}: the window of {k} rows reaches prompt rows dropped by keep_c")
        rows = dec[len(dec) - k:] if k <= len(dec) else prompt[max(0, len(prompt) - (k - len(dec))):] + dec
        S = np.zeros((n_units, n_kv))
        for cells, w in rows:
            S[:, cells] += w
        return S

    def record_prompt(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        """Record prompt rows (dense softmax weights over each row's visible cells, summed per head
        group) without computing the output."""
        q, k, v, mask, kv_pos = _check_inputs(q, k, v, mask, kv_pos)
        n_q, n_head, _ = q.shape
        n_head_kv = k.shape[1]
        g = n_head // n_head_kv
        units = self._units(n_head, n_head_kv)
        self._check_layer(layer, units)
        kd = k.astype(np.float64)
        W = np.zeros((len(units), n_q, k.shape[0]))
        for u, heads in enumerate(units):
            for j in heads:
                s = float(kq_scale) * (q[:, j, :].astype(np.float64) @ kd[:, j // g, :].T)
                s = np.where(mask, s, -np.inf)
                m = s.max(axis=1, keepdims=True)
                e = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
                tot = e.sum(axis=1, keepdims=True)
                W[u] += e / np.where(tot > 0, tot, 1.0)
        rows = self._prompt_rows.setdefault(layer, [])
        for t in range(n_q):
            cells = np.nonzero(mask[t])[0]
            rows.append((cells, W[:, t, cells].copy()))
        if self.keep_c is not None:
            # a later step t >= N sees at most t + 1 positions and its window starts at row
            # t - floor((t + 1)*c/2), which never decreases with t (c < 2): earlier rows are never read
            n_rows = self._dropped.get(layer, 0) + len(rows)
            first = max(0, n_rows - transfer.alisa_window(n_rows + 1, self.keep_c) - 1)
            drop = first - self._dropped.get(layer, 0)
            if drop > 0:
                del rows[:drop]
                self._dropped[layer] = first

    def prompt_call(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        """Prompt rows: dense attention, their weights recorded to seed the window sums."""
        out = DenseAttention()(q, k, v, mask, kv_pos, kq_scale, layer)
        self.record_prompt(q, k, v, mask, kv_pos, kq_scale, layer)
        mask = np.asarray(mask, dtype=np.bool_)
        sel = np.full((mask.shape[0], k.shape[1], mask.shape[1]), -1, dtype=np.int32)
        for t in range(mask.shape[0]):
            cells = np.nonzero(mask[t])[0]
            sel[t, :, : cells.shape[0]] = cells
        self.last_selection = sel
        return out

    def __call__(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
        """Decode rows, in order: choose by the window sums, attend, record the step's weights."""
        q, k, v, mask, kv_pos = _check_inputs(q, k, v, mask, kv_pos)
        n_q, n_head, D = q.shape
        n_kv, n_head_kv = k.shape[0], k.shape[1]
        g = n_head // n_head_kv
        units = self._units(n_head, n_head_kv)
        self._check_layer(layer, units)
        dec = self._rows.setdefault(layer, [])
        out = np.zeros(q.shape, dtype=np.float32)
        chosen_rows = []
        for t in range(n_q):
            cells = np.nonzero(mask[t])[0].astype(np.int64)
            n = cells.shape[0]
            if n == 0:
                chosen_rows.append([cells] * len(units))
                dec.append((cells, np.zeros((len(units), 0))))
                continue
            kk = self.window(n)
            if 2 * kk >= n:
                chosen = [cells] * len(units)
            else:
                rec = _recency_order(cells, kv_pos)  # most recent first
                local, rest = cells[rec[:kk]], cells[rec[kk:]]
                S = self.window_sum(layer, kk, n_kv, len(units))
                chosen = []
                for u in range(len(units)):
                    order = np.argsort(-S[u, rest], kind="stable")  # rest is most recent first: ties to recency
                    chosen.append(np.sort(np.concatenate((local, rest[order[:kk]]))))
            row_cells = np.unique(np.concatenate(chosen))
            row_w = np.zeros((len(units), row_cells.shape[0]))
            for u, heads in enumerate(units):
                sel = chosen[u]
                at = np.searchsorted(row_cells, sel)
                for j in heads:
                    h = j // g
                    s = float(kq_scale) * (k[sel, h, :].astype(np.float64) @ q[t, j].astype(np.float64))
                    e = np.exp(s - s.max())
                    w = e / e.sum()
                    out[t, j] = w @ v[sel, h, :].astype(np.float64)
                    row_w[u, at] += w
            dec.append((row_cells, row_w))
            chosen_rows.append(chosen)
        width = max([1] + [max(c.shape[0] for c in ch) for ch in chosen_rows])
        sel_out = np.full((n_q, n_head_kv, width), -1, dtype=np.int32)
        for t, ch in enumerate(chosen_rows):
            for h in range(n_head_kv):
                c = ch[h if self.per_kv_head else 0]
                sel_out[t, h, : c.shape[0]] = c
        self.last_selection = sel_out
        return out

    def __repr__(self):
        return f"SWAAttention(c={self.c:g}, per_kv_head={self.per_kv_head})"


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
