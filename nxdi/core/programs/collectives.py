"""Collectives a tensor-parallel program calls, passed in as a value (never process-group state). Pure.

A program runs on one rank's shard and meets the other ranks only through a `Collectives` value:
`SINGLE` (one rank: every collective is the identity), the torch.distributed ops of
`nxdi.effects.distributed` on CPU ranks, or XLA collectives later. All ranks run the same program on
the same shapes, so every rank calls the same collectives in the same order.

Semantics (world = number of ranks, rank r):
- `all_reduce(x)`: the elementwise sum of every rank's x.
- `all_gather(x, dim)`: every rank's x concatenated along `dim`, in rank order.
- `reduce_scatter(x, dim)`: chunk r (along `dim`, `world` equal chunks) of the sum of every rank's x.
- `scatter(x, dim)`: chunk r of this rank's own x (no communication; the inverse of all_gather).
- `rank()`: r as a 0-d int64 tensor (for arithmetic that depends on the rank, never for shapes).

A compiled program takes its rank as an input tensor named `RANK_INPUT` (one program serves every
rank): `with_rank` binds the collectives to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True, slots=True)
class Collectives:
    """The communication a program may do, over `world` ranks."""

    world: int
    all_reduce: Callable[[Tensor], Tensor]
    all_gather: Callable[[Tensor, int], Tensor]
    reduce_scatter: Callable[[Tensor, int], Tensor]
    scatter: Callable[[Tensor, int], Tensor]
    rank: Callable[[], Tensor]


def _same(x: Tensor, dim: int = 0) -> Tensor:
    return x


def _rank_zero() -> Tensor:
    return torch.zeros((), dtype=torch.int64)


RANK_INPUT = "rank"
"""The signature name of a tensor-parallel program's rank input (a 0-d int64 tensor)."""

SINGLE = Collectives(
    world=1,
    all_reduce=_same,
    all_gather=_same,
    reduce_scatter=_same,
    scatter=_same,
    rank=_rank_zero,
)
"""One rank: every collective is the identity (the programs of tp_degree 1)."""


def take_chunk(x: Tensor, dim: int, world: int, rank: Tensor) -> Tensor:
    """Chunk `rank` of `world` equal chunks of x along `dim`, chosen by a tensor (static shapes)."""
    size = x.shape[dim] // world
    return x.index_select(dim, torch.arange(size, device=x.device) + rank.to(x.device) * size)


def with_rank(coll: Collectives, rank: Tensor) -> Collectives:
    """`coll` whose rank is the 0-d tensor `rank` (a program input), and whose `scatter` takes this
    rank's chunk by it."""
    return dataclasses.replace(
        coll, rank=lambda: rank, scatter=lambda x, dim: take_chunk(x, dim % x.dim(), coll.world, rank)
    )
