"""Output files: errors that name the option and the problem before any work, and no partial file
after a failed or interrupted write; a path that is not a regular file (a device, a FIFO, a directory,
a link to one) is written in place or refused, never replaced; a failing file system is one error."""
from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import subprocess
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest

from sparq_cpp.errors import SparqError
from sparq_cpp.outfile import atomic_write, check_space, check_writable


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


# ---- paths that are not regular files ------------------------------------------------------------

def _kind(path) -> int:
    return stat.S_IFMT(os.stat(path).st_mode)


def test_dev_null_is_written_in_place_and_stays_a_device():
    before = os.stat(os.devnull)
    assert atomic_write(os.devnull, lambda tmp: tmp.write_bytes(b"x" * 100_000), "--out") == Path(os.devnull)
    after = os.stat(os.devnull)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    assert check_writable(os.devnull, "--out") == Path(os.devnull)
    check_space(os.devnull, 1 << 60, "--out")  # a device has no file system's space to check


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_dev_full_is_one_error_and_stays_a_device():
    for write in (lambda tmp: tmp.write_bytes(b"x" * 100_000), lambda tmp: tmp.write_text("x")):
        with pytest.raises(SparqError, match="^--out: no space left on the device for /dev/full$"):
            atomic_write("/dev/full", write, "--out")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


@contextlib.contextmanager
def fifo_reader(path):
    """A thread reading the FIFO at `path` to its end; yields the list its bytes are appended to. If nothing
    opened the FIFO for writing, the reader is released at the end (so a failed write cannot hang a test)."""
    got: list = []

    def read():
        with open(path, "rb") as f:
            got.append(f.read())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        yield got
    finally:
        if t.is_alive() and not got:
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)


def test_fifo_gets_the_whole_output_and_stays_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    data = os.urandom(3 << 20)  # more than a pipe holds: the copy waits for the reader

    def write(tmp):
        with open(tmp, "wb") as f:  # writers seek and ask their position, which a pipe cannot do
            f.write(data[:10])
            f.seek(0)
            f.write(data)
            assert f.tell() == len(data)

    assert check_writable(fifo, "--out") == fifo  # without opening it (that would wait for a reader)
    with fifo_reader(fifo) as got:
        atomic_write(fifo, write, "--out")
    assert got == [data]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_directory_and_links_to_one_are_refused_naming_the_path(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "to-d").symlink_to("d")
    for path in (tmp_path / "d", tmp_path / "to-d"):
        for call in (lambda: atomic_write(path, lambda tmp: tmp.write_text("x"), "--out"),
                     lambda: check_writable(path, "--out")):
            with pytest.raises(SparqError, match=f"^--out: {path} is a directory; give the path of a file"):
                call()
    assert (tmp_path / "to-d").is_symlink() and list((tmp_path / "d").iterdir()) == []


def test_links_are_followed_and_stay_links(tmp_path):
    (tmp_path / "real.txt").write_text("old")
    (tmp_path / "link").symlink_to("real.txt")
    (tmp_path / "null").symlink_to(os.devnull)
    assert atomic_write(tmp_path / "link", lambda tmp: tmp.write_text("new")) == tmp_path / "link"
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real.txt").read_text() == "new"
    atomic_write(tmp_path / "null", lambda tmp: tmp.write_text("gone"))
    assert (tmp_path / "null").is_symlink() and stat.S_ISCHR(os.stat(os.devnull).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "null", "real.txt"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO, errno.EFBIG])
def test_file_system_errors_are_one_line_and_leave_nothing(tmp_path, code):
    """A writer that fails halfway as a full, read-only or failing file system makes it fail."""
    path = tmp_path / "out.gguf"
    path.write_text("old")

    def write(tmp):
        tmp.write_text("half")
        raise OSError(code, os.strerror(code))

    with pytest.raises(SparqError) as e:
        atomic_write(path, write, "--out")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--out: ") and str(path) in msg
    assert ("no space left" in msg) if code in (errno.ENOSPC, errno.EDQUOT) else msg.endswith(os.strerror(code))
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.gguf"]


def test_short_write_is_out_of_space(tmp_path):
    def write(tmp):
        raise OSError("16384 requested and 16096 written")  # numpy's tofile on a full disk: no errno

    with pytest.raises(SparqError, match=r"^--out: no space left on the device for .*out.gguf \(16384 requested"):
        atomic_write(tmp_path / "out.gguf", write, "--out")
    assert list(tmp_path.iterdir()) == []


def test_failure_on_another_file_names_that_file(tmp_path):
    def write(tmp):
        open(tmp_path / "missing-input.gguf", "rb")

    with pytest.raises(SparqError, match=r"^--out: writing .*out.gguf failed: .*missing-input.gguf: No such file"):
        atomic_write(tmp_path / "out.gguf", write, "--out")
    assert list(tmp_path.iterdir()) == []


def test_fifo_staging_out_of_space_names_where(tmp_path, monkeypatch):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def write(tmp):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    with pytest.raises(SparqError, match=f"^--out: no space left in {tmp_path} for the output, which is written "
                                         f"there before it goes to the FIFO {fifo}$"):
        atomic_write(fifo, write, "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


# ---- a real small file system (root only: mount) ------------------------------------------------------

def test_full_and_read_only_file_systems(small_fs):
    path = small_fs / "out.bin"
    path.write_bytes(b"old")
    with pytest.raises(SparqError, match=f"^--out: no space left on the device for {path}$"):
        atomic_write(path, lambda tmp: tmp.write_bytes(b"x" * (1 << 20)), "--out")
    assert path.read_bytes() == b"old" and sorted(p.name for p in small_fs.iterdir()) == ["out.bin"]
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    for call in (lambda: atomic_write(path, lambda tmp: tmp.write_bytes(b"new"), "--out"),
                 lambda: check_writable(path, "--out")):
        with pytest.raises(SparqError, match=f"^--out: cannot write in {small_fs}: Read-only file system$"):
            call()
    assert path.read_bytes() == b"old"


# ---- fuzz: every kind of output path with every kind of writer -------------------------------------

# The targets (what the output path is before the write) and the writers (how the output is made, and how
# it fails). Whatever the pair, the write succeeds with the whole output or fails with a SparqError of one
# line (or the writer's own exception); the path and everything beside it stay what they were, apart from
# the written file's content; no temporary file is left. The fast tier runs each pair once, the slow tier
# 1,200 seeded cases with random sizes.
TARGETS = ("new", "file", "link-file", "dangling-link", "null", "link-null", "full", "fifo", "link-fifo", "dir",
           "link-dir", "socket", "missing-parent", "parent-is-file", "link-missing-dir")
WRITERS = ("text", "gguf", "seeky", "fails", "interrupt", "fs-error")
REFUSED = {"dir": "is a directory", "link-dir": "is a directory", "socket": "is a socket",
           "missing-parent": "does not exist", "parent-is-file": "is not a directory",
           "link-missing-dir": "does not exist"}
FS_ERRORS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EIO, errno.EDQUOT, errno.EFBIG)


def _make_target(kind: str, d: Path) -> Path:
    """The output path of a case in the empty folder d, made `kind`."""
    if kind == "new":
        return d / "out"
    if kind == "file":
        (d / "out").write_bytes(b"old")
    elif kind == "link-file":
        (d / "real").write_bytes(b"old")
        (d / "out").symlink_to("real")
    elif kind == "dangling-link":
        (d / "out").symlink_to("not-yet")
    elif kind == "null":
        return Path(os.devnull)
    elif kind == "link-null":
        (d / "out").symlink_to(os.devnull)
    elif kind == "full":
        return Path("/dev/full")
    elif kind in ("fifo", "link-fifo"):
        os.mkfifo(d / "pipe")
        if kind == "fifo":
            return d / "pipe"
        (d / "out").symlink_to("pipe")
    elif kind in ("dir", "link-dir"):
        (d / "sub").mkdir()
        (d / "sub" / "keep").write_bytes(b"keep")
        if kind == "dir":
            return d / "sub"
        (d / "out").symlink_to("sub")
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(d / "out"))
        s.close()
    elif kind == "missing-parent":
        return d / "nowhere" / "out"
    elif kind == "parent-is-file":
        (d / "file").write_bytes(b"old")
        return d / "file" / "out"
    elif kind == "link-missing-dir":
        (d / "out").symlink_to("nowhere/out")
    return d / "out"


def _writer(kind: str, payload: bytes, rng):
    """write(tmp) for a writer kind: text, a GGUF, one that seeks back, or one that fails halfway."""
    code = FS_ERRORS[int(rng.integers(len(FS_ERRORS)))]

    def write(tmp):
        if kind == "text":
            Path(tmp).write_text(payload.hex())
        elif kind == "gguf":
            w = gguf.GGUFWriter(tmp, "llama")
            w.add_uint32("fuzz.n", len(payload))
            w.add_tensor("t", np.frombuffer(payload.ljust(4 * ((len(payload) + 3) // 4), b"\0"), np.float32))
            try:
                w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
            finally:
                w.close()
        elif kind == "seeky":
            with open(tmp, "wb") as f:
                f.write(b"\0" * 8 + payload)
                f.seek(0)
                f.write(len(payload).to_bytes(8, "little"))
        else:
            Path(tmp).write_bytes(payload[: len(payload) // 2])
            if kind == "fails":
                raise RuntimeError("the writer failed")
            if kind == "interrupt":
                raise KeyboardInterrupt
            raise OSError(code, os.strerror(code))

    return write


def _snapshot(d: Path) -> dict:
    """name -> (type, content of a regular file or the target of a link) for everything under d."""
    out = {}
    for p in sorted(d.rglob("*")):
        st = os.lstat(p)
        content = os.readlink(p) if stat.S_ISLNK(st.st_mode) else p.read_bytes() if stat.S_ISREG(st.st_mode) else None
        out[str(p.relative_to(d))] = (stat.S_IFMT(st.st_mode), content)
    return out


def _devices() -> dict:
    return {p: (os.stat(p).st_ino, os.stat(p).st_rdev) for p in (os.devnull, "/dev/full") if os.path.exists(p)}


def _fuzz_case(seed: int, base: Path, target: str | None = None, writer: str | None = None) -> None:
    rng = np.random.default_rng(seed)
    target = target or TARGETS[int(rng.integers(len(TARGETS)))]
    writer = writer or WRITERS[int(rng.integers(len(WRITERS)))]
    if target == "full" and not os.path.exists("/dev/full"):
        return
    d = base / f"case{seed}"
    d.mkdir()
    payload = rng.integers(0, 256, int(rng.choice([1, 100, 70_000, 300_000])), dtype=np.uint8).tobytes()
    path = _make_target(target, d)
    write = _writer(writer, payload, rng)
    ref = base / f"ref{seed}"
    with contextlib.suppress(RuntimeError, KeyboardInterrupt, OSError):
        write(ref)
    want = ref.read_bytes() if ref.exists() else None
    before, devices = _snapshot(d), _devices()
    where = {"fifo": d / "pipe", "link-fifo": d / "pipe"}.get(target)
    error = None
    with fifo_reader(where) if where else contextlib.nullcontext([]) as got:
        try:
            assert atomic_write(path, write, "--out") == path
        except (SparqError, RuntimeError, KeyboardInterrupt) as e:
            error = e
    case = f"seed {seed}: {target} written by {writer}: {error!r}"
    after = _snapshot(d)
    assert _devices() == devices, case
    if target in REFUSED:
        assert isinstance(error, SparqError) and REFUSED[target] in str(error), case
    elif target == "full" and (writer in ("text", "gguf", "seeky") or len(payload) > 1):  # a write fails first
        assert isinstance(error, SparqError) and "no space left" in str(error), case
    elif writer in ("fails", "interrupt"):
        assert isinstance(error, RuntimeError if writer == "fails" else KeyboardInterrupt), case
    elif writer == "fs-error":
        assert isinstance(error, SparqError), case
    else:
        assert error is None, case
    if isinstance(error, SparqError):
        msg = str(error)
        assert "\n" not in msg and msg.startswith("--out: "), case
    if where is not None:
        assert got == [want] if error is None else got in ([], [b""]), case  # b"": the reader released
    written = {"file": "out", "new": "out", "link-file": "real", "dangling-link": "not-yet"}.get(target)
    if error is None and written is not None:  # the one change: the file written, whole
        assert after.pop(written) == (stat.S_IFREG, want), case
        before.pop(written, None)
    assert after == before, case  # nothing else changed, no temporary file left


def test_fuzz_output_paths_sample(tmp_path):
    """Each pair of target and writer once."""
    for i, (target, writer) in enumerate((t, w) for t in TARGETS for w in WRITERS):
        _fuzz_case(i, tmp_path, target, writer)


@pytest.mark.slow
def test_fuzz_output_paths_1200_cases(tmp_path):
    for seed in range(1200):
        _fuzz_case(seed, tmp_path)
