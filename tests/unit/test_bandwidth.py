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
