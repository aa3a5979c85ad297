"""ALISA's Sparse Window Attention (reference/baselines.py SWAAttention) against a direct, naive
implementation of the paper's Algorithm 1 written here, the seeding of the window sums from the
prompt, its transfer formula on hand-computed numbers, and `sparq-cpp eval --methods alisa`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sparq_cpp import transfer
from sparq_cpp.errors import SparqError
from sparq_cpp.reference.alisa import SWAAttention
from sparq_cpp.reference.attention import DenseAttention
from sparq_cpp.reference.baselines import DensePrompt, H2OAttention, RecordPrompt, compression_ratio, reads

SCALE = 0.25


def rand_qkv(n, n_head, n_head_kv, D=16, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, n_head, D)).astype(np.float32) * 1.5
    k = rng.standard_normal((n, n_head_kv, D)).astype(np.float32) * 1.5
    v = rng.standard_normal((n, n_head_kv, D)).astype(np.float32)
    return q, k, v


def naive_swa(q, k, v, n_prompt, c, per_kv_head=False):
    """Algorithm 1 over one sequence, positions 0..T-1, token by token, from the paper's text.

    Rows 0..n_prompt-1 are the prompt: dense attention, their weights recorded. Each later step t
    (n = t + 1 positions visible, its own included): k = max(1, floor(n*c/2)); S = the attention
    weights AW[t-k .. t-1] (the k previous steps' rows) summed over those rows and over heads (all
    query heads, or those of one KV head's group); I_l = the k most recent positions t-k+1..t; I_g =
    the k positions outside I_l with the largest S, equal S to the later position; attention over
    I_l + I_g; AW[t] = its weights, zero elsewhere. Returns (y [T-n_prompt, n_head, D], the sets)."""
    T, n_head, D = q.shape
    n_head_kv = k.shape[1]
    g = n_head // n_head_kv
    units = [list(range(h * g, h * g + g)) for h in range(n_head_kv)] if per_kv_head else [list(range(n_head))]
    AW = np.zeros((T, len(units), T))  # AW[step, unit, position], summed over the unit's heads

    def attend(t, j, I):
        s = np.array([SCALE * np.dot(q[t, j].astype(np.float64), k[p, j // g].astype(np.float64)) for p in I])
        w = np.exp(s - s.max())
        w /= w.sum()
        return w @ v[I, j // g].astype(np.float64), w

    ys, sets = [], []
    for t in range(T):
        n = t + 1
        if t < n_prompt:
            chosen = [list(range(n))] * len(units)
        else:
            kk = max(1, math.floor(n * c / 2))
            if 2 * kk >= n:
                chosen = [list(range(n))] * len(units)
            else:
                S = AW[max(0, t - kk): t].sum(axis=0)  # the last k steps' rows
                local = list(range(n - kk, n))
                rest = range(0, n - kk)
                chosen = [sorted(local + sorted(rest, key=lambda p: (-S[u, p], -p))[:kk]) for u in range(len(units))]
        y = np.zeros((n_head, D))
        for u, heads in enumerate(units):
            for j in heads:
                y[j], w = attend(t, j, chosen[u])
                AW[t, u, chosen[u]] += w
        if t >= n_prompt:
            ys.append(y)
            sets.append(chosen)
    return np.array(ys), sets


def run_swa(q, k, v, n_prompt, c, per_kv_head=False, one_by_one=True, kv_pos=None):
    """SWAAttention over the same sequence: the prompt through prompt_call, then decode rows. kv_pos
    (optional) stores position p in cell cell_of[p] (cells out of position order)."""
    T = q.shape[0]
    pos = np.arange(T, dtype=np.int32)
    if kv_pos is None:
        cell_of = pos
    else:
        cell_of = np.argsort(kv_pos)  # position -> cell
    kc, vc = np.empty_like(k), np.empty_like(v)
    kc[cell_of], vc[cell_of] = k, v
    cpos = np.empty(T, dtype=np.int32)
    cpos[cell_of] = pos

    def mask_for(rows, n_cells):  # visible: stored (cell holds a position < n_cells) and causal
        stored = cpos < n_cells
        return np.array([(cpos <= t) & stored for t in rows])

    swa = SWAAttention(c, per_kv_head)
    swa.prompt_call(q[:n_prompt], kc, vc, mask_for(range(n_prompt), n_prompt), cpos, SCALE, layer=3)
    ys, sels = [], []
    if one_by_one:
        for t in range(n_prompt, T):
            ys.append(swa(q[t:t + 1], kc, vc, mask_for([t], t + 1), cpos, SCALE, layer=3)[0])
            sels.append(swa.last_selection[0])
    else:
        ys = list(swa(q[n_prompt:], kc, vc, mask_for(range(n_prompt, T), T), cpos, SCALE, layer=3))
        sels = list(swa.last_selection)
    # selections back from cells to positions
    sets = [[sorted(int(cpos[cl]) for cl in s[h] if cl >= 0) for h in range(k.shape[1])] for s in sels]
    return np.array(ys), sets


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


# ---------------------------------------------------------------- against Algorithm 1

@pytest.mark.parametrize("n_head,n_head_kv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("per_kv_head", [False, True])
@pytest.mark.parametrize("c", [0.1, 0.25, 0.45])
def test_swa_equals_naive_algorithm_1(n_head, n_head_kv, per_kv_head, c):
    q, k, v = rand_qkv(72, n_head, n_head_kv, seed=n_head * 10 + n_head_kv)
    n_prompt = 40
    want, want_sets = naive_swa(q, k, v, n_prompt, c, per_kv_head)
    for one_by_one in (True, False):
        got, got_sets = run_swa(q, k, v, n_prompt, c, per_kv_head, one_by_one)
        assert rel(got, want) <= 1e-6
        for t, (gs, ws) in enumerate(zip(got_sets, want_sets)):
            for h in range(n_head_kv):
                assert gs[h] == ws[h if per_kv_head else 0], (t, h)
    # the selection is really sparse, and shrinks to the 2k of Algorithm 1
    n = n_prompt + 1
    kk = max(1, math.floor(n * c / 2))
    assert len(want_sets[0][0]) == min(n, 2 * kk) < n


def test_swa_positions_not_cells():
    """Cells out of position order: recency and the window are by token position and step order."""
    q, k, v = rand_qkv(60, 4, 2, seed=7)
    perm = np.random.default_rng(1).permutation(60).astype(np.int32)
    want, want_sets = naive_swa(q, k, v, 30, 0.3, per_kv_head=True)
    got, got_sets = run_swa(q, k, v, 30, 0.3, per_kv_head=True, kv_pos=perm)
    assert rel(got, want) <= 1e-6
    assert got_sets == [[s[0], s[1]] for s in want_sets]


def test_every_position_kept_is_dense():
    q, k, v = rand_qkv(50, 4, 2, seed=3)
    pos = np.arange(50, dtype=np.int32)
    mask = pos[None, :] <= pos[:, None]
    dense = DenseAttention()(q, k, v, mask, pos, SCALE)
    for c in (2.0, 5.0):  # 2k >= n at every step
        for per_kv_head in (False, True):
            swa = SWAAttention(c, per_kv_head)
            y0 = swa.prompt_call(q[:20], k[:20], v[:20], mask[:20, :20], pos[:20], SCALE)
            y1 = swa(q[20:], k, v, mask[20:], pos, SCALE)
            assert rel(np.concatenate((y0, y1)), dense) <= 1e-6
            assert (swa.last_selection[-1][0] == pos).all()


# ---------------------------------------------------------------- the seeding from the prompt

def test_prompt_last_k_rows_seed_the_sums():
    """Planted: position 2 has the largest total weight over the prompt (H2O keeps it), but only the
    prompt's last k rows decide the first step, and they point at position 5."""
    D, n_prompt, c = 8, 40, 0.2  # first step: n = 41, k = floor(41*0.2/2) = 4
    k = np.zeros((n_prompt + 1, 1, D), np.float32)
    k[2, 0, 0] = 1.0
    k[5, 0, 1] = 1.0
    v = np.random.default_rng(0).standard_normal(k.shape).astype(np.float32)
    q = np.zeros((n_prompt + 1, 2, D), np.float32)
    q[: n_prompt - 4, :, 0] = 40.0  # early rows look at position 2
    q[n_prompt - 4: n_prompt, :, 1] = 8.0  # the last 4 prompt rows look (more mildly) at position 5
    pos = np.arange(n_prompt + 1, dtype=np.int32)
    mask = pos[None, :] <= pos[:, None]
    swa = SWAAttention(c)
    swa.prompt_call(q[:n_prompt], k[:n_prompt], v[:n_prompt], mask[:n_prompt, :n_prompt], pos[:n_prompt], 1.0)
    S = swa.window_sum(0, 4, n_prompt + 1)[0]
    want = np.zeros((2, n_prompt + 1))
    for t in range(n_prompt - 4, n_prompt):  # the last 4 prompt rows, both heads summed
        for j in range(2):
            s = np.array([float(q[t, j] @ k[p, 0]) for p in range(t + 1)])
            want[j, : t + 1] = want[j, : t + 1] + np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    assert np.allclose(S, want.sum(axis=0), rtol=1e-12, atol=1e-15)
    assert S[5] > S[2]
    swa(q[n_prompt:], k, v, mask[n_prompt:], pos, 1.0)
    first = set(swa.last_selection[0, 0].tolist()) - {-1}
    assert 5 in first and 2 not in first and len(first) == 8
    h2o = H2OAttention(8, l=4)  # the whole prompt's sums keep position 2 instead
    h2o.prompt_call(q[:n_prompt], k[:n_prompt], v[:n_prompt], mask[:n_prompt, :n_prompt], pos[:n_prompt], 1.0)
    h2o(q[n_prompt:], k, v, mask[n_prompt:], pos, 1.0)
    assert 2 in set(h2o.last_selection[0, 0].tolist())


def test_with_ratio_and_record_prompt_share_the_prompt():
    q, k, v = rand_qkv(56, 4, 2, seed=5)
    pos = np.arange(56, dtype=np.int32)
    mask = pos[None, :] <= pos[:, None]
    # a DensePrompt(H2O) prefill with an SWA recorder beside it gives the cache's rows unchanged
    h2o_prompt = DensePrompt(H2OAttention(1))
    rec = SWAAttention(0.5)
    y = RecordPrompt(h2o_prompt, rec)(q[:40], k[:40], v[:40], mask[:40, :40], pos[:40], SCALE, 0)
    assert np.array_equal(y, DensePrompt(H2OAttention(1))(q[:40], k[:40], v[:40], mask[:40, :40], pos[:40], SCALE))
    for c in (0.2, 0.35):
        want, _ = run_swa(q, k, v, 40, c, one_by_one=False)
        a = rec.with_ratio(c)
        got = a(q[40:], k, v, mask[40:], pos, SCALE, 0)
        assert rel(got, want) <= 1e-6
    assert len(rec._rows.get(0, [])) == 0  # the recorder's own state is untouched by its copies


def test_keep_c_drops_only_rows_no_window_reaches():
    """A record with keep_c (the prompt in batches, as the eval feeds it) keeps far fewer prompt rows and
    decodes the same as one that keeps every row; a larger ratio than it kept is refused."""
    q, k, v = rand_qkv(120, 4, 2, seed=9)
    pos = np.arange(120, dtype=np.int32)
    mask = pos[None, :] <= pos[:, None]
    n_prompt = 96
    full, kept = SWAAttention(0.3), SWAAttention(0.3, keep_c=0.3)
    for a in (full, kept):
        for b in range(0, n_prompt, 32):
            a.record_prompt(q[b:b + 32], k, v, mask[b:b + 32], pos, SCALE, 0)
    assert len(kept._prompt_rows[0]) < len(full._prompt_rows[0]) // 4
    for c in (0.3, 0.12):
        want = full.with_ratio(c)(q[n_prompt:], k, v, mask[n_prompt:], pos, SCALE, 0)
        got = kept.with_ratio(c)(q[n_prompt:], k, v, mask[n_prompt:], pos, SCALE, 0)
        assert np.array_equal(got, want)
    with pytest.raises(SparqError, match="up to 0.3"):
        kept.with_ratio(0.5)


def test_state_errors():
    with pytest.raises(SparqError, match="caching ratio"):
        SWAAttention(0)
    with pytest.raises(SparqError, match="caching ratio"):
        SWAAttention(float("nan"))
    q, k, v = rand_qkv(10, 4, 2)
    pos = np.arange(10, dtype=np.int32)
    mask = pos[None, :] <= pos[:, None]
    swa = SWAAttention(0.5, per_kv_head=True)
    swa.prompt_call(q, k, v, mask, pos, SCALE)
    q1, k1, v1 = rand_qkv(11, 4, 1)
    with pytest.raises(SparqError, match="head groups"):
        swa(q1[10:], k1, v1, np.ones((1, 11), bool), np.arange(11, dtype=np.int32), SCALE)


# ---------------------------------------------------------------- transfer

def test_transfer_formula_hand_computed():
    # n = 100, D = 8, c = 1/4: k = floor(12.5) = 12, 24 positions: 2*24*8 + 2*8 + 2*100 + 8*12
    assert transfer.alisa_window(100, 0.25) == 12
    assert transfer.alisa_elements(100, 8, 0.25) == 384 + 16 + 200 + 96 == 696
    assert compression_ratio(SWAAttention(0.25), 100, 8) == pytest.approx(696 / 1616)
    assert reads(DensePrompt(SWAAttention(0.25)), 100, 8) == 696
    # k at least 1: n = 6, c = 0.25 -> floor(0.75) = 0 -> 1: 2 positions, 2*2*8 + 16 + 12 + 8
    assert transfer.alisa_elements(6, 8, 0.25) == 32 + 16 + 12 + 8 == 68
    # 2k >= n: every position, n = 5, c = 1 -> k = 2, min(4, 5) = 4 positions: 64 + 16 + 10 + 16
    assert transfer.alisa_elements(5, 8, 1.0) == 64 + 16 + 10 + 16 == 106
    assert transfer.alisa_elements(4, 8, 1.0) == 64 + 16 + 8 + 16 == 104


def test_sweep_sets_the_ratio_from_the_formula():
    from sparq_cpp.evaluation import sweep

    S, D = 2048, 128
    p = sweep.settings("alisa", 1 / 8, S, D)
    # budget (2*2048*128 + 256)/8 = 65568: k = floor((65568 - 256 - 4096) / 520) = 117
    assert p["k"] == 117 and transfer.alisa_window(S, p["c"]) == 117
    assert sweep.ratio_over_steps("alisa", p, [S], D) == pytest.approx(1 / 8, rel=0.01)
    assert sweep.ratio_over_steps("alisa", p, range(S, S + 64), D) == pytest.approx(1 / 8, rel=0.02)
    assert sweep.settings("alisa", 0.001, S, D) is None


# ---------------------------------------------------------------- sparq-cpp eval

def _eval_ready():
    pytest.importorskip("llama_cpp")
    from sparq_cpp.bindings import sparse_api

    if not sparse_api.available():
        pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _eval_ready()
    from sparq_cpp.modelfactory import write_model

    root = tmp_path_factory.mktemp("alisa-models")
    return {p: write_model(root / f"{p}.gguf", p, wtype="f32", seed=3) for p in ("tiny", "tiny-gqa")}


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_eval_alisa_equals_the_reference_run_directly(tiny, preset):
    """The eval's alisa (prompt recorded beside H2O's in a shared prefill, one ratio after another)
    gives the bits of a plain LlamaReference with DensePrompt(SWAAttention(c))."""
    from sparq_cpp.evaluation import sweep, tasks
    from sparq_cpp.evaluation.methods import parse_methods
    from sparq_cpp.evaluation.runner import EvalConfig, nll_bits, run
    from sparq_cpp.reference.forward import LlamaReference
    from sparq_cpp.reference.gguf_model import load_llama

    cfg = EvalConfig(model_path=Path(tiny[preset]), tasks=["bpc"], methods=parse_methods("h2o,alisa"),
                     ratios=sweep.parse_ratios("1/4,1/8"),
                     task_cfg=tasks.TaskConfig(samples=2, context=192, continuation=24), progress=False, threads=1)
    doc = run(cfg, log=lambda s: None)
    recs = [r for r in doc["records"] if r["method"] == "alisa"]
    assert len(recs) == 4
    tok = tasks.Tokenizer(cfg.model_path)
    samples = {s.id: s for s in tasks.build("bpc", tok, cfg.task_cfg, None, seed=0)}
    model = load_llama(cfg.model_path)
    for r in recs:
        assert abs(r["ratio"] - r["target"]) <= 0.1 * r["target"]  # k is whole: coarse at S = 192
        s = samples[r["sample"]]
        att = DensePrompt(SWAAttention(r["params"]["c"]))
        ref = LlamaReference(model, attention=att, cache_type="f16")
        ref.forward(s.prompt[:-1])
        att.prompt = False
        bits = nll_bits(ref.forward([s.prompt[-1]] + s.target[:-1]), s.target)
        assert r["score"] == pytest.approx(float(bits.sum() / s.n_chars), abs=1e-9)
        # without the prompt's rows the first steps would rank by zero sums: a different result
        bare = LlamaReference(model, attention=DensePrompt(DenseAttention()), cache_type="f16")
        bare.forward(s.prompt[:-1])
        bare.attention = SWAAttention(r["params"]["c"])
        other = nll_bits(bare.forward([s.prompt[-1]] + s.target[:-1]), s.target)
        assert abs(float(other.sum() - bits.sum())) > 1e-6


def test_cli_methods_alisa(tiny, tmp_path):
    out = tmp_path / "e.json"
    proc = subprocess.run([sys.executable, "-m", "sparq_cpp.cli.main", "eval", "--gguf", str(tiny["tiny-gqa"]),
                           "--tasks", "bpc,repetition", "--methods", "dense,alisa", "--ratios", "1,1/4",
                           "--samples", "1", "--context", "200", "--continuation", "16", "--max-new", "16",
                           "--threads", "1", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "alisa" in proc.stdout
    recs = json.loads(out.read_text())["records"]
    got = {(r["task"], r["method"]) for r in recs}
    assert got == {(t, m) for t in ("bpc", "repetition") for m in ("dense", "alisa")}
    for r in recs:
        if r["method"] == "alisa":
            assert r["backend"] == "ref" and abs(r["ratio"] - 0.25) <= 0.02 and np.isfinite(r["score"])
            assert set(r["params"]) == {"c", "k"}


def test_eval_alisa_in_llama_cpp_agrees_with_the_reference(tiny):
    """alisa@llama (llama.cpp's alisa mode: the prompt recorded densely, one decode step per token, the steps
    after the prompt removed for the next setting or the prompt attended again) scores as the reference does."""
    from sparq_cpp.evaluation import results, sweep, tasks
    from sparq_cpp.evaluation.methods import parse_methods
    from sparq_cpp.evaluation.runner import EvalConfig, run

    cfg = EvalConfig(model_path=Path(tiny["tiny-gqa"]), tasks=["bpc", "repetition"],
                     methods=parse_methods("alisa,alisa@llama"), ratios=sweep.parse_ratios("1/4,1/8"),
                     task_cfg=tasks.TaskConfig(samples=2, context=192, continuation=24, max_new=12),
                     cache_type="f32", progress=False, threads=1)
    doc = run(cfg, log=lambda s: None)
    rows = [r for r in results.summarize(doc["records"]) if "vs_llama" in r]
    assert len(rows) == 4
    for r in rows:
        v = r["vs_llama"]
        assert v["n"] == 2 and v["max_abs_diff"] <= 1e-4
        assert v["same_tokens"] in (None, 2)
    with pytest.raises(SparqError, match="runs only on the reference"):
        parse_methods("h2o@llama")
