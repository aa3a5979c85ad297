"""The thread-waiting benchmark runs every configuration as a generate child and records what it measured."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("llama_cpp")
from sparq_cpp.demo_model import default_model  # noqa: E402
from tools import thread_wait  # noqa: E402


def test_quiet_and_loaded_rows_with_the_cpu(tmp_path):
    out = tmp_path / "tw.json"
    res = CliRunner().invoke(thread_wait.main, ["-m", str(default_model(lambda *_: None)), "--repeats", "1",
                                                "--policies", "passive", "--n-predict", "4", "--prompt-words", "90",
                                                "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["cpu_model"] and doc["threads"] == 2
    got = {(r["load"], r["mode"], r["policy"]) for r in doc["rows"]}
    assert got == {(load, mode, "passive") for load in ("quiet", "loaded") for mode in ("dense", "sparq")}
    assert all(r["median_ms"] > 0 for r in doc["rows"])


def test_a_policy_reaches_the_child(monkeypatch):
    seen = {}

    def fake_run(cmd, env, **kw):
        seen["policy"] = env.get("OMP_WAIT_POLICY")

        class P:
            returncode, stderr = 0, "decode      10 tokens in   0.050 s"
        return P()

    monkeypatch.setattr(thread_wait.subprocess, "run", fake_run)
    assert thread_wait.decode_ms("m", [], "passive", 2, 10, "p", 10) == pytest.approx(5.0)
    assert seen["policy"] == "passive"
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    thread_wait.decode_ms("m", [], "default", 2, 10, "p", 10)
    assert seen["policy"] is None


def test_generate_warns_when_other_processes_hold_the_cpu():
    import os

    from conftest import run_cli

    with thread_wait.Load(os.cpu_count() or 1):
        # long enough for the kernel's 10 ms CPU accounting to tell (CpuMonitor.MIN_WALL_S)
        proc = run_cli("generate", "-n", "480", "-c", "512", "--ignore-eos", "--temp", "0", "-t", "1", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "warning: other processes used" in proc.stderr, proc.stderr[-800:]
    assert "threads other processes use" in proc.stderr and "OMP_WAIT_POLICY=passive" in proc.stderr


def test_passive_waiting_only_when_the_cpu_is_busy():
    from sparq_cpp import system

    env = {}
    assert system.choose_thread_wait(env, share=0.1) is None and env == {}
    note = system.choose_thread_wait(env, share=0.6)
    assert env == {"OMP_WAIT_POLICY": "passive"} and "60% of the CPU" in note
    for chosen in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "1000"}):
        env = dict(chosen)
        assert system.choose_thread_wait(env, share=0.9) is None and env == chosen


def test_a_build_times_llama_bench_with_the_policies_it_takes(tmp_path):
    from sparq_cpp.pyext.build import tool_path

    out = tmp_path / "tw.json"
    tools = str(tool_path("llama-completion").parent)
    res = CliRunner().invoke(thread_wait.main, ["-m", str(default_model(lambda *_: None)), "--repeats", "1",
                                                "--policies", "passive,poll50", "--n-predict", "4",
                                                "--prompt-words", "90", "--tools", tools, "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["runner"] == "llama-bench"
    # the installed build uses OpenMP: the poll policy is the thread pool's, not run here
    assert {(r["build"], r["policy"]) for r in doc["rows"]} == {("OpenMP", "passive")}
    assert all(r["median_ms"] > 0 for r in doc["rows"])


def test_poll_reaches_llama_bench(monkeypatch):
    seen = {}

    def fake_run(cmd, env, **kw):
        seen["cmd"] = cmd

        class P:
            returncode, stdout, stderr = 0, '[{"avg_ns": 40000000}]', ""
        return P()

    monkeypatch.setattr(thread_wait.subprocess, "run", fake_run)
    assert thread_wait.decode_ms("m", [], "poll50", 2, 10, "p", 10, tools="/b") == pytest.approx(4.0)
    assert seen["cmd"][0] == "/b/llama-bench" and seen["cmd"][-2:] == ["--poll", "50"]
    with pytest.raises(Exception, match="give --tools"):
        thread_wait.decode_ms("m", [], "poll50", 2, 10, "p", 10)


def test_serve_says_when_the_machine_gets_busy_after_the_server_started(capsys):
    """choose_thread_wait decides when the server starts; a load that starts later is noticed by serve's watch
    (two windows in a row) and said once. The server here is a stand-in that sleeps."""
    import os
    import sys

    from sparq_cpp.cli.serve import run_server

    with thread_wait.Load(os.cpu_count() or 1):
        rc = run_server([sys.executable, "-c", "import time; time.sleep(2.5)"], {**os.environ}, watch_s=0.5)
    assert rc == 0
    err = capsys.readouterr().err
    assert err.count("other processes now use") == 1 and "OMP_WAIT_POLICY=passive" in err, err
    rc = run_server([sys.executable, "-c", "import time; time.sleep(1.5)"], {**os.environ, "OMP_WAIT_POLICY": "passive"},
                    watch_s=0.5)
    assert rc == 0 and "other processes" not in capsys.readouterr().err
