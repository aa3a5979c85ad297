"""Output files: check early that one can be written, and never leave a partial one behind."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from sparq_cpp.errors import SparqError


def check_writable(path, what: str = "output") -> Path:
    """Fail now, not after a long run, if `path` cannot be written: a directory, a missing parent
    directory, no write access. `what` (the option or the role of the file) starts the message."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise SparqError(f"{what}: {path} is a directory")
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
    stops the write halfway). A directory still to be made is checked where it would be made."""
    path = Path(path).expanduser()
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
    interrupts and SIGTERM included, the temporary file is removed and `path` is left as it was."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise SparqError(f"{what}: {path} is a directory")
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
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SparqError(f"{what}: no space left on the device for {path}") from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


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
