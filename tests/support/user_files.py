"""Helpers for tests that hand nxdi broken user files: copies to break, snapshots that prove the
user's files are byte-identical afterwards, and permissions that really deny access.

Permissions and root: a test process running as root reads and writes files whatever their mode
(CAP_DAC_OVERRIDE), so `chmod 000` alone proves nothing there. `denied_runner()` gives a command
prefix that runs `nxdi` without those capabilities (util-linux `setpriv`), or None when that
cannot be done (the test then skips, saying why).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

NXDI = [sys.executable, "-m", "nxdi.shell.cli.main"]
"""The `nxdi` command, run by this interpreter."""

_DROP_DAC = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (or `root` itself) by relative path -> sha256 of its bytes, and every
    folder -> "<dir>", so equal snapshots mean nothing was added, removed or changed."""
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "<dir>" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def broken_copy(
    source: Path,
    dest: Path,
    edit: Callable[[dict[str, Any]], None] | None = None,
    *,
    text: str | None = None,
) -> Path:
    """A copy of the checkpoint folder `source` at `dest` whose config.json is `edit`ed (a function
    changing the parsed dict; written with Python's JSON, so NaN stays NaN) or replaced by `text`."""
    shutil.copytree(source, dest)
    config = dest / "config.json"
    if text is not None:
        config.write_text(text)
    elif edit is not None:
        data = json.loads(config.read_text())
        edit(data)
        config.write_text(json.dumps(data, indent=2))
    return dest


@contextmanager
def mode(path: Path, new_mode: int) -> Iterator[Path]:
    """`path` with permission bits `new_mode` for the block, restored afterwards (so cleanup works)."""
    old = stat.S_IMODE(path.stat().st_mode)
    path.chmod(new_mode)
    try:
        yield path
    finally:
        path.chmod(old)


def denied_runner(probe: Path, *, write: bool = False) -> list[str] | None:
    """A command prefix under which `probe` (its mode already taken away) really cannot be read, or
    with `write` the folder `probe` cannot be written: nothing as an ordinary user, `setpriv`
    dropping the override capabilities as root; None when neither works."""
    prefix: list[str] = [] if os.geteuid() != 0 else _DROP_DAC
    if prefix and shutil.which(prefix[0]) is None:
        return None
    if write:
        check = "import sys, tempfile; tempfile.TemporaryFile(dir=sys.argv[1])"
    elif probe.is_dir():
        check = "import os, sys; os.listdir(sys.argv[1])"
    else:
        check = "import sys; open(sys.argv[1], 'rb')"
    done = subprocess.run([*prefix, sys.executable, "-c", check, str(probe)], capture_output=True, check=False)
    return prefix if done.returncode != 0 else None


def run_nxdi(prefix: list[str], *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`nxdi ARGV` in a new process (under `prefix`), its output captured."""
    return subprocess.run([*prefix, *NXDI, *argv], capture_output=True, text=True, timeout=timeout, check=False)
