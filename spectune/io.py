"""Atomic file writes: a temporary file in the target's folder, fsync, then a rename.

A reader (or a server loading a table) never sees a half-written file, also on a full disk or a
crash. A leaf: standard library only.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    _atomic_write(path, text, "w")


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename."""
    _atomic_write(path, data, "wb")


def _atomic_write(path: str | os.PathLike[str], content: str | bytes, mode: str) -> None:
    """Every OSError (read-only file system, full disk, ``path`` a folder) names ``path``, not
    the temporary file, and leaves no temporary file behind."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(path))
    above = next((p for p in path.parents if p.exists()), None)  # the nearest that exists must be a folder
    if above is not None and not above.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{above} is a file, not a folder", str(path))
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        with os.fdopen(fd, mode) as fh:
            fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise type(exc)(exc.errno, exc.strerror or str(exc), str(path)) from None
        raise
