"""Output files: check early that one can be written, and never leave a partial one behind.

Every command that writes a file the user named goes through atomic_write: a regular file (or a new one)
is written to a temporary file next to it and renamed over it in one step, so a reader sees the old file
or the new one. A path that exists and is not a regular file is never replaced: a character device
(/dev/null, /dev/stdout on a terminal) or a FIFO (/dev/stdout into a pipe, `mkfifo`) is written in place,
a directory, block device or socket is refused. A symbolic link is followed: the file it points to is
written and the link stays. Failures of the file system (no space, read-only, no permission) end in one
SparqError naming the option, the path and the cause."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import stat
import tempfile
import threading
from pathlib import Path

from sparq_cpp.errors import SparqError

_COPY_CHUNK = 1 << 20

# what an existing path is, when it is not a regular file
_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"), (stat.S_ISFIFO, "FIFO"),
          (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))
_IN_PLACE = ("character device", "FIFO")  # written as they are; the other kinds are refused


def _kind(path: Path) -> str | None:
    """What `path` is if it exists and is not a regular file (a symbolic link counts as what it points to);
    None for a regular file or nothing at all."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing, a dangling link, a parent that is not a directory: the writing reports it
        return None
    return next((name for test, name in _KINDS if test(mode)), None)


def _target(path, what: str) -> tuple[Path, str | None]:
    """(the path to write, what it is when not a regular file) for an output path; refuses a directory, a
    block device and a socket. A symbolic link resolves to the path it names, so that the link survives."""
    path = Path(path).expanduser()
    kind = _kind(path)
    if kind == "directory":
        raise SparqError(f"{what}: {path} is a directory; give the path of a file to write")
    if kind is not None and kind not in _IN_PLACE:
        raise SparqError(f"{what}: {path} is a {kind}; refusing to write over it (give the path of a file)")
    if kind is None and path.is_symlink():
        path = Path(os.path.realpath(path))
    return path, kind


def _error(e: OSError, what: str, path: Path, tmp: Path | None = None) -> SparqError:
    """One line for a failed write of `path` (through `tmp`, its temporary file)."""
    cause = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return SparqError(f"{what}: no space left on the device for {path}")
    if e.errno is None and " requested and " in cause:  # numpy's tofile: a write that stopped short
        return SparqError(f"{what}: no space left on the device for {path} ({cause} bytes)")
    other = e.filename is not None and str(e.filename) not in (str(path), str(tmp))
    if other:  # the writer failed on another file (its input, say)
        return SparqError(f"{what}: writing {path} failed: {e.filename}: {cause}")
    return SparqError(f"{what}: cannot write {path}: {cause}")


def check_writable(path, what: str = "output") -> Path:
    """Fail now, not after a long run, if `path` cannot be written: a directory, a missing parent
    directory, no write access. `what` (the option or the role of the file) starts the message.
    A character device or FIFO is checked for write access only (opening a FIFO would wait for a reader)."""
    path, kind = _target(path, what)
    if kind is not None:
        if not os.access(path, os.W_OK):
            raise SparqError(f"{what}: {path} is not writable")
        return path
    parent = _check_parent(path, what)
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".check")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise SparqError(f"{what}: cannot write in {parent}: {e.strerror or e}") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise SparqError(f"{what}: {path} is not writable")
    return path


def _check_parent(path: Path, what: str) -> Path:
    """The directory `path` goes in, which must exist: a mistyped path is refused, not created."""
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise SparqError(f"{what}: {parent} is not a directory")
    if not parent.is_dir():
        raise SparqError(f"{what}: directory {parent} does not exist")
    return parent


def check_space(path, nbytes: int, what: str = "output") -> None:
    """Fail now if the file system `path` goes on has less than `nbytes` free (else a full disk
    stops the write halfway). A directory still to be made is checked where it would be made; a device
    or FIFO written in place is not checked (its space is not a file system's)."""
    path = Path(path).expanduser()
    if _kind(path) is not None:
        return
    where = next((d for d in path.parents if d.is_dir()), None)
    if where is None:
        return
    free = shutil.disk_usage(where).free
    if nbytes > free:
        raise SparqError(f"{what}: {path.name} will take about {fmt_bytes(nbytes)}; {where} has {fmt_bytes(free)} free")


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def atomic_write(path, write, what: str = "output", *, make_parents: bool = False) -> Path:
    """write(tmp) fills a temporary file next to `path`, which then replaces `path` in one rename.
    The directory must exist, unless make_parents (for caches, made on first use). On any error,
    interrupts and SIGTERM included, the temporary file is removed and `path` is left as it was; an
    error of the file system is a SparqError. A character device or FIFO at `path` is written in place
    (see the module's docstring). Returns `path`."""
    given = Path(path).expanduser()
    path, kind = _target(given, what)
    if kind is not None:
        _write_in_place(path, write, what, kind)
        return given
    try:
        if make_parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        _check_parent(path, what)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise SparqError(f"{what}: cannot write in {path.parent}: {e.strerror or e}") from None
    os.close(fd)
    tmp = Path(name)
    try:
        with _sigterm_as_exit():
            write(tmp)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; an output file is not
            os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _error(e, what, path, tmp) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return given


def _seekable(path: Path) -> bool:
    """Whether the character device at `path` can seek (/dev/null can, a terminal cannot)."""
    fd = os.open(path, os.O_WRONLY | os.O_NOCTTY)
    try:
        os.lseek(fd, 0, os.SEEK_CUR)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _write_in_place(path: Path, write, what: str, kind: str) -> None:
    """write() into the character device or FIFO at `path`, which stays what it is. A device that can seek
    is written directly; a FIFO or a terminal gets the output of write(tmp) from a temporary file, copied
    when complete (writers seek and ask their position; a pipe can do neither)."""
    try:
        direct = kind == "character device" and _seekable(path)
        if direct:
            with _sigterm_as_exit():
                write(path)
            return
        staging = tempfile.TemporaryDirectory(prefix="sparq-out.")
    except OSError as e:
        raise _error(e, what, path) from None
    with staging as d, _sigterm_as_exit():
        tmp = Path(d) / "output"
        try:
            write(tmp)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise SparqError(f"{what}: no space left in {Path(d).parent} for the output, which is written "
                                 f"there before it goes to the {kind} {path}") from None
            raise _error(e, what, path, tmp) from None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOCTTY)  # a FIFO waits here for its reader
            with open(tmp, "rb") as src, os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst, _COPY_CHUNK)
        except OSError as e:
            raise _error(e, what, path, tmp) from None


@contextlib.contextmanager
def _sigterm_as_exit():
    """SIGTERM's default action ends the process at once, so no cleanup would run and the temporary
    file would stay; while writing, it raises SystemExit(143) instead, the exit status a shell
    reports for SIGTERM. A handler someone else installed is left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
