"""Atomic file writes. Effects: writes files.

Everything nxdi writes goes to a temporary file in the destination folder and is renamed into
place, so a reader never sees half a file and an interrupted write leaves the old file intact.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path


def publish(target: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """Run `write(tmp)` on a temporary file beside `target`, fsync it, and rename it into place.

    The temporary name ends with the target's name (some writers check the suffix). On any
    exception the temporary file is removed and `target` is left as it was.
    """
    dest = Path(target)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".tmp-", suffix=f"-{dest.name}", dir=dest.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` atomically."""
    return publish(path, lambda tmp: tmp.write_bytes(data))


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write UTF-8 `text` to `path` atomically."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def link_or_copy(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """Put `source`'s bytes at `target` atomically: a hard link when the file system allows one
    (no bytes copied; nxdi never writes a file in place, so sharing the inode is safe), else a copy.
    """
    dest = Path(target)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{dest.name}"
    try:
        os.link(source, tmp)
    except OSError:  # another file system, or one without hard links
        return publish(dest, lambda t: shutil.copyfile(source, t))
    try:
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (renames into or out of it) to disk; best effort where the OS refuses."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the renames still happened
    finally:
        os.close(fd)
