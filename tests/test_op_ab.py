"""tools/micro/op_ab.py: each variant's variables are set exactly while that variant is timed."""
from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from sparq_cpp.bindings import ggml_ops as go

if not go.has_sparq_attn():
    pytest.skip("the ggml build has no ggml_sparq_attn (set SPARQ_CPP_LIB_DIR to a patched build)",
                allow_module_level=True)

from tools.micro import op_ab  # noqa: E402


def test_variants_alternate_with_their_variables(monkeypatch):
    monkeypatch.delenv("OPAB_X", raising=False)
    seen = []  # OPAB_X at each compute, after the graphs are built
    real = go.Graph.compute

    def compute(self, n_threads=2):
        seen.append(os.environ.get("OPAB_X"))
        return real(self, n_threads)

    monkeypatch.setattr(go.Graph, "compute", compute)
    res = CliRunner().invoke(op_ab.main, ["-v", "-", "-v", "OPAB_X=3", "--n-kv", "512", "--layers", "1",
                                          "--passes", "2", "--reps", "2"])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("cold sparq f16 n_kv 512, 32 kv heads, -:") and "OPAB_X=3:" in lines[1]
    assert "to -: 1.000x" in lines[0]
    # two graphs built (one compute each), then per pass and variant: (evict, timed) x reps
    timed = seen[2:]
    assert len(timed) == 2 * 2 * 2 * 2
    assert timed == ([None] * 4 + ["3"] * 4) * 2
    assert "OPAB_X" not in os.environ


def test_bad_variant_is_refused():
    res = CliRunner().invoke(op_ab.main, ["-v", "NOEQUALS"])
    assert res.exit_code != 0 and "NAME=VALUE" in res.output
