"""Output files: check early that they can be written, and never leave a partial one behind."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from sparq_cpp.errors import SparqError


def check_writable(path) -> Path:
    """Fail now, not after a long calibration, if `path` cannot be written."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise SparqError(f"output path {path} is a directory")
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise SparqError(f"cannot write the output {path}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(tmp)
    return path


def atomic_write(path, write) -> Path:
    """write(tmp_path) into a temporary file next to path, then os.replace it onto path."""
    path = check_writable(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes it private; an output file is not
        os.replace(tmp, path)
    except BaseException:  # interrupts too
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
