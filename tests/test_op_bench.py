"""sparq_cpp/bench/op_bench.py on a tiny geometry: it times the SparQ, Loki and flash-attention graphs, and
writes a row per n_kv with the bytes docs/spec.md's formulas give, and the bandwidth measured at the start
and after every row (the last of those is the end's)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sparq_cpp.bench import op_bench
from sparq_cpp.bindings import ggml_ops as go

if not go.has_sparq_attn():
    pytest.skip("the ggml build has no SPARSE_ATTN op (set SPARQ_CPP_LIB_DIR to a patched build)",
                allow_module_level=True)


def test_tiny_op_bench_writes_rows(tmp_path, monkeypatch):
    measured = iter([40.0, 50.0, 60.0])  # start, after 256, after 512
    monkeypatch.setattr(op_bench, "measure_bandwidth", lambda threads: (next(measured), "stub"))
    out = tmp_path / "op.json"
    res = CliRunner().invoke(op_bench.main, ["--n-kv", "256,512", "--n-head", "4", "--n-head-kv", "2", "-r", "8",
                                             "-k", "32", "-l", "8", "--loki-d", "8", "--reps", "3",
                                             "--mem-budget-gb", "0.001", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "read bandwidth at the end: 60.0 GB/s" in res.output
    doc = json.loads(out.read_text())
    assert doc["bandwidth_gbs"] == 40.0 and doc["bandwidth_end_gbs"] == 60.0
    assert [r["n_kv"] for r in doc["rows"]] == [256, 512]
    assert [(r["bandwidth_before_gbs"], r["bandwidth_after_gbs"]) for r in doc["rows"]] == [(40.0, 50.0), (50.0, 60.0)]
    for row in doc["rows"]:
        n = row["n_kv"]
        assert row["layers"] == 2
        # docs/spec.md's transfer formulas in llama.cpp's types (sparq_cpp.transfer), f16: per kv head n*r + 2*k*D
        # + 2*D elements and v_mean's 2*D in f32 (SparQ), 2*n*D + 2*D (dense)
        assert row["sparq_bytes"] == 2 * (2 * (n * 8 + 2 * 32 * 128 + 2 * 128) + 4 * 2 * 128)
        assert row["dense_bytes"] == 2 * 2 * (2 * n * 128 + 2 * 128)
        assert row["loki_bytes"] == 2 * 2 * (n * 8 + 2 * 32 * 128 + 2 * 128)
        for m in ("sparq", "dense", "loki"):
            assert 0 < row[f"{m}_min_s"] <= row[f"{m}_s"]
        for m in ("sparq", "loki"):
            assert row[f"{m}_bw_frac"] == pytest.approx(row[f"{m}_bytes"] / row[f"{m}_s"] / 1e9 / 40.0)
            assert row[f"{m}_bw_frac_end"] == pytest.approx(row[f"{m}_bw_frac"] * 40.0 / 60.0)
            # against the higher of the measurements just before and just after the row
            assert row[f"{m}_bw_frac_adj"] == pytest.approx(row[f"{m}_bw_frac"] * 40.0 / row["bandwidth_after_gbs"])
            assert row[f"{m}_speedup"] == pytest.approx(row["dense_s"] / row[f"{m}_s"])


def test_pages_4k_turns_numpy_huge_pages_off_for_the_run(tmp_path, monkeypatch):
    multiarray = pytest.importorskip("numpy._core.multiarray")
    monkeypatch.setattr(op_bench, "measure_bandwidth", lambda threads: (40.0, "stub"))
    seen = []  # numpy's setting while the caches are built
    real = op_bench.time_layers

    def probe(*a, **kw):
        seen.append(multiarray._get_madvise_hugepage())
        return real(*a, **kw)

    monkeypatch.setattr(op_bench, "time_layers", probe)
    before = op_bench._numpy_huge_pages(True)
    out = tmp_path / "op.json"
    args = ["--n-kv", "256", "--n-head", "2", "--n-head-kv", "1", "-r", "8", "-k", "32", "-l", "8",
            "--loki-d", "0", "--reps", "1", "--mem-budget-gb", "0.001", "--json", str(out)]
    try:
        res = CliRunner().invoke(op_bench.main, args + ["--pages", "4k"])
        assert res.exit_code == 0, res.output
        assert json.loads(out.read_text())["pages"] == "4k"
        assert seen == [False]
        assert multiarray._get_madvise_hugepage() is True  # restored after the run
        seen.clear()
        res = CliRunner().invoke(op_bench.main, args)
        assert res.exit_code == 0, res.output
        assert json.loads(out.read_text())["pages"] == "huge" and seen == [True]
    finally:
        op_bench._numpy_huge_pages(before)


@pytest.mark.parametrize("n_kv", ["", "1k", "0,512"])
def test_bad_n_kv_is_a_clear_error(n_kv, monkeypatch):
    monkeypatch.setattr(op_bench, "measure_bandwidth", lambda threads: (40.0, "stub"))
    res = CliRunner().invoke(op_bench.main, ["--n-kv", n_kv])
    assert res.exit_code == 2 and "--n-kv" in res.output, res.output


def test_several_sequences_decode_together(tmp_path, monkeypatch):
    """--n-seq: a query row per sequence over its own cells of one cache; a step's bytes are n_seq times one
    sequence's, and each row compares its time with n_seq steps of one sequence."""
    monkeypatch.setattr(op_bench, "measure_bandwidth", lambda threads: (50.0, "stub"))
    out = tmp_path / "op.json"
    res = CliRunner().invoke(op_bench.main, ["--n-kv", "256", "--n-seq", "1,3", "--n-head", "4", "--n-head-kv", "2",
                                             "-r", "8", "-k", "32", "-l", "8", "--loki-d", "8", "--reps", "3",
                                             "--mem-budget-gb", "0.001", "--json", str(out)])
    assert res.exit_code == 0, res.output
    one, three = json.loads(out.read_text())["rows"]
    assert (one["n_seq"], three["n_seq"]) == (1, 3)
    for m in ("sparq", "dense", "loki"):
        assert three[f"{m}_bytes"] == 3 * one[f"{m}_bytes"]
        assert three[f"{m}_vs_separate"] == pytest.approx(three[f"{m}_s"] / (3 * one[f"{m}_s"]))
    res = CliRunner().invoke(op_bench.main, ["--n-seq", "0"])
    assert res.exit_code != 0 and "sequence counts must be at least 1" in res.output


def test_several_sequences_see_only_their_own_cells():
    """The mask the bench gives: row s sees sequence s's cells, which is what makes the rows independent."""
    import numpy as np

    from sparq_cpp.bindings.ggml_ops import sparq_attn

    rng = np.random.default_rng(0)
    n_kv, H, D = 64, 2, 16
    q, kk, vv, _ = op_bench.random_layer(rng, n_kv, H, H, D, n_seq=2)
    mask = np.kron(np.eye(2, dtype=bool), np.ones((1, n_kv), dtype=bool))
    pos = np.tile(np.arange(n_kv, dtype=np.int32), 2)
    both = sparq_attn(q, kk, vv, mask, pos, 0.25, 16, n_kv, 0, mean_value=False)
    alone = sparq_attn(q[1:], kk[n_kv:], vv[n_kv:], np.ones((1, n_kv), bool), pos[:n_kv], 0.25, 16, n_kv, 0,
                       mean_value=False)
    np.testing.assert_allclose(both[1], alone[0], rtol=2e-3, atol=2e-3)


def test_phases_need_the_counters_and_are_accounted(tmp_path, monkeypatch):
    """--phases reads the kernel's phase counters (a profiling build): without them it says how to build one; with
    them (stood in for here: the installed build has none) each method's row gets per-phase ms and the bytes of
    the ranking (its K^T rows, or Loki's prefixes) and of the attention (the rest of the transfer formula)."""
    monkeypatch.setattr(op_bench, "measure_bandwidth", lambda threads: (50.0, "stub"))
    args = ["--n-kv", "256", "--n-head", "4", "--n-head-kv", "2", "-r", "8", "-k", "32", "-l", "8", "--loki-d", "8",
            "--reps", "2", "--mem-budget-gb", "0.001", "--phases"]
    if go.sparse_attn_phases() is None:
        res = CliRunner().invoke(op_bench.main, args)
        assert res.exit_code != 0 and "GGML_SPARSE_ATTN_PROFILE" in str(res.exception), res.output
    monkeypatch.setattr(go, "sparse_attn_phases", lambda: (4_000_000, 1_000_000, 2_000_000))
    out = tmp_path / "op.json"
    res = CliRunner().invoke(op_bench.main, args + ["--json", str(out)])
    assert res.exit_code == 0, res.output
    row = json.loads(out.read_text())["rows"][0]
    for m, width in (("sparq", 8), ("loki", 8)):
        p = row[f"{m}_phases"]
        assert p["rank_bytes"] == 2 * 256 * width * 2
        assert p["rank_bytes"] + p["attend_bytes"] == row[f"{m}_bytes"]
        assert p["rank_ms"] > 0 and p["select_ms"] > 0 and p["attend_ms"] > 0
    assert "sparq phases: rank" in res.output


def test_a_q8_0_cache(tmp_path, monkeypatch):
    """--cache-type q8_0: K and V rows in q8_0 (34 bytes per 32 values), SparQ's K^T f16, Loki's prefix read in
    whole q8_0 blocks (docs/spec.md's transfer formulas in llama.cpp's types, sparq_cpp.transfer)."""
    monkeypatch.setattr(op_bench, "measure_bandwidth", lambda threads: (50.0, "stub"))
    out = tmp_path / "op.json"
    res = CliRunner().invoke(op_bench.main, ["--n-kv", "256", "--n-head", "4", "--n-head-kv", "2", "-r", "8",
                                             "-k", "32", "-l", "8", "--loki-d", "8", "--reps", "2",
                                             "--mem-budget-gb", "0.001", "--cache-type", "q8_0", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    row = doc["rows"][0]
    assert doc["cache_type"] == "q8_0"
    assert row["sparq_bytes"] == pytest.approx(2 * (256 * 8 * 2 + (2 * 32 * 128 + 2 * 128) * 34 / 32 + 2 * 128 * 4))
    assert row["loki_bytes"] == pytest.approx(2 * (256 * 32 + 2 * 32 * 128 + 2 * 128) * 34 / 32)
    assert row["dense_bytes"] == pytest.approx(2 * (2 * 256 * 128 + 2 * 128) * 34 / 32)
