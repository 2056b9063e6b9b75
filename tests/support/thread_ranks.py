"""Tensor-parallel ranks as threads of one process: real collectives semantics, no process groups.

`run_ranks(world, fn)` calls `fn(rank, collectives)` on `world` threads and returns their results in
rank order. The collectives exchange tensors through shared slots and a barrier, with the
semantics of `nxdi.core.programs.collectives` (sums in rank order, so results are deterministic).
It lets property tests run a rank's program for every rank and compare with one rank, fast.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from nxdi.core.programs.collectives import Collectives

T = TypeVar("T")


class _World:
    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[Any] = [None] * world

    def exchange(self, rank: int, x: Tensor) -> list[Tensor]:
        self.slots[rank] = x
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return values

    def collectives(self, rank: int) -> Collectives:
        def total(x: Tensor) -> Tensor:
            return functools.reduce(torch.add, self.exchange(rank, x))

        return Collectives(
            world=self.world,
            all_reduce=total,
            all_gather=lambda x, dim: torch.cat(self.exchange(rank, x), dim),
            reduce_scatter=lambda x, dim: total(x).chunk(self.world, dim)[rank],
            scatter=lambda x, dim: x.chunk(self.world, dim)[rank],
            rank=lambda: torch.tensor(rank, dtype=torch.int64),
        )


def run_ranks(world: int, fn: Callable[[int, Collectives], T]) -> list[T]:
    """`fn(rank, collectives)` for every rank, each on its own thread; the results in rank order.

    Raises the first exception a rank raised.
    """
    w = _World(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, w.collectives(rank))
        except BaseException as e:
            errors.append(e)
            w.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
