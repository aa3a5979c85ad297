"""A state knows the sparse attention layout of the cache that saved it. SparQ's K^T travels with the
state, so a restore does not transpose K again (the upkeep then reads V only); dense and SparQ states
load into each other (their keys are the same); Loki's rotated keys and ALISA's window load only into a
context of the same layout, and a mismatch is refused with both names instead of decoding garbage."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)",
                allow_module_level=True)

from sparq_cpp import ALISA, Dense, Loki, SparQ  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402
from llama_session import Session, captured_log  # noqa: E402

SPARQ = SparQ(r=8, k=16, l=4, mean_value=True)
STEPS = [7, 8, 9, 10]
TOL = {"f16": 1e-4, "q8_0": 1e-4}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout-models")
    return {p: write_model(root / f"{p}.gguf", p, wtype="f32", seed=7) for p in ("tiny", "tiny-gqa")}


@pytest.fixture(scope="module")
def projections(models, tmp_path_factory):
    """Two Loki bases of the same model, calibrated on different text."""
    from conftest import calibration_text
    from sparq_cpp.calib import calibrate, write_projection

    out = []
    for seed in (0, 1):
        pca = calibrate(models["tiny-gqa"], calibration_text(seed=seed), n_tokens=1024, ctx_size=512, n_threads=2)
        d = tmp_path_factory.mktemp(f"layout-loki-{seed}")
        out.append(str(write_projection(d / "tiny-gqa.loki.gguf", pca, models["tiny-gqa"], ctx_size=512)))
    return out


def tokens(n, seed=0):
    return [1] + np.random.default_rng(seed).integers(3, 2048, size=n - 1).tolist()


def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


def saved(path, att, prompt, cache_type="f16"):
    """The whole state and sequence 0's state after the prompt, and the steps that follow it."""
    with Session(path, att, cache_type=cache_type) as a:
        a.prompt(prompt)
        blobs = a.state(), a.seq_state(0)
        return blobs, a.steps(STEPS, pos0=len(prompt))


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "seq"])
def test_sparq_restore_reads_kt_from_the_state(models, cache_type, whole):
    path, prompt = models["tiny"], tokens(150, seed=3)
    (blob, seq_blob), want = saved(path, SPARQ, prompt, cache_type)
    with Session(path, SPARQ, cache_type=cache_type) as b:
        b.set_state(blob) if whole else b.set_seq_state(seq_blob, 0)
        got = b.steps(STEPS, pos0=len(prompt))
        # the first step's upkeep reads V once (the sums), not K: K^T came with the state
        assert b.upkeep_n_cells() == len(prompt)
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel(g, w) <= TOL[cache_type], f"step {i}"


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "seq"])
def test_dense_state_into_sparq_rebuilds_kt(models, whole):
    path, prompt = models["tiny"], tokens(150, seed=4)
    (blob, seq_blob), _ = saved(path, Dense(), prompt)
    _, want = saved(path, SPARQ, prompt)
    with Session(path, SPARQ, cache_type="f16") as b:
        b.set_state(blob) if whole else b.set_seq_state(seq_blob, 0)
        got = b.steps(STEPS, pos0=len(prompt))
        assert b.upkeep_n_cells() == 2*len(prompt)  # K for K^T, V for the sums
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel(g, w) <= TOL["f16"], f"step {i}"


def test_sparq_state_into_dense_skips_kt(models, tmp_path):
    path, prompt = models["tiny"], tokens(150, seed=5)
    (blob, seq_blob), _ = saved(path, SPARQ, prompt)
    _, want = saved(path, Dense(), prompt)
    with Session(path, SPARQ, cache_type="f16") as a:
        a.prompt(prompt)
        a.save_seq_file(tmp_path / "slot.bin", 0, prompt)
    for load in (lambda b: b.set_state(blob), lambda b: b.set_seq_state(seq_blob, 0),
                 lambda b: b.load_seq_file(tmp_path / "slot.bin", 0)):
        with Session(path, Dense(), cache_type="f16") as b:
            load(b)
            got = b.steps(STEPS, pos0=len(prompt))
        for i, (g, w) in enumerate(zip(got, want)):
            assert rel(g, w) <= 1e-5, f"step {i}"


def refused(path, att, blob, whole, *needles):
    """Loading the blob fails, one log line names both layouts, and the context still decodes."""
    with Session(path, att, cache_type="f16") as b:
        buf = bytes(blob)
        import ctypes
        arr = (ctypes.c_uint8 * len(buf)).from_buffer_copy(buf)
        with captured_log() as log:
            n = (b.C.llama_state_set_data(b.ctx, arr, len(buf)) if whole
                 else b.C.llama_state_seq_set_data(b.ctx, arr, len(buf), 0))
        assert n == 0
        text = "".join(log)
        lines = [ln for ln in text.splitlines() if "the state was saved with" in ln]
        assert lines, text
        for needle in needles:
            assert needle in lines[0], lines[0]
        b.prompt(tokens(20, seed=9))  # still usable


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "seq"])
def test_loki_states_load_only_into_the_same_basis(models, projections, whole):
    path, prompt = models["tiny-gqa"], tokens(120, seed=6)
    loki = [Loki(d=16, k=16, l=2, projection=p) for p in projections]
    (blob, seq_blob), want = saved(path, loki[0], prompt)
    (sq_blob, sq_seq_blob), _ = saved(path, SPARQ, prompt)
    b0, bs = (blob, sq_blob) if whole else (seq_blob, sq_seq_blob)

    refused(path, SPARQ, b0, whole, "saved with Loki (basis", "this context uses SparQ attention")
    refused(path, Dense(), b0, whole, "saved with Loki (basis", "this context uses dense attention")
    refused(path, loki[1], b0, whole, "saved with Loki (basis", "this context uses Loki (basis")
    refused(path, loki[0], bs, whole, "saved with SparQ attention", "this context uses Loki (basis")

    with Session(path, loki[0], cache_type="f16") as b:  # the same basis loads
        b.set_state(b0) if whole else b.set_seq_state(b0, 0)
        got = b.steps(STEPS, pos0=len(prompt))
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel(g, w) <= TOL["f16"], f"step {i}"


def test_alisa_and_sparq_states_are_refused_by_each_other(models):
    path, prompt = models["tiny"], tokens(100, seed=8)
    (alisa_blob, _), _ = saved(path, ALISA(c=0.5), prompt)
    (sq_blob, _), _ = saved(path, SPARQ, prompt)
    (dense_blob, _), _ = saved(path, Dense(), prompt)
    refused(path, SPARQ, alisa_blob, True, "saved with ALISA (c = 0.5) attention", "this context uses SparQ attention")
    refused(path, ALISA(c=0.5), sq_blob, True, "saved with SparQ attention", "this context uses ALISA (c = 0.5) attention")
    refused(path, ALISA(c=0.5), dense_blob, True, "saved with dense attention", "this context uses ALISA")
