"""`sparq-cpp serve` safe by default: without an API key no web page of another origin gets CORS access
(llama-server's default lets any page the user opens call the API, slots included) unless --cors asks;
the options after `--` that expose files or run tools are warned about; and the server exits within a few
seconds of SIGTERM while it generates, and with serve when serve is killed."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)", allow_module_level=True)

from sparq_cpp.modelfactory import write_model  # noqa: E402

from conftest import Server, run_cli  # noqa: E402

EVIL, LOCAL = "https://evil.example", "http://localhost:3000"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("serve") / "tiny.gguf", "tiny", wtype="f32", seed=6)


def request(server, path, origin=None, method="GET", body=None, headers=None):
    """(status, headers) of one request with an Origin header (a browser's cross-origin call)."""
    h = {"Content-Type": "application/json", **({"Origin": origin} if origin else {}), **(headers or {})}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data, headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status, r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.headers


def allowed(server, origin, method="GET", path="/props", **kw):
    status, headers = request(server, path, origin, method, **kw)
    return headers.get("Access-Control-Allow-Origin")


# ---- CORS -------------------------------------------------------------------------------------------

def test_no_cors_for_other_origins_by_default(model, tmp_path):
    s = Server(model, tmp_path=tmp_path)
    try:
        for origin in (EVIL, "null", None):
            for method, path in (("GET", "/props"), ("OPTIONS", "/slots/0?action=erase"), ("GET", "/health")):
                assert allowed(s, origin, method, path) is None, (origin, method, path)
        assert allowed(s, EVIL, "POST", "/v1/completions", body={"prompt": "a", "max_tokens": 1}) is None
        assert allowed(s, LOCAL) == LOCAL  # a page of this machine (llama.cpp's "localhost" setting)
        assert allowed(s, "http://127.0.0.1:8000", "OPTIONS", "/v1/completions") == "http://127.0.0.1:8000"
    finally:
        s.close()


def test_cors_is_what_was_asked(model, tmp_path):
    s = Server(model, "--cors", "https://app.example", tmp_path=tmp_path)
    try:
        assert allowed(s, "https://app.example") == "https://app.example"
        assert allowed(s, EVIL) == "https://app.example"  # the one origin a browser lets read the replies
    finally:
        s.close()
    s = Server(model, "--", "--api-key", "k")  # with a key, llama-server's default stands: any origin, keyed
    try:
        assert allowed(s, EVIL, headers={"Authorization": "Bearer k"}) == EVIL
        assert request(s, "/props", EVIL)[0] == 401
    finally:
        s.close()


def serve_argv(model, *args, env=None):
    proc = run_cli("serve", "-m", str(model), "--print-command", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    warnings = [ln[len("warning: "):] for ln in proc.stderr.splitlines() if ln.startswith("warning: ")]
    return proc.stdout.split(), warnings


def test_cors_option_and_its_defaults(model):
    argv, warnings = serve_argv(model)
    assert argv[-2:] == ["--cors-origins", "localhost"] and warnings == []
    argv, _ = serve_argv(model, "--cors", "https://a.example,https://b.example")
    assert argv[-2:] == ["--cors-origins", "https://a.example,https://b.example"]
    for args, env in ((["--", "--api-key", "k"], None), (["--", "--api-key-file=keys"], None),
                      ([], {"LLAMA_API_KEY": "k"}), ([], {"LLAMA_ARG_CORS_ORIGINS": "https://c.example"})):
        argv, _ = serve_argv(model, *args, env=None if env is None else {**os.environ, **env})
        assert "--cors-origins" not in argv, (args, env)
    argv, warnings = serve_argv(model, "--cors", "*")
    assert argv[-2:] == ["--cors-origins", "*"]
    assert warnings == ["--cors * without an API key: any web page the user opens can call the server"]
    proc = run_cli("serve", "-m", str(model), "--print-command", "--", "--cors-origins", "*")
    assert proc.returncode == 2 and "--cors-origins after `--` would override" in proc.stderr and \
        "serve's own --cors" in proc.stderr


def test_options_that_expose_files_or_tools_are_warned_about(model):
    _, warnings = serve_argv(model, "--", "--tools", "all", "-ag", "--agent", "--path=/", "--no-ui-mcp-proxy")
    assert warnings == [
        "--tools all gives any process of this machine (no API key is set) built-in tools that read and write "
        "files and run shell commands; llama.cpp marks it experimental, not for untrusted use",
        "-ag gives any process of this machine (no API key is set) every built-in tool (files, shell commands) and "
        "the MCP CORS proxy; llama.cpp marks it experimental, not for untrusted use",
        "--path / gives any process of this machine (no API key is set) every file under the folder, as static files"]
    argv, warnings = serve_argv(model, "--host", "0.0.0.0", env={**os.environ, "LLAMA_ARG_TOOLS": "read_file"})
    assert warnings == [
        "LLAMA_ARG_TOOLS=read_file gives anyone who can reach 0.0.0.0 (no API key is set) built-in tools that read "
        "and write files and run shell commands; llama.cpp marks it experimental, not for untrusted use",
        "--host 0.0.0.0 without an API key (-- --api-key KEY): anyone who can reach it can use the server, "
        "its slots included"]
    _, warnings = serve_argv(model, "--", "--api-key", "k", "--mcp-servers-config", "mcp.json")
    assert warnings == ["--mcp-servers-config mcp.json gives whoever holds the API key the tools of MCP servers; "
                        "llama.cpp marks it experimental, not for untrusted use"]
    assert serve_argv(model, env={**os.environ, "LLAMA_ARG_AGENT": "0"})[1] == []  # set off: nothing to say


# ---- stopping ---------------------------------------------------------------------------------------

def test_sigterm_while_generating_exits_within_seconds(model):
    """A client waiting for a long completion held llama-server after SIGTERM until the client gave up (the
    generation stops, the HTTP request does not end); serve ends it within a few seconds."""
    s = Server(model, "--ctx-size", "512", "--", "--context-shift")  # generates until stopped
    got: list = []

    def ask(stream):
        body = {"prompt": "Once upon a time", "n_predict": 1_000_000, "ignore_eos": True, "stream": stream}
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{s.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
            got.append("answered")
        except Exception as e:  # noqa: BLE001 - the server going away is what this test expects
            got.append(type(e).__name__)

    try:
        clients = [threading.Thread(target=ask, args=(stream,), daemon=True) for stream in (False, True)]
        for t in clients:
            t.start()
        deadline = time.time() + 30
        while not any(slot.get("is_processing") for slot in s.get("/slots")):
            assert time.time() < deadline, "the server never started generating"
            time.sleep(0.1)
        time.sleep(0.5)
        t0 = time.perf_counter()
        s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(timeout=30)
        took = time.perf_counter() - t0
        print(f"serve exited {took:.2f} s after SIGTERM while generating (status {rc})")
        assert took < 8, took
        assert rc in (0, 128 + signal.SIGTERM), rc
        for t in clients:
            t.join(10)
        assert len(got) == 2  # every client got an answer or a closed connection, none waits
    finally:
        s.close()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's /proc")
def test_kill_of_serve_ends_the_server(model):
    s = Server(model)
    (server,) = _children(s.proc.pid)
    try:
        s.proc.kill()
        s.proc.wait(10)
        deadline = time.time() + 10
        while Path(f"/proc/{server}").exists() and Path(f"/proc/{server}/stat").read_text().split()[2] != "Z":
            assert time.time() < deadline, "llama-server outlived serve"
            time.sleep(0.05)
    finally:
        s.close()
        if Path(f"/proc/{server}").exists():
            os.kill(server, signal.SIGKILL)
