"""Evaluation baselines (reference/baselines.py) against docs/spec.md "Baselines used in evaluation":
plain-numpy oracles written from the text, k >= n equals dense, LM-Infinite's positions, H2O's
permanent eviction, masks, and the compression ratios."""

from __future__ import annotations

import numpy as np
import pytest

from sparq_cpp import transfer
from sparq_cpp.errors import SparqError
from sparq_cpp.reference.attention import DenseAttention, ExactTopKAttention, SparQAttention
from sparq_cpp.reference.baselines import (DensePrompt, H2OAttention, LMInfiniteAttention, compression_ratio,
                                           reads)

SCALE = 0.125


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def rand_qkv(n_q, n_kv, n_head=4, n_head_kv=2, D=16, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_q, n_head, D)).astype(np.float32) * 2
    k = rng.standard_normal((n_kv, n_head_kv, D)).astype(np.float32) * 2
    v = rng.standard_normal((n_kv, n_head_kv, D)).astype(np.float32)
    return q, k, v


def causal(n_q, n_kv):
    """The last n_q of n_kv cells are the queries' own; positions = cell index."""
    pos = np.arange(n_kv, dtype=np.int32)
    qpos = pos[n_kv - n_q:]
    return pos[None, :] <= qpos[:, None], pos


def attend(q, k, v, cells, h):
    """Exact attention of one query head over `cells` of KV head h, in float64."""
    w = _softmax(np.array([SCALE * np.dot(q.astype(np.float64), k[c, h]) for c in cells]))
    return sum(wi * v[c, h].astype(np.float64) for wi, c in zip(w, cells)), dict(zip(cells, w))


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


# ---------------------------------------------------------------- k >= n equals dense

@pytest.mark.parametrize("make", [lambda k: LMInfiniteAttention(k), lambda k: H2OAttention(k),
                                  lambda k: LMInfiniteAttention(k, n_first=0), lambda k: H2OAttention(k, l=0)])
def test_budget_covering_everything_is_dense(make):
    q, k, v = rand_qkv(6, 40)
    mask, pos = causal(6, 40)
    want = DenseAttention()(q, k, v, mask, pos, SCALE)
    for budget in (40, 41, 1000):
        got = make(budget)(q, k, v, mask, pos, SCALE)
        assert rel(got, want) <= 1e-6


def test_h2o_prompt_is_dense_and_accumulates_weights():
    q, k, v = rand_qkv(30, 30, n_head=4, n_head_kv=2)
    mask, pos = causal(30, 30)
    h2o = H2OAttention(k=8)
    got = h2o.prompt_call(q, k, v, mask, pos, SCALE, layer=0)
    assert rel(got, DenseAttention()(q, k, v, mask, pos, SCALE)) <= 1e-6
    assert h2o.alive(0).all()  # the prompt evicts nothing
    want = np.zeros((30, 2))
    for t in range(30):
        for j in range(4):
            _, w = attend(q[t, j], k, v, list(range(t + 1)), j // 2)
            for c, wc in w.items():
                want[c, j // 2] += wc
    assert np.allclose(h2o.scores(0), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", ["causal-300", "dead-cells-and-chunk", "empty-rows"])
def test_h2o_blocked_prompt_equals_the_row_loop(case):
    """The blocked prompt path (h2o_prompt_blocked: matrix products over blocks of rows, a KV head's
    group at once) against h2o_kernel's row loop: same outputs, scores and selections, on a SmolLM2-like
    geometry (9 query heads over 3 KV heads of 64), blocks that do not divide the rows, evicted cells
    left by decode steps before a later prompt batch, and rows that see nothing."""
    from sparq_cpp.reference import baselines

    n, H, Hkv, D = 300, 9, 3, 64
    q, k, v = rand_qkv(n, n, n_head=H, n_head_kv=Hkv, D=D, seed=21)
    mask, pos = causal(n, n)
    runs = {}
    for blocked in (True, False):
        h2o = H2OAttention(40)
        h2o.blocked_prompt = blocked
        ys = []
        if case == "causal-300":
            ys.append(h2o.prompt_call(q, k, v, mask, pos, SCALE, layer=2))
            sels = [h2o.last_selection]
        else:
            n0 = 200
            h2o.prompt_call(q[:n0], k[:n0], v[:n0], mask[:n0, :n0], pos[:n0], SCALE, layer=2)
            for m in range(n0 + 1, n0 + 4):  # decode steps evict down to 40 cells per KV head
                h2o(q[m - 1: m], k[:m], v[:m], np.ones((1, m), bool), pos[:m], SCALE, layer=2)
            m0 = n0 + 3
            rows = mask[m0:].copy()
            if case == "empty-rows":
                rows[::7] = False  # a row with no visible cell gives 0 and adds no weight
            ys.append(h2o.prompt_call(q[m0:], k, v, rows, pos, SCALE, layer=2))
            sels = [h2o.last_selection]
        runs[blocked] = (ys, sels, h2o.scores(2), h2o.alive(2))
    (ya, sa, sca, aa), (yb, sb, scb, ab) = runs[True], runs[False]
    assert baselines.PROMPT_BLOCK < n  # more than one block
    for a, b in zip(ya, yb):
        assert rel(a, b) <= 1e-6
    for a, b in zip(sa, sb):
        assert np.array_equal(a, b)
    assert np.allclose(sca, scb, rtol=1e-12, atol=1e-12)
    assert np.array_equal(aa, ab)
    if case != "causal-300":
        assert (~aa).any()  # the case has dead cells


# ---------------------------------------------------------------- LM-Infinite

def test_lm_infinite_picks_first_and_recent_by_position():
    n, budget, first = 100, 40, 16
    q, k, v = rand_qkv(1, n, seed=1)
    perm = np.random.default_rng(2).permutation(n)  # cell c holds position perm[c]
    kv_pos = perm.astype(np.int32)
    mask = np.ones((1, n), bool)
    att = LMInfiniteAttention(budget, n_first=first)
    y = att(q, k, v, mask, kv_pos, SCALE)
    want_pos = set(range(first)) | set(range(n - (budget - first), n))
    for h in range(2):
        sel = [c for c in att.last_selection[0, h] if c >= 0]
        assert {int(kv_pos[c]) for c in sel} == want_pos
        for j in (2 * h, 2 * h + 1):
            y_want, _ = attend(q[0, j], k, v, sel, h)
            assert np.allclose(y[0, j], y_want, rtol=1e-5, atol=1e-6)


def test_lm_infinite_rows_see_only_their_prefix():
    q, k, v = rand_qkv(5, 60, seed=3)
    mask, pos = causal(5, 60)
    att = LMInfiniteAttention(24, n_first=16)
    att(q, k, v, mask, pos, SCALE)
    for t in range(5):
        last = 55 + t
        sel = sorted(int(c) for c in att.last_selection[t, 0] if c >= 0)
        assert sel == list(range(16)) + list(range(last - 7, last + 1))


# ---------------------------------------------------------------- H2O

def h2o_numpy(steps, budget, l, prompt_scores=None, n_head=4, n_head_kv=2):
    """SPEC H2O written from the text for a decode loop: `steps` = [(q [1, H, D], k [n, Hkv, D], v)],
    the cache growing by one cell per step; `prompt_scores` [n0, Hkv] seeds the accumulated scores.
    Returns the outputs and the live cells per step."""
    g = n_head // n_head_kv
    score = {h: {} for h in range(n_head_kv)}
    if prompt_scores is not None:
        score = {h: {c: prompt_scores[c, h] for c in range(prompt_scores.shape[0])} for h in range(n_head_kv)}
    dead = {h: set() for h in range(n_head_kv)}
    outs, lives = [], []
    for q, k, v in steps:
        n = k.shape[0]
        y = np.zeros((n_head, k.shape[2]))
        for h in range(n_head_kv):
            live = [c for c in range(n) if c not in dead[h]]
            if len(live) > budget:
                recent = sorted(live, reverse=True)[:l]
                rest = sorted((c for c in live if c not in recent), key=lambda c: (-score[h].get(c, 0.0), -c))
                keep = set(recent) | set(rest[: budget - l])
                dead[h] |= set(live) - keep
                live = sorted(keep)
            for j in range(h * g, (h + 1) * g):
                y[j], w = attend(q[0, j], k, v, live, h)
                for c, wc in w.items():
                    score[h][c] = score[h].get(c, 0.0) + wc
        outs.append(y)
        lives.append({h: set(range(n)) - dead[h] for h in range(n_head_kv)})
    return outs, lives


def test_h2o_matches_numpy_oracle_and_never_readmits():
    n0, n_steps, budget, l = 20, 40, 12, 3
    q_all, k_all, v_all = rand_qkv(n0 + n_steps, n0 + n_steps, seed=4)
    # a planted heavy hitter: every query of KV head 0 shares a direction u that cell 5's key points along
    u = np.zeros(16, np.float32)
    u[3] = 1.0
    q_all[:, 0:2] += 3 * u
    k_all[5, 0] = 8 * u
    h2o = H2OAttention(budget, l=l)
    mask, pos = causal(n0, n0)
    h2o.prompt_call(q_all[:n0], k_all[:n0], v_all[:n0], mask, pos, SCALE, layer=0)

    steps = []
    prev_alive = None
    for s in range(n_steps):
        n = n0 + s + 1
        steps.append((q_all[n - 1: n], k_all[:n], v_all[:n]))
        mask = np.ones((1, n), bool)
        y = h2o(q_all[n - 1: n], k_all[:n], v_all[:n], mask, np.arange(n, dtype=np.int32), SCALE, layer=0)
        alive = h2o.alive(0)
        assert (alive.sum(axis=0) <= budget).all()
        assert alive[n - l: n].all()  # the l most recent are always live
        if prev_alive is not None:
            assert not (alive[: n - 1] & ~prev_alive).any(), "an evicted cell came back"
        prev_alive = alive
        for h in range(2):
            sel = [int(c) for c in h2o.last_selection[0, h] if c >= 0]
            assert sel == sorted(np.nonzero(alive[:, h])[0].tolist())
        steps[-1] = steps[-1] + (y,)
    assert prev_alive[5, 0], "the planted heavy hitter was evicted"
    assert (~prev_alive[:n0]).sum() > 0

    # the same loop in plain numpy (prompt scores seeded from the dense prompt)
    oracle = H2OAttention(budget, l=l)
    mask, pos = causal(n0, n0)
    oracle.prompt_call(q_all[:n0], k_all[:n0], v_all[:n0], mask, pos, SCALE, layer=0)
    outs, lives = h2o_numpy([st[:3] for st in steps], budget, l, prompt_scores=oracle.scores(0))
    for s, (st, want) in enumerate(zip(steps, outs)):
        assert np.allclose(st[3][0], want, rtol=1e-5, atol=1e-6), f"step {s}"
    assert {h: set(np.nonzero(prev_alive[:, h])[0].tolist()) for h in range(2)} == lives[-1]


def test_h2o_without_prompt_matches_oracle():
    n_steps, budget, l = 30, 10, 2
    q_all, k_all, v_all = rand_qkv(n_steps, n_steps, seed=5)
    steps = [(q_all[n - 1: n], k_all[:n], v_all[:n]) for n in range(1, n_steps + 1)]
    outs, lives = h2o_numpy(steps, budget, l)
    h2o = H2OAttention(budget, l=l)
    for s, (q, k, v) in enumerate(steps):
        n = k.shape[0]
        y = h2o(q, k, v, np.ones((1, n), bool), np.arange(n, dtype=np.int32), SCALE)
        assert np.allclose(y[0], outs[s], rtol=1e-5, atol=1e-6), f"step {s}"
        alive = h2o.alive(0)
        for h in range(2):
            assert set(np.nonzero(alive[:, h])[0].tolist()) == lives[s][h]


def test_h2o_evicted_cells_stay_out_of_a_later_dense_batch():
    """Scores only grow, so a decode step could never rank an evicted cell back in; a later prompt
    batch (dense rows) is where a missing eviction record would show: it must skip dead cells."""
    n0, budget = 30, 8
    q, k, v = rand_qkv(n0 + 3, n0 + 3, seed=11)
    h2o = H2OAttention(budget)
    h2o(q[n0 - 1: n0], k[:n0], v[:n0], np.ones((1, n0), bool), np.arange(n0, dtype=np.int32), SCALE)
    dead = ~h2o.alive(0)
    assert dead.sum(axis=0).tolist() == [n0 - budget] * 2
    n = n0 + 3
    mask, pos = causal(3, n)
    y = h2o.prompt_call(q[n0:], k, v, mask, pos, SCALE)
    for t in range(3):
        for j in range(4):
            h = j // 2
            live = [c for c in range(n0 + t + 1) if c >= n0 or not dead[c, h]]
            want, _ = attend(q[n0 + t, j], k, v, live, h)
            assert np.allclose(y[t, j], want, rtol=1e-5, atol=1e-6)
    assert (h2o.alive(0)[:n0] == ~dead).all()


def test_h2o_batch_of_rows_equals_one_at_a_time():
    n0, n_new, budget = 24, 10, 8
    q, k, v = rand_qkv(n0 + n_new, n0 + n_new, seed=6)
    a, b = H2OAttention(budget), H2OAttention(budget)
    m0, p0 = causal(n0, n0)
    a.prompt_call(q[:n0], k[:n0], v[:n0], m0, p0, SCALE)
    b.prompt_call(q[:n0], k[:n0], v[:n0], m0, p0, SCALE)
    n = n0 + n_new
    mask, pos = causal(n_new, n)
    y_batch = a(q[n0:], k, v, mask, pos, SCALE)
    for i in range(n_new):
        m = n0 + i + 1
        y1 = b(q[m - 1: m], k[:m], v[:m], np.ones((1, m), bool), pos[:m], SCALE)
        assert np.allclose(y_batch[i], y1[0], rtol=1e-6, atol=1e-7)
    assert np.array_equal(a.alive(0), b.alive(0))


def test_h2o_state_is_per_layer_and_reset():
    q, k, v = rand_qkv(1, 30, seed=7)
    mask, pos = np.ones((1, 30), bool), np.arange(30, dtype=np.int32)
    h2o = H2OAttention(8)
    h2o(q, k, v, mask, pos, SCALE, layer=0)
    assert h2o.alive(0).sum(axis=0).tolist() == [8, 8]
    with pytest.raises(SparqError, match="reset"):
        h2o(q, k[:20], v[:20], mask[:, :20], pos[:20], SCALE, layer=0)  # the cache shrank
    h2o.reset()
    y = h2o(q, k[:20], v[:20], mask[:, :20], pos[:20], SCALE, layer=0)
    assert y.shape == (1, 4, 16)
    h2o(q, k, v, mask, pos, SCALE, layer=3)  # another layer has its own state
    assert h2o.alive(0).shape[0] == 20 and h2o.alive(3).shape[0] == 30


# ---------------------------------------------------------------- masks

@pytest.mark.parametrize("make", [lambda: LMInfiniteAttention(12, n_first=4), lambda: H2OAttention(12),
                                  lambda: ExactTopKAttention(12)])
def test_masked_cells_are_never_read(make):
    """Cells of another sequence (masked) hold NaN: the output is unchanged and finite, never selected."""
    n = 50
    q, k, v = rand_qkv(3, n, seed=8)
    mask, pos = causal(3, n)
    other = np.arange(n) % 3 == 1  # interleaved cells of another sequence
    mask = mask & ~other[None, :]
    want = make()(q, k, v, mask, pos, SCALE)
    k2, v2 = k.copy(), v.copy()
    k2[other], v2[other] = np.nan, np.nan
    att = make()
    got = att(q, k2, v2, mask, pos, SCALE)
    assert np.isfinite(got).all() and np.array_equal(got, want)
    sel = att.last_selection
    assert not other[sel[sel >= 0]].any()
    if isinstance(att, H2OAttention):
        assert (att.scores(0)[other] == 0).all()


def test_h2o_sees_only_visible_cells_within_a_row():
    """Future cells (masked for this row) are neither attended nor evicted."""
    q, k, v = rand_qkv(1, 40, seed=9)
    mask = np.zeros((1, 40), bool)
    mask[0, :25] = True
    h2o = H2OAttention(10)
    h2o(q, k, v, mask, np.arange(40, dtype=np.int32), SCALE)
    alive = h2o.alive(0)
    assert alive[25:].all() and (alive[:25].sum(axis=0) == 10).all()


# ---------------------------------------------------------------- settings and compression

def test_bad_settings_are_refused():
    with pytest.raises(SparqError, match="k"):
        H2OAttention(0)
    with pytest.raises(SparqError, match="l"):
        H2OAttention(8, l=9)
    with pytest.raises(SparqError, match="n_first"):
        LMInfiniteAttention(8)  # 16 first positions do not fit k = 8
    with pytest.raises(SparqError, match="k"):
        LMInfiniteAttention(-1)


def test_compression_ratios_follow_spec_formulas():
    n, D = 4096, 128
    dense = 2 * n * D + 2 * D
    assert compression_ratio(DenseAttention(), n, D) == 1.0
    assert compression_ratio(H2OAttention(192), n, D) == pytest.approx((2 * 192 * D + 2 * D + 2 * n) / dense)
    assert compression_ratio(LMInfiniteAttention(192), n, D) == pytest.approx((2 * 192 * D + 2 * D) / dense)
    assert compression_ratio(ExactTopKAttention(32), n, D) == pytest.approx((n * D + 32 * D + 2 * D) / dense)
    assert compression_ratio(SparQAttention(16, 128), n, D) == pytest.approx((n * 16 + 2 * 128 * D + 4 * D) / dense)
    assert compression_ratio(DensePrompt(H2OAttention(192)), n, D) == compression_ratio(H2OAttention(192), n, D)
    assert reads(LMInfiniteAttention(192), 100, D) == transfer.lm_infinite_elements(100, D, 192)
    with pytest.raises(SparqError, match="transfer formula"):
        reads(object(), n, D)


def test_dense_prompt_switches():
    q, k, v = rand_qkv(4, 50, seed=10)
    mask, pos = causal(4, 50)
    wrapped = DensePrompt(LMInfiniteAttention(20))
    dense = DenseAttention()(q, k, v, mask, pos, SCALE)
    assert np.array_equal(wrapped(q, k, v, mask, pos, SCALE), dense)
    wrapped.prompt = False
    assert np.array_equal(wrapped(q, k, v, mask, pos, SCALE), LMInfiniteAttention(20)(q, k, v, mask, pos, SCALE))
    assert rel(wrapped(q, k, v, mask, pos, SCALE), dense) > 1e-3
    wrapped.reset()
    assert wrapped.prompt


# ---------------------------------------------------------------- whole model

def test_h2o_in_the_whole_model_batch_equals_decode(tmp_path):
    """Teacher-forced continuation in one batch = one token at a time, through LlamaReference."""
    from sparq_cpp.modelfactory import write_model
    from sparq_cpp.reference.forward import LlamaReference
    from sparq_cpp.reference.gguf_model import load_llama

    model = load_llama(write_model(tmp_path / "m.gguf", "tiny-gqa", wtype="f32", seed=1))
    toks = [1] + np.random.default_rng(0).integers(3, 2048, 99).tolist()
    outs = []
    for batched in (True, False):
        att = DensePrompt(H2OAttention(24))
        ref = LlamaReference(model, attention=att)
        ref.forward(toks[:70])
        att.prompt = False
        if batched:
            outs.append(ref.forward(toks[70:]))
        else:
            outs.append(np.concatenate([ref.forward([t]) for t in toks[70:]]))
        assert (att.method.alive(1).sum(axis=0) == 24).all()
    assert rel(outs[0], outs[1]) <= 1e-6
    dense = LlamaReference(model).forward(toks)[70:]
    assert rel(outs[0], dense) > 1e-3  # eviction changed something
