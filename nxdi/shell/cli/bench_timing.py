"""Wall-clock timing for `nxdi bench`: repeat a call, summarize min/median/p90. Effects: reads the clock."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs


def _floats(values: Iterable[float]) -> tuple[float, ...]:
    # A typed converter: mypy's attrs plugin cannot infer the element type through a bare `tuple`.
    return tuple(values)


@attrs.frozen(kw_only=True)
class Timings:
    """Summary of repeated wall-clock measurements, in seconds."""

    samples: tuple[float, ...] = attrs.field(converter=_floats)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def p90(self) -> float:
        """90th percentile by the nearest-rank rule (the smallest sample >= 90% of all samples)."""
        ordered = sorted(self.samples)
        return ordered[math.ceil(0.9 * len(ordered)) - 1]

    def to_dict(self) -> dict[str, Any]:
        """Milliseconds, for JSON output."""
        return {
            "repeat": len(self.samples),
            "min_ms": self.min * 1e3,
            "median_ms": self.median * 1e3,
            "p90_ms": self.p90 * 1e3,
        }


def time_calls(fn: Callable[[], object], *, repeat: int, warmup: int = 0) -> Timings:
    """Call `fn` `warmup` times untimed, then `repeat` times timed with `time.perf_counter`.

    Raises:
        ValueError: `repeat` < 1 or `warmup` < 0.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"repeat must be >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return Timings(samples=samples)


def render_table(rows: Sequence[tuple[str, Timings, str]], *, note_title: str = "") -> str:
    """A text table: one row per (name, timings, note), times in ms."""
    width = max(len(name) for name, _, _ in rows)
    head = f"{'case':<{width}}  {'min ms':>9}  {'median ms':>9}  {'p90 ms':>9}  {note_title}".rstrip()
    lines = [head]
    for name, t, note in rows:
        lines.append(
            f"{name:<{width}}  {t.min * 1e3:>9.3f}  {t.median * 1e3:>9.3f}  {t.p90 * 1e3:>9.3f}  {note}".rstrip()
        )
    return "\n".join(lines)
