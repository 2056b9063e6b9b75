"""`bench_pairs.paired`: the second timer's time over the first's per pair, which runs first alternating."""

from __future__ import annotations

from nxdi.shell.cli import bench_pairs


def test_pairs_alternate_and_each_ratio_is_second_over_first() -> None:
    calls: list[str] = []

    def timer(name: str, seconds: list[float]) -> bench_pairs.Timer:
        def timed() -> float:
            calls.append(name)
            return seconds[len([c for c in calls if c == name]) - 1]

        return timed

    ratios = bench_pairs.paired(timer("a", [1.0, 2.0, 4.0]), timer("b", [3.0, 3.0, 2.0]), 3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert ratios == [3.0, 1.5, 0.5]
