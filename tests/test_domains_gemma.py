"""The per-domain probe on Gemma 3 270M at 1/8 (slow): calibrate's end-to-end probe and `sparq-cpp eval --domain`
on two held-out domains, through llama.cpp's decode path; the fields each writes."""
from __future__ import annotations

import json
import math

import pytest

from sparq_cpp.calib.budget import candidates
from sparq_cpp.calib.probe import probe
from sparq_cpp.gguf_check import check_gguf
from sparq_cpp.real_models import fetch
from sparq_cpp.train import domains

from conftest import run_cli

S = 1024
TWO = ("prose", "code")


@pytest.fixture(scope="module")
def gemma():
    return fetch("gemma3-270m")


@pytest.fixture(scope="module")
def held():
    return domains.heldout_texts(domains.cached())


@pytest.mark.slow
def test_probe_scores_each_domain_on_gemma3(gemma, held):
    """The probe of two candidates at 1/8 (SparQ, Loki's with the first position kept would need a basis: SparQ with
    and without the sink) on the two domains: a loss per candidate and domain, dense's per domain, the worst kept as
    probe_text."""
    D = check_gguf(gemma).head_dim
    cands = [c for c in candidates((1 / 8,), S, D) if c["method"] == "sparq"]
    idx = [0, len(cands) - 1]
    got = probe(gemma, None, held["prose"], cands, idx, S=S, n_samples=1, n_threads=2,
                domains={d: held[d] for d in TWO}, own_text=False)
    assert got["domains"] == list(TWO) and len(got["domain_dense"]) == 2
    assert all(0.1 < x < 5 for x in got["domain_dense"])  # a working model: bits per character of real text
    assert len(got["domain_text"]) == len(cands) and all(len(row) == 2 for row in got["domain_text"])
    for i in range(len(cands)):
        row = got["domain_text"][i]
        assert all(math.isfinite(x) for x in row) and got["text"][i] == max(row)
        assert (i in idx) == bool(got["probed"][i]) and (i in idx or row == [0.0, 0.0])
    assert got["dense_copy"] > 0 and all(math.isfinite(x) for x in got["copy"])


@pytest.mark.slow
def test_eval_reports_each_domain_on_gemma3(gemma, held, tmp_path):
    """`sparq-cpp eval --domain` at 1/8 on two domains (2 windows each): records per domain and the "domains" summary
    (each domain's loss against dense on the same windows, relative, with its standard error; the worst named)."""
    args = []
    for d in TWO:
        (tmp_path / f"{d}.txt").write_text(held[d], encoding="utf-8")
        args += ["--domain", f"{d}={tmp_path / f'{d}.txt'}"]
    out = tmp_path / "e.json"
    proc = run_cli("eval", "--model", "gemma3-270m", "--tasks", "", *args, "--methods", "dense,sparq",
                   "--ratios", "1,1/8", "--samples", "2", "--context", str(S - 64), "--continuation", "64",
                   "--threads", "2", "--no-progress", "--json", out, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert {r["task"] for r in doc["records"]} == {f"bpc:{d}" for d in TWO}
    [entry] = doc["domains"]
    assert entry["method"] == "sparq" and entry["target"] == 0.125 and set(entry["domains"]) == set(TWO)
    for d, v in entry["domains"].items():
        assert v["n"] == 2 and 0.1 < v["dense"] < 5 and math.isfinite(v["rel"]) and v["rel_stderr"] >= 0
        dense = [r["score"] for r in doc["records"] if r["task"] == f"bpc:{d}" and r["method"] == "dense"]
        assert abs(v["dense"] - sum(dense) / len(dense)) < 1e-12
        assert -0.5 < v["rel"] < 1.0  # SparQ at 1/8 neither breaks the model nor beats dense by half
    assert entry["worst"] in TWO and entry["worst_rel"] == max(v["rel"] for v in entry["domains"].values())
