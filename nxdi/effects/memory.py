"""This process's host memory, for benchmarks, and the memory the host has available. Effects: reads
/proc/self/status, /proc/meminfo and the cgroup memory limit, runs a sampling thread.

Resident memory has two parts that matter differently: anonymous pages (tensors, heaps; what
exhausts a host) and file-backed pages (memory-mapped checkpoint bytes; page cache the kernel can
drop at any time). Linux reports the peak of their sum (VmHWM) but no peak of the anonymous part,
so `PeakSampler` samples it. Off Linux every figure reads 0.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType

import attrs

_STATUS = Path("/proc/self/status")
_FIELDS = {"VmRSS": "rss", "VmHWM": "peak_rss", "RssAnon": "anon", "RssFile": "file"}
_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")
_CGROUP_LIMITS = (
    ("memory.max", "memory.current"),  # cgroup v2
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),  # cgroup v1
)


@attrs.frozen(kw_only=True)
class Usage:
    """Bytes resident now (`rss` = `anon` + `file` + shared memory) and the process's peak `rss`."""

    rss: int = 0
    peak_rss: int = 0
    anon: int = 0
    file: int = 0


def usage() -> Usage:
    """This process's resident memory now (zeros where /proc is not available)."""
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError:
        return Usage()
    found = {}
    for line in lines:
        name, _, rest = line.partition(":")
        if name in _FIELDS:
            found[_FIELDS[name]] = int(rest.split()[0]) * 1024  # kB
    return Usage(**found)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def available_bytes(meminfo: Path = _MEMINFO, cgroup: Path = _CGROUP) -> int | None:
    """Bytes this process can still allocate without swapping or being killed: the kernel's
    MemAvailable, lowered to what this process's cgroup (a container's limit) has left; None where
    /proc/meminfo is not available (off Linux)."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    found = [int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")]  # kB
    if not found:
        return None
    free = found[0]
    for limit_file, usage_file in _CGROUP_LIMITS:
        limit, usage = _read_int(cgroup / limit_file), _read_int(cgroup / usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes ~2**63 for none
            free = min(free, max(limit - usage, 0))
    return free


def reset_peak() -> bool:
    """Restart the kernel's peak resident size (VmHWM) from the current size; False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakSampler:
    """`with PeakSampler() as s: ...` then `s.peak_anon`: the largest anonymous resident size seen
    while the block ran (sampled every `interval` seconds, and at its start and end)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.start = usage()
        self.peak_anon = self.start.anon
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nxdi-memory-sampler", daemon=True)

    def _sample(self) -> None:
        self.peak_anon = max(self.peak_anon, usage().anon)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> PeakSampler:
        self.start = usage()
        self.peak_anon = self.start.anon
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
