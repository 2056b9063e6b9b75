"""The compiled-model folder's lock: exclusive and shared holders, waiting, failing fast, and the
holder records that name who holds it (never a dead process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from nxdi.effects import env, folder_lock
from nxdi.effects.folder_lock import FolderLockedError


@contextmanager
def held(folder: Path, *, shared: bool, purpose: str) -> Iterator[None]:
    """Hold the folder's lock from another thread (flock locks of two open files exclude each
    other even within one process) until the block ends."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with folder_lock.locked(folder, shared=shared, purpose=purpose):
            taken.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(30)
    try:
        yield
    finally:
        release.set()
        thread.join(30)


def try_lock(folder: Path, *, shared: bool, purpose: str, timeout: float) -> None:
    with folder_lock.locked(folder, shared=shared, purpose=purpose, timeout=timeout):
        pass


def test_the_lock_file_lies_beside_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "compiled"
    with folder_lock.locked(folder, shared=False, purpose="compile") as lock:
        assert lock == tmp_path / ".compiled.nxdi-lock" and lock.is_file()
        (record,) = folder_lock.holders(lock)
        assert (record.pid, record.purpose) == (os.getpid(), "compile")
    assert not folder.exists()  # locking creates nothing in the folder
    assert lock.read_bytes() == b""  # the exclusive holder removes its record


def test_an_exclusive_holder_excludes_everyone_and_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "compiled"
    with held(folder, shared=False, purpose="compile"):
        for shared in (False, True):
            with pytest.raises(
                FolderLockedError, match=rf"{folder} is locked by pid {os.getpid()} on .*\(compile, since"
            ):
                try_lock(folder, shared=shared, purpose="load", timeout=0)


def test_shared_holders_coexist_and_a_compile_names_them_all(tmp_path: Path) -> None:
    folder = tmp_path / "compiled"
    with held(folder, shared=True, purpose="load"), held(folder, shared=True, purpose="load"):
        with folder_lock.locked(folder, shared=True, purpose="load", timeout=0):
            assert len(folder_lock.holders(folder_lock.lock_path(folder))) == 3
        with pytest.raises(FolderLockedError) as info:
            try_lock(folder, shared=False, purpose="compile", timeout=0)
        assert str(info.value).count("(load, since") == 2
    assert folder_lock.lock_path(folder).read_bytes() == b""  # the last holder out empties the file


def test_waiting_names_the_holder_once_and_takes_the_lock_when_it_is_free(tmp_path: Path) -> None:
    folder, messages, got = tmp_path / "compiled", [], threading.Event()

    def wait_for_it() -> None:
        with folder_lock.locked(folder, shared=False, purpose="compile", on_wait=messages.append):
            got.set()

    with held(folder, shared=False, purpose="write weights"):
        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        time.sleep(0.6)  # several polls
        assert not got.is_set()
    waiter.join(10)
    assert got.is_set()
    assert len(messages) == 1, messages
    assert f"is locked by pid {os.getpid()}" in messages[0] and "(write weights, since" in messages[0]
    assert "NXDI_LOCK_TIMEOUT" in messages[0]


def test_a_timeout_gives_up_after_that_many_seconds(tmp_path: Path) -> None:
    folder = tmp_path / "compiled"
    with held(folder, shared=True, purpose="load"):
        start = time.monotonic()
        with pytest.raises(FolderLockedError, match=r"gave up after .*NXDI_LOCK_TIMEOUT=0\.3\)\. Fix: wait"):
            try_lock(folder, shared=False, purpose="compile", timeout=0.3)
        assert 0.3 <= time.monotonic() - start < 3


def test_records_of_dead_processes_name_nobody(tmp_path: Path) -> None:
    folder = tmp_path / "compiled"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    lock = folder_lock.lock_path(folder)
    lock.write_text(json.dumps({"pid": pid, "host": os.uname().nodename, "purpose": "compile", "since": 0}) + "\n")
    assert folder_lock.holders(lock) == ()
    with held(folder, shared=True, purpose="load"), pytest.raises(FolderLockedError) as info:
        try_lock(folder, shared=False, purpose="compile", timeout=0)
    assert f"pid {pid} " not in str(info.value) and f"pid {os.getpid()} " in str(info.value)


def test_a_holder_killed_by_sigkill_holds_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "compiled"
    script = (
        "import sys, time; from nxdi.effects import folder_lock\n"
        "with folder_lock.locked(sys.argv[1], shared=False, purpose='compile'):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", script, str(folder)], cwd=repo, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(FolderLockedError, match=rf"pid {proc.pid} "):
            try_lock(folder, shared=False, purpose="compile", timeout=0)
    finally:
        proc.kill()
        proc.wait(30)
    with folder_lock.locked(folder, shared=False, purpose="compile", timeout=0):
        (record,) = folder_lock.holders(folder_lock.lock_path(folder))  # its stale record replaced
        assert record.pid == os.getpid()


@pytest.mark.parametrize(
    ("raw", "timeout", "problem"),
    [
        (None, None, False),
        ("", None, False),
        ("0", 0.0, False),
        ("2.5", 2.5, False),
        ("-1", None, True),
        ("x", None, True),
    ],
)
def test_nxdi_lock_timeout(raw: str | None, timeout: float | None, problem: bool) -> None:
    read = env.read_env({} if raw is None else {"NXDI_LOCK_TIMEOUT": raw})
    assert read.lock_timeout == timeout
    assert any(p.startswith("NXDI_LOCK_TIMEOUT") for p in read.problems) == problem


def test_a_loader_of_a_folder_that_does_not_exist_creates_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "no" / "such" / "compiled"
    with folder_lock.locked(folder, shared=True, purpose="load", timeout=0):
        pass
    assert list(tmp_path.iterdir()) == []
