"""`sparq-cpp bench`: the synthetic state blob is llama.cpp's own format and decodes (dense and
SparQ, f16 and q8_0 caches), the transfer model's byte counts, bad input, and a tiny full run."""
from __future__ import annotations

import ctypes
import itertools
import json

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
import llama_cpp  # noqa: E402

from sparq_cpp import Dense, Llama, SparQ, SparqError  # noqa: E402
from sparq_cpp.bench import e2e, e2e_config, e2e_memory, e2e_model, e2e_report  # noqa: E402
from sparq_cpp.bench.e2e import MODES, BenchConfig  # noqa: E402
from sparq_cpp.bench.stateblob import (KVLayout, blob_size, dequantize_q8_0, parse_state,  # noqa: E402
                                       quantize_q8_0, sparse_layout, synthetic_state)
from sparq_cpp.bench.transfer_model import token_bytes  # noqa: E402
from sparq_cpp.memory import shape_from_geometry, shape_from_gguf  # noqa: E402
from sparq_cpp.modelfactory import resolve_geometry, write_model  # noqa: E402
from sparq_cpp.bindings import sparse_api  # noqa: E402

HAS_SPARSE = sparse_api.available()
needs_sparse = pytest.mark.skipif(not HAS_SPARSE, reason="the installed llama.cpp has no sparse attention API")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    return {p: write_model(root / f"{p}.gguf", p, wtype="f32", seed=1) for p in ("tiny", "tiny-gqa")}


def open_llm(path, attention, cache_type, flash_attn=True, n_ctx=512):
    return Llama(path, attention, cache_type=cache_type, n_ctx=n_ctx, n_batch=128, n_ubatch=128,
                 flash_attn=flash_attn, n_threads=1, n_threads_batch=1, seed=0)


def get_state(llm) -> np.ndarray:
    ctx = llm._ctx.ctx
    n = llama_cpp.llama_state_seq_get_size(ctx, 0)
    buf = (ctypes.c_uint8 * n)()
    assert llama_cpp.llama_state_seq_get_data(ctx, buf, n, 0) == n
    return np.frombuffer(buf, np.uint8).copy()


def set_state(llm, blob: np.ndarray) -> None:
    ctx = llm._ctx.ctx
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    n = llama_cpp.llama_state_seq_set_data(ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), len(blob), 0)
    assert n == len(blob)


def layout_of(llm, cache_type, flash_attn=True) -> KVLayout:
    s = llm.summary
    e = s.n_head_kv * s.head_dim
    return KVLayout(s.n_layer, e, e, cache_type, not flash_attn)


def decode_logits(llm, token: int, pos: int) -> np.ndarray:
    ctx = llm._ctx.ctx
    batch = llama_cpp.llama_batch_init(1, 0, 1)
    try:
        batch.n_tokens = 1
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = token, pos, 1, 0, 1
        assert llama_cpp.llama_decode(ctx, batch) == 0
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm._model.model))
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
    finally:
        llama_cpp.llama_batch_free(batch)


# ---- the blob format ---------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
@pytest.mark.parametrize("cache_type,flash_attn", [("f16", True), ("f16", False), ("q8_0", True), ("f32", False)])
def test_blob_has_llama_cpp_format(models, preset, cache_type, flash_attn):
    """llama.cpp's own blob after a prefill and ours have the same layout, and ours loads back
    byte for byte (llama_state_seq_get_data after set_data returns exactly our bytes)."""
    llm = open_llm(models[preset], Dense(), cache_type, flash_attn)
    try:
        llm.eval(list(range(5, 105)))
        real = get_state(llm)
        lay = layout_of(llm, cache_type, flash_attn)
        ours = synthetic_state(lay, 100, seed=2)
        assert len(ours) == len(real) == blob_size(lay, 100)
        pr, po = parse_state(real), parse_state(ours)
        assert (pr.positions == po.positions).all() and pr.v_trans == po.v_trans == (not flash_attn)
        assert pr.k_types == po.k_types == [cache_type] * lay.n_layer
        assert [a.shape for a in pr.k] == [a.shape for a in po.k]
        assert [a.shape for a in pr.v] == [a.shape for a in po.v]
        n_head = 12 + 100 * 12 + 8 + 12  # magic..cells, meta, v_trans/n_layer, first K header
        assert bytes(real[:n_head]) == bytes(ours[:n_head])
        set_state(llm, ours)
        assert llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(llm._ctx.ctx), 0) == 99
        assert np.array_equal(get_state(llm), ours)
    finally:
        llm.close()


@needs_sparse
@pytest.mark.parametrize("cache_type", ["f16", "q8_0", "f32"])
def test_sparq_blob_has_llama_cpp_format(models, cache_type):
    """A SparQ context's state starts with its layout header and carries K^T (K as stored, dequantized,
    transposed): llama.cpp's blob after a prefill and ours agree, and ours loads back byte for byte."""
    llm = open_llm(models["tiny-gqa"], SparQ(r=8, k=32, l=8), cache_type)
    try:
        sparse = sparse_layout(get_state(llm))  # the empty sequence's state: the header only
        assert sparse is not None and sparse.kt and sparse.bits == 1
        llm.eval(list(range(5, 105)))
        real = get_state(llm)
        lay = layout_of(llm, cache_type)
        ours = synthetic_state(lay, 100, seed=2, sparse=sparse)
        assert len(ours) == len(real) == blob_size(lay, 100, sparse)
        pr, po = parse_state(real), parse_state(ours)
        assert len(pr.kt) == len(po.kt) == lay.n_layer
        for k_rows, kt in zip(pr.k, pr.kt):  # llama.cpp's own K^T is its K, transposed
            k = (dequantize_q8_0(k_rows, lay.n_embd_k_gqa) if cache_type == "q8_0"
                 else k_rows.view(np.float32 if cache_type == "f32" else np.float16))
            assert np.array_equal(kt.astype(np.float32), k.astype(kt.dtype).astype(np.float32).T)
        set_state(llm, ours)
        assert np.array_equal(get_state(llm), ours)
    finally:
        llm.close()


def test_blob_values_and_q8_0():
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    q = quantize_q8_0(x)
    assert q.shape == (8, 2 * 34)
    assert np.abs(dequantize_q8_0(q, 64) - x).max() <= np.abs(x).max() / 127 * 0.51 + 1e-3
    lay = KVLayout(2, 64, 64, "f16")
    std = np.stack([np.full(64, 0.5), np.full(64, 2.0)])
    p = parse_state(synthetic_state(lay, 4096, seed=3, k_std=std))
    k0, k1 = p.k[0].view(np.float16).astype(np.float32), p.k[1].view(np.float16).astype(np.float32)
    assert abs(k0.std() - 0.5) < 0.02 and abs(k1.std() - 2.0) < 0.08
    v = p.v[0].view(np.float16).astype(np.float32)
    assert abs(v.std() - 1.0) < 0.03 and abs(v.mean()) < 0.02
    # the same seed gives the same values in every layout
    pt = parse_state(synthetic_state(KVLayout(2, 64, 64, "f16", True), 4096, seed=3, k_std=std))
    assert np.array_equal(pt.v[1].view(np.float16), p.v[1].view(np.float16).T)
    with pytest.raises(SparqError, match="q8_0 V"):
        KVLayout(2, 64, 64, "q8_0", v_trans=True)


# ---- fills decode ------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("kind", ["dense", pytest.param("sparq", marks=needs_sparse)])
def test_synthetic_fill_decodes_at_fixed_depth(models, preset, cache_type, kind):
    path = models[preset]
    shape = shape_from_gguf(path)
    name = {("dense", "f16"): "dense-fa", ("dense", "q8_0"): "dense-q8kv",
            ("sparq", "f16"): "sparq", ("sparq", "q8_0"): "sparq-q8kv"}[kind, cache_type]
    cfg = e2e_config.validate(BenchConfig(model=path, depths=[300], modes=[name], threads=1, r=8, k=32, l=8))
    c = e2e._Context(path, shape, MODES[name], cfg, 300, ["synthetic"])
    try:
        assert c.attention["mode"] == (1 if kind == "sparq" else 0)
        k_std, v_std, _ = e2e_model.kv_scales(path, shape)
        assert k_std is not None and k_std.shape == (shape.n_layer, shape.n_embd_kv)
        c.fill_synthetic(300, k_std, v_std, seed=0)
        steps = [c.step(7) for _ in range(3)]  # steady steps decode at 300, 301, 302
        assert all(t > 0 and (w is None or w >= 0) for t, w in steps) and c.pos_max() == 302
        assert c.step(7, rewind=True)[0] > 0 and c.pos_max() == 302  # 302 removed, decoded again
        c.clear()
        c.fill_prefill(300, seed=0, n_vocab=shape.n_vocab)
        assert c.step(7)[0] > 0 and c.pos_max() == 300
    finally:
        c.close()


@needs_sparse
@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_sparq_after_state_load_equals_sparq_after_prefill(models, preset):
    """SparQ keeps a transposed K copy and V sums that the state does not hold: after a load they
    are rebuilt. Same state -> same logits as the context that computed it."""
    path = models[preset]
    att = SparQ(r=8, k=32, l=8)
    a = open_llm(path, att, "f16")
    b = open_llm(path, att, "f16")
    try:
        a.eval(list(np.random.default_rng(1).integers(3, 2000, 200)))
        blob = get_state(a)
        set_state(b, blob)
        la, lb = decode_logits(a, 11, 200), decode_logits(b, 11, 200)
        assert np.abs(la - lb).max() <= 1e-4 * np.abs(la).max()
    finally:
        a.close()
        b.close()


@needs_sparse
def test_sparq_selecting_everything_matches_dense_after_synthetic_fill(models):
    path = models["tiny-gqa"]
    d = open_llm(path, Dense(), "f16")
    s = open_llm(path, SparQ(r=8, k=512, l=8), "f16")
    try:
        blob = synthetic_state(layout_of(d, "f16"), 300, seed=5)
        set_state(d, blob)
        set_state(s, blob)
        ld, ls = decode_logits(d, 11, 300), decode_logits(s, 11, 300)
        assert np.abs(ld - ls).max() <= 2e-3 * np.abs(ld).max()
    finally:
        d.close()
        s.close()


# ---- transfer model ----------------------------------------------------------------------

def test_transfer_model_bytes_by_hand():
    shape = shape_from_geometry(resolve_geometry("llama2-7b", wtype="q8_0"), "q8_0")
    # per layer: q, k, v, o (4096 x 4096) + gate, up, down (11008 x 4096) at 34/32 bytes; 2 f32 norms
    per_layer = (4 * 4096 * 4096 + 3 * 11008 * 4096) * 34 // 32 + 2 * 4096 * 4
    assert per_layer == 215_056_384
    head, emb_row, out_norm = 32000 * 4096 * 34 // 32, 4096 * 34 // 32, 4096 * 4
    assert shape.weight_bytes_per_token == 32 * per_layer + head + emb_row + out_norm == 7_021_089_024
    assert shape.weight_bytes == 32 * per_layer + 2 * head + out_norm
    S = 4095  # n = 4096 visible positions
    dense = token_bytes(shape, "dense", S, "f16")
    assert dense["kv"] == 32 * 32 * (2 * 4096 * 128 + 2 * 128) * 2 == 2_148_007_936
    sparq = token_bytes(shape, "sparq", S, "f16", r=16, k=128)
    # n*r f16 from K^T + (2k*D + 2*D) f16 + 2*D f32 (V sum read and write)
    assert sparq["kv"] == 32 * 32 * (4096 * 16 * 2 + (2 * 128 * 128 + 2 * 128) * 2 + 2 * 128 * 4) == 202_899_456
    q8 = token_bytes(shape, "dense", S, "q8_0")
    assert q8["kv"] == 32 * 32 * (2 * 4096 * 128 + 2 * 128) * 34 / 32
    loki = token_bytes(shape, "loki", S, "f16", d=32, k=128)
    # + each head's f32 basis, read to rotate q and the new k
    assert loki["kv"] == 32 * 32 * ((4096 * 32 + 2 * 128 * 128 + 2 * 128) * 2 + 128 * 128 * 4)
    assert dense["total"] == dense["weights"] + dense["kv"]
    # k >= n: SparQ reads every row
    assert token_bytes(shape, "sparq", 63, "f16", r=16, k=128)["kv"] == 32 * 32 * (64 * 16 * 2 + (2 * 64 * 128 + 256) * 2 + 1024)


def test_shape_from_gguf_matches_geometry(tmp_path):
    path = write_model(tmp_path / "m.gguf", "tiny-gqa", wtype="q8_0", layers=3)
    a = shape_from_gguf(path)
    b = shape_from_geometry(resolve_geometry("tiny-gqa", wtype="q8_0", layers=3), "q8_0")
    assert a == b


def test_memory_estimate_and_layer_choice():
    geo = resolve_geometry("llama2-7b", wtype="q8_0", layers=8)
    shape = shape_from_geometry(geo, "q8_0")
    est = e2e_memory.estimate_memory(shape, MODES["sparq"], 32768, ["synthetic"])
    n_ctx = 32768 + 256
    assert est["kv_cache"] == 2 * 8 * n_ctx * 4096 * 2 and est["k_transposed"] == 8 * n_ctx * 4096 * 2
    assert est["total"] == sum(v for k, v in est.items() if k != "total")
    assert e2e_memory.estimate_memory(shape, MODES["dense-fa"], 32768, ["synthetic"])["k_transposed"] == 0
    cfg = BenchConfig(depths=[32768], modes=["dense-fa", "sparq"])

    def geo_for(L):
        return shape_from_geometry(resolve_geometry("llama2-7b", wtype="q8_0", layers=L), "q8_0")

    per = e2e_memory.depth_estimate(geo_for(9), cfg, 32768)["total"]
    assert e2e_memory.choose_layers(geo_for, cfg, per, 32) == 8  # 9 fit, rounded down to a multiple of 4
    assert e2e_memory.choose_layers(geo_for, cfg, 10**8, 32) == 0
    # modes share a depth's timing window where their contexts fit together
    cfg4 = BenchConfig(depths=[32768], modes=["dense-fa", "dense-nofa", "dense-q8kv", "sparq"])
    s8 = geo_for(8)
    one = e2e_memory.group_estimate(s8, cfg4, 32768, ["dense-fa"])
    two = e2e_memory.group_estimate(s8, cfg4, 32768, ["dense-fa", "dense-nofa"])
    assert two["weights"] == one["weights"] and two["kv_cache"] == 2 * one["kv_cache"]
    assert e2e_memory.plan_groups(s8, cfg4, 32768, 10**12) == [cfg4.modes]
    assert e2e_memory.plan_groups(s8, cfg4, 32768, two["total"]) == [["sparq"], ["dense-fa", "dense-nofa"], ["dense-q8kv"]]
    # the baseline given shares the sparse modes' window
    pair = e2e_memory.group_estimate(s8, cfg4, 32768, ["dense-nofa", "sparq"])["total"]
    assert e2e_memory.plan_groups(s8, cfg4, 32768, pair, "dense-nofa") == [["dense-nofa", "sparq"], ["dense-fa", "dense-q8kv"]]
    # ... the faster of the baselines at the deepest depth measured so far
    rec = [{"depth": d, "mode": m, "fill": "synthetic", "median_s": t} for d, m, t in
           [(1024, "dense-fa", 1.0), (1024, "dense-nofa", 2.0), (2048, "dense-fa", 3.0), (2048, "dense-nofa", 2.5),
            (2048, "sparq", 0.1)]]
    assert e2e_report.faster_baseline(rec[:2]) == "dense-fa" and e2e_report.faster_baseline(rec) == "dense-nofa"
    assert e2e_report.faster_baseline(rec[-1:]) is None
    assert e2e_memory.plan_groups(s8, cfg4, 32768, 0) == [["sparq"], ["dense-fa"], ["dense-nofa"], ["dense-q8kv"]]
    assert e2e_memory.plan_groups(s8, BenchConfig(**{**cfg4.__dict__, "interleave": False}), 32768, 10**12) == \
        [[m] for m in cfg4.modes]


# ---- bad input ---------------------------------------------------------------------------

def test_parse_depths_and_modes():
    assert e2e_config.parse_depths("1k,2k,512,1k") == [512, 1024, 2048]
    for bad in ("", "1x", "0", "-1k"):
        with pytest.raises(SparqError, match="--depths"):
            e2e_config.parse_depths(bad)
    with pytest.raises(SparqError, match="unknown mode 'sparse'"):
        e2e_config.parse_modes("dense-fa,sparse")


def test_bad_input_errors(models, tmp_path):
    tiny = models["tiny"]
    base = dict(model=tiny, depths=[64], modes=["dense-fa"], threads=1, repeats=1, warmup=0, progress=False,
                bandwidth_bytes=1 << 24)
    with pytest.raises(SparqError, match="beyond the model's context"):
        e2e.run(BenchConfig(**{**base, "depths": [8192]}), log=lambda s: None)
    with pytest.raises(SparqError, match=r"depth 64 does not fit this machine's memory: estimated peak"):
        e2e.run(BenchConfig(**{**base, "mem_fraction": 1e-6}), log=lambda s: None)
    with pytest.raises(SparqError, match="does not exist"):
        e2e_config.validate(BenchConfig(**{**base, "json_path": tmp_path / "nope" / "x.json"}))
    with pytest.raises(SparqError, match="is a directory"):
        e2e_config.validate(BenchConfig(**{**base, "plot_path": tmp_path}))
    with pytest.raises(SparqError, match="--mem-fraction"):
        e2e_config.validate(BenchConfig(**{**base, "mem_fraction": 0}))
    with pytest.raises(SparqError, match="--sparse-l: SparQ's l"):
        e2e_config.validate(BenchConfig(**{**base, "k": 8, "l": 9}))
    with pytest.raises(SparqError, match="--fill"):
        e2e_config.validate(BenchConfig(**{**base, "fill": "magic"}))
    with pytest.raises(SparqError, match="--sparse-l: Loki's l"):
        e2e_config.validate(BenchConfig(**{**base, "k": 8, "l": 2, "loki_l": 9}))
    with pytest.raises(SparqError, match="--loki-pca: file not found"):
        e2e_config.validate(BenchConfig(**{**base, "loki_pca": tmp_path / "missing.gguf"}))
    with pytest.raises(SparqError, match="model file not found"):
        e2e.run(BenchConfig(**{**base, "model": tmp_path / "missing.gguf"}), log=lambda s: None)


def test_cli_bad_input_one_line_exit_2(models, tmp_path):
    import click
    from click.testing import CliRunner

    from sparq_cpp.cli import bench
    from sparq_cpp.cli.runner import SparqGroup

    @click.group(cls=SparqGroup)
    def cli():
        pass

    cli.add_command(bench.command)
    runner = CliRunner()
    for args, needle in ((["--modes", "dense-fa,bogus"], "unknown mode 'bogus'"),
                         (["--depths", "1k,two"], "--depths"),
                         (["--modes", "dense-fa", "--json", str(tmp_path / "no" / "r.json")], "--json"),
                         (["--modes", "dense-fa", "--depths", "64k"], "beyond the model's context")):
        res = runner.invoke(cli, ["bench", "--model", str(models["tiny"]), "--no-progress", *args])
        assert res.exit_code == 2, (args, res.output)
        lines = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and needle in lines[0], (args, res.output)


# ---- a tiny full run ---------------------------------------------------------------------

def test_tiny_bench_writes_json_and_png(models, tmp_path):
    modes = ["dense-fa", "dense-nofa"] + (["sparq"] if HAS_SPARSE else []) + (["loki"] if HAS_SPARSE else [])
    cfg = BenchConfig(model=models["tiny-gqa"], depths="64,256", modes=modes, threads=1, repeats=2, rounds=2, warmup=1,
                      fill="both", r=8, k=32, l=8, d=16, json_path=tmp_path / "r.json", plot_path=tmp_path / "r.png",
                      bandwidth_bytes=1 << 25, progress=False)
    logs = []
    doc = e2e.run(cfg, log=logs.append)
    assert any("estimated peak" in s for s in logs) and any("bandwidth" in s for s in logs)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["schema"] == e2e_config.SCHEMA
    assert data["machine"]["threads"] == 1 and data["machine"]["bandwidth"]["best_gbs"] > 0
    assert data["machine"]["cpu_model"] and data["machine"]["mem_total_bytes"] > 0
    assert "build" in data["machine"]
    assert len(data["results"]) == 2 * len(modes) * 2  # depths x modes x fills
    for r in data["results"]:
        assert len(r["samples_s"]) >= 4 and len(r["warmup_s"]) == 2 and r["median_s"] > 0 and len(r["rounds"]) == 2
        assert len(r["disturbed"]) == len(r["run_queue_wait_s"]) == len(r["samples_s"])
        assert r["n_used"] >= 1 and r["timed_with"] == modes  # tiny: every mode fits at once
        assert r["bytes"]["total"] > r["bytes"]["weights"] > 0
    assert len(data["fill_agreement"]) == 2 * len(modes)
    summ = {(r["depth"], r["mode"]): r for r in data["summary"]}
    if HAS_SPARSE:
        s = summ[256, "sparq"]
        assert s["speedup"] > 0 and s["bound"] > 0 and s["baseline"] in ("dense-fa", "dense-nofa")
        assert s["fraction_of_bound"] == pytest.approx(s["speedup"] / s["bound"])
        base = {r["mode"]: r for r in data["results"] if r["depth"] == 256 and r["fill"] == "synthetic"}
        want = [b["median_s"] / x["median_s"] for b, x in zip(base[s["baseline"]]["rounds"], base["sparq"]["rounds"])]
        assert s["speedup_rounds"] == pytest.approx(want) and len(want) == 2
    if HAS_SPARSE:
        assert data["loki_basis"].startswith("synthetic")
        assert [r["attention"]["mode"] for r in data["results"] if r["mode"] == "loki"] == [2] * 4
        assert summ[256, "loki"]["speedup"] > 0
    png = (tmp_path / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp"))
    table = e2e_report.format_table(doc)
    assert "median ms" in table and "fill agreement" in table and "2 rounds" in table
    if HAS_SPARSE:
        lo, hi = min(s["speedup_rounds"]), max(s["speedup_rounds"])
        assert f"{lo:>5.2f}-{hi:.2f}x" in table


def test_rounds_pool_their_steps():
    """--rounds: one record per (S, mode, fill), the rounds' steps pooled, each round's median kept."""
    def rec(rnd, samples, disturbed=None):
        return {"depth": 1024, "mode": "sparq", "fill": "synthetic", "round": rnd, "samples_s": samples,
                "run_queue_wait_s": [0.0] * len(samples), "disturbed": disturbed or [False] * len(samples),
                "warmup_s": [9.0], "fill_s": 1.0, "bytes": {"total": 1e9}, "timed_with": ["sparq"],
                "other_processes_cpu_share": 0.0, "waited_for_quiet_s": 0.0, "median_s": float(np.median(samples)),
                "q1_s": 0.0, "q3_s": 0.0, "n_used": len(samples)}
    other = {**rec(0, [5.0, 5.0]), "mode": "dense-fa"}
    # round 1 hit a slow spell: its steps are outvoted by rounds 0 and 2
    out = e2e.pool_rounds([rec(0, [1.0, 1.1, 1.2]), other, rec(1, [3.0, 3.1, 3.2]),
                           rec(2, [1.05, 1.15, 9.0], [False, False, True])], repeats=3)
    assert len(out) == 2
    p = next(r for r in out if r["mode"] == "sparq")
    assert "round" not in p and len(p["rounds"]) == 3 and len(p["samples_s"]) == 9 and p["fill_s"] == 3.0
    assert [r["median_s"] for r in p["rounds"]] == [1.1, 3.1, 1.15]
    assert p["n_used"] == 8 and p["median_s"] == pytest.approx(1.175) and p["effective_gbs"] == pytest.approx(1 / 1.175)


def test_round_speedups_pair_rounds_of_one_window():
    def rec(medians):
        return {"rounds": [{"median_s": m} for m in medians]}
    assert e2e_report._round_speedups(rec([2.0, 3.0, 4.0]), rec([1.0, 2.0, 2.0])) == [2.0, 1.5, 2.0]
    assert e2e_report._round_speedups(rec([2.0]), rec([1.0])) is None            # one round: the pooled speed-up says it all
    assert e2e_report._round_speedups(rec([2.0, 3.0]), rec([1.0, 2.0, 2.0])) is None


def test_memory_is_checked_before_the_model_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARQ_CPP_CACHE", str(tmp_path / "cache"))
    cfg = BenchConfig(preset="llama2-7b", layers=1, depths=[1024], modes=["dense-fa"], threads=1,
                      mem_fraction=1e-6, progress=False)
    with pytest.raises(SparqError, match="does not fit this machine's memory"):
        e2e.run(cfg, log=lambda s: None)
    with pytest.raises(SparqError, match="even with 1 layer"):
        e2e.run(BenchConfig(**{**cfg.__dict__, "layers": None}), log=lambda s: None)
    assert not list((tmp_path / "cache").rglob("*.gguf"))


def test_disturbed_steps_are_retaken_and_flagged(models, monkeypatch):
    """Steps during which our threads waited for a CPU are marked, retaken (boundedly), and when
    too few steps were quiet the statistics use every step and say so."""
    from sparq_cpp.bench import machine

    waits = iter(range(0, 10**12, 10**9))  # every reading 1 s later than the last: always disturbed
    monkeypatch.setattr(machine, "run_queue_wait_ns", lambda: next(waits))
    cfg = BenchConfig(model=models["tiny"], depths=[64], modes=["dense-fa"], threads=1, repeats=3, warmup=0,
                      max_extra_steps=2, bandwidth_bytes=1 << 24, progress=False)
    doc = e2e.run(cfg, log=lambda s: None)
    (r,) = doc["results"]
    assert all(r["disturbed"]) and len(r["samples_s"]) == 3 + 2
    assert r["stats_from"].startswith("all steps") and r["n_used"] == 5
    assert "5/5!" in e2e_report.format_table(doc)


def test_bench_compare(tmp_path):
    """bench-compare: step times and speed-ups of two runs side by side (a rerun, or interleaved against
    alone), the ones off by more than the tolerance marked; files that are not bench JSON are refused by name."""
    from sparq_cpp.bench.compare import compare, format_comparison, load

    def doc(steps):
        base = 0.1
        return {"schema": e2e_config.SCHEMA, "summary": [
            {"depth": d, "mode": m, "median_s": t, "speedup": base / t} for (d, m), t in steps.items()] +
            [{"depth": 1024, "mode": "dense-nofa", "median_s": base, "speedup": None}]}
    a = doc({(1024, "sparq"): 0.1, (4096, "sparq"): 0.05, (4096, "loki"): 0.07})
    b = doc({(1024, "sparq"): 0.1 / 1.05, (4096, "sparq"): 0.05 / 0.85})
    rows = compare(a, b)
    assert [(r["depth"], r["mode"], r["agree"]) for r in rows] == \
        [(1024, "sparq", True), (4096, "sparq", False), (1024, "dense-nofa", True)]
    assert rows[1]["rel_diff"] == pytest.approx(-0.15)
    assert rows[1]["step_rel_diff"] == pytest.approx(1 / 0.85 - 1)
    assert rows[2]["rel_diff"] is None and rows[2]["step_rel_diff"] == 0
    text = format_comparison(rows)
    assert "2 of 3 (S, mode) reproduced within 10%" in text and "-15.0%  !" in text
    (tmp_path / "a.json").write_text(json.dumps(a))
    assert load(tmp_path / "a.json") == a
    (tmp_path / "bad.json").write_text('{"schema": "other"}')
    for path, msg in ((tmp_path / "bad.json", "not a `sparq-cpp bench --json` file"),
                      (tmp_path / "none.json", "no such file")):
        with pytest.raises(SparqError, match=msg):
            load(path)
    with pytest.raises(SparqError, match="no \\(S, mode\\)"):
        compare(a, {"schema": e2e_config.SCHEMA, "summary": [{"depth": 8192, "mode": "sparq", "median_s": 0.1}]})


def test_model_shape_takes_the_head_size_the_model_sets(tmp_path):
    """qwen3 and gemma3 set their head size (key_length) apart from n_embd / n_head: the KV bytes follow it."""
    from sparq_cpp.modelfactory import resolve_geometry, write_model

    for preset in ("tiny-qwen3", "tiny-gemma3"):
        geo = resolve_geometry(preset)
        assert geo.head_dim != geo.n_embd // geo.n_head
        path = write_model(tmp_path / f"{preset}.gguf", preset)
        assert shape_from_gguf(path).head_dim == geo.head_dim == shape_from_geometry(geo, "f32").head_dim


def test_interleaved_modes_take_turns_of_block_steps(models, monkeypatch):
    """--block: interleaved modes run in turns of `block` timed steps, each after one untimed step (kept as
    settle_s), so that a mode's timed steps follow its own steps, not another mode's."""
    calls = []
    step = e2e._Context.step

    def spy(self, token, rewind=False):
        calls.append((self.mode.name, rewind))
        return step(self, token, rewind)

    monkeypatch.setattr(e2e._Context, "step", spy)
    cfg = BenchConfig(model=models["tiny"], depths=[64], modes=["dense-fa", "dense-nofa"], threads=1, repeats=5,
                      warmup=0, block=2, bandwidth_bytes=1 << 24, progress=False, disturbed_frac=1e9)
    doc = e2e.run(cfg, log=lambda s: None)
    steady = [m for m, rw in calls if not rw][2:]  # after each context's first step
    # turns: settle + 2, settle + 2, settle + 1 per mode, alternating
    runs = [len(list(g)) for _, g in itertools.groupby(steady)]
    assert runs == [3, 3, 3, 3, 2, 2]
    for r in doc["results"]:
        assert r["block"] == 2 and len(r["samples_s"]) == 5
        assert len(r["settle_s"]) == 3 + 3  # steady turns, then rewind turns
        assert len(r["rewind_step_s"]) == 5
