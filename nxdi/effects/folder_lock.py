"""The advisory lock of a compiled-model folder, and who holds it.
Effects: opens, locks (flock), writes and reads a lock file; reads the clock and process table.

Rules:
- The lock of folder `parent/name` is the file `parent/.name.nxdi-lock`, beside the folder rather
  than in it, so that replacing the folder as a whole (`nxdi.effects.staging`) leaves the lock in
  place. The file stays after use: deleting a lock file races with a process about to lock it.
- Compiling (and writing weights into a folder) takes it exclusively; loading takes it shared, so
  loaders run together while a compile waits for them, and a load waits for a compile to finish.
- `flock` locks belong to an open file, and the kernel drops them when their process dies (even by
  SIGKILL), so a dead holder never keeps a folder locked and nothing needs breaking by hand.
- Holders record themselves in the lock file, one JSON line each (pid, host, what they do, since
  when, command): the exclusive holder replaces the content, and removes it when done; a shared
  holder appends its line and blanks it (in place, by offset) when done. A waiter names the
  holders from those lines, skipping lines of processes on this host that no longer exist (a
  holder killed before it could clean up), so a stale line never names the wrong process.
- A loader that cannot create the lock file (a read-only place, or no such folder) reads without
  it, creating nothing: nobody can compile there either. One that may open it only for reading
  (another user's lock file) locks it without recording itself.
- A waiter polls and says who it waits for through `on_wait` (once per change of holder); with a
  `timeout` (0: do not wait) it raises `FolderLockedError` naming the folder, the holders and the fix.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs

LOCK_SUFFIX = ".nxdi-lock"
_POLL_S = (0.05, 0.5)
"""First and longest pause between two attempts to take a held lock, in seconds."""
_MAX_READ = 1 << 20


class FolderLockedError(TimeoutError):
    """Another process holds a compiled-model folder's lock, and the lock timeout
    (NXDI_LOCK_TIMEOUT seconds; 0: do not wait) ran out. The message names the holders."""


@attrs.frozen(kw_only=True)
class Holder:
    """A process that holds (or held) a folder's lock, as it recorded itself."""

    pid: int
    host: str
    purpose: str
    """What it does with the folder: `compile`, `load`, `write weights`."""
    since: float
    """When it took the lock (seconds since the epoch)."""
    command: str = ""

    def describe(self, now: float) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(self.since))
        command = f", `{self.command}`" if self.command else ""
        return f"pid {self.pid} on {self.host} ({self.purpose}, since {clock}, {now - self.since:.0f} s ago{command})"

    def is_gone(self) -> bool:
        """True when the process ran on this host and no longer exists."""
        if self.host != socket.gethostname():
            return False  # cannot tell; trust the record
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # it exists, under another user
        return False


def lock_path(directory: str | os.PathLike[str]) -> Path:
    """The lock file of the folder `directory` (beside it)."""
    folder = Path(directory)
    return folder.parent / f".{folder.name}{LOCK_SUFFIX}"


def _record(purpose: str) -> bytes:
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else ""
    doc = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "purpose": purpose,
        "since": time.time(),
        "command": command[:160],
    }
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


def holders(lock: str | os.PathLike[str]) -> tuple[Holder, ...]:
    """The holders recorded in a lock file, without those known to be gone (see the module rules)."""
    try:
        with open(lock, "rb") as f:
            raw = f.read(_MAX_READ)
    except OSError:
        return ()
    found = []
    for line in raw.splitlines():
        try:
            doc = json.loads(line)
            holder = Holder(
                pid=int(doc["pid"]),
                host=str(doc["host"]),
                purpose=str(doc["purpose"]),
                since=float(doc["since"]),
                command=str(doc.get("command", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a blanked line, or one being written
        if not holder.is_gone():
            found.append(holder)
    return tuple(found)


def describe_holders(found: tuple[Holder, ...]) -> str:
    """Who holds a lock, for a message."""
    if not found:
        return "another process (it has not recorded itself in the lock file yet)"
    now = time.time()
    return "; ".join(h.describe(now) for h in found)


def _take(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _acquire(fd: int, folder: Path, *, shared: bool, timeout: float | None, on_wait: Callable[[str], None]) -> None:
    """Block until `fd` holds the lock, telling `on_wait` who holds it; FolderLockedError past `timeout`."""
    mode, lock = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX), lock_path(folder)
    start, pause = time.monotonic(), _POLL_S[0]
    told: tuple[Holder, ...] | None = None
    while not _take(fd, mode):
        found = holders(lock)
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            raise FolderLockedError(
                f"{folder} is locked by {describe_holders(found)} (lock file {lock}); gave up after "
                f"{waited:.0f} s (NXDI_LOCK_TIMEOUT={timeout:g}). Fix: wait for that process to finish "
                "or stop it, or unset NXDI_LOCK_TIMEOUT to wait for it"
            )
        if found != told:
            on_wait(
                f"{folder} is locked by {describe_holders(found)}; waiting for it to finish "
                "(set NXDI_LOCK_TIMEOUT=<seconds> to limit the wait, 0 to fail at once)"
            )
            told = found
        time.sleep(pause if timeout is None else max(0.0, min(pause, timeout - waited)))
        pause = min(pause * 2, _POLL_S[1])


@contextlib.contextmanager
def locked(
    directory: str | os.PathLike[str],
    *,
    shared: bool,
    purpose: str,
    timeout: float | None = None,
    on_wait: Callable[[str], None] = lambda message: None,
) -> Iterator[Path]:
    """Hold the lock of the folder `directory` (see the module rules) for the `with` block.

    Args:
        directory: the compiled-model folder (it need not exist; for an exclusive lock its parent
            is created).
        shared: True to share the lock with other shared holders (loading), False for exclusive.
        purpose: what this process does with the folder, for the messages of those who wait.
        timeout: seconds to wait for the lock; None waits as long as it takes, 0 not at all.
        on_wait: called with a message naming the holders when the lock is held (again when they change).

    Yields:
        The lock file.

    Raises:
        FolderLockedError: the lock was still held after `timeout` seconds.
    """
    lock = lock_path(directory)
    fd, writable = _open(lock, shared=shared)
    if fd is None:  # a loader that cannot create the lock file: nobody can compile here either
        yield lock
        return
    try:
        _acquire(fd, Path(directory), shared=shared, timeout=timeout, on_wait=on_wait)
        if not writable:
            yield lock  # locked, but unable to record itself (another user's lock file)
            return
        with _recorded(fd, lock, shared=shared, purpose=purpose):
            yield lock
    finally:
        os.close(fd)  # closing the last descriptor of the open file releases the lock


def _open(lock: Path, *, shared: bool) -> tuple[int | None, bool]:
    """The lock file, opened, and whether this process may write in it. A shared holder that cannot
    create it (a read-only place, or a folder that does not exist) gets None: nothing to lock."""
    if not shared:
        lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        return os.open(lock, os.O_RDWR | os.O_CREAT, 0o666), True
    except OSError:
        pass
    try:
        return os.open(lock, os.O_RDONLY), False  # flock works on a read-only descriptor too
    except OSError:
        if shared:
            return None, False
        raise


@contextlib.contextmanager
def _recorded(fd: int, lock: Path, *, shared: bool, purpose: str) -> Iterator[None]:
    """This holder's record in the lock file (see the module rules) while the block runs."""
    record = _record(purpose)
    if shared:
        offset = _append(lock, record)
    else:
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
    try:
        yield
    finally:
        if shared:
            os.pwrite(fd, b" " * (len(record) - 1) + b"\n", offset)
            if _take(fd, fcntl.LOCK_EX):  # the last holder: drop every line (ours and dead ones)
                os.ftruncate(fd, 0)
        else:
            os.ftruncate(fd, 0)


def _append(lock: Path, record: bytes) -> int:
    """Append `record` to the lock file in one write; returns the offset it landed at."""
    fd = os.open(lock, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, record)  # one small O_APPEND write: whole, even beside other appenders
        return os.lseek(fd, 0, os.SEEK_CUR) - len(record)
    finally:
        os.close(fd)
