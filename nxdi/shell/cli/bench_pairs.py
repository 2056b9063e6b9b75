"""Interleaved timings for the benchmarks: two things timed in turn, one step of each, and the ratio
taken per pair of adjacent steps.

Why: on a shared machine the memory speed drifts within seconds (docs/cpu-backend.md, "Roofline"),
so two separate runs can meet different moments; a ratio of two adjacent timings is moved far less.
`nxdi bench roofline` pairs nxdi's quantized model with its unquantized one, and each nxdi model's
decode step with a streamed read of the step's bytes (its share of the roofline at the same moments).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Timer = Callable[[], float]
"""Runs one more step of something; returns the seconds it took."""


class DecodeSteps:
    """A `Timer` of `model`'s greedy decode steps, `batch` sequences of the benchmark's random
    `prompt_len`-token prompt (`bench_generate.prompt`); every `new_tokens - 1` steps the model is
    reset and prefilled again, outside the timing."""

    def __init__(self, model: Any, batch: int, prompt_len: int, new_tokens: int) -> None:
        from nxdi.shell.cli import bench_generate

        self.model, self.batch, self.prompt_len, self.steps = model, batch, prompt_len, new_tokens - 1
        self.ids = bench_generate.prompt(model, batch, prompt_len)
        self.left = 0
        self.tokens: Any = None
        self.positions: Any = None

    def __call__(self) -> float:
        import torch

        if self.left == 0:
            self.model.reset()
            self.tokens = self.model(self.ids).tokens
            self.positions = torch.full((self.batch, 1), self.prompt_len, dtype=torch.int64)
            self.left = self.steps
        start = time.perf_counter()
        self.tokens = self.model(self.tokens[:, None], position_ids=self.positions).tokens
        took = time.perf_counter() - start
        self.positions = self.positions + 1
        self.left -= 1
        return took


def paired(first: Timer, second: Timer, pairs: int) -> list[float]:
    """`second`'s time over `first`'s for `pairs` pairs of adjacent steps; which goes first
    alternates, so neither always meets the other's after-effects (caches, prefetchers)."""
    ratios: list[float] = []
    for i in range(pairs):
        if i % 2 == 0:
            a = first()
            b = second()
        else:
            b = second()
            a = first()
        ratios.append(b / a)
    return ratios
