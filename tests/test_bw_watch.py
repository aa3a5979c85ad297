"""tools/micro/bw_watch.py: each round's figures come from its own measurements, and the JSON keeps them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from sparq_cpp.bindings import ggml_ops as go

if not go.has_sparq_attn():
    pytest.skip("the ggml build has no ggml_sparq_attn (set SPARQ_CPP_LIB_DIR to a patched build)",
                allow_module_level=True)

from tools.micro import bw_watch  # noqa: E402

needs_avx512 = pytest.mark.skipif(
    "avx512f" not in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else True,
    reason="sparq_floors.c needs AVX-512")


@needs_avx512
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_rounds_pair_the_op_and_the_floor_with_the_bandwidth_beside_them(tmp_path, monkeypatch):
    bws = iter([50.0, 80.0, 40.0])  # before round 0, after round 0 (= before round 1), after round 1
    monkeypatch.setattr(bw_watch.machine, "measure_bandwidth", lambda threads, passes=5: {"best_gbs": next(bws)})
    out = tmp_path / "w.json"
    res = CliRunner().invoke(bw_watch.main, ["--rounds", "2", "--n-kv", "512", "--layers", "1", "--reps", "2",
                                             "--floor-passes", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["rows"]
    assert [(r["bandwidth_before_gbs"], r["bandwidth_after_gbs"]) for r in rows] == [(50.0, 80.0), (80.0, 40.0)]
    for r in rows:
        assert r["op_ms"] > 0 and r["floor_ms"] > 0
        # per layer the floor streams 32 kv heads x 16 rows x 16384 f16 cells: its GB/s and ms agree to the
        # precision sparq_floors prints them with (GB/s to 0.1, ms to 0.001: half a last digit each)
        from_ms = 16 * 32 * 16384 * 2 / r["floor_ms"] / 1e6
        assert abs(r["floor_gbs"] - from_ms) <= 0.05 + from_ms * 0.0005 / r["floor_ms"] + 1e-9
        assert r["floor_bw_frac"] == pytest.approx(r["floor_gbs"] / 80.0)  # the higher of the two beside it
        assert r["op_bw_frac"] == pytest.approx(r["op_gbs"] / 80.0)
    assert "round  1: bandwidth  80.0 /  40.0 GB/s" in res.output


def test_unexpected_floor_output_is_an_error(tmp_path):
    exe = tmp_path / "fake"
    exe.write_text("#!/bin/sh\necho nothing useful\n")
    exe.chmod(0o755)
    with pytest.raises(bw_watch.click.ClickException, match="unexpected sparq_floors output"):
        bw_watch.floor_stream(exe, 1)
