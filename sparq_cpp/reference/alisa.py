"""ALISA's reference attention (Zhao et al., 2024; docs/spec.md "ALISA"), in reference/attention.py's interface
``attn(q, k, v, mask, kv_pos, kq_scale, layer) -> y``: SWAAttention, the Sparse Window Attention of the paper's
Algorithm 1. Its class docstring gives the reading of the algorithm, the seeding from the prompt and the head
grouping; reference/baselines.py's ``RecordPrompt`` lets it record a prompt beside H2O's in one dense prefill.
"""

from __future__ import annotations

import numpy as np

from sparq_cpp import transfer
from sparq_cpp.errors import SparqError
from sparq_cpp.reference.attention import DenseAttention, check_inputs
from sparq_cpp.reference.kernels import recency_order


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
        q, k, v, mask, kv_pos = check_inputs(q, k, v, mask, kv_pos)
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
        q, k, v, mask, kv_pos = check_inputs(q, k, v, mask, kv_pos)
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
                rec = recency_order(cells, kv_pos)  # most recent first
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
