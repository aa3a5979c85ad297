"""The stock tools say what they ran: llama-bench takes a list of sparse settings (a row and a JSON field each) and
says why a context cannot be made; llama-completion logs its setting at the default verbosity, finds the Loki
projection next to the model, and sizes auto for what one sequence may use."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp import Llama, Loki  # noqa: E402
from sparq_cpp.attention import Auto  # noqa: E402
from sparq_cpp.auto import resolve  # noqa: E402
from sparq_cpp.gguf_check import check_gguf  # noqa: E402
from sparq_cpp.modelfactory import default_model_path  # noqa: E402
from sparq_cpp.pyext.build import tool_path  # noqa: E402

pytestmark = pytest.mark.build
ENV = {k: v for k, v in os.environ.items() if k not in ("LLAMA_SPARSE_ATTN", "LLAMA_ARG_SPARSE_ATTN")}
REPO_MODELS = os.path.join(os.path.dirname(__file__), "..", "models")


def run(tool, *args, env=ENV):
    return subprocess.run([str(tool_path(tool)), *map(str, args)], capture_output=True, text=True, errors="replace",
                          env=env, timeout=300, stdin=subprocess.DEVNULL)


def test_llama_bench_takes_a_list_and_reports_each():
    model = default_model_path("tiny")
    proc = run("llama-bench", "-m", model, "-p", "0", "-n", "2", "-r", "1", "-fa", "1", "-t", "1",
               "--sparse-attn", "dense,sparq:r=8,k=16,l=4", "-o", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert [r["sparse_attn"] for r in rows] == ["dense", "sparq:r=8,k=16,l=4"], rows
    proc = run("llama-bench", "-m", model, "-p", "0", "-n", "2", "-r", "1", "-fa", "1", "-t", "1",
               "--sparse-attn", "sparq:r=8,k=16")
    assert proc.returncode == 0 and "sparse_attn" in proc.stdout and "sparq:r=8,k=16" in proc.stdout, proc.stdout
    # a bad setting in the list stops it before any test
    proc = run("llama-bench", "-m", model, "-p", "0", "-n", "2", "--sparse-attn", "dense,sparq:k=x")
    assert proc.returncode != 0 and "invalid value 'x' for key 'k'" in proc.stderr, proc.stderr[-1000:]


def test_llama_bench_says_why_a_context_cannot_be_made():
    proc = run("llama-bench", "-m", default_model_path("tiny"), "-p", "0", "-n", "2", "-fa", "0",
               "--sparse-attn", "sparq:r=8,k=16")
    assert proc.returncode != 0
    err = proc.stderr
    assert "failed to create context" in err and "flash attention" in err, err[-1500:]


def test_completion_logs_its_setting_by_default():
    proc = run("llama-completion", "-m", default_model_path("tiny"), "-p", "hello", "-n", "2", "-no-cnv", "-t", "1",
               "-fa", "on", "--sparse-attn", "sparq:r=8,k=16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sparse attention: sparq (r = 8, k = 16, l = 4, sink = 0, mean value on)" in proc.stderr + proc.stdout


def test_loki_projection_next_to_the_model(tmp_path):
    """llama-completion, llama-bench and the Python API find `<model stem>.loki.gguf` next to the model and say so."""
    model = tmp_path / "austen.q8_0.gguf"
    shutil.copy(os.path.join(REPO_MODELS, "austen.q8_0.gguf"), model)
    shutil.copy(os.path.join(REPO_MODELS, "austen.loki.gguf"), tmp_path / "austen.q8_0.loki.gguf")
    proc = run("llama-completion", "-m", model, "-p", "It is a truth", "-n", "2", "-no-cnv", "-t", "1", "-fa", "on",
               "--sparse-attn", "loki:d=16,k=16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stderr + proc.stdout
    assert f"loki projection: {tmp_path / 'austen.q8_0.loki.gguf'} (next to the model" in out, out[-2000:]
    llm = Llama(str(model), attention=Loki(d=16, k=16), n_ctx=256, n_threads=1)
    assert llm.attention.projection == str(tmp_path / "austen.q8_0.loki.gguf")
    proc = run("llama-bench", "-m", model, "-p", "0", "-n", "2", "-r", "1", "-fa", "1", "-t", "1",
               "--sparse-attn", "loki:d=16,k=16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"loki projection: {tmp_path / 'austen.q8_0.loki.gguf'} (next to the model" in proc.stderr, proc.stderr


def test_auto_sized_for_what_one_sequence_may_use(tmp_path):
    """llama-completion with -np 2 splits the cache: each sequence has half of -c. llama-server without -np runs
    4 slots over one unified cache, where one request may fill all of -c."""
    import time

    from test_auto_stock import _calibrated

    model, summary = _calibrated(tmp_path, "tiny", "random")
    _, why = resolve(Auto(ratio=0.125), model, summary, 1024)
    proc = run("llama-completion", "-m", model, "-p", "hello", "-n", "2", "-no-cnv", "-t", "1", "-fa", "on",
               "-c", "2048", "-np", "2", "--sparse-attn", "auto:ratio=1/8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert why in proc.stderr and "n_ctx=1024 is each sequence's share of the split cache" in proc.stderr

    _, why = resolve(Auto(ratio=0.125), model, summary, 2048)
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        server = subprocess.Popen([str(tool_path("llama-server")), "-m", str(model), "-c", "2048", "-t", "1", "-fa", "on",
                                   "--port", "0", "--sparse-attn", "auto:ratio=1/8"], stdout=f, stderr=subprocess.STDOUT,
                                  env=ENV, stdin=subprocess.DEVNULL)
        try:
            deadline = time.time() + 60
            while time.time() < deadline and "n_ctx=2048" not in log.read_text(errors="replace"):
                if server.poll() is not None:
                    break
                time.sleep(0.2)
        finally:
            server.kill()
            server.wait()
    text = log.read_text(errors="replace")
    assert why in text and "n_ctx=2048 is what one sequence may fill of the unified cache" in text, text[-2000:]
