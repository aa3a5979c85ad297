"""ALISA inside llama.cpp's graph, end to end, on tiny models: logits equal the reference forward pass with
SWAAttention (docs/spec.md, ALISA) through the prompt and the decode steps, the window of past weights survives
removing the end of the sequence and a state save/load, every position kept is dense attention, and what the
mode cannot do is refused by name."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available() or "alisa" not in sparse_api.MODES:
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)", allow_module_level=True)

from conftest import assert_rewind_and_reload_continue_as_fresh, decode_one_by_one, open_llm, rel, tokens  # noqa: E402

from sparq_cpp import ALISA, Dense, SparQ, SparqError  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402
from sparq_cpp.reference.alisa import SWAAttention  # noqa: E402
from sparq_cpp.reference.baselines import DensePrompt  # noqa: E402
from sparq_cpp.reference.forward import LlamaReference  # noqa: E402
from sparq_cpp.reference.gguf_model import load_llama  # noqa: E402

# f32 cache: the prompt's attention and the op accumulate in f32, the reference in f64
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("alisa-models")
    return {preset: write_model(root / f"{preset}.gguf", preset, wtype="f32", seed=3) for preset in ("tiny", "tiny-gqa")}


def reference(path, c):
    att = DensePrompt(SWAAttention(c))
    return att, LlamaReference(load_llama(path), attention=att, cache_type="f32")


def greedy_steps(llm, ref, att, first, n_steps, n):
    """Decode n_steps greedy tokens one by one from the logits `first`; returns the worst relative error."""
    att.prompt = False
    got, worst = first, 0.0
    for _ in range(n_steps):
        tok = int(np.argmax(got[-1]))
        llm.eval([tok])
        got = np.array(llm.scores[n: n + 1])
        worst = max(worst, rel(got, ref.forward([tok])))
        n += 1
    return worst


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
@pytest.mark.parametrize("c,n_prompt", [(0.25, 96), (0.1, 300)])
def test_prompt_and_decode_match_reference(models, preset, c, n_prompt):
    """c = 0.1 at 512 cells keeps 27 steps: the 300-token prompt (two ubatches of 256) records only its last
    rows, and the 40 decode steps slide the window from the prompt's rows into their own."""
    path = models[preset]
    llm = open_llm(path, ALISA(c=c))
    att, ref = reference(path, c)
    prompt = tokens(n_prompt)
    llm.eval(prompt)
    got = np.array(llm.scores[:n_prompt])
    assert rel(got, ref.forward(prompt)) <= TOL
    assert greedy_steps(llm, ref, att, got, 40, n_prompt) <= TOL


def test_selection_is_sparse_and_differs_from_dense(models):
    """The decode steps really attend to a subset: their logits leave dense attention's."""
    path = models["tiny-gqa"]
    prompt = tokens(200, seed=2)
    a = open_llm(path, ALISA(c=0.05))
    a.eval(prompt)
    for t in (5, 6, 7):
        a.eval([t])
    d = LlamaReference(load_llama(path), cache_type="f32").forward(prompt + [5, 6, 7])
    assert rel(np.array(a.scores[200:203]), d[200:]) > 1e-3


def test_every_position_kept_equals_dense(models):
    path = models["tiny"]
    prompt = tokens(80, seed=1)
    want = LlamaReference(load_llama(path), cache_type="f32").forward(prompt + [9, 10, 11])
    llm = open_llm(path, ALISA(c=4.0))
    llm.eval(prompt)
    for t in (9, 10, 11):
        llm.eval([t])
    assert rel(np.array(llm.scores[:83]), want) <= TOL


def test_dense_steps_between_alisa_steps_join_the_window(models):
    """Switched to dense for some steps, the context still records their (dense) weights, as the reference
    records the rows it attends densely; switched back, ALISA goes on from that window."""
    path = models["tiny-gqa"]
    c = 0.2
    llm = open_llm(path, ALISA(c=c))
    att, ref = reference(path, c)
    prompt = tokens(120, seed=3)
    llm.eval(prompt)
    ref.forward(prompt)
    n, worst = len(prompt), 0.0
    for i, tok in enumerate([4, 5, 6, 7, 8, 9, 10, 11]):
        dense = 2 <= i < 5
        llm.set_attention(Dense() if dense else ALISA(c=c))
        att.prompt = dense
        llm.eval([tok])
        worst = max(worst, rel(np.array(llm.scores[n: n + 1]), ref.forward([tok])))
        n += 1
    assert worst <= TOL


def test_lower_c_later_and_larger_c_refused(models):
    path = models["tiny"]
    llm = open_llm(path, ALISA(c=0.25))
    att, ref = reference(path, 0.1)
    prompt = tokens(90, seed=5)
    llm.eval(prompt)
    ref.forward(prompt)
    llm.set_attention(ALISA(c=0.1))  # the window sums are summed again for the smaller window
    att.prompt = False
    llm.eval([3])
    assert rel(np.array(llm.scores[90:91]), ref.forward([3])) <= TOL
    with pytest.raises(SparqError, match="c must be"):
        llm.set_attention(ALISA(c=0.5))
    with pytest.raises(SparqError, match="without support"):
        llm.set_attention(SparQ())


def test_removing_the_end_and_state_reload_continue_as_fresh(models):
    assert_rewind_and_reload_continue_as_fresh(models["tiny-gqa"], ALISA(c=0.3), tokens(100, seed=4), 98,
                                               steps=[3, 4, 5, 6])


@pytest.mark.parametrize("n_rewound", [1, 2, 5, 9])
def test_rewinds_move_the_window_back_exactly(models, n_rewound):
    """After removing the last tokens, the next decode step moves the window sums back by the few ring rows that
    differ (not a sum of the whole window again); across window starts that moved, it continues as fresh."""
    path, prompt, steps = models["tiny-gqa"], tokens(80, seed=5), list(range(3, 3 + 12))
    a = open_llm(path, ALISA(c=0.3))
    a.eval(prompt)
    decode_one_by_one(a, steps)
    a.n_tokens -= n_rewound  # llama_cpp's eval removes the cells >= n_tokens before the next batch
    got = decode_one_by_one(a, [7, 8, 9])
    b = open_llm(path, ALISA(c=0.3))
    b.eval(prompt)
    decode_one_by_one(b, steps[:-n_rewound])
    assert rel(got, decode_one_by_one(b, [7, 8, 9])) <= 1e-6


def test_edits_the_window_cannot_follow_are_refused(models):
    """Removing positions from the middle, or so many from the end that the next window's steps are no longer
    held, fails (as for recurrent models: process the sequence again) and leaves the cache as it was."""
    import llama_cpp

    path = models["tiny"]
    llm = open_llm(path, ALISA(c=0.1))  # 27 steps held
    prompt = tokens(200, seed=6)
    llm.eval(prompt)
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    assert not llama_cpp.llama_memory_seq_rm(mem, 0, 10, 20)
    assert not llama_cpp.llama_memory_seq_rm(mem, 0, 100, -1)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == 199
    llm.eval([5])  # the cache is whole: decoding goes on
    assert llama_cpp.llama_memory_seq_rm(mem, 0, 195, -1)  # the end, within reach
    assert llama_cpp.llama_memory_seq_rm(mem, 0, 0, -1)  # the whole sequence
    # a shift follows a removal from the middle: llama-server turns context shift and cache reuse off
    assert not llama_cpp.llama_memory_can_shift(mem)


def test_bad_settings_are_refused_by_name(models):
    path = models["tiny"]
    for c in (0, -0.5, float("nan"), float("inf"), True, "0.1"):
        with pytest.raises(SparqError, match="c must be"):
            ALISA(c=c)
    from llama_session import Session, captured_log

    with captured_log() as log, pytest.raises(AssertionError, match="could not create the context"):
        Session(path, ALISA(c=0.25), n_seq=2)
    assert any("n_seq_max = 2" in line and "n_seq_max = 1" in line for line in log), "".join(log[-10:])


@pytest.mark.parametrize("value,message", [
    ("alisa:c=0", "c must be a finite number > 0"),
    ("alisa:c=1.0000001", "c must be at most 1 (ALISA's caching ratio"),
    ("alisa:c=abc", "invalid value 'abc' for key 'c'"),
    ("alisa:k=16", "key 'k' is not for alisa"),
    ("sparq:c=0.1", "key 'c' is for alisa, not sparq"),
])
def test_setting_errors(models, value, message):
    """Refused by llama.cpp's parser (behind --sparse-attn) or, for a value it reads, at context creation."""
    from llama_session import Session, captured_log

    from sparq_cpp.bindings import sparse_api

    try:
        params = sparse_api.parse(value)
    except SparqError as e:
        assert message in str(e)
        return
    with captured_log() as log, pytest.raises(AssertionError, match="could not create the context"):
        Session(models["tiny"], params)
    assert any(message in line for line in log), "".join(log[-10:])


def test_cli_generate_and_serve(models):
    from conftest import assert_one_line_error, run_cli

    path = str(models["tiny-gqa"])
    proc = run_cli("generate", "--gguf", path, "-n", "8", "--temp", "0", "--prompt", "hello there " * 40,
                   "--attn", "alisa", "--alisa-c", "0.2", "--cache-type", "f32", "-t", "1")
    assert proc.returncode == 0, proc.stderr
    assert "attn    alisa: the last step read" in proc.stderr
    proc = run_cli("serve", "--gguf", path, "--alisa-c", "0.2", "--print-command")
    assert proc.returncode == 0 and "LLAMA_SPARSE_ATTN=alisa:c=0.2,min_n_kv=0 " in proc.stdout
    assert_one_line_error(run_cli("serve", "--gguf", path, "--attn", "alisa", "-np", "2", "--print-command"),
                          "--parallel must be 1")
    assert_one_line_error(run_cli("generate", "--gguf", path, "--alisa-c", "0.2", "--k", "16"),
                          "ALISA takes only --alisa-c")
    assert_one_line_error(run_cli("generate", "--gguf", path, "--attn", "sparq", "--alisa-c", "0.2"), "use --attn alisa")
    for c in ("0", "1.5"):  # c is a share of the positions, in (0, 1]
        proc = run_cli("generate", "--gguf", path, "--alisa-c", c)
        assert proc.returncode == 2 and "'--alisa-c'" in proc.stderr and "0<x<=1" in proc.stderr, proc.stderr
    proc = run_cli("generate", "--gguf", path, "--c", "4096")  # meant as -c 4096: refused, not run as ALISA
    assert proc.returncode == 2 and "ambiguous beside -c" in proc.stderr and "--alisa-c" in proc.stderr, proc.stderr


def test_server_reports_alisa_and_restores_a_slot(models, tmp_path):
    """llama-server with ALISA (one slot): /props reports it; a repeated prompt reuses the cache (removing the
    end of the sequence; its last token is then a decode step, no longer a prompt row, so the text may differ);
    a saved slot restored after an erase continues with the same text."""
    from conftest import Server, assert_slot_restore_continues

    server = Server(models["tiny"], "--alisa-c", "0.25", tmp_path=tmp_path)
    try:
        props = server.get("/props")["sparse_attn"]
        assert props["mode"] == "alisa" and props["c"] == pytest.approx(0.25)
        prompt = "hello there " * 30
        assert server.complete(prompt, n=8, cache_prompt=True)
        assert server.complete(prompt, n=8, cache_prompt=True)
        assert_slot_restore_continues(server, prompt, 6, "alisa-slot.bin")
    finally:
        server.close()


def test_python_eval_processes_the_kept_tokens_again_where_removal_is_refused(models):
    """Rewinding a Llama (n_tokens) further than the window can follow: its eval processes the kept tokens again as
    a prompt, so it continues as a fresh context given them."""
    path = models["tiny"]
    prompt = tokens(200, seed=8)
    a = open_llm(path, ALISA(c=0.1))  # 27 steps held
    a.eval(prompt)
    a.n_tokens = 100
    got = decode_one_by_one(a, [7, 8])
    b = open_llm(path, ALISA(c=0.1))
    b.eval(prompt[:100])
    want = decode_one_by_one(b, [7, 8])
    assert rel(got, want) <= 1e-6


def test_a_model_with_sliding_window_layers_is_refused_by_name(tmp_path):
    """ALISA's window follows one full-attention cache: Gemma 3's interleaved sliding-window layers are refused
    before llama.cpp is asked (which refuses them too)."""
    path = write_model(tmp_path / "g3.gguf", "tiny-gemma3", wtype="f32", seed=1)
    with pytest.raises(SparqError, match="sliding-window layers"):
        open_llm(path, ALISA(c=0.25))
    from llama_session import Session, captured_log

    with captured_log() as log, pytest.raises(AssertionError, match="could not create the context"):
        Session(path, ALISA(c=0.25))
    assert any("ALISA attention was requested" in line for line in log), "".join(log[-10:])


def test_quantized_cache(models):
    """A q8_0 cache: the prompt's weights are taken from its dequantized rows (a first version transposed the
    quantized V rows and gave NaN); every position kept, it stays close to the f16 cache's result."""
    from sparq_cpp import Llama

    path = models["tiny-gqa"]
    prompt = tokens(120, seed=9)
    got = {}
    for cache in ("q8_0", "f16"):
        llm = Llama(path, ALISA(c=4.0), cache_type=cache, n_ctx=512, n_batch=256, n_ubatch=256, logits_all=True,
                    n_threads=1, n_threads_batch=1, seed=0)
        llm.eval(prompt)
        for t in (5, 6):
            llm.eval([t])
        got[cache] = np.array(llm.scores[:122])
        llm.close()
    assert np.all(np.isfinite(got["q8_0"]))
    assert rel(got["q8_0"], got["f16"]) <= 0.05
