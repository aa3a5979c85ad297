"""SparQ inside llama.cpp's graph, end to end: logits equal the reference forward pass with the
SparQ kernel, decoding survives cache edits, and bad settings give clear errors."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)",
                allow_module_level=True)

from sparq_cpp import Dense, Llama, SparQ, SparqError  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402
from sparq_cpp.reference.attention import SparQAttention  # noqa: E402
from sparq_cpp.reference.forward import LlamaReference  # noqa: E402
from sparq_cpp.reference.gguf_model import load_llama  # noqa: E402

from conftest import open_llm, rel, tokens  # noqa: E402

# f32 cache, every row through SparQ: the op accumulates in f32, the reference in f64.
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparq-models")
    return {p: write_model(root / f"{p}.gguf", p, wtype="f32", seed=3) for p in ("tiny", "tiny-gqa")}


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
@pytest.mark.parametrize("mean_value", [True, False])
def test_prompt_and_decode_match_reference(models, preset, mean_value):
    r, k, l = 8, 24, 6
    path = models[preset]
    llm = open_llm(path, SparQ(r=r, k=k, l=l, mean_value=mean_value, sparse_prompt=True))
    ref = LlamaReference(load_llama(path), attention=SparQAttention(r, k, l, mean_value), cache_type="f32")
    prompt = tokens(96)
    llm.eval(prompt)
    got = np.array(llm.scores[: len(prompt)])
    assert rel(got, ref.forward(prompt)) <= TOL
    # 64 decode steps, one token at a time (the mean of V then comes from the running sums)
    n = len(prompt)
    for step in range(64):
        tok = int(np.argmax(got[-1]))
        llm.eval([tok])
        got = np.array(llm.scores[n: n + 1])
        want = ref.forward([tok])
        assert rel(got, want) <= TOL, f"decode step {step}"
        n += 1


def test_every_position_selected_equals_dense(models):
    path = models["tiny-gqa"]
    prompt = tokens(80, seed=1)
    sparse = open_llm(path, SparQ(r=128, k=4096, sparse_prompt=True))
    sparse.eval(prompt)
    ref = LlamaReference(load_llama(path), cache_type="f32")  # dense oracle
    assert rel(np.array(sparse.scores[:80]), ref.forward(prompt)) <= TOL


def test_set_attention_between_steps(models):
    """Changing r, k, l (or back to dense) between decode calls needs no new context."""
    path = models["tiny"]
    prompt = tokens(64, seed=2)
    a = open_llm(path, SparQ(r=8, k=16))
    a.eval(prompt)
    a.set_attention(SparQ(r=4, k=8, l=0))
    a.eval([5])
    b = open_llm(path, SparQ(r=4, k=8, l=0))
    b.eval(prompt)
    b.eval([5])
    assert np.array_equal(np.array(a.scores[64]), np.array(b.scores[64]))
    with pytest.raises(SparqError, match="r must be in 1..64"):
        a.set_attention(SparQ(r=65))


def _decode_one_by_one(llm, toks):
    for t in toks:
        llm.eval([t])  # single-token steps: SparQ with the mean of V from the running sums
    return np.array(llm.scores[llm.n_tokens - 1])


def test_seq_rm_then_continue_equals_fresh(models):
    """After removing the tail of the cache, decoding continues as a fresh context would."""
    path = models["tiny"]
    att = SparQ(r=8, k=16, l=4)
    prompt = tokens(100, seed=4)
    a = open_llm(path, att)
    a.eval(prompt)
    a.n_tokens = 70  # llama_cpp's eval removes cells >= n_tokens (seq_rm) before the next batch
    got = _decode_one_by_one(a, [7, 8, 9])
    b = open_llm(path, att)
    b.eval(prompt[:70])  # same batching as `a` had for these positions
    want = _decode_one_by_one(b, [7, 8, 9])
    assert rel(got, want) <= 1e-6


def test_state_save_load_continues(models):
    path = models["tiny-gqa"]
    att = SparQ(r=16, k=16, l=4)
    prompt = tokens(90, seed=5)
    a = open_llm(path, att)
    a.eval(prompt)
    state = a.save_state()
    a.eval([11])
    want = np.array(a.scores[90])
    b = open_llm(path, att)
    b.load_state(state)
    b.eval([11])
    assert rel(np.array(b.scores[90]), want) <= 1e-5


def test_bad_settings_are_refused(models):
    path = models["tiny"]
    with pytest.raises(SparqError, match="r must be"):
        Llama(path, SparQ(r=0))
    with pytest.raises(SparqError, match="k must be"):
        Llama(path, SparQ(k=0))
    with pytest.raises(SparqError, match="l must be"):
        Llama(path, SparQ(k=8, l=9))
    with pytest.raises(SparqError, match="flash attention"):
        Llama(path, SparQ(), flash_attn=False)
    with pytest.raises(SparqError):
        Llama(path, SparQ(), cache_type="q4_0")
    # a dense context cannot switch to SparQ: the transposed K copy was not allocated
    llm = Llama(path, Dense(), n_ctx=128)
    with pytest.raises(SparqError, match="(?i)created without|transposed"):
        llm.set_attention(SparQ())


def test_c_api_return_codes(models):
    """The C API validates on its own (return codes with messages naming the parameter)."""
    import llama_cpp

    path = models["tiny"]
    llm = Llama(path, SparQ(r=8, k=16), n_ctx=128)
    ctx = llm._ctx.ctx
    for field, value, needle in [("r", 0, "r"), ("r", 65, "r"), ("k", 0, "k"), ("l", 17, "l")]:
        p = sparse_api.get_params(ctx)
        setattr(p, field, value)
        with pytest.raises(SparqError, match=needle):
            sparse_api.set_params(ctx, p)
    assert sparse_api.get_params(ctx).r == 8  # a refused setting leaves the old one in place
    # a cache type without a kernel is refused when the context is created
    p = sparse_api.default_params()
    p.mode = sparse_api.LLAMA_SPARSE_ATTN_SPARQ
    with pytest.raises(ValueError):
        llama_cpp.Llama(str(path), n_ctx=128, flash_attn=True, type_k=2, type_v=2, verbose=False, sparse_attn=p)
    with pytest.raises(ValueError):  # and so is SparQ without flash attention
        llama_cpp.Llama(str(path), n_ctx=128, flash_attn=False, verbose=False, sparse_attn=p)


def test_stock_tool_runs_sparq_from_env(models, tmp_path):
    import os
    import subprocess

    from stock_tool import assert_refused

    from sparq_cpp.pyext.build import tool_path

    exe = tool_path("llama-completion")
    env = dict(os.environ, LLAMA_SPARSE_ATTN="sparq:r=16,k=32,l=8")
    proc = subprocess.run([str(exe), "-m", str(models["tiny"]), "-p", "hello world", "-n", "8", "-fa", "on",
                           "-no-cnv", "-c", "256", "-t", "1", "--temp", "0", "-v"],
                          capture_output=True, text=True, errors="replace", env=env, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sparse_attn           = sparq (r = 16, k = 32, l = 8" in proc.stderr
    assert_refused([exe, "-m", models["tiny"], "-p", "x", "-n", "2", "-fa", "on", "-no-cnv"],
                   dict(env, LLAMA_SPARSE_ATTN="sparq:k=x"), "invalid value 'x' for key 'k'")
    # the flag and its LLAMA_ARG_ variable, as for every setting of the stock tools; the flag wins
    base = {k: v for k, v in os.environ.items() if k not in ("LLAMA_SPARSE_ATTN", "LLAMA_ARG_SPARSE_ATTN")}
    for extra, env2, want in [(["--sparse-attn", "sparq:r=8,k=16"], base, "sparq (r = 8, k = 16, l = -1"),
                              ([], dict(base, LLAMA_ARG_SPARSE_ATTN="sparq:r=4,k=8"), "sparq (r = 4, k = 8, l = -1"),
                              (["--sparse-attn", "sparq:r=8,k=16"], dict(base, LLAMA_SPARSE_ATTN="sparq:r=4,k=8"),
                               "sparq (r = 8, k = 16, l = -1")]:
        proc = subprocess.run([str(exe), "-m", str(models["tiny"]), "-p", "hello world", "-n", "4", "-fa", "on",
                               "-no-cnv", "-c", "256", "-t", "1", "--temp", "0", "-v", *extra],
                              capture_output=True, text=True, errors="replace", env=env2, timeout=120,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"sparse_attn           = {want}" in proc.stderr, (extra, proc.stderr[-3000:])
    assert_refused([exe, "-m", models["tiny"], "-p", "x", "-n", "2", "-fa", "on", "-no-cnv", "--sparse-attn", "sparq:k=x"],
                   base, "invalid value 'x' for key 'k'")
    # the first positions kept: logged, and refused beyond k - l by llama.cpp's own check
    proc = subprocess.run([str(exe), "-m", str(models["tiny"]), "-p", "hello world", "-n", "4", "-fa", "on", "-no-cnv",
                           "-c", "256", "-t", "1", "--temp", "0", "-v", "--sparse-attn", "sparq:r=8,k=16,l=4,sink=2"],
                          capture_output=True, text=True, errors="replace", env=base, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sparse_attn           = sparq (r = 8, k = 16, l = 4, sink = 2," in proc.stderr
    assert_refused([exe, "-m", models["tiny"], "-p", "x", "-n", "2", "-fa", "on", "-no-cnv", "--sparse-attn",
                    "sparq:r=8,k=16,l=4,sink=13"], base, "sink in 0..k - l")


def test_stock_tool_runs_sparq_on_a_sliding_window_model(tmp_path):
    """tiny-gemma3 interleaves window and full layers: the stock tool runs SparQ on the full layers."""
    import os
    import subprocess

    from sparq_cpp.pyext.build import tool_path

    path = write_model(tmp_path / "tiny-gemma3.gguf", "tiny-gemma3", wtype="f16", seed=0)
    env = dict(os.environ, LLAMA_SPARSE_ATTN="sparq:r=16,k=32,l=8")
    proc = subprocess.run([str(tool_path("llama-completion")), "-m", str(path), "-p", "hello world", "-n", "8",
                           "-fa", "on", "-no-cnv", "-c", "256", "-t", "1", "--temp", "0", "-v"],
                          capture_output=True, text=True, errors="replace", env=env, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sparse_attn           = sparq (r = 16, k = 32, l = 8" in proc.stderr
    assert "creating     SWA KV cache" in proc.stderr


def test_llama_is_a_class(models):
    import llama_cpp

    import sparq_cpp
    from sparq_cpp.llm import Llama as LlamaFromLlm

    assert isinstance(Llama, type) and Llama is sparq_cpp.Llama is LlamaFromLlm
    assert issubclass(Llama, llama_cpp.Llama) and Llama.__qualname__ == "Llama"
    llm = open_llm(models["tiny"], SparQ(r=8, k=16))
    assert isinstance(llm, Llama) and isinstance(llm, llama_cpp.Llama)


def _gemma2_from_gemma3(src, dst):
    """A loadable gemma2 file (soft-capped attention logits): tiny-gemma3's tensors without the q/k norms and the
    output head (gemma2 ties it to the embedding)."""
    import gguf

    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, "gemma2")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name.startswith("gemma3.rope.freq_base_swa"):
            continue
        new = "gemma2" + name[len("gemma3"):] if name.startswith("gemma3.") else name
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(new, field.contents(), field.types[0], sub_type=sub_type)
    w.add_float32("gemma2.attn_logit_softcapping", 50.0)
    w.add_float32("gemma2.final_logit_softcapping", 30.0)
    for t in reader.tensors:
        if not t.name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")) and t.name != "output.weight":  # tied in gemma2
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_soft_capped_model_is_refused_by_the_stock_tool_and_the_cli(tmp_path):
    """A gemma2 model (soft-capped logits) runs dense in the stock tool, and sparse attention is refused by
    name there and in sparq-cpp, with one clear error each."""
    import os
    import subprocess

    from stock_tool import assert_refused

    from sparq_cpp.pyext.build import tool_path

    src = write_model(tmp_path / "tiny-gemma3.gguf", "tiny-gemma3", wtype="f16", seed=0)
    path = _gemma2_from_gemma3(src, tmp_path / "tiny-gemma2.gguf")
    args = [tool_path("llama-completion"), "-m", path, "-p", "hello", "-n", "4", "-fa", "on", "-no-cnv", "-c", "256",
            "-t", "1", "--temp", "0"]
    dense = subprocess.run([str(a) for a in args], capture_output=True, text=True, errors="replace", timeout=120,
                           stdin=subprocess.DEVNULL, env={k: v for k, v in os.environ.items() if k != "LLAMA_SPARSE_ATTN"})
    assert dense.returncode == 0, dense.stderr[-2000:]
    assert_refused(args, {"LLAMA_SPARSE_ATTN": "sparq:r=16,k=32"}, "soft-capping")
    proc = subprocess.run([os.path.join(os.path.dirname(os.sys.executable), "sparq-cpp"), "generate", "--gguf", str(path),
                           "-n", "2", "--sparq-r", "16", "--sparse-k", "32"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "soft-caps its attention logits" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
