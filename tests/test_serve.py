"""`sparq-cpp serve`: the patched llama-server with SparQ settings, over real HTTP on 127.0.0.1:
/props and the log report the settings, OpenAI-style completions and chat completions (streaming
and not, several slots at once), slot save/restore continuing exactly, SparQ selecting every
position against dense, and bad settings refused before the server starts."""
from __future__ import annotations

import concurrent.futures

import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.pyext import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)", allow_module_level=True)

from sparq_cpp.modelfactory import write_model  # noqa: E402

from conftest import SERVER_N_CTX, Server, assert_slot_restore_continues, run_cli  # noqa: E402

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("serve") / "tiny.gguf", "tiny", wtype="f32", seed=6)


@pytest.fixture(scope="module")
def sparq_server(model, tmp_path_factory):
    s = Server(model, "--r", "8", "--k", "8", "--l", "2", "--parallel", "2", tmp_path=tmp_path_factory.mktemp("slots"))
    yield s
    s.close()


PROMPTS = ["Once upon a time", "It is a truth universally", "The weather today", "In the beginning there was"]


def test_props_and_log_report_the_settings(sparq_server):
    sa = sparq_server.get("/props")["sparse_attn"]
    assert sa == {"mode": "sparq", "r": 8, "k": 8, "l": 2, "mean_value": True, "min_n_kv": 0,
                  "sparse_prompt": False}
    assert 'sparse attention: {"k":8,"l":2' in sparq_server.text()


def test_completions_and_chat_streaming_and_not(sparq_server):
    text = sparq_server.complete("Once upon a time", n=10)
    assert isinstance(text, str) and text
    events = sparq_server.stream("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0})
    assert "".join(e["choices"][0]["text"] for e in events) == text  # the same tokens, streamed
    chat = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 10, "temperature": 0}
    reply = sparq_server.post("/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    events = sparq_server.stream("/v1/chat/completions", chat)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == reply


def test_several_slots_at_once(sparq_server):
    """Four requests on two slots, each answered in full. (Whether a sequence decodes the same tokens
    alone and beside others is not asserted: the graph still takes the dense path for a whole ubatch
    that holds a prompt, so a sequence's tokens can depend on what else is decoded with it.)"""
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        res = list(ex.map(lambda p: sparq_server.post("/v1/completions", {"prompt": p, "max_tokens": 12,
                                                                          "temperature": 0}), PROMPTS))
    assert [r["usage"]["completion_tokens"] for r in res] == [12] * len(PROMPTS)


def test_slot_save_restore_continues_exactly(sparq_server):
    assert_slot_restore_continues(sparq_server, "It was the best of times, it was the worst of times", 16, "slot0.bin")


def test_every_position_selected_gives_dense_text(model, tmp_path):
    dense = Server(model, "--attn", "dense", "--cache-type", "f32", tmp_path=tmp_path)
    try:
        want = [dense.complete(p, n=16) for p in PROMPTS]
    finally:
        dense.close()
    full = Server(model, "--r", "64", "--k", str(SERVER_N_CTX), "--l", "0", "--cache-type", "f32", tmp_path=tmp_path)
    try:
        got = [full.complete(p, n=16) for p in PROMPTS]
    finally:
        full.close()
    assert got == want


@pytest.mark.parametrize("args,message", [
    (["--r", "65"], "r must be in 1..64"),
    (["--k", "0"], "k must be >= 1"),
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--d", "8", "--r", "8"], "pick one --attn"),
])
def test_bad_settings_are_refused_before_the_server_starts(model, args, message):
    proc = run_cli("serve", "--gguf", str(model), *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
