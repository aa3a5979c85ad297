"""`make check-series`: every prefix of the patch series builds. The fast test runs the driver on a fake
build (the failing patch is named, with its errors); the slow one builds the real series."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sparq_cpp.errors import SparqError
from sparq_cpp.pyext import seriescheck


def test_the_first_patch_that_does_not_build_is_named(tmp_path, monkeypatch):
    names = ["0001-a.patch", "0002-b.patch", "0003-c.patch"]
    at = {}
    monkeypatch.setattr(seriescheck, "init_tree", lambda tree, log=None: tree.mkdir(parents=True))
    monkeypatch.setattr(seriescheck, "tree_commits", lambda tree: [(f"sha{i}", f"subject {i}") for i in range(1, 4)])
    monkeypatch.setattr(seriescheck, "series", lambda: [Path(n) for n in names])
    monkeypatch.setattr(seriescheck, "checkout", lambda tree, sha: at.update(sha=sha))

    def fake_run(cmd, stdout, stderr, env):
        if cmd[:2] == ["cmake", "--build"] and at["sha"] in ("sha2", "sha3"):
            stdout.write(b"[1/2] Building CXX object src/x.cpp.o\nFAILED: src/x.cpp.o\n"
                         b"src/x.cpp:3:5: error: 'y' was not declared in this scope\n")
            return subprocess.CompletedProcess(cmd, 1)
        if cmd[:2] == ["cmake", "-S"]:
            (tmp_path / "cmake-build").mkdir(exist_ok=True)
            (tmp_path / "cmake-build" / "CMakeCache.txt").write_text("")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(seriescheck.subprocess, "run", fake_run)
    lines = []
    with pytest.raises(SparqError, match=r"patch 2 \(0002-b.patch\) does not build on the ones before it") as e:
        seriescheck.check_series(tmp_path, log=lines.append)
    assert "error: 'y' was not declared" in str(e.value)
    assert [ln.split()[2] for ln in lines] == ["ok", "FAIL"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["first_failure"] == "0002-b.patch" and [p["built"] for p in report["patches"]] == [True, False]
    assert not (tmp_path / "build-0001.log").exists() and (tmp_path / "build-0002.log").exists()

    # --keep-going builds every prefix and lists each failure
    with pytest.raises(SparqError, match="0002-b.patch"):
        seriescheck.check_series(tmp_path, keep_going=True, log=lines.append)
    report = json.loads((tmp_path / "report.json").read_text())
    assert [p["built"] for p in report["patches"]] == [True, False, False]


@pytest.mark.slow
def test_every_prefix_of_the_series_builds():
    """The real series, every prefix built (about 25 minutes on 2 cores without ccache's hits, minutes with)."""
    report = seriescheck.check_series()
    assert report["first_failure"] is None and all(p["built"] for p in report["patches"])
