"""Streaming read bandwidth of this host's memory, as torch reads it. Effects: allocates a buffer,
runs torch kernels on the calling process's intra-op threads, reads the clock.

Theory of operation: a float32 buffer much larger than the last-level cache (default 1 GiB) is
filled once (so its pages exist), then read whole by kernels that read without writing anything but
a scalar: `sum()` and `amax()` (a bf16 `sum(dtype=float32)` is compute bound, tens of times slower
on some CPUs, so it is no bandwidth measure). Each kernel runs once untimed, then the kernels
alternate for `repeat` rounds; every timed call is one sample, `buffer bytes / seconds`. The number
of threads is the process's (`torch.set_num_threads`, set by the caller to the benchmark's), so the
figure is the bandwidth the benchmarked model could reach with the same threads.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterable

import attrs

KERNELS = ("sum", "amax")
"""Read kernels, each reducing the whole buffer to one value."""
GIB = 1 << 30


def _kernel_samples(samples: Iterable[tuple[str, Iterable[float]]]) -> tuple[tuple[str, tuple[float, ...]], ...]:
    # A typed converter: mypy's attrs plugin cannot infer element types through a bare `tuple`.
    return tuple((name, tuple(values)) for name, values in samples)


@attrs.frozen(kw_only=True)
class Bandwidth:
    """Read bandwidth samples of one buffer, bytes per second."""

    buffer_bytes: int
    threads: int
    samples: tuple[tuple[str, tuple[float, ...]], ...] = attrs.field(converter=_kernel_samples)
    """(kernel name, bytes per second of each timed call) per kernel."""

    @property
    def best(self) -> float:
        return max(max(s) for _, s in self.samples)

    @property
    def median(self) -> float:
        return statistics.median(x for _, s in self.samples for x in s)

    def merged(self, other: Bandwidth) -> Bandwidth:
        """Both measurements' samples, per kernel (the same buffer size and threads)."""
        assert (self.buffer_bytes, self.threads) == (other.buffer_bytes, other.threads), "like with like"
        theirs = dict(other.samples)
        return attrs.evolve(self, samples=((k, (*s, *theirs.get(k, ()))) for k, s in self.samples))

    def to_dict(self) -> dict[str, object]:
        """GB/s (10^9 bytes per second), for JSON output."""
        return {
            "buffer_mib": self.buffer_bytes / (1 << 20),
            "threads": self.threads,
            "samples": sum(len(s) for _, s in self.samples),
            "best_gb_s": self.best / 1e9,
            "median_gb_s": self.median / 1e9,
            "kernels_best_gb_s": {k: max(s) / 1e9 for k, s in self.samples},
        }


def _reads(buffer_bytes: int) -> tuple[int, dict[str, Callable[[], object]]]:
    """A float32 buffer of `buffer_bytes` (rounded down to whole values), written once so every page
    is resident: its size in bytes and each of `KERNELS` reading it whole."""
    import torch

    buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    return buffer.numel() * 4, {name: getattr(buffer, name) for name in KERNELS}


def measure_read_bandwidth(*, buffer_bytes: int = GIB, repeat: int = 5) -> Bandwidth:
    """Time streaming reads of a `buffer_bytes` float32 buffer with this process's torch threads.

    Raises:
        ValueError: `buffer_bytes` below one float32 value, or `repeat` < 1.
    """
    import torch

    if buffer_bytes < 4 or repeat < 1:
        raise ValueError(f"buffer_bytes must be >= 4 and repeat >= 1, got {buffer_bytes} and {repeat}")
    n, kernels = _reads(buffer_bytes)
    samples: dict[str, list[float]] = {name: [] for name in KERNELS}
    with torch.inference_mode():
        for read in kernels.values():
            read()
        for _ in range(repeat):  # alternate kernels, so drifting machine load hits each
            for name, read in kernels.items():
                start = time.perf_counter()
                read()
                samples[name].append(n / (time.perf_counter() - start))
    return Bandwidth(buffer_bytes=n, threads=torch.get_num_threads(), samples=samples.items())


def read_timer(buffer_bytes: int) -> Callable[[], float]:
    """A timer of streamed reads of one float32 buffer of `buffer_bytes` (filled once, read once
    untimed): each call reads it whole with the next of `KERNELS` in turn and returns the seconds.
    What a benchmark pairs with a step that reads as many bytes (`nxdi.shell.cli.bench_pairs`).

    Raises:
        ValueError: `buffer_bytes` below one float32 value.
    """
    import torch

    if buffer_bytes < 4:
        raise ValueError(f"buffer_bytes must be >= 4, got {buffer_bytes}")
    _, kernels = _reads(buffer_bytes)
    reads = itertools.cycle(kernels.values())
    next(reads)()

    def timed() -> float:
        read = next(reads)
        with torch.inference_mode():
            start = time.perf_counter()
            read()
            return time.perf_counter() - start

    return timed
