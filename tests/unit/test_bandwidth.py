"""Streaming read bandwidth: samples per kernel, best and median, merging measurements."""

from __future__ import annotations

import pytest

from nxdi.effects import bandwidth


def test_each_kernel_reads_the_buffer_every_round_and_measurements_merge() -> None:
    first = bandwidth.measure_read_bandwidth(buffer_bytes=1 << 20, repeat=2)
    assert first.buffer_bytes == 1 << 20 and [k for k, _ in first.samples] == list(bandwidth.KERNELS)
    assert all(len(s) == 2 and min(s) > 0 for _, s in first.samples)
    assert first.best >= first.median > 0
    both = first.merged(bandwidth.measure_read_bandwidth(buffer_bytes=1 << 20, repeat=3))
    assert [len(s) for _, s in both.samples] == [5, 5] and both.best >= first.best
    assert both.to_dict()["samples"] == 10


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="buffer_bytes"):
        bandwidth.measure_read_bandwidth(buffer_bytes=2)
    with pytest.raises(ValueError, match="repeat"):
        bandwidth.measure_read_bandwidth(buffer_bytes=1 << 20, repeat=0)


def test_a_read_timer_times_each_read_and_refuses_a_bad_size() -> None:
    timed = bandwidth.read_timer(1 << 20)
    assert all(timed() > 0 for _ in range(3))
    with pytest.raises(ValueError, match="buffer_bytes must be >= 4, got 2"):
        bandwidth.read_timer(2)
