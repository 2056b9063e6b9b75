"""Replacing a compiled-model folder as a whole: build beside it, then swap it in.
Effects: creates, renames, links and deletes folders; takes the folder's lock (`folder_lock`).

Rules:
- `building(folder)` takes the folder's lock exclusively, makes an empty hidden build folder beside
  it (`.name.nxdi-build-<pid>-<random>`, same parent, so a rename moves it), and yields it. The
  caller writes the whole compile there. When the `with` block ends normally the build is swapped
  in; when it raises, the build is deleted and the folder is untouched.
- The swap: where the folder does not exist, one rename. Otherwise entries of the old folder that
  the build did not write (a tokenizer saved there, shards written by `shard_weights()`), except
  those the caller says it owns (`owned`: debug output of an older compile), are first
  hard-linked (else copied) into the build, then the two folders are exchanged atomically with
  Linux's renameat2(RENAME_EXCHANGE) and the old one, now under the build's name, is deleted. So
  at every instant the folder holds the old complete compile or the new one, whatever kills the
  process.
- Where renameat2 is missing or the file system refuses it (not Linux, an old kernel, some network
  file systems), the old folder is renamed aside (`.name.nxdi-old-<pid>-<random>`) and the build
  renamed in. Between those two renames the folder is missing; if the process dies there, the
  next compile or load of the folder (`recover`) puts the aside folder back.
- Leftover build and aside folders of killed compiles are deleted by the next compile, which holds
  the exclusive lock, so none of them can belong to a live compile of the folder.
- `reading(folder)` takes the lock shared for a load (and recovers an interrupted swap first).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from nxdi.effects import files, folder_lock

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})


@attrs.frozen(kw_only=True)
class Build:
    """A compile in progress: where to write it, and the folder it will replace."""

    path: Path
    """The build folder (empty at first); everything the compile writes goes here."""
    target: Path
    """The compiled-model folder (symlinks resolved), whose current programs a compile may reuse."""


def _resolve(directory: str | os.PathLike[str]) -> Path:
    """The folder's real path: a symlinked folder is replaced behind its link, not the link itself."""
    return Path(os.path.realpath(directory))


def _temporaries(target: Path, kind: str) -> list[Path]:
    """This folder's leftover build (`kind="build"`) or aside (`kind="old"`) folders, newest first."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.nxdi-{kind}-\d+-\w+")
    if not target.parent.is_dir():
        return []
    found = [p for p in target.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def recover(directory: str | os.PathLike[str]) -> bool:
    """Put the aside folder back where a fallback swap was interrupted (the folder is missing and an
    aside copy exists). True when it did. Call with the folder's lock held (shared is enough: two
    loaders racing both try one rename, and one of them wins)."""
    target = _resolve(directory)
    if target.exists():
        return False
    for aside in _temporaries(target, "old"):
        try:
            os.rename(aside, target)
        except OSError:
            continue  # another loader won the race, or this aside went away
        files.fsync_dir(target.parent)
        return True
    return False


def _clean_leftovers(target: Path) -> None:
    """Delete the build and aside folders of killed compiles (the exclusive lock is held)."""
    for leftover in (*_temporaries(target, "build"), *_temporaries(target, "old")):
        shutil.rmtree(leftover, ignore_errors=True)


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """glibc's renameat2 (2.28 and later), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Swap the names of two existing paths atomically (renameat2 RENAME_EXCHANGE).

    Returns:
        True when swapped; False when this platform or file system cannot (nothing changed).

    Raises:
        OSError: any other failure of the rename (permissions, a missing path...).
    """
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _link_tree(source: Path, dest: Path) -> None:
    """`dest` as a copy of `source` whose files are hard links where possible (symlinks kept)."""
    if source.is_symlink():
        os.symlink(os.readlink(source), dest)
    elif source.is_dir():
        shutil.copytree(source, dest, symlinks=True, copy_function=_link_file)
    else:
        _link_file(source, dest)


def _link_file(source: Any, dest: Any) -> None:
    try:
        os.link(source, dest)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, dest)


def _carry_over(old: Path, build: Path, owned: frozenset[str]) -> None:
    """Link every entry of `old` that the build does not have into it (temporaries and `owned`
    names excepted)."""
    for entry in old.iterdir():
        if entry.name in owned or entry.name.startswith(".tmp-"):
            continue
        if not os.path.lexists(build / entry.name):
            _link_tree(entry, build / entry.name)


def _new_folder(parent: Path, prefix: str) -> Path:
    """A new empty folder `prefix<random>` in `parent`, with the default permissions (mkdtemp's
    are 0700, which would make a compiled folder private to its user)."""
    while True:
        path = parent / f"{prefix}{uuid.uuid4().hex[:8]}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path


def swap_in(build: Path, target: Path, *, owned: Iterable[str] = ()) -> None:
    """Make the complete folder `build` the folder `target` (see the module rules); the old one is deleted."""
    parent = target.parent
    files.fsync_dir(build)
    if not os.path.lexists(target):
        os.rename(build, target)
        files.fsync_dir(parent)
        return
    _carry_over(target, build, frozenset(owned))
    shutil.copymode(target, build)
    if exchange(build, target):
        old = build  # the exchange left the old folder under the build's name
    else:
        old = _new_folder(parent, f".{target.name}.nxdi-old-{os.getpid()}-")
        os.rename(target, old)  # a folder may replace an empty one
        try:
            os.rename(build, target)
        except BaseException:
            os.rename(old, target)
            raise
    files.fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def building(
    directory: str | os.PathLike[str],
    *,
    timeout: float | None = None,
    on_wait: Callable[[str], None] = lambda message: None,
    owned: Iterable[str] = (),
) -> Iterator[Build]:
    """Lock the folder `directory` exclusively and yield an empty build folder that replaces it as a
    whole when the `with` block ends normally (see the module rules).

    Args:
        directory: the compiled-model folder (created when the block succeeds).
        timeout, on_wait: as `folder_lock.locked` (seconds to wait for another holder; None: no limit).
        owned: names of entries the compile owns: the old folder's are dropped even where the build
            has none (stale debug output), instead of carried over like a user's files.

    Raises:
        FolderLockedError: another process held the folder past `timeout`.
        NotADirectoryError: `directory` exists and is not a folder.
    """
    target = _resolve(directory)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target}: exists and is not a folder; compile into a folder")
    with folder_lock.locked(target, shared=False, purpose="compile", timeout=timeout, on_wait=on_wait):
        recover(target)
        _clean_leftovers(target)
        path = _new_folder(target.parent, f".{target.name}.nxdi-build-{os.getpid()}-")
        try:
            yield Build(path=path, target=target)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        try:
            swap_in(path, target, owned=owned)
        finally:
            shutil.rmtree(path, ignore_errors=True)  # what is left of it when the swap failed


@contextlib.contextmanager
def _held(
    directory: str | os.PathLike[str],
    *,
    shared: bool,
    purpose: str,
    timeout: float | None,
    on_wait: Callable[[str], None],
) -> Iterator[Path]:
    """The folder's lock held (after recovering an interrupted swap); yields the folder's real path."""
    target = _resolve(directory)
    with folder_lock.locked(target, shared=shared, purpose=purpose, timeout=timeout, on_wait=on_wait):
        recover(target)
        yield target


@contextlib.contextmanager
def reading(
    directory: str | os.PathLike[str],
    *,
    purpose: str = "load",
    timeout: float | None = None,
    on_wait: Callable[[str], None] = lambda message: None,
) -> Iterator[Path]:
    """Hold the folder's lock shared while it is read (loaders run together; compiles wait), after
    recovering an interrupted swap. Yields the folder's real path.

    Raises:
        FolderLockedError: a compile held the folder past `timeout` seconds.
    """
    with _held(directory, shared=True, purpose=purpose, timeout=timeout, on_wait=on_wait) as target:
        yield target


@contextlib.contextmanager
def writing(
    directory: str | os.PathLike[str],
    *,
    purpose: str,
    timeout: float | None = None,
    on_wait: Callable[[str], None] = lambda message: None,
) -> Iterator[Path]:
    """Hold the folder's lock exclusively while files are written into it in place (weights).
    Yields the folder's real path.

    Raises:
        FolderLockedError: another process held the folder past `timeout` seconds.
    """
    with _held(directory, shared=False, purpose=purpose, timeout=timeout, on_wait=on_wait) as target:
        yield target
