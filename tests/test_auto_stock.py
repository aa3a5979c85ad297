"""`--sparse-attn auto` in the stock llama.cpp tools: llama-completion resolves it from the calibration as
sparq_cpp.auto.resolve does, logs the same line, and refuses it without a usable calibration; llama-bench refuses it."""
from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from sparq_cpp.attention import Auto  # noqa: E402
from sparq_cpp.auto import resolve  # noqa: E402
from sparq_cpp.calib import write_projection  # noqa: E402
from sparq_cpp.calib.budget import candidates  # noqa: E402
from sparq_cpp.calib.pca import LokiPCA  # noqa: E402
from sparq_cpp.calib.probe import pick  # noqa: E402
from sparq_cpp.errors import SparqError  # noqa: E402
from sparq_cpp.gguf_check import check_gguf  # noqa: E402
from sparq_cpp.modelfactory import default_model_path  # noqa: E402
from sparq_cpp.pyext.build import tool_path  # noqa: E402

from stock_tool import assert_refused  # noqa: E402

CTX = 512
ENV = {k: v for k, v in os.environ.items() if k not in ("LLAMA_SPARSE_ATTN", "LLAMA_ARG_SPARSE_ATTN")}


def _identity_pca(summary) -> LokiPCA:
    """A valid basis (the identity) for every layer and KV head; auto reads only the fidelity keys."""
    L, H, D = summary.n_layer, summary.n_head_kv, summary.head_dim
    P = np.broadcast_to(np.eye(D), (L, H, D, D)).copy()
    var = np.broadcast_to(np.linspace(2.0, 1.0, D), (L, H, D)).copy()
    return LokiPCA(components={"pre": P, "post": P}, explained_variance={"pre": var, "post": var}, n_tokens=1024)


def _fidelity(summary, rig: str, seed: int = 0) -> dict:
    """A measurement over the real candidate list: random output errors, or rigged so that SparQ or Loki wins, or so
    that two candidates tie for the best (the first must be chosen); "probe": with an end-to-end probe of the best of
    each method and sink per ratio (random losses), where it is not the least output error that wins."""
    cands = candidates((1 / 4, 1 / 8, 1 / 16), CTX, summary.head_dim)
    L = summary.n_layer
    rng = np.random.default_rng(seed)
    error = rng.uniform(0.2, 0.7, (len(cands), L))
    if rig in ("sparq", "loki"):
        error[[c["method"] == rig for c in cands]] -= 0.15
    elif rig == "tie":
        for t in (1 / 4, 1 / 8, 1 / 16):
            idx = [i for i, c in enumerate(cands) if c["ratio"] == t]
            error[idx[-1]] = error[idx[1]] = 0.01  # a later Loki and an earlier SparQ candidate
    mass = rng.uniform(0.3, 0.8, (len(cands), L))
    fid = {"ctx": CTX, "windows": 2, "held_out": rig != "tie", "layers": list(range(L)), "candidates": cands,
           "mass": mass.tolist(), "exact_mass": np.minimum(mass + 0.05, 1.0).tolist(),
           "error": error.tolist(), "exact_error": (error * 0.5).tolist()}
    if rig in ("probe", "domains"):
        idx = pick(fid)
        text, copy = rng.uniform(-0.01, 0.1, len(cands)), rng.uniform(0.0, 2.0, len(cands))
        fid["probe"] = {"probed": [int(i in idx) for i in range(len(cands))], "samples": 2, "dense_text": 1.2,
                        "dense_copy": 0.05, "text": [float(x) if i in idx else 0.0 for i, x in enumerate(text)],
                        "copy": [float(x) if i in idx else 0.0 for i, x in enumerate(copy)]}
    if rig == "domains":
        # per domain (dense 1.2, 0.9, 0.6, 1.5), rigged so that at every ratio neither the least mean loss nor the
        # least worst loss in bits is the least worst loss relative to dense's: the tools must weigh that (probe_text
        # says the mean here)
        loss = rng.uniform(0.0, 0.05, (len(cands), 4))
        copy = np.full(len(cands), 0.01)
        for t in (1 / 4, 1 / 8, 1 / 16):
            at = [i for i in idx if cands[i]["ratio"] == t]
            loss[at[1:-1]] = rng.uniform(0.05, 0.1, (len(at) - 2, 4))
            loss[at[0]] = [0.0, 0.0, 0.0, 0.12]      # worst +8.0% (chat)
            loss[at[1]] = [0.0, 0.0, 0.03, 0.0]      # least mean and least worst in bits, but +5.0% on code
            loss[at[-1]] = [0.04, 0.03, 0.02, 0.05]  # +3.3% everywhere: the least worst relative to dense
        fid["probe"].update(domains=["prose", "docs", "code", "chat"],
                            domain_text=[[float(x) if i in idx else 0.0 for x in row] for i, row in enumerate(loss)],
                            domain_dense=[1.2, 0.9, 0.6, 1.5],
                            text=[float(row.mean()) if i in idx else 0.0 for i, row in enumerate(loss)],
                            copy=[float(x) if i in idx else 0.0 for i, x in enumerate(copy)])
    return fid


def _calibrated(tmp_path, preset, rig="random"):
    model = tmp_path / f"{preset}.gguf"
    model.write_bytes(default_model_path(preset).read_bytes())
    summary = check_gguf(model)
    write_projection(tmp_path / f"{preset}.loki.gguf", _identity_pca(summary), model, ctx_size=CTX,
                     fidelity=_fidelity(summary, rig))
    return model, summary


def _completion(model, spec, *extra):
    args = [tool_path("llama-completion"), "-m", model, "-p", "hello world", "-n", "2", "-fa", "on", "-no-cnv",
            "-t", "1", "--temp", "0", "-v", "--sparse-attn", spec, *extra]
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, errors="replace", env=ENV,
                          timeout=120, stdin=subprocess.DEVNULL)


def _context_line(setting) -> str:
    """How llama_context logs the setting it was created with (every field Python's setting has)."""
    if setting.name == "sparq":
        return (f"sparse_attn           = sparq (r = {setting.r}, k = {setting.k}, l = {setting.l}, sink = {setting.sink}, "
                f"mean_value = {int(setting.mean_value)}, min_n_kv = {setting.min_n_kv}, sparse_prompt = "
                f"{int(setting.sparse_prompt)})")
    return (f"sparse_attn           = loki (d = {setting.d}, k = {setting.k}, l = {setting.l}, sink = {setting.sink}, "
            f"min_n_kv = {setting.min_n_kv}, sparse_prompt = {int(setting.sparse_prompt)}, basis = {setting.projection}, "
            f"{setting.variant} RoPE)")


@pytest.mark.parametrize("preset, rig", [("tiny", "random"), ("tiny-gqa", "random"), ("tiny", "sparq"),
                                         ("tiny", "loki"), ("tiny-gqa", "tie"), ("tiny", "probe"),
                                         ("tiny-gqa", "probe"), ("tiny", "domains"), ("tiny-gqa", "domains")])
def test_completion_resolves_auto_as_python_does(tmp_path, preset, rig):
    model, summary = _calibrated(tmp_path, preset, rig)
    cases = [("auto:ratio=1/8", 0.125, 1024, 1), ("auto:ratio=0.1", 0.1, 2048, 1), ("auto", 0.125, 512, 1),
             ("auto:ratio=0.05", 0.05, 4096, 1), ("auto:ratio=1/4", 0.25, 2048, 2)]
    for spec, ratio, n_ctx, n_par in cases:
        want, why = resolve(Auto(ratio=ratio), model, summary, n_ctx // n_par)
        proc = _completion(model, spec, "-c", n_ctx, "-np", n_par)
        assert proc.returncode == 0, (spec, proc.stderr[-2000:])
        assert why in proc.stderr, (spec, why, [ln for ln in proc.stderr.splitlines() if "auto:" in ln])
        assert _context_line(want) in proc.stderr, (spec, want)
        if rig == "domains":  # the worst domain relative to dense's decided: the last probed candidate of the ratio
            assert "code +0.020 (+3.3%), chat +0.050 (+3.3%) (worst " in why and "+0.010 on a retrieval" in why, why


def test_completion_bounds_auto_as_python_does(tmp_path):
    """max_loss: both refuse a choice whose worst domain lost more (relative to dense) with the same message, naming
    the smallest measured ratio within the bound, and accept one within it."""
    model, summary = _calibrated(tmp_path, "tiny", "domains")
    # the choices lose +3.3% of dense's bits per character on every domain
    want, why = resolve(Auto(ratio=0.125, max_loss=0.04), model, summary, 1024)
    proc = _completion(model, "auto:ratio=1/8,max_loss=0.04", "-c", "1024")
    assert proc.returncode == 0 and why in proc.stderr and _context_line(want) in proc.stderr, proc.stderr[-2000:]
    with pytest.raises(SparqError) as e:
        resolve(Auto(ratio=0.125, max_loss=0.03), model, summary, 1024)
    assert "losing +3.3% bits per character on its worst domain, more than 0.03" in str(e.value)
    assert "no measured ratio stays within it" in str(e.value)
    args = [tool_path("llama-completion"), "-m", model, "-p", "x", "-n", "2", "-fa", "on", "-no-cnv", "-c", "1024",
            "--sparse-attn", "auto:ratio=1/8,max_loss=0.03"]
    assert_refused(args, ENV, str(e.value))
    assert_refused(args[:-1] + ["auto:ratio=1/8,max_loss=2"], ENV, "max_loss must be a number in (0, 1)")


def test_completion_auto_with_the_file_given(tmp_path):
    model, summary = _calibrated(tmp_path, "tiny", "loki")
    other = tmp_path / "elsewhere.gguf"
    os.replace(tmp_path / "tiny.loki.gguf", other)
    want, why = resolve(Auto(ratio=0.125, projection=str(other)), model, summary, 1024)
    proc = _completion(model, f"auto:ratio=1/8,proj={other}", "-c", "1024")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert why in proc.stderr and _context_line(want) in proc.stderr
    # from the environment, as every setting of the stock tools
    args = [tool_path("llama-completion"), "-m", model, "-p", "hi", "-n", "2", "-fa", "on", "-no-cnv", "-t", "1", "-c", "1024"]
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, errors="replace", timeout=120,
                          env=dict(ENV, LLAMA_SPARSE_ATTN=f"auto:ratio=1/8,proj={other}"), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and why in proc.stderr, proc.stderr[-2000:]


def test_completion_refuses_auto_without_a_calibration(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(default_model_path("tiny").read_bytes())
    args = [tool_path("llama-completion"), "-m", model, "-p", "x", "-n", "2", "-fa", "on", "-no-cnv", "-c", "512",
            "--sparse-attn", "auto:ratio=1/8"]
    proc = assert_refused(args, ENV, f"{tmp_path / 'm.loki.gguf'} does not exist")
    lines = [ln for ln in proc.stderr.splitlines() if "does not exist" in ln]
    assert len(lines) == 1 and "--sparse-attn auto" in lines[0] and "auto:proj=FILE" in lines[0], lines
    assert "Aborted" not in proc.stderr and "GGML_ASSERT" not in proc.stderr
    # a calibration without the measurement (an older one)
    write_projection(tmp_path / "m.loki.gguf", _identity_pca(check_gguf(model)), model, ctx_size=CTX)
    proc = assert_refused(args, ENV, "has no fidelity measurement")
    assert "GGML_ASSERT" not in proc.stderr
    # a calibration of another model
    _calibrated(tmp_path, "tiny-gqa")
    proc = assert_refused(args[:-1] + [f"auto:proj={tmp_path / 'tiny-gqa.loki.gguf'}"], ENV,
                          "is not a calibration of this model")
    assert "GGML_ASSERT" not in proc.stderr
    # a damaged measurement
    fid = _fidelity(check_gguf(model), "random")
    fid["mass"] = fid["mass"][:-1]
    write_projection(tmp_path / "m.loki.gguf", _identity_pca(check_gguf(model)), model, ctx_size=CTX, fidelity=fid)
    proc = assert_refused(args, ENV, "loki.fidelity.mass must hold")
    assert "GGML_ASSERT" not in proc.stderr
    # malformed settings are argument errors
    for spec, needle in (("auto:ratio=1", "ratio must be in (0, 1)"), ("auto:ratio=x", "fraction like 1/8"),
                         ("auto:r=3", "unknown key 'r'"), ("auto:proj", "not key=value"),
                         ("auto:ratio=1/8,ratio=1/4", "ratio given twice")):
        assert_refused(args[:-1] + [spec], ENV, needle)


def test_completion_auto_that_fits_nothing(tmp_path):
    model, _ = _calibrated(tmp_path, "tiny")
    args = [tool_path("llama-completion"), "-m", model, "-p", "x", "-n", "2", "-fa", "on", "-no-cnv", "-c", "8",
            "--sparse-attn", "auto:ratio=0.01"]
    assert_refused(args, ENV, "reads that little at a context of 8 positions")


def test_bench_refuses_auto(tmp_path):
    model = default_model_path("tiny")
    args = [tool_path("llama-bench"), "-m", model, "-p", "0", "-n", "1", "-fa", "1", "--sparse-attn", "auto"]
    assert_refused(args, ENV, "auto is not supported by llama-bench")
