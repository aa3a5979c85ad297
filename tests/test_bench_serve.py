"""`sparq-cpp bench serve`: its clients against a stub server written here (the latency accounting on known
timings, a cancelled user closing its stream, the server's errors reported and not hidden), its settings refused
before anything starts, and (slow tier) a small real run on SmolLM2 whose JSON fields are checked."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("httpx")
from sparq_cpp.bench.serve_client import (Conversation, Reply, minus, run_users, stream_chat, summarize,
                                             union_seconds)  # noqa: E402
from sparq_cpp.bench import serve_load  # noqa: E402
from sparq_cpp.bench.serve_load import failures  # noqa: E402
from sparq_cpp.bindings import sparse_api  # noqa: E402
from sparq_cpp.doctable import marked_block  # noqa: E402
from sparq_cpp.cli.main import cli  # noqa: E402
from tools import serve_table  # noqa: E402

from conftest import run_cli  # noqa: E402

TIMINGS = {"cache_n": 0, "prompt_n": 100, "prompt_ms": 50.0, "predicted_n": 4, "predicted_ms": 40.0}


def _event(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _token(text) -> bytes:
    return _event({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})


class _Stub(BaseHTTPRequestHandler):
    """Answers POST .../v1/chat/completions as the first path component says:
    /ok: a role chunk after `first` s, then 4 tokens `gap` s apart, timings with cache_n = the prompt's turns - 1;
    /http400: an error body; /midstream: a token, then an error event; /cut: a token, then the connection closes;
    /slow: a token every 0.1 s until the client goes away (then the server's `gone` event is set);
    /mixed: a user whose message holds FAIL gets HTTP 500, the others /ok;
    /busy: as /ok, but the last two tokens are " x2 x3" when another request was in flight at some time before them
    (a server whose batch changes the text)."""
    first, gap = 0.2, 0.05

    def log_message(self, *args):
        pass

    def _sse_head(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        kind = self.path.split("/")[1]
        self.server.bodies.append(body)
        if kind == "mixed":
            kind = "http500" if "FAIL" in body["messages"][0]["content"] else "ok"
        me = {"company": False}
        with self.server.lock:  # a request that overlaps another in time has company, both of them
            for other in self.server.active:
                other["company"] = me["company"] = True
            self.server.active.append(me)
        try:
            self._answer(kind, body, me)
        finally:
            with self.server.lock:
                self.server.active[:] = [x for x in self.server.active if x is not me]

    def _answer(self, kind, body, me):
        if kind in ("http400", "http500"):
            code = int(kind[4:])
            data = json.dumps({"error": {"code": code, "message": "the request exceeds the available context size",
                                         "type": "exceed_context_size_error"}}).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self._sse_head()
        if kind in ("ok", "busy"):
            time.sleep(self.first)
            self.wfile.write(_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}))
            for i in range(4):
                if i:
                    time.sleep(self.gap)
                self.wfile.write(_token(f" x{i}" if kind == "busy" and me["company"] and i >= 2 else f" w{i}"))
            turns = sum(m["role"] == "user" for m in body["messages"])
            timings = {**TIMINGS, "cache_n": 90 * (turns - 1), "prompt_n": 100 if turns == 1 else 12}
            self.wfile.write(_event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                                     "timings": timings}))
            self.wfile.write(b"data: [DONE]\n\n")
        elif kind == "midstream":
            self.wfile.write(_token("a"))
            self.wfile.write(_event({"error": {"code": 500, "message": "llama_decode failed", "type": "server_error"}}))
        elif kind == "cut":
            self.wfile.write(_token("a"))
        elif kind == "slow":
            try:
                for _ in range(200):
                    self.wfile.write(_token("x"))
                    time.sleep(0.1)
            except OSError:  # the client closed the connection
                self.server.gone.set()


@pytest.fixture
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    server.daemon_threads = True
    server.bodies, server.gone = [], threading.Event()
    server.lock, server.active = threading.Lock(), []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _one(base, kind, **kw):
    httpx = pytest.importorskip("httpx")

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            return await stream_chat(client, f"/{kind}/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, **kw)
    return asyncio.run(main())


def test_a_streamed_reply_is_timed_as_it_arrives(stub):
    server, base = stub
    rep = _one(base, "ok", user=3, turn=1)
    assert rep.ok and rep.status == 200 and rep.user == 3 and rep.turn == 1
    assert rep.text == " w0 w1 w2 w3" and rep.finish_reason == "length" and rep.timings["predicted_n"] == 4
    assert len(rep.token_times) == 4 and rep.n_tokens == 4  # the role chunk is not a token
    assert 0.19 <= rep.ttft < 0.2 + 0.5  # the stub sleeps 0.2 s before the first token
    assert all(0.04 <= g < 0.05 + 0.3 for g in rep.gaps), rep.gaps  # 0.05 s apart, as read here
    assert server.bodies[0]["stream"] is True


def test_latency_accounting_on_known_timings():
    """Two users whose replies overlap: known TTFTs, gaps, decode window and prompt window."""
    a = Reply(user=0, turn=0, t_send=0.0, t_first=1.0, t_end=2.1, token_times=[1.0, 1.5, 2.0],
              timings={"cache_n": 0, "prompt_n": 1000, "predicted_n": 3})
    b = Reply(user=1, turn=0, t_send=0.0, t_first=1.5, t_end=3.1, token_times=[1.5, 2.0, 2.5, 3.0],
              timings={"cache_n": 0, "prompt_n": 1000, "predicted_n": 4})
    c = Reply(user=0, turn=1, t_send=2.2, t_first=2.4, t_end=3.0, token_times=[2.4, 2.6],
              timings={"cache_n": 1010, "prompt_n": 10, "predicted_n": 2})
    bad = Reply(user=1, turn=1, t_send=3.2, t_end=3.3, status=500, error="HTTP 500: boom")
    s = summarize([a, b, c, bad], wall_s=4.0)
    assert (s["requests"], s["failed"]) == (4, 1)
    assert s["errors"] == [{"user": 1, "turn": 1, "status": 500, "error": "HTTP 500: boom"}]
    # tokens after each first one: 2 + 3 + 1 = 6, over the union of [1.0, 2.0], [1.5, 3.0], [2.4, 2.6] = 2.0 s
    assert s["decode_tokens_per_s"] == pytest.approx(3.0)
    # without a prompt waiting: [1.5, 2.2] and [2.4, 3.0] (c's prompt waits in [2.2, 2.4]); the tokens after a first
    # one in them: a's 2.0, b's 2.0, 2.5, 3.0 and c's 2.6
    assert s["decode_only_s"] == pytest.approx(1.3)
    assert s["decode_only_tokens_per_s"] == pytest.approx(5 / 1.3)
    assert s["output_tokens_per_s"] == pytest.approx(9 / 4.0) and s["generated_tokens"] == 9
    assert s["ttft_s"]["p50"] == pytest.approx(1.0) and s["ttft_s"]["max"] == pytest.approx(1.5)
    assert s["ttft_by_turn_s"]["1"]["p50"] == pytest.approx(0.2)
    # gaps: 0.5, 0.5 (a), 0.5 x 3 (b), 0.2 (c)
    assert s["itl_s"]["n"] == 6 and s["itl_s"]["p50"] == pytest.approx(0.5) and s["itl_s"]["max"] == pytest.approx(0.5)
    # the gaps no prompt window ([0, 1.5], [2.2, 2.4]) overlaps: a's [1.5, 2.0], b's [1.5, 2.0] and [2.5, 3.0], c's
    # [2.4, 2.6] (it starts as c's own prompt window ends)
    q = s["itl_decode_only_s"]
    assert q["n"] == 4 and q["p50"] == pytest.approx(0.5) and q["max"] == pytest.approx(0.5)
    assert s["itl_decode_only_p99_over_p50"] == pytest.approx(q["p99"] / 0.5)
    # prompt: 2010 tokens processed while some request waited for its first token: [0, 1.5] + [2.2, 2.4]
    assert s["prompt_tokens_per_s"] == pytest.approx(2010 / 1.7)
    assert s["prompt_cache"] == {"requests_from_cache": pytest.approx(1 / 3), "followups_from_cache": 1.0,
                                 "cached_token_share": pytest.approx(1010 / 3020)}
    assert union_seconds([(0, 1), (0.5, 2), (3, 4), (5, 5)]) == pytest.approx(3.0)
    assert minus([(0, 4), (5, 8)], [(1, 2), (3, 6), (7, 9)]) == [(0, 1), (2, 3), (6, 7)]


@pytest.mark.parametrize("kind, message", [
    ("http400", "HTTP 400: the request exceeds the available context size"),
    ("midstream", "the server reported an error in the stream: llama_decode failed"),
    ("cut", "the stream ended before [DONE]"),
])
def test_errors_from_the_server_are_reported(stub, kind, message):
    rep = _one(stub[1], kind)
    assert not rep.ok and rep.error == message


def test_a_failed_turn_is_counted_and_the_other_users_go_on(stub):
    server, base = stub
    convs = [Conversation(0, ["doc A", "next?"]), Conversation(1, ["doc FAIL", "next?"]),
             Conversation(2, ["doc C", "next?"])]
    replies, _, wall = asyncio.run(run_users(f"{base}/mixed", convs, max_tokens=4, timeout_s=10))
    assert sorted((r.user, r.turn, r.ok) for r in replies) == [(0, 0, True), (0, 1, True), (1, 0, False),
                                                               (2, 0, True), (2, 1, True)]
    follow = [b for b in server.bodies if len(b["messages"]) == 3]
    assert follow and all(b["messages"][1] == {"role": "assistant", "content": " w0 w1 w2 w3"} for b in follow)
    assert all(b["temperature"] == 0 and b["cache_prompt"] and b["ignore_eos"] for b in server.bodies)
    s = summarize(replies, wall)
    assert s["failed"] == 1 and s["prompt_cache"]["followups_from_cache"] == 1.0
    doc = {"results": [{"mode": "sparq", "depth": 4096, "users": 3, **s}]}
    assert failures(doc) == ("1 of 5 requests failed; the first: sparq S=4k users=3, user 1 turn 1: "
                             "HTTP 500: the request exceeds the available context size")


def test_each_user_alone_is_compared_with_the_users_together(stub):
    """Two users at once on a server whose batch changes the text: each differs from its replay alone, at the
    character where the first changed token starts; one user alone is the same as itself."""
    server, base = stub
    convs = [Conversation(0, ["doc A"]), Conversation(1, ["doc B"])]
    replies, _, _ = asyncio.run(run_users(f"{base}/busy", convs, max_tokens=4, timeout_s=10))
    assert all(r.text == " w0 w1 x2 x3" for r in replies), [r.text for r in replies]
    cfg = serve_load.ServeBenchConfig(model=None, max_tokens=4, request_timeout=10)
    bar = serve_load.tqdm(disable=True)
    got = serve_load.same_as_alone(cfg, f"{base}/busy", convs, replies, bar, "t")
    assert (got["compared"], got["identical"], got["errors"]) == (2, 0, [])
    assert [(d["user"], d["turn"], d["at_char"], d["alone"]) for d in got["differ"]] == [
        (0, 0, 7, " w0 w1 w2 w3"), (1, 0, 7, " w0 w1 w2 w3")]
    alone, _, _ = asyncio.run(run_users(f"{base}/busy", convs[:1], max_tokens=4, timeout_s=10))
    same = serve_load.same_as_alone(cfg, f"{base}/busy", convs[:1], alone, bar, "t")
    assert (same["compared"], same["identical"], same["differ"]) == (1, 1, [])
    doc = {"results": [{"mode": "sparq", "depth": 4096, "users": 2, "requests": 2, "errors": [],
                        "same_as_alone": {**got, "errors": [{"user": 1, "turn": 0, "status": 500,
                                                             "error": "alone: HTTP 500: boom"}]}}]}
    assert failures(doc) == "1 of 2 requests failed; the first: sparq S=4k users=2, user 1 turn 1: alone: HTTP 500: boom"


def test_a_cancelled_user_closes_its_stream(stub):
    server, base = stub
    httpx = pytest.importorskip("httpx")

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            task = asyncio.create_task(stream_chat(client, "/slow/v1/chat/completions", {"messages": []}))
            await asyncio.sleep(0.35)
            task.cancel()
            t0 = time.perf_counter()
            with pytest.raises(asyncio.CancelledError):
                await task
            return time.perf_counter() - t0

    assert asyncio.run(main()) < 1.0
    assert server.gone.wait(5), "the stub kept streaming to a cancelled client"


@pytest.mark.parametrize("args, message", [
    (["--users", "0"], "--users: '0' is not a number of users >= 1"),
    (["--users", "1,x"], "--users: 'x' is not a number"),
    (["--modes", "dense,fast"], "--modes: unknown mode 'fast'"),
    (["--depth", "32"], "--depth: must be more than 64 tokens"),
    (["--depth", "4q"], "--depth: cannot read '4q'"),
    (["--turns", "0"], "--turns: must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens: must be >= 1"),
    (["--text", "/nonexistent/book.txt"], "--text: file not found"),
    (["--depth", "1024k"], "tokens of context per user, more than the"),
])
def test_bad_settings_are_refused_before_anything_starts(args, message):
    res = CliRunner().invoke(cli, ["bench", "serve", *args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output, res.output


def test_each_mode_gets_its_methods_options():
    sparse = ("--sparq-r", "8", "--sparse-k", "64", "--no-mean-value", "--loki-pca", "/p.gguf", "--loki-d", "16")
    assert serve_load.mode_options(sparse, "sparq") == ["--sparq-r", "8", "--sparse-k", "64", "--no-mean-value"]
    assert serve_load.mode_options(sparse, "loki") == ["--sparse-k", "64", "--loki-pca", "/p.gguf", "--loki-d", "16"]
    assert serve_load.mode_options(sparse, "dense") == []


def test_the_end_to_end_bench_options_do_not_reach_serve():
    res = CliRunner().invoke(cli, ["bench", "--depths", "1k", "serve"])
    assert res.exit_code == 2 and "--depths belongs to `sparq-cpp bench` itself" in res.output, res.output


@pytest.mark.slow
def test_smollm2_users_and_modes(tmp_path):
    """The issue's small configuration on SmolLM2-135M: 1 and 4 users at 4k, dense and SparQ, 2 turns."""
    pytest.importorskip("llama_cpp")
    if not sparse_api.available():
        pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)")
    out = tmp_path / "serve.json"
    proc = run_cli("bench", "serve", "--model", "smollm2-135m", "--users", "1,4", "--depth", "4k", "--modes",
                   "dense,sparq", "--turns", "2", "--max-tokens", "16", "-o", str(out), "--no-progress",
                   timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "sparq-cpp-bench-serve/1" and "serve" in doc["command"]
    assert doc["machine"]["build"]["key"] and doc["machine"]["cpu_model"] and Path(out.with_suffix(".png")).is_file()
    rows = {(r["mode"], r["users"]): r for r in doc["results"]}
    assert set(rows) == {("dense", 1), ("dense", 4), ("sparq", 1), ("sparq", 4)}
    for (mode, users), r in rows.items():
        assert r["failed"] == 0 and r["requests"] == 2 * users and r["depth"] == 4096
        assert r["decode_tokens_per_s"] > 0 and r["decode_only_tokens_per_s"] > 0 and r["prompt_tokens_per_s"] > 0 and r["generated_tokens"] == 32 * users
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p95"] and 0 < r["itl_s"]["p50"] <= r["itl_s"]["p99"]
        assert r["prompt_cache"]["followups_from_cache"] == 1.0  # every second turn continued from its slot
        assert all(4096 - 64 <= n <= 4096 + 64 for n in r["depth_tokens"]), r["depth_tokens"]
        assert r["peak_rss_bytes"] > 0 and r["kv_bytes_per_user"] > 0
        assert (r["sparse_attn"].get("mode") or "dense") == mode
        assert len(r["replies"]) == 2 * users
        assert 0 < r["itl_decode_only_s"]["p50"] <= r["itl_decode_only_s"]["p99"]
        if users > 1:  # every reply replayed alone and compared (the count of identical texts is the measurement)
            a = r["same_as_alone"]
            assert a["compared"] == 2 * users and a["errors"] == [] and a["identical"] == a["compared"] - len(a["differ"])
    # SparQ's transposed K copy: half the f16 K and V caches again, per user
    assert rows[("sparq", 4)]["kv_bytes_per_user"] == 3 * rows[("dense", 4)]["kv_bytes_per_user"] // 2
    assert "decode" in proc.stdout and "sparq" in proc.stdout


def test_peak_memory_and_cpu_are_the_servers_not_its_wrappers():
    """`sparq-cpp serve` is a Python process whose child is llama-server: the bench reads the whole tree."""
    child = "x = bytearray(200 << 20); x[::4096] = b'x' * len(x[::4096]); import time; time.sleep(5)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"])
    try:
        deadline = time.time() + 10
        while time.time() < deadline and serve_load.tree_status(parent.pid).get("VmHWM", 0) < 200 << 20:
            time.sleep(0.1)
        assert len(serve_load.process_tree(parent.pid)) == 2
        assert serve_load.tree_status(parent.pid)["VmHWM"] >= 200 << 20 > serve_load.proc_status(parent.pid)["VmHWM"]
        assert serve_load.proc_cpu_seconds(parent.pid) > 0
    finally:
        for pid in reversed(serve_load.process_tree(parent.pid)):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        parent.wait()


def test_the_docs_table_is_rendered_from_its_json():
    """docs/serving.md's table is what serve_table renders from the JSON files its marker names."""
    root = Path(__file__).resolve().parent.parent
    files, body = marked_block(root / "docs" / "serving.md", "serve-table")
    assert files and body.strip() == serve_table.markdown([root / f for f in files]).strip()


def _serve_doc(rows):
    base = {"decode_tokens_per_s": 10.0, "decode_only_tokens_per_s": 20.0, "ttft_s": {"p50": 1.0, "p95": 2.0},
            "itl_s": {"p50": 0.01, "p99": 0.02}, "itl_decode_only_s": {"p50": 0.01, "p99": 0.012},
            "same_as_alone": None, "peak_rss_bytes": 1 << 20, "kv_bytes_per_user": 1 << 20}
    return {"schema": "sparq-cpp-bench-serve/1", "model": {"path": "/m/tiny.gguf"},
            "results": [{**base, "depth": 4096, **r} for r in rows]}


def test_a_row_measured_again_replaces_the_first(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_serve_doc([{"users": 1, "mode": "dense"}, {"users": 4, "mode": "loki"},
                                        {"users": 8, "mode": "loki"}])))
    b.write_text(json.dumps(_serve_doc([{"users": 4, "mode": "loki", "decode_only_tokens_per_s": 99.0}])))
    body = serve_table.markdown([a, b]).splitlines()[2:]
    assert [r.split(" | ")[2:4] for r in body] == [["1", "dense"], ["4", "loki"], ["8", "loki"]]
    assert body[1].split(" | ")[5] == "99.0" and body[2].split(" | ")[5] == "20.0"


def test_the_table_refuses_another_json(tmp_path):
    bad = tmp_path / "e2e.json"
    bad.write_text(json.dumps({"schema": "sparq-cpp-bench/1"}))
    assert serve_table.main([str(bad)]) == 2
