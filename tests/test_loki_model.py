"""Loki inside llama.cpp's graph, end to end, on tiny models calibrated here: logits equal the reference
forward pass with the Loki kernel, the rotated cache survives cache edits (K-shift included), the
embedded projection loads, and bad settings give clear errors."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)", allow_module_level=True)

from conftest import assert_rewind_and_reload_continue_as_fresh, calibration_text, open_llm, rel, tokens  # noqa: E402

from sparq_cpp import Dense, Llama, Loki, SparQ, SparqError  # noqa: E402
from sparq_cpp.calib import calibrate, embed_projection, read_projection, write_projection  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402
from sparq_cpp.reference.forward import LlamaReference  # noqa: E402
from sparq_cpp.reference.gguf_model import load_llama  # noqa: E402
from sparq_cpp.reference.loki import LokiAttention  # noqa: E402

# f32 cache, every row through Loki: the op accumulates in f32, the reference in f64.
TOL = 1e-4
CTX = 512


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{preset: (model, projection file, LokiPCA)} for f32 tiny models, calibrated on common words."""
    root = tmp_path_factory.mktemp("loki-models")
    out = {}
    for preset in ("tiny", "tiny-gqa"):
        path = write_model(root / f"{preset}.gguf", preset, wtype="f32", seed=3)
        pca = calibrate(path, calibration_text(), n_tokens=1024, ctx_size=CTX, n_threads=2)
        proj = write_projection(root / f"{preset}.loki.gguf", pca, path, ctx_size=CTX)
        out[preset] = (path, proj, pca)
    return out


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
@pytest.mark.parametrize("variant", ["post", "pre"])
def test_prompt_and_decode_match_reference(models, preset, variant):
    d, k, l = 16, 24, 4
    path, proj, _ = models[preset]
    llm = open_llm(path, Loki(d=d, k=k, l=l, projection=proj, variant=variant, sparse_prompt=True))
    att = LokiAttention(read_projection(proj, variant=variant), d, k, l)
    ref = LlamaReference(load_llama(path), attention=att, cache_type="f32")
    prompt = tokens(96)
    llm.eval(prompt)
    got = np.array(llm.scores[: len(prompt)])
    assert rel(got, ref.forward(prompt)) <= TOL
    n = len(prompt)
    for step in range(64):
        tok = int(np.argmax(got[-1]))
        llm.eval([tok])
        got = np.array(llm.scores[n: n + 1])
        assert rel(got, ref.forward([tok])) <= TOL, f"decode step {step}"
        n += 1


def test_rotated_cache_dense_and_every_position_equal_dense(models):
    """A Loki context stores rotated keys: dense attention over them, and Loki with d = D selecting every
    position, both give the model's dense logits (P orthonormal)."""
    path, proj, _ = models["tiny-gqa"]
    prompt = tokens(80, seed=1)
    want = LlamaReference(load_llama(path), cache_type="f32").forward(prompt)
    every = open_llm(path, Loki(d=128, k=4096, projection=proj, sparse_prompt=True))
    every.eval(prompt)
    assert rel(np.array(every.scores[:80]), want) <= TOL
    dense = open_llm(path, Loki(d=8, k=8, projection=proj))
    dense.set_attention(Dense())
    dense.eval(prompt)
    # dense here is llama.cpp's flash attention, which rounds q and the cache to f16 (test_logits_match.py's
    # bound for it); a plain dense context is as far from the reference
    plain = open_llm(path, Dense())
    plain.eval(prompt)
    assert rel(np.array(dense.scores[:80]), want) <= 3e-3
    assert rel(np.array(plain.scores[:80]), want) <= 3e-3


def test_set_attention_between_steps(models):
    path, proj, _ = models["tiny"]
    prompt = tokens(64, seed=2)
    a = open_llm(path, Loki(d=16, k=16, projection=proj))
    a.eval(prompt)
    a.set_attention(Loki(d=4, k=8, l=2))  # no projection: the context keeps its basis
    a.eval([5])
    b = open_llm(path, Loki(d=4, k=8, l=2, projection=proj))
    b.eval(prompt)
    b.eval([5])
    assert np.array_equal(np.array(a.scores[64]), np.array(b.scores[64]))
    with pytest.raises(SparqError, match="d must be in 1..64"):
        a.set_attention(Loki(d=65))
    # the cache holds rotated keys: SparQ (unrotated keys, transposed copy) is not possible here
    with pytest.raises(SparqError, match="created without"):
        a.set_attention(SparQ())


def test_seq_rm_and_state_reload_continue_as_fresh(models):
    path, proj, _ = models["tiny-gqa"]
    assert_rewind_and_reload_continue_as_fresh(path, Loki(d=16, k=16, l=4, projection=proj), tokens(100, seed=4), 70)


def test_context_shift_rotates_back_and_forth(models):
    """seq_rm + seq_add (a context shift): llama.cpp re-ropes the cached keys. In a Loki context they are
    rotated back with P, re-roped and rotated again, so attending to every position gives the dense
    context's logits after the same shift."""
    import llama_cpp

    path, proj, _ = models["tiny"]
    prompt = tokens(120, seed=6)
    logits = []
    # both exact in f32: dense without flash attention (which would round to f16), Loki through its op
    for att, fa in ((Dense(), False), (Loki(d=64, k=4096, projection=proj, sparse_prompt=True), True)):
        llm = Llama(path, att, cache_type="f32", n_ctx=512, n_batch=256, n_ubatch=256, logits_all=True,
                    n_threads=1, n_threads_batch=1, seed=0, flash_attn=fa)
        llm.eval(prompt)
        mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
        assert llama_cpp.llama_memory_seq_rm(mem, 0, 1, 31)
        llama_cpp.llama_memory_seq_add(mem, 0, 31, -1, -30)
        llm.n_tokens = 90
        llm.eval([9, 10])
        logits.append(np.array(llm.scores[91]))
        llm.close()
    assert rel(logits[1], logits[0]) <= TOL


def test_embedded_projection_loads_and_matches_the_file(models, tmp_path):
    path, proj, pca = models["tiny"]
    emb = embed_projection(tmp_path / "embedded.gguf", pca, path, ctx_size=CTX)
    prompt = tokens(60, seed=7)
    a = open_llm(emb, Loki(d=8, k=16))
    a.eval(prompt)
    b = open_llm(path, Loki(d=8, k=16, projection=proj))
    b.eval(prompt)
    assert np.array_equal(np.array(a.scores[:60]), np.array(b.scores[:60]))
    # the copy still loads as a plain model
    c = Llama(emb, Dense(), n_ctx=64)
    c.close()


def test_bad_settings_are_refused(models, tmp_path):
    path, proj, _ = models["tiny"]
    _, gqa_proj, _ = models["tiny-gqa"]
    # no projection given: the one calibrate wrote next to the model, else an error naming where it looked
    assert Llama(path, Loki(d=8), n_ctx=64).attention.projection == str(proj)
    alone = tmp_path / "alone.gguf"
    shutil.copy(path, alone)
    with pytest.raises(SparqError, match=f"needs a projection: .* there is no {tmp_path / 'alone.loki.gguf'}"):
        Llama(alone, Loki(d=8))
    with pytest.raises(SparqError, match="made for another model|made for a model"):
        Llama(path, Loki(d=8, projection=gqa_proj))
    with pytest.raises(SparqError, match="d must be"):
        Llama(path, Loki(d=0, projection=proj))
    with pytest.raises(SparqError, match="d must be"):
        Llama(path, Loki(d=65, projection=proj))
    with pytest.raises(SparqError, match="l must be"):
        Llama(path, Loki(k=8, l=9, projection=proj))
    with pytest.raises(SparqError, match="flash attention"):
        Llama(path, Loki(projection=proj), flash_attn=False)
    with pytest.raises(SparqError, match="not found"):
        Llama(path, Loki(projection=tmp_path / "missing.gguf"))
    # a dense context cannot switch to Loki: its keys are not in a Loki basis
    llm = Llama(path, Dense(), n_ctx=128)
    with pytest.raises(SparqError, match="created without"):
        llm.set_attention(Loki(d=8))


def test_c_api_refuses_a_foreign_projection(models):
    """llama.cpp checks the file on its own (shapes, model name), whatever the caller checked."""
    import llama_cpp

    path, _, _ = models["tiny"]
    _, gqa_proj, _ = models["tiny-gqa"]
    llm = Llama(path, Dense(), n_ctx=64)
    lib = sparse_api.lib()
    model = llm._model.model
    assert lib.llama_sparse_attn_load_projection(model, str(gqa_proj).encode(), False) == sparse_api.LLAMA_SPARSE_ATTN_ERR_PROJECTION
    assert lib.llama_sparse_attn_load_projection(model, str(path).encode(), False) == sparse_api.LLAMA_SPARSE_ATTN_ERR_PROJECTION  # not a projection
    assert lib.llama_sparse_attn_load_projection(model, None, False) == sparse_api.LLAMA_SPARSE_ATTN_ERR_PROJECTION  # nothing embedded
    assert "projection" in sparse_api.strerror(sparse_api.LLAMA_SPARSE_ATTN_ERR_PROJECTION)
    # creating a Loki context with the foreign file fails in C too
    p = sparse_api.default_params()
    p.mode = sparse_api.LLAMA_SPARSE_ATTN_LOKI
    p.loki_proj = str(gqa_proj).encode()
    with pytest.raises(ValueError):
        llama_cpp.Llama(str(path), n_ctx=64, flash_attn=True, verbose=False, sparse_attn=p)


def test_stock_tool_runs_loki_from_env(models, tmp_path):
    import os
    import subprocess

    from stock_tool import assert_refused

    from sparq_cpp.pyext.build import tool_path

    path, proj, _ = models["tiny"]
    exe = tool_path("llama-completion")
    env = dict(os.environ, LLAMA_SPARSE_ATTN=f"loki:d=16,k=32,proj={proj}")
    args = [str(exe), "-m", str(path), "-p", "hello world", "-n", "8", "-fa", "on", "-no-cnv", "-c", "256",
            "-t", "1", "--temp", "0", "-v"]
    proc = subprocess.run(args, capture_output=True, text=True, errors="replace", env=env, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sparse_attn           = loki (d = 16, k = 32, l = 0" in proc.stderr
    assert_refused(args, dict(env, LLAMA_SPARSE_ATTN="loki:d=16,r=4"), "'r' is for sparq")
    # without proj=: the projection next to the model, and the log says so; a model alone is refused
    proc = subprocess.run(args, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL,
                          env=dict(env, LLAMA_SPARSE_ATTN="loki:d=16"), timeout=120)
    assert proc.returncode == 0 and f"loki projection: {proj} (next to the model" in proc.stderr, proc.stderr[-2000:]
    alone = tmp_path / "alone.gguf"
    shutil.copy(path, alone)
    alone_args = [str(alone) if a == str(path) else a for a in args]
    assert_refused(alone_args, dict(env, LLAMA_SPARSE_ATTN="loki:d=16"), "no embedded Loki projection")


def test_generate_cli_with_loki(models):
    from conftest import assert_one_line_error, run_cli

    path, proj, _ = models["tiny"]
    ok = run_cli("generate", "--gguf", str(path), "-n", "8", "--prompt", "hello there", "--temp", "0",
                 "--attn", "loki", "--d", "16", "--k", "32", "--loki-pca", str(proj))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("hello there")
    assert "loki" in ok.stderr and "dense reads" in ok.stderr
    # --d alone selects Loki, with the projection next to the model (<stem>.loki.gguf, as calibrate writes it)
    assert proj == path.with_name(path.stem + ".loki.gguf")
    found = run_cli("generate", "--gguf", str(path), "-n", "2", "--d", "16")
    assert found.returncode == 0 and f"loki    projection {proj} (next to the model" in found.stderr, found.stderr
    assert_one_line_error(run_cli("generate", "--gguf", str(path), "-n", "2", "--d", "0", "--loki-pca", str(proj)),
                          "Invalid value for '--d'")
    assert_one_line_error(run_cli("generate", "--gguf", str(path), "-n", "2", "--d", "65", "--loki-pca", str(proj)),
                          "d must be in 1..64")
    assert_one_line_error(run_cli("generate", "--gguf", str(path), "-n", "2", "--r", "4", "--d", "16"),
                          "pick one --attn")
    assert_one_line_error(run_cli("generate", "--gguf", str(path), "-n", "2", "--attn", "loki", "--loki-pca",
                                  str(models["tiny-gqa"][1])), "made for")


@pytest.mark.parametrize("cache_type, tol", [("f16", 2e-3), ("q8_0", 3e-2)])
def test_f16_and_q8_0_caches(models, cache_type, tol):
    """The rotated keys stored as f16 or q8_0 (no Hadamard rotation for Loki caches). Attending to every
    position, the logits stay as close to the f32 cache's as dense attention's do (measured: q8_0 1.2e-2,
    f16 7e-4; a mix-up of bases or rows would be O(1)). A sparse selection is more sensitive to the
    rounding (k = 24 of 80 on this random model: 13% with q8_0, the same for SparQ), so it is only run."""
    path, proj, _ = models["tiny-gqa"]
    prompt = tokens(80, seed=9)

    def logits(att, ct):
        llm = Llama(path, att, cache_type=ct, n_ctx=512, n_batch=256, n_ubatch=256, logits_all=True,
                    n_threads=1, n_threads_batch=1, seed=0)
        llm.eval(prompt)
        return np.array(llm.scores[:80])

    every = Loki(d=64, k=4096, projection=proj, sparse_prompt=True)
    assert rel(logits(every, cache_type), logits(every, "f32")) <= tol
    sparse = logits(Loki(d=16, k=24, l=4, projection=proj, sparse_prompt=True), cache_type)
    assert np.all(np.isfinite(sparse))
