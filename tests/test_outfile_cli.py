"""`sparq-cpp calibrate -o` to paths that are not regular files, and to file systems that fail: a FIFO gets
the whole projection, /dev/null stays a device, a directory is refused before the run, /dev/full, a full
and a read-only file system end in one error line and exit status 2, with no file left behind.
(calibrate is the cheapest command that writes through sparq_cpp.outfile; all of them do.)"""
from __future__ import annotations

import os
import stat
import subprocess

import click
import pytest
from click.testing import CliRunner

pytest.importorskip("llama_cpp")

from sparq_cpp.calib import read_projection  # noqa: E402
from sparq_cpp.cli.calibrate import command  # noqa: E402
from sparq_cpp.cli.runner import SparqGroup  # noqa: E402
from sparq_cpp.modelfactory import default_model_path  # noqa: E402

from conftest import calibration_text  # noqa: E402
from test_outfile import fifo_reader  # noqa: E402


@click.group(cls=SparqGroup)
def group():
    """The calibrate command inside a group like sparq_cpp/cli/main.py's (SparqError -> one line, exit 2)."""


group.add_command(command)


@pytest.fixture(scope="module")
def model():
    return default_model_path("tiny")


@pytest.fixture(scope="module")
def args(tmp_path_factory, model):
    text = tmp_path_factory.mktemp("text") / "calib.txt"
    text.write_text(calibration_text(), encoding="utf-8")
    return ["--gguf", model, "--text", text, "--tokens", 512, "--ctx-size", 512, "--no-fidelity", "--threads", 2]


def calibrate_to(out, args):
    return CliRunner().invoke(group, ["calibrate", *map(str, args), "--out", str(out)])


def assert_one_line_error(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith("[1/1]")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "wrote" not in result.stderr and "Traceback" not in result.output
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_dev_null_stays_a_device(args):
    before = os.stat(os.devnull)
    r = calibrate_to(os.devnull, args)
    assert r.exit_code == 0, r.output
    assert f"wrote {os.devnull}" in r.stderr
    after = os.stat(os.devnull)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_dev_full_is_an_error(args):
    assert_one_line_error(calibrate_to("/dev/full", args), "--out: no space left on the device for /dev/full")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_fifo_gets_the_projection(args, model, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with fifo_reader(fifo) as got:
        r = calibrate_to(fifo, args)
    assert r.exit_code == 0, r.output
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(got[0])
    assert read_projection(copy, model_path=model).calibration_tokens == 512


def test_directory_is_refused_before_the_run(args, tmp_path):
    (tmp_path / "link").symlink_to(".")
    for out in (tmp_path, tmp_path / "link"):
        r = calibrate_to(out, args)
        assert_one_line_error(r, f"--out: {out} is a directory")
        assert "fitted" not in r.stderr  # before the run
    assert [p.name for p in tmp_path.iterdir()] == ["link"]


def test_full_and_read_only_file_systems(args, small_fs):
    out = small_fs / "p.gguf"  # the projection is ~270 KB; the file system holds 64 KiB
    assert_one_line_error(calibrate_to(out, args), f"--out: no space left on the device for {out}")
    assert list(small_fs.iterdir()) == []
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    r = calibrate_to(out, args)
    assert_one_line_error(r, f"--out: cannot write in {small_fs}: Read-only file system")
    assert "fitted" not in r.stderr  # before the run
