"""Ranking fidelity (tools/fidelity.py; the capture and weights it ranks by: sparq_cpp/calib/qkv.py): its rankings
are the reference's selections, the capture gives llama.cpp's own q and k, and llama.cpp's SparQ op selects what the
reference selects inside a model's graph (factory models here; Gemma 3 270M, a real q/k-normed model, in the slow
tier)."""
from __future__ import annotations

import numpy as np
import pytest

from sparq_cpp.calib import qkv
from sparq_cpp.gguf_check import check_gguf
from sparq_cpp.reference.attention import ExactTopKAttention, SparQAttention
from sparq_cpp.reference.loki import LokiAttention
from tools import fidelity as fid


def _inputs(seed, n=200, g=3, D=32, R=4):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((R, g, D)) * np.linspace(0.2, 3, D)  # uneven components, as real queries
    K = rng.standard_normal((n, D)) * np.linspace(3, 0.2, D)
    return Q, K


def _selected(att, Q, K, t_rows, kq_scale, layer=0):
    """The reference's selection (as bool [R, n]) for rows Q [R, g, D] at positions t_rows over K [n, D]."""
    n, D = K.shape
    R, g, _ = Q.shape
    kv_pos = np.arange(n, dtype=np.int32)
    mask = kv_pos[None, :] <= t_rows[:, None]
    att(Q.astype(np.float32), K[:, None].astype(np.float32), np.zeros((n, 1, D), np.float32), mask, kv_pos,
        kq_scale, layer)
    sel = np.zeros((R, n), bool)
    for i in range(R):
        cells = att.last_selection[i, 0]
        sel[i, cells[cells >= 0]] = True
    return sel, mask


@pytest.mark.parametrize("seed", range(3))
def test_rankings_are_the_reference_selections(seed):
    """With no local window, each ranking's top k is the reference kernel's selection: SparQ (r of D), exact
    top-k, Loki (d of D in a basis), and SparQ in that basis is SparQ run on the rotated q and k."""
    Q, K = _inputs(seed)
    D = K.shape[1]
    t_rows = np.array([120, 150, 180, 199])
    kq, k, r = 1 / np.sqrt(D), 24, 6
    P = np.linalg.qr(np.random.default_rng(seed + 10).standard_normal((D, D)))[0]
    # the reference computes in f64 from f32 inputs: rank the same numbers
    Q32, K32 = Q.astype(np.float32).astype(np.float64), K.astype(np.float32).astype(np.float64)

    want, mask = _selected(SparQAttention(r, k, 0, False), Q, K, t_rows, kq)
    assert (fid.top_k(qkv.sparq_weights(Q32, K32, kq, r, mask).sum(1), k, mask) == want).all()

    want, _ = _selected(ExactTopKAttention(k), Q, K, t_rows, kq)
    w = qkv.exact_weights(Q32, K32, kq, mask)
    assert (fid.top_k(w.sum(1), k, mask) == want).all()

    want, _ = _selected(LokiAttention(P[None, None], 8, k, 0), Q, K, t_rows, kq)
    qr = (Q32 @ P).astype(np.float32).astype(np.float64)  # LokiAttention rotates into f32
    kr = (K32 @ P).astype(np.float32).astype(np.float64)
    assert (fid.top_k(qkv.loki_weights(qr, kr, kq, 8, mask).sum(1), k, mask) == want).all()

    want, _ = _selected(SparQAttention(r, k, 0, False), Q @ P, K @ P, t_rows, kq)
    Qp32, Kp32 = (Q @ P).astype(np.float32).astype(np.float64), (K @ P).astype(np.float32).astype(np.float64)
    assert (fid.top_k(qkv.sparq_weights(Qp32, Kp32, kq, r, mask).sum(1), k, mask) == want).all()


def test_full_rankings_are_exact_and_no_ranking_beats_the_exact_mass():
    Q, K = _inputs(5)
    D = K.shape[1]
    t_rows = np.array([150, 170, 190, 199])
    mask = np.arange(len(K))[None, :] <= t_rows[:, None]
    P = np.linalg.qr(np.random.default_rng(3).standard_normal((D, D)))[0]
    fns = fid.rankings_for(fid.METHODS, [4, D], kq_scale=1 / np.sqrt(D))
    out = fid.row_fidelity(Q, K, 1 / np.sqrt(D), mask, 25, fns, P)
    for name in (f"sparq:r={D}", f"loki:d={D}", f"pca-sparq:r={D}"):
        assert np.allclose(out[name][0], 1.0) and np.allclose(out[name][1], out["exact"][1])
    for name, (recall, mass) in out.items():
        assert ((0 <= recall) & (recall <= 1)).all()
        assert (mass <= out["exact"][1] + 1e-12).all(), name
    assert out["sparq:r=4"][0].mean() < 1.0  # 4 of 32 components: not exact on these inputs


# ---- llama.cpp ---------------------------------------------------------------------------------------

llama_cpp = pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def factory(tmp_path_factory):
    from sparq_cpp.bindings import sparse_api

    if not sparse_api.available():
        pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)")
    from sparq_cpp.modelfactory import write_model

    root = tmp_path_factory.mktemp("fidelity-models")
    return {p: write_model(root / f"{p}.gguf", p, wtype="f32", seed=3) for p in ("tiny", "tiny-gemma3")}


def _toks(n, seed=0):
    return [1] + np.random.default_rng(seed).integers(3, 2048, size=n - 1).tolist()


@pytest.mark.parametrize("preset", ["tiny", "tiny-gemma3"])
def test_llama_cpp_sparq_selects_what_the_reference_selects(factory, preset):
    """In the model's graph, prompt rows and decode steps: the op's output is the reference's on llama.cpp's
    own q, K and V, far closer than a one-position change of the selection would leave it."""
    rep = fid.op_check(factory[preset], _toks(100), r=8, k=24, l=6, n_decode=3, n_threads=1)
    assert [x["layer"] for x in rep] == qkv.full_attention_layers(factory[preset])
    for x in rep:
        assert x["sparse_rows"] == x["rows"] * x["kv_heads"], x
        # measured: 6.4e-7 at most (f32 accumulation against f64), a swap 7e-3 (median)
        assert x["max_rel_diff"] <= 1e-5, x
        # a swap of two positions that both carry almost no weight changes nothing measurable (3 of 304 rows)
        assert x["rows_closer_than_a_swap"] >= 0.95 * x["sparse_rows"], x


def test_measure_on_a_factory_model(factory):
    path = factory["tiny-gemma3"]
    text = " ".join(f"word{i % 97} and{i % 13}" for i in range(3000))
    D = check_gguf(path).head_dim
    basis = np.broadcast_to(np.eye(D), (check_gguf(path).n_layer, check_gguf(path).n_head_kv, D, D))
    res = fid.measure(path, text, lengths=(64, 128), n_windows=2, n_rows=8, params=[4, D], basis=basis,
                      n_threads=1, log=lambda m: None)
    layers = qkv.full_attention_layers(path)
    assert res["full_attention_layers"] == layers and len(layers) < res["n_layer"]
    summ = fid.summarize(res, "recall")
    for S in (64, 128):
        for name in (f"sparq:r={D}", f"loki:d={D}", f"pca-sparq:r={D}"):
            assert summ[(S, name)][0] == pytest.approx(1.0)
    # in the identity basis SparQ in the PCA basis is SparQ
    assert summ[(128, "pca-sparq:r=4")] == pytest.approx(summ[(128, "sparq:r=4")])
    choice = fid.per_layer_choice(res)
    assert set(choice) == {4, D} and all(m in fid.METHODS for m in choice[4]["choice"].values())


# ---- Gemma 3 270M (slow) -----------------------------------------------------------------------------

@pytest.mark.slow
def test_llama_cpp_sparq_selects_what_the_reference_selects_on_gemma3(tmp_path):
    """Gemma 3 270M (q/k RMS-normed, 4 query heads over 1 KV head of 256), 1024 tokens of held-out Austen
    as a sparse prompt plus 4 decode steps, SparQ r = 32, k = 128, l = 32: in each of its 3 full-attention
    layers the op gives the reference's output on the same q, K, V."""
    from sparq_cpp.bindings import sparse_api

    if not sparse_api.available():
        pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)")
    from sparq_cpp.real_models import fetch
    from sparq_cpp.train import evaldata

    model = fetch("gemma3-270m")
    text = evaldata.write(tmp_path)["bpc"].read_text(encoding="utf-8")
    with qkv.QKVCapture(model, layers=[], ctx_size=8) as cap:
        toks = [cap.bos] + cap.tokenize(text[:20000])[:1027]
    rep = fid.op_check(model, toks, r=32, k=128, l=32, n_decode=4)
    assert [x["layer"] for x in rep] == [5, 11, 17]
    for x in rep:
        assert x["max_rel_diff"] <= 1e-4, x
        assert x["rows_closer_than_a_swap"] >= 0.95 * x["sparse_rows"], x
