"""A build is installed only after it ran here: a build whose prompt path dies is refused, naming the stage and
the signal, and the installed build stays. The crash is injected into the real engine by preloading a library
whose graph compute raises SIGILL, as a miscompiled kernel would."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparq_cpp.errors import SparqError
from sparq_cpp.pyext import smoke
from sparq_cpp.pyext.build import INSTALL_RECORD, Build, installed_build

pytestmark = pytest.mark.build

CRASH_C = r"""
#include <signal.h>
int ggml_backend_sched_graph_compute_async(void * sched, void * graph) {
    (void) sched; (void) graph;
    raise(SIGILL);  /* what a kernel with an instruction this CPU lacks does on its first prompt */
    return 0;
}
"""


@pytest.fixture(scope="module")
def installed():
    rec = installed_build()
    if not rec:
        pytest.skip("no patched build installed (run `make setup`)")
    b = Build.load(Path(rec["root"]))
    if b is None:
        pytest.skip("the installed build's folder has no manifest")
    return b


@pytest.fixture(scope="module")
def crash_preload(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("preload")
    (d / "crash.c").write_text(CRASH_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", str(d / "crash.c"), "-o", str(d / "crash.so")], check=True)
    return d / "crash.so"


def test_the_installed_build_passes(installed):
    smoke.check(installed, log=lambda *_: None, again=True)
    assert smoke.passed(installed)


def test_a_build_that_dies_names_the_stage_and_signal(installed, crash_preload):
    with pytest.raises(SparqError) as e:
        smoke.check(installed, log=lambda *_: None, again=True, extra_env={"LD_PRELOAD": str(crash_preload)})
    msg = str(e.value)
    assert "stage 'dense'" in msg and "died of SIGILL (illegal instruction)" in msg, msg
    assert "was not installed" in msg and "smoke.log" in msg, msg
    if installed.options.get("native", True):
        assert "BUILD_ARGS=--no-native" in msg, msg
    assert not smoke.passed(installed)
    smoke.check(installed, log=lambda *_: None)  # and without the fault it passes again
    assert smoke.passed(installed)


def test_setup_refuses_it_and_keeps_the_installed_build(installed, crash_preload):
    key = subprocess.run([sys.executable, "-m", "sparq_cpp.pyext.build", "--print-key"], capture_output=True,
                         text=True, check=True).stdout.strip()
    if key != installed.key:
        pytest.skip(f"the default build ({key}) is not the installed one ({installed.key}): it would compile")
    before = INSTALL_RECORD.read_bytes(), INSTALL_RECORD.stat().st_mtime_ns
    env = dict(os.environ, LD_PRELOAD=str(crash_preload))
    proc = subprocess.run([sys.executable, "-m", "sparq_cpp.pyext.build", "--smoke-again"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "stage 'dense'" in proc.stderr and "SIGILL" in proc.stderr, proc.stderr
    assert (INSTALL_RECORD.read_bytes(), INSTALL_RECORD.stat().st_mtime_ns) == before
    smoke.check(installed, log=lambda *_: None)
