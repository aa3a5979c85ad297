"""The core install: a fresh virtual environment with `pip install .` (the core dependencies only: no
extra, so no numba, matplotlib or torch) and the patched llama-cpp-python wheel of the build in use runs
generate (chatting with an instruct model), calibrate and serve; what needs an extra says which."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
import venv
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from sparq_cpp.modelfactory import default_model_path  # noqa: E402
from sparq_cpp.pyext.build import INSTALL_RECORD, installed_build  # noqa: E402

from conftest import calibration_text  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(argv, cwd, timeout=600):
    return subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def core_env(tmp_path_factory):
    rec = installed_build()
    if rec is None:
        pytest.skip("no patched build installed here (make setup)")
    wheel = json.loads((Path(rec["root"]) / "manifest.json").read_text())["wheel"]
    root = tmp_path_factory.mktemp("core")
    venv.create(root / "venv", with_pip=True)
    py = root / "venv" / "bin" / "python"
    for argv in ([py, "-m", "pip", "install", "-q", str(REPO)],
                 [py, "-m", "pip", "install", "-q", "--no-deps", wheel]):
        proc = _run(argv, cwd=root, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    # what pyext.build.install records beside the wheel: serve finds llama-server through it
    shutil.copy(INSTALL_RECORD, root / "venv" / INSTALL_RECORD.name)
    return root, root / "venv" / "bin" / "sparq-cpp"


def test_no_extra_is_installed(core_env):
    root, _ = core_env
    py = root / "venv" / "bin" / "python"
    for module in ("numba", "matplotlib", "torch"):
        proc = _run([py, "-c", f"import {module}"], cwd=root)
        assert proc.returncode != 0, f"{module} came with the core install"


def test_core_install_generates_calibrates_and_serves(core_env):
    root, exe = core_env
    chat = default_model_path(chat=True)
    proc = _run([exe, "generate", "-m", chat, "-p", "What is the capital of France?", "--temp", "0", "-t", "1"], root)
    assert proc.returncode == 0, proc.stderr
    assert "stop    end of turn (<|im_end|>)" in proc.stderr

    model = root / "m.gguf"
    shutil.copy(default_model_path(), model)
    (root / "text.txt").write_text(calibration_text())
    proc = _run([exe, "calibrate", "-m", model, "--text", root / "text.txt", "--tokens", "1024", "-c", "256",
                 "-t", "1"], root)
    assert proc.returncode == 0 and "wrote" in proc.stderr, proc.stderr
    proc = _run([exe, "calibrate", "-m", model, "--text", root / "text.txt", "--figure", root / "f.png"], root)
    assert proc.returncode == 2 and "--figure needs matplotlib" in proc.stderr and "sparq-cpp[plot]" in proc.stderr, \
        proc.stderr

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(exe), "serve", "-m", str(model), "--loki-d", "16", "--port", str(port), "-t", "1"],
                              cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        t0, health = time.time(), None
        while time.time() - t0 < 60 and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    health = json.load(r)
                    break
            except OSError:
                time.sleep(0.3)
        assert health == {"status": "ok"}, server.poll()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/props", timeout=30) as r:
            assert json.load(r)["sparse_attn"]["mode"] == "loki"  # with the projection found beside the model
    finally:
        server.terminate()
        out = server.communicate(timeout=30)[0].decode(errors="replace")
    assert f"loki    projection {root / 'm.loki.gguf'}" in out, out[-2000:]


def test_core_install_cli_starts_without_the_extras(core_env):
    root, exe = core_env
    for args in (["-h"], ["eval", "-h"], ["bench", "-h"], ["make-model", "-h"]):
        proc = _run([exe, *args], root)
        assert proc.returncode == 0 and "Usage:" in proc.stdout, (args, proc.stderr[-2000:])
    assert sys.prefix not in str(exe)  # the environment under test, not this one
