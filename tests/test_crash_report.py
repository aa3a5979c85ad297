"""A native crash inside a test fails that test, named, with its signal, and the run goes on (the tests run in a
pytest-xdist worker; tests/conftest.py adds the signal from the worker's fatal-error dump)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("sig, words", [("SIGILL", "Illegal instruction"), ("SIGSEGV", "Segmentation fault")])
def test_a_signal_fails_its_test_and_the_run_goes_on(tmp_path, sig, words):
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_configure, pytest_handlecrashitem\n")
    (tmp_path / "test_native.py").write_text(f"""
import ctypes, signal

def test_before():
    pass

def test_engine_dies():
    getattr(ctypes.CDLL(None), "raise")(signal.{sig})  # from C, as a crash in the engine would

def test_after():
    pass
""")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("SPARQ_PYTEST_CRASH_DIR", None)  # the inner run's own
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider", "-c", "/dev/null",
                           "--rootdir", str(tmp_path), "test_native.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 2 passed" in out, out
    assert "crashed while running 'test_native.py::test_engine_dies'" in out, out
    failures = out[out.index("= FAILURES ="):]
    assert f"Fatal Python error: {words}" in failures, out
    assert "test_native.py\", line" in failures, out  # the test's own frame
