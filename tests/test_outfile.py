"""Output files: errors that name the option and the problem before any work, and no partial file
after a failed or interrupted write."""
from __future__ import annotations

import os

import pytest

from sparq_cpp.errors import SparqError
from sparq_cpp.outfile import atomic_write, check_writable


def test_check_writable_names_the_problem(tmp_path):
    assert check_writable(tmp_path / "out.json", "--json") == tmp_path / "out.json"
    (tmp_path / "f").write_text("x")
    for path, message in [(tmp_path, f"--json: {tmp_path} is a directory"),
                          (tmp_path / "no" / "out.json", "does not exist"),
                          (tmp_path / "f" / "out.json", "f is not a directory")]:
        with pytest.raises(SparqError, match=message):
            check_writable(path, "--json")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(SparqError, match="--json: cannot write in"):
            check_writable(ro / "out.json", "--json")


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "sub" / "out.txt"
    with pytest.raises(SparqError, match=f"--json: directory {tmp_path / 'sub'} does not exist"):
        atomic_write(path, lambda tmp: tmp.write_text("one"), "--json")  # a mistyped path is not created
    assert not (tmp_path / "sub").exists()
    assert atomic_write(path, lambda tmp: tmp.write_text("one"), make_parents=True) == path  # a cache's are
    assert path.read_text() == "one" and oct(path.stat().st_mode & 0o777) == "0o644"

    def fail(tmp):
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, fail)
    assert path.read_text() == "one"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.txt"]  # no temporary file left
    with pytest.raises(SparqError, match="--plot: .* is a directory"):
        atomic_write(tmp_path, lambda tmp: None, "--plot")
