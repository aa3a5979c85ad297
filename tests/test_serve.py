"""`sparq-cpp serve`: the patched llama-server with SparQ settings, over real HTTP on 127.0.0.1:
/props and the log report the settings, the openai client's completions and chat completions (streaming
and not, several slots at once), slot save/restore continuing exactly, SparQ selecting every
position against dense; bad settings, forwarded options that would override a checked one and a busy
port refused before the server starts."""
from __future__ import annotations

import concurrent.futures

import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

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
    assert sa == {"mode": "sparq", "r": 8, "k": 8, "l": 2, "sink": 0, "mean_value": True, "min_n_kv": 0,
                  "sparse_prompt": False}
    assert 'sparse attention: {"k":8,"l":2,"sink":0,"min_n_kv":0' in sparq_server.text()


def _client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", timeout=120)


def test_openai_client_completions_and_chat_streaming_and_not(sparq_server):
    """The openai package, as users point it at the server: completions and chat completions, streamed
    and not (the same tokens both ways at temperature 0)."""
    client = _client(sparq_server)
    assert [m.id for m in client.models.list().data]
    done = client.completions.create(model="m", prompt="Once upon a time", max_tokens=10, temperature=0)
    text = done.choices[0].text
    assert text and done.usage.completion_tokens == 10 and done.choices[0].finish_reason == "length"
    chunks = client.completions.create(model="m", prompt="Once upon a time", max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    messages = [{"role": "user", "content": "Tell me a story."}]
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
    content = reply.choices[0].message.content
    assert content and reply.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_several_slots_at_once(sparq_server):
    """Four openai-client requests on two slots, each answered in full. (Whether a sequence decodes the same
    tokens alone and beside others is not asserted: the graph still takes the dense path for a whole ubatch
    that holds a prompt, so a sequence's tokens can depend on what else is decoded with it.)"""
    client = _client(sparq_server)

    def ask(prompt):
        return client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        res = list(ex.map(ask, PROMPTS))
    assert [r.usage.completion_tokens for r in res] == [12] * len(PROMPTS)
    assert len(sparq_server.get("/slots")) == 2  # two slots served the four


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
    (["--sparq-r", "65"], "r must be in 1..64"),
    (["--k", "0"], "k must be >= 1"),
    (["--alisa-c", "2"], "0<x<=1"),
    (["--alisa-c", "1.00000000000000001"], "0<x<=1"),  # above 1, though it reads as the float 1.0
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--d", "8", "--r", "8"], "pick one --attn"),
    (["-fa", "off", "--r", "8"], "needs flash attention"),
    # only what follows `--` goes to llama-server: a typo before it is an error, not forwarded
    (["--temprature", "0.5"], "No such option '--temprature'"),
    (["-np", "2", "extra.gguf"], "unexpected extra argument"),
    # forwarded options that would replace a checked setting
    (["--", "-m", "other.gguf"], "-m after `--` would override"),
    (["--", "--model=other.gguf"], "--model after `--` would override"),
    (["--", "-c", "100000"], "-c after `--` would override"),
    (["--", "-ctk", "q4_0"], "-ctk after `--` would override"),
    (["--", "--cache-type-v", "q4_0"], "--cache-type-v after `--` would override"),
    (["--", "-fa", "off"], "-fa after `--` would override"),
    (["--", "-np", "8"], "-np after `--` would override"),
    (["--", "--port", "9"], "--port after `--` would override"),
    (["--", "--sparse-attn", "sparq:r=100"], "--sparse-attn after `--` would override"),
])
def test_bad_settings_are_refused_before_the_server_starts(model, args, message):
    proc = run_cli("serve", "--gguf", str(model), "--print-command", *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_forwarded_options_and_llama_cpp_spellings(model):
    proc = run_cli("serve", "-m", str(model), "-ctk", "q8_0", "-ctv", "f16", "--sparse-k", "16", "--print-command",
                   "--", "--alias", "tiny", "--metrics")
    assert proc.returncode == 0, proc.stderr
    assert "-ctk q8_0 -ctv f16 -fa on --alias tiny --metrics" in proc.stdout
    assert proc.stdout.startswith("LLAMA_SPARSE_ATTN=sparq:r=16,k=16,")


def test_a_busy_port_is_refused_before_the_server_starts(model):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_cli("serve", "-m", str(model), "--port", str(port), "--sparq-r", "8", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in proc.stderr and "serving" not in proc.stderr
