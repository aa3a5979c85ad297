"""--attn auto: the fidelity calibrate measures and stores, and the setting auto resolves to from it."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from sparq_cpp import Llama, transfer  # noqa: E402
from sparq_cpp.attention import Auto, Dense, Loki, SparQ, parse_attention, spec  # noqa: E402
from sparq_cpp.auto import choose, known_poor, read_fidelity, resolve  # noqa: E402
from sparq_cpp.calib import calibrate, write_projection  # noqa: E402
from sparq_cpp.calib.budget import candidates, measure_budget, selection  # noqa: E402
from sparq_cpp.calib.probe import pick  # noqa: E402
from sparq_cpp.cli.generate import attention_from_options  # noqa: E402
from sparq_cpp.errors import SparqError  # noqa: E402
from sparq_cpp.gguf_check import check_gguf  # noqa: E402
from sparq_cpp.modelfactory import default_model_path  # noqa: E402

from conftest import assert_one_line_error, calibration_text, run_cli  # noqa: E402

CTX = 512


@functools.lru_cache(maxsize=None)
def _measured(preset):
    path = default_model_path(preset)
    text = calibration_text(6000)
    pca = calibrate(path, text, n_tokens=1024, ctx_size=CTX, n_threads=2)
    fid = measure_budget(path, text, basis=pca.components["post"], skip_tokens=pca.n_tokens, S=CTX, n_windows=2,
                         n_threads=2)
    return path, pca, fid


@pytest.fixture(scope="module", params=["tiny", "tiny-gqa"])
def measured(request):
    return _measured(request.param)


@pytest.fixture
def calibration(measured, tmp_path):
    path, pca, fid = measured
    model = tmp_path / "m.gguf"
    model.write_bytes(path.read_bytes())
    write_projection(tmp_path / "m.loki.gguf", pca, model, ctx_size=CTX, fidelity=fid)
    return model, tmp_path / "m.loki.gguf", fid


@pytest.mark.parametrize("S, D", [(512, 64), (2048, 256), (4096, 128)])
def test_candidates_fit_their_budget(S, D):
    cands = candidates((1 / 4, 1 / 8, 1 / 16), S, D)
    assert {c["method"] for c in cands} == {"sparq", "loki"}
    for c in cands:
        f = transfer.sparq_elements if c["method"] == "sparq" else transfer.loki_elements
        assert f(S, D, c["rank"], c["k"]) <= c["ratio"] * transfer.dense_elements(S, D)
        # k is the largest that fits
        assert f(S, D, c["rank"], c["k"] + 1) > c["ratio"] * transfer.dense_elements(S, D)
        assert 0 <= c["l"] <= c["k"] < S


def test_selection_keeps_the_local_window_and_k_positions():
    rng = np.random.default_rng(0)
    n, rows = 64, np.array([40, 63])
    mask = np.arange(n)[None, :] <= rows[:, None]
    scores = rng.standard_normal((2, n))
    sel = selection(scores, mask, k=10, l=4, rows=rows)
    assert (sel.sum(1) == 10).all() and not (sel & ~mask).any()
    for i, t in enumerate(rows):
        assert sel[i, t - 3:t + 1].all()  # the 4 most recent visible
        rest = np.where(sel[i] & (np.arange(n) <= t - 4))[0]
        others = np.where(~sel[i] & (np.arange(n) <= t - 4))[0]
        assert scores[i, rest].min() > scores[i, others].max()


def test_selection_keeps_the_sink_whatever_its_score():
    rng = np.random.default_rng(1)
    n, rows = 64, np.array([40, 63])
    mask = np.arange(n)[None, :] <= rows[:, None]
    scores = rng.standard_normal((2, n))
    scores[:, 0] = -10.0  # the first position: the lowest score
    without = selection(scores, mask, k=10, l=4, rows=rows)
    with_sink = selection(scores, mask, k=10, l=4, rows=rows, sink=1)
    assert not without[:, 0].any() and with_sink[:, 0].all()
    assert (with_sink.sum(1) == 10).all() and (with_sink[:, 1:] <= without[:, 1:]).all()


def test_candidates_with_and_without_the_sink():
    cands = candidates((1 / 8,), 2048, 256)
    for method in ("sparq", "loki"):
        sinks = {c["sink"] for c in cands if c["method"] == method}
        assert sinks == {0, 1}


def test_probe_decides_where_there_is_one(calibration, measured):
    """With a probe, auto picks the probed candidate that loses the fewest bits per character, even when another
    has the least output error; the probe and the sink round-trip through the file."""
    model, proj, fid = calibration
    summary = check_gguf(model)
    cands = fid["candidates"]
    idx = pick(fid)
    assert len(idx) == len({(c["ratio"], c["method"], c["sink"], c["l"] > 0) for c in cands})
    want = next(i for i in idx if cands[i]["ratio"] == 1 / 8 and cands[i]["method"] == "loki" and cands[i]["sink"] == 1)
    probe = {"probed": [int(i in idx) for i in range(len(cands))], "samples": 2, "dense_text": 1.1, "dense_copy": 0.05,
             "text": [0.01 if i in idx else 0.0 for i in range(len(cands))],
             "copy": [(0.002 if i == want else 1.5) if i in idx else 0.0 for i in range(len(cands))]}
    rigged = dict(fid, probe=probe, error=[[0.9] * len(fid["layers"]) if i == want else row
                                           for i, row in enumerate(fid["error"])])
    write_projection(proj, measured[1], model, ctx_size=CTX, fidelity=rigged)
    got = read_fidelity(proj)
    assert got.sink == tuple(c["sink"] for c in cands) and got.probed == tuple(bool(x) for x in probe["probed"])
    assert choose(got, 1 / 8) == want
    setting, why = resolve(Auto(ratio=0.125), model, summary, 1024)
    assert isinstance(setting, Loki) and setting.sink == 1 and "sink=1" in why and "on a retrieval" in why
    warning = known_poor(SparQ(r=8, k=64), model, summary)
    assert warning and "retrieval" in warning


def _domain_probe(cands, idx, a, b):
    """A probe over domains prose, docs and code where candidate a loses least on average but most on one domain (docs,
    +0.05 bits per character) and b a little everywhere (at most +0.03); every other probed candidate loses the
    retrieval."""
    loss = {a: [0.0, 0.05, 0.0], b: [0.03, 0.016, 0.02]}
    domain_text = [loss.get(i, [0.01, 0.01, 0.01]) if i in idx else [0.0] * 3 for i in range(len(cands))]
    return {"probed": [int(i in idx) for i in range(len(cands))], "samples": 2, "domains": ["prose", "docs", "code"],
            "domain_text": domain_text, "domain_dense": [1.0, 0.8, 0.5], "text": [max(r) for r in domain_text],
            "dense_text": 0.77, "dense_copy": 0.05,
            "copy": [0.001 if i in (a, b) else 1.5 if i in idx else 0.0 for i in range(len(cands))]}


def test_auto_weighs_the_worst_domain(calibration, measured):
    """auto picks the probed candidate whose worst domain loses least (relative to dense's bits per character there),
    not the one of least mean loss, reads the per-domain keys back (not probe_text, which is rigged here to say the
    opposite) and names each domain's expected loss; max_loss refuses a choice above it and names the smallest
    measured ratio within it."""
    model, proj, fid = calibration
    summary = check_gguf(model)
    cands, idx = fid["candidates"], pick(fid)
    at = [i for i in idx if cands[i]["ratio"] == 1 / 8]
    a, b = at[0], at[-1]
    probe = _domain_probe(cands, idx, a, b)
    probe["text"] = [0.0 if i == a else x for i, x in enumerate(probe["text"])]  # an old reader's view: a wins
    write_projection(proj, measured[1], model, ctx_size=CTX, fidelity=dict(fid, probe=probe))
    got = read_fidelity(proj)
    assert got.probe_domains == ("prose", "docs", "code") and got.probe_domain_loss.shape == (len(cands), 3)
    np.testing.assert_allclose(got.probe_domain_dense, [1.0, 0.8, 0.5], rtol=1e-6)
    assert got.worst_domain(a) == "docs" and abs(got.worst_text(a) - 0.05) < 1e-6
    # the mean over domains prefers a (0.017 against 0.022); the worst domain prefers b (+4% against +6.25%)
    assert np.mean(got.probe_domain_loss[a]) < np.mean(got.probe_domain_loss[b])
    assert choose(got, 1 / 8) == b
    setting, why = resolve(Auto(ratio=0.125), model, summary, 1024)
    assert setting.name == cands[b]["method"]
    assert "prose +0.030 (+3.0%), docs +0.016 (+2.0%), code +0.020 (+4.0%) (worst code)" in why, why
    # the bound: relative to dense, b's worst domain is code at +4%
    resolve(Auto(ratio=0.125, max_loss=0.05), model, summary, 1024)
    with pytest.raises(SparqError) as e:
        resolve(Auto(ratio=0.125, max_loss=0.035), model, summary, 1024)
    msg = str(e.value)
    assert "losing +4.0% bits per character on its worst domain, more than 0.035" in msg, msg
    # every other ratio's choice loses the retrieval only: within the bound on text, so 1/16 is the smallest within
    assert "the smallest measured ratio within it is 0.0625" in msg, msg
    assert parse_attention("auto:ratio=1/8,max_loss=0.05") == Auto(ratio=0.125, max_loss=0.05)
    with pytest.raises(SparqError, match="max_loss must be a number in"):
        Auto(ratio=0.125, max_loss=1.5)
    # generate's and serve's --max-loss (a share or a percentage) reach the same refusal
    assert attention_from_options("auto", model=model, ratio="1/8",
                                  max_loss="3.5%") == Auto(ratio=0.125, max_loss=0.035)
    res = run_cli("generate", "-m", str(model), "-n", "2", "-p", "hi", "--attn", "auto", "--ratio", "1/8",
                  "--max-loss", "0.035")
    assert res.returncode != 0 and "more than 0.035" in res.stderr and "Traceback" not in res.stderr, res.stderr
    with pytest.raises(SparqError, match="--max-loss is a bound of --attn auto"):
        attention_from_options(r=8, k=32, max_loss="0.03")
    with pytest.raises(SparqError, match="--max-loss must be in"):
        attention_from_options("auto", max_loss="150%")


def test_older_calibrations_without_domains_still_choose(calibration, measured):
    """A probe without per-domain keys (an older calibration) is read as before: text and retrieval together."""
    model, proj, fid = calibration
    cands, idx = fid["candidates"], pick(fid)
    at = [i for i in idx if cands[i]["ratio"] == 1 / 8]
    a, b = at[0], at[-1]
    probe = _domain_probe(cands, idx, a, b)
    probe["text"] = [0.0 if i == a else x for i, x in enumerate(probe["text"])]  # without domains, a wins
    for key in ("domains", "domain_text", "domain_dense"):
        probe.pop(key)
    write_projection(proj, measured[1], model, ctx_size=CTX, fidelity=dict(fid, probe=probe))
    got = read_fidelity(proj)
    assert got.probe_domains == () and got.probe_domain_loss is None
    assert choose(got, 1 / 8) == a and "per domain" not in got.describe(a)


def test_fidelity_round_trips_and_is_bounded_by_exact(calibration):
    _, proj, fid = calibration
    got = read_fidelity(proj)
    assert got.ctx == CTX and got.windows == fid["windows"] and got.layers == tuple(fid["layers"])
    assert got.method == tuple(c["method"] for c in fid["candidates"])
    np.testing.assert_allclose(got.mass, np.array(fid["mass"]), rtol=1e-6)
    np.testing.assert_allclose(got.error, np.array(fid["error"]), rtol=1e-6)
    # no ranking keeps more than the exact top-k of its k; the local window can only add what top-k also has
    assert (got.mass <= got.exact_mass + 1e-6).all() and (got.mass > 0).all()
    assert (got.error >= 0).all() and (got.exact_error >= 0).all() and (got.error < 2).all()


def test_auto_is_deterministic_and_within_budget(calibration):
    model, proj, _ = calibration
    summary = check_gguf(model)
    for ratio in (1 / 4, 1 / 8, 0.1, 1 / 16):
        for n_ctx in (512, 4096):
            a, why = resolve(Auto(ratio=ratio), model, summary, n_ctx)
            b, _ = resolve(Auto(ratio=ratio), model, summary, n_ctx)
            assert a == b and isinstance(a, (SparQ, Loki)) and "auto:ratio=" in why
            rank = a.r if isinstance(a, SparQ) else a.d
            f = transfer.sparq_elements if isinstance(a, SparQ) else transfer.loki_elements
            assert f(n_ctx, summary.head_dim, rank, a.k) <= ratio * transfer.dense_elements(n_ctx, summary.head_dim)
    # the pick is the candidate with the smallest mean output error at the ratio
    fid = read_fidelity(proj)
    i = choose(fid, 1 / 8)
    same = [j for j in range(len(fid.method)) if fid.ratio[j] == fid.ratio[i]]
    assert fid.mean_error(i) == min(fid.mean_error(j) for j in same)


def test_llama_opens_auto_and_generates(calibration):
    model, proj, _ = calibration
    # logits_all: llama-cpp-python 0.3.36 writes `scores` only then (without it the row is unwritten memory)
    llm = Llama(model, f"auto:ratio=1/8,proj={proj}", n_ctx=256, logits_all=True)
    try:
        want, _ = resolve(Auto(ratio=0.125, projection=str(proj)), model, check_gguf(model), 256)
        assert llm.attention == want and llm.auto_choice.startswith("auto:ratio=0.125 -> ")
        llm.eval(llm.tokenize(b"the quick brown fox jumps over the lazy dog " * 8))
        assert np.isfinite(llm.scores[llm.n_tokens - 1]).all()
    finally:
        llm.close()


def test_auto_finds_the_calibration_next_to_the_model(calibration):
    model, _, _ = calibration
    a, _ = resolve(Auto(), model, check_gguf(model), 1024)
    assert a.k >= 1


def test_auto_without_a_calibration_says_how_to_make_one(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(default_model_path("tiny").read_bytes())
    with pytest.raises(SparqError, match="sparq-cpp calibrate"):
        Llama(model, "auto", n_ctx=256)


def test_auto_refuses_a_calibration_without_fidelity(measured, tmp_path):
    path, pca, _ = measured
    model = tmp_path / "m.gguf"
    model.write_bytes(path.read_bytes())
    write_projection(tmp_path / "m.loki.gguf", pca, model, ctx_size=CTX)
    with pytest.raises(SparqError, match="no fidelity measurement"):
        resolve(Auto(), model, check_gguf(model), 1024)


def test_auto_spec():
    assert parse_attention("auto") == Auto()
    assert parse_attention("auto:ratio=1/16,proj=x.gguf") == Auto(ratio=0.0625, projection="x.gguf")
    assert parse_attention(spec(Auto(ratio=0.2))) == Auto(ratio=0.2)
    for bad, needle in (("auto:ratio=1", "ratio"), ("auto:r=3", "unknown key 'r'"), ("auto:ratio=x", "fraction"),
                        ("auto:proj", "key=value")):
        with pytest.raises(SparqError, match=needle):
            parse_attention(bad)


def test_known_poor_names_the_better_method(calibration, monkeypatch):
    model, proj, _ = calibration
    summary = check_gguf(model)
    fid = read_fidelity(proj)
    # make Loki look far better than SparQ at every ratio, then ask about a SparQ setting
    loki = np.array([m == "loki" for m in fid.method])
    rigged = dataclasses.replace(fid, error=np.where(loki[:, None], 0.1, 0.9))
    monkeypatch.setattr("sparq_cpp.auto.read_fidelity", lambda path: rigged)
    warning = known_poor(SparQ(r=8, k=64), model, summary)
    assert warning and "loki" in warning and "--attn auto" in warning
    assert known_poor(Loki(d=8, k=64), model, summary) is None
    assert known_poor(Dense(), model, summary) is None


def test_cli_auto(calibration):
    model, _, _ = calibration
    proc = run_cli("generate", "-m", model, "--attn", "auto", "--ratio", "1/8", "-n", "4", "--no-chat", "-c", "256",
                   "--temp", "0", "-t", "1")
    assert proc.returncode == 0, proc.stderr
    assert "auto:ratio=0.125 -> " in proc.stderr
    proc = run_cli("generate", "-m", model, "--ratio", "1/8", "-n", "4")
    assert_one_line_error(proc, "--ratio", "--attn auto")
    proc = run_cli("generate", "-m", model, "--attn", "auto", "--sparse-k", "64", "-n", "4")
    assert_one_line_error(proc, "--attn auto", "--sparse-k")
    proc = run_cli("serve", "-m", model, "--attn", "auto", "--ratio", "1/4", "--print-command")
    assert proc.returncode == 0, proc.stderr
    assert "auto:ratio=0.25 -> " in proc.stderr
    assert "LLAMA_SPARSE_ATTN=sparq:" in proc.stdout or "LLAMA_SPARSE_ATTN=loki:" in proc.stdout


def test_cli_calibrate_prints_the_fidelity_table(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(default_model_path("tiny-gqa").read_bytes())
    text = tmp_path / "t.txt"
    text.write_text(calibration_text(6000))
    proc = run_cli("calibrate", "-m", model, "--text", text, "--tokens", "1024", "--ctx-size", str(CTX), "-t", "2",
                   "--fidelity-windows", "1")
    assert proc.returncode == 0, proc.stderr
    assert "attention output error and mass kept at 512 positions" in proc.stdout and " *" in proc.stdout
    fid = read_fidelity(tmp_path / "m.loki.gguf")
    assert fid.windows == 1
    # the end-to-end probe ran (or said why not)
    assert any(fid.probed) or "no end-to-end probe" in proc.stderr, proc.stderr[-2000:]
