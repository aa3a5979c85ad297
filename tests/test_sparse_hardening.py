"""The patched llama.cpp itself neither crashes nor aborts on what a user or a damaged file can feed it:
attention scores that are not finite, a k beyond any cache, a Loki projection holding NaN or inf,
malformed sparse attention settings, a context shift of a quantized cache. (Python's own checks are
in test_hardening.py; these go around them, as the stock tools and the C API do.)"""
from __future__ import annotations

import re
import subprocess

import gguf
import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import ggml_ops, sparse_api  # noqa: E402

if not sparse_api.available() or not ggml_ops.has_sparq_attn():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)", allow_module_level=True)

from llama_session import Session, captured_log  # noqa: E402
from sparq_cpp import Dense, Loki, SparQ, SparqError  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402
from sparq_cpp.pyext.build import tool_path  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("hardening") / "tiny-gqa.gguf", "tiny-gqa", wtype="f32", seed=4)


def _op_inputs(n_kv=600, n_head=4, n_head_kv=2, D=64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, n_head, D)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head_kv, D)).astype(np.float32)
    v = rng.standard_normal((n_kv, n_head_kv, D)).astype(np.float32)
    mask = np.ones((1, n_kv), dtype=bool)
    pos = np.arange(n_kv, dtype=np.int32)
    return q, k, v, mask, pos


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_scores_that_are_not_finite_do_not_abort_the_op(bad):
    """A NaN or inf in one query head used to leave fewer candidates than k (GGML_ASSERT, abort). Now the
    op returns: the other kv head's group is exact, the poisoned group is as undefined as its scores."""
    q, k, v, mask, pos = _op_inputs()
    want = ggml_ops.sparq_attn(q, k, v, mask, pos, 0.125, 8, 32, 8, True)
    q[0, 0, 5] = bad  # head 0: kv head 0's group
    got = ggml_ops.sparq_attn(q, k, v, mask, pos, 0.125, 8, 32, 8, True)
    np.testing.assert_array_equal(got[:, 2:], want[:, 2:])  # kv head 1's group (heads 2, 3)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_keys_that_are_not_finite_do_not_abort_the_op(bad):
    q, k, v, mask, pos = _op_inputs(seed=1)
    k[100:140, 0, :] = bad
    ggml_ops.sparq_attn(q, k, v, mask, pos, 0.125, 8, 32, 8, True, kv_type="f32")
    ggml_ops.loki_attn(q, k, v, mask, pos, 0.125, 16, 32, 0, kv_type="f32")


def test_a_k_beyond_any_cache_selects_every_position():
    """k = 2e9 with l = k/4 sized the op's scratch by l (an overflow, then std::bad_alloc); it is bounded by n_kv."""
    q, k, v, mask, pos = _op_inputs(n_kv=300, seed=2)
    huge = ggml_ops.sparq_attn(q, k, v, mask, pos, 0.125, 8, 2_000_000_000, 500_000_000, True)
    every = ggml_ops.sparq_attn(q, k, v, mask, pos, 0.125, 8, 300, 0, True)
    np.testing.assert_array_equal(huge, every)


@pytest.mark.parametrize("value,message", [
    ("sparq:r= 16", "white space"),
    ("sparq:r=16 ", "white space"),
    ("sparq:r=8,k=64,r=16", "given more than once"),
    ("sparq:r=" + "9" * 120_000, "(120000 characters)"),
    ("loki:d=x", "expected an integer"),
])
def test_malformed_settings_are_refused_in_one_short_line(value, message):
    """llama.cpp's parser (llama_sparse_attn_parse, behind --sparse-attn) names what is wrong, briefly."""
    with pytest.raises(SparqError, match=re.escape(message)) as e:
        sparse_api.parse(value)
    assert len(str(e.value)) < 400


def test_libllama_reads_no_environment(model, monkeypatch):
    """The setting reaches libllama in llama_context_params only: the variable is the tools' (common/arg.cpp)."""
    monkeypatch.setenv("LLAMA_SPARSE_ATTN", "sparq:r=8,k=32")
    with Session(model, Dense()) as s:
        assert sparse_api.get_params(s.ctx).mode == sparse_api.LLAMA_SPARSE_ATTN_DENSE
    with Session(model, sparse_api.parse("sparq:r=4,k=16")) as s:
        p = sparse_api.get_params(s.ctx)
        assert (p.mode, p.r, p.k) == (sparse_api.LLAMA_SPARSE_ATTN_SPARQ, 4, 16)


def _projection_with(model, tmp_path, value):
    from sparq_cpp.calib import calibrate, write_projection
    from conftest import calibration_text

    pca = calibrate(model, calibration_text(), n_tokens=512, ctx_size=256, n_threads=2)
    path = write_projection(tmp_path / "good.loki.gguf", pca, model, ctx_size=256)
    reader = gguf.GGUFReader(path, "r+")
    t = next(t for t in reader.tensors if t.name == "blk.1.loki_proj_post")
    t.data.reshape(-1)[17] = value
    reader.data.flush()
    return path


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_projection_that_is_not_finite_is_refused(model, tmp_path, value):
    path = _projection_with(model, tmp_path, value)
    att = Loki(d=16, k=16, projection=str(path))
    with captured_log() as log, pytest.raises(AssertionError, match="could not create the context"):
        Session(model, att)  # the C API, around Python's checks
    assert any("not finite" in line and "blk.1.loki_proj_post" in line for line in log), "".join(log[-10:])
    from sparq_cpp import Llama

    with pytest.raises(SparqError, match="not finite"):
        Llama(model, att)


def test_context_shift_of_a_quantized_cache_with_sparq(model):
    """A context shift with a q8_0 K cache dereferenced a NULL Hadamard rotation (signal 11)."""
    proc = subprocess.run(
        [str(tool_path("llama-completion")), "-m", str(model), "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0", "-c", "256",
         "--context-shift", "--ignore-eos", "-n", "400", "-no-cnv", "-p", "Once upon a time", "-t", "2", "-v"],
        capture_output=True, text=True, errors="replace", timeout=300, stdin=subprocess.DEVNULL,
        env={"LLAMA_SPARSE_ATTN": "sparq:r=8,k=32", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sparse_attn           = sparq" in proc.stderr  # SparQ was on
    assert "context full, swapping" in proc.stderr  # and the cache was shifted


def test_a_vocabulary_with_a_token_twice_is_refused_not_aborted(model, tmp_path):
    """A damaged vocabulary (one token's text equal to another's) hit GGML_ASSERT in llama.cpp's vocab
    loader (SIGABRT, found by test_fuzz); it is now a load error, in the stock tool and through Python."""
    from conftest import rewrite_gguf

    tokens = gguf.GGUFReader(model).fields["tokenizer.ggml.tokens"].contents()
    tokens[10] = tokens[11]
    bad = rewrite_gguf(model, tmp_path / "dup.gguf", {"tokenizer.ggml.tokens": (tokens, gguf.GGUFValueType.ARRAY)})
    # the stock tools log through a worker thread that the exit does not wait for: on a busy machine the last
    # lines can be lost, so the message is looked for in up to three runs (each must end with an error code)
    for _ in range(3):
        proc = subprocess.run([str(tool_path("llama-completion")), "-m", str(bad), "-n", "2", "-no-cnv", "-p", "hi"],
                              capture_output=True, text=True, errors="replace", timeout=120, stdin=subprocess.DEVNULL)
        assert proc.returncode > 0, (proc.returncode, proc.stderr[-800:])
        if "appears twice" in proc.stderr:
            break
    assert "appears twice" in proc.stderr
    from sparq_cpp import Llama

    with pytest.raises(SparqError, match="could not load"):
        Llama(bad, SparQ(r=8, k=16))
