"""Output files: check early that one can be written, and never leave a partial one behind."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from sparq_cpp.errors import SparqError


def check_writable(path, what: str = "output") -> Path:
    """Fail now, not after a long run, if `path` cannot be written: a directory, a missing parent
    directory, no write access. `what` (the option or the role of the file) starts the message."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise SparqError(f"{what}: {path} is a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise SparqError(f"{what}: {parent} is not a directory")
    if not parent.is_dir():
        raise SparqError(f"{what}: directory {parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".check")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise SparqError(f"{what}: cannot write in {parent}: {e.strerror or e}") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise SparqError(f"{what}: {path} is not writable")
    return path


def atomic_write(path, write, what: str = "output") -> Path:
    """write(tmp) fills a temporary file next to `path` (its parent directories are made), which
    then replaces `path` in one rename. On any error, interrupts included, the temporary file is
    removed and `path` is left as it was."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise SparqError(f"{what}: {path} is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise SparqError(f"{what}: cannot write in {path.parent}: {e.strerror or e}") from None
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; an output file is not
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
